# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The NVIDIA device files of this node, by kernel identity, and the spellings of them that /proc
shows (/dev/nvidiaN, the GPU Operator's /run/nvidia/driver/dev/..., "... (deleted)").

A file a process has open or mapped is a GPU device file when the kernel says so (`DeviceTable`: its
device number, or the very inode of this node's own /dev/nvidia* node), never by the path a process
opened it through: a user can bind-mount /dev/nvidia0 under any name in her own mount namespace.
Also whether this namespace can reach a GPU's node at all (gpu_node_reachable)."""

from __future__ import annotations

import errno
import os
import re
import stat as stat_mod
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mounts

if t.TYPE_CHECKING:
    # {device name: [mappings, KiB]}
    Mapped = t.Dict[str, t.List[int]]

_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
# In /proc/PID/maps the path is the last field, after whitespace: "~/dev/nvidia-apex/lib.so" is
# a library, not a device.
_MAPS_LINE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s+(/\S*nvidia\S*(?: \(deleted\))?)$", re.MULTILINE)
# The spellings of one device file: on GPU Operator nodes the driver container's /dev shows
# through as /run/nvidia/driver/dev/nvidia0; a node removed while held reads "... (deleted)".
DRIVER_ROOT_PREFIXES = ("/run/nvidia/driver",)
_DEVICE_NODE = re.compile(
    r"^/dev/nvidia(?:\d+|ctl|-uvm|-uvm-tools|-modeset|-nvlink|-nvswitchctl|-nvswitch\d+|-caps/nvidia-cap\d+|-caps-imex-channels/channel\d+)$"
)


def device_path(target: str) -> str | None:
    """A /proc fd or maps target -> its /dev/nvidia* path, whatever the spelling, or None when
    it is no NVIDIA device file. The one place that knows how device paths are spelled."""
    if target.endswith(_mounts.DELETED_SUFFIX):
        target = target[: -len(_mounts.DELETED_SUFFIX)]
    for prefix in DRIVER_ROOT_PREFIXES:
        if target.startswith(prefix + "/dev/"):
            target = target[len(prefix):]
    return target if _DEVICE_NODE.match(target) else None


# /proc/devices names of the driver's character devices. The frontend (/dev/nvidiaN, nvidiactl,
# nvidia-modeset) is major 195 on every driver; the others are given a major at load time.
FRONTEND_MAJOR = 195
_FRONTEND_NAMES = ("nvidia-frontend", "nvidia")
_CONTROL_MINORS = {255: "/dev/nvidiactl", 254: "/dev/nvidia-modeset"}
_OTHER_MAJORS = {
    "nvidia-uvm": ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"),
    "nvidia-caps": None,
    "nvidia-nvlink": ("/dev/nvidia-nvlink",),
    "nvidia-nvswitch": None,
    "nvidia-caps-imex-channels": None,
}
DEV_DIRS = ("/dev",) + tuple(prefix + "/dev" for prefix in DRIVER_ROOT_PREFIXES)


def parse_proc_devices(text: bytes | str) -> dict[str, int]:
    """/proc/devices -> {name: major} of its character devices."""
    majors: dict[str, int] = {}
    block = False
    for line in _text(text).splitlines():
        if line.startswith("Block devices"):
            block = True
        parts = line.split()
        if not block and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


class DeviceTable:
    """The NVIDIA device files of this node, by kernel identity.

    A file a process has open or mapped is a GPU device file when the kernel says so, whatever
    path it was opened through (a bind mount in a user's own mount namespace shows /dev/nvidia0
    under any name):
    - `by_rdev`: its device number is the driver's (char 195:N /dev/nvidiaN, 195:255 nvidiactl;
      nvidia-uvm's and the caps' majors from /proc/devices). Only root creates device nodes, and
      any node of that number IS the device. The real driver; docker --device nodes too.
    - `by_inode`: it is the very inode (st_dev, st_ino) of a root-owned character node
      /dev/nvidia* (or /run/nvidia/driver/dev/nvidia*) as this module's mount namespace sees it: a
      bind mount keeps the inode. This is what knows the simulator's nodes (all char 1:5).
    `inode_numbers` pre-filter /proc/PID/maps lines (its `dev` column is the file system's, which
    an overlay reports differently from stat: the inode column and map_files decide)."""

    def __init__(self, by_rdev: t.Mapping[int, str] | None = None, by_inode: t.Mapping[tuple[int, int], str] | None = None) -> None:
        self.by_rdev = dict(by_rdev or {})
        self.by_inode = dict(by_inode or {})
        self.inode_numbers = set(str(ino).encode() for _dev, ino in self.by_inode)
        self.maps_by_inode = _maps_by_inode(self.inode_numbers)
        # Answers already read in this scan (see known_fd, known_mapping).
        self._fds: dict[str, str | None] = {}
        self._mappings: dict[tuple[bytes, bytes], str | None] = {}
        self.mount_ns: str | None
        try:
            self.mount_ns = os.readlink("/proc/self/ns/mnt")
        except OSError:
            self.mount_ns = None
        # {(mount namespace, root) of processes elsewhere: their file systems} (see view).
        self._trees: dict[tuple[str, str], _mounts.MountTable] = {}

    def view(self, base: str) -> _mounts.View:
        """How to read the paths a process (its /proc directory `base`) shows: whether it sees this
        module's tree (its mount namespace is ours: its paths name the same files as here), and
        the file systems of its tree. Where every file system here answers a stat from the cache
        (MountTable.all_answer: no Lustre, GPFS, 9p...), another namespace's are taken to be of
        the same kinds (only root mounts those, and a container binds the node's); otherwise its
        own mountinfo is read, once per namespace and root."""
        own = _mounts.own_tree()
        try:
            mount_ns = os.readlink(base + "/ns/mnt")
        except OSError:
            return _mounts.View(False, own)
        if mount_ns == self.mount_ns:
            return _mounts.View(True, own)
        if own.all_answer:
            return _mounts.View(False, own)
        try:
            key = (mount_ns, os.readlink(base + "/root"))
            if key not in self._trees:
                self._trees[key] = _mounts.MountTable(_read(base + "/mountinfo"))
            return _mounts.View(False, self._trees[key])
        except OSError:
            return _mounts.View(False, _mounts.MountTable(b""))

    def known_fd(self, link: str, target: str, view: _mounts.View | None) -> str | None:
        """name_of an fd. For a process that sees this module's tree (`view.same`) the path it shows
        is a path of this tree, which only root can mount on, so one stat per path serves every
        such process (a busy node: thousands of fds on /dev/null and log files); a process
        elsewhere, or a deleted file, is asked fd by fd. The stat asks the kernel's cache, never a
        file system's server (_bounded_reads.stat_nosync), and is made here only on a file system known
        to answer it so (`view.mounts`, MountTable.answers); others raise NeedsIsolation. Raises
        OSError as os.stat does."""
        if view is None or not view.same or target.endswith(_mounts.DELETED_SUFFIX):
            if view is not None:
                view.mounts.check(target)
            return self.name_of(_bounded_reads.stat_nosync(link))
        if target not in self._fds:
            view.mounts.check(target)
            self._fds[target] = self.name_of(_bounded_reads.stat_nosync(link))
        return self._fds[target]

    def known_mapping(self, map_file: bytes, dev: bytes, inode: bytes) -> str | None:
        """name_of a mapping through /proc/PID/map_files: the maps `dev` and `inode` columns name
        one inode of the kernel, so one stat per (dev, inode) serves every mapping of it."""
        key = (dev, inode)
        if key not in self._mappings:
            self._mappings[key] = self.name_of(_bounded_reads.stat_nosync(os.fsdecode(map_file)))
        return self._mappings[key]

    @classmethod
    def read(cls, dev_dirs: t.Iterable[str] = DEV_DIRS, proc_devices: str = "/proc/devices") -> DeviceTable:
        try:
            majors = parse_proc_devices(_read(proc_devices))
        except OSError:
            majors = {}
        by_rdev: dict[int, str] = {}
        frontend = [majors[name] for name in _FRONTEND_NAMES if name in majors] or [FRONTEND_MAJOR]
        nvidia_majors = set(frontend)
        for name, nodes in _OTHER_MAJORS.items():
            if name in majors:
                nvidia_majors.add(majors[name])
                for minor, node in enumerate(nodes or ()):
                    by_rdev[os.makedev(majors[name], minor)] = node
        by_inode: dict[tuple[int, int], str] = {}
        for directory in dev_dirs:
            for path in _candidate_nodes(directory):
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                # Only root can create a character device node; a user's file named so is no device.
                if not stat_mod.S_ISCHR(st.st_mode) or st.st_uid != 0:
                    continue
                canonical = "/dev/" + path[len(directory) + 1:]
                by_inode[(st.st_dev, st.st_ino)] = canonical
                if os.major(st.st_rdev) in nvidia_majors:
                    by_rdev.setdefault(st.st_rdev, canonical)
        table = cls(by_rdev, by_inode)
        table.frontend = set(frontend)
        return table

    frontend: t.Collection[int] = (FRONTEND_MAJOR,)

    def name_of(self, st: os.stat_result | _bounded_reads.Stat) -> str | None:
        """The canonical /dev/nvidia* name of a stat result, or None when it is no NVIDIA device."""
        if not stat_mod.S_ISCHR(st.st_mode):
            return None
        name = self.by_inode.get((st.st_dev, st.st_ino)) or self.by_rdev.get(st.st_rdev)
        if name is None and os.major(st.st_rdev) in self.frontend:
            minor = os.minor(st.st_rdev)
            name = _CONTROL_MINORS.get(minor) or f"/dev/nvidia{minor:d}"
        return name


def gpu_node(minor: int) -> str:
    """The device node of the GPU with this minor number (the driver's `Device Minor:`)."""
    return f"/dev/nvidia{minor:d}"


# An open refused before the driver is asked: file permissions (or a nodev mount) and the device
# cgroup (v1 devices.deny, v2 eBPF program). Any other error comes from the driver itself, which
# this namespace then reaches.
_DENIED = (errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR)


def gpu_node_reachable(minor: int, table: DeviceTable, dev_dirs: t.Iterable[str] = DEV_DIRS) -> bool:
    """Whether this process reaches the GPU of `minor` through its device node, as NVML must to list
    it (issue 37: a container, a Slurm step or `docker --device` is given only some of the host's
    GPUs, while the driver's /proc/driver/nvidia/gpus, which no namespace masks, lists them all).

    The node must be the driver's character device (`table`'s identity rules: device number
    195:minor, or the very inode of this node's root-owned /dev/nvidia<minor>, the simulator's), and
    an open of it must be allowed: a device cgroup v2 eBPF program cannot be read, only asked. The
    open is O_NONBLOCK so that the driver (NVreg_EnableNonblockingOpen, on by default) does not
    bring a GPU up in this thread under its lock; it is closed at once. Where the answer is unsure
    (another error from the driver) the GPU counts as reachable: then a GPU nvidia-smi left out
    fails the look, never the other way round."""
    path = gpu_node(minor)
    for directory in dev_dirs:
        node = directory + path[len("/dev"):]
        try:
            st = os.stat(node)
        except OSError:
            continue
        if not stat_mod.S_ISCHR(st.st_mode):
            continue
        if os.major(st.st_rdev) in table.frontend:
            if os.minor(st.st_rdev) != minor:
                continue
        elif table.name_of(st) != path:
            continue
        try:
            os.close(os.open(node, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)))
        except OSError as exc:
            if exc.errno in _DENIED:
                continue
        return True
    return False


def _candidate_nodes(directory: str) -> list[str]:
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    paths: list[str] = []
    for entry in entries:
        if not entry.startswith("nvidia"):
            continue
        path = directory + "/" + entry
        if entry.startswith("nvidia-caps"):
            try:
                paths.extend(path + "/" + sub for sub in os.listdir(path))
            except OSError:
                pass
            continue
        paths.append(path)
    return [p for p in paths if _DEVICE_NODE.match("/dev/" + p[len(directory) + 1:])]


def gpu_minor(device: str) -> int | None:
    """'/dev/nvidia3' -> 3; control nodes (/dev/nvidiactl, /dev/nvidia-uvm, caps) -> None."""
    match = _GPU_NODE.match(device)
    return int(match.group(1)) if match else None


def mapped_devices(maps: bytes) -> Mapped:
    """/proc/PID/maps (bytes) -> {device path: [mappings, KiB]} for NVIDIA device files, by the
    spelling of their paths (what a fake /proc, or a reader without map_files, can tell). The
    sizes tell a GPU's context from the small mappings every CUDA process makes of the other
    GPUs' nodes (see _attribution)."""
    return mapped_by_identity(maps, DeviceTable())


# A maps line whose path mentions nvidia (a spelling of a device file), and, built per table, one
# whose inode is a device node's: the regex engine picks the few candidate lines of a CUDA
# process's thousands.
_MAPS_SPELLED = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ (\S+) (\d+)\s+(/\S*nvidia.*)$", re.MULTILINE)


def _maps_by_inode(inode_numbers: t.Collection[bytes]) -> re.Pattern[bytes] | None:
    if not inode_numbers:
        return None
    alternatives = b"|".join(sorted(inode_numbers))
    return re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ (\S+) (" + alternatives + rb")\s+(/.*)$", re.MULTILINE)


def mapped_by_identity(maps: bytes, table: DeviceTable, map_files: bytes | None = None, mounts: _mounts.MountTable | None = None) -> Mapped:
    """/proc/PID/maps (bytes) -> {device name: [mappings, KiB]}, known by identity: a line is a
    candidate when its inode is one of the table's or its path is spelled like a device file;
    /proc/PID/map_files/<range> (root) then says what the mapped file is (os.stat: its rdev,
    dev and inode). Without map_files (not root, a fake /proc) a candidate counts by its path's
    spelling only, as the scan did before. `mounts`: the process's file systems (DeviceTable.view),
    checked before a stat (MountTable.check)."""
    found: Mapped = {}
    seen: set[bytes] = set()
    patterns = [_MAPS_SPELLED] + ([table.maps_by_inode] if table.maps_by_inode is not None else [])
    for pattern in patterns:
        for match in pattern.finditer(maps):
            start, end, dev, inode, path = match.groups()
            if start in seen:
                continue
            seen.add(start)
            spelled = device_path(path.decode("utf-8", "replace")) if b"nvidia" in path else None
            device = spelled
            if map_files is not None:
                if mounts is not None:
                    mounts.check(path.decode("utf-8", "replace"))
                try:
                    device = table.known_mapping(b"%s/%s-%s" % (map_files, start, end), dev, inode)
                except OSError:
                    device = spelled
            if device is None:
                continue
            entry = found.setdefault(device, [0, 0])
            entry[0] += 1
            entry[1] += (int(end, 16) - int(start, 16)) // 1024
    return found


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _text(data: bytes | str) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data
