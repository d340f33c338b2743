# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the plugins and roles of
# zeromib.gpu may use it.

"""GPUs that several jobs use at once: gres/shard (Slurm 22.05+: no fence between the jobs on a
GPU), gres/mps, MIG slices of one GPU, or a site's own MPS daemon. The epilog of one job cannot
expect its GPU to read its baseline while another job still uses it, and slurmd gives the hooks no
sign of it: a shard job's epilog reads SLURM_JOB_GPUS=0 and CUDA_VISIBLE_DEVICES=0 exactly as a
whole-GPU job's (captured from 22.05.8, tests/fixtures/slurm-22.05.8/shard/).

So, on a GPU that is shared (the runner's `shared_gpus`, or any MIG GPU), the hook reads each GPU as
nvidia-smi reads it less what other jobs hold there: the `used_memory` of every compute app whose
process is another job's (_look/_jobs: its cgroup, or its vouched slurmstepd; never the user's
word), or an MPS server kept for another job, and the context overhead those apps bring (H200,
measured: memory.used is 9 MiB above the apps' sum with one context, 15 with two, 20 with three).
Every process of the ending job or of no job is still a holder, freed and waited for as before; what
is left must be within `max_used_mib` of what the other jobs hold. Nothing here signals anything."""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmiError, parse_compute_apps

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, Gpu

# The overhead of n other contexts on a GPU, beyond their compute apps' used_memory: 10 + 5 n MiB
# covers the H200's measured 9, 15 and 20 MiB for one, two and three contexts.
OVERHEAD_BASE_MIB = 10
OVERHEAD_PER_CONTEXT_MIB = 5


class Share(t.NamedTuple):
    """What other jobs hold on one GPU, by the driver's word (its compute apps)."""

    held_mib: int              # their apps' used_memory
    contexts: int              # how many of their processes have a context there
    owners: tuple[str, ...]    # "Slurm job 12", "MPS server for Slurm job 12": sorted, once each

    @property
    def allowance_mib(self) -> int:
        return self.held_mib + (OVERHEAD_BASE_MIB + OVERHEAD_PER_CONTEXT_MIB * self.contexts if self.contexts else 0)


def shares(apps: t.Iterable[ComputeApp], index_of: t.Mapping[str, int], others: t.Callable[[int], str | None]) -> dict[int, Share]:
    """{gpu index: Share} from compute apps: `others(pid)` names whose a process is when it is
    another job's (or kept for one), else None (the ending job's, no job's: not deducted)."""
    held: dict[int, list[tuple[int, str]]] = {}
    for app in apps:
        index = index_of.get((app.get("gpu_uuid") or "").lower())
        owner = others(app["pid"]) if index is not None else None
        if owner is None or index is None:
            continue
        held.setdefault(index, []).append((int(app.get("used_memory_mib") or 0), owner))
    return {index: Share(sum(mib for mib, _o in rows), len(rows), tuple(sorted({o for _m, o in rows}))) for index, rows in held.items()}


def deducted(gpu: Gpu, share: Share | None) -> Gpu:
    """The GPU as the ending job's hook judges it: memory.used less what other jobs hold there
    (never below 0); the driver's own reading stays in `memory_used_raw_mib`."""
    used = gpu.get("memory_used_mib")
    if share is None or used is None:
        return gpu
    out = t.cast("Gpu", dict(gpu))
    out["memory_used_mib"] = max(0, int(used) - share.allowance_mib)
    out["memory_used_raw_mib"] = used  # type: ignore[typeddict-unknown-key]
    return out


class SharedReadings:
    """nvidia-smi as the hook of a job on shared GPUs reads it: every other call goes to the real
    one; query_gpus deducts, on each GPU the job was given, what other jobs hold there. The compute
    apps are asked only when such a GPU reads above `limit` (a clean node pays nothing)."""

    def __init__(self, smi: t.Any, is_selected: t.Callable[[Gpu], bool], others: t.Callable[[int], str | None], limit: float) -> None:
        self.smi = smi
        self.is_selected = is_selected
        self.others = others
        self.limit = limit
        # {index: Share} of the last reading that needed one: the log and the causes say it.
        self.last: dict[int, Share] = {}

    def __getattr__(self, name: str) -> t.Any:
        return getattr(self.smi, name)

    def query_gpus(self, *args: t.Any, **kwargs: t.Any) -> list[Gpu]:
        return self.deduct(self.smi.query_gpus(*args, **kwargs))

    def query_all(self, *args: t.Any, **kwargs: t.Any) -> tuple[list[Gpu], list[ComputeApp]]:
        # The look's call: the real one runs its own query_gpus, which this wrapper does not see.
        gpus, apps = self.smi.query_all(*args, **kwargs)
        return self.deduct(gpus, apps if kwargs.get("with_apps", True) else None), apps

    def deduct(self, gpus: list[Gpu], apps: list[ComputeApp] | None = None) -> list[Gpu]:
        busy = [g for g in gpus if self.is_selected(g) and (g.get("memory_used_mib") or 0) > self.limit]
        if not busy:
            self.last = {}
            return gpus
        if apps is None:
            try:
                apps = parse_compute_apps(self.smi.run(self.smi.app_args()))
            except NvidiaSmiError:
                # The readings stand as the driver gave them: nothing is deducted on a guess.
                return gpus
        index_of = {str(g.get("uuid") or "").lower(): g["index"] for g in gpus}
        found = shares(apps, index_of, self.others)
        self.last = {g["index"]: found[g["index"]] for g in busy if g["index"] in found}
        return [deducted(g, self.last.get(g["index"])) if self.is_selected(g) else g for g in gpus]


def describe(share: t.Mapping[str, t.Any]) -> str:
    """` beyond the 2009 MiB that Slurm job 12 holds there` for a cause (a record() entry)."""
    owners = list(share.get("owners") or [])
    verb = "holds" if len(owners) == 1 else "hold"
    return " beyond the {:d} MiB that {} {} there".format(int(share.get("allowance_mib") or 0), ", ".join(owners), verb)


def record(last: t.Mapping[int, Share]) -> dict[str, dict[str, t.Any]]:
    """The log's `shared`: {gpu index: {held_mib, allowance_mib, owners}}."""
    return {str(i): {"held_mib": s.held_mib, "allowance_mib": s.allowance_mib, "owners": list(s.owners)} for i, s in sorted(last.items())}
