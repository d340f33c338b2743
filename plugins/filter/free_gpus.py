# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Filters of the free_gpus role and playbook: one host's outcome, and the fleet summary."""

from __future__ import annotations

from collections.abc import Mapping

from ansible.errors import AnsibleError, AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.module_utils._health import CHECKS

# Summary order: what needs the operator's eyes first.
_STATUS_ORDER = {"unreachable": 0, "failed": 1, "unhealthy": 1, "dirty": 2, "stopped": 3, "would free": 3, "freed": 4, "clean": 5}


def _selected(result):
    selected = set(result.get("selected_gpus") or [])
    return [g for g in result.get("gpus") or [] if not selected or g.get("index") in selected]


def _mib(gpus):
    values = [g.get("memory_used_mib") for g in gpus]
    return None if not values or any(v is None for v in values) else sum(values)


def _container(entry):
    """A stopped_containers entry of gpu_release -> `vllm (vllm/vllm-openai:v0.11.0)`."""
    name = entry.get("name") or str(entry.get("id") or "?")[:12]
    return "{} ({})".format(name, entry["image"]) if entry.get("image") else name


def _footprint_note(outcome):
    gpus = outcome.get("footprint_gpus") or []
    return "GPU{} {} ({} MiB)".format("" if len(gpus) == 1 else "s", ",".join(str(g) for g in gpus), outcome.get("footprint_mib"))


def _spanning(result):
    """gpu_release's `spanning` -> what the summary shows of each: who, and the GPUs it uses."""
    found = []
    for entry in result.get("spanning") or []:
        if isinstance(entry, Mapping):
            found.append({key: entry.get(key) for key in ("pid", "name", "unit", "container", "gpu_indexes", "outside_gpus")})
    return found


def _spanning_note(spanning):
    """`pid 700 python3 uses GPUs 0,1`, `vllm.service uses GPUs 0,1`, one per entry."""
    notes = []
    for entry in spanning:
        who = ("pid {} {}".format(entry["pid"], entry.get("name") or "?") if entry.get("pid") is not None
               else entry.get("unit") or "container {}".format(str(entry.get("container") or "?")[:12]))
        notes.append("{} uses GPUs {}".format(who, ",".join(str(i) for i in entry.get("gpu_indexes") or [])))
    return ", ".join(notes)


def _health_problems(result):
    """The gpu_release result's health issues, or a sentence when it has no health verdict."""
    if result.get("healthy") is True:
        return []
    return list(result.get("health_issues") or []) or ["GPU health unknown (gpu_release read no health)"]


def _unchecked(result):
    """The health checks that could not run on some GPU (each GPU's health_unchecked), in docs order."""
    names = set(name for g in result.get("gpus") or [] if isinstance(g, Mapping) for name in g.get("health_unchecked") or [])
    return sorted(names, key=lambda name: (CHECKS.index(name) if name in CHECKS else len(CHECKS), name))


def _smoke_notes(gpus):
    """'smoke test passed on 2 GPUs (1024 MiB each, 0.41 s)' and each GPU skipped, with why."""
    records = [(g.get("index"), g["smoke_test"]) for g in gpus if isinstance(g.get("smoke_test"), Mapping)]
    passed = [r for _i, r in records if r.get("ok") is True]
    notes = []
    if passed:
        notes.append("smoke test passed on %d GPU%s (%s MiB, %s s)" % (
            len(passed), "" if len(passed) == 1 else "s", "/".join(sorted(set(str(r.get("mib")) for r in passed))),
            round(sum(r.get("seconds") or 0 for r in passed), 3)))
    notes.extend("smoke test skipped on GPU {}: {}".format(i, r.get("skipped")) for i, r in records if r.get("ok") is None)
    return notes


def free_gpus_outcome(result, host, expected_count=0, check_mode=False, require_healthy=False):
    """A gpu_release result -> the `free_gpus_result` fact: status, MiB before/after, a message."""
    if not isinstance(result, Mapping):
        raise AnsibleFilterError(f"free_gpus_outcome expects the registered result of zeromib.gpu.gpu_release, got {type(result).__name__}")
    expected_count = int(expected_count or 0)
    before = [g for g in result.get("gpus_before") or [] if not result.get("selected_gpus") or g.get("index") in result["selected_gpus"]]
    after = _selected(result)
    count = len(result.get("gpus") or [])
    killed = result.get("killed") or []
    outcome = {
        "host": host,
        "count": count,
        "selected": result.get("selected_gpus") or [],
        "mib_before": _mib(before),
        "mib_after": _mib(after),
        "stopped_units": result.get("stopped_units") or [],
        "disabled_units": result.get("disabled_units") or [],
        "masked_units": result.get("masked_units") or [],
        "stopped_containers": [_container(c) for c in result.get("stopped_containers") or []],
        "disabled_containers": [_container(c) for c in result.get("disabled_containers") or []],
        "killed": [{"pid": k.get("pid"), "name": k.get("name"), "signal": k.get("signal"), "container": k.get("container")} for k in killed],
        "protected": result.get("protected") or [],
        "spanning": _spanning(result),
        # Selected GPUs that read only the cross-GPU footprint of contexts on other GPUs (clean),
        # and the NVML clients (monitors, exporters) left running: they use no GPU memory.
        "footprint_gpus": [g.get("index") for g in after if g.get("cross_gpu_footprint")],
        "footprint_mib": _mib([g for g in after if g.get("cross_gpu_footprint")]),
        "nvml_clients": [{"pid": h.get("pid"), "name": h.get("name")} for h in result.get("holders") or []
                         if isinstance(h, Mapping) and h.get("attribution") == "nvml_client"],
        "elapsed_s": result.get("elapsed_s"),
        "check_mode": bool(check_mode),
    }
    problems = []
    # gpu_release fails with a verdict (GPUs read dirty) or before one (nvidia-smi broken, bad option).
    # A result without `released` is a failure even when failed_when cleared its flag.
    status = "dirty"
    if result.get("failed") or "released" not in result:
        problems.append(result.get("msg") or "gpu_release failed")
        if not result.get("gpus"):
            status = "failed"
    elif result.get("released") is False and not outcome["check_mode"]:
        dirty = ["GPU {} reads {} MiB".format(g.get("index"), g.get("memory_used_mib")) for g in after if not g.get("clean")]
        problems.append("not released: " + ", ".join(dirty))
    if expected_count and count != expected_count:
        problems.append("expected %d GPUs, nvidia-smi shows %d: a GPU may have fallen off the bus" % (expected_count, count))
        status = "failed"
    outcome["healthy"] = result.get("healthy")
    outcome["health_issues"] = list(result.get("health_issues") or [])
    outcome["health_unchecked"] = _unchecked(result)
    # Health is read, never changed: a dry run reports an unhealthy GPU as the real run would.
    if require_healthy and result.get("gpus") and _health_problems(result):
        problems.append("unhealthy: " + "; ".join(_health_problems(result)))
        if status == "dirty" and not problems[:-1]:
            status = "unhealthy"
    outcome["smoke_test_passed"] = result.get("smoke_test_passed")
    outcome["smoke_test_issues"] = list(result.get("smoke_test_issues") or [])
    # A GPU that failed the CUDA smoke test is not ready, however free it reads.
    if result.get("smoke_test_passed") is False:
        problems.append("smoke test failed: " + "; ".join(outcome["smoke_test_issues"] or ["(no detail)"]))
        if status == "dirty" and not problems[:-1]:
            status = "unhealthy"
    if problems:
        outcome["status"] = status
        outcome["ok"] = False
        outcome["message"] = "{}: {}".format(host, "; ".join(problems))
        return outcome
    outcome["ok"] = True
    did = []
    if outcome["stopped_units"]:
        did.append("stopped " + ", ".join(outcome["stopped_units"]))
    if outcome["disabled_units"]:
        did.append("disabled " + ", ".join(outcome["disabled_units"]))
    if outcome["masked_units"]:
        did.append("masked " + ", ".join(outcome["masked_units"]))
    if outcome["stopped_containers"]:
        did.append("stopped container{} {}".format("" if len(outcome["stopped_containers"]) == 1 else "s", ", ".join(outcome["stopped_containers"])))
    if outcome["disabled_containers"]:
        did.append("disabled container{} {}".format("" if len(outcome["disabled_containers"]) == 1 else "s", ", ".join(outcome["disabled_containers"])))
    if killed:
        did.append("killed %d process%s" % (len(killed), "" if len(killed) == 1 else "es"))
    if outcome["spanning"]:
        did.append("ended spanning {} (kill_spanning)".format(_spanning_note(outcome["spanning"])))
    if outcome["footprint_gpus"]:
        did.append(f"{_footprint_note(outcome)} at the cross-GPU footprint")
    outcome["smoke_test_notes"] = _smoke_notes(after)
    did.extend(outcome["smoke_test_notes"])
    if outcome["nvml_clients"]:
        did.append("%d NVML client%s left running" % (len(outcome["nvml_clients"]), "" if len(outcome["nvml_clients"]) == 1 else "s"))
    changed = bool(result.get("changed"))
    outcome["status"] = ("would free" if result.get("released") is False or changed else "clean") if outcome["check_mode"] else (
        "freed" if changed else "clean")
    outcome["message"] = "%s: %d GPU%s %s (%s -> %s MiB)%s in %s s" % (
        host,
        len(after),
        "" if len(after) == 1 else "s",
        "free" if not outcome["check_mode"] else outcome["status"],
        outcome["mib_before"],
        outcome["mib_after"],
        ", " + ", ".join(did) if did else "",
        outcome["elapsed_s"],
    )
    if outcome["health_unchecked"]:
        # Said aloud: a check that could not run is no proof of health (docs/health.md).
        outcome["message"] += "; not checked on this driver or GPU: " + ", ".join(outcome["health_unchecked"])
    return outcome


def free_gpus_failed(host, message, status="failed"):
    """The `free_gpus_result` of a host that failed before gpu_release gave a result (a bad
    variable, a template error): no GPU figures, the message."""
    message = " ".join(str(message).split("\n"))
    return {
        "host": host, "status": status, "ok": False, "message": message if message.startswith(f"{host}: ") else f"{host}: {message}",
        "count": None, "selected": [], "mib_before": None, "mib_after": None, "stopped_units": [], "disabled_units": [],
        "masked_units": [], "stopped_containers": [], "disabled_containers": [], "killed": [], "protected": [],
        "footprint_gpus": [], "footprint_mib": None, "nvml_clients": [], "elapsed_s": None, "check_mode": False,
        "healthy": None, "health_issues": [],
    }


GATE_ACTIONS = ("zeromib.gpu.free_gpus_gate", "free_gpus_gate")


def _failed_in_gate(failed_task):
    return isinstance(failed_task, Mapping) and failed_task.get("action") in GATE_ACTIONS


def free_gpus_rescued(failed_result, host, own_result=None, failed_task=None, hostvars=None, play_hosts_all=None, play_hosts=None):
    """The role's rescue -> this host's `free_gpus_result`.

    A host whose gate failed: the outcome the gate returned (a failed task keeps no facts), or one
    made from its message. A host whose gate passed is here because another host failed under
    any_errors_fatal (or max_fail_percentage): its own outcome, with `stopped_by` naming the
    hosts that failed and a message saying so."""
    if isinstance(failed_result, Mapping) and (failed_task is None or _failed_in_gate(failed_task)):
        outcome = (failed_result.get("ansible_facts") or {}).get("free_gpus_result")
        message = failed_result.get("msg") or "free_gpus failed"
        if isinstance(outcome, Mapping) and outcome.get("host") == host:
            outcome = dict(outcome)
            outcome["ok"] = False
            outcome["message"] = outcome.get("message") or message
            return outcome
        return free_gpus_failed(host, message)
    failed = []
    missing = []
    hostvars = hostvars if hostvars is not None else {}
    live = set(play_hosts or [])
    for other in play_hosts_all or []:
        if other == host:
            continue
        try:
            variables = hostvars[other]
            task = variables.get("ansible_failed_task")
            result = variables.get("free_gpus_result")
        except (KeyError, AttributeError, TypeError):
            task, result = None, None
        if _failed_in_gate(task):
            failed.append(other)
        elif other not in live and not isinstance(result, Mapping):
            missing.append(other)
    outcome = dict(own_result) if isinstance(own_result, Mapping) else free_gpus_failed(host, "stopped", "stopped")
    outcome["stopped_by"] = failed or missing
    if failed:
        why = "{} failed".format(", ".join(failed))
    elif missing:
        why = "{} failed or {} unreachable".format(", ".join(missing), "was" if len(missing) == 1 else "were")
    else:
        why = "another host failed or was unreachable (see the recap)"
    own = "its GPUs are free" if outcome.get("ok") else "it was not checked"
    outcome["message"] = f"{host}: {own}, but the play stops here because {why} (any_errors_fatal)"
    outcome["status"] = "stopped"
    return outcome


def _outcomes(data, hosts, live=None):
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
                outcome = free_gpus_failed(host, failure)
            found.append(outcome)
        return found
    return list(data or [])


def _note(outcome):
    """Why an OK host reads above 0 MiB, and what was left running on purpose."""
    notes = []
    if outcome.get("footprint_gpus"):
        notes.append(f"{_footprint_note(outcome)}: cross-GPU footprint")
    if outcome.get("spanning"):
        notes.append("spanning: {}".format(_spanning_note(outcome["spanning"])))
    clients = outcome.get("nvml_clients") or []
    if clients:
        notes.append("%d NVML client%s kept" % (len(clients), "" if len(clients) == 1 else "s"))
    if outcome.get("health_unchecked"):
        notes.append("not checked: " + ", ".join(outcome["health_unchecked"]))
    notes.extend(outcome.get("smoke_test_notes") or [])
    return "; ".join(notes)


def free_gpus_summary(data, hosts=None, live=None):
    """Outcomes, or hostvars, -> fleet summary lines, worst first. A host of `hosts` without an
    outcome (unreachable, or failed before gpu_release ran) is listed too; `live`: see _outcomes."""
    rows = []
    by_host = {}
    for outcome in _outcomes(data, hosts, live):
        if isinstance(outcome, Mapping) and outcome.get("host"):
            by_host[outcome["host"]] = outcome
    for host in hosts or sorted(by_host):
        outcome = by_host.get(host)
        if outcome is None:
            rows.append(("unreachable", host, "-", "-", "-", "-", "-", "unreachable, or failed before gpu_release ran"))
            continue
        killed = outcome.get("killed") or []
        changed_state = {u: "disabled" for u in outcome.get("disabled_units") or []}
        changed_state.update({u: "masked" for u in outcome.get("masked_units") or []})
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
            str(len(killed)) if killed else "-",
            "{} s".format(outcome.get("elapsed_s")) if outcome.get("elapsed_s") is not None else "-",
            _note(outcome) if outcome.get("ok") else outcome.get("message", ""),
        ))
    rows.sort(key=lambda r: (_STATUS_ORDER.get(r[0], 1), r[1]))
    header = ("STATUS", "HOST", "GPUS", "MIB BEFORE -> AFTER", "UNITS/CONTAINERS STOPPED", "KILLED", "TIME", "")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(7)]
    lines = []
    for row in [header] + rows:
        line = "  ".join(str(cell).ljust(widths[i]) for i, cell in enumerate(row[:7]))
        if row[7]:
            line += "  " + row[7]
        lines.append(line.rstrip())
    totals = {}
    for row in rows:
        totals[row[0]] = totals.get(row[0], 0) + 1
    lines.append("%d host%s: %s" % (len(rows), "" if len(rows) == 1 else "s", ", ".join("%d %s" % (n, s) for s, n in sorted(
        totals.items(), key=lambda item: _STATUS_ORDER.get(item[0], 1)))))
    return lines


class FilterModule:
    def filters(self):
        return {"free_gpus_outcome": free_gpus_outcome, "free_gpus_summary": free_gpus_summary, "free_gpus_rescued": free_gpus_rescued}
