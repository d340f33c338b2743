# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Every time option of every module has an upper bound (_options.TIME_LIMITS), through the
modules' main(): a huge or infinite value fails naming the option and its bound, before anything
runs. Before issue 31, `timeout: 1e10` ended in an uncaught OverflowError."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.modules import gpu_facts, gpu_release, gpu_restore
from ansible_collections.zeromib.gpu.tests.unit.plugins.modules.utils import fail_of

MODULES = {"gpu_facts": gpu_facts, "gpu_release": gpu_release, "gpu_restore": gpu_restore}

# (module, option) for every option that is a time: the seconds or hours of a wait, a poll or a window.
TIME_OPTIONS = [
    ("gpu_facts", "timeout"),
    ("gpu_facts", "xid_window_hours"),
    ("gpu_release", "timeout"),
    ("gpu_release", "kill_timeout"),
    ("gpu_release", "wait_timeout"),
    ("gpu_release", "poll_interval"),
    ("gpu_release", "settle_timeout"),
    ("gpu_release", "xid_window_hours"),
    ("gpu_restore", "step_timeout"),
    ("gpu_restore", "wait_for_gpus"),
]


def looks_like_a_time(name: str) -> bool:
    return name.endswith(("timeout", "_interval", "_hours", "_s")) or name.startswith("wait")


def test_every_time_option_of_every_module_is_in_the_list_and_has_a_bound():
    found = sorted((module, name) for module, mod in MODULES.items() for name in mod.ARGUMENT_SPEC if looks_like_a_time(name))
    assert found == sorted(TIME_OPTIONS)
    assert {name for _module, name in TIME_OPTIONS} == set(_options.TIME_LIMITS)


def bound_message(name: str, value: str) -> str:
    most, words = _options.TIME_LIMITS[name]
    unit = "hours" if name.endswith("_hours") else "seconds"
    return f"{name} must be at most {most:d} {unit} ({words}), got {value}"


@pytest.mark.parametrize("module, name", TIME_OPTIONS, ids=str)
@pytest.mark.parametrize("value, shown", [(1e10, "10000000000.0"), (1e308, "1e+308"), ("inf", "inf"), ("1e10", "10000000000.0")],
                         ids=["1e10", "1e308", "inf", "1e10-as-text"])
def test_a_huge_or_infinite_time_fails_naming_the_option_and_its_bound(monkeypatch, module, name, value, shown):
    result = fail_of(MODULES[module].main, {name: value}, monkeypatch)
    assert result["msg"] == bound_message(name, shown)
    assert "exception" not in result


@pytest.mark.parametrize("module, name", TIME_OPTIONS, ids=str)
@pytest.mark.parametrize("value", ["-inf", "nan", -1e308])
def test_minus_infinity_nan_and_a_huge_negative_fail_naming_the_option(monkeypatch, module, name, value):
    result = fail_of(MODULES[module].main, {name: value}, monkeypatch)
    assert result["msg"].startswith(name + " must be ") and "exception" not in result


@pytest.mark.parametrize("module, name", TIME_OPTIONS, ids=str)
def test_the_bound_itself_passes_the_check(module, name):
    most, _words = _options.TIME_LIMITS[name]
    assert _options.range_problem(name, most) is None


@pytest.mark.parametrize("module, name", [("gpu_release", "max_used_mib"), ("gpu_release", "smoke_test_mib"), ("gpu_facts", "cross_gpu_footprint_mib")],
                         ids=str)
def test_an_integer_past_any_float_fails_naming_the_option_never_a_traceback(monkeypatch, module, name):
    """10**400 passes Ansible's int check and ended in OverflowError from float(). (A float
    option given it fails in ansible-core's own type check, before the module's code.)"""
    result = fail_of(MODULES[module].main, {name: 10 ** 400}, monkeypatch)
    assert result["msg"] == f"{name} must be a number that fits a float, got an integer of 401 digits" and "exception" not in result
