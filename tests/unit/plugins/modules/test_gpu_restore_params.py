# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_restore's parameter checking, through its main(): nothing is read or restored first."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.modules import gpu_restore
from ansible_collections.zeromib.gpu.tests.unit.plugins.modules.utils import fail_of


@pytest.mark.parametrize("args, msg", [
    ({"step_timeout": 0}, "step_timeout must be greater than 0, got 0.0"),
    ({"step_timeout": -3}, "step_timeout must be greater than 0, got -3.0"),
    ({"step_timeout": "nan"}, "step_timeout must be a finite number, got nan"),
    ({"wait_for_gpus": "soon"}, "wait_for_gpus must be true, false or a number of seconds, got 'soon'"),
    ({"wait_for_gpus": -5}, "wait_for_gpus must be 0 or more seconds, got -5.0"),
    # A NaN or infinite wait never reached its deadline: refused since issue 22; past a day since issue 31.
    ({"wait_for_gpus": "nan"}, "wait_for_gpus must be true, false or a number of seconds, got 'nan'"),
    ({"wait_for_gpus": "inf"}, "wait_for_gpus must be at most 86400 seconds (one day), got inf"),
], ids=lambda value: str(value)[:40])
def test_a_bad_value_fails_naming_the_option(monkeypatch, args, msg):
    result = fail_of(gpu_restore.main, args, monkeypatch)
    assert result["msg"] == msg and "restored" not in result


@pytest.mark.parametrize("args, option", [
    ({"step_timeout": "long"}, "step_timeout"),
    ({"forget": {"a": 1}}, "forget"),
    ({"wait_for_gpu": True}, "wait_for_gpu"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_option(monkeypatch, args, option):
    result = fail_of(gpu_restore.main, args, monkeypatch)
    assert option in result["msg"] and "Traceback" not in result["msg"] and "exception" not in result
