# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Which container or pod a cgroup path names, and whether that name is only a claim.

A cgroup path is what a user can write inside the subtree systemd delegates to them
(`user@UID.service`, or any cgroup directory they own): there they can name a cgroup
`docker-<any id>.scope` or `kubepods.slice` (docs/docsite/rst/guide_design.rst, "What can be trusted on a shared
node"). So what a path names is believed only outside such subtrees (`container_ref`,
`delegated_to`: the cgroup file system's owners, the kernel's word), and even then it is a claim
that the container's runtime must confirm before anything is stopped through it (_containers).
"""

from __future__ import annotations

import os
import re
import typing as t

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ContainerRef, GuestRef

DOCKER = "docker"
PODMAN = "podman"
CONTAINERD = "containerd"
CRIO = "cri-o"


_HEX_ID = r"([0-9a-f]{64}|[0-9a-f]{12,63})"
_PREFIX_RUNTIME = {
    "docker": DOCKER,
    "libpod": PODMAN,
    "podman": PODMAN,
    "cri-containerd": CONTAINERD,
    "containerd": CONTAINERD,
    "nerdctl": CONTAINERD,
    "crio": CRIO,
    "cri-o": CRIO,
}
_PATTERNS = (
    # systemd cgroup driver: /system.slice/docker-<id>.scope, /machine.slice/libpod-<id>.scope[/container],
    # .../cri-containerd-<id>.scope, .../crio-<id>.scope. (libpod-conmon-<id>.scope is conmon, not the container.)
    re.compile(r"(?:^|/)(docker|cri-containerd|crio|libpod|containerd|podman|nerdctl)-" + _HEX_ID + r"\.scope(?:/|$)"),
    # containerd's systemd cgroup driver when it and runc disagree (kind, k3s):
    # /system.slice/containerd.service/kubepods-...slice:cri-containerd:<id>
    re.compile(r":(cri-containerd|cri-o|crio|docker|containerd):" + _HEX_ID + r"(?:/|$)"),
    # cgroupfs driver: /docker/<id>, /libpod_parent/libpod-<id>, /crio/<id>
    re.compile(r"/(docker|containerd|crio)/" + _HEX_ID + r"(?:/|$)"),
    re.compile(r"/(libpod)-" + _HEX_ID + r"(?:/|$)"),
    # Kubernetes with the cgroupfs driver: /kubepods/<qos>/pod<uid>/<id> (runtime not in the path)
    re.compile(r"/kubepods[^\s]*/pod[0-9a-f_-]+/()" + _HEX_ID + r"(?:/|$)"),
)
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})(?:\.slice)?(?=[/:]|$)")
_KUBEPODS = re.compile(r"(?:^|/)kubepods(?:[.\-/]|$)")
# The subtree systemd delegates to a user's own manager: everything below it is theirs to name.
_USER_MANAGER = re.compile(r"(?:^|/)user@\d+\.service(?:/|$)")


def in_user_manager(cgroup_path: str | None) -> bool:
    """Whether a cgroup path lies in the subtree systemd delegates to a user's own manager
    (`user@UID.service`): every name below it is its user's choice."""
    return bool(_USER_MANAGER.search(cgroup_path or ""))


def under_kubepods(cgroup_path: str | None) -> bool:
    """Whether a cgroup path (or a runtime's cgroup parent) lies under `kubepods`, where a
    kubelet places its pods' containers: what makes a container a pod's, not its labels."""
    return bool(_KUBEPODS.search(cgroup_path or ""))


def container_ref(cgroup_path: str | None) -> ContainerRef | None:
    """The container a cgroup path belongs to, or None (also for a path in a user manager's
    subtree). `runtime` is None where the path does not say (Kubernetes with the cgroupfs
    driver); a process of a pod outside any container cgroup has `id` None. No I/O."""
    if not cgroup_path or in_user_manager(cgroup_path):
        return None
    return _named_ref(cgroup_path)


def _named_ref(cgroup_path: str) -> ContainerRef | None:
    """What a cgroup path names, wherever it lies (see container_ref)."""
    kubernetes = bool(_KUBEPODS.search(cgroup_path))
    pod = _POD_UID.search(cgroup_path) if kubernetes else None
    pod_uid = pod.group(1).replace("_", "-") if pod else None
    for pattern in _PATTERNS:
        match = pattern.search(cgroup_path)
        if match:
            return {"id": match.group(2), "runtime": _PREFIX_RUNTIME.get(match.group(1)), "kubernetes": kubernetes, "pod_uid": pod_uid}
    if kubernetes:
        return {"id": None, "runtime": None, "kubernetes": True, "pod_uid": pod_uid}
    return None


def container_of(cgroup_path: str | None) -> str | None:
    """The container id of a cgroup path (docker, podman, containerd, CRI-O, Kubernetes), or None."""
    ref = container_ref(cgroup_path)
    return ref["id"] if ref else None


def user_manager_claim(cgroup_path: str | None) -> str | None:
    """The user manager (`user@UID.service`) whose subtree holds `cgroup_path`, when the path
    there names a container or pod: a name its user chose, never believed. None otherwise."""
    manager = _USER_MANAGER.search(cgroup_path or "")
    if manager and cgroup_path and _named_ref(cgroup_path) is not None:
        return manager.group(0).strip("/")
    return None


# ---------------------------------------------------------------- system containers (guests)

LXC = "lxc"
LXD = "lxd"
NSPAWN = "nspawn"
GUEST_KINDS = (LXC, LXD, NSPAWN)
# Where a system container's own tree starts, as its manager on the host names it (the guest's
# systemd sees this directory as its `/`). Only root (or the delegate of the directory above,
# which _guests asks of the file system) creates these directories: a guest cannot write above
# its delegation, so the boundary is the kernel's word.
_GUEST_BOUNDARIES = (
    # Proxmox VE: /lxc/<vmid> carries the limits, the guest's delegated tree is its `ns` below.
    (LXC, re.compile(r"/lxc/([^/]+)/ns(?=/|$)")),
    # LXD, Incus and LXC 4+: /lxc.payload.<name> (the monitor sits in /lxc.monitor.<name>).
    (LXD, re.compile(r"/lxc\.payload\.([^/]+)(?=/|$)")),
    # systemd-nspawn@NAME.service (machinectl start): the container in payload/, nspawn itself in supervisor/.
    (NSPAWN, re.compile(r"/machine\.slice/systemd-nspawn@([^/]+)\.service/payload(?=/|$)")),
    # A container systemd-machined registered (systemd-nspawn run by hand): machine-NAME.scope,
    # with payload/ below it since systemd 240.
    (NSPAWN, re.compile(r"/machine\.slice/machine-([^/]+)\.scope(?:/payload)?(?=/|$)")),
    # LXC before 4.0, and cgroup v1 hierarchies without the `ns` split: /lxc/<name>.
    (LXC, re.compile(r"/lxc/([^/]+)(?=/|$)")),
)
_UNIT_PART = re.compile(r"^[^/]+\.(?:service|scope)$")
_ESCAPED = re.compile(r"\\x([0-9a-fA-F]{2})")


def _unescape(name: str) -> str:
    """systemd's unit-name escaping (`web\\x2d1` is `web-1`)."""
    return _ESCAPED.sub(lambda m: chr(int(m.group(1), 16)), name)


def _guest_boundary(cgroup_path: str) -> tuple[str, str, int, int] | None:
    """(kind, name, start, end) of the outermost guest boundary in a path, or None."""
    found = None
    for kind, pattern in _GUEST_BOUNDARIES:
        match = pattern.search(cgroup_path)
        if match and (found is None or match.start() < found[2]):
            found = (kind, _unescape(match.group(1)), match.start(), match.end())
    # A libvirt virtual machine's scope (machine-qemu-1-vm.scope) holds the VM's emulator, a
    # process of the host: no guest whose own manager could be asked.
    if found and found[0] == NSPAWN and found[1].startswith("qemu-"):
        return None
    return found


def guest_ref(cgroup_path: str | None) -> GuestRef | None:
    """The system container (guest) a cgroup path lies in, from the host: {kind, name, unit,
    cgroup, parent}. `unit` is the guest's own unit of the process (the deepest `.service` or
    `.scope` below the boundary, None below a user manager of the guest or where none is named),
    `cgroup` the boundary directory, `parent` the directory above it (whose owner vouches for the
    boundary: _guests). None for a path in no guest, and for one in a user manager's subtree of
    the host, whose user may name cgroups at will. No I/O."""
    if not cgroup_path:
        return None
    found = _guest_boundary(cgroup_path)
    if found is None:
        return None
    kind, name, start, end = found
    if _USER_MANAGER.search(cgroup_path[:start]):
        return None
    inner = cgroup_path[end:]
    unit = None
    if not _USER_MANAGER.search(inner):
        for part in inner.split("/"):
            if _UNIT_PART.match(part):
                unit = part
    return {"kind": kind, "name": name, "unit": unit, "cgroup": cgroup_path[:end], "parent": cgroup_path[:start] or "/"}


def cgroup_hierarchies(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, list[str]]]:
    """(mount point, file system type, super options) of every cgroup and cgroup2 mount of this
    mount namespace; [] where mountinfo cannot be read."""
    try:
        with open(mountinfo, "rb") as handle:
            # "\n" only: a mount point a user names (a FUSE mount in her folder) may hold any other line break.
            lines = handle.read().decode("utf-8", "replace").split("\n")
    except OSError:
        return []
    found = []
    for line in lines:
        left, _sep, right = line.partition(" - ")
        # The kernel separates fields with one space and escapes a space in a path (\040): str.split()
        # would also split at a \x0b a user put in her mount point's name, shifting the fields.
        fields, tail = left.split(" "), right.split(" ")
        if len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        found.append((fields[4].replace("\\040", " "), tail[0], tail[2].split(",")))
    return found


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points of the cgroup hierarchies systemd paths live in: cgroup2, and v1's
    name=systemd (hybrid nodes)."""
    return [point for point, kind, options in cgroup_hierarchies(mountinfo) if kind == "cgroup2" or "name=systemd" in options]


def read_small(path: str) -> str | None:
    """The first 4 KiB of a cgroup file system's file (cgroup.events, cgroup.freeze, freezer.state), None when unread."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4096).decode("ascii", "replace")
    except OSError:
        return None


def is_frozen(events: str | None, freeze: str | None) -> bool:
    """A cgroup v2 directory's cgroup.events and cgroup.freeze (text, None when unread) -> frozen
    or freezing. `frozen 1` in cgroup.events also holds below a frozen ancestor; cgroup.freeze 1
    alone is a freeze under way, whose tasks trap before they could run a handler."""
    if freeze is not None and freeze.strip() == "1":
        return True
    return any(line.split() == ["frozen", "1"] for line in (events or "").split("\n"))


def delegated_to(cgroup_path: str | None, mounts: t.Iterable[str]) -> int | None:
    """The uid that owns a cgroup directory on `cgroup_path` (or one above it), or None when
    root owns all of them: only a delegated subtree (a user manager's, or a unit with
    Delegate=yes and User=) is owned by anyone else, and its owner may create and name cgroups
    there at will."""
    parts = [part for part in (cgroup_path or "").split("/") if part]
    for mount in mounts:
        for depth in range(len(parts), 0, -1):
            try:
                owner = os.stat(os.path.join(mount, *parts[:depth])).st_uid
            except OSError:
                continue
            if owner != 0:
                return owner
    return None
