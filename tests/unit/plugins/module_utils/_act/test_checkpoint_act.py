# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_act/_checkpoint's pure logic with a scripted tool: the states read once, lock then checkpoint, one
deadline for every call (the real tool on a simulated driver: tests/integration/test_checkpointed_holders.py)."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _checkpoint
from ansible_collections.zeromib.gpu.plugins.module_utils._look._checkpoint import Answer

HOLDER = {"pid": 812, "start_time": 99, "name": "python3", "user": "alice", "uid": 4242}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def scripted(answers, calls, clock=None, cost=0.0):
    def runner(argv, timeout):
        calls.append((list(argv[1:]), timeout))
        if clock is not None:
            clock.t += cost
        return answers.pop(0)
    return runner


def test_the_state_is_asked_once_a_run_per_process():
    calls = []
    ck = _checkpoint.Checkpoints("/usr/bin/cuda-checkpoint", scripted([Answer(0, "checkpointed\n", "")], calls))
    assert ck.state(HOLDER) == "checkpointed" and ck.state(HOLDER) == "checkpointed"
    assert [c[0] for c in calls] == [["--get-state", "--pid", "812"]]


def test_a_running_holder_is_locked_then_checkpointed_and_a_locked_one_only_checkpointed():
    calls = []
    ck = _checkpoint.Checkpoints("/t", scripted([Answer(0, "", ""), Answer(0, "", ""), Answer(0, "", "")], calls))
    assert ck.suspend(HOLDER, "running") is None
    assert ck.suspend(dict(HOLDER, pid=813), "locked") is None
    assert [c[0][:2] for c in calls] == [["--action", "lock"], ["--action", "checkpoint"], ["--action", "checkpoint"]]
    assert calls[0][0][-2:] == ["--timeout", str(_checkpoint.LOCK_MS)]


def test_a_failed_lock_stops_there_and_says_why():
    calls = []
    ck = _checkpoint.Checkpoints("/t", scripted([Answer(1, "", "Could not lock process 812: CUDA_ERROR_ILLEGAL_STATE")], calls))
    assert ck.suspend(HOLDER, "running") == "cuda-checkpoint failed (rc 1: Could not lock process 812: CUDA_ERROR_ILLEGAL_STATE) at lock"
    assert len(calls) == 1


def test_every_call_shares_one_deadline_and_none_is_made_past_it():
    calls, clock = [], Clock()
    ck = _checkpoint.Checkpoints("/t", scripted([Answer(124, "", "")] * 3, calls, clock, cost=4.0), bound_s=6.0, now=clock)
    assert ck.state(HOLDER) is None and calls[0][1] == 5.0
    assert ck.state(dict(HOLDER, pid=2)) is None and calls[1][1] == 2.0  # what is left of the bound
    assert ck.state(dict(HOLDER, pid=3)) is None and len(calls) == 2  # none past it
    assert len(ck.problems) == 3 and "did not answer in time" in ck.problems[0]


def test_the_refusal_names_each_dormant_holder_and_what_to_do_and_no_reset():
    words = _checkpoint.refusal([HOLDER])
    assert words.startswith("CUDA-checkpointed process(es) hold the selected GPUs' memory in host memory and take it back when restored: "
                            "pid 812 (python3, alice); nothing was done.")
    assert "kill_checkpointed: true" in words and "reset" not in words and "reboot" not in words
