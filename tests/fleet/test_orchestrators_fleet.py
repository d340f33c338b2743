"""A Ray node on a real systemd host (issue 72): `ray start --block` as a unit's ExecStart= (the
identity rule vouches for it through systemd's MainPID) runs an actor on GPU 0 and a CPU task, as a
raylet runs its workers. The attacker is the runtime itself: an actor killed from outside comes back.

- Without `ray:` in free_gpus_services the run refuses before anything is done, naming the Ray node
  and `ray stop`: the actor keeps its GPU, nothing was killed, and the host is not reported free.
- With `ray:` the actor is ended, the node and its CPU task stay up.
- A user's process posing as a Ray node (their `exec -a raylet`, their uid) makes root refuse nothing:
  its GPU child is an ordinary holder, ended.

A real Ray cluster (two hosts, a head and a worker from the Python package registry) is not here:
see the helper's report. One host (`ZEROMIB_FLEET_HOSTS=1 pytest tests/fleet/test_orchestrators_fleet.py`)."""
from __future__ import annotations

import json

import pytest

from scenarios import PLAYBOOK, RELEASE_TASK, alive, summary_lines, summary_row, summary_status, wait_for

pytestmark = pytest.mark.usefixtures("fleet_baselines")

RAY = r'''#!/usr/bin/python3
import json, os, signal, subprocess, sys, time
ready = sys.argv[sys.argv.index("--ready-file") + 1]
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
actor = subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", "0", "--mib", "3000", "--name", "ray::Trainer", "--ready-file", ready + ".a"])
cpu = subprocess.Popen(["/bin/bash", "-c", "exec -a ray::cpu_task sleep infinity"])
while not os.path.exists(ready + ".a"):
    time.sleep(0.02)
with open(ready + ".tmp", "w") as out:
    out.write(json.dumps({"pid": os.getpid(), "actor": actor.pid, "cpu": cpu.pid}))
os.rename(ready + ".tmp", ready)
while True:
    time.sleep(3600)
'''
READY = "/run/nvidia-sim/ready/ray-node"
# A user's process that calls itself raylet (argv[0] and comm), run as her uid: what she controls.
FAKE_RAYLET = """#!/bin/bash
exec -a raylet /usr/bin/python3 -c 'import subprocess, time
subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", "0", "--mib", "1000", "--name", "ray::X"])
time.sleep(3600)'
"""
UNIT = "ray-node.service"
UNIT_FILE = ("[Unit]\nDescription=A Ray node (simulated): ray start --block runs every job's workers\n[Service]\n"
             f"ExecStart=/usr/local/bin/ray start --block --ready-file {READY}\n")


def _host(fleet) -> str:
    return next(h.name for h in fleet.hosts if h.idle_mib == 0 and h.gpu_count >= 1)


@pytest.fixture
def ray_node(fleet):
    host = _host(fleet)
    fleet.reset([host])
    fleet.ssh(host, f"cat > /usr/local/bin/ray <<'EOF'\n{RAY}EOF\nchmod 0755 /usr/local/bin/ray; mkdir -p /run/nvidia-sim/ready; rm -f {READY}*\n"
                    f"cat > /etc/systemd/system/{UNIT} <<'EOF'\n{UNIT_FILE}EOF\nsystemctl daemon-reload; systemctl start {UNIT}", check=True)
    try:
        assert wait_for(lambda: fleet.ssh(host, f"test -s {READY}").returncode == 0, timeout=30), "the Ray node never got ready"
        yield host, json.loads(fleet.ssh(host, f"cat {READY}", check=True).stdout)
    finally:
        fleet.ssh(host, f"systemctl stop {UNIT}; rm -f /etc/systemd/system/{UNIT} /usr/local/bin/ray {READY}*; systemctl daemon-reload; "
                        "systemctl reset-failed; true")
        fleet.reset([host])


def test_a_ray_nodes_actor_is_refused_with_the_command_and_nothing_is_done(fleet, ray_node):
    host, node = ray_node
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_kill_timeout": 2})
    assert run.rc != 0, run
    row = summary_row(summary_lines(run), host)
    assert summary_status(summary_lines(run), host) == "failed", row
    assert "Ray node" in row and f"(PID {node['pid']})" in row and "`ray stop" in row and "services as ray:" in row, row
    assert alive(fleet, host, [node["pid"], node["actor"], node["cpu"]]) == {node["pid"]: True, node["actor"]: True, node["cpu"]: True}
    assert fleet.gpu_memory(host)[0] >= 3000
    assert not run.result(RELEASE_TASK, host).get("killed")


def test_named_ray_the_actor_is_ended_and_the_node_stays(fleet, ray_node):
    host, node = ray_node
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_kill_timeout": 2, "free_gpus_services": ["ray:"]})
    assert run.rc == 0, run
    assert alive(fleet, host, [node["pid"], node["actor"], node["cpu"]]) == {node["pid"]: True, node["actor"]: False, node["cpu"]: True}
    assert fleet.gpu_memory(host)[0] == 0
    res = run.result(RELEASE_TASK, host)
    assert [o["kind"] for o in res["orchestrated"]] == ["ray"] and res["orchestrated"][0]["pids"] == [node["actor"]]


def test_a_users_process_posing_as_a_ray_node_makes_root_refuse_nothing(fleet):
    host = _host(fleet)
    fleet.reset([host])
    # uid 4242's `exec -a raylet` python, its child holding GPU 0: her process tree (uid 4242 by number,
    # setpriv: no account name that another test's user could already hold on this host).
    # The simulator's context registry is open to every user, as the real driver serves every user's contexts.
    setup = ("mkdir -p /run/nvidia-sim/contexts && chmod 1777 /run/nvidia-sim/contexts\n"
             f"cat > /usr/local/bin/fake-raylet <<'EOF'\n{FAKE_RAYLET}EOF\nchmod 0755 /usr/local/bin/fake-raylet\n"
             # From a login session, as she would (a system unit's main process would be root's word: systemd's MainPID).
             "setsid setpriv --reuid 4242 --regid 4242 --clear-groups -- /usr/local/bin/fake-raylet </dev/null >/dev/null 2>&1 & "
             "echo $! > /run/fake-raylet.pid")
    fleet.ssh(host, setup, check=True)
    try:
        assert wait_for(lambda: fleet.gpu_memory(host)[0] >= 1000, timeout=30), fleet.ssh(host, "ps -ef").stdout
        run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_kill_timeout": 2})
        assert run.rc == 0, summary_lines(run)
        assert run.result(RELEASE_TASK, host).get("orchestrated") == []
        assert fleet.gpu_memory(host)[0] == 0
    finally:
        # Her session's process group, by the PID this test started (setsid: the group is that PID's).
        fleet.ssh(host, "kill -KILL -- -$(cat /run/fake-raylet.pid); rm -f /run/fake-raylet.pid /usr/local/bin/fake-raylet; true")
        fleet.reset([host])
