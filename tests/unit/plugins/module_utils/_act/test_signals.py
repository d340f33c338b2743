# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_signals against this machine's kernel: a child of the test itself (`sleep`) is the only
process ever signalled. The fake-world cases (PID reuse in each window) are in test_release_run."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _signals as signals

HAS_PIDFD = signals.Pidfd.available()


@pytest.fixture
def child():
    process = subprocess.Popen(["sleep", "60"])
    yield process
    if process.poll() is None:
        process.kill()
    process.wait()


def holder_of(process):
    return {"pid": process.pid, "name": "sleep", "cmdline": "sleep 60", "start_time": holders.start_time_of(process.pid)}


class Reaping(release.System):
    """The real System, reaping our own child so that it does not linger as a zombie."""

    def __init__(self, process, pidfd):
        super().__init__()
        self.process = process
        self.pidfd = pidfd

    def start_time(self, pid):
        self.process.poll()
        return super().start_time(pid)


@pytest.mark.skipif(not HAS_PIDFD, reason="needs Python 3.9+ on Linux 5.3+")
def test_real_system_uses_pidfds_where_the_kernel_has_them():
    assert isinstance(release.System().pidfd, signals.Pidfd)
    assert release.System(proc="/tmp/fake-proc").pidfd is None  # a fake /proc has no pidfds


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "start-time-recheck"])
def test_sigterm_reaches_the_planned_process(child, use_pidfd):
    if use_pidfd and not HAS_PIDFD:
        pytest.skip("needs Python 3.9+ on Linux 5.3+")
    system = Reaping(child, signals.Pidfd() if use_pidfd else None)
    result = signals.Signaller(system, 5.0).terminate([holder_of(child)])
    assert child.wait(timeout=5) == -signal.SIGTERM
    assert result["killed"][0]["signal"] == "SIGTERM" and result["killed"][0]["exited_after_s"] < 5.0


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "start-time-recheck"])
def test_a_process_with_another_start_time_is_not_signalled(child, use_pidfd):
    if use_pidfd and not HAS_PIDFD:
        pytest.skip("needs Python 3.9+ on Linux 5.3+")
    planned = dict(holder_of(child), start_time=holder_of(child)["start_time"] - 1)
    result = signals.Signaller(Reaping(child, signals.Pidfd() if use_pidfd else None), 1.0).terminate([planned])
    assert child.poll() is None and result["killed"] == [] and result["reused_pids"][0]["pid"] == child.pid


def test_an_exited_process_is_gone_not_an_error(child):
    start = holders.start_time_of(child.pid)
    child.kill()
    child.wait()
    for pidfd in ([signals.Pidfd()] if HAS_PIDFD else []) + [None]:
        assert signals.signal_checked(release.System(), child.pid, start, signal.SIGTERM, pidfd) == signals.GONE


def test_python_without_pidfd_falls_back(monkeypatch):
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    assert signals.pidfd_or_none() is None


def test_kernel_without_pidfd_falls_back(monkeypatch):
    def enosys(pid):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", enosys, raising=False)
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda fd, signum: None, raising=False)
    assert signals.pidfd_or_none() is None


PYTHON38 = os.path.expanduser("~/.pyenv/versions/3.8.18/bin/python3.8")
COLLECTIONS = os.path.abspath(os.path.join(os.path.dirname(signals.__file__), "..", "..", "..", "..", "..", ".."))
ON_38 = """
import signal, subprocess
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release, _signals
assert _signals.pidfd_or_none() is None and _release.System().pidfd is None
child = subprocess.Popen(["sleep", "60"])
holder = {"pid": child.pid, "name": "sleep", "start_time": _holders.start_time_of(child.pid)}

class Reaping(_release.System):
    def start_time(self, pid):
        child.poll()
        return super(Reaping, self).start_time(pid)

result = _signals.Signaller(Reaping(), 5.0).terminate([holder])
assert child.wait(timeout=5) == -signal.SIGTERM, child.returncode
print(result["killed"][0]["signal"])
"""


@pytest.mark.skipif(not os.path.exists(PYTHON38), reason="no CPython 3.8 here")
def test_python_38_node_signals_with_the_start_time_recheck():
    """Managed nodes may run Python 3.8, which has no os.pidfd_open."""
    done = subprocess.run([PYTHON38, "-c", ON_38], env=dict(os.environ, PYTHONPATH=COLLECTIONS), capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "SIGTERM"), done.stderr


def test_a_pidfd_that_cannot_be_opened_for_want_of_fds_falls_back_to_the_start_time_check():
    class Full:
        def open(self, pid):
            raise OSError(24, "Too many open files")

    class System:
        sent = []

        def start_time(self, pid):
            return 42

        def signal(self, pid, signum):
            self.sent.append((pid, signum))

    system = System()
    assert signals.signal_checked(system, 9, 42, 15, Full()) == signals.SENT and system.sent == [(9, 15)]
