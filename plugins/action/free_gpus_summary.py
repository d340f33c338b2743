# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""free_gpus.yml's fleet summary in one controller step (documented in plugins/modules/free_gpus_summary.py).

Reads each play host's `free_gpus_result` (the gate's fact, or the rescue's) and
`_free_gpus_failure` (free_gpus.yml's rescue) once, raw, from the variable manager's caches, and
returns the summary lines (`msg`, as the free_gpus_summary filter words them) and the play's
hosts that are not free (`not_free`), which the play's last two tasks read.

Why an action and not `debug` over `hostvars`: the template compiled the summary's Jinja in the
worker, loaded the filter plugin there, and built every host's whole variables to read one fact,
and a second template in the play did the same again to decide which hosts to fail: ~50 ms of
a one-host play on the 2-core machine, most of the gap between free_gpus.yml and its role alone
(benchmarks/HISTORY.md, "The clean gate's cost, sixth round"), and seconds at a
thousand hosts.
"""

from __future__ import annotations

import typing as t
from collections.abc import Mapping

from ansible.plugins.action import ActionBase

from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain
from ansible_collections.zeromib.gpu.plugins.plugin_utils._play_vars import play_vars
from ansible_collections.zeromib.gpu.plugins.plugin_utils._summary import summary_lines

# What the playbook's hosts set: the role's outcome, and the playbook's rescue's message. One name
# per line: Ansible's documentation reader warns on a tuple assignment at module level (seen in
# ansible-lint's output).
OUTCOME = "free_gpus_result"
FAILURE = "_free_gpus_failure"
# The role's gate's registered result: for a host Ansible could not reach, its SSH error.
GATE = "__free_gpus_gate"


def not_free(variables: t.Mapping[str, t.Mapping[str, t.Any]], live: t.Iterable[str]) -> list[str]:
    """The hosts of `live` (the play's hosts left) whose GPUs are not free: the rescue recorded a
    failure, or no outcome says ok (none at all: the host failed before its gate)."""
    hosts = []
    for host in live:
        values = variables.get(host) or {}
        outcome = values.get(OUTCOME)
        if values.get(FAILURE) is not None or not (isinstance(outcome, Mapping) and outcome.get("ok")):
            hosts.append(host)
    return hosts


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset()
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: str | None = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        hosts_all = [str(h) for h in task_vars.get("ansible_play_hosts_all") or []]
        live = [str(h) for h in task_vars.get("ansible_play_hosts") or []]
        # Only the hosts still in the play are read: the others are listed unreachable whatever
        # they hold (an earlier run's cached fact), and one the caches lack costs a whole raw_get.
        variables = {host: {name: plain(value) for name, value in found.items()}
                     for host, found in play_vars(task_vars, live, (OUTCOME, FAILURE)).items()}
        gone = [host for host in hosts_all if host not in live]
        said = {host: found.get(GATE, {}).get("msg") if isinstance(found.get(GATE), Mapping) else None
                for host, found in play_vars(task_vars, gone, (GATE,)).items()} if gone else {}
        result.update({
            "msg": summary_lines(variables, hosts_all, live, said),
            "not_free": not_free(variables, live),
            # The hosts that left the play (unreachable, or failed before the gate): the play's end says so.
            "unreachable_hosts": gone,
            # Shown without -v, as debug's message is.
            "_ansible_verbose_always": True,
        })
        return result
