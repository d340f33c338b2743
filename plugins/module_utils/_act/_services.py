# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The one reader of `services`: each entry by whoever stops what it names.

`container:<glob>` names Docker/Podman containers (_containers), `supervisor:<glob>` supervisord
programs (_supervisor), `lxc:<id glob>:<unit glob>`, `lxd:<name glob>:<unit glob>` and
`machine:<name glob>:<unit glob>` a system container's own units, stopped through the guest's
manager (_guest_units), `swarm:<service glob>` and `ray:` a cluster runtime's work
(_orchestrators), anything else a systemd unit pattern of the host (_units). gpu_release
parses the option once (`Release.named`) and hands each room its part.
"""

from __future__ import annotations

import typing as t

CONTAINER = "container:"
SUPERVISOR = "supervisor:"
# Cluster runtimes' entries (`swarm:<service glob>`, `ray:`), read by _act/_orchestrators.
ORCHESTRATOR_PREFIXES = ("swarm:", "ray:")
# Guest kinds as _cgroups names them, by the prefix that names their units in `services`.
GUEST_PREFIXES = {"lxc:": "lxc", "lxd:": "lxd", "machine:": "nspawn"}


class GuestUnits(t.NamedTuple):
    """`lxc:101:vllm*.service`: the kind of guest, a glob of guest names (Proxmox's VMID, LXD's
    or the machine's name), a unit pattern of the guest's systemd, and the entry as written."""

    kind: str
    guest: str
    unit: str
    entry: str


class Services(t.NamedTuple):
    units: list[t.Any]  # systemd unit patterns, as the user wrote them (_units reads and checks them)
    containers: list[str]  # container name globs, once each
    programs: list[str]  # supervisord program globs, once each
    guests: list[GuestUnits] = []  # a guest's units, once each (never mutated: parse passes its own list)


def guest_units(text: str) -> GuestUnits | None:
    """`lxc:101:vllm.service` -> GuestUnits; None for an entry of no guest prefix. Raises
    ValueError for one that names no guest or no unit."""
    for prefix, kind in GUEST_PREFIXES.items():
        if text.startswith(prefix):
            guest, sep, unit = (part.strip() for part in text[len(prefix):].partition(":"))
            if not guest:
                raise ValueError(f"services: {text} names no guest and unit: write {prefix}<guest>:<unit>, e.g. {prefix}101:vllm.service")
            if not sep or not unit:
                raise ValueError(f"services: {text} names no unit of the guest: write {prefix}{guest}:<unit>, e.g. {prefix}{guest}:vllm*.service")
            return GuestUnits(kind, guest, unit, f"{prefix}{guest}:{unit}")
    return None


def parse(services: t.Iterable[t.Any] | None) -> Services:
    """`services` -> Services. A prefix with nothing after it names nothing (and is dropped);
    a guest entry without its guest or its unit raises ValueError."""
    named = Services([], [], [], [])
    for item in services or []:
        text = str(item).strip()
        if text.startswith(ORCHESTRATOR_PREFIXES):
            continue
        guest = guest_units(text)
        if guest is not None:
            if guest not in named.guests:
                named.guests.append(guest)
            continue
        for prefix, globs in ((CONTAINER, named.containers), (SUPERVISOR, named.programs)):
            if text.startswith(prefix):
                glob = text[len(prefix):].strip()
                if glob and glob not in globs:
                    globs.append(glob)
                break
        else:
            named.units.append(item)
    return named
