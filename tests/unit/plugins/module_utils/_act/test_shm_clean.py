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
    for name in ("nccl-aaaaaa", "torch_1_1_0", "sem.daemon"):
        (shm / name).write_bytes(b"x" * 8192)
    at_look = {(e.dev, e.ino) for e in entries(shm).values()}
    with open(shm / "torch_1_1_0", "rb"):  # held open by this live process
        plan = _shm_clean.clean(at_look, act=True, check_mode=True, shm=str(shm), euid=0)
        assert [r["path"] for r in plan.removed] == [str(shm / "nccl-aaaaaa")] and sorted(os.listdir(shm)) == ["nccl-aaaaaa", "sem.daemon", "torch_1_1_0"]
        assert not _shm_clean.clean(at_look, act=False, check_mode=False, shm=str(shm), euid=0).removed
        done = _shm_clean.clean(at_look, act=True, check_mode=False, shm=str(shm), euid=0)
    assert [r["pattern"] for r in done.removed] == ["nccl-*"] and [r["pattern"] for r in done.unheld] == ["sem.*"]
    assert sorted(os.listdir(shm)) == ["sem.daemon", "torch_1_1_0"] and done.warnings == []
