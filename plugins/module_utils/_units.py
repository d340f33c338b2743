# -*- coding: utf-8 -*-
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

from ansible_collections.zeromib.gpu.plugins.module_utils import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._errors import ReleaseError

ACTIVE_STATES = ("active", "activating", "deactivating", "reloading", "refreshing")
ENABLED_STATES = ("enabled", "enabled-runtime", "linked", "linked-runtime")
MASKED_STATES = ("masked", "masked-runtime")
# A stop is over when the unit reads one of these (a unit killed with SIGKILL ends "failed").
STOPPED_STATES = ("inactive", "failed")
UNIT_SUFFIXES = ("service", "socket", "timer", "target", "path", "scope", "slice", "mount", "device", "swap", "automount")

# Daemons that start other people's jobs. Stopping one ends (or orphans) every job it runs,
# on every GPU, so it is never stopped to free GPUs: its GPU jobs are signalled instead.
# Matched against the main process's executable, argv[0], script (python3 /usr/bin/jupyterhub)
# and comm, so a renamed unit file is still recognised.
LAUNCHER_NAMES = (
    # job schedulers: Slurm, PBS/OpenPBS/Torque, LSF, HTCondor, Grid Engine
    "slurmd", "slurmstepd", "slurmctld", "slurmdbd", "slurmrestd",
    "pbs_mom", "pbs_server", "pbs_server.bin", "pbs_sched", "pbs_comm", "trqauthd",
    "sbatchd", "mbatchd", "lsfd",
    "condor_master", "condor_startd", "condor_starter", "condor_schedd", "condor_shadow",
    "sge_execd", "sge_qmaster", "sge_shepherd",
    # time-based launchers
    "cron", "crond", "CRON", "anacron", "atd", "fcron",
    # notebook hubs
    "jupyterhub", "jupyterhub-singleuser", "configurable-http-proxy",
    # CI runners
    "gitlab-runner", "Runner.Listener", "Runner.Worker", "runsvc.sh", "buildkite-agent", "jenkins-agent", "drone-runner-exec",
    # container engines and their shims
    "dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2", "kubelet", "crio", "conmon", "podman",
    # process supervisors
    "supervisord", "circusd", "runsvdir", "runsv", "s6-svscan", "s6-supervise", "pm2",
    # login and the init system
    "sshd", "login", "systemd", "init",
)
LAUNCHER_UNITS = (
    "slurm*.service", "pbs*.service", "openpbs.service", "lsfd.service", "lsf*.service", "condor.service", "htcondor.service",
    "sge*.service", "cron.service", "crond.service", "cronie.service", "anacron.service", "atd.service", "fcron.service",
    "jupyterhub*.service", "gitlab-runner*.service", "actions.runner.*.service", "buildkite-agent*.service", "jenkins*.service",
    "docker.service", "containerd.service", "kubelet.service", "crio.service", "cri-o.service", "podman*.service",
    "k3s*.service", "rke2*.service", "supervisor.service", "supervisord.service",
)
# Units the node needs to stay reachable and sane. Named in `services`, they are refused;
# matched by a glob, skipped. systemd's own units, D-Bus, login, SSH, consoles, networking.
ESSENTIAL_UNITS = (
    "systemd-*", "dbus.*", "dbus-broker.*", "ssh.*", "sshd.*", "ssh@*", "sshd@*", "user@*", "user-runtime-dir@*",
    "*getty*", "polkit.*", "init.scope", "-.slice", "*.slice", "*.target", "*.mount", "*.device", "*.swap",
    "networking.service", "NetworkManager*", "wpa_supplicant*", "rsyslog.*", "auditd.service",
)
INTERPRETERS = re.compile(r"^(?:python[0-9.]*|perl[0-9.]*|ruby[0-9.]*|node|nodejs|bash|sh|dash|java)$")
SLURM_JOB_CGROUP = re.compile(r"/job_(\d+)(?:/|$)")
# systemctl show polls: first fast (a cooperative unit stops in ~0.1 s), then every STOP_POLL_MAX_S.
STOP_POLL_S = 0.02
STOP_POLL_MAX_S = 0.2


def normalize_unit(name):
    name = name.strip()
    if "." not in name.rsplit("/", 1)[-1] or name.rsplit(".", 1)[-1] not in UNIT_SUFFIXES:
        return name + ".service"
    return name


def is_glob(pattern):
    return any(char in pattern for char in "*?[")


def matches(unit, patterns):
    return any(fnmatch.fnmatchcase(unit, pattern) for pattern in patterns)


def expand_services(patterns, known_units, no_match=None):
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


def parse_list_units(text):
    """First column of `systemctl list-units/list-unit-files --plain --no-legend`."""
    names = []
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] not in ("UNIT", "●"):
            names.append(fields[0])
        elif len(fields) > 1 and fields[0] == "●":
            names.append(fields[1])
    return names


def parse_show(text):
    """`systemctl show -p Id,LoadState,ActiveState,SubState,UnitFileState u1 u2` -> {Id: props}."""
    units = {}
    current = {}
    for line in text.splitlines() + [""]:
        if not line.strip():
            if current.get("Id"):
                units[current["Id"]] = current
            current = {}
            continue
        key, _sep, value = line.partition("=")
        current[key] = value
    return units


def unit_actions(props, service_state):
    """What to do to one named unit: (stop, disable, mask)."""
    if props.get("LoadState") in (None, "not-found"):
        return False, False, False
    stop = props.get("ActiveState") in ACTIVE_STATES or props.get("SubState") == "auto-restart"
    file_state = props.get("UnitFileState", "")
    disable = service_state == "disabled" and file_state in ENABLED_STATES
    mask = service_state == "masked" and file_state not in MASKED_STATES and props.get("LoadState") != "masked"
    return stop, disable, mask


# ---------------------------------------------------------------- workload or launcher


def process_names(record):
    """The names a process goes by: comm, executable, argv[0] and, for an interpreter, the
    script or module it runs (`python3 /usr/local/bin/jupyterhub`, `python3 -m jupyterhub`)."""
    if not record:
        return set()
    names = {record.get("name"), record.get("exe"), record.get("argv0")}
    words = (record.get("cmdline") or "").split()
    if words and INTERPRETERS.match(words[0].rsplit("/", 1)[-1]):
        rest = words[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            rest = rest[1:]
        if len(rest) >= 2 and rest[0] == "-m":
            names.add(rest[1].split(".")[0])
        elif rest:
            names.add(rest[0].rsplit("/", 1)[-1])
    return {name for name in names if name}


def is_launcher_name(names):
    """True when one of a process's names is a launcher's (comm is cut at 15 characters)."""
    for launcher in LAUNCHER_NAMES:
        if launcher in names or (len(launcher) > holders_mod.COMM_LENGTH and launcher[:holders_mod.COMM_LENGTH] in names):
            return True
    return False


def stop_verdict(unit, main_names, under_main, unit_gpus, selected):
    """Whether stopping UNIT through systemd is how to free the selected GPUs of its holders.

    None: stop it, it IS the workload (vllm.service: its main process or the main process's
    descendants hold the GPUs; vLLM V1's API server holds none, its EngineCore child does).
    Otherwise (kind, why), its holders are signalled instead and the unit keeps running:
    kind "launcher" for a unit that starts other people's jobs (recognised by the unit's name
    or its main process's names, or because the holders are not its main process or its
    descendants: slurmstepd is reparented to PID 1 inside slurmd.service), kind "other_gpus"
    for a workload that also holds GPUs outside the selection."""
    if matches(unit, LAUNCHER_UNITS):
        return "launcher", "%s starts other jobs (scheduler, cron, hub, CI runner, container engine or supervisor)" % unit
    if is_launcher_name(main_names):
        return "launcher", "the main process of %s (%s) starts other jobs" % (unit, "/".join(sorted(main_names)))
    if not under_main:
        return "launcher", "the GPU processes of %s are not its main process or its descendants" % unit
    outside = sorted(set(unit_gpus) - set(selected))
    if outside:
        return "other_gpus", "%s also holds GPU %s, outside the selection" % (unit, ", ".join(str(i) for i in outside))
    return None


def slurm_job_id(cgroup_path, environ=b""):
    """The Slurm job a process runs in: `job_<id>` in its cgroup (cgroup v2, task/cgroup), else
    SLURM_JOB_ID in its environment (proctrack/linuxproc, cgroup v1: tasks sit in slurmd's cgroup)."""
    match = SLURM_JOB_CGROUP.search(cgroup_path or "")
    if match:
        return match.group(1)
    for entry in (environ or b"").split(b"\0"):
        if entry.startswith(b"SLURM_JOB_ID="):
            value = entry.split(b"=", 1)[1].decode("ascii", "replace").strip()
            return value or None
    return None


def _environ(pid, proc):
    try:
        with open("%s/%d/environ" % (proc, pid), "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def owners(systemctl, targets, holders, selected, forbidden, proc="/proc", protect_names=()):
    """The system services that own targets -> (to stop, launchers, warnings).

    `launchers` lists, per unit (and Slurm job), the holders signalled instead of stopping it:
    [{unit, reason, pids, slurm_job_id}]; holders in a Slurm job outside any service (a
    slurmstepd scope) are listed too. `forbidden` units (this session's, a protected
    process's) and units whose main process is protected are never stopped."""
    units = []
    for holder in targets:
        unit = holder.get("unit")
        if holder.get("system_service") and unit and unit not in units:
            units.append(unit)
    props = {}
    if units:
        rc, out, _err = systemctl(["show", "--property=Id,MainPID", "--no-pager"] + units)
        props = parse_show(out) if rc == 0 else {}
    to_stop, warnings, reasons = [], [], {}
    for unit in units:
        in_unit = [h for h in targets if h.get("unit") == unit and h.get("system_service")]
        if unit in forbidden:
            reasons[unit] = "%s runs this Ansible session or a protected process" % unit
            continue
        try:
            main_pid = int(props.get(unit, {}).get("MainPID") or 0)
        except ValueError:
            main_pid = 0
        main = holders_mod.read_process(main_pid, proc) if main_pid > 0 else None
        if main and holders_mod.name_matches(main, tuple(holders_mod.BUILTIN_PROTECTED_NAMES) + tuple(protect_names or ())):
            reasons[unit] = "the main process of %s (pid %d %s) is protected" % (unit, main_pid, main.get("name"))
            continue
        # Without a main process (MainPID=0, or gone) there is nothing to tell descendants by.
        under_main = main is None or all(main_pid in holders_mod.lineage(h["pid"], proc) for h in in_unit)
        unit_gpus = set()
        for holder in holders:
            if holder.get("unit") == unit and holder.get("system_service"):
                unit_gpus.update(holder.get("gpu_indexes") or [])
        verdict = stop_verdict(unit, process_names(main), under_main, unit_gpus, selected)
        if verdict is None:
            to_stop.append(unit)
        elif verdict[0] == "launcher":
            reasons[unit] = verdict[1]
        else:
            warnings.append(
                "%s: not stopped; its processes on the selected GPUs are signalled, and its Restart= setting may start them again"
                % verdict[1]
            )
    launchers = []
    for holder in targets:
        unit = holder.get("unit")
        reason = reasons.get(unit) if holder.get("system_service") else None
        job = slurm_job_id(holder.get("cgroup"), _environ(holder["pid"], proc)) if reason or not holder.get("system_service") else None
        if reason is None and job is None:
            continue
        if reason is None:
            reason = "Slurm job %s" % job
        entry = next((e for e in launchers if e["unit"] == unit and e["slurm_job_id"] == job), None)
        if entry is None:
            entry = {"unit": unit, "reason": reason, "pids": [], "slurm_job_id": job}
            launchers.append(entry)
        entry["pids"].append(holder["pid"])
    return to_stop, launchers, warnings


# ---------------------------------------------------------------- named units


def known_units(systemctl, named, service_state):
    """The units systemd knows that the globs among `named` may match."""
    globs = [normalize_unit(p) for p in named if is_glob(p)]
    if not globs:
        return []
    # Loaded units cover what runs, what restarts and what is enabled (wanted at boot); only
    # masking also needs the unit files nobody loaded (listing them costs ~0.2 s).
    listings = [["list-units", "--all"]]
    if service_state == "masked":
        listings.append(["list-unit-files"])
    known = []
    for verb in listings:
        rc, out, _err = systemctl(verb + ["--plain", "--no-legend", "--no-pager"] + globs)
        if rc == 0:
            known.extend(parse_list_units(out))
    return known


SHOW_PROPERTIES = "Id,LoadState,ActiveState,SubState,UnitFileState,MainPID,TriggeredBy,FragmentPath"


def _show(systemctl, units, result):
    rc, out, err = systemctl(["show", "--property=" + SHOW_PROPERTIES, "--no-pager"] + units)
    if rc != 0:
        raise ReleaseError("systemctl show failed (rc %s): %s" % (rc, (err or out).strip()), result)
    return parse_show(out)


def _runs_protected(props, protect_names, proc):
    """The main process of a unit, when it is protected (built-in names or `protect`)."""
    try:
        main_pid = int(props.get("MainPID") or 0)
    except ValueError:
        return None
    if main_pid <= 0:
        return None
    record = holders_mod.read_process(main_pid, proc)
    if record and holders_mod.name_matches(record, tuple(holders_mod.BUILTIN_PROTECTED_NAMES) + tuple(protect_names or ())):
        return "pid %d %s" % (main_pid, record.get("name"))
    return None


def _cannot_mask(props):
    """systemctl mask puts a link to /dev/null in /etc/systemd/system: it fails for a unit whose
    own file (or link, `systemctl link`) is already there (measured, systemd 252)."""
    fragment = props.get("FragmentPath") or ""
    return fragment.startswith("/etc/systemd/system/") and props.get("LoadState") != "masked"


def plan(systemctl, named, owned, service_state, forbidden, result, protect_names=(), proc="/proc"):
    """{stop, disable, mask, not_found}: named units (and the sockets and timers that trigger
    them) get `service_state`, owned ones are stopped only. Raises ReleaseError (carrying
    `result`) before anything is done when a named unit is forbidden, essential, runs a
    protected process, cannot be masked, or systemd cannot be asked. A glob never selects
    such a unit, nor a launcher: those matches are skipped with a warning."""
    no_match = []
    expanded = expand_services(named, set(known_units(systemctl, named, service_state)), no_match)
    for pattern in no_match:
        result["warnings"].append("services: %s matches no unit on this host" % pattern)
    explicit = {normalize_unit(p) for p in named or [] if not is_glob(p)}
    steps = {"stop": [], "disable": [], "mask": [], "not_found": []}
    props = _show(systemctl, expanded + [u for u in owned if u not in expanded], result) if expanded or owned else {}

    def refusal(unit):
        if unit in forbidden:
            return "it runs this Ansible session or a protected process"
        if matches(unit, ESSENTIAL_UNITS):
            return "the node needs it (systemd's own units, D-Bus, login, SSH, consoles and networking are never stopped)"
        protected = _runs_protected(props.get(unit, {}), protect_names, proc)
        if protected:
            return "its main process %s is protected" % protected
        return None

    named_units = []
    for unit in expanded:
        why = refusal(unit)
        if why and unit in explicit:
            raise ReleaseError("refusing to stop %s: %s" % (unit, why), result)
        if why or (unit not in explicit and matches(unit, LAUNCHER_UNITS)):
            result["warnings"].append(
                "services: skipped %s, which a glob matched: %s" % (unit, why or "it is a launcher of other jobs; name it to stop it")
            )
            continue
        named_units.append(unit)
    # A socket or timer would start a stopped service again: it gets the service's state.
    triggers = []
    for unit in named_units:
        for trigger in (props.get(unit, {}).get("TriggeredBy") or "").split():
            if trigger not in named_units and trigger not in triggers and not refusal(trigger):
                triggers.append(trigger)
    if triggers:
        props.update(_show(systemctl, triggers, result))
        named_units += triggers
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
                unmaskable.append("%s (%s)" % (unit, unit_props.get("FragmentPath")))
    if unmaskable:
        raise ReleaseError(
            "service_state=masked: cannot mask %s: systemctl masks a unit by putting a link to /dev/null in /etc/systemd/system, "
            "where this unit's own file is. Move the unit file to /usr/local/lib/systemd/system/ and run systemctl daemon-reload, "
            "or use service_state=disabled. Nothing was stopped or signalled." % ", ".join(unmaskable),
            result,
        )
    return steps


# ---------------------------------------------------------------- acting


def _systemctl_or_fail(systemctl, args, units, result):
    rc, out, err = systemctl(args + ["--no-ask-password"] + units)
    if rc != 0:
        raise ReleaseError("systemctl %s %s failed (rc %s): %s" % (args[0], " ".join(units), rc, (err or out).strip()), result)


def wait_stopped(system, units, timeout):
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


def stop_bounded(system, units, kill_timeout, result):
    """Stop units together (one `systemctl stop --no-block`), never waiting on TimeoutStopSec
    (90 s by default, or infinity): a unit still stopping after kill_timeout gets SIGKILL
    through systemd, and its stop job is queued again, so that Restart= cannot start it."""
    _systemctl_or_fail(system.systemctl, ["stop", "--no-block"], units, result)
    result["stopped_units"] = list(units)
    left = wait_stopped(system, units, kill_timeout)
    if not left:
        return
    # Not checked: a unit that ended between the poll and this call makes systemctl kill fail.
    system.systemctl(["kill", "--signal=SIGKILL", "--no-ask-password"] + left)
    result["killed_units"] = list(left)
    _systemctl_or_fail(system.systemctl, ["stop", "--no-block"], left, result)
    left = wait_stopped(system, left, kill_timeout)
    if left:
        result["warnings"].append(
            "%s still not stopped %.0f s after SIGKILL (a process in D state?): see systemctl status" % (", ".join(left), kill_timeout)
        )


def act(system, steps, result, kill_timeout):
    """Carry out a plan; `result` records each step as it is done, so a failure keeps it."""
    if steps["stop"]:
        stop_bounded(system, steps["stop"], kill_timeout, result)
    if steps["disable"]:
        _systemctl_or_fail(system.systemctl, ["disable"], steps["disable"], result)
        result["disabled_units"] = list(steps["disable"])
    if steps["mask"]:
        _systemctl_or_fail(system.systemctl, ["mask"], steps["mask"], result)
        result["masked_units"] = list(steps["mask"])
