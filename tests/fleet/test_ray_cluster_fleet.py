"""A real Ray cluster on two fleet hosts (issue 72): Ray from the Python package registry
(tests/fleet/requirements-ray.txt, installed here into .build/ray and bind-mounted read-only into
the hosts at /opt/ray), a head on one host and a worker on the other (`ray start --block` as
systemd units, so the identity rule vouches for the node through systemd's MainPID), joined on a
bridge in a network namespace this test makes (fleet.linked_hosts). A detached actor with
`max_restarts=-1` and one GPU on each host holds that host's GPU 0 through its child (the
simulator's gpu_holder); the actor exits when its child dies, as a training actor does when its CUDA
work is killed, and Ray's GCS starts it again. Beside each, a CPU actor with `max_restarts=-1`
(the bystander: an actor whose PID is no holder of a selected GPU).

- Without `ray:` free_gpus.yml on both hosts refuses each, naming each actor's own Ray command
  (`ray.kill(ray.get_actor(...), no_restart=True)`): nothing is killed, both GPUs stay held, no
  host is reported free.
- With `ray:` each host ends its GPU actor through Ray (the node's own Ray installation, the GCS's
  PID matched to the kernel's process) before any signal: both hosts are freed, the fleet-wide
  proof passes, the actors stay dead, the bystanders live on untouched. On the code before, the
  actors' work was killed, Ray started it again, and both hosts failed.
- With `ray:` and the head unreachable from the worker, the worker's run fails within its bound
  naming Ray's GCS, and its GPU is not reported free.

Two hosts (`ZEROMIB_FLEET_HOSTS=2 pytest tests/fleet/test_ray_cluster_fleet.py`)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import pytest

import fleet as rig
from scenarios import PLAYBOOK, RELEASE_TASK, TRAINING, fatal_line, host_message, summary_lines, summary_row, summary_status, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

# The oldest ansible-core the collection supports and the newest.
ENDS = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
IDS = [f"ansible-core-{c}" for c, _p in ENDS]
REFUSED = "GPUs are held by work a cluster runtime starts again, here or on another node, when its processes are killed: Ray node "

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

@ray.remote(num_cpus=0.1, max_restarts=-1)
class Bystander:
    def where(self):
        return [ray.util.get_node_ip_address(), os.getpid()]

actors = [Trainer.options(name=f"trainer{i}", lifetime="detached", get_if_exists=True).remote() for i in range(2)]
placed = [ray.get(a.where.remote(), timeout=60) for a in actors]
# One bystander on each node, pinned there by the node's own resource.
others = [Bystander.options(name=f"bystander{i}", lifetime="detached", resources={f"node:{ip}": 0.01}, get_if_exists=True).remote()
          for i, (ip, _pid, _child) in enumerate(placed)]
print(json.dumps([p + ray.get(b.where.remote(), timeout=60)[1:] for p, b in zip(placed, others)]))
'''
# The GCS's word on the test's actors, from the head: {name: [state, pid, num_restarts]}.
STATES = r'''
import json, ray
ray.init(address="auto", namespace="zm", log_to_driver=False)
import ray._private.state as s
print(json.dumps({a["Name"]: [a["State"], a["Pid"], a["NumRestarts"]] for a in s.actors().values() if a["Name"]}))
'''


def actor_states(fleet, head: str) -> dict[str, list]:
    fleet.ssh(head, f"cat > /root/zm-states.py <<'EOF'\n{STATES}EOF", check=True)
    out = fleet.ssh(head, "PYTHONPATH=/opt/ray RAY_USAGE_STATS_ENABLED=0 timeout 90 python3 /root/zm-states.py 2>/dev/null",
                    timeout=120).stdout
    return json.loads(_json_line(out))


def _json_line(out: str) -> str:
    """The script's one JSON line among what Ray's driver prints beside it (a raylet's notes)."""
    return [line for line in out.splitlines() if line.startswith(("{", "["))][-1]


def _install_ray() -> None:
    """The pinned Ray tree, once per checkout (about 9 s and 260 MB here)."""
    stamp = RAY_TREE / ".pins"
    if stamp.exists() and stamp.read_text() == PINS.read_text():
        return
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--target", str(RAY_TREE),
                    "--upgrade", "-r", str(PINS)], check=True)
    stamp.write_text(PINS.read_text())


class Cluster(t.NamedTuple):
    head: str
    worker: str
    addrs: dict
    # {host: {"actor": the GPU actor's PID, "child": its GPU holder's, "bystander": the CPU actor's}}
    pids: dict

    @property
    def hosts(self) -> list[str]:
        return [self.head, self.worker]


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
            by_ip = {p[0]: p for p in placed}
            yield Cluster(head, worker, addrs, {h: {"actor": by_ip[addrs[h]][1], "child": by_ip[addrs[h]][2], "bystander": by_ip[addrs[h]][3]}
                                                for h in plain})
    finally:
        for host in plain:
            fleet.ssh(host, "systemctl stop zm-ray-head zm-ray-worker; systemctl reset-failed zm-ray-head zm-ray-worker; "
                            "rm -f /root/zm-driver.py /root/zm-states.py; rm -rf /tmp/ray; umount /opt/ray; rmdir /opt/ray; true", timeout=60)
        fleet.reset(plain)


def test_without_ray_named_both_hosts_are_refused_naming_each_actors_ray_command_and_nothing_is_done(fleet, ray_cluster):
    hosts = ray_cluster.hosts
    run = fleet.ansible_playbook(PLAYBOOK, limit=hosts, extra_vars={"free_gpus_kill_timeout": 2})
    assert run.rc != 0, run
    lines = summary_lines(run)
    for host in hosts:
        row = summary_row(lines, host)
        assert summary_status(lines, host) == "failed", row
        assert "Ray node" in row and "free_gpus_services as ray:" in row, row
        # The exact command for the actor on this host (Ray's GCS asked, read only), and `ray stop` for the node.
        actor = [a for a in ("trainer0", "trainer1") if f"ray.get_actor('{a}', namespace='zm')" in row]
        assert len(actor) == 1 and "no_restart=True)" in row and f"PID {ray_cluster.pids[host]['actor']}" in row, row
        assert "`ray stop` on this node" in row, row
        assert fleet.gpu_memory(host)[0] >= 3000
    assert {name: state[0] for name, state in actor_states(fleet, ray_cluster.head).items()} == {
        "trainer0": "ALIVE", "trainer1": "ALIVE", "bystander0": "ALIVE", "bystander1": "ALIVE"}


def test_with_ray_named_the_actors_are_ended_through_ray_both_hosts_are_freed_and_stay_free(fleet, ray_cluster):
    """The attack is Ray's own: an actor with max_restarts killed from outside comes back. Ended
    through Ray (no_restart), it stays dead; the bystander actors (no holder) are never touched."""
    hosts = ray_cluster.hosts
    check = fleet.ansible_playbook(PLAYBOOK, limit=hosts, check=True, extra_vars={"free_gpus_kill_timeout": 2, "free_gpus_services": ["ray:"]})
    assert check.rc == 0, check.stdout[-4000:]
    for host in hosts:
        # The dry run asks Ray's GCS (read only) and says what the real run ends through Ray; nothing is ended.
        said = check.result(RELEASE_TASK, host)["ansible_facts"]["free_gpus_result"]["message"]
        assert "would end Ray actor trainer" in said, said
        assert fleet.gpu_memory(host)[0] >= 3000
    run = fleet.ansible_playbook(PLAYBOOK, limit=hosts, extra_vars={"free_gpus_kill_timeout": 2, "free_gpus_services": ["ray:"]})
    lines = summary_lines(run)
    assert run.rc == 0, (lines, run.stdout[-4000:])
    for host in hosts:
        assert summary_status(lines, host) == "freed", lines
        # The host's first sentence (free_gpus_result.message) says what was ended through Ray.
        said = run.result(RELEASE_TASK, host)["ansible_facts"]["free_gpus_result"]["message"]
        assert "ended Ray actor trainer" in said and "through Ray (no_restart)" in said, said
    assert any("fleet-wide proof" in line for line in lines), lines
    ended = {h: run.result(RELEASE_TASK, h).get("ray_actors") for h in hosts}
    assert {h: [(a["pid"], a["ended"], a["max_restarts"]) for a in actors] for h, actors in ended.items()} == {
        h: [(ray_cluster.pids[h]["actor"], True, -1)] for h in hosts}, ended
    time.sleep(5)  # well past Ray's restart of an actor killed from outside (about 1 s)
    assert all(fleet.gpu_memory(h)[0] == 0 for h in hosts), {h: fleet.gpu_memory(h) for h in hosts}
    states = actor_states(fleet, ray_cluster.head)
    assert states["trainer0"][0] == "DEAD" and states["trainer1"][0] == "DEAD", states
    # The bystanders: alive, never restarted, the same processes.
    assert sorted((states[b][0], states[b][2]) for b in ("bystander0", "bystander1")) == [("ALIVE", 0), ("ALIVE", 0)], states
    assert sorted(states[b][1] for b in ("bystander0", "bystander1")) == sorted(ray_cluster.pids[h]["bystander"] for h in hosts)


def test_with_ray_named_and_the_head_unreachable_the_worker_fails_naming_rays_gcs_and_is_not_reported_free(fleet, ray_cluster):
    worker = ray_cluster.worker
    # The head's end of the cluster's link, from this machine (the host has no CAP_NET_ADMIN of its own).
    head_link = ["ip", "-n", fleet.rig.host(ray_cluster.head)["netns"], "link", "set", "ray0"]
    rig.run(head_link + ["down"])
    try:
        started = time.monotonic()
        run = fleet.ansible_playbook(PLAYBOOK, limit=worker, extra_vars={"free_gpus_kill_timeout": 2, "free_gpus_services": ["ray:"]})
        took = time.monotonic() - started
    finally:
        rig.run(head_link + ["up"])
    lines = summary_lines(run)
    print(f"the worker's run with the head unreachable took {took:.1f} s: {summary_row(lines, worker)}")
    assert run.rc != 0, lines
    row = summary_row(lines, worker)
    assert summary_status(lines, worker) == "failed", row
    assert f"Ray's GCS at {ray_cluster.addrs[ray_cluster.head]}:6379" in row, row
    assert took < 150, took
    # Nothing was signalled: the actor's GPU work is where it was.
    assert fleet.gpu_memory(worker)[0] >= 3000


@pytest.mark.parametrize(("core", "python"), ENDS, ids=IDS)
def test_the_first_line_of_each_ray_failure_on_both_paths(fleet, ray_cluster, core, python):
    """What a user reads first, through free_gpus.yml and the role in their own play, on the
    oldest and newest ansible-core: the refusal with the actor's own command, and, with `ray:`
    and the head unreachable, the failure that names Ray's GCS."""
    head, worker = ray_cluster.head, ray_cluster.worker
    bin_dir = matrix.controller_bin(core, python)
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}

    def play(playbook, hosts, **extra):
        return fleet.ansible_playbook(playbook, limit=hosts, bin_dir=bin_dir, env=env,
                                      extra_vars={"free_gpus_kill_timeout": 2, "training_command": "true", **extra})

    kill = "ray.kill(ray.get_actor('trainer"
    run = play(PLAYBOOK, [head])
    said = host_message(run, head)
    assert run.rc == 2 and said.startswith(REFUSED) and kill in said and f"PID {ray_cluster.pids[head]['actor']}" in said, said
    own = play(TRAINING, [head])
    line = fatal_line(own, head)
    assert own.rc == 2 and f'"msg": "{head}: {REFUSED}' in line and kill in line, line
    # (the interpreter as the kernel resolves the raylet's: /usr/bin/python3 -> python3.11 on Debian 12)
    gcs = f"Ray's GCS at {ray_cluster.addrs[head]}:6379 (asked with /usr/bin/python3"
    head_link = ["ip", "-n", fleet.rig.host(head)["netns"], "link", "set", "ray0"]
    rig.run(head_link + ["down"])
    try:
        run = play(PLAYBOOK, [worker], free_gpus_services=["ray:"])
        own = play(TRAINING, [worker], free_gpus_services=["ray:"])
    finally:
        rig.run(head_link + ["up"])
    said = host_message(run, worker)
    assert run.rc == 2 and said.startswith(gcs) and " and the Ray of /opt/ray): " in said and "nothing was done" in said, said
    line = fatal_line(own, worker)
    assert own.rc == 2 and f'"msg": "{worker}: {gcs}' in line, line
    assert fleet.gpu_memory(worker)[0] >= 3000 and fleet.gpu_memory(head)[0] >= 3000


# A user's own Ray on the head host: her uid, her temp dir, her actor (max_restarts=-1) on GPU 1.
USER, UID = "zmray", 4242
USER_DRIVER = r'''
import json, os, subprocess, threading
import ray
ray.init(address="127.0.0.1:6390", namespace="hers", log_to_driver=False)

@ray.remote(num_gpus=1, max_restarts=-1)
class Mine:
    def __init__(self):
        # Her Ray gives her actor its GPU 0 (CUDA_VISIBLE_DEVICES=0); the host's GPU 1 is what she takes.
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        self.child = subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", "1", "--mib", "1000", "--name", "ray::Mine"], env=env)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        self.child.wait()
        os._exit(1)

    def where(self):
        return [os.getpid(), self.child.pid]

mine = Mine.options(name="mine", lifetime="detached", get_if_exists=True).remote()
print(json.dumps(ray.get(mine.where.remote(), timeout=60)))
'''
USER_STATE = r'''
import json, ray
ray.init(address="127.0.0.1:6390", namespace="hers", log_to_driver=False)
import ray._private.state as s
print(json.dumps([[a["State"], a["Pid"], a["NumRestarts"]] for a in s.actors().values() if a["Name"] == "mine"]))
'''


def _as_user(fleet, host: str, cmd: str, timeout: float = 120):
    return fleet.ssh(host, f"cd /home/{USER} && runuser -u {USER} -- env HOME=/home/{USER} PYTHONPATH=/opt/ray RAY_USAGE_STATS_ENABLED=0 {cmd}",
                     timeout=timeout)


def test_a_users_own_ray_is_hers_ray_is_not_asked_about_her_actor_and_roots_actor_is_ended_through_ray(fleet, ray_cluster):
    """The attacker: her Ray (her uid, run from her own shell) with an actor Ray restarts. It is no
    vouched node: her actor's GPU work is an ordinary holder, and root's run never calls Ray for it
    (her GCS never hears a kill: her actor is restarted, as her Ray does). Root's node's actor on the
    same host is ended through Ray in the same run."""
    head = ray_cluster.head
    fleet.ssh(head, f"useradd -u {UID} -m -s /bin/bash {USER} && cat > /home/{USER}/driver.py <<'EOF'\n{USER_DRIVER}EOF\n"
                    f"cat > /home/{USER}/state.py <<'EOF'\n{USER_STATE}EOF\nchown -R {USER} /home/{USER}\n"
                    # The simulator's context registry, open to a user's CUDA work as the real driver is.
                    "mkdir -p /run/nvidia-sim/contexts && chmod 1777 /run/nvidia-sim/contexts", check=True)
    try:
        started = _as_user(fleet, head, f"timeout 120 python3 /opt/ray/bin/ray start --head --port=6390 --num-gpus=1 --include-dashboard=false "
                                        f"--node-ip-address=127.0.0.1 --temp-dir=/home/{USER}/ray-tmp --disable-usage-stats")
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        out = _as_user(fleet, head, "timeout 90 python3 driver.py 2>/dev/null").stdout
        her_actor, her_child = json.loads(_json_line(out))
        assert wait_for(lambda: fleet.gpu_memory(head)[1] >= 1000, timeout=30), fleet.gpu_memory(head)
        run = fleet.ansible_playbook(PLAYBOOK, limit=[head], extra_vars={"free_gpus_kill_timeout": 2, "free_gpus_services": ["ray:"]})
        result = run.result(RELEASE_TASK, head)
        # Root's node's actor (GPU 0) through Ray; hers is no Ray node's: no entry, no actor, her holder signalled as any.
        assert [a["pid"] for a in result.get("ray_actors") or []] == [ray_cluster.pids[head]["actor"]], result.get("ray_actors")
        assert [o["name"] for o in result.get("orchestrated") or []] and all(her_child not in o["pids"] for o in result["orchestrated"])
        assert her_child in [k["pid"] for k in result.get("killed") or []], result.get("killed")
        time.sleep(3)
        [[state, _pid, restarts]] = json.loads(_json_line(_as_user(fleet, head, "timeout 90 python3 state.py 2>/dev/null").stdout))
        # Her Ray restarted her actor (no ray.kill(no_restart) ever reached her GCS); the host is never reported free while it holds GPU 1.
        assert state in ("ALIVE", "RESTARTING") and restarts >= 1, (state, restarts)
        if fleet.gpu_memory(head)[1] >= 1000:
            assert summary_status(summary_lines(run), head) not in ("freed", "clean"), summary_lines(run)
        assert her_actor
    finally:
        _as_user(fleet, head, "timeout 60 python3 /opt/ray/bin/ray stop --force >/dev/null 2>&1", timeout=90)
        # Whatever of hers is left (the test started all of it), by PID, inside the test host.
        fleet.ssh(head, f"for pid in $(ps -u {USER} -o pid=); do kill -KILL $pid; done; sleep 0.5; userdel -r {USER} >/dev/null 2>&1; true",
                  timeout=60)
