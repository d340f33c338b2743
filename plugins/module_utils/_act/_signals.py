# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Signals: SIGTERM, then SIGKILL after kill_timeout, to exactly the processes planned; SIGKILL
at once to a process that SIGTERM cannot reach: it ignores SIGTERM, or it is the init of a PID
namespace below ours without a handler for it (as /proc/PID/status said at the scan), or, read
right before its first signal, it is stopped (state T), stopped by its tracer (state t) or in a
frozen cgroup (cgroup v2 `cgroup.freeze`).

A PID is signalled only while it is still the process that was planned (same start time,
/proc/PID/stat field 22): a PID reused since the scan is reported, never signalled. Where the
kernel and Python have pidfds (Linux 5.3+, Python 3.9+) the process is pinned first
(pidfd_open), its start time checked after that, and the signal sent through the pidfd: a PID
reused after the check cannot receive it. Elsewhere (Python 3.8 nodes) the start time is
checked again right before every signal. The `system` object (see _release.System) does the
reading, signalling and sleeping."""

from __future__ import annotations

import errno
import os
import signal
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    class Node(t.Protocol):
        """What signalling needs of _release.System."""

        proc: str

        def start_time(self, pid: int) -> int | None: ...
        def signal(self, pid: int, signum: int) -> None: ...
        def state(self, pid: int) -> str | None: ...
        def now(self) -> float: ...
        def sleep(self, seconds: float) -> None: ...

    class SignalsDone(t.TypedDict):
        """What a Signaller did, under the release result's keys (Release folds it in)."""

        killed: list[dict[str, t.Any]]
        reused_pids: list[dict[str, t.Any]]
        unkillable: list[dict[str, t.Any]]

# A process that has exited is seen within this; polling /proc is cheap (a stat per PID).
EXIT_POLL_S = 0.01
# How long a SIGKILLed holder may take to exit before it is called unkillable, whatever
# kill_timeout says: the kernel tears down a 40 GiB CUDA process in ~0.15 s (real H200), so with
# kill_timeout 0 a process that did die on SIGKILL was listed unkillable in a released run.
SIGKILL_EXIT_FLOOR_S = 1.0

SENT, GONE, REUSED = "sent", "gone", "reused"


class Pidfd:
    """The kernel's pidfd calls; `available()` says whether this Python and kernel have them."""

    @staticmethod
    def available() -> bool:
        if not (hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")):
            return False
        try:
            os.close(os.pidfd_open(os.getpid()))
        except OSError:  # ENOSYS: a kernel before 5.3 (or a seccomp filter)
            return False
        return True

    @staticmethod
    def open(pid: int) -> int:
        return os.pidfd_open(pid)

    @staticmethod
    def send(fd: int, signum: int) -> None:
        signal.pidfd_send_signal(fd, signum)

    @staticmethod
    def close(fd: int) -> None:
        os.close(fd)


def pidfd_or_none() -> Pidfd | None:
    return Pidfd() if Pidfd.available() else None


def signal_checked(system: Node, pid: int, start_time: int | None, signum: int, pidfd: Pidfd | None = None) -> str:
    """Send `signum` to PID if it is still the process that started at `start_time`.
    Returns SENT, GONE (exited) or REUSED (the PID now belongs to another process). Raises
    PermissionError from the kernel as it is."""
    if pidfd is not None:
        try:
            fd = pidfd.open(pid)
        except ProcessLookupError:
            return GONE
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                return GONE
            fd = None  # EMFILE and the like: this signal goes the start-time way
        if fd is not None:
            try:
                # Checked after the pidfd pins the process: if this start time matches, the pidfd
                # is the planned process, whatever happens to the PID from now on.
                return _send_if_same(system, pid, start_time, lambda: pidfd.send(fd, signum))
            finally:
                pidfd.close(fd)
    return _send_if_same(system, pid, start_time, lambda: system.signal(pid, signum))


def _send_if_same(system: Node, pid: int, start_time: int | None, send: t.Callable[[], None]) -> str:
    """The identity check before a signal -> SENT, GONE or REUSED."""
    now_start = system.start_time(pid)
    if now_start is None:
        return GONE
    if now_start != start_time:
        return REUSED
    try:
        send()
    except ProcessLookupError:
        return GONE
    return SENT


# Why a holder gets SIGKILL at once (the `sigkill_at_once` of its `killed` entry): SIGTERM cannot
# arrive, so waiting kill_timeout for it would only delay the SIGKILL (real H200: a holder under
# `unshare --pid --fork` cost the whole kill_timeout before it; real H100: a stopped holder cost
# 5.3 s with kill_timeout 5, against ~0.3 s for a SIGKILL).
IGNORES_SIGTERM = "ignores SIGTERM"
NAMESPACE_INIT = "init of its PID namespace, no SIGTERM handler"
# SIGKILL at once, not SIGTERM then SIGCONT, for these three (the design rule "a signal that cannot arrive is not
# waited for", docs/docsite/rst/guide_design.rst):
# - a tracee in a ptrace stop (t) is resumed by its tracer only: SIGCONT does nothing to it, and
#   SIGKILL is the one signal a tracer cannot hold back;
# - a frozen cgroup is thawed only by writing its cgroup.freeze, the freezer's owner's call (Slurm's
#   `scontrol suspend` on cgroup v2 freezes the job's cgroup), which SIGCONT does not do; a fatal
#   signal is delivered to a frozen task (H100: freed in 0.29 s), a handled SIGTERM stays pending;
# - a stopped process (T: Ctrl-Z, SIGSTOP, a job suspended by its scheduler) was paused by its owner
#   or its scheduler: SIGCONT would run its code again (GPU kernels, file writes, a handler that
#   saves a checkpoint for up to kill_timeout) only to end it, against the state the scheduler
#   holds for it. SIGKILL ends it without running any of it.
STOPPED = "stopped (state T)"
TRACED = "stopped by its tracer (state t)"
FROZEN = "in a frozen cgroup (cgroup.freeze)"
# A zombie leader (state Z, its other threads running on: _holders.holds_threads): its main thread
# has exited, and a runtime that runs signal handlers on its main thread (CPython runs every Python
# handler there: a trainer's SIGTERM handler) can never run one, so a caught SIGTERM stays pending
# for the whole kill_timeout. SIGKILL to the PID ends the whole thread group (issue 57).
ZOMBIE_LEADER = "its main thread has exited (zombie leader, state Z)"


def sigkill_at_once(holder: Holder | t.Mapping[str, t.Any], state: str | None = None, frozen: bool = False) -> str | None:
    """Why SIGTERM cannot reach this holder, or None: a process that ignores SIGTERM, or the
    init of a PID namespace below ours without a handler for it, which the kernel shields from
    SIGTERM (pid_namespaces(7)), both from its /proc/PID/status at the scan; a process that is
    stopped or stopped by its tracer, or a zombie leader whose threads run on (`state`, read right
    before the signal; the scan's when None), or one in a frozen cgroup (`frozen`): it cannot run a
    SIGTERM handler."""
    sigterm = holder.get("sigterm")
    if sigterm == "ignored":
        return IGNORES_SIGTERM
    if holder.get("pid_namespace_init") and sigterm == "default":
        return NAMESPACE_INIT
    state = holder.get("state") if state is None else state
    if state == "T":
        return STOPPED
    if state == "t":
        return TRACED
    if state == "Z":
        return ZOMBIE_LEADER
    if frozen:
        return FROZEN
    return None


def planned_signals(entry: t.Mapping[str, t.Any]) -> str:
    """What the real run will send to a planned holder, in check mode's words."""
    reason = entry.get("sigkill_at_once")
    return f"SIGKILL at once: {reason}" if reason else "SIGTERM, then SIGKILL after kill_timeout"


class Freezer:
    """Whether a cgroup path is frozen now, read from the cgroup v2 file system (the hierarchies
    of this mount namespace, read once: _cgroups.cgroup_mounts; a v1 name=systemd hierarchy has no
    cgroup.events and answers nothing). A fake /proc has no mountinfo: nothing is frozen there."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self._mounts: list[str] | None = None

    def mounts(self) -> list[str]:
        if self._mounts is None:
            self._mounts = _cgroups.cgroup_mounts(os.path.join(self.proc, "self", "mountinfo"))
        return self._mounts

    def frozen(self, cgroup_path: str | None) -> bool:
        if not cgroup_path or cgroup_path == "/":
            return False
        parts = [part for part in cgroup_path.split("/") if part and part not in (".", "..")]
        for mount in self.mounts():
            directory = os.path.join(mount, *parts)
            events = _cgroups.read_small(os.path.join(directory, "cgroup.events"))
            if events is not None:
                return _cgroups.is_frozen(events, _cgroups.read_small(os.path.join(directory, "cgroup.freeze")))
        return False


def reason_now(system: Node, holder: Holder | t.Mapping[str, t.Any], freezer: Freezer) -> str | None:
    """sigkill_at_once with the state read now (System.state: /proc/PID/stat, the existing reader)
    and the cgroup's freezer read now: a process can be stopped or frozen between the look and
    the act. Check mode asks the same, so it says what the real run will send."""
    reason = sigkill_at_once(holder, system.state(holder["pid"]))
    if reason is None and freezer.frozen(holder.get("cgroup")):
        reason = FROZEN
    return reason


def entry_of(holder: Holder) -> dict[str, t.Any]:
    """What is recorded of one signalled holder (the `killed` shape), plus its identity.
    `sigkill_at_once` is decided right before its first signal (Signaller._terminate)."""
    return {
        "pid": holder["pid"],
        "name": holder.get("name"),
        "cmdline": holder.get("cmdline"),
        "unit": holder.get("unit"),
        "container": holder.get("container"),
        "gpu_indexes": holder.get("gpu_indexes"),
        # What its own vLLM server said of its sleep (_look/_sleep_mode): its word, quoted.
        "sleep_answer": holder.get("sleep_answer"),
        "start_time": holder["start_time"],
        "signal": None,
        "sigkill_at_once": None,
        "_holder": holder,
    }


PRIVATE_KEYS = ("_first_signal", "_reused", "_holder", "start_time")


class Signaller:
    """TERM -> wait -> KILL -> wait for a list of planned holders.

    Each signalled holder enters the Signaller's record (`done["killed"]`) when its first
    signal is sent, so that a failure later on (PermissionError on the second signal) still
    reports it: StepFailed carries the record."""

    def __init__(self, system: Node, kill_timeout: float, pidfd: Pidfd | None = None) -> None:
        self.system = system
        self.kill_timeout = kill_timeout
        self.done: SignalsDone = {"killed": [], "reused_pids": [], "unkillable": []}
        self.pidfd = pidfd if pidfd is not None else getattr(system, "pidfd", None)
        self.freezer = Freezer(getattr(system, "proc", "/proc"))

    def send(self, entry: dict[str, t.Any], signum: int) -> bool:
        """Signal one target after checking it is still the same process (PID reuse)."""
        try:
            outcome = signal_checked(self.system, entry["pid"], entry["start_time"], signum, self.pidfd)
        except PermissionError as exc:
            raise StepFailed(f"not permitted to signal pid {entry['pid']} ({exc}): run with become: true", self.done) from exc
        if outcome == REUSED:
            entry["_reused"] = True
        if outcome != SENT:
            return False
        entry["signal"] = signal.Signals(signum).name
        if "_first_signal" not in entry:
            entry["_first_signal"] = self.system.now()
            self.done["killed"].append(entry)
        return True

    def gone(self, entry: dict[str, t.Any]) -> bool:
        return self.system.start_time(entry["pid"]) != entry["start_time"]

    def wait_exit(self, entries: list[dict[str, t.Any]], timeout: float) -> list[dict[str, t.Any]]:
        deadline = self.system.now() + timeout
        while True:
            now = self.system.now()
            for entry in entries:
                if "exited_after_s" not in entry and self.gone(entry):
                    entry["exited_after_s"] = round(now - entry.get("_first_signal", now), 3)
            waiting = [e for e in entries if "exited_after_s" not in e]
            if not waiting or now >= deadline:
                return waiting
            self.system.sleep(min(EXIT_POLL_S, deadline - now))

    def terminate(self, holders: list[Holder]) -> SignalsDone:
        """SIGTERM each holder, SIGKILL the survivors after kill_timeout -> the record: `killed`,
        `reused_pids` and `unkillable`, under the result's keys. A holder that SIGTERM cannot
        reach (`sigkill_at_once`, decided right before its first signal) gets SIGKILL first, and no
        wait for a SIGTERM."""
        entries = [entry_of(holder) for holder in holders]
        try:
            self._terminate(entries)
        finally:
            for entry in entries:
                for key in PRIVATE_KEYS:
                    entry.pop(key, None)
        return self.done

    def _terminate(self, entries: list[dict[str, t.Any]]) -> None:
        for entry in entries:
            # Read now, not at the scan: a holder stopped or frozen since the look gets no SIGTERM to wait for.
            entry["sigkill_at_once"] = reason_now(self.system, entry["_holder"], self.freezer)
            first = signal.SIGKILL if entry["sigkill_at_once"] else signal.SIGTERM
            if not self.send(entry, first) and "_reused" not in entry:
                entry["exited_after_s"] = 0.0
        waiting = self.wait_exit([e for e in entries if "_reused" not in e], self.kill_timeout)
        survivors = [e for e in waiting if not e["sigkill_at_once"]]
        for entry in survivors:
            if not self.send(entry, signal.SIGKILL) and "_reused" not in entry:
                entry["exited_after_s"] = round(self.system.now() - entry.get("_first_signal", self.system.now()), 3)
        # Those SIGKILLed at once that still live wait with the rest (and, with kill_timeout 0, the floor).
        killed = survivors + [e for e in waiting if e["sigkill_at_once"]]
        unkillable = self.wait_exit([e for e in killed if "_reused" not in e],
                                    max(self.kill_timeout, SIGKILL_EXIT_FLOOR_S)) if killed else []
        for entry in entries:
            if entry.get("_reused"):
                self.done["reused_pids"].append(
                    {"pid": entry["pid"], "name": entry["name"], "reason": "PID reused by another process since the scan; not signalled"}
                )
            elif entry in unkillable:
                entry["state"] = self.system.state(entry["pid"])
                self.done["unkillable"].append({k: v for k, v in entry.items() if k not in PRIVATE_KEYS})
