# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""systemd units: which to stop, disable or mask, and doing it within a time bound.

Everything here talks to systemd through one `systemctl(args) -> (rc, out, err)` callable
(the `System` seam of _release, which also gives `now()` and `sleep()`), so the plans are
tested without a systemd. Which unit is a GPU workload and which is a launcher of other
people's jobs is decided by one pure function, `stop_verdict`."""

from __future__ import annotations

import fnmatch
import re
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._act._unit_kinds import (  # noqa: F401 - as callers and tests know them
    ESSENTIAL_UNITS, LAUNCHER_NAMES, LAUNCHER_UNITS, NODE_KEEPING_UNITS, UNIT_SUFFIXES, is_glob, is_template, normalize_unit,
    parse_list_units,
)

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    Systemctl = t.Callable[[t.List[str]], t.Tuple[int, str, str]]

    class Node(t.Protocol):
        """What acting on units needs of _release.System."""

        def systemctl(self, args: list[str]) -> tuple[int, str, str]: ...
        def now(self) -> float: ...
        def sleep(self, seconds: float) -> None: ...

    class UnitPlan(t.TypedDict):
        """plan(): what to do to which unit, and what the plan found (kept units, warnings)."""

        stop: list[str]
        disable: list[str]
        mask: list[str]
        not_found: list[str]
        # systemctl show's properties before, by unit (the restore record's).
        before: dict[str, dict[str, str]]
        kept_units: list[dict[str, t.Any]]
        warnings: list[str]

    class UnitsDone(t.TypedDict, total=False):
        """What acting on units did, under the release result's keys (Release folds it in)."""

        stopped_units: list[str]
        killed_units: list[str]
        failed_units: list[str]
        disabled_units: list[str]
        masked_units: list[str]
        kept_units: list[dict[str, t.Any]]
        warnings: list[str]

ACTIVE_STATES = ("active", "activating", "deactivating", "reloading", "refreshing")
ENABLED_STATES = ("enabled", "enabled-runtime", "linked", "linked-runtime")
MASKED_STATES = ("masked", "masked-runtime")
# A stop is over when the unit reads one of these (a unit killed with SIGKILL ends "failed").
STOPPED_STATES = ("inactive", "failed")


SLURM_JOB_CGROUP = re.compile(r"/job_(\d+)(?:/|$)")
# systemctl show polls: first fast (a cooperative unit stops in ~0.1 s), then every STOP_POLL_MAX_S.
STOP_POLL_S = 0.02
STOP_POLL_MAX_S = 0.2


def matches(unit: str, patterns: t.Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(unit, pattern) for pattern in patterns)


def expand_services(patterns: t.Iterable[str] | None, known_units: t.Collection[str], no_match: list[str] | None = None) -> list[str]:
    """Unit names and globs -> unit names. A plain name is kept even if unknown (systemctl
    reports it not-found); a glob expands over the units systemd knows; globs that match
    nothing are appended to `no_match`, if given."""
    units = []
    for pattern in patterns or []:
        pattern = normalize_unit(pattern)
        if is_glob(pattern):
            found = sorted(unit for unit in known_units if fnmatch.fnmatchcase(unit, pattern))
            if not found and no_match is not None:
                no_match.append(pattern)
        else:
            found = [pattern]
        for unit in found:
            if unit not in units:
                units.append(unit)
    return units


def parse_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show -p Id,LoadState,ActiveState,SubState,UnitFileState u1 u2` -> {Id: props}."""
    units = {}
    current: dict[str, str] = {}
    for line in text.splitlines() + [""]:
        if not line.strip():
            if current.get("Id"):
                units[current["Id"]] = current
            current = {}
            continue
        key, _sep, value = line.partition("=")
        current[key] = value
    return units


def unit_actions(props: dict[str, str], service_state: str | None) -> tuple[bool, bool, bool]:
    """What to do to one named unit: (stop, disable, mask)."""
    if props.get("LoadState") in (None, "not-found"):
        return False, False, False
    stop = props.get("ActiveState") in ACTIVE_STATES or props.get("SubState") == "auto-restart"
    file_state = props.get("UnitFileState", "")
    disable = service_state == "disabled" and file_state in ENABLED_STATES
    mask = service_state == "masked" and file_state not in MASKED_STATES and props.get("LoadState") != "masked"
    return stop, disable, mask


# ---------------------------------------------------------------- workload or launcher


# The names a process goes by (comm, executable, argv[0], script, "tool subcommand"): _holders.
process_names = _protect.process_names


def exec_start_names(text: str | None) -> set[str]:
    """The names of the commands in a unit's `ExecStart=` as `systemctl show` prints it
    (`{ path=/usr/bin/ray ; argv[]=/usr/bin/ray start --block ; ... }`): what systemd itself
    runs, whatever the process later calls itself."""
    names = set()
    for command in (text or "").split("{")[1:]:
        fields = dict(
            (key.strip(), value.strip()) for key, _sep, value in (part.partition("=") for part in command.split(" ; ")) if key.strip()
        )
        argv = fields.get("argv[]", "").split()
        path = fields.get("path", "")
        if argv or path:
            names |= process_names({"exe": path.rsplit("/", 1)[-1], "argv0": argv[0].rsplit("/", 1)[-1] if argv else None,
                                    "cmdline": " ".join(argv)})
    return names


def split_launchers(entries: t.Iterable[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The `launchers` option -> (unit globs, process name globs): an entry that ends with a unit
    suffix (`mysched*.service`) names units, any other (`mysched`, `my-agent*`) processes."""
    unit_globs, names = [], []
    for entry in entries or []:
        entry = str(entry).strip()
        if not entry:
            continue
        if entry.rsplit(".", 1)[-1] in UNIT_SUFFIXES and "." in entry:
            unit_globs.append(entry)
        else:
            names.append(entry)
    return tuple(unit_globs), tuple(names)


def launcher_name(names: t.Collection[str], site_names: t.Iterable[str] = ()) -> str | None:
    """The launcher name that one of `names` is (comm is cut at 15 characters), or a name that
    matches a name glob of the `launchers` option, or None. `names` are those systemd vouches
    for: its ExecStart= and its MainPID's (main_names)."""
    return LAUNCHER_NAMES.among(names, site_names)


def systemd_main(pid: int) -> t.Callable[[str], int | None]:
    """main_pid_of for the identity rule when `pid` is the MainPID systemd gave for the unit asked."""
    def main_pid_of(_unit: str) -> int | None:
        return pid
    return main_pid_of


def main_names(pid: int, record: t.Mapping[str, t.Any] | None, props: t.Mapping[str, str]) -> set[str]:
    """The names of a unit's main process (systemd's MainPID `pid`, its record read from /proc),
    through the identity rule, and of its ExecStart= (systemd's own, from a unit file only root
    writes)."""
    names = exec_start_names(props.get("ExecStart"))
    if pid > 0 and _protect.identified(record, systemd_main(pid)):
        names |= process_names(record)
    return names


def stop_verdict(unit: str, main_names: t.Collection[str], under_main: bool, unit_gpus: t.Collection[int], selected: t.Collection[int],
                 site: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> tuple[str, str] | None:
    """Whether stopping UNIT through systemd is how to free the selected GPUs of its holders.

    None: stop it, it IS the workload (vllm.service: its main process or the main process's
    descendants hold the GPUs; vLLM V1's API server holds none, its EngineCore child does; a
    unit that also runs processes without a GPU - an API server, Python's multiprocessing
    resource tracker, tokenizer workers - is no launcher for that).
    Otherwise (kind, why), its holders are signalled instead and the unit keeps running:
    kind "launcher" for a unit that starts other people's jobs (recognised by the unit's name,
    by the names of its main process and of its ExecStart=, or because the holders are not its
    main process or its descendants: slurmstepd is reparented to PID 1 inside slurmd.service;
    `site` adds the `launchers` option's (unit globs, process names)), kind "other_gpus" for a
    workload that also holds GPUs outside the selection: a spanning unit, never stopped for a
    partial selection unless kill_spanning says so.

    Recognising a launcher only ever keeps a unit running (its GPU holders are still signalled),
    so names a process gives itself can make root stop less, never more."""
    site_units, site_names = site
    if matches(unit, LAUNCHER_UNITS) or matches(unit, site_units):
        return "launcher", f"{unit} starts other jobs (scheduler, cron, hub, CI runner, container engine, supervisor or cluster runtime)"
    launcher = launcher_name(main_names, site_names)
    if launcher:
        return "launcher", f"the main process of {unit} ({launcher}) starts other jobs"
    if not under_main:
        return "launcher", f"the GPU processes of {unit} are not its main process or its descendants"
    outside = sorted(set(unit_gpus) - set(selected))
    if outside:
        return "other_gpus", "{} also holds GPU {}, outside the selection".format(unit, ", ".join(str(i) for i in outside))
    return None


def slurm_job_id(cgroup_path: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The Slurm job a process runs in: `job_<id>` in its cgroup (cgroup v2, task/cgroup), else
    SLURM_JOB_ID in its environment (proctrack/linuxproc, cgroup v1: tasks sit in slurmd's cgroup)."""
    match = SLURM_JOB_CGROUP.search(cgroup_path or "")
    if match:
        return match.group(1)
    return (environ or {}).get("SLURM_JOB_ID", "").strip() or None


def main_pid(props: dict[str, str]) -> int:
    """A unit's MainPID from `systemctl show` (0 when none or unreadable)."""
    try:
        return int(props.get("MainPID") or 0)
    except ValueError:
        return 0


def main_process(props: dict[str, str], proc: str) -> tuple[int, Holder | None]:
    """(MainPID, its /proc record or None) of a unit."""
    pid = main_pid(props)
    return pid, (holders_mod.read_process(pid, proc) if pid > 0 else None)


def protected_main(pid: int, record: t.Mapping[str, t.Any] | None, protect_names: t.Iterable[str] = ()) -> str | None:
    """"pid N name" when a unit's main process is protected (built-in names or `protect`, through
    the identity rule: systemd's MainPID of the unit), else None: such a unit is never stopped,
    named or owning a holder."""
    main = systemd_main(pid)
    if record and (_protect.BUILTIN_PROTECTED_NAMES.of(record, main) or _protect.ProcessNames(*(protect_names or ())).of(record, main)):
        return "pid {} {}".format(pid, record.get("name"))
    return None


def _service_units(targets: list[Holder]) -> list[str]:
    units: list[str] = []
    for holder in targets:
        unit = holder.get("unit")
        if holder.get("system_service") and unit and unit not in units:
            units.append(unit)
    return units


def _unit_gpus(unit: str, holders: list[Holder]) -> set[int]:
    used: set[int] = set()
    for holder in holders:
        if holder.get("unit") == unit and holder.get("system_service"):
            used.update(holder.get("gpu_indexes") or [])
    return used


def owned_refusal(unit: str, has_main: bool, named: t.Collection[str], explicit: t.Collection[str]) -> str | None:
    """Why a unit that owns holders is not stopped for them, whatever else it is, or None: the
    refusals of named units hold for owned ones too (a holder's unit is what systemd says, yet the
    holder chose to run there). Essential units never (named or not); what keeps the node reachable
    and its data safe only when named exactly; a unit without a main process (oneshot,
    RemainAfterExit=yes, or its main process ended) only when named: with no main process there is
    no workload to tell its holders by, any process in it may be anyone's. `named`: the units the
    services entries select (globs expanded), `explicit`: those named exactly. Pure."""
    if matches(unit, ESSENTIAL_UNITS):
        return f"{unit} is essential to the node (systemd's own units, D-Bus, login, SSH, consoles, networking): never stopped"
    kind = keeps_node(unit)
    if kind and unit not in explicit:
        return f"{unit} is {kind}: the node needs it to stay reachable and its data safe; stopped only when services names it exactly"
    if not has_main and unit not in named and unit not in explicit:
        return f"{unit} has no main process (oneshot, RemainAfterExit=yes, or it ended): stopped for its holders only when services names it"
    return None


def _owner_verdict(unit: str, props: dict[str, str], in_unit: list[Holder], unit_gpus: set[int], selected: list[int],
                   forbidden: set[str], proc: str, protect_names: t.Iterable[str], site: tuple[tuple[str, ...], tuple[str, ...]],
                   named: t.Collection[str] = (), explicit: t.Collection[str] = ()) -> tuple[str, str] | None:
    """stop_verdict for a unit that owns targets, with this session's, protected and refused
    units (owned_refusal) first."""
    if unit in forbidden:
        return "launcher", f"{unit} runs this Ansible session or a protected process"
    pid, main = main_process(props, proc)
    protected = protected_main(pid, main, protect_names)
    if protected:
        return "launcher", f"the main process of {unit} ({protected}) is protected"
    refused = owned_refusal(unit, main is not None, named, explicit)
    if refused:
        return "launcher", refused
    # Without a main process (named: owned_refusal lets it through) every holder is the workload named.
    under_main = main is None or all(pid in holders_mod.lineage(h["pid"], proc) for h in in_unit)
    return stop_verdict(unit, main_names(pid, main, props), under_main, unit_gpus, selected, site)


def owners(systemctl: Systemctl, targets: list[Holder], holders: list[Holder], selected: list[int], forbidden: set[str],
           proc: str = "/proc", protect_names: t.Iterable[str] = (), launchers: t.Iterable[str] = (), kill_spanning: bool = False,
           named: t.Iterable[str] = ()) -> tuple[list[str], list[dict[str, t.Any]], list[dict[str, t.Any]]]:
    """The system services that own targets -> (to stop, launchers, spanning).

    `launchers` (returned) lists, per unit (and Slurm job), the holders signalled instead of
    stopping it: [{unit, reason, pids, slurm_job_id}]; holders in a Slurm job outside any
    service (a slurmstepd scope) are listed too. `forbidden` units (this session's, a protected
    process's) and units whose main process is protected are never stopped. `spanning` lists
    the workload units that also hold GPUs outside the selection: [{unit, pids, gpu_indexes,
    outside_gpus}]; they are stopped (and still listed) only with `kill_spanning`: the caller
    refuses to act otherwise. `launchers` (the option) adds a site's own (see split_launchers).

    `named`: the services entries (unit names and globs). A unit that services does not name is
    never stopped for its holders when it is essential, keeps the node reachable, or has no main
    process (owned_refusal): its holders are signalled and it is listed in `launchers`.

    Which unit a holder is in is systemd's (the look's _unit_owner: its ControlGroup= is the
    holder's cgroup or the directory a delegated subtree starts at), the unit's main process and
    command too (MainPID, ExecStart)."""
    site = split_launchers(launchers)
    patterns = [normalize_unit(p) for p in named or []]
    explicit = {p for p in patterns if not is_glob(p)}
    units = _service_units(targets)
    props: dict[str, dict[str, str]] = {}
    if units:
        rc, out, _err = systemctl(["show", "--property=Id,MainPID,ExecStart", "--no-pager"] + units)
        props = parse_show(out) if rc == 0 else {}
    to_stop: list[str] = []
    spanning: list[dict[str, t.Any]] = []
    reasons: dict[str, str] = {}
    for unit in units:
        in_unit = [h for h in targets if h.get("unit") == unit and h.get("system_service")]
        unit_gpus = _unit_gpus(unit, holders)
        verdict = _owner_verdict(unit, props.get(unit, {}), in_unit, unit_gpus, selected, forbidden, proc, protect_names, site,
                                 {unit} if matches(unit, patterns) else set(), explicit)
        if verdict is not None and verdict[0] == "launcher":
            reasons[unit] = verdict[1]
            continue
        if verdict is not None:
            spanning.append({"unit": unit, "pids": sorted(h["pid"] for h in in_unit), "gpu_indexes": sorted(unit_gpus),
                             "outside_gpus": sorted(unit_gpus - set(selected))})
        if verdict is None or kill_spanning:
            to_stop.append(unit)
    return to_stop, launcher_entries(targets, reasons, proc), spanning


def launcher_entries(targets: list[Holder], reasons: dict[str, str], proc: str = "/proc") -> list[dict[str, t.Any]]:
    """[{unit, reason, pids, slurm_job_id}]: the targets signalled instead of stopping their unit
    (`reasons`: why, by unit), and those in a Slurm job."""
    entries: list[dict[str, t.Any]] = []
    for holder in targets:
        unit = holder.get("unit")
        reason = reasons.get(unit or "") if holder.get("system_service") else None
        job = (slurm_job_id(holder.get("cgroup"), holders_mod.environ_of(holder["pid"], proc))
               if reason or not holder.get("system_service") else None)
        if reason is None and job is None:
            continue
        if reason is None:
            reason = f"Slurm job {job}"
        entry = next((e for e in entries if e["unit"] == unit and e["slurm_job_id"] == job), None)
        if entry is None:
            entry = {"unit": unit, "reason": reason, "pids": [], "slurm_job_id": job}
            entries.append(entry)
        entry["pids"].append(holder["pid"])
    return entries


# ---------------------------------------------------------------- named units


def known_units(systemctl: Systemctl, named: list[str], service_state: str | None) -> list[str]:
    """The units systemd knows that the globs among `named` may match: the loaded ones (what
    runs, what restarts, what is wanted at boot) and the unit files nobody loaded (an enabled
    vllm.service that is inactive, a disabled one to mask). The unit files are listed (~0.2 s)
    only when they can change the answer: to disable or mask, or when a glob matched no loaded
    unit (so no false "matches no unit" warning). Templates (`ifup@.service`) are no unit that
    can be stopped: their instances are."""
    globs = [normalize_unit(p) for p in named if is_glob(p)]
    if not globs:
        return []
    known: list[str] = []
    rc, out, _err = systemctl(["list-units", "--all", "--plain", "--no-legend", "--no-pager"] + globs)
    if rc == 0:
        known.extend(parse_list_units(out))
    unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(unit, g) for unit in known)]
    if service_state in ("disabled", "masked") or unmatched:
        rc, out, _err = systemctl(["list-unit-files", "--plain", "--no-legend", "--no-pager"] + globs)
        if rc == 0:
            known.extend(unit for unit in parse_list_units(out) if unit not in known)
    return [unit for unit in known if not is_template(unit)]


def keeps_node(unit: str) -> str | None:
    """Why a glob never selects UNIT (network, storage, identity, remote access, time), or None."""
    for kind, patterns in NODE_KEEPING_UNITS:
        if matches(unit, patterns):
            return kind
    return None


SHOW_PROPERTIES = "Id,LoadState,ActiveState,SubState,UnitFileState,MainPID,TriggeredBy,FragmentPath,ExecStart"


def _show(systemctl: Systemctl, units: list[str], done: UnitPlan) -> dict[str, dict[str, str]]:
    rc, out, err = systemctl(["show", "--property=" + SHOW_PROPERTIES, "--no-pager"] + units)
    if rc != 0:
        raise StepFailed(f"systemctl show failed (rc {rc}): {(err or out).strip()}", _planned(done))
    return parse_show(out)


def _cannot_mask(props: dict[str, str]) -> bool:
    """systemctl mask puts a link to /dev/null in /etc/systemd/system: it fails for a unit whose
    own file (or link, `systemctl link`) is already there (measured, systemd 252)."""
    fragment = props.get("FragmentPath") or ""
    return fragment.startswith("/etc/systemd/system/") and props.get("LoadState") != "masked"


def _launcher_by_main(props: dict[str, str], site: tuple[tuple[str, ...], tuple[str, ...]], proc: str) -> str | None:
    """The launcher the main process (or ExecStart=) of a unit is, or None (see stop_verdict)."""
    return launcher_name(main_names(*main_process(props, proc), props), site[1])


class Judge:
    """Which units a plan never touches: `refused` ones (named or not), and those a glob never
    selects (`kept_from_globs`). `props` are systemctl show's, by unit."""

    def __init__(self, props: dict[str, dict[str, str]], forbidden: set[str], protect_names: t.Iterable[str], proc: str,
                 site: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
        self.props = props
        self.forbidden = forbidden
        self.protect_names = protect_names
        self.proc = proc
        self.site = site

    def refused(self, unit: str) -> tuple[str, str] | None:
        """(kind, reason) when UNIT is never stopped, named or not, else None."""
        if unit in self.forbidden:
            return "session", "it runs this Ansible session or a protected process"
        if matches(unit, ESSENTIAL_UNITS):
            return "essential", "the node needs it (systemd's own units, D-Bus, login, SSH, consoles and networking are never stopped)"
        protected = protected_main(*main_process(self.props.get(unit, {}), self.proc), self.protect_names)
        if protected:
            return "protected", f"its main process {protected} is protected"
        return None

    def kept_from_globs(self, unit: str) -> tuple[str, str] | None:
        """(kind, reason) when a glob never selects UNIT, else None."""
        kind = keeps_node(unit)
        if kind:
            return kind, f"{kind}: the node needs it to stay reachable and its data safe; name it exactly to stop it"
        if matches(unit, LAUNCHER_UNITS) or matches(unit, self.site[0]):
            return "launcher", "it is a launcher of other jobs; name it to stop it"
        launcher = _launcher_by_main(self.props.get(unit, {}), self.site, self.proc)
        if launcher:
            return "launcher", f"it is a launcher of other jobs (its main process is {launcher}); name it to stop it"
        return None


def _planned(steps: UnitPlan) -> UnitsDone:
    """What a plan that fails hands back: its warnings and kept units (nothing was done)."""
    return {"warnings": list(steps["warnings"]), "kept_units": list(steps["kept_units"])}


def _select_named(expanded: list[str], explicit: set[str], judge: Judge, service_state: str | None, steps: UnitPlan) -> list[str]:
    """The expanded units to act on; those a glob matched but never selects go to kept_units."""
    named_units = []
    for unit in expanded:
        kept_as = judge.refused(unit)
        if kept_as and unit in explicit:
            raise StepFailed(f"refusing to stop {unit}: {kept_as[1]}", _planned(steps))
        if not kept_as and unit not in explicit:
            kept_as = judge.kept_from_globs(unit)
        if kept_as:
            # Only what the glob would have changed is worth a line: `*` matches every inactive
            # unit of systemd's too.
            if any(unit_actions(judge.props.get(unit, {}), service_state)):
                steps["kept_units"].append({"unit": unit, "kind": kept_as[0], "reason": kept_as[1]})
            continue
        named_units.append(unit)
    return named_units


def kept_warning(kept: list[dict[str, t.Any]]) -> str:
    """One warning naming the units globs matched but kept, by kind."""
    groups: list[tuple[str, list[str]]] = []
    for entry in kept:
        group = next((g for g in groups if g[0] == entry["kind"]), None)
        if group is None:
            group = (entry["kind"], [])
            groups.append(group)
        group[1].append(entry["unit"])
    return "services: kept {} unit{} that a glob matched (see kept_units; name one exactly to stop it, where allowed): {}".format(
        len(kept), "" if len(kept) == 1 else "s", "; ".join("{}: {}".format(kind, ", ".join(names)) for kind, names in groups))


def _triggers(named_units: list[str], judge: Judge) -> list[str]:
    """The sockets and timers that would start a named service again (they get its state)."""
    triggers: list[str] = []
    for unit in named_units:
        for trigger in (judge.props.get(unit, {}).get("TriggeredBy") or "").split():
            if trigger not in named_units and trigger not in triggers and not judge.refused(trigger):
                triggers.append(trigger)
    return triggers


def _fill_steps(steps: UnitPlan, named_units: list[str], owned: list[str], props: dict[str, dict[str, str]], service_state: str | None) -> None:
    all_units = named_units + [u for u in owned if u not in named_units]
    # The state before, for the restore record (_record): what gpu_restore puts back.
    steps["before"] = {unit: props.get(unit, {}) for unit in all_units}
    unmaskable = []
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
            if _cannot_mask(unit_props):
                unmaskable.append("{} ({})".format(unit, unit_props.get("FragmentPath")))
    if unmaskable:
        raise StepFailed(
            "service_state=masked: cannot mask {}: systemctl masks a unit by putting a link to /dev/null in /etc/systemd/system, "
            "where this unit's own file is. Move the unit file to /usr/local/lib/systemd/system/ and run systemctl daemon-reload, "
            "or use service_state=disabled. Nothing was stopped or signalled.".format(", ".join(unmaskable)),
            _planned(steps),
        )


def plan(systemctl: Systemctl, named: list[str], owned: list[str], service_state: str | None, forbidden: set[str],
         protect_names: t.Iterable[str] = (), proc: str = "/proc", launchers: t.Iterable[str] = (),
         recorded: t.Collection[str] = ()) -> UnitPlan:
    """{stop, disable, mask, not_found, before, kept_units, warnings}: named units (and the
    sockets and timers that trigger them) get `service_state`, owned ones are stopped only.
    Raises StepFailed (with the warnings so far) before anything is done when a named unit is
    forbidden, essential, runs a protected process, cannot be masked, or systemd cannot be
    asked. A glob never selects such a unit, nor a launcher (built in, or of the `launchers`
    option), nor what keeps the node reachable and its data safe (NODE_KEEPING_UNITS): those
    matches are kept and, where the glob would have changed them, listed in kept_units ({unit,
    kind, reason}) and named in one warning. `recorded`: the units an earlier release disabled or
    masked (the restore record), whose files are read on disk (already_on_disk)."""
    steps: UnitPlan = {"stop": [], "disable": [], "mask": [], "not_found": [], "before": {}, "kept_units": [], "warnings": []}
    no_match: list[str] = []
    expanded = expand_services(named, set(known_units(systemctl, named, service_state)), no_match)
    steps["warnings"] += [f"services: {pattern} matches no unit on this host" for pattern in no_match]
    explicit = {normalize_unit(p) for p in named or [] if not is_glob(p)}
    props = _show(systemctl, expanded + [u for u in owned if u not in expanded], steps) if expanded or owned else {}
    judge = Judge(props, forbidden, protect_names, proc, split_launchers(launchers))
    named_units = _select_named(expanded, explicit, judge, service_state, steps)
    if steps["kept_units"]:
        steps["warnings"].append(kept_warning(steps["kept_units"]))
    triggers = _triggers(named_units, judge)
    if triggers:
        props.update(_show(systemctl, triggers, steps))
        named_units += triggers
    # The refusals of owned units (owners, owned_refusal) hold here too, whoever built `owned`.
    owned = [u for u in owned if not matches(u, ESSENTIAL_UNITS) and (u in explicit or not keeps_node(u))]
    _fill_steps(steps, named_units, owned, props, service_state)
    already_on_disk(systemctl, steps, recorded)
    return steps


def already_on_disk(systemctl: Systemctl, steps: UnitPlan, recorded: t.Collection[str]) -> None:
    """Leave out of `steps` the disables and masks an earlier release already made on disk.
    Unit files change with --no-reload (act), so systemd's UnitFileState is the one it read at its
    last reload, and a second release would disable or mask again and say `changed`; `systemctl
    is-enabled` reads the files. Asked only for the units the restore record says a release changed
    (a first release asks nothing more); where it does not answer one line per unit, nothing is left out."""
    candidates = [u for u in dict.fromkeys(steps["disable"] + steps["mask"]) if u in recorded]
    if not candidates:
        return
    _rc, out, _err = systemctl(["is-enabled", "--"] + candidates)
    states = [line.strip() for line in out.splitlines() if line.strip()]
    if len(states) != len(candidates):
        return
    disk = dict(zip(candidates, states))
    steps["disable"] = [u for u in steps["disable"] if disk.get(u, "enabled") in ENABLED_STATES]
    steps["mask"] = [u for u in steps["mask"] if disk.get(u, "") not in MASKED_STATES]


def keep_outside_selection(steps: UnitPlan, unit_gpus: t.Mapping[str, t.Collection[int]], selected: t.Collection[int],
                           owned: t.Collection[str] = ()) -> list[str]:
    """Named units whose processes hold GPUs, none of them selected, leave the plan (in place):
    freeing GPU 4 never stops the vllm.service that serves on GPUs 0 and 1, whoever named it (the
    GPU selection rule holds for every unit). Each is listed in kept_units (kind `other_gpus`) and
    in one warning; returns their names. A named unit that holds nothing now is still stopped
    (it is named so that it cannot start again); one that also holds a selected GPU is the
    spanning rule's (owners)."""
    chosen = set(selected)
    kept = []
    for unit in list(dict.fromkeys(steps["stop"] + steps["disable"] + steps["mask"])):
        gpus = set(unit_gpus.get(unit) or ())
        if unit in owned or not gpus or gpus & chosen:
            continue
        for key in ("stop", "disable", "mask"):
            if unit in steps[key]:
                steps[key].remove(unit)  # type: ignore[literal-required]
        steps["kept_units"].append({"unit": unit, "kind": "other_gpus", "reason": "it holds only GPU {}, outside the selection".format(
            ",".join(str(i) for i in sorted(gpus)))})
        kept.append(unit)
    if kept:
        steps["warnings"].append("services: kept {} (named, but its processes hold only GPUs outside the selection {}; select their GPUs to "
                                 "stop it)".format(", ".join(kept), ",".join(str(i) for i in sorted(chosen))))
    return kept


def held_gpus(holders: t.Iterable[Holder]) -> dict[str, set[int]]:
    """{host system unit: the GPUs its processes hold}."""
    used: dict[str, set[int]] = {}
    for holder in holders:
        if holder.get("system_service") and holder.get("unit"):
            used.setdefault(holder["unit"] or "", set()).update(holder.get("gpu_indexes") or [])
    return used


# ---------------------------------------------------------------- acting


def _systemctl_or_fail(systemctl: Systemctl, args: list[str], units: list[str], done: UnitsDone) -> None:
    rc, out, err = systemctl(args + ["--no-ask-password"] + units)
    if rc != 0:
        raise StepFailed("systemctl {} {} failed (rc {}): {}".format(args[0], " ".join(units), rc, (err or out).strip()), done)


def wait_stopped(system: Node, units: list[str], timeout: float) -> list[str]:
    """Poll until every unit reads inactive or failed; returns those that do not by `timeout`."""
    deadline = system.now() + timeout
    interval = STOP_POLL_S
    while True:
        rc, out, _err = system.systemctl(["show", "--property=Id,ActiveState,SubState", "--no-pager"] + units)
        states = parse_show(out) if rc == 0 else {}
        left = [u for u in units if states.get(u, {}).get("ActiveState") not in STOPPED_STATES]
        now = system.now()
        if not left or now >= deadline:
            return left
        system.sleep(min(interval, deadline - now))
        interval = min(interval * 2, STOP_POLL_MAX_S)


def stop_bounded(system: Node, units: list[str], kill_timeout: float, done: UnitsDone | None = None) -> UnitsDone:
    """Stop units together (one `systemctl stop --no-block`), never waiting on TimeoutStopSec
    (90 s by default, or infinity): a unit still stopping after kill_timeout gets SIGKILL
    through systemd, and its stop job is queued again, so that Restart= cannot start it.
    Returns (and fills in `done`) stopped_units, killed_units and warnings."""
    done = done if done is not None else {"warnings": []}
    _systemctl_or_fail(system.systemctl, ["stop", "--no-block"], units, done)
    done["stopped_units"] = list(units)
    left = wait_stopped(system, units, kill_timeout)
    if not left:
        return done
    # Not checked: a unit that ended between the poll and this call makes systemctl kill fail.
    system.systemctl(["kill", "--signal=SIGKILL", "--no-ask-password"] + left)
    done["killed_units"] = list(left)
    _systemctl_or_fail(system.systemctl, ["stop", "--no-block"], left, done)
    killed = list(left)
    left = wait_stopped(system, left, kill_timeout)
    if left:
        done["warnings"].append(
            "{} still not stopped {:.0f} s after SIGKILL (a process in D state?): see systemctl status".format(", ".join(left), kill_timeout)
        )
    failed = left_failed(system, [u for u in killed if u not in left])
    if failed:
        done["failed_units"] = failed
        done["warnings"].append(failed_warning(failed, kill_timeout))
    return done


def left_failed(system: Node, units: list[str]) -> list[str]:
    """The units that read `failed` now: systemd leaves a unit it SIGKILLed there (Result=signal),
    listed by `systemctl --failed` and monitoring until someone resets it."""
    if not units:
        return []
    rc, out, _err = system.systemctl(["show", "--property=Id,ActiveState", "--no-pager"] + units)
    states = parse_show(out) if rc == 0 else {}
    return [u for u in units if states.get(u, {}).get("ActiveState") == "failed"]


def failed_warning(units: list[str], kill_timeout: float) -> str:
    return ("{} {} killed through systemd (the stop outlasted kill_timeout, {:g} s) and {} left failed: gpu_restore (the restore_gpus "
            "role) resets {} before starting {} again (by hand: systemctl reset-failed {})".format(
                ", ".join(units), "was" if len(units) == 1 else "were", kill_timeout, "is" if len(units) == 1 else "are",
                "it" if len(units) == 1 else "them", "it" if len(units) == 1 else "them", " ".join(units)))


def act(system: Node, steps: UnitPlan, kill_timeout: float) -> UnitsDone:
    """Carry out a plan -> what was done (stopped, killed, disabled and masked units, warnings);
    a failure raises StepFailed with what was done before it."""
    done: UnitsDone = {"warnings": []}
    if steps["stop"]:
        stop_bounded(system, steps["stop"], kill_timeout, done)
    # --no-reload: without it, disable and mask reload systemd, and a reload cuts running GPU
    # containers off their GPUs (_reload_risk). The unit files change on disk; the boot reads them.
    if steps["disable"]:
        _systemctl_or_fail(system.systemctl, ["disable", "--no-reload"], steps["disable"], done)
        done["disabled_units"] = list(steps["disable"])
    if steps["mask"]:
        _systemctl_or_fail(system.systemctl, ["mask", "--no-reload"], steps["mask"], done)
        done["masked_units"] = list(steps["mask"])
        startable = not_masked_yet(system, steps["mask"])
        if startable:
            done["warnings"].append(mask_pending_warning(startable))
    return done


def not_masked_yet(system: Node, units: list[str]) -> list[str]:
    """The units masked on disk that systemd still holds loaded as they were: one that another unit
    wants (an enabled unit, wanted by its target) stays loaded until systemd reloads its units, and
    until then it can be started (measured, systemd 252 and 257); one nothing wants is read again
    from disk at once, and reads masked."""
    rc, out, _err = system.systemctl(["show", "--property=Id,LoadState", "--no-pager"] + units)
    states = parse_show(out) if rc == 0 else {}
    return [u for u in units if states.get(u, {}).get("LoadState") != "masked"]


def mask_pending_warning(units: list[str]) -> str:
    one = len(units) == 1
    return ("{} {} stopped and masked on disk (masked from the next boot), but systemd keeps {} loaded as {} {} until it reloads its "
            "units: until then `systemctl start` and the units that want {} can still start {}. This run does not reload systemd: "
            "a daemon-reload cuts running GPU containers off their GPUs unless the node has /dev/char links for the NVIDIA device "
            "nodes (nvidia-ctk system create-dev-char-symlinks --create-all); with them, run systemctl daemon-reload".format(
                ", ".join(units), "is" if one else "are", "it" if one else "them", "it" if one else "they", "was" if one else "were",
                "it" if one else "them", "it" if one else "them"))
