# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Put back what gpu_release changed: read the record (_record), compare each entry with what the
node has now, and undo only what is still undone, newest release first.

Per unit: unmask (when the release masked it), enable (when it was enabled before and is not
now), start (when it was active before and is not now). Per container: its restart policy, then a
start when it was running. An entry whose steps all succeed leaves the record; one that fails
stays, and the run fails naming it. Every step is bounded (`step_timeout`).

Check mode plans exactly that: the steps of each entry are decided by the same functions, and each
planned step is reported under the key the real run reports it under (`started_units`,
`started_containers`, ...), so a plan reads like the run it predicts; nothing is done.

No AnsibleModule in here; side effects go through `System` (_system's, with systemctl bounded
in time: the container runtimes, the clock), as in _release."""

from __future__ import annotations

import fnmatch
import math
import os
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi
from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mig_restore
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ready_settings
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _reload_risk
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _system
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units

if t.TYPE_CHECKING:
    from types import ModuleType

    from ansible_collections.zeromib.gpu.plugins.module_utils._record import Entry, Record
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    # The steps an entry needed (or took), and why it was not restored (None: it was).
    Outcome = t.Tuple[t.List[str], t.Optional[str]]
    Systemctl = t.Callable[[t.List[str]], t.Tuple[int, str, str]]

# How often a wait for the GPUs looks (one nvidia-smi call and a /proc scan each time).
GPU_POLL_S = 0.5
WAIT_FOR_GPUS_DEFAULT_S = 60.0


class RestoreError(Exception):
    def __init__(self, msg: str, result: dict[str, t.Any] | None = None) -> None:
        super().__init__(msg)
        self.msg = msg
        self.result = result or {}


class System(_system.System):
    """What gpu_restore does to the node: the one System (_system) with restore's defaults (the
    record at _record.PATH, every systemctl call bounded) and the daemon-reload risk."""

    def __init__(self, systemctl_path: str | None = None, runtimes: _engines.Runtimes | None = None, record_path: str = _record.PATH,
                 proc: str = "/proc") -> None:
        super().__init__(systemctl_path, proc=proc, runtimes=runtimes if runtimes is not None else _engines.Runtimes(), record_path=record_path)
        self.record_path: str = record_path

    def systemctl(self, args: t.Sequence[str], timeout: float | None = 30.0) -> tuple[int, str, str]:
        """(rc, out, err); a call that outlasts `timeout` is ended and reads rc 124 (systemd goes on with its job)."""
        return super().systemctl(args, timeout)

    @staticmethod
    def reload_risk(systemctl: Systemctl) -> list[_reload_risk.Risk]:
        """The running GPU containers a daemon-reload would cut off their GPUs (_reload_risk)."""
        return _reload_risk.at_risk(systemctl)

    @staticmethod
    def device_nodes(check_mode: bool) -> dict[str, t.Any] | None:
        """The NVIDIA device nodes checked and created where missing (_device_nodes.ensure); None
        where the NVIDIA driver is not loaded (no /proc/driver/nvidia: nothing to check against)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _device_nodes  # pylint: disable=import-outside-toplevel
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi  # pylint: disable=import-outside-toplevel
        if not os.path.isdir("/proc/driver/nvidia"):
            return None
        return _device_nodes.ensure(_nvidia_smi.read_minor_numbers().values(), check_mode)


# ---------------------------------------------------------------- pure: what is left to undo


def unit_steps(entry: Entry, props: t.Mapping[str, str]) -> list[str]:
    """The steps that put one unit back, given its `systemctl show` props now (in order)."""
    actions = entry.get("actions") or []
    steps = []
    file_state_now = props.get("UnitFileState") or ""
    masked_now = file_state_now in _units.MASKED_STATES or props.get("LoadState") == "masked"
    if "masked" in actions and masked_now:
        steps.append("unmask")
        # Planned as if unmask gave back the state before (systemctl mask leaves an enabled unit's
        # .wants/ links); the run reads the unit again after unmasking.
        file_state_now = entry.get("unit_file_state") or ""
    was_enabled = (entry.get("unit_file_state") or "") in _units.ENABLED_STATES
    if ("disabled" in actions or "masked" in actions) and was_enabled and file_state_now not in _units.ENABLED_STATES:
        steps.append("enable")
    if "stopped" in actions and entry.get("active") and (props.get("ActiveState") not in ("active", "reloading", "refreshing")):
        if props.get("ActiveState") == "failed":
            # A unit the release killed through systemd reads failed (Result=signal): reset first, so that
            # neither `systemctl --failed` nor a start-rate limit it reached keeps it from coming back clean.
            steps.append("reset-failed")
        steps.append("start")
    return steps


def container_steps(entry: Entry, record: t.Mapping[str, t.Any]) -> list[str]:
    """The steps that put one container back, given the runtime's record of it now."""
    steps = []
    if "disabled" in (entry.get("actions") or []) and record.get("restart_policy") != entry.get("restart_policy"):
        steps.append("restart_policy")
    if entry.get("running") and not record.get("running"):
        steps.append("start")
    return steps


def parse_wait(value: t.Any) -> float:
    """`wait_for_gpus` (false, true or seconds) -> seconds, 0 for no wait. Raises ValueError."""
    if value is None or value is False:
        return 0.0
    if value is True:
        return WAIT_FOR_GPUS_DEFAULT_S
    text = str(value).strip().lower()
    if text in ("", "false", "no", "off", "0"):
        return 0.0
    if text in ("true", "yes", "on"):
        return WAIT_FOR_GPUS_DEFAULT_S
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"wait_for_gpus must be true, false or a number of seconds, got {value!r}") from None
    if math.isnan(seconds):
        # A NaN deadline is never reached: the wait would not end.
        raise ValueError(f"wait_for_gpus must be true, false or a number of seconds, got {value!r}")
    if seconds < 0:
        raise ValueError(f"wait_for_gpus must be 0 or more seconds, got {seconds}")
    too_long = _options.range_problem("wait_for_gpus", seconds)
    if too_long:
        raise ValueError(too_long)
    return seconds


def label(entry: Entry) -> str:
    """How a plan names an entry: `vllm.service`, `container vllm`, `supervisor program vllm`,
    `guest unit lxc:101:vllm.service`."""
    if entry.get("kind") == "guest_unit":
        return "guest unit {}".format(entry.get("entry") or entry.get("name"))
    if entry.get("kind") == _ready_settings.KIND:
        return "settings of GPU {} ({})".format(entry.get("index"), entry.get("name"))
    if entry.get("kind") == _mig_restore.KIND:
        return "MIG layout of GPU {} ({})".format(entry.get("index"), entry.get("uuid"))
    what = {"container": "container ", "supervisor": "supervisor program "}.get(entry.get("kind") or "", "")
    return what + (entry.get("name") or (entry.get("id") or "")[:12])


# step -> (how the thing reads before it, after it); restart_policy is filled in by change_lines.
_STEP_STATES = {
    "unmask": ("masked", "unmasked"),
    "enable": ("disabled", "enabled"),
    "reset-failed": ("failed", "failed state reset"),
    "start": ("stopped", "running"),
    "autostart": ("autostart off", "autostart as before"),
    "re-create": ("MIG instances gone", "MIG instances re-created"),
}


def change_lines(entry: Entry, steps: t.Sequence[str], policy_now: t.Any = None) -> tuple[str, str]:
    """One entry's --diff lines: `vllm.service: stopped, disabled` -> `vllm.service: running, enabled`
    (in the order the steps are taken)."""
    before, after = [], []
    for step in steps:
        if step == "restart_policy":
            before.append(f"restart policy {policy_now or 'no'}")
            after.append("restart policy {}".format(entry.get("restart_policy")))
        else:
            was, will = _STEP_STATES.get(step, (step + " not done", step + " done"))
            before.append(was)
            after.append(will)
    return "{}: {}".format(label(entry), ", ".join(before) or "as before"), "{}: {}".format(label(entry), ", ".join(after) or "as before")


def plan_line(entry: Entry, steps: t.Sequence[str]) -> str:
    """`vllm.service: enable, start`; `container vllm: restart policy always, start`."""
    words = {"restart_policy": "restart policy {}".format(entry.get("restart_policy")), "autostart": "autostart/autorestart as before"}
    return "{}: {}".format(label(entry), ", ".join(words.get(step, step) for step in steps))


def forgotten(entries: t.Iterable[Entry], patterns: t.Sequence[str]) -> list[Entry]:
    """Entries that `forget` names (unit or container names, globs allowed)."""
    return [e for e in entries if any(fnmatch.fnmatchcase(e.get("name") or "", p) or (e.get("id") or "").startswith(p)
                                      or (e.get("kind") == "guest_unit" and fnmatch.fnmatchcase(e.get("entry") or "", p)) for p in patterns)]


# ---------------------------------------------------------------- the run


class Restore:
    def __init__(self, system: System, params: t.Mapping[str, t.Any], check_mode: bool = False,
                 look: t.Callable[[], list[Holder]] | None = None) -> None:
        self.system = system
        # gpu_restore's options, read from here on as self.options.NAME (tests give a partial mapping).
        self.options = _options.RestoreOptions.of(params)
        self.check_mode = check_mode
        # look() -> holders of the node now (for wait_for_gpus); None when it cannot be asked.
        self.look = look
        self.step_timeout = float(self.options.step_timeout or 30)
        # {container id: its restart policy now}, read while planning, for the diff.
        self.policies_now: dict[str, t.Any] = {}
        # {program name: the supervisord that runs it}, for wait_for_gpus.
        self.supervisors: dict[str, t.Any] = {}
        # (file, section) of supervisord programs put back (planned, in check mode) by this run.
        self.edited_sections: set[tuple[t.Any, t.Any]] = set()
        self.result: dict[str, t.Any] = {
            "changed": False,
            "record_path": system.record_path,
            "restored": [],
            "unmasked_units": [],
            "enabled_units": [],
            "started_units": [],
            # Units the release left failed (killed through systemd), reset before their start.
            "reset_failed_units": [],
            "restored_policies": [],
            "started_containers": [],
            "started_programs": [],
            # The NVIDIA device nodes checked before anything started (_device_nodes.ensure); None when not checked.
            "device_nodes": None,
            # GPU settings ready_fix changed, set back: `GPU 1 (GPU-...): compute mode Exclusive_Process`.
            "restored_gpu_settings": [],
            # MIG layouts re-created (recreate_mig_layout): `GPU 0 (GPU-...): nvidia-smi mig -i 0 -cgi 9,9 -C`.
            "recreated_mig_layouts": [],
            # A system container's own units, put back through the guest's systemd: `lxc:101:vllm.service`.
            "unmasked_guest_units": [],
            "enabled_guest_units": [],
            "started_guest_units": [],
            "reset_failed_guest_units": [],
            "forgotten": [],
            "already_restored": [],
            "not_restored": [],
            "plan": [],
            "pending": [],
            "gpus_held": {},
            "timings": {"restore_s": 0.0, "wait_s": 0.0},
            # Shown as the task's warnings (gpu_restore's main), not returned under this key.
            "warnings": [],
        }

    # --- units

    def _show(self, units: list[str], systemctl: Systemctl | None = None) -> dict[str, dict[str, str]]:
        call = systemctl or (lambda args: self.system.systemctl(args, timeout=self.step_timeout))
        rc, out, err = call(["show", "--property=Id,LoadState,ActiveState,SubState,UnitFileState,Result", "--no-pager"] + units)
        if rc != 0:
            raise RestoreError(f"systemctl show failed (rc {rc}): {(err or out).strip()}", self.result)
        return _units.parse_show(out)

    def _unit_step(self, unit: str, step: str, before: Entry, systemctl: Systemctl | None = None) -> str | None:
        """One step on a unit (of the host, or of a guest through `systemctl`); why it failed, or None."""
        call = systemctl or (lambda args: self.system.systemctl(args, timeout=self.step_timeout))
        # --no-reload: a daemon-reload cuts running GPU containers off their GPUs (_reload_risk).
        args = {"unmask": ["unmask", "--no-reload"], "enable": ["enable", "--no-reload"], "reset-failed": ["reset-failed"],
                "start": ["start"]}[step]
        if step == "enable" and (before.get("unit_file_state") or "").endswith("-runtime"):
            args = ["enable", "--no-reload", "--runtime"]
        rc, out, err = call(args + ["--no-ask-password", unit])
        if rc == 124:
            return f"systemctl {step} {unit} did not finish within {self.step_timeout:.0f} s (step_timeout)"
        if rc != 0:
            return f"systemctl {step} {unit} failed (rc {rc:d}): {(err or out).strip()}"
        if step == "start":
            # `systemctl start` returns when the start job is done; a unit that died at once reads failed.
            state = self._show([unit], call).get(unit, {})
            if state.get("ActiveState") not in ("active", "activating", "reloading") or state.get("SubState") == "auto-restart":
                return "{} did not start: it reads {} ({}, result {})".format(unit, state.get("ActiveState"), state.get("SubState"), state.get("Result"))
        return None

    def _host_systemctl(self, args: list[str]) -> tuple[int, str, str]:
        return self.system.systemctl(args, timeout=self.step_timeout)

    def _file_state_on_disk(self, entry: Entry, props: t.Mapping[str, str], call: Systemctl) -> dict[str, str]:
        """PROPS with UnitFileState as the unit files on disk say (`systemctl is-enabled`), for a unit
        the release disabled or masked: systemd keeps the state it last read for a unit until it
        reloads its units (or unloads the unit), so after a disable, mask or unmask without a
        reload `systemctl show` reads the state before (measured, systemd 252 and 257)."""
        props = dict(props)
        if not {"disabled", "masked"} & set(entry.get("actions") or []):
            return props
        _rc, out, _err = call(["is-enabled", "--no-pager", entry["name"]])
        state = out.strip().splitlines()[-1].strip() if out.strip() else ""
        if state and " " not in state:
            props["UnitFileState"] = state
        return props

    def _reload_to_start(self, unit: str, call: Systemctl, guest: str | None = None) -> str | None:
        """`unit` is unmasked on disk but systemd still holds it masked (another unit wants it, and
        it was masked when systemd loaded it): only a daemon-reload lets it start. A reload cuts
        running GPU containers off their GPUs (_reload_risk): refused while any is found, or, in a
        guest, where they are not looked for, unless `reload_despite_gpu_containers`. Why not, or None."""
        if not self.options.reload_despite_gpu_containers:
            if guest:
                return (f"{unit} is unmasked in {guest}, but the guest's systemd holds it masked until it reloads its units, and this run does not "
                        "reload a guest's systemd (a daemon-reload cuts the guest's running GPU containers off their GPUs unless the "
                        f"node has /dev/char links for the NVIDIA device nodes: {_reload_risk.FIX}). Run systemctl daemon-reload in the guest, or set "
                        "reload_despite_gpu_containers, then run gpu_restore again")
            risks = self.system.reload_risk(call)
            if risks:
                return (f"{unit} is unmasked, but systemd holds it masked until it reloads its units, and a daemon-reload now would cut "
                        "these running GPU containers off their GPUs (their access to the NVIDIA devices was granted outside systemd's "
                        f"DeviceAllow=; they would fail with \"Failed to initialize NVML: Unknown Error\"): {_reload_risk.describe(risks)}. Fix the node first "
                        f"({_reload_risk.FIX}, and the GPUs passed to the containers as devices), or set reload_despite_gpu_containers, then run "
                        "gpu_restore again")
        rc, out, err = call(["daemon-reload"])
        if rc != 0:
            return f"systemctl daemon-reload (to start {unit}, which systemd held masked) failed (rc {rc:d}): {(err or out).strip()}"
        self.result["warnings"].append(f"systemd was reloaded{' in ' + guest if guest else ''} to start {unit}, which it held masked")
        return None

    def _report_unit(self, unit: str, step: str) -> None:
        """A step done (in check mode: planned) goes under its result key."""
        {"unmask": self.result["unmasked_units"], "enable": self.result["enabled_units"], "reset-failed": self.result["reset_failed_units"],
         "start": self.result["started_units"]}[step].append(unit)

    def restore_unit(self, entry: Entry, props: t.Mapping[str, str]) -> Outcome:
        unit = entry["name"]
        if (props.get("LoadState") or "not-found") == "not-found":
            return [], f"{unit} is no longer known to systemd (its unit file was removed?)"
        call = self._host_systemctl
        steps = unit_steps(entry, self._file_state_on_disk(entry, props, call))
        if self.check_mode:
            for step in steps:
                self._report_unit(unit, step)
            return steps, None
        done = []
        while steps:
            step = steps[0]
            why = self._unit_step(unit, step, entry)
            if why:
                return steps, why
            done.append(step)
            self._report_unit(unit, step)
            if step == "unmask":
                # Whether the unit reads enabled again after unmask depends on its links: read it, do not assume.
                now = self._show([unit]).get(unit, {})
                steps = [s for s in unit_steps(entry, self._file_state_on_disk(entry, now, call)) if s != "unmask"]
                why = self._reload_to_start(unit, call) if now.get("LoadState") == "masked" and "start" in steps else None
                if why:
                    return steps, why
            else:
                steps = steps[1:]
        return done, None

    # --- a guest's units

    def restore_guest_unit(self, entry: Entry) -> Outcome:
        """A system container's own unit, put back through the guest's systemd, confined as the
        guest (_guest_units, _guest_reach), with the steps of a host unit. A guest that is not
        running keeps its entry: start the guest, then run gpu_restore again."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units  # pylint: disable=import-outside-toplevel
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests  # pylint: disable=import-outside-toplevel
        unit, kind, name = entry["name"], entry.get("guest_kind") or "", str(entry.get("guest"))
        guests = [g for g in self.system.running_guests(kind, _glob_escape(name)) if g["name"] == name]
        if not guests:
            return [], "{} is not running: start it, then run gpu_restore again".format(_guests.label({"kind": kind, "name": name}))
        guest = guests[0]
        if guest.get("manager") != "systemd":
            return [], "{} runs {} as its init, not systemd".format(_guests.label(guest), guest.get("manager") or "no system manager")
        refused = self.system.guest_refusal(guest)
        if refused:
            return [], "{}. Run `{}` there yourself (the entry stays in the record)".format(
                refused, _guests.guest_command(guest, ["systemctl", "start", unit], _guests.host_tools()))
        node = _guest_units.GuestNode(self.system, guest, self.step_timeout)
        try:
            props = self._show([unit], node.systemctl).get(unit, {})
        except RestoreError as exc:
            return [], exc.msg
        if (props.get("LoadState") or "not-found") == "not-found":
            return [], f"{unit} is no longer known to the guest's systemd (its unit file was removed?)"
        steps = unit_steps(entry, self._file_state_on_disk(entry, props, node.systemctl))
        keys = {"unmask": "unmasked_guest_units", "enable": "enabled_guest_units", "reset-failed": "reset_failed_guest_units",
                "start": "started_guest_units"}
        done = []
        for step in steps:
            if not self.check_mode:
                why = self._unit_step(unit, step, entry, node.systemctl)
                if not why and step == "unmask" and "start" in steps and self._show([unit], node.systemctl).get(unit, {}).get("LoadState") == "masked":
                    why = self._reload_to_start(unit, node.systemctl, _guests.label(guest))
                if why:
                    return steps, why
            done.append(step)
            self.result[keys[step]].append(entry.get("entry") or unit)
        return done, None

    # --- containers

    def _report_policy(self, entry: Entry) -> None:
        self.result["restored_policies"].append({"name": entry.get("name"), "id": entry.get("id"), "restart_policy": entry["restart_policy"]})

    def restore_container(self, entry: Entry) -> Outcome:
        runtimes = self.system.runtimes
        # A container entry names its runtime and id (_record.container_entries writes both).
        runtime, cid = t.cast("str", entry.get("runtime")), t.cast("str", entry.get("id"))
        try:
            record = runtimes.inspect(runtime, cid)
        except _engines.RuntimeUnavailable as exc:
            return [], f"cannot ask {runtime}: {exc}"
        if record is None:
            return [], "{} no longer knows it (removed since the release?); forget it with forget: [{}]".format(runtime, entry.get("name"))
        steps = container_steps(entry, record)
        self.policies_now[cid] = record.get("restart_policy")
        if self.check_mode:
            if "restart_policy" in steps:
                self._report_policy(entry)
            if "start" in steps:
                self.result["started_containers"].append(entry.get("name") or cid)
            return steps, None
        try:
            if "restart_policy" in steps:
                runtimes.set_restart_policy(runtime, cid, entry["restart_policy"], entry.get("restart_max_retries") or 0)
                self._report_policy(entry)
            if "start" in steps:
                runtimes.start(runtime, cid, self.step_timeout)
                now = runtimes.inspect(runtime, cid)
                if not now or not now.get("running"):
                    return steps, "it did not stay running after the start (status {})".format(now.get("status") if now else None)
                self.result["started_containers"].append(entry.get("name") or cid)
        except _engines.RuntimeUnavailable as exc:
            return steps, str(exc)
        return steps, None

    # --- supervisor programs

    def restore_program(self, entry: Entry) -> Outcome:
        """A supervisord program: its autostart/autorestart lines as they were (gpu_release marked
        the ones it wrote), then `supervisorctl start` when it was running. `reread` + `update
        GROUP` only when the program is alone in its group: `update` removes and re-adds the whole
        group, stopping and starting every other program in it. Beside others, the file is put
        back and the program started, nothing else; a supervisord that read the release's edit
        (restarted since, or a release before `group_updated: false`) keeps autorestart off for it
        until its next start, and the result warns so."""
        try:
            from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor  # pylint: disable=import-outside-toplevel
        except ImportError:
            return [], "this version of zeromib.gpu cannot restore supervisord programs; start it with supervisorctl start {}".format(entry["name"])
        running = [s for s in _supervisor.find_supervisors(self.system.proc) if s.ctl]
        supervisor = next((s for s in running if s.config == entry.get("config")), None) or (running[0] if len(running) == 1 else None)
        if supervisor is None:
            return [], "no running supervisord (with supervisorctl) for its configuration {}".format(entry.get("config") or "(default)")
        steps = []
        edit = program_edit(entry, _supervisor) if "disabled" in (entry.get("actions") or []) and entry.get("file") else None
        # The copies of a numprocs program share one section: it is put back once (check mode too).
        edited = (entry.get("file"), entry.get("section") or entry["name"])
        if edit is not None and edited in self.edited_sections:
            edit = None
        if edit is not None:
            self.edited_sections.add(edited)
            steps.append("autostart")
        try:
            programs = supervisor.status(self.step_timeout)
        except Exception as exc:  # _errors.ReleaseError from supervisorctl status; pylint: disable=broad-except
            return steps, str(getattr(exc, "msg", exc))
        state = next((p["state"] for p in programs if p["name"] == entry["name"]), None)
        group = entry["name"].split(":")[0]
        siblings = sorted(p["name"] for p in programs if p["name"] != entry["name"] and p["name"].split(":")[0] == group)
        if entry.get("running") and state not in _supervisor.RUNNING_STATES:
            steps.append("start")
        self.supervisors[entry["name"]] = supervisor
        if self.check_mode:
            if "start" in steps:
                self.result["started_programs"].append(entry["name"])
            return steps, None
        if not steps:
            return steps, None
        if edit is not None:
            _supervisor.write_atomically(entry["file"], edit)
            if not siblings:
                supervisor.call(["reread"], self.step_timeout)
                supervisor.call(["update", group], self.step_timeout)
            elif entry.get("group_updated", True) or supervisor.pid != entry.get("supervisor_pid"):
                self.result["warnings"].append(
                    "supervisor:{}: its file is restored, but the running supervisord (pid {:d}) read autorestart=false for it; it gets "
                    "autorestart back at supervisord's next start (`supervisorctl update {}` would also restart {})".format(
                        entry["name"], supervisor.pid, group, ", ".join(siblings)))
        if "start" in steps:
            rc, out = supervisor.call(["start", entry["name"]], self.step_timeout)
            if rc != 0 and "already started" not in (out or ""):
                return ["start"], "supervisorctl start {} failed (rc {}): {}".format(entry["name"], rc, (out or "").strip()[:300])
            self.result["started_programs"].append(entry["name"])
        return steps, None

    # --- the whole run

    def run(self) -> dict[str, t.Any]:
        started = self.system.now()
        path = self.system.record_path
        with _record.locked(path, create=False):
            try:
                record = _record.read(path)
            except _record.RecordError as exc:
                raise RestoreError(str(exc), self.result) from exc
            return self._run(record, path, started)

    def _run(self, record: Record, path: str, started: float) -> dict[str, t.Any]:
        entries = record["entries"]
        forget = forgotten(entries, self.options.forget or [])
        self.result["forgotten"] = [_record.describe(e) for e in forget]
        forget_keys = {_record.key(e) for e in forget}
        todo = [e for e in entries if _record.key(e) not in forget_keys]
        # Before anything starts: the device nodes restored GPU containers and guests open (issue 71).
        nodes = self.system.device_nodes(self.check_mode) if todo else None
        self.result["device_nodes"] = nodes
        if nodes and nodes["error"]:
            raise RestoreError(nodes["error"] + "; nothing was restored", self.result)
        # Issue 71: the MIG layouts the record keeps, against the node, before anything starts (_mig_restore).
        try:
            mig = _mig_restore.check(self, todo)
        except _mig_restore.MigRefused as exc:
            raise RestoreError(str(exc), self.result) from exc
        pinned = mig.still_pinned() if mig else {}
        # A unit pinned to a lost MIG UUID is not restored: systemd is not asked about it.
        units = [e["name"] for e in todo if e["kind"] == "unit" and _record.key(e) not in pinned]
        props = self._show(units) if units else {}
        restored: list[Entry] = []
        kept: list[Entry] = []
        before_lines: list[str] = []
        after_lines: list[str] = []
        steps: list[str]
        why: str | None
        for entry in reversed(todo):
            if _record.key(entry) in pinned:
                steps, why = [], pinned[_record.key(entry)]
            elif entry["kind"] == _mig_restore.KIND:
                steps, why = mig.outcomes.get(_record.key(entry), ([], None)) if mig else ([], None)
            elif entry["kind"] == "unit":
                steps, why = self.restore_unit(entry, props.get(entry["name"], {}))
            elif entry["kind"] == "container":
                steps, why = self.restore_container(entry)
            elif entry["kind"] == "guest_unit":
                steps, why = self.restore_guest_unit(entry)
            elif entry["kind"] == _ready_settings.KIND:
                steps, why = self.restore_gpu_settings(entry)
            elif entry["kind"] == "swarm_service":
                # Issue 72: a Swarm service back to its replicas (_act/_orchestrators).
                from ansible_collections.zeromib.gpu.plugins.module_utils._act import _orchestrators  # pylint: disable=import-outside-toplevel
                steps, why = _orchestrators.restore_for(self, entry)
            else:
                steps, why = self.restore_program(entry)
            before, after = change_lines(entry, steps, self.policies_now.get(entry.get("id") or ""))
            if why:
                kept.append(entry)
                self.result["not_restored"].append({"kind": entry["kind"], "name": entry.get("name"), "id": entry.get("id"), "steps": steps,
                                                    "reason": why})
                before_lines.append(before)
                after_lines.append(before + f" (not restored: {why})")
                continue
            restored.append(entry)
            if steps:
                self.result["restored"].append({"kind": entry["kind"], "name": entry.get("name"), "steps": steps})
                self.result["plan"].append(plan_line(entry, steps))
                before_lines.append(before)
                after_lines.append(after)
            else:
                # Already as before the release (put back by hand): only its record entry goes.
                self.result["already_restored"].append(_record.describe(entry))
                self.result["plan"].append(f"{label(entry)}: already as before, dropped from the record")
                before_lines.append(f"{label(entry)}: in the restore record")
                after_lines.append(f"{label(entry)}: dropped from the record (already as before)")
        for entry in forget:
            self.result["plan"].append(f"{label(entry)}: forgotten (not restored)")
            before_lines.append(f"{label(entry)}: in the restore record")
            after_lines.append(f"{label(entry)}: forgotten (not restored)")
        self.result["timings"]["restore_s"] = round(self.system.now() - started, 3)
        self.result["diff"] = {"before_header": path, "after_header": path + " (after the restore)",
                               "before": "".join(line + "\n" for line in before_lines),
                               "after": "".join(line + "\n" for line in after_lines)}
        # Every entry restored, already back or forgotten has a line in the plan: the record changes.
        self.result["changed"] = bool(self.result["plan"])
        left = [e for e in entries if e in kept]
        self.result["pending"] = [_record.describe(e) for e in left]
        if not self.check_mode and (restored or forget):
            try:
                _record.write(_record.without(record, [_record.key(e) for e in restored + forget], _record.now_iso()), path)
            except (_record.RecordError, OSError) as exc:
                raise RestoreError(f"restored, but the record {path} could not be updated: {exc}", self.result) from exc
        if self.result["not_restored"]:
            raise RestoreError(self.failure_message(), self.result)
        wait = parse_wait(self.options.wait_for_gpus)
        if wait and not self.check_mode:
            self.wait_for_gpus([e for e in restored if e.get("gpu_indexes")], wait)
        self.result["elapsed_s"] = round(self.system.now() - started, 3)
        return self.result

    def restore_gpu_settings(self, entry: Entry) -> Outcome:
        """A GPU's settings ready_fix changed, set back with nvidia-smi (_ready_settings): before
        the inference side's units start (entries are undone in reverse)."""
        steps, why, notes = _ready_settings.restore(self._smi, entry, self.check_mode)
        self.result["warnings"].extend("GPU {} ({}): {}".format(entry.get("index"), entry.get("name"), note) for note in notes)
        if not why and steps:
            self.result["restored_gpu_settings"].append("GPU {} ({}): {}".format(entry.get("index"), entry.get("name"), ", ".join(steps)))
        return steps, why

    def _smi(self) -> NvidiaSmi:
        return NvidiaSmi(NvidiaSmi.find(self.options.nvidia_smi), self.step_timeout)

    def failure_message(self) -> str:
        parts = ["{} {}: {}".format(item["kind"], item["name"] or (item.get("id") or "")[:12], item["reason"]) for item in self.result["not_restored"]]
        return "could not restore {}. Kept in {} for the next run of gpu_restore".format("; ".join(parts), self.system.record_path)

    def wait_for_gpus(self, entries: list[Entry], seconds: float) -> None:
        """Until every restored entry that held GPUs at the release holds a GPU again."""
        # A program is waited for when this run found its supervisord (restore_program).
        wanted = [e for e in entries if e["kind"] in ("unit", "container", "guest_unit") or (e["kind"] == "supervisor" and e.get("name") in self.supervisors)]
        if not wanted or self.look is None:
            return
        started = self.system.now()
        deadline = started + seconds
        while True:
            holders = self.look()
            programs = self.program_pids(wanted)
            held: dict[str | None, list[int]] = {}
            for entry in wanted:
                gpus = sorted({i for h in holders if _holds(entry, h, programs, self.system.proc) for i in h.get("gpu_indexes") or []})
                if gpus:
                    held[entry.get("name")] = gpus
            self.result["gpus_held"] = held
            missing = [e for e in wanted if e.get("name") not in held]
            now = self.system.now()
            if not missing or now >= deadline:
                break
            self.system.sleep(min(GPU_POLL_S, deadline - now))
        self.result["timings"]["wait_s"] = round(self.system.now() - started, 3)
        if missing:
            raise RestoreError(
                "restored, but {} {} not holding a GPU again after {:.0f} s (wait_for_gpus); they held GPU {} at the release".format(
                    ", ".join(str(e.get("name")) for e in missing), "is" if len(missing) == 1 else "are", seconds,
                    "; ".join("{}: {}".format(e.get("name"), ",".join(str(i) for i in e["gpu_indexes"])) for e in missing)),
                self.result,
            )

    def program_pids(self, entries: list[Entry]) -> dict[str, int]:
        """{program name: its process now}, as its supervisord reports it (supervisorctl status)."""
        pids: dict[str, int] = {}
        for entry in entries:
            supervisor = self.supervisors.get(entry.get("name") or "") if entry["kind"] == "supervisor" else None
            if supervisor is None:
                continue
            try:
                listed = supervisor.status(self.step_timeout)
            except Exception:  # a supervisorctl that fails now is asked again at the next look; pylint: disable=broad-except
                continue
            pid = next((p.get("pid") for p in listed if p.get("name") == entry["name"]), None)
            if pid:
                pids[entry["name"]] = pid
        return pids


def program_edit(entry: Entry, supervisor_mod: ModuleType) -> str | None:
    """The text of the program's file with the autostart/autorestart lines gpu_release wrote put
    back as they were (a line it added removed), or None when there is nothing to put back."""
    try:
        with open(entry["file"]) as handle:
            text = handle.read()
    except OSError:
        return None
    before = {"autostart": entry.get("autostart_before"), "autorestart": entry.get("autorestart_before")}
    sections = [entry["section"]] if entry.get("section") else supervisor_mod.section_names(entry["name"])
    out: list[str] = []
    section: str | None = None
    changed = False
    for line in text.splitlines(True):
        header = supervisor_mod._SECTION.match(line)  # pylint: disable=protected-access
        if header:
            section = header.group(1).strip()
        match = supervisor_mod._OPTION.match(line)  # pylint: disable=protected-access
        if section in sections and match and supervisor_mod.MARK in line:
            option = match.group(2).lower()
            changed = True
            if before.get(option) is None:
                continue
            line = f"{match.group(1)}{option}={before[option]}\n"
        out.append(line)
    return "".join(out) if changed else None


def _holds(entry: Entry, holder: Holder, programs: t.Mapping[str, int] | None = None, proc: str = "/proc") -> bool:
    if entry["kind"] == "unit":
        return holder.get("unit") == entry["name"] and holder.get("system_service", True)
    if entry["kind"] == "guest_unit":
        guest: t.Mapping[str, t.Any] = holder.get("guest") or {}
        return (guest.get("kind"), guest.get("name"), guest.get("unit")) == (entry.get("guest_kind"), entry.get("guest"), entry["name"])
    if entry["kind"] == "supervisor":
        pid = (programs or {}).get(entry.get("name") or "")
        return pid is not None and pid in ancestry(holder.get("pid"), proc)
    container = holder.get("container")
    if not container:
        return False
    return (entry.get("id") or "").startswith(container)


def _glob_escape(name: str) -> str:
    """A name as an fnmatch glob that matches only itself."""
    return "".join(f"[{char}]" if char in "*?[]" else char for char in name)


def ancestry(pid: t.Any, proc: str = "/proc", limit: int = 64) -> list[int]:
    """`pid` and its parents up to PID 1, from /proc/PID/status (the kernel's parent links; status
    answers where stat may wait: _holders.status_of)."""
    chain: list[int] = []
    while isinstance(pid, int) and pid > 1 and len(chain) < limit and pid not in chain:
        chain.append(pid)
        found = _holders.status_of(pid, proc)
        if found is None:
            break
        pid = found[1]
    return chain


def holders_now(smi: NvidiaSmi, proc: str = "/proc") -> list[Holder]:
    """A look for wait_for_gpus: the holders of the node now, attributed to GPUs."""
    return _facts.look(smi, [], with_processes=True, proc=proc).holders
