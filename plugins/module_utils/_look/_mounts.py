# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The file systems of a process's tree, from /proc/PID/mountinfo: which one a path lies on, and
whether a stat of a file there can wait on a server (a stalled FUSE or NFS daemon). The holder scan
(_holders) and the device tables (_devices) stat a process's files only where the kernel answers
from its cache (_bounded_reads.stat_nosync); elsewhere the stat is made in a forked reader."""

from __future__ import annotations

import re
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads
DELETED_SUFFIX = " (deleted)"


# File systems whose getattr never waits on a server with AT_STATX_DONT_SYNC: local ones, memory
# ones, and the network ones that honour the flag (FUSE, NFS, CIFS, Ceph; overlayfs passes it on).
# Measured for FUSE on 6.18: stat() of a file of a stalled daemon waits for good, statx with the
# flag answers from the cache. Elsewhere (Lustre, GPFS, BeeGFS, 9p, autofs triggers, an unknown
# type) a stat is made in a forked reader only (_bounded_reads.NeedsIsolation).
ANSWERING_FS = frozenset((
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "vfat", "msdos", "exfat", "ntfs3", "squashfs", "erofs",
    "iso9660", "udf", "tmpfs", "ramfs", "devtmpfs", "devpts", "proc", "sysfs", "cgroup", "cgroup2", "mqueue", "hugetlbfs", "bpf",
    "tracefs", "debugfs", "securityfs", "pstore", "configfs", "efivarfs", "binfmt_misc", "fusectl", "rpc_pipefs", "nsfs", "overlay",
    "fuse", "fuseblk", "nfs", "nfs4", "cifs", "smb3", "ceph",
))


def _unescape(field: bytes) -> str:
    """A mountinfo path field: octal escapes (\\040 a space) undone."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes((int(m.group(1), 8),)), field).decode("utf-8", "replace")


class MountTable:
    """The file systems of one tree, from /proc/PID/mountinfo (mount points as its process sees
    them): which one a path lies on, its longest mount point that is a prefix."""

    def __init__(self, mountinfo: bytes) -> None:
        points: dict[str, str] = {}
        # "\n" only: a mount point a user names may hold a "\r", which bytes.splitlines() breaks at.
        for line in mountinfo.split(b"\n"):
            left, sep, right = line.partition(b" - ")
            # One space between fields (a space in a path is \040); bytes.split() would also split at a \x0b.
            fields, tail = left.split(b" "), right.split(b" ")
            if sep and len(fields) >= 5 and tail:
                points[_unescape(fields[4])] = tail[0].decode("ascii", "replace")
        self._points = sorted(points.items(), key=lambda item: len(item[0]), reverse=True)
        self._answers: dict[str, bool] = {}
        # An empty table (unreadable) knows nothing: every stat then waits for a forked reader.
        self.all_answer = bool(points) and all(_answering(fstype) for fstype in points.values())

    def fstype(self, path: str) -> str | None:
        for point, fstype in self._points:
            if path == point or point == "/" or path.startswith(point + "/"):
                return fstype
        return None

    def answers(self, path: str) -> bool:
        """Whether a stat of a file at `path` (of this tree) cannot wait on a server (ANSWERING_FS)."""
        if self.all_answer:
            return True
        if path not in self._answers:
            fstype = self.fstype(path[: -len(DELETED_SUFFIX)] if path.endswith(DELETED_SUFFIX) else path)
            self._answers[path] = fstype is not None and _answering(fstype)
        return self._answers[path]

    def check(self, path: str) -> None:
        """Raise _bounded_reads.NeedsIsolation for a path a stat of which may wait, outside a forked reader."""
        if not self.all_answer and not _bounded_reads.isolated() and not self.answers(path):
            raise _bounded_reads.NeedsIsolation(path)


def _answering(fstype: str) -> bool:
    return fstype in ANSWERING_FS or fstype.startswith("fuse.")


_OWN_TREE: list[MountTable] = []


def own_tree() -> MountTable:
    """This module's file systems (/proc/self/mountinfo), read once a run."""
    if not _OWN_TREE:
        try:
            _OWN_TREE.append(MountTable(_read("/proc/self/mountinfo")))
        except OSError:
            _OWN_TREE.append(MountTable(b""))
    return _OWN_TREE[0]


class View(t.NamedTuple):
    """How a process's paths read here (DeviceTable.view)."""

    same: bool
    mounts: MountTable


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()
