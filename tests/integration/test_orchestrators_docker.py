"""Docker Swarm on a simulated GPU host (issue 72): a single-node Swarm (this dockerd its manager) runs a
service whose task holds GPU 0; the attacker is Swarm itself, which recreates a killed task as a new
container under a new name.

- Today's gpu_release stops the task's container through Docker (or kills it), and Swarm starts
  another: the GPU is held again. Now: without `swarm:NAME` in services the run refuses before
  anything is done, naming the service and `docker service scale NAME=0`; check mode says the same.
- With `swarm:vllm` the service is scaled to 0 through the Engine API, the GPU reads free, the
  record keeps its replicas, and gpu_restore scales it back (the task holds the GPU again).

Seen with the code before issue 72 on this rig: gpu_release stopped the task's container through
Docker (released: true), and Swarm's new task held GPU 0 again (3000 MiB) within seconds.

The rig: tests/integration/docker_rig.py (TEST_RIGS.md, "Docker Engine"), plus `docker swarm init`
on the namespace's loopback. The task's holder registers under the host's PID through the host's
/proc mounted into the container (the simulator's NVIDIA_SIM_DRIVER_PROC): a Swarm service cannot
share the host's PID namespace as `docker run --pid=host` does."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "sim"))
sys.path.insert(0, HERE)
import docker_rig  # noqa: E402
from ansible_in_ns import run_module  # noqa: E402
from docker_rig import IMAGE, SIM_DIR, used  # noqa: E402

SERVICE = "vllm"


@pytest.fixture(scope="module")
def swarm():
    with docker_rig.docker_node("h200x8", "swarmnode") as dockerd:
        try:
            dockerd.docker("swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", "127.0.0.1:2377", timeout=60)
            yield dockerd
        finally:
            dockerd.docker("service", "rm", SERVICE, check=False)
            dockerd.docker("swarm", "leave", "--force", check=False)


def _service(docker, replicas=1):
    """`docker service create` of a gpu_holder on GPU 0 (3000 MiB); waits until GPU 0 holds it."""
    minor = [g for g in docker.host.config["gpus"] if g["index"] == 0][0]["minor"]
    mounts = []
    for node in ("/dev/nvidiactl", "/dev/nvidia-uvm", f"/dev/nvidia{minor}"):
        mounts += ["--mount", f"type=bind,source={node},target={node}"]
    for source, target, ro in (("/usr", "/usr", True), (SIM_DIR, SIM_DIR, True), ("/etc/nvidia-sim", "/etc/nvidia-sim", True),
                               ("/run/nvidia-sim", "/run/nvidia-sim", False), ("/proc", "/host-proc", True)):
        mounts += ["--mount", f"type=bind,source={source},target={target}" + (",readonly" if ro else "")]
    docker.docker("service", "create", "--detach", "--name", SERVICE, "--replicas", str(replicas),
                  "--env", "NVIDIA_SIM_DRIVER_PROC=/host-proc", *mounts,
                  IMAGE, "python3", os.path.join(SIM_DIR, "gpu_holder"), "--gpus", "0", "--mib", "3000", timeout=60)
    assert _wait(lambda: used(docker.host, 0) >= 3000, 60), (docker.docker("service", "ps", "--no-trunc", SERVICE, check=False).stdout)


def _wait(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_a_swarm_task_is_refused_with_the_command_and_nothing_is_done(swarm):
    _service(swarm)
    try:
        tasks = swarm.docker("ps", "-q", "--no-trunc").stdout.split()
        for check in (True, False):
            run = run_module(swarm.host, "gpu_release", check=check)
            assert run.failed, run.result
            assert f"Docker Swarm service {SERVICE}" in run.msg and f"docker service scale {SERVICE}=0" in run.msg, run.msg
            assert f"services as swarm:{SERVICE}" in run.msg
            assert run.get("killed") == [] and run.get("stopped_containers") == []
        assert swarm.docker("ps", "-q", "--no-trunc").stdout.split() == tasks, "the task's container was left alone"
        assert used(swarm.host, 0) >= 3000
    finally:
        swarm.docker("service", "rm", SERVICE, check=False)
        _wait(lambda: used(swarm.host, 0) == 0, 30)


def test_named_the_service_is_scaled_to_zero_and_restore_scales_it_back(swarm):
    _service(swarm, replicas=1)
    try:
        run = run_module(swarm.host, "gpu_release", args={"services": [f"swarm:{SERVICE}"], "kill_timeout": 2})
        assert not run.failed, run.result
        assert run["scaled_services"] == [SERVICE] and run["killed"] == [] and run["stopped_containers"] == []
        assert used(swarm.host, 0) == 0
        spec = json.loads(swarm.docker("service", "inspect", SERVICE).stdout)[0]["Spec"]
        assert spec["Mode"]["Replicated"]["Replicas"] == 0
        time.sleep(2)
        assert used(swarm.host, 0) == 0, "Swarm started nothing again"
        restored = run_module(swarm.host, "gpu_restore")
        assert not restored.failed, restored.msg
        assert [(r["kind"], r["name"]) for r in restored["restored"]] == [("swarm_service", SERVICE)], restored.result
        assert json.loads(swarm.docker("service", "inspect", SERVICE).stdout)[0]["Spec"]["Mode"]["Replicated"]["Replicas"] == 1
        assert _wait(lambda: used(swarm.host, 0) >= 3000, 60), "the task holds the GPU again"
    finally:
        swarm.docker("service", "rm", SERVICE, check=False)
        _wait(lambda: used(swarm.host, 0) == 0, 30)
