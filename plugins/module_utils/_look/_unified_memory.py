# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""GPUs that share the host's memory (issue 70, shape 1): GB10 (DGX Spark), Jetson-class.

Such a GPU has no memory of its own: nvidia-smi answers `[N/A]` for memory.total, memory.used and
memory.free while the GPU answers everything else, and per-process `used_memory` still works
(leptonai/gpud#1170, Syllo/nvtop#411, XuehaiPan/nvitop#208, wookayin/gpustat#179). A 0 MiB proof can
never pass there, and what limits the next job is the host's MemAvailable. Its proof is instead: no
compute process on the GPU (the driver's list) and at least `min_host_available_mib` of the host's
MemAvailable (/proc/meminfo: the kernel's, no tenant's to write).

Loaded only where nvidia-smi's answer shows the shape (_nvidia_smi.shows_unified_memory): a plain
node reads nothing here. The GPU's record then carries `memory_used_mib` as the sum of its
processes' used_memory (what the driver charges them; 0 with none), `memory_proof` UNIFIED and
`host_memory_available_mib`; `_unified_not_free` says why it is not free (or None), which
_facts.gpu_is_clean reads.
"""

from __future__ import annotations

import typing as t

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, Gpu

MEMINFO = "/proc/meminfo"
UNIFIED = "unified memory"
# The least host memory a unified-memory GPU's next job gets by default: a CUDA context and the
# driver's own allocations take a few hundred MiB, a small model a few GiB; 1 GiB is what any job
# needs and what a Jetson with 4 GiB in all can still leave free. A serving node sets its model's size.
DEFAULT_MIN_HOST_AVAILABLE_MIB = 1024
# Why such a GPU is not free (the words _act/_words and the Slurm causes give).
BUSY = "compute processes"
SHORT = "host memory"
UNREAD = "host memory unread"


def host_available_mib(meminfo: str = MEMINFO) -> int | None:
    """MemAvailable in MiB, from /proc/meminfo; None where it cannot be read."""
    try:
        with open(meminfo, "rb") as handle:
            text = handle.read(8192).decode("ascii", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) // 1024
    return None


def not_free(apps_on_gpu: int, available: int | None, least: int) -> str | None:
    """Why a unified-memory GPU is not free (BUSY, UNREAD, SHORT), or None; pure."""
    if apps_on_gpu:
        return BUSY
    if available is None:
        return UNREAD
    return SHORT if available < least else None


def fill(gpus: t.Sequence[Gpu], apps: t.Sequence[ComputeApp], least: int, available: int | None) -> None:
    """Annotate the unified-memory GPUs of `gpus` (in place) from the compute apps' rows (raw:
    gpu_uuid, used_memory_mib) and the host's MemAvailable. A process whose used_memory is unknown
    leaves the GPU's reading unknown (never clean)."""
    for gpu in gpus:
        if not shows_unified(gpu):
            continue
        record = t.cast("dict[str, t.Any]", gpu)
        on_gpu = [app for app in apps if app.get("gpu_uuid") == gpu.get("uuid")]
        charged = [app.get("used_memory_mib") for app in on_gpu]
        record["memory_used_mib"] = None if any(mib is None for mib in charged) else sum(t.cast("list[int]", charged))
        record["memory_proof"] = UNIFIED
        record["host_memory_available_mib"] = available
        record["min_host_available_mib"] = least
        record["_unified_not_free"] = not_free(len(on_gpu), available, least)


def shows_unified(gpu: t.Mapping[str, t.Any]) -> bool:
    """nvidia-smi answered `[N/A]` for memory.total, memory.used and memory.free of a GPU that
    answers its name and bus (not `[Unknown Error]` or a lost GPU: those stay unknown); pure."""
    unavailable = gpu.get("_unavailable") or {}
    return (all(unavailable.get(key) == "[N/A]" for key in ("memory_total_mib", "memory_used_mib", "memory_free_mib"))
            and bool(gpu.get("name")) and bool(gpu.get("pci_bus_id")))


def proof_words(gpu: t.Mapping[str, t.Any]) -> str:
    """How a unified-memory GPU was proven (or not): for facts, the gate and the Slurm causes; pure."""
    available = gpu.get("host_memory_available_mib")
    least = gpu.get("min_host_available_mib")
    host = "MemAvailable unread" if available is None else f"{available} MiB of host memory available"
    return f"unified memory (memory.used [N/A]): proven by no compute process and {host} (at least {least} MiB: min_host_available_mib)"


def failure(gpu: t.Mapping[str, t.Any]) -> str:
    """What follows `GPU 0 (GPU-...) reads N MiB` for a unified-memory GPU that no process holds
    and that is not free: the host's memory is short or unread. Never reset advice (a reset frees no
    host memory); pure."""
    available = gpu.get("host_memory_available_mib")
    least = gpu.get("min_host_available_mib")
    if gpu.get("_unified_not_free") == UNREAD or available is None:
        have = "its MemAvailable could not be read (/proc/meminfo)"
    else:
        have = f"it has {available} MiB available"
    return (f", and no compute process is on it: the GPU shares the host's memory (unified memory: nvidia-smi reads memory.used [N/A]), "
            f"so it is free when the host has at least {least} MiB of MemAvailable (min_host_available_mib), and {have}: free host memory "
            "(the processes holding it: `ps -eo pid,rss,comm --sort=-rss | head`), or lower min_host_available_mib; a GPU reset frees no "
            "host memory")


def short_cause(gpu: t.Mapping[str, t.Any]) -> str:
    """A Slurm hook's short cause for such a GPU that no process holds (from its public record,
    which carries the host's MemAvailable, not the least asked); pure."""
    available = gpu.get("host_memory_available_mib")
    have = "MemAvailable unread" if available is None else f"{available} MiB of host memory available"
    return "GPU {}: unified memory, no compute process, {}: below min_host_available_mib (no reset frees host memory)".format(gpu.get("index"), have)
