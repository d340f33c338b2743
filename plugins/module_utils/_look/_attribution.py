# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Which process uses which GPU. Pure functions: records in, records out.

Which device files a process has open says nothing about which GPU it uses: on a real
multi-GPU node every CUDA process and every NVML client opens every /dev/nvidia<minor>
(readings of a 2-GPU H200, driver 580.159.04, in tests/fixtures/h200x2-proc/maps_probe.json).
What does tell them apart, in this order:

1. listed: a live PID that `nvidia-smi --query-compute-apps` lists on GPU X uses GPU X, and
   only the GPUs where it is listed, while it really holds X's device file (open or mapped: a
   listing alone moves nothing, `held_listing`). Where it maps some GPU's node context-sized, a
   listing counts only on such a GPU: a PID reused by a new process after its listed owner died
   (the owner's orphaned child keeps the context, nvidia-smi keeps listing the old PID) maps the
   old owner's GPU only as every CUDA process maps its peers.
2. mapped: a process nvidia-smi does not list (the child of a CUDA process, orphaned or not;
   nvidia-smi charges its memory to the owner, `[Not Found]` once the owner is dead) uses the
   GPUs whose per-GPU node it maps context-sized. Measured: its context GPU's node in 3
   mappings of 2176 KiB in all; each other GPU's node in 2 mappings of 128 KiB (none at all
   for a GPU that CUDA_VISIBLE_DEVICES hides). CONTEXT_MAP_MIN_KIB sits between the two.
   undecided: it maps per-GPU nodes but none context-sized, or its maps cannot be read. It
   may use any of them (`candidate_gpu_indexes`): it is reported, and never signalled on
   behalf of a selection that does not hold all of them.
3. nvml_client: not listed and mapping no per-GPU node (nvidia-smi itself, `nvidia-smi dmon`
   maps 8 KiB of /dev/nvidiactl, a pynvml loop maps nothing; nvtop, gpustat, DCGM/NVML
   exporters, the Kubernetes device plugin, nvidia-persistenced). It uses no GPU memory: never
   dirty, never signalled unless `match` names it.

blocked: a process whose /proc entries did not answer (_holders.blocked_record: in execve on a
FUSE mount that stopped answering, a stalled NFS server). What it holds is unknown: it may use any
GPU of the node (`candidate_gpu_indexes`), so no GPU is clean beside it, and it is never signalled
(its identity cannot be checked).

Spanning: a process placed on a selected GPU and on one outside the selection (listed or
mapped on both: JAX on every visible GPU, a DataParallel trainer, an MPS server) is never
signalled for that selection unless the caller says kill_spanning (`may_signal_for`,
`spanning_for`): ending it would end its work on the GPUs the selection kept out.

A GPU with no context of its own still reads the footprint of contexts on the other GPUs: 4 MiB
on H200 (GPU 1 while a process without CUDA_VISIBLE_DEVICES has its context on GPU 0, also with
two such processes; GPU 0 next to the orphaned child of a GPU-1 owner). That allowance is
explicit (`cross_gpu_footprint_mib`), applies only to a GPU that no process uses, and is reported
per GPU (`cross_gpu_footprint`), instead of a silent raise of max_used_mib.
"""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look._devices import gpu_minor

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, Gpu, Holder

    # (gpu_indexes, attribution, candidate_gpu_indexes)
    Placement = t.Tuple[t.List[int], str, t.List[int]]

LISTED = "listed"
MAPPED = "mapped"
UNDECIDED = "undecided"
NVML_CLIENT = "nvml_client"
BLOCKED = "blocked"

# Context GPU: 2176 KiB mapped; the other GPUs: 128 KiB (H200, driver 580.159.04). A factor of
# two below the one and eight above the other.
CONTEXT_MAP_MIN_KIB = 1024
# memory.used of a GPU without a context of its own while contexts live on other GPUs (H200).
CROSS_GPU_FOOTPRINT_MIB = 4


def listed_gpus(apps: t.Iterable[ComputeApp]) -> dict[int, set[int]]:
    """Compute apps -> {live pid: {GPU index, ...}}. Dead owners ([Not Found]) list nobody."""
    listed: dict[int, set[int]] = {}
    for app in apps:
        index = app.get("gpu_index")
        if app.get("alive") and index is not None:
            listed.setdefault(app["pid"], set()).add(index)
    return listed


def mapped_gpu_kib(mapped: t.Mapping[str, t.Mapping[str, int]] | None, minor_to_index: t.Mapping[int, int]) -> dict[int, int] | None:
    """{GPU index: KiB mapped of its node} for the GPUs of this host; None when unknown."""
    if mapped is None:
        return None
    sizes: dict[int, int] = {}
    for device, mapping in mapped.items():
        minor = gpu_minor(device)
        if minor is not None and minor in minor_to_index:
            sizes[minor_to_index[minor]] = sizes.get(minor_to_index[minor], 0) + mapping["kib"]
    return sizes


def open_gpus(devices: t.Iterable[str], minor_to_index: t.Mapping[int, int]) -> set[int]:
    """GPU indexes whose per-GPU node is among `devices` (open or mapped)."""
    indexes: set[int] = set()
    for device in devices:
        minor = gpu_minor(device)
        if minor is not None and minor in minor_to_index:
            indexes.add(minor_to_index[minor])
    return indexes


def held_listing(listed: t.Iterable[int] | None, mapped_kib: t.Mapping[int, int] | None, devices_gpus: t.Iterable[int]) -> set[int]:
    """The GPUs of a listing that the process really holds (rule 1 above)."""
    held = set(listed or ()) & set(devices_gpus)
    context = {index for index, kib in (mapped_kib or {}).items() if kib >= CONTEXT_MAP_MIN_KIB}
    return held & context if context else held


def place(listed: t.Iterable[int] | None, mapped_kib: t.Mapping[int, int] | None, devices_gpus: t.Collection[int]) -> Placement:
    """The rule above for one process -> (gpu_indexes, attribution, candidate_gpu_indexes).

    `listed`: GPUs where nvidia-smi lists the PID; `mapped_kib`: {GPU: KiB mapped}, or None
    when the maps could not be read; `devices_gpus`: GPUs whose node it has open or mapped."""
    held = held_listing(listed, mapped_kib, devices_gpus)
    if held:
        return sorted(held), LISTED, []
    if mapped_kib is None:
        if devices_gpus:
            return [], UNDECIDED, sorted(devices_gpus)
        return [], NVML_CLIENT, []
    if not mapped_kib:
        return [], NVML_CLIENT, []
    context = sorted(index for index, kib in mapped_kib.items() if kib >= CONTEXT_MAP_MIN_KIB)
    if context:
        return context, MAPPED, []
    return [], UNDECIDED, sorted(mapped_kib)


def attribute(holders: t.Iterable[Holder], apps: t.Iterable[ComputeApp], minor_to_index: t.Mapping[int, int]) -> list[Holder]:
    """Fill in gpu_indexes, attribution and candidate_gpu_indexes (returns new records)."""
    listed = listed_gpus(apps)
    result: list[Holder] = []
    for holder in holders:
        record = t.cast("Holder", dict(holder))
        if record.get("blocked"):
            record["gpu_indexes"], record["attribution"], record["candidate_gpu_indexes"] = [], BLOCKED, sorted(set(minor_to_index.values()))
            result.append(record)
            continue
        gpus, why, candidates = place(
            listed.get(record["pid"]),
            mapped_gpu_kib(record.get("mapped"), minor_to_index),
            open_gpus(record.get("devices") or [], minor_to_index),
        )
        record["gpu_indexes"] = gpus
        record["attribution"] = why
        record["candidate_gpu_indexes"] = candidates
        result.append(record)
    return result


def needs_listing(holders: t.Iterable[Holder]) -> bool:
    """True when nvidia-smi's compute apps can change the answer: some process maps a per-GPU
    node (or its maps are unknown). With only NVML clients about, one call fewer."""
    for holder in holders:
        mapped = holder.get("mapped")
        if mapped is None or any(gpu_minor(device) is not None for device in mapped):
            return True
    return False


def outside_gpus(holder: Holder, selected: t.Iterable[int]) -> list[int]:
    """GPUs outside `selected` that a holder of a selected GPU uses (listed or mapped there):
    a *spanning* process (JAX preallocates on every visible GPU, a DataParallel trainer, an MPS
    server). Empty when it uses no selected GPU, or only selected ones. An undecided holder
    spans nothing here: it may not use a selected GPU at all (see undecided_for)."""
    gpus = set(holder.get("gpu_indexes") or [])
    chosen = set(selected)
    if not gpus & chosen:
        return []
    return sorted(gpus - chosen)


def may_signal_for(holder: Holder, selected: t.Iterable[int], kill_spanning: bool = False) -> bool:
    """Whether freeing `selected` may signal this holder: it uses a selected GPU and no other
    (or `kill_spanning`: ending its work on the unselected GPUs too was asked for), or,
    undecided, every GPU it may use is selected."""
    chosen = set(selected)
    if holder.get("attribution") == BLOCKED:
        return False
    if holder.get("attribution") == UNDECIDED:
        candidates = set(holder.get("candidate_gpu_indexes") or [])
        return bool(candidates) and candidates <= chosen
    if not set(holder.get("gpu_indexes") or []) & chosen:
        return False
    return kill_spanning or not outside_gpus(holder, chosen)


def spanning_for(holders: t.Iterable[Holder], selected: t.Iterable[int]) -> list[Holder]:
    """Holders of a selected GPU that also use GPUs outside the selection (outside_gpus)."""
    chosen = set(selected)
    return [holder for holder in holders if outside_gpus(holder, chosen)]


def undecided_for(holders: t.Iterable[Holder], selected: t.Iterable[int]) -> list[Holder]:
    """Undecided holders that may use a selected GPU but are not signalled for it."""
    chosen = set(selected)
    return [
        holder
        for holder in holders
        if holder.get("attribution") == UNDECIDED and set(holder.get("candidate_gpu_indexes") or []) & chosen
        and not may_signal_for(holder, chosen)
    ]


def blocked_for(holders: t.Iterable[Holder], selected: t.Iterable[int]) -> list[Holder]:
    """Processes that did not answer and may use a selected GPU (all of them do: see BLOCKED)."""
    chosen = set(selected)
    return [holder for holder in holders if holder.get("attribution") == BLOCKED and set(holder.get("candidate_gpu_indexes") or []) & chosen]


def unexplained_by_readers(gpus: t.Iterable[Gpu], apps: t.Iterable[ComputeApp], holders: t.Iterable[Holder], selected: t.Iterable[int],
                           max_used_mib: float, footprint: t.Container[int] = ()) -> list[int]:
    """Selected GPUs whose memory a process that could not be read (blocked, or left unread by
    the scan's deadline) may hold: the verdict on a GPU comes from the GPU (issue 66). A GPU that
    reads at most `max_used_mib` (or only the cross-GPU footprint) with no compute app is free,
    whatever else could not be read; one above it is explained when processes that answered are
    placed on it and every compute app listed there is one of them, alive. Anything else (no
    reading, memory nobody readable holds, a listing of a dead or unread PID) is unexplained."""
    chosen = set(selected)
    listed: dict[int, list[ComputeApp]] = {}
    for app in apps:
        if app.get("gpu_index") is not None:
            listed.setdefault(t.cast(int, app["gpu_index"]), []).append(app)
    readers = [h for h in holders if h.get("attribution") != BLOCKED]
    placed: dict[int, set[int]] = {}
    for holder in readers:
        for index in holder.get("gpu_indexes") or []:
            placed.setdefault(index, set()).add(holder["pid"])
    unexplained = []
    for gpu in gpus:
        index, used = gpu["index"], gpu.get("memory_used_mib")
        claims = listed.get(index, [])
        if index not in chosen:
            continue
        if used is not None and not claims and (used <= max_used_mib or index in footprint):
            continue
        pids = placed.get(index, set())
        if used is not None and pids and all(app.get("alive") and app["pid"] in pids for app in claims):
            continue
        unexplained.append(index)
    return unexplained


def footprint_gpus(gpus: t.Iterable[Gpu], holders: t.Iterable[Holder], apps: t.Iterable[ComputeApp], max_used_mib: float,
                   footprint_mib: float | None = CROSS_GPU_FOOTPRINT_MIB) -> set[int]:
    """Indexes of the GPUs whose memory above max_used_mib is only the cross-GPU footprint: no
    compute app and no process on the GPU itself, contexts on another GPU, and memory.used
    within max_used_mib + footprint_mib."""
    if not footprint_mib:
        return set()
    with_context = {app["gpu_index"] for app in apps if app.get("gpu_index") is not None}
    for holder in holders:
        with_context.update(holder.get("gpu_indexes") or [])
        if holder.get("attribution") in (UNDECIDED, BLOCKED):
            with_context.update(holder.get("candidate_gpu_indexes") or [])
    footprint: set[int] = set()
    for gpu in gpus:
        used = gpu.get("memory_used_mib")
        if used is None or used <= max_used_mib or used > max_used_mib + footprint_mib:
            continue
        if gpu["index"] not in with_context and with_context - {gpu["index"]}:
            footprint.add(gpu["index"])
    return footprint
