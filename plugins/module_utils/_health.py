# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Is a GPU ready, not just free: nvidia-smi health readings and kernel-log Xids -> issues.

Pure functions turn records (from _nvidia_smi) and kernel log lines into plain sentences per
GPU. Two thin readers run commands, each bounded in time and size: the kernel log
(journalctl, else dmesg) and, when asked, `dcgmi diag`.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

from ansible_collections.zeromib.gpu.plugins.module_utils._nvidia_smi import kill_group, normalize_bus_id

try:
    from typing import Any, Dict, List, Optional, Tuple  # noqa: F401 (type comments)
except ImportError:  # pragma: no cover
    pass

# Xids that mean the GPU (or its memory, NVLink or firmware) needs a reset, a reboot or a
# replacement before a job can trust it, per NVIDIA's Xid catalog and the fleet checks that
# act on them (DCGM health watches, GCM, NHC). Application faults (13, 31, 43, 45) are not.
CRITICAL_XIDS = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping event",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

# The reasons nvidia-smi gives for lowered clocks that point at the hardware or its cooling.
# (sw_power_cap, gpu_idle and applications_clocks_setting are normal operation.)
SLOWDOWN_REASONS = (
    ("slowdown_hw", "hardware slowdown"),
    ("slowdown_hw_thermal", "hardware thermal slowdown"),
    ("slowdown_hw_power_brake", "hardware power brake slowdown"),
    ("slowdown_sw_thermal", "software thermal slowdown"),
)

# "NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
# Older drivers print the bus without "PCI:", some with the function.
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\): (?P<xid>\d+)(?:, (?P<rest>.*))?"
)
_DMESG_TIME = re.compile(r"^\[\s*(\d+(?:\.\d+)?)\]")
_ISO_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S*)")

# Bounds of the kernel log read: the last 24 h of kernel messages is usually well under 1 MiB.
KERNEL_LOG_MAX_BYTES = 32 * 1024 * 1024
KERNEL_LOG_TIMEOUT_S = 5.0
DCGM_DIAG_TIMEOUT_S = {1: 120.0, 2: 900.0, 3: 3600.0, 4: 7200.0}


class Checks(object):
    """What a healthy GPU must read. 0/None thresholds mean: the GPU's own max / no check."""

    def __init__(self, min_pcie_gen=0, min_pcie_width=0, require_persistence=True, expected_mig_mode=None, xid_window_hours=24.0):
        # type: (int, int, bool, Optional[str], float) -> None
        self.min_pcie_gen = min_pcie_gen or 0
        self.min_pcie_width = min_pcie_width or 0
        self.require_persistence = require_persistence
        self.expected_mig_mode = expected_mig_mode.lower() if expected_mig_mode else None
        self.xid_window_hours = xid_window_hours

    @classmethod
    def from_params(cls, params):
        # type: (Dict[str, Any]) -> Optional[Checks]
        """The modules' options -> Checks; None when `health` is off (or absent)."""
        if not params.get("health"):
            return None
        return cls(
            params.get("min_pcie_gen") or 0,
            params.get("min_pcie_width") or 0,
            params.get("require_persistence", True),
            params.get("expected_mig_mode"),
            24.0 if params.get("xid_window_hours") is None else params["xid_window_hours"],
        )


def _yes(value):
    # type: (Any) -> Optional[bool]
    """nvidia-smi's Yes/No and Active/Not Active -> bool; None for [N/A] and the like."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("yes", "active", "enabled", "true"):
        return True
    if text in ("no", "not active", "disabled", "false"):
        return False
    return None


def _plural(count, word):
    # type: (int, str) -> str
    return "%d %s%s" % (count, word, "" if count == 1 else "s")


def readings(gpu):
    # type: (Dict[str, Any]) -> Dict[str, Any]
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
    }


def gpu_issues(gpu, checks, xids=()):
    # type: (Dict[str, Any], Checks, Any) -> List[str]
    """Plain sentences, one per problem, for one GPU record ([N/A] is never a problem)."""
    r = readings(gpu)
    issues = []
    ecc = r["ecc_uncorrected_volatile"]
    if ecc:
        issues.append("%s since the driver loaded" % _plural(ecc, "uncorrectable ECC error"))
    if r["remapped_rows_failure"]:
        issues.append("row remapping failed: the GPU has run out of spare rows and needs replacing")
    if r["remapped_rows_pending"]:
        issues.append("a row remap is pending: reset the GPU (or reboot) to apply it")
    if r["retired_pages_pending"]:
        issues.append("a page retirement is pending: reset the GPU (or reboot) to apply it")
    width, width_max = r["pcie_link_width_current"], r["pcie_link_width_max"]
    want_width = checks.min_pcie_width or width_max
    if width is not None and want_width and width < want_width:
        issues.append("PCIe link runs at x%d, expected x%d" % (width, want_width))
    # An idle GPU in a power-saving P-state trains its link down (an RTX 4080 at P8 reads Gen1
    # of 4); data-center GPUs idle at P0 at their max (H200, H100, L40S captures): compare the
    # generation only at P0.
    gen, gen_max = r["pcie_link_gen_current"], r["pcie_link_gen_max"]
    want_gen = checks.min_pcie_gen or gen_max
    if gen is not None and want_gen and gen < want_gen and (r["pstate"] or "").upper() == "P0":
        issues.append("PCIe link runs at Gen%d, expected Gen%d" % (gen, want_gen))
    for text in r["slowdown"]:
        issues.append("clocks lowered by %s" % text)
    persistence = _yes(gpu.get("persistence_mode"))
    if checks.require_persistence and persistence is False:
        issues.append("persistence mode is off")
    mig = gpu.get("mig_mode")
    if checks.expected_mig_mode and mig is not None and str(mig).lower() != checks.expected_mig_mode:
        issues.append("MIG mode is %s, expected %s" % (mig, checks.expected_mig_mode.capitalize()))
    if checks.expected_mig_mode == "enabled" and mig is None:
        issues.append("MIG mode is not supported, expected Enabled")
    critical = {}
    for xid in xids:
        if xid["xid"] in CRITICAL_XIDS:
            critical.setdefault(xid["xid"], []).append(xid)
    for number in sorted(critical):
        seen = critical[number]
        issues.append("Xid %d (%s) in the kernel log %s%s" % (
            number, CRITICAL_XIDS[number], "at %s" % seen[-1]["time"] if seen[-1].get("time") else "recently",
            "" if len(seen) == 1 else " (%d times)" % len(seen)))
    return issues


def unchecked(gpu, rejected, kernel_log_error, checks):
    # type: (Dict[str, Any], Any, Optional[str], Checks) -> List[str]
    """What could not be checked on this GPU: fields the driver rejected, an unread kernel log."""
    notes = []
    if rejected:
        notes.append("the driver does not know %s: not checked" % ", ".join(sorted(rejected)))
    if checks.xid_window_hours and kernel_log_error:
        notes.append("recent Xid errors not checked: %s" % kernel_log_error)
    return notes


def bus_key(bus_id):
    # type: (Optional[str]) -> Optional[str]
    """Domain:bus:device of a PCI address, the part Xid lines carry ('0000:18:00')."""
    if not bus_id:
        return None
    normalized = normalize_bus_id(bus_id if "." in bus_id else bus_id + ".0")
    return normalized.rsplit(".", 1)[0] if normalized else None


def parse_xids(lines, uptime_s=None, window_s=None):
    # type: (Any, Optional[float], Optional[float]) -> Dict[str, List[Dict[str, Any]]]
    """Kernel log lines (journalctl short-iso or dmesg) -> {bus key: [{xid, time, message}]}.

    dmesg lines carry seconds since boot: with `uptime_s` and `window_s` the older ones are
    dropped (journalctl is asked for the window itself)."""
    found = {}  # type: Dict[str, List[Dict[str, Any]]]
    for line in lines:
        match = _XID.search(line)
        if not match:
            continue
        when = None
        stamp = _DMESG_TIME.match(line)
        if stamp:
            since_boot = float(stamp.group(1))
            if uptime_s is not None and window_s and uptime_s - since_boot > window_s:
                continue
            when = "%.0f s ago" % (uptime_s - since_boot) if uptime_s is not None else "%s s after boot" % stamp.group(1)
        else:
            iso = _ISO_TIME.match(line)
            when = iso.group(1) if iso else None
        found.setdefault(bus_key(match.group("bus")), []).append({
            "xid": int(match.group("xid")),
            "time": when,
            "message": line[match.start():].strip(),
        })
    return found


def xids_of(gpu, xids_by_bus):
    # type: (Dict[str, Any], Dict[str, List[Dict[str, Any]]]) -> List[Dict[str, Any]]
    return list(xids_by_bus.get(bus_key(gpu.get("pci_bus_id")), []))


class KernelLog(object):
    """The one reader of the kernel log: journalctl -k for the window, else dmesg. Read-only,
    bounded in time and bytes; started before nvidia-smi runs and collected after it."""

    def __init__(self, window_hours, timeout=KERNEL_LOG_TIMEOUT_S, max_bytes=KERNEL_LOG_MAX_BYTES, search_path=None):
        # type: (float, float, int, Optional[str]) -> None
        self.window_hours = window_hours
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.search_path = search_path
        self.source = None  # type: Optional[str]
        self.error = None  # type: Optional[str]
        self.elapsed_s = 0.0
        self._started = None  # type: Any
        self._queue = []  # type: List[Tuple[str, List[str]]]
        self._began = time.monotonic()

    def _which(self, name):
        # type: (str) -> Optional[str]
        path = self.search_path if self.search_path is not None else os.environ.get("PATH", "")
        for directory in [d for d in path.split(os.pathsep) if d] + ["/usr/bin", "/bin", "/usr/sbin", "/sbin"]:
            candidate = os.path.join(directory, name)
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return candidate
        return None

    def _commands(self):
        # type: () -> List[Tuple[str, List[str]]]
        commands = []
        journalctl = self._which("journalctl")
        if journalctl:
            commands.append(("journalctl", [journalctl, "-k", "--since", "-%dmin" % max(1, int(self.window_hours * 60)),
                                            "-o", "short-iso", "-q", "--no-pager"]))
        dmesg = self._which("dmesg")
        if dmesg:
            commands.append(("dmesg", [dmesg]))
        return commands

    @staticmethod
    def _spawn(argv):
        # type: (List[str]) -> Any
        env = dict(os.environ, LC_ALL="C", LANG="C", SYSTEMD_PAGER="", SYSTEMD_COLORS="0")
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)

    def start(self):
        # type: () -> None
        if not self.window_hours:
            return
        self._began = time.monotonic()
        self._queue = self._commands()
        self._next()

    def _next(self):
        # type: () -> None
        self._started = None
        while self._queue:
            source, argv = self._queue.pop(0)
            try:
                self._started = (source, self._spawn(argv))
                return
            except OSError as exc:
                self.error = "%s: %s" % (source, exc)

    def abandon(self):
        # type: () -> None
        """nvidia-smi failed: the Xids are not wanted, do not leave the reader behind."""
        if self._started is not None:
            kill_group(self._started[1])
            self._started = None
        self._queue = []

    def lines(self):
        # type: () -> List[str]
        """The kernel log lines that mention an Xid; [] (with .error set) when none was readable."""
        if not self.window_hours:
            return []
        if not self._queue and self._started is None and self.error is None:
            self.error = "neither journalctl nor dmesg found"
        found = []  # type: List[str]
        while self._started is not None:
            source, process = self._started
            deadline = self._began + self.timeout
            try:
                stdout, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(process)
                self.error = "%s took longer than %g s" % (source, self.timeout)
                break
            text = stdout[-self.max_bytes:].decode("utf-8", "replace")
            said = stderr.decode("utf-8", "replace").strip().splitlines()
            if process.returncode == 0:
                self.source, self.error = source, None
                found = [line for line in text.splitlines() if "Xid" in line]
                break
            self.error = "%s failed (rc %s)%s" % (source, process.returncode, ": " + said[0] if said else "")
            self._next()
        self.elapsed_s = round(time.monotonic() - self._began, 3)
        return found

    def xids(self):
        # type: () -> Dict[str, List[Dict[str, Any]]]
        found = self.lines()
        if self.source == "dmesg":
            return parse_xids(found, uptime(), self.window_hours * 3600.0)
        return parse_xids(found)


def uptime(path="/proc/uptime"):
    # type: (str) -> Optional[float]
    try:
        with open(path) as handle:
            return float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


HEALTH_KEYS = ("healthy", "health_checked", "health_issues", "health")


class Health(object):
    """One look's health context: the checks, the Xids read, the fields the driver rejected."""

    def __init__(self, checks, xids_by_bus=None, rejected=(), kernel_log=None):
        # type: (Checks, Optional[Dict[str, List[Dict[str, Any]]]], Any, Optional[KernelLog]) -> None
        self.checks = checks
        self.xids_by_bus = xids_by_bus or {}
        self.rejected = set(rejected)
        self.kernel_log = kernel_log

    def annotate(self, gpus):
        # type: (List[Dict[str, Any]]) -> List[Dict[str, Any]]
        """Copies of the records with healthy, health_issues, health_checked and health."""
        error = self.kernel_log.error if self.kernel_log is not None else None
        result = []
        for gpu in gpus:
            record = dict(gpu)
            rejected = set(self.rejected) | set(gpu.get("_rejected") or ())
            xids = xids_of(gpu, self.xids_by_bus)
            record["health_issues"] = gpu_issues(gpu, self.checks, xids)
            notes = unchecked(gpu, rejected, error, self.checks)
            record["healthy"] = not record["health_issues"]
            record["health_checked"] = not notes
            details = readings(gpu)
            details["xids"] = xids
            details["unchecked"] = notes
            record["health"] = details
            result.append(record)
        return result

    @staticmethod
    def carry(gpus, looked):
        # type: (List[Dict[str, Any]], List[Dict[str, Any]]) -> List[Dict[str, Any]]
        """Later memory readings of the same GPUs (gpu_release's polls ask no health field)
        keep the look's verdict, matched by UUID."""
        by_uuid = dict((gpu.get("uuid"), gpu) for gpu in looked)
        result = []
        for gpu in gpus:
            record = dict(gpu)
            before = by_uuid.get(gpu.get("uuid"), {})
            for key in HEALTH_KEYS:
                record[key] = before.get(key)
            result.append(record)
        return result

    def host_record(self, dcgm=None):
        # type: (Optional[Dict[str, Any]]) -> Dict[str, Any]
        log = self.kernel_log
        return {
            "kernel_log": {
                "source": log.source if log else None,
                "error": log.error if log else None,
                "window_hours": self.checks.xid_window_hours,
                "elapsed_s": log.elapsed_s if log else 0.0,
            },
            "dcgm_diag": dcgm,
        }


def host_verdict(gpus, dcgm=None):
    # type: (List[Dict[str, Any]], Optional[Dict[str, Any]]) -> Tuple[bool, List[str]]
    """(healthy, issues) of a host: every GPU's issues as 'GPU i (bus): issue', and DCGM's."""
    issues = []
    for gpu in gpus:
        for issue in gpu.get("health_issues") or []:
            issues.append("GPU %s (%s): %s" % (gpu.get("index"), gpu.get("pci_bus_id"), issue))
    if dcgm and dcgm.get("passed") is False:
        issues.append("dcgmi diag -r %s failed: %s" % (dcgm.get("level"), dcgm.get("summary")))
    return not issues, issues


# --- DCGM, optional

_DCGM_FAIL = re.compile(r"^\|\s*(?P<test>[^|]*?)\s*\|\s*Fail\b(?P<rest>.*)$", re.IGNORECASE)


def parse_dcgm_diag(rc, text):
    # type: (int, str) -> Tuple[bool, str]
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
        return False, "rc %s: %s" % (rc, lines[-1] if lines else "no output")
    return True, "passed"


def dcgm_diag(level, which, run_timeout=None):
    # type: (int, Any, Optional[float]) -> Optional[Dict[str, Any]]
    """Run `dcgmi diag -r LEVEL` when dcgmi is installed. `which(name)` finds a binary or None.
    None when level is 0; {"ran": False, "summary": "dcgmi not installed"} without DCGM."""
    if not level:
        return None
    record = {"level": level, "ran": False, "passed": None, "summary": None, "elapsed_s": 0.0}
    path = which("dcgmi")
    if not path:
        record["summary"] = "dcgmi not installed"
        return record
    timeout = run_timeout or DCGM_DIAG_TIMEOUT_S.get(level, 3600.0)
    began = time.monotonic()
    try:
        process = subprocess.Popen([path, "diag", "-r", str(level)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ, LC_ALL="C", LANG="C"))
        stdout, _stderr = process.communicate(timeout=timeout)
    except OSError as exc:
        record["summary"] = "cannot run dcgmi: %s" % exc
        return record
    except subprocess.TimeoutExpired:
        kill_group(process)
        record.update(ran=True, passed=False, summary="timed out after %g s" % timeout)
        return record
    passed, summary = parse_dcgm_diag(process.returncode, stdout.decode("utf-8", "replace"))
    record.update(ran=True, passed=passed, summary=summary, elapsed_s=round(time.monotonic() - began, 3))
    return record
