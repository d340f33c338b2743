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
- free: its one line (`h1: 8 GPUs free (327752 -> 0 MiB), stopped vllm.service in 0.436 s`), `ok`.
Under free_gpus.yml (`_free_gpus_summary_follows`) nothing fails here: its fleet summary says
each host's message, then its last task (this action with `msg`) fails the hosts that are not free.
"""

from __future__ import annotations

import typing as t
from collections.abc import Mapping

from ansible.plugins.action import ActionBase

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _fleet_proof, _gate, _services_check
from ansible_collections.zeromib.gpu.plugins.plugin_utils._gate import drain_reason, is_free, say_success, should_drain
from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import failed, same_mistake_message, same_mistakes, stopped
from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain
from ansible_collections.zeromib.gpu.plugins.plugin_utils._play_vars import play_vars
from ansible_collections.zeromib.gpu.plugins.plugin_utils._said_once import fail_once

OUTCOME = "free_gpus_result"


class ActionModule(_gate.GateAction):
    """The gate's own methods (validation, release) serve a host the fleet check held back."""

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
        # ActionBase's, not the gate's
        result = ActionBase.run(self, tmp, task_vars)
        del tmp
        host = str(task_vars.get("inventory_hostname"))
        batch = [str(h) for h in task_vars.get("ansible_play_batch") or [host]]
        outcomes = {name: plain(found.get(OUTCOME)) for name, found in play_vars(task_vars, batch, (OUTCOME,)).items()}
        own = outcomes.get(host)
        if not isinstance(own, Mapping):
            own = failed(host, "the role's gate gave no result on this host", "failed")
        result["changed"] = False
        # Every host of the batch has looked (the linear strategy's lockstep); under `strategy: free`
        # some may not have yet, and no entry is called a typo on their behalf.
        all_looked = all(isinstance(outcomes.get(name), Mapping) for name in batch)
        if own.get("services_unmatched") and not self._task.args.get("msg"):
            own, result = self._fleet_checked(own, outcomes if all_looked else {host: own}, host, result, task_vars, all_looked)
        # Under any_errors_fatal a failed host stops the play here: nothing starts on a proven host.
        stops = bool(self._task.any_errors_fatal) and not self._var(task_vars, "_free_gpus_summary_follows", False) and any(
            not is_free(found) for name, found in outcomes.items() if name != host)
        if not self._task.args.get("msg") and not stops and _fleet_proof.needs_proof(own, outcomes, all_looked, bool(self._task.check_mode)):
            # Issue 72: some host was freed; this one is read once more, after the last one (plugin_utils/_fleet_proof.py).
            own = _fleet_proof.prove_host(self, own, outcomes, host, task_vars)
            result["ansible_facts"] = {OUTCOME: own}
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
            # A settings mistake the whole play shares is said once, by the first host of the batch that has it.
            in_order = [own if name == host else outcomes.get(name) for name in batch]
            first = same_mistakes(in_order).get(host) if own.get("status") == "invalid" else None
            if first:
                result["msg"] = same_mistake_message(own, first)
            # The reason, once; a fact (what the fleet check found) would be dropped from a failed result.
            return fail_once({key: result[key] for key in ("changed", "msg", "warnings") if key in result})
        # A host the fleet check held back is not failing unless its entry is a typo (its release runs now, beside this).
        not_free = [name for name in batch if name != host and name in outcomes and not is_free(outcomes[name])
                    and ((outcomes[name] or {}).get("status") != "deferred" or _services_check.fleet_typos(name, outcomes))]
        if not_free and self._task.any_errors_fatal and not self._var(task_vars, "_free_gpus_summary_follows", False):
            said = stopped(own, host, not_free, outcomes=outcomes)
            # A warning: one line without -v (an ok result would need verbose_always, which dumps the
            # whole result, facts and all).
            result.update({"msg": said["message"], "warnings": [said["message"]], "ansible_facts": {OUTCOME: said}})
            return result
        result["msg"] = own.get("message")
        if not self._var(task_vars, "_free_gpus_summary_follows", False):
            say_success(str(result["msg"]))
        return result

    def _fleet_checked(self, own: t.Mapping[str, t.Any], outcomes: t.Mapping[str, t.Any], host: str, result: dict[str, t.Any],
                       task_vars: dict[str, t.Any], all_looked: bool = True) -> tuple[t.Mapping[str, t.Any], dict[str, t.Any]]:
        """A host on which some free_gpus_services entry matches nothing: a typo if no host of the
        play matches it either (the host fails, nothing was done on it); otherwise, when the gate
        held it back, its release runs now. -> (its outcome, this task's result so far)."""
        typos = _services_check.fleet_typos(host, outcomes) if all_looked else {}
        if typos:
            outcome = failed(host, _services_check.typo_message(typos), "invalid")
        elif own.get("status") == "deferred":
            look = {"matched": own.get("services_matched") or [], "unmatched": own.get("services_unmatched") or [],
                    "close": own.get("services_close") or {}, "error": None}
            try:
                params = self._validated(task_vars)
            except _gate.Invalid as exc:
                outcome = failed(host, exc.result["msg"], "invalid")
            else:
                result = self.release(result, params, task_vars, host, look)
                outcome = result["ansible_facts"][OUTCOME]
                result["failed"] = False
        else:
            return own, result
        result["ansible_facts"] = {OUTCOME: outcome}
        return outcome, result
