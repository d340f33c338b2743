# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""A system container's own units, from the host: stopped (and disabled or masked) through the
guest's systemd when `services` names them (`lxc:101:vllm*.service`, `lxd:web:vllm.service`,
`machine:build:vllm.service`), refused with the command to run when it does not.

A guest whose init is a system manager starts its `vllm.service` again within a second of its
processes being killed from outside; and the host's `systemctl stop vllm.service` stops the
host's unit of that name, not the guest's. So a guest's unit is stopped inside the guest, through
the guest's systemd, with the plans and the time bounds of _units; every call is made confined as
the guest (its manager's tool, else joined to its init's cgroup, bounding set and namespaces), or
refused before anything is done where the host cannot (_guest_reach). Without such an entry, a run
that would signal a process of a guest unit whose guest runs a system manager refuses before
anything is done, naming the guest, the command to run there and the entry to add (`refusal`).
"""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._services import GuestUnits
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._units import UnitPlan, UnitsDone
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Guest, Holder

    class Node(t.Protocol):
        """What acting on a guest's units needs of _release.System (and _restore.System)."""

        def guest_systemctl(self, guest: Guest, args: list[str], timeout: float) -> tuple[int, str, str]: ...
        def guest_refusal(self, guest: Guest) -> str | None: ...
        def running_guests(self, kind: str, name_glob: str) -> list[Guest]: ...
        def now(self) -> float: ...
        def sleep(self, seconds: float) -> None: ...
        proc: str

    class GuestPlan(t.TypedDict):
        """One guest's part of the plan: the guest, the entries that named it and _units' plan
        of its units."""

        guest: Guest
        entries: list[str]
        steps: UnitPlan

# Each systemctl call into a guest gets this long at least (a guest whose systemd does not answer
# fails the step, it does not hang the run); stops themselves are bounded by kill_timeout (_units).
CALL_S = 10.0
RESULT_KEYS = {"stopped_units": "stopped_guest_units", "killed_units": "killed_guest_units",
               "disabled_units": "disabled_guest_units", "masked_units": "masked_guest_units"}


def name(guest: t.Mapping[str, t.Any], unit: str) -> str:
    """How the result names a guest's unit: as its services entry, `lxc:101:vllm.service`."""
    return _guests.entry(guest, unit)


def guest_systemctl(guest: t.Mapping[str, t.Any], args: t.Sequence[str], timeout: float, proc: str = "/proc") -> tuple[int, str, str]:
    """(rc, out, err) of systemctl in the guest, confined as the guest; rc 126 with the reason
    where the host cannot, 124 past `timeout`; `show`'s MainPID in host numbers (_guest_reach)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_reach  # pylint: disable=import-outside-toplevel
    return _guest_reach.guest_systemctl(guest, args, timeout, proc)


def guest_refusal(guest: t.Mapping[str, t.Any], proc: str = "/proc") -> str | None:
    """Why the host cannot ask this guest's systemd confined as the guest (None: it can)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_reach  # pylint: disable=import-outside-toplevel
    return _guest_reach.refusal(guest, proc)


class GuestNode:
    """_units.Node for one guest: its systemctl, through the node's `guest_systemctl`."""

    def __init__(self, system: Node, guest: Guest, timeout: float = CALL_S) -> None:
        self.system = system
        self.guest = guest
        self.timeout = timeout

    def systemctl(self, args: list[str]) -> tuple[int, str, str]:
        return self.system.guest_systemctl(self.guest, list(args), self.timeout)

    def now(self) -> float:
        return self.system.now()

    def sleep(self, seconds: float) -> None:
        self.system.sleep(seconds)


def unit_gpus(holders: t.Iterable[Holder], guest: t.Mapping[str, t.Any]) -> dict[str, set[int]]:
    """{unit of this guest: the GPUs its processes hold}."""
    used: dict[str, set[int]] = {}
    for holder in holders:
        mine = holder.get("guest")
        if mine and (mine["kind"], mine["name"]) == (guest["kind"], guest["name"]) and mine.get("unit"):
            used.setdefault(mine["unit"] or "", set()).update(holder.get("gpu_indexes") or [])
    return used


def _grouped(entries: t.Iterable[GuestUnits], running: t.Callable[[str, str], list[Guest]], not_found: list[str]
             ) -> list[tuple[Guest, list[GuestUnits]]]:
    """Each running guest the entries name, with the entries that name it; an entry that names no
    running guest goes to `not_found`."""
    groups: dict[tuple[str, str], tuple[Guest, list[GuestUnits]]] = {}
    for entry in entries:
        guests = running(entry.kind, entry.guest)
        if not guests:
            not_found.append(entry.entry)
        for guest in guests:
            groups.setdefault((guest["kind"], guest["name"]), (guest, []))[1].append(entry)
    return list(groups.values())


def plan(system: Node, entries: t.Sequence[GuestUnits], holders: list[Holder], selected: t.Collection[int], service_state: str | None,
         protect_names: t.Iterable[str] = (), kill_timeout: float = 0.0) -> tuple[list[GuestPlan], list[str], list[str]]:
    """(one plan per running guest the entries name, the entries that name no running guest or
    no unit there, warnings). Each guest's units are planned by _units.plan through the guest's
    systemctl (globs, triggers, service_state, the units never stopped), then the GPU selection
    rule: a unit whose processes hold only unselected GPUs is kept. Raises StepFailed before
    anything is done for a guest whose init is no systemd, or whose systemd cannot be asked."""
    not_found: list[str] = []
    warnings: list[str] = []
    plans: list[GuestPlan] = []
    for guest, named in _grouped(entries, system.running_guests, not_found):
        if guest.get("manager") != "systemd":
            raise StepFailed("services: {}: {} runs {} as its init, not systemd; gpu_release stops a guest's units through its systemd "
                             "only. Stop them in the guest with its own tools (enter it with {}). Nothing was stopped or signalled".format(
                                 ", ".join(e.entry for e in named), _guests.label(guest), guest.get("manager") or "no system manager",
                                 _guests.guest_command(guest, ["sh"], _guests.host_tools())))
        refused = system.guest_refusal(guest)
        if refused:
            raise StepFailed("services: {}: {}. Run `{}` there yourself. Nothing was stopped or signalled".format(
                ", ".join(e.entry for e in named), refused,
                _guests.guest_command(guest, ["systemctl", "stop"] + [e.unit for e in named], _guests.host_tools())))
        node = GuestNode(system, guest, max(CALL_S, kill_timeout))
        try:
            # The host's /proc: MainPID comes back in host numbers (_guest_reach), nothing is read in the guest's.
            steps = _units.plan(node.systemctl, [e.unit for e in named], [], service_state, set(), protect_names, system.proc)
        except StepFailed as exc:
            raise StepFailed("{} ({}): {}".format(_guests.label(guest), ", ".join(e.entry for e in named), exc.msg)) from exc
        _units.keep_outside_selection(steps, unit_gpus(holders, guest), selected)
        label = _guests.label(guest)
        warnings += ["{}: {}".format(label, w.replace(" on this host", " in the guest")) for w in steps["warnings"]]
        for entry in named:
            pattern = _units.normalize_unit(entry.unit)
            if not any(_units.matches(unit, [pattern]) for unit in steps["before"] if unit not in steps["not_found"]):
                not_found.append(entry.entry)
        plans.append({"guest": guest, "entries": [e.entry for e in named], "steps": steps})
    return plans, sorted(set(not_found), key=not_found.index), warnings


def acted_on(plans: t.Iterable[GuestPlan]) -> bool:
    return any(p["steps"]["stop"] or p["steps"]["disable"] or p["steps"]["mask"] for p in plans)


def covered(holder: Holder, plans: t.Iterable[GuestPlan]) -> bool:
    """Whether the plan stops the guest unit a holder runs in (then it ends with its unit)."""
    mine = holder.get("guest")
    if not mine or not mine.get("unit"):
        return False
    for guest_plan in plans:
        guest = guest_plan["guest"]
        if (guest["kind"], guest["name"]) == (mine["kind"], mine["name"]) and mine["unit"] in guest_plan["steps"]["stop"]:
            return True
    return False


def planned(plans: t.Iterable[GuestPlan], service_state: str | None) -> dict[str, list[str]]:
    """Check mode: the result keys of what the plans would do."""
    done: dict[str, list[str]] = {"stopped_guest_units": [], "disabled_guest_units": [], "masked_guest_units": []}
    for guest_plan in plans:
        guest, steps = guest_plan["guest"], guest_plan["steps"]
        done["stopped_guest_units"] += [name(guest, u) for u in steps["stop"]]
        done["disabled_guest_units"] += [name(guest, u) for u in steps["disable"]] if service_state == "disabled" else []
        done["masked_guest_units"] += [name(guest, u) for u in steps["mask"]] if service_state == "masked" else []
    return done


def _renamed(guest: Guest, done: UnitsDone) -> dict[str, list[str]]:
    """_units' record of one guest under the result's guest keys, each unit named as its entry."""
    renamed: dict[str, list[str]] = {"warnings": [f"{_guests.label(guest)}: {w}" for w in done.get("warnings") or []]}
    for key, guest_key in RESULT_KEYS.items():
        renamed[guest_key] = [name(guest, unit) for unit in done.get(key) or []]  # type: ignore[attr-defined]
    return renamed


def act(system: Node, plans: t.Iterable[GuestPlan], kill_timeout: float) -> dict[str, list[str]]:
    """Carry out each guest's plan through its systemctl -> what was done, under the result's
    keys (stopped_guest_units, killed_guest_units, disabled_guest_units, masked_guest_units,
    warnings). A failure raises StepFailed with what was done before it."""
    total: dict[str, list[str]] = {"warnings": []}
    for guest_key in RESULT_KEYS.values():
        total[guest_key] = []
    for guest_plan in plans:
        guest, steps = guest_plan["guest"], guest_plan["steps"]
        if not (steps["stop"] or steps["disable"] or steps["mask"]):
            continue
        try:
            done = _units.act(GuestNode(system, guest, max(CALL_S, kill_timeout)), steps, kill_timeout)
        except StepFailed as exc:
            for key, value in _renamed(guest, t.cast("UnitsDone", exc.done or {})).items():
                total[key] += value
            raise StepFailed(f"{_guests.label(guest)}: {exc.msg}", total) from exc
        for key, value in _renamed(guest, done).items():
            total[key] += value
    return total


def before(plans: t.Iterable[GuestPlan]) -> dict[str, dict[str, t.Any]]:
    """{`lxc:101:vllm.service`: {guest_kind, guest, unit, props}} of each unit planned, with
    systemctl show's props before: what the restore record keeps (_record.guest_unit_entries)."""
    found: dict[str, dict[str, t.Any]] = {}
    for guest_plan in plans:
        guest = guest_plan["guest"]
        for unit, unit_props in guest_plan["steps"]["before"].items():
            found[name(guest, unit)] = {"guest_kind": guest["kind"], "guest": guest["name"], "unit": unit, "props": dict(unit_props)}
    return found


# ---------------------------------------------------------------- without an entry: refuse


def refused_holders(targets: t.Iterable[Holder], plans: t.Iterable[GuestPlan]) -> list[Holder]:
    """The targets a run would signal although their guest's manager would start them again: in
    a `.service` of a guest whose init is a system manager, and not stopped through that guest
    by a services entry. (A process in a guest's session scope, or in a guest without a
    manager, is signalled as any process: nothing there restarts it by a unit's Restart=.)"""
    plans = list(plans)
    found = []
    for holder in targets:
        guest = holder.get("guest")
        if guest and guest.get("manager") and (guest.get("unit") or "").endswith(".service") and not covered(holder, plans):
            found.append(holder)
    return found


def refusal(holders: list[Holder], selected: t.Collection[int], tools: t.Collection[str], service_state: str | None = None) -> str:
    """Why the run refuses before anything is done: per guest unit, its processes and GPUs, the
    command that stops it in the guest (with the tool this host has), and the services entry
    that makes gpu_release stop it there and gpu_restore start it again."""
    groups: dict[tuple[str, str, str], list[Holder]] = {}
    for holder in holders:
        guest = t.cast("Guest", holder["guest"])
        groups.setdefault((guest["kind"], guest["name"], guest["unit"] or ""), []).append(holder)
    parts = []
    for members in groups.values():
        guest = t.cast("Guest", members[0]["guest"])
        unit = guest["unit"] or ""
        gpus = sorted({i for h in members for i in h.get("gpu_indexes") or []})
        then = "disable" if service_state in (None, "stopped", "disabled") else "mask"
        parts.append("{unit} of {label} (pids {pids}, GPU {gpus}; its {manager} would start it again): run `{stop}` (and `{keep}` to keep it "
                     "from starting at boot), or add {entry} to services (role: free_gpus_services) so that gpu_release stops it in the "
                     "guest and gpu_restore starts it again".format(
                         unit=unit, label=_guests.label(guest), pids=",".join(str(h["pid"]) for h in members),
                         gpus=",".join(str(i) for i in gpus), manager=guest.get("manager"),
                         stop=_guests.guest_command(guest, ["systemctl", "stop", unit], tools),
                         keep=_guests.guest_command(guest, ["systemctl", then, unit], tools), entry=_guests.entry(guest, unit)))
    gpu_list = ",".join(str(i) for i in sorted(selected))
    return ("refusing to free GPU {}: {} held by a system container's own service, which only the guest's manager stops for good: {}. "
            "Nothing was stopped or signalled".format(gpu_list, "it is" if len(groups) == 1 else "they are", "; ".join(parts)))
