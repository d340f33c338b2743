# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The kernel log's lines: where the kernel's message starts in them, and what the last gate
already read, so that the next one reads only new lines.

A line proves only what the kernel wrote, and the kernel quotes what users choose in its own
messages: a crashing program's file name (with any byte but `/` and NUL, line feeds included) in
its segfault report, a process's `comm` (15 bytes) at the start of many. `kernel_message` is the
one place that finds where the kernel's message starts (after journalctl's `STAMP HOST kernel: `
or dmesg's `[ time] `, at the start of a line, lines split at line feeds only), and
`driver_messages` the one place that says which of them the NVIDIA driver wrote.

`/var/lib/zeromib-gpu/kernel-log.json`, root-only (file 0600 in the release record's 0700
directory), replaced atomically (a temporary file in the same directory, then a rename):

    {"format": 1, "boot_id": "<this boot>", "window_hours": 24.0, "read_at": <epoch s>,
     "cursor": "<journalctl's cursor after the last line read>",
     "lines": ["<the Xid and driver-load lines of the window, as journalctl printed them>"]}

A gate whose state is missing, unreadable, untrusted, corrupt, of another boot, of another
window, or older than the window reads the whole window, as without a state. The kept lines are
judged again on every gate with the new ones, exactly as a whole read would judge them: an Xid
stays reported while it is in the window (and since the driver loaded), whatever was read
before. Only journalctl has a cursor; dmesg is always read whole.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import stat
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands

PATH = "/var/lib/zeromib-gpu/kernel-log.json"
FORMAT = 1
BOOT_ID = "/proc/sys/kernel/random/boot_id"
# journalctl -k -o short-iso: "2026-12-01T02:20:22+0000 node01 kernel: MESSAGE" (systemd 252;
# "...+00:00" newer; no host name where the entry has none); dmesg (util-linux, as _health runs it): "[ 4321.123456] MESSAGE". Both indent
# the further lines of a message (a file name with a line feed in a segfault report): those start
# no message (tests/fixtures/kernel-log/segfault-linux-6.18).
_JOURNAL_PREFIX = re.compile(r"(?P<stamp>(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.\d+)?(?P<zone>[+-]\d\d:?\d\d|Z)) (?:\S+ )?kernel: ")
_DMESG_PREFIX = re.compile(r"\[ *(?P<stamp>\d+\.\d+)\] ")
# What the NVIDIA driver starts each of its messages with.
DRIVER_PREFIX = "NVRM: "
# The kernel's reports about a task start with its comm (at most 15 bytes, the user's choice) and
# its PID: "comm[1234]: segfault at ..." (show_signal_msg, print_vma_addr then quotes the file
# name), "comm (1234): drop_caches: 3". A comm of "NVRM: Xid (PCI:" starts such a message with the
# driver's prefix (the capture's first line).
# dmesg in the C locale writes each byte outside ASCII as \xNN: one byte of the comm each.
_TASK_REPORT = re.compile(r"(?:\\x[0-9a-fA-F]{2}|.){0,15}?(?:\[\d+\]|\(\d+\))")
# journalctl --show-cursor's last line.
CURSOR_PREFIX = "-- cursor: "
# The state is never larger than this (a window of Xid lines is a few KiB).
MAX_BYTES = 4 * 1024 * 1024


def boot_id(path: str = BOOT_ID) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


class KernelMessage(t.NamedTuple):
    """One line of the kernel log where a message of the kernel starts."""
    source: str   # "journalctl" or "dmesg": how the line was printed
    stamp: str    # its time as printed: "2026-12-01T02:20:22+0000", or dmesg's seconds since boot "4321.123456"
    message: str  # the kernel's message, from its first character


def kernel_message(line: str) -> KernelMessage | None:
    """The kernel's message in one line of `journalctl -k -o short-iso` or `dmesg`, or None for a
    line that starts none (a further line of a message, journalctl's own notes, anything else)."""
    match = _JOURNAL_PREFIX.match(line)
    if match:
        return KernelMessage("journalctl", match.group("stamp"), line[match.end():])
    match = _DMESG_PREFIX.match(line)
    if match:
        return KernelMessage("dmesg", match.group("stamp"), line[match.end():])
    return None


def log_lines(text: str) -> list[str]:
    """A reader's output -> its lines, split at line feeds only: journalctl prints a U+2028 of a
    file name as it is, and str.splitlines() would start a line there that the user wrote whole."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


def _driver_wrote(message: str) -> bool:
    return message.startswith(DRIVER_PREFIX) and not _TASK_REPORT.match(message)


def driver_messages(lines: t.Iterable[str]) -> list[tuple[str, KernelMessage]]:
    """The lines whose kernel message the NVIDIA driver wrote ("NVRM: " starts the message, which
    is not a report about a task whose comm starts so), with their message, in order.

    dmesg through syslog(2) (busybox, or util-linux without /dev/kmsg) prints every line of a
    multi-line message with the message's own `[ time] `: a line with the time of the line before
    it, when that line's message is not the driver's, is read as part of it (a crash in a file
    named "x<line feed>NVRM: Xid ..." logs such a line). A real driver message in the same
    microsecond right after another subsystem's line is read so too; the journal and dmesg
    through /dev/kmsg indent further lines instead, and are never so read."""
    found = []
    before: tuple[str, bool] | None = None  # (dmesg time, the driver's) of the last message start
    # Lines that are not the driver's (most of a log) are read only when a driver line follows:
    # the last dmesg message start among them gives the time it is judged by.
    others: list[str] = []
    for line in lines:
        if DRIVER_PREFIX not in line:
            if line[:1] == "[":
                others.append(line)
            continue
        for other in reversed(others):
            match = _DMESG_PREFIX.match(other)
            if match:
                before = (match.group("stamp"), False)
                break
        others = []
        parsed = kernel_message(line)
        if parsed is None:
            continue
        driver = _driver_wrote(parsed.message)
        if parsed.source == "dmesg":
            if before is not None and before[0] == parsed.stamp and not before[1]:
                continue
            before = (parsed.stamp, driver)
        if driver:
            found.append((line, parsed))
    return found


def line_time(line: str) -> float | None:
    """A journalctl short-iso line's time (epoch seconds), or None."""
    match = _JOURNAL_PREFIX.match(line)
    if not match:
        return None
    zone = match.group("zone").replace("Z", "+0000").replace(":", "")
    try:
        return datetime.datetime.strptime(match.group("time") + zone, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def in_window(lines: t.Iterable[str], window_hours: float, now: float) -> list[str]:
    """The lines not older than the window (journalctl --since -Nmin's cut, a second's slack for
    the stamp's truncation); a line without a time is kept (never hide an Xid)."""
    since = now - max(1, int(window_hours * 60)) * 60.0
    kept = []
    for line in lines:
        when = line_time(line)
        if when is None or when + 1.0 >= since:
            kept.append(line)
    return kept


def usable(state: t.Any, boot: str | None, window_hours: float, now: float) -> bool:
    """Whether `state` may stand for what was read: this boot, this window, read within it."""
    if not isinstance(state, dict) or state.get("format") != FORMAT or not boot or state.get("boot_id") != boot:
        return False
    if state.get("window_hours") != window_hours or not isinstance(state.get("cursor"), str) or not state["cursor"]:
        return False
    lines, read_at = state.get("lines"), state.get("read_at")
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        return False
    return isinstance(read_at, (int, float)) and 0 <= now - read_at < window_hours * 3600.0


def new_state(boot: str | None, window_hours: float, cursor: str | None, lines: list[str], now: float) -> dict[str, t.Any] | None:
    """The state to keep after a journalctl read, or None when it could not stand for it (no
    boot id or cursor, or a line whose time cannot be read: it could never leave the window)."""
    if not boot or not cursor or any(line_time(line) is None for line in lines):
        return None
    return {"format": FORMAT, "boot_id": boot, "window_hours": window_hours, "read_at": now, "cursor": cursor, "lines": list(lines)}


def same_read(kept: t.Any, state: dict[str, t.Any]) -> bool:
    """Whether `kept` already says what `state` does (nothing new logged) and is fresh enough to
    stay usable: the clean gate then writes nothing."""
    if not isinstance(kept, dict) or any(kept.get(key) != state[key] for key in ("boot_id", "window_hours", "cursor", "lines")):
        return False
    return state["read_at"] - kept.get("read_at", 0) < state["window_hours"] * 3600.0 / 2


def _trusted(info: os.stat_result) -> bool:
    return info.st_uid in (0, os.geteuid()) and not info.st_mode & 0o022


def read(path: str = PATH) -> t.Any:
    """The state at `path`, or None (none, a link, a FIFO, not root's, writable by others, not
    JSON, too deep): any doubt costs one whole read of the window, never the look."""
    try:
        if not _trusted(os.lstat(os.path.dirname(path))):
            return None
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or not _trusted(info) or info.st_size > MAX_BYTES:
                return None
            data = handle.read(MAX_BYTES + 1)
        return json.loads(data.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None


def write(state: dict[str, t.Any], path: str = PATH) -> None:
    """Replace the state atomically. No fsync: a state lost in a crash costs one whole read."""
    directory = os.path.dirname(path)
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(directory) or "/", exist_ok=True)
        os.mkdir(directory, 0o700)
        info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or not _trusted(info):
        raise OSError(f"{directory} is not a directory of root's that only root may write")
    _commands.replace_file(path, json.dumps(state, sort_keys=True).encode("utf-8"), durable=False)
