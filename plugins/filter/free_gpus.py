# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Filters of the free_gpus role and playbook: one host's outcome, and the fleet summary."""

from __future__ import annotations

import typing as t
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _outcome
from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import Outcome
from ansible_collections.zeromib.gpu.plugins.plugin_utils._summary import summary_lines


def free_gpus_outcome(result: t.Any, host: str, expected_count: int | None = 0, check_mode: bool = False,
                      require_healthy: bool = False) -> Outcome:
    """A gpu_release result -> the `free_gpus_result` fact: status, MiB before/after, a message.

    The verdict (whether the host passes) is the role's gate's own (plugin_utils/_verdict.py)."""
    if not isinstance(result, Mapping):
        raise AnsibleFilterError(f"free_gpus_outcome expects the registered result of zeromib.gpu.gpu_release, got {type(result).__name__}")
    return _outcome.outcome(result, host, expected_count, check_mode, require_healthy)


free_gpus_failed = _outcome.failed


GATE_ACTIONS = ("zeromib.gpu.free_gpus_gate", "free_gpus_gate")


def _failed_in_gate(failed_task: object) -> bool:
    return isinstance(failed_task, Mapping) and failed_task.get("action") in GATE_ACTIONS


def free_gpus_rescued(failed_result: t.Any, host: str, own_result: t.Any = None, failed_task: t.Any = None, hostvars: t.Any = None,
                      play_hosts_all: t.Iterable[str] | None = None, play_hosts: t.Iterable[str] | None = None) -> Outcome:
    """The role's rescue -> this host's `free_gpus_result`.

    A host whose gate failed: the outcome the gate returned (a failed task keeps no facts), or one
    made from its message. A host whose gate passed is here because another host failed under
    any_errors_fatal (or max_fail_percentage): its own outcome, with `stopped_by` naming the
    hosts that failed and a message saying so."""
    if isinstance(failed_result, Mapping) and (failed_task is None or _failed_in_gate(failed_task)):
        outcome = (failed_result.get("ansible_facts") or {}).get("free_gpus_result")
        message = failed_result.get("msg") or "free_gpus failed"
        if isinstance(outcome, Mapping) and outcome.get("host") == host:
            outcome = t.cast(Outcome, dict(outcome))
            outcome["ok"] = False
            outcome["message"] = outcome.get("message") or message
            return outcome
        return free_gpus_failed(host, message)
    failed = []
    missing = []
    hostvars = hostvars if hostvars is not None else {}
    live = set(play_hosts or [])
    for other in play_hosts_all or []:
        if other == host:
            continue
        try:
            variables = hostvars[other]
            task = variables.get("ansible_failed_task")
            result = variables.get("free_gpus_result")
        except (KeyError, AttributeError, TypeError):
            task, result = None, None
        if _failed_in_gate(task):
            failed.append(other)
        elif other not in live and not isinstance(result, Mapping):
            missing.append(other)
    return _outcome.stopped(own_result, host, failed, missing)


def free_gpus_summary(data: t.Any, hosts: list[str] | None = None, live: t.Container[str] | None = None) -> list[str]:
    """Outcomes, or hostvars, -> fleet summary lines, worst first (plugin_utils._summary). A host of
    `hosts` without an outcome (unreachable, or failed before gpu_release ran) is listed too."""
    return summary_lines(data, hosts, live)


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"free_gpus_outcome": free_gpus_outcome, "free_gpus_summary": free_gpus_summary, "free_gpus_rescued": free_gpus_rescued}
