"""The Slurm epilog's CUDA smoke test (issue 35), run as slurmd runs the hook: the runner packed by
the role's pack_runner.py, `python3 RUNNER epilog` with slurmd's environment, on a simulated host
with the fake libcuda.so.1 (tests/sim/fake_libcuda.c). No Slurm is needed to call the hook; the
real-Slurm cases are in tests/fleet/test_slurm_checks_fleet.py (the fleet's hosts have no libcuda).
"""
import json
import os
import subprocess

import pytest

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


def epilog(host, runner, tmp_path, job, gpus="0,1", **options):
    """The hook as slurmd calls it -> (rc, stderr, the run's log entry)."""
    config, log = tmp_path / f"config-{job}.json", tmp_path / f"log-{job}.jsonl"
    config.write_text(json.dumps(dict({"drain": False, "log": str(log)}, **options)))
    config.chmod(0o600)
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd",
           "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
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
    assert stderr.startswith("zeromib: epilog job 702: GPU 1 (") and entry["drain"] == "not drained: drain is false"


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
