# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Holders that outlived SIGKILL because their cgroup is frozen (issue 70, paused containers and
the cgroup v1 freezer), told apart from processes stuck in the kernel.

Under the cgroup v1 freezer (`freezer.state` FROZEN: `docker pause` on a v1 node, Slurm's `scontrol
suspend`, a user's own freezer cgroup) every signal stays pending, SIGKILL included, and the task
reads state D until the cgroup is thawed (seen on this project's test machine: SIGKILLed, still
there; thawed, gone at once; moby/moby#15853). Such a holder is frozen, not unkillable, and no reboot
is needed: thawing it lets the SIGKILL already sent end it. (cgroup v2's freezer lets a fatal signal
through: _act/_signals sends SIGKILL at once there.)

The witnesses are the kernel's: the holder's /proc/PID/cgroup and its freezer cgroup's state file,
read from this mount namespace's cgroup hierarchies. Who may thaw it is the owner of the directory:
a directory some user owns is a delegated subtree, hers (the run never thaws it through the cgroup
file system, and neither does its advice); a container's freeze is its runtime's (`docker unpause`).
Read only for a holder that outlived SIGKILL (a failure): a plain run reads nothing here.
"""

from __future__ import annotations

import os
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders


class Frozen(t.NamedTuple):
    """A holder's frozen cgroup: the directory, what reads frozen there, and its owner (0: root)."""

    directory: str
    reading: str
    owner: int


def freezer_mounts(mountinfo: str = "/proc/self/mountinfo") -> tuple[list[str], list[str]]:
    """(cgroup2 mount points, cgroup v1 freezer mount points) of this mount namespace."""
    hierarchies = _cgroups.cgroup_hierarchies(mountinfo)
    return ([point for point, kind, _options in hierarchies if kind == "cgroup2"],
            [point for point, kind, options in hierarchies if kind == "cgroup" and "freezer" in options])


def cgroup_paths(text: str | None) -> tuple[str | None, str | None]:
    """(the cgroup v2 path, the v1 freezer path) of a /proc/PID/cgroup text; pure."""
    v2 = v1 = None
    # "\n" only: the names below a delegated subtree are its user's, any other line break included.
    for line in (text or "").split("\n"):
        number, _sep, rest = line.partition(":")
        controllers, _sep, path = rest.partition(":")
        if number == "0" and controllers == "":
            v2 = path
        elif "freezer" in controllers.split(","):
            v1 = path
    return v2, v1


def _below(mount: str, path: str | None) -> str | None:
    parts = [part for part in (path or "").split("/") if part and part not in (".", "..")]
    return os.path.join(mount, *parts) if parts else None


def frozen_of(pid: int, proc: str = "/proc") -> Frozen | None:
    """The frozen cgroup holding `pid` (v1 freezer.state FROZEN or FREEZING, v2 cgroup.events
    frozen 1), or None."""
    v2_path, v1_path = cgroup_paths(_holders.cgroup_text(pid, proc))
    v2_mounts, v1_mounts = freezer_mounts(os.path.join(proc, "self", "mountinfo"))
    for mount in v1_mounts:
        directory = _below(mount, v1_path)
        state = (_cgroups.read_small(os.path.join(directory, "freezer.state")) or "").strip() if directory else ""
        if state in ("FROZEN", "FREEZING"):  # the v1 freezer's frozen states (THAWED: not)
            return Frozen(directory or "", f"freezer.state {state}", owner_of(directory or "", mount))
    for mount in v2_mounts:
        directory = _below(mount, v2_path)
        events = _cgroups.read_small(os.path.join(directory, "cgroup.events")) if directory else None
        if events is not None and _cgroups.is_frozen(events, None):
            return Frozen(directory or "", "cgroup.events frozen 1", owner_of(directory or "", mount))
    return None


def owner_of(directory: str, mount: str) -> int:
    """The first owner other than root of `directory` or a directory above it up to `mount` (a
    delegated subtree), else 0."""
    while directory.startswith(mount.rstrip("/") + "/"):
        try:
            owner = os.stat(directory).st_uid
        except OSError:
            owner = 0
        if owner:
            return owner
        directory = os.path.dirname(directory)
    return 0


def advice(described: str, frozen: Frozen, runtime: str | None = None, container: str | None = None) -> str:
    """Words for a SIGKILLed holder that a frozen cgroup keeps (instead of "unkillable, reboot"); pure.
    `runtime`, `container`: its container's runtime and name, as the runtime confirmed them."""
    head = f"frozen ({frozen.reading} in {frozen.directory}): {described}, SIGKILLed, stays until its cgroup is thawed (the SIGKILL then ends it)"
    return head + who_thaws(frozen, runtime, container)


def keeps_sigkill_pending(frozen: Frozen) -> bool:
    """Whether the freezer keeps even SIGKILL pending: the cgroup v1 freezer does; v2 lets a fatal
    signal through (_act/_signals sends it at once there)."""
    return frozen.reading.startswith("freezer")


def not_signalled(described: str, frozen: Frozen, runtime: str | None = None, container: str | None = None) -> str:
    """Words for a holder in a frozen cgroup that the run does not signal (check mode, kill=false):
    what a signal would meet, and who thaws it; pure."""
    meets = ("every signal stays pending until its cgroup is thawed, SIGKILL included" if keeps_sigkill_pending(frozen)
             else "it runs no code until its cgroup is thawed; only SIGKILL reaches it before")
    return f"frozen ({frozen.reading} in {frozen.directory}): {described}, {meets}" + who_thaws(frozen, runtime, container)


def who_thaws(frozen: Frozen, runtime: str | None = None, container: str | None = None) -> str:
    """"; ..." naming who thaws the cgroup: a paused container's runtime, the user of a delegated
    subtree (never thawed by this run), or whoever froze it, or root with the file to write; pure."""
    if runtime in ("docker", "podman") and container:
        return f"; its container is paused: `{runtime} unpause {container}` thaws it (no reboot is needed)"
    if frozen.owner:
        return (f"; the cgroup is in uid {frozen.owner:d}'s delegated subtree, frozen by that user: this run does not thaw a "
                "user's cgroup; that user thaws it (or stop the unit that delegates it), no reboot is needed")
    thaw = f"echo THAWED > {frozen.directory}/freezer.state" if keeps_sigkill_pending(frozen) else f"echo 0 > {frozen.directory}/cgroup.freeze"
    return f"; whoever froze it (a scheduler's suspend, a paused container) thaws it, or root: `{thaw}`; no reboot is needed"
