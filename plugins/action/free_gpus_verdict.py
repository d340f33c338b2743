# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The free_gpus role's last task (documented in plugins/modules/free_gpus_verdict.py).

The gate (plugins/action/free_gpus_gate.py) records each host's outcome in `free_gpus_result`
and never fails. This task runs when every host of the batch has its outcome, and for each host:
- not free: drains its Slurm node when `free_gpus_on_failure` says so, then fails with the
  outcome's message, once (plugin_utils/_said_once.py): the one failure of the host, the line a
  rescue around the role reads in `ansible_failed_result.msg`, the result callbacks receive;
- free, while other hosts of the batch are not and the task is `any_errors_fatal`: warns which
  hosts stop the play, and how to put back what its own run stopped;
- free: nothing to say (`ok`).
Under free_gpus.yml (`_free_gpus_summary_follows`) nothing fails here: its fleet summary says
each host's message, then its last task (this action with `msg`) fails the hosts that are not free.
"""

from __future__ import annotations

import typing as t
from collections.abc import Mapping

from ansible.plugins.action import ActionBase

from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import failed, stopped
from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain
from ansible_collections.zeromib.gpu.plugins.plugin_utils._play_vars import play_vars
from ansible_collections.zeromib.gpu.plugins.plugin_utils._said_once import fail_once

OUTCOME = "free_gpus_result"


def is_free(outcome: t.Any) -> bool:
    return isinstance(outcome, Mapping) and bool(outcome.get("ok"))


def drain_reason(outcome: t.Mapping[str, t.Any], host: str) -> str:
    """The outcome's message without the host's name (Slurm's node is the host)."""
    message = str(outcome.get("message") or "GPUs could not be freed")
    return message[len(host) + 2:] if message.startswith(f"{host}: ") else message


def should_drain(outcome: t.Mapping[str, t.Any], on_failure: t.Any, check_mode: bool) -> bool:
    """free_gpus_on_failure=drain drains a host whose GPUs could not be freed or are unhealthy; a
    settings mistake (nothing was done, nothing is wrong with the node) drains nothing."""
    return str(on_failure) == "drain" and not check_mode and outcome.get("status") != "invalid"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(["msg"])
    _supports_check_mode = True
    _supports_async = False

    def _var(self, task_vars: t.Mapping[str, t.Any], name: str, default: t.Any) -> t.Any:
        return self._templar.template(task_vars.get(name, default))

    def _drain(self, outcome: t.Mapping[str, t.Any], host: str, task_vars: dict[str, t.Any]) -> list[str]:
        """Drain this host's Slurm node (zeromib.gpu.slurm_node); a drain that fails is a warning:
        the host fails anyway, with its own reason."""
        args = {"state": "drained", "reason": drain_reason(outcome, host)}
        node_name = self._var(task_vars, "free_gpus_slurm_node_name", "")
        if node_name:
            args["node_name"] = node_name
        done = self._execute_module(module_name="zeromib.gpu.slurm_node", module_args=args, task_vars=task_vars)
        if done.get("failed"):
            return [f"{host}: could not drain its Slurm node (free_gpus_on_failure=drain): {done.get('msg')}"]
        return []

    def run(self, tmp: str | None = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        host = str(task_vars.get("inventory_hostname"))
        batch = [str(h) for h in task_vars.get("ansible_play_batch") or [host]]
        outcomes = {name: plain(found.get(OUTCOME)) for name, found in play_vars(task_vars, batch, (OUTCOME,)).items()}
        own = outcomes.get(host)
        if not isinstance(own, Mapping):
            own = failed(host, "the role's gate gave no result on this host", "failed")
        result["changed"] = False
        if self._task.args.get("msg"):
            # free_gpus.yml's last task: the reason is in its summary; this fails the host pointing to it.
            result["msg"] = str(self._task.args["msg"])
            return fail_once(result)
        if not is_free(own):
            warnings: list[str] = []
            if should_drain(own, self._var(task_vars, "free_gpus_on_failure", "none"), bool(self._task.check_mode)):
                warnings = self._drain(own, host, task_vars)
            if warnings:
                result["warnings"] = warnings
            result["msg"] = own.get("message") or f"{host}: GPUs not free"
            if self._var(task_vars, "_free_gpus_summary_follows", False):
                # free_gpus.yml: its summary says the message, then the play fails the host.
                return result
            return fail_once(result)
        not_free = [name for name in batch if name != host and name in outcomes and not is_free(outcomes[name])]
        if not_free and self._task.any_errors_fatal and not self._var(task_vars, "_free_gpus_summary_follows", False):
            said = stopped(own, host, not_free)
            # A warning: one line without -v (an ok result would need verbose_always, which dumps the
            # whole result, facts and all).
            result.update({"msg": said["message"], "warnings": [said["message"]], "ansible_facts": {OUTCOME: said}})
            return result
        result["msg"] = own.get("message")
        return result
