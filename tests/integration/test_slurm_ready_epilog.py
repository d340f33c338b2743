"""The Slurm epilog leaves the job's GPUs as gpu_release leaves them (issue 71), run as slurmd runs the
hook (the runner packed by the role's pack_runner.py, `python3 RUNNER epilog` with slurmd's
environment) on a simulated host with the fake libcuda.so.1: a GPU the job's killed holder left 100 %
busy with no process and 0 MiB gets a CUDA context opened and closed from a fresh process and is read
again; one that clears passes, one that stays busy fails the epilog with what was seen and the reset
to run, naming the NVML clients that block it. Where the site opted in (`ready_fix` in the hooks'
config, the role's slurm_gpu_checks_options), a GPU the job left off the training-ready profile is
set back and recorded for gpu_restore; without it, the epilog fails naming the setting and its
command. The real-slurmd cases: tests/fleet/test_ready_slurm_fleet.py.
"""
import json
import os

import pytest

from ansible_in_ns import run_module
from test_slurm_epilog_smoke import BUS, epilog, runner  # noqa: F401  # pylint: disable=unused-import  # runner: a fixture
from test_smoke_test_gate import configure, cuda_calls

RECORD = "/var/lib/zeromib-gpu/released.json"


@pytest.fixture(scope="module")
def host(module_nshost, library):
    return module_nshost("h200x2", seed="readyepi", libcuda=library)


def settings(host, values):
    with open(os.path.join(host.root.state, "settings.json"), "w") as handle:
        json.dump(values, handle)


def read_settings(host):
    with open(os.path.join(host.root.state, "settings.json")) as handle:
        return json.load(handle)


def setters(host):
    try:
        with open(os.path.join(host.root.state, "setters.log")) as handle:
            return [line.strip() for line in handle if line.strip()]
    except OSError:
        return []


@pytest.fixture
def clean(host):
    configure(host)
    settings(host, {})
    host.run(["rm", "-f", RECORD])
    try:
        os.unlink(os.path.join(host.root.state, "setters.log"))
    except OSError:
        pass
    yield host
    settings(host, {})
    host.run(["rm", "-f", RECORD])


@pytest.mark.parametrize("kind", ["clears", "stuck"])
def test_a_gpu_the_jobs_kill_left_busy_with_no_process_gets_a_context_and_a_stuck_one_fails_naming_the_reset(clean, runner, tmp_path, kind):
    host = clean
    settings(host, {host.config["gpus"][1]["uuid"]: {"ghost_busy": kind}})
    left = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    rc, stderr, entry = epilog(host, runner, tmp_path, f"91{len(kind)}", gpus="1")
    assert [k["pid"] for k in entry["killed"]] == [left.pid] and not host.alive(left.pid)
    [said] = entry["ghost_busy"]
    assert said.startswith(f"GPU 1 ({BUS[1]}) read 100 % busy at 101.5 W with no process and no memory after this run's kills; "
                           "a CUDA context was opened and closed on it from a fresh process"), said
    assert [c for c, _a in cuda_calls(host) if c in ("cuDeviceGetByPCIBusId", "cuCtxCreate", "cuCtxDestroy")] == [
        "cuDeviceGetByPCIBusId", "cuCtxCreate", "cuCtxDestroy"], cuda_calls(host)
    if kind == "clears":
        assert (rc, entry["ok"], entry["causes"]) == (0, True, []), stderr
        assert said.endswith("(cleared)"), said
    else:
        assert (rc, entry["ok"]) == (1, False), entry
        assert stderr.startswith(f"zeromib: epilog job {entry['job']}: GPU 1: 100 % busy with no process, also after a CUDA context: "
                                 "reset it (nvidia-smi -r -i 1)"), stderr
        assert len(stderr.splitlines()[0]) <= 120, stderr


def test_a_stuck_ghost_under_a_tight_deadline_is_read_again_only_as_long_as_the_deadline_leaves_and_named(clean, runner, tmp_path):
    """deadline 6 s with drain exit_status leaves 5 s for the work: the release's own waits fit it
    (the config is accepted); after a slow release on a loaded machine, the ghost's 3 s of readings
    would not. The readings end a second before the work's end, so the drain reason names the GPU,
    not the deadline (the arithmetic alone: test_jobcheck's ghost readings test)."""
    host = clean
    settings(host, {host.config["gpus"][1]["uuid"]: {"ghost_busy": "stuck"}})
    left = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    rc, stderr, entry = epilog(host, runner, tmp_path, "925", gpus="1", deadline=6, kill_timeout=0.5, wait_timeout=1, settle_timeout=0.2, timeout=2)
    assert not host.alive(left.pid) and (rc, entry["ok"]) == (1, False), entry
    assert stderr.startswith(f"zeromib: epilog job {entry['job']}: GPU 1: 100 % busy with no process, also after a CUDA context: "
                             "reset it (nvidia-smi -r -i 1)"), stderr
    assert "deadline" not in stderr.splitlines()[0], stderr


def test_a_stuck_ghost_names_the_nvml_clients_that_block_a_reset_and_the_epilog_never_signals_them(clean, runner, tmp_path):
    """A tenant (uid 4242) keeps an NVML monitor open on every GPU: never signalled, never steering
    the context, named in the full cause as what blocks the reset."""
    host = clean
    settings(host, {host.config["gpus"][1]["uuid"]: {"ghost_busy": "stuck"}})
    monitor = host.spawn_as(4242, ["gpu_holder", "--monitor", "dmon", "--name", "user-dmon"])
    try:
        left = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
        rc, _stderr, entry = epilog(host, runner, tmp_path, "920", gpus="1")
        assert host.alive(monitor.pid), "the epilog signalled a user's NVML client"
    finally:
        host.kill(monitor.pid)
        host.wait_gone(monitor.pid, 5)
    assert not host.alive(left.pid) and rc == 1
    assert all(k["pid"] != monitor.pid for k in entry["killed"]), entry["killed"]
    [cause] = entry["causes"]
    assert cause.endswith(f"; NVML handles block a reset: stop pid {monitor.pid} user-dmon first"), cause


def test_a_gpu_busy_before_the_job_and_never_killed_on_gets_no_context(clean, runner, tmp_path):
    host = clean
    settings(host, {host.config["gpus"][1]["uuid"]: {"ghost_busy": "stuck"}})
    rc, stderr, entry = epilog(host, runner, tmp_path, "921", gpus="1")
    assert (rc, entry["ok"]) == (0, True), stderr
    assert "ghost_busy" not in entry and cuda_calls(host) == []


def test_the_epilog_puts_the_profile_back_where_the_site_opted_in_and_gpu_restore_puts_the_inference_side_back(clean, runner, tmp_path):
    host = clean
    uuid = host.config["gpus"][1]["uuid"]
    # What the job left: an inference server it ran as root set EXCLUSIVE_PROCESS and a lower power limit.
    settings(host, {uuid: {"compute_mode": "Exclusive_Process", "power.limit": "350.00", "power.default_limit": "700.00"}})
    host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    rc, stderr, entry = epilog(host, runner, tmp_path, "930", gpus="1")
    assert (rc, entry["ok"]) == (1, False), entry
    assert stderr.startswith(f"zeromib: epilog job 930: GPU 1 ({BUS[1]}): compute mode is Exclusive_Process, expected Default"), stderr
    assert setters(host) == [] and "ready_fixed" not in entry, "the epilog changed a setting it was not asked to"

    host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    rc, stderr, entry = epilog(host, runner, tmp_path, "931", gpus="1", ready_fix=True)
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), stderr
    [fixed] = entry["ready_fixed"]
    assert fixed["index"] == 1 and fixed["changes"] == ["compute mode Exclusive_Process -> Default", "power limit 350 W -> 700 W"], fixed
    assert setters(host) == [f"-i {uuid} -c 0", f"-i {uuid} -pl 700"]
    assert read_settings(host)[uuid]["compute_mode"] == "Default"
    [record] = [e for e in json.loads(host.read(RECORD))["entries"] if e["kind"] == "gpu_settings"]
    assert record["name"] == uuid and record["before"] == {"compute_mode": "Exclusive_Process", "power_limit": 350.0}, record

    restored = run_module(host, "gpu_restore", {})
    assert not restored.failed, restored.msg
    assert setters(host)[2:] == [f"-i {uuid} -c 3", f"-i {uuid} -pl 350"]
    assert read_settings(host)[uuid]["compute_mode"] == "Exclusive_Process"


def test_the_prolog_only_looks_also_with_ready_fix(clean, runner, tmp_path):
    """ready_fix is the epilog's, after the GPUs are proven free: a prolog never changes a GPU
    (another job may be about to use it), it fails naming the setting."""
    host = clean
    uuid = host.config["gpus"][0]["uuid"]
    settings(host, {uuid: {"compute_mode": "Exclusive_Process"}})
    config, log = tmp_path / "config.json", tmp_path / "log.jsonl"
    config.write_text(json.dumps({"drain": "exit_status", "log": str(log), "ready_fix": True}))
    config.chmod(0o600)
    env = {"SLURM_JOB_ID": "940", "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0", "SLURM_SCRIPT_CONTEXT": "prolog_slurmd",
           "SLURM_CONF": "/etc/slurm/slurm.conf", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = host.run(["/usr/bin/python3", runner, "prolog", f"--config={config}"], env=env, timeout=120)
    assert proc.returncode == 1 and "compute mode is Exclusive_Process, expected Default" in proc.stderr, proc.stderr
    assert setters(host) == [] and read_settings(host)[uuid]["compute_mode"] == "Exclusive_Process"
