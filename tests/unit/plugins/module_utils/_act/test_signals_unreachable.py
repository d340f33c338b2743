# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Signals that cannot arrive, generalised (issue 57): a stopped holder (T), one stopped by its
tracer (t) and one in a frozen cgroup v2 get SIGKILL at once, decided from /proc/PID/stat and the
cgroup read right before the first signal, and check mode says so. The decision is pure; the fake
node runs it through Release; this machine's kernel runs it on the test's own children (a `sleep`
stopped, or traced by the test itself). The simulated hosts run it in
tests/integration/test_signals_that_cannot_arrive.py."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _signals as signals
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import World, run

SIGTERM_MASK = 1 << 14


# ------------------------------------------------------------------ the decision, pure


@pytest.mark.parametrize("holder, state, frozen, reason", [
    ({"sigterm": "default"}, "S", False, None),
    ({"sigterm": "caught"}, "R", False, None),
    # D alone: most often a short wait in the kernel (a checkpoint's write); its SIGTERM arrives when it returns.
    ({"sigterm": "default"}, "D", False, None),
    ({"sigterm": "default"}, "T", False, signals.STOPPED),
    ({"sigterm": "caught"}, "t", False, signals.TRACED),
    ({"sigterm": "caught"}, "S", True, signals.FROZEN),
    # The reasons read at the scan come first: the record says the one that always holds.
    ({"sigterm": "ignored"}, "T", True, signals.IGNORES_SIGTERM),
    ({"sigterm": "default", "pid_namespace_init": True}, "t", False, signals.NAMESPACE_INIT),
    # No reading now (the process is gone): the scan's state.
    ({"sigterm": "default", "state": "T"}, None, False, signals.STOPPED),
    # A zombie leader whose threads run on: a handler that runs on its main thread never runs.
    ({"sigterm": "caught", "threads": 3}, "Z", False, signals.ZOMBIE_LEADER),
], ids=["sleeping", "running", "disk-sleep", "stopped", "traced", "frozen", "sigign-first", "ns-init-first", "scan-state", "zombie-leader"])
def test_which_holder_gets_sigkill_at_once(holder, state, frozen, reason):
    assert signals.sigkill_at_once(holder, state, frozen) == reason


def test_check_mode_words_the_signal_the_real_run_will_send():
    assert signals.planned_signals({"sigkill_at_once": None}) == "SIGTERM, then SIGKILL after kill_timeout"
    assert signals.planned_signals({"sigkill_at_once": signals.STOPPED}) == "SIGKILL at once: stopped (state T)"


@pytest.mark.parametrize("events, freeze, frozen", [
    ("populated 1\nfrozen 1\n", "1\n", True),
    # Frozen by an ancestor: its own cgroup.freeze reads 0, its events say frozen.
    ("populated 1\nfrozen 1\n", "0\n", True),
    # A freeze under way: the tasks trap before they could run a handler.
    ("populated 1\nfrozen 0\n", "1\n", True),
    ("populated 1\nfrozen 0\n", "0\n", False),
    (None, None, False),
])
def test_frozen_is_read_from_cgroup_events_and_cgroup_freeze(events, freeze, frozen):
    assert _cgroups.is_frozen(events, freeze) is frozen


def fake_cgroup_fs(tmp_path, frozen_dirs=(), freezing_dirs=(), plain=()):
    """A fake /proc/self/mountinfo naming a cgroup2 tree and a v1 name=systemd tree under tmp_path,
    and the cgroup directories given (made in both, as a hybrid node has them)."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    v2, v1 = tmp_path / "cg2", tmp_path / "systemd"
    (proc / "self" / "mountinfo").write_text(
        f"36 31 0:33 / {v1} rw,nosuid - cgroup cgroup rw,xattr,name=systemd\n"
        f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw\n")
    for path in list(frozen_dirs) + list(freezing_dirs) + list(plain):
        for top in (v1, v2):
            (top / path.strip("/")).mkdir(parents=True, exist_ok=True)
        events = f"populated 1\nfrozen {1 if path in frozen_dirs else 0}\n"
        (v2 / path.strip("/") / "cgroup.events").write_text(events)
        (v2 / path.strip("/") / "cgroup.freeze").write_text("1\n" if path in freezing_dirs else "0\n")
    return str(proc)


def test_the_freezer_reads_the_cgroup2_hierarchy_of_this_mount_namespace(tmp_path):
    proc = fake_cgroup_fs(tmp_path, frozen_dirs=["/slurm/job_7/step_0"], freezing_dirs=["/slurm/job_8"], plain=["/user.slice"])
    freezer = signals.Freezer(proc)
    assert freezer.frozen("/slurm/job_7/step_0") and freezer.frozen("/slurm/job_8")
    assert not freezer.frozen("/user.slice") and not freezer.frozen("/") and not freezer.frozen(None)
    # No directory there, and no climbing out of the hierarchy through "..".
    assert not freezer.frozen("/gone.scope") and not freezer.frozen("/../../etc")
    # A fake /proc without mountinfo (the fake node's): nothing is frozen.
    assert not signals.Freezer(str(tmp_path / "nowhere")).frozen("/slurm/job_7/step_0")


# ------------------------------------------------------------------ Release on the fake node


@pytest.fixture
def world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return World(root)


def set_state(world, pid, state):
    """The kernel's state letter in /proc/PID/stat (field 3) and /proc/PID/status (`State:`), as a
    stop, a tracer or a SIGCONT leaves it: the signaller reads status, which answers where stat may wait."""
    path = os.path.join(str(world.root), str(pid), "stat")
    with open(path) as handle:
        text = handle.read()
    right = text.rindex(")")
    with open(path, "w") as handle:
        handle.write(text[: right + 2] + state + text[right + 3:])
    status = os.path.join(str(world.root), str(pid), "status")
    with open(status) as handle:
        text = handle.read()
    with open(status, "w") as handle:
        handle.write(re.sub(r"^State:\t\S", "State:\t" + state, text, flags=re.MULTILINE))


def stopped_holder(world, pid, state):
    # A SIGTERM to a stopped or traced process stays pending: only SIGKILL ends it.
    world.spawn(pid, {0: 40960}, on_term="ignore")
    set_state(world, pid, state)


@pytest.mark.parametrize("state, reason", [("T", signals.STOPPED), ("t", signals.TRACED)], ids=["stopped", "traced"])
def test_a_stopped_or_traced_holder_gets_sigkill_at_once_not_after_kill_timeout(world, state, reason):
    stopped_holder(world, 495, state)
    world.spawn(497, {0: 1000}, argv=("python3", "train.py"))
    result = run(world, kill_timeout=10.0)
    assert world.signals == [(0.0, 495, "SIGKILL"), (0.0, 497, "SIGTERM")]
    killed = {k["pid"]: k for k in result["killed"]}
    assert (killed[495]["signal"], killed[495]["sigkill_at_once"], killed[495]["exited_after_s"]) == ("SIGKILL", reason, 0.0)
    assert killed[497]["sigkill_at_once"] is None
    assert result["released"] is True and world.t < 1.0


def test_a_holder_stopped_between_the_look_and_the_signal_gets_sigkill_at_once(world):
    world.spawn(495, {0: 40960}, on_term="ignore")

    class StoppedAfterLook(release.Release):
        def look(self):
            snapshot = super().look()
            set_state(world, 495, "T")  # Ctrl-Z while the plan was made
            return snapshot

    result = run(world, release_class=StoppedAfterLook, kill_timeout=10.0)
    assert world.signals == [(0.0, 495, "SIGKILL")] and result["killed"][0]["sigkill_at_once"] == signals.STOPPED
    assert world.t < 1.0


def test_a_holder_continued_between_the_look_and_the_signal_gets_sigterm(world):
    stopped_holder(world, 495, "T")
    world.procs[495].on_term = "exit"

    class ContinuedAfterLook(release.Release):
        def look(self):
            snapshot = super().look()
            set_state(world, 495, "S")  # `fg`: it runs again and can handle its SIGTERM
            return snapshot

    result = run(world, release_class=ContinuedAfterLook, kill_timeout=10.0)
    assert world.signals == [(0.0, 495, "SIGTERM")] and result["killed"][0]["sigkill_at_once"] is None


def test_a_holder_in_a_frozen_cgroup_gets_sigkill_at_once(world, tmp_path):
    # The fake /proc's own mountinfo points at a fake cgroup2 tree where the holder's scope is frozen.
    fake_cgroup_fs(tmp_path / "fs", frozen_dirs=["/slurm/uid_1000/job_7/step_0"])
    os.makedirs(os.path.join(str(world.root), "self"), exist_ok=True)
    os.replace(str(tmp_path / "fs" / "proc" / "self" / "mountinfo"), os.path.join(str(world.root), "self", "mountinfo"))
    world.spawn(495, {0: 40960}, on_term="ignore", sig_cgt=SIGTERM_MASK, cgroup="0::/slurm/uid_1000/job_7/step_0\n")
    dry = run(world, check_mode=True, kill_timeout=10.0)
    assert [(k["pid"], k["sigkill_at_once"]) for k in dry["killed"]] == [(495, signals.FROZEN)] and world.signals == []
    result = run(world, kill_timeout=10.0)
    assert world.signals == [(0.0, 495, "SIGKILL")] and result["killed"][0]["sigkill_at_once"] == signals.FROZEN


@pytest.mark.parametrize("status, state, reason", [
    ({}, "T", signals.STOPPED),
    ({}, "t", signals.TRACED),
    ({"sig_ign": SIGTERM_MASK}, "S", signals.IGNORES_SIGTERM),
], ids=["stopped", "traced", "SigIgn"])
def test_check_mode_says_the_signal_the_real_run_will_send(world, status, state, reason):
    world.spawn(495, {0: 40960}, **status)
    set_state(world, 495, state)
    world.spawn(497, {0: 1000}, argv=("python3", "train.py"))
    result = run(world, check_mode=True)
    assert world.signals == []
    assert [(k["pid"], k["signal"], k["sigkill_at_once"]) for k in result["killed"]] == [(495, None, reason), (497, None, None)]
    after = result["diff"]["after"].splitlines()
    assert f"process 495 python3: SIGKILL at once: {reason}" in after
    assert "process 497 python3: SIGTERM, then SIGKILL after kill_timeout" in after


# ------------------------------------------------------------------ this machine's kernel, the test's own children


HAS_PIDFD = signals.Pidfd.available()
PTRACE_SEIZE, PTRACE_INTERRUPT, WALL = 0x4206, 0x4207, 0x40000000


class Reaping(release.System):
    """The real System, reaping our own child so that it does not linger as a zombie."""

    def __init__(self, process, pidfd):
        super().__init__()
        self.process = process
        self.pidfd = pidfd

    def start_time(self, pid):
        try:
            os.waitpid(self.process.pid, os.WNOHANG | WALL)
        except ChildProcessError:
            pass
        return super().start_time(pid)


def wait_state(pid, wanted, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = holders.parse_stat(handle.read())[1]
        if state == wanted or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


@pytest.fixture
def child():
    process = subprocess.Popen(["sleep", "60"])
    yield process
    # Whatever the test did to it: continued, then killed and reaped.
    for signum in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            break
    try:
        os.waitpid(process.pid, WALL)
    except ChildProcessError:
        pass


def ptrace(request, pid):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(request, pid, None, None) != 0:
        pytest.skip(f"ptrace {request:#x} refused here (errno {ctypes.get_errno()})")


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "start-time-recheck"])
@pytest.mark.parametrize("how", ["SIGSTOP", "ptrace"])
def test_a_stopped_child_of_this_test_gets_sigkill_at_once(child, use_pidfd, how):
    if use_pidfd and not HAS_PIDFD:
        pytest.skip("needs Python 3.9+ on Linux 5.3+")
    if how == "SIGSTOP":
        os.kill(child.pid, signal.SIGSTOP)
        assert wait_state(child.pid, "T") == "T"
    else:
        ptrace(PTRACE_SEIZE, child.pid)
        ptrace(PTRACE_INTERRUPT, child.pid)
        assert wait_state(child.pid, "t") == "t"
    holder = {"pid": child.pid, "name": "sleep", "cmdline": "sleep 60", "start_time": holders.start_time_of(child.pid), "sigterm": "default"}
    result = signals.Signaller(Reaping(child, signals.Pidfd() if use_pidfd else None), 30.0).terminate([holder])
    [entry] = result["killed"]
    assert (entry["signal"], entry["sigkill_at_once"]) == ("SIGKILL", signals.STOPPED if how == "SIGSTOP" else signals.TRACED)
    assert result["unkillable"] == []
