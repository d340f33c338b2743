# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""gpu_release's clean_shm: remove what killed jobs left in /dev/shm, and nothing else.

A file goes only when all of these hold:
- it is a regular file directly in /dev/shm (lstat: a link is never followed, a directory never
  entered), named like a job framework's segment that may go (_shm.PATTERNS, `clean`);
- it was there when this run first looked (its very inode): a file made since belongs to a job
  that started meanwhile, whose processes may not have opened or mapped it yet;
- it ties to a process this run ended (signalled, or stopped with its unit; `ended`): its name
  names that process's PID and it is that process's uid's (torch_<pid>_*, pym-<pid>-*,
  cuda.shm.*.<pid in hex>.*), or its owner's uid had processes ended by this run and no live
  process left that could open it (one running as that uid, or, where the file's mode lets them,
  of its group or any uid). A file is no job's leftover just because no process holds it now: a
  live service that made a block others attach to by name has it neither open nor mapped
  (Python's multiprocessing.shared_memory: created, its handle closed, never unlinked), and the
  next reader of a removed one gets FileNotFoundError. So the file of a uid whose processes this
  run did not end stays, unless its name names a PID this run ended; root's too (root always
  runs processes this run did not end). What stays, and why, is said (Done.kept);
- the last scan found no live process with it open or mapped, and that scan read every process
  (root): a process this module cannot read may hold it;
- every process that may hold a file of /dev/shm is one this run can see: in a container, a
  /dev/shm shared with the host or another container (_shm.not_private: the node's IPC
  namespace, a bind from outside, or the tmpfs a container runtime makes for an IPC namespace
  that other containers may join, as a Kubernetes pod's containers do) is never cleaned, in
  check mode too, as a process there holds files that look unheld from here;
- /dev/shm is a root-owned directory with the sticky bit (tmpfs' 1777), opened without following a
  link: there only a file's owner (or root) can remove or rename it, so a user who swaps a name
  between the check and the unlink swaps only their own file. The name is unlinked through the
  directory's descriptor after a last lstat that must show the same inode; unlink never follows a
  link, so a link raced in is what goes, never its target.
"""

from __future__ import annotations

import os
import re
import stat as stat_mod
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _shm

if t.TYPE_CHECKING:
    Identity = t.Tuple[int, int]


def removable(files: t.Iterable[_shm.Entry], present_at_look: t.Container[Identity]) -> list[_shm.Entry]:
    """Of the unheld `files`, those clean_shm may remove: a job pattern that may go, and there at
    the run's first look."""
    chosen = []
    for entry in files:
        pattern = _shm.pattern_of(entry.name)
        if pattern is not None and pattern.clean and (entry.dev, entry.ino) in present_at_look:
            chosen.append(entry)
    return chosen


# The patterns whose names carry their maker's PID (_shm.PATTERNS' sources): PyTorch's
# "torch_<pid>_<random>", multiprocessing's heap arenas "pym-<pid>-", CUDA IPC's
# "cuda.shm.<id>.<pid in hex>.<n>". The PID is the one the maker saw (its own PID namespace's).
PID_IN_NAME = (
    (re.compile(r"^torch_(\d+)_"), 10),
    (re.compile(r"^pym-(\d+)-"), 10),
    (re.compile(r"^cuda\.shm\.[^.]+\.([0-9a-f]+)\."), 16),
)


def named_pid(name: str) -> int | None:
    """The PID a job framework put in a file's name, or None."""
    for regex, base in PID_IN_NAME:
        found = regex.match(name)
        if found:
            return int(found.group(1), base)
    return None


class Live(t.NamedTuple):
    """A live process, as far as opening a file of /dev/shm goes: its uids (real, effective,
    saved, file system) and groups, from /proc/PID/status."""

    pid: int
    name: str
    uids: frozenset[int]
    gids: frozenset[int]


def live_processes(proc: str = "/proc", ended: t.Container[int] = ()) -> list[Live]:
    """Every live process but those this run ended (in check mode, those it would end). A zombie
    whose threads are all gone opens nothing; a process gone meanwhile is skipped."""
    found = []
    for pid in _shm._pids(proc):
        if pid in ended:
            continue
        try:
            status = _holders.read_status(pid, proc)
        except OSError:
            continue
        if not _holders.holds_threads({"state": _holders.status_state(status), "threads": _holders.status_field(status, "Threads")}):
            continue
        groups = (_holders.status_ints(status, "Gid") or []) + (_holders.status_ints(status, "Groups") or [])
        found.append(Live(pid, status.get("Name", "?"), frozenset(_holders.status_ints(status, "Uid") or ()), frozenset(groups)))
    return found


def may_open(process: Live, uid: int, gid: int, mode: int) -> bool:
    """Whether `process` may open a file of `uid`:`gid` with `mode` without root's override: it
    runs as the owner, or the mode lets its group or everyone in."""
    if uid in process.uids:
        return True
    if mode & 0o060 and gid in process.gids:
        return True
    return bool(mode & 0o006) and any(u != 0 for u in process.uids)


def _printable(name: str) -> str:
    """A process's name as its user wrote it, control characters escaped (it goes into one line)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


def _named(processes: t.Sequence[Live]) -> str:
    shown = ", ".join(f"pid {p.pid:d} {_printable(p.name)}" for p in processes[:3])
    return shown + (f", and {len(processes) - 3:d} more" if len(processes) > 3 else "")


def attribute(files: t.Iterable[_shm.Entry], ended: t.Mapping[int, int | None], live: t.Sequence[Live],
              modes: t.Mapping[str, tuple[int, int]]) -> tuple[list[_shm.Entry], list[tuple[_shm.Entry, str]]]:
    """(the files that tie to a process this run ended, [(file, why it stays)]): the rule of this
    module's doc. `ended`: {pid: uid} of the processes this run ended; `live`: every other live
    process; `modes`: {name: (mode, gid)} of the files. Pure."""
    ended_uids = {uid for uid in ended.values() if uid is not None}
    chosen, kept = [], []
    for entry in files:
        pid = named_pid(entry.name)
        if pid is not None and pid in ended and ended[pid] == entry.uid:
            chosen.append(entry)
            continue
        who = f"uid {entry.uid:d}"
        if entry.uid not in ended_uids:
            kept.append((entry, f"this run ended no process of its owner ({who})"))
            continue
        mode, gid = modes.get(entry.name, (0o600, -1))
        owners = [p for p in live if entry.uid in p.uids]
        if owners:
            kept.append((entry, f"its owner ({who}) runs processes this run did not end, which may use it ({_named(owners)})"))
            continue
        others = [p for p in live if may_open(p, entry.uid, gid, mode)]
        if others:
            kept.append((entry, f"its mode ({stat_mod.filemode(stat_mod.S_IFREG | mode)}) lets processes this run did not end open it ({_named(others)})"))
            continue
        chosen.append(entry)
    return chosen, kept


def file_modes(entries: t.Iterable[_shm.Entry], shm: str) -> dict[str, tuple[int, int]]:
    """{name: (mode, gid)} of the files, read without following a link; a file gone is left out."""
    modes = {}
    for entry in entries:
        try:
            st = os.lstat(os.path.join(shm, entry.name))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (entry.dev, entry.ino):
            modes[entry.name] = (stat_mod.S_IMODE(st.st_mode), st.st_gid)
    return modes


def why_not(holding: _shm.Holding, euid: int) -> str | None:
    """Why nothing may be removed at all, or None."""
    if euid != 0:
        return "clean_shm needs root (become: true): /dev/shm was not cleaned"
    if holding.unreadable:
        return (f"clean_shm: {holding.unreadable:d} process(es) could not be read, and one of them may hold a file of /dev/shm: "
                "nothing was removed")
    if holding.blocked:
        return (f"clean_shm: {holding.blocked:d} process(es) did not answer (a file system that stopped answering?), and one of them may "
                "hold a file of /dev/shm: nothing was removed")
    return None


def open_dir(shm: str) -> int:
    """A descriptor of `shm`, a root-owned sticky directory reached without following a link.
    Raises OSError (with the reason) otherwise."""
    fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)
    if st.st_uid != 0 or not st.st_mode & stat_mod.S_ISVTX:
        os.close(fd)
        raise OSError(f"{shm} is not a root-owned directory with the sticky bit (mode {stat_mod.filemode(st.st_mode)}, uid {st.st_uid:d})")
    return fd


def remove(entries: t.Sequence[_shm.Entry], shm: str = _shm.SHM_DIR) -> tuple[list[_shm.Entry], list[str]]:
    """Unlink each entry that is still the same regular file -> (removed, warnings)."""
    if not entries:
        return [], []
    try:
        dfd = open_dir(shm)
    except OSError as exc:
        return [], [f"clean_shm: nothing was removed: {exc.strerror or exc}"]
    removed, warnings = [], []
    try:
        for entry in entries:
            try:
                st = os.stat(entry.name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError as exc:
                warnings.append(f"clean_shm: {shm}/{entry.name} not removed: {exc.strerror}")
                continue
            if not stat_mod.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (entry.dev, entry.ino):
                continue  # another file under that name now: not the one found unheld
            try:
                os.unlink(entry.name, dir_fd=dfd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                warnings.append(f"clean_shm: {shm}/{entry.name} not removed: {exc.strerror}")
                continue
            removed.append(entry)
    finally:
        os.close(dfd)
    return removed, warnings


class Done(t.NamedTuple):
    """What one clean_shm step did: the files it removed (in check mode, would remove) and those no
    live process holds that stay, as _shm.unheld_record lists them; whether every process was read;
    the files of killed jobs' patterns it kept because nothing ties them to this run, each with
    its `why`."""

    removed: list[dict[str, t.Any]]
    unheld: list[dict[str, t.Any]]
    complete: bool
    warnings: list[str]
    kept: list[dict[str, t.Any]] = []


def clean(present_at_look: t.Container[Identity], act: bool, check_mode: bool, proc: str = "/proc", shm: str = _shm.SHM_DIR,
          euid: int | None = None, deadline_s: float | None = None, ended: t.Mapping[int, int | None] | None = None) -> Done:
    """Find what no live process holds in `shm` now and remove what may go (`act`: the GPUs are
    proven free; in check mode nothing is removed and the plan is returned as removed).
    `ended`: {pid: uid} of the processes this run ended (in check mode, would end); only their
    files may go (attribute). `deadline_s` bounds the /proc pass (_shm.Holding.scan)."""
    try:
        files = _shm.list_files(shm)
    except OSError as exc:
        return Done([], [], False, [f"clean_shm: {shm} cannot be read: {exc.strerror or exc}"])
    holding = _shm.scan_holding(files, shm, proc, deadline_s)
    unheld = holding.unheld()
    chosen = removable(unheld, present_at_look) if act else []
    kept_why: list[tuple[_shm.Entry, str]] = []
    if chosen:
        ended = ended or {}
        chosen, kept_why = attribute(chosen, ended, live_processes(proc, ended), file_modes(chosen, shm))
    warnings: list[str] = []
    outside = _shm.shared_with_outside(shm, proc) if chosen else None
    if outside:
        # Listed, never removed: a process this run cannot see may hold any of them.
        chosen, warnings = [], [f"clean_shm: nothing was removed: {outside}, so a process there may hold a file that no process here holds "
                                "(clean it on the host)"]
    if check_mode or not chosen:
        removed = chosen
    else:
        why = why_not(holding, os.geteuid() if euid is None else euid)
        removed, warnings = ([], [why]) if why else remove(chosen, shm)
    now = time.time()
    gone = set() if check_mode else {(e.dev, e.ino) for e in removed}
    stay = [e for e in unheld if (e.dev, e.ino) not in gone]
    reasons = {entry.name: reason for entry, reason in kept_why}
    kept = [dict(record, why=reasons[os.path.basename(record["path"])]) for record in _shm.unheld_record([e for e, _w in kept_why], now, shm)]
    return Done(_shm.unheld_record(removed, now, shm), _shm.unheld_record(stay, now, shm), holding.complete, warnings, kept)
