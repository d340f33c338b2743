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
- With `ray:` the actors' GPU work is ended, Ray restarts them, and the run never reports a host
  free while an actor holds its GPU: each host whose GPU reads held afterwards failed.

Both cases pass on the code before this test too (the refusal and the settle window were built in
the previous session); this is their check against a real Ray. Two hosts
(`ZEROMIB_FLEET_HOSTS=2 pytest tests/fleet/test_ray_cluster_fleet.py`)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import fleet as rig
from scenarios import PLAYBOOK, summary_lines, summary_row, summary_status, wait_for

pytestmark = pytest.mark.usefixtures("fleet_baselines")

RAY_TREE = rig.REPO / ".build" / "ray"
PINS = rig.REPO / "tests" / "fleet" / "requirements-ray.txt"
ENV = "-E PYTHONPATH=/opt/ray -E RAY_USAGE_STATS_ENABLED=0 -E HOME=/root"
RAY = "/usr/bin/python3 /opt/ray/bin/ray start --block --num-gpus=1 --disable-usage-stats"
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


@pytest.fixture
def ray_cluster(fleet):
    plain = [h.name for h in fleet.hosts if h.idle_mib == 0 and h.gpu_count >= 1][:2]
    assert len(plain) == 2, "needs two hosts whose GPUs idle at 0 MiB"
    head, worker = plain
    fleet.reset(plain)
    _install_ray()
    for host in plain:
        rig.bind_ro_into(fleet.rig, host, RAY_TREE, "/opt/ray")
    started = time.monotonic()
    try:
        with rig.linked_hosts(fleet.rig, plain) as addrs:
            fleet.ssh(head, f"systemd-run --unit zm-ray-head {ENV} {RAY} --head --port=6379 --include-dashboard=false "
                            f"--node-ip-address={addrs[head]}", check=True)
            fleet.ssh(worker, f"systemd-run --unit zm-ray-worker {ENV} {RAY} --address={addrs[head]}:6379 "
                              f"--node-ip-address={addrs[worker]}", check=True)
            fleet.ssh(head, f"cat > /root/zm-driver.py <<'EOF'\n{DRIVER}EOF", check=True)
            placed = None
            for _attempt in range(30):  # the worker joins a few seconds after the head
                out = fleet.ssh(head, "PYTHONPATH=/opt/ray RAY_USAGE_STATS_ENABLED=0 timeout 90 python3 /root/zm-driver.py 2>/dev/null | tail -1",
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
                            "rm -f /root/zm-driver.py; rm -rf /tmp/ray; umount /opt/ray; rmdir /opt/ray; true", timeout=60)
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


def test_with_ray_named_no_host_is_reported_free_while_an_actor_holds_its_gpu(fleet, ray_cluster):
    hosts = list(ray_cluster)
    run = fleet.ansible_playbook(PLAYBOOK, limit=hosts, extra_vars={"free_gpus_kill_timeout": 2, "free_gpus_services": ["ray:"]})
    lines = summary_lines(run)
    time.sleep(3)  # past Ray's restart of the actors
    held = [h for h in hosts if fleet.gpu_memory(h)[0] >= 3000]
    assert held, "Ray restarts its actors (max_restarts=-1): some GPU is held again"
    assert run.rc != 0, lines
    for host in held:
        assert summary_status(lines, host) not in ("freed", "clean"), lines
    assert any("raylet" in summary_row(lines, h) for h in hosts), lines
