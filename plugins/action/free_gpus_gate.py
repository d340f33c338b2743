# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The free_gpus role's gate in one task per host (documented in plugins/modules/free_gpus_gate.py).

On the controller: validate the role's variables against its meta/argument_specs.yml, run
zeromib.gpu.gpu_release once on the node, turn its result into the `free_gpus_result` fact with
the free_gpus_outcome filter, and record the verdict in it. It never fails the host itself: the
role's next task (plugins/action/free_gpus_verdict.py) fails each host that is not free with
that fact's message, once, when every host's outcome is known.

Its steps live in plugin_utils/_gate.py (GateAction), which the verdict shares.
"""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _services_check
from ansible_collections.zeromib.gpu.plugins.plugin_utils._gate import (
    NOT_OPTIONS, GateAction, Invalid, NoAnswer, gate_bound_s, pause_collector_in_worker,
)
from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import failed
from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_vars import unknown_variables


class ActionModule(GateAction):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset()
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: str | None = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        pause_collector_in_worker()
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        # Ansible sets it for every task.
        host = t.cast(str, task_vars.get("inventory_hostname"))
        unknown = unknown_variables(task_vars, self._argument_spec(task_vars), not_options=NOT_OPTIONS)
        try:
            params = self._validated(task_vars)
        except Invalid as exc:
            invalid = exc.result
            if unknown and invalid.get("argument_errors"):
                # Every mistake in one pass: a typo beside a wrong type is said too (its value would be ignored).
                invalid["argument_errors"] = unknown + invalid["argument_errors"]
                invalid["msg"] = "settings mistake, nothing was done: " + "; ".join(invalid["argument_errors"])
            result.update(invalid)
            # The summary of free_gpus.yml lists this host with its error, as any failed host.
            result["ansible_facts"] = {"free_gpus_result": failed(host, invalid["msg"], "invalid")}
            return self._recorded(result)
        if unknown:
            # A typo in a variable's name: its value would be ignored (issue 55: typos stop the play).
            return self._invalid(result, host, unknown)
        elsewhere = self._mistakes_elsewhere(task_vars, host)
        if elsewhere:
            # Another host's mistake stops this one too, before anything is done (issue 67).
            return self._stopped_by(result, host, elsewhere)
        strict = bool(params.get("free_gpus_strict"))
        look = None
        if params.get("free_gpus_services"):
            try:
                look = self._services_look(params, task_vars)
            except NoAnswer:
                return self._no_answer(result, host, gate_bound_s(params))
            if strict and (look["unmatched"] or look["error"]):
                problems = [f"free_gpus_services: cannot tell which entries exist on this host: {look['error']}"] if look["error"] else [
                    "free_gpus_services: {} matches no unit, container or supervisord program on this host{}".format(
                        entry, f"; did you mean {near}?" if (near := _services_check.closest(entry, look["close"].get(entry) or [])) else "")
                    for entry in look["unmatched"]]
                return self._invalid(result, host, problems, " (free_gpus_strict)")
            if look["unmatched"] and not self._task.check_mode:
                return self._deferred(result, host, look, [])
        return self.release(result, params, task_vars, host, look)
