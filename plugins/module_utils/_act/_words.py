# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""gpu_release's failure words: the messages of a refusal or a failure, pure functions of what
the run read (no reading, no acting). The reset advice loads _look/_reset only for a failure
that needs it."""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _caps
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._act._plan import is_idle_baseline, is_mig

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._release import MemoryTrend
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _reset  # noqa: F401 - annotations
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, Gpu, Holder


def _gpu_list(indexes: t.Iterable[int]) -> str:
    return ",".join(str(i) for i in indexes)


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


def describe_holder(holder: Holder | dict[str, t.Any], mib: int | None = None) -> str:
    """`pid 812 vllm [cmdline] (unit ..., state S)`; `mib`: what nvidia-smi charges it on the GPU named before."""
    parts = ["pid {} {}".format(holder["pid"], holder.get("name"))]
    cmdline = holder.get("cmdline") or ""
    if cmdline and cmdline != holder.get("name"):
        parts[0] += " [{}]".format(cmdline if len(cmdline) <= 60 else cmdline[:57] + "...")
    origin = holder.get("origin")
    if origin:
        # Where it came from, outside every job (_look/_origin, issue 70): the login session names the unit.
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _origin
        parts.append(origin["text"] + _origin.stop_words(origin))
    elif holder.get("unit"):
        parts.append("unit {}".format(holder["unit"]))
    if holder.get("container"):
        parts.append("container {}".format(holder.get("container_name") or (holder.get("container") or "")[:12]))
    guest = holder.get("guest")
    if guest:
        parts.append("{}{}".format(_guests.label(guest), ": {}".format(guest["unit"]) if guest.get("unit") else ""))
    if holder.get("sleep_answer"):
        # Its own server's word, quoted (_look/_sleep_mode, loaded only for a holder that answered): it decides nothing.
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _sleep_mode
        said = _sleep_mode.note(holder["sleep_answer"], mib)
        if said:
            parts.append(said)
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
    "frozen": "GPUs are held by processes in a frozen cgroup, which no signal ends before it is thawed (waiting would not free them)",
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
        charged = {a["pid"]: a.get("used_memory_mib") for a in claims if a.get("alive")}
        text += ", held by " + _caps.named([describe_holder(h, charged.get(h["pid"])) for h in unprotected + protected_claimants])
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
    elif gpu.get("memory_proof") == "unified memory" and not on_gpu and not claims:
        # A GPU sharing the host's memory: its proof is the host's MemAvailable (_look/_unified_memory, issue 70).
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _unified_memory
        text += _unified_memory.failure(gpu)
    elif node is not None and (node.virtualization or {}).get(gpu["index"]) == "Host VGPU" and not on_gpu and not dead_claims:
        # A vGPU host: what no process holds is the VMs' framebuffer (_look/_node_shapes, issue 70).
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _node_shapes
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _vfio
        text += _node_shapes.given_to_vms(gpu, _vfio.vms_of_gpu(node.given_to_vms, gpu.get("pci_bus_id")))
    elif node is not None and node.imex is not None and not on_gpu and (dead_claims or not is_idle_baseline(gpu)):
        # A node of a multi-node NVLink domain: the holder may be another node's importer (_look/_node_shapes, issue 70).
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _node_shapes
        text += _node_shapes.pinned_elsewhere(gpu, node.imex, [a["pid"] for a in dead_claims], inside)
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
                    freeing: t.Mapping[int, str] | None = None, inside: bool = False, node: _reset.Node | None = None,
                    proc: str | None = None, unsignalled: t.Sequence[Holder] = ()) -> str:
    """One message naming each dirty GPU, its MiB and what still holds it. `early`: why the
    wait stopped before wait_timeout (a key of EARLY_HEADS). `unreadable`: how many processes
    could not be read (not root): then the permission problem is the head. `freeing`: the GPUs
    still being freed when wait_timeout ran out, and why (freeing_notes). `inside`: the run is
    in a container (gpu_failure). `node`: for the reset advice (_reset). `proc`: where a holder that
    outlived SIGKILL, or one of `unsignalled` (holders the run does not signal: check mode,
    kill=false), is looked up in a frozen cgroup (_look/_frozen; None: not looked up)."""
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
    if unkillable and proc is not None:
        frozen_lines, unkillable = frozen_holders(unkillable, holders, proc)
        lines += frozen_lines
    if unsignalled and proc is not None:
        lines += [words for _holder, words in frozen_unsignalled(unsignalled, proc)]
    if unkillable:
        lines.append("unkillable (outlived SIGKILL: a thread of it stays in the kernel, D state, in the driver or a file system that does not "
                     "answer): " + "; ".join(describe_holder(h) for h in unkillable) + "; a reboot is needed (nothing else ends a process "
                     "stuck in the kernel)")
    return "{}: {}".format(head, ". ".join(lines))


def frozen_holders(unkillable: list[dict[str, t.Any]], holders: list[Holder], proc: str) -> tuple[list[str], list[dict[str, t.Any]]]:
    """The words for the holders that outlived SIGKILL because their cgroup is frozen (a paused
    container, the cgroup v1 freezer: never "unkillable, reboot"), and the truly unkillable rest."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _frozen
    by_pid = {h["pid"]: h for h in holders}
    lines, rest = [], []
    for entry in unkillable:
        frozen = _frozen.frozen_of(int(entry["pid"]), proc)
        if frozen is None:
            rest.append(entry)
            continue
        holder = by_pid.get(entry["pid"]) or {}
        lines.append(_frozen.advice(describe_holder(t.cast("Holder", dict(holder, **entry))), frozen, holder.get("container_runtime"),
                                    holder.get("container_name")))
    return lines, rest


def frozen_unsignalled(unsignalled: t.Sequence[Holder], proc: str, for_good: bool = False) -> list[tuple[Holder, str]]:
    """(holder, words) for each holder the run does not signal whose cgroup is frozen (read only
    for these: a dirty host's check mode or kill=false); `for_good`: only those no signal would
    end before a thaw (the cgroup v1 freezer keeps even SIGKILL pending)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _frozen
    found = []
    for holder in unsignalled:
        frozen = _frozen.frozen_of(int(holder["pid"]), proc)
        if frozen is not None and (not for_good or _frozen.keeps_sigkill_pending(frozen)):
            found.append((holder, _frozen.not_signalled(describe_holder(holder), frozen, holder.get("container_runtime"), holder.get("container_name"))))
    return found


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


def reset_node(gpus: list[Gpu], health: t.Any, inside: bool, run: t.Any = None, given_to_vms: t.Sequence[t.Mapping[str, t.Any]] = ()) -> _reset.Node:
    """What the reset advice of a failure needs of this node (read only for a failure). `run`:
    nvidia-smi's runner, for each GPU's virtualization mode (_look/_node_shapes, issue 70);
    `given_to_vms`: the look's GPUs and vGPUs given to VMs (_look/_vfio)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _node_shapes
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _reset
    return _reset.Node(gpus=gpus, fabric_manager=getattr(health, "fabric_manager", None),
                       drm=_reset.read_nvidia_drm(), nvswitch=_reset.nvswitch_present(), inside=inside,
                       kernel_seen=_reset.driver_module_seen(), imex=_node_shapes.imex_domain(),
                       virtualization=_node_shapes.read_virtualization(run, gpus) if run is not None else None, given_to_vms=given_to_vms)


def summarize_diff(gpus: list[Gpu], holders: list[Holder], changes: t.Iterable[str] = ()) -> str:
    """Diff-mode text: per-GPU memory and the holders, one line each, then `changes` (lines of
    plan_diff: what is, or will be, stopped, disabled, masked and signalled)."""
    lines = ["GPU {} {}: {} MiB".format(g["index"], g.get("uuid"), g.get("memory_used_mib")) for g in gpus]
    lines += ["holder {}: {}".format(describe_holder(h), ",".join(str(i) for i in h["gpu_indexes"]) or "control nodes") for h in holders]
    lines += list(changes)
    return "\n".join(lines) + "\n"
