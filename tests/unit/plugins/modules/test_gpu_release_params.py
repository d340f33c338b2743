# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_release's parameter checking, through its main() (nothing on the node is read before it),
and the free_gpus role's argument spec and defaults against gpu_release's argument spec."""

from __future__ import annotations

import os

import pytest
import yaml

from ansible_collections.zeromib.gpu.plugins.action import free_gpus_gate
from ansible_collections.zeromib.gpu.plugins.modules import gpu_release
from ansible_collections.zeromib.gpu.tests.unit.plugins.modules.utils import fail_of

ROLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, os.pardir, os.pardir, "roles", "free_gpus")


@pytest.mark.parametrize("args, msg", [
    ({"kill_timeout": "nan"}, "kill_timeout must be a finite number, got nan"),
    ({"kill_timeout": -1}, "kill_timeout must be at least 0, got -1.0"),
    ({"wait_timeout": "inf"}, "wait_timeout must be a finite number, got inf"),
    ({"poll_interval": 0}, "poll_interval must be greater than 0, got 0.0"),
    ({"timeout": 0}, "timeout must be greater than 0, got 0.0"),
    ({"settle_timeout": -0.5}, "settle_timeout must be at least 0, got -0.5"),
    ({"max_used_mib": -1}, "max_used_mib must be at least 0, got -1"),
    ({"cross_gpu_footprint_mib": -4}, "cross_gpu_footprint_mib must be at least 0, got -4"),
    ({"min_pcie_gen": -1}, "min_pcie_gen must be at least 0, got -1"),
    ({"xid_window_hours": "nan"}, "xid_window_hours must be a finite number, got nan"),
    ({"smoke_test_mib": -1}, "smoke_test_mib must be at least 0, got -1"),
    ({"kill_timeout": "nan", "max_used_mib": -1},
     "kill_timeout must be a finite number, got nan; max_used_mib must be at least 0, got -1"),
    ({"services": ["x" * 300]}, "services: an entry of 300 characters (" + "x" * 40 + "...) is longer than any unit or container name (255)"),
    ({"services": [f"u{i}.service" for i in range(1001)]},
     "services: 1001 entries, more than the 1000 gpu_release accepts: use globs (vllm*.service)"),
], ids=lambda value: str(value)[:40])
def test_a_bad_value_fails_with_the_message_of_the_range_check(monkeypatch, args, msg):
    assert fail_of(gpu_release.main, args, monkeypatch)["msg"] == msg


def test_a_bad_regular_expression_is_named_with_its_option(monkeypatch):
    msg = fail_of(gpu_release.main, {"match": ["vllm", "(unclosed"]}, monkeypatch)["msg"]
    assert msg.startswith("match: '(unclosed' is not a valid regular expression: ")


@pytest.mark.parametrize("args, option", [
    ({"kill_timeout": "soon"}, "kill_timeout"),
    ({"max_used_mib": "lots"}, "max_used_mib"),
    ({"service_state": "stoped"}, "service_state"),
    ({"dcgm_diag": 5}, "dcgm_diag"),
    ({"expected_mig_mode": "on"}, "expected_mig_mode"),
    ({"xid_ignore": ["seventy-nine"]}, "xid_ignore"),
    ({"kill_timout": 5}, "kill_timout"),
])
def test_a_value_of_the_wrong_type_or_choice_is_refused_by_the_argument_spec_naming_the_option(monkeypatch, args, option):
    result = fail_of(gpu_release.main, args, monkeypatch)
    assert option in result["msg"] and "Traceback" not in result["msg"] and "exception" not in result


# ------------------------------------------------------------------ the role against the module

def _role_spec():
    with open(os.path.join(ROLE, "meta", "argument_specs.yml")) as handle:
        return yaml.safe_load(handle)["argument_specs"]["main"]["options"]


def _role_defaults():
    with open(os.path.join(ROLE, "defaults", "main.yml")) as handle:
        return yaml.safe_load(handle)


def _passed_through():
    """free_gpus_X -> X for every role variable the gate hands to gpu_release."""
    return {name: name[len(free_gpus_gate.ROLE_PREFIX):] for name in _role_spec() if name not in free_gpus_gate.GATE_ONLY}


def test_the_role_passes_through_only_options_gpu_release_has():
    assert sorted(option for option in _passed_through().values() if option not in gpu_release.ARGUMENT_SPEC) == []


@pytest.mark.parametrize("name", sorted(_passed_through()))
def test_each_role_variable_has_the_type_default_and_choices_of_its_gpu_release_option(name):
    role, module = _role_spec()[name], gpu_release.ARGUMENT_SPEC[_passed_through()[name]]
    option = _passed_through()[name]
    if option in free_gpus_gate.OMIT_WHEN_EMPTY:
        # Empty in the role means "not given": the gate leaves it out and gpu_release's default
        # (None: search PATH, no MIG check) applies. A path option is a plain string there.
        assert role.get("default") == "" and module.get("default") is None
        assert role.get("type", "str") == "str" and module.get("type") in ("str", "path")
        assert [c for c in role.get("choices") or [] if c != ""] == (module.get("choices") or [])
        return
    assert role.get("type", "str") == module.get("type", "str")
    assert role.get("elements") == module.get("elements")
    assert role.get("choices") == module.get("choices")
    assert role.get("default") == module.get("default")


def test_the_role_defaults_are_its_argument_spec_defaults():
    spec, defaults = _role_spec(), _role_defaults()
    assert sorted(defaults) == sorted(spec)
    assert {name: value for name, value in defaults.items() if value != spec[name].get("default")} == {}


def test_zero_kill_and_wait_timeouts_pass_the_checks_and_the_run_goes_on_to_nvidia_smi(monkeypatch):
    # 0 is meaningful (SIGKILL at once, one reading): the message says "at least 0", and 0 is let through.
    result = fail_of(gpu_release.main, {"kill_timeout": 0, "wait_timeout": 0, "nvidia_smi": "/nonexistent/nvidia-smi"}, monkeypatch)
    assert result["msg"] == "nvidia-smi not found or not executable at /nonexistent/nvidia-smi"
