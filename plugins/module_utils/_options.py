# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the plugins of
# zeromib.gpu may use it.

"""The options gpu_facts and gpu_release share, and the one range check of every option.

Ansible's argument spec types a value (`float` accepts "nan" and "inf") but checks no range:
a NaN timeout compares false with everything, so `now >= deadline` never holds and a wait
never ends; a huge one overflows the OS's timers. Every numeric option of the modules, and of
the role's gate, goes through `check` before anything runs: at least RANGES' low end, and for
a time at most its TIME_LIMITS."""

from __future__ import annotations

import math
import typing as t

# Options both modules take, with the same meaning and default.
SHARED_SPEC = dict(
    nvidia_smi=dict(type="path"),
    timeout=dict(type="float", default=10),
    max_used_mib=dict(type="int", default=0),
    cross_gpu_footprint_mib=dict(type="int", default=4),
    protect=dict(type="list", elements="str", default=[]),
    health=dict(type="bool", default=True),
    min_pcie_gen=dict(type="int", default=0),
    min_pcie_width=dict(type="int", default=0),
    require_persistence=dict(type="bool", default=True),
    expected_mig_mode=dict(type="str", choices=["enabled", "disabled"]),
    xid_window_hours=dict(type="float", default=24),
    dcgm_diag=dict(type="int", default=0, choices=[0, 1, 2, 3, 4]),
    xid_ignore=dict(type="list", elements="int", default=[]),
    xid_fatal=dict(type="list", elements="int", default=[]),
    smoke_test=dict(type="bool", default=False),
    smoke_test_mib=dict(type="int", default=1024),
    # _shm.DEFAULT_MIN_FREE_MIB_PER_GPU, with its reason.
    shm_min_free_mib_per_gpu=dict(type="int", default=128),
    # The training-ready profile (_look/_readiness.py): not given, the default one.
    # No default ({} would be one dict object that Ansible fills in place, shared by every caller).
    ready_profile=dict(type="dict", options=dict(
        compute_mode=dict(type="str", default="default", choices=["default", "exclusive_process", "prohibited", "any"]),
        clocks=dict(type="str", default="default", choices=["default", "any"]),
        power_limit=dict(type="str", default="default"),
    )),
)

# option -> the smallest value it accepts, and whether that bound itself is allowed.
# 0 is a meaningful kill_timeout (SIGKILL at once) and wait_timeout (one reading); a 0 timeout or
# poll_interval would never let nvidia-smi answer or would spin.
RANGES = {
    "timeout": (0, False),
    "poll_interval": (0, False),
    "kill_timeout": (0, True),
    "wait_timeout": (0, True),
    "max_used_mib": (0, True),
    "cross_gpu_footprint_mib": (0, True),
    "min_pcie_gen": (0, True),
    "min_pcie_width": (0, True),
    "xid_window_hours": (0, True),
    "expected_count": (0, True),
    "smoke_test_mib": (0, True),
    "shm_min_free_mib_per_gpu": (0, True),
    "settle_timeout": (0, True),
    # gpu_restore: every step (a systemctl call, a container start) must be given some time.
    "step_timeout": (0, False),
    "wait_for_gpus": (0, True),
}

# option -> the most it accepts, in its own unit (seconds; xid_window_hours in hours), and how the
# message says it. Every option that is a time has its bound here: past it, deadlines overflow
# what the OS takes (`timeout: 1e10` ended in an OverflowError from a subprocess wait), and no
# GPU needs a longer wait than a day.
ONE_DAY_S = 86400
TIME_LIMITS = {
    "timeout": (ONE_DAY_S, "one day"),
    "kill_timeout": (ONE_DAY_S, "one day"),
    "wait_timeout": (ONE_DAY_S, "one day"),
    "poll_interval": (ONE_DAY_S, "one day"),
    "settle_timeout": (ONE_DAY_S, "one day"),
    "step_timeout": (ONE_DAY_S, "one day"),
    "wait_for_gpus": (ONE_DAY_S, "one day"),
    # A window over the kernel log, not a wait: a year of it is more than any node's uptime between reboots.
    "xid_window_hours": (8760, "one year"),
}

# systemd refuses unit names longer than 255 characters (UNIT_NAME_MAX); the count keeps every
# systemctl command line far below the kernel's limit on arguments (no "Argument list too long").
MAX_SERVICES = 1000
MAX_SERVICE_LEN = 255


def range_problem(name: str, value: t.Any) -> str | None:
    """A sentence saying what is wrong with one numeric option, or None."""
    if value is None or name not in RANGES or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return f"{name} must be a number, got {value!r}"
    except OverflowError:  # an integer past any float (10**400): no option takes it
        return f"{name} must be a number that fits a float, got an integer of {len(str(abs(int(value)))):d} digits"
    # An infinite time is told its bound (below); any other NaN or infinity is no number to check.
    if math.isnan(number) or (math.isinf(number) and name not in TIME_LIMITS):
        return f"{name} must be a finite number, got {value}"
    low, inclusive = RANGES[name]
    if number < low or (number == low and not inclusive):
        return "{} must be {} {}, got {}".format(name, "at least" if inclusive else "greater than", low, value)
    if name in TIME_LIMITS and number > TIME_LIMITS[name][0]:
        most, words = TIME_LIMITS[name]
        unit = "hours" if name.endswith("_hours") else "seconds"
        return f"{name} must be at most {most:d} {unit} ({words}), got {value}"
    return None


def services_problem(services: t.Sequence[str] | None) -> str | None:
    """A sentence when `services` is more than systemctl can be given, or None."""
    services = services or []
    if len(services) > MAX_SERVICES:
        return f"services: {len(services):d} entries, more than the {MAX_SERVICES:d} gpu_release accepts: use globs (vllm*.service)"
    for entry in services:
        if len(entry) > MAX_SERVICE_LEN + len("container:"):
            return f"services: an entry of {len(entry):d} characters ({entry[:40]}...) is longer than any unit or container name ({MAX_SERVICE_LEN:d})"
    return None


# nvidia-smi's compute modes a ready_profile may ask for (lower case; _look/_readiness.py).
READY_COMPUTE_MODES = ("default", "exclusive_process", "prohibited")


def ready_profile_problems(given: t.Any, name: str = "ready_profile") -> list[str]:
    """One sentence per mistake in a ready_profile value (the module's spec checks its own; the
    Slurm prolog's JSON config comes here unchecked). The profile itself: _look/_readiness.py."""
    if given is None:
        return []
    if not isinstance(given, dict):
        return [f"{name} must be a mapping (compute_mode, clocks, power_limit), got {given!r}"]
    known = {"compute_mode", "clocks", "power_limit"}
    problems = [f"{name}: unknown key {key!r} (known: compute_mode, clocks, power_limit)" for key in sorted(set(given) - known)]
    mode = given.get("compute_mode")
    if mode is not None and str(mode).lower() not in READY_COMPUTE_MODES + ("any",):
        problems.append(f"{name}.compute_mode must be one of default, exclusive_process, prohibited, any; got {mode!r}")
    clocks = given.get("clocks")
    if clocks is not None and str(clocks).lower() not in ("default", "any"):
        problems.append(f"{name}.clocks must be default or any, got {clocks!r}")
    power = given.get("power_limit")
    if power is not None and not isinstance(power, bool) and str(power).strip().lower() not in ("default", "any"):
        try:
            watts = float(str(power))
        except ValueError:
            watts = float("nan")
        if math.isnan(watts) or math.isinf(watts) or watts <= 0:
            problems.append(f"{name}.power_limit must be default, any or the least watts a GPU may be limited to (e.g. 300), got {power!r}")
    elif isinstance(power, bool):
        problems.append(f"{name}.power_limit must be default, any or a number of watts, got {power!r}")
    return problems


def check(params: t.Mapping[str, t.Any], prefix: str = "") -> list[str]:
    """Every problem of the numeric options and of `services` in `params` -> a list of sentences
    (empty: fine). `prefix` names the options as the user wrote them (the role's free_gpus_)."""
    problems = []
    for name in sorted(params):
        problem = range_problem(name, params[name])
        if problem:
            problems.append(prefix + problem)
    if "ready_profile" in params:
        problems.extend(prefix + problem for problem in ready_profile_problems(params["ready_profile"]))
    if "services" in params:
        problem = services_problem(params["services"])
        if problem:
            problems.append(prefix + problem)
    return problems


def baseline_with_margin(mib: int) -> int:
    """The max_used_mib to set for a GPU whose idle baseline reads MIB: the next multiple of 16 with
    at least 4 MiB to spare (55 -> 64: MIG GPUs read 50-59 MiB idle). The exact reading would fail
    the host again the day its GPU reads 1 MiB more. gpu_release, the free_gpus role and the audit
    all advise this value."""
    return -(-(int(mib) + 4) // 16) * 16
