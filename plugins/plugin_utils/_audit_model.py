# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""The fleet audit's model (the gpu_audit_model filter, the gpu_audit_report action): host records ->
status, reasons, holders, health and counts. Documented in plugins/filter/gpu_audit_model.py."""

from __future__ import annotations

import re
import time
import typing as t
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.module_utils._act._ghost_busy import busy_with_nothing
from ansible_collections.zeromib.gpu.plugins.module_utils._options import baseline_with_margin


SCHEMA_VERSION = 1
_INPUT_STATUSES = {"ok": "ok", "error": "error", "failed": "error", "unreachable": "unreachable"}


def _natural_key(name: str) -> list[tuple[int, int, str]]:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part.lower()) for part in re.split(r"(\d+)", name)]


def _int_or_none(value: object) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return int(value)
    return None


def _pct(used: float | None, total: float | None) -> float | None:
    if used is None or not total:
        return None
    return round(100.0 * used / total, 1)


def _first_line(text: object) -> str:
    text = str(text or "").strip()
    line = text.splitlines()[0].strip() if text else ""
    # ansible-core 2.19 prefixes unreachable and module failures with this; the report says it already.
    return line[len("Task failed: "):] if line.startswith("Task failed: ") else line


_SECONDS_AGO = re.compile(r"\b(?:at )?(\d+(?:\.\d+)?) s ago\b")


def age_text(seconds: float | str) -> str:
    """7200 -> '2 h', 90 -> '90 s': the unit a person would say.

    The report's one age formatter. gpu_facts writes its Xid ages itself (module_utils/_look/_health.py's
    human_age: '2 h ago', switching units at 90 s, 90 min and 48 h, 'days'); human_ages rewrites
    only the 'at N s ago' of records saved before that, so the two never format the same text."""
    seconds = float(seconds)
    if seconds < 120:
        return f"{round(seconds)} s"
    if seconds < 120 * 60:
        return f"{round(seconds / 60)} min"
    if seconds < 72 * 3600:
        return f"{round(seconds / 3600)} h"
    return f"{round(seconds / 86400)} d"


def human_ages(text: object) -> str:
    """'... in the kernel log at 7200 s ago' (a dmesg Xid) -> '... in the kernel log 2 h ago'."""
    return _SECONDS_AGO.sub(lambda m: f"{age_text(m.group(1))} ago", str(text))


def _container_label(holder: t.Mapping[str, t.Any]) -> str | None:
    """`vllm (vllm/vllm-openai:v0.11.0)`, or the short id where the runtime could not be asked; the pod first."""
    cid = holder.get("container")
    name, image = holder.get("container_name"), holder.get("container_image")
    label = name or (str(cid)[:12] if cid else None)
    if label and image:
        label = f"{label} ({image})"
    pod = holder.get("pod") or ("UID {}".format(holder["pod_uid"]) if holder.get("pod_uid") else None)
    if pod:
        label = "pod {}{}".format(pod, ": " + label if label else "")
    return label


_GUEST_WORDS = {"lxc": "LXC guest", "lxd": "LXD guest", "nspawn": "nspawn guest"}


def _guest_label(holder: t.Mapping[str, t.Any]) -> str | None:
    """`LXC guest 101: vllm.service` for a holder in a system container seen from the host, else None."""
    guest = holder.get("guest")
    if not isinstance(guest, Mapping) or not guest.get("name"):
        return None
    label = "{} {}".format(_GUEST_WORDS.get(str(guest.get("kind")), "guest"), guest["name"])
    return "{}: {}".format(label, guest["unit"]) if guest.get("unit") else label


def _gpu_records(host: str, facts: t.Mapping[str, t.Any]) -> tuple[list[dict[str, t.Any]], list[dict[str, t.Any]], list[dict[str, t.Any]]]:
    holders = []
    mib_by_pid: dict[t.Any, int] = {}
    for proc in facts.get("processes") or []:
        if isinstance(proc, Mapping) and proc.get("alive", True) and _int_or_none(proc.get("used_memory_mib")) is not None:
            mib_by_pid[proc.get("pid")] = mib_by_pid.get(proc.get("pid"), 0) + int(proc["used_memory_mib"])
    for holder in facts.get("holders") or []:
        if not isinstance(holder, Mapping):
            continue
        record = dict(holder)
        record["host"] = host
        record["gpu_indexes"] = list(record.get("gpu_indexes") or [])
        record["protected"] = bool(record.get("protected"))
        record["used_memory_mib"] = mib_by_pid.get(record.get("pid"))
        record["nvml_client"] = record.get("attribution") == "nvml_client"
        uses = bool(record["gpu_indexes"]) or record.get("attribution") in ("undecided", "blocked")
        record["blocking"] = uses and not record["nvml_client"] and not record["protected"]
        # Freeing a subset of its GPUs refuses it (gpu_release's kill_spanning): worth a note.
        record["spanning"] = len(set(record["gpu_indexes"])) > 1
        record["container_label"] = _container_label(record)
        record["guest_label"] = _guest_label(record)
        holders.append(record)
    holders.sort(key=lambda h: (not h["blocking"], h["gpu_indexes"][:1] or [1 << 30], h.get("pid") or 0))

    stale = [dict(p, host=host) for p in facts.get("processes") or [] if isinstance(p, Mapping) and p.get("alive") is False]

    gpus = []
    for gpu in facts.get("gpus") or []:
        if not isinstance(gpu, Mapping):
            continue
        record = dict(gpu)
        record["host"] = host
        used = _int_or_none(record.get("memory_used_mib"))
        total = _int_or_none(record.get("memory_total_mib"))
        record["used_pct"] = _pct(used, total)
        record["clean"] = bool(record.get("clean"))
        record["cross_gpu_footprint"] = bool(record.get("cross_gpu_footprint"))
        record.update(_gpu_health(record))
        record["smoke_test"] = _smoke_test(record)
        index = record.get("index")
        # Busy with no process and no memory: what a process killed mid-kernel can leave (issue 71).
        record["ghost_busy"] = busy_with_nothing(record, holders) and not any(
            p.get("alive", True) for p in facts.get("processes") or [] if isinstance(p, Mapping) and p.get("gpu_index") == index)
        record["holders"] = [h for h in holders if index in h["gpu_indexes"]][:HOST_HOLDERS]
        record["processes"] = [
            dict(p) for p in facts.get("processes") or []
            if isinstance(p, Mapping) and (p.get("gpu_uuid") == record.get("uuid") or (p.get("gpu_uuid") is None and p.get("gpu_index") == index))
        ]
        gpus.append(record)
    gpus.sort(key=lambda g: (_int_or_none(g.get("index")) is None, _int_or_none(g.get("index")) or 0))
    return gpus, holders, stale


def _gpu_health(gpu: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """Health columns of one GPU: healthy (None when gpu_facts read no health), its issues,
    uncorrected ECC errors and the number of recent Xids."""
    raw_health = gpu.get("health")
    health: t.Mapping[str, t.Any] = raw_health if isinstance(raw_health, Mapping) else {}
    healthy = gpu.get("healthy")
    checked = gpu.get("health_checked")
    return {
        "healthy": None if healthy is None else bool(healthy),
        # Which checks could not run on this GPU (gpu_facts' health_unchecked); None without health,
        # or in saved records from before health_checked.
        "health_checked": None if healthy is None or checked is None else bool(checked),
        "health_issues": [human_ages(issue) for issue in gpu.get("health_issues") or []],
        "ecc_uncorrected": _int_or_none(health.get("ecc_uncorrected_volatile")),
        "xid_recent": len(health.get("xids") or []) if health else None,
        "health_unchecked": [str(name) for name in gpu.get("health_unchecked") or []],
    }


def _unchecked_notes(gpu: t.Mapping[str, t.Any]) -> list[str]:
    """What could not be checked on one GPU: gpu_facts' check names (health_unchecked) where it
    gives them, else its notes (health.unchecked)."""
    names = gpu.get("health_unchecked")
    if names:
        return [str(name) for name in names]
    raw_health = gpu.get("health")
    health: t.Mapping[str, t.Any] = raw_health if isinstance(raw_health, Mapping) else {}
    return [str(note) for note in health.get("unchecked") or []]


def _health_reason(record: t.Mapping[str, t.Any]) -> str | None:
    """The host's health issues, then what was not checked, grouped by GPU; None when all is well."""
    # gpu_facts gives the host's list (every GPU's issues, then DCGM's); saved records may carry
    # only the GPUs' own.
    parts = list(record["health_issues"]) or [
        "GPU {} ({}): {}".format(g.get("index"), g.get("pci_bus_id"), issue) for g in record["gpus"] for issue in g["health_issues"]]
    by_notes: dict[str, list[str]] = {}
    for gpu in record["gpus"]:
        if gpu["health_checked"] is False:
            notes = ", ".join(_unchecked_notes(gpu)) or "some checks"
            by_notes.setdefault(notes, []).append(str(gpu.get("index")))
    for notes, indexes in by_notes.items():
        parts.append("health not checked on GPU {}: {}".format(", ".join(indexes), notes))
    return "; ".join(parts) or None


def _ghost_busy(gpus: list[dict[str, t.Any]]) -> list[str]:
    """One line per GPU that reads busy with no process: what it reads, and what clears it."""
    return ["GPU {} ({}): {} % busy at {} W with no process and no memory (ghost-busy, as a process killed mid-kernel leaves it); "
            "opening and closing a CUDA context on it from a fresh process clears it (gpu_release does after its kills), "
            "else reset it (nvidia-smi -r -i {})".format(g.get("index"), g.get("pci_bus_id"), g.get("utilization_gpu_pct"),
                                                         _watts(g.get("power_draw_w")), g.get("index"))
            for g in gpus if g["ghost_busy"]]


def _watts(value: t.Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


def _smoke_test(gpu: t.Mapping[str, t.Any]) -> dict[str, t.Any] | None:
    """The GPU's last CUDA smoke test (gpu_facts with smoke_test), with a one-word `result`
    (passed, FAILED, skipped); None when the facts carry none."""
    test = gpu.get("smoke_test")
    if not isinstance(test, Mapping):
        return None
    result = "passed" if test.get("ok") is True else "FAILED" if test.get("ok") is False else "skipped"
    return dict(test, result=result)


def _dirty_reason(gpus: list[dict[str, t.Any]], holders: list[dict[str, t.Any]], stale: list[dict[str, t.Any]], inside_container: bool = False) -> str:
    parts = []
    dirty = [g for g in gpus if not g["clean"]]
    if len(dirty) > 3:
        used = sum(g.get("memory_used_mib") or 0 for g in dirty)
        parts.append("{} GPUs ({}) {} MiB in all".format(len(dirty), ", ".join(str(g.get("index")) for g in dirty), int(used)))
    elif dirty:
        parts.append(", ".join(
            "GPU {} {} MiB".format(g.get("index"), "?" if g.get("memory_used_mib") is None else g.get("memory_used_mib")) for g in dirty
        ))
    blocking = [h for h in holders if h["blocking"]]
    if blocking:
        # One line per owner: eight vLLM workers of one unit read as the unit, not eight PIDs.
        owners: dict[str, list[dict[str, t.Any]]] = {}
        for h in blocking:
            owner = h.get("unit") or h.get("guest_label") or ("container {}".format(h["container_label"]) if h.get("container_label") else None)
            owners.setdefault(owner or "pid {}".format(h.get("pid")), []).append(h)
        shown = []
        for owner, members in owners.items():
            spans = sorted(set(g for h in members if h.get("spanning") for g in h["gpu_indexes"]))
            note = " uses GPUs {}".format(",".join(str(g) for g in spans)) if spans else ""
            if owner.startswith("pid "):
                shown.append("{} {}{}".format(members[0].get("pid"), members[0].get("name") or "?", note))
            elif len(members) == 1:
                shown.append("{} {} ({}){}".format(members[0].get("pid"), members[0].get("name") or "?", owner, note))
            else:
                shown.append(f"{owner} ({len(members)} processes){note}")
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        parts.append("held by " + ", ".join(shown[:3]) + more)
    # An idle MIG baseline is said as such, also inside a container (the same advice as the role's).
    advice = _baseline_advice(dirty, blocking, stale)
    if stale and not blocking and inside_container:
        # A container sees no process of the host or of the other guests that share its GPUs.
        parts.append("memory counted for PID {}, not in this container: held outside it (the host or another guest)? look on the host".format(
            ", ".join(str(p.get("pid")) for p in stale[:3])))
    elif stale and not blocking:
        parts.append("memory counted for gone PID {}".format(", ".join(str(p.get("pid")) for p in stale[:3])))
    elif dirty and not blocking and inside_container and not advice:
        parts.append("no process in this container holds it: held outside it (the host or another guest)? look on the host")
    if advice:
        parts.append(advice)
    return "; ".join(parts) or "gpu_facts reports the host not clean"


# MIG GPUs read 50-59 MiB with nothing on them (docs/docsite/rst/guide_troubleshooting.rst); past this it is no baseline.
_IDLE_BASELINE_MIB = 256


def _baseline_advice(dirty: list[dict[str, t.Any]], blocking: list[dict[str, t.Any]], stale: list[dict[str, t.Any]]) -> str | None:
    """A dirty GPU in MIG mode that no process holds and that reads a few MiB is its idle baseline:
    the same advice, with the same margin, as the free_gpus role gives for it (issue 55)."""
    readings = [_int_or_none(g.get("memory_used_mib")) for g in dirty]
    if not dirty or blocking or stale or any(r is None or r > _IDLE_BASELINE_MIB for r in readings):
        return None
    if not all(str(g.get("mig_mode") or "").lower() == "enabled" for g in dirty):
        return None
    most = max(r for r in readings if r is not None)
    return (f"no process holds them: the idle baseline of MIG mode; set free_gpus_max_used_mib: {baseline_with_margin(most)} "
            f"(its {most} MiB reading with a margin; per host or group; the audit reads it too)")


# ---- pending restore (issue 24): what zeromib.gpu.gpu_release stopped and gpu_restore has not put
# back yet, from gpu_facts' `pending_restore`. One line per entry; an unreadable record is a line too.
def _pending_restore(facts: t.Mapping[str, t.Any]) -> list[str]:
    pending = facts.get("pending_restore")
    if not isinstance(pending, Mapping):
        return []
    lines = [str(line) for line in pending.get("summary") or []]
    if pending.get("error"):
        lines.append("restore record not read: {}".format(_first_line(pending["error"])))
    return lines


# The same record, one row per entry for the report's "Pending restores" (issue 33): what, what the
# release did, since when, by whom (the run: its time and its login user).
_KIND_WORDS = {"unit": "", "container": "container ", "supervisor": "supervisor program "}


def _pending_restore_entries(facts: t.Mapping[str, t.Any]) -> list[dict[str, t.Any]]:
    pending = facts.get("pending_restore")
    if not isinstance(pending, Mapping):
        return []
    rows = []
    for entry in pending.get("entries") or []:
        if not isinstance(entry, Mapping):
            continue
        name = entry.get("name") or str(entry.get("id") or "")[:12] or "?"
        rows.append({
            "what": _KIND_WORDS.get(str(entry.get("kind")), "") + str(name),
            "kind": entry.get("kind"),
            "actions": ", ".join(str(a) for a in entry.get("actions") or []),
            "since": entry.get("released_at"),
            "by": entry.get("released_by"),
        })
    if pending.get("error"):
        rows.append({"what": "restore record not read", "kind": None, "actions": _first_line(pending["error"]), "since": None, "by": None})
    return rows


def _checked_entry(entry: t.Any) -> tuple[str, str, dict[str, t.Any]]:
    """One host's input record -> (host, status ok/error/unreachable, its gpu_facts or {})."""
    if not isinstance(entry, Mapping):
        raise AnsibleFilterError(f"zeromib.gpu.gpu_audit_model: each host must be a dictionary, got {entry!r}")
    host = entry.get("host")
    if not host:
        raise AnsibleFilterError(f"zeromib.gpu.gpu_audit_model: a host record has no 'host': {dict(entry)!r}")
    host = str(host)
    raw_status = str(entry.get("status") or "ok").lower()
    if raw_status not in _INPUT_STATUSES:
        raise AnsibleFilterError(
            "zeromib.gpu.gpu_audit_model: host {} has status {!r}; expected one of {}".format(host, raw_status, ", ".join(sorted(_INPUT_STATUSES)))
        )
    facts = entry.get("gpu")
    return host, _INPUT_STATUSES[raw_status], dict(facts) if isinstance(facts, Mapping) else {}


def _status(entry: t.Mapping[str, t.Any], raw_status: str, facts: t.Mapping[str, t.Any]) -> tuple[str, bool, str | None]:
    """(status, up, reason) of one host: what it answered, or why it did not."""
    if raw_status == "unreachable":
        return "unreachable", False, _first_line(entry.get("error")) or "unreachable"
    if raw_status == "error":
        return "error", False, _first_line(entry.get("error")) or "zeromib.gpu.gpu_facts failed"
    if not facts:
        return "error", False, _first_line(entry.get("error")) or "zeromib.gpu.gpu_facts returned no ansible_facts.gpu"
    if facts.get("error"):
        return "error", False, _first_line(facts["error"])
    if facts.get("clean") is True:
        return "clean", True, None
    return "dirty", True, None


def _driver_drift(facts: t.Mapping[str, t.Any]) -> str | None:
    """One line when the driver library on disk is not the loaded module's version (gpu_facts'
    `driver`): new CUDA jobs fail there, running ones go on, so the audit names it before a job does."""
    driver = facts.get("driver")
    if not isinstance(driver, Mapping) or driver.get("mismatch") is not True:
        return None
    return ("driver upgraded under the loaded module (kernel module {}, library {}): new CUDA jobs fail until the node is rebooted "
            "or the modules are reloaded".format(driver.get("loaded"), driver.get("library")))


def _shm(facts: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """/dev/shm as gpu_facts read it (`shm`): its space, and what killed jobs left there. `leftovers`
    is one line when files of a job pattern are held by no process (the next job's NCCL init may
    fail for want of space while every GPU reads 0 MiB), else None."""
    shm = facts.get("shm")
    if not isinstance(shm, Mapping):
        return {"free_mib": None, "size_mib": None, "unheld_files": None, "unheld_mib": None, "leftovers": None}
    unheld = [f for f in shm.get("unheld") or [] if isinstance(f, Mapping)]
    jobs = [f for f in unheld if f.get("pattern")]
    count = _int_or_none(shm.get("unheld_count"))
    record = {"free_mib": shm.get("free_mib"), "size_mib": shm.get("size_mib"),
              "unheld_files": (len(unheld) if count is None else count) if shm.get("unheld") is not None else None,
              "unheld_mib": shm.get("unheld_mib"), "leftovers": None}
    if jobs:
        counts: dict[str, int] = {}
        for f in jobs:
            counts[str(f["pattern"])] = counts.get(str(f["pattern"]), 0) + 1
        mib = sum(float(f.get("size_mib") or 0) for f in jobs)
        record["leftovers"] = "{} file(s) of killed jobs in {} that no process holds, {:g} MiB ({}); {:g} MiB free of {:g} MiB".format(
            len(jobs), shm.get("path") or "/dev/shm", round(mib, 1), ", ".join(f"{p} {n:d}" for p, n in sorted(counts.items())),
            float(shm.get("free_mib") or 0), float(shm.get("size_mib") or 0))
    return record


# Holders a host lists in the report, most relevant first (blocking ones): the rest are counted in
# its `holders_not_listed`, so that 4,000 hosts each with thousands of processes holding device
# files (NVML clients, processes that do not answer) still make a report one can read (issue 66).
HOST_HOLDERS = 10


def _listed(holders: list[dict[str, t.Any]], facts: t.Mapping[str, t.Any]) -> tuple[list[dict[str, t.Any]], int]:
    """(the first HOST_HOLDERS holders, how many more the host has: those cut here and those
    gpu_facts' own cap left out, its `truncated`)."""
    truncated = facts.get("truncated") if isinstance(facts.get("truncated"), Mapping) else {}
    had = _int_or_none((truncated or {}).get("holders")) or len(facts.get("holders") or [])
    return holders[:HOST_HOLDERS], max(0, had - min(len(holders), HOST_HOLDERS))


def _host_record(entry: t.Any) -> dict[str, t.Any]:
    host, raw_status, facts = _checked_entry(entry)
    gpus, every_holder, stale = _gpu_records(host, facts)
    holders, not_listed = _listed(every_holder, facts)
    used = [g["memory_used_mib"] for g in gpus if _int_or_none(g.get("memory_used_mib")) is not None]
    total = [g["memory_total_mib"] for g in gpus if _int_or_none(g.get("memory_total_mib")) is not None]
    record: dict[str, t.Any] = {
        "host": host,
        "status": None,
        "up": False,
        "reason": None,
        "driver_version": facts.get("driver_version"),
        "cuda_version": facts.get("cuda_version"),
        "gpu_count": _int_or_none(facts.get("count")) if facts else None,
        "memory_used_mib": sum(used) if used else _int_or_none(facts.get("memory_used_mib")),
        "memory_total_mib": sum(total) if total else None,
        "used_pct": None,
        "dirty_gpus": [g.get("index") for g in gpus if not g["clean"]],
        "footprint_gpus": [g.get("index") for g in gpus if g["clean"] and g["cross_gpu_footprint"]],
        "nvml_clients": [h for h in holders if h["nvml_client"]],
        "healthy": facts.get("healthy") if facts.get("healthy") is None else bool(facts.get("healthy")),
        "health_issues": [human_ages(issue) for issue in facts.get("health_issues") or []] if not facts.get("error") else [],
        "unhealthy_gpus": [g.get("index") for g in gpus if g["healthy"] is False],
        "health_checked": None if facts.get("health_checked") is None or facts.get("error") else bool(facts.get("health_checked")),
        "unchecked_gpus": [g.get("index") for g in gpus if g["health_checked"] is False],
        "health_reason": None,
        "ghost_busy_gpus": [g.get("index") for g in gpus if g["ghost_busy"]],
        "ghost_busy": _ghost_busy(gpus),
        "gpus": gpus,
        "holders": holders,
        "holders_not_listed": not_listed,
        "stale_processes": stale,
        "pending_restore": _pending_restore(facts),
        "pending_restore_entries": _pending_restore_entries(facts),
        "driver_drift": _driver_drift(facts),
        # /dev/shm: its free space and what killed jobs left there (gpu_facts' `shm`).
        "shm": _shm(facts),
        # GPUs the host's driver lists that its namespace cannot reach (a container or job given
        # other GPUs, issue 37): not this host's, so neither clean nor dirty; a line in the report.
        "not_visible": [str(bus) for bus in facts.get("not_visible") or []] if not facts.get("error") else [],
        # The host ran gpu_facts in a container (an LXC/LXD/nspawn guest, a pod): memory no process
        # there holds may be held by the host or another guest.
        "inside_container": bool(facts.get("inside_container")),
        # /dev/nvidia<minor> not in nvidia-smi's order (gpu_facts' minor_order_differs): every tool that
        # counts device files (Slurm's File=/dev/nvidia[0-7]) names other GPUs than nvidia-smi there.
        "minor_order_differs": facts.get("minor_order_differs") if isinstance(facts.get("minor_order_differs"), bool) and not facts.get("error") else None,
    }
    if record["gpu_count"] is None and facts:
        record["gpu_count"] = len(gpus)
    record["used_pct"] = _pct(record["memory_used_mib"], record["memory_total_mib"])
    record["status"], record["up"], record["reason"] = _status(entry, raw_status, facts)
    if record["status"] == "dirty":
        record["reason"] = _dirty_reason(gpus, every_holder, stale, record["inside_container"])
    if record["up"]:
        record["health_reason"] = _health_reason(record)
    return record


def model_of(hosts: list[t.Any], generated_at: t.Any = None, expected_hosts: t.Iterable[t.Any] | None = None) -> dict[str, t.Any]:
    """The model from host records that are plain Python already (json.load, or plain() once):
    the report plugin's way in, which copies nothing twice."""
    records = [_host_record(entry) for entry in hosts]
    recorded = set(r["host"] for r in records)
    for name in expected_hosts or []:
        if str(name) not in recorded:
            recorded.add(str(name))
            records.append(_host_record({"host": str(name), "status": "error", "gpu": None,
                                         "error": "no audit result: the audit stopped on this host before recording one"}))
    seen = set()
    for record in records:
        if record["host"] in seen:
            raise AnsibleFilterError("zeromib.gpu.gpu_audit_model: host {} appears twice".format(record["host"]))
        seen.add(record["host"])
    records.sort(key=lambda r: _natural_key(r["host"]))

    try:
        epoch = float(time.time() if generated_at is None else generated_at)
    except (TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"zeromib.gpu.gpu_audit_model: generated_at must be seconds since the epoch, got {generated_at!r}") from exc

    summary = _summary(records)
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch)),
        "generated_epoch": epoch,
        "max_gpu_count": max([len(r["gpus"]) for r in records] + [1]),
        "summary": summary,
        "hosts": records,
    }


def _summary(records: list[dict[str, t.Any]]) -> dict[str, int]:
    """The fleet's counts: hosts by status, GPUs, MiB, holders, health."""
    def count(status: str) -> int:
        return sum(1 for r in records if r["status"] == status)

    up_gpus = [g for r in records if r["up"] for g in r["gpus"]]
    return {
        "hosts_total": len(records),
        "hosts_clean": count("clean"),
        "hosts_dirty": count("dirty"),
        "hosts_error": count("error"),
        "hosts_unreachable": count("unreachable"),
        "gpus_total": len(up_gpus),
        "gpus_clean": sum(1 for g in up_gpus if g["clean"]),
        "gpus_dirty": sum(1 for g in up_gpus if not g["clean"]),
        "memory_used_mib": sum(r["memory_used_mib"] or 0 for r in records if r["up"]),
        "memory_total_mib": sum(r["memory_total_mib"] or 0 for r in records if r["up"]),
        "holders": sum(1 for r in records if r["up"] for h in r["holders"] if h["blocking"]),
        "nvml_clients": sum(len(r["nvml_clients"]) for r in records if r["up"]),
        "holders_not_listed": sum(r.get("holders_not_listed") or 0 for r in records if r["up"]),
        "hosts_unhealthy": sum(1 for r in records if r["up"] and r["healthy"] is False),
        "gpus_unhealthy": sum(1 for g in up_gpus if g["healthy"] is False),
        "hosts_health_unchecked": sum(1 for r in records if r["up"] and r["unchecked_gpus"]),
        "gpus_health_unchecked": sum(1 for g in up_gpus if g["health_checked"] is False),
        "hosts_pending_restore": sum(1 for r in records if r["pending_restore"]),
        "hosts_driver_drift": sum(1 for r in records if r["driver_drift"]),
        "hosts_shm_leftovers": sum(1 for r in records if r["up"] and r["shm"]["leftovers"]),
        "hosts_ghost_busy": sum(1 for r in records if r["up"] and r["ghost_busy_gpus"]),
        "gpus_ghost_busy": sum(1 for g in up_gpus if g["ghost_busy"]),
    }
