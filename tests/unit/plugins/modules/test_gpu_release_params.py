# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_release's parameter checking, through its main() (nothing on the node is read before it).
The free_gpus role's argument spec against gpu_release's is tests/unit/plugins/action/test_role_spec.py
(it reads the gate's action plugin, controller code that ansible-test runs apart from modules')."""

from __future__ import annotations


import pytest

from ansible_collections.zeromib.gpu.plugins.modules import gpu_release
from ansible_collections.zeromib.gpu.tests.unit.plugins.modules.utils import fail_of


@pytest.mark.parametrize("args, msg", [
    ({"kill_timeout": "nan"}, "kill_timeout must be a finite number, got nan"),
    ({"kill_timeout": -1}, "kill_timeout must be at least 0, got -1.0"),
    ({"wait_timeout": "inf"}, "wait_timeout must be at most 86400 seconds (one day), got inf"),
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


def test_zero_kill_and_wait_timeouts_pass_the_checks_and_the_run_goes_on_to_nvidia_smi(monkeypatch):
    # 0 is meaningful (SIGKILL at once, one reading): the message says "at least 0", and 0 is let through.
    result = fail_of(gpu_release.main, {"kill_timeout": 0, "wait_timeout": 0, "nvidia_smi": "/nonexistent/nvidia-smi"}, monkeypatch)
    assert result["msg"] == "nvidia-smi not found or not executable at /nonexistent/nvidia-smi"
