# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Which container a GPU holder runs in, confirmed by its runtime (the look's half of containers;
what gpu_release does about them is _act/_containers).

`annotate`: what a holder's cgroup path claims (_cgroups), believed only outside a delegated
subtree and once the runtime (_engines) confirms that the process runs in that container (its
State.Pid, or a process in the cgroup of State.Pid: `confirmed`). Anything else is an ordinary
holder, reported with a note (docs/docsite/rst/guide_security.rst).
"""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look._engines import DOCKER, MANAGED, RuntimeUnavailable

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._engines import Runtimes
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ContainerRecord, ContainerRef, Holder

    CgroupOf = t.Callable[[int], t.Optional[str]]

# Keys each holder record gets (gpu_facts' holders, gpu_release's holders).
HOLDER_KEYS = ("container_runtime", "container_name", "container_image", "pod", "pod_uid")


def confirmed(holder: Holder, record: ContainerRecord, cgroup_of: CgroupOf) -> bool:
    """Whether the runtime's own record places the holder in that container: the holder is its
    State.Pid, or it runs in the cgroup of State.Pid (or below it), which only the runtime (root)
    could have put it in."""
    init = record.get("pid")
    if not init:
        return False
    if init == holder["pid"]:
        return True
    path = cgroup_of(init)
    if not path or path == "/":
        return False
    own = holder.get("cgroup") or ""
    return own == path or own.startswith(path.rstrip("/") + "/")


def _ordinary(holder: Holder, note: str | None) -> None:
    for key in HOLDER_KEYS:
        holder[key] = None  # type: ignore[literal-required]
    holder["container"] = None
    holder["_container_ref"] = None
    holder["container_note"] = note


def _runtime_record(holder: Holder, ref: ContainerRef, runtimes: Runtimes) -> ContainerRecord | None:
    """The runtime's record of the container the holder's cgroup names, None when it cannot be
    asked or does not know it. Kubernetes on cgroupfs does not name its runtime: dockershim's
    containers are Docker's (then the holder's runtime reads docker)."""
    cid = ref["id"]
    if not cid:
        return None
    try:
        if ref["runtime"] in MANAGED:
            return runtimes.inspect(ref["runtime"], cid)
        if ref["runtime"] is None and ref["kubernetes"] and runtimes.client(DOCKER):
            record = runtimes.inspect(DOCKER, cid)
            if record is not None:
                holder["container_runtime"] = DOCKER
            return record
    except RuntimeUnavailable:
        return None
    return None


def _annotate_one(holder: Holder, runtimes: Runtimes, mounts: t.Callable[[], list[str]], cgroup_of: CgroupOf) -> None:
    ref = _cgroups.container_ref(holder.get("cgroup"))
    holder["_container_ref"] = ref
    holder.setdefault("container_note", None)
    for key in HOLDER_KEYS:
        holder.setdefault(key, None)  # type: ignore[misc]
    if ref is None:
        holder["container"] = None
        manager = _cgroups.user_manager_claim(holder.get("cgroup"))
        if manager:
            holder["container_note"] = (f"cgroup {holder['cgroup']} lies in the subtree systemd delegates to {manager}, whose user may name it at will: "
                                        "no container or pod")
        return
    owner = _cgroups.delegated_to(holder.get("cgroup"), mounts())
    if owner is not None:
        _ordinary(holder, f"cgroup {holder.get('cgroup')} lies in a subtree owned by uid {owner:d}, who may name it at will: no container or pod")
        return
    holder["container"] = ref["id"]
    holder["container_runtime"] = ref["runtime"]
    holder["pod_uid"] = ref["pod_uid"]
    record = _runtime_record(holder, ref, runtimes)
    if record is not None and not confirmed(holder, record, cgroup_of):
        _ordinary(holder, "cgroup {0} names {1} container {2}, but {1} does not run this process in it: an ordinary holder".format(
            holder.get("cgroup"), holder.get("container_runtime"), (ref["id"] or "")[:12]))
        return
    if record is not None:
        holder["container_name"] = record["name"]
        holder["container_image"] = record["image"]
        # A pod only where the kernel puts the process under kubepods, as a kubelet does: the
        # io.kubernetes.* labels are whoever created the container's.
        claim = record["pod"] or record.get("pod_claim")
        holder["pod"] = claim if ref["kubernetes"] else None
        holder["pod_uid"] = holder["pod_uid"] or (record["pod_uid"] if ref["kubernetes"] else None)
        holder["_container_record"] = record
        if claim and not ref["kubernetes"]:
            holder["container_note"] = (f"its labels name Kubernetes pod {claim}, but its cgroup {holder.get('cgroup')} is not under kubepods, "
                                        "where a kubelet puts its pods: labels its creator set, an ordinary container")
    if ref["kubernetes"] and not holder["pod"] and ref["id"]:
        holder["pod"] = runtimes.pod_of(ref["id"])


def annotate(holders: list[Holder], runtimes: Runtimes, proc: str = "/proc", mounts: list[str] | None = None,
             cgroup_of: CgroupOf | None = None) -> list[Holder]:
    """Add HOLDER_KEYS to each holder (in place; returns the list): the runtime from the cgroup
    path, and name, image and pod from the runtime where it answers. Holders outside containers
    cost a regex each; the runtime is asked once per container. A path in a delegated subtree,
    or a container its runtime does not confirm, makes an ordinary holder with a note."""
    read_cgroup = cgroup_of or (lambda pid: _holders.cgroup_of(pid, proc))
    # The cgroup mounts are read once, and only when some holder's cgroup names a container.
    found: list[list[str]] = [] if mounts is None else [mounts]

    def cgroup_mounts() -> list[str]:
        if not found:
            found.append(_cgroups.cgroup_mounts())
        return found[0]

    for holder in holders:
        _annotate_one(holder, runtimes, cgroup_mounts, read_cgroup)
    return holders
