# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Free GPUs and prove it: look -> plan -> act (units, SIGTERM, SIGKILL) -> verify.

No AnsibleModule in here. Side effects go through a `System` object (systemctl, signals,
clock) so that the logic is tested without killing anything.
"""

from __future__ import annotations

import os
import subprocess
import time

from ansible_collections.zeromib.gpu.plugins.module_utils import _attribution
from ansible_collections.zeromib.gpu.plugins.module_utils import _containers
from ansible_collections.zeromib.gpu.plugins.module_utils import _engines
from ansible_collections.zeromib.gpu.plugins.module_utils import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils import _health
from ansible_collections.zeromib.gpu.plugins.module_utils import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils import _mps
from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils import _settle
from ansible_collections.zeromib.gpu.plugins.module_utils import _signals
from ansible_collections.zeromib.gpu.plugins.module_utils import _supervisor
from ansible_collections.zeromib.gpu.plugins.module_utils import _units
from ansible_collections.zeromib.gpu.plugins.module_utils._errors import ReleaseError  # noqa: F401 (the modules' import)
from ansible_collections.zeromib.gpu.plugins.module_utils._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._nvidia_smi import (
    GPU_FIELDS, NvidiaSmiError, check_against_driver, normalize_bus_id, parse_compute_apps,
)

# While GPUs stay dirty, look for who holds them this often (a /proc scan, a few ms).
RESCAN_S = 1.0
# How long a dirty GPU that no process holds is given to free itself before the run fails: a
# process that exited just before frees its memory within ~1 s on H200 (one still tearing down,
# e.g. unpinning host memory in D state, is still in /proc, so still a holder).
NO_HOLDER_GRACE_S = 1.0
# A GPU that no process holds and that reads this little (or is in MIG mode) is taken for its
# idle baseline: MIG-enabled H100/H200/A100 read 50-59 MiB idle (public reports, the fleet's
# simulated A100 MIG host reads 55 MiB).
BASELINE_MAX_MIB = 64


class System:
    """Everything gpu_release does to the node, in one replaceable place."""

    def __init__(self, systemctl_path=None, proc="/proc", runtimes=None, record_path=None):
        self.systemctl_path = systemctl_path
        self.proc = proc
        # Where the restore record goes (_record.PATH for the module); None writes none.
        self.record_path = record_path
        # pidfds pin a process of this kernel's /proc only.
        self.pidfd = _signals.pidfd_or_none() if proc == "/proc" else None
        # Docker and Podman, asked only when a holder runs in a container or services names one.
        self.runtimes = runtimes if runtimes is not None else _engines.Runtimes()

    def systemctl(self, args):
        if not self.systemctl_path:
            return 127, "", "systemctl not found"
        process = subprocess.run(
            [self.systemctl_path] + list(args),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=dict(os.environ, LC_ALL="C", LANG="C", SYSTEMD_PAGER="", SYSTEMD_COLORS="0"),
            check=False,
        )
        return process.returncode, process.stdout.decode("utf-8", "replace"), process.stderr.decode("utf-8", "replace")

    def start_time(self, pid):
        return holders_mod.start_time_of(pid, self.proc)

    def supervisors(self):
        """Running supervisord processes of root (asked only when services names a program)."""
        return _supervisor.find_supervisors(self.proc)

    def state(self, pid):
        try:
            with open("%s/%d/stat" % (self.proc, pid), "rb") as handle:
                return holders_mod.parse_stat(handle.read())[1]
        except (OSError, ValueError, IndexError):
            return None

    def signal(self, pid, signum):
        os.kill(pid, signum)

    def cgroup_unit(self, pid):
        """(unit, is a system service) of a PID, from its cgroup."""
        try:
            with open("%s/%d/cgroup" % (self.proc, pid), "rb") as handle:
                path = holders_mod.parse_cgroup(handle.read())
        except OSError:
            return None, False
        return holders_mod.unit_of(path), holders_mod.is_system_service(path)

    @staticmethod
    def now():
        return time.monotonic()

    @staticmethod
    def sleep(seconds):
        time.sleep(max(0.0, seconds))


# ---------------------------------------------------------------- pure planning steps


def select_gpus(gpus, wanted):
    """`gpus` option (indexes or UUIDs) -> sorted indexes. Empty/None selects all."""
    if not wanted:
        return sorted(gpu["index"] for gpu in gpus)
    by_uuid = {gpu["uuid"].lower(): gpu["index"] for gpu in gpus if gpu.get("uuid")}
    indexes = {gpu["index"] for gpu in gpus}
    selected = set()
    for item in wanted:
        text = str(item).strip()
        if text.isdigit() and text.isascii() and int(text) in indexes:
            selected.add(int(text))
        elif text.lower() in by_uuid:
            selected.add(by_uuid[text.lower()])
        else:
            raise ReleaseError(
                "GPU {!r} is not on this host: it has indexes {} and UUIDs {}".format(
                    text, ", ".join(str(i) for i in sorted(indexes)), ", ".join(sorted(by_uuid)) or "none")
            )
    return sorted(selected)


def matches_any(holder, regexes):
    return any(regex.search(holder.get("cmdline") or "") for regex in regexes)


def plan_targets(holders, selected, regexes, kill_spanning=False):
    """(to signal, protected holders of the selected GPUs). A holder is signalled for the GPUs it
    uses (see _attribution: an undecided one only when every GPU it may use is selected, a
    spanning one only with kill_spanning); `match` narrows that, and an NVML client is signalled
    only when `match` names it."""
    targets, protected = [], []
    for holder in holders:
        for_selection = _attribution.may_signal_for(holder, selected, kill_spanning)
        named = bool(regexes) and matches_any(holder, regexes)
        if holder["protected"]:
            # Reported when it holds a selected GPU, spanning or not: it is never signalled anyway.
            if _attribution.may_signal_for(holder, selected, kill_spanning=True) or named:
                protected.append(holder)
            continue
        if regexes and not named:
            continue
        if for_selection or (named and holder.get("attribution") == _attribution.NVML_CLIENT):
            targets.append(holder)
    return targets, protected


def spanning_targets(holders, selected, regexes):
    """Unprotected holders that freeing `selected` would signal (those `match` names, when set)
    but that also use GPUs outside it: [(holder, outside GPUs)]."""
    found = []
    for holder in _attribution.spanning_for(holders, selected):
        if not holder["protected"] and (not regexes or matches_any(holder, regexes)):
            found.append((holder, _attribution.outside_gpus(holder, selected)))
    return found


def spanning_containers(holders, selected, stopping):
    """Containers planned to be stopped because they hold a selected GPU, whose processes also
    use GPUs outside the selection: [{container, name, pids, gpu_indexes, outside_gpus}]."""
    found = []
    for entry in stopping:
        if not entry.get("gpu_indexes"):
            continue  # named in services: stopped because the user named it
        inside = [h for h in holders if h.get("container") and h["container"] == entry.get("id")]
        used = set(g for h in inside for g in h.get("gpu_indexes") or [])
        if used - set(selected):
            found.append({"container": entry.get("id"), "name": entry.get("name"), "pids": sorted(h["pid"] for h in inside),
                          "gpu_indexes": sorted(used), "outside_gpus": sorted(used - set(selected))})
    return found


def _gpu_list(indexes):
    return ",".join(str(i) for i in indexes)


def spanning_record(processes, units, containers):
    """The `spanning` return value: what uses a selected GPU and GPUs outside the selection."""
    record = [
        {"pid": h["pid"], "name": h.get("name"), "cmdline": h.get("cmdline"), "unit": h.get("unit"), "container": h.get("container"),
         "pids": [h["pid"]], "gpu_indexes": list(h.get("gpu_indexes") or []), "outside_gpus": outside}
        for h, outside in processes
    ]
    record += [dict(u, pid=None, name=None, cmdline=None, container=None) for u in units]
    record += [{"pid": None, "name": c.get("name"), "cmdline": None, "unit": None, "container": c["container"], "pids": c["pids"],
                "gpu_indexes": c["gpu_indexes"], "outside_gpus": c["outside_gpus"]} for c in containers]
    return record


def spanning_message(processes, units, containers, selected):
    """Why a partial selection is refused before anything is done, naming each spanning process
    (pid, name, command line) or unit or container and the unselected GPUs it uses."""
    parts = []
    for holder, outside in processes:
        parts.append("{} uses GPUs {}; GPU {} {} outside the selection".format(
            describe_holder(holder), _gpu_list(holder.get("gpu_indexes") or []), _gpu_list(outside), "is" if len(outside) == 1 else "are"))
    for unit in units:
        parts.append("unit {} (pids {}) holds GPUs {}; GPU {} {} outside the selection".format(
            unit["unit"], _gpu_list(unit["pids"]), _gpu_list(unit["gpu_indexes"]), _gpu_list(unit["outside_gpus"]),
            "is" if len(unit["outside_gpus"]) == 1 else "are"))
    for container in containers:
        parts.append("container {} (pids {}) holds GPUs {}; GPU {} {} outside the selection".format(
            container.get("name") or str(container["container"])[:12], _gpu_list(container["pids"]), _gpu_list(container["gpu_indexes"]),
            _gpu_list(container["outside_gpus"]), "is" if len(container["outside_gpus"]) == 1 else "are"))
    return (
        "refusing to free GPU {}: ending these would also end their work on GPUs outside the selection: {}. Nothing was stopped or "
        "signalled. Select every GPU they use, or set kill_spanning: true (role: free_gpus_kill_spanning) to end them anyway".format(
            _gpu_list(selected), "; ".join(parts))
    )


def describe_holder(holder):
    parts = ["pid %d %s" % (holder["pid"], holder.get("name"))]
    cmdline = holder.get("cmdline") or ""
    if cmdline and cmdline != holder.get("name"):
        parts[0] += " [%s]" % (cmdline if len(cmdline) <= 60 else cmdline[:57] + "...")
    if holder.get("unit"):
        parts.append("unit {}".format(holder["unit"]))
    if holder.get("container"):
        parts.append("container %s" % (holder.get("container_name") or holder["container"][:12]))
    parts.append("state {}".format(holder.get("state")))
    if holder.get("protected"):
        parts.append("protected")
    if holder.get("attribution") == _attribution.UNDECIDED:
        parts.append("may use GPU {}: maps their device files, none context-sized".format(",".join(str(i) for i in holder.get("candidate_gpu_indexes") or [])))
    return "{} ({})".format(parts[0], ", ".join(parts[1:]))


EARLY_HEADS = {
    "protected": "GPUs are held only by protected processes, which gpu_release never signals",
    "no_holder": "GPUs read above max_used_mib with no process holding them (waiting would not free them)",
    "unreadable": "GPU memory cannot be read, so the GPUs cannot be proven free (waiting would not change that)",
    "not_killed": "GPUs are held by processes that kill=false leaves running (waiting would not free them)",
    "respawned": "GPUs are held again by a process started again by a restarter that this run does not stop",
}


def failure_message(dirty_gpus, holders, apps, waited_s, unkillable, protected_only=False, early=None):
    """One message naming each dirty GPU, its MiB and what still holds it. `early`: why the
    wait stopped before wait_timeout (a key of EARLY_HEADS)."""
    lines = []
    for gpu in dirty_gpus:
        on_gpu = [h for h in holders if gpu["index"] in h["gpu_indexes"]]
        unprotected = [h for h in on_gpu if not h["protected"]]
        claims = [a for a in apps if a.get("gpu_index") == gpu["index"]]
        dead_claims = [a for a in claims if not a.get("alive")]
        claimed_pids = {a["pid"] for a in claims if a.get("alive")}
        protected_claimants = [h for h in on_gpu if h["protected"] and h["pid"] in claimed_pids]
        undecided = [h for h in holders if h.get("attribution") == _attribution.UNDECIDED and gpu["index"] in (h.get("candidate_gpu_indexes") or [])]
        used = gpu.get("memory_used_mib")
        text = "GPU %d (%s) reads %s MiB" % (gpu["index"], gpu.get("uuid"), "unknown" if used is None else used)
        if unprotected or protected_claimants:
            text += ", held by " + "; ".join(describe_holder(h) for h in unprotected + protected_claimants)
        elif undecided:
            # Never signalled for a selection it may not belong to (see _attribution).
            text += (", possibly held by {}, not signalled because it may use GPUs outside the selection: select them all, "
                     "or name it in match".format("; ".join(describe_holder(h) for h in undecided)))
        elif unplaced_claims(claims, holders, gpu["index"]):
            # Never "no live process" while nvidia-smi lists a live PID: name it and say why it was not placed.
            text += ", " + "; ".join(describe_unplaced(app, holders, gpu["index"]) for app in unplaced_claims(claims, holders, gpu["index"]))
        elif dead_claims:
            text += (
                ", attributed to exited process(es) %s and no live process holds the GPU: the driver has not freed this "
                "context; a GPU reset (nvidia-smi --gpu-reset -i %d) or a reboot is needed"
                % (", ".join("%d %s" % (a["pid"], a["name"] or "[No data]") for a in dead_claims), gpu["index"])
            )
        elif used is None:
            text += ": nvidia-smi cannot report its memory, so it cannot be proven free"
        elif on_gpu:
            # Graphics memory of a compositor (Xorg, gnome-shell) is not listed as a compute app.
            text += (
                ", held only by protected process(es) {} that nvidia-smi does not charge with this memory: if this is the GPU's "
                "idle baseline (a desktop, MIG), set max_used_mib; otherwise the driver has not freed it and a GPU reset or a "
                "reboot is needed".format("; ".join(describe_holder(h) for h in on_gpu))
            )
        elif is_idle_baseline(gpu):
            text += (", and no process holds the GPU: this is its idle baseline{}, not a leak; set max_used_mib: {} "
                     "(role: free_gpus_max_used_mib, per host or group) to accept it".format(" (MIG mode is enabled)" if is_mig(gpu) else "", used))
        else:
            text += (", and no live process holds the GPU: memory the driver has not freed; a GPU reset or a reboot is needed "
                     f"(if {used} MiB is this GPU's idle baseline, set max_used_mib: {used} instead)")
        lines.append(text)
    if protected_only or early in EARLY_HEADS:
        head = EARLY_HEADS[early or "protected"]
    else:
        head = f"GPUs still in use after {waited_s:.1f} s"
    if unkillable:
        lines.append("unkillable (outlived SIGKILL, likely D state in the driver): " + "; ".join(describe_holder(h) for h in unkillable))
    return "{}: {}".format(head, ". ".join(lines))


def unplaced_claims(claims, holders, index):
    """Live compute apps of a GPU that the scan did not place on it."""
    placed = {h["pid"] for h in holders if index in (h.get("gpu_indexes") or [])}
    return [a for a in claims if a.get("alive") and a["pid"] not in placed]


def describe_unplaced(app, holders, index):
    holder = next((h for h in holders if h["pid"] == app["pid"]), None)
    text = "listed by nvidia-smi for live pid %d %s, which the scan could not place on this GPU: " % (app["pid"], app.get("name"))
    if holder is None:
        return text + ("it has no device file open or mapped that this node's /dev/nvidia* nodes or the driver's device numbers "
                       "identify (a node of its own, or a file system this module cannot stat); it is not signalled on a listing alone")
    if holder.get("gpu_indexes"):
        return text + ("it holds GPU {} context-sized and this GPU's device only as every CUDA process does: a PID reused since the "
                       "listed owner exited? it is not signalled for this GPU".format(",".join(str(i) for i in holder["gpu_indexes"])))
    return text + "it does not hold this GPU's device file; it is not signalled on a listing alone"


def trust_notes(holders, selected):
    """Notes on holders of the selected GPUs that a name or a cgroup path could have passed off as
    something they are not (see docs/security.md)."""
    notes = []
    for holder in holders:
        if not _attribution.may_signal_for(holder, selected):
            continue
        for note in (holder.get("protection_note"), holder.get("container_note")):
            if note and note not in notes:
                notes.append(note)
    return notes


def is_mig(gpu):
    return str(gpu.get("mig_mode") or "").lower() == "enabled"


def is_idle_baseline(gpu):
    """A small steady reading that no process explains: MIG's 50-59 MiB, or a few MiB of a
    desktop GPU. The caller has checked that nothing holds the GPU."""
    used = gpu.get("memory_used_mib")
    return used is not None and (used <= BASELINE_MAX_MIB or (is_mig(gpu) and used <= 2 * BASELINE_MAX_MIB))


def unheld(dirty, holders, apps):
    """The dirty GPUs that no process holds: no holder uses (or may use) them and no live
    process is listed on them. Waiting frees such a GPU only when a process exited just before."""
    live_claims = {a.get("gpu_index") for a in apps if a.get("alive")}
    held = set(live_claims)
    for holder in holders:
        held.update(holder["gpu_indexes"])
        held.update(holder.get("candidate_gpu_indexes") or [])
    return [g for g in dirty if g["index"] not in held]


def only_protected(dirty, holders, apps):
    """True when waiting cannot help: on every dirty GPU no unprotected process holds it and
    nvidia-smi attributes its memory only to live protected processes. A GPU whose memory
    no app claims (a context being released right now) is never decided here."""
    protected_pids = {h["pid"] for h in holders if h["protected"]}
    for gpu in dirty:
        if any(not h["protected"] for h in holders if gpu["index"] in h["gpu_indexes"]):
            return False
        claims = [a for a in apps if a.get("gpu_index") == gpu["index"]]
        if not claims or any(not a.get("alive") or a["pid"] not in protected_pids for a in claims):
            return False
    return True


def undecided_record(holders):
    """The `undecided` return value: holders that may use a selected GPU, not signalled."""
    return [
        {"pid": h["pid"], "name": h.get("name"), "cmdline": h.get("cmdline"), "candidate_gpu_indexes": h.get("candidate_gpu_indexes")}
        for h in holders
    ]


def summarize_diff(gpus, holders, changes=()):
    """Diff-mode text: per-GPU memory and the holders, one line each, then `changes` (lines of
    plan_diff: what is, or will be, stopped, disabled, masked and signalled)."""
    lines = ["GPU %d %s: %s MiB" % (g["index"], g.get("uuid"), g.get("memory_used_mib")) for g in gpus]
    lines += ["holder {}: {}".format(describe_holder(h), ",".join(str(i) for i in h["gpu_indexes"]) or "control nodes") for h in holders]
    lines += list(changes)
    return "\n".join(lines) + "\n"


def plan_diff(result, check_mode):
    """(before, after) lines for the units, containers and processes the run acts on: their state
    before, and after (or, in check mode, what the real run would leave)."""
    before, after = [], []
    disabled = set(result.get("disabled_units") or [])
    masked = set(result.get("masked_units") or [])
    stopped = list(result.get("stopped_units") or [])
    for unit in stopped + sorted((disabled | masked) - set(stopped)):
        before.append("unit {}: {}".format(unit, "active" if unit in stopped else "enabled"))
        state = "masked" if unit in masked else "disabled" if unit in disabled else None
        after.append("unit {}: {}".format(unit, ", ".join(x for x in ("stopped" if unit in stopped else None, state) if x)))
    stopped_c = [_containers.describe_entry(c) for c in result.get("stopped_containers") or []]
    disabled_c = [_containers.describe_entry(c) for c in result.get("disabled_containers") or []]
    for name in stopped_c + [c for c in disabled_c if c not in stopped_c]:
        before.append("container {}: {}".format(name, "running" if name in stopped_c else "restart policy set"))
        states = ("stopped" if name in stopped_c else None, "restart policy no" if name in disabled_c else None)
        after.append("container {}: {}".format(name, ", ".join(x for x in states if x)))
    for entry in result.get("killed") or []:
        label = "process {} {}".format(entry.get("pid"), entry.get("name"))
        before.append(f"{label}: running")
        after.append("{}: {}".format(label, "SIGTERM, then SIGKILL after kill_timeout" if check_mode else "ended by {}".format(entry.get("signal"))))
    return before, after


# ---------------------------------------------------------------- the run


class Release:
    """look -> plan -> act -> verify, for the options of gpu_release."""

    def __init__(self, smi, system, params, check_mode=False, driver_root="/proc/driver/nvidia/gpus"):
        self.smi = smi
        self.system = system
        self.params = params
        self.check_mode = check_mode
        self.driver_root = driver_root
        self.names, self.pids = holders_mod.split_protect(params.get("protect"))
        self.lineage = holders_mod.lineage(os.getpid(), system.proc)
        self.regexes = params.get("_match_regexes") or []
        # Workload units that also hold GPUs outside the selection (plan_units).
        self.spanning_units = []
        # The compute apps of the latest scan ([] when none was needed).
        self.apps = []
        self._main_pids = {}
        # Minor numbers by bus id, from the look; the verify loop's readings reuse them.
        self.minors_by_bus = {}
        # The look's _health.Health: the final readings are judged with the same checks and Xids.
        self.health = None
        # What may start a signalled holder again (_settle), set when something is signalled.
        self.watch = None
        self.result = {
            "changed": False,
            "released": False,
            "stopped_units": [],
            # Units whose stop outlasted kill_timeout, killed through systemd.
            "killed_units": [],
            "launchers": [],
            "stopped_containers": [],
            "disabled_containers": [],
            "stopped_programs": [],
            "disabled_programs": [],
            "stopped_mps_servers": [],
            "killed": [],
            "protected": [],
            # Not "skipped": Ansible reads a result with that key as a skipped task and then
            # ignores failed_when on it.
            "reused_pids": [],
            "unkillable": [],
            "undecided": [],
            # {path, entries} when this run added to the record gpu_restore reads (_record).
            "restore_record": None,
            # Holders of a selected GPU that also use GPUs outside the selection (kill_spanning).
            "spanning": [],
            # Units a glob in services matched but that are never selected by one (reason given).
            "kept_units": [],
            "warnings": [],
            "gpus_before": [],
            "gpus": [],
            "holders": [],
            "timings": {"look_s": 0.0, "plan_s": 0.0, "stop_s": 0.0, "kill_s": 0.0, "wait_s": 0.0, "settle_s": 0.0},
        }
        state_key = {"disabled": "disabled_units", "masked": "masked_units"}.get(params.get("service_state"))
        self.state_key = state_key
        if state_key:
            self.result[state_key] = []

    # --- look

    def settle_timeout(self):
        value = self.params.get("settle_timeout")
        return _settle.SETTLE_S if value is None else value

    def footprint_mib(self):
        value = self.params.get("cross_gpu_footprint_mib")
        return _attribution.CROSS_GPU_FOOTPRINT_MIB if value is None else value

    def scan(self, gpus):
        """Who uses which GPU now (compute apps fetched only when they can change the answer).
        The apps seen are kept in self.apps."""
        holders, self.apps = _facts.scan_and_attribute(
            gpus, None, lambda: self._apps(gpus), protect_names=self.names, protect_pids=self.pids, own_lineage=self.lineage, proc=self.system.proc,
            max_used_mib=self.params.get("max_used_mib") or 0, footprint_mib=self.footprint_mib(), main_pid_of=self.main_pid_of,
        )
        return _containers.annotate(holders, self.system.runtimes, self.system.proc)

    def main_pid_of(self, unit):
        """systemd's MainPID of a system unit (asked only for a process named like a protected
        daemon that its uid and executable do not vouch for)."""
        if unit not in self._main_pids:
            rc, out, _err = self.system.systemctl(["show", "-p", "MainPID", "--value", unit])
            self._main_pids[unit] = int(out.strip()) if rc == 0 and out.strip().isdigit() else None
        return self._main_pids[unit]

    def may_be_footprint(self, dirty):
        """Whether some dirty GPU reads little enough to be only the cross-GPU footprint (then a
        scan decides it; otherwise none is needed)."""
        allowance = (self.params.get("max_used_mib") or 0) + self.footprint_mib()
        return bool(self.footprint_mib()) and any(g["memory_used_mib"] is not None and g["memory_used_mib"] <= allowance for g in dirty)

    def footprint(self, gpus, holders):
        return _attribution.footprint_gpus(gpus, holders, self.apps, self.params.get("max_used_mib") or 0, self.footprint_mib())

    def look(self):
        snapshot = _facts.look(self.smi, self.params.get("protect"), with_processes=True, proc=self.system.proc, driver_root=self.driver_root, with_apps=False,
                               max_used_mib=self.params.get("max_used_mib") or 0, footprint_mib=self.footprint_mib(),
                               runtimes=self.system.runtimes, checks=_health.Checks.from_params(self.params), main_pid_of=self.main_pid_of)
        self.apps = snapshot.apps
        self.health = snapshot.health
        return snapshot

    # --- plan

    def forbidden_units(self, holders):
        """Units gpu_release must never stop: those of its own session and of protected processes."""
        forbidden = set()
        for pid in self.lineage:
            unit, _service = self.system.cgroup_unit(pid)
            if unit:
                forbidden.add(unit)
        for holder in holders:
            if holder["protected"] and holder.get("unit"):
                forbidden.add(holder["unit"])
        return forbidden

    def plan_units(self, targets, holders, selected):
        forbidden = self.forbidden_units(holders)
        owned, self.result["launchers"], self.spanning_units = _units.owners(
            self.system.systemctl, targets, holders, selected, forbidden, self.system.proc, self.names,
            self.params.get("launchers") or (), bool(self.params.get("kill_spanning")))
        unit_services, _globs = _containers.split_services(self.params.get("services"))
        unit_services, _programs = _supervisor.split_services(unit_services)
        return _units.plan(self.system.systemctl, unit_services, owned if self.params.get("stop_owning_units") else [],
                           self.params.get("service_state"), forbidden, self.result, self.names, self.system.proc,
                           self.params.get("launchers") or ())

    def refuse_spanning(self, holders, selected, container_plan):
        """Spanning processes, units and containers (see _attribution) -> result["spanning"];
        without kill_spanning, a failure before anything is done (check mode says the same)."""
        processes = spanning_targets(holders, selected, self.regexes)
        containers = spanning_containers(holders, selected, container_plan.stop)
        self.result["spanning"] = spanning_record(processes, self.spanning_units, containers)
        if self.result["spanning"] and not self.params.get("kill_spanning"):
            raise ReleaseError(spanning_message(processes, self.spanning_units, containers, selected), self.result)

    def plan_containers(self, holders, targets):
        """Containers to stop through their runtime, and the targets left to signal (_containers)."""
        _patterns, globs = _containers.split_services(self.params.get("services"))
        own = _containers.own_containers(self.lineage, self.system.proc) if globs or any(t.get("container") for t in targets) else set()
        try:
            return _containers.plan(self.system.runtimes, holders, targets, globs, self.params.get("service_state"), own,
                                    stop_found=self.params.get("kill", True))
        except StepFailed as exc:
            raise ReleaseError(exc.msg, self.result) from exc

    def plan_programs(self):
        """supervisord programs named in services as supervisor:<glob> (_supervisor)."""
        _units_and_programs, _globs = _containers.split_services(self.params.get("services"))
        _unit_services, programs = _supervisor.split_services(_units_and_programs)
        if not programs:
            return {"stop": [], "disable": [], "not_found": []}
        return _supervisor.plan(programs, self.params.get("service_state"), self.system.supervisors(), self.result)

    def plan_mps(self, targets):
        """(targets, MPS servers to quit through their control daemon): _mps. A server that also
        serves unselected GPUs is a spanning process: it is a target only with kill_spanning."""
        if not self.params.get("kill", True):
            return targets, []
        return _mps.plan(targets)

    # --- act

    def act_containers(self, plan):
        def record(done):
            # What _containers.act did goes into the result as it comes (also when it failed).
            self.result["disabled_containers"].extend(done["disabled"])
            self.result["stopped_containers"].extend(done["stopped"])
            self.result["warnings"].extend(done["warnings"])

        started = self.system.now()
        try:
            done = _containers.act(self.system.runtimes, plan, self.params.get("kill_timeout"), now=self.system.now)
        except StepFailed as exc:
            record(exc.done)
            raise ReleaseError(exc.msg, self.result) from exc
        record(done)
        self.result["timings"]["stop_s"] = round(self.system.now() - started, 3)
        return done["failed"]

    def act_units(self, plan):
        started = self.system.now()
        _units.act(self.system, plan, self.result, self.params.get("kill_timeout"))
        self.result["timings"]["stop_s"] = round(self.result["timings"]["stop_s"] + self.system.now() - started, 3)

    def act_signals(self, targets):
        started = self.system.now()
        _signals.Signaller(self.system, self.params.get("kill_timeout"), self.result).terminate(targets)
        self.result["timings"]["kill_s"] = round(self.system.now() - started, 3)

    # --- verify

    def verify(self, selected, deadline, acted, unheld_at_look=()):
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
        limit = self.params.get("max_used_mib")
        poll = self.params.get("poll_interval")
        last_scan = self.system.now() if acted else None
        # The footprint decision holds while the readings do (or for RESCAN_S): one scan, not one a poll.
        footprint, footprint_key, footprint_at = set(), None, None
        # Since when every dirty GPU has read unheld, and what it read then.
        unheld_since, unheld_mib = None, {}
        while True:
            poll_started = self.system.now()
            gpus = self._read_gpus()
            dirty = [g for g in gpus if g["index"] in selected and not _facts.gpu_is_clean(g, limit)]
            if not dirty:
                return gpus, True, None, set()
            if any(g.get("memory_used_mib") is None for g in dirty):
                return gpus, False, "unreadable", set()
            now = self.system.now()
            if self.may_be_footprint(dirty):
                key = tuple(g["memory_used_mib"] for g in gpus)
                if key != footprint_key or now - footprint_at >= RESCAN_S:
                    footprint, footprint_key, footprint_at = self.footprint(gpus, self.scan(gpus)), key, now
                dirty = [g for g in dirty if g["index"] not in footprint]
                if not dirty:
                    return gpus, True, None, footprint
            if last_scan is None or now - last_scan >= RESCAN_S:
                holders = self.scan(gpus)
                last_scan = now
                # The scan fetched the compute apps whenever a listing can decide this.
                if only_protected(dirty, holders, self.apps):
                    return gpus, False, "protected", set()
                if not self.params.get("kill", True) and _facts.dirty_holders(holders, [g["index"] for g in dirty]):
                    return gpus, False, "not_killed", set()
                if self.watch and self.watch.respawned():
                    return gpus, False, "respawned", set()
                nobody = unheld(dirty, holders, self.apps)
                mib = {g["index"]: g["memory_used_mib"] for g in dirty}
                if len(nobody) == len(dirty) and (not acted or all(g["index"] in unheld_at_look for g in dirty)):
                    if unheld_since is None or any(mib.get(i, 0) < m for i, m in unheld_mib.items()):
                        # Memory still dropping: a context is being freed right now.
                        unheld_since, unheld_mib = now, mib
                    elif now - unheld_since >= NO_HOLDER_GRACE_S:
                        return gpus, False, "no_holder", set()
                else:
                    unheld_since, unheld_mib = None, {}
            if now >= deadline:
                return gpus, False, None, set()
            self.system.sleep(min(poll_started + poll, deadline) - self.system.now())

    # --- the whole run

    def run(self):
        started = self.system.now()
        snapshot = self.look()
        self.result["timings"]["look_s"] = round(self.system.now() - started, 3)
        gpus, holders = snapshot.gpus, snapshot.holders
        self.minors_by_bus = {normalize_bus_id(g.get("pci_bus_id")): g["minor_number"] for g in gpus}
        hidden = _facts.unreadable_warning(getattr(snapshot, "unreadable", None))
        if hidden:
            self.result["warnings"].append(hidden)
        limit = self.params.get("max_used_mib")
        selected = select_gpus(gpus, self.params.get("gpus"))
        self.result["gpus_before"] = [_facts.public_gpu(g, limit, snapshot.footprint) for g in gpus]
        self.result["selected_gpus"] = selected
        kill_spanning = bool(self.params.get("kill_spanning"))
        targets, protected = plan_targets(holders, selected, self.regexes, kill_spanning)
        targets, mps_servers = self.plan_mps(targets)
        self.result["warnings"].extend(trust_notes(holders, selected))
        self.result["undecided"] = undecided_record(_attribution.undecided_for(holders, selected))
        self.result["protected"] = [{"pid": h["pid"], "name": h["name"], "unit": h.get("unit"), "gpu_indexes": h["gpu_indexes"]} for h in protected]
        planning = self.system.now()
        container_plan = self.plan_containers(holders, targets)
        self.result["warnings"].extend(container_plan.warnings)
        targets = container_plan.signal
        unit_plan = self.plan_units(targets, holders, selected)
        program_plan = self.plan_programs()
        self.refuse_spanning(holders, selected, container_plan)
        self.result["timings"]["plan_s"] = round(self.system.now() - planning, 3)
        self.result["services_not_found"] = unit_plan["not_found"] + container_plan.not_found + program_plan["not_found"]
        gpus_clean = all(g["clean"] for g in self.result["gpus_before"] if g["index"] in selected)
        to_do = bool(container_plan or unit_plan["stop"] or unit_plan["disable"] or unit_plan["mask"] or (targets and self.params.get("kill", True))
                     or program_plan["stop"] or program_plan["disable"] or mps_servers)

        dirty_before = [g for g in gpus if g["index"] in selected and g["index"] not in snapshot.footprint
                        and not _facts.gpu_is_clean(g, limit)]
        unheld_at_look = {g["index"] for g in unheld(dirty_before, holders, self.apps)}

        if self.check_mode:
            self.result["changed"] = to_do
            self.result["released"] = gpus_clean and not targets and not any(e["gpu_indexes"] for e in container_plan.stop)
            self.result["stopped_units"] = unit_plan["stop"]
            self.result["stopped_containers"] = container_plan.stop
            self.result["disabled_containers"] = container_plan.disable
            self.result["stopped_programs"] = [_supervisor.public(e) for e in program_plan["stop"]]
            self.result["disabled_programs"] = [_supervisor.public(e) for e in program_plan["disable"]]
            self.result["stopped_mps_servers"] = [{"pid": h["pid"], "name": h["name"], "pipe_directory": _mps.pipe_directory(h, self.system.proc),
                                                   "gpu_indexes": h["gpu_indexes"], "how": None} for h in mps_servers]
            if self.state_key == "disabled_units":
                self.result["disabled_units"] = unit_plan["disable"]
            elif self.state_key == "masked_units":
                self.result["masked_units"] = unit_plan["mask"]
            # What the real run would signal: holders whose unit is stopped end with it.
            by_unit = set(unit_plan["stop"])
            signalled = [h for h in targets if not (h.get("system_service") and h.get("unit") in by_unit)]
            self.result["killed"] = [] if not self.params.get("kill", True) else [
                {"pid": h["pid"], "name": h["name"], "cmdline": h["cmdline"], "unit": h.get("unit"), "container": h.get("container"),
                 "gpu_indexes": h["gpu_indexes"], "signal": None, "exited_after_s": None}
                for h in signalled
            ]
            self.result["gpus"] = self.result["gpus_before"]
            self.result["holders"] = [_facts.public_holder(h) for h in holders]
            self.result["elapsed_s"] = round(self.system.now() - started, 3)
            certain = self.certain_failure(selected, dirty_before, holders, signalled, bool(unheld_at_look) and not hidden)
            if certain:
                self.result["elapsed_s"] = round(self.system.now() - started, 3)
                raise ReleaseError(certain, self._finish(gpus, holders))
            return self._finish(gpus, holders)

        if not to_do and gpus_clean:
            # Nothing to act on and the look already proves the GPUs free: that reading is the
            # verification (no second nvidia-smi call, no second scan on the fast path).
            self.result["released"] = True
            self.result["gpus"] = self.result["gpus_before"]
            self.result["holders"] = [_facts.public_holder(h) for h in holders]
            self.result["elapsed_s"] = round(self.system.now() - started, 3)
            return self._finish(gpus, holders)

        outside = {h["container"]: reason for h, reason in container_plan.outside}
        try:
            if container_plan:
                outside.update(self.act_containers(container_plan))
            if unit_plan["stop"] or unit_plan["disable"] or unit_plan["mask"]:
                self.act_units(unit_plan)
            if program_plan["stop"] or program_plan["disable"]:
                stopping = self.system.now()
                _supervisor.act(program_plan, self.params.get("kill_timeout"), self.result)
                self.result["timings"]["stop_s"] = round(self.result["timings"]["stop_s"] + self.system.now() - stopping, 3)
        finally:
            # Also when a step failed: what was already done must be put back by gpu_restore.
            self.write_record(unit_plan.get("before") or {}, holders)
        if container_plan.stop or unit_plan["stop"] or program_plan["stop"]:
            # Stopping a unit or a container ended its processes; see who is left before signalling anyone.
            holders = self.scan(gpus)
            targets, _protected = plan_targets(holders, selected, self.regexes, kill_spanning)
            targets = [t for t in targets if not _containers.pod_holders([t]) and t["pid"] not in {s["pid"] for s in mps_servers}]
        if targets and self.params.get("kill", True):
            minors = [g["minor_number"] for g in gpus if g["index"] in selected]
            self.watch = _settle.watch_for(targets, outside, self.system.systemctl, self.lineage, minors, self.system.proc)
            self.act_signals(targets)
        if mps_servers:
            # After the clients: the control daemon's quit waits for them.
            stopping = self.system.now()
            left = _mps.stop(self.system, mps_servers, self.params.get("kill_timeout"), self.result)
            self.result["timings"]["stop_s"] = round(self.result["timings"]["stop_s"] + self.system.now() - stopping, 3)
            if left:
                self.act_signals(left)
        self.result["changed"] = bool(
            self.result["stopped_units"] or self.result.get("disabled_units") or self.result.get("masked_units") or self.result["killed"]
            or self.result["stopped_containers"] or self.result["disabled_containers"]
            or self.result["stopped_programs"] or self.result["disabled_programs"] or self.result["stopped_mps_servers"]
        )

        verify_started = self.system.now()
        deadline = verify_started + self.params.get("wait_timeout")
        try:
            final_gpus, clean, early, footprint = self.verify(selected, deadline, acted=self.result["changed"],
                                                              unheld_at_look=unheld_at_look if not hidden else ())
        except NvidiaSmiError as exc:
            # After acting, a failure still reports what was stopped and signalled.
            self.result.update({key: value for key, value in exc.details().items() if key != "msg"})
            done = " (after acting: see stopped_units and killed)" if self.result["changed"] else ""
            raise ReleaseError(exc.msg + done, self._finish(gpus, holders))
        self.result["timings"]["wait_s"] = round(self.system.now() - verify_started, 3)
        came_back = None
        if clean and self.watch:
            settle_started = self.system.now()
            came_back = self.watch.settle(self.system, lambda: self._dirty_now(selected), self.settle_timeout())
            self.result["timings"]["settle_s"] = round(self.system.now() - settle_started, 3)
            if came_back:
                clean = False
                final_gpus = self._read_gpus()
        elif not clean and self.watch:
            # Dirty because a restarter started a killed holder again: name the restarter.
            again = self.watch.respawned()
            if again:
                came_back = self.watch.message([], [], 0.0, again, clean=False)
        final_holders = self.scan(final_gpus)
        footprint |= self.footprint(final_gpus, final_holders)
        if self.health is not None:
            final_gpus = self.health.carry(final_gpus, gpus)
        self.result["gpus"] = [_facts.public_gpu(g, limit, footprint) for g in final_gpus]
        self.result["holders"] = [_facts.public_holder(h) for h in final_holders]
        self.result["released"] = clean
        self.result["elapsed_s"] = round(self.system.now() - started, 3)
        if came_back:
            raise ReleaseError(came_back, self._finish(gpus, holders, final_gpus, final_holders))
        if not clean:
            # A GPU that reads only the cross-GPU footprint is clean in this result: not in its message.
            dirty = [g for g in final_gpus if g["index"] in selected and g["index"] not in footprint
                     and not _facts.gpu_is_clean(g, limit)]
            apps = self._apps(final_gpus)
            message = failure_message(
                dirty, final_holders, apps, self.result["timings"]["wait_s"], self.result["unkillable"], early == "protected", early
            )
            if hidden:
                message += ". Also: " + hidden
            raise ReleaseError(message, self._finish(gpus, holders, final_gpus, final_holders))
        return self._finish(gpus, holders, final_gpus, final_holders)

    def certain_failure(self, selected, dirty, holders, signalled, may_be_unheld):
        """Check mode: the message of a failure the real run cannot escape, or None. Waiting
        cannot free a GPU held only by protected processes, one held by processes that kill=false
        leaves running, or one that nothing holds (after the same grace as the real run: a
        process that just exited may still free its memory)."""
        if not dirty:
            return None
        apps = self.apps
        protected = [g for g in dirty if only_protected([g], holders, apps)]
        if protected:
            return failure_message(protected, holders, apps, 0.0, [], True, "protected")
        if not self.params.get("kill", True):
            left = [h for h in _facts.dirty_holders(holders, selected) if h["pid"] in {t["pid"] for t in signalled}]
            stuck = [g for g in dirty if any(g["index"] in h["gpu_indexes"] for h in left)]
            if stuck:
                return failure_message(stuck, holders, apps, 0.0, [], False, "not_killed")
        nobody = [g["index"] for g in unheld(dirty, holders, apps)] if may_be_unheld else []
        if nobody:
            gpus, clean, early, _footprint = self.verify(nobody, self.system.now() + NO_HOLDER_GRACE_S + RESCAN_S, acted=False)
            if not clean and early == "no_holder":
                still = [g for g in gpus if g["index"] in nobody and not _facts.gpu_is_clean(g, self.params.get("max_used_mib"))]
                return failure_message(still, self.scan(gpus), self.apps, 0.0, [], False, "no_holder")
        return None

    def write_record(self, unit_before, holders):
        """Add what this run stopped, disabled or masked to the restore record (_record)."""
        path = getattr(self.system, "record_path", None)
        if not path:
            return
        entries = _record.release_entries(self.result, unit_before, holders, _record.now_iso())
        try:
            record = _record.add(path, entries)
        except (_record.RecordError, OSError) as exc:
            self.result["warnings"].append(f"the restore record was not written, so gpu_restore cannot put back what this run changed: {exc}")
            return
        if record is not None:
            self.result["restore_record"] = {"path": path, "entries": len(record["entries"])}

    def _read_gpus(self):
        gpus = self.smi.query_gpus(GPU_FIELDS)
        # A GPU that drops out of nvidia-smi's answer later is never read as released either.
        check_against_driver(gpus, self.minors_by_bus)
        return _facts.with_minor_numbers(gpus, self.minors_by_bus)

    def _dirty_now(self, selected):
        """Selected GPUs dirty right now; a GPU that reads only the cross-GPU footprint is not."""
        limit = self.params.get("max_used_mib")
        gpus = self._read_gpus()
        dirty = [g for g in gpus if g["index"] in selected and not _facts.gpu_is_clean(g, limit)]
        if self.may_be_footprint(dirty):
            footprint = self.footprint(gpus, self.scan(gpus))
            dirty = [g for g in dirty if g["index"] not in footprint]
        return dirty

    def _apps(self, gpus):
        try:
            text = self.smi.run(self.smi.app_args())
            apps = parse_compute_apps(text)
        except NvidiaSmiError:  # best effort: the verdict comes from memory.used, not from this list
            return []
        return _facts.join_apps(apps, gpus, lambda pid: _facts.alive(pid, self.system.proc),
                                lambda pid: holders_mod.display_name(pid, self.system.proc))

    def _finish(self, gpus_before, holders_before, gpus_after=None, holders_after=None):
        self.result.update(_facts.health_summary(self.result["gpus"] or self.result["gpus_before"], self.health))
        changes_before, changes_after = plan_diff(self.result, self.check_mode)
        if self.check_mode:
            # Memory and holders are what a dry run cannot change: the plan is the difference.
            ending = {k["pid"] for k in self.result.get("killed") or []}
            stopping = set(self.result.get("stopped_units") or [])
            gpus_after, holders_after = gpus_before, [h for h in holders_before if h["pid"] not in ending
                                                      and not (h.get("system_service") and h.get("unit") in stopping)]
        self.result["diff"] = {
            "before": summarize_diff(gpus_before, holders_before, changes_before),
            "after": summarize_diff(gpus_after if gpus_after is not None else gpus_before,
                                    holders_after if holders_after is not None else holders_before, changes_after),
        }
        return self.result
