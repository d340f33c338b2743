"""gpu_release then gpu_restore against a real Docker Engine and a real (rootful) Podman on a
simulated GPU host (issues 24, 33): every container comes back to exactly its state before -
running or not, its restart policy - read through the engine (docker/podman inspect), never
through the module's return values; twice in a row; a second restore changes nothing; and the
check-mode plan names exactly what the real run then does, under the same keys. The rigs are
test_container_engines.py's."""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim")]
from ansible_in_ns import run_module  # noqa: E402
from docker_rig import used  # noqa: E402
# The Docker rig's fixtures, used by name.
from test_container_engines import docker, podman, podman_rig, rig  # noqa: E402,F401 pylint: disable=unused-import

RECORD = "/var/lib/zeromib-gpu/released.json"
# What a check-mode plan and the real run both report (issue 33): the same values.
PLAN_KEYS = ("changed", "plan", "restored", "restored_policies", "started_containers", "started_units", "enabled_units", "unmasked_units",
             "started_programs", "already_restored", "not_restored", "pending", "diff")


def same_plan(plan, done):
    assert {k: plan[k] for k in PLAN_KEYS} == {k: done[k] for k in PLAN_KEYS}, (plan.result, done.result)


def state(docker_rig, names):
    """{name: (running, restart policy)} as the Docker API reports them."""
    out = {}
    for name in names:
        record = docker_rig.inspect(name)
        out[name] = (record["State"]["Running"], record["HostConfig"]["RestartPolicy"]["Name"])
    return out


def settled_used(host, index, timeout=5.0):
    """memory.used of GPU `index` once a context that just died is released: the driver (and
    the simulator) frees memory tens of ms after the process list empties, so a read right
    after `docker stop` may still count it."""
    deadline = time.monotonic() + timeout
    while True:
        mib = used(host, index)
        if mib == 0 or time.monotonic() > deadline:
            return mib
        time.sleep(0.05)


def record(host):
    proc = host.run(["cat", RECORD])
    return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None


def test_free_then_restore_puts_every_container_back_as_it_was_twice_in_a_row(docker):
    docker.host.run(["rm", "-f", RECORD])
    docker.run_holder("vllm", [0, 1], restart="always")  # named: stopped, restart policy no
    docker.run_holder("sglang", [2], restart="unless-stopped")
    docker.docker("stop", "sglang")  # named, already stopped: restart policy no only
    docker.run_holder("found", [3], restart="on-failure")  # not named, holds GPU 3: stopped only
    names = ["vllm", "sglang", "found"]
    before = state(docker, names)
    assert before == {"vllm": (True, "always"), "sglang": (False, "unless-stopped"), "found": (True, "on-failure")}
    memory_before = [settled_used(docker.host, 2) if i == 2 else used(docker.host, i) for i in range(4)]
    assert memory_before[0] >= 20480 and memory_before[2] == 0
    args = {"services": ["container:vllm", "container:sglang"], "service_state": "disabled", "kill_timeout": 5}
    for round_ in (1, 2):
        free = run_module(docker.host, "gpu_release", args)
        assert not free.failed, free.msg
        assert state(docker, names) == {"vllm": (False, "no"), "sglang": (False, "no"), "found": (False, "on-failure")}
        entries = {e["name"]: (e["actions"], e["running"], e["restart_policy"]) for e in record(docker.host)["entries"]}
        assert entries == {"vllm": (["stopped", "disabled"], True, "always"), "sglang": (["disabled"], False, "unless-stopped"),
                           "found": (["stopped"], True, "on-failure")}, entries

        plan = run_module(docker.host, "gpu_restore", check=True, diff=True)
        assert not plan.failed and plan["changed"] is True, plan.msg
        assert state(docker, names) == {"vllm": (False, "no"), "sglang": (False, "no"), "found": (False, "on-failure")}
        assert sorted(plan["started_containers"]) == ["found", "vllm"], plan.result
        assert sorted(p["name"] for p in plan["restored_policies"]) == ["sglang", "vllm"], plan.result
        assert "container vllm: restart policy no, stopped" in plan["diff"]["before"], plan["diff"]
        assert "container vllm: restart policy always, running" in plan["diff"]["after"], plan["diff"]

        restore = run_module(docker.host, "gpu_restore", {"wait_for_gpus": 30})
        assert not restore.failed, restore.msg
        same_plan(plan, restore)
        assert state(docker, names) == before, round_
        assert record(docker.host) is None
        assert [used(docker.host, i) for i in range(4)] == memory_before
        assert sorted(restore["gpus_held"]) == ["found", "vllm"], restore["gpus_held"]

        again = run_module(docker.host, "gpu_restore")
        assert not again.failed and again["changed"] is False and again["started_containers"] == []


def test_a_container_removed_since_the_release_is_named_kept_and_can_be_forgotten(docker):
    docker.host.run(["rm", "-f", RECORD])
    docker.run_holder("gone", [0], restart="always")
    docker.run_holder("stays", [1], restart="always")
    free = run_module(docker.host, "gpu_release", {"services": ["container:*"], "service_state": "disabled", "kill_timeout": 5})
    assert not free.failed, free.msg
    docker.docker("rm", "gone")
    restore = run_module(docker.host, "gpu_restore")
    assert restore.failed and "container gone" in restore.msg and "no longer knows it" in restore.msg, restore.msg
    assert state(docker, ["stays"]) == {"stays": (True, "always")}
    assert [e["name"] for e in record(docker.host)["entries"]] == ["gone"]
    forget = run_module(docker.host, "gpu_restore", {"forget": ["gone"]})
    assert not forget.failed and forget["changed"] is True, forget.msg
    assert record(docker.host) is None


def test_podman_containers_come_back_as_they_were_twice_in_a_row_and_the_check_plan_is_the_run(podman):
    """Podman 4.3 cannot change a restart policy (gpu_release refuses `disabled` there), so its
    containers are stopped only: one named, one found holding GPU 3; both start again and hold
    their GPUs (wait_for_gpus), read through `podman inspect`."""
    podman.host.run(["rm", "-f", RECORD])
    podman.run_holder("pvllm", [0, 1], restart="always")
    podman.run_holder("pfound", [3], restart="on-failure")
    names = ["pvllm", "pfound"]
    before = state(podman, names)
    assert before == {"pvllm": (True, "always"), "pfound": (True, "on-failure")}
    memory_before = [used(podman.host, i) for i in range(4)]
    assert memory_before[0] >= 20480 and memory_before[3] >= 20480
    for round_ in (1, 2):
        free = run_module(podman.host, "gpu_release", {"services": ["container:pvllm"], "kill_timeout": 5})
        assert not free.failed, free.msg
        stopped = {"pvllm": (False, "always"), "pfound": (False, "on-failure")}
        assert state(podman, names) == stopped
        entries = {e["name"]: (e["runtime"], e["actions"], e["running"]) for e in record(podman.host)["entries"]}
        assert entries == {"pvllm": ("podman", ["stopped"], True), "pfound": ("podman", ["stopped"], True)}, entries

        plan = run_module(podman.host, "gpu_restore", check=True, diff=True)
        assert not plan.failed and plan["changed"] is True, plan.msg
        assert state(podman, names) == stopped, "check mode started a container"
        assert sorted(plan["started_containers"]) == ["pfound", "pvllm"] and plan["restored_policies"] == [], plan.result

        restore = run_module(podman.host, "gpu_restore", {"wait_for_gpus": 30})
        assert not restore.failed, restore.msg
        same_plan(plan, restore)
        assert state(podman, names) == before, round_
        assert record(podman.host) is None
        assert sorted(restore["gpus_held"]) == ["pfound", "pvllm"], restore["gpus_held"]
        assert [used(podman.host, i) for i in range(4)] == memory_before

        again = run_module(podman.host, "gpu_restore")
        assert not again.failed and again["changed"] is False and again["started_containers"] == [] and again["plan"] == []
