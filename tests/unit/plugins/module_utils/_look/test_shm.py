# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_shm: what jobs left in /dev/shm, told from what live processes hold by the kernel's identity of
each file. The holders here are real processes this test starts (a file open, a file mapped with its
fd closed, one killed), against a directory standing in for /dev/shm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _shm

HOLD = r"""
import mmap, os, sys, time
path, how = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)
keep = None
if how == "map":
    keep = mmap.mmap(fd, 4096)
    os.close(fd)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holders():
    started = []

    def start(path, how):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), how], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def write(path, mib=0.0, age_s=0):
    with open(path, "wb") as handle:
        handle.write(b"\1" * int(mib * _shm.MIB) or b"\1")
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


@pytest.mark.parametrize("name,label,clean", [
    ("nccl-Xb3kLq", "nccl-*", True),
    ("torch_4242_1298412897_0", "torch_*", True),
    ("cuda.shm.3e9.52f2.1", "cuda.shm.*", True),
    ("psm_1a2b3c4d", "psm_*", True),
    ("psm_shm.8a3f2c10-6f1e-4a2b-9c1d-0e5f7a9b3c21", "psm_shm.*", True),
    ("psm2_shm.10000000000a1b2c3d4e5f60", "psm_shm.*", True),
    ("sem.mp-k2j4h5g6", "sem.mp-*", True),
    ("pym-4242-x8k2_a1", "pym-*", True),
    ("sem.postgres_lock", "sem.*", False),
    ("torch_shm_manager_socket", None, False),
    ("psm_toolong123", None, False),
    ("pulse-shm-1234", None, False),
])
def test_each_framework_is_named_by_what_its_source_calls_its_segments(name, label, clean):
    pattern = _shm.pattern_of(name)
    assert (pattern.label if pattern else None, bool(pattern and pattern.clean)) == (label, clean)


def test_unheld_files_are_listed_largest_then_oldest_with_their_pattern(tmp_path):
    write(tmp_path / "nccl-aaaaaa", 2, age_s=10)
    write(tmp_path / "torch_1_2_0", 2, age_s=300)
    write(tmp_path / "sem.mp-small", age_s=900)
    record = _shm.look(str(tmp_path), now=time.time())
    assert [(os.path.basename(f["path"]), f["pattern"]) for f in record["unheld"]] == [
        ("torch_1_2_0", "torch_*"), ("nccl-aaaaaa", "nccl-*"), ("sem.mp-small", "sem.mp-*")]
    first = record["unheld"][0]
    assert first["size_mib"] == 2.0 and 299 <= first["age_s"] <= 302 and first["user"] == "root"
    assert record["files"] == 3 and record["unheld_mib"] == pytest.approx(4.0, abs=0.01)
    assert record["size_mib"] > 0 and record["free_mib"] > 0 and record["error"] is None


def test_a_file_open_or_mapped_by_a_live_process_is_held_and_a_killed_holders_is_not(tmp_path, holders):
    opened = write(tmp_path / "nccl-opened", 1)
    mapped = write(tmp_path / "torch_7_7_0", 1)
    left = write(tmp_path / "torch_8_8_0", 1)
    holders(opened, "open")
    holders(mapped, "map")  # fd closed: only /proc/PID/maps shows it
    killed = holders(left, "map")
    assert {f["path"] for f in _shm.look(str(tmp_path))["unheld"]} == set()
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert [f["path"] for f in _shm.look(str(tmp_path))["unheld"]] == [str(left)]


def test_a_file_of_the_same_name_open_elsewhere_is_not_stat_ed_and_keeps_the_file_listed_held(tmp_path, holders):
    # A bind mount of /dev/shm elsewhere shows its files under other paths: the name alone keeps the
    # file out of the unheld list (never removed), without a stat of a path that may not be tmpfs.
    shm = tmp_path / "shm"
    elsewhere = tmp_path / "elsewhere"
    shm.mkdir()
    elsewhere.mkdir()
    write(shm / "nccl-shared", 1)
    holders(write(elsewhere / "nccl-shared", 1), "open")
    assert _shm.look(str(shm))["unheld"] == []


def test_a_process_that_cannot_be_read_makes_the_list_incomplete(tmp_path, monkeypatch):
    # Not root (or a process the kernel will not show): a file it holds may be listed as unheld.
    write(tmp_path / "nccl-aaaaaa", 1)

    def refused(base):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(_shm, "fd_targets", refused)
    record = _shm.look(str(tmp_path))
    assert record["complete"] is False and [os.path.basename(f["path"]) for f in record["unheld"]] == ["nccl-aaaaaa"]


def test_a_process_whose_maps_do_not_answer_is_counted_blocked_and_the_pass_goes_on(tmp_path, monkeypatch):
    # A process in execve on a FUSE mount that stopped answering: its maps wait with it (a FIFO
    # stands in). The look returns within its deadline, the list incomplete, the rest read.
    write(tmp_path / "nccl-aaaaaa", 1)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    real = _shm.read_maps

    def maps(base):
        if base.endswith("/2"):
            os.close(os.open(fifo, os.O_RDONLY))
        return real(base) if base.endswith(f"/{os.getpid()}") else b""
    monkeypatch.setattr(_shm, "read_maps", maps)
    monkeypatch.setattr(_shm, "_pids", lambda proc: [1, 2, os.getpid()])
    monkeypatch.setattr(_shm, "fd_targets", lambda base: [])
    try:
        started = time.monotonic()
        holding = _shm.scan_holding(_shm.list_files(str(tmp_path)), str(tmp_path), deadline_s=5)
        assert time.monotonic() - started < 3
        assert (holding.blocked, holding.complete) == (1, False)
    finally:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


# The main thread exits (SYS_exit, as after pthread_exit in main) while a thread keeps the files:
# the leader reads Z with empty fd and maps, its live thread holds them (issue 57).
ZOMBIE_LEADER = r"""
import ctypes, mmap, os, sys, threading, time
opened = os.open(sys.argv[1], os.O_RDWR)
fd = os.open(sys.argv[2], os.O_RDWR)
keep = mmap.mmap(fd, 4096)
os.close(fd)
threading.Thread(target=lambda: time.sleep(600)).start()
print("ready", flush=True)
ctypes.CDLL(None).syscall(int(sys.argv[3]), 0)
"""


def _state(pid):
    with open(f"/proc/{pid:d}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0]


def test_a_zombie_leaders_files_are_held_through_its_live_thread(tmp_path):
    opened, mapped, left = write(tmp_path / "nccl-opened", 1), write(tmp_path / "torch_7_7_0", 1), write(tmp_path / "torch_8_8_0", 1)
    number = {"x86_64": 60, "aarch64": 93}[os.uname().machine]
    proc = subprocess.Popen([sys.executable, "-c", ZOMBIE_LEADER, str(opened), str(mapped), str(number)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while _state(proc.pid) != "Z":
            assert time.monotonic() < deadline, "the leader did not turn zombie"
            time.sleep(0.01)
        assert os.listdir(f"/proc/{proc.pid}/fd") == []
        assert [f["path"] for f in _shm.look(str(tmp_path))["unheld"]] == [str(left)]
    finally:
        # SIGKILL to the thread group ends the live thread; the leader is then reaped.
        proc.kill()
        proc.wait(10)


def test_without_processes_only_the_space_is_read(tmp_path):
    write(tmp_path / "nccl-aaaaaa", 1)
    record = _shm.look(str(tmp_path), processes=False)
    assert record["files"] == 1 and record["unheld"] is None and record["complete"] is None


def test_links_directories_and_sockets_are_no_files_of_it(tmp_path):
    write(tmp_path / "target", 1)
    os.symlink(str(tmp_path / "target"), str(tmp_path / "nccl-link"))
    os.mkdir(tmp_path / "torch_1_1_dir")
    assert [f.name for f in _shm.list_files(str(tmp_path))] == ["target"]


def test_a_missing_dev_shm_is_said_not_raised(tmp_path):
    record = _shm.look(str(tmp_path / "none"))
    assert record["error"].startswith(str(tmp_path / "none") + " cannot be read") and record["free_mib"] is None


def test_maps_lines_are_matched_by_device_and_inode_never_by_path():
    maps = (b"7f00a0000000-7f00a0400000 rw-s 00000000 00:1a 4242 /dev/shm/nccl-abcdef\n"
            b"7f00b0000000-7f00b0001000 rw-s 00000000 00:1b 4242 /somewhere/else\n"
            b"7f00c0000000-7f00c0001000 r--p 00000000 08:01 99 /usr/lib/libc.so.6\n")
    assert _shm.mapped_identities(maps, {b"00:1a", b"00:1b"}, {b"4242"}) == {(os.makedev(0, 0x1a), 4242), (os.makedev(0, 0x1b), 4242)}
    assert _shm.mapped_identities(maps, {b"00:1a"}, {b"4242", b"99"}) == {(os.makedev(0, 0x1a), 4242)}
    assert _shm.mapped_identities(maps, {b"00:1a"}, {b"7"}) == set() and _shm.maps_device(os.makedev(0, 0x1a)) == b"00:1a"
    assert _shm.maps_device(os.makedev(259, 3)) == b"103:03"


FULL = {"path": "/dev/shm", "size_mib": 64.0, "free_mib": 20.0, "unheld": [{"size_mib": 40.0, "pattern": None}], "unheld_mib": 40.0}


def test_free_space_below_the_floor_for_each_gpu_is_a_health_issue_naming_the_leftovers():
    issue = _shm.floor_issue(FULL, 128, 1)
    assert issue == ("/dev/shm has 20 MiB free of 64 MiB, below the 128 MiB that 1 GPU(s) need at 128 MiB each (shm_min_free_mib_per_gpu): "
                     "NCCL init and DataLoader workers fail with \"No space left on device\" (1 file(s) no live process holds take 40 MiB)")
    jobs = dict(FULL, unheld=[{"size_mib": 30.0, "pattern": "torch_*"}, {"size_mib": 10.0, "pattern": "sem.*"}])
    assert _shm.floor_issue(jobs, 128, 1).endswith("(2 file(s) no live process holds take 40 MiB); clean_shm (role: free_gpus_clean_shm) "
                                                   "removes such files of the jobs its run ends (1 here match job patterns)")
    assert _shm.floor_issue(FULL, 16, 1) is None and _shm.floor_issue(FULL, 0, 8) is None
    assert _shm.floor_issue(dict(FULL, free_mib=None), 128, 8) is None and _shm.floor_issue(FULL, 128, 0) is None
    summary = _shm.with_floor({"healthy": True, "health_issues": []}, issue)
    assert summary == {"healthy": False, "health_issues": [issue]}


# ------------------------------------------------------------------ whose /dev/shm it is (clean_shm's guard)

NESTED_PID, OWN_IPC = 4026532177, 4026532176
# mountinfo lines of /dev/shm as each kind of container shows it (proc(5) format).
OWN_TMPFS = "70 79 0:45 / /dev/shm rw,nosuid,nodev,relatime - tmpfs tmpfs rw,size=65536k"
# Docker's, Podman's, containerd's and CRI-O's: the tmpfs of an IPC namespace other containers may join (a pod's).
RUNTIME_TMPFS = "70 79 0:45 / /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k"
NSPAWN_SHARED = "312 300 0:61 / /dev/shm rw,nosuid,nodev shared:160 - tmpfs tmpfs rw,uid=0,gid=0"
LXC_HOST_BIND = "402 390 0:25 / /dev/shm rw,nosuid,nodev master:6 - tmpfs tmpfs rw"
SUBDIR_BIND = "88 77 254:0 /srv/guests/101/shm /dev/shm rw,relatime - ext4 /dev/vda rw"
ROOT = "47 46 254:0 / / rw,relatime - ext4 /dev/vda rw"


@pytest.mark.parametrize("lines, pid_ns, ipc_ns, said", [
    pytest.param([ROOT, OWN_TMPFS], _shm.PROC_PID_INIT_INO, _shm.PROC_IPC_INIT_INO, None, id="the-node-itself-sees-every-process"),
    pytest.param([ROOT, OWN_TMPFS], NESTED_PID, OWN_IPC, None, id="a-container-with-a-tmpfs-of-its-own"),
    pytest.param([ROOT, NSPAWN_SHARED], NESTED_PID, OWN_IPC, None, id="an-nspawn-guest-whose-systemd-made-it-shared"),
    pytest.param([ROOT, RUNTIME_TMPFS], NESTED_PID, OWN_IPC, "/dev/shm is the tmpfs a container runtime made for this container's IPC namespace "
                 "(source \"shm\"), which other containers may share (the containers of one Kubernetes pod, docker --ipc=container:NAME)",
                 id="a-pods-or-a-docker-containers-ipc-namespace"),
    pytest.param([ROOT, RUNTIME_TMPFS], _shm.PROC_PID_INIT_INO, _shm.PROC_IPC_INIT_INO, None, id="the-node-sees-every-process-of-its-pods"),
    pytest.param([ROOT, OWN_TMPFS], NESTED_PID, _shm.PROC_IPC_INIT_INO, "this container shares the node's IPC namespace", id="docker-ipc-host"),
    pytest.param([ROOT, LXC_HOST_BIND], NESTED_PID, OWN_IPC, "/dev/shm's mount receives mounts from outside this container (master:6)",
                 id="lxc-bind-of-the-hosts"),
    pytest.param([ROOT, SUBDIR_BIND], NESTED_PID, OWN_IPC, "/dev/shm is the directory /srv/guests/101/shm of a file system (ext4)",
                 id="a-directory-of-the-hosts-disk"),
    pytest.param([ROOT, OWN_TMPFS, SUBDIR_BIND], NESTED_PID, OWN_IPC, "/dev/shm is the directory /srv/guests/101/shm", id="the-mount-on-top-counts"),
])
def test_dev_shm_is_cleaned_in_a_container_only_where_nothing_says_it_is_reachable_from_outside(lines, pid_ns, ipc_ns, said):
    mounts = _shm.parse_mountinfo("\n".join(lines) + "\n")
    reason = _shm.not_private(_shm.mount_of("/dev/shm", mounts), pid_ns, ipc_ns)
    assert reason == said if said is None else reason.startswith(said), reason


def test_mountinfo_escapes_and_the_covering_mount_of_a_path_that_is_no_mount_point():
    mounts = _shm.parse_mountinfo(ROOT + "\n90 47 0:30 /a\\040b /dev rw - tmpfs dev rw\n")
    assert mounts[1].root == "/a b" and _shm.mount_of("/dev/shm", mounts).point == "/dev"
    assert _shm.mount_of("/devices", mounts).point == "/"
