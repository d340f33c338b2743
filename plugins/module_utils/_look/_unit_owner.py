# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Which unit of the host's systemd a holder runs in, as systemd says it.

A cgroup path is partly written by tenants: below a unit with `Delegate=yes` (and `User=`), or a
user's manager (`user@UID.service`), its user creates and names directories at will
(`.../lab-alice.service/networking.service`), and so does a container's root below the unit it
runs in (`systemd-nspawn --keep-unit`: `.../lab-box.service/payload/system.slice/networking.service`,
root-owned). A name there decides nothing (docs/docsite/rst/guide_security.rst, "Which unit a
process belongs to").

systemd's own tree holds a unit only in a slice, never in another unit: the unit of a process is
the first `*.service` or `*.scope` of its path from the root (_holders.unit_of), whatever lies
below it is that unit's (a delegated subtree is a boundary, like a guest's). `confirm` asks
systemd once for every unit the look's holders claim and keeps a claim only where the unit's
`ControlGroup=` is that very directory: a path made outside systemd (a directory root made and
gave to a user, anywhere) names no unit. Asked only where a look found holders: a clean host runs
no systemctl for it.
"""

from __future__ import annotations

import re
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    Systemctl = t.Callable[[t.List[str]], t.Tuple[int, str, str]]

# A unit name as systemd writes it (unit-name.h: ASCII letters, digits, ":-_.\" and the "@" of a
# template's instance; 255 characters at most), the only names asked: anything else is no unit.
_UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.\\@-]{1,247}\.(?:service|scope)$")
# At most this many units in one systemctl call (a node runs a few units with GPU holders; the
# rest read as no unit, which stops nothing).
ASK_AT_MOST = 64
# systemctl show answers in milliseconds; a systemd that does not answer confirms nothing.
SHOW_TIMEOUT_S = 10.0


def valid_name(unit: str) -> bool:
    return bool(_UNIT_NAME.match(unit)) and not unit.startswith("-")


def claimed_cgroup(cgroup_path: str | None, unit: str) -> str | None:
    """The directory of `cgroup_path` named `unit` (its first such directory, as unit_of reads it):
    what systemd's ControlGroup= of that unit must be."""
    parts = (cgroup_path or "").split("/")
    if unit not in parts:
        return None
    return "/".join(parts[: parts.index(unit) + 1])


def parse_control_groups(text: str) -> dict[str, str]:
    """`systemctl show --property=Id,ControlGroup U...` -> {Id: ControlGroup}; "" for a unit
    without a cgroup (inactive, not found)."""
    found: dict[str, str] = {}
    current: dict[str, str] = {}
    for line in text.split("\n") + [""]:
        if not line.strip():
            if current.get("Id"):
                found[current["Id"]] = current.get("ControlGroup", "")
            current = {}
            continue
        key, _sep, value = line.partition("=")
        current[key] = value
    return found


def ask(units: t.Iterable[str], systemctl: Systemctl | None = None, known: dict[str, str] | None = None) -> dict[str, str]:
    """{unit: its ControlGroup= ("" where systemd gives none or does not answer)} for `units`,
    from `known` where it has them (a unit's cgroup is its name's directory as long as it runs:
    one call per run is enough), else from one `systemctl show`; `known` gets the answers."""
    known = {} if known is None else known
    todo = [unit for unit in dict.fromkeys(units) if unit not in known]
    asked = [unit for unit in todo if valid_name(unit)][:ASK_AT_MOST]
    found: dict[str, str] = {}
    if asked:
        args = ["show", "--property=Id,ControlGroup", "--no-pager", "--"] + asked
        if systemctl is None:
            rc, out, _err = _commands.systemctl(_commands.which("systemctl"), args, SHOW_TIMEOUT_S)
        else:
            rc, out, _err = systemctl(args)
        found = parse_control_groups(out) if rc == 0 else {}
    for unit in todo:
        known[unit] = found.get(unit, "")
    return known


def confirm(holders: list[Holder], systemctl: Systemctl | None = None, known: dict[str, str] | None = None) -> list[Holder]:
    """Each holder's `unit` kept only where systemd's ControlGroup= of that unit is the directory
    of the holder's cgroup path it names; otherwise `unit` None and `system_service` False: no
    unit is stopped for it, no unit is advised (the holder is an ordinary process). `systemctl`:
    the run's (System.systemctl), else the node's; `known`: answers of earlier calls of the run."""
    claims = [h.get("unit") or "" for h in holders if h.get("unit")]
    if not claims:
        return holders
    groups = ask(claims, systemctl, known)
    for holder in holders:
        unit = holder.get("unit")
        if not unit:
            continue
        path = claimed_cgroup(holder.get("cgroup"), unit)
        if path is None or groups.get(unit) != path:
            holder["unit"] = None
            holder["system_service"] = False
    return holders
