# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""CUDA-checkpointed holders in gpu_release (issue 70; the readings: _look/_checkpoint).

Where root's own cuda-checkpoint exists, each holder the run is to signal is asked its state:
- checkpointed (dormant: about 0 MiB now, its memory comes back when it is restored) is refused
  before anything is done, named with the sentence and what to do, unless `kill_checkpointed`;
- running (or locked) is locked and checkpointed just before it is signalled: killing a restored
  process can hard-hang the host (NVIDIA/cuda-checkpoint#53), one that no longer refers to the GPU
  cannot; the GPU is then proven at 0 MiB as for any holder.
Every call is bounded, and all of them together (BOUND_S): a tool that hangs or fails is said in
the warnings and the holder is signalled as it would have been without the tool (the GPU's reading,
never the tool's word, decides the verdict). Imported by the freeing room only (_act/_freeing).
"""

from __future__ import annotations

import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _checkpoint as look
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._act._guest_reach import run_bounded

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

# All of a run's cuda-checkpoint calls together (a checkpoint copies a holder's GPU memory to the
# host: tens of GiB take seconds), and the lock's own wait, which the tool takes in milliseconds.
BOUND_S = 60.0
LOCK_MS = 5000

Runner = t.Callable[[t.Sequence[str], float], "look.Answer"]


def run(argv: t.Sequence[str], timeout: float) -> look.Answer:
    """One bounded call (its own session, a clean environment; ended past `timeout`: rc 124)."""
    rc, out, err = run_bounded(argv, timeout, limit=look.ANSWER_BYTES)
    return look.Answer(rc, out, err)


class Checkpoints:
    """The run's cuda-checkpoint: its path (None: none that root may run), the states read, by
    (pid, start time), and one deadline for every call."""

    def __init__(self, tool: str | None, runner: Runner = run, bound_s: float = BOUND_S, now: t.Callable[[], float] = time.monotonic) -> None:
        self.tool = tool
        self.runner = runner
        self.now = now
        self.deadline = now() + bound_s
        self.states: dict[tuple[int, int | None], str | None] = {}
        self.problems: list[str] = []

    def _call(self, args: t.Sequence[str], most_s: float = look.CALL_S) -> look.Answer:
        left = min(most_s, self.deadline - self.now())
        if left <= 0 or not self.tool:
            return look.Answer(124, "", "")
        return self.runner([self.tool] + list(args), left)

    def state(self, holder: Holder) -> str | None:
        """The holder's state (read once a run), or None: unknown (no CUDA, a failed call)."""
        key = (holder["pid"], holder.get("start_time"))
        if key not in self.states:
            answer = self._call(["--get-state", "--pid", str(holder["pid"])])
            self.states[key] = look.parse_state(answer.rc, answer.out)
            if answer.rc == 124:
                self.problems.append(f"pid {holder['pid']:d}: {look.describe(answer)} (--get-state)")
        return self.states[key]

    def suspend(self, holder: Holder, state: str) -> str | None:
        """Lock (when running) and checkpoint the holder -> None, or why it was not done."""
        pid = str(holder["pid"])
        steps = ([["--action", "lock", "--pid", pid, "--timeout", str(LOCK_MS)]] if state == look.RUNNING else []) + [
            ["--action", "checkpoint", "--pid", pid]]
        for args in steps:
            answer = self._call(args, BOUND_S)
            if answer.rc != 0:
                return f"{look.describe(answer)} at {args[1]}"
        self.states[(holder["pid"], holder.get("start_time"))] = look.CHECKPOINTED
        return None


def described(holder: Holder) -> str:
    name = holder.get("name") or "?"
    user = holder.get("user") or f"uid {holder.get('uid')}"
    return f"pid {holder['pid']:d} ({name}, {user})"


def refusal(dormant: t.Sequence[Holder]) -> str:
    """The first sentence a user reads when checkpointed holders are refused; pure."""
    who = ", ".join(described(h) for h in dormant)
    return (f"CUDA-checkpointed process(es) hold the selected GPUs' memory in host memory and take it back when restored: {who}; "
            "nothing was done. They read about 0 MiB now, so the GPUs look free but are not: restore and stop them through whoever "
            "checkpointed them (`cuda-checkpoint --toggle --pid PID`, then stop the process), or set kill_checkpointed: true "
            "(role: free_gpus_kill_checkpointed) to end them and lose their saved state.")


def for_release(release: t.Any, plan: t.Any) -> None:
    """Plan time: the states of the targets; checkpointed ones refused unless kill_checkpointed.
    No cuda-checkpoint that root may run: nothing is asked, nothing changes."""
    tool = look.find_tool()
    if not tool or not plan.targets:
        return
    checkpoints = Checkpoints(tool)
    plan.checkpoints = checkpoints
    dormant = [h for h in plan.targets if checkpoints.state(h) == look.CHECKPOINTED]
    release.result["warnings"].extend(checkpoints.problems)
    del checkpoints.problems[:]
    if dormant and not release.options.kill_checkpointed:
        words = refusal(dormant)
        if hasattr(release, "refusal"):
            # The Slurm hook's run (_slurm/_jobcheck.JobRelease): a refusal is its first cause, not the GPU's reading.
            release.refusal = words
        raise StepFailed(words)
    if dormant:
        release.result["warnings"].append(
            "kill_checkpointed: ending CUDA-checkpointed process(es) " + ", ".join(described(h) for h in dormant) + "; their saved state is lost")


def before_signals(release: t.Any, plan: t.Any, targets: list[Holder]) -> None:
    """Just before the signals: each running or locked target is checkpointed (its memory off the
    GPU), into the result's `checkpointed_holders`; what could not be done is a warning, and the
    holder is signalled as without the tool."""
    checkpoints = getattr(plan, "checkpoints", None)
    if checkpoints is None:
        return
    done = release.result.setdefault("checkpointed_holders", [])
    for holder in targets:
        if holder.get("start_time") is not None and holders_mod.start_time_of(holder["pid"], release.system.proc) != holder.get("start_time"):
            continue  # gone (or its PID reused) since the look: nothing of its to suspend
        state = checkpoints.state(holder)
        if state not in (look.RUNNING, look.LOCKED):
            continue
        started = checkpoints.now()
        why = checkpoints.suspend(holder, state)
        if why:
            release.result["warnings"].append(f"{described(holder)} was not checkpointed before its signal: {why}")
        else:
            done.append({"pid": holder["pid"], "name": holder.get("name"), "state_before": state,
                         "checkpoint_s": round(checkpoints.now() - started, 3)})
    release.result["warnings"].extend(checkpoints.problems)
    del checkpoints.problems[:]
