# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_look/_checkpoint: cuda-checkpoint's answer parsed, and which file root may run as the tool."""

from __future__ import annotations

import os

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _checkpoint


def test_only_one_known_word_with_rc_0_is_a_state():
    assert _checkpoint.parse_state(0, "running\n") == "running"
    assert _checkpoint.parse_state(0, "Checkpointed\n") == "checkpointed"
    assert _checkpoint.parse_state(1, "running\n") is None  # a failed call says nothing
    assert _checkpoint.parse_state(0, "running\nchecked\n") is None and _checkpoint.parse_state(0, "") is None


def test_the_failure_words_say_a_hang_apart_from_a_failure():
    assert _checkpoint.describe(_checkpoint.Answer(124, "", "")) == "cuda-checkpoint did not answer in time"
    assert _checkpoint.describe(_checkpoint.Answer(1, "", "Could not lock process 5:\nCUDA_ERROR_ILLEGAL_STATE")) == (
        "cuda-checkpoint failed (rc 1: Could not lock process 5: CUDA_ERROR_ILLEGAL_STATE)")


def _tool(directory, mode=0o755):
    path = directory / "cuda-checkpoint"
    path.write_text("#!/bin/sh\n")
    os.chmod(path, mode)
    return path


def test_a_file_others_may_write_or_in_a_directory_others_may_write_is_never_run(tmp_path):
    # tmp_path lies below /tmp (writable by all, sticky): root's own directories are the only trusted ones.
    assert os.getuid() != 0 or not _checkpoint.trusted(str(_tool(tmp_path)))
    assert _checkpoint.find_tool((str(tmp_path),)) is None
    closed = tmp_path / "bin"
    closed.mkdir(mode=0o755)
    assert not _checkpoint.trusted(str(_tool(closed, 0o777)))


def test_a_tenants_file_in_a_root_directory_is_never_run(tmp_path):
    path = _tool(tmp_path)
    if os.getuid() == 0:
        os.chown(path, 4242, 4242)
    assert not _checkpoint.trusted(str(path))
    assert not _checkpoint.trusted(str(tmp_path / "missing"))


def test_root_s_own_tool_in_a_closed_system_directory_is_run():
    # /bin/sh stands for the tool: root's, mode 755, in root's closed directories.
    assert _checkpoint.trusted("/bin/sh") == (os.stat(os.path.realpath("/bin/sh")).st_uid == 0)
