# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""free_gpus.yml's summary step: each host's outcome read once from the variable manager's caches
(set_fact over a returned fact, a host found in neither through raw_get, a host that left the play
never read), the same lines as the filter, and the hosts that are not free. The real play runs in
tests/fleet (test_failure_paths.py, test_first_sentence.py, test_free_gpus_fleet.py)."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.action import free_gpus_summary as plugin
from ansible_collections.zeromib.gpu.plugins.filter.free_gpus import free_gpus_outcome, free_gpus_summary
from ansible_collections.zeromib.gpu.plugins.plugin_utils._play_vars import play_vars
from ansible_collections.zeromib.gpu.tests.unit.plugins.action.action_harness import action


def gpu(index, used):
    return {"index": index, "uuid": f"GPU-{index}", "memory_used_mib": used, "clean": used == 0}


def outcome(host, used_after=0, **kw):
    result = {"changed": used_after == 0, "released": used_after == 0, "selected_gpus": [0], "gpus_before": [gpu(0, 40960)],
              "gpus": [gpu(0, used_after)], "stopped_units": ["vllm.service"], "killed": [], "elapsed_s": 0.4}
    result.update(kw)
    if used_after:
        result.update(failed=True, msg=f"GPUs still in use after 60.0 s: GPU 0 (GPU-0) reads {used_after} MiB")
    return free_gpus_outcome(result, host)


class _Manager:
    def __init__(self, nonpersistent, facts):
        self._nonpersistent_fact_cache = nonpersistent
        self._fact_cache = facts


class _HostVars:
    """What a task's `hostvars` gives the plugin: the variable manager's two caches, and raw_get,
    which records the hosts it was asked for (each is a whole get_vars on a real controller)."""

    def __init__(self, nonpersistent, facts, others=None):
        self._variable_manager = _Manager(nonpersistent, facts)
        self.others = others or {}
        self.raw_reads = []

    def raw_get(self, host):
        self.raw_reads.append(host)
        return self.others.get(host, {})


def fleet():
    """n1 clean (the gate's fact); n2 dirty, its fact replaced by the role's rescue (set_fact); n3
    broke before its gate (free_gpus.yml's rescue); n4 left the play (unreachable), with a clean
    result of an earlier run in a fact cache; n5 has its outcome where only raw_get finds it."""
    stale_n2 = outcome("n2")
    facts = {"n1": {"free_gpus_result": outcome("n1")}, "n2": {"free_gpus_result": stale_n2}, "n4": {"free_gpus_result": outcome("n4")}}
    nonpersistent = {"n2": {"free_gpus_result": outcome("n2", used_after=3072)}, "n3": {"_free_gpus_failure": "template error in free_gpus_gpus"}}
    hostvars = _HostVars(nonpersistent, facts, {"n5": {"free_gpus_result": outcome("n5"), "inventory_hostname": "n5"}})
    return hostvars, ["n1", "n2", "n3", "n4", "n5"], ["n1", "n2", "n3", "n5"]


def test_a_set_fact_wins_over_a_returned_fact_and_only_hosts_in_neither_cache_are_read_through_raw_get():
    hostvars, hosts, _live = fleet()
    found = play_vars({"hostvars": hostvars}, hosts, ["free_gpus_result", "_free_gpus_failure"])
    assert found["n2"]["free_gpus_result"]["status"] == "dirty", "the rescue's set_fact, not the gate's fact"
    assert found["n3"] == {"_free_gpus_failure": "template error in free_gpus_gpus"}
    assert found["n5"]["free_gpus_result"]["host"] == "n5"
    assert hostvars.raw_reads == ["n5"], "a whole get_vars only for a host the caches do not know"


def test_without_the_caches_every_host_is_read_through_raw_get():
    hostvars = _HostVars(None, None, {"a": {"free_gpus_result": outcome("a")}})
    hostvars._variable_manager = object()
    found = play_vars({"hostvars": hostvars}, ["a", "b"], ["free_gpus_result"])
    assert found == {"a": {"free_gpus_result": outcome("a")}, "b": {}}
    assert hostvars.raw_reads == ["a", "b"]


def test_the_summary_says_what_the_filter_says_and_names_the_hosts_that_are_not_free():
    hostvars, hosts, live = fleet()
    plugin_ = action(plugin.ActionModule, {}, name="zeromib.gpu.free_gpus_summary")
    result = plugin_.run(task_vars={"hostvars": hostvars, "ansible_play_hosts_all": hosts, "ansible_play_hosts": live})
    as_hostvars = {host: dict(hostvars._variable_manager._fact_cache.get(host, {}), **hostvars._variable_manager._nonpersistent_fact_cache.get(host, {}),
                              **hostvars.others.get(host, {})) for host in hosts}
    assert result["msg"] == free_gpus_summary(as_hostvars, hosts, live)
    assert [line.split()[:2] for line in result["msg"][1:6]] == [
        ["unreachable", "n4"], ["failed", "n3"], ["dirty", "n2"], ["freed", "n1"], ["freed", "n5"]]
    assert result["not_free"] == ["n2", "n3"], "n4 left the play: the play does not fail it again"
    assert result["_ansible_verbose_always"] is True and not result.get("failed")


def test_every_host_free_leaves_no_host_to_fail():
    hostvars = _HostVars({}, {h: {"free_gpus_result": outcome(h)} for h in ("a", "b")})
    plugin_ = action(plugin.ActionModule, {}, name="zeromib.gpu.free_gpus_summary")
    result = plugin_.run(task_vars={"hostvars": hostvars, "ansible_play_hosts_all": ["a", "b"], "ansible_play_hosts": ["a", "b"]})
    assert result["not_free"] == [] and result["msg"][-1] == "2 hosts: 2 freed"


def test_a_host_without_any_outcome_is_not_free():
    assert plugin.not_free({"a": {}, "b": {"free_gpus_result": {"ok": True}}, "c": {"free_gpus_result": "oops"}}, ["a", "b", "c"]) == ["a", "c"]


def test_a_host_that_left_the_play_is_named_unreachable_with_the_ssh_error_its_gate_registered():
    # issue 55: the line quotes what Ansible said (was: "the SSH error is in Ansible's UNREACHABLE line above")
    error = "Task failed: Data could not be sent to remote host \"10.0.0.9\". Make sure this host can be reached over ssh: No route to host"
    hostvars = _HostVars({"n2": {"__free_gpus_gate": {"unreachable": True, "msg": error}}}, {"n1": {"free_gpus_result": outcome("n1")}})
    plugin_ = action(plugin.ActionModule, {}, name="zeromib.gpu.free_gpus_summary")
    result = plugin_.run(task_vars={"hostvars": hostvars, "ansible_play_hosts_all": ["n1", "n2", "n3"], "ansible_play_hosts": ["n1"]})
    assert result["unreachable_hosts"] == ["n2", "n3"] and result["not_free"] == []
    assert result["msg"][1].endswith(f"n2: unreachable, or failed before gpu_release ran: {error}"), result["msg"]
    assert result["msg"][2].endswith("n3: unreachable, or failed before gpu_release ran: the SSH error is in Ansible's UNREACHABLE (or fatal) "
                                     "line for n3 above")
    assert result["msg"][-1] == "3 hosts: 2 unreachable (n2, n3), 1 freed"
