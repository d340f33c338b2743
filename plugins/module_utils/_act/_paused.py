# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Paused containers holding GPUs (issue 70): thawed through their runtime, then stopped, when
`services` names them; refused, naming the runtime's `unpause`, when it does not.

A paused container's processes are frozen by its runtime (`docker pause`, `podman pause`: the
cgroup freezer). Under the cgroup v1 freezer no signal arrives before it is thawed, SIGKILL
included (moby/moby#15853). Podman's stop refuses a paused container (4.3: "container state
improper"); Docker's (20.10) thaws it itself (seen here: stopped in 0.06-0.08 s, exit 143). Either
way someone paused it on purpose (a suspended job, a parked server), so the run thaws it only where
the user named it, through the runtime's own `unpause` first, the same on both runtimes.

Who says it is paused is the runtime (root's daemon or CLI), for a container it confirmed the
holder runs in (_look/_container_of): never a cgroup's name or freezer file a user can write. The
thaw is the runtime's `unpause`, never a write to the cgroup file system.
"""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look._engines import RuntimeUnavailable

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._engines import Runtimes
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ContainerEntry, ContainerRecord, Holder


def is_paused(record: ContainerRecord | t.Mapping[str, t.Any] | None) -> bool:
    """Whether the runtime's record says the container is paused; pure."""
    return bool(record and (record.get("paused") or record.get("status") == "paused"))


def unnamed(holders: t.Iterable[Holder], named_ids: t.Container[str | None]) -> list[Holder]:
    """The holders (to be stopped through their runtime) whose container is paused and not named
    in `services`: the run refuses them; pure."""
    return [h for h in holders if is_paused(h.get("_container_record")) and h.get("container") not in named_ids]


def refusal(holders: t.Iterable[Holder], describe: t.Callable[[t.Mapping[str, t.Any]], str]) -> str:
    """The refusal for paused containers that `services` does not name: which container, on which
    GPUs, and the runtime's unpause command; pure. `describe` names a container (_containers)."""
    containers: dict[str | None, list[Holder]] = {}
    for holder in holders:
        containers.setdefault(holder.get("container"), []).append(holder)
    parts = [_one(members, describe) for members in containers.values()]
    names = ", ".join(f"container:{members[0]['container_name']}" for members in containers.values() if members[0].get("container_name"))
    return ("GPUs are held by paused containers: {}. gpu_release does not thaw a container it was not told to stop (someone paused it "
            "on purpose); unpause it yourself, or name it in services ({}) to have it unpaused and stopped through its runtime, then run "
            "gpu_release again".format("; ".join(parts), names or "container:<name>"))


def _one(members: list[Holder], describe: t.Callable[[t.Mapping[str, t.Any]], str]) -> str:
    """`suspended (docker 4f3c2b1a4f3c, IMAGE) on GPU 0,1: its container is paused: `docker unpause suspended` thaws it`."""
    first = members[0]
    cid, runtime = first.get("container") or "", first.get("container_runtime") or "docker"
    name = first.get("container_name") or cid[:12]
    gpus = sorted({index for holder in members for index in holder.get("gpu_indexes") or ()})
    text = describe({"name": first.get("container_name"), "id": cid, "runtime": runtime, "image": first.get("container_image")})
    return "{} on GPU {}: its container is paused: `{} unpause {}` thaws it".format(text, ",".join(str(i) for i in gpus) or "-", runtime, name)


def thaw(runtimes: Runtimes, entry: ContainerEntry) -> None:
    """Unpause a planned stop's container through its runtime. A container no longer paused (its
    owner unpaused it since the look) is fine; RuntimeUnavailable when it stays paused."""
    try:
        runtimes.unpause(entry["runtime"], entry["id"])
    except RuntimeUnavailable as exc:
        record = runtimes.inspect(entry["runtime"], entry["id"])
        if is_paused(record):
            raise RuntimeUnavailable(f"could not unpause it: {exc}") from exc
