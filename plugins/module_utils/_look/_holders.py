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
kernel says it is (_devices.DeviceTable: its device number, or the very inode of this node's own
/dev/nvidia* node), never by the path a process opened it through; a protected daemon is known by
its real uid and its executable as the kernel resolves it, never by its name alone (the protection
rules: _protect). Which file systems a stat may wait on: _mounts.

No read here can hang root (_bounded_reads): files a process holds are stat'ed from what the kernel has
cached (`_bounded_reads.stat_nosync`: a stalled FUSE or NFS server is never asked), the pass over /proc
runs in a bounded child, and a process whose /proc entries do not answer is reported `blocked`,
never passed over. A thread-group leader that exited while its other threads run on (state Z,
`Threads:` > 1: `ps` shows `Zl <defunct>`) is a live process: its files, maps and command line are
read through a live thread (/proc/PID/task/TID/...), whose are the group's.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mounts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect
# Still read as holders_mod.X by _act/_release.py, whose split (issue 68, its first part) lands
# beside this one: its two call sites then name _protect, and these two lines go.

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    # {device name: [mappings, KiB]}
    Mapped = t.Dict[str, t.List[int]]
    MainPidOf = t.Callable[[str], t.Optional[int]]
_UNIT = re.compile(r"^[^/]+\.(?:service|scope)$")


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


def cgroup_text(pid: int, proc: str = "/proc") -> str | None:
    """/proc/PID/cgroup as text (split it at "\n" only: a delegated subtree's names are its user's), None when it cannot be read."""
    try:
        return _read(f"{proc}/{pid:d}/cgroup").decode("utf-8", "replace")
    except OSError:
        return None


def cgroup_paths(pid: int, proc: str = "/proc") -> list[str] | None:
    """Every cgroup path of a process, one per hierarchy line of /proc/PID/cgroup (a cgroup v1
    node lists one per controller), None when it cannot be read."""
    text = cgroup_text(pid, proc)
    return None if text is None else [line.split(":", 2)[-1] for line in text.split("\n") if line]


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


def open_devices(pid: int, proc: str = "/proc", table: _devices.DeviceTable | None = None) -> set[str]:
    """The /dev/nvidia* names of the device files a process has open, known by identity (see
    DeviceTable): a stat of /proc/PID/fd/N follows the kernel's link to the opened inode,
    whatever path or namespace it was opened through. Only where the kernel cannot be asked
    (the fd closed meanwhile, a test's fake /proc) does the path's spelling count. Raises
    OSError when the process is gone or not ours to read."""
    return _open_devices(pid, proc, table if table is not None else _devices.DeviceTable())[0]


def _open_devices(pid: int, proc: str, table: _devices.DeviceTable) -> tuple[set[str], str]:
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
            device = _devices.device_path(target)
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


def read_maps(pid: int, proc: str = "/proc", table: _devices.DeviceTable | None = None) -> Mapped | None:
    """{device: [mappings, KiB]} of a process, or None when its maps cannot be read (gone, not
    ours, or not answering: _bounded_reads)."""
    try:
        return _bounded_reads.call(_read_maps, pid, proc, table if table is not None else _devices.DeviceTable(), None, process=f"{proc}/{pid:d}")
    except _bounded_reads.ReadBlocked:
        return None


def _read_maps(pid: int, proc: str, table: _devices.DeviceTable, base: str | None) -> Mapped | None:
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
    return _devices.mapped_by_identity(maps, table, (base + "/map_files").encode(), table.view(base).mounts)


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
    deleted = path.endswith(_mounts.DELETED_SUFFIX)
    if deleted:
        path = path[: -len(_mounts.DELETED_SUFFIX)]
    if not path.startswith(_protect.SYSTEM_DIRS):
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


_TREES: list[_devices.DeviceTable] = []


def _trees() -> _devices.DeviceTable:
    """The trees processes see (DeviceTable.view), read once a run."""
    if not _TREES:
        _TREES.append(_devices.DeviceTable())
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
    """blocked_record of each {pid: where root's read waited}, their wchans read all at once, once
    per run (a wchan waits as the process's other entries do: one after the other, thirty blocked
    processes cost thirty budgets; two readers at a time, they filled the pass's deadline)."""
    todo = [pid for pid in waits if f"{proc}/{pid:d}" not in _WCHANS]
    outcome = _bounded_reads.scan(_bounded_reads.wchan_of, [f"{proc}/{pid:d}/wchan" for pid in todo], budget=WCHAN_BUDGET_S,
                                  deadline_s=WCHAN_BUDGET_S * 4, together=True)
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
                 table: _devices.DeviceTable | None = None, limits: ScanLimits = DEFAULT_LIMITS, unscanned: list[int] | None = None,
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
    table = table if table is not None else _devices.DeviceTable.read()
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


def scan_mapped(pids: t.Iterable[int], proc: str = "/proc", table: _devices.DeviceTable | None = None, limits: ScanLimits = DEFAULT_LIMITS,
                unscanned: list[int] | None = None) -> list[Holder]:
    """The processes among `pids` (which had no device file open) that map a /dev/nvidia* node:
    the second half of a full scan, done only when a GPU's memory is not explained without it.
    Speed: it saves re-listing every process's fds (measured, benchmarks/changes.md)."""
    table = table if table is not None else _devices.DeviceTable.read()
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


def _holder(pid: int, devices: set[str], base: str | None, proc: str, users: dict[int, str], table: _devices.DeviceTable) -> Holder | None:
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


def own_pid(proc: str = "/proc") -> int:
    """This process's PID as `proc` numbers it: the kernel's `self` link there (the same number as
    os.getpid() on the host's own /proc; a test's /proc gives its own), else os.getpid()."""
    try:
        return int(os.readlink(f"{proc}/self"))
    except (OSError, ValueError):
        return os.getpid()


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
