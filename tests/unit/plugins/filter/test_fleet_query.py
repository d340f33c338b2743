# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""fleet_query: JMESPath over the audit model and over raw gpu facts."""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.filter import fleet_query as fq
from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_model import gpu_audit_model
from ansible_collections.zeromib.gpu.tests.unit.plugins.filter import audit_hosts as ah

MODEL = gpu_audit_model(ah.fleet(), 1748779200.0)


@pytest.mark.parametrize("expr, expected", [
    pytest.param("hosts[?status != 'clean'].host", ["dirty-h200", "gone", "hung-driver"], id="hosts-not-clean"),
    pytest.param("hosts[?status == 'unreachable'].reason", ["Failed to connect to the host via ssh: ssh: connect to host 10.0.3.29 port 22: No route to host"],
                 id="unreachable-reason"),
    pytest.param("hosts[?up].gpus[] | [?!clean].[host, index, memory_used_mib]", [["dirty-h200", 0, 10267]], id="dirty-gpus"),
    pytest.param("hosts[].gpus[] | [?used_pct > `5`].uuid", ["GPU-ab0cf4f6-818d-be7e-f16b-963690000000"], id="gpus-over-threshold"),
    pytest.param("hosts[].holders[] | [?blocking].{pid: pid, unit: unit, gpus: gpu_indexes}", [{"pid": 495, "unit": "vllm.service", "gpus": [0]}],
                 id="blocking-holders"),
    pytest.param("length(hosts[?contains(host, 'h200')])", 3, id="functions-type-check"),
    pytest.param("summary.hosts_total", 5, id="summary"),
    pytest.param("hosts[?host == 'nope'].host | [0]", None, id="nothing-matches"),
    pytest.param("max_by(hosts[?up].gpus[], &memory_used_mib).[host, index]", ["dirty-h200", 0], id="busiest-gpu"),
])
def test_queries_over_the_audit_model(expr, expected):
    assert fq.fleet_query(MODEL, expr) == expected


def test_queries_over_raw_facts():
    facts = ah.dirty_with_holders()["gpu"]
    assert fq.fleet_query(facts, "holders[?unit != null].{pid: pid, unit: unit}") == [{"pid": 495, "unit": "vllm.service"}]
    assert fq.fleet_query(facts, "processes[?!alive].pid") == [427]


def test_a_dictionary_of_expressions_gives_a_dictionary_of_results():
    assert fq.fleet_query(MODEL, {"bad": "hosts[?status != 'clean'] | length(@)", "clean": "summary.hosts_clean"}) == {"bad": 3, "clean": 2}


class _TaggedStr(str):
    """Stands in for ansible-core's tagged str subclass, which JMESPath's type checks reject."""


class _TaggedDict(dict):
    pass


def test_string_and_dict_subclasses_are_queried_as_plain_values():
    data = _TaggedDict(hosts=[_TaggedDict(host=_TaggedStr("node1"), gpus=(1, 2))])
    assert fq.fleet_query(data, "hosts[?contains(host, 'node')].host") == ["node1"]
    assert fq.fleet_query(data, "length(hosts[0].gpus)") == 2
    assert not isinstance(fq.fleet_query(data, "hosts[0].host"), _TaggedStr)


@pytest.mark.parametrize("expr, message", [
    pytest.param("hosts[?status == ", "bad JMESPath expression 'hosts\\[\\?status == '", id="syntax"),
    pytest.param("hosts[", "bad JMESPath expression", id="unclosed"),
    pytest.param("", "needs a non-empty JMESPath expression", id="empty"),
    pytest.param(None, "needs a non-empty JMESPath expression", id="none"),
    pytest.param(42, "needs a non-empty JMESPath expression", id="not-a-string"),
    pytest.param("length(summary.hosts_total)", "failed on this data: .*invalid type", id="type-error"),
    pytest.param("no_such_function(hosts)", "Unknown function", id="unknown-function"),
    pytest.param({"ok": "hosts[].host", "broken": "hosts["}, "bad JMESPath expression 'hosts\\['", id="one-bad-in-a-dict"),
])
def test_bad_expressions_fail_naming_the_expression(expr, message):
    with pytest.raises(AnsibleFilterError, match=message):
        fq.fleet_query(MODEL, expr)


def test_missing_jmespath_says_what_to_install(monkeypatch):
    monkeypatch.setattr(fq, "jmespath", None)
    with pytest.raises(AnsibleFilterError, match="needs the 'jmespath' Python library on the controller"):
        fq.fleet_query(MODEL, "summary")


def test_filter_is_registered():
    assert fq.FilterModule().filters() == {"fleet_query": fq.fleet_query}
