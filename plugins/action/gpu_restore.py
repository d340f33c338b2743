# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""zeromib.gpu.gpu_restore's controller side (the module does the work on the node): a failed
restore is said once. ansible-core 2.19 and later print a module's failure as `[ERROR]: Task
failed: Module failed: <msg>`, a 5-line `Origin:` excerpt of the task's file, and the `fatal:` line
with the same msg; through plugin_utils/_said_once.py the `fatal:` line alone carries the whole
result, as on 2.17 and 2.18, and every callback plugin receives it (no no_log).

Under playbooks/restore_gpus.yml (`_restore_gpus_summary_follows`) a failed restore does not fail
the task: its fleet summary says each host's reason, and the play's last task fails the host,
pointing there (as free_gpus.yml does). The result then keeps the module's `msg` and says
`restore_failed: true`."""

from __future__ import annotations

import typing as t

from ansible.plugins.action import ActionBase

from ansible_collections.zeromib.gpu.plugins.plugin_utils._said_once import fail_once


class ActionModule(ActionBase):
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: str | None = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        result.update(self._execute_module(module_name="zeromib.gpu.gpu_restore", module_args=dict(self._task.args), task_vars=task_vars))
        if not result.get("failed"):
            return result
        if self._templar.template(task_vars.get("_restore_gpus_summary_follows", False)):
            # 2.19's module failure carries an `exception` (its error summary), which the callback prints as [ERROR] even on an ok result.
            result.pop("exception", None)
            result.update(failed=False, restore_failed=True)
            return result
        return fail_once(result)
