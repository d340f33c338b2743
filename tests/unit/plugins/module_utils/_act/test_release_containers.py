# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Release.run with containers and with things that respawn, on the fake node of
test_release_run (a /proc tree, nvidia-smi, systemctl and a clock that moves only when Release
sleeps) plus a container runtime that stops the node's containers."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _settle
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fake_node as node

A, B = "a" * 64, "b" * 64
USER_UNIT = "0::/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service\n"


class NodeRuntime:
    """Docker on the fake node: containers by id; stopping one ends its processes."""

    def __init__(self, world):
        self.world = world
        self.containers = {}
        self.log = []

    def add(self, cid, name, restart="always", image="vllm/vllm-openai:v0.11.0"):
        self.containers[cid] = {"id": cid, "name": name, "image": image, "restart_policy": restart, "running": True, "status": "running",
                                "pod": None, "pod_uid": None}

    def client(self, runtime):
        return self

    def inspect(self, runtime, cid):
        record = self.containers.get(cid)
        if not record:
            return None
        # State.Pid: the container's first process, as Docker reports it (0 when stopped).
        members = sorted(pid for pid, proc in self.world.procs.items() if cid in proc.spec["cgroup"])
        return dict(record, pid=members[0] if members and record["running"] else None)

    def find(self, glob):
        import fnmatch

        return [("docker", dict(r)) for r in self.containers.values() if fnmatch.fnmatchcase(r["name"], glob)]

    def stop(self, runtime, cid, grace):
        self.log.append(("stop", cid, grace, self.world.t))
        for pid, proc in sorted(self.world.procs.items()):
            if cid in proc.spec["cgroup"]:
                self.world.exit(pid, by_stop=True)
        self.containers[cid].update(running=False, status="exited")

    def set_restart_no(self, runtime, cid):
        self.log.append(("update", cid))
        self.containers[cid]["restart_policy"] = "no"

    def pod_of(self, cid):
        return None


class UserSystem(node.FakeSystem):
    """Also answers `systemctl --user --machine=USER@ show -p Restart` (None: the user manager cannot be asked)."""

    user_restart = None

    def systemctl(self, args):
        if args and args[0] == "--user":
            self.world.systemctl_log.append(list(args))
            if self.user_restart is None:
                return 1, "", "Failed to connect to bus: No medium found"
            return 0, self.user_restart + "\n", ""
        return super().systemctl(args)


@pytest.fixture
def world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    world = node.World(root)
    world.runtimes = NodeRuntime(world)
    return world


def run(world, check_mode=False, user_restart=None, **options):
    system = UserSystem(world)
    system.user_restart = user_restart
    worker = release.Release(node.FakeSmi(world), system, node.params(**options), check_mode=check_mode, driver_root=str(world.root.parent / "none"))
    return worker.run()


def fail(world, **options):
    with pytest.raises(release.ReleaseError) as info:
        run(world, **options)
    return info.value


def respawn_on_exit(world, pid, new_pid, after_s, mem=None):
    """Whatever ends `pid`, its supervisor starts `new_pid` in the same cgroup `after_s` later."""
    proc = world.procs[pid]
    exit_ = world.exit

    def respawn():
        world.spawn(new_pid, mem if mem is not None else proc.mem, cgroup=proc.spec["cgroup"], argv=proc.spec["argv"])

    def exit_and_respawn(which, by_stop=False):
        exit_(which, by_stop)
        if which == pid:
            world.at(world.t + after_s, respawn)

    world.exit = exit_and_respawn


def test_holder_in_a_container_is_stopped_through_its_runtime_never_signalled(world):
    world.runtimes.add(A, "vllm")
    world.spawn(495, {0: 40960, 1: 40960}, cgroup=f"0::/docker/{A}\n", argv=("python3", "-m", "vllm.entrypoints.openai.api_server"))
    world.spawn(496, {0: 1000}, cgroup=f"0::/docker/{A}\n", comm="VLLM::Worker_TP0")
    result = run(world, kill_timeout=4.0)
    assert world.signals == [] and result["killed"] == []
    assert world.runtimes.log == [("stop", A, 4.0, 0.0)]
    [entry] = result["stopped_containers"]
    assert (entry["name"], entry["id"], entry["image"], entry["runtime"], entry["restart_policy"], entry["gpu_indexes"]) == (
        "vllm", A, "vllm/vllm-openai:v0.11.0", "docker", "always", [0, 1])
    assert result["released"] is True and result["changed"] is True and result["disabled_containers"] == []
    # Stopped through the runtime: nothing can respawn it, so no settle window.
    assert result["timings"]["settle_s"] == 0.0 and world.t < 1.0


def test_check_mode_lists_the_containers_it_would_stop_and_does_nothing(world):
    world.runtimes.add(A, "vllm")
    world.spawn(495, {0: 40960}, cgroup=f"0::/docker/{A}\n")
    world.spawn(600, {1: 1000})
    result = run(world, check_mode=True)
    assert world.runtimes.log == [] and world.signals == [] and 495 in world.procs
    assert [e["name"] for e in result["stopped_containers"]] == ["vllm"] and [k["pid"] for k in result["killed"]] == [600]
    assert result["changed"] is True and result["released"] is False


def test_named_containers_are_disabled_then_stopped_and_reported(world):
    world.runtimes.add(A, "vllm-a")
    world.runtimes.add(B, "vllm-b", restart="no")
    world.runtimes.containers[B].update(running=False, status="exited")
    world.spawn(495, {0: 40960}, cgroup=f"0::/docker/{A}\n")
    result = run(world, services=["container:vllm*", "container:tgi"], service_state="disabled")
    assert world.runtimes.log[0] == ("update", A) and world.runtimes.log[1][:2] == ("stop", A)
    assert [(e["name"], e["restart_policy"], e["restart_policy_before"]) for e in result["disabled_containers"]] == [("vllm-a", "no", "always")]
    assert [e["name"] for e in result["stopped_containers"]] == ["vllm-a"] and result["services_not_found"] == ["container:tgi"]
    again = run(world, services=["container:vllm*"], service_state="disabled")
    assert again["changed"] is False and again["stopped_containers"] == [] and again["disabled_containers"] == []


def test_user_unit_that_respawns_inside_the_settle_window_fails_naming_it(world):
    world.spawn(495, {0: 40960}, cgroup=USER_UNIT, argv=("python3", "serve.py"))
    respawn_on_exit(world, 495, 812, after_s=1.5)
    error = fail(world)
    assert [pid for _t, pid, _name in world.signals] == [495]
    assert "came back" in error.msg and "pid 812 python3 [python3 serve.py] in unit vllm.service of root's systemd manager" in error.msg
    assert error.result["released"] is False and error.result["timings"]["settle_s"] < _settle.SETTLE_S
    assert ["--user", "--machine=root@", "show", "--property=Restart", "--value", "--", "vllm.service"] in world.systemctl_log


def test_user_unit_that_stays_down_is_released_after_the_window(world):
    world.spawn(495, {0: 40960}, cgroup=USER_UNIT)
    result = run(world)
    assert result["released"] is True and result["timings"]["settle_s"] == pytest.approx(_settle.SETTLE_S, abs=_settle.POLL_S)


def test_user_unit_with_restart_no_needs_no_window(world):
    world.spawn(495, {0: 40960}, cgroup=USER_UNIT)
    result = run(world, user_restart="no")
    assert result["released"] is True and result["timings"]["settle_s"] == 0.0


def test_bare_process_keeps_the_fast_path(world):
    world.spawn(495, {0: 40960})
    result = run(world)
    assert result["released"] is True and result["timings"]["settle_s"] == 0.0 and world.t < 0.5


def test_container_signalled_from_outside_that_comes_back_fails_naming_the_container(world):
    world.runtimes = _engines.Runtimes(which=lambda name: None, sockets={})  # no Docker to ask
    world.spawn(495, {0: 40960}, cgroup=f"0::/system.slice/docker-{A}.scope\n")
    respawn_on_exit(world, 495, 901, after_s=0.5)
    error = fail(world)
    assert f"pid 901 python3 [python3 serve.py] in container {A[:12]} (docker)" in error.msg
    assert [k["pid"] for k in error.result["killed"]] == [495] and error.result["released"] is False


def test_respawn_that_fills_the_gpu_again_is_named_too(world):
    world.spawn(495, {0: 40960}, cgroup=USER_UNIT)
    respawn_on_exit(world, 495, 812, after_s=0.4, mem={0: 20000})
    error = fail(world)
    assert "pid 812" in error.msg and "GPU 0 reads" in error.msg and "again" in error.msg
    assert [g["memory_used_mib"] for g in error.result["gpus"]][0] >= 20000


def test_pod_holder_fails_before_anything_is_done(world):
    world.unit("vllm.service")
    world.spawn(400, {1: 1000}, unit="vllm.service")
    world.spawn(495, {0: 40960}, cgroup=f"0::/kubepods/burstable/pod1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901/{B}\n")
    error = fail(world, services=["vllm.service"])
    assert world.signals == [] and not [a for a in world.systemctl_log if a[0] == "stop"] and world.runtimes.log == []
    assert "pod UID 1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901 (pid 495" in error.msg and "drain" in error.msg


def test_watch_list_covers_only_what_can_respawn_outside_this_runs_control():
    def h(cgroup, unit=None, container=None, user="alice"):
        return {"pid": 1, "name": "python3", "cgroup": cgroup, "unit": unit, "container": container, "user": user}

    user_unit = "/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service"
    signalled = [
        h(f"/docker/{A}", container=A),  # its runtime could not be asked
        h(f"/docker/{B}", container=B),  # not among those: not watched
        # systemd's unit of the holder is the user's manager; her own unit is the deepest name below it
        h(user_unit + "/sub", unit="user@1000.service"),
        h("/system.slice/cron.service", unit="cron.service"),  # a system unit this run did not stop: a launcher
        h("/user.slice/user-1000.slice/session-3.scope", unit="session-3.scope"),
        # a system unit she was delegated: the names below it are hers, and no user manager answers for them
        h("/system.slice/lab-alice.service/app.slice/vllm.service", unit="lab-alice.service"),
    ]
    assert _settle.watch_list(signalled, {A: "no docker"}, systemctl=None) == {
        f"/docker/{A}": f"container {A[:12]} (docker)",
        user_unit: "unit vllm.service of alice's systemd manager",
    }
    asked = _settle.watch_list(signalled[2:3], {}, systemctl=lambda args: (0, "no\n", ""))
    assert asked == {}, "Restart=no: nothing starts it again"


def test_container_whose_processes_hold_gpus_on_both_sides_of_the_selection_is_refused_then_stopped_with_kill_spanning(world):
    # one container, a worker on GPU 0 and one on GPU 1 (tensor parallel): stopping it for GPU 1 ends GPU 0's work too
    world.runtimes.add(A, "vllm-tp")
    world.spawn(495, {0: 30000}, cgroup=f"0::/docker/{A}\n", comm="VLLM::Worker_TP0")
    world.spawn(496, {1: 30000}, cgroup=f"0::/docker/{A}\n", comm="VLLM::Worker_TP1")
    for check_mode in (True, False):
        with pytest.raises(release.ReleaseError) as info:
            run(world, check_mode=check_mode, gpus=["1"])
        assert world.runtimes.log == [] and world.signals == [] and {495, 496} <= set(world.procs)
        assert "container vllm-tp (pids 495,496) holds GPUs 0,1; GPU 0 is outside the selection" in info.value.msg, info.value.msg
        [entry] = info.value.result["spanning"]
        assert (entry["container"], entry["outside_gpus"]) == (A, [0])
    result = run(world, gpus=["1"], kill_spanning=True)
    assert [e["name"] for e in result["stopped_containers"]] == ["vllm-tp"] and result["released"] is True and not world.procs


def test_container_on_the_selected_gpus_only_is_no_spanning_container(world):
    world.runtimes.add(A, "infer-gpu1")
    world.spawn(495, {1: 30000}, cgroup=f"0::/docker/{A}\n")
    world.spawn(600, {0: 1000})
    result = run(world, gpus=["1"])
    assert result["spanning"] == [] and [e["name"] for e in result["stopped_containers"]] == ["infer-gpu1"] and 600 in world.procs


def test_a_restart_policy_that_cannot_be_set_fails_keeping_what_was_disabled(world):
    """_containers.act stops at the first restart policy it cannot set (StepFailed with what it did):
    Release fails with that message and keeps the container already disabled for gpu_restore."""
    world.runtimes.add(A, "vllm-a")
    world.runtimes.add(B, "vllm-b")
    world.spawn(495, {0: 40960}, cgroup=f"0::/docker/{A}\n")
    refuse = world.runtimes.set_restart_no

    def set_restart_no(runtime, cid):
        if cid == B:
            raise _engines.RuntimeUnavailable("docker CLI /usr/bin/docker: update --restart=no (rc 1): unknown flag: --restart")
        refuse(runtime, cid)

    world.runtimes.set_restart_no = set_restart_no
    error = fail(world, services=["container:vllm*"], service_state="disabled")
    assert error.msg == ("could not set the restart policy of container vllm-b (docker bbbbbbbbbbbb, vllm/vllm-openai:v0.11.0) to no: "
                         "docker CLI /usr/bin/docker: update --restart=no (rc 1): unknown flag: --restart")
    assert [(e["name"], e["restart_policy"], e["restart_policy_before"]) for e in error.result["disabled_containers"]] == [("vllm-a", "no", "always")]
    assert error.result["stopped_containers"] == [] and world.runtimes.log == [("update", A)] and world.signals == []


def test_containers_that_cannot_be_listed_fail_before_anything_is_done(world):
    world.spawn(495, {0: 40960})

    def find(glob):
        raise _engines.RuntimeUnavailable("docker API at /run/docker.sock: GET /containers/json?all=1 answered 500: boom")

    world.runtimes.find = find
    error = fail(world, services=["container:vllm*"])
    assert error.msg == "cannot list containers for container:vllm*: docker API at /run/docker.sock: GET /containers/json?all=1 answered 500: boom"
    assert error.result["stopped_containers"] == [] and error.result["killed"] == [] and world.signals == [] and 495 in world.procs
