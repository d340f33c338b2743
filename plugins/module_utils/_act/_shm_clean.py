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
- the last scan found no live process with it open or mapped, and that scan read every process
  (root): a process this module cannot read may hold it;
- every process that may hold a file of /dev/shm is one this run can see: in a container, a
  /dev/shm shared with the host or another container (_shm.not_private) is never cleaned, in
  check mode too, as a process there holds files that look unheld from here;
- /dev/shm is a root-owned directory with the sticky bit (tmpfs' 1777), opened without following a
  link: there only a file's owner (or root) can remove or rename it, so a user who swaps a name
  between the check and the unlink swaps only their own file. The name is unlinked through the
  directory's descriptor after a last lstat that must show the same inode; unlink never follows a
  link, so a link raced in is what goes, never its target.
"""

from __future__ import annotations

import os
import stat as stat_mod
import time
import typing as t

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
    live process holds that stay, as _shm.unheld_record lists them; whether every process was read."""

    removed: list[dict[str, t.Any]]
    unheld: list[dict[str, t.Any]]
    complete: bool
    warnings: list[str]


def clean(present_at_look: t.Container[Identity], act: bool, check_mode: bool, proc: str = "/proc", shm: str = _shm.SHM_DIR,
          euid: int | None = None, deadline_s: float | None = None) -> Done:
    """Find what no live process holds in `shm` now and remove what may go (`act`: the GPUs are
    proven free; in check mode nothing is removed and the plan is returned as removed).
    `deadline_s` bounds the /proc pass (_shm.Holding.scan)."""
    try:
        files = _shm.list_files(shm)
    except OSError as exc:
        return Done([], [], False, [f"clean_shm: {shm} cannot be read: {exc.strerror or exc}"])
    holding = _shm.scan_holding(files, shm, proc, deadline_s)
    unheld = holding.unheld()
    chosen = removable(unheld, present_at_look) if act else []
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
    return Done(_shm.unheld_record(removed, now, shm), _shm.unheld_record(stay, now, shm), holding.complete, warnings)
