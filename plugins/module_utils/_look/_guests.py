# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""System containers (Proxmox LXC, LXD, systemd-nspawn) that share the node's GPUs: which guest a
holder runs in, the guest's init and whether that init is a system manager, the guests running
on the node, and what a person runs to reach one (the look's half; acting on a guest's units is
_act/_guest_units).

Seen from the host, a guest's process sits below a boundary cgroup its manager made
(_cgroups.guest_ref); its `vllm.service` is the guest's unit, never the host's. `annotate` believes
the boundary only where root made it (the directory above it is root's, not a delegated
subtree's), and finds the guest's init: the process of the guest's PID namespace whose PID there is
1. A guest whose init is a system manager (its systemd) starts its units again when their
processes are killed from outside, so gpu_release asks that manager instead, or refuses.

From inside a guest, the node's GPUs may be used by the host or by other guests, whose processes
this namespace cannot see: `pid_namespace_nested` says whether this look runs there.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Guest, GuestRef, Holder

# What a guest's init is when the guest runs its own services: these restart what they run.
# (lxc-init, tini, dumb-init, catatonit and a shell are no managers: nothing they run comes back.)
SYSTEM_MANAGERS = ("systemd", "init", "openrc-init", "runit", "runit-init", "s6-svscan", "dinit", "shepherd", "upstart")
# The kernel's inode of the initial PID namespace (PROC_PID_INIT_INO, include/linux/proc_ns.h):
# any other means this process runs in a container.
PROC_PID_INIT_INO = 0xEFFFFFFC
# How `services` names a guest's units, by kind: lxc:101:vllm.service, lxd:NAME:..., machine:NAME:...
ENTRY_PREFIX = {_cgroups.LXC: "lxc", _cgroups.LXD: "lxd", _cgroups.NSPAWN: "machine"}
KIND_WORDS = {_cgroups.LXC: "LXC guest", _cgroups.LXD: "LXD guest", _cgroups.NSPAWN: "nspawn guest"}
# The host tools that reach into a guest, by kind, best first (looked up, never assumed).
ENTER_TOOLS = {_cgroups.LXC: ("pct", "lxc-attach"), _cgroups.LXD: ("lxc", "incus", "lxc-attach"), _cgroups.NSPAWN: ("machinectl",)}
# A lineage longer than this is no process tree a guest builds.
MAX_DEPTH = 64


def label(guest: t.Mapping[str, t.Any]) -> str:
    """`LXC guest 101`, `LXD guest web`, `nspawn guest build`."""
    return "{} {}".format(KIND_WORDS.get(guest.get("kind") or "", "guest"), guest.get("name"))


def entry(guest: t.Mapping[str, t.Any], unit: str | None = None) -> str:
    """The `services` entry that names the guest's unit: `lxc:101:vllm.service`."""
    return "{}:{}:{}".format(ENTRY_PREFIX.get(guest.get("kind") or "", "lxc"), guest.get("name"), unit or guest.get("unit") or "<unit>")


def pid_namespace_nested(proc: str = "/proc") -> bool:
    """Whether this process runs in a PID namespace other than the kernel's first one (a
    container: LXC, LXD, nspawn, Docker, a Kubernetes pod): there, processes of the host and of
    other containers are invisible, also those that use this node's GPUs. False where it cannot
    be read."""
    try:
        return os.stat(f"{proc}/self/ns/pid").st_ino != PROC_PID_INIT_INO
    except OSError:
        return False


# ---------------------------------------------------------------- a holder's guest


def ns_pids(pid: int, proc: str = "/proc") -> list[int]:
    """The PIDs of a process from this namespace down to its own (/proc/PID/status NSpid):
    `[4242, 1]` for a guest's init seen from the host; [] where it cannot be read."""
    try:
        return _holders.status_ints(_holders.read_status(pid, proc), "NSpid") or []
    except OSError:
        return []


def _inside(path: str | None, boundary: str) -> bool:
    return bool(path) and (path == boundary or (path or "").startswith(boundary.rstrip("/") + "/"))


def _is_init(pid: int, proc: str) -> bool:
    pids = ns_pids(pid, proc)
    return len(pids) > 1 and pids[-1] == 1


def init_from_lineage(pid: int, boundary: str, proc: str = "/proc") -> int | None:
    """The guest's init among a process's ancestors: the topmost one still below the boundary,
    when its PID in its own namespace is 1 (a process attached from outside, `pct exec`, has its
    parent outside and is no init)."""
    top = None
    for ancestor in _holders.lineage(pid, proc)[:MAX_DEPTH]:
        if not _inside(_holders.cgroup_of(ancestor, proc), boundary):
            break
        top = ancestor
    return top if top is not None and _is_init(top, proc) else None


def _tree_pids(directory: str) -> list[int]:
    """Every PID in a cgroup directory and below it."""
    pids: list[int] = []
    for folder, dirs, files in os.walk(directory):
        dirs.sort()
        if "cgroup.procs" not in files:
            continue
        try:
            with open(os.path.join(folder, "cgroup.procs"), "rb") as handle:
                pids.extend(int(word) for word in handle.read().split())
        except (OSError, ValueError):
            continue
    return pids


def init_from_cgroup(boundary: str, mounts: t.Iterable[str], proc: str = "/proc") -> int | None:
    """The guest's init from its cgroup tree: the process below the boundary whose PID is 1 in
    the outermost PID namespace there (a container nested in the guest has its own PID 1)."""
    best: tuple[int, int] | None = None
    for mount in mounts:
        directory = os.path.join(mount, boundary.lstrip("/"))
        if not os.path.isdir(directory):
            continue
        for pid in _tree_pids(directory):
            pids = ns_pids(pid, proc)
            if len(pids) > 1 and pids[-1] == 1 and (best is None or len(pids) < best[0]):
                best = (len(pids), pid)
        if best is not None:
            return best[1]
    return None


def manager_of(record: t.Mapping[str, t.Any] | None) -> str | None:
    """The system manager a guest's init is (SYSTEM_MANAGERS, by its executable, argv[0] or comm:
    systemd run as /sbin/init reads `systemd`), or None. The guest's own word about its own init:
    it decides only whether the host asks the guest's manager or signals, never what is stopped."""
    if not record:
        return None
    names = _protect.process_names(record)
    return next((name for name in SYSTEM_MANAGERS if name in names), None)


def guest_record(ref: GuestRef, init_pid: int | None, proc: str = "/proc") -> Guest:
    """{kind, name, unit, init_pid, manager} of a guest whose init is `init_pid` (None: not found)."""
    record = _holders.read_process(init_pid, proc) if init_pid else None
    return {"kind": ref["kind"], "name": ref["name"], "unit": ref["unit"], "init_pid": init_pid if record else None,
            "manager": manager_of(record)}


def confirmed(ref: GuestRef, mounts: t.Iterable[str]) -> int | None:
    """None when root made the boundary (the directory above it is root's, no delegated
    subtree's); else the uid that owns it, who may have named the directory at will."""
    return _cgroups.delegated_to(ref["parent"], mounts)


def annotate(holders: list[Holder], proc: str = "/proc", mounts: list[str] | None = None) -> list[Holder]:
    """Add `guest` to each holder (in place; returns the list): None, or the system container
    it runs in (Guest). A holder below a boundary has no host unit (_holders.unit_of); one whose
    boundary lies in a subtree another uid owns is no guest's, and gets a note. Holders outside
    guests cost a regex each; the cgroup mounts and a guest's init are read once per guest."""
    found: list[list[str]] = [] if mounts is None else [mounts]
    inits: dict[str, int | None] = {}

    def cgroup_mounts() -> list[str]:
        if not found:
            found.append(_cgroups.cgroup_mounts())
        return found[0]

    for holder in holders:
        holder["guest"] = None
        ref = _cgroups.guest_ref(holder.get("cgroup"))
        if ref is None:
            continue
        owner = confirmed(ref, cgroup_mounts())
        if owner is not None:
            holder["container_note"] = holder.get("container_note") or (
                f"cgroup {holder.get('cgroup')} names {label(ref)}, but lies in a subtree owned by uid {owner:d}, who may name it at will: "
                "no guest")
            continue
        if ref["cgroup"] not in inits:
            inits[ref["cgroup"]] = (init_from_lineage(holder["pid"], ref["cgroup"], proc)
                                    or init_from_cgroup(ref["cgroup"], cgroup_mounts(), proc))
        holder["guest"] = guest_record(ref, inits[ref["cgroup"]], proc)
    return holders


# ---------------------------------------------------------------- the guests of this node


def _candidates(mount: str) -> list[str]:
    """Cgroup paths under one mount where a boundary may be (see _cgroups._GUEST_BOUNDARIES)."""
    paths: list[str] = []
    for parent in ("", "lxc", "machine.slice"):
        try:
            names = sorted(os.listdir(os.path.join(mount, parent)))
        except OSError:
            continue
        for name in names:
            path = "/" + "/".join(part for part in (parent, name) if part)
            paths += [path + "/ns", path + "/payload", path]
    return paths


def running(kind: str, name_glob: str, mounts: t.Iterable[str] | None = None, proc: str = "/proc") -> list[Guest]:
    """The running guests of `kind` whose name matches `name_glob`, with their init (for a
    services entry, and for gpu_restore). A guest is running when its boundary cgroup holds its
    init. Sorted by name."""
    mounts = list(_cgroups.cgroup_mounts() if mounts is None else mounts)
    guests: dict[str, Guest] = {}
    for mount in mounts:
        for path in _candidates(mount):
            ref = _cgroups.guest_ref(path)
            if (ref is None or ref["cgroup"] != path or ref["kind"] != kind or ref["name"] in guests
                    or not fnmatch.fnmatchcase(ref["name"], name_glob) or not os.path.isdir(os.path.join(mount, path.lstrip("/")))):
                continue
            if confirmed(ref, mounts) is not None:
                continue
            init = init_from_cgroup(path, mounts, proc)
            if init is not None:
                guests[ref["name"]] = guest_record(ref, init, proc)
    return [guests[name] for name in sorted(guests)]


# ---------------------------------------------------------------- what a person runs


def host_tools(lookup: t.Callable[[str], str | None] = _commands.which) -> dict[str, str]:
    """{tool: path} of the host's tools that run a command in a guest confined as the guest (pct,
    lxc-attach, lxc, incus, machinectl), looked up on this node."""
    tools: dict[str, str] = {}
    for name in sorted({n for names in ENTER_TOOLS.values() for n in names}):
        path = lookup(name)
        if path:
            tools[name] = path
    return tools


def guest_command(guest: t.Mapping[str, t.Any], command: t.Sequence[str], tools: t.Collection[str]) -> str:
    """`command` run in the guest, confined by its manager: with the first of the host's tools
    that reaches it, else with its kind's own (`pct exec 101 -- systemctl stop vllm.service`,
    `lxc exec web -- ...`, `systemctl -M build stop ...`). Never `nsenter -a`: that runs the
    guest's own program outside its cgroup, bounding set and seccomp filter."""
    kind, name = guest.get("kind") or "", str(guest.get("name"))
    words = " ".join(shlex.quote(word) for word in command)
    known = [tool for tool in ENTER_TOOLS.get(kind, ("lxc-attach",)) if tool != "pct" or name.isdigit()]
    present = [tool for tool in known if tool in tools]
    tool = (present or known or ["lxc-attach"])[0]
    if tool == "pct":
        return f"pct exec {shlex.quote(name)} -- {words}"
    if tool in ("lxc", "incus"):
        return f"{tool} exec {shlex.quote(name)} -- {words}"
    if tool == "machinectl":
        if command and command[0] == "systemctl":
            return "systemctl -M {} {}".format(shlex.quote(name), " ".join(shlex.quote(word) for word in command[1:]))
        return "machinectl shell {}{}".format(shlex.quote(name), "" if list(command) == ["sh"] else " /bin/sh -c " + shlex.quote(words))
    return f"lxc-attach -n {shlex.quote(name)} -- {words}"
