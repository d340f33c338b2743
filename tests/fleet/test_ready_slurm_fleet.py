"""The training-ready profile and ghost-busy GPUs at the job boundary with real Slurm (issue 71):
slurmd runs the prolog and epilog the role zeromib.gpu.slurm_gpu_checks installs, on the fleet's
one-node cluster of test_slurm_checks_fleet.py (its GPUs given as gres). A GPU the inference side left
in EXCLUSIVE_PROCESS fails the prolog; the job does not run and the node is drained, its reason's
first sentence naming the GPU and its compute mode. The site's ready_profile, set through the role,
accepts it, and the next job runs; the prolog changes nothing on the GPU. A job that leaves its GPU
off the profile fails its epilog the same way, unless the site opted in to ready_fix through the
role: the epilog then sets it back, records it, and restore_gpus.yml puts the job's setting back. A
GPU the epilog's kill leaves 100 % busy with no process (the fake libcuda.so.1 of tests/sim installed
on the host for these tests) gets a context from a fresh process: cleared, the node stays up; stuck,
the drain reason's first sentence says what it reads and the reset to run.

Runs on a fleet of 1 or more hosts: `ZEROMIB_FLEET_HOSTS=1 ZEROMIB_FLEET_PROFILE=h200 pytest tests/fleet/test_ready_slurm_fleet.py`."""
from __future__ import annotations

import base64
import json
import shlex
import sys
from pathlib import Path

import pytest

from scenarios import wait_for
from test_slurm_checks_fleet import RESTORE, drained, ended, install, job, leave_behind, node, ready_pid, submit
from test_slurm_checks_fleet import gres_host, slurm_node  # noqa: F401  # pylint: disable=unused-import  # fixtures, used by name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
import fake_libcuda  # noqa: E402

SETTINGS = "/run/nvidia-sim/settings.json"
LEFT = "compute mode is Exclusive_Process, expected Default"
# Where Debian's NVIDIA driver packages put libcuda.so.1 (the loader's multiarch directory).
LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
RECORD = "/var/lib/zeromib-gpu/released.json"


def compute_modes(fleet, host) -> list[str]:
    out = fleet.ssh(host, "nvidia-smi --query-gpu=compute_mode --format=csv,noheader", check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_a_gpu_left_in_exclusive_process_fails_the_prolog_drains_the_node_naming_it_and_the_sites_profile_accepts_it(gres_host):
    fleet, host = gres_host
    # Every GPU of the node: whichever GRES index slurmd gives the job, its GPU is off the profile.
    left = {gpu["uuid"]: {"compute_mode": "Exclusive_Process"} for gpu in fleet.host(host).gpus}
    fleet.ssh(host, f"printf %s {shlex.quote(json.dumps(left))} > {SETTINGS}", check=True)
    try:
        first = submit(fleet, host, "touch /run/zeromib-ready-job-ran")
        assert wait_for(lambda: drained(node(fleet, host)), timeout=60), (node(fleet, host), job(fleet, host, first))
        reason = node(fleet, host)["Reason"]
        assert reason.startswith(f"zeromib: prolog job {first}: GPU "), reason
        assert LEFT in reason.split("; ")[0], reason
        assert fleet.ssh(host, "test -e /run/zeromib-ready-job-ran").returncode != 0, "the job ran on a GPU off the profile"
        assert set(compute_modes(fleet, host)) == {"Exclusive_Process"}, "the prolog changed a setting"
        fleet.ssh(host, f"scancel --quiet --full {first}; true")

        # The site's training runs one process per GPU: its profile accepts any compute mode.
        done = install(fleet, host, ready_profile={"compute_mode": "any"})
        assert done.rc == 0, str(done)
        fleet.ssh(host, f"scontrol update nodename={host} state=resume", check=True)
        after = submit(fleet, host, "touch /run/zeromib-ready-job-ran")
        assert wait_for(lambda: job(fleet, host, after).get("JobState") == "COMPLETED", timeout=60), (job(fleet, host, after), node(fleet, host))
        assert not drained(node(fleet, host)), node(fleet, host)
    finally:
        fleet.ssh(host, f"rm -f {SETTINGS} /run/zeromib-ready-job-ran; scancel --quiet --full -u root; true")
        install(fleet, host)


def write_settings(fleet, host, values):
    fleet.ssh(host, f"printf %s {shlex.quote(json.dumps(values))} > {SETTINGS}", check=True)


@pytest.fixture
def with_libcuda(gres_host):
    """The host given the fake libcuda.so.1 (tests/sim/fake_libcuda.c, built here: the fleet's Debian 12
    is this machine's), its config listing the host's GPUs, and an empty call log; all removed after."""
    fleet, host = gres_host
    data = base64.b64encode(Path(fake_libcuda.build()).read_bytes()).decode()
    buses = "".join(f"device {gpu['pci_bus_id']}\n" for gpu in fleet.host(host).gpus)
    fleet.ssh(host, f"echo {data} | base64 -d > {LIBCUDA}.new && mv {LIBCUDA}.new {LIBCUDA} && "
                    f"printf {shlex.quote(buses)} > /run/nvidia-sim/libcuda.conf && rm -f /run/nvidia-sim/libcuda.log", check=True)
    try:
        yield fleet, host
    finally:
        fleet.ssh(host, f"rm -f {LIBCUDA} /run/nvidia-sim/libcuda.conf /run/nvidia-sim/libcuda.log {SETTINGS}; "
                        "scancel --quiet --full -u root; true")


@pytest.mark.parametrize("kind", ["stuck", "clears"])
def test_a_gpu_the_epilogs_kill_leaves_busy_with_no_process_gets_a_context_and_a_stuck_one_drains_saying_the_reset(with_libcuda, kind):
    fleet, host = with_libcuda
    # Every GPU of the node: whichever GRES index slurmd gives the job, its GPU is the one killed on.
    write_settings(fleet, host, {gpu["uuid"]: {"ghost_busy": kind} for gpu in fleet.host(host).gpus})
    # A name of its own per case: ready_pid must not read the file an earlier case's job left.
    first = submit(fleet, host, leave_behind(f"ghost-{kind}", 2048))
    pid = ready_pid(fleet, host, f"ghost-{kind}")
    run = ended(fleet, host, first)
    assert [k["pid"] for k in run["killed"]] == [pid], run
    [index] = [int(g) for g in run["gpus"]]
    [said] = run["ghost_busy"]
    assert "read 100 % busy at 101.5 W with no process and no memory after this run's kills; a CUDA context was opened and closed" in said, said
    calls = fleet.ssh(host, "cat /run/nvidia-sim/libcuda.log").stdout
    assert " cuCtxCreate " in calls and " cuCtxDestroy " in calls, calls
    if kind == "clears":
        assert run["ok"] is True and said.endswith("(cleared)"), run
        assert not drained(node(fleet, host)), node(fleet, host)
        return
    assert run["ok"] is False, run
    assert wait_for(lambda: drained(node(fleet, host)), timeout=30), node(fleet, host)
    reason = node(fleet, host)["Reason"]
    first_sentence = reason.split("; ")[0]
    assert first_sentence == (f"zeromib: epilog job {first}: GPU {index}: 100 % busy with no process, also after a CUDA context: "
                              f"reset it (nvidia-smi -r -i {index})"), reason


def test_a_job_that_leaves_its_gpu_off_the_profile_drains_the_node_unless_the_site_opted_in_to_ready_fix(gres_host):
    fleet, host = gres_host
    # An inference job run as root puts its GPU in EXCLUSIVE_PROCESS (nvidia-smi -c 3 takes root).
    script = "nvidia-smi -i $SLURM_JOB_GPUS -c 3"
    try:
        first = submit(fleet, host, script)
        run = ended(fleet, host, first)
        [index] = [int(g) for g in run["gpus"]]
        assert run["ok"] is False and "ready_fixed" not in run, run
        assert wait_for(lambda: drained(node(fleet, host)), timeout=30), node(fleet, host)
        reason = node(fleet, host)["Reason"]
        assert reason.startswith(f"zeromib: epilog job {first}: GPU {index} (") and LEFT in reason.split("; ")[0], reason
        assert compute_modes(fleet, host)[index] == "Exclusive_Process", "the epilog changed a setting it was not asked to"
        fleet.ssh(host, f"nvidia-smi -i {index} -c 0 && scontrol update nodename={host} state=resume", check=True)

        done = install(fleet, host, ready_fix=True)
        assert done.rc == 0, str(done)
        second = submit(fleet, host, script)
        run = ended(fleet, host, second)
        [index] = [int(g) for g in run["gpus"]]
        assert run["ok"] is True and run["causes"] == [], run
        [fixed] = run["ready_fixed"]
        assert fixed["index"] == index and fixed["changes"] == ["compute mode Exclusive_Process -> Default"], fixed
        assert set(compute_modes(fleet, host)) == {"Default"}
        assert not drained(node(fleet, host)), node(fleet, host)
        record = json.loads(fleet.ssh(host, f"cat {RECORD}", check=True).stdout)
        [entry] = [e for e in record["entries"] if e["kind"] == "gpu_settings"]
        assert entry["index"] == index and entry["before"] == {"compute_mode": "Exclusive_Process"}, entry

        # The inference side's setting back when the site puts the inference side back.
        restored = fleet.ansible_playbook(RESTORE, limit=host)
        assert restored.rc == 0, str(restored)
        assert compute_modes(fleet, host)[index] == "Exclusive_Process"
    finally:
        fleet.ssh(host, f"scancel --quiet --full -u root; nvidia-smi -c 0 >/dev/null; rm -f {SETTINGS} {RECORD}; true")
        install(fleet, host)
