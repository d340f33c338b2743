# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Free GPUs and prove it: look -> plan -> act (units, SIGTERM, SIGKILL) -> verify.

No AnsibleModule in here. Side effects go through a `System` object (systemctl, signals,
clock) so that the logic is tested without killing anything.
"""

from __future__ import annotations

import importlib
import os
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _caps
from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _signals
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import ReleaseError, StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import (
    GPU_FIELDS, NvidiaSmiError, check_against_driver, normalize_bus_id, parse_compute_apps,
)

# What only a host with something to free needs (containers and their runtimes, systemd units,
# supervisord, MPS, the respawn watch, the restore record) is imported by the function that
# uses it: a clean host (the gate before every job) loads none of it. Each module_util is
# compiled from source on every run (AnsiballZ ships no bytecode), ~40 ms of the ~90 ms that
# gpu_release's own imports took on a clean simulated host (benchmarks/HISTORY.md, "The clean gate's cost (issue 36, 2026-12-01)"). Ansible finds
# imports anywhere in a module's source, so the payload still carries them all.

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers, _services, _settle, _supervisor  # noqa: F401 - annotations
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._guest_units import GuestPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _reset  # noqa: F401 - annotations
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, ContainersDone, DriverGpu, Gpu, Holder, ReleaseResult
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._supervisor import ProgramPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._units import UnitPlan

# While GPUs stay dirty, look for who holds them this often (a /proc scan, a few ms).
RESCAN_S = 1.0
# How long a dirty GPU that no process holds is given to free itself before the run fails: a
# process that exited just before frees its memory within ~1 s on H200 (one still tearing down,
# e.g. unpinning host memory in D state, is still in /proc, so still a holder).
NO_HOLDER_GRACE_S = 1.0
# How far back the verify loop's readings tell a GPU still being freed at the end of wait_timeout
# from a leak: the same ~1 s in which a process that exited frees its memory on H200.
TREND_WINDOW_S = 1.0
# Check mode: room past the grace for a slow first scan (seen: a loaded CI host said nothing for an idle MIG GPU).
CHECK_SLACK_S = 5.0
# A GPU that no process holds and that reads this little (or is in MIG mode) is taken for its
# idle baseline: MIG-enabled H100/H200/A100 read 50-59 MiB idle (public reports, the fleet's
# simulated A100 MIG host reads 55 MiB).
BASELINE_MAX_MIB = 64


class System:
    """Everything gpu_release does to the node, in one replaceable place."""

    def __init__(self, systemctl_path: str | None = None, proc: str = "/proc", runtimes: t.Any = None, record_path: str | None = None,
                 kernel_log_state: str | None = None) -> None:
        self.systemctl_path = systemctl_path
        self.proc = proc
        # Where the restore record goes (_record.PATH for the module); None writes none.
        self.record_path = record_path
        # What the last look read of the kernel log (_kernel_log_state.PATH for the module); None keeps none.
        self.kernel_log_state = kernel_log_state
        # pidfds pin a process of this kernel's /proc only.
        self.pidfd = _signals.pidfd_or_none() if proc == "/proc" else None
        # Docker and Podman, asked only when a holder runs in a container or services names one.
        self._runtimes = runtimes

    @property
    def runtimes(self) -> t.Any:
        """_engines.Runtimes, made (and _engines loaded) when first needed."""
        if self._runtimes is None:
            from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines
            self._runtimes = _engines.Runtimes()
        return self._runtimes

    def systemctl(self, args: t.Sequence[str]) -> tuple[int, str, str]:
        return _commands.systemctl(self.systemctl_path, args)

    def start_time(self, pid: int) -> int | None:
        return holders_mod.start_time_of(pid, self.proc)

    def supervisors(self) -> list[_supervisor.Supervisor]:
        """Running supervisord processes of root (asked only when services names a program)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor
        return _supervisor.find_supervisors(self.proc)

    def state(self, pid: int) -> str | None:
        found = holders_mod.status_of(pid, self.proc)
        return None if found is None else found[0]

    def signal(self, pid: int, signum: int) -> None:
        os.kill(pid, signum)

    def cgroup_unit(self, pid: int) -> tuple[str | None, bool]:
        """(unit, is a system service) of a PID, from its cgroup."""
        path = holders_mod.cgroup_of(pid, self.proc)
        if path is None:
            return None, False
        return holders_mod.unit_of(path), holders_mod.is_system_service(path)

    def running_guests(self, kind: str, name_glob: str) -> list[t.Any]:
        """The system containers of `kind` running on this node whose name matches (_guests.running)."""
        return _guests.running(kind, name_glob, proc=self.proc)

    def guest_systemctl(self, guest: t.Any, args: list[str], timeout: float) -> tuple[int, str, str]:
        """systemctl in a guest, confined as the guest (_guest_units.guest_systemctl)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units
        return _guest_units.guest_systemctl(guest, args, timeout, self.proc)

    def guest_refusal(self, guest: t.Any) -> str | None:
        """Why this host cannot reach the guest's systemd confined as the guest (None: it can)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units
        return _guest_units.guest_refusal(guest, self.proc)

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(max(0.0, seconds))


# ---------------------------------------------------------------- pure planning steps


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


def _gpu_list(indexes: t.Iterable[int]) -> str:
    return ",".join(str(i) for i in indexes)


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


def spanning_message(processes: list[tuple[Holder, list[int]]], units: list[dict[str, t.Any]], containers: list[dict[str, t.Any]], selected: list[int],
                     programs: t.Sequence[dict[str, t.Any]] = ()) -> str:
    """Why a partial selection is refused before anything is done, naming each spanning process
    (pid, name, command line) or unit or container and the unselected GPUs it uses."""
    parts = []
    for holder, outside in processes:
        parts.append("{} uses GPUs {}; GPU {} {} outside the selection".format(
            describe_holder(holder), _gpu_list(holder.get("gpu_indexes") or []), _gpu_list(outside), "is" if len(outside) == 1 else "are"))
    for unit in units:
        parts.append("unit {} (pids {}) holds GPUs {}; GPU {} {} outside the selection".format(
            unit["unit"], _gpu_list(unit["pids"]), _gpu_list(unit["gpu_indexes"]), _gpu_list(unit["outside_gpus"]),
            "is" if len(unit["outside_gpus"]) == 1 else "are"))
    for container in containers:
        parts.append("container {} (pids {}) holds GPUs {}; GPU {} {} outside the selection".format(
            container.get("name") or str(container["container"])[:12], _gpu_list(container["pids"]), _gpu_list(container["gpu_indexes"]),
            _gpu_list(container["outside_gpus"]), "is" if len(container["outside_gpus"]) == 1 else "are"))
    for program in programs:
        parts.append("supervisor:{} (pids {}), a copy of [{}] that naming the program stops too, holds GPU {}, outside the selection (to stop "
                     "only the copies on selected GPUs, name them, with service_state: stopped)".format(
                         program["program"], _gpu_list(program["pids"]), program["section"], _gpu_list(program["outside_gpus"])))
    return (
        "refusing to free GPU {}: ending these would also end their work on GPUs outside the selection: {}. Nothing was stopped or "
        "signalled. Select every GPU they use, or set kill_spanning: true (role: free_gpus_kill_spanning) to end them anyway".format(
            _gpu_list(selected), "; ".join(parts))
    )


def describe_holder(holder: Holder | dict[str, t.Any]) -> str:
    parts = ["pid {} {}".format(holder["pid"], holder.get("name"))]
    cmdline = holder.get("cmdline") or ""
    if cmdline and cmdline != holder.get("name"):
        parts[0] += " [{}]".format(cmdline if len(cmdline) <= 60 else cmdline[:57] + "...")
    if holder.get("unit"):
        parts.append("unit {}".format(holder["unit"]))
    if holder.get("container"):
        parts.append("container {}".format(holder.get("container_name") or (holder.get("container") or "")[:12]))
    guest = holder.get("guest")
    if guest:
        parts.append("{}{}".format(_guests.label(guest), ": {}".format(guest["unit"]) if guest.get("unit") else ""))
    parts.append("state {}".format(holder.get("state")))
    if holder.get("state") == "Z" and not holder.get("blocked"):
        parts.append("zombie leader, {} threads running".format(max(0, (holder.get("threads") or 1) - 1)))
    if holder.get("blocked"):
        parts.append("did not answer" + (": wchan {}".format(holder["wchan"]) if holder.get("wchan") else ""))
    if holder.get("protected"):
        parts.append("protected")
    if holder.get("attribution") == _attribution.UNDECIDED:
        parts.append("may use GPU {}: maps their device files, none context-sized".format(",".join(str(i) for i in holder.get("candidate_gpu_indexes") or [])))
    return "{} ({})".format(parts[0], ", ".join(parts[1:]))


EARLY_HEADS = {
    "protected": "GPUs are held only by protected processes, which gpu_release never signals",
    "no_holder": "GPUs read above max_used_mib with no process holding them (waiting would not free them)",
    "unreadable": "GPU memory cannot be read, so the GPUs cannot be proven free (waiting would not change that)",
    "not_killed": "GPUs are held by processes that kill=false leaves running (waiting would not free them)",
    "respawned": "GPUs are held again by a process started again by a restarter that this run does not stop",
}


# The words that mark a GPU of a failure message as possibly held outside this container.
INSIDE_A_CONTAINER = "this run is inside a container (a PID namespace of its own)"


def held_outside(gpu: Gpu, dead_claims: list[ComputeApp]) -> str:
    """Memory no process of this container holds: a container sees neither the host's processes
    nor other guests' that share its GPUs (nvidia-smi lists them under PIDs that do not exist
    here), so no reset or reboot is advised from inside (it would take the GPU from them)."""
    listed = " (nvidia-smi charges it to pid {}, which does not exist here)".format(", ".join(str(a["pid"]) for a in dead_claims)) if dead_claims else ""
    return (", and no process of this container holds it{}: {}, which cannot see the host's processes or other guests', so GPU {} may "
            "be held outside it, by the host or another guest sharing it. Look on the host: zeromib.gpu.gpu_facts there names the holder "
            "and the guest it runs in (gpu_release there frees it)".format(listed, INSIDE_A_CONTAINER, gpu["index"]))


def host_advice(gpu: Gpu, holders: list[Holder], node: _reset.Node | None) -> str:
    """After held_outside: what the host's operator runs if nothing on the host holds the GPU
    either (_reset.text, from inside)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _reset
    return "; " + reset_advice(gpu, holders, (node or _reset.Node(gpus=[gpu], kernel_seen=False))._replace(inside=True))


def gpu_failure(gpu: Gpu, holders: list[Holder], apps: list[ComputeApp], blind: bool = False, freeing: str | None = None,
                inside: bool = False, node: _reset.Node | None = None) -> str:
    """The part of the failure message of one dirty GPU: its MiB and what still holds it.
    `blind`: some processes could not be read (not root), so "nothing holds it" is unknown and
    neither a reset nor a baseline is advised. `freeing`: why it is still being freed (see
    freeing_notes), when it is; then no reset is advised either. `inside`: this run is in a
    container, where memory with no holder here may be held outside it (held_outside). `node`:
    what the reset advice needs (_reset)."""
    on_gpu = [h for h in holders if gpu["index"] in h["gpu_indexes"]]
    unprotected = [h for h in on_gpu if not h["protected"]]
    claims = [a for a in apps if a.get("gpu_index") == gpu["index"]]
    dead_claims = [a for a in claims if not a.get("alive")]
    claimed_pids = {a["pid"] for a in claims if a.get("alive")}
    protected_claimants = [h for h in on_gpu if h["protected"] and h["pid"] in claimed_pids]
    undecided = [h for h in holders if h.get("attribution") == _attribution.UNDECIDED and gpu["index"] in (h.get("candidate_gpu_indexes") or [])]
    blocked = [h for h in _attribution.blocked_for(holders, [gpu["index"]]) if not h.get("protected")]
    used = gpu.get("memory_used_mib")
    text = gpu_head(gpu)
    if freeing:
        text += f" ({freeing})"
    if unprotected or protected_claimants:
        text += ", held by " + _caps.named([describe_holder(h) for h in unprotected + protected_claimants])
    elif blocked:
        text += f", possibly held by {_caps.named([describe_holder(h) for h in blocked])}: what it holds cannot be read"
    elif undecided:
        # Never signalled for a selection it may not belong to (see _attribution).
        named = _caps.named([describe_holder(h) for h in undecided])
        text += f", possibly held by {named}, not signalled because it may use GPUs outside the selection: select them all, or name it in match"
    elif unplaced_claims(claims, holders, gpu["index"]):
        # Never "no live process" while nvidia-smi lists a live PID: name it and say why it was not placed.
        text += ", " + "; ".join(describe_unplaced(app, holders, gpu["index"]) for app in unplaced_claims(claims, holders, gpu["index"]))
    elif used is None:
        text += ": nvidia-smi cannot report its memory, so it cannot be proven free"
    elif blind:
        # Its holder may be one of the processes this module could not read (the orphaned child
        # of a dead, listed owner, another user's): no verdict on the memory, no reset advised.
        text += ", and no process that this module can read holds it (its holder may be one it cannot read)"
    elif freeing:
        text += ", and no live process holds it any more: the driver is still freeing its memory"
    elif inside and not on_gpu and (dead_claims or not is_idle_baseline(gpu)):
        text += held_outside(gpu, dead_claims) + host_advice(gpu, holders, node)
    elif dead_claims:
        text += (
            ", attributed to exited process(es) {} and no live process holds the GPU: the driver has not freed this "
            "context; {}".format(", ".join("{} {}".format(a["pid"], a["name"] or "[No data]") for a in dead_claims), reset_advice(gpu, holders, node))
        )
    elif on_gpu:
        # Graphics memory of a compositor (Xorg, gnome-shell) is not listed as a compute app.
        text += (
            ", held only by protected process(es) {} that nvidia-smi does not charge with this memory: if this is the GPU's "
            "idle baseline (a desktop, MIG), set max_used_mib; otherwise the driver has not freed it: {}".format(
                "; ".join(describe_holder(h) for h in on_gpu), reset_advice(gpu, holders, node))
        )
    elif is_idle_baseline(gpu):
        text += (", and no process holds the GPU: this is its idle baseline{}, not a leak; set max_used_mib: {} (its {} MiB reading with "
                 "a margin; role: free_gpus_max_used_mib, per host or group) to accept it".format(
                     " (MIG mode is enabled)" if is_mig(gpu) else "", _options.baseline_with_margin(used), used))
    else:
        text += (f", and no live process holds the GPU: memory the driver has not freed (if {used} MiB is this GPU's idle baseline, set "
                 f"max_used_mib: {used} instead); {reset_advice(gpu, holders, node)}")
    return text


def gpu_head(gpu: Gpu) -> str:
    """How gpu_failure's text of one GPU begins: `GPU 3 (GPU-...) reads 6662 MiB`."""
    used = gpu.get("memory_used_mib")
    return "GPU {} ({}) reads {} MiB".format(gpu["index"], gpu.get("uuid"), "unknown" if used is None else used)


def index_list(indexes: t.Sequence[int]) -> str:
    """[0, 1, 2, 3, 5] -> `0-3,5`."""
    runs: list[list[int]] = []
    for index in indexes:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(str(i) for i in run) for run in runs)


# The GPU texts that name who holds the GPU and nothing of the GPU itself: GPUs with the same are said together.
_HOLDER_TEXTS = (", held by ", ", possibly held by ")


def by_holder(gpus: t.Sequence[Gpu], texts: t.Sequence[str]) -> list[str]:
    """The texts of gpu_failure, one per GPU, with the GPUs that one holder (or the same holders)
    keeps said once: `GPUs 0-7 read 40960 MiB each (327680 MiB in all), held by pid 700 python3 (...)`,
    where 8 GPUs of one training job were 8 copies of its description. A GPU whose text says
    something of its own (a reset, a baseline, memory still falling) keeps its own sentence, UUID
    and all."""
    # Keyed by the holder text, or by the GPU's position where its text is its own.
    groups: dict[str | int, list[int]] = {}
    for position, (gpu, text) in enumerate(zip(gpus, texts)):
        rest = text[len(gpu_head(gpu)):] if text.startswith(gpu_head(gpu)) else ""
        groups.setdefault(rest if rest.startswith(_HOLDER_TEXTS) else position, []).append(position)
    lines: list[str] = []
    for key, positions in groups.items():
        if len(positions) == 1 or not isinstance(key, str):
            lines.extend(texts[p] for p in positions)
            continue
        readings = [gpus[p].get("memory_used_mib") for p in positions]
        known = [int(r) for r in readings if r is not None]
        each = (f"{known[0]} MiB each" if len(set(known)) == 1 else f"{min(known)}-{max(known)} MiB") if len(known) == len(readings) else "unknown MiB"
        total = f" ({sum(known)} MiB in all)" if len(known) == len(readings) else ""
        lines.append("GPUs {} read {}{}{}".format(index_list([int(gpus[p]["index"]) for p in positions]), each, total, key))
    return lines


def reset_advice(gpu: Gpu, holders: list[Holder], node: _reset.Node | None) -> str:
    """What frees a GPU that only a reset or a reboot can free, on this node (_reset: loaded only
    for such a failure)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _reset
    node = node or _reset.Node(gpus=[gpu])
    return _reset.text(gpu, node._replace(holders=holders))


def permission_head(unreadable: int) -> str:
    """The first sentence of a failure when some processes could not be read: the cause to fix
    before any reading of GPU memory is judged (a reset or a baseline would be the wrong cure)."""
    return (f"cannot see other users' processes: run as root (become: true); could not read the open files of {unreadable:d} process(es), "
            "so what holds the GPUs is unknown and no GPU memory is judged")


def failure_message(dirty_gpus: list[Gpu], holders: list[Holder], apps: list[ComputeApp], waited_s: float, unkillable: list[dict[str, t.Any]],
                    protected_only: bool = False, early: str | None = None, unreadable: int = 0,
                    freeing: t.Mapping[int, str] | None = None, inside: bool = False, node: _reset.Node | None = None) -> str:
    """One message naming each dirty GPU, its MiB and what still holds it. `early`: why the
    wait stopped before wait_timeout (a key of EARLY_HEADS). `unreadable`: how many processes
    could not be read (not root): then the permission problem is the head. `freeing`: the GPUs
    still being freed when wait_timeout ran out, and why (freeing_notes). `inside`: the run is
    in a container (gpu_failure). `node`: for the reset advice (_reset)."""
    freeing = freeing or {}
    lines = by_holder(dirty_gpus, [gpu_failure(gpu, holders, apps, blind=unreadable > 0, freeing=freeing.get(gpu["index"]), inside=inside,
                                               node=node) for gpu in dirty_gpus])
    if unreadable:
        head = permission_head(unreadable)
    elif early == "no_holder" and any(INSIDE_A_CONTAINER in line for line in lines):
        head = "GPUs read above max_used_mib with no process of this container holding them (waiting would not free them)"
    elif protected_only or early in EARLY_HEADS:
        head = EARLY_HEADS[early or "protected"]
    elif any(gpu["index"] in freeing for gpu in dirty_gpus):
        # Not a leak yet: memory still falling, or a holder the kernel is still ending.
        head = (f"GPUs still in use after {waited_s:.1f} s, still being freed: a longer wait_timeout "
                "(role: free_gpus_wait_timeout) may free them")
    else:
        head = f"GPUs still in use after {waited_s:.1f} s"
    if unkillable:
        lines.append("unkillable (outlived SIGKILL: a thread of it stays in the kernel, D state, in the driver or a file system that does not "
                     "answer): " + "; ".join(describe_holder(h) for h in unkillable) + "; a reboot is needed (nothing else ends a process "
                     "stuck in the kernel)")
    return "{}: {}".format(head, ". ".join(lines))


def freeing_notes(dirty_gpus: list[Gpu], holders: list[Holder], apps: list[ComputeApp], trend: MemoryTrend,
                  exiting: t.Callable[[int], bool], signalled: t.Collection[int]) -> dict[int, str]:
    """{GPU index: why it is still being freed} for the dirty GPUs whose memory fell over the last
    readings (trend), or that a process the kernel is ending (`exiting`: PF_EXITING) still holds
    or is listed on; never for a GPU that a live process this run did not signal (`signalled`:
    the PIDs it did) still holds, which no wait frees. A process in D state alone is no sign: a
    task frozen by the cgroup v1 freezer reads D, and SIGKILL does not end it before it is thawed
    (seen on this project's test machine)."""
    notes = {}
    names = {h["pid"]: h.get("name") for h in holders}
    for gpu in dirty_gpus:
        on_gpu = {h["pid"] for h in holders if gpu["index"] in (h.get("gpu_indexes") or [])}
        listed = {a["pid"] for a in apps if a.get("gpu_index") == gpu["index"] and a.get("alive")}
        ending = sorted(pid for pid in on_gpu | listed if exiting(pid))
        if any(pid not in signalled and pid not in ending for pid in on_gpu):
            continue
        parts = []
        fall = trend.falling(gpu["index"])
        if fall is not None:
            parts.append("its memory fell from {} to {} MiB in the last {:.1f} s".format(*fall))
        parts += [" ".join(str(x) for x in ("pid", pid, names.get(pid)) if x) + " is exiting" for pid in ending]
        if parts:
            notes[gpu["index"]] = "; ".join(parts)
    return notes


def blocked_message(blocked: list[Holder], unscanned: int, selected: list[int], timeout: float | None, gpus: t.Sequence[Gpu] = ()) -> str:
    """Why a run stops before acting when some process did not answer the scan (or the scan's
    deadline left processes unread) and `gpus`, selected, hold memory no process read explains:
    what holds them cannot be known. Names at most NAMED processes, then how many more."""
    parts = [_facts.blocked_text(h) + owner_words(h) for h in blocked[:_caps.NAMED]]
    if len(blocked) > _caps.NAMED:
        parts.append(f"and {len(blocked) - _caps.NAMED:d} more that did not answer")
    if unscanned:
        parts.append(f"the scan reached its deadline ({timeout} s, the timeout option) with {unscanned:d} process(es) not read")
    held = "; GPU {} holds memory that no process read explains".format(
        ", ".join("{} ({} MiB)".format(g["index"], "unknown" if g.get("memory_used_mib") is None else g["memory_used_mib"]) for g in gpus)) if gpus else ""
    return ("cannot free GPU {}: {}{}; what it holds is unknown, so no GPU can be proven free, and a process whose identity cannot be read is "
            "never signalled. Nothing was stopped or signalled. A file system that stopped answering (FUSE, NFS) holds it: its owner brings "
            "its server back, or root aborts the FUSE connection (echo 1 > /sys/fs/fuse/connections/N/abort) or unmounts it lazily (umount -l), "
            "then runs gpu_release again".format(_gpu_list(selected), "; ".join(parts), held))


def owner_words(holder: t.Mapping[str, t.Any]) -> str:
    """Whose a process that did not answer is beyond its uid (blocked_text), as the kernel places
    it: its unit or container, from its cgroup."""
    for key, label in (("unit", "unit"), ("container", "container")):
        if holder.get(key):
            return f", in {label} {holder[key]}"
    return ""


def unplaced_claims(claims: list[ComputeApp], holders: list[Holder], index: int) -> list[ComputeApp]:
    """Live compute apps of a GPU that the scan did not place on it."""
    placed = {h["pid"] for h in holders if index in (h.get("gpu_indexes") or [])}
    return [a for a in claims if a.get("alive") and a["pid"] not in placed]


def describe_unplaced(app: ComputeApp, holders: list[Holder], index: int) -> str:
    holder = next((h for h in holders if h["pid"] == app["pid"]), None)
    text = "listed by nvidia-smi for live pid {} {}, which the scan could not place on this GPU: ".format(app["pid"], app.get("name"))
    if holder is None:
        return text + ("it has no device file open or mapped that this node's /dev/nvidia* nodes or the driver's device numbers "
                       "identify (a node of its own, or a file system this module cannot stat); it is not signalled on a listing alone")
    if holder.get("gpu_indexes"):
        return text + ("it holds GPU {} context-sized and this GPU's device only as every CUDA process does: a PID reused since the "
                       "listed owner exited? it is not signalled for this GPU".format(",".join(str(i) for i in holder["gpu_indexes"])))
    return text + "it does not hold this GPU's device file; it is not signalled on a listing alone"


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


def summarize_diff(gpus: list[Gpu], holders: list[Holder], changes: t.Iterable[str] = ()) -> str:
    """Diff-mode text: per-GPU memory and the holders, one line each, then `changes` (lines of
    plan_diff: what is, or will be, stopped, disabled, masked and signalled)."""
    lines = ["GPU {} {}: {} MiB".format(g["index"], g.get("uuid"), g.get("memory_used_mib")) for g in gpus]
    lines += ["holder {}: {}".format(describe_holder(h), ",".join(str(i) for i in h["gpu_indexes"]) or "control nodes") for h in holders]
    lines += list(changes)
    return "\n".join(lines) + "\n"


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


# What freeing a GPU needs beyond the look, imported where used (a clean node never loads it).
FREEING_CODE = ("_act._containers", "_act._units", "_act._supervisor", "_act._settle", "_act._mps")


def load_freeing_code(_raw_holders: t.Any) -> None:
    """Some process maps a GPU: the code that frees it is loaded while nvidia-smi answers rather
    than after (each import compiles its source, AnsiballZ ships no bytecode: ~15-25 ms of the
    H200's elapsed_s when a holder was found, benchmarks/HISTORY.md, "The look's /proc pass beside nvidia-smi")."""
    for name in FREEING_CODE:
        importlib.import_module("ansible_collections.zeromib.gpu.plugins.module_utils." + name)


class Release:
    """look -> plan -> act -> verify, for the options of gpu_release. The one writer of the
    result: the steps it calls return plans and records of what they did (StepFailed carries
    the record of a step that failed), and it raises the one ReleaseError."""

    def __init__(self, smi: t.Any, system: System, params: dict[str, t.Any], check_mode: bool = False,
                 driver_root: str = "/proc/driver/nvidia/gpus") -> None:
        self.smi = smi
        self.system = system
        self.params = params
        self.check_mode = check_mode
        self.driver_root = driver_root
        self.names, self.pids = holders_mod.split_protect(params.get("protect"))
        self.lineage = holders_mod.lineage(os.getpid(), system.proc)
        self.regexes = params.get("_match_regexes") or []
        # Workload units that also hold GPUs outside the selection (plan_units).
        self.spanning_units: list[dict[str, t.Any]] = []
        self._main_pids: dict[str, int | None] = {}
        # systemd's ControlGroup= of each unit a holder's cgroup named (_unit_owner): asked once per run.
        self.unit_cgroups: dict[str, str] = {}
        # Namespace inits this run spares (spare_namespace_inits), by identity: still spared, and
        # so protected, in every later scan of the run.
        self.spared_inits: set[tuple[int, int]] = set()
        # Minor numbers by bus id, from the look; the verify loop's readings reuse them.
        self.minors_by_bus: dict[str | None, int] = {}
        # The look's _health.Health: the final readings are judged with the same checks and Xids.
        self.health: t.Any = None
        # What may start a signalled holder again (_settle), set when something is signalled.
        self.watch: _settle.Watch | None = None
        self.state_key = STATE_KEYS.get(params.get("service_state") or "")
        self.result = new_result(self.state_key)
        self._named: _services.Services | None = None
        self.started = 0.0
        # The look's (gpus, holders) and the last readings: the diff's before and after.
        self.before: tuple[list[Gpu], list[Holder]] = ([], [])
        self.after: tuple[list[Gpu], list[Holder]] | None = None
        # Until the selection is made, a failure is about the request itself: its result is {}.
        self.selected = False
        # Processes the look could not read (not root): failures then say so first.
        self.unreadable = 0
        # The verify loop's last readings: whether a GPU is still being freed at the end (freeing_notes).
        self.trend = MemoryTrend()
        # Guest entries of services that name no running guest or no unit there; the guest units' state before.
        self.guests_not_found: list[str] = []
        self.guest_before: dict[str, dict[str, t.Any]] = {}
        # Whether the look ran in a container (_guests.pid_namespace_nested): memory no process here holds may be held outside.
        self.inside_container = False
        # clean_shm: the files /dev/shm held at the look, by inode (only those may go), and the
        # health issue of its free space at the end (_shm.floor_issue).
        self.shm_at_look: set[tuple[int, int]] = set()
        self.shm_issue: str | None = None
        # clean_shm: the processes this run is to end (signalled, or stopped with their unit,
        # container or program), by PID: only their files may go (ended_processes).
        self.ending: dict[int, Holder] = {}

    # --- the whole run

    def run(self) -> ReleaseResult:
        """look -> plan -> (check mode: the answer) -> act -> verify and settle, all ending in
        one tail. A step that fails (StepFailed) ends the run here, in the one ReleaseError,
        with what was done folded into the result."""
        try:
            self.started = self.system.now()
            plan = self.plan(self.look())
            if self.check_mode:
                return self.answer_check(plan)
            if not plan.to_do and plan.gpus_clean:
                # Nothing to act on and the look already proves the GPUs free: that reading is the
                # verification (no second nvidia-smi call, no second scan on the fast path).
                return self.tail(True, self.result["gpus_before"], plan.holders)
            self.act(plan)
            return self.verify_and_settle(plan)
        except StepFailed as exc:
            raise ReleaseError(exc.msg, self.failed(exc)) from exc

    def failed(self, exc: StepFailed) -> ReleaseResult | dict[str, t.Any]:
        """The result a failure carries: what the failed step did, folded in (a verdict's is the
        finished result already); {} when the request itself was refused (no GPU selected)."""
        if isinstance(exc, Verdict):
            return exc.done
        self.fold(exc.done)
        return self.result if self.selected else {}

    def fold(self, done: t.Mapping[str, t.Any] | None) -> None:
        """A step's record (under the result's keys) into the result: lists are added to."""
        for key, value in (done or {}).items():
            if isinstance(value, list):
                self.result.setdefault(key, []).extend(value)  # type: ignore[misc]
            else:
                self.result[key] = value  # type: ignore[literal-required]

    def tail(self, released: bool, gpus: list[Gpu], holders: list[Holder], failure: str | None = None) -> ReleaseResult:
        """The one end of every run: the readings, the verdict, the time, health and the diff;
        `failure` (a message) ends the run in ReleaseError with this result."""
        self.result["gpus"] = gpus
        self.result["holders"] = t.cast("list[Holder]", [_facts.public_holder(h) for h in holders])
        self.result["released"] = released
        # clean_shm acts once the GPUs are proven free (in check mode: what the run would free).
        self.read_shm(failure is None and (released or self.check_mode))
        self.result["elapsed_s"] = round(self.system.now() - self.started, 3)
        result = self._finish(*self.before, *(self.after or (None, None)))
        if failure:
            raise Verdict(failure, result)
        return result

    # --- look

    def settle_timeout(self) -> float:
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _settle
        value = self.params.get("settle_timeout")
        return _settle.SETTLE_S if value is None else value

    def read_shm(self, may_clean: bool) -> None:
        """/dev/shm at the end: its free space, for the health floor (shm_min_free_mib_per_gpu), and
        with clean_shm, the killed jobs' files removed once the GPUs are proven free (_shm_clean;
        in check mode, those it would remove). Not read at all without health and clean_shm."""
        floor = self.params.get("shm_min_free_mib_per_gpu")
        clean = bool(self.params.get("clean_shm"))
        if not clean and (self.health is None or not floor):
            return
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _shm
        done = None
        if clean:
            from ansible_collections.zeromib.gpu.plugins.module_utils._act import _shm_clean
            done = _shm_clean.clean(self.shm_at_look, may_clean, self.check_mode, self.system.proc, deadline_s=self.params.get("timeout"),
                                    ended=self.ended_processes() if may_clean else {})
            self.result["shm_removed"] = done.removed
            self.result["shm_kept"] = done.kept
            self.result["shm_removed_mib"] = round(sum(entry["size_mib"] for entry in done.removed), 2)
            self.result["warnings"].extend(done.warnings)
            self.result["changed"] = self.result["changed"] or bool(done.removed)
        record = _shm.look(processes=False)
        if done is None and self.health is not None and _shm.floor_issue(record, floor, len(self.before[0])):
            # Below the floor: what fills it is worth a scan of the processes (only then).
            record = _shm.look(proc=self.system.proc, deadline_s=self.params.get("timeout"))
        if done is not None:
            record = _shm.with_unheld(record, done.unheld, done.complete)
        self.result["shm"] = record
        self.shm_issue = _shm.floor_issue(record, floor, len(self.before[0])) if self.health is not None else None

    def ended_processes(self) -> dict[int, int | None]:
        """{pid: uid} of the processes this run ended: those it was to end that are gone now, by
        identity (a zombie its parent has not reaped is gone); in check mode, those it would
        signal and those whose unit it would stop."""
        if self.check_mode:
            signalled = {k["pid"] for k in self.result.get("killed") or []}
            stopping = set(self.result.get("stopped_units") or [])
            return {pid: h.get("uid") for pid, h in self.ending.items()
                    if pid in signalled or (h.get("system_service") and h.get("unit") in stopping)}
        return {pid: h.get("uid") for pid, h in self.ending.items()
                if h.get("start_time") is not None and holders_mod.start_time_of(pid, self.system.proc) != h.get("start_time")}

    def to_end(self, holders: t.Iterable[Holder]) -> None:
        """Note processes this run is to end (ended_processes)."""
        for holder in holders:
            self.ending.setdefault(holder["pid"], holder)

    def max_used_mib(self) -> float:
        return self.params.get("max_used_mib") or 0

    def footprint_mib(self) -> int:
        value = self.params.get("cross_gpu_footprint_mib")
        return _attribution.CROSS_GPU_FOOTPRINT_MIB if value is None else value

    def scan(self, gpus: list[Gpu]) -> tuple[list[Holder], list[ComputeApp]]:
        """Who uses which GPU now -> (holders, the compute apps seen: fetched only when they can
        change the answer, else [])."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _container_of
        holders, apps = _facts.scan_and_attribute(
            gpus, None, lambda: self._apps(gpus), protect_names=self.names, protect_pids=self.pids, own_lineage=self.lineage, proc=self.system.proc,
            max_used_mib=self.max_used_mib(), footprint_mib=self.footprint_mib(), main_pid_of=self.main_pid_of,
            limits=_facts.scan_limits(self.params.get("timeout")), again=True,
        )
        holders = _container_of.annotate(holders, self.system.runtimes, self.system.proc)
        holders = _guests.annotate(holders, self.system.proc)
        holders = _facts.annotate_units(holders, self.system.systemctl, self.unit_cgroups)
        for holder in holders:
            if (holder["pid"], holder["start_time"]) in self.spared_inits:
                holder["protected"], holder["protected_reason"] = True, SPARED_INIT
        return holders, apps

    def main_pid_of(self, unit: str) -> int | None:
        """systemd's MainPID of a system unit (asked only for a process named like a protected
        daemon that its uid and executable do not vouch for)."""
        if unit not in self._main_pids:
            rc, out, _err = self.system.systemctl(["show", "-p", "MainPID", "--value", unit])
            self._main_pids[unit] = int(out.strip()) if rc == 0 and out.strip().isdigit() else None
        return self._main_pids[unit]

    def may_be_footprint(self, dirty: list[Gpu]) -> bool:
        """Whether some dirty GPU reads little enough to be only the cross-GPU footprint (then a
        scan decides it; otherwise none is needed)."""
        allowance = self.max_used_mib() + self.footprint_mib()
        return bool(self.footprint_mib()) and any(g["memory_used_mib"] is not None and g["memory_used_mib"] <= allowance for g in dirty)

    def footprint(self, gpus: list[Gpu], holders: list[Holder], apps: list[ComputeApp]) -> set[int]:
        return _attribution.footprint_gpus(gpus, holders, apps, self.max_used_mib(), self.footprint_mib())

    def look(self) -> t.Any:
        snapshot = _facts.look(self.smi, self.params.get("protect"), with_processes=True, proc=self.system.proc, driver_root=self.driver_root, with_apps=False,
                               max_used_mib=self.max_used_mib(), footprint_mib=self.footprint_mib(),
                               runtimes_of=lambda: self.system.runtimes, checks=_health.Checks.from_params(self.params), main_pid_of=self.main_pid_of,
                               kernel_log_state=getattr(self.system, "kernel_log_state", None), while_waiting=load_freeing_code,
                               systemctl=self.system.systemctl, unit_cgroups=self.unit_cgroups)
        self.health = snapshot.health
        if self.params.get("clean_shm"):
            from ansible_collections.zeromib.gpu.plugins.module_utils._look import _shm
            try:
                self.shm_at_look = {(f.dev, f.ino) for f in _shm.list_files()}
            except OSError:
                self.shm_at_look = set()
        return snapshot

    # --- plan

    def plan(self, snapshot: t.Any) -> Plan:
        """The look's readings into the result, then what to stop, disable and signal (every
        planner returns its plan; the spanning refusal comes before anything is done)."""
        self.result["timings"]["look_s"] = round(self.system.now() - self.started, 3)
        gpus, holders = snapshot.gpus, snapshot.holders
        self.before = (gpus, holders)
        self.minors_by_bus = {normalize_bus_id(g.get("pci_bus_id")): g["minor_number"] for g in gpus}
        hidden = _facts.unreadable_warning(getattr(snapshot, "unreadable", None))
        if hidden:
            self.result["warnings"].append(hidden)
        limit = self.max_used_mib()
        not_visible = getattr(snapshot, "not_visible", [])
        self.result["not_visible"] = [gpu["bus"] for gpu in not_visible]
        plan = Plan(gpus, holders, snapshot.footprint, hidden, select_gpus(gpus, self.params.get("gpus"), not_visible))
        plan.unreadable = self.unreadable = len(getattr(snapshot, "unreadable", None) or [])
        self.selected = True
        self.result["gpus_before"] = t.cast("list[Gpu]", [_facts.public_gpu(g, limit, snapshot.footprint) for g in gpus])
        self.result["selected_gpus"] = plan.selected
        self.inside_container = bool(getattr(snapshot, "inside_container", False))
        self.choose_targets(plan)
        self.refuse_blocked(snapshot, plan.selected)
        planning = self.system.now()
        if holders or self.params.get("services"):
            plan.containers = self.plan_containers(holders, plan.targets)
            self.result["warnings"].extend(plan.containers.warnings)
            plan.targets = plan.containers.signal
            plan.units = self.plan_units(plan.targets, holders, plan.selected)
            plan.programs = self.plan_programs()
            plan.guests = self.plan_guests(holders, plan.selected)
        else:
            # No process holds a GPU and services names nothing (the clean gate): the planners of
            # containers, units and supervisord would find nothing, so they are not loaded.
            plan.containers, plan.units, plan.programs = NoContainers(), no_units(), no_programs()
        self.refuse_spanning(holders, plan.selected, plan.containers, plan.mps_servers, plan.programs)
        self.refuse_guest_services(plan)
        self.result["timings"]["plan_s"] = round(self.system.now() - planning, 3)
        self.result["services_not_found"] = (plan.units["not_found"] + plan.containers.not_found + plan.programs["not_found"]
                                             + self.guests_not_found)
        plan.gpus_clean = all(g["clean"] for g in self.result["gpus_before"] if g["index"] in plan.selected)
        plan.to_do = bool(plan.containers or plan.units["stop"] or plan.units["disable"] or plan.units["mask"]
                          or (plan.targets and self.params.get("kill", True)) or plan.programs["stop"] or plan.programs["disable"]
                          or plan.mps_servers or bool(plan.guests and self.guest_units.acted_on(plan.guests)))
        plan.dirty_before = [g for g in gpus if g["index"] in plan.selected and g["index"] not in snapshot.footprint
                             and not _facts.gpu_is_clean(g, limit)]
        plan.unheld_at_look = {g["index"] for g in unheld(plan.dirty_before, holders, snapshot.apps)}
        plan.apps = snapshot.apps
        return plan

    def choose_targets(self, plan: Plan) -> None:
        """Holders to signal and MPS servers to quit; the protected, undecided and trust notes."""
        targets, protected = plan_targets(plan.holders, plan.selected, self.regexes, bool(self.params.get("kill_spanning")))
        targets, spared = self.spare_namespace_inits(targets)
        protected += spared
        plan.targets, plan.mps_servers = self.plan_mps(targets)
        self.to_end(plan.targets + plan.mps_servers)
        self.result["warnings"].extend(trust_notes(plan.holders, plan.selected))
        self.result["undecided"] = undecided_record(_attribution.undecided_for(plan.holders, plan.selected))
        self.result["protected"] = [{"pid": h["pid"], "name": h["name"], "unit": h.get("unit"), "gpu_indexes": h["gpu_indexes"]}
                                    for h in protected]

    def spare_namespace_inits(self, targets: list[Holder]) -> tuple[list[Holder], list[Holder]]:
        """(targets, spared): a target that is the init of a PID namespace below ours takes every
        other process of that namespace with it when it ends (the kernel's SIGKILL to each). It is
        signalled only when each of them is a target too, or is run by the holder's own uid and is
        not protected (its own job's processes); otherwise it is spared, as a protected holder,
        with a warning that names the processes its end would take."""
        kept, spared = [], []
        target_pids = {h["pid"] for h in targets}
        for holder in targets:
            blocking = self.members_that_may_not_end(holder, target_pids) if holder.get("pid_namespace_init") else []
            if not blocking:
                kept.append(holder)
                continue
            holder["protected"], holder["protected_reason"] = True, SPARED_INIT
            self.spared_inits.add((holder["pid"], holder["start_time"]))
            self.result["warnings"].append(
                "not signalled: pid {} {} is the init of a PID namespace, and ending it would end every process of that namespace, "
                "among them {}".format(holder["pid"], holder.get("name"), "; ".join(blocking)))
            spared.append(holder)
        return kept, spared

    def members_that_may_not_end(self, holder: Holder, target_pids: t.Container[int]) -> list[str]:
        """The processes of the namespace HOLDER is the init of that this run may not end: not
        targets themselves, and protected (the identity rule) or run by another uid."""
        found = []
        for pid in holders_mod.namespace_members(holder["pid"], self.system.proc):
            if pid in target_pids:
                continue
            record = holders_mod.read_process(pid, self.system.proc)
            if record is None:
                continue  # ended meanwhile
            reason = holders_mod.protection_reason(dict(record), self.names, self.pids, self.lineage, self.main_pid_of)
            if reason is None and record.get("uid") == holder.get("uid"):
                continue
            why = reason or "uid {}, not the holder's uid {}".format(record.get("uid"), holder.get("uid"))
            found.append("pid {} {} ({})".format(pid, record.get("name"), why))
        return found

    def forbidden_units(self, holders: list[Holder]) -> set[str]:
        """Units gpu_release must never stop: those of its own session and of protected processes."""
        forbidden = set()
        for pid in self.lineage:
            unit, _service = self.system.cgroup_unit(pid)
            if unit:
                forbidden.add(unit)
        for holder in holders:
            if holder["protected"] and holder.get("unit"):
                forbidden.add(holder["unit"] or "")
        return forbidden

    @property
    def named(self) -> _services.Services:
        """The `services` option, read once: units, containers and supervisord programs (_services)."""
        if self._named is None:
            from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services
            try:
                self._named = _services.parse(self.params.get("services"))
            except ValueError as exc:
                raise StepFailed(str(exc)) from exc
        return self._named

    @property
    def guest_units(self) -> t.Any:
        """_act/_guest_units, loaded where services names a guest or a guest's process holds a GPU."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units
        return _guest_units

    def plan_units(self, targets: list[Holder], holders: list[Holder], selected: list[int]) -> UnitPlan:
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units
        forbidden = self.forbidden_units(holders)
        owned, self.result["launchers"], self.spanning_units = _units.owners(
            self.system.systemctl, targets, holders, selected, forbidden, self.system.proc, self.names,
            self.params.get("launchers") or (), bool(self.params.get("kill_spanning")), self.named.units)
        steps = _units.plan(self.system.systemctl, self.named.units, owned if self.params.get("stop_owning_units") else [],
                            self.params.get("service_state"), forbidden, self.names, self.system.proc, self.params.get("launchers") or (),
                            self.recorded_unit_files())
        _units.keep_outside_selection(steps, _units.held_gpus(holders), selected, owned)
        self.result["kept_units"].extend(steps["kept_units"])
        self.result["warnings"].extend(steps["warnings"])
        return steps

    def plan_guests(self, holders: list[Holder], selected: list[int]) -> list[GuestPlan]:
        """A guest's units named in services (lxc:101:vllm.service, ...), planned through the
        guest's systemd (_guest_units); [] without such entries."""
        if not self.named.guests:
            return []
        plans, self.guests_not_found, warnings = self.guest_units.plan(
            self.system, self.named.guests, holders, selected, self.params.get("service_state"), self.names,
            float(self.params.get("kill_timeout") or 0.0))
        self.result["warnings"].extend(warnings)
        for guest_plan in plans:
            self.result["kept_units"].extend(dict(k, unit=self.guest_units.name(guest_plan["guest"], k["unit"]))
                                             for k in guest_plan["steps"]["kept_units"])
        return plans

    def refuse_guest_services(self, plan: Plan) -> None:
        """From the host, a process of a guest's service whose guest runs a system manager is not
        signalled (the guest's manager would start it again) unless services names the unit of
        that guest: the run fails before anything is done, naming the command to run there and
        the entry to add (check mode says the same)."""
        if not self.params.get("kill", True) or not any(h.get("guest") for h in plan.targets):
            return
        refused = self.guest_units.refused_holders(plan.targets, plan.guests)
        if refused:
            raise StepFailed(self.guest_units.refusal(refused, plan.selected, _guests.host_tools(), self.params.get("service_state")))

    def refuse_blocked(self, snapshot: t.Any, selected: list[int]) -> None:
        """Processes that did not answer the look's scan (_holders.blocked_record), or that the
        scan's deadline left unread: a failure before anything is done (check mode says the same),
        but only where a selected GPU holds memory that no process read explains
        (_attribution.unexplained_by_readers). A blocked process that is another's (another Slurm
        job's: protected; another guest's) never fails this run, and a selected GPU that reads
        clean with no compute app is free whatever else could not be read (issue 66)."""
        holders = snapshot.holders
        unscanned = len(getattr(snapshot, "unscanned", None) or [])
        blocked = [h for h in _attribution.blocked_for(holders, selected) if not h.get("protected") and not h.get("guest")]
        if not blocked and not unscanned:
            return
        gpus = [g for g in snapshot.gpus if g["index"] in selected]
        unexplained = _attribution.unexplained_by_readers(gpus, getattr(snapshot, "apps", None) or [], holders, selected, self.max_used_mib(),
                                                          getattr(snapshot, "footprint", ()))
        if not unexplained:
            return
        self.result["holders"] = t.cast("list[Holder]", [_facts.public_holder(h) for h in holders])
        raise StepFailed(blocked_message(blocked, unscanned, selected, self.params.get("timeout"), [g for g in gpus if g["index"] in unexplained]))

    def refuse_spanning(self, holders: list[Holder], selected: list[int], container_plan: _containers.Plan, mps_servers: list[Holder],
                        program_plan: ProgramPlan | None = None) -> None:
        """Spanning processes, units and containers (see _attribution), MPS control daemons
        whose quit would end a server of an unselected GPU (_mps) and copies of a supervisord
        program named whole that work on unselected GPUs (_supervisor) -> result["spanning"];
        without kill_spanning, a failure before anything is done (check mode says the same)."""
        processes = spanning_targets(holders, selected, self.regexes)
        if mps_servers:
            from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
            processes += t.cast("list[tuple[Holder, list[int]]]", _mps.spanning_daemons(mps_servers, holders, selected, self.system.proc))
        containers = spanning_containers(holders, selected, container_plan.stop)
        programs: list[dict[str, t.Any]] = []
        if program_plan and (program_plan["stop"] or program_plan["disable"]):
            from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor
            programs = _supervisor.spanning_copies(program_plan, holders, selected, lambda pid: holders_mod.lineage(pid, self.system.proc))
        self.result["spanning"] = spanning_record(processes, self.spanning_units, containers, programs)
        if self.result["spanning"] and not self.params.get("kill_spanning"):
            raise StepFailed(spanning_message(processes, self.spanning_units, containers, selected, programs))

    def plan_containers(self, holders: list[Holder], targets: list[Holder]) -> _containers.Plan:
        """Containers to stop through their runtime, and the targets left to signal (_containers).
        A refusal (StepFailed) ends the run before anything is done."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers
        globs = self.named.containers
        own = _containers.own_containers(self.lineage, self.system.proc) if globs or any(t.get("container") for t in targets) else set()
        return _containers.plan(self.system.runtimes, holders, targets, globs, self.params.get("service_state"), own,
                                stop_found=self.params.get("kill", True))

    def plan_programs(self) -> ProgramPlan:
        """supervisord programs named in services as supervisor:<glob> (_supervisor)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor
        programs = self.named.programs
        if not programs:
            return no_programs()
        steps = _supervisor.plan(programs, self.params.get("service_state"), self.system.supervisors())
        self.result["warnings"].extend(steps["warnings"])
        return steps

    def plan_mps(self, targets: list[Holder]) -> tuple[list[Holder], list[Holder]]:
        """(targets, MPS servers to quit through their control daemon): _mps. A server that also
        serves unselected GPUs is a spanning process: it is a target only with kill_spanning."""
        if not targets or not self.params.get("kill", True):
            return targets, []
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
        return _mps.plan(targets, self.system.proc)

    # --- check mode

    def answer_check(self, plan: Plan) -> ReleaseResult:
        """Check mode: what the real run would stop, disable and signal, and its verdict when
        the look already decides it."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor
        units, programs, containers = plan.unit_steps, plan.program_steps, plan.containers
        self.result["changed"] = plan.to_do
        self.result["stopped_units"] = units["stop"]
        self.result["stopped_containers"] = containers.stop
        self.result["disabled_containers"] = containers.disable
        self.result["stopped_programs"] = [_supervisor.public(e) for e in programs["stop"]]
        self.result["disabled_programs"] = [_supervisor.public(e) for e in programs["disable"]]
        self.result["stopped_mps_servers"] = [{"pid": h["pid"], "name": h["name"], "pipe_directory": _mps.pipe_directory(h, self.system.proc),
                                               "gpu_indexes": h["gpu_indexes"], "how": None} for h in plan.mps_servers]
        if self.params.get("kill", True) and _mps.present(plan.holders):
            self.result["terminated_mps_clients"], notes = _mps.client_terminations(plan.holders, plan.targets, self.system.proc)
            self.result["warnings"].extend(notes)
        if self.state_key == "disabled_units":
            self.result["disabled_units"] = units["disable"]
        elif self.state_key == "masked_units":
            self.result["masked_units"] = units["mask"]
        if plan.guests:
            self.result.update(self.guest_units.planned(plan.guests, self.params.get("service_state")))  # type: ignore[typeddict-item]
        # What the real run would signal: holders whose unit is stopped end with it.
        by_unit = set(units["stop"])
        signalled = [h for h in plan.targets if not (h.get("system_service") and h.get("unit") in by_unit)
                     and not (plan.guests and self.guest_units.covered(h, plan.guests))]
        freezer = _signals.Freezer(self.system.proc)
        self.result["killed"] = [] if not self.params.get("kill", True) else [
            {"pid": h["pid"], "name": h["name"], "cmdline": h["cmdline"], "unit": h.get("unit"), "container": h.get("container"),
             "gpu_indexes": h["gpu_indexes"], "signal": None, "sigkill_at_once": _signals.reason_now(self.system, h, freezer), "exited_after_s": None}
            for h in signalled
        ]
        released = plan.gpus_clean and not plan.targets and not any(e["gpu_indexes"] for e in containers.stop)
        certain = self.certain_failure(plan.selected, plan.dirty_before, plan.holders, plan.apps,
                                       signalled, bool(plan.unheld_at_look) and not plan.hidden)
        return self.tail(released, self.result["gpus_before"], plan.holders, certain)

    def certain_failure(self, selected: list[int], dirty: list[Gpu], holders: list[Holder], apps: list[ComputeApp],
                        signalled: list[Holder], may_be_unheld: bool) -> str | None:
        """Check mode: the message of a failure the real run cannot escape, or None. Waiting
        cannot free a GPU held only by protected processes, one held by processes that kill=false
        leaves running, or one that nothing holds (after the same grace as the real run: a
        process that just exited may still free its memory)."""
        if not dirty:
            return None
        blind = unheld(dirty, holders, apps) if self.unreadable else []
        if blind:
            # Not root: the real run cannot see who holds these GPUs either; said as its first sentence, once.
            self.result["warnings"] = [w for w in self.result["warnings"] if not w.startswith("could not read the open files")]
            return failure_message(blind, holders, apps, 0.0, [], False, None, self.unreadable, inside=self.inside_container, node=self.reset_node())
        protected = [g for g in dirty if only_protected([g], holders, apps)]
        if protected:
            return failure_message(protected, holders, apps, 0.0, [], True, "protected", inside=self.inside_container, node=self.reset_node())
        if not self.params.get("kill", True):
            left = [h for h in _facts.dirty_holders(holders, selected) if h["pid"] in {t["pid"] for t in signalled}]
            stuck = [g for g in dirty if any(g["index"] in h["gpu_indexes"] for h in left)]
            if stuck:
                return failure_message(stuck, holders, apps, 0.0, [], False, "not_killed", inside=self.inside_container)
        nobody = [g["index"] for g in unheld(dirty, holders, apps)] if may_be_unheld else []
        if nobody:
            # The grace counts from the first scan, which a loaded host makes late: the deadline only
            # bounds the wait (verify ends as soon as the grace decides), so it leaves room for it.
            gpus, clean, early, _footprint = self.verify(nobody, self.system.now() + NO_HOLDER_GRACE_S + RESCAN_S + CHECK_SLACK_S, acted=False)
            if not clean and early == "no_holder":
                still = [g for g in gpus if g["index"] in nobody and not _facts.gpu_is_clean(g, self.max_used_mib())]
                holders_now, apps_now = self.scan(gpus)
                return failure_message(still, holders_now, apps_now, 0.0, [], False, "no_holder", inside=self.inside_container, node=self.reset_node())
        return None

    # --- act

    def act(self, plan: Plan) -> None:
        """Stop containers, units and programs, then signal who is left, then quit MPS servers.
        The restore record is written also when a stop failed: what was done must be put back."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _settle
        units, programs = plan.unit_steps, plan.program_steps
        outside = {h["container"]: reason for h, reason in plan.containers.outside}
        try:
            if plan.containers:
                outside.update(self.act_containers(plan.containers))
            if units["stop"] or units["disable"] or units["mask"]:
                self.act_units(units)
            if plan.guests:
                self.act_guests(plan.guests)
            if programs["stop"] or programs["disable"]:
                self.act_programs(programs)
        except StepFailed as exc:
            self.fold(exc.done)
            exc.done = None
            raise
        finally:
            self.write_record(units.get("before") or {}, plan.holders)
        targets = plan.targets
        if plan.containers.stop or units["stop"] or programs["stop"] or self.result["stopped_guest_units"]:
            # Stopping a unit or a container ended its processes; see who is left before signalling anyone.
            holders, _apps = self.scan(plan.gpus)
            targets, _protected = plan_targets(holders, plan.selected, self.regexes, bool(self.params.get("kill_spanning")))
            # Neither a control daemon (never signalled) nor a server to be quit through it (_mps).
            from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
            targets = _mps.without_daemons([t for t in targets if not _containers.pod_holders([t])], plan.mps_servers)
            self.to_end(targets)
        if targets and self.params.get("kill", True):
            minors = [g["minor_number"] for g in plan.gpus if g["index"] in plan.selected]
            self.watch = _settle.watch_for(targets, outside, self.system.systemctl, self.lineage, minors, self.system.proc,
                                           foreign=self.foreign(targets))
            self.act_mps_clients(plan.holders, targets)
            self.act_signals(targets)
        if plan.mps_servers:
            self.act_mps(plan.mps_servers)
        self.result["changed"] = bool(
            self.result["stopped_units"] or self.result.get("disabled_units") or self.result.get("masked_units") or self.result["killed"]
            or self.result["stopped_containers"] or self.result["disabled_containers"]
            or self.result["stopped_programs"] or self.result["disabled_programs"] or self.result["stopped_mps_servers"]
            or self.result["terminated_mps_clients"]
            or self.result["stopped_guest_units"] or self.result["disabled_guest_units"] or self.result["masked_guest_units"]
        )

    def foreign(self, targets: list[Holder]) -> t.Callable[[int, int], bool]:
        """For the respawn watch: (new pid, killed pid) -> whether the new process runs in another
        Slurm job than the killed holder did (read now, before the signals): the next task of an
        array job runs the same command line and is no restart. A holder of no job is restarted
        only outside any job."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs
        proc = self.system.proc
        jobs = {holder["pid"]: _jobs.owning_job(holder["pid"], proc) for holder in targets}
        return lambda pid, killed: _jobs.other_job(_jobs.owning_job(pid, proc), jobs.get(killed))

    def act_containers(self, plan: _containers.Plan) -> dict[str, str]:
        """Stop and disable containers -> {id: reason} of those that could not be stopped (they
        are signalled and watched from outside). What was done goes into the result also when a
        step failed."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers
        started = self.system.now()
        try:
            done = _containers.act(self.system.runtimes, plan, self.params.get("kill_timeout"), now=self.system.now)
        except StepFailed as exc:
            self.fold_containers(exc.done)
            raise StepFailed(exc.msg) from exc
        self.fold_containers(done)
        self.result["timings"]["stop_s"] = round(self.system.now() - started, 3)
        return done["failed"]

    def fold_containers(self, done: ContainersDone | None) -> None:
        """_containers.act's record (its own keys) into the result."""
        if done:
            self.result["disabled_containers"].extend(done.get("disabled") or [])
            self.result["stopped_containers"].extend(done.get("stopped") or [])
            self.result["warnings"].extend(done.get("warnings") or [])

    def _add_stop_time(self, started: float) -> None:
        self.result["timings"]["stop_s"] = round(self.result["timings"]["stop_s"] + self.system.now() - started, 3)

    def act_units(self, plan: UnitPlan) -> None:
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units
        started = self.system.now()
        try:
            self.fold(_units.act(self.system, plan, self.params.get("kill_timeout") or 0.0))
        finally:
            self._add_stop_time(started)

    def act_guests(self, plans: list[GuestPlan]) -> None:
        """A guest's named units, through the guest's systemd (_guest_units); their state before
        goes to the restore record."""
        self.guest_before = self.guest_units.before(plans)
        started = self.system.now()
        try:
            self.fold(self.guest_units.act(self.system, plans, float(self.params.get("kill_timeout") or 0.0)))
        finally:
            self._add_stop_time(started)

    def act_programs(self, plan: ProgramPlan) -> None:
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor
        started = self.system.now()
        try:
            self.fold(_supervisor.act(plan, self.params.get("kill_timeout")))
        finally:
            self._add_stop_time(started)

    def act_mps(self, servers: list[Holder]) -> None:
        """After the clients: the control daemon's quit waits for them. Servers that do not
        quit are signalled as holders."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
        started = self.system.now()
        left, done = _mps.stop(self.system, servers, self.params.get("kill_timeout"))
        self.fold(done)
        self._add_stop_time(started)
        if left:
            self.act_signals(left)

    def act_mps_clients(self, holders: list[Holder], targets: list[Holder]) -> None:
        """terminate_client for the targets that an MPS server's control daemon lists as its
        clients, before any signal (_mps); they are signalled after it as before."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
        if not _mps.present(holders):
            return
        started = self.system.now()
        self.fold(_mps.terminate_clients(holders, targets, self.system.proc))
        self._add_stop_time(started)

    def act_signals(self, targets: list[Holder]) -> None:
        started = self.system.now()
        try:
            self.fold(_signals.Signaller(self.system, self.params.get("kill_timeout") or 0.0).terminate(targets))
        finally:
            self.result["timings"]["kill_s"] = round(self.system.now() - started, 3)

    # --- verify

    def verify_and_settle(self, plan: Plan) -> ReleaseResult:
        """After acting: wait until the selected GPUs read clean, watch that nothing comes back,
        and end in the tail with the final readings (a failure names what still holds them)."""
        verify_started = self.system.now()
        deadline = verify_started + self.params["wait_timeout"]
        try:
            gpus, clean, early, footprint = self.verify(plan.selected, deadline, acted=self.result["changed"],
                                                        unheld_at_look=plan.unheld_at_look if not plan.hidden else ())
        except NvidiaSmiError as exc:
            # After acting, a failure still reports what was stopped and signalled.
            self.result.update({key: value for key, value in exc.details().items() if key != "msg"})  # type: ignore[typeddict-item]
            done = " (after acting: see stopped_units and killed)" if self.result["changed"] else ""
            raise Verdict(exc.msg + done, self._finish(*self.before)) from exc
        self.result["timings"]["wait_s"] = round(self.system.now() - verify_started, 3)
        came_back, clean, gpus = self.settle(plan.selected, clean, gpus)
        holders, apps = self.scan(gpus)
        self.after = (gpus, holders)
        footprint |= self.footprint(gpus, holders, apps)
        if self.health is not None:
            gpus = self.health.carry(gpus, plan.gpus)
            self.after = (gpus, holders)
        limit = self.max_used_mib()
        public = t.cast("list[Gpu]", [_facts.public_gpu(g, limit, footprint) for g in gpus])
        failure = came_back or (None if clean else self.dirty_message(plan, gpus, holders, footprint, early))
        return self.tail(clean, public, holders, failure)

    def settle(self, selected: list[int], clean: bool, gpus: list[Gpu]) -> tuple[str | None, bool, list[Gpu]]:
        """(why GPUs are held again or None, clean, readings): a clean run watches what may start
        a signalled holder again (_settle); a dirty one names the restarter that did."""
        came_back = None
        if clean and self.watch:
            settle_started = self.system.now()
            came_back = self.watch.settle(self.system, lambda: self._dirty_now(selected), self.settle_timeout())
            self.result["timings"]["settle_s"] = round(self.system.now() - settle_started, 3)
            if came_back:
                clean = False
                gpus = self._read_gpus()
        elif not clean and self.watch:
            # Dirty because a restarter started a killed holder again: name the restarter.
            again = self.watch.respawned()
            if again:
                came_back = self.watch.message([], [], 0.0, again, clean=False)
        if self.watch is not None and not came_back:
            # A restart from outside the parents (a double-forked watcher): one more table read.
            outside = self.watch.restarted_outside()
            if outside:
                came_back = self.watch.outside_message(outside, clean)
                if clean:
                    clean, gpus = False, self._read_gpus()
        return came_back, clean, gpus

    def dirty_message(self, plan: Plan, gpus: list[Gpu], holders: list[Holder], footprint: set[int], early: str | None) -> str:
        # A GPU that reads only the cross-GPU footprint is clean in this result: not in its message.
        limit = self.max_used_mib()
        dirty = [g for g in gpus if g["index"] in plan.selected and g["index"] not in footprint and not _facts.gpu_is_clean(g, limit)]
        unreadable = plan.unreadable if plan.hidden else 0
        if unreadable and plan.hidden in self.result["warnings"]:
            # Said once: the message's first sentence carries it.
            self.result["warnings"].remove(plan.hidden)
        apps = self._apps(gpus)
        # Only when wait_timeout ran out: an early end says why waiting cannot help.
        signalled = {e["pid"] for e in self.result["killed"]} | {e["pid"] for e in self.result["unkillable"]}
        freeing = {} if early else freeing_notes(dirty, holders, apps, self.trend, lambda pid: holders_mod.is_exiting(pid, self.system.proc),
                                                 signalled)
        return failure_message(dirty, holders, apps, self.result["timings"]["wait_s"], self.result["unkillable"],
                               early == "protected", early, unreadable, freeing, self.inside_container, self.reset_node())

    def reset_node(self) -> _reset.Node:
        """What the reset advice of a failure needs of this node (read only for a failure)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _reset
        return _reset.Node(gpus=self.before[0], fabric_manager=getattr(self.health, "fabric_manager", None),
                           drm=_reset.read_nvidia_drm(), nvswitch=_reset.nvswitch_present(), inside=self.inside_container,
                           kernel_seen=_reset.driver_module_seen())

    def verify(self, selected: list[int], deadline: float, acted: bool, unheld_at_look: t.Collection[int] = ()
               ) -> tuple[list[Gpu], bool, str | None, set[int]]:
        """Poll until every selected GPU is clean. Returns (gpus, clean, early, footprint): early
        says why it stopped before `deadline` because waiting cannot help (see EARLY_HEADS);
        footprint are the GPUs clean only through the cross-GPU footprint allowance.

        A dirty GPU that no process holds, when nothing was done (or nothing was done for it: it
        was unheld at the look, `unheld_at_look`), fails after NO_HOLDER_GRACE_S of readings that
        do not drop, not after wait_timeout: an idle MIG GPU reads 55 MiB forever.

        A GPU that reads no more than the footprint above max_used_mib is clean when nothing uses
        it and contexts live on other GPUs: freeing GPU 1 next to training on GPU 0 leaves 4 MiB
        on GPU 1 (H200). Deciding that takes a scan (and the compute apps), so only then.

        Reads start every poll_interval (a fixed rate: the ~25 ms of each nvidia-smi call is not
        added to the interval). Right after acting, memory is expected to drop 20-130 ms after
        the holders exit, so the costlier look at who still holds the GPUs waits RESCAN_S."""
        limit = self.max_used_mib()
        poll = self.params["poll_interval"]
        last_scan = self.system.now() if acted else None
        footprint = Footprint(self)
        unheld_for = Unheld(acted, unheld_at_look)
        while True:
            poll_started = self.system.now()
            gpus = self._read_gpus()
            self.trend.add(self.system.now(), gpus)
            dirty = [g for g in gpus if g["index"] in selected and not _facts.gpu_is_clean(g, limit)]
            if not dirty:
                return gpus, True, None, set()
            if any(g.get("memory_used_mib") is None for g in dirty):
                return gpus, False, "unreadable", set()
            now = self.system.now()
            if self.may_be_footprint(dirty):
                dirty = [g for g in dirty if g["index"] not in footprint.of(gpus, now)]
                if not dirty:
                    return gpus, True, None, footprint.gpus
            if last_scan is None or now - last_scan >= RESCAN_S:
                last_scan = now
                early = self.why_waiting_cannot_help(gpus, dirty, unheld_for, now)
                if early:
                    return gpus, False, early, set()
            if now >= deadline:
                return gpus, False, None, set()
            self.system.sleep(min(poll_started + poll, deadline) - self.system.now())

    def why_waiting_cannot_help(self, gpus: list[Gpu], dirty: list[Gpu], unheld_for: Unheld, now: float) -> str | None:
        """A scan of who holds the dirty GPUs -> a key of EARLY_HEADS when waiting cannot free
        them, else None."""
        holders, apps = self.scan(gpus)
        # The scan fetched the compute apps whenever a listing can decide this.
        if only_protected(dirty, holders, apps):
            return "protected"
        if not self.params.get("kill", True) and _facts.dirty_holders(holders, [g["index"] for g in dirty]):
            return "not_killed"
        if self.watch and self.watch.respawned():
            return "respawned"
        if unheld_for.long_enough(dirty, unheld(dirty, holders, apps), now):
            return "no_holder"
        return None

    def recorded_unit_files(self) -> set[str]:
        """The units an earlier release disabled or masked, by the restore record (_record): their
        files are read on disk before they are disabled or masked again (_units.already_on_disk)."""
        path = getattr(self.system, "record_path", None)
        if not path or self.params.get("service_state") not in ("disabled", "masked"):
            return set()
        from ansible_collections.zeromib.gpu.plugins.module_utils import _record
        return _record.unit_files_changed(path)

    def write_record(self, unit_before: dict[str, dict[str, str]], holders: list[Holder]) -> None:
        """Add what this run stopped, disabled or masked to the restore record (_record)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils import _record
        path = getattr(self.system, "record_path", None)
        if not path:
            return
        entries = _record.release_entries(self.result, unit_before, holders, _record.now_iso(), _record.login_user(self.system.proc),
                                          self.guest_before)
        try:
            record = _record.add(path, entries)
        except (_record.RecordError, OSError) as exc:
            self.result["warnings"].append(f"the restore record was not written, so gpu_restore cannot put back what this run changed: {exc}")
            return
        if record is not None:
            self.result["restore_record"] = {"path": path, "entries": len(record["entries"])}

    def _read_gpus(self) -> list[Gpu]:
        gpus = self.smi.query_gpus(GPU_FIELDS)
        # A GPU that drops out of nvidia-smi's answer later is never read as released either.
        check_against_driver(gpus, self.minors_by_bus)
        return _facts.with_minor_numbers(gpus, self.minors_by_bus)

    def _dirty_now(self, selected: list[int]) -> list[Gpu]:
        """Selected GPUs dirty right now; a GPU that reads only the cross-GPU footprint is not."""
        limit = self.max_used_mib()
        gpus = self._read_gpus()
        dirty = [g for g in gpus if g["index"] in selected and not _facts.gpu_is_clean(g, limit)]
        if self.may_be_footprint(dirty):
            footprint = self.footprint(gpus, *self.scan(gpus))
            dirty = [g for g in dirty if g["index"] not in footprint]
        return dirty

    def _apps(self, gpus: list[Gpu]) -> list[ComputeApp]:
        try:
            text = self.smi.run(self.smi.app_args())
            apps = parse_compute_apps(text)
        except NvidiaSmiError:  # best effort: the verdict comes from memory.used, not from this list
            return []
        return _facts.join_apps(apps, gpus, lambda pid: _facts.alive(pid, self.system.proc),
                                lambda pid: holders_mod.display_name(pid, self.system.proc))

    def with_shm_floor(self, summary: dict[str, t.Any]) -> dict[str, t.Any]:
        """The host's health keys with /dev/shm's free-space issue, if any (read_shm)."""
        if self.shm_issue is None:
            return summary
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _shm
        return _shm.with_floor(summary, self.shm_issue)

    def _finish(self, gpus_before: list[Gpu], holders_before: list[Holder], gpus_after: list[Gpu] | None = None,
                holders_after: list[Holder] | None = None) -> ReleaseResult:
        summary = _facts.health_summary(self.result["gpus"] or self.result["gpus_before"], self.health)  # type: ignore[arg-type]
        self.result.update(self.with_shm_floor(summary))  # type: ignore[typeddict-item]
        changes_before, changes_after = plan_diff(self.result, self.check_mode)
        if self.check_mode:
            # Memory and holders are what a dry run cannot change: the plan is the difference.
            ending = {k["pid"] for k in self.result.get("killed") or []}
            stopping = set(self.result.get("stopped_units") or [])
            stopping_guests = set(self.result.get("stopped_guest_units") or [])
            gpus_after, holders_after = gpus_before, [h for h in holders_before if h["pid"] not in ending
                                                      and not (h.get("system_service") and h.get("unit") in stopping)
                                                      and not (h.get("guest") and _guests.entry(h["guest"] or {}) in stopping_guests)]
        self.result["diff"] = {  # type: ignore[typeddict-unknown-key]
            "before": summarize_diff(gpus_before, holders_before, changes_before),
            "after": summarize_diff(gpus_after if gpus_after is not None else gpus_before,
                                    holders_after if holders_after is not None else holders_before, changes_after),
        }
        return self.result


class Verdict(StepFailed):
    """The run's own verdict of failure, raised by Release.tail with the finished result."""

    done: t.Any


class Footprint:
    """The verify loop's footprint decision: it holds while the readings do (or for RESCAN_S),
    so one scan decides it, not one a poll."""

    def __init__(self, release: Release) -> None:
        self.release = release
        self.gpus: set[int] = set()
        self.key: tuple[int | None, ...] | None = None
        self.at = 0.0

    def of(self, gpus: list[Gpu], now: float) -> set[int]:
        key = tuple(g["memory_used_mib"] for g in gpus)
        if key != self.key or now - self.at >= RESCAN_S:
            self.gpus, self.key, self.at = self.release.footprint(gpus, *self.release.scan(gpus)), key, now
        return self.gpus


class Unheld:
    """Since when every dirty GPU has read unheld, and what it read then: NO_HOLDER_GRACE_S of
    readings that do not drop end the wait (only when nothing was done, or nothing for them)."""

    def __init__(self, acted: bool, unheld_at_look: t.Collection[int]) -> None:
        self.acted = acted
        self.unheld_at_look = unheld_at_look
        self.since: float | None = None
        self.mib: dict[int, int | None] = {}

    def long_enough(self, dirty: list[Gpu], nobody: list[Gpu], now: float) -> bool:
        mib = {g["index"]: g["memory_used_mib"] for g in dirty}
        if len(nobody) == len(dirty) and (not self.acted or all(g["index"] in self.unheld_at_look for g in dirty)):
            if self.since is None or any((mib.get(i) or 0) < (m or 0) for i, m in self.mib.items()):
                # Memory still dropping: a context is being freed right now.
                self.since, self.mib = now, mib
            elif now - self.since >= NO_HOLDER_GRACE_S:
                return True
        else:
            self.since, self.mib = None, {}
        return False


class MemoryTrend:
    """The verify loop's readings over the last TREND_WINDOW_S, per GPU: whether a GPU still dirty
    when wait_timeout runs out is still being freed (its memory fell and never rose meanwhile: a
    training step's allocations go up and down, a teardown only down)."""

    def __init__(self) -> None:
        self.readings: dict[int, list[tuple[float, int]]] = {}

    def add(self, now: float, gpus: list[Gpu]) -> None:
        for gpu in gpus:
            mib = gpu.get("memory_used_mib")
            if mib is None:
                continue
            kept = self.readings.setdefault(gpu["index"], [])
            kept.append((now, mib))
            # One reading at or before the window's start stays, so that the fall spans the window.
            while len(kept) > 2 and kept[1][0] <= now - TREND_WINDOW_S:
                kept.pop(0)

    def falling(self, index: int) -> tuple[int, int, float] | None:
        """(MiB then, MiB now, seconds between) when the memory fell over the window, else None."""
        kept = self.readings.get(index) or []
        values = [mib for _at, mib in kept]
        if len(values) >= 2 and values[-1] < values[0] and all(after <= before for before, after in zip(values, values[1:])):
            return values[0], values[-1], kept[-1][0] - kept[0][0]
        return None
