"""Ray and Swarm work stopped only through them (_act/_orchestrators, issue 72): which services
entries name what, the refusal, and Swarm's scale-down and scale-back against an Engine API that
answers as Docker 20.10's does (the real one runs in tests/integration/test_orchestrators_docker.py)."""
from __future__ import annotations

import json

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _orchestrators as orch
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._look._engines import RuntimeUnavailable

RAY = {"kind": "ray", "name": "raylet (PID 1)", "pids": [2], "gpu_indexes": [0], "command": "ray stop", "entry": "ray:"}
WEB = {"kind": "swarm", "name": "vllm", "pids": [3], "gpu_indexes": [1], "command": "docker service scale vllm=0", "entry": "swarm:vllm"}


def test_the_services_parser_leaves_swarm_and_ray_entries_to_this_room():
    named = _services.parse(["swarm:vllm", "ray:", "vllm.service"])
    assert named.units == ["vllm.service"] and not named.containers
    assert orch.entries(["swarm:vllm", " ray: ", "vllm.service"]) == ["swarm:vllm", "ray:"]


def test_named_means_named():
    assert orch.is_named(RAY, ["ray:"]) and not orch.is_named(RAY, ["swarm:*"])
    assert orch.is_named(WEB, ["swarm:vl*"]) and not orch.is_named(WEB, ["swarm:sglang", "ray:"])
    assert orch.not_found(["ray:", "swarm:vllm", "swarm:nope*"], [WEB], ["vllm", "db"]) == ["ray:", "swarm:nope*"]


class FakeSwarm:
    """Docker's answers: /services, /services/NAME, /services/ID/update, /containers/json."""

    def __init__(self, replicas=2, mode="Replicated", running=0, manager=True):
        self.spec = {"Name": "vllm", "Mode": {mode: {"Replicas": replicas} if mode == "Replicated" else {}}}
        self.version, self.running, self.manager, self.updates = 7, running, manager, []

    def __call__(self, method, path, body=None):
        if not self.manager:
            raise RuntimeUnavailable("docker API at /run/docker.sock: GET /services answered 503: This node is not a swarm manager.")
        if path == "/services":
            return 200, json.dumps([{"ID": "s1", "Spec": self.spec}])
        if path.startswith("/services/s1/update"):
            assert f"version={self.version}" in path
            self.updates.append(body["Mode"]["Replicated"]["Replicas"])
            self.spec, self.version = body, self.version + 1
            return 200, "{}"
        if path.startswith("/services/"):
            return (200, json.dumps({"ID": "s1", "Version": {"Index": self.version}, "Spec": json.loads(json.dumps(self.spec))})
                    if path.endswith("vllm") else (404, json.dumps({"message": "service nope not found"})))
        if path.startswith("/containers/json"):
            self.running = max(0, self.running - 1)
            return 200, json.dumps([{"Id": "c"}] * self.running)
        raise AssertionError(path)


def test_a_named_service_is_scaled_to_zero_waited_for_and_recorded():
    api = FakeSwarm(replicas=2, running=2)
    done, missing = orch.scale_down(orch.Swarm(api), ["swarm:vllm", "swarm:nope"], [WEB], "T", 2, sleep=lambda s: None)
    assert api.updates == [0] and missing == ["swarm:nope"]
    assert done == [{"kind": "swarm_service", "name": "vllm", "replicas": 2, "actions": ["stopped"], "released_at": "T"}]
    assert orch.scale_back(orch.Swarm(api), done[0]) == ["scaled to 2"] and api.updates == [0, 2]
    assert orch.scale_back(orch.Swarm(api), done[0]) == [], "idempotent"


def test_a_global_service_cannot_be_scaled_and_says_what_to_do():
    with pytest.raises(StepFailed, match="global .*--constraint-add node.hostname!=NODE vllm"):
        orch.scale_down(orch.Swarm(FakeSwarm(mode="Global")), ["swarm:vllm"], [], "T", 2)


def test_a_node_that_is_no_manager_says_so_with_the_command():
    with pytest.raises(StepFailed, match="not a swarm manager.*docker service scale NAME=0"):
        orch.scale_down(orch.Swarm(FakeSwarm(manager=False)), ["swarm:vllm"], [], "T", 2)


def test_tasks_that_do_not_stop_fail_naming_the_service_and_keep_what_was_done():
    api = FakeSwarm(replicas=1, running=10 ** 6)
    clock = iter(range(0, 1000, 5))
    with pytest.raises(StepFailed, match="did not stop the tasks of vllm") as failed:
        orch.scale_down(orch.Swarm(api), ["swarm:vllm"], [WEB], "T", 2, clock=lambda: next(clock), sleep=lambda s: None)
    assert failed.value.done[0]["replicas"] == 1


def test_a_multi_node_rank_is_named_in_a_warning():
    said = orch.multi_node_warning([{"pid": 60, "launcher": "torchrun --nnodes 2 train.py (PID 50)"}])
    assert said.startswith("PID 60 is a rank of a multi-node job (torchrun --nnodes 2 train.py (PID 50)): its ranks on the other nodes")


class _Release:
    """What for_release reads of gpu_release: options, system (runtimes, proc), main_pid_of, result."""

    def __init__(self, services, runtimes):
        self.options = _options.ReleaseOptions.from_params({"services": services})
        self.system = type("System", (), {"runtimes": runtimes, "proc": "/proc"})()
        self.result = {"warnings": []}

    def main_pid_of(self, unit):
        return None


class _NoDocker:
    def client(self, runtime):
        return None

    def error(self, runtime):
        return "docker is not on this node"


def test_a_swarm_entry_on_a_host_without_docker_names_nothing_here():
    # A mixed fleet: the entry is for the hosts that run Swarm; here it matches nothing (the fleet check decides).
    steps = type("Plan", (), {"targets": [], "selected": [0]})()
    assert orch.for_release(_Release(["swarm:vllm"], _NoDocker()), steps) == []
    assert steps.orchestrated_missing == ["swarm:vllm"] and steps.orchestrated_to_do is False


def test_slurm_is_asked_once_per_job_and_a_silent_or_missing_scontrol_names_nothing(tmp_path):
    calls = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 'JobId=77 NumNodes=2 NodeList=gpu[01-02]'\n")
    scontrol.chmod(0o755)
    show_job = orch.scontrol_show_job(str(scontrol))
    assert show_job("77") == show_job("77") == "JobId=77 NumNodes=2 NodeList=gpu[01-02]\n"
    assert calls.read_text() == "show job -o 77\n"
    assert orch.scontrol_show_job(None)("77") is None
    hung = tmp_path / "hung"
    hung.write_text("#!/bin/sh\nexec sleep 30\n")
    hung.chmod(0o755)
    assert orch.scontrol_show_job(str(hung), timeout=0.3)("77") is None
