# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Which Apptainer (or Singularity) instance a holder outside every job runs in (issue 70, work
that escaped its job).

`apptainer instance start IMAGE NAME` execs the starter, root's binary (`starter`, or
`starter-suid` in setuid mode, in `<libexecdir>/apptainer/bin/`), with argv[0] set to
`Apptainer instance: USER [NAME]` (apptainer's internal/pkg/instance: `ProgPrefix`,
`prognameFormat`); that starter stays as the instance's master, detached from the shell that
started it, and the container's processes run below it. Its `instance stop` and `instance list`
find it by the same argv[0].

An instance is told only by the kernel's identity of an ancestor (the identity rule of
_look/_protect): /proc/PID/exe resolving to a root-owned `starter` or `starter-suid` in an
`apptainer/bin` or `singularity/bin` directory of a system directory, the same inode in this
module's own mount namespace. A user's own binary named `starter-suid` (in her home, or
bind-mounted in a namespace of hers) is her program, and names no instance. The instance's name
and user in argv[0] are what its user gave the starter: quoted as its user's word in the message
and the advice, deciding nothing (the holder is signalled, or not, as any process of that user).
The user the advice names is the starter's real uid, the kernel's.

Loaded by _origin only, for a holder that a look found outside every job, unit and container.
"""

from __future__ import annotations

import os
import re
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect

STARTERS = frozenset(("starter", "starter-suid"))
# Where the distributions install them: /usr/libexec/apptainer/bin (Debian, Ubuntu, EPEL),
# /usr/lib/<triplet>/singularity/bin (Debian's singularity-container).
STARTER_DIRS = ("/apptainer/bin", "/singularity/bin")
# apptainer's prognameFormat "%s: %s [%s]" with ProgPrefix, and the instance names its CheckName
# accepts (`^[a-zA-Z0-9._-]+$`); a name longer than this is not quoted.
_PROGNAME = re.compile(r"^(Apptainer|Singularity) instance: ([A-Za-z0-9._-]{1,64}) \[([A-Za-z0-9._-]{1,64})\]$")
# The starter is the holder's parent or a few generations up (the container's init, a shell of
# its start script); PID 1 ends the walk.
MAX_GENERATIONS = 8
# Every walk of a run together (an ancestor in execve on a stalled file system costs one read's
# budget, _bounded_reads): past it, a holder is not looked up, and reads as it would without Apptainer.
WALKS_S = 2.0


class Instance(t.NamedTuple):
    """An instance as its starter shows it: `name` and `product` from argv[0] (its user's word),
    `uid`/`user` the starter's real uid (the kernel's), `pid` the starter's."""

    name: str
    product: str
    pid: int
    uid: int | None
    user: str | None


def is_starter(record: t.Mapping[str, t.Any]) -> bool:
    """Whether the kernel shows the process running root's Apptainer starter (see the module's
    docstring); pure."""
    path = record.get("exe_path") or ""
    return (record.get("exe_owner") == 0 and bool(record.get("exe_verified")) and path.startswith(_protect.SYSTEM_DIRS)
            and os.path.basename(path) in STARTERS and os.path.dirname(path).endswith(STARTER_DIRS))


def parse_progname(cmdline: str | None) -> tuple[str, str] | None:
    """(product, instance name) from a starter's argv[0] (`Apptainer instance: alice [train]`), else
    None; pure."""
    match = _PROGNAME.match((cmdline or "").strip())
    return (match.group(1), match.group(3)) if match else None


class Walks:
    """The run's walks up the holders' ancestors: one deadline for all of them, and each ancestor read once."""

    def __init__(self, bound_s: float = WALKS_S, now: t.Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self.deadline = now() + bound_s
        self.records: dict[int, t.Mapping[str, t.Any] | None] = {}

    def parent(self, record: t.Mapping[str, t.Any], proc: str) -> t.Mapping[str, t.Any] | None:
        """The record's parent as the kernel shows it now (None: gone, unread, or past the deadline)."""
        parent = int(record.get("ppid") or 0)
        if parent <= 1:
            return None
        if parent not in self.records:
            if self.now() >= self.deadline:
                return None
            self.records[parent] = _holders.read_process(parent, proc)
        return self.records[parent]


def instance_of(holder: t.Mapping[str, t.Any], proc: str = "/proc", walks: Walks | None = None) -> Instance | None:
    """The instance whose starter is the holder or one of its ancestors (each read bounded, as the
    look reads any process; `walks`: the run's, shared by its holders), or None."""
    walks = Walks() if walks is None else walks
    record: t.Mapping[str, t.Any] | None = holder
    for _generation in range(MAX_GENERATIONS + 1):
        if not record or record.get("blocked"):
            return None
        if is_starter(record):
            named = parse_progname(record.get("cmdline"))
            if named is None:
                return None
            return Instance(named[1], named[0], int(record["pid"]), record.get("uid"), record.get("user"))
        record = walks.parent(record, proc)
    return None
