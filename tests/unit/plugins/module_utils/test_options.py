# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The one range check of gpu_facts, gpu_release and the role's gate (issue 21, item 6)."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.modules import gpu_facts
from ansible_collections.zeromib.gpu.plugins.modules import gpu_release


def release_params(**overrides):
    values = {name: spec.get("default") for name, spec in gpu_release.ARGUMENT_SPEC.items()}
    values.update(overrides)
    return values


def facts_params(**overrides):
    values = {name: spec.get("default") for name, spec in gpu_facts.ARGUMENT_SPEC.items()}
    values.update(overrides)
    return values


FLOATS = ["kill_timeout", "wait_timeout", "poll_interval", "timeout", "xid_window_hours"]


@pytest.mark.parametrize("name", FLOATS)
def test_gpu_release_refuses_nan_in_every_float_option(name):
    with pytest.raises(ValueError) as info:
        gpu_release.checked_params(release_params(**{name: float("nan")}))
    assert str(info.value) == f"{name} must be a finite number, got nan"


@pytest.mark.parametrize("name", FLOATS)
def test_an_infinite_time_is_told_its_bounds(name):
    most, words = _options.TIME_LIMITS[name]
    unit = "hours" if name == "xid_window_hours" else "seconds"
    with pytest.raises(ValueError) as info:
        gpu_release.checked_params(release_params(**{name: float("inf")}))
    assert str(info.value) == f"{name} must be at most {most:d} {unit} ({words}), got inf"
    with pytest.raises(ValueError, match=f"^{name} must be (at least|greater than) 0, got -inf$"):
        gpu_release.checked_params(release_params(**{name: float("-inf")}))


def test_a_time_at_its_bound_is_accepted_and_just_past_it_refused():
    assert _options.range_problem("wait_timeout", 86400) is None
    assert _options.range_problem("wait_timeout", 86400.001) == "wait_timeout must be at most 86400 seconds (one day), got 86400.001"
    assert _options.range_problem("xid_window_hours", 8760) is None
    assert _options.range_problem("xid_window_hours", 8761) == "xid_window_hours must be at most 8760 hours (one year), got 8761"


@pytest.mark.parametrize("name", ["timeout", "xid_window_hours"])
def test_gpu_facts_refuses_nan_like_gpu_release(name):
    assert gpu_facts.checked_params(facts_params(**{name: float("nan")})) == f"{name} must be a finite number, got nan"


@pytest.mark.parametrize("name", ["max_used_mib", "cross_gpu_footprint_mib", "min_pcie_gen", "min_pcie_width"])
def test_negative_counts_are_refused_by_both_modules(name):
    assert gpu_facts.checked_params(facts_params(**{name: -1})) == f"{name} must be at least 0, got -1"
    with pytest.raises(ValueError, match=f"{name} must be at least 0, got -1"):
        gpu_release.checked_params(release_params(**{name: -1}))


def test_zero_kill_and_wait_timeouts_are_meaningful_but_zero_timeout_and_poll_interval_are_not():
    assert gpu_release.checked_params(release_params(kill_timeout=0.0, wait_timeout=0.0))
    for name in ("timeout", "poll_interval"):
        with pytest.raises(ValueError, match=f"{name} must be greater than 0, got 0"):
            gpu_release.checked_params(release_params(**{name: 0}))


def test_the_gate_names_options_as_the_role_does():
    assert _options.check({"kill_timeout": float("nan"), "expected_count": -2}, "free_gpus_") == [
        "free_gpus_expected_count must be at least 0, got -2", "free_gpus_kill_timeout must be a finite number, got nan"]


def test_twenty_thousand_services_are_refused_with_the_limit_not_argument_list_too_long():
    with pytest.raises(ValueError) as info:
        gpu_release.checked_params(release_params(services=[f"unit-{i:05d}-{'x' * 200}.service" for i in range(20000)]))
    assert "20000 entries, more than the 1000 gpu_release accepts" in str(info.value)
    with pytest.raises(ValueError, match="longer than any unit or container name"):
        gpu_release.checked_params(release_params(services=["x" * 5000]))
    assert gpu_release.checked_params(release_params(services=[f"u{i:d}.service" for i in range(1000)]))


def test_both_modules_share_one_spec_for_their_common_options():
    for name, spec in _options.SHARED_SPEC.items():
        assert gpu_facts.ARGUMENT_SPEC[name] == spec, name
        assert gpu_release.ARGUMENT_SPEC[name] == spec, name
