# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""free_gpus.yml's fleet summary: every host's outcome -> one line each, worst first (the
free_gpus_summary filter and the free_gpus_summary action)."""

from __future__ import annotations

import typing as t
from collections.abc import Mapping

from ansible.errors import AnsibleError

from ansible_collections.zeromib.gpu.plugins.plugin_utils._fleet_proof import summary_line as fleet_proof_line
from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import (
    asleep_note, clients_with_units, failed, footprint_note, planned_signals, same_mistake_message, same_mistakes, shm_kept_note, shm_note,
    spanning_note,
)

# Summary order: what needs the operator's eyes first.
_STATUS_ORDER = {"unreachable": 0, "failed": 1, "back": 1, "invalid": 1, "unhealthy": 1, "dirty": 2, "stopped": 3, "would free": 3, "freed": 4, "clean": 5}


def _outcomes(data: t.Any, hosts: t.Iterable[str] | None, live: t.Container[str] | None = None) -> list[t.Any]:
    """A list of outcomes, or hostvars (a mapping of host to its variables). From hostvars only
    the hosts of `live` (the play's hosts left: with fact caching, an unreachable host would show
    its cached result of an earlier run) are read; a host that failed without an outcome of this
    run (`_free_gpus_failure` set by free_gpus.yml's rescue) gets one from that message."""
    if isinstance(data, Mapping):
        found = []
        for host in hosts or []:
            if live is not None and host not in live:
                continue
            try:
                variables = data[host]
                outcome = variables.get("free_gpus_result")
                failure = variables.get("_free_gpus_failure")
            except (KeyError, AttributeError, AnsibleError):
                continue
            if failure and not (isinstance(outcome, Mapping) and outcome.get("host") == host and not outcome.get("ok")):
                outcome = failed(host, failure)
            found.append(outcome)
        return found
    return list(data or [])


def _note(outcome: t.Mapping[str, t.Any]) -> str:
    """Why an OK host reads above 0 MiB, and what was left running on purpose."""
    notes = []
    if outcome.get("footprint_gpus"):
        notes.append(f"{footprint_note(outcome)}: cross-GPU footprint")
    if outcome.get("spanning"):
        notes.append("spanning: {}".format(spanning_note(outcome["spanning"])))
    if outcome.get("multi_node"):
        notes.append("multi-node: {}".format("; ".join(outcome["multi_node"])))
    if outcome.get("check_mode") and outcome.get("killed"):
        notes.append(planned_signals(outcome["killed"]))
    elif asleep_note(outcome.get("killed") or []):
        # What a killed holder's own vLLM server said of its sleep, quoted (its word, gpu_release's sleep_answer).
        notes.append("killed " + asleep_note(outcome.get("killed") or []))
    if outcome.get("shm_removed"):
        notes.append(shm_note(outcome))
    if outcome.get("shm_kept"):
        notes.append(shm_kept_note(outcome))
    if outcome.get("nvml_clients_with_units"):
        notes.append(clients_with_units(outcome["nvml_clients_with_units"]))
    clients = outcome.get("nvml_clients") or []
    if clients:
        notes.append("{} NVML client{} kept".format(len(clients), "" if len(clients) == 1 else "s"))
    if outcome.get("health_unchecked"):
        notes.append("not checked: " + ", ".join(outcome["health_unchecked"]))
    notes.extend(outcome.get("smoke_test_notes") or [])
    return "; ".join(notes)


def unreachable_message(host: str, said: t.Any = None) -> str:
    """The line of a host with no outcome of this run, quoting what Ansible said of it (the gate's
    registered result of an unreachable host holds the SSH error) where there is something."""
    text = " ".join(str(said).split()) if said else ""
    if text:
        return f"{host}: unreachable, or failed before gpu_release ran: {text}"
    return (f"{host}: unreachable, or failed before gpu_release ran: the SSH error is in Ansible's UNREACHABLE (or fatal) "
            f"line for {host} above")


def summary_lines(data: t.Any, hosts: t.Sequence[str] | None = None, live: t.Container[str] | None = None,
                  said: t.Mapping[str, t.Any] | None = None) -> list[str]:
    """Outcomes, or hostvars, -> fleet summary lines, worst first. A host of `hosts` without an
    outcome (unreachable, or failed before gpu_release ran) is listed too, with what Ansible said
    of it where `said` has it; `live`: see _outcomes."""
    rows = []
    by_host = {}
    for outcome in _outcomes(data, hosts, live):
        if isinstance(outcome, Mapping) and outcome.get("host"):
            by_host[outcome["host"]] = outcome
    for host in hosts or sorted(by_host):
        outcome = by_host.get(host)
        if outcome is None:
            # Ansible keeps no fact of an unreachable host; the gate's registered result has its SSH error.
            rows.append(("unreachable", host, "-", "-", "-", "-", "-", unreachable_message(host, (said or {}).get(host))))
            continue
        killed = outcome.get("killed") or []
        changed_state = {u: "disabled" for u in outcome.get("disabled_units") or []}
        changed_state.update({u: "masked" for u in outcome.get("masked_units") or []})
        for unit in outcome.get("failed_units") or []:
            changed_state[unit] = changed_state[unit] + ", left failed" if unit in changed_state else "left failed"
        units = [f"{u} ({changed_state[u]})" if u in changed_state else u for u in outcome.get("stopped_units") or []]
        units += [f"{u} ({state})" for u, state in changed_state.items() if u not in (outcome.get("stopped_units") or [])]
        disabled = outcome.get("disabled_containers") or []
        units += ["container {}{}".format(c, " (disabled)" if c in disabled else "") for c in outcome.get("stopped_containers") or []]
        units += [f"container {c} (disabled)" for c in disabled if c not in (outcome.get("stopped_containers") or [])]
        rows.append((
            outcome.get("status", "failed"),
            host,
            "-" if outcome.get("count") is None else str(len(outcome.get("selected") or [])) + "/" + str(outcome["count"]),
            "-" if outcome.get("mib_before") is None and outcome.get("mib_after") is None else "{} -> {}".format(
                outcome.get("mib_before"), outcome.get("mib_after")),
            ", ".join(units) or "-",
            str(outcome.get("killed_count") or len(killed)) if killed else "-",
            "{} s".format(outcome.get("elapsed_s")) if outcome.get("elapsed_s") is not None else "-",
            _note(outcome) if outcome.get("ok") else outcome.get("message", ""),
        ))
    rows.sort(key=lambda r: (_STATUS_ORDER.get(r[0], 1), r[1]))
    # A settings mistake of the whole play is said once, on its first host's line.
    same = same_mistakes(by_host.get(row[1]) for row in rows)
    rows = [row[:7] + (same_mistake_message(by_host[row[1]], same[row[1]]),) if row[1] in same else row for row in rows]
    header = ("STATUS", "HOST", "GPUS", "MIB BEFORE -> AFTER", "UNITS/CONTAINERS STOPPED", "KILLED", "TIME", "")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(7)]
    lines = []
    for row in [header] + rows:
        line = "  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row[:7]))
        if row[7]:
            line += "  " + row[7]
        lines.append(line.rstrip())
    totals: dict[str, int] = {}
    for row in rows:
        totals[row[0]] = totals.get(row[0], 0) + 1
    # The unreachable hosts by name: they have left the play, and nothing after this line names them.
    gone = [row[1] for row in rows if row[0] == "unreachable"]
    lines.append("{} host{}: {}".format(len(rows), "" if len(rows) == 1 else "s", ", ".join(
        f"{n} {s}" + (" ({})".format(", ".join(gone)) if s == "unreachable" else "")
        for s, n in sorted(totals.items(), key=lambda item: _STATUS_ORDER.get(item[0], 1)))))
    # Issue 72: the one read after the last host was freed, only where some host was freed; the
    # totals stay the last line.
    proof = fleet_proof_line(by_host.values())
    if proof:
        lines.insert(len(lines) - 1, proof)
    return lines
