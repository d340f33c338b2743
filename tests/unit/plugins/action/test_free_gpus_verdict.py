# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The free_gpus role's verdict (issue 55: said once, seen by every consumer): a host that is not
free fails with its reason as `msg`, nothing hidden; a free host stopped by another's failure under
any_errors_fatal says so in one warning; the Slurm drain comes first. The real plays run in
tests/fleet (test_said_once.py, test_failure_paths.py)."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.action import free_gpus_verdict as plugin
from ansible_collections.zeromib.gpu.plugins.filter.free_gpus import free_gpus_failed, free_gpus_outcome
from ansible_collections.zeromib.gpu.plugins.plugin_utils import _said_once
from ansible_collections.zeromib.gpu.plugins.plugin_utils._said_once import result_of
from ansible_collections.zeromib.gpu.tests.unit.plugins.action.action_harness import action


class _Manager:
    def __init__(self, facts):
        self._nonpersistent_fact_cache = {}
        self._fact_cache = facts


class _HostVars:
    def __init__(self, facts):
        self._variable_manager = _Manager(facts)

    def raw_get(self, host):
        return {}


def _outcome(host, dirty=False, stopped_units=()):
    result = {"changed": bool(stopped_units), "released": not dirty, "selected_gpus": [0], "elapsed_s": 0.3,
              "gpus_before": [{"index": 0, "memory_used_mib": 1024, "clean": False}],
              "gpus": [{"index": 0, "memory_used_mib": 1024 if dirty else 0, "clean": not dirty}], "stopped_units": list(stopped_units)}
    if dirty:
        result.update(failed=True, msg="GPUs still in use after 60.0 s: GPU 0 (GPU-0) reads 1024 MiB")
    return free_gpus_outcome(result, host)


def _verdict(host, outcomes, any_errors_fatal=False, check_mode=False, module_result=None, args=None, **variables):
    task_vars = dict({"inventory_hostname": host, "ansible_play_batch": list(outcomes),
                      "hostvars": _HostVars({h: {"free_gpus_result": o} for h, o in outcomes.items() if o is not None})}, **variables)
    verdict = action(plugin.ActionModule, task_vars, args=args, check_mode=check_mode, name="zeromib.gpu.free_gpus_verdict",
                     module_result=module_result)
    verdict._task.any_errors_fatal = any_errors_fatal
    return verdict, task_vars


def test_a_host_that_is_not_free_fails_with_its_reason_as_msg_and_nothing_else():
    verdict, task_vars = _verdict("n2", {"n1": _outcome("n1"), "n2": _outcome("n2", dirty=True)})
    result = result_of(lambda: verdict.run(task_vars=task_vars))
    assert result == {"failed": True, "changed": False, "msg": "n2: GPUs still in use after 60.0 s: GPU 0 (GPU-0) reads 1024 MiB"}
    assert "censored" not in str(result) and "_ansible_no_log" not in result
    assert verdict.module.calls == [], "no drain unless asked"


def test_on_ansible_core_2_19_and_later_the_failure_is_raised_so_that_no_error_summary_repeats_it():
    verdict, task_vars = _verdict("n2", {"n2": _outcome("n2", dirty=True)})
    if _said_once.OMITS_EXCEPTION:
        with pytest.raises(_said_once.SaidOnce) as raised:
            verdict.run(task_vars=task_vars)
        assert raised.value.omit_exception_key is True and raised.value.result_contribution["failed"] is True
    else:
        assert verdict.run(task_vars=task_vars)["failed"] is True


def test_a_free_host_passes_quietly_with_its_message():
    verdict, task_vars = _verdict("n1", {"n1": _outcome("n1"), "n2": _outcome("n2")}, any_errors_fatal=True)
    result = verdict.run(task_vars=task_vars)
    assert not result.get("failed") and not result.get("warnings") and result["msg"].startswith("n1: 1 GPU free")


def test_under_any_errors_fatal_a_free_host_warns_which_hosts_stop_the_play_and_how_to_put_back_what_it_stopped():
    # n3's gate gave no result: it fails here too
    outcomes = {"n1": _outcome("n1", stopped_units=["vllm.service"]), "n2": _outcome("n2", dirty=True), "n3": None, "n4": _outcome("n4")}
    verdict, task_vars = _verdict("n1", outcomes, any_errors_fatal=True)
    result = verdict.run(task_vars=task_vars)
    said = ("n1: its GPUs are free, but the play stops here because n2, n3 failed (any_errors_fatal); what was stopped here stays stopped: "
            "put it back with `ansible-playbook playbooks/restore_gpus.yml -l n1` (or the zeromib.gpu.restore_gpus role)")
    assert not result.get("failed") and result["warnings"] == [said] and result["msg"] == said
    fact = result["ansible_facts"]["free_gpus_result"]
    assert fact["status"] == "stopped" and fact["stopped_by"] == ["n2", "n3"] and fact["ok"] is True
    # without any_errors_fatal the others go on: nothing to say
    verdict, task_vars = _verdict("n1", outcomes)
    assert not verdict.run(task_vars=task_vars).get("warnings")


def test_a_settings_mistake_fails_with_its_words_and_drains_nothing():
    invalid = free_gpus_failed("n1", "settings mistake, nothing was done: free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'",
                               "invalid")
    verdict, task_vars = _verdict("n1", {"n1": invalid}, free_gpus_on_failure="drain")
    result = result_of(lambda: verdict.run(task_vars=task_vars))
    assert result["msg"] == invalid["message"] and verdict.module.calls == []


def test_with_on_failure_drain_the_node_is_drained_first_with_the_reason_without_the_host_name():
    verdict, task_vars = _verdict("n2", {"n2": _outcome("n2", dirty=True)}, module_result={"changed": True}, free_gpus_on_failure="drain",
                                  free_gpus_slurm_node_name="gpu02")
    result = result_of(lambda: verdict.run(task_vars=task_vars))
    assert verdict.module.calls == [{"module_name": "zeromib.gpu.slurm_node", "module_args": {
        "state": "drained", "reason": "GPUs still in use after 60.0 s: GPU 0 (GPU-0) reads 1024 MiB", "node_name": "gpu02"}}]
    assert result["failed"] is True and "warnings" not in result


def test_a_drain_that_fails_is_a_warning_and_the_host_fails_with_its_own_reason(monkeypatch):
    verdict, task_vars = _verdict("n2", {"n2": _outcome("n2", dirty=True)}, module_result={"failed": True, "msg": "scontrol: not found"},
                                  free_gpus_on_failure="drain")
    # 2.19 and later keep a task's warnings from what it displayed, not from a raised result (_said_once.fail_once).
    shown: list[str] = []
    monkeypatch.setattr(_said_once._display, "warning", shown.append)
    result = result_of(lambda: verdict.run(task_vars=task_vars))
    said = shown if _said_once.OMITS_EXCEPTION else result["warnings"]
    assert said == ["n2: could not drain its Slurm node (free_gpus_on_failure=drain): scontrol: not found"]
    assert result["msg"].startswith("n2: GPUs still in use")


def test_check_mode_drains_nothing():
    verdict, task_vars = _verdict("n2", {"n2": _outcome("n2", dirty=True)}, check_mode=True, free_gpus_on_failure="drain")
    result_of(lambda: verdict.run(task_vars=task_vars))
    assert verdict.module.calls == []


def test_under_free_gpus_yml_nothing_fails_here_and_its_last_task_fails_with_the_pointer():
    outcomes = {"n2": _outcome("n2", dirty=True)}
    verdict, task_vars = _verdict("n2", outcomes, _free_gpus_summary_follows=True)
    assert verdict.run(task_vars=task_vars)["msg"].startswith("n2: GPUs still in use")
    verdict, task_vars = _verdict("n2", outcomes, args={"msg": "n2: not free (its line in the fleet summary above says why)"})
    assert result_of(lambda: verdict.run(task_vars=task_vars)) == {
        "failed": True, "changed": False, "msg": "n2: not free (its line in the fleet summary above says why)"}


def test_a_host_without_an_outcome_fails_saying_so():
    verdict, task_vars = _verdict("n3", {"n3": None})
    assert result_of(lambda: verdict.run(task_vars=task_vars))["msg"] == "n3: the role's gate gave no result on this host"


# --------------------------------------------------------------------------- the fleet check of free_gpus_services


def _deferred(host, matched, unmatched, close=None):
    outcome = free_gpus_failed(host, f"waiting for the fleet check of free_gpus_services: {', '.join(unmatched)} matches nothing on this host",
                               "deferred")
    outcome.update(services_matched=list(matched), services_unmatched=list(unmatched), services_close=close or {})
    return outcome


def _checked(host, matched):
    outcome = _outcome(host)
    outcome.update(services_matched=list(matched), services_unmatched=[], services_close={})
    return outcome


SERVICES = {"free_gpus_services": ["vllm*.service", "sglang.service"]}


def _released(**kw):
    return dict({"changed": True, "released": True, "healthy": True, "selected_gpus": [0], "elapsed_s": 0.3, "stopped_units": ["vllm.service"],
                 "gpus_before": [{"index": 0, "memory_used_mib": 40960, "clean": False}], "gpus": [{"index": 0, "memory_used_mib": 0, "clean": True}]}, **kw)


def test_a_host_held_back_for_an_entry_another_host_matches_is_freed_now():
    from ansible_collections.zeromib.gpu.tests.unit.plugins.action.action_harness import ROLE_PATH

    outcomes = {"h200": _checked("h200", ["vllm*.service", "sglang.service"]), "h100": _deferred("h100", ["vllm*.service"], ["sglang.service"])}
    verdict, task_vars = _verdict("h100", outcomes, any_errors_fatal=True, module_result=_released(), role_path=ROLE_PATH, **SERVICES)
    result = verdict.run(task_vars=task_vars)
    [call] = verdict.module.calls
    assert call["module_name"] == "zeromib.gpu.gpu_release" and call["module_args"]["services"] == SERVICES["free_gpus_services"]
    fact = result["ansible_facts"]["free_gpus_result"]
    assert not result.get("failed") and fact["status"] == "freed" and fact["services_unmatched"] == ["sglang.service"]
    assert result["msg"].startswith("h100: 1 GPU free (40960 -> 0 MiB), stopped vllm.service") and not result.get("warnings"), result
    # the free host beside it: a host held back is no host that stops the play
    verdict, task_vars = _verdict("h200", outcomes, any_errors_fatal=True)
    assert not verdict.run(task_vars=task_vars).get("warnings")


def test_an_entry_no_host_matches_fails_every_host_that_has_it_and_none_acts():
    close = {"vllm-server.service": ["vllm.service", "vllm-v1.service"]}
    outcomes = {"a": _deferred("a", [], ["vllm-server.service"], close), "b": _deferred("b", [], ["vllm-server.service"], close)}
    said = ("settings mistake, nothing was done: free_gpus_services: vllm-server.service matches no unit, container or supervisord "
            "program on any host of the play; did you mean vllm.service?")
    for host in outcomes:
        verdict, task_vars = _verdict(host, outcomes, any_errors_fatal=True, free_gpus_on_failure="drain")
        result = result_of(lambda verdict=verdict, task_vars=task_vars: verdict.run(task_vars=task_vars))
        assert result["msg"] == f"{host}: {said}" and result["failed"] is True
        assert verdict.module.calls == [], "no release, no drain"
    # under free_gpus.yml: recorded for its summary, not failed here
    verdict, task_vars = _verdict("a", outcomes, _free_gpus_summary_follows=True)
    result = verdict.run(task_vars=task_vars)
    assert result["ansible_facts"]["free_gpus_result"]["status"] == "invalid" and not result.get("failed")


def test_in_check_mode_the_same_typo_fails_the_dry_run():
    close = {"sglang-x.service": ["sglang.service"]}
    checked = _outcome("a")
    checked.update(services_matched=["vllm*.service"], services_unmatched=["sglang-x.service"], services_close=close)
    verdict, task_vars = _verdict("a", {"a": checked}, check_mode=True)
    result = result_of(lambda: verdict.run(task_vars=task_vars))
    assert result["failed"] is True and "sglang-x.service matches no unit" in result["msg"] and "did you mean sglang.service?" in result["msg"]


def test_while_a_host_of_the_batch_has_not_looked_yet_no_entry_is_called_a_typo():
    # strategy: free; the held-back host is freed rather than failed on the others' behalf
    from ansible_collections.zeromib.gpu.tests.unit.plugins.action.action_harness import ROLE_PATH

    outcomes = {"a": _deferred("a", ["vllm*.service"], ["sglang.service"]), "b": None}
    verdict, task_vars = _verdict("a", outcomes, module_result=_released(), role_path=ROLE_PATH, **SERVICES)
    result = verdict.run(task_vars=task_vars)
    assert [c["module_name"] for c in verdict.module.calls] == ["zeromib.gpu.gpu_release"]
    assert not result.get("failed") and result["ansible_facts"]["free_gpus_result"]["status"] == "freed"


def test_under_any_errors_fatal_a_host_stopped_by_a_settings_mistake_says_the_cause_first():
    """Issue 67: its warning may be printed above the failing host's line, so the cause comes first, with the variable."""
    wrong = free_gpus_failed("n2", "settings mistake, nothing was done: free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'",
                             "invalid")
    verdict, task_vars = _verdict("n1", {"n1": _outcome("n1", stopped_units=["vllm.service"]), "n2": wrong}, any_errors_fatal=True)
    said = verdict.run(task_vars=task_vars)["msg"]
    assert said.startswith("n1: the play stops here because n2 has a settings mistake (free_gpus_wait_timeout), said on its line "
                           "(any_errors_fatal); its GPUs are free; what was stopped here stays stopped: put it back with"), said
