"""Ray's actors that its GCS would restart, ended through Ray (_act/_ray, issue 72), on a fake /proc
written as the kernel writes it for the fleet's real Ray node (`ray start --block` as a unit's
main process, its raylet, a worker, the worker's GPU child: tests/fleet/test_ray_cluster_fleet.py).
The attackers: a GCS answer whose PID is not the holder's worker (another actor, a PID reused
since), a raylet-named copy that is not the node's child, an installation a user can write, and a
client that hangs or fails (never a hang of the run, always a message naming Ray)."""
from __future__ import annotations

import json
import os
import stat
import sys
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _orchestrators as orch
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ray
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fakeproc import write_process

RAYLET = "/opt/ray/ray/core/src/ray/raylet/raylet"
# The raylet's own argv as `ray start` wrote it on the fleet's worker node (shortened).
RAYLET_ARGV = (RAYLET, "--node_id=b99b49e3", "--node_ip_address=172.31.77.2",
               "--python_worker_command=/usr/bin/python3 /opt/ray/ray/_private/workers/setup_worker.py --node-ip-address=172.31.77.2",
               "--gcs-address=172.31.77.1:6379", "--session-name=s")
GCS_ACTOR = {"id": "a1", "name": "trainer1", "namespace": "zm", "pid": 139, "class_name": "Trainer", "max_restarts": -1, "num_restarts": 0,
             "detached": True, "job_id": "01000000", "submission_id": ""}


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    write_process(root, 57, comm="ray", argv=("/usr/bin/python3", "/opt/ray/bin/ray", "start", "--block"), exe="/usr/bin/python3")
    write_process(root, 71, comm="raylet", ppid=57, argv=RAYLET_ARGV, exe=RAYLET)
    write_process(root, 139, comm="ray::Trainer", ppid=71, argv=("ray::Trainer",), start_time=2000)
    write_process(root, 164, comm="gpu_holder", ppid=139, argv=("ray::Trainer", "/usr/local/bin/gpu_holder"), start_time=2100)
    return root


def _read(proc):
    return lambda pid: _holders.read_process(pid, str(proc))


def _root_only(path):
    return os.stat_result((stat.S_IFDIR | 0o755, 0, 0, 0, 0, 0, 0, 0, 0, 0))


def test_the_node_is_asked_with_what_its_own_raylet_says(proc):
    node = _ray.node_for(164, _read(proc)(57), str(proc), _read(proc), realpath=lambda p: p, lstat=_root_only)
    assert node == {"node_pid": 57, "raylet_pid": 71, "gcs": "172.31.77.1:6379", "node_id": "b99b49e3", "node_ip": "172.31.77.2",
                    "python": "/usr/bin/python3", "packages": "/opt/ray"}
    assert _ray.worker_of(164, 71, str(proc), _read(proc))["pid"] == 139


def test_a_raylet_copy_that_is_not_the_nodes_child_runs_no_ray_call(proc):
    # A user's copy of Ray's raylet (her uid) that runs her worker: under the node's session by name only.
    write_process(proc, 300, comm="raylet", ppid=1, argv=RAYLET_ARGV, exe=RAYLET, uid=4242)
    write_process(proc, 301, comm="ray::Mine", ppid=300, uid=4242)
    write_process(proc, 302, comm="gpu_holder", ppid=301, uid=4242)
    assert _ray.node_for(302, _read(proc)(57), str(proc), _read(proc), realpath=lambda p: p, lstat=_root_only) is None
    # A node with no raylet below it (a `ray start` stand-in that runs its workers itself) restarts nothing through a GCS.
    write_process(proc, 400, comm="gpu_holder", ppid=57)
    assert _ray.node_for(400, _read(proc)(57), str(proc), _read(proc), realpath=lambda p: p, lstat=_root_only) is None


def test_an_installation_a_user_can_write_is_never_run(proc):
    def users_dir(path):
        return os.stat_result((stat.S_IFDIR | 0o755, 0, 0, 0, 4242 if path == "/opt/ray" else 0, 0, 0, 0, 0, 0))

    with pytest.raises(_ray.RayUnavailable, match=r"not root's alone \(/opt/ray is owned by uid 4242\)"):
        _ray.node_for(164, _read(proc)(57), str(proc), _read(proc), realpath=lambda p: p, lstat=users_dir)

    def group_writable(path):
        return os.stat_result((stat.S_IFDIR | (0o775 if path == "/opt" else 0o755), 0, 0, 0, 0, 0, 0, 0, 0, 0))

    with pytest.raises(_ray.RayUnavailable, match="/opt is writable by others than root"):
        _ray.node_for(164, _read(proc)(57), str(proc), _read(proc), realpath=lambda p: p, lstat=group_writable)


def test_a_raylet_that_names_no_gcs_is_a_clear_failure(proc):
    write_process(proc, 71, comm="raylet", ppid=57, argv=(RAYLET, "--node_id=b99b49e3"), exe=RAYLET)
    with pytest.raises(_ray.RayUnavailable, match="names no GCS address"):
        _ray.node_for(164, _read(proc)(57), str(proc), _read(proc), realpath=lambda p: p, lstat=_root_only)


def test_an_actor_is_the_holders_only_where_the_gcs_pid_and_the_kernels_process_agree():
    workers = {139: {"pid": 139, "start_time": 2000, "holders": [164]}}
    bystander = dict(GCS_ACTOR, id="b1", name="bystander1", pid=167)
    [found] = _ray.match(workers, [GCS_ACTOR, bystander], lambda pid: 2000)
    assert found["id"] == "a1" and found["holders"] == [164]
    # PID 139 reused since the look (another start time): the GCS's word names another process.
    assert _ray.match(workers, [GCS_ACTOR], lambda pid: 2500) == []
    assert _ray.match(workers, [GCS_ACTOR], lambda pid: None) == []


@pytest.mark.parametrize("most, done, again", [(-1, 7, True), (3, 2, True), (3, 3, False), (0, 0, False)])
def test_restartable_is_what_the_gcs_would_start_again(most, done, again):
    assert _ray.restartable({"max_restarts": most, "num_restarts": done}) is again


def test_the_command_is_rays_own_for_each_actor():
    assert _ray.command(GCS_ACTOR) == "ray.kill(ray.get_actor('trainer1', namespace='zm'), no_restart=True)"
    assert _ray.command(dict(GCS_ACTOR, name="", detached=False, submission_id="raysubmit_9")) == "ray job stop raysubmit_9"
    assert "in job 01000000" in _ray.command(dict(GCS_ACTOR, name="", detached=False))
    # A detached actor outlives its job: stopping the job would leave it running.
    assert _ray.command(dict(GCS_ACTOR, name="", submission_id="raysubmit_9")).startswith("ray.kill(<its handle>, no_restart=True) from a program")


def _interpreter(tmp_path, body):
    path = tmp_path / "python"
    path.write_text(f"#!{sys.executable}\n{body}\n")
    path.chmod(0o755)
    return {"node_pid": 57, "raylet_pid": 71, "gcs": "10.0.0.1:6379", "node_id": "n", "node_ip": "10.0.0.2", "python": str(path),
            "packages": "/opt/ray"}


def test_the_client_runs_isolated_in_a_clean_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/home/alice/evil")
    monkeypatch.setenv("RAY_ADDRESS", "alice:1")
    node = _interpreter(tmp_path, "import json, os, sys; print(json.dumps({'args': sys.argv[1:], 'env': dict(os.environ), 'cwd': os.getcwd()}))")
    said = _ray.ask(node, {"do": "list"})
    assert said["args"] == ["-I", "-c", _ray.CLIENT, "/opt/ray", '{"do": "list"}']
    assert "PYTHONPATH" not in said["env"] and "RAY_ADDRESS" not in said["env"] and said["cwd"] == "/"


def test_a_client_that_hangs_is_killed_within_its_bound_and_named(tmp_path):
    helper = tmp_path / "helper.pid"
    node = _interpreter(tmp_path, f"import os, time\nchild = os.fork()\nif child == 0:\n    time.sleep(60)\n"
                                  f"open({str(helper)!r}, 'w').write(str(child))\ntime.sleep(60)")
    with pytest.raises(_ray.RayUnavailable, match=r"Ray's GCS at 10.0.0.1:6379 .*no answer within 1 s"):
        _ray.ask(node, {"do": "list"}, timeout=1)
    # What the client started went with it (its session's group): nothing of it is left running.
    left = int(helper.read_text())
    assert wait_gone(left), left


def wait_gone(pid, timeout=2.0):
    """PID ended (gone, or a zombie its new parent has yet to reap)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid:d}/stat") as handle:
                if handle.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def test_a_client_that_fails_says_its_last_word(tmp_path):
    node = _interpreter(tmp_path, "import sys; sys.stderr.write('Traceback\\nModuleNotFoundError: No module named ray\\n'); sys.exit(1)")
    with pytest.raises(_ray.RayUnavailable, match=r"the Ray client failed \(exit 1\): ModuleNotFoundError: No module named ray"):
        _ray.ask(node, {"do": "list"})
    node = _interpreter(tmp_path, "print('not json')")
    with pytest.raises(_ray.RayUnavailable, match="answer is not one"):
        _ray.ask(node, {"do": "list"})


def test_a_line_break_other_than_a_line_feed_in_the_clients_words_cuts_no_line(tmp_path):
    """An error naming an actor whose name holds U+2028 or a form feed: the last line is the
    whole error, not the name's tail (splitlines would cut at both; the message then folds every
    space into one)."""
    node = _interpreter(tmp_path, "import sys; sys.stderr.write('Traceback\\nValueError: actor tr\\u2028ainer\\x0cX not found\\n'); sys.exit(1)")
    with pytest.raises(_ray.RayUnavailable, match=r"the Ray client failed \(exit 1\): ValueError: actor tr ainer X not found$") as caught:
        _ray.ask(node, {"do": "list"})
    assert "Traceback" not in str(caught.value)


def test_the_room_asks_once_per_raylet_and_keeps_only_what_ray_would_restart(proc, monkeypatch):
    monkeypatch.setattr(_ray, "owned_by_root_only", lambda path, lstat=None: None)
    asked = []

    def ask(node, request):
        asked.append(request)
        return {"actors": [GCS_ACTOR, dict(GCS_ACTOR, id="a2", name="once", pid=139 + 1000, max_restarts=0)]}

    entry = {"kind": "ray", "name": "ray (PID 57)", "pids": [164], "gpu_indexes": [0], "command": "", "entry": "ray:", "node_pid": 57, "actors": []}
    monkeypatch.setattr(_ray, "start_time", lambda pid, proc: 2000)
    [actor] = orch.ray_actors(entry, str(proc), _read(proc), ask)
    assert asked == [{"do": "list", "gcs": "172.31.77.1:6379", "node_id": "b99b49e3", "max": _ray.MAX_ACTORS}]
    assert actor["id"] == "a1" and actor["command"].startswith("ray.kill(ray.get_actor('trainer1'") and actor["holders"] == [164]


class _Steps:
    def __init__(self, actors):
        self.ray_actors = actors


class _Release:
    def __init__(self, actors):
        self.result = {"warnings": [], "ray_actors": [orch.public_actor(a) for a in actors]}


NODE = {"node_pid": 57, "raylet_pid": 71, "gcs": "172.31.77.1:6379", "node_id": "b99b49e3", "node_ip": "172.31.77.2", "python": "/usr/bin/python3",
        "packages": "/opt/ray"}


def test_ending_through_ray_marks_what_ray_ended_and_fails_before_any_signal_when_ray_does_not_confirm():
    actor = dict(GCS_ACTOR, node=NODE, command=_ray.command(GCS_ACTOR), label=_ray.label(GCS_ACTOR), holders=[164])
    release = _Release([actor])
    orch.end_ray_actors(release, _Steps([actor]), lambda node, request: {"killed": ["a1"], "changed": [], "not_dead": []})
    assert release.result["ray_actors"][0]["ended"] is True
    release = _Release([actor])
    with pytest.raises(StepFailed, match=r"did not say actor trainer1 \(Trainer, PID 139, max_restarts -1\) dead"):
        orch.end_ray_actors(release, _Steps([actor]), lambda node, request: {"killed": ["a1"], "changed": [], "not_dead": ["a1"]})

    def unreachable(node, request):
        raise _ray.RayUnavailable("Ray's GCS at 172.31.77.1:6379: no answer within 45 s")

    with pytest.raises(StepFailed, match=r"no answer within 45 s; no process was signalled: end the actors with ray.kill"):
        orch.end_ray_actors(_Release([actor]), _Steps([actor]), unreachable)


def test_an_unnamed_actor_is_refused_with_its_jobs_command():
    said = orch.unnamed_refusal([dict(GCS_ACTOR, name="", submission_id="raysubmit_9", label="actor a1 (Trainer, PID 139, max_restarts -1)",
                                      command="ray job stop raysubmit_9")])
    assert "only by its name" in said and "`ray job stop raysubmit_9`" in said and "`ray stop` on this node" in said


def test_the_client_script_compiles():
    compile(_ray.CLIENT, "<ray client>", "exec")
    assert json.loads(json.dumps({"do": "kill"}))
