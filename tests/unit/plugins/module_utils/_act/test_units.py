# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_units: which unit is the GPU workload and which a launcher, the named units' plan (globs,
refusals, sockets and timers, masking), and the bounded stop, against a scripted systemctl."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units as units
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

# ------------------------------------------------------------------ the launcher rule


@pytest.mark.parametrize(
    "unit, main_names, under_main, unit_gpus, selected, verdict",
    [
        # the workload: stopped through systemd
        ("vllm.service", {"python3", "vllm"}, True, {0, 1}, [0, 1], None),
        # vLLM V1: the API server (main) holds no GPU, its EngineCore child does
        ("vllm-v1.service", {"vllm", "python3.11"}, True, {0}, [0, 1], None),
        ("llm.service", set(), True, {0}, [0], None),  # MainPID 0 (auto-restart, oneshot): decided by name
        # launchers by unit name
        ("atd.service", {"atd"}, True, {0}, [0], "launcher"),
        ("cron.service", {"cron"}, True, {0}, [0], "launcher"),
        ("slurmd.service", {"slurmd"}, False, {1}, [1], "launcher"),
        ("jupyterhub.service", {"jupyterhub", "python3"}, True, {0}, [0], "launcher"),
        ("gitlab-runner.service", {"gitlab-runner"}, True, {0}, [0], "launcher"),
        ("actions.runner.acme-ml.gpu-01.service", {"runsvc.sh", "bash"}, True, {0}, [0], "launcher"),
        ("containerd.service", {"containerd"}, True, {0}, [0], "launcher"),
        # launchers by the main process's name: a renamed unit file is still recognised
        ("notebook-hub.service", {"jupyterhub", "python3", "python3.11"}, True, {0}, [0], "launcher"),
        ("batch.service", {"slurmd"}, False, {0}, [0], "launcher"),
        ("jobs.service", {"supervisord", "python3"}, True, {0}, [0], "launcher"),
        ("ci.service", {"buildkite-agent"}, True, {0}, [0], "launcher"),
        ("runner.service", {"Runner.Listener"}, True, {0}, [0], "launcher"),
        ("k8s.service", {"kubelet"}, True, {0}, [0], "launcher"),
        ("sched.service", {"condor_master"}, True, {0}, [0], "launcher"),
        ("pbs-node.service", {"pbs_mom"}, True, {0}, [0], "launcher"),
        # a process that is not the main process's descendant was launched, not run, by the unit
        ("gpu-jobs.service", {"python3"}, False, {0}, [0], "launcher"),
        # a workload that also holds GPUs outside the selection
        ("vllm.service", {"python3"}, True, {0, 1, 2, 3}, [1], "other_gpus"),
        # cluster runtimes and notebook servers (issue 20.5), by unit name or main process
        ("ray.service", {"python3"}, True, {0}, [0], "launcher"),
        ("cluster.service", {"ray", "ray start", "python3"}, True, {0}, [0], "launcher"),
        ("node.service", {"raylet"}, True, {0}, [0], "launcher"),
        ("gcs.service", {"gcs_server"}, True, {0}, [0], "launcher"),
        ("dw.service", {"dask", "dask worker", "python3"}, True, {0}, [0], "launcher"),
        ("dcw.service", {"dask", "dask cuda", "python3"}, True, {0}, [0], "launcher"),
        ("dw2.service", {"dask-worker"}, True, {0}, [0], "launcher"),
        ("dw3.service", {"distributed", "distributed.cli.dask_worker"}, True, {0}, [0], "launcher"),
        ("nomad.service", {"nomad"}, True, {0}, [0], "launcher"),
        ("agent.service", {"nomad", "nomad agent"}, True, {0}, [0], "launcher"),
        ("startd.service", {"condor_startd"}, True, {0}, [0], "launcher"),
        ("starter.service", {"condor_starter"}, True, {0}, [0], "launcher"),
        ("lab.service", {"jupyter-lab", "python3"}, True, {0}, [0], "launcher"),
        ("lab2.service", {"jupyter", "jupyter lab"}, True, {0}, [0], "launcher"),
        ("nb.service", {"jupyter-noteboo"}, True, {0}, [0], "launcher"),  # comm cut at 15 characters
        ("srv.service", {"jupyter-server"}, True, {0}, [0], "launcher"),
        ("kg.service", {"jupyter-kernelg"}, True, {0}, [0], "launcher"),
        # vLLM with Ray's executor: raylet and ray:: workers run under the API server; the main
        # process is vllm, so the unit is the workload
        ("vllm-ray.service", {"vllm", "vllm serve", "python3"}, True, {0, 1}, [0, 1], None),
        # an inference server with processes without a GPU is still the workload
        ("sglang.service", {"python3", "sglang.launch_server", "sglang"}, True, {0}, [0], None),
    ],
    ids=[
        "vllm-is-the-workload",
        "vllm-v1-main-without-gpu",
        "no-main-pid",
        "atd",
        "cron",
        "slurmd",
        "jupyterhub",
        "gitlab-runner",
        "github-actions-runner",
        "containerd",
        "renamed-hub-by-main-name",
        "renamed-slurmd",
        "supervisord",
        "buildkite",
        "github-runner-listener",
        "kubelet",
        "htcondor",
        "pbs",
        "holders-outside-main-process-tree",
        "holds-unselected-gpus",
        "ray-unit-name",
        "ray-start-main",
        "raylet-main",
        "gcs-server-main",
        "dask-worker-subcommand",
        "dask-cuda-worker",
        "dask-worker-binary",
        "dask-worker-module",
        "nomad-unit-name",
        "nomad-agent-main",
        "htcondor-startd",
        "htcondor-starter",
        "jupyter-lab",
        "jupyter-lab-subcommand",
        "jupyter-notebook-comm",
        "jupyter-server",
        "jupyter-kernelgateway-comm",
        "vllm-with-ray-executor-is-the-workload",
        "server-with-cpu-helpers-is-the-workload",
    ],
)
def test_stop_verdict(unit, main_names, under_main, unit_gpus, selected, verdict):
    result = units.stop_verdict(unit, main_names, under_main, unit_gpus, selected)
    assert (result[0] if result else None) == verdict, result


@pytest.mark.parametrize(
    "unit, main_names, launchers, verdict",
    [
        ("mysched-node.service", {"python3"}, ["mysched*.service"], "launcher"),
        ("gpu.service", {"mysched", "python3"}, ["mysched"], "launcher"),
        ("gpu.service", {"my-agent-7", "python3"}, ["my-agent*"], "launcher"),
        ("vllm.service", {"vllm", "python3"}, ["mysched*.service", "mysched"], None),
    ],
    ids=["unit-glob", "process-name", "process-name-glob", "not-a-site-launcher"],
)
def test_site_launchers_option(unit, main_names, launchers, verdict):
    result = units.stop_verdict(unit, main_names, True, {0}, [0], units.split_launchers(launchers))
    assert (result[0] if result else None) == verdict, result


def test_split_launchers_tells_unit_globs_from_process_names():
    assert units.split_launchers(["mysched*.service", "mysched", " ", "agent.socket", "ray.worker"]) == (
        ("mysched*.service", "agent.socket"), ("mysched", "ray.worker"))


def test_exec_start_names_come_from_what_systemd_runs():
    text = ("{ path=/usr/bin/python3 ; argv[]=/usr/bin/python3 /usr/local/bin/ray start --head --block ; ignore_errors=no ; "
            "start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }")
    assert {"ray", "ray start"} <= units.exec_start_names(text)
    assert units.exec_start_names("") == set()
    assert "jupyterhub" in units.exec_start_names("{ path=/usr/local/bin/jupyterhub ; argv[]=/usr/local/bin/jupyterhub ; ignore_errors=no }")


def test_stop_verdict_names_the_gpus_outside_the_selection():
    assert units.stop_verdict("vllm.service", {"python3"}, True, {0, 1, 3}, [1]) == (
        "other_gpus",
        "vllm.service also holds GPU 0, 3, outside the selection",
    )


@pytest.mark.parametrize(
    "record, names",
    [
        ({"name": "atd", "exe": "atd", "argv0": "atd", "cmdline": "/usr/sbin/atd -f"}, {"atd"}),
        (
            {"name": "jupyterhub", "exe": "python3.11", "argv0": "python3", "cmdline": "/usr/bin/python3 /usr/local/bin/jupyterhub -f x"},
            {"jupyterhub", "python3.11", "python3"},
        ),
        ({"name": "python3", "exe": "python3.11", "argv0": "python3", "cmdline": "python3 -u -m jupyterhub.app"},
         {"jupyterhub", "jupyterhub.app", "python3", "python3.11"}),
        ({"name": "bash", "exe": "bash", "argv0": "bash", "cmdline": "bash /opt/runner/runsvc.sh"}, {"bash", "runsvc.sh"}),
        ({"name": "ray", "exe": "python3.11", "argv0": "/usr/bin/python3", "cmdline": "/usr/bin/python3 /usr/local/bin/ray start --head --block"},
         {"ray", "ray start", "python3.11", "/usr/bin/python3"}),
        ({"name": "nomad", "exe": "nomad", "argv0": "/usr/bin/nomad", "cmdline": "/usr/bin/nomad agent -config /etc/nomad.d"},
         {"nomad", "nomad agent", "/usr/bin/nomad"}),
        ({"name": "python3", "exe": "python3.11", "argv0": "python3", "cmdline": "python3 -m distributed.cli.dask_worker tcp://s:8786"},
         {"python3", "python3.11", "distributed", "distributed.cli.dask_worker"}),
        (None, set()),
    ],
    ids=["binary", "python-script", "python-module", "shell-script", "ray-start", "nomad-agent", "dask-worker-module", "no-main-process"],
)
def test_process_names(record, names):
    assert units.process_names(record) == names


@pytest.mark.parametrize(
    "cgroup, environ, job",
    [
        ("/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0", b"", "4242"),
        ("/slurm/uid_0/job_17/step_batch", b"", "17"),
        ("/system.slice/slurmd.service", b"PATH=/usr/bin\0SLURM_JOB_ID=31\0SLURM_JOBID=31\0", "31"),
        ("/system.slice/atd.service", b"PATH=/usr/bin\0", None),
        (None, b"", None),
        ("/system.slice/myjob_12.service", b"", None),
    ],
    ids=["cgroup-v2-scope", "cgroup-v1", "environ-linuxproc", "no-job", "nothing", "job-in-a-unit-name-is-not-a-job-cgroup"],
)
def test_slurm_job_id(cgroup, environ, job):
    assert units.slurm_job_id(cgroup, holders_mod.parse_environ(environ)) == job


# ------------------------------------------------------------------ owners: /proc and systemctl


class Systemctl:
    """Answers `systemctl show` from a dict of unit properties; records every call."""

    def __init__(self, props=None, listed=()):
        self.props = props or {}
        self.listed = list(listed)
        self.calls = []

    def __call__(self, args):
        self.calls.append(list(args))
        if args[0] == "show":
            wanted = [a.split("=", 1)[1].split(",") for a in args if a.startswith("--property=")][0]
            blocks = []
            for name in [a for a in args[1:] if not a.startswith("-")]:
                props = dict({"Id": name, "LoadState": "not-found", "MainPID": "0"}, **self.props.get(name, {}))
                blocks.append("".join(f"{k}={props[k]}\n" for k in wanted if k in props))
            return 0, "\n".join(blocks), ""
        if args[0] in ("list-units", "list-unit-files"):
            return 0, "".join(f"{u} loaded active running x\n" for u in self.listed), ""
        return 0, "", ""


def loaded(**extra):
    props = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "UnitFileState": "enabled", "MainPID": "0",
             "TriggeredBy": "", "FragmentPath": "/usr/lib/systemd/system/x.service"}
    props.update(extra)
    return props


def holder(pid, gpus, unit, cgroup=None, service=True):
    return {"pid": pid, "name": "python3", "gpu_indexes": gpus, "unit": unit, "system_service": service, "protected": False,
            "cgroup": cgroup or f"/system.slice/{unit}", "start_time": 1000 + pid}


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    fakeproc.write_process(root, 1, comm="systemd", ppid=0, argv=("/sbin/init",), exe="/usr/lib/systemd/systemd")
    return root


def test_owners_stops_the_workload_and_names_launchers_with_their_slurm_job(proc):
    # vllm.service: main 100 (API server, no GPU) -> 101 EngineCore (GPU 0)
    fakeproc.write_process(proc, 100, comm="vllm", argv=("/usr/bin/python3", "/usr/bin/vllm", "serve"), cgroup="0::/system.slice/vllm.service\n")
    fakeproc.write_process(proc, 101, comm="VLLM::EngineCor", ppid=100, cgroup="0::/system.slice/vllm.service\n")
    # atd.service: main 200 -> 201 atd (job runner) -> 202 the job
    fakeproc.write_process(proc, 200, comm="atd", argv=("/usr/sbin/atd", "-f"), exe="/usr/sbin/atd", cgroup="0::/system.slice/atd.service\n")
    fakeproc.write_process(proc, 201, comm="atd", ppid=200, exe="/usr/sbin/atd")
    fakeproc.write_process(proc, 202, comm="train", ppid=201)
    # slurmd.service (cgroup v1, proctrack/linuxproc): slurmstepd is reparented to PID 1
    fakeproc.write_process(proc, 300, comm="slurmd", argv=("/usr/sbin/slurmd", "-D"), exe="/usr/sbin/slurmd")
    fakeproc.write_process(proc, 301, comm="slurmstepd", ppid=1, exe="/usr/sbin/slurmstepd")
    fakeproc.write_process(proc, 302, comm="train", ppid=301)
    with open(str(proc / "302" / "environ"), "wb") as handle:
        handle.write(b"HOME=/root\0SLURM_JOB_ID=7\0")
    systemctl = Systemctl({"vllm.service": loaded(MainPID="100"), "atd.service": loaded(MainPID="200"), "slurmd.service": loaded(MainPID="300")})
    targets = [holder(101, [0], "vllm.service"), holder(202, [1], "atd.service"), holder(302, [2], "slurmd.service"),
               holder(400, [3], "slurmstepd.scope", cgroup="/system.slice/slurmstepd.scope/job_8/step_0/user/task_0", service=False),
               holder(500, [3], "session-4.scope", service=False)]
    holders = targets + [{"pid": 100, "gpu_indexes": [], "unit": "vllm.service", "system_service": True}]
    to_stop, launchers, spanning = units.owners(systemctl, targets, holders, [0, 1, 2, 3], set(), str(proc))
    assert to_stop == ["vllm.service"] and spanning == []
    assert [(e["unit"], e["pids"], e["slurm_job_id"]) for e in launchers] == [
        ("atd.service", [202], None),
        ("slurmd.service", [302], "7"),
        ("slurmstepd.scope", [400], "8"),
    ]
    assert "starts other jobs" in launchers[0]["reason"]
    # one systemctl call for all units
    assert [c[0] for c in systemctl.calls] == ["show"]


def test_owners_never_stops_a_unit_that_holds_unselected_gpus_and_lists_it_as_spanning(proc):
    fakeproc.write_process(proc, 100, comm="VLLM::EngineCor", argv=("VLLM::EngineCore",), cgroup="0::/system.slice/vllm.service\n")
    for i in range(4):
        fakeproc.write_process(proc, 101 + i, comm=f"VLLM::Worker_TP{i}", ppid=100, cgroup="0::/system.slice/vllm.service\n")
    workers = [holder(101 + i, [i], "vllm.service") for i in range(4)]
    to_stop, launchers, spanning = units.owners(Systemctl({"vllm.service": loaded(MainPID="100")}), [workers[1]], workers, [1], set(), str(proc))
    assert (to_stop, launchers) == ([], [])
    assert spanning == [{"unit": "vllm.service", "pids": [102], "gpu_indexes": [0, 1, 2, 3], "outside_gpus": [0, 2, 3]}]
    # kill_spanning: the unit is ended anyway, through systemd
    to_stop, launchers, spanning = units.owners(Systemctl({"vllm.service": loaded(MainPID="100")}), [workers[1]], workers, [1], set(), str(proc),
                                                kill_spanning=True)
    assert (to_stop, launchers, [e["unit"] for e in spanning]) == (["vllm.service"], [], ["vllm.service"])


def test_owners_tells_a_ray_like_launcher_from_a_vllm_v1_shaped_workload(proc):
    # ray-like.service: `ray start` (main) -> a GPU worker of job A and a CPU worker of job B
    fakeproc.write_process(proc, 100, comm="ray", argv=("/usr/bin/python3", "/usr/local/bin/ray", "start", "--block"),
                           cgroup="0::/system.slice/compute.service\n")
    fakeproc.write_process(proc, 101, comm="ray::job_a", ppid=100, cgroup="0::/system.slice/compute.service\n")
    fakeproc.write_process(proc, 102, comm="ray::job_b", ppid=100, cgroup="0::/system.slice/compute.service\n")
    # vllm-v1.service: API server (main, no GPU) -> resource tracker, EngineCore -> workers on GPU 0 and 1
    cg = "0::/system.slice/llm.service\n"
    fakeproc.write_process(proc, 200, comm="vllm", argv=("/usr/bin/python3", "/usr/bin/vllm", "serve", "m"), cgroup=cg)
    fakeproc.write_process(proc, 201, comm="python3", ppid=200, argv=("python3", "-c", "from multiprocessing.resource_tracker import main;main(5)"),
                           cgroup=cg)
    fakeproc.write_process(proc, 202, comm="VLLM::EngineCor", ppid=200, cgroup=cg)
    fakeproc.write_process(proc, 203, comm="VLLM::Worker_TP", ppid=202, cgroup=cg)
    fakeproc.write_process(proc, 204, comm="VLLM::Worker_TP", ppid=202, cgroup=cg)
    systemctl = Systemctl({"compute.service": loaded(MainPID="100"), "llm.service": loaded(MainPID="200")})
    targets = [holder(101, [2], "compute.service"), holder(203, [0], "llm.service"), holder(204, [1], "llm.service")]
    to_stop, launchers, spanning = units.owners(systemctl, targets, targets, [0, 1, 2], set(), str(proc))
    assert to_stop == ["llm.service"] and spanning == []
    assert [(e["unit"], e["pids"]) for e in launchers] == [("compute.service", [101])]
    assert "ray start" in launchers[0]["reason"]
    # asked for ExecStart too: the unit's command as systemd runs it
    assert systemctl.calls[0][:2] == ["show", "--property=Id,MainPID,ExecStart"]


def test_owners_knows_a_launcher_by_its_exec_start_when_the_main_process_renamed_itself(proc):
    fakeproc.write_process(proc, 100, comm="worker", argv=("worker",), cgroup="0::/system.slice/cluster.service\n")
    fakeproc.write_process(proc, 101, comm="train", ppid=100, cgroup="0::/system.slice/cluster.service\n")
    exec_start = "{ path=/usr/local/bin/ray ; argv[]=/usr/local/bin/ray start --block ; ignore_errors=no }"
    systemctl = Systemctl({"cluster.service": loaded(MainPID="100", ExecStart=exec_start)})
    to_stop, launchers, _s = units.owners(systemctl, [holder(101, [0], "cluster.service")], [], [0], set(), str(proc))
    assert to_stop == [] and launchers[0]["unit"] == "cluster.service"


def test_owners_site_launchers_by_unit_glob_and_by_name(proc):
    fakeproc.write_process(proc, 100, comm="python3", argv=("python3", "/opt/mysched/agent.py"), cgroup="0::/system.slice/mysched-a.service\n")
    fakeproc.write_process(proc, 101, comm="train", ppid=100, cgroup="0::/system.slice/mysched-a.service\n")
    fakeproc.write_process(proc, 200, comm="sched", argv=("/opt/bin/sched", "run"), exe="/opt/bin/sched", cgroup="0::/system.slice/b.service\n")
    fakeproc.write_process(proc, 201, comm="train", ppid=200, cgroup="0::/system.slice/b.service\n")
    systemctl = Systemctl({"mysched-a.service": loaded(MainPID="100"), "b.service": loaded(MainPID="200")})
    targets = [holder(101, [0], "mysched-a.service"), holder(201, [1], "b.service")]
    to_stop, _l, _s = units.owners(systemctl, targets, targets, [0, 1], set(), str(proc))
    assert to_stop == ["mysched-a.service", "b.service"]
    to_stop, launchers, _s = units.owners(systemctl, targets, targets, [0, 1], set(), str(proc), launchers=["mysched*.service", "sched"])
    assert to_stop == [] and [e["unit"] for e in launchers] == ["mysched-a.service", "b.service"]


def test_owners_reports_this_sessions_unit_as_a_launcher_never_to_stop(proc):
    to_stop, launchers, _warnings = units.owners(Systemctl(), [holder(600, [0], "ssh.service")], [], [0], {"ssh.service"}, str(proc))
    assert to_stop == [] and launchers[0]["unit"] == "ssh.service" and "this Ansible session" in launchers[0]["reason"]


# ------------------------------------------------------------------ named units


def plan(systemctl, named, owned=(), state="stopped", forbidden=(), protect=(), proc="/nonexistent"):
    steps = units.plan(systemctl, named, list(owned), state, set(forbidden), protect, str(proc))
    return steps, steps["warnings"]


def test_glob_that_matches_nothing_is_a_warning():
    steps, warnings = plan(Systemctl(listed=[]), ["tgi*"])
    assert steps["stop"] == [] and warnings == ["services: tgi*.service matches no unit on this host"]


def test_star_never_stops_systemd_dbus_ssh_logind_or_launchers(proc):
    fakeproc.write_process(proc, 50, comm="sshd", exe="/usr/sbin/sshd")
    fakeproc.write_process(proc, 51, comm="jupyterhub", argv=("/usr/bin/python3", "/usr/local/bin/jupyterhub"))
    listed = ["dbus.service", "systemd-journald.service", "systemd-logind.service", "ssh.service", "getty@tty1.service", "cron.service",
              "atd.service", "vllm.service", "user@0.service", "gpu-sshd.service", "notebook-hub.service"]
    props = {u: loaded() for u in listed}
    props["gpu-sshd.service"] = loaded(MainPID="50")  # runs a protected process under another name
    props["notebook-hub.service"] = loaded(MainPID="51")  # a launcher by its main process
    steps = result = units.plan(Systemctl(props, listed), ["*"], [], "stopped", set(), (), str(proc))
    assert steps["stop"] == ["vllm.service"]
    kept = {k["unit"]: k["reason"] for k in result["kept_units"]}
    assert sorted(kept) == sorted(u for u in listed if u != "vllm.service")
    assert "pid 50 sshd is protected" in kept["gpu-sshd.service"]
    assert "name it to stop it" in kept["cron.service"] and "jupyterhub" in kept["notebook-hub.service"]
    # one warning names them all
    [warning] = result["warnings"]
    assert warning.startswith("services: kept 10 units that a glob matched (see kept_units") and all(u in warning for u in kept)
    assert "launcher: atd.service, cron.service, notebook-hub.service" in warning and "; protected: gpu-sshd.service" in warning


def test_a_glob_lists_only_the_kept_units_it_would_have_changed():
    listed = ["tailscaled.service", "chrony.service", "vllm.service"]
    props = {u: loaded() for u in listed}
    props["chrony.service"] = loaded(ActiveState="inactive", SubState="dead", UnitFileState="disabled")  # nothing to do to it
    result = units.plan(Systemctl(props, listed), ["*"], [], "stopped", set())
    assert [(k["unit"], k["kind"]) for k in result["kept_units"]] == [("tailscaled.service", "network")]


NODE_KEEPING = ["networking.service", "ifup@eth9.service", "NetworkManager.service", "systemd-networkd.service", "wg-quick@wg0.service",
                "tailscaled.service", "nftables.service", "iptables.service", "firewalld.service", "iscsid.service", "multipathd.service",
                "nfs-server.service", "nfs-idmapd.service", "autofs.service", "lvm2-monitor.service", "zfs-zed.service", "sssd.service",
                "nslcd.service", "winbind.service", "sshd.service", "dropbear.service", "chrony.service", "chronyd.service",
                "ntp.service", "ntpsec.service", "systemd-timesyncd.service"]


@pytest.mark.parametrize("unit", NODE_KEEPING)
def test_a_glob_never_selects_what_keeps_the_node_reachable_and_its_data_safe(unit):
    listed = [unit, "vllm.service"]
    steps = result = units.plan(Systemctl({u: loaded() for u in listed}, listed), ["*"], [], "disabled", set())
    assert steps["stop"] == ["vllm.service"] and steps["disable"] == ["vllm.service"]
    assert [k["unit"] for k in result["kept_units"]] == [unit]


@pytest.mark.parametrize("unit, kind", [("tailscaled", "network"), ("ifup@eth9", "network"), ("nftables", "network"),
                                        ("iscsid", "storage"), ("sssd", "identity"), ("dropbear", "remote access"), ("chrony", "time")])
def test_naming_a_node_keeping_unit_exactly_stops_it(unit, kind):
    name = units.normalize_unit(unit)
    assert units.keeps_node(name) == kind
    steps = result = units.plan(Systemctl({name: loaded()}), [unit], [], "stopped", set())
    assert steps["stop"] == [name] and result["kept_units"] == [] and result["warnings"] == []


def test_a_site_launcher_unit_is_kept_from_globs_and_stopped_when_named():
    listed = ["mysched-node.service", "vllm.service"]
    systemctl = Systemctl({u: loaded() for u in listed}, listed)
    steps = result = units.plan(systemctl, ["*"], [], "stopped", set(), launchers=["mysched*.service"])
    assert steps["stop"] == ["vllm.service"] and result["kept_units"][0]["unit"] == "mysched-node.service"
    steps = result = units.plan(systemctl, ["mysched-node"], [], "stopped", set(), launchers=["mysched*.service"])
    assert steps["stop"] == ["mysched-node.service"]


class UnitFiles(Systemctl):
    """Loaded units and unit files differ: an installed, enabled, inactive unit is not loaded."""

    def __init__(self, props, loaded_units, unit_files):
        super().__init__(props, loaded_units)
        self.unit_files = list(unit_files)

    def __call__(self, args):
        if args[0] == "list-unit-files":
            self.calls.append(list(args))
            return 0, "".join(f"{u} enabled enabled\n" for u in self.unit_files), ""
        return super().__call__(args)


def test_a_glob_matches_an_installed_inactive_unit_file_and_disables_it_without_a_false_warning():
    inactive = loaded(ActiveState="inactive", SubState="dead", UnitFileState="enabled")
    systemctl = UnitFiles({"vllm.service": inactive}, [], ["vllm.service", "vllm-tp@.service"])
    steps = result = units.plan(systemctl, ["vllm*.service"], [], "disabled", set())
    assert steps["stop"] == [] and steps["disable"] == ["vllm.service"] and result["warnings"] == []
    # the template is no unit to act on
    assert "vllm-tp@.service" not in str([c for c in systemctl.calls if c[0] == "show"])


def test_unit_files_are_listed_only_when_they_can_change_the_answer():
    systemctl = UnitFiles({"vllm.service": loaded()}, ["vllm.service"], ["vllm.service"])
    units.plan(systemctl, ["vllm*"], [], "stopped", set())
    assert [c[0] for c in systemctl.calls] == ["list-units", "show"]  # loaded and matched: no unit-file listing (~0.2 s)
    systemctl = UnitFiles({}, [], [])
    result = units.plan(systemctl, ["tgi*"], [], "stopped", set())
    assert [c[0] for c in systemctl.calls] == ["list-units", "list-unit-files"]
    assert result["warnings"] == ["services: tgi*.service matches no unit on this host"]


@pytest.mark.parametrize("name", ["dbus", "systemd-journald.service", "ssh", "systemd-logind", "getty@tty1"])
def test_naming_an_essential_unit_is_refused_before_anything_is_done(name):
    systemctl = Systemctl({units.normalize_unit(name): loaded()})
    with pytest.raises(StepFailed) as info:
        plan(systemctl, [name])
    assert f"refusing to stop {units.normalize_unit(name)}: the node needs it" in info.value.msg
    assert [c[0] for c in systemctl.calls] == ["show"]


def test_naming_a_launcher_stops_it_because_the_user_asked():
    steps, warnings = plan(Systemctl({"atd.service": loaded()}), ["atd"])
    assert steps["stop"] == ["atd.service"] and warnings == []


def test_naming_a_unit_whose_main_process_is_protected_is_refused(proc):
    fakeproc.write_process(proc, 60, comm="nvidia-persiste", exe="/usr/bin/nvidia-persistenced")
    with pytest.raises(StepFailed) as info:
        plan(Systemctl({"persist.service": loaded(MainPID="60")}), ["persist"], proc=proc)
    assert "refusing to stop persist.service: its main process pid 60 nvidia-persiste is protected" in info.value.msg


def test_protect_option_names_count_for_units_too(proc):
    fakeproc.write_process(proc, 61, comm="jupyter-lab", exe="/usr/bin/python3.11")
    with pytest.raises(StepFailed):
        plan(Systemctl({"lab.service": loaded(MainPID="61")}), ["lab"], protect=["jupyter-lab"], proc=proc)


def test_sockets_and_timers_that_trigger_a_named_service_get_its_state():
    systemctl = Systemctl({
        "vllm.service": loaded(TriggeredBy="vllm.socket vllm-warmup.timer"),
        "vllm.socket": loaded(SubState="listening"),
        "vllm-warmup.timer": loaded(SubState="waiting"),
    })
    steps, _warnings = plan(systemctl, ["vllm"], state="disabled")
    assert steps["stop"] == ["vllm.service", "vllm.socket", "vllm-warmup.timer"]
    assert steps["disable"] == ["vllm.service", "vllm.socket", "vllm-warmup.timer"]


def test_owned_units_do_not_bring_their_triggers():
    steps, _warnings = plan(Systemctl({"vllm.service": loaded(TriggeredBy="vllm.socket")}), [], owned=["vllm.service"])
    assert steps["stop"] == ["vllm.service"]


def test_masking_a_unit_whose_file_is_in_etc_is_refused_before_anything_is_done():
    systemctl = Systemctl({"vllm.service": loaded(FragmentPath="/etc/systemd/system/vllm.service")})
    with pytest.raises(StepFailed) as info:
        plan(systemctl, ["vllm"], state="masked")
    assert "cannot mask vllm.service (/etc/systemd/system/vllm.service)" in info.value.msg
    assert "Move the unit file to /usr/local/lib/systemd/system/" in info.value.msg and "service_state=disabled" in info.value.msg
    assert "Nothing was stopped or signalled" in info.value.msg
    assert {c[0] for c in systemctl.calls} == {"show"}


def test_masking_works_for_packaged_units_and_an_already_masked_etc_link_is_left_alone():
    steps, _w = plan(Systemctl({"vllm.service": loaded(FragmentPath="/usr/local/lib/systemd/system/vllm.service")}), ["vllm"], state="masked")
    assert steps["mask"] == ["vllm.service"]
    masked = loaded(LoadState="masked", UnitFileState="masked", ActiveState="inactive", SubState="dead", FragmentPath="/etc/systemd/system/x")
    steps, _w = plan(Systemctl({"vllm.service": masked}), ["vllm"], state="masked")
    assert steps["mask"] == [] and steps["stop"] == []


# ------------------------------------------------------------------ the bounded stop


class Node:
    """systemctl with units that stop after a delay, or never until SIGKILLed; a clock."""

    def __init__(self, stop_after):
        self.t = 0.0
        self.stop_after = dict(stop_after)  # unit -> seconds its stop takes; None: ignores SIGTERM
        self.stopping = {}
        self.state = {u: "active" for u in stop_after}
        self.calls = []

    def now(self):
        return self.t

    def sleep(self, seconds):
        self.t += max(0.0, seconds)
        for unit, since in list(self.stopping.items()):
            took = self.stop_after[unit]
            if took is not None and self.t - since >= took:
                self.state[unit] = "inactive"
                del self.stopping[unit]

    def systemctl(self, args):
        self.calls.append((round(self.t, 3), list(args)))
        names = [a for a in args[1:] if not a.startswith("-")]
        if args[0] == "stop":
            for unit in names:
                if self.state[unit] == "active":
                    self.state[unit] = "deactivating"
                    self.stopping[unit] = self.t
            self.sleep(0)
        elif args[0] == "kill":
            for unit in names:
                self.state[unit] = "failed"
                self.stopping.pop(unit, None)
        elif args[0] == "show":
            return 0, "\n".join(f"Id={u}\nActiveState={self.state[u]}\nSubState=x\n" for u in names), ""
        return 0, "", ""


def test_units_are_stopped_together_without_waiting_for_each():
    node = Node({"a.service": 0.3, "b.service": 0.3, "c.service": 0.3})
    result = units.stop_bounded(node, ["a.service", "b.service", "c.service"], 10.0)
    assert node.calls[0] == (0.0, ["stop", "--no-block", "--no-ask-password", "a.service", "b.service", "c.service"])
    assert 0.3 <= node.t < 0.6, "stopped one after the other?"
    assert result["stopped_units"] == ["a.service", "b.service", "c.service"] and "killed_units" not in result


def test_a_unit_ignoring_sigterm_is_killed_through_systemd_after_kill_timeout_not_after_timeoutstopsec():
    node = Node({"stubborn.service": None, "vllm.service": 0.2})
    result = units.stop_bounded(node, ["stubborn.service", "vllm.service"], 2.0)
    kills = [(t, args) for t, args in node.calls if args[0] == "kill"]
    assert kills == [(pytest.approx(2.0, abs=0.25), ["kill", "--signal=SIGKILL", "--no-ask-password", "stubborn.service"])]
    # the stop job is queued again after the kill, so that Restart= cannot start the unit
    assert [args for _t, args in node.calls if args[0] == "stop"][-1] == ["stop", "--no-block", "--no-ask-password", "stubborn.service"]
    assert result["killed_units"] == ["stubborn.service"] and node.state["stubborn.service"] == "failed"
    assert node.t < 2.5
    # Issue 55: systemd leaves the unit it SIGKILLed `failed`; the result names it, and what clears it.
    assert result["failed_units"] == ["stubborn.service"]
    assert result["warnings"] == ["stubborn.service was killed through systemd (the stop outlasted kill_timeout, 2 s) and is left failed: "
                                  "gpu_restore (the restore_gpus role) resets it before starting it again (by hand: systemctl reset-failed "
                                  "stubborn.service)"]


def test_a_failing_stop_is_reported_with_what_was_done_so_far():
    def systemctl(args):
        return (5, "", "Failed to stop vllm.service: Access denied") if args[0] == "stop" else (0, "", "")

    class System:
        pass

    system = System()
    system.systemctl = systemctl
    result = {"warnings": [], "stopped_units": [], "killed": [{"pid": 1}]}
    with pytest.raises(StepFailed) as info:
        units.stop_bounded(system, ["vllm.service"], 1.0, result)
    assert "systemctl stop vllm.service failed (rc 5): Failed to stop vllm.service: Access denied" in info.value.msg
    # StepFailed hands back the record it was given, filled in so far: Release folds it into the result.
    assert info.value.done["killed"] == [{"pid": 1}]


def test_owners_never_stops_a_unit_whose_main_process_is_protected(proc):
    # nvidia-persistenced opens no device file itself here (so it is no protected holder), but
    # a helper it started holds a GPU: the daemon's unit is still never stopped.
    fakeproc.write_process(proc, 700, comm="nvidia-persiste", argv=("/usr/bin/nvidia-persistenced",), exe="/usr/bin/nvidia-persistenced")
    fakeproc.write_process(proc, 701, comm="python3", ppid=700)
    systemctl = Systemctl({"nvidia-persistenced.service": loaded(MainPID="700")})
    to_stop, launchers, _w = units.owners(systemctl, [holder(701, [0], "nvidia-persistenced.service")], [], [0], set(), str(proc))
    assert to_stop == [] and "(pid 700 nvidia-persiste) is protected" in launchers[0]["reason"]
    fakeproc.write_process(proc, 710, comm="lab", exe="/usr/bin/lab")
    fakeproc.write_process(proc, 711, comm="python3", ppid=710)
    systemctl = Systemctl({"lab.service": loaded(MainPID="710")})
    to_stop, _l, _w = units.owners(systemctl, [holder(711, [0], "lab.service")], [], [0], set(), str(proc), ["lab"])
    assert to_stop == []


def test_a_disable_or_mask_an_earlier_release_made_on_disk_is_not_made_again():
    """Unit files change with --no-reload, so systemd's UnitFileState still says `enabled` after a
    release disabled the unit: the units the restore record names are read on disk (is-enabled),
    and a second release changes nothing there (idempotent); the others are asked nothing."""
    calls = []

    def systemctl(args):
        calls.append(args)
        if args[0] == "is-enabled":
            return 1, "disabled\nmasked\nenabled\n", ""
        return 0, "", ""

    steps = {"stop": ["vllm.service"], "disable": ["vllm.service", "tgi.service"], "mask": ["sglang.service", "ollama.service"]}
    units.already_on_disk(systemctl, steps, {"vllm.service", "sglang.service", "ollama.service"})
    assert calls == [["is-enabled", "--", "vllm.service", "sglang.service", "ollama.service"]]
    assert steps == {"stop": ["vllm.service"], "disable": ["tgi.service"], "mask": ["ollama.service"]}
    calls.clear()
    units.already_on_disk(systemctl, steps, set())
    assert calls == []


def test_an_is_enabled_that_does_not_answer_each_unit_leaves_the_plan_as_it_was():
    steps = {"stop": [], "disable": ["vllm.service"], "mask": ["sglang.service"]}
    units.already_on_disk(lambda args: (4, "", "Failed to get unit file state"), steps, {"vllm.service", "sglang.service"})
    assert steps == {"stop": [], "disable": ["vllm.service"], "mask": ["sglang.service"]}
