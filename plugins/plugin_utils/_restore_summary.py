# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""restore_gpus.yml's fleet summary: each host's restore_gpus_result -> one line each, worst first,
as free_gpus.yml's summary is (the restore_gpus_summary filter)."""

from __future__ import annotations

import typing as t
from collections.abc import Mapping

_ORDER = {"unreachable": 0, "failed": 1, "would put back": 2, "put back": 3, "nothing": 4}


def restored_text(result: t.Mapping[str, t.Any]) -> str:
    """What a host got back: `unit vllm.service (start), container tgi (restart policy, start)`."""
    return ", ".join("{} {} ({})".format(entry.get("kind") or "", entry.get("name") or "?", ", ".join(entry.get("steps") or []))
                     for entry in result.get("restored") or [] if isinstance(entry, Mapping))


def host_row(host: str, result: t.Any, check_mode: bool) -> tuple[str, str, str]:
    """(status, host, what): one host of the play."""
    if not isinstance(result, Mapping):
        return ("unreachable", host, "unreachable, or failed before gpu_restore ran: see Ansible's line for it above")
    # restore_failed: under restore_gpus.yml a failed restore is said here first (plugins/action/gpu_restore.py).
    if result.get("failed") or result.get("restore_failed"):
        return ("failed", host, "restore failed: " + " ".join(str(result.get("msg") or "").split()))
    done = restored_text(result)
    if not done:
        return ("nothing", host, "-")
    return ("would put back" if check_mode else "put back", host, done)


def summary_lines(results: t.Mapping[str, t.Any], hosts: t.Iterable[str], check_mode: bool = False) -> list[str]:
    rows = sorted((host_row(host, results.get(host), check_mode) for host in hosts), key=lambda row: (_ORDER.get(row[0], 1), row[1]))
    header = ("STATUS", "HOST", "PUT BACK")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(2)]
    lines = ["  ".join((row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2])).rstrip() for row in [header, *rows]]
    totals: dict[str, int] = {}
    for row in rows:
        totals[row[0]] = totals.get(row[0], 0) + 1
    lines.append("{} host{}: {}".format(len(rows), "" if len(rows) == 1 else "s", ", ".join(
        f"{n} {status}" for status, n in sorted(totals.items(), key=lambda item: _ORDER.get(item[0], 1)))))
    return lines
