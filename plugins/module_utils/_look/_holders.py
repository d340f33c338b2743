# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Who holds /dev/nvidia*: a scan of /proc/*/fd and /proc/*/maps, as `fuser -v` does.

nvidia-smi cannot see a child forked after CUDA init once its parent is gone (tests/gpu/results/README.md,
measured on an H200): only the device files tell the truth about who keeps GPU memory. Which
GPU a holder uses is NOT which device files it has open (every CUDA process and every NVML
client opens every /dev/nvidiaN of the node): that is decided in _attribution.py, from
nvidia-smi's compute apps and the mapping sizes this scan records.

/proc is read as bytes and decoded once, with replacement: a 15-byte comm can end inside a
multi-byte character (CJK names, setproctitle).

What a user controls decides nothing here (docs/docsite/rst/guide_security.rst): a device file is known by what the
kernel says it is (`DeviceTable`: its device number, or the very inode of this node's own
/dev/nvidia* node), never by the path a process opened it through; a protected daemon is known by
its real uid and its executable as the kernel resolves it, never by its name alone.

No read here can hang root (_bounded_reads): files a process holds are stat'ed from what the kernel has
cached (`_bounded_reads.stat_nosync`: a stalled FUSE or NFS server is never asked), the pass over /proc
runs in a bounded child, and a process whose /proc entries do not answer is reported `blocked`,
never passed over. A thread-group leader that exited while its other threads run on (state Z,
`Threads:` > 1: `ps` shows `Zl <defunct>`) is a live process: its files, maps and command line are
read through a live thread (/proc/PID/task/TID/...), whose are the group's.
"""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import os
import pwd
import re
import stat as stat_mod
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    # {device name: [mappings, KiB]}
    Mapped = t.Dict[str, t.List[int]]
    MainPidOf = t.Callable[[str], t.Optional[int]]

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
DELETED_SUFFIX = " (deleted)"
_UNIT = re.compile(r"^[^/]+\.(?:service|scope)$")

COMM_LENGTH = 15


def device_path(target: str) -> str | None:
    """A /proc fd or maps target -> its /dev/nvidia* path, whatever the spelling, or None when
    it is no NVIDIA device file. The one place that knows how device paths are spelled."""
    if target.endswith(DELETED_SUFFIX):
        target = target[: -len(DELETED_SUFFIX)]
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
        self._trees: dict[tuple[str, str], MountTable] = {}

    def view(self, base: str) -> View:
        """How to read the paths a process (its /proc directory `base`) shows: whether it sees this
        module's tree (its mount namespace is ours: its paths name the same files as here), and
        the file systems of its tree. Where every file system here answers a stat from the cache
        (MountTable.all_answer: no Lustre, GPFS, 9p...), another namespace's are taken to be of
        the same kinds (only root mounts those, and a container binds the node's); otherwise its
        own mountinfo is read, once per namespace and root."""
        own = own_tree()
        try:
            mount_ns = os.readlink(base + "/ns/mnt")
        except OSError:
            return View(False, own)
        if mount_ns == self.mount_ns:
            return View(True, own)
        if own.all_answer:
            return View(False, own)
        try:
            key = (mount_ns, os.readlink(base + "/root"))
            if key not in self._trees:
                self._trees[key] = MountTable(_read(base + "/mountinfo"))
            return View(False, self._trees[key])
        except OSError:
            return View(False, MountTable(b""))

    def known_fd(self, link: str, target: str, view: View | None) -> str | None:
        """name_of an fd. For a process that sees this module's tree (`view.same`) the path it shows
        is a path of this tree, which only root can mount on, so one stat per path serves every
        such process (a busy node: thousands of fds on /dev/null and log files); a process
        elsewhere, or a deleted file, is asked fd by fd. The stat asks the kernel's cache, never a
        file system's server (_bounded_reads.stat_nosync), and is made here only on a file system known
        to answer it so (`view.mounts`, MountTable.answers); others raise NeedsIsolation. Raises
        OSError as os.stat does."""
        if view is None or not view.same or target.endswith(DELETED_SUFFIX):
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


def _text(data: bytes | str) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


# The /proc files below are split at "\n" only, never with str.splitlines(): a user's comm (the
# Name: line of status) and cgroup names may hold \x1c-\x1e or \x85, which the kernel prints as
# they are and splitlines() takes for line breaks; a comm of "x\x1cUid: 0 0 0 0" would read as root.


# ---------------------------------------------------------------- /proc/PID/status: the one reader

# Every read of /proc/PID/status in plugins/ is read_status (tests/quality/test_one_status_reader.py).
# The kernel escapes only "\n" and "\\" in the Name: line (a process's comm, 15 bytes its user
# chooses): \r, \x0b, \x0c, \x1c-\x1e, \x85 and U+2028 come out as they are, and each of them is a
# line break to str.splitlines() (\r to bytes.splitlines() and a text-mode file too). Split there, a
# comm of "\x0bThreads:\t2" made an unreaped zombie a leader whose threads run on; the file is split
# at "\n" alone, and each field is taken at its first line (Name: comes first, and is one line).


def parse_status(data: bytes | str) -> dict[str, str]:
    """/proc/PID/status (bytes or text) -> {field: value}, each value as the kernel wrote it after
    the field's ":" and tab."""
    fields: dict[str, str] = {}
    for line in _text(data).split("\n"):
        key, sep, value = line.partition(":")
        if sep and key not in fields:
            fields[key] = value[1:] if value.startswith("\t") else value
    return fields


def read_status(pid: int, proc: str = "/proc") -> dict[str, str]:
    """parse_status of /proc/PID/status. Raises OSError when the process is gone. The file answers
    where /proc/PID/stat may wait (_bounded_reads's doc)."""
    return parse_status(_read(f"{proc}/{pid:d}/status"))


def status_ints(status: bytes | str | t.Mapping[str, str], key: str) -> list[int] | None:
    """The integers of a field of /proc/PID/status (`Uid`: real, effective, saved, file system;
    `Groups`, `NSpid`), None when absent or not numbers."""
    fields = status if isinstance(status, t.Mapping) else parse_status(status)
    if key not in fields:
        return None
    try:
        return [int(value) for value in fields[key].split()]
    except ValueError:
        return None


def status_field(status: bytes | str | t.Mapping[str, str], key: str) -> int | None:
    """An integer field of /proc/PID/status (`Threads`, `PPid`), None when absent."""
    fields = status if isinstance(status, t.Mapping) else parse_status(status)
    try:
        return int(fields[key].split()[0])
    except (KeyError, ValueError, IndexError):
        return None


def status_state(status: t.Mapping[str, str]) -> str:
    """The state letter of a parsed status (`S`, `Z`...), "?" when absent."""
    return (status.get("State") or "?").strip()[:1] or "?"


def parse_stat(data: bytes | str) -> tuple[str, str, int, int]:
    """/proc/PID/stat (bytes or text) -> (comm, state, ppid, start_time). comm may hold spaces,
    parens and, as bytes, half of a multi-byte character."""
    if isinstance(data, bytes):
        left = data.index(b"(")
        right = data.rindex(b")")
        comm = data[left + 1:right].decode("utf-8", "replace")
        rest = data[right + 2:].decode("ascii", "replace").split()
    else:
        left = data.index("(")
        right = data.rindex(")")
        comm = data[left + 1:right]
        rest = data[right + 2:].split()
    # rest[0] is field 3 (state); field 22 (starttime) is rest[19].
    return comm, rest[0], int(rest[1]), int(rest[19])


PF_KTHREAD = 0x00200000


def is_kernel_thread(stat: bytes | str) -> bool:
    """Kernel threads carry PF_KTHREAD in /proc/PID/stat field 9. (Their PIDs say nothing:
    inside a PID namespace PID 2 is an ordinary process.)"""
    text = _text(stat)
    rest = text[text.rindex(")") + 2:].split()
    return bool(int(rest[6]) & PF_KTHREAD)


def parse_cgroup(text: bytes | str) -> str | None:
    """/proc/PID/cgroup -> the cgroup path that systemd manages (the v2 `0::` line, else the
    v1 `name=systemd` line), or None."""
    unified = named = None
    for line in _text(text).split("\n"):
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2]
        elif parts[1] == "name=systemd":
            named = parts[2]
    path = unified if unified not in (None, "/") else named
    return path or unified


def unit_of(cgroup_path: str | None) -> str | None:
    """The unit of the host's systemd a cgroup path claims: its FIRST `*.service` or `*.scope` from
    the root. systemd puts a unit only in a slice, never in another unit, so everything below that
    directory is the unit's own: where systemd delegates it (`Delegate=yes`, `user@UID.service`), its
    user or container names the directories below at will (`.../lab-alice.service/networking.service`
    is lab-alice.service's). A claim until systemd confirms it (_unit_owner.confirm: the unit's
    ControlGroup= is that directory). None below a system container's boundary: there the unit is
    the guest's, never the host's (_guests)."""
    if not cgroup_path or _cgroups.guest_ref(cgroup_path) is not None:
        return None
    for part in cgroup_path.split("/"):
        if _UNIT.match(part):
            return part
    return None


def is_system_service(cgroup_path: str | None) -> bool:
    """True when the unit is a .service of the system manager that runs its own processes, i.e.
    one that `systemctl stop` stops for them: not a user's manager (`user@UID.service`, the whole
    session of its user), not a container's runtime."""
    unit = unit_of(cgroup_path)
    # A container's processes can sit below its runtime's unit (containerd.service): stopping
    # that unit would take down every container of the node.
    return bool(unit and unit.endswith(".service") and not unit.startswith("user@") and container_of(cgroup_path) is None)


def container_of(cgroup_path: str | None) -> str | None:
    return _cgroups.container_of(cgroup_path)


def parse_cmdline(raw: bytes) -> tuple[list[str], str]:
    """NUL-separated argv -> (argv list, display string)."""
    argv = raw.decode("utf-8", "replace").split("\0")
    while argv and argv[-1] == "":
        argv.pop()
    return argv, " ".join(argv)


def mapped_devices(maps: bytes) -> Mapped:
    """/proc/PID/maps (bytes) -> {device path: [mappings, KiB]} for NVIDIA device files, by the
    spelling of their paths (what a fake /proc, or a reader without map_files, can tell). The
    sizes tell a GPU's context from the small mappings every CUDA process makes of the other
    GPUs' nodes (see _attribution)."""
    return mapped_by_identity(maps, DeviceTable())


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def parse_environ(raw: bytes) -> dict[str, str]:
    """/proc/PID/environ (bytes) -> {name: value}; an entry without "=" is skipped."""
    pairs = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            pairs[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return pairs


def environ_of(pid: int, proc: str = "/proc") -> dict[str, str]:
    """The environment a process started with, {} when it cannot be read (gone, not ours to read,
    or not answering: _bounded_reads). Written by whoever started the process: a hint for display
    and lookups, never a reason to signal or stop anything (docs/docsite/rst/guide_design.rst,
    "What can be trusted on a shared node")."""
    try:
        return _bounded_reads.call(_environ, pid, proc, process=f"{proc}/{pid:d}")
    except (OSError, _bounded_reads.ReadBlocked):
        return {}


def _environ(pid: int, proc: str) -> dict[str, str]:
    return parse_environ(_read(process_dir(pid, proc) + "/environ"))


def cgroup_paths(pid: int, proc: str = "/proc") -> list[str] | None:
    """Every cgroup path of a process, one per hierarchy line of /proc/PID/cgroup (a cgroup v1
    node lists one per controller), None when it cannot be read."""
    try:
        raw = _read(f"{proc}/{pid:d}/cgroup")
    except OSError:
        return None
    return [line.split(":", 2)[-1] for line in raw.decode("utf-8", "replace").split("\n") if line]


def cgroup_of(pid: int, proc: str = "/proc") -> str | None:
    """The systemd-managed cgroup path of a process (parse_cgroup), None when it cannot be read."""
    try:
        return parse_cgroup(_read(f"{proc}/{pid:d}/cgroup"))
    except OSError:
        return None


def _user_name(uid: int, cache: dict[int, str]) -> str:
    if uid not in cache:
        name = str(uid)
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            pass
        cache[uid] = name
    return cache[uid]


def _uid_from_status(status: bytes | str | t.Mapping[str, str]) -> int | None:
    """The real uid of a status."""
    uids = status_ints(status, "Uid")
    return uids[0] if uids else None


SIGTERM_BIT = 1 << (15 - 1)  # signal N is bit N-1 of the SigIgn/SigCgt masks (proc(5))


def signal_facts(text: bytes | str | t.Mapping[str, str]) -> tuple[str | None, bool]:
    """/proc/PID/status -> (what SIGTERM does to the process: "ignored", "caught" or "default";
    None when the kernel did not say, whether it is the init of its own PID namespace). NSpid
    lists its PID in each namespace from ours down to its own: more than one entry ending in 1 is
    the init of a namespace below ours, which the kernel shields from every signal it has no
    handler for (pid_namespaces(7)), SIGKILL aside."""
    fields = text if isinstance(text, t.Mapping) else parse_status(text)
    masks: dict[str, int] = {}
    for key in ("SigIgn", "SigCgt"):
        try:
            masks[key] = int(fields[key].strip(), 16)
        except (KeyError, ValueError):
            pass
    pids = (fields.get("NSpid") or "").split()
    namespace_init = len(pids) > 1 and pids[-1] == "1"
    if "SigIgn" not in masks or "SigCgt" not in masks:
        return None, namespace_init
    if masks["SigIgn"] & SIGTERM_BIT:
        return "ignored", namespace_init
    return ("caught" if masks["SigCgt"] & SIGTERM_BIT else "default"), namespace_init


def open_devices(pid: int, proc: str = "/proc", table: DeviceTable | None = None) -> set[str]:
    """The /dev/nvidia* names of the device files a process has open, known by identity (see
    DeviceTable): a stat of /proc/PID/fd/N follows the kernel's link to the opened inode,
    whatever path or namespace it was opened through. Only where the kernel cannot be asked
    (the fd closed meanwhile, a test's fake /proc) does the path's spelling count. Raises
    OSError when the process is gone or not ours to read."""
    return _open_devices(pid, proc, table if table is not None else DeviceTable())[0]


def _open_devices(pid: int, proc: str, table: DeviceTable) -> tuple[set[str], str]:
    """(open_devices, the directory its files are read through: /proc/PID, or a live thread's
    for a zombie leader)."""
    devices: set[str] = set()
    base = f"{proc}/{pid:d}"
    entries = os.listdir(base + "/fd")
    if not entries and _threads_beyond_leader(base):
        # A zombie leader's own fd table is gone; its live threads share the group's.
        base = process_dir(pid, proc)
        entries = os.listdir(base + "/fd")
    fd_dir = base + "/fd"
    view = None
    for entry in entries:
        link = fd_dir + "/" + entry
        try:
            target = os.readlink(link)
        except OSError:
            continue
        # socket:[..], pipe:[..], anon_inode:..: never a device file.
        if not target.startswith("/"):
            continue
        if view is None:
            view = table.view(base)
        try:
            device = table.known_fd(link, target, view)
        except OSError:
            device = device_path(target)
        if device is not None:
            devices.add(device)
    return devices, base


def _threads_beyond_leader(base: str) -> bool:
    """Whether a process runs more than one thread: /proc/PID/task links one directory per thread
    (a stat, not a read: kernel threads, whose fd table also reads empty, cost no more)."""
    try:
        return os.stat(base + "/task").st_nlink > 3
    except OSError:
        return False


def live_thread(pid: int, proc: str = "/proc") -> int | None:
    """A live thread of a process whose leader is a zombie (the main thread called pthread_exit
    or SYS_exit while others run on: `ps` shows `Zl <defunct>`, and /proc/PID/fd and maps read
    empty); None when the leader is alive, or no thread of it is."""
    base = f"{proc}/{pid:d}"
    try:
        if parse_stat(_read(base + "/stat"))[1] != "Z":
            return None
        tids = sorted(int(tid) for tid in os.listdir(base + "/task") if tid.isdigit() and int(tid) != pid)
    except (OSError, ValueError, IndexError):
        return None
    for tid in tids:
        try:
            if parse_stat(_read(f"{base}/task/{tid:d}/stat"))[1] not in ("Z", "X"):
                return tid
        except (OSError, ValueError, IndexError):
            continue
    return None


def process_dir(pid: int, proc: str = "/proc") -> str:
    """Where a process's files, maps, command line and environment are read: /proc/PID, or, for
    a zombie leader with live threads, one live thread's /proc/PID/task/TID (see live_thread)."""
    tid = live_thread(pid, proc)
    return f"{proc}/{pid:d}" if tid is None else f"{proc}/{pid:d}/task/{tid:d}"


# A maps line whose path mentions nvidia (a spelling of a device file), and, built per table, one
# whose inode is a device node's: the regex engine picks the few candidate lines of a CUDA
# process's thousands.
_MAPS_SPELLED = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ (\S+) (\d+)\s+(/\S*nvidia.*)$", re.MULTILINE)


def _maps_by_inode(inode_numbers: t.Collection[bytes]) -> re.Pattern[bytes] | None:
    if not inode_numbers:
        return None
    alternatives = b"|".join(sorted(inode_numbers))
    return re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ (\S+) (" + alternatives + rb")\s+(/.*)$", re.MULTILINE)


def mapped_by_identity(maps: bytes, table: DeviceTable, map_files: bytes | None = None, mounts: MountTable | None = None) -> Mapped:
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


def read_maps(pid: int, proc: str = "/proc", table: DeviceTable | None = None) -> Mapped | None:
    """{device: [mappings, KiB]} of a process, or None when its maps cannot be read (gone, not
    ours, or not answering: _bounded_reads)."""
    try:
        return _bounded_reads.call(_read_maps, pid, proc, table if table is not None else DeviceTable(), None, process=f"{proc}/{pid:d}")
    except _bounded_reads.ReadBlocked:
        return None


def _read_maps(pid: int, proc: str, table: DeviceTable, base: str | None) -> Mapped | None:
    """read_maps through `base` (process_dir's, when known already)."""
    base = base or f"{proc}/{pid:d}"
    try:
        maps = _read(base + "/maps")
        if not maps and _threads_beyond_leader(base):
            base = process_dir(pid, proc)
            maps = _read(base + "/maps")
    except OSError:
        return None
    # Most processes map no device file: byte searches skip the regex for them.
    if b"nvidia" not in maps and not any(b" " + ino + b" " in maps for ino in table.inode_numbers):
        return {}
    return mapped_by_identity(maps, table, (base + "/map_files").encode(), table.view(base).mounts)


# Where a daemon a node needs is installed: only root writes there. /proc/PID/exe names the
# executable as the kernel resolved it at exec (no symlink, no argv[0]).
SYSTEM_DIRS = ("/usr/bin/", "/usr/sbin/", "/bin/", "/sbin/", "/usr/lib/", "/usr/lib64/", "/usr/libexec/", "/lib/", "/lib64/",
               "/usr/local/bin/", "/usr/local/sbin/", "/usr/local/nvidia/bin/", "/run/nvidia/driver/usr/bin/")
# Accounts below this uid are system accounts (login.defs SYS_UID_MAX, 999 on Debian and RHEL):
# only root creates them.
SYSTEM_UID_MAX = 999


def _fs_root(proc: str) -> str:
    """The root the executables of `proc`'s processes are found under: "" for the kernel's
    /proc; a fake /proc tree of the unit tests keeps them in the sibling `<proc>-fs`."""
    return "" if proc == "/proc" else proc.rstrip("/") + "-fs"


def read_executable(base: str, fs_root: str = "") -> tuple[str | None, int | None, bool]:
    """(path, owner uid, verified) of /proc/PID/exe: the path as the kernel shows it, the owner
    of the executable it resolved at exec (os.stat follows the link to that very inode), and
    whether that path names the same inode in this module's own mount namespace (a user's bind
    mount of /usr/bin/python3 onto /usr/bin/Xorg in a namespace of their own does not). A
    deleted executable (a package upgraded under a running daemon) cannot be verified by inode:
    its path and owner then speak. (None, None, False) where the kernel does not answer.

    Only an executable in a system directory can be vouched for (`vouched`): any other is neither
    stat'ed nor looked up (a user's program on a FUSE mount that stopped answering would hold the
    lookup), and reads (path, None, False). The stat of the executable asks the kernel's cache only
    (_bounded_reads.stat_nosync)."""
    try:
        path = os.readlink(base + "/exe")
    except OSError:
        return None, None, False
    if fs_root and path.startswith(fs_root + "/"):
        path = path[len(fs_root):]
    deleted = path.endswith(DELETED_SUFFIX)
    if deleted:
        path = path[: -len(DELETED_SUFFIX)]
    if not path.startswith(SYSTEM_DIRS):
        return path, None, False
    if not fs_root:
        _trees().view(base).mounts.check(path)
    try:
        st = _bounded_reads.stat_nosync(base + "/exe")
    except OSError:
        return path, None, False
    if deleted:
        return path, st.st_uid, True
    try:
        here = os.stat(fs_root + path)
    except OSError:
        return path, st.st_uid, False
    return path, st.st_uid, (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino)


_TREES: list[DeviceTable] = []


def _trees() -> DeviceTable:
    """The trees processes see (DeviceTable.view), read once a run."""
    if not _TREES:
        _TREES.append(DeviceTable())
    return _TREES[0]


def read_process(pid: int, proc: str = "/proc", users: dict[int, str] | None = None) -> Holder | None:
    """Identity and placement of one process (the holder shape of gpu_facts' RETURN, docs/gpu_facts.md, without the GPU
    attribution), or None if it vanished. A process whose /proc entries do not answer within the
    budget (_bounded_reads) reads as blocked_record says."""
    users = {} if users is None else users
    try:
        return _bounded_reads.call(_read_process, pid, proc, users, process=f"{proc}/{pid:d}")
    except _bounded_reads.ReadBlocked as exc:
        return blocked_record(pid, proc, exc.waits_in, users)


def _read_process(pid: int, proc: str = "/proc", users: dict[int, str] | None = None) -> Holder | None:
    """read_process, unbounded: in a bounded reader only."""
    users = {} if users is None else users
    try:
        stat = _read(f"{proc}/{pid:d}/stat")
        comm, state, ppid, start_time = parse_stat(stat)
        kernel_thread = is_kernel_thread(stat)
        base = process_dir(pid, proc) if state == "Z" else f"{proc}/{pid:d}"
        argv, cmdline = parse_cmdline(_read(base + "/cmdline"))
        status = read_status(pid, proc)
        cgroup = _read(f"{proc}/{pid:d}/cgroup")
    except (OSError, ValueError, IndexError):
        return None
    exe, exe_owner, exe_verified = read_executable(base, _fs_root(proc))
    uid = _uid_from_status(status)
    sigterm, namespace_init = signal_facts(status)
    cgroup_path = parse_cgroup(cgroup)
    record: Holder = {
        "pid": pid,
        "ppid": ppid,
        "name": comm,
        "cmdline": cmdline,
        "argv0": os.path.basename(argv[0]) if argv else None,
        "exe": os.path.basename(exe) if exe else None,
        "exe_path": exe,
        "exe_owner": exe_owner,
        "exe_verified": exe_verified,
        "uid": uid,
        "user": _user_name(uid, users) if uid is not None else None,
        "state": state,
        "start_time": start_time,
        "devices": [],
        "mapped": {},
        "gpu_indexes": [],
        "unit": unit_of(cgroup_path),
        "system_service": is_system_service(cgroup_path),
        "container": container_of(cgroup_path),
        "cgroup": cgroup_path,
        "protected": False,
        "kernel_thread": kernel_thread,
        "sigterm": sigterm,
        "pid_namespace_init": namespace_init,
        "threads": status_field(status, "Threads"),
        "blocked": False,
        "wchan": None,
    }
    return record


def status_of(pid: int, proc: str = "/proc") -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc/PID/status, None when gone. Status answers where
    /proc/PID/stat may wait (a process in execve on a file system that stopped answering:
    _bounded_reads's doc), so the checks made in loops read it."""
    try:
        status = read_status(pid, proc)
    except OSError:
        return None
    return status_state(status), status_field(status, "PPid") or 0


def holds_threads(record: t.Mapping[str, t.Any]) -> bool:
    """Whether a process is alive: any state but Z and X, or a zombie leader whose other threads
    run on (`Threads:` > 1), which holds what the group holds."""
    return record.get("state") not in ("Z", "X") or (record.get("state") == "Z" and (record.get("threads") or 0) > 1)


# /proc/PID/status answers where stat, wchan, maps and the rest wait (_bounded_reads's doc): what is
# told of a process that does not answer comes from it.
WCHAN_BUDGET_S = 0.1


# Where each process found blocked sleeps, {its /proc directory: wchan}: read once per run.
_WCHANS: dict[str, str | None] = {}


def blocked_records(waits: t.Mapping[int, str | None], proc: str) -> list[Holder]:
    """blocked_record of each {pid: where root's read waited}, their wchans read in one parallel
    pass (a wchan waits as the process's other entries do: one after the other, thirty blocked
    processes cost thirty budgets), once per run."""
    todo = [pid for pid in waits if f"{proc}/{pid:d}" not in _WCHANS]
    outcome = _bounded_reads.scan(_bounded_reads.wchan_of, [f"{proc}/{pid:d}/wchan" for pid in todo], budget=WCHAN_BUDGET_S, deadline_s=WCHAN_BUDGET_S * 4)
    for index, pid in enumerate(todo):
        _WCHANS[f"{proc}/{pid:d}"] = outcome.results.get(index)
    users: dict[int, str] = {}
    records = [blocked_record(pid, proc, waits[pid], users, wchan=_WCHANS[f"{proc}/{pid:d}"]) for pid in sorted(waits)]
    return [record for record in records if record is not None]


def blocked_record(pid: int, proc: str, waits_in: str | None, users: dict[int, str] | None = None, wchan: str | None | bool = False) -> Holder | None:
    """What can be told of a process whose /proc entries did not answer (a process in execve
    closing a file of a FUSE mount that stopped answering holds them; a stalled NFS server, a
    process stuck in the kernel): its name, state, parent and owner from /proc/PID/status, its
    wchan where that answers at once. `blocked` is true, `waits_in` is where root's read waited.
    Its devices, maps and start time are unknown: it may hold any GPU and is never signalled.
    None when it is gone."""
    try:
        status = read_status(pid, proc)
        cgroup_path = parse_cgroup(_read(f"{proc}/{pid:d}/cgroup"))
    except OSError:
        return None
    uid = _uid_from_status(status)
    if wchan is False:
        try:
            wchan = _bounded_reads.call(_bounded_reads.wchan_of, f"{proc}/{pid:d}/wchan", budget=WCHAN_BUDGET_S)
        except _bounded_reads.ReadBlocked:
            wchan = None
    # start_time None: /proc/PID/stat is what does not answer; never signalled without it.
    record = t.cast("Holder", {
        "pid": pid, "ppid": status_field(status, "PPid") or 0, "name": status.get("Name", "?"), "cmdline": "",
        "argv0": None, "exe": None, "exe_path": None, "exe_owner": None, "exe_verified": False, "uid": uid,
        "user": _user_name(uid, {} if users is None else users) if uid is not None else None, "state": status_state(status),
        "start_time": None, "devices": [], "mapped": None, "gpu_indexes": [], "unit": unit_of(cgroup_path),
        "system_service": is_system_service(cgroup_path), "container": container_of(cgroup_path), "cgroup": cgroup_path, "protected": False,
        "kernel_thread": False, "sigterm": None, "pid_namespace_init": False,
        "threads": status_field(status, "Threads"), "blocked": True, "wchan": wchan, "waits_in": waits_in,
    })
    return record


def pid_namespace_of(pid: int, proc: str = "/proc") -> tuple[int, int] | None:
    """The identity (device, inode) of the PID namespace a process lives in, or None."""
    try:
        st = os.stat(f"{proc}/{pid:d}/ns/pid")
    except OSError:
        return None
    return st.st_dev, st.st_ino


# ioctl_ns(2): NS_GET_PARENT, _IO(0xb7, 0x2): an fd of the parent of a PID namespace.
NS_GET_PARENT = 0xB702


def _nspid_depth(pid: int, proc: str) -> int | None:
    """How many PID namespaces, ours included, a process is in (its NSpid line's length)."""
    try:
        pids = read_status(pid, proc).get("NSpid")
    except OSError:
        return None
    return None if pids is None else len(pids.split())


def _ancestor_namespace(pid: int, levels: int, proc: str) -> tuple[int, int] | None:
    """The identity of the PID namespace LEVELS above the one a process lives in, asked of the
    kernel (NS_GET_PARENT), or None where it cannot be asked."""
    try:
        fd = os.open(f"{proc}/{pid:d}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for _level in range(levels):
            parent = fcntl.ioctl(fd, NS_GET_PARENT)
            os.close(fd)
            fd = parent
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    except OSError:
        return None
    finally:
        os.close(fd)


def namespace_members(init_pid: int, proc: str = "/proc") -> list[int]:
    """The processes that end when INIT_PID, the init of a PID namespace below ours, ends: the
    kernel sends SIGKILL to every other process of its namespace (pid_namespaces(7)), and so to
    every namespace nested in it. Those are the processes whose namespace is its namespace or
    has it as an ancestor (asked of the kernel, NS_GET_PARENT: also a process that entered a
    nested namespace by setns from outside), and every descendant of those (a fork stays in its
    parent's namespace or one below it; this also covers where the kernel cannot be asked). A
    process whose /proc entries do not answer (_bounded_reads) counts as a member: it may be one."""
    own = pid_namespace_of(init_pid, proc)
    depth = _nspid_depth(init_pid, proc)
    if own is None:
        return []

    def one(pid: int) -> tuple[int, bool] | None:
        try:
            ppid = parse_stat(_read(f"{proc}/{pid:d}/stat"))[2]
        except (OSError, ValueError, IndexError):
            return None
        if pid_namespace_of(pid, proc) == own:
            return ppid, True
        deeper = _nspid_depth(pid, proc)
        return ppid, bool(depth is not None and deeper is not None and deeper > depth and _ancestor_namespace(pid, deeper - depth, proc) == own)

    pids = [pid for pid in list_pids(proc) if pid != init_pid]
    outcome = _bounded_reads.scan(one, pids, isolate=False, processes=[f"{proc}/{pid:d}" for pid in pids])
    inside = {pids[blocked.item] for blocked in outcome.blocked} | {pids[index] for index in outcome.unread}
    children: dict[int, list[int]] = {}
    for index, (ppid, within) in outcome.results.items():
        children.setdefault(ppid, []).append(pids[index])
        if within:
            inside.add(pids[index])
    members, todo = set(inside), list(inside)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in members and child != init_pid:
                members.add(child)
                todo.append(child)
    return sorted(members)


def list_pids(proc: str = "/proc") -> list[int]:
    return sorted(int(entry) for entry in os.listdir(proc) if entry.isdigit())


def process_entries(proc: str = "/proc") -> dict[int, int]:
    """{pid: inode number of /proc/PID}, from one read of the directory (no stat). The inode names
    one process: the kernel drops a process's /proc entries when it is reaped (proc_flush_pid), so
    a PID used again comes back under a new inode."""
    with os.scandir(proc) as entries:
        return {int(entry.name): entry.inode() for entry in entries if entry.name.isdigit()}


# The run's last device-file pass, by /proc: {pid: inode of /proc/PID} of the processes it read
# with no device file open. A later pass of the same run (`again`, gpu_release's rescans) reads
# only the others: the look's holders, what it could not read, and every process started since.
QUIET: dict[str, dict[int, int]] = {}


class ScanLimits(t.NamedTuple):
    """How long a pass over /proc may wait: on one process (`budget`) and in all (`deadline_s`)."""

    budget: float = _bounded_reads.PROCESS_BUDGET_S
    deadline_s: float = _bounded_reads.DEADLINE_S


DEFAULT_LIMITS = ScanLimits()


def scan_holders(proc: str = "/proc", unreadable: list[int] | None = None, with_maps: bool = True, without_devices: list[int] | None = None,
                 table: DeviceTable | None = None, limits: ScanLimits = DEFAULT_LIMITS, unscanned: list[int] | None = None,
                 again: bool = False) -> list[Holder]:
    """Every live process with a /dev/nvidia* node open or (with `with_maps`) mapped, with its
    mappings of those nodes (`mapped`), and every process whose /proc entries did not answer
    (blocked_record). Processes that vanish mid-scan or that we may not read are skipped (the PIDs
    we may not read are appended to `unreadable`, if given); a zombie holds nothing and is no
    holder, but a zombie leader whose threads run on is a process like any other.

    The maps of every process that has a device file open are read: attribution needs their
    sizes. Reading the maps of all the others is two thirds of a full scan's cost (~70 of ~100 us
    a process, benchmarks/HISTORY.md, "What profiling changed (2026-11-29)") and finds only processes that mapped a device file and then
    closed it, which CUDA never does; callers ask for that (`with_maps`) only where such a
    process could be what holds a GPU. Without `with_maps`, the PIDs skipped for having no
    device file open are appended to `without_devices`, if given, for `scan_mapped` later.

    The pass runs in a bounded reader (_bounded_reads.scan, `limits`); the PIDs its deadline left
    unread are appended to `unscanned`, if given.

    Without `with_maps`, the processes found with no device file open are remembered for the run
    (QUIET); `again` reads only the others, taking the last pass's answer for those (a process
    that opens a device file meanwhile and holds memory shows on the GPU, and an unexplained GPU
    has every process's maps read, scan_mapped). Speed: on a node of 10,000 processes a pass
    lists about 130,000 fds (benchmarks/HISTORY.md, issue 66); gpu_release's rescans after
    acting read a few dozen processes instead."""
    table = table if table is not None else DeviceTable.read()
    users: dict[int, str] = {}
    entries = process_entries(proc)
    known = QUIET.get(proc, {}) if again and not with_maps else {}
    kept = [pid for pid, inode in entries.items() if known.get(pid) == inode]
    kept_set = set(kept)
    quiet: list[int] = []

    def one(pid: int) -> t.Any:
        try:
            devices, base = _open_devices(pid, proc, table)
        except PermissionError:
            return "unreadable"
        except OSError:
            return None
        if not devices and not with_maps:
            return None
        return _holder(pid, devices, base, proc, users, table)

    found = _bounded_pass(one, sorted(pid for pid in entries if pid not in kept_set), proc, limits, unreadable, quiet, unscanned)
    if not with_maps:
        QUIET[proc] = {pid: entries[pid] for pid in quiet + kept}
        if without_devices is not None:
            without_devices.extend(sorted(quiet + kept))
    return found


def scan_mapped(pids: t.Iterable[int], proc: str = "/proc", table: DeviceTable | None = None, limits: ScanLimits = DEFAULT_LIMITS,
                unscanned: list[int] | None = None) -> list[Holder]:
    """The processes among `pids` (which had no device file open) that map a /dev/nvidia* node:
    the second half of a full scan, done only when a GPU's memory is not explained without it.
    Speed: it saves re-listing every process's fds (measured, benchmarks/changes.md)."""
    table = table if table is not None else DeviceTable.read()
    users: dict[int, str] = {}
    return _bounded_pass(lambda pid: _holder(pid, set(), None, proc, users, table), list(pids), proc, limits, None, None, unscanned)


def _bounded_pass(one: t.Callable[[int], t.Any], pids: list[int], proc: str, limits: ScanLimits, unreadable: list[int] | None,
                  others: list[int] | None, unscanned: list[int] | None) -> list[Holder]:
    """`one(pid)` over `pids` in a bounded reader -> holder records, blocked ones included.
    `one` returns a holder record, "unreadable" or None; `others` gets the PIDs it returned
    None for (and those gone meanwhile: a later read of them finds nothing). A process found
    blocked earlier in the run is reported without waiting on it again (_bounded_reads.BLOCKED)."""
    outcome = _bounded_reads.scan(one, pids, limits.budget, limits.deadline_s, isolate=False, processes=[f"{proc}/{pid:d}" for pid in pids])
    holders: list[Holder] = []
    answered = set()
    for index, result in sorted(outcome.results.items()):
        answered.add(index)
        if result == "unreadable":
            if unreadable is not None:
                unreadable.append(pids[index])
        else:
            holders.append(result)
    silent = {blocked.item for blocked in outcome.blocked} | set(outcome.unread)
    if others is not None:
        others.extend(pid for index, pid in enumerate(pids) if index not in answered and index not in silent)
    if unscanned is not None:
        unscanned.extend(pids[index] for index in outcome.unread)
    holders.extend(blocked_records({pids[b.item]: b.waits_in for b in outcome.blocked}, proc))
    return sorted(holders, key=lambda holder: holder["pid"])


def _holder(pid: int, devices: set[str], base: str | None, proc: str, users: dict[int, str], table: DeviceTable) -> Holder | None:
    """A holder record for a process with `devices` open, its maps read; None when it holds
    nothing or is gone (or a zombie whose threads have all exited)."""
    mapped = _read_maps(pid, proc, table, base)
    if not devices and not mapped:
        return None
    record = _read_process(pid, proc, users)
    if record is None or not holds_threads(record):
        return None
    record["devices"] = sorted(devices | set(mapped or ()))
    # None: the maps could not be read, so the mapping sizes are unknown.
    record["mapped"] = None if mapped is None else {device: {"count": n, "kib": kib} for device, (n, kib) in mapped.items()}
    return record


def read_stats(pids: t.Iterable[int], proc: str = "/proc", limits: ScanLimits = DEFAULT_LIMITS) -> dict[int, bytes]:
    """{pid: /proc/PID/stat} of `pids`, read in a bounded reader: a process whose stat does not
    answer (in execve, closing a file of a stalled FUSE mount) is left out, as one gone is."""

    def one(pid: int) -> bytes | None:
        try:
            return _read(f"{proc}/{pid:d}/stat")
        except OSError:
            return None

    items = list(pids)
    outcome = _bounded_reads.scan(one, items, limits.budget, limits.deadline_s, isolate=False, processes=[f"{proc}/{pid:d}" for pid in items])
    return {items[index]: data for index, data in outcome.results.items()}


def display_name(pid: int, proc: str = "/proc") -> str | None:
    """A live process's argv[0] (what nvidia-smi would print as its name), else its comm; None
    when it is gone or does not answer. For display only: the process chose it."""
    try:
        return _bounded_reads.call(_display_name, pid, proc, process=f"{proc}/{pid:d}")
    except _bounded_reads.ReadBlocked:
        return None


def _display_name(pid: int, proc: str) -> str | None:
    try:
        stat = _read(f"{proc}/{pid:d}/stat")
        base = process_dir(pid, proc) if parse_stat(stat)[1] == "Z" else f"{proc}/{pid:d}"
        argv, _cmdline = parse_cmdline(_read(base + "/cmdline"))
        if argv and argv[0]:
            return argv[0]
        return parse_stat(stat)[0]
    except (OSError, ValueError, IndexError):
        return None


PF_EXITING = 0x00000004


def is_exiting(pid: int, proc: str = "/proc") -> bool:
    """The kernel is ending this process (PF_EXITING in /proc/PID/stat field 9: set in do_exit,
    where a large context's teardown runs) and it is no zombie yet. A zombie leader carries the
    flag whatever its live threads do, so it says nothing here."""
    try:
        stat = _read(f"{proc}/{pid:d}/stat")
        state = parse_stat(stat)[1]
        text = _text(stat)
        flags = int(text[text.rindex(")") + 2:].split()[6])
    except (OSError, ValueError, IndexError):
        return False
    return state not in ("Z", "X") and bool(flags & PF_EXITING)


def start_time_of(pid: int, proc: str = "/proc") -> int | None:
    """Start time of a live PID, or None: the identity check before a signal. A zombie leader
    whose threads run on is alive (holds_threads); a process whose stat does not answer within the
    budget reads as gone here (its identity cannot be checked, so it is never signalled)."""
    try:
        return _bounded_reads.call(_start_time, pid, proc, process=f"{proc}/{pid:d}")
    except _bounded_reads.ReadBlocked:
        return None


def _start_time(pid: int, proc: str) -> int | None:
    try:
        _comm, state, _ppid, start_time = parse_stat(_read(f"{proc}/{pid:d}/stat"))
        if state == "Z":
            threads = status_field(read_status(pid, proc), "Threads")
            state = "z" if threads is not None and threads > 1 else state
    except (OSError, ValueError, IndexError):
        return None
    if state in ("Z", "X"):
        return None
    return start_time


def lineage(pid: int, proc: str = "/proc") -> list[int]:
    """PIDs of a process and all its ancestors (the module and its Ansible/SSH session)."""
    seen = []
    while pid and pid not in seen:
        seen.append(pid)
        try:
            _comm, _state, pid, _start = parse_stat(_read(f"{proc}/{pid:d}/stat"))
        except (OSError, ValueError, IndexError):
            break
    return seen


def split_protect(items: t.Iterable[t.Any] | None) -> tuple[list[str], set[int]]:
    """User `protect` entries -> (names, pids): entries of ASCII digits are PIDs ('³'.isdigit()
    is true, but int('³') fails: such an entry is a name)."""
    names: list[str] = []
    pids: set[int] = set()
    for item in items or []:
        text = str(item).strip()
        if text.isdigit() and text.isascii():
            pids.add(int(text))
        elif text:
            names.append(text)
    return names, pids


def name_matches(record: t.Mapping[str, t.Any], names: t.Iterable[str]) -> bool:
    """Whether a process goes by one of `names` (its executable's basename, argv[0]'s basename or
    comm, which the kernel truncates to 15 characters: nvidia-persistenced shows as
    nvidia-persiste). A name alone decides nothing: rules ask ProcessNames.of, which asks the
    identity rule first."""
    return _first_match(names, own_names(record)) is not None


def own_names(record: t.Mapping[str, t.Any]) -> set[str]:
    """The names a process gives itself: comm, executable basename, argv[0] basename."""
    return {name for name in (record.get("name"), record.get("exe"), record.get("argv0")) if name}


INTERPRETERS = re.compile(r"^(?:python[0-9.]*|perl[0-9.]*|ruby[0-9.]*|node|nodejs|bash|sh|dash|java)$")
SUBCOMMAND = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


def process_names(record: t.Mapping[str, t.Any] | None) -> set[str]:
    """The names a process goes by: comm, executable, argv[0] and, for an interpreter, the
    script or module it runs (`python3 /usr/local/bin/jupyterhub`, `python3 -m jupyterhub`);
    also "tool subcommand" for the script or binary and its first argument (`ray start`,
    `dask worker`, `nomad agent`, `jupyter lab`)."""
    if not record:
        return set()
    names = {record.get("name"), record.get("exe"), record.get("argv0")}
    words = (record.get("cmdline") or "").split()
    tool, rest = (words[0].rsplit("/", 1)[-1], words[1:]) if words else (None, [])
    if tool and INTERPRETERS.match(tool):
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]
        if len(rest) >= 2 and rest[0] == "-m":
            names.update((rest[1], rest[1].split(".")[0]))
            tool, rest = rest[1], rest[2:]
        elif rest:
            tool, rest = rest[0].rsplit("/", 1)[-1], rest[1:]
            names.add(tool)
        else:
            tool = None
    if tool and rest and SUBCOMMAND.match(rest[0]):
        names.add(f"{tool} {rest[0]}")
    return {name for name in names if name}


def _first_match(names: t.Iterable[str], candidates: t.Collection[str], globs: t.Iterable[str] = (), cut: bool = True) -> str | None:
    """The first of `names` among `candidates` (with `cut`, a name longer than comm also as its
    15-character cut), else the first candidate that matches one of `globs`, else None."""
    for name in names:
        if name in candidates or (cut and len(name) > COMM_LENGTH and name[:COMM_LENGTH] in candidates):
            return name
    for pattern in globs:
        for candidate in sorted(candidates):
            if fnmatch.fnmatchcase(candidate, pattern):
                return candidate
    return None


def vouched(record: t.Mapping[str, t.Any]) -> bool:
    """Whether the kernel vouches for a process as a daemon of the node: its real uid is root or
    a system account (/proc/PID/status), and it runs a root-owned executable in a system
    directory, as /proc/PID/exe resolves it (see read_executable). Nothing a user can set
    (comm, argv[0], a copied or bind-mounted interpreter, their own uid) passes."""
    uid = record.get("uid")
    path = record.get("exe_path")
    if uid is None or uid > SYSTEM_UID_MAX or not path:
        return False
    return record.get("exe_owner") == 0 and bool(record.get("exe_verified")) and path.startswith(SYSTEM_DIRS)


def identified(record: t.Mapping[str, t.Any] | None, main_pid_of: MainPidOf | None = None) -> bool:
    """THE identity rule: a name a process goes by counts only when this holds. The kernel
    vouches for it (`vouched`), or it is systemd's MainPID of the system unit it runs in
    (`main_pid_of(unit)`, where given: systemd's word)."""
    return bool(record) and (vouched(t.cast("t.Mapping[str, t.Any]", record)) or _unit_main(t.cast("t.Mapping[str, t.Any]", record), main_pid_of))


class ProcessNames:
    """A list of process names some rule is keyed on (protected daemons, launchers, MPS,
    supervisors, ...). It answers one question, `of(record)`, and only through the identity rule
    (`identified`): any user can name a process so. Every list of process names in module_utils is
    one of these (tests/unit/plugins/module_utils/_act/test_identity.py fails on a bare one).

    `scripts`: also match the script an interpreter runs and "tool subcommand" (process_names:
    `python3 /usr/bin/supervisord`, `ray start`); otherwise executable, argv[0] and comm only.
    `cut`: a name longer than comm matches its 15-character cut too (not for names that share
    it: both MPS programs read `nvidia-cuda-mps`)."""

    def __init__(self, *names: str, scripts: bool = False, cut: bool = True) -> None:
        self._names = tuple(names)
        self._scripts = scripts
        self._cut = cut

    def __repr__(self) -> str:
        return f"ProcessNames{self._names!r}"

    def __len__(self) -> int:
        return len(self._names)

    @property
    def names(self) -> tuple[str, ...]:
        """The names, to print or document (never to match a process by: use `of`)."""
        return self._names

    def candidates(self, record: t.Mapping[str, t.Any]) -> set[str]:
        return process_names(record) if self._scripts else own_names(record)

    def of(self, record: t.Mapping[str, t.Any] | None, main_pid_of: MainPidOf | None = None, globs: t.Iterable[str] = (),
           also: t.Collection[str] = ()) -> str | None:
        """The name (of this list, or a candidate matching one of `globs`) a process goes by, when
        the identity rule backs it; else None. `also`: names systemd gives the process's unit
        (ExecStart=), added to the process's own once its identity holds."""
        if not record or not identified(record, main_pid_of):
            return None
        return _first_match(self._names, self.candidates(record) | set(also), globs, self._cut)

    def among(self, names: t.Collection[str], globs: t.Iterable[str] = ()) -> str | None:
        """The name of this list among `names` that the caller already holds for vouched: a unit's
        ExecStart= (systemd's, from a unit file only root writes) and its main process's names once
        `identified` (_units.main_names). Never a process's own names: ask `of`."""
        return _first_match(self._names, names, globs, self._cut)

    def posed_by(self, record: t.Mapping[str, t.Any], main_pid_of: MainPidOf | None = None) -> str | None:
        """The name a process takes from this list without the identity to back it (an impostor):
        only to tell so in a warning, never to decide anything."""
        if identified(record, main_pid_of):
            return None
        return _first_match(self._names, self.candidates(record), cut=self._cut)


# Daemons a GPU node needs and a desktop lives on (docs/docsite/rst/guide_design.rst, "Never signalled"). Names are matched against the
# executable's basename, argv[0]'s basename and the kernel's 15-character comm, and protect only
# a process whose identity backs them (`vouched`): any user can name a process so.
BUILTIN_PROTECTED_NAMES = ProcessNames(
    "nvidia-persistenced",
    "nv-hostengine",
    "nvidia-fabricmanager",
    "nv-fabricmanager",
    "dcgm-exporter",
    "Xorg",
    "Xwayland",
    "gnome-shell",
    "kwin_wayland",
    "sshd",
    "systemd",
)


def impostor_note(record: t.Mapping[str, t.Any], name: str) -> str:
    """What to tell about a process named like a protected daemon that is not one."""
    uid = record.get("uid") if record.get("uid") is not None else "?"
    exe = record.get("exe_path") or "an executable the kernel does not show"
    return (f"pid {record['pid']:d} is named like {name} but is run by uid {uid} from {exe}: not protected, an ordinary holder "
            "(the collection's security guide)")


def protection_reason(record: dict[str, t.Any], names: t.Iterable[str], pids: t.Container[int], own_lineage: t.Container[int],
                      main_pid_of: MainPidOf | None = None) -> str | None:
    """Why a process must never be signalled, or None. Built-in rules first. A name (built-in or
    from `protect`) protects only a process the identity rule backs (`identified`)."""
    pid = record["pid"]
    if pid == 1:
        return "PID 1"
    if pid in own_lineage:
        return "this Ansible session"
    if record.get("kernel_thread"):
        return "kernel thread"
    if pid in pids:
        return "protect"
    for names_, reason in ((BUILTIN_PROTECTED_NAMES, "protected daemon"), (ProcessNames(*names), "protect")):
        if names_.of(record, main_pid_of):
            return reason
        posed = names_.posed_by(record, main_pid_of)
        if posed:
            record["protection_note"] = impostor_note(record, posed)
            return None
    return None


def _unit_main(record: t.Mapping[str, t.Any], main_pid_of: MainPidOf | None) -> bool:
    if main_pid_of is None or not record.get("system_service") or not record.get("unit"):
        return False
    try:
        return main_pid_of(record["unit"]) == record["pid"]
    except (OSError, ValueError):
        return False


def protect(holders: t.Iterable[Holder], protect_names: t.Iterable[str], protect_pids: t.Container[int], own_lineage: t.Container[int],
            main_pid_of: MainPidOf | None = None) -> list[Holder]:
    """Fill in protected, protected_reason and protection_note for each holder (returns new records)."""
    result: list[Holder] = []
    for holder in holders:
        record: dict[str, t.Any] = dict(holder)
        record["protection_note"] = None
        reason = protection_reason(record, protect_names, protect_pids, own_lineage, main_pid_of)
        record["protected"] = reason is not None
        record["protected_reason"] = reason
        result.append(t.cast("Holder", record))
    return result
