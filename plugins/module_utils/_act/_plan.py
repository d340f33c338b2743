# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""gpu_release's plan room: pure steps from the look's readings to what the run is to do (the
GPUs selected, the holders to signal, what spans the selection, idle baselines), the result
before anything is done, the diff, and the Plan the later steps read. No reading, no acting."""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _signals
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import normalize_bus_id

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._guest_units import GuestPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._supervisor import ProgramPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._units import UnitPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, DriverGpu, Gpu, Holder, ReleaseResult

# A GPU that no process holds and that reads this little (or is in MIG mode) is taken for its
# idle baseline: MIG-enabled H100/H200/A100 read 50-59 MiB idle (public reports, the fleet's
# simulated A100 MIG host reads 55 MiB).
BASELINE_MAX_MIB = 64


def select_gpus(gpus: list[Gpu], wanted: t.Iterable[t.Any] | None, not_visible: t.Sequence[DriverGpu] = ()) -> list[int]:
    """`gpus` option (indexes or UUIDs) -> sorted indexes. Empty/None selects all. `not_visible`:
    the driver's GPUs this namespace cannot reach (_facts.not_visible_gpus), which a request may
    name (by UUID or bus id) but never select."""
    if not wanted:
        return sorted(gpu["index"] for gpu in gpus)
    by_uuid = {gpu["uuid"].lower(): gpu["index"] for gpu in gpus if gpu.get("uuid")}
    indexes = {gpu["index"] for gpu in gpus}
    selected = set()
    for item in wanted:
        text = str(item).strip()
        if text.isdigit() and text.isascii() and int(text) in indexes:
            selected.add(int(text))
        elif text.lower() in by_uuid:
            selected.add(by_uuid[text.lower()])
        else:
            # Matched without case, said as nvidia-smi prints it: the user copies it from there.
            uuids = [gpu["uuid"] for gpu in sorted(gpus, key=lambda g: g["index"]) if gpu.get("uuid")]
            raise StepFailed(unknown_gpu_message(text, sorted(indexes), uuids, not_visible))
    return sorted(selected)


def unknown_gpu_message(text: str, indexes: list[int], uuids: list[str], not_visible: t.Sequence[DriverGpu]) -> str:
    """Why `text` in the gpus option selects nothing: a GPU of the driver this namespace cannot
    reach (named by UUID or bus id, or an index beyond what nvidia-smi shows here), or none at all."""
    here = "nvidia-smi here shows indexes {} and UUIDs {}".format(", ".join(str(i) for i in indexes) or "none", ", ".join(uuids) or "none")
    named = [gpu for gpu in not_visible if text.lower() in ((gpu.get("uuid") or "").lower(), gpu["bus"]) or normalize_bus_id(text) == gpu["bus"]]
    if named:
        gpu = named[0]
        return (f"GPU {text} is not visible on this node: the driver lists it (bus {gpu['bus']}, UUID {gpu.get('uuid') or 'unknown'}) but this "
                f"namespace cannot open its device node /dev/nvidia{gpu['minor']} (a container, job or device cgroup given other GPUs); {here}")
    if not_visible and text.isdigit():
        others = "GPU ({}) has".format(not_visible[0]["bus"]) if len(not_visible) == 1 else "{:d} GPUs ({}) have".format(
            len(not_visible), ", ".join(g["bus"] for g in not_visible))
        return (f"GPU {text} is not visible on this node: {here}, numbered from 0 in this namespace; the driver's other {others} no device "
                "node it can open (a container, job or device cgroup given only some GPUs)")
    return "GPU {!r} is not on this host: it has indexes {} and UUIDs {}".format(text, ", ".join(str(i) for i in indexes), ", ".join(uuids) or "none")


def matches_any(holder: Holder, regexes: t.Iterable[t.Pattern[str]]) -> bool:
    return any(regex.search(holder.get("cmdline") or "") for regex in regexes)


SPARED_INIT = "init of a PID namespace whose other processes may not be ended"


def plan_targets(holders: list[Holder], selected: list[int], regexes: t.Sequence[t.Pattern[str]], kill_spanning: bool = False
                 ) -> tuple[list[Holder], list[Holder]]:
    """(to signal, protected holders of the selected GPUs). A holder is signalled for the GPUs it
    uses (see _attribution: an undecided one only when every GPU it may use is selected, a
    spanning one only with kill_spanning); `match` narrows that, and an NVML client is signalled
    only when `match` names it."""
    targets, protected = [], []
    for holder in holders:
        for_selection = _attribution.may_signal_for(holder, selected, kill_spanning)
        named = bool(regexes) and matches_any(holder, regexes)
        if holder["protected"]:
            # Reported when it holds a selected GPU, spanning or not: it is never signalled anyway.
            if _attribution.may_signal_for(holder, selected, kill_spanning=True) or named:
                protected.append(holder)
            continue
        if regexes and not named:
            continue
        if for_selection or (named and holder.get("attribution") == _attribution.NVML_CLIENT):
            targets.append(holder)
    return targets, protected


def spanning_targets(holders: list[Holder], selected: list[int], regexes: t.Sequence[t.Pattern[str]]) -> list[tuple[Holder, list[int]]]:
    """Unprotected holders that freeing `selected` would signal (those `match` names, when set)
    but that also use GPUs outside it: [(holder, outside GPUs)]."""
    found = []
    for holder in _attribution.spanning_for(holders, selected):
        if not holder["protected"] and (not regexes or matches_any(holder, regexes)):
            found.append((holder, _attribution.outside_gpus(holder, selected)))
    return found


def spanning_containers(holders: list[Holder], selected: list[int], stopping: t.Iterable[t.Any]) -> list[dict[str, t.Any]]:
    """Containers planned to be stopped because they hold a selected GPU, whose processes also
    use GPUs outside the selection: [{container, name, pids, gpu_indexes, outside_gpus}]."""
    found = []
    for entry in stopping:
        if not entry.get("gpu_indexes"):
            continue  # named in services: stopped because the user named it
        inside = [h for h in holders if h.get("container") and h["container"] == entry.get("id")]
        used = set(g for h in inside for g in h.get("gpu_indexes") or [])
        if used - set(selected):
            found.append({"container": entry.get("id"), "name": entry.get("name"), "pids": sorted(h["pid"] for h in inside),
                          "gpu_indexes": sorted(used), "outside_gpus": sorted(used - set(selected))})
    return found


def spanning_record(processes: list[tuple[Holder, list[int]]], units: list[dict[str, t.Any]], containers: list[dict[str, t.Any]],
                    programs: t.Sequence[dict[str, t.Any]] = ()) -> list[dict[str, t.Any]]:
    """The `spanning` return value: what uses a selected GPU and GPUs outside the selection
    (`programs`: copies of a supervisord program, _supervisor.spanning_copies)."""
    record = [
        {"pid": h["pid"], "name": h.get("name"), "cmdline": h.get("cmdline"), "unit": h.get("unit"), "container": h.get("container"),
         "pids": [h["pid"]], "gpu_indexes": list(h.get("gpu_indexes") or []), "outside_gpus": outside}
        for h, outside in processes
    ]
    record += [dict(u, pid=None, name=None, cmdline=None, container=None) for u in units]
    record += [{"pid": None, "name": c.get("name"), "cmdline": None, "unit": None, "container": c["container"], "pids": c["pids"],
                "gpu_indexes": c["gpu_indexes"], "outside_gpus": c["outside_gpus"]} for c in containers]
    record += [{"pid": None, "name": p["program"], "cmdline": None, "unit": None, "container": None, "program": p["program"], "pids": p["pids"],
                "gpu_indexes": p["gpu_indexes"], "outside_gpus": p["outside_gpus"]} for p in programs]
    return record


def trust_notes(holders: list[Holder], selected: list[int]) -> list[str]:
    """Notes on holders of the selected GPUs that a name or a cgroup path could have passed off as
    something they are not (see docs/docsite/rst/guide_security.rst)."""
    notes = []
    for holder in holders:
        if not _attribution.may_signal_for(holder, selected):
            continue
        for note in (holder.get("protection_note"), holder.get("container_note")):
            if note and note not in notes:
                notes.append(note)
    return notes


def is_mig(gpu: Gpu) -> bool:
    return str(gpu.get("mig_mode") or "").lower() == "enabled"


def is_idle_baseline(gpu: Gpu) -> bool:
    """A small steady reading that no process explains: MIG's 50-59 MiB, or a few MiB of a
    desktop GPU. The caller has checked that nothing holds the GPU."""
    used = gpu.get("memory_used_mib")
    return used is not None and (used <= BASELINE_MAX_MIB or (is_mig(gpu) and used <= 2 * BASELINE_MAX_MIB))


def unheld(dirty: list[Gpu], holders: list[Holder], apps: list[ComputeApp]) -> list[Gpu]:
    """The dirty GPUs that no process holds: no holder uses (or may use) them and no live
    process is listed on them. Waiting frees such a GPU only when a process exited just before."""
    live_claims = {a.get("gpu_index") for a in apps if a.get("alive")}
    held = set(live_claims)
    for holder in holders:
        held.update(holder["gpu_indexes"])
        held.update(holder.get("candidate_gpu_indexes") or [])
    return [g for g in dirty if g["index"] not in held]


def only_protected(dirty: list[Gpu], holders: list[Holder], apps: list[ComputeApp]) -> bool:
    """True when waiting cannot help: on every dirty GPU no unprotected process holds it and
    nvidia-smi attributes its memory only to live protected processes. A GPU whose memory
    no app claims (a context being released right now) is never decided here."""
    protected_pids = {h["pid"] for h in holders if h["protected"]}
    for gpu in dirty:
        if any(not h["protected"] for h in holders if gpu["index"] in h["gpu_indexes"]):
            return False
        claims = [a for a in apps if a.get("gpu_index") == gpu["index"]]
        if not claims or any(not a.get("alive") or a["pid"] not in protected_pids for a in claims):
            return False
    return True


def undecided_record(holders: list[Holder]) -> list[dict[str, t.Any]]:
    """The `undecided` return value: holders that may use a selected GPU, not signalled."""
    return [
        {"pid": h["pid"], "name": h.get("name"), "cmdline": h.get("cmdline"), "candidate_gpu_indexes": h.get("candidate_gpu_indexes")}
        for h in holders
    ]


def _container_names(entries: t.Iterable[t.Any] | None) -> list[str]:
    if not entries:
        return []
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers
    return [_containers.describe_entry(c) for c in entries]


def plan_diff(result: ReleaseResult, check_mode: bool) -> tuple[list[str], list[str]]:
    """(before, after) lines for the units, containers and processes the run acts on: their state
    before, and after (or, in check mode, what the real run would leave)."""
    before, after = [], []
    disabled = set(result.get("disabled_units") or [])
    masked = set(result.get("masked_units") or [])
    stopped = list(result.get("stopped_units") or [])
    for unit in stopped + sorted((disabled | masked) - set(stopped)):
        before.append("unit {}: {}".format(unit, "active" if unit in stopped else "enabled"))
        state = "masked" if unit in masked else "disabled" if unit in disabled else None
        after.append("unit {}: {}".format(unit, ", ".join(x for x in ("stopped" if unit in stopped else None, state) if x)))
    stopped_c = _container_names(result.get("stopped_containers"))
    disabled_c = _container_names(result.get("disabled_containers"))
    for name in stopped_c + [c for c in disabled_c if c not in stopped_c]:
        before.append("container {}: {}".format(name, "running" if name in stopped_c else "restart policy set"))
        states = ("stopped" if name in stopped_c else None, "restart policy no" if name in disabled_c else None)
        after.append("container {}: {}".format(name, ", ".join(x for x in states if x)))
    guest_disabled = set(result.get("disabled_guest_units") or []) | set(result.get("masked_guest_units") or [])
    guest_stopped = list(result.get("stopped_guest_units") or [])
    for name in guest_stopped + sorted(guest_disabled - set(guest_stopped)):
        before.append("guest unit {}: {}".format(name, "active" if name in guest_stopped else "enabled"))
        state = "masked" if name in (result.get("masked_guest_units") or []) else "disabled" if name in guest_disabled else None
        after.append("guest unit {}: {}".format(name, ", ".join(x for x in ("stopped" if name in guest_stopped else None, state) if x)))
    for entry in result.get("killed") or []:
        label = "process {} {}".format(entry.get("pid"), entry.get("name"))
        before.append(f"{label}: running")
        after.append("{}: {}".format(label, _signals.planned_signals(entry) if check_mode else "ended by {}".format(entry.get("signal"))))
    for removed in result.get("shm_removed") or []:
        label = "shm {} ({:g} MiB, {})".format(removed["path"], removed["size_mib"], removed["pattern"])
        before.append(f"{label}: held by no process")
        after.append("{}: {}".format(label, "to be removed (clean_shm)" if check_mode else "removed"))
    return before, after


# ---------------------------------------------------------------- the run


STATE_KEYS = {"disabled": "disabled_units", "masked": "masked_units"}


def new_result(state_key: str | None) -> ReleaseResult:
    """The release result before anything is looked at or done."""
    result: ReleaseResult = {
        "changed": False,
        "released": False,
        "stopped_units": [],
        # Units whose stop outlasted kill_timeout, killed through systemd; those it left `failed`.
        "killed_units": [],
        "failed_units": [],
        "launchers": [],
        # The driver's GPUs this namespace cannot reach: not this node's (_facts.not_visible_gpus).
        "not_visible": [],
        # GPUs bound to vfio-pci, given to VMs (_look/_vfio): not this host's to free.
        "given_to_vms": [],
        "stopped_containers": [],
        "disabled_containers": [],
        "stopped_programs": [],
        "disabled_programs": [],
        # A system container's own units, stopped (disabled, masked) through the guest's systemd: `lxc:101:vllm.service`.
        "stopped_guest_units": [],
        "killed_guest_units": [],
        "disabled_guest_units": [],
        "masked_guest_units": [],
        "stopped_mps_servers": [],
        # MPS clients told terminate_client through their server's control daemon before any signal (_mps).
        "terminated_mps_clients": [],
        "killed": [],
        "protected": [],
        # Not "skipped": Ansible reads a result with that key as a skipped task and then
        # ignores failed_when on it.
        "reused_pids": [],
        "unkillable": [],
        "undecided": [],
        # {path, entries} when this run added to the record gpu_restore reads (_record).
        "restore_record": None,
        # Holders of a selected GPU that also use GPUs outside the selection (kill_spanning).
        "spanning": [],
        # Units a glob in services matched but that are never selected by one (reason given).
        "kept_units": [],
        "warnings": [],
        # /dev/shm at the end (_shm: its space, and with clean_shm what no process holds), None when
        # not read (health off and no clean_shm); what clean_shm removed (in check mode, would remove).
        "shm": None,
        "shm_removed": [],
        # The files of killed jobs' patterns clean_shm kept, each with its `why` (_shm_clean.attribute).
        "shm_kept": [],
        "shm_removed_mib": 0.0,
        # {list: how many entries it had} for each list cut to _caps.LIMIT entries (the module's exit).
        "truncated": {},
        "gpus_before": [],
        "gpus": [],
        "holders": [],
        "timings": {"look_s": 0.0, "plan_s": 0.0, "stop_s": 0.0, "kill_s": 0.0, "wait_s": 0.0, "settle_s": 0.0},
    }
    if state_key:
        result[state_key] = []  # type: ignore[literal-required]
    return result


class NoContainers:
    """What _containers.plan returns where no process holds a GPU and services names no
    container: nothing to stop, disable or signal (without loading _containers)."""

    def __init__(self) -> None:
        self.stop: list[t.Any] = []
        self.disable: list[t.Any] = []
        self.not_found: list[str] = []
        self.signal: list[Holder] = []
        self.outside: list[tuple[Holder, str | None]] = []
        self.warnings: list[str] = []

    def __bool__(self) -> bool:
        return False


def no_units() -> UnitPlan:
    """What _units.plan returns for no unit named and none owning a target."""
    return {"stop": [], "disable": [], "mask": [], "not_found": [], "before": {}, "kept_units": [], "warnings": []}


def no_programs() -> ProgramPlan:
    """What plan_programs returns when services names no supervisord program."""
    return {"stop": [], "disable": [], "not_found": [], "warnings": []}


class Plan:
    """What the look found and what the run is to do: made by Release.plan, read by the
    check-mode answer, act and verify."""

    def __init__(self, gpus: list[Gpu], holders: list[Holder], footprint: set[int], hidden: str | None, selected: list[int]) -> None:
        self.gpus = gpus
        self.holders = holders
        # GPUs the look read as clean only through the cross-GPU footprint allowance.
        self.footprint = footprint
        # Why some GPU's memory cannot be read (a warning of _facts), or None.
        self.hidden = hidden
        # How many processes could not be read (not root): a holder may hide among them.
        self.unreadable = 0
        self.selected = selected
        self.targets: list[Holder] = []
        self.mps_servers: list[Holder] = []
        self.containers: t.Any = None
        self.units: UnitPlan | None = None
        self.programs: ProgramPlan | None = None
        # A guest's units named in services, stopped through the guest's systemd (_guest_units).
        self.guests: list[GuestPlan] = []
        self.to_do = False
        self.gpus_clean = False
        self.dirty_before: list[Gpu] = []
        self.unheld_at_look: set[int] = set()
        # The compute apps the look saw ([] when none was needed).
        self.apps: list[ComputeApp] = []

    @property
    def unit_steps(self) -> UnitPlan:
        if self.units is None:
            raise RuntimeError("the units are planned before they are acted on")
        return self.units

    @property
    def program_steps(self) -> ProgramPlan:
        if self.programs is None:
            raise RuntimeError("the supervisor programs are planned before they are acted on")
        return self.programs
