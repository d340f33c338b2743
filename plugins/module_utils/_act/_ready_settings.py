# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Putting a freed GPU's settings back to the training-ready profile, and the inference side's back.

Opt-in (gpu_release's `ready_fix`): once the run has proven the GPUs free, each selected GPU whose
compute mode, power limit, application clocks or clock lock is off the profile (_look/_readiness)
is set to it with nvidia-smi's own setters (-c, -pl, -rac, -rgc/-rmc), and what it read before goes
into the restore record (_record.py, kind `gpu_settings`), so that gpu_restore sets the inference
side's settings back before it starts the inference side's units. A pending ECC mode change needs a
reset and is only reported. A clock lock's range cannot be read (nvidia-smi has no query field for
it): it is unlocked, recorded as "locked", and gpu_restore says it does not lock it again.

Who else controls these settings: root only (every setter needs it; an unprivileged caller reads
"Insufficient Permissions"). The values written come from the driver's own readings (the default
power limit, the default application clocks) and the profile, never from a process's text.
"""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _readiness

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._release import Release
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._health import Health
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi

    Step = t.Dict[str, t.Any]

KIND = "gpu_settings"
# The record's actions of this kind, in the order a release takes them.
ACTIONS = ("compute_mode", "power_limit", "app_clocks", "clock_lock")
# nvidia-smi -c takes these numbers (R580's nvidia-smi -h: 0/DEFAULT, 2/PROHIBITED, 3/EXCLUSIVE_PROCESS).
COMPUTE_MODE_NUMBER = {"default": "0", "prohibited": "2", "exclusive_process": "3"}


def _gpu_id(gpu: t.Mapping[str, t.Any]) -> str:
    return str(gpu.get("uuid"))


def fix_steps(gpu: t.Mapping[str, t.Any], profile: _readiness.Profile) -> list[Step]:
    """The setters that bring one GPU (a gpu_release record, its readings in health.ready) to
    `profile`: [{action, args, before, after}], in ACTIONS order; [] when it is on the profile."""
    ready = (gpu.get("health") or {}).get("ready") or {}
    uuid = _gpu_id(gpu)
    steps: list[Step] = []
    mode = ready.get("compute_mode")
    if profile.compute_mode in COMPUTE_MODE_NUMBER and mode and str(mode).lower() != profile.compute_mode:
        steps.append({"action": "compute_mode", "args": ["-i", uuid, "-c", COMPUTE_MODE_NUMBER[profile.compute_mode]],
                      "before": mode, "after": _readiness.SPELLED[profile.compute_mode]})
    limit, default = ready.get("power_limit_w"), ready.get("power_default_limit_w")
    if isinstance(limit, float) and isinstance(default, float) and profile.power_limit != _readiness.ANY:
        least = default if profile.power_limit == "default" else t.cast(float, profile.power_limit)
        if limit < least - _readiness.POWER_SLACK_W:
            steps.append({"action": "power_limit", "args": ["-i", uuid, "-pl", f"{default:g}"], "before": limit, "after": default})
    if profile.clocks == "default":
        app = {part: ready.get(f"app_clocks_{part}_mhz") for part in ("graphics", "memory")}
        defaults = {part: ready.get(f"app_clocks_{part}_default_mhz") for part in ("graphics", "memory")}
        off = any(isinstance(app[p], int) and isinstance(defaults[p], int) and app[p] != defaults[p] for p in app)
        if off:
            steps.append({"action": "app_clocks", "args": ["-i", uuid, "-rac"], "before": app, "after": defaults})
        elif ready.get("clocks_user_limited"):
            steps.append({"action": "clock_lock", "args": ["-i", uuid, "-rgc", "-rmc"], "before": "locked", "after": "unlocked"})
    return steps


def _said(step: Step) -> str:
    words = {"compute_mode": "compute mode {before} -> {after}", "power_limit": "power limit {before:g} W -> {after:g} W",
             "app_clocks": "application clocks reset to their defaults", "clock_lock": "clock lock removed"}
    return words[step["action"]].format(**step)


def apply(smi: NvidiaSmi, gpus: t.Sequence[t.Mapping[str, t.Any]], profile: _readiness.Profile,
          at: str | None = None) -> tuple[list[dict[str, t.Any]], list[dict[str, t.Any]], list[str]]:
    """Run the setters of every GPU off the profile. Returns (record entries of what changed, the
    result's `ready_fixed` lines, errors as sentences). A setter that fails is said and skipped; the
    others still run."""
    entries, fixed, errors = [], [], []
    for gpu in gpus:
        done: list[Step] = []
        for step in fix_steps(gpu, profile):
            try:
                smi.run(step["args"])
            except Exception as exc:  # pylint: disable=broad-exception-caught  # NvidiaSmiError and OSError alike: said, not raised
                why = getattr(exc, "msg", str(exc))
                errors.append("GPU {} ({}): nvidia-smi {} failed: {}".format(gpu.get("index"), gpu.get("pci_bus_id"), " ".join(step["args"]), why))
                continue
            done.append(step)
        if not done:
            continue
        fixed.append({"index": gpu.get("index"), "uuid": gpu.get("uuid"), "changes": [_said(s) for s in done],
                      "commands": ["nvidia-smi " + " ".join(s["args"]) for s in done]})
        entries.append({"kind": KIND, "name": gpu.get("uuid"), "index": gpu.get("index"), "pci_bus_id": gpu.get("pci_bus_id"),
                        "actions": [s["action"] for s in done], "before": {s["action"]: s["before"] for s in done},
                        "released_at": at})
    return entries, fixed, errors


def read_again(smi: NvidiaSmi, gpus: t.Sequence[t.Mapping[str, t.Any]], health: Health) -> list[t.Any]:
    """The GPU records with their health read again after the setters (one --query-gpu of the health
    fields for the GPUs fixed and the rest), judged by the same checks; memory keys as they were."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi  # pylint: disable=import-outside-toplevel
    fresh = health.annotate(smi.query_gpus(_nvidia_smi.GPU_FIELDS + _nvidia_smi.HEALTH_FIELDS))
    by_uuid = {gpu.get("uuid"): gpu for gpu in fresh}
    result = []
    for gpu in gpus:
        record = dict(gpu)
        now = t.cast("dict[str, t.Any]", by_uuid.get(gpu.get("uuid")) or {})
        for key in ("healthy", "health_checked", "health_unchecked", "health_issues", "health"):
            if key in now:
                record[key] = now[key]
        result.append(record)
    return result


def after_release(smi: NvidiaSmi, result: dict[str, t.Any], release: Release, record_path: str = _record.PATH) -> dict[str, t.Any]:
    """The result of a release that proved its GPUs free, with its GPUs put back to the profile
    (ready_fixed, ready_fix_errors): what changed recorded for gpu_restore, with the MIG layout of
    the selected GPUs in MIG mode, then read again so that their health says what they read now.
    gpu_release's ready_fix and the Slurm epilog's alike."""
    result = dict(result, ready_fixed=[], ready_fix_errors=[])
    if not result.get("released") or release.health is None:
        return result
    entries, fixed, errors = apply(smi, result["gpus"], release.health.checks.ready_profile, _record.now_iso())
    result.update(ready_fixed=fixed, ready_fix_errors=errors)
    if not entries:
        return result
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts  # pylint: disable=import-outside-toplevel
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mig_layout  # pylint: disable=import-outside-toplevel
    layouts, problems = _mig_layout.record_entries(smi, result["gpus"], result.get("selected_gpus") or [], _record.now_iso())
    result["warnings"] = list(result.get("warnings") or []) + problems
    _record.add(record_path, entries + layouts)
    result["changed"] = True
    result["gpus"] = read_again(smi, result["gpus"], release.health)
    result.update(release.with_shm_floor(_facts.health_summary(result["gpus"], release.health, None)))
    return result


def restore_steps(entry: t.Mapping[str, t.Any]) -> tuple[list[list[str]], list[str], list[str]]:
    """What puts a `gpu_settings` entry's settings back: (nvidia-smi argument lists, the plan's
    words for each, notes of what cannot be put back)."""
    uuid = str(entry.get("name"))
    before = entry.get("before") or {}
    calls, words, notes = [], [], []
    mode = before.get("compute_mode")
    if "compute_mode" in (entry.get("actions") or []) and mode:
        number = COMPUTE_MODE_NUMBER.get(str(mode).lower())
        if number is None:
            notes.append(f"compute mode {mode} is not one nvidia-smi -c sets: set it by hand")
        else:
            calls.append(["-i", uuid, "-c", number])
            words.append(f"compute mode {mode}")
    limit = before.get("power_limit")
    if "power_limit" in (entry.get("actions") or []) and isinstance(limit, (int, float)):
        calls.append(["-i", uuid, "-pl", f"{float(limit):g}"])
        words.append(f"power limit {float(limit):g} W")
    clocks = before.get("app_clocks") or {}
    if "app_clocks" in (entry.get("actions") or []) and isinstance(clocks.get("memory"), int) and isinstance(clocks.get("graphics"), int):
        calls.append(["-i", uuid, "-ac", "{:d},{:d}".format(clocks["memory"], clocks["graphics"])])
        words.append("application clocks {:d},{:d} MHz".format(clocks["memory"], clocks["graphics"]))
    if "clock_lock" in (entry.get("actions") or []):
        notes.append("its clocks were locked (nvidia-smi -lgc/-lmc) to a range nvidia-smi cannot read: not locked again; "
                     "lock them again with nvidia-smi -lgc if the inference side needs it")
    return calls, words, notes


def restore(smi_of: t.Callable[[], NvidiaSmi], entry: t.Mapping[str, t.Any], check_mode: bool) -> tuple[list[str], str | None, list[str]]:
    """Put one entry's settings back: (the plan's words, why it could not be put back or None, notes)."""
    calls, words, notes = restore_steps(entry)
    if check_mode or not calls:
        return words, None, notes
    smi = smi_of()
    for args, said in zip(calls, words):
        try:
            smi.run(args)
        except Exception as exc:  # pylint: disable=broad-exception-caught  # said as the entry's reason, the record kept
            return words, "nvidia-smi {} failed ({}): {}".format(" ".join(args), said, getattr(exc, "msg", str(exc))), notes
    return words, None, notes
