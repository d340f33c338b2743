# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The NVIDIA driver's lines of the kernel log, and the Xids in them by the GPU they name.

The kernel log is read with journalctl, else dmesg (found in root's directories, TOOL_DIRS), in a
bounded child started beside nvidia-smi (KernelLog), its output capped in size (DriverLines); only
the lines since the last load of the driver and within the window count, and with a saved cursor
(_kernel_log_state) only the new ones are read. NVIDIA's Xid catalog says what each Xid asks for
(XID_CATALOG); _health turns them into issues per GPU."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import select
import subprocess
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log_state as log_state
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import KERNEL_MODULE_NAMED, kill_group, normalize_bus_id

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Gpu

    # {bus key: [{xid, time, message, action}]}: the Xids of the kernel log by the GPU they name.
    XidsByBus = t.Dict[t.Optional[str], t.List[t.Dict[str, t.Any]]]

# NVIDIA's Xid catalog: Xid -> (immediate action, description). Source: "Analyzing Xid Errors with
# the Xid Catalog" (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, the
# catalog for Ampere and newer GPUs, columns "Resolution Bucket (Immediate Action)"), read
# 2026-12-01: rows 1-13 from the page itself, the others as that catalog is quoted row by row in a
# public Xid triage reference ("NVIDIA Xid Triage Reference", which cites the page above and
# NVIDIA's GPU Debug Guidelines). Xids not listed here are reported, not judged (xid_fatal judges
# them). Unused Xids the catalog maps to CONTACT_SUPPORT (1-7, 9, 10, 12, 56-58, 61) are kept: if
# one ever fires, the GPU is in a state nobody documented.
XID_CATALOG = {
    1: ("CONTACT_SUPPORT", "unused Xid"),
    2: ("CONTACT_SUPPORT", "unused Xid"),
    3: ("CONTACT_SUPPORT", "unused Xid"),
    4: ("CONTACT_SUPPORT", "unused Xid"),
    5: ("CONTACT_SUPPORT", "unused Xid"),
    6: ("CONTACT_SUPPORT", "unused Xid"),
    7: ("CONTACT_SUPPORT", "unused Xid"),
    8: ("RESTART_APP", "GPU stopped processing"),
    9: ("CONTACT_SUPPORT", "unused Xid"),
    10: ("CONTACT_SUPPORT", "unused Xid"),
    11: ("RESTART_APP", "invalid or corrupted push buffer stream"),
    12: ("CONTACT_SUPPORT", "unused Xid"),
    13: ("RESTART_APP", "graphics engine exception"),
    25: ("RESTART_APP", "invalid or illegal push buffer stream"),
    31: ("RESTART_APP", "GPU memory page fault"),
    32: ("RESTART_APP", "invalid or corrupted push buffer stream"),
    43: ("IGNORE", "GPU stopped processing"),
    44: ("IGNORE", "graphics engine fault during context switch"),
    45: ("WORKFLOW_XID_45", "preemptive cleanup, due to previous errors"),
    46: ("RESET_GPU", "GPU stopped processing"),
    48: ("WORKFLOW_XID_48", "double-bit ECC error"),
    56: ("CONTACT_SUPPORT", "unused Xid (display channel exception)"),
    57: ("CONTACT_SUPPORT", "unused Xid (framebuffer link training failure)"),
    58: ("CONTACT_SUPPORT", "unused Xid (framebuffer memory error)"),
    61: ("CONTACT_SUPPORT", "internal micro-controller breakpoint"),
    62: ("RESET_GPU", "internal micro-controller halt"),
    63: ("IGNORE", "ECC page retirement or row remapping event"),
    64: ("RESET_GPU", "ECC page retirement or row remapper failure"),
    69: ("RESTART_APP", "graphics engine class error"),
    74: ("WORKFLOW_NVLINK_ERR", "NVLink error"),
    79: ("RESTART_BM", "GPU has fallen off the bus"),
    92: ("IGNORE", "high single-bit ECC error rate"),
    94: ("RESTART_APP", "contained ECC error"),
    95: ("RESET_GPU", "uncontained ECC error"),
    109: ("RESET_GPU", "context switch timeout"),
    110: ("RESET_GPU", "security fault"),
    119: ("RESET_GPU", "GSP RPC timeout"),
    120: ("RESET_GPU", "GSP error"),
    136: ("RESET_GPU", "link training failed"),
    137: ("IGNORE", "NVLink privilege error (an application's illegal peer access)"),
    140: ("RESET_GPU", "unrecovered ECC error"),
    143: ("RESET_GPU", "GPU initialization error"),
    144: ("WORKFLOW_NVLINK5_ERR", "NVLink SAW error"),
    145: ("WORKFLOW_NVLINK5_ERR", "NVLink RLW error"),
    146: ("WORKFLOW_NVLINK5_ERR", "NVLink TLW error"),
    147: ("WORKFLOW_NVLINK5_ERR", "NVLink TREX error"),
    148: ("WORKFLOW_NVLINK5_ERR", "NVLink NVLPW_CTRL error"),
    149: ("WORKFLOW_NVLINK5_ERR", "NVLink NETIR error"),
    150: ("WORKFLOW_NVLINK5_ERR", "NVLink MSE error"),
    151: ("RESTART_VM", "key rotation error"),
    154: ("XID_154", "GPU recovery action changed"),
    155: ("RESET_GPU", "NVLink software-defined error"),
    156: ("RESET_GPU", "resource retirement event"),
    157: ("IGNORE", "resource retirement failure"),
    158: ("RESET_GPU", "GPU fatal timeout"),
}

# Both match the kernel's message from its first character (_kernel_log_state.kernel_message),
# never anywhere in a line: the kernel quotes users' file names and comms in its own messages.
# "NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
# Older drivers print the bus without "PCI:", some with the function.
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F]{1,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?\): (?P<xid>\d+)(?:, (?P<rest>.*))?"
)
# What the driver prints when its kernel module loads (open and proprietary modules alike):
# "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.105.08 ..." (public dmesg reports);
# "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
# (the open module's banner, the text of /proc/driver/nvidia/version).
_DRIVER_LOAD = re.compile(r"NVRM: loading " + KERNEL_MODULE_NAMED)
ISO_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S*)")

# Bounds of the kernel log read: the last 24 h of kernel messages is usually well under 1 MiB.
KERNEL_LOG_MAX_BYTES = 32 * 1024 * 1024
KERNEL_LOG_TIMEOUT_S = 5.0
# journalctl without a journal (Storage=none, volatile journal not kept): systemd 252 prints this
# on stderr and exits 0 (issue 23's field report).
NO_JOURNAL = "No journal files were found"


def human_age(seconds: float) -> str:
    """How long ago, in the unit a person would say: seconds -> '45 s ago' (under 90 s),
    '12 min ago' (under 90 min), '2 h ago' (under 48 h), '3 days ago'; a negative age reads 0 s.
    The words of the Xid sentences of `health_issues` (a dmesg Xid's time)."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{round(seconds):d} s ago"
    if seconds < 90 * 60:
        return f"{round(seconds / 60):d} min ago"
    if seconds < 48 * 3600:
        return f"{round(seconds / 3600):d} h ago"
    return f"{round(seconds / 86400):d} days ago"


def bus_key(bus_id: str | None) -> str | None:
    """Domain:bus:device of a PCI address, the part Xid lines carry ('0000:18:00')."""
    if not bus_id:
        return None
    normalized = normalize_bus_id(bus_id if "." in bus_id else bus_id + ".0")
    return normalized.rsplit(".", 1)[0] if normalized else None


def driver_events(lines: t.Iterable[str]) -> list[str]:
    """The kernel log lines whose message is the NVIDIA driver's Xid or its load, in order: what
    the Xid check judges, and what _kernel_log_state keeps of a read."""
    return [line for line, kernel in log_state.driver_messages(lines) if _XID.match(kernel.message) or _DRIVER_LOAD.match(kernel.message)]


def split_at_driver_load(lines: t.Iterable[str]) -> tuple[list[str], list[str], str | None]:
    """Kernel log lines in time order -> (the driver's lines since its last load, its lines before
    it, that load's line). Without a load line in the window the driver loaded before it: all count."""
    driver = log_state.driver_messages(lines)
    loads = [position for position, (_line, kernel) in enumerate(driver) if _DRIVER_LOAD.match(kernel.message)]
    lines = [line for line, _kernel in driver]
    if not loads:
        return lines, [], None
    last = loads[-1]
    return lines[last + 1:], lines[:last], lines[last].strip()


def parse_xids(lines: t.Iterable[str], uptime_s: float | None = None, window_s: float | None = None) -> XidsByBus:
    """Kernel log lines (journalctl short-iso or dmesg) -> {bus key: [{xid, time, message, action}]}.

    dmesg lines carry seconds since boot: with `uptime_s` and `window_s` the older ones are
    dropped (journalctl is asked for the window itself)."""
    found: XidsByBus = {}
    for _line, kernel in log_state.driver_messages(lines):
        match = _XID.match(kernel.message)
        if not match:
            continue
        when: str | None = kernel.stamp
        if kernel.source == "dmesg":
            since_boot = float(kernel.stamp)
            if uptime_s is not None and window_s and uptime_s - since_boot > window_s:
                continue
            when = human_age(uptime_s - since_boot) if uptime_s is not None else f"{kernel.stamp} s after boot"
        number = int(match.group("xid"))
        found.setdefault(bus_key(match.group("bus")), []).append({
            "xid": number,
            "time": when,
            "message": kernel.message.strip(),
            "action": XID_CATALOG.get(number, (None, None))[0],
        })
    return found


def xids_of(gpu: Gpu, xids_by_bus: XidsByBus) -> list[dict[str, t.Any]]:
    return list(xids_by_bus.get(bus_key(gpu.get("pci_bus_id")), []))


# Where the kernel log's readers, systemctl and nv-fabricmanager are looked for after PATH: the
# system's own directories, not the NVIDIA driver container's (its tools are not the host's).
TOOL_DIRS = ("/usr/bin", "/bin", "/usr/sbin", "/sbin")


def which(name: str, search_path: str | None = None) -> str | None:
    """A program on PATH (or `search_path`), else in TOOL_DIRS, or None."""
    return _commands.which(name, dirs=TOOL_DIRS, search_path=search_path)


def spawn(argv: list[str], stderr: int = subprocess.PIPE) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=_commands.systemd_env(),
                            start_new_session=True)


class KernelLog:
    """The one reader of the kernel log: journalctl -k for the window, else dmesg. Read-only,
    bounded in time and bytes; started before nvidia-smi runs and collected after it.

    journalctl that has no journal ("No journal files were found." with rc 0, or an answer with
    no line at all while dmesg has some) is passed over for dmesg; `fallback` says why.

    With `state_path` (_kernel_log_state), journalctl reads only what came after the last read's
    cursor, and the Xid lines kept from it are judged again with the new ones: the same lines a
    whole read of the window gives, for a fraction of the journal read. Without a usable state
    (or when that read fails) the whole window is read, as without `state_path`."""

    def __init__(self, window_hours: float, timeout: float = KERNEL_LOG_TIMEOUT_S, max_bytes: int = KERNEL_LOG_MAX_BYTES,
                 search_path: str | None = None, state_path: str | None = None, clock: t.Callable[[], float] = time.time) -> None:
        self.window_hours = window_hours
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.search_path = search_path
        self.source: str | None = None
        self.error: str | None = None
        self.fallback: str | None = None
        self.driver_loaded: str | None = None
        # True when journalctl read only the lines after the last read (state_path).
        self.incremental = False
        self.elapsed_s = 0.0
        self.state_path = state_path
        self.clock = clock
        self._state: dict[str, t.Any] | None = None
        self._boot: str | None = None
        self._started: tuple[str, bool, subprocess.Popen[bytes]] | None = None
        self._queue: list[tuple[str, bool, list[str]]] = []
        self._began = time.monotonic()

    def _which(self, name: str) -> str | None:
        return which(name, self.search_path)

    def _commands(self) -> list[tuple[str, bool, list[str]]]:
        """(source, reads only what follows the kept state, argv), in the order they are tried."""
        commands = []
        journalctl = self._which("journalctl")
        if journalctl:
            tail = ["-o", "short-iso", "-q", "--no-pager"] + (["--show-cursor"] if self.state_path else [])
            if self._state is not None:
                commands.append(("journalctl", True, [journalctl, "-k", "--after-cursor", self._state["cursor"]] + tail))
            commands.append(("journalctl", False, [journalctl, "-k", "--since", f"-{max(1, int(self.window_hours * 60)):d}min"] + tail))
        dmesg = self._which("dmesg")
        if dmesg:
            commands.append(("dmesg", False, [dmesg]))
        return commands

    def _load_state(self) -> None:
        if not self.state_path:
            return
        self._boot = log_state.boot_id()
        state = log_state.read(self.state_path)
        self._state = state if log_state.usable(state, self._boot, self.window_hours, self.clock()) else None

    def _keep_state(self, cursor: str | None, lines: list[str]) -> None:
        """After a journalctl read: what it judged, for the next gate (a failure to write costs
        only that gate a whole read)."""
        if not self.state_path:
            return
        if cursor is None and self._state is not None and self.incremental:
            cursor = self._state["cursor"]  # nothing new since the last read
        state = log_state.new_state(self._boot, self.window_hours, cursor, lines, self.clock())
        if state is not None and not log_state.same_read(self._state, state):
            with contextlib.suppress(OSError):
                log_state.write(state, self.state_path)

    @staticmethod
    def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
        return spawn(argv)

    def start(self) -> None:
        if not self.window_hours:
            return
        self._began = time.monotonic()
        self._load_state()
        self._queue = self._commands()
        self._next()

    def _next(self) -> None:
        self._started = None
        while self._queue:
            source, incremental, argv = self._queue.pop(0)
            try:
                self._started = (source, incremental, self._spawn(argv))
                return
            except OSError as exc:
                self.error = f"{source}: {exc}"

    def abandon(self) -> None:
        """nvidia-smi failed: the Xids are not wanted, do not leave the reader behind."""
        if self._started is not None:
            kill_group(self._started[2])
            self._started = None
        self._queue = []

    def lines(self) -> list[str]:
        """The kernel log lines whose message is the driver's Xid or load (driver_events); [] (with .error set) when
        none was readable."""
        if not self.window_hours:
            return []
        if not self._queue and self._started is None and self.error is None:
            self.error = "neither journalctl nor dmesg found"
        found: list[str] = []
        kept: tuple[bool, list[str]] | None = None
        while self._started is not None:
            source, incremental, process = self._started
            deadline = self._began + self.timeout
            try:
                driver_lines, stderr = read_driver_lines(process, deadline, self.max_bytes)
            except subprocess.TimeoutExpired:
                kill_group(process)
                self.error = f"{source} took longer than {self.timeout:g} s"
                break
            text, cursor = _split_cursor(driver_lines.text())
            said = stderr.decode("utf-8", "replace").strip().splitlines()
            # journalctl --show-cursor (systemd 252) exits 1, saying nothing, when no entry matches:
            # an empty answer, not a failure (seen on the fleet's hosts, whose journal holds no kernel line).
            empty_journal = (source == "journalctl" and process.returncode == 1 and not said and not driver_lines.any_line
                             and cursor is None and bool(self.state_path))
            answered = process.returncode == 0 or empty_journal
            if answered and incremental and not any(NO_JOURNAL in line for line in said):
                # What the last read kept, still in the window, then the lines since: a whole
                # read's lines (an answer with no new line is no reason to try dmesg).
                # (Kept lines are judged again: what an earlier version kept is read as now.)
                earlier: list[str] = t.cast("dict[str, t.Any]", self._state)["lines"]
                found = log_state.in_window(driver_events(earlier + log_state.log_lines(text)), self.window_hours, self.clock())
                self.source, self.error, self.incremental = source, None, True
                self._keep_state(cursor, found)
                break
            if answered and not incremental:
                wanted = driver_events(log_state.log_lines(text))
                no_journal = source == "journalctl" and any(NO_JOURNAL in line for line in said)
                if source == "journalctl" and (no_journal or not driver_lines.any_line):
                    # No journal, or one that kept no kernel message: dmesg may still hold the Xids.
                    self.fallback = "journalctl: %s" % (said[0] if no_journal else "no kernel message in the window")
                    kept = (no_journal, wanted)
                    self._next()
                    continue
                self.source, self.error, found = source, None, wanted
                if source == "journalctl":
                    self._keep_state(cursor, found)
                break
            if incremental:
                # The kept cursor did not serve (a vacuumed journal, another journal): the whole window.
                self._next()
                continue
            self.error = "{} failed (rc {}){}".format(source, process.returncode, ": " + said[0] if said else "")
            self._next()
        if self.source is None and kept is not None:
            no_journal, wanted = kept
            if no_journal:
                # Nothing was read: journalctl has no journal and dmesg could not be read.
                self.error = "{}; {}".format(self.fallback, self.error or "no dmesg")
            elif os.geteuid() != 0:
                # Not root: journalctl shows a user only their own part of the journal (-q hides
                # that it says so) and dmesg refused: the kernel's lines were not read at all.
                self.error = "{}; {}; not root: the kernel log was not readable (become: true)".format(self.fallback, self.error or "no dmesg")
            else:
                # journalctl answered, with nothing, and dmesg could not say otherwise: it stands.
                self.source, found = "journalctl", wanted
                if self.error:
                    self.fallback, self.error = f"{self.fallback}; {self.error}", None
        self.elapsed_s = round(time.monotonic() - self._began, 3)
        return found

    def xids(self) -> tuple[XidsByBus, XidsByBus]:
        """({bus: Xids since the driver loaded}, {bus: Xids before it}): only the first count."""
        after, before, loaded = split_at_driver_load(self.lines())
        self.driver_loaded = loaded
        if self.source == "dmesg":
            up = uptime()
            window = self.window_hours * 3600.0
            return parse_xids(after, up, window), parse_xids(before, up, window)
        return parse_xids(after), parse_xids(before)


class DriverLines:
    """What the Xid and driver-load checks need of a kernel log, kept as it streams in (issue 66: a
    100 MB log read whole, then cut to its last 32 MiB, cost root 300 MiB): the lines that name the
    driver ("NVRM: ") with the few dmesg lines before each (driver_messages judges a dmesg line by
    the message start before it), and journalctl's cursor line; at most `max_bytes` of them, the
    newest. `any_line`: whether the log had any line at all (an empty journal is passed over)."""

    # dmesg lines kept before a driver line: driver_messages looks back to the last message start.
    BEFORE = 8

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.kept: collections.deque[bytes] = collections.deque()
        self.size = 0
        self.recent: collections.deque[bytes] = collections.deque(maxlen=self.BEFORE)
        self.rest = b""
        self.any_line = False

    def feed(self, chunk: bytes) -> None:
        data = self.rest + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self.rest = data[-self.max_bytes:]
            return
        self._lines(data[:cut])
        self.rest = data[cut + 1:]

    def _lines(self, whole: bytes) -> None:
        self.any_line = self.any_line or bool(whole.strip())
        if b"NVRM: " not in whole and log_state.CURSOR_PREFIX.encode() not in whole:
            # Most of a log: only its last dmesg lines may matter to a driver line that follows.
            self.recent.extend(line for line in whole.rsplit(b"\n", self.BEFORE)[-self.BEFORE:] if line[:1] == b"[")
            return
        for line in whole.split(b"\n"):
            if b"NVRM: " in line:
                self._keep(list(self.recent) + [line])
                self.recent.clear()
            elif line.startswith(log_state.CURSOR_PREFIX.encode()):
                self._keep([line])
            elif line[:1] == b"[":
                self.recent.append(line)

    def _keep(self, lines: list[bytes]) -> None:
        for line in lines:
            self.kept.append(line)
            self.size += len(line) + 1
        while self.size > self.max_bytes and self.kept:
            self.size -= len(self.kept.popleft()) + 1

    def text(self) -> str:
        if self.rest:
            self._lines(self.rest)
            self.rest = b""
        return b"\n".join(self.kept).decode("utf-8", "replace") + ("\n" if self.kept else "")


# What a kernel log reader may say on stderr that is kept (the first line is what is told).
STDERR_MAX_BYTES = 64 * 1024


def read_driver_lines(process: subprocess.Popen[bytes], deadline: float, max_bytes: int) -> tuple[DriverLines, bytes]:
    """A reader's output as DriverLines, and its stderr (the first STDERR_MAX_BYTES), read as they
    come until both end; raises subprocess.TimeoutExpired at `deadline` (monotonic)."""
    lines, stderr = DriverLines(max_bytes), b""
    streams = [s for s in (process.stdout, process.stderr) if s is not None]
    while streams:
        left = deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired(process.args, 0)
        ready, _w, _x = select.select(streams, [], [], left)
        for stream in ready:
            chunk = os.read(stream.fileno(), 1 << 20)
            if not chunk:
                streams.remove(stream)
            elif stream is process.stdout:
                lines.feed(chunk)
            elif len(stderr) < STDERR_MAX_BYTES:
                stderr += chunk[:STDERR_MAX_BYTES - len(stderr)]
    process.wait(max(0.0, deadline - time.monotonic()))
    return lines, stderr


def _split_cursor(text: str) -> tuple[str, str | None]:
    """journalctl --show-cursor's output -> (the log lines, the cursor after the last, or None)."""
    cursor = None
    lines = []
    for line in log_state.log_lines(text):
        if line.startswith(log_state.CURSOR_PREFIX):
            cursor = line[len(log_state.CURSOR_PREFIX):].strip() or None
        else:
            lines.append(line)
    return "\n".join(lines), cursor


def uptime(path: str = "/proc/uptime") -> float | None:
    try:
        with open(path) as handle:
            return float(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
