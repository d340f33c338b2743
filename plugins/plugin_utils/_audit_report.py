# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""The fleet audit's report (plugins/action/gpu_audit_report.py runs it): its argument spec, the
hosts' records of a play or of part files, the report built from the model (_audit_model.py) and
its JMESPath findings, the verdict, and the four files rendered with Jinja and written each
through a temporary file and a rename.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import tempfile
import typing as t

from ansible.errors import AnsibleActionFail, AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.plugin_utils._audit_model import model_of
from ansible_collections.zeromib.gpu.plugins.plugin_utils._audit_prom import gpu_audit_prom
from ansible_collections.zeromib.gpu.plugins.plugin_utils._markdown import markdown_code, markdown_escape
from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain
from ansible_collections.zeromib.gpu.plugins.plugin_utils._play_vars import play_vars
from ansible_collections.zeromib.gpu.plugins.plugin_utils._query import search_plain

if t.TYPE_CHECKING:
    import jinja2

PART_FORMAT = "zeromib.gpu audit part"
PART_VERSION = 1
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "playbooks", "tasks", "templates")
FILES = ("report.json", "report.md", "report.html", "gpu_audit.prom")
# Hosts named per group in the summary line of "Needs attention"; the rest behind "and N more".
FIRST_HOSTS = 5

ARGUMENT_SPEC = {
    "hosts_data": {"type": "list", "elements": "dict"},
    "hosts_data_var": {"type": "str"},
    "result_var": {"type": "str", "default": "__gpu_audit_facts"},
    "expected_hosts": {"type": "list", "elements": "str"},
    "parts": {"type": "list", "elements": "path", "default": []},
    "write_part": {"type": "path"},
    "report": {"type": "bool", "default": True},
    "report_dir": {"type": "path", "default": "gpu_audit_report"},
    "title": {"type": "str", "default": "GPU fleet audit"},
    "max_used_mib": {"type": "int", "default": 0},
    "busy_pct": {"type": "float", "default": 50.0},
    "queries": {"type": "dict", "default": {}},
    "fail_on_dirty": {"type": "bool", "default": False},
    "fail_on_unhealthy": {"type": "bool", "default": False},
    "generated_at": {"type": "float"},
}

# A host with a pending restore (services zeromib stopped and never put back), or whose driver was
# upgraded under its loaded module (new jobs fail there), needs attention too, clean or not.
# Files killed jobs left in /dev/shm (the next job's NCCL init may run out of space there) too.
# A GPU busy with no process (ghost-busy, issue 71) fails or slows the next job on a clean host too.
NEEDS_ATTENTION = ("status != 'clean' || health_reason != null || length(pending_restore) > `0` || driver_drift != null || shm.leftovers != null"
                   " || length(ghost_busy_gpus || `[]`) > `0`")


def queries(busy_pct: float) -> dict[str, str]:
    """The report's own JMESPath queries (findings).

    The GPU queries pick the hosts first (a dirty GPU sits on a host with dirty_gpus, a busy one on
    a host that uses memory): the same answer as filtering every GPU, without visiting 32,000 of them."""
    busy = json.dumps(float(busy_pct))
    return {
        "attention": (f"hosts[?{NEEDS_ATTENTION}].{{host: host, status: status, reason: reason, health: health_reason, "
                      "pending_restore: length(pending_restore), driver: driver_drift, shm: shm.leftovers, "
                      "ghost_busy: (length(ghost_busy || `[]`) > `0` && join('; ', ghost_busy)) || `null`}"),
        "dirty_gpus": ("hosts[?up && length(dirty_gpus) > `0`].gpus[] | [?!clean].{host: host, index: index, uuid: uuid, name: name, "
                       "memory_used_mib: memory_used_mib, memory_total_mib: memory_total_mib, used_pct: used_pct, holders: holders[].pid}"),
        "busy_gpus": "hosts[?up{}].gpus[] | [?used_pct >= `{}`].{{host: host, index: index, used_pct: used_pct}}".format(
            " && memory_used_mib > `0`" if float(busy_pct) > 0 else "", busy),
        "holders": ("hosts[].holders[] | [?blocking].{host: host, pid: pid, name: name, user: user, unit: unit, container: container, "
                    "container_label: container_label, guest_label: guest_label, gpu_indexes: gpu_indexes, spanning: spanning, "
                    "used_memory_mib: used_memory_mib, "
                    "cmdline: cmdline}"),
        "stale_processes": "hosts[].stale_processes[]",
        "not_visible": "hosts[?up && length(not_visible) > `0`].{host: host, gpu_count: gpu_count, not_visible: not_visible}",
        "minor_order": "hosts[?up && minor_order_differs].{host: host, gpus: gpus[].{index: index, minor_number: minor_number}}",
        "nvml_clients": ("hosts[?up].nvml_clients[].{host: host, pid: pid, name: name, user: user, unit: unit, "
                         "container: container, protected: protected, cmdline: cmdline}"),
    }


# --------------------------------------------------------------------------- the hosts' data


def host_record(host: object, result: t.Any) -> dict[str, t.Any]:
    """One host's registered gpu_facts result -> {host, status, error, gpu} (what the model reads).

    As audit_gpus.yml's per-host set_fact did: unreachable when Ansible could not connect, ok when
    the module returned ansible_facts.gpu, else error with the module's message and the last line
    of its stderr (ansible-core 2.19 puts a crashed module's exception there)."""
    result = result if isinstance(result, dict) else {}
    facts = (result.get("ansible_facts") or {}).get("gpu") if isinstance(result.get("ansible_facts"), dict) else None
    if result.get("unreachable"):
        status = "unreachable"
    else:
        status = "ok" if facts is not None else "error"
    error = None
    if facts is None:
        message = re.sub(r"[.]$", "", str(result.get("msg") or "zeromib.gpu.gpu_facts failed"))
        stderr = str(result.get("module_stderr") or "").strip().splitlines()[-1:]
        error = ": ".join(part for part in [message] + stderr if part)
    return {"host": str(host), "status": status, "error": error, "gpu": facts}


def play_results(task_vars: t.Mapping[str, t.Any], hosts: list[str], result_var: str) -> list[dict[str, t.Any]]:
    """The registered result of each host, read once and raw (never templated), from the variable
    manager's caches, not through hostvars (plugin_utils._play_vars)."""
    found = play_vars(task_vars, hosts, [result_var])
    return [host_record(host, plain(found[host][result_var])) for host in hosts if found[host].get(result_var) is not None]


def part_name(hosts: t.Iterable[str]) -> str:
    """A part's file name, the same for the same hosts: a rerun of one slice replaces its part."""
    digest = hashlib.sha256("\n".join(sorted(hosts)).encode("utf-8")).hexdigest()[:16]
    return f"gpu-audit-part-{digest}.json"


def part_document(hosts_data: list[t.Any], expected_hosts: t.Iterable[str], epoch: float) -> dict[str, t.Any]:
    return {"format": PART_FORMAT, "version": PART_VERSION, "generated_epoch": epoch,
            "expected_hosts": sorted(set(expected_hosts)), "hosts_data": hosts_data}


def part_files(paths: t.Iterable[str]) -> list[str]:
    """Part paths as given: a file, a directory (its *.json), or a glob; sorted, no duplicates."""
    found: list[str] = []
    for path in paths:
        path = os.path.expanduser(str(path))
        if os.path.isdir(path):
            matches = sorted(glob.glob(os.path.join(path, "*.json")))
        elif glob.has_magic(path):
            matches = sorted(glob.glob(path))
        else:
            matches = [path]
        if not matches:
            raise AnsibleActionFail(f"zeromib.gpu.gpu_audit_report: no part in {path}")
        found.extend(m for m in matches if m not in found)
    return found


def read_parts(paths: t.Iterable[str]) -> tuple[list[t.Any], list[str], float | None]:
    """[part file] -> (hosts_data, expected_hosts, earliest generated_epoch)."""
    hosts_data: list[t.Any] = []
    expected: list[str] = []
    epochs: list[float] = []
    for path in part_files(paths):
        try:
            with open(path, "rb") as handle:
                part = json.load(handle)
        except (OSError, ValueError) as exc:
            raise AnsibleActionFail(f"zeromib.gpu.gpu_audit_report: cannot read the part {path}: {exc}") from exc
        if not isinstance(part, dict) or part.get("format") != PART_FORMAT or not isinstance(part.get("hosts_data"), list):
            raise AnsibleActionFail(f"zeromib.gpu.gpu_audit_report: {path} is not an audit part (written with write_part)")
        if part.get("version") != PART_VERSION:
            raise AnsibleActionFail("zeromib.gpu.gpu_audit_report: {} is an audit part of version {!r}; this collection reads version {}".format(
                path, part.get("version"), PART_VERSION))
        hosts_data.extend(part["hosts_data"])
        expected.extend(part.get("expected_hosts") or [])
        if isinstance(part.get("generated_epoch"), (int, float)):
            epochs.append(float(part["generated_epoch"]))
    return hosts_data, expected, (min(epochs) if epochs else None)


# --------------------------------------------------------------------------- the report


def build_report(hosts_data: t.Any, expected_hosts: list[str] | None = None, generated_at: float | None = None, max_used_mib: int = 0,
                 busy_pct: float = 50.0, title: str = "GPU fleet audit", custom_queries: t.Mapping[str, str] | None = None) -> dict[str, t.Any]:
    """The report.json document: the model, its findings, the custom queries and the settings."""
    if not isinstance(hosts_data, list):
        raise AnsibleActionFail(f"zeromib.gpu.gpu_audit_report: the hosts' data must be a list of host records, got {type(hosts_data).__name__}")
    try:
        model = model_of(hosts_data, generated_at=generated_at, expected_hosts=expected_hosts or [])
        # The model is plain Python already: no copy before JMESPath (fleet_query's would be most of its time).
        model["findings"] = {name: search_plain(model, expr) for name, expr in queries(busy_pct).items()}
        model["queries"] = {str(name): search_plain(model, expr) for name, expr in plain(custom_queries).items()} if custom_queries else {}
    except AnsibleFilterError as exc:
        raise AnsibleActionFail(str(exc).replace("zeromib.gpu.gpu_audit_model", "zeromib.gpu.gpu_audit_report")) from exc
    model["settings"] = {"max_used_mib": int(max_used_mib), "busy_pct": float(busy_pct), "title": title}
    return model


def not_ready(report: t.Mapping[str, t.Any], fail_on_dirty: bool, fail_on_unhealthy: bool) -> list[dict[str, t.Any]]:
    """The attention entries that fail the run as asked: not clean, and/or unhealthy or unchecked."""
    failing = []
    for entry in report["findings"]["attention"]:
        if (fail_on_dirty and entry["status"] != "clean") or (fail_on_unhealthy and entry.get("health")):
            failing.append(entry)
    return failing


def _failing_detail(entry: t.Mapping[str, t.Any]) -> str:
    why = ": ".join(x for x in (entry["status"], entry.get("reason")) if x)
    health = "; {}".format(entry["health"]) if entry.get("health") else ""
    return "{} ({}{})".format(entry["host"], why, health)


def verdict(report: t.Mapping[str, t.Any], failing: list[dict[str, t.Any]], fail_on_dirty: bool, fail_on_unhealthy: bool,
            report_html: str) -> tuple[bool, str]:
    """(failed, message) as the task file's assert says it."""
    total = report["summary"]["hosts_total"]
    hosts = "host" if total == 1 else "hosts"
    what = " or ".join(w for w, asked in (("not clean", fail_on_dirty), ("not known healthy", fail_on_unhealthy)) if asked)
    if failing:
        details = "; ".join(_failing_detail(e) for e in failing)
        verb = "is" if len(failing) == 1 else "are"
        return True, f"{len(failing)} of {total} {hosts} {verb} {what}: {details}. Report: {report_html}"
    if total == 1:
        return False, "The host is clean" + (" and healthy" if fail_on_unhealthy else "")
    return False, f"All {total} hosts are clean" + (" and healthy" if fail_on_unhealthy else "")


def summary_line(report: t.Mapping[str, t.Any], report_html: str) -> str:
    s = report["summary"]
    line = "{} host{}: {} clean, {} dirty, {} error, {} unreachable; {} of {} GPUs dirty, {} MiB used.".format(
        s["hosts_total"], "" if s["hosts_total"] == 1 else "s", s["hosts_clean"], s["hosts_dirty"], s["hosts_error"],
        s["hosts_unreachable"], s["gpus_dirty"], s["gpus_total"], int(s["memory_used_mib"]))
    if s.get("gpus_unhealthy") or s.get("gpus_health_unchecked"):
        line += " {} GPU{} unhealthy, {} not fully checked.".format(s["gpus_unhealthy"], "" if s["gpus_unhealthy"] == 1 else "s",
                                                                    s["gpus_health_unchecked"])
    if s.get("gpus_ghost_busy"):
        line += " {} GPU{} busy with no process (ghost-busy) on {} host{}.".format(
            s["gpus_ghost_busy"], "" if s["gpus_ghost_busy"] == 1 else "s", s["hosts_ghost_busy"], "" if s["hosts_ghost_busy"] == 1 else "s")
    return line + f" Report: {report_html}"


# --------------------------------------------------------------------------- rendering


# One escaping for every Markdown the collection writes (plugin_utils/_markdown.py).
markdown_text = markdown_escape


def json_for_script(value: t.Any) -> str:
    """JSON for a <script type="application/json"> block: no '<', '>' or '&' can end it early."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _flatten(value: t.Iterable[t.Any], levels: int | None = None) -> list[t.Any]:
    out = []
    for item in value:
        if isinstance(item, (list, tuple)) and (levels is None or levels > 0):
            out.extend(_flatten(item, None if levels is None else levels - 1))
        else:
            out.append(item)
    return out


def to_nice_json(value: t.Any, indent: int = 4, sort_keys: bool = True) -> str:
    """As ansible.builtin.to_nice_json writes it."""
    return json.dumps(value, indent=indent, sort_keys=sort_keys, separators=(",", ": "))


_ENV = None


def environment() -> jinja2.Environment:
    """Jinja as the template module configures it (trim_blocks), with the filters the templates use."""
    global _ENV  # pylint: disable=global-statement
    if _ENV is None:
        import jinja2

        env = jinja2.Environment(loader=jinja2.FileSystemLoader(os.path.realpath(TEMPLATES)), trim_blocks=True,
                                 keep_trailing_newline=False, autoescape=False)
        env.filters.update({"md": markdown_text, "md_code": markdown_code, "flatten": _flatten, "to_nice_json": to_nice_json,
                            "ansible.builtin.to_nice_json": to_nice_json, "json_for_script": json_for_script})
        _ENV = env
    return _ENV


def _reason_kind(text: str) -> str:
    """A reason without what is particular to one host: IP addresses, ports, counts, MiB, PIDs."""
    text = re.sub(r"\b\d{1,3}(?:\.\d{1,3}){3}\b", "<address>", text)
    text = re.sub(r"\bport \d+", "port <n>", text)
    return re.sub(r"\b\d+(?:\.\d+)?\b", "N", text)


def _owner(holder: t.Mapping[str, t.Any]) -> str:
    if holder.get("unit"):
        return holder["unit"]
    if holder.get("guest_label"):
        return holder["guest_label"]
    if holder.get("container_label"):
        return "container " + holder["container_label"].split(" (")[0]
    return "%s (no unit)" % (holder.get("name") or "?")


_HEALTH_CUT = re.compile(r" (?:in the kernel log|since the driver loaded|: reset|, expected).*$")


def _health_kind(issue: str) -> str:
    issue = re.sub(r"^GPU \S+ \([^)]*\): ", "", issue)
    issue = _HEALTH_CUT.sub("", issue)
    return re.sub(r"^\d+ ", "", issue)


def _restore_kind(host: t.Mapping[str, t.Any]) -> str:
    """A pending restore's group: what was stopped (names, not times), so that 500 nodes whose vLLM
    was never put back read as one line."""
    rows = host.get("pending_restore_entries") or []
    what = sorted(set(str(e["what"]) for e in rows if e.get("kind")))
    if not what:
        return "restore record not read"
    return "stopped by zeromib, not restored: " + ", ".join(what[:3]) + (f" and {len(what) - 3} more" if len(what) > 3 else "")


def attention_groups(report: t.Mapping[str, t.Any]) -> list[dict[str, t.Any]]:
    """The hosts that need attention, grouped by kind of reason, largest group first.

    A 4,000-host fleet had 1,066 such hosts; one line each buries the one reason that matters.
    Grouping: dirty hosts by what holds their GPUs (unit, container, process name), hosts in error
    or unreachable by their message with addresses and numbers taken out, unhealthy hosts by kind
    of issue (Xid 79, uncorrectable ECC...). A host can sit in more than one group."""
    hosts = {h["host"]: h for h in report["hosts"]}
    groups: dict[tuple[str, str], dict[str, t.Any]] = {}

    def add(kind: str, status: str, entry: dict[str, t.Any]) -> None:
        group = groups.setdefault((status, kind), {"status": status, "title": kind, "hosts": [], "_seen": set()})
        if entry["host"] not in group["_seen"]:
            group["_seen"].add(entry["host"])
            group["hosts"].append(entry)

    for entry in report["findings"]["attention"]:
        host = hosts[entry["host"]]
        if host["status"] == "dirty":
            owners = sorted(set(_owner(h) for h in host["holders"] if h["blocking"]))
            if owners:
                kind = "held by " + ", ".join(owners[:3]) + (f" and {len(owners) - 3} more" if len(owners) > 3 else "")
            elif host.get("inside_container"):
                kind = "memory used, no holder in this container (held outside it?)"
            elif host["stale_processes"]:
                kind = "memory counted for a gone PID"
            else:
                kind = "memory used, no holder found"
            add(kind, "dirty", entry)
        elif host["status"] in ("error", "unreachable"):
            add(_reason_kind(host["reason"] or host["status"]), host["status"], entry)
        issues = host["health_issues"] or [i for g in host["gpus"] for i in g["health_issues"]]
        for kind in sorted(set(_health_kind(i) for i in issues)):
            add(kind, "unhealthy", entry)
        if host["unchecked_gpus"]:
            add("health not fully checked", "unchecked", entry)
        if host["pending_restore"]:
            add(_restore_kind(host), "pending restore", entry)
        if host.get("driver_drift"):
            add("driver upgraded under the loaded module", "driver drift", entry)
        if (host.get("shm") or {}).get("leftovers"):
            add("files of killed jobs left in /dev/shm", "shm leftovers", entry)
        if host.get("ghost_busy_gpus"):
            add("GPUs busy with no process (a CUDA context or a reset clears them)", "ghost busy", entry)
    order = {"unreachable": 0, "error": 1, "dirty": 2, "unhealthy": 3, "unchecked": 4, "pending restore": 5, "driver drift": 6, "shm leftovers": 7,
             "ghost busy": 8}
    result = sorted(groups.values(), key=lambda g: (-len(g["hosts"]), order[g["status"]], g["title"]))
    for group in result:
        del group["_seen"]
        group["count"] = len(group["hosts"])
        group["first"] = [e["host"] for e in group["hosts"][:FIRST_HOSTS]]
    return result


def _tip_holder(h: t.Mapping[str, t.Any]) -> str:
    protected = " [protected]" if h.get("protected") else ""
    memory = " ({} MiB)".format(h["used_memory_mib"]) if h.get("used_memory_mib") is not None else ""
    line = "pid {} {}{}{} · user {}".format(h.get("pid"), h.get("name") or "?", protected, memory, h.get("user") or "?")
    if h.get("unit"):
        line += " · unit {}".format(h["unit"])
    if h.get("container"):
        line += " · container %s" % (h.get("container_label") or str(h["container"])[:12])
    if h.get("guest_label"):
        line += " · {}".format(h["guest_label"])
    gpus = ",".join(str(i) for i in h.get("gpu_indexes") or []) or ("none (NVML client)" if h.get("nvml_client") else "none")
    return line + " · GPUs {}\n    {}".format(gpus, h.get("cmdline") or "")


def heat_data(report: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The heat map as compact rows for the page's script, which draws one page of hosts at a time
    (a 4,000-host table of 32,000 cells with their tooltips was 16 MB of HTML).

    Repeated strings (GPU names, bus ids, MIG modes, drivers) are stored once in `s` and referred
    to by index; a holder's tooltip line is stored once per host, and its GPUs refer to it. Per host:
    [name, status, reason, used, total, pct, driver, cuda, blocking holders, holder lines, needs
    attention, health, gpus, indexes of the blocking holders' lines, pending restore entries]; per GPU: [index, used, total,
    pct, flags, util, temp, power, name, uuid, bus, mig, blocking holders, indexes of its holders'
    lines, other notes] with flags 1 clean, 2 footprint, 4 unhealthy, 8 not fully checked."""
    strings = _Interned()
    attention = {e["host"] for e in report["findings"]["attention"]}
    rows = []
    for h in report["hosts"]:
        lines = _Interned(_tip_holder, key=id)
        blocking = [lines(x) for x in h["holders"] if x["blocking"]]
        gpus = [_heat_gpu(g, strings, lines) for g in (h["gpus"] if h["up"] else [])]
        rows.append([h["host"], h["status"], h["reason"], h["memory_used_mib"], h["memory_total_mib"], h["used_pct"],
                     strings(h.get("driver_version")), strings(h.get("cuda_version")), len(blocking), lines.values or 0,
                     1 if h["host"] in attention else 0, h["health_reason"], gpus, blocking or 0,
                     sum(1 for e in h.get("pending_restore_entries") or [] if e.get("kind"))])
    return {"w": report["max_gpu_count"], "s": strings.values, "h": rows}


class _Interned:
    """Values stored once, referred to by index: `self(value)` -> its index (-1 for None)."""

    def __init__(self, text: t.Callable[[t.Any], str] = str, key: t.Callable[[t.Any], t.Hashable] = str) -> None:
        self.values: list[str] = []
        self._index: dict[t.Hashable, int] = {}
        self._text = text
        self._key = key

    def __call__(self, value: t.Any) -> int:
        if value is None:
            return -1
        key = self._key(value)
        if key not in self._index:
            self._index[key] = len(self.values)
            self.values.append(self._text(value))
        return self._index[key]


def _heat_notes(g: t.Mapping[str, t.Any]) -> list[str]:
    """A GPU's tooltip notes: memory of gone PIDs, the unified-memory proof, health, the CUDA smoke test."""
    notes = ["nvidia-smi counts {} MiB for gone PID {} ({})".format(p.get("used_memory_mib"), p.get("pid"), p.get("name"))
             for p in g["processes"] if p.get("alive") is False]
    if g.get("memory_proof") == "unified memory":
        # A GPU sharing the host's memory (GB10, Jetson): its proof is not a 0 MiB reading.
        notes.append("unified memory: free with no compute process and min_host_available_mib of host memory; {} MiB available".format(
            g.get("host_memory_available_mib")))
    if g.get("healthy") is False:
        notes.append("UNHEALTHY: " + "; ".join(g["health_issues"]))
    if g.get("health_checked") is False:
        notes.append("health not fully checked: " + ", ".join(_unchecked_notes_of(g)))
    smoke = g.get("smoke_test")
    if isinstance(smoke, dict):
        detail = " in {} s".format(smoke.get("seconds")) if smoke.get("ok") else ": {}".format(smoke.get("error") or smoke.get("skipped"))
        notes.append("CUDA smoke test: {}{}".format(smoke.get("result"), detail))
    return notes


def _heat_gpu(g: t.Mapping[str, t.Any], strings: _Interned, lines: _Interned) -> list[t.Any]:
    flags = (1 if g["clean"] else 0) | (2 if g["clean"] and g.get("cross_gpu_footprint") else 0) \
        | (4 if g.get("healthy") is False else 0) | (8 if g.get("health_checked") is False else 0)
    return [g.get("index"), g.get("memory_used_mib"), g.get("memory_total_mib"), g.get("used_pct"), flags,
            g.get("utilization_gpu_pct"), g.get("temperature_c"), g.get("power_draw_w"), strings(g.get("name")), g.get("uuid"),
            strings(g.get("pci_bus_id")), strings(g.get("mig_mode")), sum(1 for x in g["holders"] if x["blocking"]),
            [lines(x) for x in g["holders"]] or 0, "\n".join(_heat_notes(g)) or 0]


def _unchecked_notes_of(gpu: t.Mapping[str, t.Any]) -> list[str]:
    names = gpu.get("health_unchecked")
    if names:
        return [str(n) for n in names]
    return [str(n) for n in ((gpu.get("health") or {}).get("unchecked") or [])] or ["some checks"]


def report_json(report: t.Mapping[str, t.Any]) -> str:
    """report.json: one host per line inside an indented document.

    Python's JSON encoder indents in pure Python (3.4 s for 4,000 hosts here, the C encoder 0.3 s);
    a line per host also keeps the diff of two audits to the hosts that changed."""
    def compact(value: t.Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ": "))

    lines = ["{"]
    keys = sorted(report)
    for n, key in enumerate(keys):
        comma = "," if n < len(keys) - 1 else ""
        value = report[key]
        if key == "hosts" and value:
            lines.append('  "hosts": [')
            lines.extend("    {}{}".format(compact(h), "," if i < len(value) - 1 else "") for i, h in enumerate(value))
            lines.append("  ]" + comma)
        elif isinstance(value, dict) and value:
            lines.append(f"  {compact(key)}: {{")
            inner = sorted(value)
            lines.extend("    {}: {}{}".format(compact(k), compact(value[k]), "," if i < len(inner) - 1 else "") for i, k in enumerate(inner))
            lines.append("  }" + comma)
        else:
            lines.append(f"  {compact(key)}: {compact(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(report: t.Mapping[str, t.Any]) -> dict[str, str]:
    """{file name: text} of the four report files."""
    env = environment()
    context = {"_gpu_audit_report": report, "attention_groups": attention_groups(report)}
    html_context = dict(context, heat_data=heat_data(report))
    return {
        "report.json": report_json(report),
        "report.md": env.get_template("gpu_audit_report.md.j2").render(context),
        "report.html": env.get_template("gpu_audit_report.html.j2").render(html_context),
        "gpu_audit.prom": gpu_audit_prom(report),
    }


def write_atomically(path: str, text: str, mode: int = 0o644) -> bool:
    """Write through a temporary file in the same directory and rename it: a reader (the textfile
    collector, a browser, a script) sees the old file or the new one, never half of one.
    Returns whether the content changed."""
    data = text.encode("utf-8")
    try:
        with open(path, "rb") as handle:
            if handle.read() == data:
                return False
    except OSError:
        pass
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return True


def report_dir_of(path: object) -> str:
    """A relative directory is relative to the controller's working directory (where
    ansible-playbook runs), not to the playbook."""
    return os.path.realpath(os.path.expanduser(str(path)))
