# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The protection rules: which processes are never signalled, whatever the selection (the file a
security reviewer reads alone).

A protected daemon (nvidia-persistenced, nv-hostengine, sshd, systemd ...) is known by its real uid
and its executable as the kernel resolves it (`vouched`: a system account, a root-owned executable
in a system directory), or by systemd's MainPID of its unit; never by its name alone, which any
user chooses (`exec -a sshd`, a comm of 15 bytes). The user's `protect` option adds names and PIDs
(split_protect); this module and its ancestors are never signalled (`own_lineage`). Every holder
gets `protected` and, when protected, `protected_reason` (protect)."""

from __future__ import annotations

import fnmatch
import re
import typing as t

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    MainPidOf = t.Callable[[str], t.Optional[int]]

COMM_LENGTH = 15


# Where a daemon a node needs is installed: only root writes there. /proc/PID/exe names the
# executable as the kernel resolved it at exec (no symlink, no argv[0]).
SYSTEM_DIRS = ("/usr/bin/", "/usr/sbin/", "/bin/", "/sbin/", "/usr/lib/", "/usr/lib64/", "/usr/libexec/", "/lib/", "/lib64/",
               "/usr/local/bin/", "/usr/local/sbin/", "/usr/local/nvidia/bin/", "/run/nvidia/driver/usr/bin/")
# Accounts below this uid are system accounts (login.defs SYS_UID_MAX, 999 on Debian and RHEL):
# only root creates them.
SYSTEM_UID_MAX = 999


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
