"""The fleet-wide proof on real systemd hosts (issue 72): work that a cluster runtime reschedules
onto a host already proven free fails the gate, and a clean fleet reads nothing more.

The rescheduler plays Ray's GCS (or Swarm's manager, or the kubelet's API server): it lives on
another machine (here the controller, as a GCS lives on the head node), sees the actor on host A
die, and, after a back-off, starts it again on host B, whose gate has already proven B free. On A
the actor is the GPU child of a node process (a `ray start`-shaped launcher unit, so only the actor
is killed and A's gate watches the launcher for its settle window): the restart on B comes while
A is still being proven, before the verdict. Today's code reports both hosts free while B holds
the actor's 3000 MiB; the proof names B's holder and that this run freed A.

Both paths: free_gpus.yml and the role in a user's own play, each on the oldest and the newest
supported ansible-core (the compatibility matrix's controller venvs). Two hosts of the fleet
(`ZEROMIB_FLEET_HOSTS=2 pytest tests/fleet/test_fleet_proof_fleet.py`)."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from scenarios import PLAYBOOK, RELEASE_TASK, summary_lines, summary_row, summary_status, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

pytestmark = pytest.mark.usefixtures("fleet_baselines")

VERDICT_TASK = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
# The restart's back-off after the actor died on A, and A's settle window (longer: the restart
# lands before A's gate ends, after B's clean gate, ~1-3 s on the 2-core machine, has ended).
BACKOFF_S = 3
SETTLE_S = 14
RAYLET = r'''#!/usr/bin/python3
import json, os, signal, subprocess, sys, time
ready = sys.argv[1]
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
actor = subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", "0", "--mib", "3000", "--name", "ray::Trainer", "--ready-file", ready + ".a"])
while not os.path.exists(ready + ".a"):
    time.sleep(0.02)
with open(ready + ".tmp", "w") as out:
    out.write(json.dumps({"pid": os.getpid(), "actor": actor.pid}))
os.rename(ready + ".tmp", ready)
while True:
    time.sleep(3600)
'''
READY = "/run/nvidia-sim/ready/sim-ray"
UNITS = "sim-ray-node.service sim-ray-actor.service"
# The node process is a launcher (as a real raylet is by its vouched executable): only its actor is killed.
VARS = {"free_gpus_settle_timeout": SETTLE_S, "free_gpus_kill_timeout": 2, "free_gpus_launchers": ["sim-ray-node.service"]}


# The oldest ansible-core the collection supports and the newest (as tests/fleet/test_typos.py).
ENDS = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]


def _controller(core: str, python: str) -> dict:
    """ansible_playbook's keywords that run it on that ansible-core's controller venv."""
    bin_dir = matrix.controller_bin(core, python)
    return {"bin_dir": bin_dir, "env": {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}}


def _hosts(fleet) -> tuple[str, str]:
    plain = [h.name for h in fleet.hosts if h.idle_mib == 0 and h.gpu_count >= 1]
    assert len(plain) >= 2, "needs two hosts whose GPUs idle at 0 MiB"
    return plain[0], plain[1]


def _cleanup(fleet, hosts) -> None:
    for host in hosts:
        fleet.ssh(host, f"systemctl stop {UNITS}; systemctl reset-failed {UNITS}; rm -f /usr/local/bin/sim-ray {READY}*; true")
    fleet.reset(list(hosts))


def _start_actor_on(fleet, a: str) -> dict:
    """A's node process and its actor on GPU 0 (3000 MiB)."""
    fleet.ssh(a, f"cat > /usr/local/bin/sim-ray <<'EOF'\n{RAYLET}EOF\nchmod 0755 /usr/local/bin/sim-ray; mkdir -p /run/nvidia-sim/ready; "
                 f"systemd-run --unit sim-ray-node --collect /usr/local/bin/sim-ray {READY}", check=True)
    assert wait_for(lambda: fleet.ssh(a, f"test -s {READY}").returncode == 0, timeout=30), "the node process never got ready"
    return json.loads(fleet.ssh(a, f"cat {READY}", check=True).stdout)


def _gcs(fleet, a: str, actor: int, b: str, said: dict) -> threading.Thread:
    """The rescheduler: once A's actor is gone, after the back-off, the actor again on B."""
    def run() -> None:
        gone = fleet.ssh(a, f"while [ -d /proc/{actor} ] && [ \"$(cut -d' ' -f3 /proc/{actor}/stat 2>/dev/null)\" != Z ]; do sleep 0.1; done",
                         timeout=120)
        said["gone_at"] = time.monotonic()
        time.sleep(BACKOFF_S)
        if gone.returncode == 0:
            started = fleet.ssh(b, "systemd-run --unit sim-ray-actor --collect /usr/local/bin/gpu_holder --gpus 0 --mib 3000 "
                                   "--name ray::Trainer")
            said["restarted_at"], said["restart_rc"] = time.monotonic(), started.returncode
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _rescheduled(fleet, run_play) -> dict:
    a, b = _hosts(fleet)
    _cleanup(fleet, (a, b))
    try:
        node = _start_actor_on(fleet, a)
        said: dict = {}
        gcs = _gcs(fleet, a, node["actor"], b, said)
        started = time.monotonic()
        run = run_play(a, b)
        gcs.join(timeout=60)
        return {"a": a, "b": b, "run": run, "said": said, "started": started, "b_after": fleet.gpu_memory(b)}
    finally:
        _cleanup(fleet, (a, b))


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_work_rescheduled_onto_a_proven_host_fails_free_gpus_yml_naming_it(fleet, core, python):
    controller = _controller(core, python)
    found = _rescheduled(fleet, lambda a, b: fleet.ansible_playbook(PLAYBOOK, limit=[a, b], extra_vars=VARS, **controller))
    a, b, run, said = found["a"], found["b"], found["run"], found["said"]
    assert said.get("restart_rc") == 0, said
    assert found["b_after"][0] >= 3000, (found, summary_lines(run))
    assert run.rc != 0, run
    lines = summary_lines(run)
    assert lines, run
    assert summary_status(lines, b) == "back", lines
    row = summary_row(lines, b)
    assert "not free after the last host was freed: GPU 0 reads" in row and "ray::Trainer" in row and "sim-ray-actor.service" in row, row
    assert f"after this run freed {a}" in row, row
    assert summary_status(lines, a) == "freed", lines
    assert lines[-2] == f"fleet-wide proof after {a} was freed: 2 hosts read once more, not free again: {b}", lines
    assert lines[-1] == "2 hosts: 1 back, 1 freed", lines


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_work_rescheduled_onto_a_proven_host_fails_the_role_in_a_users_play(fleet, core, python):
    controller = _controller(core, python)

    def play(a, b):
        return fleet.ansible_playbook({"hosts": f"{a},{b}", "gather_facts": False, "become": True,
                                       "pre_tasks": [{"name": "Free the GPUs", "ansible.builtin.include_role": {"name": "zeromib.gpu.free_gpus"}}],
                                       "tasks": [{"name": "Train", "ansible.builtin.debug": {"msg": "training"}}]}, extra_vars=VARS,
                                      **controller)
    found = _rescheduled(fleet, play)
    a, b, run = found["a"], found["b"], found["run"]
    assert found["said"].get("restart_rc") == 0, found["said"]
    assert run.rc != 0, run
    [verdict_b] = run.results(VERDICT_TASK, b)
    assert verdict_b["status"] == "failed" and verdict_b["result"]["msg"].startswith(f"{b}: not free after the last host was freed: GPU 0 reads"), verdict_b
    assert [t["status"] for t in run.results(VERDICT_TASK, a)] == ["ok"], run
    assert not run.results(task="Train", host=b), "training never starts on the host where the actor came back"


def test_a_clean_fleet_reads_nothing_more(fleet):
    a, b = _hosts(fleet)
    fleet.reset([a, b])
    run = fleet.ansible_playbook(PLAYBOOK, limit=[a, b])
    assert run.rc == 0, run
    lines = summary_lines(run)
    assert not any("fleet-wide proof" in line for line in lines), lines
    for host in (a, b):
        assert [t["task"] for t in run.results(host=host) if t["task"] in (RELEASE_TASK, VERDICT_TASK)] == [RELEASE_TASK, VERDICT_TASK]
        # The verdict ran no module: it set no fact (the proof's outcome carries `fleet_proof`).
        assert "fleet_proof" not in json.dumps(run.result(VERDICT_TASK, host)), run.result(VERDICT_TASK, host)
