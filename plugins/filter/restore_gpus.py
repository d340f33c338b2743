# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""restore_gpus_summary: restore_gpus.yml's fleet summary, one line per host."""

from __future__ import annotations

import typing as t

from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain
from ansible_collections.zeromib.gpu.plugins.plugin_utils._restore_summary import summary_lines


def restore_gpus_summary(hostvars: t.Any, hosts: t.Any, check_mode: bool = False) -> list[str]:
    """hostvars and the play's hosts -> one line per host (what was put back), worst first."""
    if not isinstance(hosts, (list, tuple)):
        raise AnsibleFilterError(f"restore_gpus_summary expects the play's hosts as a list, got {type(hosts).__name__}")
    results = {}
    for host in hosts:
        try:
            results[str(host)] = plain(hostvars[host].get("restore_gpus_result"))
        except (KeyError, AttributeError):
            results[str(host)] = None
    return summary_lines(results, [str(h) for h in hosts], bool(check_mode))


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"restore_gpus_summary": restore_gpus_summary}
