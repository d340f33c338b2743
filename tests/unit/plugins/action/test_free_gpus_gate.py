# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The free_gpus role's verdict (the assert it replaces) and its gpu_release options."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.action.free_gpus_gate import gate_failures, module_args


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
    from ansible_collections.zeromib.gpu.plugins.action.free_gpus_gate import unknown_variables
    spec = {"free_gpus_services": {}, "free_gpus_kill_timeout": {}, "free_gpus_gpus": {}}
    names = ["free_gpus_sevices", "free_gpus_services", "free_gpus_result", "free_gpus_hosts", "free_gpus_zzz_qqq", "other_var"]
    assert unknown_variables(names, spec) == [
        "free_gpus_sevices is not a variable of the zeromib.gpu.free_gpus role and is ignored; did you mean free_gpus_services?",
        "free_gpus_zzz_qqq is not a variable of the zeromib.gpu.free_gpus role and is ignored (its variables: meta/argument_specs.yml)",
    ]


def test_the_gate_checks_the_roles_numbers_with_the_modules_range_check():
    from ansible_collections.zeromib.gpu.plugins.action.free_gpus_gate import range_problems
    assert range_problems({"free_gpus_wait_timeout": float("nan"), "free_gpus_expected_count": -1, "free_gpus_gpus": ["\u00b2"]}) == [
        "free_gpus_expected_count must be at least 0, got -1", "free_gpus_wait_timeout must be a finite number, got nan"]
    assert range_problems({"free_gpus_kill_timeout": 0.0, "free_gpus_max_used_mib": 64}) == []


def test_a_failed_gate_shows_no_gpu_records_and_its_message_once_without_verbosity():
    from ansible_collections.zeromib.gpu.plugins.action.free_gpus_gate import compact
    result = {"failed": True, "msg": "n1: GPU 0 reads 55 MiB", "gpus": [{"index": 0}], "gpus_before": [{"index": 0}], "holders": [],
              "killed": [], "ansible_facts": {"free_gpus_result": {"host": "n1", "message": "n1: GPU 0 reads 55 MiB", "ok": False}}}
    shown = compact(result, 0)
    assert "gpus" not in shown and "gpus_before" not in shown and "holders" not in shown and shown["killed"] == []
    assert str(shown).count("GPU 0 reads 55 MiB") == 1
    assert compact(result, 1) is result  # -v shows everything
