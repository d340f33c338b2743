# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""The `free_gpus_result` fact of one host: gpu_release's result in the operator's words.

Built by the role's gate (plugins/action/free_gpus_gate.py) and by the public filter
free_gpus_outcome (plugins/filter/free_gpus.py); whether the host passes is _verdict's alone.
"""

from __future__ import annotations

import re
import typing as t
from collections.abc import Mapping

from ansible_collections.zeromib.gpu.plugins.module_utils._look._check_names import CHECKS
from ansible_collections.zeromib.gpu.plugins.plugin_utils._verdict import Verdict, selected_gpus, verdict

# /dev/shm files a kept-files line names with their reason before "and N more" (a user sets how many there are).
SHM_KEPT_NAMED = 5

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ContainerEntry, Gpu


class Outcome(t.TypedDict, total=False):
    """free_gpus_result (plugins/filter/free_gpus_outcome.yml's RETURN)."""

    host: str
    status: str
    ok: bool
    message: str
    count: int | None
    selected: list[int]
    mib_before: int | None
    mib_after: int | None
    stopped_units: list[str]
    disabled_units: list[str]
    masked_units: list[str]
    failed_units: list[str]
    stopped_containers: list[str]
    disabled_containers: list[str]
    killed: list[dict[str, t.Any]]
    # The files clean_shm removed from /dev/shm (in check mode, would remove), and their MiB.
    shm_removed: list[str]
    shm_removed_mib: float
    # The files of killed jobs' patterns clean_shm kept ({path, size_mib, why}): nothing ties them to a process the run ended.
    shm_kept: list[dict[str, t.Any]]
    shm_removed_count: int
    shm_kept_count: int
    killed_count: int
    protected: list[t.Any]
    spanning: list[dict[str, t.Any]]
    # The multi-node jobs whose ranks here were ended (gpu_release's multi_node, each job once).
    multi_node: list[str]
    # Ray actors ended through Ray (gpu_release's ray_actors; in check mode, those it would end): their names.
    ray_actors: list[str]
    footprint_gpus: list[int | None]
    footprint_mib: int | None
    nvml_clients: list[dict[str, t.Any]]
    nvml_clients_with_units: list[dict[str, t.Any]]
    elapsed_s: float | None
    check_mode: bool
    healthy: bool | None
    health_issues: list[str]
    health_unchecked: list[str]
    smoke_test_passed: bool | None
    smoke_test_issues: list[str]
    # Issue 71: the GPUs gpu_release found busy with no process after its kills (what was seen and
    # done), and those ready_fix set back to the training-ready profile ({index, uuid, changes}).
    ghost_busy: list[str]
    ready_fixed: list[dict[str, t.Any]]
    smoke_test_notes: list[str]
    stopped_by: list[str]
    # free_gpus_services entries that match something on this host, those that match nothing, and
    # for those the nearest units here (the role's fleet check reads every host's).
    services_matched: list[str]
    services_unmatched: list[str]
    services_close: dict[str, list[str]]
    # The hosts whose settings mistake stopped this one before it acted (it has none of its own).
    mistake_on: list[str]


def _mib(gpus: list[Gpu]) -> int | None:
    values = [g.get("memory_used_mib") for g in gpus]
    return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


def _plural(count: int, word: str, plural: str = "s") -> str:
    return "{} {}{}".format(count, word, "" if count == 1 else plural)


def container_label(entry: ContainerEntry | t.Mapping[str, t.Any]) -> str:
    """A stopped_containers entry of gpu_release -> `vllm (vllm/vllm-openai:v0.11.0)`."""
    name = entry.get("name") or str(entry.get("id") or "?")[:12]
    return "{} ({})".format(name, entry["image"]) if entry.get("image") else name


def footprint_note(outcome: Outcome | t.Mapping[str, t.Any]) -> str:
    gpus = outcome.get("footprint_gpus") or []
    return "GPU{} {} ({} MiB)".format("" if len(gpus) == 1 else "s", ",".join(str(g) for g in gpus), outcome.get("footprint_mib"))


def _spanning(result: t.Mapping[str, t.Any]) -> list[dict[str, t.Any]]:
    """gpu_release's `spanning` -> what the summary shows of each: who, and the GPUs it uses."""
    found = []
    for entry in result.get("spanning") or []:
        if isinstance(entry, Mapping):
            found.append({key: entry.get(key) for key in ("pid", "name", "unit", "container", "gpu_indexes", "outside_gpus")})
    return found


def spanning_note(spanning: list[dict[str, t.Any]]) -> str:
    """`pid 700 python3 uses GPUs 0,1`, `vllm.service uses GPUs 0,1`, one per entry."""
    notes = []
    for entry in spanning:
        who = ("pid {} {}".format(entry["pid"], entry.get("name") or "?") if entry.get("pid") is not None
               else entry.get("unit") or "container {}".format(str(entry.get("container") or "?")[:12]))
        notes.append("{} uses GPUs {}".format(who, ",".join(str(i) for i in entry.get("gpu_indexes") or [])))
    return ", ".join(notes)


def _unchecked(result: t.Mapping[str, t.Any]) -> list[str]:
    """The health checks that could not run on some GPU (each GPU's health_unchecked), in docs order."""
    names = {name for g in result.get("gpus") or [] if isinstance(g, Mapping) for name in g.get("health_unchecked") or []}
    return sorted(names, key=lambda name: (CHECKS.index(name) if name in CHECKS else len(CHECKS), name))


def _smoke_notes(gpus: t.Sequence[t.Mapping[str, t.Any]]) -> list[str]:
    """'smoke test passed on 2 GPUs (1024 MiB each, 0.41 s)' and each GPU skipped, with why."""
    records = [(g.get("index"), g["smoke_test"]) for g in gpus if isinstance(g.get("smoke_test"), Mapping)]
    passed = [r for _i, r in records if r.get("ok") is True]
    notes = []
    if passed:
        notes.append("smoke test passed on {} ({} MiB, {} s)".format(
            _plural(len(passed), "GPU"), "/".join(sorted({str(r.get("mib")) for r in passed})),
            round(sum(r.get("seconds") or 0 for r in passed), 3)))
    notes.extend("smoke test skipped on GPU {}: {}".format(i, r.get("skipped")) for i, r in records if r.get("ok") is None)
    return notes


def shm_note(outcome: Outcome | t.Mapping[str, t.Any]) -> str:
    """'removed 4 files of /dev/shm (32.0 MiB)', or 'would remove' in check mode."""
    verb = "would remove" if outcome.get("check_mode") else "removed"
    count = outcome.get("shm_removed_count") or len(outcome.get("shm_removed") or [])
    return "{} {} of /dev/shm ({} MiB)".format(verb, _plural(count, "file"), outcome.get("shm_removed_mib"))


def _truncated(result: t.Mapping[str, t.Any], key: str) -> int | None:
    """How many entries a list of the result had before gpu_release cut it (its `truncated`), or None."""
    counts = result.get("truncated")
    count = counts.get(key) if isinstance(counts, Mapping) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def shm_kept_note(outcome: Outcome | t.Mapping[str, t.Any]) -> str:
    """'kept 1 file of /dev/shm (1.0 MiB): /dev/shm/psm_1a2b3c4d (why)', every file and its reason
    in the one line."""
    kept = outcome.get("shm_kept") or []
    count = max(int(outcome.get("shm_kept_count") or 0), len(kept))
    # A user decides how many such files there are: the line names the first few, then counts.
    said = "; ".join("{} ({})".format(k.get("path"), k.get("why")) for k in kept[:SHM_KEPT_NAMED])
    if count > SHM_KEPT_NAMED:
        said += f"; and {count - SHM_KEPT_NAMED:d} more"
    return "kept {} of /dev/shm ({:g} MiB{}): {}".format(
        _plural(count, "file"), round(sum(float(k.get("size_mib") or 0) for k in kept), 1),
        "" if count == len(kept) else " listed", said)


def _record(result: t.Mapping[str, t.Any], host: str, check_mode: bool) -> Outcome:
    """The figures of free_gpus_result, before the verdict: what was read and what was done."""
    after = selected_gpus(result)
    footprint = [g for g in after if g.get("cross_gpu_footprint")]
    clients = [h for h in result.get("holders") or [] if isinstance(h, Mapping) and h.get("attribution") == "nvml_client"]
    ending = set(result.get("stopped_units") or [])
    removed = [f for f in result.get("shm_removed") or [] if isinstance(f, Mapping)]
    return {
        "host": host,
        # None (shown "-") when gpu_release read no GPU: it failed before it looked, never "0/0".
        "count": len(result["gpus"]) if result.get("gpus") else None,
        "selected": result.get("selected_gpus") or [],
        "mib_before": _mib(selected_gpus(result, "gpus_before")),
        "mib_after": _mib(after),
        # A system container's units (`lxc:101:vllm.service`, stopped through the guest's systemd) read as units, by that name.
        "stopped_units": (result.get("stopped_units") or []) + (result.get("stopped_guest_units") or []),
        "disabled_units": (result.get("disabled_units") or []) + (result.get("disabled_guest_units") or []),
        "masked_units": (result.get("masked_units") or []) + (result.get("masked_guest_units") or []),
        # Killed through systemd and left `failed` (Result=signal) until gpu_restore resets them.
        "failed_units": list(result.get("failed_units") or []),
        "stopped_containers": [container_label(c) for c in result.get("stopped_containers") or []],
        "disabled_containers": [container_label(c) for c in result.get("disabled_containers") or []],
        "killed": [{"pid": k.get("pid"), "name": k.get("name"), "signal": k.get("signal"), "container": k.get("container"),
                    "sigkill_at_once": k.get("sigkill_at_once"), "asleep": bool((k.get("sleep_answer") or {}).get("asleep"))}
                   for k in result.get("killed") or [] if isinstance(k, Mapping)],
        "shm_removed": [str(f.get("path")) for f in removed],
        # gpu_release lists at most _caps.LIMIT of them: its total and its count (truncated) say the rest.
        "shm_removed_mib": round(float(result["shm_removed_mib"]) if isinstance(result.get("shm_removed_mib"), (int, float))
                                 else sum(float(f.get("size_mib") or 0) for f in removed), 1),
        "shm_removed_count": _truncated(result, "shm_removed") or len(removed),
        "shm_kept": [{"path": str(f.get("path")), "size_mib": f.get("size_mib"), "why": f.get("why")}
                     for f in result.get("shm_kept") or [] if isinstance(f, Mapping)],
        "shm_kept_count": _truncated(result, "shm_kept") or len(result.get("shm_kept") or []),
        "killed_count": _truncated(result, "killed") or len(result.get("killed") or []),
        "protected": result.get("protected") or [],
        "spanning": _spanning(result),
        "multi_node": list(dict.fromkeys(str(r.get("launcher")) for r in result.get("multi_node") or [] if isinstance(r, Mapping))),
        "ray_actors": [str(a.get("name") or a.get("id")) for a in result.get("ray_actors") or []
                       if isinstance(a, Mapping) and (a.get("ended") or check_mode)],
        # Selected GPUs that read only the cross-GPU footprint of contexts on other GPUs (clean),
        # and the NVML clients (monitors, exporters) left running: they use no GPU memory.
        "footprint_gpus": [g.get("index") for g in footprint],
        "footprint_mib": _mib(footprint),
        "nvml_clients": [{"pid": h.get("pid"), "name": h.get("name")} for h in clients if not _ends_with_unit(h, ending, check_mode)],
        "nvml_clients_with_units": [{"pid": h.get("pid"), "name": h.get("name"), "unit": h.get("unit")} for h in clients
                                    if _ends_with_unit(h, ending, check_mode)],
        "elapsed_s": result.get("elapsed_s"),
        "check_mode": bool(check_mode),
        "healthy": result.get("healthy"),
        "health_issues": list(result.get("health_issues") or []),
        "health_unchecked": _unchecked(result),
        "smoke_test_passed": result.get("smoke_test_passed"),
        "smoke_test_issues": list(result.get("smoke_test_issues") or []),
        "ghost_busy": [str(said) for said in result.get("ghost_busy") or []],
        "ready_fixed": [{"index": f.get("index"), "uuid": f.get("uuid"), "changes": list(f.get("changes") or [])}
                        for f in result.get("ready_fixed") or [] if isinstance(f, Mapping)],
    }


def _ends_with_unit(holder: t.Mapping[str, t.Any], stopping: t.Container[str], check_mode: bool) -> bool:
    """Check mode: an NVML client of a host unit the real run stops (vllm.service's API server)
    ends with it; only a dry run still lists it among the holders left. A guest's process is the
    guest's unit's, named apart (stopped_guest_units)."""
    return check_mode and not holder.get("guest") and holder.get("unit") in stopping


def clients_with_units(clients: t.Iterable[t.Mapping[str, t.Any]]) -> str:
    """'1 NVML client stops with vllm.service' (check mode's plan, in the summary's words)."""
    clients = list(clients)
    units = list(dict.fromkeys(str(c.get("unit")) for c in clients))
    return "{} {} with {}".format(_plural(len(clients), "NVML client"), "stops" if len(clients) == 1 else "stop", ", ".join(units))


def planned_signals(killed: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    """Check mode's plan for the holders it would signal, with the signal the real run sends each:
    `would signal 2 processes (1 SIGTERM, then SIGKILL after kill_timeout; 512 python3 SIGKILL at once: stopped (state T))`."""
    at_once = [k for k in killed if k.get("sigkill_at_once")]
    ways = [f"{len(killed) - len(at_once)} SIGTERM, then SIGKILL after kill_timeout"] if len(at_once) < len(killed) else []
    ways += ["{} {} SIGKILL at once: {}".format(k.get("pid"), k.get("name") or "?", k["sigkill_at_once"]) for k in at_once]
    return "would signal {} ({})".format(_plural(len(killed), "process", "es"), "; ".join(ways))


def asleep_note(killed: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    """`pid 812 vllm: its server said it was asleep`: what killed holders' own vLLM servers said of
    their sleep (gpu_release's sleep_answer), quoted as their word; "" for none."""
    asleep = ["pid {} {}".format(k.get("pid"), k.get("name") or "?") for k in killed if k.get("asleep")]
    if not asleep:
        return ""
    return "{}: {} said {} asleep".format(", ".join(asleep), "its server" if len(asleep) == 1 else "their servers",
                                          "it was" if len(asleep) == 1 else "they were")


def _done(outcome: Outcome) -> list[str]:
    """What a host that passes had done and left running, in the message's words."""
    did = [f"{verb} {', '.join(names)}" for verb, names in (
        ("stopped", outcome["stopped_units"]), ("disabled", outcome["disabled_units"]), ("masked", outcome["masked_units"])) if names]
    if outcome["failed_units"]:
        did.append("left {} failed (killed through systemd; restore_gpus resets {})".format(
            ", ".join(outcome["failed_units"]), "it" if len(outcome["failed_units"]) == 1 else "them"))
    did += ["{} container{} {}".format(verb, "" if len(names) == 1 else "s", ", ".join(names)) for verb, names in (
        ("stopped", outcome["stopped_containers"]), ("disabled", outcome["disabled_containers"])) if names]
    if outcome.get("ray_actors"):
        # Before any signal, so that Ray's GCS does not start them again (_act/_ray).
        did.append("{} Ray actor{} {} through Ray (no_restart)".format("would end" if outcome["check_mode"] else "ended",
                                                                       "" if len(outcome["ray_actors"]) == 1 else "s", ", ".join(outcome["ray_actors"])))
    if outcome["killed"] and outcome["check_mode"]:
        did.append(planned_signals(outcome["killed"]))
    elif outcome["killed"]:
        asleep = asleep_note(outcome["killed"])
        did.append("killed " + _plural(outcome.get("killed_count") or len(outcome["killed"]), "process", "es") + (f" ({asleep})" if asleep else ""))
    if outcome.get("multi_node"):
        # Said in the first sentence: the job's ranks elsewhere keep their GPUs until freed too.
        did.append("ranks of multi-node {} (their ranks on the other nodes hang in a collective until freed)".format("; ".join(outcome["multi_node"])))
    if outcome["shm_removed"]:
        did.append(shm_note(outcome))
    if outcome["shm_kept"]:
        did.append(shm_kept_note(outcome))
    if outcome["spanning"]:
        did.append(f"ended spanning {spanning_note(outcome['spanning'])} (kill_spanning)")
    if outcome["footprint_gpus"]:
        did.append(f"{footprint_note(outcome)} at the cross-GPU footprint")
    did.extend(outcome["smoke_test_notes"])
    if outcome["nvml_clients_with_units"]:
        did.append(clients_with_units(outcome["nvml_clients_with_units"]))
    if outcome["nvml_clients"]:
        did.append(_plural(len(outcome["nvml_clients"]), "NVML client") + " left running")
    return did


def _passed(outcome: Outcome, result: t.Mapping[str, t.Any], host: str) -> Outcome:
    """A host that passes: its status (clean, freed, would free) and the message of what was done."""
    outcome["ok"] = True
    after = selected_gpus(result)
    outcome["smoke_test_notes"] = _smoke_notes(after)
    did = _done(outcome)
    changed = bool(result.get("changed"))
    if outcome["check_mode"]:
        outcome["status"] = "would free" if result.get("released") is False or changed else "clean"
    else:
        outcome["status"] = "freed" if changed else "clean"
    outcome["message"] = "{}: {} {} ({} -> {} MiB){} in {} s".format(
        host, _plural(len(after), "GPU"), "free" if not outcome["check_mode"] else outcome["status"],
        outcome["mib_before"], outcome["mib_after"], ", " + ", ".join(did) if did else "", outcome["elapsed_s"])
    if outcome["health_unchecked"]:
        # Said aloud: a check that could not run is no proof of health (docs/docsite/rst/guide_health.rst).
        outcome["message"] += "; not checked on this driver or GPU: " + ", ".join(outcome["health_unchecked"])
    return outcome


def outcome_of(result: t.Mapping[str, t.Any], host: str, found: Verdict, check_mode: bool = False) -> Outcome:
    """A gpu_release result and its verdict -> the `free_gpus_result` fact: status, MiB before/after, a message."""
    outcome = _record(result, host, check_mode)
    if found.problems:
        outcome["status"] = found.status
        outcome["ok"] = False
        outcome["message"] = "{}: {}".format(host, "; ".join(found.problems))
        return outcome
    return _passed(outcome, result, host)


def outcome(result: t.Mapping[str, t.Any], host: str, expected_count: int | None = 0, check_mode: bool = False,
            require_healthy: bool = False) -> Outcome:
    """free_gpus_outcome: the verdict and the fact in one call."""
    return outcome_of(result, host, verdict(result, expected_count, check_mode, require_healthy), check_mode)


def failed(host: str, message: object, status: str = "failed") -> Outcome:
    """The `free_gpus_result` of a host that failed before gpu_release gave a result (a bad
    variable, a template error): no GPU figures, the message."""
    text = " ".join(str(message).split("\n"))
    return {
        "host": host, "status": status, "ok": False, "message": text if text.startswith(f"{host}: ") else f"{host}: {text}",
        "count": None, "selected": [], "mib_before": None, "mib_after": None, "stopped_units": [], "disabled_units": [],
        "masked_units": [], "failed_units": [], "stopped_containers": [], "disabled_containers": [], "killed": [], "shm_removed": [],
        "shm_removed_mib": 0.0, "shm_removed_count": 0, "shm_kept": [], "shm_kept_count": 0, "killed_count": 0, "protected": [],
        "footprint_gpus": [], "footprint_mib": None,
        "nvml_clients": [], "nvml_clients_with_units": [],
        "elapsed_s": None, "check_mode": False, "healthy": None, "health_issues": [],
    }


def stopped(own: t.Mapping[str, t.Any] | None, host: str, failed_hosts: t.Sequence[str], missing: t.Sequence[str] = (),
            outcomes: t.Mapping[str, t.Any] | None = None) -> Outcome:
    """A host that any_errors_fatal stops because other hosts failed: its own outcome, with
    `status` stopped, `stopped_by` naming those hosts and a message that says so (and how to put
    back what its run stopped, which stays stopped). When every one of them failed for a settings
    mistake (OUTCOMES, theirs), the message says that first, with the variables: this line may be
    printed above theirs, and the cause is the first thing read."""
    outcome = t.cast(Outcome, dict(own)) if isinstance(own, Mapping) else failed(host, "stopped", "stopped")
    outcome["stopped_by"] = list(failed_hosts or missing)
    if failed_hosts:
        why = "{} failed".format(", ".join(failed_hosts))
    elif missing:
        why = "{} failed or {} unreachable".format(", ".join(missing), "was" if len(missing) == 1 else "were")
    else:
        why = "another host failed or was unreachable (see the recap)"
    said = "its GPUs are free" if outcome.get("ok") else "it was not checked"
    mistakes = [(name, (outcomes or {}).get(name)) for name in failed_hosts]
    if failed_hosts and all(isinstance(found, Mapping) and found.get("status") == "invalid" for _name, found in mistakes):
        names = list(dict.fromkeys(name for _host, found in mistakes for name in _mistaken(t.cast(t.Mapping[str, t.Any], found))))
        outcome["message"] = "{}: the play stops here because {} {} a settings mistake{}, said on {} line (any_errors_fatal); {}".format(
            host, ", ".join(failed_hosts), "has" if len(failed_hosts) == 1 else "have", f" ({', '.join(names)})" if names else "",
            "its" if len(failed_hosts) == 1 else "their", said)
    else:
        outcome["message"] = f"{host}: {said}, but the play stops here because {why} (any_errors_fatal)"
    if any(outcome.get(key) for key in ("stopped_units", "disabled_units", "masked_units", "stopped_containers", "disabled_containers")):
        outcome["message"] += (f"; what was stopped here stays stopped: put it back with "
                               f"`ansible-playbook playbooks/restore_gpus.yml -l {host}` (or the zeromib.gpu.restore_gpus role)")
    outcome["status"] = "stopped"
    return outcome


# gpu_release's options that its messages name and that the role sets as free_gpus_<option>: in
# the role's messages they are named as the user sets them. Words that are also plain English
# (kill, gpus, services, match, protect, timeout) are renamed only where a message uses them as
# an option (`kill=false`, `name it in services`, `services: ...` at the start).
_OPTION_WORDS = ("max_used_mib", "nvidia_smi", "kill_spanning", "service_state", "wait_timeout", "kill_timeout", "stop_owning_units",
                 "expected_mig_mode", "min_pcie_gen", "min_pcie_width", "cross_gpu_footprint_mib", "smoke_test_mib", "xid_ignore",
                 "xid_fatal", "xid_window_hours", "settle_timeout", "poll_interval", "require_persistence", "launchers", "dcgm_diag",
                 "shm_min_free_mib_per_gpu", "clean_shm")
_OPTION = re.compile(r"(?<![\w.-])({})(?![\w-])".format("|".join(_OPTION_WORDS)))
_CONTEXT = (
    (re.compile(r"(?<![\w.-])(kill|smoke_test)=(false|true)"), r"free_gpus_\1: \2"),
    (re.compile(r"(?<![\w.-])(kill|smoke_test)(: (?:false|true))"), r"free_gpus_\1\2"),
    (re.compile(r"\b(name (?:it|that unit|one) in) (services|match|protect)\b"), r"\1 free_gpus_\2"),
    (re.compile(r"(^|; |: )(services|match|protect|gpus): "), r"\1free_gpus_\2: "),
    # The module's own pointer to the role's name is now the name itself.
    (re.compile(r"; role: free_gpus_\w+(?:, ([^)]*))?\)"), lambda m: f"; {m.group(1)})" if m.group(1) else ")"),
    (re.compile(r" \(role: free_gpus_\w+(?:, ([^)]*))?\)"), lambda m: f" ({m.group(1)})" if m.group(1) else ""),
)


def in_role_words(text: str) -> str:
    """A gpu_release message as the free_gpus role's user reads it: its options named as the role
    variables they set (`set max_used_mib: 64 (its 55 MiB reading with a margin; role:
    free_gpus_max_used_mib, per host or group)` -> `set free_gpus_max_used_mib: 64 (its 55 MiB
    reading with a margin; per host or group)`)."""
    text = _OPTION.sub(r"free_gpus_\1", str(text))
    for pattern, replacement in _CONTEXT:
        text = pattern.sub(replacement, text)  # type: ignore[arg-type]
    return text


SETTINGS_MISTAKE = "settings mistake, nothing was done"


def _reason(outcome: t.Mapping[str, t.Any]) -> str:
    """An outcome's message without its host's name."""
    host, message = str(outcome.get("host")), str(outcome.get("message") or "")
    return message[len(host) + 2:] if message.startswith(f"{host}: ") else message


def same_mistakes(outcomes: t.Iterable[t.Any]) -> dict[str, str]:
    """{host: the first host with the same settings mistake} for each host of OUTCOMES (in the
    order they are said) whose settings mistake an earlier one has word for word: a mistake of the
    whole play (`-e`, the play's or the role's vars, a group's) is said once, on its first host."""
    first: dict[str, str] = {}
    same: dict[str, str] = {}
    for outcome in outcomes:
        if not isinstance(outcome, Mapping) or outcome.get("status") != "invalid" or not outcome.get("host") or outcome.get("mistake_on"):
            # A host held still by another's mistake says that host's name, already short.
            continue
        reason = _reason(outcome)
        if reason in first:
            same[str(outcome["host"])] = first[reason]
        else:
            first[reason] = str(outcome["host"])
    return same


def _mistaken(outcome: t.Mapping[str, t.Any]) -> list[str]:
    """The variables a settings mistake names, each once: `free_gpus_wait_timeout must be ...; free_gpus_sevices is not ...`."""
    reason = _reason(outcome)
    said = reason.split(": ", 1)[1] if reason.startswith(SETTINGS_MISTAKE) and ": " in reason else reason
    return list(dict.fromkeys(re.findall(r"(?:^|; )(free_gpus_\w+)", said)))


def same_mistake_message(outcome: t.Mapping[str, t.Any], first: str) -> str:
    """`h2: settings mistake, nothing was done: the same as h1 (free_gpus_wait_timeout), whose line says it`."""
    names = _mistaken(outcome)
    return "{}: {}: the same as {}{}, whose line says it".format(outcome.get("host"), SETTINGS_MISTAKE, first,
                                                                 " ({})".format(", ".join(names)) if names else "")
