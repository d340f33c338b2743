# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A GPU still being freed when wait_timeout runs out (issue 57): its memory still falling, or held
by a process the kernel is ending (PF_EXITING: a Triton unpinning a large host-memory pool after
the stop), fails saying that a longer wait_timeout may free it, not that the driver leaked it. A
process in D state alone, or a holder this run left running, says nothing of the kind. Pure parts,
then Release on the fake node (fake_node.py), then the PF_EXITING reading on this machine's
kernel. The simulated hosts: tests/integration/test_still_freeing.py."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import World, fail, run

HINT = "still being freed: a longer wait_timeout (role: free_gpus_wait_timeout) may free them"


def gpu(index, mib):
    return {"index": index, "uuid": f"GPU-{index}", "memory_used_mib": mib}


# ------------------------------------------------------------------ pure


def test_memory_falling_over_the_last_second_is_a_release_under_way():
    trend = release.MemoryTrend()
    for step, mib in enumerate([40960, 40960, 36864, 32768, 28672, 24576]):
        trend.add(step * 0.25, [gpu(0, mib), gpu(1, 4096)])
    # Only the readings of the last TREND_WINDOW_S count, plus the one before its start.
    assert trend.falling(0) == (40960, 24576, 1.0)
    assert trend.falling(1) is None and trend.falling(7) is None


def test_memory_that_rose_in_the_window_is_a_workload_not_a_teardown():
    trend = release.MemoryTrend()
    for step, mib in enumerate([30000, 20000, 25000, 10000]):
        trend.add(step * 0.25, [gpu(0, mib)])
    assert trend.falling(0) is None
    single = release.MemoryTrend()
    single.add(0.0, [gpu(0, 100)])
    assert single.falling(0) is None


def test_freeing_notes_name_the_fall_and_the_exiting_process_never_a_holder_left_running():
    dirty = [gpu(0, 30000), gpu(1, 8000), gpu(2, 8000)]
    trend = release.MemoryTrend()
    trend.add(0.0, [gpu(0, 40000), gpu(1, 8000), gpu(2, 9000)])
    trend.add(1.0, dirty)
    holders_now = [{"pid": 495, "name": "tritonserver", "gpu_indexes": [1]}, {"pid": 600, "name": "python3", "gpu_indexes": [2]}]
    notes = release.freeing_notes(dirty, holders_now, [], trend, lambda pid: pid == 495, signalled={495})
    assert notes == {0: "its memory fell from 40000 to 30000 MiB in the last 1.0 s", 1: "pid 495 tritonserver is exiting"}
    # GPU 2 falls too, but pid 600 (not signalled, not exiting) holds it: no wait frees that.


def test_the_head_says_a_longer_wait_may_help_only_when_wait_timeout_ran_out():
    dirty = [gpu(0, 30000)]
    text = release.failure_message(dirty, [], [], 60.0, [], freeing={0: "its memory fell from 40000 to 30000 MiB in the last 1.0 s"})
    assert text.startswith(f"GPUs still in use after 60.0 s, {HINT}: GPU 0 (GPU-0) reads 30000 MiB (its memory fell from 40000 to 30000 MiB"), text
    assert "the driver is still freeing its memory" in text and "reset" not in text
    plain = release.failure_message(dirty, [], [], 60.0, [])
    assert plain.startswith("GPUs still in use after 60.0 s: GPU 0") and "a GPU reset or a reboot is needed" in plain


# ------------------------------------------------------------------ Release on the fake node

PF_EXITING = 0x00000004


class SlowRelease(World):
    """A driver that frees an exited holder's memory 1 GiB every 0.5 s (as a large context torn down
    piece by piece), instead of all of it ~50 ms after the exit."""

    def exit(self, pid, by_stop=False):
        proc = self.procs[pid]
        super().exit(pid, by_stop)
        for index, mib in proc.mem.items():
            self.freeing = [f for f in self.freeing if f[1] != index]
            steps = max(1, mib // 1024)
            self.freeing += [(self.t + 0.5 * (k + 1), index, mib - 1024 * (steps - 1)) if k == steps - 1 else (self.t + 0.5 * (k + 1), index, 1024)
                             for k in range(steps)]


class ExitingInDState(World):
    """SIGKILL reaches the holder, which then stays in the kernel's exit path (PF_EXITING) in D state,
    its GPU memory held: a Triton unpinning a large host-memory pool."""

    exiting = True

    def enter_d_state(self, pid):
        super().enter_d_state(pid)
        path = os.path.join(str(self.root), str(pid), "stat")
        with open(path) as handle:
            fields = handle.read().split(" ")
        if self.exiting:
            fields[8] = str(int(fields[8]) | PF_EXITING)
        with open(path, "w") as handle:
            handle.write(" ".join(fields))


@pytest.fixture
def root(tmp_path):
    path = tmp_path / "proc"
    path.mkdir()
    return path


def test_memory_still_falling_when_wait_timeout_runs_out_says_a_longer_wait_may_free_it(root):
    world = SlowRelease(root)
    world.spawn(495, {0: 40960})
    error = fail(world, wait_timeout=2.0)
    assert error.msg.startswith(f"GPUs still in use after 2.0 s, {HINT}: GPU 0 ("), error.msg
    assert "MiB (its memory fell from " in error.msg
    assert "MiB in the last 1.0 s), and no live process holds it any more: the driver is still freeing its memory" in error.msg
    assert "reset" not in error.msg
    # The same node with a wait long enough: released.
    (root.parent / "again").mkdir()
    world = SlowRelease(root.parent / "again")
    world.spawn(495, {0: 40960})
    assert run(world, wait_timeout=30.0)["released"] is True


def test_a_holder_the_kernel_is_still_ending_says_a_longer_wait_may_free_it(root):
    world = ExitingInDState(root)
    world.spawn(495, {0: 40960}, comm="tritonserver", on_term="ignore", on_kill="D")
    error = fail(world, kill_timeout=1.0, wait_timeout=2.0)
    assert error.msg.startswith(f"GPUs still in use after 2.0 s, {HINT}: GPU 0 ("), error.msg
    assert "MiB (pid 495 tritonserver is exiting), held by pid 495 tritonserver" in error.msg
    assert error.result["unkillable"][0]["pid"] == 495


def test_a_holder_in_d_state_that_is_not_exiting_gets_no_such_hope(root):
    # D alone: blocked in the driver, or frozen by cgroup v1's freezer (D, and SIGKILL waits for the thaw).
    world = ExitingInDState(root)
    world.exiting = False
    world.spawn(495, {0: 40960}, on_term="ignore", on_kill="D")
    error = fail(world, kill_timeout=1.0, wait_timeout=2.0)
    assert error.msg.startswith("GPUs still in use after 2.0 s: GPU 0 (") and "wait_timeout" not in error.msg, error.msg
    assert ("unkillable (outlived SIGKILL: a thread of it stays in the kernel, D state, in the driver or a file system that does not "
            "answer): pid 495") in error.msg
    assert error.msg.endswith("a reboot is needed (nothing else ends a process stuck in the kernel)"), error.msg


def test_falling_memory_beside_a_holder_this_run_left_running_gets_no_such_hope(root):
    world = SlowRelease(root)
    world.spawn(495, {0: 40960}, argv=("python3", "serve.py"))
    world.spawn(496, {0: 1024}, argv=("python3", "notebook.py"))
    error = fail(world, match=["serve"], wait_timeout=2.0)
    assert error.msg.startswith("GPUs still in use after 2.0 s: GPU 0 (") and "wait_timeout" not in error.msg, error.msg
    assert "held by pid 496 python3" in error.msg


# ------------------------------------------------------------------ PF_EXITING on the kernel


def test_pf_exiting_is_read_from_stat_field_9(tmp_path):
    fakeproc.write_process(tmp_path, 495, state="D")
    fakeproc.write_process(tmp_path, 496, state="Z")
    for pid in (495, 496):
        path = tmp_path / str(pid) / "stat"
        fields = path.read_text().split(" ")
        fields[8] = str(int(fields[8]) | PF_EXITING)
        path.write_text(" ".join(fields))
    fakeproc.write_process(tmp_path, 497, state="D")
    assert holders.is_exiting(495, str(tmp_path))
    # A zombie leader carries the flag whatever its live threads do; a plain D process has none.
    assert not holders.is_exiting(496, str(tmp_path)) and not holders.is_exiting(497, str(tmp_path))
    assert not holders.is_exiting(498, str(tmp_path))  # gone


SYS_EXIT = {"x86_64": 60, "aarch64": 93}


def read_stat(pid):
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read()


ZOMBIE_LEADER = """
import ctypes, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=False).start()
print("ready", flush=True)
ctypes.CDLL(None).syscall({nr}, 0)  # the main thread alone exits; the worker lives on
"""


@pytest.mark.skipif(platform.machine() not in SYS_EXIT, reason="exit(2)'s number is known here for x86_64 and aarch64 only")
def test_a_zombie_leader_with_a_live_thread_is_not_read_as_exiting():
    child = subprocess.Popen([sys.executable, "-c", ZOMBIE_LEADER.format(nr=SYS_EXIT[platform.machine()])], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 5
        while holders.parse_stat(read_stat(child.pid))[1] != "Z":
            assert time.monotonic() < deadline, "the leader never became a zombie"
            time.sleep(0.01)
        text = read_stat(child.pid).decode()
        assert int(text[text.rindex(")") + 2:].split()[6]) & PF_EXITING  # the kernel's flag is there...
        assert len(os.listdir(f"/proc/{child.pid}/task")) == 2
        assert not holders.is_exiting(child.pid)  # ...and says nothing of the process
    finally:
        child.kill()
        child.wait()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert not holders.is_exiting(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
