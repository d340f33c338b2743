"""The role's verdict runs the fleet-wide proof (issue 72): one gpu_facts read per host, only when some
host of the batch was freed; a host where work came back fails naming it. The fake gpu_facts answers
as the module does (its `ansible_facts.gpu`); the real read runs on the fleet
(tests/fleet/test_orchestrators_fleet.py)."""
from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.action import free_gpus_verdict as plugin
from ansible_collections.zeromib.gpu.plugins.plugin_utils._said_once import result_of
from ansible_collections.zeromib.gpu.tests.unit.plugins.action.action_harness import action
from ansible_collections.zeromib.gpu.tests.unit.plugins.action.test_free_gpus_verdict import _HostVars, _outcome


def _facts(mib=0, holders=()):
    return {"ansible_facts": {"gpu": {"error": None, "holders": list(holders),
                                      "gpus": [{"index": 0, "memory_used_mib": mib, "clean": mib == 0}]}}}


def _verdict(host, outcomes, facts, **variables):
    task_vars = dict({"inventory_hostname": host, "ansible_play_batch": list(outcomes),
                      "hostvars": _HostVars({h: {"free_gpus_result": o} for h, o in outcomes.items()})}, **variables)
    verdict = action(plugin.ActionModule, task_vars, name="zeromib.gpu.free_gpus_verdict", module_result=facts)
    return verdict, task_vars


def test_a_clean_fleet_runs_no_module():
    verdict, task_vars = _verdict("n1", {"n1": _outcome("n1"), "n2": _outcome("n2")}, _facts())
    assert verdict.run(task_vars=task_vars)["msg"].startswith("n1: ")
    assert verdict.module.calls == []


def test_once_a_host_was_freed_each_host_is_read_once_and_stays_free():
    freed = _outcome("n2", stopped_units=["vllm.service"])
    verdict, task_vars = _verdict("n1", {"n1": _outcome("n1"), "n2": freed}, _facts(), free_gpus_max_used_mib=64)
    result = verdict.run(task_vars=task_vars)
    assert [call["module_name"] for call in verdict.module.calls] == ["zeromib.gpu.gpu_facts"]
    assert verdict.module.calls[0]["module_args"]["max_used_mib"] == 64
    assert not result.get("failed")
    assert result["ansible_facts"]["free_gpus_result"]["fleet_proof"] == {"freed_hosts": ["n2"], "free": True}


def test_work_back_on_a_proven_host_fails_it_naming_the_holder():
    freed = _outcome("n2", stopped_units=["vllm.service"])
    actor = {"pid": 4242, "ppid": 99, "cmdline": "ray::Holder", "gpu_indexes": [0], "protected": False}
    verdict, task_vars = _verdict("n1", {"n1": _outcome("n1"), "n2": freed}, _facts(3000, [actor]))
    result = result_of(lambda: verdict.run(task_vars=task_vars))
    assert result["failed"] is True
    assert result["msg"].startswith("n1: not free after the last host was freed: GPU 0 reads 3000 MiB, held by PID 4242 (ray::Holder)")


@pytest.mark.parametrize("answer", [{"failed": True, "msg": "nvidia-smi not found"}, {}])
def test_a_read_that_fails_is_no_proof(answer):
    freed = _outcome("n2", stopped_units=["vllm.service"])
    verdict, task_vars = _verdict("n1", {"n1": _outcome("n1"), "n2": freed}, answer)
    result = result_of(lambda: verdict.run(task_vars=task_vars))
    assert result["failed"] is True and "fleet-wide proof" in result["msg"]


def test_under_free_gpus_yml_the_outcome_carries_it_to_the_summary():
    freed = _outcome("n2", stopped_units=["vllm.service"])
    actor = {"pid": 4242, "cmdline": "ray::Holder", "gpu_indexes": [0], "protected": False}
    verdict, task_vars = _verdict("n1", {"n1": _outcome("n1"), "n2": freed}, _facts(3000, [actor]), _free_gpus_summary_follows=True)
    result = verdict.run(task_vars=task_vars)
    assert result["ansible_facts"]["free_gpus_result"]["status"] == "back"
