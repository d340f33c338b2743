# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The node's side effects, in one replaceable place: the clock, sleeping, systemctl, signals,
/proc reads of one process, container runtimes, a guest's systemd. gpu_release (_release),
gpu_restore (_restore) and the Slurm hook (_slurm/_jobcheck) act on the node only through a
`System`; their tests give them a fake one (tests/unit/plugins/module_utils/fake_node.py)."""

from __future__ import annotations

import os
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _signals

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor  # noqa: F401 - annotations


class System:
    """Everything gpu_release, gpu_restore and the Slurm hook do to the node, in one replaceable place."""

    def __init__(self, systemctl_path: str | None = None, proc: str = "/proc", runtimes: t.Any = None, record_path: str | None = None,
                 kernel_log_state: str | None = None) -> None:
        self.systemctl_path = systemctl_path
        self.proc = proc
        # Where the restore record goes (_record.PATH for the module); None writes none.
        self.record_path = record_path
        # What the last look read of the kernel log (_kernel_log_state.PATH for the module); None keeps none.
        self.kernel_log_state = kernel_log_state
        # pidfds pin a process of this kernel's /proc only.
        self.pidfd = _signals.pidfd_or_none() if proc == "/proc" else None
        # Docker and Podman, asked only when a holder runs in a container or services names one.
        self._runtimes = runtimes

    @property
    def runtimes(self) -> t.Any:
        """_engines.Runtimes, made (and _engines loaded) when first needed."""
        if self._runtimes is None:
            from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines
            self._runtimes = _engines.Runtimes()
        return self._runtimes

    @runtimes.setter
    def runtimes(self, runtimes: t.Any) -> None:
        self._runtimes = runtimes

    def systemctl(self, args: t.Sequence[str], timeout: float | None = None) -> tuple[int, str, str]:
        """(rc, out, err); a call that outlasts `timeout` is ended and reads rc 124 (systemd goes on with its job)."""
        return _commands.systemctl(self.systemctl_path, args, timeout)

    def start_time(self, pid: int) -> int | None:
        return holders_mod.start_time_of(pid, self.proc)

    def supervisors(self) -> list[_supervisor.Supervisor]:
        """Running supervisord processes of root (asked only when services names a program)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor
        return _supervisor.find_supervisors(self.proc)

    def state(self, pid: int) -> str | None:
        found = holders_mod.status_of(pid, self.proc)
        return None if found is None else found[0]

    def signal(self, pid: int, signum: int) -> None:
        os.kill(pid, signum)

    def cgroup_unit(self, pid: int) -> tuple[str | None, bool]:
        """(unit, is a system service) of a PID, from its cgroup."""
        path = holders_mod.cgroup_of(pid, self.proc)
        if path is None:
            return None, False
        return holders_mod.unit_of(path), holders_mod.is_system_service(path)

    def running_guests(self, kind: str, name_glob: str) -> list[t.Any]:
        """The system containers of `kind` running on this node whose name matches (_guests.running)."""
        return _guests.running(kind, name_glob, proc=self.proc)

    def guest_systemctl(self, guest: t.Any, args: list[str], timeout: float) -> tuple[int, str, str]:
        """systemctl in a guest, confined as the guest (_guest_units.guest_systemctl)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units
        return _guest_units.guest_systemctl(guest, args, timeout, self.proc)

    def guest_refusal(self, guest: t.Any) -> str | None:
        """Why this host cannot reach the guest's systemd confined as the guest (None: it can)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units
        return _guest_units.guest_refusal(guest, self.proc)

    @staticmethod
    def now() -> float:
        return time.monotonic()

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(max(0.0, seconds))
