# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Who holds /dev/nvidia*: a scan of /proc/*/fd and /proc/*/maps, as `fuser -v` does.

nvidia-smi cannot see a child forked after CUDA init once its parent is gone (DESIGN.md,
measured on an H200): only the device files tell the truth about who keeps GPU memory. Which
GPU a holder uses is NOT which device files it has open (every CUDA process and every NVML
client opens every /dev/nvidiaN of the node): that is decided in _attribution.py, from
nvidia-smi's compute apps and the mapping sizes this scan records.

/proc is read as bytes and decoded once, with replacement: a 15-byte comm can end inside a
multi-byte character (CJK names, setproctitle).
"""

from __future__ import annotations

import os
import re

from ansible_collections.zeromib.gpu.plugins.module_utils import _containers

try:
    import pwd
except ImportError:  # pragma: no cover - Linux always has it
    pwd = None

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

# Daemons a GPU node needs and a desktop lives on (DESIGN.md). Names are matched against the
# executable's basename, argv[0]'s basename and the kernel's 15-character comm.
BUILTIN_PROTECTED_NAMES = (
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

COMM_LENGTH = 15


def device_path(target):
    """A /proc fd or maps target -> its /dev/nvidia* path, whatever the spelling, or None when
    it is no NVIDIA device file. The one place that knows how device paths are spelled."""
    if target.endswith(DELETED_SUFFIX):
        target = target[: -len(DELETED_SUFFIX)]
    for prefix in DRIVER_ROOT_PREFIXES:
        if target.startswith(prefix + "/dev/"):
            target = target[len(prefix):]
    return target if _DEVICE_NODE.match(target) else None


def gpu_minor(device):
    """'/dev/nvidia3' -> 3; control nodes (/dev/nvidiactl, /dev/nvidia-uvm, caps) -> None."""
    match = _GPU_NODE.match(device)
    return int(match.group(1)) if match else None


def _text(data):
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def parse_stat(data):
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


def is_kernel_thread(stat):
    """Kernel threads carry PF_KTHREAD in /proc/PID/stat field 9. (Their PIDs say nothing:
    inside a PID namespace PID 2 is an ordinary process.)"""
    stat = _text(stat)
    rest = stat[stat.rindex(")") + 2:].split()
    return bool(int(rest[6]) & PF_KTHREAD)


def parse_cgroup(text):
    """/proc/PID/cgroup -> the cgroup path that systemd manages (the v2 `0::` line, else the
    v1 `name=systemd` line), or None."""
    unified = named = None
    for line in _text(text).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2]
        elif parts[1] == "name=systemd":
            named = parts[2]
    path = unified if unified not in (None, "/") else named
    return path or unified


def unit_of(cgroup_path):
    """The systemd unit a cgroup path belongs to: its deepest `*.service` or `*.scope`."""
    if not cgroup_path:
        return None
    unit = None
    for part in cgroup_path.split("/"):
        if _UNIT.match(part):
            unit = part
    return unit


def is_system_service(cgroup_path):
    """True when the unit is a .service of the system manager (not of a user@ manager), i.e.
    one that `systemctl stop` can stop."""
    unit = unit_of(cgroup_path)
    # A container's processes can sit below its runtime's unit (containerd.service): stopping
    # that unit would take down every container of the node.
    return bool(unit and unit.endswith(".service") and "/user@" not in cgroup_path and container_of(cgroup_path) is None)


def container_of(cgroup_path):
    return _containers.container_of(cgroup_path)


def parse_cmdline(raw):
    """NUL-separated argv -> (argv list, display string)."""
    argv = raw.decode("utf-8", "replace").split("\0")
    while argv and argv[-1] == "":
        argv.pop()
    return argv, " ".join(argv)


def mapped_devices(maps):
    """/proc/PID/maps (bytes) -> {device path: [mappings, KiB]} for NVIDIA device files.
    The sizes tell a GPU's context from the small mappings every CUDA process makes of the
    other GPUs' nodes (see _attribution)."""
    found = {}
    for match in _MAPS_LINE.finditer(maps):
        device = device_path(match.group(3).decode("utf-8", "replace"))
        if device is None:
            continue
        entry = found.setdefault(device, [0, 0])
        entry[0] += 1
        entry[1] += (int(match.group(2), 16) - int(match.group(1), 16)) // 1024
    return found


def _read(path):
    with open(path, "rb") as handle:
        return handle.read()


def _user_name(uid, cache):
    if uid not in cache:
        name = str(uid)
        if pwd is not None:
            try:
                name = pwd.getpwuid(uid).pw_name
            except KeyError:
                pass
        cache[uid] = name
    return cache[uid]


def _uid_from_status(text):
    for line in _text(text).splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def open_devices(pid, proc="/proc"):
    """The /dev/nvidia* paths a process has open. Raises OSError when the process is gone or
    not ours to read."""
    devices = set()
    fd_dir = "%s/%d/fd" % (proc, pid)
    for entry in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir + "/" + entry)
        except OSError:
            continue
        if "nvidia" in target:
            device = device_path(target)
            if device is not None:
                devices.add(device)
    return devices


def read_maps(pid, proc="/proc"):
    """{device: [mappings, KiB]} of a process, or None when its maps cannot be read."""
    try:
        maps = _read("%s/%d/maps" % (proc, pid))
    except OSError:
        return None
    # Most processes map no device file: a byte search skips the regex for them.
    return mapped_devices(maps) if b"nvidia" in maps else {}


def read_process(pid, proc="/proc", users=None):
    """Identity and placement of one process (the DESIGN.md holder shape, without the GPU
    attribution), or None if it vanished."""
    users = {} if users is None else users
    base = "%s/%d" % (proc, pid)
    try:
        stat = _read(base + "/stat")
        comm, state, ppid, start_time = parse_stat(stat)
        kernel_thread = is_kernel_thread(stat)
        argv, cmdline = parse_cmdline(_read(base + "/cmdline"))
        status = _read(base + "/status")
        cgroup = _read(base + "/cgroup")
    except (OSError, ValueError, IndexError):
        return None
    try:
        exe = os.readlink(base + "/exe")
    except OSError:
        exe = None
    uid = _uid_from_status(status)
    cgroup_path = parse_cgroup(cgroup)
    return {
        "pid": pid,
        "ppid": ppid,
        "name": comm,
        "cmdline": cmdline,
        "argv0": os.path.basename(argv[0]) if argv else None,
        "exe": os.path.basename(exe.replace(" (deleted)", "")) if exe else None,
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
    }


def list_pids(proc="/proc"):
    return sorted(int(entry) for entry in os.listdir(proc) if entry.isdigit())


def scan_holders(proc="/proc", unreadable=None, with_maps=True, without_devices=None):
    """Every live process with a /dev/nvidia* node open or (with `with_maps`) mapped, with its
    mappings of those nodes (`mapped`). Processes that vanish mid-scan or that we may not read
    are skipped (the PIDs we may not read are appended to `unreadable`, if given); a zombie
    holds nothing and is no holder.

    The maps of every process that has a device file open are read: attribution needs their
    sizes. Reading the maps of all the others is two thirds of a full scan's cost (~70 of ~100 us
    a process, docs/benchmarks.md) and finds only processes that mapped a device file and then
    closed it, which CUDA never does; callers ask for that (`with_maps`) only where such a
    process could be what holds a GPU. Without `with_maps`, the PIDs skipped for having no
    device file open are appended to `without_devices`, if given, for `scan_mapped` later."""
    holders = []
    users = {}
    for pid in list_pids(proc):
        try:
            devices = open_devices(pid, proc)
        except PermissionError:
            if unreadable is not None:
                unreadable.append(pid)
            continue
        except OSError:
            continue
        if not devices and not with_maps:
            if without_devices is not None:
                without_devices.append(pid)
            continue
        record = _holder(pid, devices, proc, users)
        if record is not None:
            holders.append(record)
    return holders


def scan_mapped(pids, proc="/proc"):
    """The processes among `pids` (which had no device file open) that map a /dev/nvidia* node:
    the second half of a full scan, done only when a GPU's memory is not explained without it.
    Speed: it saves re-listing every process's fds (measured, benchmarks/changes.md)."""
    holders = []
    users = {}
    for pid in pids:
        record = _holder(pid, set(), proc, users)
        if record is not None:
            holders.append(record)
    return holders


def _holder(pid, devices, proc, users):
    """A holder record for a process with `devices` open, its maps read; None when it holds
    nothing or is gone (or a zombie)."""
    mapped = read_maps(pid, proc)
    if not devices and not mapped:
        return None
    record = read_process(pid, proc, users)
    if record is None or record["state"] in ("Z", "X"):
        return None
    record["devices"] = sorted(devices | set(mapped or ()))
    # None: the maps could not be read, so the mapping sizes are unknown.
    record["mapped"] = None if mapped is None else {device: {"count": n, "kib": kib} for device, (n, kib) in mapped.items()}
    return record


def start_time_of(pid, proc="/proc"):
    """Start time of a live, non-zombie PID, or None: the identity check before a signal."""
    try:
        _comm, state, _ppid, start_time = parse_stat(_read("%s/%d/stat" % (proc, pid)))
    except (OSError, ValueError, IndexError):
        return None
    if state in ("Z", "X"):
        return None
    return start_time


def lineage(pid, proc="/proc"):
    """PIDs of a process and all its ancestors (the module and its Ansible/SSH session)."""
    seen = []
    while pid and pid not in seen:
        seen.append(pid)
        try:
            _comm, _state, pid, _start = parse_stat(_read("%s/%d/stat" % (proc, pid)))
        except (OSError, ValueError, IndexError):
            break
    return seen


def split_protect(items):
    """User `protect` entries -> (names, pids): entries of ASCII digits are PIDs ('³'.isdigit()
    is true, but int('³') fails: such an entry is a name)."""
    names, pids = [], set()
    for item in items or []:
        text = str(item).strip()
        if text.isdigit() and text.isascii():
            pids.add(int(text))
        elif text:
            names.append(text)
    return names, pids


def name_matches(record, names):
    """A protected name matches the executable's basename, argv[0]'s basename, or the comm
    (which the kernel truncates to 15 characters: nvidia-persistenced shows as nvidia-persiste)."""
    candidates = {record.get("exe"), record.get("argv0")}
    comm = record.get("name")
    for name in names:
        if name in candidates:
            return True
        if comm is not None and (comm == name or (len(name) > COMM_LENGTH and comm == name[:COMM_LENGTH])):
            return True
    return False


def protection_reason(record, names, pids, own_lineage):
    """Why a process must never be signalled, or None. Built-in rules first."""
    pid = record["pid"]
    if pid == 1:
        return "PID 1"
    if pid in own_lineage:
        return "this Ansible session"
    if record.get("kernel_thread"):
        return "kernel thread"
    if pid in pids:
        return "protect"
    if name_matches(record, BUILTIN_PROTECTED_NAMES):
        return "protected daemon"
    if name_matches(record, names):
        return "protect"
    return None


def protect(holders, protect_names, protect_pids, own_lineage):
    """Fill in protected and protected_reason for each holder (returns new records)."""
    result = []
    for holder in holders:
        record = dict(holder)
        reason = protection_reason(record, protect_names, protect_pids, own_lineage)
        record["protected"] = reason is not None
        record["protected_reason"] = reason
        result.append(record)
    return result
