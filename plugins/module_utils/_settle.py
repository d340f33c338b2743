# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The respawn watch: no `released: true` that rests on one reading taken between a kill and a
restart.

The rule. When this run signalled, from outside, a process that something outside its control
may start again -- a process in a container it could not stop through the container's runtime,
or in a `.service` of a user's systemd manager (user@UID.service) whose Restart= is not `no` --
then, after every selected GPU reads clean, it keeps watching for SETTLE_S seconds. If in that
window a new process appears in the cgroup of what was killed (same container, same unit), or a
selected GPU reads dirty again, the run fails naming it. When nothing of the kind was signalled
(units stopped through systemd, containers stopped through their runtime, bare processes), there
is no window: the fast path stays as fast as before.

SETTLE_S: Docker restarts a container killed from outside after a back-off of 100 ms that doubles
on each restart within 10 s of the last (measured here, Docker 20.10: running again in ~0.6 s,
RestartCount 1); systemd's RestartSec defaults to 100 ms, and units with Restart=always were seen
back in 1-3 s (DESIGN.md). 3 s covers both first restarts with room; a runtime already in a long
back-off can come back later, which is why containers are stopped through their runtime and the
window is only the last line.
"""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils import _containers
from ansible_collections.zeromib.gpu.plugins.module_utils import _holders as holders_mod

SETTLE_S = 3.0
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
    rc, out, _err = systemctl(["--user", "--machine=%s@" % user, "show", "--property=Restart", "--value", holder["unit"]])
    return (out.strip() or None) if rc == 0 else None


def watch_list(signalled, outside_reasons, systemctl=None):
    """The things to watch after signalling `signalled` (holders): {cgroup: description}."""
    watched = {}
    for holder in signalled:
        cgroup = holder.get("cgroup") or ""
        if holder.get("container") and holder["container"] in outside_reasons:
            ref = _containers.container_ref(cgroup) or {}
            if ref.get("id"):
                described = dict(holder, container_runtime=holder.get("container_runtime") or ref.get("runtime"))
                watched.setdefault(cgroup, "container %s" % _containers.describe_container(described))
            continue
        unit = holder.get("unit") or ""
        if unit.endswith(".service") and "/user@" in cgroup:
            path = unit_cgroup(cgroup, unit)
            if path and path not in watched and user_restart(systemctl, holder) != "no":
                watched[path] = "unit %s of %s's systemd manager" % (unit, holder.get("user") or "a user")
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


class Watch(object):
    """Members of the watched cgroups before acting; newcomers after."""

    def __init__(self, watched, proc="/proc"):
        self.watched = watched
        self.proc = proc
        self.before = members(list(watched), proc)

    def __bool__(self):
        return bool(self.watched)

    __nonzero__ = __bool__

    def newcomers(self):
        return [(key, value) for key, value in sorted(members(list(self.watched), self.proc).items()) if key not in self.before]

    def settle(self, system, read_dirty, seconds=SETTLE_S, poll=POLL_S):
        """Watch for `seconds`; returns None when nothing came back, else a message naming what
        did. `read_dirty()` returns the selected GPUs that read dirty now."""
        started = system.now()
        while True:
            came = self.newcomers()
            dirty = read_dirty()
            if came or dirty:
                return self.message(came, dirty, system.now() - started)
            left = started + seconds - system.now()
            if left <= 0:
                return None
            system.sleep(min(poll, left))

    def message(self, came, dirty, after_s):
        parts = []
        for (pid, _start), (cgroup, name, cmdline) in came:
            text = "pid %d %s" % (pid, name)
            if cmdline and cmdline != name:
                text += " [%s]" % (cmdline if len(cmdline) <= 60 else cmdline[:57] + "...")
            parts.append("%s in %s" % (text, self.watched[cgroup]))
        for gpu in dirty:
            parts.append("GPU %d reads %s MiB again" % (gpu["index"], gpu.get("memory_used_mib")))
        return (
            "the GPUs read clean, but %.1f s later something this run killed from outside came back: %s. Its restart policy is "
            "outside gpu_release's control: stop it through its runtime or manager (name the container in services as "
            "container:<name> with service_state: disabled, or stop the user's unit), then run gpu_release again"
            % (after_s, "; ".join(parts))
        )
