# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""gpu_release's freeing room: the dirty path's plan and act. What only a host with something
to free needs (containers and their runtimes, systemd units, a guest's units, supervisord, MPS,
the respawn watch, /dev/shm cleaning, the restore record) is imported here, at the top, and this
file is imported once, by Release.freeing, when something is to be freed: a clean host (the gate
before every job) loads none of it. Ansible finds every import of a module's source, so the
AnsiballZ payload still carries it all.

Each function takes the Release it works for (`release`): its options, its System, and the one
result it writes into (see _release.Release)."""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _container_of
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mig_layout
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _origin
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _sleep_mode
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _checkpoint
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _orchestrators
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _settle
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _shm_clean
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _signals
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._act._plan import no_programs, plan_targets

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._guest_units import GuestPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._plan import Plan
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._release import Release
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._supervisor import ProgramPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._units import UnitPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ContainersDone, Gpu, Holder


# ---------------------------------------------------------------- plan


def plan_dirty(release: Release, plan: Plan) -> None:
    """Some process holds a GPU or services names something: the containers to stop, the units,
    supervisord programs and guests' units to stop or disable, and the targets left to signal."""
    if plan.targets or release.options.services:
        # Issue 72: what Ray or Docker Swarm would start again is stopped only through them, or refused.
        _orchestrators.for_release(release, plan)
    plan.containers = plan_containers(release, plan.holders, plan.targets)
    release.result["warnings"].extend(plan.containers.warnings)
    plan.targets = plan.containers.signal
    plan.units = plan_units(release, plan.targets, plan.holders, plan.selected)
    plan.programs = plan_programs(release)
    plan.guests = plan_guests(release, plan.holders, plan.selected)
    if release.options.kill:
        # Issue 70: CUDA-checkpointed targets refused, running ones suspended before their signal (_checkpoint).
        _checkpoint.for_release(release, plan)


def plan_mps(release: Release, targets: list[Holder]) -> tuple[list[Holder], list[Holder]]:
    """(targets, MPS servers to quit through their control daemon): _mps."""
    return _mps.plan(targets, release.system.proc)


def spanning_mps(release: Release, servers: list[Holder], holders: list[Holder], selected: list[int]) -> list[tuple[Holder, list[int]]]:
    """MPS control daemons whose quit would end a server of an unselected GPU (_mps)."""
    return t.cast("list[tuple[Holder, list[int]]]", _mps.spanning_daemons(servers, holders, selected, release.system.proc))


def spanning_programs(release: Release, program_plan: ProgramPlan, holders: list[Holder], selected: list[int]) -> list[dict[str, t.Any]]:
    """Copies of a supervisord program named whole that work on unselected GPUs (_supervisor)."""
    return _supervisor.spanning_copies(program_plan, holders, selected, lambda pid: holders_mod.lineage(pid, release.system.proc))


def refuse_guest_services(release: Release, plan: Plan) -> None:
    """A guest's service process is refused unless services names its unit (Release.refuse_guest_services)."""
    refused = _guest_units.refused_holders(plan.targets, plan.guests)
    if refused:
        raise StepFailed(_guest_units.refusal(refused, plan.selected, _guests.host_tools(), release.options.service_state))


def guests_acted_on(plans: list[GuestPlan]) -> bool:
    return bool(_guest_units.acted_on(plans))


def annotate(release: Release, holders: list[Holder]) -> list[Holder]:
    """A scan's holders with their container (asked of its runtime), guest and systemd unit."""
    holders = _container_of.annotate(holders, release.system.runtimes, release.system.proc)
    holders = _guests.annotate(holders, release.system.proc)
    holders = _facts.annotate_units(holders, release.system.systemctl, release.unit_cgroups)
    holders = _origin.annotate(holders, release.system.proc)
    # What a holder's own vLLM server says of its sleep: quoted in its description, deciding nothing (issue 70).
    return _sleep_mode.annotate(holders, release.system.proc)


# ---------------------------------------------------------------- check mode


def check_steps(release: Release, plan: Plan) -> None:
    """Check mode: the supervisord programs, MPS servers and MPS clients the real run would stop."""
    programs = plan.program_steps
    release.result["stopped_programs"] = [_supervisor.public(e) for e in programs["stop"]]
    release.result["disabled_programs"] = [_supervisor.public(e) for e in programs["disable"]]
    release.result["stopped_mps_servers"] = [{"pid": h["pid"], "name": h["name"], "pipe_directory": _mps.pipe_directory(h, release.system.proc),
                                              "gpu_indexes": h["gpu_indexes"], "how": None} for h in plan.mps_servers]
    if release.options.kill and _mps.present(plan.holders):
        release.result["terminated_mps_clients"], notes = _mps.client_terminations(plan.holders, plan.targets, release.system.proc)
        release.result["warnings"].extend(notes)


def guests_planned(plans: list[GuestPlan], service_state: str | None) -> dict[str, t.Any]:
    return t.cast("dict[str, t.Any]", _guest_units.planned(plans, service_state))


def guest_covered(holder: Holder, plans: list[GuestPlan]) -> bool:
    return bool(_guest_units.covered(holder, plans))


# ---------------------------------------------------------------- /dev/shm


def clean_shm(release: Release, may_clean: bool) -> _shm_clean.Done:
    """clean_shm: the killed jobs' files removed once the GPUs are proven free (_shm_clean; in
    check mode, those it would remove), into the result."""
    done = _shm_clean.clean(release.shm_at_look, may_clean, release.check_mode, release.system.proc, deadline_s=release.options.timeout,
                            ended=ended_processes(release) if may_clean else {})
    release.result["shm_removed"] = done.removed
    release.result["shm_kept"] = done.kept
    release.result["shm_removed_mib"] = round(sum(entry["size_mib"] for entry in done.removed), 2)
    release.result["warnings"].extend(done.warnings)
    release.result["changed"] = release.result["changed"] or bool(done.removed)
    return done


# ---------------------------------------------------------------- the rest, as Release had it


def settle_timeout(release: Release) -> float:
    value = release.options.settle_timeout
    return _settle.SETTLE_S if value is None else value


def ended_processes(release: Release) -> dict[int, int | None]:
    """{pid: uid} of the processes this run ended: those it was to end that are gone now, by
    identity (a zombie its parent has not reaped is gone); in check mode, those it would
    signal and those whose unit it would stop."""
    if release.check_mode:
        signalled = {k["pid"] for k in release.result.get("killed") or []}
        stopping = set(release.result.get("stopped_units") or [])
        return {pid: h.get("uid") for pid, h in release.ending.items()
                if pid in signalled or (h.get("system_service") and h.get("unit") in stopping)}
    return {pid: h.get("uid") for pid, h in release.ending.items()
            if h.get("start_time") is not None and holders_mod.start_time_of(pid, release.system.proc) != h.get("start_time")}


def named(release: Release) -> _services.Services:
    """The `services` option, read once: units, containers and supervisord programs (_services)."""
    if release.named_services is None:
        try:
            release.named_services = _services.parse(release.options.services)
        except ValueError as exc:
            raise StepFailed(str(exc)) from exc
    return release.named_services


def forbidden_units(release: Release, holders: list[Holder]) -> set[str]:
    """Units gpu_release must never stop: those of its own session and of protected processes."""
    forbidden = set()
    for pid in release.lineage:
        unit, _service = release.system.cgroup_unit(pid)
        if unit:
            forbidden.add(unit)
    for holder in holders:
        if holder["protected"] and holder.get("unit"):
            forbidden.add(holder["unit"] or "")
    return forbidden


def plan_units(release: Release, targets: list[Holder], holders: list[Holder], selected: list[int]) -> UnitPlan:
    forbidden = forbidden_units(release, holders)
    owned, release.result["launchers"], release.spanning_units = _units.owners(
        release.system.systemctl, targets, holders, selected, forbidden, release.system.proc, release.names,
        release.options.launchers or (), bool(release.options.kill_spanning), named(release).units)
    steps = _units.plan(release.system.systemctl, named(release).units, owned if release.options.stop_owning_units else [],
                        release.options.service_state, forbidden, release.names, release.system.proc, release.options.launchers or (),
                        recorded_unit_files(release))
    _units.keep_outside_selection(steps, _units.held_gpus(holders), selected, owned)
    release.result["kept_units"].extend(steps["kept_units"])
    release.result["warnings"].extend(steps["warnings"])
    return steps


def plan_guests(release: Release, holders: list[Holder], selected: list[int]) -> list[GuestPlan]:
    """A guest's units named in services (lxc:101:vllm.service, ...), planned through the
    guest's systemd (_guest_units); [] without such entries."""
    if not named(release).guests:
        return []
    plans, release.guests_not_found, warnings = _guest_units.plan(
        release.system, named(release).guests, holders, selected, release.options.service_state, release.names,
        float(release.options.kill_timeout or 0.0))
    release.result["warnings"].extend(warnings)
    for guest_plan in plans:
        release.result["kept_units"].extend(dict(k, unit=_guest_units.name(guest_plan["guest"], k["unit"]))
                                            for k in guest_plan["steps"]["kept_units"])
    return plans


def plan_containers(release: Release, holders: list[Holder], targets: list[Holder]) -> _containers.Plan:
    """Containers to stop through their runtime, and the targets left to signal (_containers).
    A refusal (StepFailed) ends the run before anything is done."""
    globs = named(release).containers
    own = _containers.own_containers(release.lineage, release.system.proc) if globs or any(t.get("container") for t in targets) else set()
    try:
        return _containers.plan(release.system.runtimes, holders, targets, globs, release.options.service_state, own,
                                stop_found=release.options.kill)
    except StepFailed as refused:
        if hasattr(release, "refusal"):
            # The Slurm hook's run (_slurm/_jobcheck.JobRelease): a pod's or a paused container's
            # refusal is its first cause, not the GPU's reading (as _checkpoint's).
            release.refusal = str(refused)
        raise


def plan_programs(release: Release) -> ProgramPlan:
    """supervisord programs named in services as supervisor:<glob> (_supervisor)."""
    programs = named(release).programs
    if not programs:
        return no_programs()
    steps = _supervisor.plan(programs, release.options.service_state, release.system.supervisors())
    release.result["warnings"].extend(steps["warnings"])
    return steps


def act(release: Release, plan: Plan) -> None:
    """Stop containers, units and programs, then signal who is left, then quit MPS servers.
    The restore record is written also when a stop failed: what was done must be put back."""

    units, programs = plan.unit_steps, plan.program_steps
    outside = {h["container"]: reason for h, reason in plan.containers.outside}
    try:
        if getattr(plan, "orchestrated_to_do", False):
            # Issue 72: Swarm services named in services scaled to 0 (_act/_orchestrators).
            _orchestrators.act_for_release(release, plan)
        if release.options.kill and getattr(plan, "ray_actors", None):
            # Issue 72: with ray:, the actors Ray would start again are ended through Ray before any signal (_act/_ray).
            _orchestrators.end_ray_actors(release, plan)
        if plan.containers:
            outside.update(act_containers(release, plan.containers))
        if units["stop"] or units["disable"] or units["mask"]:
            act_units(release, units)
        if plan.guests:
            act_guests(release, plan.guests)
        if programs["stop"] or programs["disable"]:
            act_programs(release, programs)
    except StepFailed as exc:
        release.fold(exc.done)
        exc.done = None
        raise
    finally:
        write_record(release, units.get("before") or {}, plan.holders, plan.gpus, plan.selected)
    targets = plan.targets
    if plan.containers.stop or units["stop"] or programs["stop"] or release.result["stopped_guest_units"]:
        # Stopping a unit or a container ended its processes; see who is left before signalling anyone.
        holders, _apps = release.scan(plan.gpus)
        targets, _protected = plan_targets(holders, plan.selected, release.regexes, bool(release.options.kill_spanning))
        # Neither a control daemon (never signalled) nor a server to be quit through it (_mps).
        targets = _mps.without_daemons([t for t in targets if not _containers.pod_holders([t])], plan.mps_servers)
        release.to_end(targets)
    if targets and release.options.kill:
        minors = [g["minor_number"] for g in plan.gpus if g["index"] in plan.selected]
        release.watch = _settle.watch_for(targets, outside, release.system.systemctl, release.lineage, minors, release.system.proc,
                                          foreign=release.foreign(targets))
        act_mps_clients(release, plan.holders, targets)
        _checkpoint.before_signals(release, plan, targets)
        act_signals(release, targets)
    if plan.mps_servers:
        act_mps(release, plan.mps_servers)
    release.result["changed"] = bool(
        release.result["stopped_units"] or release.result.get("disabled_units") or release.result.get("masked_units") or release.result["killed"]
        or release.result["stopped_containers"] or release.result["disabled_containers"]
        or release.result["stopped_programs"] or release.result["disabled_programs"] or release.result["stopped_mps_servers"]
        or release.result["terminated_mps_clients"]
        or release.result["stopped_guest_units"] or release.result["disabled_guest_units"] or release.result["masked_guest_units"]
        or release.result.get("scaled_services") or any(a.get("ended") for a in t.cast("list[dict[str, t.Any]]", release.result.get("ray_actors") or []))
    )


def foreign(release: Release, targets: list[Holder]) -> t.Callable[[int, int], bool]:
    """For the respawn watch: (new pid, killed pid) -> whether the new process runs in another
    Slurm job than the killed holder did (read now, before the signals): the next task of an
    array job runs the same command line and is no restart. A holder of no job is restarted
    only outside any job."""
    proc = release.system.proc
    jobs = {holder["pid"]: _jobs.owning_job(holder["pid"], proc) for holder in targets}
    return lambda pid, killed: _jobs.other_job(_jobs.owning_job(pid, proc), jobs.get(killed))


def act_containers(release: Release, plan: _containers.Plan) -> dict[str, str]:
    """Stop and disable containers -> {id: reason} of those that could not be stopped (they
    are signalled and watched from outside). What was done goes into the result also when a
    step failed."""
    started = release.system.now()
    try:
        done = _containers.act(release.system.runtimes, plan, release.options.kill_timeout, now=release.system.now)
    except StepFailed as exc:
        fold_containers(release, exc.done)
        raise StepFailed(exc.msg) from exc
    fold_containers(release, done)
    release.result["timings"]["stop_s"] = round(release.system.now() - started, 3)
    return done["failed"]


def fold_containers(release: Release, done: ContainersDone | None) -> None:
    """_containers.act's record (its own keys) into the result."""
    if done:
        release.result["disabled_containers"].extend(done.get("disabled") or [])
        release.result["stopped_containers"].extend(done.get("stopped") or [])
        release.result["warnings"].extend(done.get("warnings") or [])


def _add_stop_time(release: Release, started: float) -> None:
    release.result["timings"]["stop_s"] = round(release.result["timings"]["stop_s"] + release.system.now() - started, 3)


def act_units(release: Release, plan: UnitPlan) -> None:
    started = release.system.now()
    try:
        release.fold(_units.act(release.system, plan, release.options.kill_timeout or 0.0))
    finally:
        _add_stop_time(release, started)


def act_guests(release: Release, plans: list[GuestPlan]) -> None:
    """A guest's named units, through the guest's systemd (_guest_units); their state before
    goes to the restore record."""
    release.guest_before = _guest_units.before(plans)
    started = release.system.now()
    try:
        release.fold(_guest_units.act(release.system, plans, float(release.options.kill_timeout or 0.0)))
    finally:
        _add_stop_time(release, started)


def act_programs(release: Release, plan: ProgramPlan) -> None:
    started = release.system.now()
    try:
        release.fold(_supervisor.act(plan, release.options.kill_timeout))
    finally:
        _add_stop_time(release, started)


def act_mps(release: Release, servers: list[Holder]) -> None:
    """After the clients: the control daemon's quit waits for them. Servers that do not
    quit are signalled as holders."""
    started = release.system.now()
    left, done = _mps.stop(release.system, servers, release.options.kill_timeout)
    release.fold(done)
    _add_stop_time(release, started)
    if left:
        act_signals(release, left)


def act_mps_clients(release: Release, holders: list[Holder], targets: list[Holder]) -> None:
    """terminate_client for the targets that an MPS server's control daemon lists as its
    clients, before any signal (_mps); they are signalled after it as before."""
    if not _mps.present(holders):
        return
    started = release.system.now()
    release.fold(_mps.terminate_clients(holders, targets, release.system.proc))
    _add_stop_time(release, started)


def act_signals(release: Release, targets: list[Holder]) -> None:
    started = release.system.now()
    try:
        release.fold(_signals.Signaller(release.system, release.options.kill_timeout or 0.0).terminate(targets))
    finally:
        release.result["timings"]["kill_s"] = round(release.system.now() - started, 3)


def settle(release: Release, selected: list[int], clean: bool, gpus: list[Gpu]) -> tuple[str | None, bool, list[Gpu]]:
    """(why GPUs are held again or None, clean, readings): a clean run watches what may start
    a signalled holder again (_settle); a dirty one names the restarter that did."""
    came_back = None
    if clean and release.watch:
        settle_started = release.system.now()
        came_back = release.watch.settle(release.system, lambda: release._dirty_now(selected), settle_timeout(release))
        release.result["timings"]["settle_s"] = round(release.system.now() - settle_started, 3)
        if came_back:
            clean = False
            gpus = release._read_gpus()
    elif not clean and release.watch:
        # Dirty because a restarter started a killed holder again: name the restarter.
        again = release.watch.respawned()
        if again:
            came_back = release.watch.message([], [], 0.0, again, clean=False)
    if release.watch is not None and not came_back:
        # A restart from outside the parents (a double-forked watcher): one more table read.
        outside = release.watch.restarted_outside()
        if outside:
            came_back = release.watch.outside_message(outside, clean)
            if clean:
                clean, gpus = False, release._read_gpus()
    return came_back, clean, gpus


def recorded_unit_files(release: Release) -> set[str]:
    """The units an earlier release disabled or masked, by the restore record (_record): their
    files are read on disk before they are disabled or masked again (_units.already_on_disk)."""
    path = getattr(release.system, "record_path", None)
    if not path or release.options.service_state not in ("disabled", "masked"):
        return set()
    return _record.unit_files_changed(path)


def write_record(release: Release, unit_before: dict[str, dict[str, str]], holders: list[Holder], gpus: t.Sequence[Gpu] = (),
                 selected: t.Iterable[int] = ()) -> None:
    """Add what this run stopped, disabled or masked to the restore record (_record), and with it the
    MIG layout of the selected GPUs in MIG mode (_mig_layout: a reboot loses it, gpu_restore compares)."""
    path = getattr(release.system, "record_path", None)
    if not path:
        return
    entries = _record.release_entries(release.result, unit_before, holders, _record.now_iso(), _record.login_user(release.system.proc),
                                      release.guest_before)
    if any(e.get("actions") for e in entries):
        layouts, problems = _mig_layout.record_entries(release.smi, t.cast("t.Any", gpus), selected, _record.now_iso())
        entries += layouts
        release.result["warnings"].extend(problems)
    try:
        record = _record.add(path, entries)
    except (_record.RecordError, OSError) as exc:
        release.result["warnings"].append(f"the restore record was not written, so gpu_restore cannot put back what this run changed: {exc}")
        return
    if record is not None:
        release.result["restore_record"] = {"path": path, "entries": len(record["entries"])}
