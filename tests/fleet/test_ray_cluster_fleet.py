"""A real Ray cluster on two fleet hosts (issue 72): Ray from the Python package registry
(tests/fleet/requirements-ray.txt, installed here into .build/ray and bind-mounted read-only into
the hosts at /opt/ray), a head on one host and a worker on the other (`ray start --block` as
systemd units, so the identity rule vouches for the node through systemd's MainPID), joined on a
bridge in a network namespace this test makes (fleet.linked_hosts). A detached actor with
`max_restarts=-1` and one GPU on each host holds that host's GPU 0 through its child (the
simulator's gpu_holder); the actor exits when its child dies, as a training actor does when its CUDA
work is killed, and Ray's GCS starts it again.

- Without `ray:` free_gpus.yml on both hosts refuses each, naming the Ray node and `ray stop`:
  nothing is killed, both GPUs stay held, no host is reported free.
- With `ray:` each host's Ray node is stopped through its unit (the fixture runs `ray start --block`
  from a unit file, as an operator does): the actors end with their nodes and Ray has no node left
  to restart them on, so both hosts are freed and stay free; restore_gpus.yml starts both units
  again. On the code before this test, the actors' workers were killed, Ray started them again, and
  both hosts failed (never reported free, never freed either).

- With `ray:` and nodes root started by hand from a system directory (no unit runs them), the
  actors' GPU work is ended with a warning naming `ray stop`, Ray restarts it, no host is reported
  free while an actor holds its GPU, and the advice is Ray's own commands, not `kill <raylet>`.

The refusal passed on the code before this test too (built in the previous session); this is its
check against a real Ray. Two hosts
(`ZEROMIB_FLEET_HOSTS=2 pytest tests/fleet/test_ray_cluster_fleet.py`)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import fleet as rig
from scenarios import PLAYBOOK, summary_lines, summary_row, summary_status, unit_states, wait_for

RESTORE = "playbooks/restore_gpus.yml"

pytestmark = pytest.mark.usefixtures("fleet_baselines")

RAY_TREE = rig.REPO / ".build" / "ray"
PINS = rig.REPO / "tests" / "fleet" / "requirements-ray.txt"
ENV = "-E PYTHONPATH=/opt/ray -E RAY_USAGE_STATS_ENABLED=0 -E HOME=/root"
RAY = "/usr/bin/python3 /opt/ray/bin/ray start --block --num-gpus=1 --disable-usage-stats"
# Where root's own Ray install lives when a node is started by hand (a system directory, so the
# identity rule vouches for its raylet: root-owned, under /usr/lib/).
BY_HAND = "/usr/lib/zm-ray"
DRIVER = r'''
import json, os, subprocess, threading
import ray
ray.init(address="auto", namespace="zm", log_to_driver=False)

@ray.remote(num_gpus=1, max_restarts=-1)
class Trainer:
    def __init__(self):
        self.child = subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", "0", "--mib", "3000", "--name", "ray::Trainer"])
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        self.child.wait()
        os._exit(1)  # the actor dies with its GPU work; Ray starts it again (max_restarts)

    def where(self):
        return [ray.util.get_node_ip_address(), os.getpid(), self.child.pid]

actors = [Trainer.options(name=f"trainer{i}", lifetime="detached").remote() for i in range(2)]
print(json.dumps([ray.get(a.where.remote(), timeout=60) for a in actors]))
'''


def _install_ray() -> None:
    """The pinned Ray tree, once per checkout (about 9 s and 260 MB here)."""
    stamp = RAY_TREE / ".pins"
    if stamp.exists() and stamp.read_text() == PINS.read_text():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target", str(RAY_TREE),
                    "--upgrade", "-r", str(PINS)], check=True)
    stamp.write_text(PINS.read_text())


def _node_unit(fleet, host: str, unit: str, args: str) -> None:
    """A Ray node as an operator runs one: `ray start --block` as a unit file's ExecStart= (so
    systemd's MainPID vouches for it and `systemctl start` brings it back)."""
    env = "\n".join(f"Environment={kv}" for kv in ENV.replace("-E ", "").split())
    fleet.ssh(host, f"cat > /etc/systemd/system/{unit}.service <<'EOF'\n[Service]\nExecStart={RAY} {args}\n{env}\nEOF\n"
                    f"systemctl daemon-reload && systemctl start {unit}", check=True)


def _by_hand(fleet, host: str, args: str) -> None:
    """A Ray node root started by hand from a login shell (`ray start` daemonizes its raylet and
    returns): in the session's scope, no unit runs it."""
    fleet.ssh(host, f"cd /root && PYTHONPATH={BY_HAND} RAY_USAGE_STATS_ENABLED=0 HOME=/root "
                    f"{RAY.replace('/opt/ray', BY_HAND).replace(' --block', '')} {args} >/dev/null 2>&1 < /dev/null", check=True, timeout=120)


@pytest.fixture
def ray_cluster(fleet, request):
    by_hand = getattr(request, "param", "unit") == "by hand"
    where = BY_HAND if by_hand else "/opt/ray"
    plain = [h.name for h in fleet.hosts if h.idle_mib == 0 and h.gpu_count >= 1][:2]
    assert len(plain) == 2, "needs two hosts whose GPUs idle at 0 MiB"
    head, worker = plain
    fleet.reset(plain)
    _install_ray()
    for host in plain:
        rig.bind_ro_into(fleet.rig, host, RAY_TREE, where)
    started = time.monotonic()
    try:
        with rig.linked_hosts(fleet.rig, plain) as addrs:
            start = _by_hand if by_hand else (lambda fleet, host, args: _node_unit(fleet, host, "zm-ray-head" if host == head else "zm-ray-worker", args))
            start(fleet, head, f"--head --port=6379 --include-dashboard=false --node-ip-address={addrs[head]}")
            start(fleet, worker, f"--address={addrs[head]}:6379 --node-ip-address={addrs[worker]}")
            fleet.ssh(head, f"cat > /root/zm-driver.py <<'EOF'\n{DRIVER}EOF", check=True)
            placed = None
            for _attempt in range(30):  # the worker joins a few seconds after the head
                out = fleet.ssh(head, f"PYTHONPATH={where} RAY_USAGE_STATS_ENABLED=0 timeout 90 python3 /root/zm-driver.py 2>/dev/null | tail -1",
                                timeout=120).stdout.strip()
                if out.startswith("[["):
                    placed = json.loads(out)
                    break
                time.sleep(1)
            assert placed and sorted(p[0] for p in placed) == sorted(addrs.values()), placed
            assert wait_for(lambda: all(fleet.gpu_memory(h)[0] >= 3000 for h in plain), timeout=30)
            print(f"ray cluster up with an actor on each host in {time.monotonic() - started:.1f} s")
            yield head, worker
    finally:
        for host in plain:
            fleet.ssh(host, "systemctl stop zm-ray-head zm-ray-worker; systemctl reset-failed zm-ray-head zm-ray-worker; "
                            "rm -f /etc/systemd/system/zm-ray-head.service /etc/systemd/system/zm-ray-worker.service; systemctl daemon-reload; "
                            f"PYTHONPATH={BY_HAND} timeout 30 python3 {BY_HAND}/bin/ray stop --force >/dev/null 2>&1; "
                            f"rm -f /root/zm-driver.py; rm -rf /tmp/ray; umount {where}; rmdir {where}; true", timeout=90)
        fleet.reset(plain)


def test_without_ray_named_both_hosts_are_refused_naming_the_ray_node_and_nothing_is_done(fleet, ray_cluster):
    hosts = list(ray_cluster)
    run = fleet.ansible_playbook(PLAYBOOK, limit=hosts, extra_vars={"free_gpus_kill_timeout": 2})
    assert run.rc != 0, run
    lines = summary_lines(run)
    for host in hosts:
        row = summary_row(lines, host)
        assert summary_status(lines, host) == "failed", row
        assert "Ray node" in row and "`ray stop" in row and "free_gpus_services as ray:" in row, row
        assert fleet.gpu_memory(host)[0] >= 3000


def test_with_ray_named_both_nodes_are_stopped_through_systemd_the_fleet_is_freed_and_restore_starts_them(fleet, ray_cluster):
    """`ray:` stops each host's Ray node through the unit systemd says runs it: the actors' GPU work
    ends with the node and Ray has no node left to restart it on, so both hosts are freed and stay
    free; restore_gpus.yml starts both units again. (On the code before: the actors' workers were
    killed, Ray started them again, and both hosts failed.)"""
    head, worker = hosts = list(ray_cluster)
    run = fleet.ansible_playbook(PLAYBOOK, limit=hosts, extra_vars={"free_gpus_kill_timeout": 2, "free_gpus_services": ["ray:"]})
    lines = summary_lines(run)
    assert run.rc == 0, lines
    for host in hosts:
        assert summary_status(lines, host) == "freed", lines
    time.sleep(3)  # past any restart Ray would make
    assert all(fleet.gpu_memory(h)[0] == 0 for h in hosts), {h: fleet.gpu_memory(h) for h in hosts}
    # `ray start --block` exits 1 on systemd's SIGTERM: the unit reads failed, stopped all the same.
    assert unit_states(fleet, head, "zm-ray-head")["zm-ray-head"][0] in ("inactive", "failed")
    assert unit_states(fleet, worker, "zm-ray-worker")["zm-ray-worker"][0] in ("inactive", "failed")
    back = fleet.ansible_playbook(RESTORE, limit=hosts)
    assert back.rc == 0, back
    assert unit_states(fleet, head, "zm-ray-head")["zm-ray-head"][0] == "active"
    assert unit_states(fleet, worker, "zm-ray-worker")["zm-ray-worker"][0] == "active"


@pytest.mark.parametrize("ray_cluster", ["by hand"], indirect=True)
def test_with_ray_named_a_node_no_unit_runs_fails_where_ray_restarts_and_names_rays_own_commands(fleet, ray_cluster):
    """Root's Ray from a system directory, started by hand (no unit to stop): `ray:` ends the actors'
    GPU work, with a warning naming the node and `ray stop`; Ray restarts them, and the host is
    never reported free while an actor holds its GPU. The restart's advice is Ray's own commands
    (on the code before: `end pid <raylet> first (kill ...)`)."""
    hosts = list(ray_cluster)
    run = fleet.ansible_playbook(PLAYBOOK, limit=hosts, extra_vars={"free_gpus_kill_timeout": 2, "free_gpus_services": ["ray:"]})
    lines = summary_lines(run)
    time.sleep(3)  # past Ray's restart of the actors
    held = [h for h in hosts if fleet.gpu_memory(h)[0] >= 3000]
    assert held, "Ray restarts its actors (max_restarts=-1): some GPU is held again"
    assert run.rc != 0, lines
    for host in held:
        assert summary_status(lines, host) not in ("freed", "clean"), lines
    warned = [w for r in run.results() for w in ((r.get("result") or {}).get("warnings") or []) if "runs in no system unit" in str(w)]
    assert warned and "`ray stop`" in str(warned[0]), run.stderr[-3000:]
    assert "`ray stop` on this host" in run.stdout and "`ray job stop JOB_ID`" in run.stdout, run.stdout[-3000:]
    assert "first (kill" not in run.stdout, run.stdout[-3000:]
