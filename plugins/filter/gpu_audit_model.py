# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: gpu_audit_model
short_description: Build the fleet GPU audit report from per-host results
version_added: 0.1.0
author: zeromib.gpu developers
description:
  - Turns one record per audited host into the report model that C(playbooks/audit_gpus.yml)
    writes as C(report.json) and renders as Markdown, HTML and Prometheus text.
  - Decides each host's status, V(clean), V(dirty), V(error) or V(unreachable), with a one-line
    reason for every host that is not clean, and counts hosts, GPUs, MiB and holders.
  - Hosts are sorted by name, with digits compared as numbers (V(node2) before V(node10)).
  - Pure data in, pure data out; it touches no host and no file.
positional: generated_at
options:
  _input:
    description:
      - One dictionary per host.
      - C(host) (str, required) is the inventory name.
      - C(status) is V(ok) when C(zeromib.gpu.gpu_facts) answered (the default),
        V(error) (or V(failed)) when the module failed, V(unreachable) when Ansible could not
        connect.
      - C(error) is the message for V(error) and V(unreachable).
      - C(gpu) is the host's C(ansible_facts.gpu) as C(zeromib.gpu.gpu_facts) returns it. Facts
        whose own C(error) is set (O(zeromib.gpu.gpu_facts#module:fail_on_error=false)) make the
        host V(error).
    type: list
    elements: dict
    required: true
  generated_at:
    description:
      - When the audit ran, as seconds since the epoch. Defaults to now.
    type: float
  expected_hosts:
    description:
      - Every host the audit targeted. One without a record in the input is reported as V(error)
        (the audit stopped on it before recording a result) instead of silently missing.
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Build the report from per-host records
  ansible.builtin.set_fact:
    gpu_report: "{{ hosts_data | zeromib.gpu.gpu_audit_model }}"
  vars:
    hosts_data:
      - host: node01
        status: ok
        error: null
        gpu: "{{ hostvars['node01'].ansible_facts.gpu }}"
      - host: node02
        status: unreachable
        error: "Failed to connect to the host via ssh: Connection timed out"
        gpu: null

- name: Say how the fleet looks
  ansible.builtin.debug:
    msg: "{{ gpu_report.summary.hosts_clean }} of {{ gpu_report.summary.hosts_total }} hosts are clean"
"""

RETURN = r"""
_value:
  description: The report model.
  type: dict
  contains:
    schema_version:
      description: Version of this structure; bumped on incompatible changes.
      type: int
      sample: 1
    generated_at:
      description: When the audit ran, ISO 8601 in UTC.
      type: str
      sample: "2025-06-01T12:00:00Z"
    generated_epoch:
      description: When the audit ran, seconds since the epoch.
      type: float
    max_gpu_count:
      description: The largest GPU count of any host (at least 1); the width of the heat map.
      type: int
    summary:
      description: Fleet totals.
      type: dict
      contains:
        hosts_total: {description: Hosts audited., type: int}
        hosts_clean: {description: Hosts whose GPUs are all clean and held by no unprotected process., type: int}
        hosts_dirty: {description: Hosts that answered and are not clean., type: int}
        hosts_error: {description: Hosts where the module or nvidia-smi failed., type: int}
        hosts_unreachable: {description: Hosts Ansible could not reach., type: int}
        gpus_total: {description: GPUs reported by the hosts that answered., type: int}
        gpus_clean: {description: GPUs at or below the host's C(max_used_mib)., type: int}
        gpus_unhealthy: {description: GPUs with a health issue (C(healthy=false))., type: int}
        hosts_unhealthy: {description: Hosts that answered with at least one unhealthy GPU., type: int}
        gpus_health_unchecked: {description: GPUs whose health was not fully checked (C(health_checked=false))., type: int}
        hosts_health_unchecked: {description: Hosts that answered with at least one such GPU., type: int}
        gpus_dirty: {description: GPUs above it., type: int}
        memory_used_mib: {description: MiB used over all GPUs., type: int}
        memory_total_mib: {description: MiB installed over all GPUs., type: int}
        holders: {description: Unprotected processes using GPU memory (C(attribution) other than V(nvml_client))., type: int}
        nvml_clients:
          description:
            - NVML clients on the hosts that answered (C(attribution=nvml_client)), protected ones included,
              such as C(nvidia-smi dmon), exporters or C(nvidia-persistenced). They open the device files but use no
              GPU memory and never make a host dirty.
          type: int
    hosts:
      description: One entry per host, sorted by name.
      type: list
      elements: dict
      contains:
        host: {description: Inventory name., type: str}
        status: {description: "V(clean), V(dirty), V(error) or V(unreachable).", type: str}
        up: {description: Whether the host answered with GPU facts (V(clean) or V(dirty))., type: bool}
        reason: {description: Why the host is not clean; V(null) when it is., type: str}
        pending_restore:
          description:
            - What zeromib stopped on the host and C(zeromib.gpu.gpu_restore) has not put back yet, one line per unit or container
              (V(vllm.service stopped, disabled by zeromib at 2026-12-01T10:00:00Z)); empty when nothing is pending.
          type: list
          elements: str
        driver_version: {description: NVIDIA driver version., type: str}
        cuda_version: {description: CUDA version the driver supports., type: str}
        gpu_count: {description: GPUs found; V(null) when the host did not answer., type: int}
        memory_used_mib: {description: MiB used over the host's GPUs., type: int}
        memory_total_mib: {description: MiB installed over the host's GPUs., type: int}
        used_pct: {description: Used share of the host's GPU memory in percent, one decimal., type: float}
        dirty_gpus: {description: Indexes of the GPUs that are not clean., type: list, elements: int}
        footprint_gpus:
          description:
            - Indexes of the GPUs that are clean although they read more than C(max_used_mib), because what they
              read is only the cross-GPU footprint of contexts on other GPUs (C(cross_gpu_footprint)).
          type: list
          elements: int
        nvml_clients:
          description: The host's holders whose C(attribution) is V(nvml_client) (also in C(holders)).
          type: list
          elements: dict
        healthy: {description: "gpu_facts' host verdict on GPU health; V(null) when it read none.", type: bool}
        health_issues:
          description:
            - "Every GPU's health issues, C(GPU <index> (<bus id>): <issue>)."
            - Ages in seconds read as people say them (V(Xid 79 ... 2 h ago), not V(at 7200 s ago)).
          type: list
          elements: str
        unhealthy_gpus: {description: Indexes of the GPUs with a health issue., type: list, elements: int}
        health_checked:
          description: "gpu_facts' C(health_checked) - V(false) when some health check could not be made on some GPU; V(null) when it read no health."
          type: bool
        unchecked_gpus: {description: Indexes of the GPUs whose health was not fully checked (C(health_checked=false))., type: list, elements: int}
        health_reason:
          description:
            - Why the host's GPUs are not ready for work, or not known to be - its health issues, then what could not be checked on
              which GPU; V(null) when every GPU is healthy and fully checked (or the host did not answer).
            - A host with a health reason is listed under "Hosts that need attention" even when its memory is clean.
          type: str
        gpus:
          description:
            - The host's GPUs as C(gpu_facts) returns them, plus C(host), C(used_pct) (one
              decimal, V(null) when unknown), C(holders) (the holders of this GPU, protected ones
              included) and C(processes) (nvidia-smi's compute apps on it).
            - C(smoke_test) is the GPU's last CUDA smoke test when the facts carry one (C(gpu_audit_smoke_test)),
              with C(result) V(passed), V(FAILED) or V(skipped); V(null) otherwise.
          type: list
          elements: dict
        holders:
          description:
            - The host's holders as C(gpu_facts) returns them, plus C(host), C(used_memory_mib)
              (what nvidia-smi attributes to the PID, V(null) if nothing), C(nvml_client) (its C(attribution)
              is V(nvml_client), so it uses no GPU), C(blocking) (unprotected and using a GPU, or V(undecided),
              so it makes the host dirty), C(spanning) (it uses more than one GPU - JAX, DataParallel, an MPS server - so
              freeing only some of them fails unless C(kill_spanning) is set; the reason says V(uses GPUs 0,1)) and
              C(container_label) (the container as the report shows it next to the PID, V(vllm (vllm/vllm-openai:v0.11.0))
              with the name and image its runtime gave, else the short id; prefixed with the Kubernetes pod; V(null) outside containers).
          type: list
          elements: dict
        stale_processes:
          description:
            - Compute apps whose PID is gone (C(alive=false)) while nvidia-smi still counts their
              memory; usually a forked child still holds it, else only a reboot or GPU reset frees it.
          type: list
          elements: dict
"""

import re
import time
import typing as t
from collections.abc import Mapping, Sequence

from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain

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

    The report's one age formatter. gpu_facts writes its Xid ages itself (module_utils/_health.py's
    age_text: '2 h ago', switching units at 90 s, 90 min and 48 h, 'days'); human_ages rewrites
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
        uses = bool(record["gpu_indexes"]) or record.get("attribution") == "undecided"
        record["blocking"] = uses and not record["nvml_client"] and not record["protected"]
        # Freeing a subset of its GPUs refuses it (gpu_release's kill_spanning): worth a note.
        record["spanning"] = len(set(record["gpu_indexes"])) > 1
        record["container_label"] = _container_label(record)
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
        record["holders"] = [h for h in holders if index in h["gpu_indexes"]]
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


def _smoke_test(gpu: t.Mapping[str, t.Any]) -> dict[str, t.Any] | None:
    """The GPU's last CUDA smoke test (gpu_facts with smoke_test), with a one-word `result`
    (passed, FAILED, skipped); None when the facts carry none."""
    test = gpu.get("smoke_test")
    if not isinstance(test, Mapping):
        return None
    result = "passed" if test.get("ok") is True else "FAILED" if test.get("ok") is False else "skipped"
    return dict(test, result=result)


def _dirty_reason(gpus: list[dict[str, t.Any]], holders: list[dict[str, t.Any]], stale: list[dict[str, t.Any]]) -> str:
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
            owner = h.get("unit") or ("container {}".format(h["container_label"]) if h.get("container_label") else None)
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
    if stale and not blocking:
        parts.append("memory counted for gone PID {}".format(", ".join(str(p.get("pid")) for p in stale[:3])))
    return "; ".join(parts) or "gpu_facts reports the host not clean"


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


def _host_record(entry: t.Any) -> dict[str, t.Any]:
    host, raw_status, facts = _checked_entry(entry)
    gpus, holders, stale = _gpu_records(host, facts)
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
        "gpus": gpus,
        "holders": holders,
        "stale_processes": stale,
        "pending_restore": _pending_restore(facts),
    }
    if record["gpu_count"] is None and facts:
        record["gpu_count"] = len(gpus)
    record["used_pct"] = _pct(record["memory_used_mib"], record["memory_total_mib"])
    record["status"], record["up"], record["reason"] = _status(entry, raw_status, facts)
    if record["status"] == "dirty":
        record["reason"] = _dirty_reason(gpus, holders, stale)
    if record["up"]:
        record["health_reason"] = _health_reason(record)
    return record


def gpu_audit_model(hosts: t.Any, generated_at: t.Any = None, expected_hosts: t.Any = None) -> dict[str, t.Any]:
    if isinstance(hosts, Mapping) or not isinstance(hosts, Sequence) or isinstance(hosts, str):
        raise AnsibleFilterError(f"zeromib.gpu.gpu_audit_model expects a list of host records, got {type(hosts).__name__}")
    return model_of([plain(entry) for entry in hosts], generated_at, plain(expected_hosts))


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
        "hosts_unhealthy": sum(1 for r in records if r["up"] and r["healthy"] is False),
        "gpus_unhealthy": sum(1 for g in up_gpus if g["healthy"] is False),
        "hosts_health_unchecked": sum(1 for r in records if r["up"] and r["unchecked_gpus"]),
        "gpus_health_unchecked": sum(1 for g in up_gpus if g["health_checked"] is False),
    }


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"gpu_audit_model": gpu_audit_model}
