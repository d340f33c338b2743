# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The first task of the restore_gpus and slurm_gpu_checks roles (documented in
plugins/modules/role_variables_check.py): their variables checked before anything is done, as
the free_gpus gate checks its own - a typo names the closest known variable, a wrong type is said
in the collection's words (plugin_utils/_role_spec.py) - and a mistake fails the host once
(plugin_utils/_said_once.py: no `[ERROR]` and `Origin:` excerpt repeating it on ansible-core 2.19+)."""

from __future__ import annotations

import typing as t

from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.plugins.action import ActionBase

from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_spec import ROLE_TYPES, type_problems
from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_vars import role_options, unknown_variables
from ansible_collections.zeromib.gpu.plugins.plugin_utils._said_once import fail_once


def problems(settings: t.Mapping[str, t.Any], options: t.Mapping[str, t.Any], prefix: str, not_options: t.Container[str] = ()) -> list[str]:
    """The typos first (their values are ignored), then the values of a wrong type."""
    typos = unknown_variables(list(settings), options, prefix, "zeromib.gpu." + prefix.rstrip("_"), not_options)
    return typos + type_problems(settings, options, ROLE_TYPES[prefix])


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(["prefix", "not_options"])
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: str | None = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        prefix = str(self._task.args.get("prefix") or "")
        if prefix not in ROLE_TYPES:
            raise AnsibleActionFail("prefix must be one of {}, got {!r}".format(", ".join(sorted(ROLE_TYPES)), prefix))
        options = role_options(str(task_vars.get("role_path") or ""))
        if options is None:
            raise AnsibleActionFail("zeromib.gpu.role_variables_check runs inside a role of zeromib.gpu (no meta/argument_specs.yml in role_path)")
        names = [name for name in task_vars if isinstance(name, str) and name.startswith(prefix)]
        try:
            settings = self._templar.template({name: task_vars[name] for name in names})
        except AnsibleError as exc:
            found = ["a {}* variable cannot be templated: {}".format(prefix, " ".join(str(getattr(exc, "message", exc)).split()))]
        else:
            found = problems(settings, options, prefix, frozenset(self._task.args.get("not_options") or ()))
        result["changed"] = False
        if found:
            # The reason once: msg alone, as the free_gpus verdict's (a list beside it would print it twice).
            result["msg"] = "settings mistake, nothing was done: " + "; ".join(found)
            return fail_once(result)
        result["msg"] = "the role's variables are fine"
        return result
