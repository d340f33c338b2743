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

from ansible_collections.zeromib.gpu.plugins.module_utils import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils import _containers
from ansible_collections.zeromib.gpu.plugins.module_utils import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils import _units
from ansible_collections.zeromib.gpu.plugins.module_utils._attribution import CONTEXT_MAP_MIN_KIB

SETTLE_S = 5.0
POLL_S = 0.25


def unit_cgroup(cgroup_path, unit):
    """The cgroup of `unit` within a process's cgroup path (the path up to that component)."""
    parts = (cgroup_path or "").split("/")
    if unit in parts:
        return "/".join(parts[: parts.index(unit) + 1])
    return None


def user_restart(systemctl, holder):
    """Restart= of a user-manager unit, asked through `systemctl --user --machine=USER@`, or
    None when it cannot be asked (then the unit is watched)."""
    user = holder.get("user")
    if not user or systemctl is None:
        return None
    rc, out, _err = systemctl(["--user", f"--machine={user}@", "show", "--property=Restart", "--value", holder["unit"]])
    return (out.strip() or None) if rc == 0 else None


def watch_list(signalled, outside_reasons, systemctl=None):
    """The things to watch after signalling `signalled` (holders): {cgroup: description}."""
    watched = {}
    for holder in signalled:
        cgroup = holder.get("cgroup") or ""
        if holder.get("container") and holder["container"] in outside_reasons:
            ref = _cgroups.container_ref(cgroup) or {}
            if ref.get("id"):
                described = dict(holder, container_runtime=holder.get("container_runtime") or ref.get("runtime"))
                watched.setdefault(cgroup, f"container {_containers.describe_entry(_containers.holder_entry(described))}")
            continue
        unit = holder.get("unit") or ""
        if unit.endswith(".service") and "/user@" in cgroup:
            path = unit_cgroup(cgroup, unit)
            if path and path not in watched and user_restart(systemctl, holder) != "no":
                watched[path] = "unit {} of {}'s systemd manager".format(unit, holder.get("user") or "a user")
    return watched


def _within(path, cgroup):
    return path == cgroup or path.startswith(cgroup + "/")


def members(cgroups, proc="/proc"):
    """{(pid, start_time): (cgroup watched, name, cmdline)} of live processes in the cgroups."""
    found = {}
    if not cgroups:
        return found
    for pid in holders_mod.list_pids(proc):
        try:
            with open("%s/%d/cgroup" % (proc, pid)) as handle:
                path = holders_mod.parse_cgroup(handle.read())
        except OSError:
            continue
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


def short(text, limit=60):
    text = text or ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read(path):
    with open(path, "rb") as handle:
        return handle.read()


def read_table(proc="/proc"):
    """{pid: (ppid, session id, start time)} of every live process (one read of each stat)."""
    table = {}
    for pid in holders_mod.list_pids(proc):
        try:
            data = _read("%s/%d/stat" % (proc, pid))
            _comm, state, ppid, start_time = holders_mod.parse_stat(data)
            session = int(data[data.rindex(b")") + 2:].split()[3])
        except (OSError, ValueError, IndexError):
            continue
        if state not in ("Z", "X"):
            table[pid] = (ppid, session, start_time)
    return table


def environ_of(pid, proc="/proc"):
    """{name: value} of a process's environment (text), {} when it cannot be read."""
    try:
        data = _read("%s/%d/environ" % (proc, pid))
    except OSError:
        return {}
    pairs = {}
    for entry in data.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep:
            pairs[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return pairs


def _cwd(pid, proc):
    try:
        return os.readlink("%s/%d/cwd" % (proc, pid))
    except OSError:
        return None


def _names(record):
    names = _units.process_names(record)
    words = (record.get("cmdline") or "").split()
    if words:
        names.add(words[0].rsplit("/", 1)[-1])
    return names


KIND_LABELS = {"supervisord": "supervisord", "pm2": "pm2", "runit": "runit's runsv", "s6": "s6-supervise", "circus": "circusd",
               "monit": "monit", "torchrun": "torchrun's elastic agent"}
TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch", "torch.distributed.elastic")


def supervisor_kind(record):
    """The known supervisor a process is, or None: supervisord, pm2, runit, s6, circus, monit,
    torchrun (its elastic agent restarts failed workers up to --max-restarts)."""
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


def supervisor_program(environ):
    """supervisord's name for a program from the environment it gives its children."""
    process = environ.get("SUPERVISOR_PROCESS_NAME")
    group = environ.get("SUPERVISOR_GROUP_NAME")
    if not process:
        return None
    return process if not group or group == process else f"{group}:{process}"


def stop_hint(kind, parent, child_environ, proc="/proc"):
    """What stops this restarter, in the user's words (a command to run, or what to name)."""
    pid = parent["pid"]
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
        return ("torchrun's elastic agent restarts its workers (--max-restarts): the agent goes first: end pid %d (kill -TERM %d; "
                "its workers end with it)" % (pid, pid))
    return "end pid %d first (kill %d), or stop what runs it" % (pid, pid)


def describe_process(record):
    text = "pid %d %s" % (record["pid"], record.get("name"))
    cmdline = record.get("cmdline")
    if cmdline and cmdline != record.get("name"):
        text += f" [{short(cmdline)}]"
    return text


def parent_chain(holder, table, own_lineage, signalled, proc="/proc"):
    """The ancestors of a holder that may start it again: from its parent up to its session leader
    or a launcher, never PID 1, a protected daemon (sshd, systemd, ...), a kernel thread or this
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
        if record is None or record.get("kernel_thread") or holders_mod.name_matches(record, holders_mod.BUILTIN_PROTECTED_NAMES):
            break
        chain.append(record)
        if session == pid or supervisor_kind(record) or _units.is_launcher_name(_names(record)):
            break
        pid = ppid
    return chain


def restarters(targets, own_lineage, proc="/proc", skip=(), table=None):
    """{pid: restarter} for the parents of `targets` (holders about to be signalled) that may
    restart them; `skip` are the PIDs of holders watched through their cgroup instead. Each
    restarter: its process record, the start time that identifies it, the command lines of the
    holders it started (a restart runs one of them again), its kind and what stops it."""
    candidates = [t for t in targets if t["pid"] not in skip and (t.get("ppid") or 0) > 1]
    if not candidates:
        return {}
    table = read_table(proc) if table is None else table
    signalled = {t["pid"] for t in targets}
    found = {}
    for holder in candidates:
        environ = None
        for depth, parent in enumerate(parent_chain(holder, table, set(own_lineage or ()), signalled, proc)):
            entry = found.get(parent["pid"])
            if entry is None:
                if environ is None:
                    environ = environ_of(holder["pid"], proc)
                kind = supervisor_kind(parent)
                entry = found[parent["pid"]] = {
                    "record": parent, "start_time": parent["start_time"], "kind": kind,
                    "hint": stop_hint(kind, parent, environ, proc), "cmdlines": set(), "depth": depth,
                }
            entry["cmdlines"].add(holder.get("cmdline") or "")
            entry["depth"] = min(entry["depth"], depth)
    return found


def descendants(table, roots):
    """{pid: the nearest of `roots` above it} for every live descendant of the roots."""
    children = {}
    for pid, (ppid, _session, _start) in table.items():
        children.setdefault(ppid, []).append(pid)
    below = {}
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


def maps_selected_gpu(pid, minors, proc="/proc"):
    """Whether a process maps a selected GPU's node context-sized (a CUDA context there)."""
    try:
        mapped = holders_mod.read_maps(pid, proc)
    except OSError:
        return False
    sizes = {}
    for device, (_count, kib) in (mapped or {}).items():
        minor = holders_mod.gpu_minor(device)
        if minor is not None and minor in minors:
            sizes[minor] = sizes.get(minor, 0) + kib
    return any(kib >= CONTEXT_MAP_MIN_KIB for kib in sizes.values())


class Watch:
    """What may start a signalled holder again, seen before acting; what came back after.

    `watched`: {cgroup: description} (watch_list); `parents`: restarters(); `minors`: the device
    minors of the selected GPUs."""

    def __init__(self, watched, proc="/proc", parents=None, minors=(), table=None):
        self.watched = watched
        self.proc = proc
        self.parents = parents or {}
        self.minors = set(minors)
        self.before = members(list(watched), proc)
        self.known = set()
        if self.parents:
            table = read_table(proc) if table is None else table
            self.known = {(pid, table[pid][2]) for pid in descendants(table, self.roots())}

    def __bool__(self):
        return bool(self.watched or self.parents)

    __nonzero__ = __bool__

    def roots(self):
        """Watched parents, nearest to the holders first."""
        return sorted(self.parents, key=lambda pid: self.parents[pid]["depth"])

    def alive(self, table=None):
        table = read_table(self.proc) if table is None else table
        return [pid for pid in self.roots() if pid in table and table[pid][2] == self.parents[pid]["start_time"]]

    def newcomers(self):
        return [(key, value) for key, value in sorted(members(list(self.watched), self.proc).items()) if key not in self.before]

    def respawned(self):
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
            if record.get("cmdline") in self.parents[root]["cmdlines"] or maps_selected_gpu(pid, self.minors, self.proc):
                found.append((root, record))
        return found

    def settle(self, system, read_dirty, seconds=SETTLE_S, poll=POLL_S):
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
            if came or again or dirty:
                return self.message(came, dirty, system.now() - started, again)
            left = started + seconds - system.now()
            if left <= 0 or (not self.watched and not self.alive()):
                return None
            system.sleep(min(poll, left))

    def message(self, came, dirty, after_s, again=(), clean=True):
        parts = []
        for (pid, _start), (cgroup, name, cmdline) in came:
            text = "pid %d %s" % (pid, name)
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
            parts.append("GPU %d reads %s MiB again" % (gpu["index"], gpu.get("memory_used_mib")))
        head = f"the GPUs read clean, but {after_s:.1f} s later something this run killed came back" if clean else \
            "something this run killed came back before the GPUs read clean"
        if again and not came:
            return "{}: {}. Stop the restarter first, then run gpu_release again".format(head, "; ".join(parts))
        return (
            "{}: {}. Its restart policy is outside gpu_release's control: stop it through its runtime or manager (name the container "
            "in services as container:<name> with service_state: disabled, or stop the user's unit), then run gpu_release again".format(head, "; ".join(parts))
        )


def watch_for(targets, outside_reasons, systemctl, own_lineage, minors, proc="/proc"):
    """The Watch to start before signalling `targets`: their cgroups that restart outside this
    run's control (watch_list) and, for the others, the parents that may restart them."""
    watched = watch_list(targets, outside_reasons, systemctl)
    in_cgroups = {t["pid"] for t in targets if any(_within(t.get("cgroup") or "", cgroup) for cgroup in watched)}
    # One read of the process table serves both the walk and the snapshot of what runs now.
    table = read_table(proc) if any(t["pid"] not in in_cgroups and (t.get("ppid") or 0) > 1 for t in targets) else {}
    return Watch(watched, proc, restarters(targets, own_lineage, proc, skip=in_cgroups, table=table), minors, table=table)
