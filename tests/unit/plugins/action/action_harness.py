# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""An action plugin of the collection built as Ansible builds it for a task: a real Task,
PlayContext, DataLoader and Templar (over the task's variables); the connection and the module
run on the node are fakes (the plugins' `run` is controller logic: what it sends, what it
decides). The real thing runs in tests/fleet and tests/integration."""

from __future__ import annotations

import os
import typing as t

from ansible.parsing.dataloader import DataLoader
from ansible.playbook.play_context import PlayContext
from ansible.playbook.task import Task
from ansible.template import Templar

ROLE_PATH = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "roles", "free_gpus"))


class _Shell:
    # A temporary directory already made: ActionBase.run makes none for an action that copies nothing.
    tmpdir = "/nonexistent/zeromib-test"


class FakeConnection:
    _shell = _Shell()


class FakeModule:
    """_execute_module: records each call, answers `result` (a dict, or a function of the module's arguments)."""

    def __init__(self, result: t.Any) -> None:
        self.result = result
        self.calls: list[dict[str, t.Any]] = []

    def __call__(self, module_name: str | None = None, module_args: dict[str, t.Any] | None = None, task_vars: t.Any = None,
                 **_kw: t.Any) -> dict[str, t.Any]:
        self.calls.append({"module_name": module_name, "module_args": module_args})
        return dict(self.result(module_args) if callable(self.result) else self.result)


def action(plugin_class: t.Any, task_vars: dict[str, t.Any], args: dict[str, t.Any] | None = None, check_mode: bool = False,
           name: str = "zeromib.gpu.free_gpus_gate", module_result: t.Any = None) -> t.Any:
    """The plugin's ActionModule for one task on one host; `.module` is the fake gpu_release/gpu_facts."""
    task = Task()
    task.action = name
    task.args = dict(args or {})
    task.check_mode = check_mode
    loader = DataLoader()
    plugin = plugin_class(task, FakeConnection(), PlayContext(), loader, Templar(loader=loader, variables=task_vars), None)
    plugin.module = FakeModule(module_result if module_result is not None else {})
    plugin._execute_module = plugin.module
    return plugin
