# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Free GPUs and prove it: look -> plan -> act (units, SIGTERM, SIGKILL) -> verify.

This file keeps the run, the look, the verdict, the verify loop and the result. Its rooms:
_plan (pure: selection, targets, spanning, baselines, the result and the Plan), _words (the
failure messages), _system (the node's side effects: one `System`, shared with gpu_restore and
the Slurm hook) and _freeing (the dirty path's plan and act, imported by freeing_room only when
something is to be freed). No AnsibleModule in here; the logic is tested without killing
anything."""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _shm
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _signals
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import ReleaseError, StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._act._plan import (
    SPARED_INIT, STATE_KEYS, NoContainers, Plan, new_result, no_programs, no_units, only_protected, plan_diff, plan_targets, select_gpus,
    spanning_containers, spanning_record, spanning_targets, trust_notes, undecided_record, unheld,
)
from ansible_collections.zeromib.gpu.plugins.module_utils._act._system import System
from ansible_collections.zeromib.gpu.plugins.module_utils._options import ReleaseOptions
from ansible_collections.zeromib.gpu.plugins.module_utils._act._words import (
    blocked_message, failure_message, freeing_notes, frozen_unsignalled, reset_node, spanning_message, summarize_diff,
)
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import (
    GPU_FIELDS, NvidiaSmiError, check_against_driver, normalize_bus_id, parse_compute_apps,
)

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers, _services, _settle  # noqa: F401 - annotations
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._supervisor import ProgramPlan
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._guest_units import GuestPlan  # noqa: F401 - annotations
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _reset  # noqa: F401 - annotations
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, Gpu, Holder, ReleaseResult

# While GPUs stay dirty, look for who holds them this often (a /proc scan, a few ms).
RESCAN_S = 1.0
# How long a dirty GPU that no process holds is given to free itself before the run fails: a
# process that exited just before frees its memory within ~1 s on H200 (one still tearing down,
# e.g. unpinning host memory in D state, is still in /proc, so still a holder).
NO_HOLDER_GRACE_S = 1.0
# How far back the verify loop's readings tell a GPU still being freed at the end of wait_timeout
# from a leak: the same ~1 s in which a process that exited frees its memory on H200.
TREND_WINDOW_S = 1.0
# Check mode: room past the grace for a slow first scan (seen: a loaded CI host said nothing for an idle MIG GPU).
CHECK_SLACK_S = 5.0


def freeing_room() -> t.Any:
    """_act/_freeing, the dirty path's plan and act: imported here, once, where something is to be
    freed, and while nvidia-smi answers when the look finds a process mapping a GPU (each import
    compiles its source, AnsiballZ ships no bytecode: ~15-25 ms of the H200's elapsed_s when a
    holder was found, benchmarks/HISTORY.md, "The look's /proc pass beside nvidia-smi"). The only
    import of this file inside a function: a clean host (the gate before every job) never loads
    that room; Ansible finds the import in the source, so the payload carries it."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _freeing
    return _freeing


class Release:
    """look -> plan -> act -> verify, for the options of gpu_release. The one writer of the
    result: the steps it calls return plans and records of what they did (StepFailed carries
    the record of a step that failed), and it raises the one ReleaseError."""

    def __init__(self, smi: t.Any, system: System, params: t.Mapping[str, t.Any] | ReleaseOptions, check_mode: bool = False,
                 driver_root: str = "/proc/driver/nvidia/gpus") -> None:
        self.smi = smi
        self.system = system
        # The one boundary: gpu_release gives its record, tests and the Slurm runner may give a
        # (partial) mapping. Every option is read from here on as self.options.NAME.
        self.options = ReleaseOptions.of(params)
        self.check_mode = check_mode
        self.driver_root = driver_root
        self.names, self.pids = _protect.split_protect(self.options.protect)
        self.lineage = holders_mod.lineage(holders_mod.own_pid(system.proc), system.proc)
        self.regexes = self.options.match_regexes or []
        self._request: _facts.Request | None = None
        # Workload units that also hold GPUs outside the selection (plan_units).
        self.spanning_units: list[dict[str, t.Any]] = []
        self._main_pids: dict[str, int | None] = {}
        # systemd's ControlGroup= of each unit a holder's cgroup named (_unit_owner): asked once per run.
        self.unit_cgroups: dict[str, str] = {}
        # Namespace inits this run spares (spare_namespace_inits), by identity: still spared, and
        # so protected, in every later scan of the run.
        self.spared_inits: set[tuple[int, int]] = set()
        # Minor numbers by bus id, from the look; the verify loop's readings reuse them.
        self.minors_by_bus: dict[str | None, int] = {}
        # The look's _health.Health: the final readings are judged with the same checks and Xids.
        self.health: t.Any = None
        # What may start a signalled holder again (_settle), set when something is signalled.
        self.watch: _settle.Watch | None = None
        self.state_key = STATE_KEYS.get(self.options.service_state or "")
        self.result = new_result(self.state_key)
        self.named_services: _services.Services | None = None
        self.started = 0.0
        # The look's (gpus, holders) and the last readings: the diff's before and after.
        self.before: tuple[list[Gpu], list[Holder]] = ([], [])
        self.after: tuple[list[Gpu], list[Holder]] | None = None
        # Until the selection is made, a failure is about the request itself: its result is {}.
        self.selected = False
        # Processes the look could not read (not root): failures then say so first.
        self.unreadable = 0
        # The verify loop's last readings: whether a GPU is still being freed at the end (freeing_notes).
        self.trend = MemoryTrend()
        # Guest entries of services that name no running guest or no unit there; the guest units' state before.
        self.guests_not_found: list[str] = []
        self.guest_before: dict[str, dict[str, t.Any]] = {}
        # Whether the look ran in a container (_guests.pid_namespace_nested): memory no process here holds may be held outside.
        self.inside_container = False
        # clean_shm: the files /dev/shm held at the look, by inode (only those may go), and the
        # health issue of its free space at the end (_shm.floor_issue).
        self.shm_at_look: set[tuple[int, int]] = set()
        self.shm_issue: str | None = None
        # clean_shm: the processes this run is to end (signalled, or stopped with their unit,
        # container or program), by PID: only their files may go (ended_processes).
        self.ending: dict[int, Holder] = {}

    # --- the whole run

    def run(self) -> ReleaseResult:
        """look -> plan -> (check mode: the answer) -> act -> verify and settle, all ending in
        one tail. A step that fails (StepFailed) ends the run here, in the one ReleaseError,
        with what was done folded into the result."""
        try:
            self.started = self.system.now()
            plan = self.plan(self.look())
            if self.check_mode:
                return self.answer_check(plan)
            if not plan.to_do and plan.gpus_clean:
                # Nothing to act on and the look already proves the GPUs free: that reading is the
                # verification (no second nvidia-smi call, no second scan on the fast path).
                return self.tail(True, self.result["gpus_before"], plan.holders)
            freeing_room().act(self, plan)
            return self.verify_and_settle(plan)
        except StepFailed as exc:
            raise ReleaseError(exc.msg, self.failed(exc)) from exc

    def failed(self, exc: StepFailed) -> ReleaseResult | dict[str, t.Any]:
        """The result a failure carries: what the failed step did, folded in (a verdict's is the
        finished result already); {} when the request itself was refused (no GPU selected)."""
        if isinstance(exc, Verdict):
            return exc.done
        self.fold(exc.done)
        return self.result if self.selected else {}

    def fold(self, done: t.Mapping[str, t.Any] | None) -> None:
        """A step's record (under the result's keys) into the result: lists are added to."""
        for key, value in (done or {}).items():
            if isinstance(value, list):
                self.result.setdefault(key, []).extend(value)  # type: ignore[misc]
            else:
                self.result[key] = value  # type: ignore[literal-required]

    def tail(self, released: bool, gpus: list[Gpu], holders: list[Holder], failure: str | None = None) -> ReleaseResult:
        """The one end of every run: the readings, the verdict, the time, health and the diff;
        `failure` (a message) ends the run in ReleaseError with this result."""
        self.result["gpus"] = gpus
        self.result["holders"] = t.cast("list[Holder]", [_facts.public_holder(h) for h in holders])
        self.result["released"] = released
        # clean_shm acts once the GPUs are proven free (in check mode: what the run would free).
        self.read_shm(failure is None and (released or self.check_mode))
        self.result["elapsed_s"] = round(self.system.now() - self.started, 3)
        result = self._finish(*self.before, *(self.after or (None, None)))
        if failure:
            raise Verdict(failure, result)
        return result

    # --- look

    def read_shm(self, may_clean: bool) -> None:
        """/dev/shm at the end: its free space, for the health floor (shm_min_free_mib_per_gpu), and
        with clean_shm, the killed jobs' files removed once the GPUs are proven free (_shm_clean;
        in check mode, those it would remove). Not read at all without health and clean_shm."""
        floor = self.options.shm_min_free_mib_per_gpu
        clean = bool(self.options.clean_shm)
        if not clean and (self.health is None or not floor):
            return
        done = freeing_room().clean_shm(self, may_clean) if clean else None
        record = _shm.look(processes=False)
        if done is None and self.health is not None and _shm.floor_issue(record, floor, len(self.before[0])):
            # Below the floor: what fills it is worth a scan of the processes (only then).
            record = _shm.look(proc=self.system.proc, deadline_s=self.options.timeout)
        if done is not None:
            record = _shm.with_unheld(record, done.unheld, done.complete)
        self.result["shm"] = record
        self.shm_issue = _shm.floor_issue(record, floor, len(self.before[0])) if self.health is not None else None

    def to_end(self, holders: t.Iterable[Holder]) -> None:
        """Note processes this run is to end (ended_processes)."""
        for holder in holders:
            self.ending.setdefault(holder["pid"], holder)

    def max_used_mib(self) -> float:
        return self.options.max_used_mib or 0

    def footprint_mib(self) -> int:
        value = self.options.cross_gpu_footprint_mib
        return _attribution.CROSS_GPU_FOOTPRINT_MIB if value is None else value

    def scan(self, gpus: list[Gpu]) -> tuple[list[Holder], list[ComputeApp]]:
        """Who uses which GPU now -> (holders, the compute apps seen: fetched only when they can
        change the answer, else [])."""
        holders, apps = _facts.scan_and_attribute(
            gpus, None, lambda: self._apps(gpus), self.look_request(), protect_names=self.names, protect_pids=self.pids, own_lineage=self.lineage,
            limits=_facts.scan_limits(self.options.timeout), again=True,
        )
        if holders:
            # Some process holds a GPU: its container, guest and unit come from the freeing room's readers.
            holders = freeing_room().annotate(self, holders)
        for holder in holders:
            if (holder["pid"], holder["start_time"]) in self.spared_inits:
                holder["protected"], holder["protected_reason"] = True, SPARED_INIT
        return holders, apps

    def main_pid_of(self, unit: str) -> int | None:
        """systemd's MainPID of a system unit (asked only for a process named like a protected
        daemon that its uid and executable do not vouch for)."""
        if unit not in self._main_pids:
            rc, out, _err = self.system.systemctl(["show", "-p", "MainPID", "--value", unit])
            self._main_pids[unit] = int(out.strip()) if rc == 0 and out.strip().isdigit() else None
        return self._main_pids[unit]

    def may_be_footprint(self, dirty: list[Gpu]) -> bool:
        """Whether some dirty GPU reads little enough to be only the cross-GPU footprint (then a
        scan decides it; otherwise none is needed)."""
        allowance = self.max_used_mib() + self.footprint_mib()
        return bool(self.footprint_mib()) and any(g["memory_used_mib"] is not None and g["memory_used_mib"] <= allowance for g in dirty)

    def footprint(self, gpus: list[Gpu], holders: list[Holder], apps: list[ComputeApp]) -> set[int]:
        return _attribution.footprint_gpus(gpus, holders, apps, self.max_used_mib(), self.footprint_mib())

    def look_request(self) -> _facts.Request:
        """What this run's looks and scans are asked: its options, from this node's /proc and
        systemd. Made at the first look, then the same for every rescan of the run."""
        if self._request is None:
            self._request = _facts.Request.from_options(self.options, proc=self.system.proc, driver_root=self.driver_root, with_apps=False,
                                                        runtimes_of=lambda: self.system.runtimes, main_pid_of=self.main_pid_of,
                                                        kernel_log_state=getattr(self.system, "kernel_log_state", None),
                                                        while_waiting=lambda _raw_holders: freeing_room(), systemctl=self.system.systemctl,
                                                        unit_cgroups=self.unit_cgroups)
        return self._request

    def look(self) -> t.Any:
        snapshot = _facts.look_at(self.smi, self.look_request())
        self.health = snapshot.health
        if self.options.clean_shm:
            try:
                self.shm_at_look = {(f.dev, f.ino) for f in _shm.list_files()}
            except OSError:
                self.shm_at_look = set()
        return snapshot

    # --- plan

    def plan(self, snapshot: t.Any) -> Plan:
        """The look's readings into the result, then what to stop, disable and signal (every
        planner returns its plan; the spanning refusal comes before anything is done)."""
        self.result["timings"]["look_s"] = round(self.system.now() - self.started, 3)
        gpus, holders = snapshot.gpus, snapshot.holders
        self.before = (gpus, holders)
        self.minors_by_bus = {normalize_bus_id(g.get("pci_bus_id")): g["minor_number"] for g in gpus}
        hidden = _facts.unreadable_warning(getattr(snapshot, "unreadable", None))
        if hidden:
            self.result["warnings"].append(hidden)
        limit = self.max_used_mib()
        not_visible = getattr(snapshot, "not_visible", [])
        self.result["not_visible"] = [gpu["bus"] for gpu in not_visible]
        self.result["given_to_vms"] = getattr(snapshot, "given_to_vms", [])
        plan = Plan(gpus, holders, snapshot.footprint, hidden, select_gpus(gpus, self.options.gpus, not_visible))
        plan.unreadable = self.unreadable = len(getattr(snapshot, "unreadable", None) or [])
        self.selected = True
        self.result["gpus_before"] = t.cast("list[Gpu]", [_facts.public_gpu(g, limit, snapshot.footprint) for g in gpus])
        self.result["selected_gpus"] = plan.selected
        self.inside_container = bool(getattr(snapshot, "inside_container", False))
        self.choose_targets(plan)
        self.refuse_blocked(snapshot, plan.selected)
        planning = self.system.now()
        if holders or self.options.services:
            freeing_room().plan_dirty(self, plan)
        else:
            # No process holds a GPU and services names nothing (the clean gate): the planners of
            # containers, units and supervisord would find nothing, so they are not loaded.
            plan.containers, plan.units, plan.programs = NoContainers(), no_units(), no_programs()
        self.refuse_spanning(holders, plan.selected, plan.containers, plan.mps_servers, plan.programs)
        self.refuse_guest_services(plan)
        self.result["timings"]["plan_s"] = round(self.system.now() - planning, 3)
        units, programs = plan.unit_steps, plan.program_steps
        self.result["services_not_found"] = (units["not_found"] + plan.containers.not_found + programs["not_found"]
                                             + self.guests_not_found + getattr(plan, "orchestrated_missing", []))
        plan.gpus_clean = all(g["clean"] for g in self.result["gpus_before"] if g["index"] in plan.selected)
        plan.to_do = bool(plan.containers or units["stop"] or units["disable"] or units["mask"]
                          or (plan.targets and self.options.kill) or programs["stop"] or programs["disable"]
                          or plan.mps_servers or bool(plan.guests and freeing_room().guests_acted_on(plan.guests))
                          or getattr(plan, "orchestrated_to_do", False))
        plan.dirty_before = [g for g in gpus if g["index"] in plan.selected and g["index"] not in snapshot.footprint
                             and not _facts.gpu_is_clean(g, limit)]
        plan.unheld_at_look = {g["index"] for g in unheld(plan.dirty_before, holders, snapshot.apps)}
        plan.apps = snapshot.apps
        return plan

    def choose_targets(self, plan: Plan) -> None:
        """Holders to signal and MPS servers to quit; the protected, undecided and trust notes."""
        targets, protected = plan_targets(plan.holders, plan.selected, self.regexes, bool(self.options.kill_spanning))
        targets, spared = self.spare_namespace_inits(targets)
        protected += spared
        plan.targets, plan.mps_servers = self.plan_mps(targets)
        self.to_end(plan.targets + plan.mps_servers)
        self.result["warnings"].extend(trust_notes(plan.holders, plan.selected))
        self.result["undecided"] = undecided_record(_attribution.undecided_for(plan.holders, plan.selected))
        self.result["protected"] = [{"pid": h["pid"], "name": h["name"], "unit": h.get("unit"), "gpu_indexes": h["gpu_indexes"]}
                                    for h in protected]

    def spare_namespace_inits(self, targets: list[Holder]) -> tuple[list[Holder], list[Holder]]:
        """(targets, spared): a target that is the init of a PID namespace below ours takes every
        other process of that namespace with it when it ends (the kernel's SIGKILL to each). It is
        signalled only when each of them is a target too, or is run by the holder's own uid and is
        not protected (its own job's processes); otherwise it is spared, as a protected holder,
        with a warning that names the processes its end would take."""
        kept, spared = [], []
        target_pids = {h["pid"] for h in targets}
        for holder in targets:
            blocking = self.members_that_may_not_end(holder, target_pids) if holder.get("pid_namespace_init") else []
            if not blocking:
                kept.append(holder)
                continue
            holder["protected"], holder["protected_reason"] = True, SPARED_INIT
            self.spared_inits.add((holder["pid"], holder["start_time"]))
            self.result["warnings"].append(
                "not signalled: pid {} {} is the init of a PID namespace, and ending it would end every process of that namespace, "
                "among them {}".format(holder["pid"], holder.get("name"), "; ".join(blocking)))
            spared.append(holder)
        return kept, spared

    def members_that_may_not_end(self, holder: Holder, target_pids: t.Container[int]) -> list[str]:
        """The processes of the namespace HOLDER is the init of that this run may not end: not
        targets themselves, and protected (the identity rule) or run by another uid."""
        found = []
        for pid in holders_mod.namespace_members(holder["pid"], self.system.proc):
            if pid in target_pids:
                continue
            record = holders_mod.read_process(pid, self.system.proc)
            if record is None:
                continue  # ended meanwhile
            reason = _protect.protection_reason(dict(record), self.names, self.pids, self.lineage, self.main_pid_of)
            if reason is None and record.get("uid") == holder.get("uid"):
                continue
            why = reason or "uid {}, not the holder's uid {}".format(record.get("uid"), holder.get("uid"))
            found.append("pid {} {} ({})".format(pid, record.get("name"), why))
        return found

    def refuse_guest_services(self, plan: Plan) -> None:
        """From the host, a process of a guest's service whose guest runs a system manager is not
        signalled (the guest's manager would start it again) unless services names the unit of
        that guest: the run fails before anything is done, naming the command to run there and
        the entry to add (check mode says the same)."""
        if not self.options.kill or not any(h.get("guest") for h in plan.targets):
            return
        freeing_room().refuse_guest_services(self, plan)

    def refuse_blocked(self, snapshot: t.Any, selected: list[int]) -> None:
        """Processes that did not answer the look's scan (_holders.blocked_record), or that the
        scan's deadline left unread: a failure before anything is done (check mode says the same),
        but only where a selected GPU holds memory that no process read explains
        (_attribution.unexplained_by_readers). A blocked process that is another's (another Slurm
        job's: protected; another guest's) never fails this run, and a selected GPU that reads
        clean with no compute app is free whatever else could not be read (issue 66)."""
        holders = snapshot.holders
        unscanned = len(getattr(snapshot, "unscanned", None) or [])
        blocked = [h for h in _attribution.blocked_for(holders, selected) if not h.get("protected") and not h.get("guest")]
        if not blocked and not unscanned:
            return
        gpus = [g for g in snapshot.gpus if g["index"] in selected]
        unexplained = _attribution.unexplained_by_readers(gpus, getattr(snapshot, "apps", None) or [], holders, selected, self.max_used_mib(),
                                                          getattr(snapshot, "footprint", ()))
        if not unexplained:
            return
        self.result["holders"] = t.cast("list[Holder]", [_facts.public_holder(h) for h in holders])
        raise StepFailed(blocked_message(blocked, unscanned, selected, self.options.timeout, [g for g in gpus if g["index"] in unexplained]))

    def refuse_spanning(self, holders: list[Holder], selected: list[int], container_plan: _containers.Plan, mps_servers: list[Holder],
                        program_plan: ProgramPlan | None = None) -> None:
        """Spanning processes, units and containers (see _attribution), MPS control daemons
        whose quit would end a server of an unselected GPU (_mps) and copies of a supervisord
        program named whole that work on unselected GPUs (_supervisor) -> result["spanning"];
        without kill_spanning, a failure before anything is done (check mode says the same)."""
        processes = spanning_targets(holders, selected, self.regexes)
        if mps_servers:
            processes += freeing_room().spanning_mps(self, mps_servers, holders, selected)
        containers = spanning_containers(holders, selected, container_plan.stop)
        programs: list[dict[str, t.Any]] = []
        if program_plan and (program_plan["stop"] or program_plan["disable"]):
            programs = freeing_room().spanning_programs(self, program_plan, holders, selected)
        self.result["spanning"] = spanning_record(processes, self.spanning_units, containers, programs)
        if self.result["spanning"] and not self.options.kill_spanning:
            # The refused holders stay in the result: a Slurm hook's cause names them (never "no process holds it").
            self.result["holders"] = t.cast("list[Holder]", [_facts.public_holder(h) for h in holders])
            raise StepFailed(spanning_message(processes, self.spanning_units, containers, selected, programs))

    def plan_mps(self, targets: list[Holder]) -> tuple[list[Holder], list[Holder]]:
        """(targets, MPS servers to quit through their control daemon): _mps. A server that also
        serves unselected GPUs is a spanning process: it is a target only with kill_spanning."""
        if not targets or not self.options.kill:
            return targets, []
        return freeing_room().plan_mps(self, targets)

    # --- check mode

    def answer_check(self, plan: Plan) -> ReleaseResult:
        """Check mode: what the real run would stop, disable and signal, and its verdict when
        the look already decides it."""
        units, containers = plan.unit_steps, plan.containers
        self.result["changed"] = plan.to_do
        self.result["stopped_units"] = units["stop"]
        self.result["stopped_containers"] = containers.stop
        self.result["disabled_containers"] = containers.disable
        if plan.holders or plan.to_do:
            # Programs, MPS servers and clients: only where something holds a GPU or is named.
            freeing_room().check_steps(self, plan)
        if self.state_key == "disabled_units":
            self.result["disabled_units"] = units["disable"]
        elif self.state_key == "masked_units":
            self.result["masked_units"] = units["mask"]
        if plan.guests:
            self.result.update(freeing_room().guests_planned(plan.guests, self.options.service_state))  # type: ignore[typeddict-item]
        # What the real run would signal: holders whose unit is stopped end with it.
        by_unit = set(units["stop"])
        signalled = [h for h in plan.targets if not (h.get("system_service") and h.get("unit") in by_unit)
                     and not (plan.guests and freeing_room().guest_covered(h, plan.guests))]
        freezer = _signals.Freezer(self.system.proc)
        self.result["killed"] = [] if not self.options.kill else [
            {"pid": h["pid"], "name": h["name"], "cmdline": h["cmdline"], "unit": h.get("unit"), "container": h.get("container"),
             "gpu_indexes": h["gpu_indexes"], "signal": None, "sigkill_at_once": _signals.reason_now(self.system, h, freezer), "exited_after_s": None}
            for h in signalled
        ]
        released = plan.gpus_clean and not plan.targets and not any(e["gpu_indexes"] for e in containers.stop)
        certain = self.certain_failure(plan.selected, plan.dirty_before, plan.holders, plan.apps,
                                       signalled, bool(plan.unheld_at_look) and not plan.hidden)
        return self.tail(released, self.result["gpus_before"], plan.holders, certain)

    def certain_failure(self, selected: list[int], dirty: list[Gpu], holders: list[Holder], apps: list[ComputeApp],
                        signalled: list[Holder], may_be_unheld: bool) -> str | None:
        """Check mode: the message of a failure the real run cannot escape, or None. Waiting
        cannot free a GPU held only by protected processes, one held by processes that kill=false
        leaves running, or one that nothing holds (after the same grace as the real run: a
        process that just exited may still free its memory)."""
        if not dirty:
            return None
        # Not root, nvidia-smi still lists every user's processes: a GPU that no process this run
        # can read holds is as blind as one nobody is listed on (the real run ends in the same sentence).
        blind = unheld(dirty, holders, []) if self.unreadable else []
        if blind:
            # Not root: the real run cannot see who holds these GPUs either; said as its first sentence, once.
            self.result["warnings"] = [w for w in self.result["warnings"] if not w.startswith("could not read the open files")]
            return failure_message(blind, holders, apps, 0.0, [], False, None, self.unreadable, inside=self.inside_container, node=self.reset_node())
        protected = [g for g in dirty if only_protected([g], holders, apps)]
        if protected:
            return failure_message(protected, holders, apps, 0.0, [], True, "protected", inside=self.inside_container, node=self.reset_node())
        if not self.options.kill:
            left = [h for h in _facts.dirty_holders(holders, selected) if h["pid"] in {t["pid"] for t in signalled}]
            stuck = [g for g in dirty if any(g["index"] in h["gpu_indexes"] for h in left)]
            if stuck:
                return failure_message(stuck, holders, apps, 0.0, [], False, "not_killed", inside=self.inside_container, proc=self.system.proc,
                                       unsignalled=left)
        else:
            # The cgroup v1 freezer keeps every signal pending, SIGKILL too: the real run would wait
            # kill_timeout and wait_timeout, then fail naming them frozen.
            frozen = [h for h, _words in frozen_unsignalled(_facts.dirty_holders(signalled, selected), self.system.proc, for_good=True)]
            stuck = [g for g in dirty if any(g["index"] in h["gpu_indexes"] for h in frozen)]
            if stuck:
                return failure_message(stuck, holders, apps, 0.0, [], False, "frozen", inside=self.inside_container, proc=self.system.proc,
                                       unsignalled=frozen)
        nobody = [g["index"] for g in unheld(dirty, holders, apps)] if may_be_unheld else []
        if nobody:
            # The grace counts from the first scan, which a loaded host makes late: the deadline only
            # bounds the wait (verify ends as soon as the grace decides), so it leaves room for it.
            gpus, clean, early, _footprint = self.verify(nobody, self.system.now() + NO_HOLDER_GRACE_S + RESCAN_S + CHECK_SLACK_S, acted=False)
            if not clean and early == "no_holder":
                still = [g for g in gpus if g["index"] in nobody and not _facts.gpu_is_clean(g, self.max_used_mib())]
                holders_now, apps_now = self.scan(gpus)
                return failure_message(still, holders_now, apps_now, 0.0, [], False, "no_holder", inside=self.inside_container, node=self.reset_node())
        return None

    # --- act

    def foreign(self, targets: list[Holder]) -> t.Callable[[int, int], bool]:
        """For the respawn watch: (new pid, killed pid) -> whether the new process runs in another
        Slurm job than the killed holder did (read now, before the signals): the next task of an
        array job runs the same command line and is no restart. A holder of no job is restarted
        only outside any job."""
        return freeing_room().foreign(self, targets)

    # --- verify

    def verify_and_settle(self, plan: Plan) -> ReleaseResult:
        """After acting: wait until the selected GPUs read clean, watch that nothing comes back,
        and end in the tail with the final readings (a failure names what still holds them)."""
        verify_started = self.system.now()
        deadline = verify_started + self.options.wait_timeout
        try:
            gpus, clean, early, footprint = self.verify(plan.selected, deadline, acted=self.result["changed"],
                                                        unheld_at_look=plan.unheld_at_look if not plan.hidden else ())
        except NvidiaSmiError as exc:
            # After acting, a failure still reports what was stopped and signalled.
            self.result.update({key: value for key, value in exc.details().items() if key != "msg"})  # type: ignore[typeddict-item]
            done = " (after acting: see stopped_units and killed)" if self.result["changed"] else ""
            raise Verdict(exc.msg + done, self._finish(*self.before)) from exc
        self.result["timings"]["wait_s"] = round(self.system.now() - verify_started, 3)
        # Only a run that signalled something has a respawn watch (_settle) to settle.
        came_back, clean, gpus = freeing_room().settle(self, plan.selected, clean, gpus) if self.watch is not None else (None, clean, gpus)
        holders, apps = self.scan(gpus)
        self.after = (gpus, holders)
        footprint |= self.footprint(gpus, holders, apps)
        if self.health is not None:
            gpus = self.health.carry(gpus, plan.gpus)
            self.after = (gpus, holders)
        limit = self.max_used_mib()
        public = t.cast("list[Gpu]", [_facts.public_gpu(g, limit, footprint) for g in gpus])
        failure = came_back or (None if clean else self.dirty_message(plan, gpus, holders, footprint, early))
        return self.tail(clean, public, holders, failure)

    def dirty_message(self, plan: Plan, gpus: list[Gpu], holders: list[Holder], footprint: set[int], early: str | None) -> str:
        # A GPU that reads only the cross-GPU footprint is clean in this result: not in its message.
        limit = self.max_used_mib()
        dirty = [g for g in gpus if g["index"] in plan.selected and g["index"] not in footprint and not _facts.gpu_is_clean(g, limit)]
        unreadable = plan.unreadable if plan.hidden else 0
        if unreadable and plan.hidden in self.result["warnings"]:
            # Said once: the message's first sentence carries it.
            self.result["warnings"].remove(plan.hidden)
        apps = self._apps(gpus)
        # Only when wait_timeout ran out: an early end says why waiting cannot help.
        signalled = {e["pid"] for e in self.result["killed"]} | {e["pid"] for e in self.result["unkillable"]}
        freeing = {} if early else freeing_notes(dirty, holders, apps, self.trend, lambda pid: holders_mod.is_exiting(pid, self.system.proc),
                                                 signalled)
        # kill=false: the holders it leaves are named frozen where their cgroup is.
        left = _facts.dirty_holders(holders, [g["index"] for g in dirty]) if early == "not_killed" else []
        return failure_message(dirty, holders, apps, self.result["timings"]["wait_s"], self.result["unkillable"],
                               early == "protected", early, unreadable, freeing, self.inside_container, self.reset_node(),
                               self.system.proc, left)

    def reset_node(self) -> _reset.Node:
        """What the reset advice of a failure needs of this node (read only for a failure)."""
        return reset_node(self.before[0], self.health, self.inside_container, self.smi.run, self.result.get("given_to_vms") or ())

    def verify(self, selected: list[int], deadline: float, acted: bool, unheld_at_look: t.Collection[int] = ()
               ) -> tuple[list[Gpu], bool, str | None, set[int]]:
        """Poll until every selected GPU is clean. Returns (gpus, clean, early, footprint): early
        says why it stopped before `deadline` because waiting cannot help (see EARLY_HEADS);
        footprint are the GPUs clean only through the cross-GPU footprint allowance.

        A dirty GPU that no process holds, when nothing was done (or nothing was done for it: it
        was unheld at the look, `unheld_at_look`), fails after NO_HOLDER_GRACE_S of readings that
        do not drop, not after wait_timeout: an idle MIG GPU reads 55 MiB forever.

        A GPU that reads no more than the footprint above max_used_mib is clean when nothing uses
        it and contexts live on other GPUs: freeing GPU 1 next to training on GPU 0 leaves 4 MiB
        on GPU 1 (H200). Deciding that takes a scan (and the compute apps), so only then.

        Reads start every poll_interval (a fixed rate: the ~25 ms of each nvidia-smi call is not
        added to the interval). Right after acting, memory is expected to drop 20-130 ms after
        the holders exit, so the costlier look at who still holds the GPUs waits RESCAN_S."""
        limit = self.max_used_mib()
        poll = self.options.poll_interval
        last_scan = self.system.now() if acted else None
        footprint = Footprint(self)
        unheld_for = Unheld(acted, unheld_at_look)
        while True:
            poll_started = self.system.now()
            gpus = self._read_gpus()
            self.trend.add(self.system.now(), gpus)
            dirty = [g for g in gpus if g["index"] in selected and not _facts.gpu_is_clean(g, limit)]
            if not dirty:
                return gpus, True, None, set()
            if any(g.get("memory_used_mib") is None for g in dirty):
                return gpus, False, "unreadable", set()
            now = self.system.now()
            if self.may_be_footprint(dirty):
                dirty = [g for g in dirty if g["index"] not in footprint.of(gpus, now)]
                if not dirty:
                    return gpus, True, None, footprint.gpus
            if last_scan is None or now - last_scan >= RESCAN_S:
                last_scan = now
                early = self.why_waiting_cannot_help(gpus, dirty, unheld_for, now)
                if early:
                    return gpus, False, early, set()
            if now >= deadline:
                return gpus, False, None, set()
            self.system.sleep(min(poll_started + poll, deadline) - self.system.now())

    def why_waiting_cannot_help(self, gpus: list[Gpu], dirty: list[Gpu], unheld_for: Unheld, now: float) -> str | None:
        """A scan of who holds the dirty GPUs -> a key of EARLY_HEADS when waiting cannot free
        them, else None."""
        holders, apps = self.scan(gpus)
        # The scan fetched the compute apps whenever a listing can decide this.
        if only_protected(dirty, holders, apps):
            return "protected"
        if not self.options.kill and _facts.dirty_holders(holders, [g["index"] for g in dirty]):
            return "not_killed"
        if self.watch and self.watch.respawned():
            return "respawned"
        if unheld_for.long_enough(dirty, unheld(dirty, holders, apps), now):
            return "no_holder"
        return None

    def _read_gpus(self) -> list[Gpu]:
        gpus = self.smi.query_gpus(GPU_FIELDS)
        # A GPU that drops out of nvidia-smi's answer later is never read as released either.
        check_against_driver(gpus, self.minors_by_bus)
        return _facts.with_minor_numbers(gpus, self.minors_by_bus)

    def _dirty_now(self, selected: list[int]) -> list[Gpu]:
        """Selected GPUs dirty right now; a GPU that reads only the cross-GPU footprint is not."""
        limit = self.max_used_mib()
        gpus = self._read_gpus()
        dirty = [g for g in gpus if g["index"] in selected and not _facts.gpu_is_clean(g, limit)]
        if self.may_be_footprint(dirty):
            footprint = self.footprint(gpus, *self.scan(gpus))
            dirty = [g for g in dirty if g["index"] not in footprint]
        return dirty

    def _apps(self, gpus: list[Gpu]) -> list[ComputeApp]:
        try:
            text = self.smi.run(self.smi.app_args())
            apps = parse_compute_apps(text)
        except NvidiaSmiError:  # best effort: the verdict comes from memory.used, not from this list
            return []
        return _facts.join_apps(apps, gpus, lambda pid: _facts.alive(pid, self.system.proc),
                                lambda pid: holders_mod.display_name(pid, self.system.proc))

    def with_shm_floor(self, summary: dict[str, t.Any]) -> dict[str, t.Any]:
        """The host's health keys with /dev/shm's free-space issue, if any (read_shm)."""
        if self.shm_issue is None:
            return summary
        return _shm.with_floor(summary, self.shm_issue)

    def _finish(self, gpus_before: list[Gpu], holders_before: list[Holder], gpus_after: list[Gpu] | None = None,
                holders_after: list[Holder] | None = None) -> ReleaseResult:
        summary = _facts.health_summary(self.result["gpus"] or self.result["gpus_before"], self.health)  # type: ignore[arg-type]
        self.result.update(self.with_shm_floor(summary))  # type: ignore[typeddict-item]
        changes_before, changes_after = plan_diff(self.result, self.check_mode)
        if self.check_mode:
            # Memory and holders are what a dry run cannot change: the plan is the difference.
            ending = {k["pid"] for k in self.result.get("killed") or []}
            stopping = set(self.result.get("stopped_units") or [])
            stopping_guests = set(self.result.get("stopped_guest_units") or [])
            gpus_after, holders_after = gpus_before, [h for h in holders_before if h["pid"] not in ending
                                                      and not (h.get("system_service") and h.get("unit") in stopping)
                                                      and not (h.get("guest") and _guests.entry(h["guest"] or {}) in stopping_guests)]
        self.result["diff"] = {  # type: ignore[typeddict-unknown-key]
            "before": summarize_diff(gpus_before, holders_before, changes_before),
            "after": summarize_diff(gpus_after if gpus_after is not None else gpus_before,
                                    holders_after if holders_after is not None else holders_before, changes_after),
        }
        return self.result


class Verdict(StepFailed):
    """The run's own verdict of failure, raised by Release.tail with the finished result."""

    done: t.Any


class Footprint:
    """The verify loop's footprint decision: it holds while the readings do (or for RESCAN_S),
    so one scan decides it, not one a poll."""

    def __init__(self, release: Release) -> None:
        self.release = release
        self.gpus: set[int] = set()
        self.key: tuple[int | None, ...] | None = None
        self.at = 0.0

    def of(self, gpus: list[Gpu], now: float) -> set[int]:
        key = tuple(g["memory_used_mib"] for g in gpus)
        if key != self.key or now - self.at >= RESCAN_S:
            self.gpus, self.key, self.at = self.release.footprint(gpus, *self.release.scan(gpus)), key, now
        return self.gpus


class Unheld:
    """Since when every dirty GPU has read unheld, and what it read then: NO_HOLDER_GRACE_S of
    readings that do not drop end the wait (only when nothing was done, or nothing for them)."""

    def __init__(self, acted: bool, unheld_at_look: t.Collection[int]) -> None:
        self.acted = acted
        self.unheld_at_look = unheld_at_look
        self.since: float | None = None
        self.mib: dict[int, int | None] = {}

    def long_enough(self, dirty: list[Gpu], nobody: list[Gpu], now: float) -> bool:
        mib = {g["index"]: g["memory_used_mib"] for g in dirty}
        if len(nobody) == len(dirty) and (not self.acted or all(g["index"] in self.unheld_at_look for g in dirty)):
            if self.since is None or any((mib.get(i) or 0) < (m or 0) for i, m in self.mib.items()):
                # Memory still dropping: a context is being freed right now.
                self.since, self.mib = now, mib
            elif now - self.since >= NO_HOLDER_GRACE_S:
                return True
        else:
            self.since, self.mib = None, {}
        return False


class MemoryTrend:
    """The verify loop's readings over the last TREND_WINDOW_S, per GPU: whether a GPU still dirty
    when wait_timeout runs out is still being freed (its memory fell and never rose meanwhile: a
    training step's allocations go up and down, a teardown only down)."""

    def __init__(self) -> None:
        self.readings: dict[int, list[tuple[float, int]]] = {}

    def add(self, now: float, gpus: list[Gpu]) -> None:
        for gpu in gpus:
            mib = gpu.get("memory_used_mib")
            if mib is None:
                continue
            kept = self.readings.setdefault(gpu["index"], [])
            kept.append((now, mib))
            # One reading at or before the window's start stays, so that the fall spans the window.
            while len(kept) > 2 and kept[1][0] <= now - TREND_WINDOW_S:
                kept.pop(0)

    def falling(self, index: int) -> tuple[int, int, float] | None:
        """(MiB then, MiB now, seconds between) when the memory fell over the window, else None."""
        kept = self.readings.get(index) or []
        values = [mib for _at, mib in kept]
        if len(values) >= 2 and values[-1] < values[0] and all(after <= before for before, after in zip(values, values[1:])):
            return values[0], values[-1], kept[-1][0] - kept[0][0]
        return None
