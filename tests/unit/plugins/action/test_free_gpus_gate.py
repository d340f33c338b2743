# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The free_gpus role's verdict (the assert it replaces) and its gpu_release options."""

from __future__ import annotations

import gc
import multiprocessing
import signal

import pytest

from ansible_collections.zeromib.gpu.plugins.plugin_utils._gate import gate_failures, module_args, pause_collector_in_worker


def release(clean=True, released=True, count=2, selected=None, failed=False, healthy=True):
    gpus = [{"index": i, "clean": clean if i == 0 else True, "memory_used_mib": 0 if clean or i else 1024} for i in range(count)]
    result = {"gpus": gpus, "selected_gpus": selected if selected is not None else list(range(count)), "released": released,
              "healthy": healthy}
    if failed:
        result = {"failed": True, "msg": "nvidia-smi timed out after 10 s"}
    return result


@pytest.mark.parametrize("result, check_mode, expected, failures", [
    (release(), False, 0, []),
    (release(clean=False, released=False), False, 0, ["released", "every selected GPU clean"]),
    (release(clean=False, released=False), True, 0, []),  # a dry run on a dirty host: "would free"
    (release(failed=True), True, 0, ["gpu_release failed"]),  # a host that cannot be read fails a dry run
    (release(clean=False, released=True, selected=[1]), False, 0, []),  # GPU 0 not selected
    (release(count=7), False, 8, ["free_gpus_expected_count"]),  # a GPU fell off the bus
    (release(count=7), True, 8, ["free_gpus_expected_count"]),
    (release(healthy=False), False, 0, ["free_gpus_require_healthy"]),  # free but not ready: an Xid 79, an ECC error
    (release(healthy=False), True, 0, ["free_gpus_require_healthy"]),  # health is read, so a dry run says it too
    (release(healthy=None), False, 0, ["free_gpus_require_healthy"]),  # health not read is not healthy
], ids=["clean", "dirty", "dirty-check-mode", "unreadable-check-mode", "unselected-dirty", "lost-gpu", "lost-gpu-check-mode",
        "unhealthy", "unhealthy-check-mode", "health-unknown"])
def test_gate_verdict_is_the_roles_assert(result, check_mode, expected, failures):
    assert gate_failures(result, {"free_gpus_expected_count": expected}, check_mode) == failures


def test_health_is_not_required_when_the_role_says_so():
    assert gate_failures(release(healthy=False), {"free_gpus_require_healthy": False}, False) == []


def test_role_variables_become_gpu_release_options_without_the_gate_only_ones():
    params = {"free_gpus_gpus": ["1"], "free_gpus_kill_timeout": 0.0, "free_gpus_expected_count": 8, "free_gpus_nvidia_smi": "",
              "free_gpus_require_healthy": True, "free_gpus_expected_mig_mode": ""}
    assert module_args(params) == {"gpus": ["1"], "kill_timeout": 0.0}
    assert module_args(dict(params, free_gpus_nvidia_smi="/opt/nvidia-smi"))["nvidia_smi"] == "/opt/nvidia-smi"


def test_misspelled_role_variables_are_named_with_the_closest_known_one():
    from ansible_collections.zeromib.gpu.plugins.plugin_utils._gate import NOT_OPTIONS
    from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_vars import unknown_variables
    spec = {"free_gpus_services": {}, "free_gpus_kill_timeout": {}, "free_gpus_gpus": {}}
    names = ["free_gpus_sevices", "free_gpus_services", "free_gpus_result", "free_gpus_hosts", "free_gpus_zzz_qqq", "other_var"]
    assert unknown_variables(names, spec, not_options=NOT_OPTIONS) == [
        "free_gpus_sevices is not a variable of the zeromib.gpu.free_gpus role; did you mean free_gpus_services?",
        "free_gpus_zzz_qqq is not a variable of the zeromib.gpu.free_gpus role (its variables: meta/argument_specs.yml)",
    ]


def test_the_gate_checks_the_roles_numbers_with_the_modules_range_check():
    from ansible_collections.zeromib.gpu.plugins.plugin_utils._play_settings import range_problems
    assert range_problems({"free_gpus_wait_timeout": float("nan"), "free_gpus_expected_count": -1, "free_gpus_gpus": ["\u00b2"]}) == [
        "free_gpus_expected_count must be at least 0, got -1", "free_gpus_wait_timeout must be a finite number, got nan"]
    assert range_problems({"free_gpus_kill_timeout": 0.0, "free_gpus_max_used_mib": 64}) == []


@pytest.mark.parametrize("name", ["timeout", "kill_timeout", "wait_timeout", "poll_interval", "settle_timeout"])
def test_the_gate_bounds_every_time_variable_of_the_role(name):
    from ansible_collections.zeromib.gpu.plugins.plugin_utils._play_settings import range_problems
    assert range_problems({"free_gpus_" + name: 1e10}) == [f"free_gpus_{name} must be at most 86400 seconds (one day), got 10000000000.0"]
    assert range_problems({"free_gpus_" + name: float("inf")}) == [f"free_gpus_{name} must be at most 86400 seconds (one day), got inf"]
    assert range_problems({"free_gpus_xid_window_hours": 1e10}) == ["free_gpus_xid_window_hours must be at most 8760 hours (one year), got 10000000000.0"]


# --------------------------------------------------------------------------- the task: ActionModule.run


def _gate(task_vars=None, check_mode=False, module_result=None, **variables):
    from ansible_collections.zeromib.gpu.plugins.action.free_gpus_gate import ActionModule
    from ansible_collections.zeromib.gpu.tests.unit.plugins.action.action_harness import ROLE_PATH, action

    task_vars = dict({"role_path": ROLE_PATH, "inventory_hostname": "node01"} if task_vars is None else task_vars, **variables)
    plugin = action(ActionModule, task_vars, check_mode=check_mode, module_result=module_result)
    return plugin, task_vars


def _released(clean=True, **kw):
    result = release(clean=clean, released=clean)
    result.update({"changed": not clean, "gpus_before": result["gpus"], "elapsed_s": 0.2, "holders": []}, **kw)
    return result


def test_the_gate_outside_its_role_fails_saying_where_it_runs():
    from ansible.errors import AnsibleActionFail

    plugin, task_vars = _gate(task_vars={"inventory_hostname": "node01"})
    with pytest.raises(AnsibleActionFail, match="runs inside the zeromib.gpu.free_gpus role only"):
        plugin.run(task_vars=task_vars)
    assert plugin.module.calls == []


def test_a_variable_of_the_wrong_type_is_recorded_in_the_users_words_and_runs_nothing():
    plugin, task_vars = _gate(free_gpus_kill_timeout="soon")
    result = plugin.run(task_vars=task_vars)
    # One line in the user's words (issue 32), not the validator's "is of type str and we were unable to convert".
    said = "settings mistake, nothing was done: free_gpus_kill_timeout must be a number of seconds (e.g. 120), got 'soon'"
    # Recorded, not failed: the role's verdict fails the host with it (issue 55: said once).
    assert result["failed"] is False and result["msg"] == said
    assert "Traceback" not in str(result) and plugin.module.calls == []
    outcome = result["ansible_facts"]["free_gpus_result"]
    assert outcome["status"] == "invalid" and outcome["ok"] is False and outcome["message"] == f"node01: {said}"
    assert "argument_spec_data" not in result  # the role's whole spec only with -v


def test_a_number_out_of_range_fails_with_the_modules_words():
    plugin, task_vars = _gate(free_gpus_expected_count=-1)
    result = plugin.run(task_vars=task_vars)
    assert result["msg"] == "settings mistake, nothing was done: free_gpus_expected_count must be at least 0, got -1" and plugin.module.calls == []


def test_a_variable_that_cannot_be_templated_fails_naming_the_undefined_one():
    from ansible.template import trust_as_template

    plugin, task_vars = _gate(free_gpus_kill_timeout=trust_as_template("{{ no_such_variable }}"))
    result = plugin.run(task_vars=task_vars)
    assert result["failed"] is False and result["msg"] == (
        "settings mistake, nothing was done: a free_gpus_* variable cannot be templated: 'no_such_variable' is undefined")
    assert plugin.module.calls == []


def _listing(units):
    """_low_level_execute_command answering `systemctl list-units/list-unit-files` with UNITS (rc 1: None)."""
    calls = []

    def run(cmd, *args, **kwargs):
        calls.append(cmd)
        if units is None:
            return {"rc": 1, "stdout": "", "stderr": "System has not been booted with systemd as init system (PID 1)."}
        return {"rc": 0, "stdout": "".join(f"{u} loaded inactive dead {u}\n" for u in units), "stderr": ""}
    run.calls = calls
    return run


def test_a_misspelled_variable_is_a_settings_mistake_and_nothing_runs():
    # issue 55: typos stop the play (was a warning, and the run went on with the inference servers enabled)
    plugin, task_vars = _gate(module_result=_released(), free_gpus_services=["vllm*.service"], free_gpus_sevices=["x"])
    result = plugin.run(task_vars=task_vars)
    said = ("settings mistake, nothing was done: free_gpus_sevices is not a variable of the zeromib.gpu.free_gpus role; "
            "did you mean free_gpus_services?")
    assert result["failed"] is False and result["msg"] == said and plugin.module.calls == []
    assert result["ansible_facts"]["free_gpus_result"]["status"] == "invalid"


def test_a_typo_beside_a_wrong_type_is_said_with_it_in_one_line():
    # issue 55: every mistake in one pass (the type error alone hid the typo until it was fixed)
    plugin, task_vars = _gate(module_result=_released(), free_gpus_wait_timeout="2m", free_gpus_sevices=["x"])
    result = plugin.run(task_vars=task_vars)
    assert result["msg"] == ("settings mistake, nothing was done: free_gpus_sevices is not a variable of the zeromib.gpu.free_gpus role; "
                             "did you mean free_gpus_services?; free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'")
    assert plugin.module.calls == []


def test_a_clean_host_passes_with_the_outcomes_message_and_its_services_checked_first():
    plugin, task_vars = _gate(module_result=_released(), free_gpus_services=["vllm*.service"], free_gpus_expected_count=2)
    plugin._low_level_execute_command = _listing(["vllm.service", "ssh.service"])
    result = plugin.run(task_vars=task_vars)
    assert "failed" not in result and "failed_checks" not in result and not result["warnings"]
    outcome = result["ansible_facts"]["free_gpus_result"]
    assert result["msg"] == "node01: 2 GPUs free (0 -> 0 MiB) in 0.2 s" == outcome["message"]
    assert outcome["services_matched"] == ["vllm*.service"] and outcome["services_unmatched"] == []
    [call] = plugin.module.calls
    assert call["module_name"] == "zeromib.gpu.gpu_release" and call["module_args"]["services"] == ["vllm*.service"]
    assert "expected_count" not in call["module_args"] and "require_healthy" not in call["module_args"]
    assert len(plugin._low_level_execute_command.calls) == 1, "one listing, one SSH round trip"


def test_a_services_entry_that_matches_nothing_here_holds_the_host_back_for_the_fleet_check():
    plugin, task_vars = _gate(module_result=_released(), free_gpus_services=["vllm.service", "sglang.service"])
    plugin._low_level_execute_command = _listing(["vllm.service", "vllm-v1.service"])
    result = plugin.run(task_vars=task_vars)
    outcome = result["ansible_facts"]["free_gpus_result"]
    assert plugin.module.calls == [], "nothing done before the fleet check"
    assert outcome["status"] == "deferred" and outcome["services_unmatched"] == ["sglang.service"]
    assert outcome["services_matched"] == ["vllm.service"] and result["failed"] is False and not result["changed"]


def test_strict_fails_the_host_for_an_entry_that_matches_nothing_here_or_when_it_cannot_tell():
    plugin, task_vars = _gate(module_result=_released(), free_gpus_services=["vllm-server.service"], free_gpus_strict=True)
    plugin._low_level_execute_command = _listing(["vllm.service", "vllm-v1.service"])
    result = plugin.run(task_vars=task_vars)
    assert result["msg"] == ("settings mistake, nothing was done (free_gpus_strict): free_gpus_services: vllm-server.service matches no unit, "
                             "container or supervisord program on this host; did you mean vllm.service?")
    assert plugin.module.calls == []
    # a host whose system manager cannot be asked: strict cannot vouch for the entry, so nothing is done
    plugin, task_vars = _gate(module_result=_released(), free_gpus_services=["vllm.service"], free_gpus_strict=True)
    plugin._low_level_execute_command = _listing(None)
    result = plugin.run(task_vars=task_vars)
    assert result["msg"].startswith("settings mistake, nothing was done (free_gpus_strict): free_gpus_services: cannot tell which entries "
                                    "exist on this host: systemctl could not list the units (rc 1): System has not been booted with systemd")
    assert plugin.module.calls == []


def test_without_strict_a_host_that_cannot_list_its_units_is_not_held_back_and_vouches_for_nothing():
    plugin, task_vars = _gate(module_result=_released(), free_gpus_services=["vllm.service"])
    plugin._low_level_execute_command = _listing(None)
    outcome = plugin.run(task_vars=task_vars)["ansible_facts"]["free_gpus_result"]
    assert len(plugin.module.calls) == 1 and outcome["services_matched"] == [] and outcome["services_unmatched"] == []


def test_gpu_releases_line_per_host_about_a_glob_that_matches_nothing_goes():
    said = "services: sglang*.service matches no unit on this host"
    plugin, task_vars = _gate(module_result=_released(warnings=[said, "something else"]), free_gpus_services=["sglang*.service"],
                              check_mode=True)
    plugin._low_level_execute_command = _listing(["vllm.service"])
    result = plugin.run(task_vars=task_vars)
    assert result["warnings"] == ["something else"]
    assert result["ansible_facts"]["free_gpus_result"]["services_unmatched"] == ["sglang*.service"], "check mode: recorded, not held back"


def test_a_clean_host_returns_its_gpu_and_holder_records_only_with_verbosity(monkeypatch):
    from ansible.utils.display import Display

    plugin, task_vars = _gate(module_result=_released())
    result = plugin.run(task_vars=task_vars)
    assert not {"gpus", "gpus_before", "holders"} & set(result), sorted(result)
    # What the records say is in free_gpus_result and in the rest of gpu_release's result.
    assert result["released"] is True and result["selected_gpus"] == [0, 1] and result["elapsed_s"] == 0.2
    assert result["ansible_facts"]["free_gpus_result"]["mib_after"] == 0
    monkeypatch.setattr(Display(), "verbosity", 1)
    plugin, task_vars = _gate(module_result=_released())
    result = plugin.run(task_vars=task_vars)
    assert [g["index"] for g in result["gpus"]] == [0, 1] == [g["index"] for g in result["gpus_before"]] and result["holders"] == []


def test_a_dirty_host_is_recorded_with_the_checks_that_failed_and_no_gpu_records():
    dirty = _released(clean=False, failed=True, msg="GPUs still in use after 60.0 s: GPU 0 reads 1024 MiB")
    plugin, task_vars = _gate(module_result=dirty)
    result = plugin.run(task_vars=task_vars)
    assert result["failed"] is False and result["failed_checks"] == ["gpu_release failed", "released", "every selected GPU clean"]
    assert result["msg"] == "node01: GPUs still in use after 60.0 s: GPU 0 reads 1024 MiB"
    assert "gpus" not in result and result["ansible_facts"]["free_gpus_result"]["message"] == result["msg"]
    assert result["ansible_facts"]["free_gpus_result"]["status"] == "dirty"


def test_an_unhealthy_host_fails_unless_the_role_is_told_not_to_require_health():
    plugin, task_vars = _gate(module_result=_released(healthy=False, health_issues=["GPU 0: Xid 79"]))
    result = plugin.run(task_vars=task_vars)
    assert result["failed_checks"] == ["free_gpus_require_healthy"] and result["msg"] == "node01: unhealthy: GPU 0: Xid 79"
    plugin, task_vars = _gate(module_result=_released(healthy=False, health_issues=["GPU 0: Xid 79"]), free_gpus_require_healthy=False)
    assert "failed" not in plugin.run(task_vars=task_vars)


def test_check_mode_passes_a_dirty_host_that_would_be_freed():
    would = _released(clean=False)
    plugin, task_vars = _gate(check_mode=True, module_result=would)
    result = plugin.run(task_vars=task_vars)
    assert "failed" not in result and result["ansible_facts"]["free_gpus_result"]["status"] == "would free"
    assert result["msg"].startswith("node01: 2 GPUs would free (1024 -> 1024 MiB)")


def test_check_mode_fails_a_host_that_cannot_be_read():
    plugin, task_vars = _gate(check_mode=True, module_result={"failed": True, "msg": "nvidia-smi timed out after 10 s"})
    result = plugin.run(task_vars=task_vars)
    assert result["failed_checks"] == ["gpu_release failed"] and result["msg"] == "node01: nvidia-smi timed out after 10 s"
    assert result["ansible_facts"]["free_gpus_result"]["status"] == "failed"


def test_the_gates_documented_failed_checks_are_the_verdicts_checks():
    import yaml

    from ansible_collections.zeromib.gpu.plugins.modules import free_gpus_gate as docs
    from ansible_collections.zeromib.gpu.plugins.plugin_utils._verdict import CHECKS

    described = " ".join(yaml.safe_load(docs.RETURN)["failed_checks"]["description"])
    assert all(f"V({name})" in described for name in CHECKS)
    assert sorted(CHECKS, key=lambda name: described.index(f"V({name})")) == list(CHECKS), "in the verdict's order"
    assert described.count("V(") == len(CHECKS)


def _collector_state_in_child(conn) -> None:
    pause_collector_in_worker()
    conn.send((gc.isenabled(), gc.get_freeze_count() > 0))
    conn.close()


def test_the_collector_is_paused_only_in_a_forked_worker_process() -> None:
    # The test's own process (not a multiprocessing child): left as it is.
    pause_collector_in_worker()
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
    # A forked child, as Ansible's WorkerProcess is: collection off, the inherited heap frozen.
    parent, child = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=_collector_state_in_child, args=(child,))
    process.start()
    enabled, frozen = parent.recv()
    process.join(10)
    assert (enabled, frozen) == (False, True)
    assert gc.isenabled()


# ------------------------------------------------------------------ the gate's bound (issue 57)


def test_the_gates_bound_is_the_sum_of_the_roles_own_timeouts_and_a_margin():
    from ansible_collections.zeromib.gpu.plugins.plugin_utils._gate import gate_bound_s

    defaults = {"free_gpus_timeout": 10, "free_gpus_kill_timeout": 10, "free_gpus_wait_timeout": 60, "free_gpus_settle_timeout": 5}
    assert gate_bound_s(defaults) == 6 * 10 + 2 * 10 + 60 + 5 + 40 == 185
    # The smoke test: cuInit and each GPU, each bounded by free_gpus_timeout (8 GPUs when the count is not set).
    assert gate_bound_s(dict(defaults, free_gpus_smoke_test=True, free_gpus_expected_count=2)) == 185 + 3 * 10
    assert gate_bound_s(dict(defaults, free_gpus_smoke_test=True)) == 185 + 9 * 10
    assert gate_bound_s({}) == 40


def test_a_node_whose_gpu_release_does_not_answer_fails_alone_with_the_bound_in_its_first_words(monkeypatch):
    import time

    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _gate as free_gpus_gate

    def wedged(args):
        time.sleep(30)  # the alarm interrupts it
        return _released()
    monkeypatch.setattr(free_gpus_gate, "GATE_MARGIN_S", 0.3)
    plugin, task_vars = _gate(module_result=wedged, free_gpus_timeout=0.1, free_gpus_kill_timeout=0.1, free_gpus_wait_timeout=0.1,
                              free_gpus_settle_timeout=0)
    started = time.monotonic()
    result = plugin.run(task_vars=task_vars)
    assert time.monotonic() - started < 5
    outcome = result["ansible_facts"]["free_gpus_result"]
    assert result["msg"].startswith("gpu_release did not answer within 1 s, the bound of this host's free_gpus_* timeouts"), result["msg"]
    # Recorded, not failed: the verdict fails the host with it, once.
    assert result["failed"] is False and (outcome["status"], outcome["ok"]) == ("failed", False)
    assert outcome["message"] == "node01: " + result["msg"]
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_an_outer_alarm_set_first_is_kept_and_restored():
    from ansible_collections.zeromib.gpu.plugins.plugin_utils._gate import bounded

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_args: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30)
        with bounded(5):
            assert 4 < signal.getitimer(signal.ITIMER_REAL)[0] <= 5
        assert 25 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30
        # An outer one sooner than the bound: left alone, it stays Ansible's to enforce.
        signal.setitimer(signal.ITIMER_REAL, 2)
        with bounded(5):
            assert signal.getitimer(signal.ITIMER_REAL)[0] <= 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired


# Ansible's local connection (ansible-core 2.19's words) when sudo is not there: the task's error, not the module's result.
NO_SUDO_LOCALLY = "Premature end of stream waiting for become success.\n>>> Standard Error\n/bin/sh: 1: sudo: not found"


def _raises(text):
    from ansible.errors import AnsibleError

    def run(_args):
        raise AnsibleError(text)
    return run


@pytest.mark.parametrize("services", [[], ["vllm.service"]], ids=["gpu_release", "the services look"])
def test_no_sudo_over_a_local_connection_is_said_in_the_roles_words(services):
    """Issue 67: without fact gathering, a host without sudo over the local connection failed the task with
    Ansible's "Premature end of stream waiting for become success"; its outcome now says the cause and the fix."""
    plugin, task_vars = _gate(module_result=_raises(NO_SUDO_LOCALLY), **({"free_gpus_services": services} if services else {}))
    plugin._low_level_execute_command = lambda *_a, **_k: _raises(NO_SUDO_LOCALLY)(None)
    result = plugin.run(task_vars=task_vars)
    if services:
        # the look could not list the units: the entry waits for the fleet check; the release says why (the verdict runs it)
        result = plugin.release({}, plugin._validated(task_vars), task_vars, "node01", {"matched": [], "unmatched": [], "close": {}, "error": "x"})
    message = result["ansible_facts"]["free_gpus_result"]["message"]
    assert message.startswith("node01: the module could not start on this host: /bin/sh: 1: sudo: not found; sudo is not installed"), message
    assert "Premature end of stream" not in message and result["failed"] is False


def test_a_sudo_that_wants_a_password_over_a_local_connection_says_how_to_give_it():
    plugin, task_vars = _gate(module_result=_raises("Premature end of stream waiting for become success or become password prompt.\n"
                                                    ">>> Standard Error\nsudo: a password is required"))
    message = plugin.run(task_vars=task_vars)["ansible_facts"]["free_gpus_result"]["message"]
    assert "sudo: a password is required" in message and "--ask-become-pass (-K)" in message, message


def test_any_other_error_of_ansible_stays_its_own():
    from ansible.errors import AnsibleError

    plugin, task_vars = _gate(module_result=_raises("something else entirely"))
    with pytest.raises(AnsibleError, match="something else entirely"):
        plugin.run(task_vars=task_vars)
