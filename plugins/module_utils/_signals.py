# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Signals: SIGTERM, then SIGKILL after kill_timeout, to exactly the processes planned.

A PID is signalled only while it is still the process that was planned (same start time,
/proc/PID/stat field 22): a PID reused since the scan is reported, never signalled. The
`system` object (see _release.System) does the reading, signalling and sleeping."""

from __future__ import annotations

import signal

from ansible_collections.zeromib.gpu.plugins.module_utils._errors import ReleaseError

# A process that has exited is seen within this; polling /proc is cheap (a stat per PID).
EXIT_POLL_S = 0.01


def entry_of(holder):
    """What is recorded of one signalled holder (the `killed` shape), plus its identity."""
    return {
        "pid": holder["pid"],
        "name": holder.get("name"),
        "cmdline": holder.get("cmdline"),
        "unit": holder.get("unit"),
        "container": holder.get("container"),
        "gpu_indexes": holder.get("gpu_indexes"),
        "start_time": holder["start_time"],
        "signal": None,
    }


class Signaller(object):
    """TERM -> wait -> KILL -> wait for a list of planned holders."""

    def __init__(self, system, kill_timeout, result):
        self.system = system
        self.kill_timeout = kill_timeout
        self.result = result

    def send(self, entry, signum):
        """Signal one target after checking it is still the same process (PID reuse)."""
        now_start = self.system.start_time(entry["pid"])
        if now_start is None:
            return False
        if now_start != entry["start_time"]:
            entry["_reused"] = True
            return False
        try:
            self.system.signal(entry["pid"], signum)
        except ProcessLookupError:
            return False
        except PermissionError as exc:
            raise ReleaseError("not permitted to signal pid %d (%s): run with become: true" % (entry["pid"], exc), self.result)
        entry["signal"] = signal.Signals(signum).name
        entry.setdefault("_first_signal", self.system.now())
        return True

    def gone(self, entry):
        return self.system.start_time(entry["pid"]) != entry["start_time"]

    def wait_exit(self, entries, timeout):
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

    def terminate(self, holders):
        """SIGTERM each holder, SIGKILL the survivors after kill_timeout. Records into the
        result's `killed`, `reused_pids` and `unkillable`."""
        entries = [entry_of(holder) for holder in holders]
        for entry in entries:
            if not self.send(entry, signal.SIGTERM) and "_reused" not in entry:
                entry["exited_after_s"] = 0.0
        survivors = self.wait_exit([e for e in entries if "_reused" not in e], self.kill_timeout)
        for entry in survivors:
            if not self.send(entry, signal.SIGKILL) and "_reused" not in entry:
                entry["exited_after_s"] = round(self.system.now() - entry.get("_first_signal", self.system.now()), 3)
        unkillable = self.wait_exit([e for e in survivors if "_reused" not in e], self.kill_timeout) if survivors else []
        for entry in entries:
            if entry.pop("_reused", False):
                self.result["reused_pids"].append(
                    {"pid": entry["pid"], "name": entry["name"], "reason": "PID reused by another process since the scan; not signalled"}
                )
                continue
            entry.pop("_first_signal", None)
            entry.pop("start_time", None)
            if entry in unkillable:
                entry["state"] = self.system.state(entry["pid"])
                self.result["unkillable"].append(dict(entry))
            if entry["signal"] is not None:
                self.result["killed"].append(entry)
