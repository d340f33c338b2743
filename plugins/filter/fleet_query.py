# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: fleet_query
short_description: Query fleet GPU data with a JMESPath expression
version_added: 0.1.0
author: zeromib.gpu developers
description:
  - Evaluates a JMESPath expression against any data structure, typically the audit model built by
    P(zeromib.gpu.gpu_audit_model#filter) or a list of C(ansible_facts.gpu) dictionaries.
  - Works like C(community.general.json_query) without the dependency on that collection, and
    converts Ansible's own string, list and dictionary types to plain Python first, so JMESPath
    functions such as C(contains), C(length) and C(sort_by) type-check as expected.
  - Needs the C(jmespath) Python library on the controller (not on managed nodes).
positional: expr
options:
  _input:
    description: The data to query.
    type: raw
    required: true
  expr:
    description:
      - A JMESPath expression, see U(https://jmespath.org/specification.html).
      - Or a dictionary of name to expression, to run several queries over the same data in one
        pass; the result is then a dictionary with the same names.
      - A bad expression fails with the parser's message and the expression itself.
    type: raw
    required: true
requirements:
  - jmespath (Python library, on the controller)
seealso:
  - plugin: zeromib.gpu.gpu_audit_model
    plugin_type: filter
"""

EXAMPLES = r"""
- name: Names of the hosts that are not clean
  ansible.builtin.debug:
    msg: "{{ report | zeromib.gpu.fleet_query(\"hosts[?status != 'clean'].host\") }}"
  # => ["node03", "node07"]

- name: Every dirty GPU in the fleet, with its host
  ansible.builtin.debug:
    msg: "{{ report | zeromib.gpu.fleet_query('hosts[].gpus[] | [?!clean].[host, index, memory_used_mib]') }}"
  # => [["node03", 0, 10267]]

- name: GPUs above a threshold given in a variable (JMESPath literals go in backticks)
  ansible.builtin.debug:
    msg: "{{ report | zeromib.gpu.fleet_query('hosts[].gpus[] | [?used_pct > `' ~ busy_pct ~ '`].uuid') }}"

- name: Several queries at once
  ansible.builtin.set_fact:
    findings: "{{ report | zeromib.gpu.fleet_query(queries) }}"
  vars:
    queries:
      not_clean: "hosts[?status != 'clean'].host"
      busiest: "max_by(hosts[].gpus[], &memory_used_mib).[host, index]"
  # => {"not_clean": ["node03"], "busiest": ["node03", 0]}

- name: Holders that run inside a systemd unit, straight from gathered facts
  ansible.builtin.debug:
    msg: "{{ ansible_facts.gpu | zeromib.gpu.fleet_query('holders[?unit != null].{pid: pid, unit: unit}') }}"
"""

RETURN = r"""
_value:
  description:
    - What the expression selects; V(null) when nothing matches a plain path.
    - A dictionary of results when O(expr) is a dictionary.
  type: raw
"""

import typing as t
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain
from ansible_collections.zeromib.gpu.plugins.plugin_utils._query import NO_JMESPATH, jmespath, search, search_plain

# The queries are plugin_utils/_query.py's (the report action uses them too).
__all__ = ["FilterModule", "fleet_query", "search_plain"]


def fleet_query(data: t.Any, expr: t.Any) -> t.Any:
    if jmespath is None:
        raise AnsibleFilterError(NO_JMESPATH)
    if isinstance(expr, Mapping):
        data = plain(data)
        return {str(name): search(data, one) for name, one in expr.items()}
    return search(plain(data), expr)


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"fleet_query": fleet_query}
