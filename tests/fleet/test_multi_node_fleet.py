"""A rank of a multi-node torchrun on a real systemd host (issue 72): its peers are on another
node, so when this node's rank is killed the survivors hang in a collective holding their GPUs.

The "other node" is a network namespace this test makes on this machine (a veth pair into the host's
own namespace, a listener
playing torchrun's c10d rendezvous store on 192.168.77.2:29500): the agent's TCP connection to it is
what the kernel's tables show, as for a store on another host. The agent and its rank are a user's
session processes (uid 4242 by number, `setsid setpriv`: no account another test could share), their command line hers.

- Connected to the peer, the rank is ended and the host's first sentence names the job
  (`ranks of multi-node /usr/bin/python3 /usr/local/bin/torchrun --nnodes 2 ... (PID N, connected to
  192.168.77.2:29500)`), as the result's `multi_node` and the fleet summary do.
- Attacker: the same command line with no peer (a one-node `--nnodes 2`, her word alone): the rank is
  ended and nothing names a multi-node job. Seen on the code before this test: named from the
  command line alone.

One host (`ZEROMIB_FLEET_HOSTS=1 pytest tests/fleet/test_multi_node_fleet.py`)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from scenarios import PLAYBOOK, RELEASE_TASK, summary_lines, summary_row, wait_for

pytestmark = pytest.mark.usefixtures("fleet_baselines")

VERDICT_TASK = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
PEER = "192.168.77.2"
# The agent: connects to the store (when one is given), starts its rank on GPU 0, waits.
AGENT = r'''#!/usr/bin/python3
import os, socket, subprocess, sys, time
store = os.environ.get("STORE")
conn = socket.create_connection((store, 29500), timeout=10) if store else None
rank = subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", "0", "--mib", "2000", "--name", "train.py"])
while True:
    time.sleep(3600)
'''
LISTENER = ("import socket, time\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('{PEER}', 29500)); s.listen(8)\nkept = []\nwhile True:\n    kept.append(s.accept())\n")
AGENT_ARGS = "--nnodes 2 --nproc-per-node 1 train.py"
TEARDOWN = "kill -KILL -- -$(cat /run/zm-agent.pid) 2>/dev/null; rm -f /run/zm-agent.pid /usr/local/bin/torchrun; true"


@contextlib.contextmanager
def peer_node(fleet, host: str):
    """The other node: a network namespace this test makes on this machine (the host itself may
    not add links), a veth pair from it into HOST's own namespace, and a listener in it playing
    the rendezvous store. This machine's own namespace and routes are never touched."""
    netns = fleet.rig.host(host)["netns"]
    peer = f"zmpeer{os.getpid() % 100000}"
    listener = None
    try:
        subprocess.run(["ip", "netns", "add", peer], check=True)
        subprocess.run(["ip", "-n", peer, "link", "add", "zmp1", "type", "veth", "peer", "name", "zmp0", "netns", netns], check=True)
        subprocess.run(["ip", "-n", peer, "addr", "add", f"{PEER}/30", "dev", "zmp1"], check=True)
        subprocess.run(["ip", "-n", peer, "link", "set", "zmp1", "up"], check=True)
        subprocess.run(["ip", "-n", netns, "addr", "add", "192.168.77.1/30", "dev", "zmp0"], check=True)
        subprocess.run(["ip", "-n", netns, "link", "set", "zmp0", "up"], check=True)
        listener = subprocess.Popen(["ip", "netns", "exec", peer, sys.executable, "-c", LISTENER], stdin=subprocess.DEVNULL)
        assert wait_for(lambda: fleet.ssh(host, f"timeout 1 bash -c '</dev/tcp/{PEER}/29500'").returncode == 0, timeout=20), "no store"
        yield
    finally:
        if listener is not None:
            listener.kill()
            listener.wait(timeout=10)
        subprocess.run(["ip", "netns", "del", peer], check=False)  # its end of the veth pair goes with it, and the host's end


def _host(fleet) -> str:
    return next(h.name for h in fleet.hosts if h.idle_mib == 0 and h.gpu_count >= 1)


@pytest.fixture
def torchrun(fleet):
    host = _host(fleet)
    fleet.reset([host])
    # uid 4242 by number (setpriv), no account: no name another test's user could already hold on this host.
    fleet.ssh(host, "mkdir -p /run/nvidia-sim/contexts && chmod 1777 /run/nvidia-sim/contexts\n"
                    f"cat > /usr/local/bin/torchrun <<'EOF'\n{AGENT}EOF\nchmod 0755 /usr/local/bin/torchrun", check=True)

    def start(store: str | None) -> int:
        """Starts the agent as uid 4242 in a session of its own; returns its PID once its rank holds GPU 0."""
        env = f"STORE={store} " if store else ""
        fleet.ssh(host, f"setsid setpriv --reuid 4242 --regid 4242 --clear-groups -- env {env}/usr/local/bin/torchrun --nnodes 2 "
                        "--nproc-per-node 1 train.py </dev/null >/dev/null 2>&1 & echo $! > /run/zm-agent.pid", check=True)
        assert wait_for(lambda: fleet.gpu_memory(host)[0] >= 2000, timeout=30), fleet.ssh(host, "ps -ef").stdout
        agent = fleet.ssh(host, f"pgrep -u 4242 -f -- {AGENT_ARGS!r}", check=True).stdout.split()
        assert len(agent) == 1, (agent, fleet.ssh(host, "ps -ef").stdout)
        return int(agent[0])
    try:
        yield host, start
    finally:
        fleet.ssh(host, TEARDOWN)
        fleet.reset([host])


def test_a_rank_whose_agent_is_connected_to_another_node_is_named_in_the_first_sentence(fleet, torchrun):
    host, start = torchrun
    with peer_node(fleet, host):
        agent = start(PEER)
        run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_kill_timeout": 2})
    assert run.rc == 0, summary_lines(run)
    job = f"/usr/local/bin/torchrun {AGENT_ARGS} (PID {agent}, connected to {PEER}:29500)"
    [rank] = run.result(RELEASE_TASK, host)["multi_node"]
    assert rank["launcher"].endswith(job), (rank, agent)
    # Only the rank was the run's: the agent, which holds no GPU, is never signalled.
    assert fleet.ssh(host, f"kill -0 {agent}").returncode == 0, fleet.ssh(host, "ps -ef").stdout
    first = run.result(VERDICT_TASK, host)["msg"].split(". ")[0]
    said = f"ranks of multi-node {rank['launcher']} (their ranks on the other nodes hang in a collective until freed)"
    assert first.startswith(f"{host}: 8 GPUs free (") and f"killed 1 process, {said} in " in first, first
    assert f"multi-node: {rank['launcher']}" in summary_row(summary_lines(run), host)
    assert fleet.gpu_memory(host)[0] == 0


def test_the_same_command_line_without_a_peer_names_no_multi_node_job(fleet, torchrun):
    host, start = torchrun
    start(None)
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_kill_timeout": 2})
    assert run.rc == 0, summary_lines(run)
    assert run.result(RELEASE_TASK, host)["multi_node"] == []
    assert "multi-node" not in run.result(VERDICT_TASK, host)["msg"] and "multi-node" not in " ".join(summary_lines(run))
    assert fleet.gpu_memory(host)[0] == 0
