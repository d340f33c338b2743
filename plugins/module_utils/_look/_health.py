# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Is a GPU ready, not just free: nvidia-smi health readings and kernel-log Xids -> issues.

Pure functions turn records (from _nvidia_smi) and kernel log lines into plain sentences per
GPU, and say which checks could not run (`health_unchecked`). Thin readers run commands, each
bounded in time and size: the kernel log (journalctl, else dmesg), Fabric Manager's unit and
version where a GPU has a fabric, and, when asked, `dcgmi diag`.

The GPU's own reading is the authority (docs/docsite/rst/guide_health.rst): host context (a unit, a binary) explains
a bad reading and never turns a good one bad.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _readiness
from ansible_collections.zeromib.gpu.plugins.module_utils._look._check_names import CHECK_KEYS, CHECKS, SLOWDOWN_REASONS  # noqa: F401 - as callers know them
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import GPU_FIELDS, HEALTH_FIELDS, kill_group

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Gpu

    # {bus key: [{xid, time, message, action}]}: the Xids of the kernel log by the GPU they name.
    XidsByBus = t.Dict[t.Optional[str], t.List[t.Dict[str, t.Any]]]

# The fault set, derived from the immediate action: the application's own faults (RESTART_APP) and
# what NVIDIA says to ignore are not faults of the GPU; a reset, a reboot (RESTART_BM, RESTART_VM),
# a workflow (WORKFLOW_*) or support are.
NOT_GPU_FAULTS = frozenset(["RESTART_APP", "IGNORE"])
# Xid 45 is logged when a process with GPU work is killed (channels torn down on a normal exit or
# kill, public fleet reports): gpu_release's own SIGKILLs would make every later run fail. Its
# workflow judges it by the Xid it follows, which is judged itself. xid_fatal: [45] restores it.
NOT_FAULT_XIDS = frozenset([45])

# What the operator is told for each action (the catalog's bucket names, in words).
ACTION_WORDS = {
    "RESET_GPU": "reset the GPU",
    "RESTART_BM": "reboot the node",
    "RESTART_VM": "restart the VM",
    "WORKFLOW_XID_48": "reset the GPU; with Xid 63/64 drain and reset",
    "WORKFLOW_NVLINK_ERR": "check the NVLink, then reset the GPU or reboot",
    "WORKFLOW_NVLINK5_ERR": "decode it with NVIDIA's Xid 144-150 table",
    "CONTACT_SUPPORT": "contact NVIDIA support",
    "XID_154": "follow the GPU's recovery action",
}

_CHECKED_KEYS = frozenset(key for _name, keys in CHECK_KEYS for key in keys)
# The fabric check rests on the registration; fabric.health.summary is judged where the driver has it.
FABRIC_REGISTRATION_KEYS = ("fabric_state", "fabric_status")

# Values nvidia-smi prints in a field when the GPU is in trouble, not when it lacks the feature.
FAULT_TOKENS = ("[GPU requires reset]", "[Unknown Error]", "[GPU is lost]")

# nvidia-smi's name of each record key, for messages that name the field.
FIELD_OF = dict((key, field) for field, key, _kind in GPU_FIELDS + HEALTH_FIELDS)
FABRIC_MANAGER_TIMEOUT_S = 5.0
DCGM_DIAG_TIMEOUT_S = {1: 120.0, 2: 900.0, 3: 3600.0, 4: 7200.0}


class Checks:
    """What a healthy GPU must read. 0/None thresholds mean: the GPU's own max / no check."""

    def __init__(self, min_pcie_gen: int = 0, min_pcie_width: int = 0, require_persistence: bool = True,
                 expected_mig_mode: str | None = None, xid_window_hours: float = 24.0, xid_ignore: t.Iterable[int] | None = (),
                 xid_fatal: t.Iterable[int] | None = (), ready_profile: _readiness.Profile | None = None) -> None:
        # The training-ready profile (ready_profile): the default one unless given.
        self.ready_profile = ready_profile or _readiness.Profile()
        self.min_pcie_gen = min_pcie_gen or 0
        self.min_pcie_width = min_pcie_width or 0
        self.require_persistence = require_persistence
        self.expected_mig_mode = expected_mig_mode.lower() if expected_mig_mode else None
        self.xid_window_hours = xid_window_hours
        self.xid_ignore = frozenset(int(x) for x in xid_ignore or ())
        # In both lists: fatal (never a wrong "healthy").
        self.xid_fatal = frozenset(int(x) for x in xid_fatal or ())

    @classmethod
    def from_params(cls, params: t.Mapping[str, t.Any]) -> Checks | None:
        """The modules' options (a mapping, maybe partial) -> Checks; None when `health` is off (or absent)."""
        return cls.from_options(_options.LookOptions.of(params))

    @classmethod
    def from_options(cls, options: t.Any) -> Checks | None:
        """A record of the options (_options.LookOptions, or gpu_release's ReleaseOptions) -> Checks;
        None when `health` is off."""
        options = _options.LookOptions.of(options)
        if not options.health:
            return None
        return cls(
            options.min_pcie_gen or 0,
            options.min_pcie_width or 0,
            options.require_persistence,
            options.expected_mig_mode,
            24.0 if options.xid_window_hours is None else options.xid_window_hours,
            options.xid_ignore or (),
            options.xid_fatal or (),
            _readiness.Profile.from_params(options.ready_profile),
        )

    def xid_fault(self, number: int, recovery_action: str | None = None) -> bool:
        """Whether Xid `number` is a fault of the GPU (the catalog's action, then the overrides)."""
        if number in self.xid_fatal:
            return True
        if number in self.xid_ignore or number in NOT_FAULT_XIDS:
            return False
        action = _kernel_log.XID_CATALOG.get(number, (None, None))[0]
        if action == "XID_154":
            # The change it reports is read directly: history once the GPU says None again.
            return not (recovery_action and recovery_action.lower() == "none")
        return action is not None and action not in NOT_GPU_FAULTS


def _yes(value: t.Any) -> bool | None:
    """nvidia-smi's Yes/No and Active/Not Active -> bool; None for [N/A] and the like."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("yes", "active", "enabled", "true"):
        return True
    if text in ("no", "not active", "disabled", "false"):
        return False
    return None


def _plural(count: int, word: str) -> str:
    return "{:d} {}{}".format(count, word, "" if count == 1 else "s")


def readings(gpu: Gpu) -> dict[str, t.Any]:
    """The health readings of one --query-gpu record, typed ([N/A] stays None)."""
    return {
        "ecc_uncorrected_volatile": gpu.get("ecc_uncorrected_volatile"),
        "remapped_rows_pending": _yes(gpu.get("remapped_rows_pending")),
        "remapped_rows_failure": _yes(gpu.get("remapped_rows_failure")),
        "retired_pages_pending": _yes(gpu.get("retired_pages_pending")),
        "pcie_link_gen_current": gpu.get("pcie_link_gen_current"),
        "pcie_link_gen_max": gpu.get("pcie_link_gen_max"),
        "pcie_link_width_current": gpu.get("pcie_link_width_current"),
        "pcie_link_width_max": gpu.get("pcie_link_width_max"),
        "pstate": gpu.get("pstate"),
        "slowdown": [text for key, text in SLOWDOWN_REASONS if _yes(gpu.get(key))],
        "mig_mode_pending": gpu.get("mig_mode_pending"),
        "recovery_action": gpu.get("recovery_action"),
        "fabric_state": gpu.get("fabric_state"),
        "fabric_status": gpu.get("fabric_status"),
        "fabric_health_summary": gpu.get("fabric_health_summary"),
    }


def fault_tokens(gpu: Gpu) -> dict[str, str]:
    """{record key: token} of the health readings that read [GPU requires reset] or the like."""
    unavailable = gpu.get("_unavailable") or {}
    return dict((key, token) for key, token in unavailable.items() if key in _CHECKED_KEYS and token in FAULT_TOKENS)


def _word(value: t.Any) -> str | None:
    """A fabric reading in lower case; None where the GPU has none ([N/A], N/A, Not Supported)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    return None if text in ("n/a", "not supported", "") else text


def has_fabric(gpu: Gpu) -> bool:
    """A GPU registered (or to be registered) with an NVSwitch fabric; N/A is no fabric."""
    return _word(gpu.get("fabric_state")) is not None


def fabric_registered(gpu: Gpu) -> bool:
    """The GPU says its fabric registration is done: state Completed, status Success (or none)."""
    return _word(gpu.get("fabric_state")) == "completed" and _word(gpu.get("fabric_status")) in (None, "success")


def fabric_issues(gpu: Gpu, fabric_manager: dict[str, t.Any] | None = None) -> list[str]:
    """The GPU's own verdict on its fabric: registration Completed with status Success, and a
    fabric.health.summary of Healthy where the driver has one (N/A there is no reading). What was
    found of Fabric Manager (`fabric_manager`) is added to a fault, to say where to look."""
    if not has_fabric(gpu):
        return []
    found = "" if fabric_manager is None else "; on this host: " + fabric_manager_found(fabric_manager)
    state, status, summary = gpu.get("fabric_state"), gpu.get("fabric_status"), gpu.get("fabric_health_summary")
    if _word(state) != "completed":
        return [f"NVSwitch fabric registration is {str(state).strip()}, expected Completed: NCCL jobs fail (CUDA error 802, system not yet "
                f"initialized) until Fabric Manager completes it{found}"]
    if status is not None and _word(status) != "success":
        return [f"NVSwitch fabric registration failed ({str(status).strip()}){found}"]
    if _word(summary) not in (None, "healthy"):
        return [f"NVSwitch fabric health is {str(summary).strip()} (fabric.health.summary), expected Healthy: see the Fabric section of "
                f"nvidia-smi -q{found}"]
    return []


def gpu_issues(gpu: Gpu, checks: Checks, xids: t.Iterable[dict[str, t.Any]] = (), host_issues: t.Iterable[str] = (),
               fabric_manager: dict[str, t.Any] | None = None) -> list[str]:
    """Plain sentences, one per problem, for one GPU record ([N/A] is never a problem; a field
    that reads [GPU requires reset] or [Unknown Error] is). `host_issues`: the node's faults that
    concern this GPU (fabric_manager_issues); `fabric_manager`: what was found of it, said in a
    fabric fault."""
    r = readings(gpu)
    issues = _hardware_issues(gpu, r, checks) + _mode_issues(gpu, r, checks)
    issues.extend(fabric_issues(gpu, fabric_manager))
    issues.extend(host_issues)
    issues.extend(xid_issues(xids, checks, r["recovery_action"]))
    issues.extend(_readiness.issues(gpu, checks.ready_profile))
    return issues


def _hardware_issues(gpu: Gpu, r: dict[str, t.Any], checks: Checks) -> list[str]:
    """Faults of the GPU itself: fault tokens, ECC, row remapping, page retirement, the PCIe
    link, lowered clocks (`r`: its readings())."""
    issues = []
    for key, token in sorted(fault_tokens(gpu).items()):
        advice = ": reset the GPU (or reboot)" if token == "[GPU requires reset]" else ""
        issues.append(f"{FIELD_OF.get(key, key)} reads {token}{advice}")
    ecc = r["ecc_uncorrected_volatile"]
    if ecc:
        issues.append("{} since the driver loaded".format(_plural(ecc, "uncorrectable ECC error")))
    if r["remapped_rows_failure"]:
        issues.append("row remapping failed: the GPU has run out of spare rows and needs replacing")
    if r["remapped_rows_pending"]:
        issues.append("a row remap is pending: reset the GPU (or reboot) to apply it")
    if r["retired_pages_pending"]:
        issues.append("a page retirement is pending: reset the GPU (or reboot) to apply it")
    width, width_max = r["pcie_link_width_current"], r["pcie_link_width_max"]
    want_width = checks.min_pcie_width or width_max
    if width is not None and want_width and width < want_width:
        issues.append(f"PCIe link runs at x{width:d}, expected x{want_width:d}")
    # An idle GPU in a power-saving P-state trains its link down (an RTX 4080 at P8 reads Gen1
    # of 4); data-center GPUs idle at P0 at their max (H200, H100, L40S captures): compare the
    # generation only at P0.
    gen, gen_max = r["pcie_link_gen_current"], r["pcie_link_gen_max"]
    want_gen = checks.min_pcie_gen or gen_max
    if gen is not None and want_gen and gen < want_gen and (r["pstate"] or "").upper() == "P0":
        issues.append(f"PCIe link runs at Gen{gen:d}, expected Gen{want_gen:d}")
    for text in r["slowdown"]:
        issues.append(f"clocks lowered by {text}")
    return issues


def _mode_issues(gpu: Gpu, r: dict[str, t.Any], checks: Checks) -> list[str]:
    """Settings the GPU must have: persistence mode, the MIG mode (and none pending), no
    recovery action asked for."""
    issues = []
    persistence = _yes(gpu.get("persistence_mode"))
    if checks.require_persistence and persistence is False:
        issues.append("persistence mode is off")
    mig = gpu.get("mig_mode")
    if checks.expected_mig_mode and mig is not None and str(mig).lower() != checks.expected_mig_mode:
        issues.append(f"MIG mode is {mig}, expected {checks.expected_mig_mode.capitalize()}")
    if checks.expected_mig_mode == "enabled" and mig is None and "mig_mode" not in fault_tokens(gpu) and \
            "mig.mode.current" not in (gpu.get("_rejected") or ()):
        issues.append("MIG mode is not supported, expected Enabled")
    pending = r["mig_mode_pending"]
    if mig is not None and pending is not None and str(pending).lower() != str(mig).lower():
        issues.append(f"a MIG mode change to {pending} is pending: reset the GPU to apply it")
    action = r["recovery_action"]
    if action is not None and str(action).strip().lower() != "none":
        issues.append(f"the driver asks for a recovery action: {action} (gpu_recovery_action; NVML: None means no action needed)")
    return issues


def xid_issues(xids: t.Iterable[dict[str, t.Any]], checks: Checks, recovery_action: str | None = None) -> list[str]:
    """One sentence per Xid number that is a fault (NVIDIA's catalog, then xid_ignore/xid_fatal)."""
    faults: dict[int, list[dict[str, t.Any]]] = {}
    for xid in xids:
        if checks.xid_fault(xid["xid"], recovery_action):
            faults.setdefault(xid["xid"], []).append(xid)
    issues = []
    for number in sorted(faults):
        seen = faults[number]
        action, text = _kernel_log.XID_CATALOG.get(number, (None, "in xid_fatal"))
        when = seen[-1].get("time")
        issues.append("Xid {:d} ({}) in the kernel log {}{}{}".format(
            number, text, ("at " + when if _kernel_log.ISO_TIME.match(when or "") else when) if when else "recently",
            "" if len(seen) == 1 else f" ({len(seen):d} times)",
            f"; NVIDIA's Xid catalog: {action} ({ACTION_WORDS.get(action, action)})" if action else "; listed in xid_fatal"))
    return issues


def _missing(gpu: Gpu, keys: t.Iterable[str]) -> list[str]:
    """The keys that read no value (rejected by the driver or a bracketed token), a fault token aside."""
    faulty = fault_tokens(gpu)
    return [key for key in keys if gpu.get(key) is None and key not in faulty]


def _rejected_fields(gpu: Gpu, keys: t.Iterable[str]) -> list[str]:
    rejected = set(gpu.get("_rejected") or ())
    return [FIELD_OF[key] for key in keys if FIELD_OF.get(key) in rejected]


def unchecked_checks(gpu: Gpu, checks: Checks, kernel_log_error: str | None = None) -> list[tuple[str, str]]:
    """[(check, why)] of the checks that could not run on this GPU, in CHECKS order.

    A check whose reading is [N/A] on every GPU of its kind is still unchecked (ECC off, no
    recovery action); what a GPU lacks by design is not: MIG and the fabric read N/A on GPUs
    without them (unchecked only when the driver does not know the field), and row remapping
    (Ampere+) and page retirement (before Ampere) stand in for each other. The fabric is checked
    whenever the GPU answered its registration fields: Fabric Manager is context, not a reading."""
    found = []
    keys = dict(CHECK_KEYS)

    def why(check_keys: t.Iterable[str]) -> str:
        rejected = _rejected_fields(gpu, check_keys)
        if rejected:
            return "the driver does not know {}".format(", ".join(rejected))
        tokens = gpu.get("_unavailable") or {}
        missing = _missing(gpu, check_keys)
        fields = ", ".join(FIELD_OF.get(k, k) for k in missing)
        return "{} reads {}".format(fields, "/".join(sorted(set(tokens.get(k, "no value") for k in missing))))

    for name in ("ecc", "pcie", "clocks"):
        if _missing(gpu, keys[name]):
            found.append((name, why(keys[name])))
    remap_missing = len(_missing(gpu, keys["row_remap"])) == len(keys["row_remap"])
    retired_missing = bool(_missing(gpu, keys["retired_pages"]))
    if remap_missing and retired_missing:
        found.append(("row_remap", why(keys["row_remap"])))
        found.append(("retired_pages", why(keys["retired_pages"])))
    if checks.require_persistence and _missing(gpu, keys["persistence"]):
        found.append(("persistence", why(keys["persistence"])))
    if _rejected_fields(gpu, keys["mig"]):
        found.append(("mig", why(keys["mig"])))
    if _missing(gpu, keys["recovery_action"]):
        found.append(("recovery_action", why(keys["recovery_action"])))
    if _rejected_fields(gpu, FABRIC_REGISTRATION_KEYS):
        found.append(("fabric", why(FABRIC_REGISTRATION_KEYS)))
    if checks.xid_window_hours and kernel_log_error:
        found.append(("xid", f"recent Xid errors not checked: {kernel_log_error}"))
    found.extend(_readiness.unchecked(gpu, checks.ready_profile, FIELD_OF))
    order = dict((name, i) for i, name in enumerate(CHECKS))
    return sorted(found, key=lambda item: order[item[0]])


_FM_VERSION = re.compile(r"Fabric Manager version is\s*:?\s*(?P<version>\d[\w.-]*)")


def parse_fabric_manager_version(text: str) -> str | None:
    """`nv-fabricmanager --version` ('Fabric Manager version is : 580.159.04') -> '580.159.04'."""
    match = _FM_VERSION.search(text or "")
    return match.group("version") if match else None


def _run_bounded(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """(rc, stdout + stderr) of a short command; rc None when it ran past `timeout` (killed)."""
    process = _kernel_log.spawn(argv, stderr=subprocess.STDOUT)
    try:
        out, _err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        return None, ""
    return process.returncode, out.decode("utf-8", "replace")


# Where the NVIDIA GPU Operator's driver container shows its root on the host: Fabric Manager
# runs inside it there, with no unit of the host's systemd (GPU Operator's driver container).
GPU_OPERATOR_DRIVER_ROOT = "/run/nvidia/driver"
FABRIC_MANAGER_UNIT = "nvidia-fabricmanager"
NO_FABRIC_MANAGER = ("no Fabric Manager on this host: it may run in a container (GPU Operator) or not be needed (VM, GB200 "
                     "compute tray)")


def parse_unit_state(text: str) -> dict[str, str | None] | None:
    """`systemctl show -p LoadState,ActiveState,SubState UNIT` -> {load_state, active_state,
    sub_state}; None when it printed no LoadState (systemd did not answer). A unit that does not
    exist reads LoadState=not-found (rc 0), where `is-active` would say `inactive`."""
    props = dict(line.strip().partition("=")[::2] for line in (text or "").splitlines() if "=" in line)
    if not props.get("LoadState"):
        return None
    return {"load_state": props["LoadState"], "active_state": props.get("ActiveState") or None, "sub_state": props.get("SubState") or None}


def _first_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return ": " + lines[0] if lines else ""


def read_fabric_manager(timeout: float = FABRIC_MANAGER_TIMEOUT_S, search_path: str | None = None,
                        driver_root: str = GPU_OPERATOR_DRIVER_ROOT) -> dict[str, t.Any]:
    """Where a GPU has a fabric: what this host has of Fabric Manager, as context for the GPU's
    own reading. {unit ({load_state, active_state, sub_state} of nvidia-fabricmanager, None when
    systemd could not be asked), unit_error (why), binary (nv-fabricmanager on PATH or the system
    directories, else under the GPU Operator's driver root), version (`--version` of a host
    binary; the driver container's is not run from the host), version_error, note}. Read-only,
    each command bounded to `timeout`."""
    record: dict[str, t.Any] = {"unit": None, "unit_error": None, "binary": None, "version": None, "version_error": None, "note": None}
    systemctl = _kernel_log.which("systemctl", search_path)
    if not systemctl:
        record["unit_error"] = "systemctl not found"
    else:
        try:
            rc, out = _run_bounded([systemctl, "show", "-p", "LoadState,ActiveState,SubState", FABRIC_MANAGER_UNIT], timeout)
        except OSError as exc:
            rc, out = 1, str(exc)
        record["unit"] = parse_unit_state(out) if rc == 0 else None
        if rc is None:
            record["unit_error"] = f"systemctl show took longer than {timeout:g} s"
        elif record["unit"] is None:
            # No systemd as PID 1 (a container, some CI hosts): "System has not been booted with systemd".
            record["unit_error"] = f"systemctl show {FABRIC_MANAGER_UNIT} failed (rc {rc}){_first_line(out)}"
    binary = _kernel_log.which("nv-fabricmanager", search_path)
    if binary:
        record["binary"] = binary
        try:
            rc, out = _run_bounded([binary, "--version"], timeout)
        except OSError as exc:
            rc, out = 1, str(exc)
        record["version"] = parse_fabric_manager_version(out) if rc == 0 else None
        if record["version"] is None:
            record["version_error"] = f"nv-fabricmanager --version printed no version (rc {rc}){_first_line(out)}"
    else:
        in_root = [os.path.join(driver_root, d.lstrip("/"), "nv-fabricmanager") for d in ("/usr/bin", "/usr/sbin")]
        record["binary"] = next((path for path in in_root if os.path.isfile(path) and os.access(path, os.X_OK)), None)
    loaded = (record["unit"] or {}).get("load_state") == "loaded"
    if not loaded and record["binary"] is None:
        record["note"] = NO_FABRIC_MANAGER
    elif not loaded and not binary:
        record["note"] = f"Fabric Manager of the GPU Operator's driver container ({driver_root}): no unit of this host"
    return record


def fabric_manager_found(fabric_manager: dict[str, t.Any]) -> str:
    """What was found of Fabric Manager, in one phrase for a fabric fault."""
    unit, binary = fabric_manager.get("unit"), fabric_manager.get("binary")
    if unit is None:
        said = "unit {} not asked ({})".format(FABRIC_MANAGER_UNIT, fabric_manager.get("unit_error") or "no systemd")
    elif unit.get("load_state") == "not-found":
        said = f"no unit {FABRIC_MANAGER_UNIT}"
    else:
        said = "unit {} {}, {} ({})".format(FABRIC_MANAGER_UNIT, unit.get("load_state"), unit.get("active_state"), unit.get("sub_state"))
    if binary:
        version = fabric_manager.get("version")
        said += ", nv-fabricmanager {}at {}".format(version + " " if version else "", binary)
    else:
        said += ", no nv-fabricmanager"
    return said + ("; " + fabric_manager["note"] if fabric_manager.get("note") else "")


def fabric_manager_issues(fabric_manager: dict[str, t.Any] | None, driver_version: str | None, gpu: Gpu) -> list[str]:
    """The faults of Fabric Manager that concern this GPU: only where certain, and never where
    the GPU itself reads its fabric registered (Completed, Success): the GPU is the authority,
    the host only explains a bad reading. Its unit is loaded and failed or inactive while the
    GPU's fabric is not registered; or it is loaded and active with a version other than the
    driver's (Fabric Manager refuses another driver's version) while the fabric is not
    registered. A version seen on the host beside a registered fabric (a binary on PATH other
    than the one running, the GPU Operator's) is recorded in health.fabric_manager, no fault.
    No unit, no binary, no systemd: not a fault (a VM, a GB200 compute tray, the GPU Operator)."""
    if not fabric_manager or not has_fabric(gpu):
        return []
    unit = fabric_manager.get("unit") or {}
    if unit.get("load_state") != "loaded":
        return []
    active, version = unit.get("active_state"), fabric_manager.get("version")
    if active in ("failed", "inactive") and not fabric_registered(gpu):
        return [f"nvidia-fabricmanager is {active}: NVSwitch jobs fail (CUDA error 802) until it runs"]
    if active == "active" and version and driver_version and version != driver_version and not fabric_registered(gpu):
        return [f"nv-fabricmanager is version {version}, the driver {driver_version}: Fabric Manager must match the driver exactly"]
    return []


HEALTH_KEYS = ("healthy", "health_checked", "health_unchecked", "health_issues", "health")


class Health:
    """One look's health context: the checks, the Xids read, the fields the driver rejected,
    Fabric Manager where the GPUs sit on an NVSwitch fabric."""

    def __init__(self, checks: Checks, xids_by_bus: XidsByBus | None = None, rejected: t.Iterable[str] = (),
                 kernel_log: _kernel_log.KernelLog | None = None, history_by_bus: XidsByBus | None = None, fabric_manager: dict[str, t.Any] | None = None,
                 driver_version: str | None = None) -> None:
        self.checks = checks
        self.xids_by_bus = xids_by_bus or {}
        self.history_by_bus = history_by_bus or {}
        self.rejected = set(rejected)
        self.kernel_log = kernel_log
        self.fabric_manager = fabric_manager
        self.driver_version = driver_version
        # The node's own faults (Fabric Manager), said once by host_verdict: set by annotate().
        self.host_issues: list[str] = []

    def annotate(self, gpus: list[Gpu]) -> list[Gpu]:
        """Copies of the records with healthy, health_issues, health_checked, health_unchecked and health."""
        error = self.kernel_log.error if self.kernel_log is not None else None
        result = []
        for gpu in gpus:
            record = gpu.copy()
            record["_rejected"] = sorted(set(self.rejected) | set(gpu.get("_rejected") or ()))
            xids = _kernel_log.xids_of(gpu, self.xids_by_bus)
            node = fabric_manager_issues(self.fabric_manager, self.driver_version, record)
            self.host_issues.extend(issue for issue in node if issue not in self.host_issues)
            record["health_issues"] = gpu_issues(record, self.checks, xids, node, self.fabric_manager)
            missing = unchecked_checks(record, self.checks, error)
            record["healthy"] = not record["health_issues"]
            record["health_unchecked"] = [name for name, _why in missing]
            record["health_checked"] = not missing
            details = readings(gpu)
            details["xids"] = [dict(x, fault=self.checks.xid_fault(x["xid"], gpu.get("recovery_action"))) for x in xids]
            details["xids_before_driver_load"] = _kernel_log.xids_of(gpu, self.history_by_bus)
            details["unchecked"] = ["{}: {}".format(*item) for item in missing]
            details["ready"] = dict(_readiness.readings(gpu), profile=self.checks.ready_profile.record())
            record["health"] = details
            result.append(record)
        return result

    @staticmethod
    def carry(gpus: list[Gpu], looked: list[Gpu]) -> list[Gpu]:
        """Later memory readings of the same GPUs (gpu_release's polls ask no health field)
        keep the look's verdict, matched by UUID."""
        by_uuid = dict((gpu.get("uuid"), gpu) for gpu in looked)
        result = []
        for gpu in gpus:
            record = t.cast("dict[str, t.Any]", dict(gpu))
            before = t.cast("dict[str, t.Any]", by_uuid.get(gpu.get("uuid"), {}))
            for key in HEALTH_KEYS:
                record[key] = before.get(key)
            result.append(t.cast("Gpu", record))
        return result

    def host_record(self, dcgm: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        log = self.kernel_log
        return {
            "kernel_log": {
                "source": log.source if log else None,
                "error": log.error if log else None,
                "fallback": log.fallback if log else None,
                "driver_loaded": log.driver_loaded if log else None,
                "incremental": log.incremental if log else False,
                "window_hours": self.checks.xid_window_hours,
                "elapsed_s": log.elapsed_s if log else 0.0,
            },
            "fabric_manager": self.fabric_manager,
            "dcgm_diag": dcgm,
        }


def host_verdict(gpus: list[Gpu], dcgm: dict[str, t.Any] | None = None, host_issues: t.Iterable[str] = ()) -> tuple[bool, list[str]]:
    """(healthy, issues) of a host: every GPU's issues as 'GPU i (bus): issue', the node's own
    (Fabric Manager, once, not per GPU), and DCGM's."""
    issues = []
    node = [issue for issue in host_issues if any(issue in (gpu.get("health_issues") or []) for gpu in gpus)]
    for gpu in gpus:
        for issue in gpu.get("health_issues") or []:
            if issue not in node:
                issues.append("GPU {} ({}): {}".format(gpu.get("index"), gpu.get("pci_bus_id"), issue))
    issues.extend(node)
    if dcgm and dcgm.get("passed") is False:
        issues.append("dcgmi diag -r {} failed: {}".format(dcgm.get("level"), dcgm.get("summary")))
    return not issues, issues


# --- DCGM, optional

_DCGM_FAIL = re.compile(r"^\|\s*(?P<test>[^|]*?)\s*\|\s*Fail\b(?P<rest>.*)$", re.IGNORECASE)


def parse_dcgm_diag(rc: int, text: str) -> tuple[bool, str]:
    """`dcgmi diag -r N` output -> (passed, one-line summary). A Fail row or a non-zero rc fails."""
    failed = []
    for line in text.splitlines():
        match = _DCGM_FAIL.match(line.strip())
        if match:
            failed.append(match.group("test"))
    if failed:
        return False, "failed: " + ", ".join(failed)
    if rc != 0:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return False, "rc {}: {}".format(rc, lines[-1] if lines else "no output")
    return True, "passed"


def dcgm_diag(level: int, which: t.Callable[[str], str | None], run_timeout: float | None = None) -> dict[str, t.Any] | None:
    """Run `dcgmi diag -r LEVEL` when dcgmi is installed. `which(name)` finds a binary or None.
    None when level is 0; {"ran": False, "summary": "dcgmi not installed"} without DCGM."""
    if not level:
        return None
    record: dict[str, t.Any] = {"level": level, "ran": False, "passed": None, "summary": None, "elapsed_s": 0.0}
    path = which("dcgmi")
    if not path:
        record["summary"] = "dcgmi not installed"
        return record
    timeout = run_timeout or DCGM_DIAG_TIMEOUT_S.get(level, 3600.0)
    began = time.monotonic()
    try:
        process = subprocess.Popen([path, "diag", "-r", str(level)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=_commands.c_locale_env())
        stdout, _stderr = process.communicate(timeout=timeout)
    except OSError as exc:
        record["summary"] = f"cannot run dcgmi: {exc}"
        return record
    except subprocess.TimeoutExpired:
        kill_group(process)
        record.update(ran=True, passed=False, summary=f"timed out after {timeout:g} s")
        return record
    passed, summary = parse_dcgm_diag(process.returncode, stdout.decode("utf-8", "replace"))
    record.update(ran=True, passed=passed, summary=summary, elapsed_s=round(time.monotonic() - began, 3))
    return record
