"""Reads of other processes under a bound (_bounded_reads), the file systems a stat may wait on
(_holders.MountTable), zombie leaders read through a live thread, and what is told of a process
that does not answer (issue 54 class 4, issue 57).

A read that waits in the kernel here is the open of a FIFO nobody writes (interruptible, as a
FUSE request is at first); the real ones (a stalled FUSE daemon) are in
tests/integration/test_stalled_fs.py. Every process a test starts is its own and is SIGKILLed
and reaped by the test."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution, _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mounts


@pytest.fixture
def fifo(tmp_path):
    """A FIFO whose open waits until a writer comes; the writer comes at teardown (no thread of
    the test run stays waiting)."""
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    yield path
    for _attempt in range(4):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            break
        time.sleep(0.05)


def waits_on(fifo):
    def read(item):
        if item == "waits":
            os.close(os.open(fifo, os.O_RDONLY))
        return item
    return read


@pytest.mark.parametrize("isolate", [False, True], ids=["thread", "forked"])
def test_a_read_that_waits_is_reported_blocked_and_the_pass_goes_on(fifo, isolate):
    started = time.monotonic()
    outcome = _bounded_reads.scan(waits_on(fifo), ["a", "waits", "b"], budget=0.2, isolate=isolate)
    assert outcome.results == {0: "a", 2: "b"} and outcome.unread == []
    [blocked] = outcome.blocked
    assert blocked.item == 1 and blocked.waits_in == "wait_for_partner"
    assert time.monotonic() - started < 2


def test_the_deadline_leaves_the_rest_unread(fifo):
    """Another reader goes on past the item that waits; at the deadline that item is unread."""
    outcome = _bounded_reads.scan(waits_on(fifo), ["a", "waits", "b"], budget=5, deadline_s=0.3)
    assert (outcome.results, outcome.blocked, outcome.unread) == ({0: "a", 2: "b"}, [], [1])


@pytest.fixture
def fifos(tmp_path):
    """Thirty FIFOs whose opens wait until a writer comes (at teardown)."""
    paths = [str(tmp_path / f"fifo{n}") for n in range(30)]
    for path in paths:
        os.mkfifo(path)
    yield paths
    for path in paths:
        for _attempt in range(4):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                break
            time.sleep(0.01)


def test_thirty_reads_that_wait_cost_one_budget_not_thirty(fifos):
    """Issue 66: thirty processes a user blocked, read one after the other at 0.5 s each, outlasted
    the pass's deadline; read in parallel they are all found blocked within about one budget, and
    every item that answers is read."""
    items = [("waits", path) if n % 2 else ("reads", n) for n, path in enumerate(fifos * 2)]

    def work(item):
        if item[0] == "waits":
            os.close(os.open(item[1], os.O_RDONLY))
        return item[1]

    started = time.monotonic()
    outcome = _bounded_reads.scan(work, items, budget=0.5, deadline_s=10)
    took = time.monotonic() - started
    assert [b.item for b in outcome.blocked] == [n for n in range(60) if n % 2] and outcome.unread == []
    assert {b.waits_in for b in outcome.blocked} == {"wait_for_partner"}
    assert sorted(outcome.results) == [n for n in range(60) if not n % 2]
    assert took < 3, took


def test_a_process_found_blocked_is_waited_for_once_in_the_run(fifo, monkeypatch):
    """The pass that finds it blocked records it; a later pass or call on that PID does not wait."""
    monkeypatch.setattr(_bounded_reads, "BLOCKED", {})
    calls = []

    def work(item):
        calls.append(item)
        return waits_on(fifo)(item)

    first = _bounded_reads.scan(work, ["a", "waits"], budget=0.2, processes=["/proc/101", "/proc/102"])
    assert [b.item for b in first.blocked] == [1] and _bounded_reads.BLOCKED == {"/proc/102": "wait_for_partner"}
    started = time.monotonic()
    again = _bounded_reads.scan(work, ["waits", "b"], budget=5, processes=["/proc/102", "/proc/103"])
    assert again == _bounded_reads.Outcome({1: "b"}, [_bounded_reads.Blocked(0, "wait_for_partner")], [])
    with pytest.raises(_bounded_reads.ReadBlocked):
        _bounded_reads.call(work, "waits", budget=5, process="/proc/102")
    assert time.monotonic() - started < 1 and calls.count("waits") == 1


def test_a_busy_reader_is_not_called_blocked():
    """Running (state R) past the budget is a slow node, not a read that waits."""
    def spin(item):
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            pass
        return item
    assert _bounded_reads.scan(spin, [1, 2], budget=0.1) == _bounded_reads.Outcome({0: 1, 1: 2}, [], [])


def test_a_reader_waiting_on_a_lock_of_this_process_is_not_called_blocked():
    """A futex is this process's own (the GIL on a loaded node, another thread's lock): the reader
    runs late, it waits on no other process (a read of /proc never waits on a futex)."""
    lock = threading.Lock()
    lock.acquire()
    threading.Timer(0.5, lock.release).start()

    def wait_for_lock(item):
        with lock:
            return item
    assert _bounded_reads.scan(wait_for_lock, [1, 2], budget=0.1) == _bounded_reads.Outcome({0: 1, 1: 2}, [], [])


def test_work_that_needs_isolation_is_read_again_in_a_forked_reader_that_holds_none_of_our_files():
    def work(item):
        if item == "stat" and not _bounded_reads.isolated():
            raise _bounded_reads.NeedsIsolation(item)
        return sorted(int(fd) for fd in os.listdir("/proc/self/fd")) if item == "stat" else item

    keep = os.open(os.devnull, os.O_RDONLY)
    try:
        outcome = _bounded_reads.scan(work, ["a", "stat"])
    finally:
        os.close(keep)
    fds = outcome.results[1]
    assert outcome.results[0] == "a" and keep not in fds and len(fds) <= 5, fds


def test_call_returns_raises_or_says_the_read_did_not_answer(fifo):
    assert _bounded_reads.call(os.path.basename, "/a/b") == "b"
    with pytest.raises(FileNotFoundError):
        _bounded_reads.call(os.stat, "/nonexistent/zeromib")
    with pytest.raises(_bounded_reads.ReadBlocked) as raised:
        _bounded_reads.call(os.open, fifo, os.O_RDONLY, budget=0.2)
    assert raised.value.waits_in == "wait_for_partner"


def test_call_of_work_that_needs_isolation_forks():
    def work():
        if not _bounded_reads.isolated():
            raise _bounded_reads.NeedsIsolation("x")
        return os.getpid()
    assert _bounded_reads.call(work) != os.getpid()


def test_stat_nosync_tells_what_os_stat_tells(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    for name in (os.devnull, str(path), "/proc/self/fd/0"):
        st, ours = os.stat(name), _bounded_reads.stat_nosync(name)
        assert (ours.st_mode, ours.st_uid, ours.st_dev, ours.st_ino, ours.st_rdev) == (st.st_mode, st.st_uid, st.st_dev, st.st_ino, st.st_rdev)
    with pytest.raises(FileNotFoundError):
        _bounded_reads.stat_nosync(str(tmp_path / "missing"))


MOUNTINFO = b"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
40 22 0:40 / /lustre rw shared:20 - lustre 10.0.0.1@tcp:/fs rw
41 40 0:41 / /lustre/home/al\\040ice/fuse rw,nosuid,nodev - fuse.sshfs al@host: rw,user_id=4242
42 22 0:42 / /mnt/nfs rw - nfs4 server:/export rw
"""


def test_a_stat_may_wait_only_on_a_file_system_that_ignores_the_cache_flag(monkeypatch):
    table = _mounts.MountTable(MOUNTINFO)
    assert table.fstype("/lustre/scratch/x") == "lustre" and table.fstype("/lustre/home/al ice/fuse/f") == "fuse.sshfs"
    assert table.fstype("/lustreish") == "ext4" and table.fstype("/dev/nvidia0") == "devtmpfs"
    assert [table.answers(p) for p in ("/etc/passwd", "/dev/nvidia0", "/mnt/nfs/a", "/lustre/home/al ice/fuse/f", "/tmp/x (deleted)")] == [True] * 5
    assert not table.answers("/lustre/scratch/x") and not table.all_answer
    with pytest.raises(_bounded_reads.NeedsIsolation):
        table.check("/lustre/scratch/x")
    monkeypatch.setattr(_bounded_reads, "_ISOLATED", [True])
    table.check("/lustre/scratch/x")
    assert _mounts.MountTable(MOUNTINFO.replace(b"lustre 10", b"nfs 10")).all_answer
    assert not _mounts.MountTable(b"").all_answer and not _mounts.MountTable(b"").answers("/")


def zombie_leader():
    """A real process of ours whose main thread exited (SYS_exit) while a thread runs on, with
    /dev/null open -> its pid."""
    code = ("import ctypes, os, sys, threading, time\nkeep = open(os.devnull, 'rb')\n"
            "threading.Thread(target=lambda: time.sleep(600)).start()\nsys.stdout.write('go\\n'); sys.stdout.flush()\n"
            "ctypes.CDLL(None).syscall({:d}, 0)\n".format({"x86_64": 60, "aarch64": 93}[os.uname().machine]))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"go\n"
    deadline = time.monotonic() + 10
    while holders.parse_stat(holders._read(f"/proc/{proc.pid}/stat"))[1] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


def test_a_zombie_leader_with_a_live_thread_is_read_through_that_thread():
    proc = zombie_leader()
    try:
        null = os.stat(os.devnull)
        table = _devices.DeviceTable(by_inode={(null.st_dev, null.st_ino): "/dev/nvidia0"})
        tid = holders.live_thread(proc.pid)
        assert tid and tid != proc.pid and holders.process_dir(proc.pid) == f"/proc/{proc.pid}/task/{tid}"
        assert os.listdir(f"/proc/{proc.pid}/fd") == [] and holders.open_devices(proc.pid, "/proc", table) == {"/dev/nvidia0"}
        record = holders.read_process(proc.pid)
        assert (record["state"], record["threads"], record["blocked"]) == ("Z", 2, False) and "syscall" in record["cmdline"]
        assert record["exe_path"] and holders.holds_threads(record)
        assert holders.start_time_of(proc.pid) == record["start_time"]
        assert holders.read_maps(proc.pid, "/proc", table) == {}
    finally:
        # SIGKILL to the thread group ends the live thread; the leader is then reaped.
        proc.kill()
        proc.wait(10)
    assert holders.start_time_of(proc.pid) is None


def test_a_zombie_whose_threads_all_exited_holds_nothing():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while holders.parse_stat(holders._read(f"/proc/{proc.pid}/stat"))[1] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert holders.live_thread(proc.pid) is None and holders.start_time_of(proc.pid) is None
        assert not holders.holds_threads({"state": "Z", "threads": 1})
    finally:
        proc.wait(10)


def test_what_is_told_of_a_process_that_does_not_answer_comes_from_its_status():
    record = holders.blocked_record(os.getpid(), "/proc", "mm_access")
    assert (record["pid"], record["uid"], record["blocked"], record["waits_in"]) == (os.getpid(), os.getuid(), True, "mm_access")
    assert record["start_time"] is None and record["cmdline"] == "" and record["mapped"] is None and record["name"]
    assert holders.blocked_record(2 ** 22 + 7, "/proc", None) is None


def blocked_holder(pid=777):
    return {"pid": pid, "name": "python3", "cmdline": "", "state": "S", "uid": 4242, "user": "4242", "blocked": True, "wchan": None,
            "waits_in": "mm_access", "devices": [], "mapped": None, "protected": False}


def test_a_process_that_does_not_answer_may_use_every_gpu_and_is_never_signalled():
    [record] = _attribution.attribute([blocked_holder()], [], {0: 0, 1: 1})
    assert (record["attribution"], record["gpu_indexes"], record["candidate_gpu_indexes"]) == ("blocked", [], [0, 1])
    assert not _attribution.may_signal_for(record, [0, 1], kill_spanning=True)
    assert _attribution.blocked_for([record], [1]) == [record] and _attribution.undecided_for([record], [0, 1]) == []
    assert _facts.dirty_holders([record]) == [record]
    gpus = [{"index": 0, "memory_used_mib": 4}, {"index": 1, "memory_used_mib": 0}]
    assert _attribution.footprint_gpus(gpus, [record], [], 0) == set()


def test_the_scan_limits_follow_the_timeout_option():
    assert _facts.scan_limits(10) == holders.ScanLimits(0.5, 10.0)
    assert _facts.scan_limits(1) == holders.ScanLimits(0.25, 1.0)
    assert _facts.scan_limits(None) == holders.DEFAULT_LIMITS


def test_a_scan_reports_a_process_found_blocked_earlier_in_the_run_without_waiting_again(monkeypatch):
    monkeypatch.setitem(_bounded_reads.BLOCKED, f"/proc/{os.getpid()}", "mm_access")
    started = time.monotonic()
    found = holders.scan_holders(with_maps=False)
    assert [h["waits_in"] for h in found if h["pid"] == os.getpid()] == ["mm_access"]
    assert time.monotonic() - started < 5


def test_a_killed_reader_child_is_reaped(fifo, monkeypatch):
    # Reaped at once when SIGKILL ends it before the pass returns, else by a later _reap: either
    # way no zombie child of ours stays.
    left = []
    leave = _bounded_reads._leave
    monkeypatch.setattr(_bounded_reads, "_leave", lambda pid: left.append(pid) or leave(pid))
    _bounded_reads.scan(waits_on(fifo), ["waits"], budget=0.1, isolate=True)
    assert len(left) == 1
    deadline = time.monotonic() + 5
    while _bounded_reads._LEFT and time.monotonic() < deadline:
        _bounded_reads._reap()
        time.sleep(0.02)
    assert not _bounded_reads._LEFT
    with pytest.raises(ChildProcessError):
        os.waitpid(left[0], os.WNOHANG)


def test_reads_together_start_at_once_and_wait_one_budget(fifos):
    """`together`: a reader for each item from the start, so thirty reads that wait are all under
    way within the first budget, where two readers at a time reach them one pair after another."""
    started = {}

    def work(path):
        started[path] = time.monotonic()
        os.close(os.open(path, os.O_RDONLY))

    outcome = _bounded_reads.scan(work, fifos, budget=0.1, deadline_s=5, together=True)
    assert sorted(b.item for b in outcome.blocked) == list(range(30)) and outcome.unread == []
    assert len(started) == 30 and max(started.values()) - min(started.values()) < 0.1


def test_the_wchans_of_thirty_blocked_processes_are_read_together(fifos, monkeypatch):
    """Issue 66: the wchan of a process found blocked waits as its other entries do; read two at a
    time, thirty of them filled the wchan pass's deadline (0.4 s) in every run beside another job's
    thirty blocked processes. All at once, every one is under way within one wchan budget."""
    started = {}
    by_pid = {4000 + n: path for n, path in enumerate(fifos)}
    real = _bounded_reads.wchan_of

    def wchan_of(path):
        if int(path.split("/")[2]) not in by_pid:
            return real(path)  # the readers' own (the pass's watch)
        started[path] = time.monotonic()
        os.close(os.open(by_pid[int(path.split("/")[2])], os.O_RDONLY))
        return "never"

    monkeypatch.setattr(holders, "_WCHANS", {})
    monkeypatch.setattr(_bounded_reads, "wchan_of", wchan_of)
    monkeypatch.setattr(holders, "blocked_record", lambda pid, proc, waits_in, users, wchan=False: {"pid": pid, "wchan": wchan})
    records = holders.blocked_records({pid: "mm_access" for pid in by_pid}, "/proc")
    assert [r["pid"] for r in records] == sorted(by_pid) and {r["wchan"] for r in records} == {None}
    assert len(started) == 30 and max(started.values()) - min(started.values()) < holders.WCHAN_BUDGET_S
