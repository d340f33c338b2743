# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Ghost-busy GPUs: busy with no process and 0 MiB after this run's kills, and how they are cleared.

On Blackwell, killing a process mid-kernel can leave the GPU at 100 % utilization and ~100 W with
0 MiB and no process, for days under persistence mode (Datura-ai/lium-io #1140, #1142: most
mid-kernel kills on RTX PRO 6000, 5090 and B200, drivers 580-595). Opening and closing a CUDA
context from a fresh process clears it; a GPU reset is refused while NVML handles are open. So a
GPU this run freed (a process on it was killed) that still reads busy with nothing on it gets one
context opened and closed by the smoke test's path (_look/_cuda_smoke.run_in_child: a forked child,
bounded), is read again, and is said with what was seen and done; a reset is advised only if that
fails, naming the processes that hold its device node (NVML clients block a reset).

Who else controls what is read: nothing a user writes. Utilization and power come from the driver;
which GPUs are candidates comes from this run's own kills, and the context is opened by the
module's own child, never in a process someone else chose.
"""

from __future__ import annotations

import time
import typing as t

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi

# Utilization at or above this with no process and no memory is no idle GPU (an idle GPU reads 0 %;
# the capture of the issue reads 100 %).
BUSY_PCT = 50
# utilization.gpu is averaged over the driver's last sample period (1/6 s to 1 s, --help-query-gpu):
# read again for this long after the context closed.
SETTLE_S = 3.0
# The context's allocation: the smoke test's path, as small as it goes.
CONTEXT_MIB = 1


def killed_on(result: t.Mapping[str, t.Any]) -> set[int]:
    """The GPUs this run killed a process on."""
    return {index for entry in result.get("killed") or [] if entry.get("signal") for index in entry.get("gpu_indexes") or []}


def holders_on(index: int, holders: t.Iterable[t.Mapping[str, t.Any]], minor: int | None = None) -> list[t.Mapping[str, t.Any]]:
    """The holders placed on the GPU, and (given its minor) every process with its device node open:
    an NVML client (nvidia-persistenced, DCGM's nv-hostengine) is placed on no GPU but holds them all."""
    node = f"/dev/nvidia{minor:d}" if isinstance(minor, int) else None
    return [h for h in holders if index in (h.get("gpu_indexes") or []) or index in (h.get("candidate_gpu_indexes") or [])
            or (node is not None and node in (h.get("devices") or []))]


def busy_with_nothing(gpu: t.Mapping[str, t.Any], holders: t.Iterable[t.Mapping[str, t.Any]]) -> bool:
    """Whether a GPU reads busy with no process on it and within max_used_mib (clean): a ghost when
    a kill left it so. An NVML client (a monitor) works on no GPU; any other holder placed on it,
    or that may be on it, does: busy, not a ghost. gpu_release's rule and the audit's."""
    busy = gpu.get("utilization_gpu_pct")
    if not gpu.get("clean") or isinstance(busy, bool) or not isinstance(busy, int) or busy < BUSY_PCT:
        return False
    return not [h for h in holders_on(t.cast(int, gpu.get("index")), holders) if h.get("attribution") != "nvml_client"]


def found(result: t.Mapping[str, t.Any]) -> list[dict[str, t.Any]]:
    """The selected GPUs that read busy with no process and within max_used_mib (clean), on which
    this run killed something: [{index, pci_bus_id, utilization_gpu_pct, power_draw_w}]."""
    selected = set(result.get("selected_gpus") or [])
    killed = killed_on(result)
    ghosts = []
    for gpu in result.get("gpus") or []:
        index = gpu.get("index")
        if index not in selected or index not in killed or not busy_with_nothing(gpu, result.get("holders") or []):
            continue
        busy = gpu.get("utilization_gpu_pct")
        ghosts.append({"index": index, "pci_bus_id": gpu.get("pci_bus_id"), "minor_number": gpu.get("minor_number"), "utilization_gpu_pct": busy,
                       "power_draw_w": gpu.get("power_draw_w")})
    return ghosts


def _label(holder: t.Mapping[str, t.Any]) -> str:
    return "pid {} {}".format(holder.get("pid"), holder.get("name") or "?") + (" ({})".format(holder["unit"]) if holder.get("unit") else "")


def said(ghost: t.Mapping[str, t.Any], holders: t.Iterable[t.Mapping[str, t.Any]]) -> str:
    """The sentence of one ghost-busy GPU: what was seen, what was done, what it reads now; the reset
    advice, naming its device node's holders, only when it is still busy."""
    seen = "GPU {} ({}) read {} % busy at {} W with no process and no memory after this run's kills".format(
        ghost["index"], ghost["pci_bus_id"], ghost["utilization_gpu_pct"], _watts(ghost.get("power_draw_w")))
    if ghost.get("error"):
        done = f"; opening a CUDA context on it from a fresh process failed ({ghost['error']})"
    else:
        done = "; a CUDA context was opened and closed on it from a fresh process"
    if ghost.get("cleared"):
        return seen + done + ", and it now reads {} % at {} W (cleared)".format(ghost.get("utilization_after_pct"), _watts(ghost.get("power_after_w")))
    blockers = [_label(h) for h in holders_on(ghost["index"], holders, ghost.get("minor_number"))]
    why = ("; a reset is refused while NVML handles are open: stop {} first".format(", ".join(blockers)) if blockers
           else "; nothing holds its device node now")
    return seen + done + ", and it still reads {} % busy: reset it (nvidia-smi -r -i {}){}".format(
        ghost.get("utilization_after_pct"), ghost["index"], why)


def short_cause(ghost: t.Mapping[str, t.Any], holders: t.Iterable[t.Mapping[str, t.Any]]) -> str:
    """A GPU still busy after the context, in the few words a Slurm drain reason holds (120
    characters with the job's): what it reads and the command, then what blocks a reset."""
    done = ", no process, opening a CUDA context failed" if ghost.get("error") else " with no process, also after a CUDA context"
    cause = "GPU {}: {} % busy{}: reset it (nvidia-smi -r -i {})".format(
        ghost["index"], ghost.get("utilization_after_pct"), done, ghost["index"])
    blockers = [_label(h) for h in holders_on(ghost["index"], holders, ghost.get("minor_number"))]
    return cause + ("; NVML handles block a reset: stop {} first".format(", ".join(blockers)) if blockers else "")


def _watts(value: t.Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else "?"


def clear(smi: NvidiaSmi, ghosts: list[dict[str, t.Any]], timeout: float,
          runner: t.Callable[[list[str], int, float], tuple[dict[str, t.Any], float | None]] | None = None,
          settle_s: float = SETTLE_S, sleep: t.Callable[[float], None] = time.sleep) -> list[dict[str, t.Any]]:
    """Open and close a CUDA context on each ghost from one fresh child, then read them again until
    they read idle or `settle_s` passes -> the ghosts with error, cleared, utilization_after_pct, power_after_w."""
    if runner is None:
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cuda_smoke  # pylint: disable=import-outside-toplevel
        runner = _cuda_smoke.run_in_child
    by_bus, _init_s = runner([g["pci_bus_id"] for g in ghosts], CONTEXT_MIB, timeout)
    out = [dict(g, error=(by_bus.get(g["pci_bus_id"]) or {}).get("error")) for g in ghosts]
    waited = 0.0
    while True:
        now = {gpu.get("index"): gpu for gpu in smi.query_gpus(gpus=[g["index"] for g in out])}
        for ghost in out:
            reading = now.get(ghost["index"]) or {}
            ghost["utilization_after_pct"] = reading.get("utilization_gpu_pct")
            ghost["power_after_w"] = reading.get("power_draw_w")
            after = ghost["utilization_after_pct"]
            ghost["cleared"] = isinstance(after, int) and after < BUSY_PCT
        if all(g["cleared"] for g in out) or waited >= settle_s:
            return out
        sleep(0.5)
        waited += 0.5


def after_release(smi: NvidiaSmi, result: dict[str, t.Any], timeout: float, short: bool = False, settle_s: float = SETTLE_S) -> dict[str, t.Any]:
    """The result with `ghost_busy` (one sentence per ghost-busy GPU); a GPU still busy after the
    context is a health issue of the host (healthy false), said whole, or (`short`: the Slurm
    hooks' drain reason) as short_cause. `settle_s`: how long to read again (the Slurm hook gives
    what its deadline leaves, up to SETTLE_S)."""
    ghosts = found(result)
    if not ghosts:
        return result
    holders = result.get("holders") or []
    done = clear(smi, ghosts, timeout, settle_s=settle_s)
    result = dict(result, ghost_busy=[said(g, holders) for g in done])
    stuck = [short_cause(g, holders) if short else "GPU {} ({}): {}".format(g["index"], g["pci_bus_id"], said(g, holders))
             for g in done if not g["cleared"]]
    if stuck:
        result["health_issues"] = list(result.get("health_issues") or []) + stuck
        result["healthy"] = False
    return result
