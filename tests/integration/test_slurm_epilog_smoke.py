"""The Slurm epilog run as slurmd runs the hook: the runner packed by the role's pack_runner.py,
`python3 RUNNER epilog` with slurmd's environment, on a simulated host. Its CUDA smoke test
(issue 35), with the fake libcuda.so.1 (tests/sim/fake_libcuda.c); and its respawn check across
jobs (issue 54), with real processes of an unprivileged user in real cgroup v2 directories of
slurmstepd's shape. No Slurm is needed to call the hook; the real-Slurm cases are in
tests/fleet/test_slurm_checks_fleet.py (the fleet's hosts have no libcuda, and their Slurm keeps
tasks in slurmd's cgroup: proctrack/linuxproc).
"""
import json
import os
import subprocess
import time

import pytest

from test_gpu_release import used
from test_smoke_test_gate import configure, cuda_calls

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUS = {0: "00000000:00:06.0", 1: "00000000:00:07.0"}  # the h200x2 preset's GPUs
DEFAULT_LOG = "/var/log/zeromib-gpu/slurm_gpu_checks.log"  # inside the simulated host (its own /var/log)


@pytest.fixture(scope="module")
def host(module_nshost, library):
    return module_nshost("h200x2", seed="epismoke", libcuda=library)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    out = tmp_path_factory.mktemp("runner") / "slurm_gpu_checks.pyz"
    subprocess.run(["/usr/bin/python3", os.path.join(REPO, "roles", "slurm_gpu_checks", "files", "pack_runner.py"),
                    os.path.join(REPO, "plugins", "module_utils"), str(out)], check=True, capture_output=True)
    return str(out)


def gres_conf(host, text=None, owner=0, mode=0o644):
    """/etc/slurm/gres.conf inside the simulated host (its own /etc), `owner`'s with `mode`; by default
    what a site writes for the host's GPUs: `Name=gpu File=/dev/nvidia[0-N]`."""
    text = "Name=gpu File=/dev/nvidia[0-{:d}]\n".format(len(host.config["gpus"]) - 1) if text is None else text
    host.run(["sh", "-c", f"mkdir -p /etc/slurm && cat > /etc/slurm/gres.conf && chown {owner:d} /etc/slurm/gres.conf && "
              f"chmod {mode:o} /etc/slurm/gres.conf"], input=text, check=True)


def epilog(host, runner, tmp_path, job, gpus="0,1", **options):
    """The hook as slurmd calls it, beside the node's gres.conf (which maps Slurm's GPU numbers to
    GPUs: test_slurm_gres_minors.py) -> (rc, stderr, the run's log entry)."""
    config, log = tmp_path / f"config-{job}.json", tmp_path / f"log-{job}.jsonl"
    config.write_text(json.dumps(dict({"drain": "exit_status", "log": str(log)}, **options)))
    config.chmod(0o600)
    gres_conf(host)
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd",
           "SLURM_CONF": "/etc/slurm/slurm.conf", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = host.run(["/usr/bin/python3", runner, "epilog", f"--config={config}"], env=env, timeout=120)
    # A config the runner refuses has no log of its own: the line goes to the default log, the host's.
    text = log.read_text() if log.exists() else host.read(DEFAULT_LOG)
    return proc.returncode, proc.stderr, json.loads(text.splitlines()[-1])


def test_the_epilog_frees_what_the_job_left_then_runs_cuda_on_each_of_its_gpus(host, runner, tmp_path):
    configure(host)
    left = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "4096"])
    rc, stderr, entry = epilog(host, runner, tmp_path, "701", smoke_test=True, smoke_test_mib=64)
    assert (rc, entry["ok"], entry["smoke_test_passed"], entry["causes"]) == (0, True, True, []), stderr
    assert [k["pid"] for k in entry["killed"]] == [left.pid] and not host.alive(left.pid)
    assert [arg for call, arg in cuda_calls(host) if call == "cuDeviceGetByPCIBusId"] == [BUS[0], BUS[1]]
    assert ("cuMemAlloc", str(64 << 20)) in cuda_calls(host)


def test_a_gpu_that_fails_cuda_fails_the_epilog_naming_it(host, runner, tmp_path):
    configure(host, fail={"cuMemAlloc": 2})
    rc, stderr, entry = epilog(host, runner, tmp_path, "702", gpus="1", smoke_test=True, smoke_test_mib=64)
    assert (rc, entry["ok"], entry["smoke_test_passed"]) == (1, False, False)
    [cause] = entry["causes"]
    assert cause.startswith(f"GPU 1 ({BUS[1]}): CUDA_ERROR_OUT_OF_MEMORY") and "cuMemAlloc" in cause, cause
    assert stderr.startswith("zeromib: epilog job 702: GPU 1 (") and entry["drain"].startswith("not drained through scontrol (drain: exit_status)")


def test_without_smoke_test_the_epilog_runs_no_cuda(host, runner, tmp_path):
    configure(host)
    rc, stderr, entry = epilog(host, runner, tmp_path, "703")
    assert (rc, entry["ok"]) == (0, True), stderr
    assert "smoke_test_passed" not in entry and cuda_calls(host) == []


def test_a_smoke_test_that_is_not_a_boolean_is_refused_before_anything_runs(host, runner, tmp_path):
    """Said in the host's default log (the refused config's own is not believed), never on this machine."""
    configure(host)
    rc, stderr, entry = epilog(host, runner, tmp_path, "704", smoke_test="yes")
    assert (rc, entry["ok"]) == (1, False)
    [cause] = entry["causes"]
    assert "smoke_test must be true or false, got 'yes'" in cause, cause
    assert cuda_calls(host) == []


# --------------------------------------------------------------------------- issue 54: whose restart


USER = 4242
# One argv for every task of an array job (the task id is only in the environment): device 0 is
# CUDA's first of the job's own GPUs (CUDA_VISIBLE_DEVICES), as the simulator counts them.
TWIN = ["gpu_holder", "--gpus", "0", "--mib", "2048"]


def task_cgroup(host, job, owner=None, below=""):
    """A task cgroup of `job` as slurmstepd makes it (cgroup v2, root's), or the same names
    below `below` (a user's own subtree, `owner`'s)."""
    return host.user_cgroup(f"{below}system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0", owner=owner)


def wait_used(host, index, mib, timeout=15.0):
    deadline = time.monotonic() + timeout
    while used(host, index) < mib:
        assert time.monotonic() < deadline, f"GPU {index} never read {mib} MiB"
        time.sleep(0.05)


def children(host, pid):
    return [int(p) for p in host.run(["ps", "-o", "pid=", "--ppid", str(pid)]).stdout.split()]


def cmdline(host, pid):
    return host.read(f"/proc/{pid}/cmdline")


def twins(host, cgroup, job=801):
    """Job `job`'s leftover (USER's TWIN on GPU 0, in the job's cgroup) and, in `cgroup` (None:
    no job's), what slurmstepd does for a task: root starts USER's TWIN on GPU 1 once the leftover
    is gone (the epilog killed it): a process new since the signals, with the killed argv."""
    left = host.spawn_as(USER, TWIN, env={"CUDA_VISIBLE_DEVICES": "0"}, ready=False)
    host.move_to_cgroup(left.pid, task_cgroup(host, job))
    wait_used(host, 0, 2048)
    # `& wait`: a process of its own (dash runs a -c string's last command in its own process).
    launch = (f'while kill -0 {left.pid:d} 2>/dev/null; do sleep 0.01; done; '
              f'setpriv --reuid {USER:d} --regid {USER:d} --clear-groups -- "$@" & wait')
    stepd = host.spawn(["sh", "-c", launch, "slurmstepd"] + TWIN, env={"CUDA_VISIBLE_DEVICES": "1"}, ready=False)
    if cgroup is not None:
        host.move_to_cgroup(stepd.pid, cgroup)
    # The killed holder's memory lingers a moment after it is gone, as the real driver's does: the
    # next task runs the killed argv (its interpreter's, past env and setpriv) before the GPU reads clean.
    host.set_fault({"release_delay_s": 1.5})
    return left, stepd


def test_another_jobs_next_task_with_the_killed_argv_is_no_restart_and_the_epilog_passes(nshost, runner, tmp_path):
    """The incident: the epilog of job 801 frees its leftover on GPU 0; job 802 of the same user
    starts its next array task, the same argv, on GPU 1, in job 802's cgroup. Before issue 54 the
    epilog failed ("something this run killed was started again") and slurmd drained the node."""
    host = nshost("h200x2", seed="twins")
    left, stepd = twins(host, task_cgroup(host, 802))
    before = cmdline(host, left.pid)
    rc, stderr, entry = epilog(host, runner, tmp_path, "801", gpus="0")
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), (stderr, entry)
    assert [k["pid"] for k in entry["killed"]] == [left.pid] and "drain" not in entry
    [task] = children(host, stepd.pid)
    assert cmdline(host, task) == before and int(host.read(f"/proc/{task}/status").split("Uid:")[1].split()[0]) == USER
    assert "/job_802/" in host.read(f"/proc/{task}/cgroup")
    wait_used(host, 1, 2048)
    assert used(host, 0) == 0 and host.alive(task)


@pytest.mark.parametrize("where", ["the same job", "no job", "a user's cgroup named like another job"])
def test_the_killed_argv_again_in_its_own_job_or_in_none_still_fails_the_epilog(nshost, runner, tmp_path, where):
    """A real restart: the same scene, the new process in job 801's own cgroup, in none, or in a
    cgroup of the user's own systemd manager that they named `slurmstepd.scope/job_802/...`
    (a name its user chose: no job)."""
    host = nshost("h200x2", seed="twins")
    cgroup = {"the same job": lambda: task_cgroup(host, 801), "no job": lambda: None,
              "a user's cgroup named like another job": lambda: task_cgroup(
                  host, 802, owner=USER, below=f"user.slice/user-{USER}.slice/user@{USER}.service/app.slice/")}[where]()
    left, stepd = twins(host, cgroup)
    rc, stderr, entry = epilog(host, runner, tmp_path, "801", gpus="0")
    assert (rc, entry["ok"]) == (1, False), (stderr, entry)
    [task] = children(host, stepd.pid)
    [cause] = entry["causes"]
    assert f"pid {task} " in cause and f"runs the command line of killed pid {left.pid} again, started by pid {stepd.pid} sh" in cause, cause
    assert stderr.startswith("zeromib: epilog job 801: the GPUs read clean, but something this run killed was started again"), stderr
    assert entry["drain"].startswith("not drained through scontrol (drain: exit_status)")  # slurmd drains the node for the failed epilog itself
