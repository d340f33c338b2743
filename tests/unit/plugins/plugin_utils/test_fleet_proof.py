"""The fleet-wide proof's pure logic (plugin_utils/_fleet_proof.py, issue 72): who is read again, and
what a host that reads dirty again is told. The read itself runs through the role on the fleet
(tests/fleet/test_orchestrators_fleet.py)."""
from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _fleet_proof as proof
from ansible_collections.zeromib.gpu.plugins.plugin_utils._summary import summary_lines

CLEAN = {"host": "h1", "ok": True, "status": "clean", "selected": [0, 1], "killed": [], "stopped_units": [], "check_mode": False}
FREED = dict(CLEAN, host="h2", status="freed", killed=[{"pid": 42, "name": "python3"}])


def test_a_clean_fleet_reads_nothing_more():
    outcomes = {"h1": CLEAN, "h2": dict(CLEAN, host="h2")}
    assert proof.freed_hosts(outcomes) == []
    assert not proof.needs_proof(CLEAN, outcomes, all_looked=True, check_mode=False)


def test_every_passing_host_is_read_once_some_host_was_freed():
    outcomes = {"h1": CLEAN, "h2": FREED}
    assert proof.freed_hosts(outcomes) == ["h2"]
    assert proof.needs_proof(CLEAN, outcomes, all_looked=True, check_mode=False)
    assert proof.needs_proof(FREED, outcomes, all_looked=True, check_mode=False)


def test_no_proof_in_check_mode_before_every_host_answered_or_for_a_failed_host():
    outcomes = {"h1": CLEAN, "h2": FREED}
    assert not proof.needs_proof(CLEAN, outcomes, all_looked=True, check_mode=True)
    assert not proof.needs_proof(CLEAN, outcomes, all_looked=False, check_mode=False)
    assert not proof.needs_proof(dict(CLEAN, ok=False, status="dirty"), outcomes, all_looked=True, check_mode=False)
    # A dry run's planned kills free nothing.
    assert proof.freed_hosts({"h2": dict(FREED, check_mode=True)}) == []


def test_the_read_asks_for_memory_and_holders_only_with_the_roles_settings():
    args = proof.facts_args({"free_gpus_max_used_mib": 64, "free_gpus_nvidia_smi": "", "free_gpus_timeout": 5, "free_gpus_protect": []})
    assert args == {"processes": True, "fail_on_error": False, "health": False, "xid_window_hours": 0, "max_used_mib": 64, "timeout": 5}
    assert proof.bound_s({"free_gpus_timeout": 5}) == 55.0


def _facts(mib=0, holders=()):
    gpus = [{"index": 0, "memory_used_mib": mib, "clean": mib == 0}, {"index": 1, "memory_used_mib": 0, "clean": True}]
    return {"error": None, "gpus": gpus, "holders": list(holders)}


ACTOR = {"pid": 4242, "ppid": 17, "cmdline": "ray::Holder.__init__", "gpu_indexes": [0], "protected": False, "container_name": None}


def test_a_host_still_free_passes():
    assert proof.judge(_facts(), "h1", [0, 1], ["h2"]) is None
    # An NVML client (no GPU) and a protected daemon are no holders.
    assert proof.judge(_facts(holders=[dict(ACTOR, gpu_indexes=[]), dict(ACTOR, protected=True)]), "h1", [0, 1], ["h2"]) is None


def test_work_back_on_a_proven_host_fails_it_naming_holder_and_freed_hosts():
    said = proof.judge(_facts(3000, [ACTOR]), "h1", [0, 1], ["h2"])
    assert said.startswith("h1: not free after the last host was freed: GPU 0 reads 3000 MiB, held by PID 4242 (ray::Holder.__init__)")
    assert "started by PID 17" in said and "after this run freed h2" in said


def test_a_holder_on_an_unselected_gpu_is_not_this_runs():
    assert proof.judge(_facts(holders=[dict(ACTOR, gpu_indexes=[1])]), "h1", [0], ["h2"]) is None
    assert proof.judge(_facts(holders=[dict(ACTOR, gpu_indexes=[1])]), "h1", [], ["h2"]) is not None


def test_no_reading_is_no_proof():
    assert "could not read the GPUs (nvidia-smi timed out)" in proof.judge({"error": "nvidia-smi timed out"}, "h1", [], ["h2"])
    assert proof.judge(None, "h1", [], ["h2"]).endswith("not free")
    assert "found none of the selected GPUs" in proof.judge({"error": None, "gpus": []}, "h1", [], ["h2"])


def test_many_holders_are_capped_with_a_count():
    said = proof.judge(_facts(3000, [dict(ACTOR, pid=p) for p in range(10)]), "h1", [0], ["h2"])
    assert said.count("PID ") == proof.NAMED + 0 + said.count("started by PID ") and "and 7 more" in said


def test_the_outcome_and_the_summary_say_it():
    back = proof.proven(CLEAN, proof.judge(_facts(3000, [ACTOR]), "h1", [0, 1], ["h2"]), ["h2"])
    assert back["ok"] is False and back["status"] == "back" and back["fleet_proof"] == {"freed_hosts": ["h2"], "free": False}
    still = proof.proven(FREED, None, ["h2"])
    assert still["ok"] is True and still["status"] == "freed"
    lines = summary_lines([back, still])
    assert lines[1].startswith("back") and "h1" in lines[1]
    assert lines[-2] == "fleet-wide proof after h2 was freed: 2 hosts read once more, not free again: h1"
    assert lines[-1] == "2 hosts: 1 back, 1 freed"
    assert not any("fleet-wide proof" in line for line in summary_lines([CLEAN]))


def test_a_unified_memory_gpu_is_said_by_its_own_proof_in_the_gate_and_the_fleet_proof():
    """A GB10 whose host has too little memory available never reads "reads 0 MiB" as the reason."""
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _verdict
    gpu = {"index": 0, "clean": False, "memory_used_mib": 0, "memory_proof": "unified memory", "host_memory_available_mib": 612}
    assert _verdict.dirty_reading(gpu) == "GPU 0 (unified memory) has 0 MiB in compute processes and 612 MiB of host memory available"
    assert _verdict.dirty_reading({"index": 1, "memory_used_mib": 4096}) == "GPU 1 reads 4096 MiB"
    checks, problems, _status = _verdict._release_failures({"released": False, "selected_gpus": [0], "gpus": [gpu]}, False)
    assert problems == ["not released: GPU 0 (unified memory) has 0 MiB in compute processes and 612 MiB of host memory available"], problems
