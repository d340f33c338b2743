# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_shm_clean: only unheld files of a job pattern that were there at the look go; a name raced
into a link or another file is never followed nor taken for the file found unheld."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _shm_clean
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _shm

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sticky directory must be root's")


@pytest.fixture
def shm(tmp_path):
    directory = tmp_path / "shm"
    directory.mkdir()
    os.chmod(directory, 0o1777)
    return directory


def entries(directory):
    return {entry.name: entry for entry in _shm.list_files(str(directory))}


def test_only_job_patterns_there_at_the_look_are_chosen(shm):
    for name in ("nccl-aaaaaa", "sem.daemon", "my-app-state", "torch_1_1_0"):
        (shm / name).write_bytes(b"x")
    found = entries(shm)
    at_look = {(e.dev, e.ino) for name, e in found.items() if name != "torch_1_1_0"}  # made after the run started
    assert [e.name for e in _shm_clean.removable(found.values(), at_look)] == ["nccl-aaaaaa"]


def test_remove_unlinks_the_same_file_and_nothing_else(shm):
    (shm / "nccl-aaaaaa").write_bytes(b"x")
    (shm / "keep").write_bytes(b"x")
    removed, warnings = _shm_clean.remove([entries(shm)["nccl-aaaaaa"]], str(shm))
    assert [e.name for e in removed] == ["nccl-aaaaaa"] and warnings == []
    assert sorted(os.listdir(shm)) == ["keep"]


def test_a_name_swapped_for_a_link_is_removed_as_a_link_and_its_target_stays(shm, tmp_path):
    (shm / "nccl-aaaaaa").write_bytes(b"x")
    found = entries(shm)["nccl-aaaaaa"]
    precious = tmp_path / "precious"
    precious.write_bytes(b"data")
    os.unlink(shm / "nccl-aaaaaa")
    os.symlink(str(precious), str(shm / "nccl-aaaaaa"))
    removed, _warnings = _shm_clean.remove([found], str(shm))
    # Not the file found unheld (another inode): left alone, and the link's target untouched.
    assert removed == [] and os.path.islink(shm / "nccl-aaaaaa") and precious.read_bytes() == b"data"


def test_a_name_swapped_for_another_file_is_not_taken_for_the_one_found(shm):
    (shm / "torch_1_1_0").write_bytes(b"x")
    found = entries(shm)["torch_1_1_0"]
    # Kept open, the old inode cannot be reused by the new file (as tmpfs never reuses one soon).
    old = os.open(shm / "torch_1_1_0", os.O_RDONLY)
    os.unlink(shm / "torch_1_1_0")
    (shm / "torch_1_1_0").write_bytes(b"new job's")
    os.close(old)
    assert _shm_clean.remove([found], str(shm)) == ([], []) and (shm / "torch_1_1_0").read_bytes() == b"new job's"


def test_a_directory_without_the_sticky_bit_or_reached_through_a_link_is_not_touched(shm, tmp_path):
    (shm / "nccl-aaaaaa").write_bytes(b"x")
    found = entries(shm)["nccl-aaaaaa"]
    os.chmod(shm, 0o777)
    removed, warnings = _shm_clean.remove([found], str(shm))
    assert removed == [] and "not a root-owned directory with the sticky bit" in warnings[0]
    os.chmod(shm, 0o1777)
    os.symlink(str(shm), str(tmp_path / "link"))
    removed, warnings = _shm_clean.remove([found], str(tmp_path / "link"))
    assert removed == [] and warnings and (shm / "nccl-aaaaaa").exists()


def test_nothing_goes_without_root_or_when_a_process_could_not_be_read():
    holding = _shm.Holding([])
    assert _shm_clean.why_not(holding, 1000) == "clean_shm needs root (become: true): /dev/shm was not cleaned"
    holding.unreadable = 2
    assert "2 process(es) could not be read" in _shm_clean.why_not(holding, 0)
    holding.unreadable = 0
    holding.blocked = 1
    assert "1 process(es) did not answer" in _shm_clean.why_not(holding, 0) and "nothing was removed" in _shm_clean.why_not(holding, 0)
    holding.blocked = 0
    assert _shm_clean.why_not(holding, 0) is None


def test_clean_removes_what_no_live_process_holds_and_check_mode_only_lists_it(shm, monkeypatch):
    # This test's own process is the one that may hold a file (this machine's PID 1 hides its maps even from root).
    monkeypatch.setattr(_shm, "_pids", lambda proc: [os.getpid()])
    for name in ("nccl-aaaaaa", "torch_4711_1_0", "torch_1_1_0", "sem.daemon"):
        (shm / name).write_bytes(b"x" * 8192)
    at_look = {(e.dev, e.ino) for e in entries(shm).values()}
    ended = {4711: os.geteuid()}  # the job this run ended, whose PID torch_4711_* names
    with open(shm / "torch_1_1_0", "rb"):  # held open by this live process
        plan = _shm_clean.clean(at_look, act=True, check_mode=True, shm=str(shm), euid=0, ended=ended)
        assert [r["path"] for r in plan.removed] == [str(shm / "torch_4711_1_0")]
        assert sorted(os.listdir(shm)) == ["nccl-aaaaaa", "sem.daemon", "torch_1_1_0", "torch_4711_1_0"]
        assert not _shm_clean.clean(at_look, act=False, check_mode=False, shm=str(shm), euid=0, ended=ended).removed
        done = _shm_clean.clean(at_look, act=True, check_mode=False, shm=str(shm), euid=0, ended=ended)
    assert [r["pattern"] for r in done.removed] == ["torch_*"] and sorted(r["pattern"] for r in done.unheld) == ["nccl-*", "sem.*"]
    # The NCCL segment names no PID, and its owner (this test's uid) runs this very process: kept, and said why.
    [kept] = done.kept
    assert kept["path"] == str(shm / "nccl-aaaaaa")
    assert kept["why"].startswith(f"its owner (uid {os.geteuid():d}) runs processes this run did not end, which may use it (pid {os.getpid():d} ")
    assert sorted(os.listdir(shm)) == ["nccl-aaaaaa", "sem.daemon", "torch_1_1_0"] and done.warnings == []


# ------------------------------------------------------------------ which files tie to this run (issue 65)


def entry(name, uid=4242):
    return _shm.Entry(name, 1, abs(hash(name)) % 100000, uid, 4096, 0.0)


def live(pid, uid, name="python3", groups=()):
    return _shm_clean.Live(pid, name, frozenset({uid}), frozenset({uid, *groups}))


@pytest.mark.parametrize("name, pid", [
    ("torch_4711_1298412897_0", 4711), ("pym-4711-k2j4h5g6", 4711), ("cuda.shm.3.1267.0", 0x1267),
    ("nccl-Xb3kLq", None), ("psm_1a2b3c4d", None), ("sem.mp-k2j4h5g6", None), ("psm_shm.0123", None), ("torch_x_1", None),
])
def test_the_pid_a_frameworks_name_carries(name, pid):
    assert _shm_clean.named_pid(name) == pid


def test_a_file_goes_only_when_it_ties_to_a_process_this_run_ended():
    files = [
        entry("torch_4711_1_0"),                 # names the ended job's PID, its uid: goes
        entry("torch_4712_1_0", uid=4343),       # names an ended PID of another uid: no tie by name
        entry("nccl-job0aa"),                    # 4242 had a process ended and runs none now: goes
        entry("psm_1a2b3c4d", uid=4343),         # 4343's live service's block: nothing of 4343 was ended
        entry("psm_0a0b0c0d", uid=4444),         # 4444 had a job ended, and runs a service still
        entry("nccl-root01", uid=0),             # root always runs processes this run did not end
    ]
    ended = {4711: 4242, 4712: 4242, 5000: 4444, 5001: 0}
    running = [live(1, 0, "init"), live(77, 4343, "data-service"), live(88, 4444, "loader")]
    chosen, kept = _shm_clean.attribute(files, ended, running, {})
    assert [e.name for e in chosen] == ["torch_4711_1_0", "nccl-job0aa"]
    assert [(e.name, why) for e, why in kept] == [
        ("torch_4712_1_0", "this run ended no process of its owner (uid 4343)"),
        ("psm_1a2b3c4d", "this run ended no process of its owner (uid 4343)"),
        ("psm_0a0b0c0d", "its owner (uid 4444) runs processes this run did not end, which may use it (pid 88 loader)"),
        ("nccl-root01", "its owner (uid 0) runs processes this run did not end, which may use it (pid 1 init)"),
    ]


def test_a_file_its_mode_opens_to_others_stays_while_they_run():
    files = [entry("nccl-shared"), entry("nccl-group"), entry("nccl-private")]
    modes = {"nccl-shared": (0o666, 4242), "nccl-group": (0o660, 500), "nccl-private": (0o600, 500)}
    running = [live(1, 0, "init"), live(90, 4343, "reader\x0bThreads:\t2", groups=(500,))]
    chosen, kept = _shm_clean.attribute(files, {4711: 4242}, running, modes)
    assert [e.name for e in chosen] == ["nccl-private"]
    assert [(e.name, why) for e, why in kept] == [
        ("nccl-shared", "its mode (-rw-rw-rw-) lets processes this run did not end open it (pid 90 reader\\x0bThreads:\\t2)"),
        ("nccl-group", "its mode (-rw-rw----) lets processes this run did not end open it (pid 90 reader\\x0bThreads:\\t2)"),
    ]


def test_live_processes_read_each_status_once_and_leave_out_the_ended_and_the_dead(tmp_path):
    def status(pid, name, state, threads, uid, groups=""):
        (tmp_path / str(pid)).mkdir()
        text = (f"Name:\t{name}\nState:\t{state}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
                f"Groups:\t{groups}\nThreads:\t{threads}\n")
        (tmp_path / str(pid) / "status").write_text(text)

    status(10, "x\x0bThreads:\t2", "Z (zombie)", 1, 4343)        # an unreaped zombie whose name forges a thread count
    status(11, "leader", "Z (zombie)", 3, 4343)                    # a zombie leader whose threads run on: live
    status(12, "svc", "S (sleeping)", 1, 4444, "500 501")
    status(13, "ended", "S (sleeping)", 1, 4242)                   # this run's: left out
    found = _shm_clean.live_processes(str(tmp_path), ended={13})
    assert [(p.pid, p.name, sorted(p.uids), sorted(p.gids)) for p in found] == [(11, "leader", [4343], [4343]), (12, "svc", [4444], [500, 501, 4444])]
