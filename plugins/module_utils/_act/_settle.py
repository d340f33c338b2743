# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The respawn watch: no `released: true` that rests on one reading taken between a kill and a
restart, by whoever restarts.

Two kinds of restarter are watched after this run signalled a holder:

- A cgroup: a process in a container it could not stop through the container's runtime, or in a
  `.service` of a user's systemd manager (user@UID.service) whose Restart= is not `no`. A new
  process in that cgroup fails the run naming the container or unit.
- A parent: the killed holder's ancestors that are still alive, walking up from its parent to its
  session leader or to a launcher (never PID 1, a protected daemon or this Ansible session): a
  `while true; do python train.py; done` loop, supervisord, pm2, runsv, s6-supervise, circusd,
  monit, torchrun's elastic agent. A new descendant of such a parent that runs the killed
  command line again, or that maps a selected GPU's device file context-sized (a new holder),
  fails the run naming the parent (PID, name, command line) and what stops it; known
  supervisors are named as such, with their stop command.

Whose a new process is, the watch does not know: its caller may tell it (`foreign(new pid,
killed pid)`, from the kernel's cgroup path: a scheduler's job, _look/_jobs.owning_job). A process
that the caller calls another's is never a restart of that holder, whatever it runs: every task
of an array job runs the same command line. A process inside a watched cgroup is in the killed
holder's own cgroup, so in its job: the cgroup watch needs no such word.

When nothing of the kind survives the signals (units stopped through systemd, containers stopped
through their runtime, a holder whose parent was PID 1 or exited with it) there is no window:
the fast path stays as fast as before. Otherwise, after every selected GPU reads clean, the run
watches for `settle_timeout` seconds (SETTLE_S by default), polling every POLL_S; a window over
parents ends early when every watched parent has exited.

SETTLE_S, 5 s: measured on a real H200, a shell loop restarted a 4.7 GiB PyTorch holder and the
GPU read 4715 MiB again 5 s after a `released: true`; a loop without `sleep` starts the command
again within milliseconds (recognised here by its command line, before its CUDA init of 1-3 s).
supervisord restarts an exited program on its next tick (~1 s), runsv and s6-supervise after at
most 1 s, pm2's restart_delay defaults to 0, torchrun's agent monitors its workers every 0.1 s
(5 s in releases before 2.2, the edge of the window), systemd's RestartSec defaults to 100 ms
(units with Restart=always were seen back in 1-3 s), and Docker restarts a container killed from
outside after a back-off of 100 ms (running again in ~0.6 s, measured, Docker 20.10). A restarter
that waits longer than the window (a loop with `sleep 30`, monit's 30 s cycle) is not caught:
raise settle_timeout, or stop the restarter first.
"""

from __future__ import annotations

import os
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units
from ansible_collections.zeromib.gpu.plugins.module_utils._look._attribution import CONTEXT_MAP_MIN_KIB

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Gpu, Holder

    Systemctl = t.Callable[[t.List[str]], t.Tuple[int, str, str]]
    # {pid: (ppid, session id, start time)} of every live process (read_table).
    Table = t.Dict[int, t.Tuple[int, int, int]]
    # (new pid, killed pid) -> whether the new process is someone else's than the killed holder
    # was (another scheduler job's): then it is no restart of it.
    Foreign = t.Callable[[int, int], bool]

SETTLE_S = 5.0
POLL_S = 0.25
# What came back is decided by the first read that sees it; naming it may wait this long more
# (NAME_POLL_S apart) for the newcomers to stop changing. A container runtime starts the process
# through short-lived helpers that join the container's cgroup first (runc's init stages: under
# load the first read saw only those), and the message should name the process the user will
# find with `docker top`, not its launcher. Bounded, so the window ends at most this much later.
NAME_SETTLE_S = 0.5
NAME_POLL_S = 0.05


def unit_cgroup(cgroup_path: str | None, unit: str) -> str | None:
    """The cgroup of `unit` within a process's cgroup path (the path up to that component)."""
    parts = (cgroup_path or "").split("/")
    if unit in parts:
        return "/".join(parts[: parts.index(unit) + 1])
    return None


def user_unit(holder: Holder) -> str | None:
    """The unit of a user's own manager a holder runs in: the deepest `*.service` of its cgroup
    below the `user@UID.service` systemd says it runs in (_unit_owner), or None. A name its user
    chose: used only to watch that cgroup and to ask that user's manager, never to stop anything."""
    owner = holder.get("unit") or ""
    if not owner.startswith("user@"):
        return None
    _above, sep, below = (holder.get("cgroup") or "").partition("/" + owner + "/")
    units = [part for part in below.split("/") if part.endswith(".service")] if sep else []
    return units[-1] if units else None


def user_restart(systemctl: Systemctl | None, holder: Holder, unit: str) -> str | None:
    """Restart= of a user-manager unit, asked through `systemctl --user --machine=USER@`, or
    None when it cannot be asked (then the unit is watched)."""
    user = holder.get("user")
    if not user or systemctl is None:
        return None
    rc, out, _err = systemctl(["--user", f"--machine={user}@", "show", "--property=Restart", "--value", "--", unit])
    return (out.strip() or None) if rc == 0 else None


def watch_list(signalled: list[Holder], outside_reasons: t.Mapping[str, t.Any], systemctl: Systemctl | None = None) -> dict[str, str]:
    """The things to watch after signalling `signalled` (holders): {cgroup: description}."""
    watched: dict[str, str] = {}
    for holder in signalled:
        cgroup = holder.get("cgroup") or ""
        if holder.get("container") and holder["container"] in outside_reasons:
            ref: t.Mapping[str, t.Any] = _cgroups.container_ref(cgroup) or {}
            if ref.get("id"):
                described = dict(holder, container_runtime=holder.get("container_runtime") or ref.get("runtime"))
                watched.setdefault(cgroup, f"container {_containers.describe_entry(_containers.holder_entry(described))}")
            continue
        unit = user_unit(holder)
        if unit:
            path = unit_cgroup(cgroup, unit)
            if path and path not in watched and user_restart(systemctl, holder, unit) != "no":
                watched[path] = "unit {} of {}'s systemd manager".format(unit, holder.get("user") or "a user")
    return watched


def _within(path: str, cgroup: str) -> bool:
    return path == cgroup or path.startswith(cgroup + "/")


def members(cgroups: list[str], proc: str = "/proc") -> dict[tuple[int, int], tuple[str, str, str]]:
    """{(pid, start_time): (cgroup watched, name, cmdline)} of live processes in the cgroups."""
    found: dict[tuple[int, int], tuple[str, str, str]] = {}
    if not cgroups:
        return found
    for pid in holders_mod.list_pids(proc):
        path = holders_mod.cgroup_of(pid, proc)
        if not path:
            continue
        for cgroup in cgroups:
            if _within(path, cgroup):
                record = holders_mod.read_process(pid, proc)
                if record is not None and record["state"] not in ("Z", "X"):
                    found[(pid, record["start_time"])] = (cgroup, record["name"], record["cmdline"])
                break
    return found


# ---------------------------------------------------------------- parents that restart


def short(text: str | None, limit: int = 60) -> str:
    text = text or ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_table(proc: str = "/proc") -> Table:
    """{pid: (ppid, session id, start time)} of every live process (one read of each stat, under
    the scan's bound: a process whose stat does not answer is left out, _holders.read_stats)."""
    return _rows(holders_mod.read_stats(holders_mod.list_pids(proc), proc))


def ancestors_table(targets: t.Iterable[Holder], proc: str = "/proc") -> Table:
    """The rows of read_table for the targets' ancestors only (their parents, theirs, up to PID 1):
    what parent_chain walks, one bounded read a generation instead of one of every process."""
    table: Table = {}
    wanted = {holder.get("ppid") or 0 for holder in targets}
    while True:
        wanted = {pid for pid in wanted if pid > 1 and pid not in table}
        if not wanted:
            return table
        rows = _rows(holders_mod.read_stats(sorted(wanted), proc))
        table.update(rows)
        wanted = {ppid for ppid, _session, _start in rows.values()}


def _rows(stats: t.Mapping[int, bytes]) -> Table:
    table: Table = {}
    for pid, data in sorted(stats.items()):
        try:
            _comm, state, ppid, start_time = holders_mod.parse_stat(data)
            session = int(data[data.rindex(b")") + 2:].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        if state not in ("Z", "X"):
            table[pid] = (ppid, session, start_time)
    return table


def _cwd(pid: int, proc: str) -> str | None:
    try:
        return os.readlink(f"{proc}/{pid}/cwd")
    except OSError:
        return None


def _names(record: t.Mapping[str, t.Any]) -> set[str]:
    names = _units.process_names(record)
    words = (record.get("cmdline") or "").split()
    if words:
        names.add(words[0].rsplit("/", 1)[-1])
    return names


KIND_LABELS = {"supervisord": "supervisord", "pm2": "pm2", "runit": "runit's runsv", "s6": "s6-supervise", "circus": "circusd",
               "monit": "monit", "torchrun": "torchrun's elastic agent"}
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch", "torch.distributed.elastic")


def supervisor_kind(record: t.Mapping[str, t.Any]) -> str | None:
    """The known supervisor a process looks like, or None: supervisord, pm2, runit, s6, circus,
    monit, torchrun (its elastic agent restarts failed workers up to --max-restarts). A label for
    the message (what stops it), deciding nothing: the walk's stop is stops_the_walk's."""
    names = _names(record)
    cmdline = record.get("cmdline") or ""
    if "supervisord" in names:
        return "supervisord"
    if "pm2" in names or cmdline.startswith("PM2 ") or "God Daemon" in cmdline:
        return "pm2"
    if "runsv" in names:
        return "runit"
    if "s6-supervise" in names:
        return "s6"
    if "circusd" in names:
        return "circus"
    if "monit" in names:
        return "monit"
    if "torchrun" in names or any(module in cmdline.split() for module in TORCHRUN_MODULES):
        return "torchrun"
    return None


def supervisor_program(environ: dict[str, str]) -> str | None:
    """supervisord's name for a program from the environment it gives its children."""
    process = environ.get("SUPERVISOR_PROCESS_NAME")
    group = environ.get("SUPERVISOR_GROUP_NAME")
    if not process:
        return None
    return process if not group or group == process else f"{group}:{process}"


def guest_init_hint(parent: t.Mapping[str, t.Any]) -> str | None:
    """What to do when the restarter is the init of a system container seen from the host, or
    None: never `kill` it (that ends the whole guest); stop the server in the guest."""
    ref = _cgroups.guest_ref(parent.get("cgroup"))
    if ref is None or not parent.get("pid_namespace_init"):
        return None
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests  # pylint: disable=import-outside-toplevel
    guest = {"kind": ref["kind"], "name": ref["name"], "init_pid": parent["pid"]}
    return ("pid {} is the init of {}, which starts it again; ending that init ends the whole guest: stop the server inside the guest "
            "(enter it with `{}`), or, where the guest runs systemd, name its unit in services as {}".format(
                parent["pid"], _guests.label(guest), _guests.guest_command(guest, ["sh"], _guests.host_tools()), _guests.entry(guest)))


def stop_hint(kind: str | None, parent: t.Mapping[str, t.Any], child_environ: dict[str, str], proc: str = "/proc") -> str:
    """What stops this restarter, in the user's words (a command to run, or what to name)."""
    pid = parent["pid"]
    guest_hint = guest_init_hint(parent)
    if guest_hint:
        return guest_hint
    if kind == "supervisord":
        program = supervisor_program(child_environ) or "<program>"
        return (f"supervisord restarts program {program} (autorestart): stop it with `supervisorctl stop {program}`, or name it in services as "
                f"supervisor:{program} (service_state: disabled also turns autostart and autorestart off)")
    if kind == "pm2":
        app = child_environ.get("name") or child_environ.get("pm_id") or "<app>"
        return f"pm2 restarts app {app}: stop it with `pm2 stop {app}` (as the user that runs pm2; `pm2 save` keeps it stopped)"
    if kind == "runit":
        service = _cwd(pid, proc) or "<service dir>"
        return f"runsv restarts its service: stop it with `sv down {service}`"
    if kind == "s6":
        service = _cwd(pid, proc) or "<service dir>"
        return f"s6-supervise restarts its service: stop it with `s6-svc -d {service}`"
    if kind == "circus":
        return "circusd restarts its watcher: stop it with `circusctl stop <watcher>`"
    if kind == "monit":
        return "monit restarts what it monitors: stop it with `monit stop <name>`"
    if kind == "torchrun":
        return (f"torchrun's elastic agent restarts its workers (--max-restarts): the agent goes first: end pid {pid} (kill -TERM {pid}; "
                "its workers end with it)")
    return f"end pid {pid} first (kill {pid}), or stop what runs it"


def describe_process(record: t.Mapping[str, t.Any]) -> str:
    text = "pid {} {}".format(record["pid"], record.get("name"))
    cmdline = record.get("cmdline")
    if cmdline and cmdline != record.get("name"):
        text += f" [{short(cmdline)}]"
    return text


def stops_the_walk(record: t.Mapping[str, t.Any]) -> bool:
    """Whether the walk up ends at this ancestor (it is watched itself): a known supervisor or a
    launcher, by the identity rule only. A user's process named so (`exec -a supervisord sh -c
    'while ...'`) is watched and the walk goes on above it."""
    return _protect.identified(record) and bool(supervisor_kind(record) or _units.LAUNCHER_NAMES.of(record, also=_names(record)))


def parent_chain(holder: Holder, table: Table, own_lineage: t.Collection[int], signalled: t.Collection[int], proc: str = "/proc"
                 ) -> list[Holder]:
    """The ancestors of a holder that may start it again: from its parent up to its session leader
    or a launcher, never PID 1, a protected daemon (sshd, systemd, ... through the identity rule:
    a user's loop run as `exec -a sshd` is a parent like any other), a kernel thread or this
    Ansible session. Ancestors that are themselves being signalled are passed over."""
    chain = []
    pid = holder.get("ppid")
    seen = set()
    while pid and pid > 1 and pid in table and pid not in own_lineage and pid not in seen:
        seen.add(pid)
        ppid, session, _start = table[pid]
        if pid in signalled:
            pid = ppid
            continue
        record = holders_mod.read_process(pid, proc)
        if record is None or record.get("kernel_thread") or _protect.BUILTIN_PROTECTED_NAMES.of(record):
            break
        chain.append(record)
        if session == pid or stops_the_walk(record):
            break
        pid = ppid
    return chain


def restarters(targets: list[Holder], own_lineage: t.Iterable[int] | None, proc: str = "/proc", skip: t.Collection[int] = (),
               table: Table | None = None) -> dict[int, dict[str, t.Any]]:
    """{pid: restarter} for the parents of `targets` (holders about to be signalled) that may
    restart them; `skip` are the PIDs of holders watched through their cgroup instead. Each
    restarter: its process record, the start time that identifies it, {pid: command line} of the
    holders it started (a restart runs one of them again), its kind and what stops it."""
    candidates = [t for t in targets if t["pid"] not in skip and (t.get("ppid") or 0) > 1]
    if not candidates:
        return {}
    table = read_table(proc) if table is None else table
    signalled = {t["pid"] for t in targets}
    found: dict[int, dict[str, t.Any]] = {}
    for holder in candidates:
        environ = None
        for depth, parent in enumerate(parent_chain(holder, table, set(own_lineage or ()), signalled, proc)):
            entry = found.get(parent["pid"])
            if entry is None:
                if environ is None:
                    environ = holders_mod.environ_of(holder["pid"], proc)
                kind = supervisor_kind(parent)
                entry = found[parent["pid"]] = {
                    "record": parent, "start_time": parent["start_time"], "kind": kind,
                    "hint": stop_hint(kind, parent, environ, proc), "killed": {}, "depth": depth,
                }
            entry["killed"][holder["pid"]] = holder.get("cmdline") or ""
            entry["depth"] = min(entry["depth"], depth)
    return found


def descendants(table: Table, roots: t.Iterable[int]) -> dict[int, int]:
    """{pid: the nearest of `roots` above it} for every live descendant of the roots."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _session, _start) in table.items():
        children.setdefault(ppid, []).append(pid)
    below: dict[int, int] = {}
    # Deepest roots first, so that a process under two roots is credited to the nearer one.
    for root in roots:
        stack = list(children.get(root, []))
        while stack:
            pid = stack.pop()
            if pid in below and below[pid] != root:
                continue
            below[pid] = root
            stack.extend(children.get(pid, []))
    return below


def maps_selected_gpu(pid: int, minors: t.Collection[int], proc: str = "/proc") -> bool:
    """Whether a process maps a selected GPU's node context-sized (a CUDA context there)."""
    try:
        mapped = holders_mod.read_maps(pid, proc)
    except OSError:
        return False
    sizes: dict[int, int] = {}
    for device, (_count, kib) in (mapped or {}).items():
        minor = _devices.gpu_minor(device)
        if minor is not None and minor in minors:
            sizes[minor] = sizes.get(minor, 0) + kib
    return any(kib >= CONTEXT_MAP_MIN_KIB for kib in sizes.values())


class Watch:
    """What may start a signalled holder again, seen before acting; what came back after.

    `watched`: {cgroup: description} (watch_list); `parents`: restarters(); `minors`: the device
    minors of the selected GPUs; `foreign`: the caller's word on whose a new process is (None:
    every new process may be a restart)."""

    def __init__(self, watched: dict[str, str], proc: str = "/proc", parents: dict[int, dict[str, t.Any]] | None = None, minors: t.Iterable[int] = (),
                 table: Table | None = None, killed: t.Iterable[Holder] = (), foreign: Foreign | None = None) -> None:
        self.watched = watched
        self.proc = proc
        self.foreign = foreign
        self.parents = parents or {}
        self.minors = set(minors)
        self.before = members(list(watched), proc)
        self.known: set[tuple[int, int]] = set()
        # The killed holders' command lines, by the PID that ran each, and every process alive
        # before the signals: a new one running such a command line is a restart, by whoever
        # (restarted_outside).
        self.killed_cmdlines = {h["pid"]: h["cmdline"] for h in killed if h.get("cmdline")}
        # Whose it was: another user's job that happens to run the same command line (or copies
        # it to make the release fail) is not this holder started again.
        self.killed_uids = {h["pid"]: h.get("uid") for h in killed if h.get("cmdline")}
        # Every process there before the signals, by its /proc entry (not by a read of each: on a
        # node of 10,000 processes that read is most of the watch's cost), and the boot-clock
        # tick the watch began at: a PID seen again under a new entry is new only if it started
        # since (an entry the kernel dropped from its cache and made again is the same process).
        self.alive_before = holders_mod.process_entries(proc) if self.killed_cmdlines else {}
        self.since = boot_ticks(proc) if self.killed_cmdlines else None
        if self.parents:
            table = read_table(proc) if table is None else table
            self.known = {(pid, table[pid][2]) for pid in descendants(table, self.roots())}

    def __bool__(self) -> bool:
        return bool(self.watched or self.parents)

    def roots(self) -> list[int]:
        """Watched parents, nearest to the holders first."""
        return sorted(self.parents, key=lambda pid: self.parents[pid]["depth"])

    def alive(self, table: Table | None = None) -> list[int]:
        table = read_table(self.proc) if table is None else table
        return [pid for pid in self.roots() if pid in table and table[pid][2] == self.parents[pid]["start_time"]]

    def newcomers(self) -> list[tuple[tuple[int, int], tuple[str, str, str]]]:
        return [(key, value) for key, value in sorted(members(list(self.watched), self.proc).items()) if key not in self.before]

    def respawned(self) -> list[tuple[int, Holder]]:
        """[(parent pid, newcomer record)]: new descendants of a live watched parent that run a
        killed holder's command line again or hold a selected GPU."""
        if not self.parents:
            return []
        table = read_table(self.proc)
        live = self.alive(table)
        found = []
        for pid, root in sorted(descendants(table, live).items()):
            if (pid, table[pid][2]) in self.known:
                continue
            record = holders_mod.read_process(pid, self.proc)
            if record is None:
                continue
            killed: dict[int, str] = self.parents[root]["killed"]
            # The holders it would start again: those whose command line it runs, else (a new
            # holder of a selected GPU) any this parent started.
            again = [k for k, cmdline in killed.items() if cmdline == record.get("cmdline")]
            if not again and maps_selected_gpu(pid, self.minors, self.proc):
                again = list(killed)
            if again and self.may_restart(pid, again):
                found.append((root, record))
        return found

    def may_restart(self, pid: int, killed: t.Iterable[int]) -> bool:
        """Whether new process `pid` may be one of `killed` (pids) started again: by the caller's
        word (`foreign`), it is not someone else's than all of them were."""
        return self.foreign is None or any(not self.foreign(pid, k) for k in killed)

    def restarted_outside(self, skip: t.Collection[int] = ()) -> list[tuple[int, Holder]]:
        """[(killed pid, new process)]: processes started since the signals that run a killed
        holder's exact command line again as the same user, whatever their parent (a
        double-forked watcher, a `pgrep || nohup` loop, cron). One read of the process table;
        only new processes are read."""
        if not self.killed_cmdlines:
            return []
        found = []
        for pid, entry in sorted(holders_mod.process_entries(self.proc).items()):
            if self.alive_before.get(pid) == entry or pid in skip:
                continue
            record = holders_mod.read_process(pid, self.proc)
            if record is None or record.get("kernel_thread"):
                continue
            if pid in self.alive_before and self.since is not None and record["start_time"] < self.since:
                continue
            killed = self.restart_of(record)
            if killed is not None:
                found.append((killed, record))
        return found

    def restart_of(self, record: Holder) -> int | None:
        """The killed holder (pid) that a new process starts again, or None: one that ran its
        command line, as its user (where known), and whose it is, by the caller's word
        (`foreign`), too."""
        for killed, cmdline in sorted(self.killed_cmdlines.items()):
            if cmdline != record.get("cmdline"):
                continue
            owner = self.killed_uids.get(killed)
            if owner is not None and record.get("uid") != owner:
                continue
            if self.foreign is not None and self.foreign(record["pid"], killed):
                continue
            return killed
        return None

    def outside_message(self, again: t.Sequence[tuple[int, Holder]], clean: bool = True) -> str:
        """Why the run fails when a killed command line runs again outside any watched parent."""
        parts = []
        for killed, record in again:
            text = f"{describe_process(record)} runs the command line of killed pid {killed} again"
            parent = holders_mod.read_process(record.get("ppid") or 0, self.proc) if (record.get("ppid") or 0) > 1 else None
            text += f", started by {describe_process(parent)}" if parent else ", its parent gone (a double-forked or detached restarter)"
            parts.append(text)
        head = "the GPUs read clean, but something this run killed was started again" if clean else \
            "something this run killed was started again before the GPUs read clean"
        return ("{}: {}. Something outside the holder's parents restarts it (a watcher loop, `pgrep || nohup`, cron, a script of its "
                "user): stop that first, then run gpu_release again".format(head, "; ".join(parts)))

    def settle(self, system: t.Any, read_dirty: t.Callable[[], list[Gpu]], seconds: float = SETTLE_S, poll: float = POLL_S) -> str | None:
        """Watch for `seconds`; returns None when nothing came back, else a message naming what
        did. `read_dirty()` returns the selected GPUs that read dirty now. No window at all when
        no cgroup is watched and no watched parent is alive; a window over parents only ends
        as soon as the last of them has exited."""
        started = system.now()
        if not self.watched and not self.alive():
            return None
        while True:
            came = self.newcomers()
            again = self.respawned()
            dirty = read_dirty()
            if dirty and not again:
                # The restarted process may have come while the GPUs were read: name its parent,
                # not only the memory (one more read of the table, on the failing path only).
                again = self.respawned()
            if came or again or dirty:
                after_s = system.now() - started  # when it was seen, not when it was named
                return self.message(self.settled(system, came), dirty, after_s, again)
            left = started + seconds - system.now()
            if left <= 0 or (not self.watched and not self.alive()):
                return None
            system.sleep(min(poll, left))

    def settled(self, system: t.Any, came: list[tuple[tuple[int, int], tuple[str, str, str]]]) -> list[tuple[tuple[int, int], tuple[str, str, str]]]:
        """The newcomers once two reads NAME_POLL_S apart agree, within NAME_SETTLE_S; the last
        non-empty read when they do not (or when every newcomer has exited since). Nothing in
        the failure depends on this: it only chooses which reading the message names."""
        until = system.now() + NAME_SETTLE_S
        while came and system.now() < until:
            system.sleep(NAME_POLL_S)
            now = self.newcomers()
            if now == came:
                break
            came = now or came
        return came

    def message(self, came: t.Sequence[tuple[tuple[int, int], tuple[str, str, str]]], dirty: t.Sequence[Gpu], after_s: float,
                again: t.Sequence[tuple[int, Holder]] = (), clean: bool = True) -> str:
        parts = []
        for (pid, _start), (cgroup, name, cmdline) in came:
            text = f"pid {pid} {name}"
            if cmdline and cmdline != name:
                text += f" [{short(cmdline)}]"
            parts.append(f"{text} in {self.watched[cgroup]}")
        named = set()
        for root, record in again:
            parent = self.parents[root]
            who = describe_process(parent["record"])
            if parent["kind"]:
                who = "{} ({})".format(who, KIND_LABELS[parent["kind"]])
            text = f"{describe_process(record)}, started again by its parent {who}"
            if root not in named:
                text += ": " + parent["hint"]
                named.add(root)
            parts.append(text)
        for gpu in dirty:
            parts.append("GPU {} reads {} MiB again".format(gpu["index"], gpu.get("memory_used_mib")))
        head = f"the GPUs read clean, but {after_s:.1f} s later something this run killed came back" if clean else \
            "something this run killed came back before the GPUs read clean"
        if again and not came:
            return "{}: {}. Stop the restarter first, then run gpu_release again".format(head, "; ".join(parts))
        return (
            "{}: {}. Its restart policy is outside gpu_release's control: stop it through its runtime or manager (name the container "
            "in services as container:<name> with service_state: disabled, or stop the user's unit), then run gpu_release again".format(head, "; ".join(parts))
        )


def boot_ticks(proc: str = "/proc") -> int | None:
    """Clock ticks since boot now (the unit of a process's start time in /proc/PID/stat), or None
    where /proc does not say (a test's tree)."""
    try:
        with open(f"{proc}/uptime", "rb") as handle:
            return int(float(handle.read().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def watch_for(targets: list[Holder], outside_reasons: t.Mapping[str, t.Any], systemctl: Systemctl | None, own_lineage: t.Iterable[int],
              minors: t.Iterable[int], proc: str = "/proc", foreign: Foreign | None = None) -> Watch:
    """The Watch to start before signalling `targets`: their cgroups that restart outside this
    run's control (watch_list) and, for the others, the parents that may restart them; `foreign`
    as for Watch."""
    watched = watch_list(targets, outside_reasons, systemctl)
    in_cgroups = {t["pid"] for t in targets if any(_within(t.get("cgroup") or "", cgroup) for cgroup in watched)}
    # The walk reads the targets' ancestors only; the whole table is read only where a parent is
    # watched (its descendants), and a restart from outside the parents is found by the /proc
    # entries new since (Watch.restarted_outside).
    table = ancestors_table(targets, proc) if targets else {}
    return Watch(watched, proc, restarters(targets, own_lineage, proc, skip=in_cgroups, table=table), minors, killed=targets, foreign=foreign)
