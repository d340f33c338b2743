# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""A holder's CUDA checkpoint state, as NVIDIA's cuda-checkpoint reads it from the driver (issue 70).

cuda-checkpoint (github.com/NVIDIA/cuda-checkpoint, driver 550+) moves a process's GPU memory into
host memory and back: `--get-state --pid PID` prints one of running, locked, checkpointed, failed;
`--action lock|checkpoint|restore|unlock --pid PID [--timeout MS]` moves it (lock, then checkpoint;
restore, then unlock). Two field reports make it matter here:
- killing a *restored* process can hard-hang the whole host (NVIDIA/cuda-checkpoint#53, 4 of 4,
  no Xid): a running holder is locked and checkpointed first, so the signal ends a process that
  no longer refers to the GPU (_act/_checkpoint);
- a *checkpointed* process holds about 0 MiB and takes its memory back when restored: a dormant
  holder that a 0 MiB reading misses; it is named and refused by default.

Who controls what: the tool is run only from a root-owned file in a system directory that no one
else may write (a tenant's `cuda-checkpoint` earlier on PATH is a tenant's program, never run);
its answer is the driver's, read bounded (each call under a deadline, the whole under the run's).
A hung, failing or garbled answer is "unknown": it never makes a GPU clean and never spares a
holder; the GPU's own reading decides. Nothing here runs on a clean host (only the freeing room
imports it).
"""

from __future__ import annotations

import os
import stat
import typing as t

# The states cuda-checkpoint --get-state prints (its README; the driver API's CUprocessState).
RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
STATES = (RUNNING, LOCKED, CHECKPOINTED, FAILED)
TOOL = "cuda-checkpoint"
# Root's own directories only: PATH is the caller's and may name a tenant's directory.
TOOL_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# One call's bound, and what a state's answer may be long (one word and a newline).
CALL_S = 5.0
ANSWER_BYTES = 4096


def _owned_by_root_and_closed(info: os.stat_result) -> bool:
    return info.st_uid == 0 and not info.st_mode & 0o022


def trusted(path: str) -> bool:
    """Whether `path` is a root-owned regular executable that no one else may write, in directories
    (up to /) that are root's and no one else may write: what root may run."""
    try:
        real = os.path.realpath(path)
        info = os.stat(real)
    except OSError:
        return False
    if not stat.S_ISREG(info.st_mode) or not info.st_mode & 0o111 or not _owned_by_root_and_closed(info):
        return False
    directory = os.path.dirname(real)
    while True:
        try:
            info = os.lstat(directory)
        except OSError:
            return False
        if not stat.S_ISDIR(info.st_mode) or not _owned_by_root_and_closed(info):
            return False
        parent = os.path.dirname(directory)
        if parent == directory:
            return True
        directory = parent


def find_tool(dirs: t.Sequence[str] = TOOL_DIRS) -> str | None:
    """The first cuda-checkpoint in root's directories that root may run (trusted), or None."""
    for directory in dirs:
        candidate = os.path.join(directory, TOOL)
        if os.path.lexists(candidate) and trusted(candidate):
            return candidate
    return None


def parse_state(rc: int, out: str) -> str | None:
    """The state in a `--get-state` answer, or None (a failed call, no CUDA in the process, or
    anything but one known word); pure."""
    word = out.strip().lower()
    return word if rc == 0 and word in STATES else None


class Answer(t.NamedTuple):
    """One call's outcome: rc (124 past its bound), what it printed, and why it failed (or '')."""

    rc: int
    out: str
    why: str


def describe(answer: Answer) -> str:
    """Why a call did not do what was asked, in a few words; pure."""
    if answer.rc == 124:
        return "cuda-checkpoint did not answer in time"
    text = " ".join((answer.why or answer.out).split())[:200]
    return f"cuda-checkpoint failed (rc {answer.rc:d}{': ' + text if text else ''})"
