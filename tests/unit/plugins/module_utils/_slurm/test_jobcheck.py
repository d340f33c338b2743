"""The Slurm job boundary (_jobcheck): the job's GPUs as slurmd gives them to the hooks (read from
real 22.05 prolog/epilog environments of the fleet), whose process a holder is (cgroup first, then
a vouched slurmstepd ancestor; never the user's environment), the root-owned config, the short
drain reason, and the packed runner (roles/slurm_gpu_checks/files/pack_runner.py)."""
import importlib.util
import json
import os
import re
import subprocess
import time
import sys
import types
import zipfile

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _jobcheck as jobcheck
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _drain
from ansible_collections.zeromib.gpu.plugins.module_utils._act._release import Release
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, os.pardir, os.pardir))
PACKER = os.path.join(ROOT, "roles", "slurm_gpu_checks", "files", "pack_runner.py")


def packer_pack():
    """pack_runner.pack, loaded from its file (runpy.run_path would ask the path hooks first, and
    ansible-test's collection loader claims the path: "can't find '__main__' module")."""
    spec = importlib.util.spec_from_file_location("pack_runner", PACKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pack


MODULE_UTILS = os.path.join(ROOT, "plugins", "module_utils")

# slurmd 22.05.8's epilog environment for `sbatch --gres=gpu:2` (the fleet's gres=gpu:8 node), trimmed.
EPILOG_ENV = {"SLURM_JOB_DERIVED_EC": "0", "SLURM_JOB_GPUS": "0,1", "SLURM_JOB_USER": "root", "SLURM_JOBID": "1", "CUDA_VISIBLE_DEVICES": "0,1",
              "SLURM_SCRIPT_CONTEXT": "epilog_slurmd", "GPU_DEVICE_ORDINAL": "0,1", "SLURM_JOB_ID": "1", "SLURMD_NODENAME": "zsl-01",
              "SLURM_JOB_UID": "0", "SLURM_JOB_EXIT_CODE": "0"}


def test_the_jobs_gpus_come_from_slurm_job_gpus_as_slurmd_sets_them():
    assert jobcheck.job_gpus(EPILOG_ENV) == ["0", "1"]
    assert jobcheck.job_gpus(dict(EPILOG_ENV, SLURM_JOB_GPUS="3")) == ["3"]


def test_without_slurm_job_gpus_cuda_visible_devices_names_them_uuids_included():
    env = {"CUDA_VISIBLE_DEVICES": "GPU-ab0cf4f6-1111-2222-3333-444455556666"}
    assert jobcheck.job_gpus(env) == ["GPU-ab0cf4f6-1111-2222-3333-444455556666"]


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_GPUS": ""}, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}], ids=["none", "empty", "nodevfiles"])
def test_a_job_given_no_gpu_has_none(env):
    assert jobcheck.job_gpus(env) is None


@pytest.mark.parametrize("value", ["0,../1", "0;rm", "1 2", "²"])
def test_a_gpu_list_that_is_no_list_of_indexes_or_uuids_is_refused_by_name(value):
    with pytest.raises(jobcheck.JobCheckError, match="SLURM_JOB_GPUS"):
        jobcheck.job_gpus({"SLURM_JOB_GPUS": value})


def test_the_mode_is_the_argument_else_slurmds_script_context():
    assert jobcheck.mode_of(["prolog"], EPILOG_ENV) == "prolog"
    assert jobcheck.mode_of([], EPILOG_ENV) == "epilog"
    assert jobcheck.mode_of([], {"SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}) == "prolog"
    with pytest.raises(jobcheck.JobCheckError, match="prolog or epilog"):
        jobcheck.mode_of([], {})
    with pytest.raises(jobcheck.JobCheckError, match="unknown mode"):
        jobcheck.mode_of(["cleanup"], {})


@pytest.mark.parametrize("value", ["", "12a", "1;2", "٣"])
def test_a_job_id_that_is_no_number_is_refused(value):
    with pytest.raises(jobcheck.JobCheckError, match="SLURM_JOB_ID"):
        jobcheck.job_id({"SLURM_JOB_ID": value})


@pytest.mark.parametrize("lines, job", [
    (["/system.slice/slurmstepd.scope/job_42/step_0/user/task_0"], "42"),                      # cgroup v2
    (["/", "/slurm/uid_1000/job_7/step_batch/task_0", "/system.slice/slurmd.service"], "7"),   # v1 freezer line
    (["/system.slice/slurmd.service"], None),                                                  # proctrack/linuxproc
    (["/user.slice/user-1000.slice/session-3.scope/job_9x"], None),
    (["/system.slice/slurm_node07_slurmstepd.scope/job_5/step_batch/user/task_0"], "5"),       # v2, several slurmd on a host
    (["/slurm_node07/uid_1000/job_6/step_0/task_0"], "6"),                                     # v1, several slurmd on a host
    # issue 54: a user's own systemd manager delegates its subtree to the user, who names cgroups
    # there at will: `job_123` in it names no job, also in slurmstepd's own shape.
    (["/user.slice/user-1000.slice/user@1000.service/app.slice/job_123"], None),
    (["/user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_123/step_0/user/task_0",
      "/user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_123/step_0/user/task_0"], None),
    # a v1 controller line that slurmstepd wrote still names the job beside a user's claim on the systemd line
    (["/user.slice/user-1000.slice/user@1000.service/job_123", "/slurm/uid_1000/job_8/step_0/task_0"], "8"),
], ids=["v2", "v1-freezer-line", "linuxproc", "no-job-component", "v2-several-slurmd", "v1-several-slurmd",
        "user-manager", "user-manager-in-slurmstepds-shape", "v1-line-beside-a-user-manager-claim"])
def test_the_job_of_a_cgroup_is_read_from_any_hierarchy_line(lines, job):
    assert _jobs.job_of_cgroups(lines) == job


@pytest.mark.parametrize("title, job", [("slurmstepd: [12.batch]", "12"), ("slurmstepd: [12.0]", "12"), ("slurmstepd: [12.extern]", "12"),
                                        ("slurmstepd", None), ("python3 slurmstepd: [12.batch]", None)])
def test_the_job_of_a_slurmstepd_is_its_title(title, job):
    assert _jobs.job_of_stepd_title(title) == job


def test_only_another_jobs_process_is_spared():
    assert _jobs.other_job("8", "7") is True
    assert _jobs.other_job("7", "7") is False
    assert _jobs.other_job(None, "7") is False  # escaped every job: what the epilog frees
    assert _jobs.other_job("8", None) is True   # gpu_release: a job's task is not a restart of a holder of no job
    assert _jobs.other_job(None, None) is False


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return root


def stepd(proc, pid, job, uid=0, exe="/usr/sbin/slurmstepd", owner=0):
    fakeproc.write_process(proc, pid, comm="slurmstepd", ppid=1, argv=(f"slurmstepd: [{job}.batch]",), uid=uid, exe=exe, exe_owner=owner,
                           cgroup="0::/system.slice/slurmd.service\n")


def test_a_holder_below_another_jobs_slurmstepd_is_that_jobs(proc):
    stepd(proc, 100, 8)
    fakeproc.write_process(proc, 101, ppid=100, uid=1000, cgroup="0::/system.slice/slurmd.service\n")
    fakeproc.write_process(proc, 102, ppid=101, uid=1000, cgroup="0::/system.slice/slurmd.service\n")
    assert _jobs.owning_job(102, str(proc)) == "8"


def test_a_users_process_named_slurmstepd_owns_no_job(proc):
    stepd(proc, 100, 8, uid=1000, exe="/home/u/slurmstepd", owner=1000)
    fakeproc.write_process(proc, 101, ppid=100, uid=1000)
    assert _jobs.owning_job(101, str(proc)) is None


def test_an_orphan_reparented_to_init_owns_no_job_whatever_its_environment_says(proc):
    fakeproc.write_process(proc, 1, comm="systemd", ppid=0, argv=("/sbin/init",), exe="/usr/lib/systemd/systemd")
    fakeproc.write_process(proc, 300, ppid=1, uid=1000)
    with open(os.path.join(str(proc), "300", "environ"), "wb") as handle:
        handle.write(b"SLURM_JOB_ID=8\0")
    assert _jobs.owning_job(300, str(proc)) is None


def test_a_users_cgroup_named_like_a_job_is_no_job_and_the_process_tree_decides(proc):
    """issue 54: below a vouched slurmstepd of job 8, a task that moved itself into a cgroup of
    its user manager's subtree named `job_9` is still job 8's; outside any job, it is no job's."""
    claim = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/job_9/x\n"
    stepd(proc, 100, 8)
    fakeproc.write_process(proc, 101, ppid=100, uid=1000, cgroup=claim)
    fakeproc.write_process(proc, 1, comm="systemd", ppid=0, argv=("/sbin/init",), exe="/usr/lib/systemd/systemd")
    fakeproc.write_process(proc, 300, ppid=1, uid=1000, cgroup=claim)
    assert (_jobs.owning_job(101, str(proc)), _jobs.owning_job(300, str(proc))) == ("8", None)


def test_the_cgroup_decides_before_the_process_tree(proc):
    stepd(proc, 100, 8)
    fakeproc.write_process(proc, 101, ppid=100, cgroup="0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n")
    assert _jobs.owning_job(101, str(proc)) == "9"


def test_spare_other_jobs_marks_only_their_holders_protected(proc):
    stepd(proc, 100, 8)
    fakeproc.write_process(proc, 101, ppid=100)
    fakeproc.write_process(proc, 200, ppid=1, cgroup="0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n")
    fakeproc.write_process(proc, 300, ppid=1)
    holders = [{"pid": 101, "protected": False}, {"pid": 200, "protected": False}, {"pid": 300, "protected": False}]
    marked = jobcheck.spare_other_jobs(holders, "7", str(proc))
    assert [(h["pid"], h["protected"], h.get("protected_reason")) for h in marked] == [
        (101, True, "Slurm job 8"), (200, False, None), (300, False, None)]
    assert holders[0]["protected"] is False  # new records


def task(proc, pid, job=None, uid=1000):
    cgroup = f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n" if job else "0::/system.slice/cron.service\n"
    fakeproc.write_process(proc, pid, ppid=1, uid=uid, cgroup=cgroup)


def test_the_epilogs_respawn_check_passes_over_another_jobs_process_only(proc):
    """issue 54: the word the epilog of job 7 gives the respawn watch (_settle's `foreign`): a
    new process of job 8 is someone else's; one of job 7 or of no job may be a restart."""
    for pid, number in ((310, "8"), (320, "7"), (330, None)):
        task(proc, pid, number)
    release = types.SimpleNamespace(system=types.SimpleNamespace(proc=str(proc)), ending_job="7")
    foreign = jobcheck.JobRelease.foreign(release, [{"pid": 300}])
    assert [foreign(pid, 300) for pid in (310, 320, 330)] == [True, False, False]


def test_gpu_releases_respawn_check_passes_over_a_process_of_another_job_than_the_killed_holders(proc):
    """gpu_release reads each holder's job before the signals (it cannot be read from a dead
    process): a restart runs in the same job, or in none."""
    task(proc, 300, "7")
    task(proc, 301)
    release = types.SimpleNamespace(system=types.SimpleNamespace(proc=str(proc)))
    foreign = Release.foreign(release, [{"pid": 300}, {"pid": 301}])
    for pid in (300, 301):
        fakeproc.remove_process(proc, pid)
    for pid, number in ((310, "8"), (320, "7"), (330, None)):
        task(proc, pid, number)
    assert [foreign(pid, 300) for pid in (310, 320, 330)] == [True, False, False]
    assert [foreign(pid, 301) for pid in (310, 320, 330)] == [True, True, False]


# ------------------------------------------------------------------ config


def test_the_defaults_are_gpu_releases_except_the_shorter_waits():
    from ansible_collections.zeromib.gpu.plugins.modules import gpu_release
    spec = {name: value.get("default") for name, value in gpu_release.ARGUMENT_SPEC.items()}
    assert set(jobcheck.RELEASE_DEFAULTS) == set(spec)
    assert {k: v for k, v in jobcheck.RELEASE_DEFAULTS.items() if spec[k] != v} == {}
    config = jobcheck.check_config({})
    assert (config["kill_timeout"], config["wait_timeout"]) == (3.0, 15.0)


@pytest.mark.parametrize("raw, message", [
    ({"kill_timout": 1}, "unknown option 'kill_timout'"),
    ({"smoke_test": "yes"}, "smoke_test must be true or false"),
    ({"smoke_test_mib": -1}, "smoke_test_mib"),
    ({"dcgm_diag": 1}, "unknown option 'dcgm_diag'"),  # not run by the hooks: never silently ignored
    ({"wait_timeout": float("nan")}, "wait_timeout must be a finite number"),
    ({"without_gres": "some"}, "without_gres must be one of skip, all"),
    ({"drain": "yes"}, "drain must be one of scontrol, exit_status, got 'yes'"),
    ({"protect": "sshd"}, "protect must be a list"),
    ([], "must be a JSON object"),
])
def test_a_bad_config_is_named_never_a_traceback(raw, message):
    with pytest.raises(jobcheck.JobCheckError, match=message):
        jobcheck.check_config(raw)


def test_a_config_others_may_write_is_refused(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"max_used_mib": 5}))
    path.chmod(0o600)
    assert jobcheck.read_config(str(path), owner=os.getuid())["max_used_mib"] == 5
    path.chmod(0o666)
    with pytest.raises(jobcheck.JobCheckError, match="only its owner can write"):
        jobcheck.read_config(str(path), owner=os.getuid())
    path.chmod(0o600)
    with pytest.raises(jobcheck.JobCheckError, match="owned by uid"):
        jobcheck.read_config(str(path), owner=os.getuid() + 1)


def test_a_config_that_is_no_json_is_named(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{max_used_mib: 5")
    path.chmod(0o600)
    with pytest.raises(jobcheck.JobCheckError, match="not valid JSON"):
        jobcheck.read_config(str(path), owner=os.getuid())


# ------------------------------------------------------------------ verdict and reason


GPU0 = {"index": 0, "uuid": "GPU-0", "memory_used_mib": 4096, "clean": False}
GPU1 = {"index": 1, "uuid": "GPU-1", "memory_used_mib": 0, "clean": True}


def test_the_cause_names_the_gpu_its_mib_and_who_holds_it():
    result = {"selected_gpus": [0, 1], "gpus": [GPU0, GPU1], "released": False, "healthy": True,
              "holders": [{"pid": 345, "name": "python3", "gpu_indexes": [0], "protected_reason": "Slurm job 8"}]}
    ok, causes = jobcheck.verdict("epilog", result, "GPUs are held only by protected processes")
    assert not ok and causes == ["GPU 0: 4096 MiB, held by pid 345 python3 (Slurm job 8)"]


def test_memory_no_process_holds_is_said_so():
    ok, causes = jobcheck.verdict("epilog", {"selected_gpus": [0], "gpus": [GPU0], "released": False, "holders": []}, "x")
    assert causes == ["GPU 0: 4096 MiB, no process holds it"]


def test_a_free_but_unhealthy_gpu_fails_with_its_issue():
    result = {"selected_gpus": [1], "gpus": [GPU1], "released": True, "healthy": False, "health_issues": ["GPU 1: 2 retired pages pending"]}
    assert jobcheck.verdict("prolog", result, None) == (False, ["GPU 1: 2 retired pages pending"])


def test_free_and_healthy_is_ok_and_other_gpus_do_not_count():
    result = {"selected_gpus": [1], "gpus": [GPU0, GPU1], "released": True, "healthy": True}
    assert jobcheck.verdict("epilog", result, None) == (True, [])


def test_the_drain_reason_is_zeromibs_one_line_and_short():
    reason = jobcheck.drain_reason("epilog", "12", ["GPU 0: 4096 MiB, no process holds it"] * 5)
    assert reason.startswith("zeromib: epilog job 12: GPU 0: 4096 MiB") and len(reason) <= _drain.REASON_MAX


class FakeSlurm:
    def __init__(self, state="IDLE", reason=None):
        self.line = f"NodeName=gpu01 State={state}" + (f" Reason={reason}" if reason else "")
        self.calls = []

    def __call__(self, argv):
        self.calls.append(argv)
        if argv[1] == "show":
            return 0, self.line, ""
        return 0, "", ""


def test_the_hook_drains_with_its_reason_through_scontrol(tmp_path):
    run = FakeSlurm()
    done = jobcheck.drain({"scontrol": "/bin/true"}, {"SLURMD_NODENAME": "gpu01"}, "zeromib: epilog job 1: x", run)
    assert run.calls[-1] == ["/bin/true", "update", "nodename=gpu01", "state=drain", "reason=zeromib: epilog job 1: x"]
    assert done.startswith("drained gpu01")


def test_the_hook_never_overwrites_an_admins_drain():
    run = FakeSlurm("IDLE+DRAIN", "maintenance [root@2026-12-01T10:00:00]")
    done = jobcheck.drain({"scontrol": "/bin/true"}, {"SLURMD_NODENAME": "gpu01"}, "zeromib: epilog job 1: x", run)
    assert all(call[1] == "show" for call in run.calls) and "someone else" in done


# ------------------------------------------------------------------ the packed runner


def test_the_runner_is_one_zip_of_the_collections_module_utils_and_the_same_bytes_twice(tmp_path):
    pack = packer_pack()
    first, second = pack(MODULE_UTILS), pack(MODULE_UTILS)
    assert first == second and first.startswith(b"#!/usr/bin/env python3\n")
    out = tmp_path / "r.pyz"
    out.write_bytes(first)
    names = zipfile.ZipFile(str(out)).namelist()
    prefix = "ansible_collections/zeromib/gpu/plugins/module_utils/"
    assert "__main__.py" in names and prefix + "_act/_release.py" in names and prefix + "_slurm/_jobcheck.py" in names
    # Every source of every wing, each wing a package: a folder that dropped out would fail at import.
    sources = sorted(os.path.relpath(os.path.join(folder, n), MODULE_UTILS) for folder, _dirs, files in os.walk(MODULE_UTILS)
                     for n in files if n.endswith(".py") and n != "__init__.py")
    assert {"_look/_holders.py", "_act/_release.py", "_slurm/_jobcheck.py", "_options.py"} <= set(sources)
    assert sorted(n[len(prefix):] for n in names if n.startswith(prefix) and n.endswith(".py") and not n.endswith("__init__.py")) == sources
    assert {prefix + wing + "/__init__.py" for wing in ("_look", "_act", "_slurm")} <= set(names)
    # Bytecode of the packing Python beside each source: the node's python3 of that version compiles nothing.
    assert all(prefix + n + "c" in names for n in sources)


def private_config(tmp_path):
    """A config of the test's own, its log in tmp_path: the runner's defaults are this machine's
    /etc/zeromib-gpu and /var/log/zeromib-gpu, which no test may read or write."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"log": str(tmp_path / "runner.log"), "drain": False}))
    config.chmod(0o600)
    return config


def test_the_runner_runs_without_ansible_and_says_what_is_wrong(tmp_path):
    out = tmp_path / "r.pyz"
    out.write_bytes(packer_pack()(MODULE_UTILS))
    config = private_config(tmp_path)
    # -I: no site-packages (no ansible), no PYTHONPATH: only the zip's own code.
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "5"}
    done = subprocess.run([sys.executable, "-I", str(out), "cleanup", f"--config={config}"], capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert done.returncode == 1 and "unknown mode 'cleanup'" in done.stderr and "Traceback" not in done.stderr
    # Said in the configured log too, the config being read before the mode.
    assert "unknown mode 'cleanup'" in (tmp_path / "runner.log").read_text()
    skipped = subprocess.run([sys.executable, "-I", "-c", "import runpy, sys; sys.argv = ['x', 'epilog']; "
                              "sys.modules.setdefault('ansible', None); "
                              f"sys.path.insert(0, {str(out)!r}); "
                              "from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _jobcheck as j; "
                              f"sys.exit(j.main(['epilog'], {{'SLURM_JOB_ID': '5'}}, config_path={str(config)!r}) "
                              "if 'ansible.module_utils' not in sys.modules else 3)"],
                             capture_output=True, text=True, env=dict(env, HOME=str(tmp_path)), timeout=60, check=False)
    assert skipped.returncode == 0, skipped.stderr
    loaded = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(out)!r}); "
                             "from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as r; print(r.__spec__.origin)"],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    assert loaded.stdout.strip().endswith("_release.pyc"), loaded


def test_a_python_of_another_version_compiles_the_sources_of_the_runner(tmp_path):
    other = next((p for p in (os.path.expanduser(f"~/.pyenv/versions/{v}/bin/python3") for v in ("3.8.18", "3.13.0", "3.12.1"))
                  if os.path.exists(p) and subprocess.run([p, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                                          text=True, check=False).stdout.strip() != str(tuple(sys.version_info[:2]))), None)
    if other is None:
        pytest.skip("no Python of another version on this machine")
    out = tmp_path / "r.pyz"
    out.write_bytes(packer_pack()(MODULE_UTILS))
    done = subprocess.run([other, "-I", str(out), "cleanup", f"--config={private_config(tmp_path)}"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin"}, timeout=60, check=False)
    assert done.returncode == 1 and "unknown mode 'cleanup'" in done.stderr and "Traceback" not in done.stderr


PYTHON_38 = os.path.expanduser("~/.pyenv/versions/3.8.18/bin/python3")
IMPORT_ALL = ("import sys, zipfile, importlib\n"
              "runner = sys.argv[1]\n"
              "sys.path.insert(0, runner)\n"
              "names = [n[:-3].replace('/', '.') for n in zipfile.ZipFile(runner).namelist() if n.endswith('.py') and n != '__main__.py'\n"
              "         and not n.endswith('__init__.py')]\n"
              "for name in sorted(names):\n"
              "    importlib.import_module(name)\n"
              "print(len(names), 'ansible' in sys.modules)\n")


@pytest.mark.parametrize("python", [sys.executable, PYTHON_38], ids=["this-python", "python-3.8"])
def test_the_packed_runner_imports_every_module_it_packs_without_ansible(tmp_path, python):
    """Every module_util of every wing (_look, _act, _slurm, the shared files) imports from the zip
    alone, on the oldest managed-node Python and this one: a wing that dropped out of the zip, or
    an import of a folder it lacks, fails here rather than in a node's epilog."""
    if python == PYTHON_38 and not os.path.exists(PYTHON_38):
        pytest.skip("no Python 3.8 under ~/.pyenv on this machine (tests/compat/matrix.py installs the managed-node Pythons)")
    out = tmp_path / "r.pyz"
    out.write_bytes(packer_pack()(MODULE_UTILS))
    done = subprocess.run([python, "-I", "-c", IMPORT_ALL, str(out)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    count, with_ansible = done.stdout.split()
    assert int(count) >= 25 and with_ansible == "False", done.stdout


def recorded_checks(tmp_path, monkeypatch, answer):
    """check_job replaced by `answer(mode)`, each call's mode written to a file: the hook runs
    the check in a forked child (its deadline), whose memory the test does not share."""
    record = tmp_path / "checks"

    def check(mode, job, gpus, cfg, note=None, environ=None):
        with open(record, "a") as handle:
            handle.write(mode + "\n")
        return answer(mode)

    monkeypatch.setattr(jobcheck, "check_job", check)
    return lambda: record.read_text().split() if record.exists() else []


def test_the_epilog_after_a_failed_prolog_touches_nothing_and_only_once(tmp_path, monkeypatch):
    # slurmd runs the epilog after a failed prolog too: the job never ran, its GPUs' holders are someone else's.
    marks = str(tmp_path / "marks")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"log": str(tmp_path / "log"), "drain": False}))
    config.chmod(0o600)
    monkeypatch.setattr(jobcheck, "read_config", lambda path, **_kw: jobcheck.check_config(json.loads(config.read_text())))
    calls = recorded_checks(tmp_path, monkeypatch, lambda mode: (mode == "epilog", ["GPU 0: 1000 MiB, held by pid 9 x"], {}))
    env = {"SLURM_JOB_ID": "3", "SLURM_JOB_GPUS": "0"}
    assert jobcheck.main(["prolog"], env, marks=marks) == 1
    assert jobcheck.main(["epilog"], env, marks=marks) == 0 and calls() == ["prolog"]
    assert jobcheck.main(["epilog"], env, marks=marks) == 0 and calls() == ["prolog", "epilog"]  # the mark is taken once
    assert oct(os.stat(marks).st_mode & 0o777) == "0o700"


def test_the_cause_names_the_job_of_a_spared_holder_from_the_runs_own_record():
    # The result's public holders carry no protected_reason: the run's {pid: job} names it.
    result = {"selected_gpus": [0], "gpus": [GPU0], "released": False, "holders": [{"pid": 345, "name": "python3", "gpu_indexes": [0], "protected": True}]}
    assert jobcheck.verdict("epilog", result, "x", {345: "8"}) == (False, ["GPU 0: 4096 MiB, held by pid 345 python3 (Slurm job 8)"])


@pytest.mark.parametrize("raw, message", [
    ({"kill_timeout": "3"}, "kill_timeout must be a number, got '3'"),
    ({"max_used_mib": True}, "max_used_mib must be a number, got True"),
    ({"log": 5}, "log must be a path or null, got 5"),
    ({"scontrol": ""}, "scontrol must be a path or null, got ''"),
    ({"nvidia_smi": ["nvidia-smi"]}, "nvidia_smi must be a path or null"),
    ({"xid_ignore": ["79"]}, "xid_ignore must be a list of Xid numbers"),
    ({"protect": [None]}, "protect must be a list of names or PIDs"),
    ({"expected_mig_mode": "on"}, "expected_mig_mode must be enabled, disabled or null, got 'on'"),
])
def test_json_types_the_runner_cannot_use_are_named(raw, message):
    """JSON carries no Ansible conversion: a quoted number or a wrong type is refused when the
    role writes the config, never a TypeError at the next job."""
    with pytest.raises(jobcheck.JobCheckError, match=re.escape(message)):
        jobcheck.check_config(raw)


def test_a_config_the_hook_was_given_must_exist(tmp_path):
    with pytest.raises(jobcheck.JobCheckError, match="does not exist"):
        jobcheck.read_config(str(tmp_path / "none.json"), owner=os.geteuid(), required=True)
    assert jobcheck.read_config(str(tmp_path / "none.json"), owner=os.geteuid())["drain"] == "scontrol"


def test_a_config_that_is_a_link_or_a_fifo_is_refused_without_blocking(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("{}")
    real.chmod(0o600)
    (tmp_path / "link.json").symlink_to(real)
    with pytest.raises(jobcheck.JobCheckError, match="cannot read the config"):
        jobcheck.read_config(str(tmp_path / "link.json"), owner=os.geteuid())
    os.mkfifo(tmp_path / "fifo.json", 0o600)
    with pytest.raises(jobcheck.JobCheckError, match="must be a regular file"):
        jobcheck.read_config(str(tmp_path / "fifo.json"), owner=os.geteuid())


def test_an_unexpected_error_drains_with_a_reason_never_a_traceback(tmp_path, monkeypatch, capsys):
    config = private_config(tmp_path)
    monkeypatch.setattr(jobcheck, "check_job", lambda *a, **kw: 1 / 0)
    assert jobcheck.main(["epilog", f"--config={config}"], {"SLURM_JOB_ID": "8", "SLURM_JOB_GPUS": "0"}, marks=str(tmp_path / "m")) == 1
    assert capsys.readouterr().err.startswith("zeromib: epilog job 8: internal error, ZeroDivisionError")
    assert '"ok": false' in (tmp_path / "runner.log").read_text()


def test_a_passing_prolog_clears_a_stale_mark_of_its_job(tmp_path, monkeypatch):
    """Review of issue 35: a requeued job keeps its id; a mark from an earlier failed prolog whose
    epilog never ran would make the epilog after this run's good prolog skip the job's leftovers."""
    marks = str(tmp_path / "marks")
    config = private_config(tmp_path)
    jobcheck.mark_prolog_failed("9", marks)
    calls = recorded_checks(tmp_path, monkeypatch, lambda mode: (True, [], {}))
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_GPUS": "0"}
    assert jobcheck.main(["prolog", f"--config={config}"], env, marks=marks) == 0
    assert jobcheck.main(["epilog", f"--config={config}"], env, marks=marks) == 0 and calls() == ["prolog", "epilog"]


# ------------------------------------------------------------------ the hook's deadline (issue 59)


def fast_config(tmp_path, **options):
    """A config whose deadline is 3 s: 2 s of work after drain exit_status's 1 s."""
    config = tmp_path / "fast.json"
    config.write_text(json.dumps(dict({"log": str(tmp_path / "runner.log"), "drain": "exit_status", "deadline": 3, "timeout": 1,
                                       "kill_timeout": 0, "wait_timeout": 1, "settle_timeout": 0}, **options)))
    config.chmod(0o600)
    return config


def test_a_check_that_hangs_is_stopped_at_the_deadline_and_the_hook_answers_naming_where_it_was(tmp_path, monkeypatch, capsys):
    """A step with no bound of its own (a read stuck in the driver) would keep the hook until
    slurmd's PrologEpilogTimeout killed it with no reason: the hook answers at its deadline."""
    pid_file = tmp_path / "worker.pid"

    def hang(mode, job, gpus, cfg, note=lambda _s: None, environ=None):
        pid_file.write_text(str(os.getpid()))
        note("the look (nvidia-smi, the /proc scan, the health readings)")
        time.sleep(3600)

    monkeypatch.setattr(jobcheck, "check_job", hang)
    started = time.monotonic()
    rc = jobcheck.main(["epilog", f"--config={fast_config(tmp_path)}"], {"SLURM_JOB_ID": "12", "SLURM_JOB_GPUS": "0"}, marks=str(tmp_path / "m"))
    elapsed = time.monotonic() - started
    assert rc == 1 and 1.9 < elapsed < 3.0, elapsed
    [entry] = [json.loads(line) for line in (tmp_path / "runner.log").read_text().splitlines()]
    assert entry["causes"] == ["the epilog did not finish within its deadline of 3 s (still at: the look (nvidia-smi, the /proc scan, "
                               "the health readings)); the run was stopped"], entry
    assert entry["drain"].startswith("not drained through scontrol (drain: exit_status)")
    assert capsys.readouterr().err.startswith("zeromib: epilog job 12: the epilog did not finish within its deadline of 3 s")
    assert not os.path.exists(f"/proc/{int(pid_file.read_text())}")  # the stuck child was killed and reaped


def test_the_check_runs_in_a_child_and_its_answer_comes_back_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(jobcheck, "check_job", lambda mode, job, gpus, cfg, note=None, environ=None: (
        False, ["GPU 0: 4096 MiB, held by pid 7 x"], {"killed": [{"pid": 7, "name": "x", "signal": "SIGKILL", "parent": os.getpid()}]}))
    rc = jobcheck.main(["epilog", f"--config={fast_config(tmp_path)}"], {"SLURM_JOB_ID": "13", "SLURM_JOB_GPUS": "0"}, marks=str(tmp_path / "m"))
    [entry] = [json.loads(line) for line in (tmp_path / "runner.log").read_text().splitlines()]
    assert rc == 1 and entry["causes"] == ["GPU 0: 4096 MiB, held by pid 7 x"] and entry["killed"] == [{"pid": 7, "name": "x", "signal": "SIGKILL"}]


@pytest.mark.parametrize("options, message", [
    ({"deadline": 20}, "deadline 20 s leaves 15 s for the work after the 5 s kept for drain scontrol, and kill_timeout + wait_timeout + "
                       "settle_timeout are 19 s: lower them or raise deadline (it must stay below Slurm's PrologEpilogTimeout)"),
    ({"deadline": 4}, "deadline 4 s leaves nothing for the work after the 5 s kept for drain scontrol"),
    ({"deadline": 30, "timeout": 28}, "timeout (nvidia-smi's) 28 s is longer than the 25 s the deadline leaves for the work"),
    ({"deadline": 0}, "deadline must be a number of seconds above 0 and at most one day, got 0"),
    ({"deadline": "60"}, "deadline must be a number, got '60'"),
])
def test_a_deadline_the_bounded_steps_do_not_fit_is_refused_when_written(options, message):
    with pytest.raises(jobcheck.JobCheckError, match=re.escape(message)):
        jobcheck.check_config(options)


def test_waits_that_fit_the_deadline_pass_and_exit_status_keeps_less_back():
    config = jobcheck.check_config({"deadline": 20, "drain": "exit_status"})
    assert (config["deadline"], jobcheck.work_budget(config)) == (20, 19.0)
    assert jobcheck.check_config({})["deadline"] == 60.0


@pytest.mark.parametrize("given, drain", [(True, "scontrol"), (False, "exit_status"), ("exit_status", "exit_status")])
def test_drain_takes_its_first_spelling_true_or_false_too(given, drain):
    assert jobcheck.check_config({"drain": given})["drain"] == drain


def test_drain_exit_status_calls_no_slurm_command():
    run = FakeSlurm()
    done = jobcheck.drain({"drain": "exit_status", "scontrol": "/bin/true"}, {"SLURMD_NODENAME": "gpu01"}, "zeromib: epilog job 1: x", run)
    assert run.calls == [] and done == "not drained through scontrol (drain: exit_status): slurmd drains the node for the failed hook"


def test_scontrol_is_never_waited_for_past_the_hooks_deadline(tmp_path):
    slow = tmp_path / "scontrol"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    started = time.monotonic()
    rc, _out, err = jobcheck.run_command([str(slow), "show", "node"], deadline=started + 0.5)
    assert rc == 124 and "did not answer within 0.5 s" in err and time.monotonic() - started < 3
    assert jobcheck.run_command([str(slow)], deadline=time.monotonic() - 1) == (124, "", "not run: the hook's deadline has come")


def test_the_roles_argument_spec_lists_every_runner_option_with_the_runners_default():
    """The table of docs/slurm_gpu_checks.md is generated from the spec (tests/tools/gen_docs.py): the spec
    must say what the runner does, or a misspelt option stops the play and a real one does not."""
    import yaml
    with open(os.path.join(ROOT, "roles", "slurm_gpu_checks", "meta", "argument_specs.yml"), encoding="utf-8") as handle:
        spec = yaml.safe_load(handle)
    options = spec["argument_specs"]["main"]["options"]["slurm_gpu_checks_options"]["options"]
    defaults = jobcheck.check_config({})
    assert set(options) == set(defaults)
    assert {name: options[name].get("default") for name in options} == defaults


@pytest.mark.parametrize(("reading", "owner"), [("freezer.state FROZEN", 0), ("cgroup.events frozen 1", 0), ("freezer.state FREEZING", 4242)])
def test_a_frozen_holder_in_the_release_failure_is_the_first_cause(reading, owner):
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _frozen
    said = _frozen.advice("pid 7 python3", _frozen.Frozen("/sys/fs/cgroup/j", reading, owner))
    result = {"released": False, "gpus": [{"index": 0, "memory_used_mib": 2048, "clean": False}],
              "holders": [{"pid": 7, "name": "python3", "gpu_indexes": [0]}]}
    ok, causes = jobcheck.verdict("epilog", result, "GPUs still in use after 1.0 s: GPU 0: pid 7 python3. " + said)
    assert not ok and causes[0] == said and len(causes) >= 2, causes
    # without a frozen holder the causes are the per-GPU ones only
    assert not [c for c in jobcheck.verdict("epilog", result, "GPUs still in use after 1.0 s")[1] if c.startswith("frozen (")]


def test_the_hooks_short_cause_names_an_escaped_holders_origin_and_a_vgpu_hosts_vms():
    """Issue 70 in the hooks' first sentence: where a holder outside every job came from and what ends
    it; memory no process holds on a GPU whose vGPUs VMs hold (no reset)."""
    instance = {"kind": "apptainer_instance", "session": None, "stop": "apptainer instance stop train", "user": None,
                "text": "Apptainer instance train of uid 4242 (the name is its user's word; its starter is pid 811), outside any job"}
    ssh = {"kind": "ssh_session", "session": "5", "stop": "loginctl terminate-session 5",
           "text": "SSH session 5 of user alice from 10.0.0.9, detached from it (parent PID 1, a session of its own), outside any job"}
    detached = {"kind": "detached", "session": None, "stop": "kill 813", "text": "a process of uid 4242 started outside any job (parent PID 1, own session)"}
    result = {"selected_gpus": [0, 1], "released": False,
              "gpus": [{"index": 0, "memory_used_mib": 2048, "clean": False, "pci_bus_id": "00000000:18:00.0"},
                       {"index": 1, "memory_used_mib": 24576, "clean": False, "pci_bus_id": "00000000:61:00.0"}],
              "holders": [{"pid": 812, "name": "python3", "gpu_indexes": [0], "origin": instance},
                          {"pid": 813, "name": "python3", "gpu_indexes": [0], "origin": ssh},
                          {"pid": 814, "name": "python3", "gpu_indexes": [0], "origin": detached}],
              "given_to_vms": [{"bus": "0000:61:00.0", "iommu_group": "101", "mdev": "aa", "vm": "train-vm (libvirt)", "pid": 4100}]}
    causes = jobcheck.dirty_causes(result)
    assert causes == [
        "GPU 0: 2048 MiB, held by pid 812 python3 (Apptainer instance train of uid 4242: `apptainer instance stop train`), pid 813 python3 "
        "(SSH session 5 of user alice from 10.0.0.9: `loginctl terminate-session 5`), pid 814 python3 (a process of uid 4242 started outside "
        "any job)",
        "GPU 1: 24576 MiB, no process holds it here: vGPUs given to VMs (train-vm (libvirt)), no reset"], causes


def test_the_ghost_readings_end_a_second_before_the_work_and_never_past_it(monkeypatch):
    """The epilog's ghost-busy readings last what the hook's deadline leaves, less GHOST_MARGIN_S,
    up to SETTLE_S; none where it leaves less; SETTLE_S where the caller gives no end."""
    seen = []
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ghost_busy  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(_ghost_busy, "after_release", lambda smi, result, timeout, short=False, settle_s=None: seen.append(settle_s) or result)
    result = {"released": True, "killed": [{"pid": 7, "signal": "SIGTERM", "gpu_indexes": [1]}]}
    now = time.monotonic()
    for until in (now + 2.5, now + 0.5, now + 60, None):
        jobcheck.ready_for_the_next_job(None, None, {"timeout": 10}, result, until)
    assert 1.0 < seen[0] <= 1.5 and seen[1] == 0.0 and seen[2] == seen[3] == _ghost_busy.SETTLE_S, seen
