# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""systemd units: which to stop, disable or mask, and doing it.

Everything here talks to systemd through one `systemctl(args) -> (rc, out, err)` callable
(the `System` seam of _release), so the plans are tested without a systemd."""

from __future__ import annotations

import fnmatch

from ansible_collections.zeromib.gpu.plugins.module_utils._errors import ReleaseError

ACTIVE_STATES = ("active", "activating", "deactivating", "reloading", "refreshing")
ENABLED_STATES = ("enabled", "enabled-runtime", "linked", "linked-runtime")
MASKED_STATES = ("masked", "masked-runtime")
UNIT_SUFFIXES = ("service", "socket", "timer", "target", "path", "scope", "slice", "mount", "device", "swap", "automount")


def normalize_unit(name):
    name = name.strip()
    if "." not in name.rsplit("/", 1)[-1] or name.rsplit(".", 1)[-1] not in UNIT_SUFFIXES:
        return name + ".service"
    return name


def is_glob(pattern):
    return any(char in pattern for char in "*?[")


def expand_services(patterns, known_units):
    """Unit names and globs -> unit names. A plain name is kept even if unknown (systemctl
    reports it not-found); a glob expands over the units systemd knows."""
    units = []
    for pattern in patterns or []:
        pattern = normalize_unit(pattern)
        if is_glob(pattern):
            matches = sorted(unit for unit in known_units if fnmatch.fnmatchcase(unit, pattern))
        else:
            matches = [pattern]
        for unit in matches:
            if unit not in units:
                units.append(unit)
    return units


def parse_list_units(text):
    """First column of `systemctl list-units/list-unit-files --plain --no-legend`."""
    names = []
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] not in ("UNIT", "●"):
            names.append(fields[0])
        elif len(fields) > 1 and fields[0] == "●":
            names.append(fields[1])
    return names


def parse_show(text):
    """`systemctl show -p Id,LoadState,ActiveState,SubState,UnitFileState u1 u2` -> {Id: props}."""
    units = {}
    current = {}
    for line in text.splitlines() + [""]:
        if not line.strip():
            if current.get("Id"):
                units[current["Id"]] = current
            current = {}
            continue
        key, _sep, value = line.partition("=")
        current[key] = value
    return units


def unit_actions(props, service_state):
    """What to do to one named unit: (stop, disable, mask)."""
    if props.get("LoadState") in (None, "not-found"):
        return False, False, False
    stop = props.get("ActiveState") in ACTIVE_STATES or props.get("SubState") == "auto-restart"
    file_state = props.get("UnitFileState", "")
    disable = service_state == "disabled" and file_state in ENABLED_STATES
    mask = service_state == "masked" and file_state not in MASKED_STATES
    return stop, disable, mask


def owning_units(targets, forbidden):
    """System .service units that own targets, in first-seen order, minus forbidden ones."""
    units = []
    for holder in targets:
        unit = holder.get("unit")
        if holder.get("system_service") and unit and unit not in forbidden and unit not in units:
            units.append(unit)
    return units


def known_units(systemctl, named, service_state):
    """The units systemd knows that the globs among `named` may match."""
    globs = [normalize_unit(p) for p in named if is_glob(p)]
    if not globs:
        return []
    # Loaded units cover what runs, what restarts and what is enabled (wanted at boot); only
    # masking also needs the unit files nobody loaded (listing them costs ~0.2 s).
    listings = [["list-units", "--all"]]
    if service_state == "masked":
        listings.append(["list-unit-files"])
    known = []
    for verb in listings:
        rc, out, _err = systemctl(verb + ["--type=service", "--plain", "--no-legend", "--no-pager"] + globs)
        if rc == 0:
            known.extend(parse_list_units(out))
    return known


def plan(systemctl, named, owned, service_state, forbidden, result):
    """{stop, disable, mask, not_found}: named units get `service_state`, owned ones are stopped
    only. Raises ReleaseError (carrying `result`) before anything is done when a named unit is
    forbidden or systemd cannot be asked."""
    named_units = expand_services(named, set(known_units(systemctl, named, service_state)))
    for unit in named_units:
        if unit in forbidden:
            raise ReleaseError("refusing to stop %s: it runs this Ansible session or a protected process" % unit, result)
    all_units = named_units + [u for u in owned if u not in named_units]
    steps = {"stop": [], "disable": [], "mask": [], "not_found": []}
    if not all_units:
        return steps
    rc, out, err = systemctl(["show", "--property=Id,LoadState,ActiveState,SubState,UnitFileState", "--no-pager"] + all_units)
    if rc != 0:
        raise ReleaseError("systemctl show failed (rc %s): %s" % (rc, (err or out).strip()), result)
    props = parse_show(out)
    for unit in all_units:
        unit_props = props.get(unit, {})
        if unit_props.get("LoadState") in (None, "not-found"):
            steps["not_found"].append(unit)
            continue
        stop, disable, mask = unit_actions(unit_props, service_state if unit in named_units else "stopped")
        # A unit that owns a holder is stopped even if systemd calls it inactive in between.
        if stop or unit in owned:
            steps["stop"].append(unit)
        if disable:
            steps["disable"].append(unit)
        if mask:
            steps["mask"].append(unit)
    return steps


def _systemctl_or_fail(systemctl, verb, units, result):
    rc, out, err = systemctl([verb, "--no-ask-password"] + units)
    if rc != 0:
        raise ReleaseError("systemctl %s %s failed (rc %s): %s" % (verb, " ".join(units), rc, (err or out).strip()), result)


def act(systemctl, steps, result):
    """Carry out a plan; `result` records each step as it is done, so a failure keeps it."""
    if steps["stop"]:
        _systemctl_or_fail(systemctl, "stop", steps["stop"], result)
        result["stopped_units"] = list(steps["stop"])
    if steps["disable"]:
        _systemctl_or_fail(systemctl, "disable", steps["disable"], result)
        result["disabled_units"] = list(steps["disable"])
    if steps["mask"]:
        _systemctl_or_fail(systemctl, "mask", steps["mask"], result)
        result["masked_units"] = list(steps["mask"])
