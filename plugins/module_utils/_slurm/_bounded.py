# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the plugins and roles of
# zeromib.gpu may use it.

"""The hook's time bound: the prolog's or epilog's work runs in a forked child that the hook
process stops waiting for at its deadline, so that slurmd always gets the hook's own answer (a
drain reason naming what hung) before PrologEpilogTimeout kills it with none.

Every step of the work has a bound of its own (nvidia-smi's `timeout`, `kill_timeout`,
`wait_timeout`, `settle_timeout`, the bounded reads of the scan); this is the bound of their sum
and of what has none: a child stuck in the kernel (a read of a wedged driver's file, a D-state
wait) cannot be interrupted, only left behind. The parent SIGKILLs it, does not wait for a child
that cannot die, and answers. A thread would not do: a process exits only when all its threads
have, so slurmd would wait for the stuck one."""

from __future__ import annotations

import json
import os
import select
import signal
import time
import typing as t

# How long the parent waits for a killed child to be reaped before it answers without it.
REAP_S = 0.2


class Outcome(t.NamedTuple):
    finished: bool           # the work ended (with a value or an error) before the deadline
    value: t.Any             # what the work returned (JSON round trip), None if it did not finish
    error: str | None        # "ExceptionType: text" of an exception the work raised
    stage: str | None        # the last stage the work noted: where it was when the deadline came
    elapsed_s: float


def run_bounded(work: t.Callable[[t.Callable[[str], None]], t.Any], seconds: float,
                now: t.Callable[[], float] = time.monotonic) -> Outcome:
    """work(note) in a forked child, for at most `seconds`. `note(stage)` tells the parent where
    the work is (for the cause when it does not finish). What work returns must be JSON."""
    started = now()
    try:
        read_fd, write_fd = os.pipe()
    except OSError:
        return run_inline(work, started, now)
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return run_inline(work, started, now)
    if pid == 0:  # pragma: no cover - the child's lines run in the fork (their effect is tested)
        os.close(read_fd)
        _child(work, write_fd)
    os.close(write_fd)
    try:
        messages, finished = _read_until(read_fd, started + seconds, now)
    finally:
        os.close(read_fd)
    if not finished:
        _kill(pid)
    else:
        _reap(pid, REAP_S)
    return _outcome(messages, finished, now() - started)


def run_inline(work: t.Callable[[t.Callable[[str], None]], t.Any], started: float, now: t.Callable[[], float]) -> Outcome:
    """No fork possible (no memory, no PIDs left): the work in this process, bounded by its
    steps' own bounds only."""
    stages: list[str] = []
    try:
        value = work(stages.append)
        return Outcome(True, value, None, stages[-1] if stages else None, now() - started)
    except Exception as exc:  # pylint: disable=broad-exception-caught
        return Outcome(True, None, f"{type(exc).__name__}: {exc}", stages[-1] if stages else None, now() - started)


def _child(work: t.Callable[[t.Callable[[str], None]], t.Any], write_fd: int) -> t.NoReturn:  # pragma: no cover - runs in the fork
    code = 0
    try:
        out = os.fdopen(write_fd, "w", encoding="utf-8")

        def note(stage: str) -> None:
            out.write(json.dumps({"stage": stage}) + "\n")
            out.flush()

        try:
            message = {"value": work(note)}
        except BaseException as exc:  # pylint: disable=broad-exception-caught
            message, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        out.write(json.dumps(message, default=str) + "\n")
        out.flush()
    except BaseException:  # pylint: disable=broad-exception-caught
        code = 2
    finally:
        # Never back into the caller's code (a test runner, the parent's own exit handlers).
        os._exit(code)


def _read_until(fd: int, deadline: float, now: t.Callable[[], float]) -> tuple[list[dict[str, t.Any]], bool]:
    """The child's JSON lines until it closes its end (finished) or the deadline passes."""
    chunks: list[bytes] = []
    while True:
        left = deadline - now()
        if left <= 0:
            return _lines(chunks), False
        ready, _w, _x = select.select([fd], [], [], left)
        if not ready:
            continue
        data = os.read(fd, 65536)
        if not data:
            return _lines(chunks), True
        chunks.append(data)


def _lines(chunks: list[bytes]) -> list[dict[str, t.Any]]:
    messages = []
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        try:
            messages.append(json.loads(line))
        except ValueError:
            continue  # a line cut by the kill
    return messages


def _outcome(messages: list[dict[str, t.Any]], finished: bool, elapsed: float) -> Outcome:
    stages = [m["stage"] for m in messages if "stage" in m]
    ends = [m for m in messages if "value" in m or "error" in m]
    stage = stages[-1] if stages else None
    if not ends:
        # EOF without an answer: the child died (killed by someone, out of memory).
        return Outcome(False, None, "the work ended without an answer" if finished else None, stage, elapsed)
    end = ends[-1]
    return Outcome(True, end.get("value"), end.get("error"), stage, elapsed)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return
    _reap(pid, REAP_S)


def _reap(pid: int, seconds: float) -> None:
    """Reap the child within `seconds`, else leave it: one stuck in the kernel dies later, and a
    hook that waited for it would be killed by slurmd instead of answering."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() >= deadline:
            return
        time.sleep(0.005)
