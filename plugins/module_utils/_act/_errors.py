# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The errors of gpu_release: StepFailed, raised by the rooms Release orchestrates (units,
containers, supervisor programs, MPS, signals) with what they did before; ReleaseError, raised by
Release alone with the whole result."""

from __future__ import annotations

import typing as t


class StepFailed(Exception):
    """A planner or actor cannot go on. `done` is its own record of what it did before (for
    example the containers it already stopped), which Release folds into the result before it
    raises ReleaseError: the failure keeps what gpu_restore must put back."""

    def __init__(self, msg: str, done: t.Any = None) -> None:
        super().__init__(msg)
        self.msg = msg
        self.done = done


class ReleaseError(Exception):
    """The GPUs could not be freed, or the request cannot be carried out. `result` is what
    was done up to then (a failure keeps the record of stopped units and signalled PIDs)."""

    def __init__(self, msg: str, result: t.Any = None) -> None:
        super().__init__(msg)
        self.msg = msg
        self.result = result or {}
