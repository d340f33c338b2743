# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The training-ready profile: settings an inference side leaves on a GPU that reads 0 MiB.

A GPU in EXCLUSIVE_PROCESS or PROHIBITED compute mode fails a second process ("all CUDA-capable
devices are busy or unavailable": multi-process training, the collection's own smoke test); a
power limit below the default, application clocks off their defaults or clocks locked by a user
slow the job that follows (issue 71). Every reading comes from the one --query-gpu call the look
makes already (_nvidia_smi.READY_FIELDS): no call of its own. Pure: records in, sentences out.

nvidia-smi has no query field for a clock lock (nvidia-smi -lgc/-lmc; R580's --help-query-gpu): a
lock is seen through NVML's "user defined clocks" event reason, which nvidia-smi prints as
clocks_event_reasons.applications_clocks_setting (NVML: nvmlClocksThrottleReasonUserDefinedClocks
is nvmlClocksThrottleReasonApplicationsClocksSetting), and only while it holds the clocks down.
"""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._options import ready_profile_problems as profile_problems

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Gpu

# The compute modes a profile may ask for, and the check of a given profile (profile_problems), are
# _options' (READY_COMPUTE_MODES, ready_profile_problems): the option check runs on the controller too.
SPELLED = {"default": "Default", "exclusive_process": "Exclusive_Process", "prohibited": "Prohibited"}
ANY = "any"
# The profile when none is given: what a training job started on a freed node expects.
DEFAULT_PROFILE = {"compute_mode": "default", "clocks": "default", "power_limit": "default"}
# Below the default by less than this is the driver's rounding (700.00 W vs 699.99 W), not a setting.
POWER_SLACK_W = 1.0

# The profile's checks (values of health_unchecked) and the record keys each rests on.
CHECK_KEYS = (
    ("compute_mode", ("compute_mode",)),
    ("clock_settings", ("app_clocks_graphics_mhz", "app_clocks_graphics_default_mhz", "app_clocks_memory_mhz",
                        "app_clocks_memory_default_mhz", "clocks_user_limited")),
    ("power_limit", ("power_limit_w", "power_default_limit_w")),
    ("ecc_mode", ("ecc_mode", "ecc_mode_pending")),
)


class Profile:
    """What a GPU must read to be ready for the next job. `any` skips a setting."""

    def __init__(self, compute_mode: str = "default", clocks: str = "default", power_limit: str | float = "default") -> None:
        self.compute_mode = str(compute_mode).lower()
        self.clocks = str(clocks).lower()
        self.power_limit: str | float = power_limit if isinstance(power_limit, float) else str(power_limit).lower()

    @classmethod
    def from_params(cls, given: t.Mapping[str, t.Any] | None) -> Profile:
        """The ready_profile option (None: the default profile; a key left out keeps its default).
        Raises ValueError with the sentence to say for a value it cannot take."""
        problems = profile_problems(given)
        if problems:
            raise ValueError("; ".join(problems))
        merged = dict(DEFAULT_PROFILE, **{k: v for k, v in (given or {}).items() if v is not None})
        power = str(merged["power_limit"]).strip().lower()
        return cls(merged["compute_mode"], merged["clocks"], power if power in (ANY, "default") else float(power))

    def record(self) -> dict[str, t.Any]:
        return {"compute_mode": self.compute_mode, "clocks": self.clocks, "power_limit": self.power_limit}


def _word(value: t.Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text if text and text.lower() not in ("n/a", "not supported") else None


def _active(value: t.Any) -> bool:
    return (_word(value) or "").lower() == "active"


def _index(gpu: Gpu) -> str:
    return str(gpu.get("index", "N"))


def readings(gpu: Gpu) -> dict[str, t.Any]:
    """The profile's readings of one GPU record, as gpu_facts' `health.ready` shows them."""
    return {
        "compute_mode": gpu.get("compute_mode"),
        "power_limit_w": gpu.get("power_limit_w"),
        "power_default_limit_w": gpu.get("power_default_limit_w"),
        "app_clocks_graphics_mhz": gpu.get("app_clocks_graphics_mhz"),
        "app_clocks_graphics_default_mhz": gpu.get("app_clocks_graphics_default_mhz"),
        "app_clocks_memory_mhz": gpu.get("app_clocks_memory_mhz"),
        "app_clocks_memory_default_mhz": gpu.get("app_clocks_memory_default_mhz"),
        "clocks_user_limited": _active(gpu.get("clocks_user_limited")) if _word(gpu.get("clocks_user_limited")) else None,
        "ecc_mode": gpu.get("ecc_mode"),
        "ecc_mode_pending": gpu.get("ecc_mode_pending"),
        "utilization_gpu_pct": gpu.get("utilization_gpu_pct"),
        "power_draw_w": gpu.get("power_draw_w"),
    }


def compute_mode_issue(gpu: Gpu, profile: Profile) -> str | None:
    mode = _word(gpu.get("compute_mode"))
    if profile.compute_mode == ANY or mode is None or mode.lower() == profile.compute_mode:
        return None
    cure = f"nvidia-smi -i {_index(gpu)} -c {profile.compute_mode.upper()} sets it"
    busy = (": a second CUDA process on it (multi-process training, the smoke test) fails with \"all CUDA-capable devices are busy or "
            "unavailable\"") if mode.lower() != "default" else ""
    return f"compute mode is {mode}, expected {SPELLED.get(profile.compute_mode, profile.compute_mode)}{busy}; {cure}"


def clock_issues(gpu: Gpu, profile: Profile) -> list[str]:
    """Application clocks off their defaults; clocks held by a user setting (a lock or application clocks)."""
    if profile.clocks == ANY:
        return []
    issues = []
    for part, short in (("graphics", "graphics"), ("memory", "memory")):
        now, default = gpu.get(f"app_clocks_{part}_mhz"), gpu.get(f"app_clocks_{part}_default_mhz")
        if isinstance(now, int) and isinstance(default, int) and now != default:
            issues.append(f"application clocks ({short}) are {now:d} MHz, the default is {default:d} MHz; nvidia-smi -i {_index(gpu)} -rac resets them")
    if not issues and _active(gpu.get("clocks_user_limited")):
        issues.append(f"clocks are held down by a user setting (clocks_event_reasons.applications_clocks_setting is Active: locked clocks or "
                      f"application clocks); nvidia-smi -i {_index(gpu)} -rgc -rmc unlocks them")
    return issues


def power_limit_issue(gpu: Gpu, profile: Profile) -> str | None:
    limit, default = gpu.get("power_limit_w"), gpu.get("power_default_limit_w")
    if profile.power_limit == ANY or not isinstance(limit, float):
        return None
    if profile.power_limit == "default":
        if not isinstance(default, float) or limit >= default - POWER_SLACK_W:
            return None
        return f"power limit is {limit:g} W, below the default {default:g} W; nvidia-smi -i {_index(gpu)} -pl {default:g} sets it back"
    least = t.cast(float, profile.power_limit)
    if limit >= least - POWER_SLACK_W:
        return None
    return f"power limit is {limit:g} W, below the {least:g} W of ready_profile.power_limit"


def ecc_pending_issue(gpu: Gpu) -> str | None:
    mode, pending = _word(gpu.get("ecc_mode")), _word(gpu.get("ecc_mode_pending"))
    if mode is None or pending is None or mode.lower() == pending.lower():
        return None
    return f"an ECC mode change to {pending} is pending: reset the GPU (or reboot) to apply it"


def issues(gpu: Gpu, profile: Profile) -> list[str]:
    """Plain sentences, one per setting off the profile; a value the GPU does not report ([N/A],
    [Requested functionality has been deprecated] for application clocks on Hopper) is no issue."""
    found: list[str | None] = [compute_mode_issue(gpu, profile)]
    found += clock_issues(gpu, profile)
    found += [power_limit_issue(gpu, profile), ecc_pending_issue(gpu)]
    return [issue for issue in found if issue]


def unchecked(gpu: Gpu, profile: Profile, field_of: t.Mapping[str, str]) -> list[tuple[str, str]]:
    """[(check, why)] of the profile's checks the driver could not answer (it rejected the field,
    rc 2: an older driver); a setting the profile skips is never unchecked."""
    rejected = set(gpu.get("_rejected") or ())
    skipped = {"compute_mode": profile.compute_mode == ANY, "clock_settings": profile.clocks == ANY, "power_limit": profile.power_limit == ANY}
    found = []
    for name, keys in CHECK_KEYS:
        fields = [field_of[key] for key in keys if field_of.get(key) in rejected]
        if fields and not skipped.get(name):
            found.append((name, "the driver does not know {}".format(", ".join(fields))))
    return found
