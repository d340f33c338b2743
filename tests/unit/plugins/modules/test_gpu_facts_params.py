# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_facts' parameter checking, through its main(): the range check of gpu_release, before
nvidia-smi is looked for."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.modules import gpu_facts
from ansible_collections.zeromib.gpu.tests.unit.plugins.modules.utils import fail_of


@pytest.mark.parametrize("args, msg", [
    # gpu_facts accepted a negative max_used_mib before the range check was shared (issue 22).
    ({"max_used_mib": -1}, "max_used_mib must be at least 0, got -1"),
    ({"cross_gpu_footprint_mib": -1}, "cross_gpu_footprint_mib must be at least 0, got -1"),
    ({"timeout": 0}, "timeout must be greater than 0, got 0.0"),
    ({"timeout": "nan"}, "timeout must be a finite number, got nan"),
    ({"xid_window_hours": "-inf"}, "xid_window_hours must be at least 0, got -inf"),
    ({"min_pcie_width": -16}, "min_pcie_width must be at least 0, got -16"),
    ({"smoke_test_mib": -1}, "smoke_test_mib must be at least 0, got -1"),
], ids=lambda value: str(value)[:40])
def test_a_bad_value_fails_with_the_message_of_the_range_check(monkeypatch, args, msg):
    result = fail_of(gpu_facts.main, args, monkeypatch)
    assert result["msg"] == msg and "ansible_facts" not in result


@pytest.mark.parametrize("args, option", [
    ({"timeout": "ten"}, "timeout"),
    ({"processes": "maybe"}, "processes"),
    ({"expected_mig_mode": "on"}, "expected_mig_mode"),
    ({"dcgm_diag": 9}, "dcgm_diag"),
    ({"xid_fatal": ["x"]}, "xid_fatal"),
    ({"max_used": 0}, "max_used"),
])
def test_a_value_of_the_wrong_type_or_choice_is_refused_naming_the_option(monkeypatch, args, option):
    result = fail_of(gpu_facts.main, args, monkeypatch)
    assert option in result["msg"] and "Traceback" not in result["msg"] and "exception" not in result
