# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_audit_model: one record per host in, the report model out."""

from __future__ import annotations

import copy

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_model import FilterModule, gpu_audit_model
from ansible_collections.zeromib.gpu.tests.unit.plugins.filter import audit_hosts as ah

EPOCH = 1748779200.0  # 2025-06-01T12:00:00Z


def _one(record):
    return gpu_audit_model([record], EPOCH)["hosts"][0]


@pytest.mark.parametrize("record, status, reason, up, gpu_count, used, dirty_gpus", [
    pytest.param(ah.clean_h200x8(), "clean", None, True, 8, 0, [], id="clean-8x-h200"),
    pytest.param(ah.dirty_with_holders(), "dirty", "GPU 0 10267 MiB; held by 495 python3 (vllm.service)", True, 8, 10267, [0], id="dirty-with-holders"),
    pytest.param(ah.mig_baseline(), "clean", None, True, 8, 8 * 55, [], id="mig-55-mib-baseline-under-60"),
    pytest.param(ah.nvidia_smi_timeout(), "error", "nvidia-smi timed out after 10 s", False, 0, None, [], id="nvidia-smi-timed-out"),
    pytest.param(ah.unreachable(), "unreachable", "Failed to connect to the host via ssh: ssh: connect to host 10.0.3.29 port 22: No route to host",
                 False, None, None, [], id="unreachable"),
    pytest.param(ah.module_failure(), "error", "MODULE FAILURE: /bin/sh: 1: /usr/bin/python3: not found", False, None, None, [], id="module-failed"),
    pytest.param({"host": "quiet", "status": "ok", "gpu": None}, "error", "zeromib.gpu.gpu_facts returned no ansible_facts.gpu", False, None, None, [],
                 id="ok-without-facts"),
    pytest.param({"host": "bare", "status": "error"}, "error", "zeromib.gpu.gpu_facts failed", False, None, None, [], id="error-without-message"),
    pytest.param({"host": "legacy", "status": "FAILED", "error": "boom"}, "error", "boom", False, None, None, [], id="failed-is-error"),
])
def test_host_status_and_reason(record, status, reason, up, gpu_count, used, dirty_gpus):
    host = _one(record)
    assert (host["status"], host["reason"], host["up"], host["gpu_count"], host["memory_used_mib"], host["dirty_gpus"]) == (
        status, reason, up, gpu_count, used, dirty_gpus)


def test_a_driver_upgraded_under_its_module_is_a_line_and_a_count_also_on_a_clean_host():
    drifted = ah.clean_h200x8("drifted")
    drifted["gpu"]["driver"] = {"loaded": "580.159.04", "library": "580.178.04", "library_path": "/usr/lib64/libnvidia-ml.so.580.178.04",
                                "mismatch": True}
    steady = ah.clean_h200x8("steady")
    steady["gpu"]["driver"] = {"loaded": "580.159.04", "library": "580.159.04", "library_path": None, "mismatch": False}
    model = gpu_audit_model([drifted, steady, ah.clean_h200x8("older-facts")], EPOCH)
    lines = {host["host"]: host["driver_drift"] for host in model["hosts"]}
    assert lines == {"drifted": "driver upgraded under the loaded module (kernel module 580.159.04, library 580.178.04): new CUDA jobs fail "
                                "until the node is rebooted or the modules are reloaded", "steady": None, "older-facts": None}
    assert model["summary"]["hosts_driver_drift"] == 1 and model["hosts"][0]["status"] == "clean"


def test_files_killed_jobs_left_in_dev_shm_are_a_line_and_a_count_also_on_a_clean_host():
    left = ah.clean_h200x8("left")
    left["gpu"]["shm"] = {"path": "/dev/shm", "size_mib": 1024.0, "free_mib": 576.0, "files": 15, "unheld_mib": 449.0, "complete": True, "error": None,
                          "unheld": [{"path": f"/dev/shm/torch_4242_{i:d}_0", "size_mib": 32.0, "age_s": 40, "pattern": "torch_*", "user": "alice"}
                                     for i in range(14)] + [{"path": "/dev/shm/app.state", "size_mib": 1.0, "age_s": 9, "pattern": None, "user": "root"}]}
    tidy = ah.clean_h200x8("tidy")
    tidy["gpu"]["shm"] = dict(left["gpu"]["shm"], unheld=[], unheld_mib=0)
    model = gpu_audit_model([left, tidy, ah.clean_h200x8("older-facts")], EPOCH)
    shm = {host["host"]: host["shm"] for host in model["hosts"]}
    assert shm["left"] == {"free_mib": 576.0, "size_mib": 1024.0, "unheld_files": 15, "unheld_mib": 449.0,
                           "leftovers": "14 file(s) of killed jobs in /dev/shm that no process holds, 448 MiB (torch_* 14); 576 MiB free of 1024 MiB"}
    assert shm["tidy"]["leftovers"] is None and shm["tidy"]["unheld_files"] == 0
    assert shm["older-facts"] == {"free_mib": None, "size_mib": None, "unheld_files": None, "unheld_mib": None, "leftovers": None}
    assert model["summary"]["hosts_shm_leftovers"] == 1 and model["hosts"][0]["status"] == "clean"


def test_fleet_summary_counts_hosts_gpus_and_blocking_holders():
    model = gpu_audit_model(ah.fleet(), EPOCH)
    assert model["summary"] == {
        "hosts_total": 5, "hosts_clean": 2, "hosts_dirty": 1, "hosts_error": 1, "hosts_unreachable": 1,
        "gpus_total": 24, "gpus_clean": 23, "gpus_dirty": 1,
        "memory_used_mib": 10267 + 8 * 55, "memory_total_mib": 24 * ah.H200_TOTAL,
        "holders": 1, "nvml_clients": 2, "holders_not_listed": 0, "hosts_unhealthy": 0, "gpus_unhealthy": 0,
        "hosts_health_unchecked": 0, "gpus_health_unchecked": 0, "hosts_pending_restore": 0, "hosts_driver_drift": 0,
        "hosts_shm_leftovers": 0, "hosts_ghost_busy": 0, "gpus_ghost_busy": 0,
    }
    assert model["schema_version"] == 1
    assert model["generated_at"] == "2025-06-01T12:00:00Z" and model["generated_epoch"] == EPOCH
    assert model["max_gpu_count"] == 8


def test_hosts_sort_by_name_with_numbers_compared_as_numbers():
    hosts = [ah.clean_h200x8(name) for name in ("node10", "node2", "Node1", "node1-b", "gpu")]
    assert [h["host"] for h in gpu_audit_model(hosts, EPOCH)["hosts"]] == ["gpu", "Node1", "node1-b", "node2", "node10"]


def test_holders_are_joined_to_their_memory_and_gpus():
    host = _one(ah.dirty_with_holders())
    by_pid = {h["pid"]: h for h in host["holders"]}
    assert by_pid[495]["blocking"] and by_pid[495]["used_memory_mib"] == 6662 and by_pid[495]["host"] == "dirty-h200"
    assert not by_pid[812]["blocking"], "a protected daemon never makes a host dirty"
    assert not by_pid[903]["blocking"], "an NVML client on control nodes only is listed, not blocking"
    assert [h["pid"] for h in host["holders"]][0] == 495, "blocking holders come first"
    gpu0 = host["gpus"][0]
    assert [h["pid"] for h in gpu0["holders"]] == [495]
    assert [p["pid"] for p in gpu0["processes"]] == [495, 427]
    assert gpu0["used_pct"] == 7.1 and gpu0["host"] == "dirty-h200"
    assert host["gpus"][1]["holders"] == [] and host["gpus"][1]["used_pct"] == 0.0


def test_memory_of_a_gone_pid_is_reported_as_stale():
    host = _one(ah.dirty_with_holders())
    assert [(p["pid"], p["name"], p["used_memory_mib"]) for p in host["stale_processes"]] == [(427, "[Not Found]", 3590)]


def test_stale_memory_without_a_live_holder_is_the_reason():
    record = ah.dirty_with_holders()
    record["gpu"]["holders"] = []
    assert _one(record)["reason"] == "GPU 0 10267 MiB; memory counted for gone PID 427"


def test_inside_a_container_memory_of_a_pid_it_cannot_see_is_said_to_be_held_outside():
    """gpu_facts run in an LXC guest: the host's (or another guest's) process on the shared GPU is
    a PID the guest cannot see, never "a gone PID" to reset for."""
    record = ah.dirty_with_holders()
    record["gpu"]["holders"] = []
    record["gpu"]["inside_container"] = True
    host = _one(record)
    assert host["inside_container"] is True
    assert host["reason"] == ("GPU 0 10267 MiB; memory counted for PID 427, not in this container: held outside it (the host or another guest)? "
                              "look on the host")
    record["gpu"]["processes"] = []
    assert _one(record)["reason"] == "GPU 0 10267 MiB; no process in this container holds it: held outside it (the host or another guest)? look on the host"


def test_a_holder_in_a_guest_is_named_with_its_guest_and_the_guests_own_unit():
    """From the Proxmox host: the guest's vllm.service is no unit of the host."""
    record = ah.clean_h200x8("pve")
    guest = {"kind": "lxc", "name": "101", "unit": "vllm.service", "init_pid": 4000, "manager": "systemd"}
    record["gpu"]["holders"] = [dict(ah.holder(4101 + i, "python3", [4 + i]), guest=guest) for i in range(2)]
    record["gpu"]["holders"].append(ah.holder(900, "python3", [0], unit="vllm.service"))
    record["gpu"]["clean"] = False
    host = _one(record)
    assert {h["pid"]: h["guest_label"] for h in host["holders"]} == {4101: "LXC guest 101: vllm.service", 4102: "LXC guest 101: vllm.service",
                                                                     900: None}
    assert host["reason"] == "held by 900 python3 (vllm.service), LXC guest 101: vllm.service (2 processes)"


def test_a_holder_alone_makes_a_host_dirty_even_at_zero_mib():
    record = ah.clean_h200x8("held")
    record["gpu"]["holders"] = [ah.holder(77, "python3", [2], container="3f9c2d1ab4e8a7c6d5e4f3a2")]
    record["gpu"]["clean"] = False
    host = _one(record)
    assert host["status"] == "dirty" and host["dirty_gpus"] == []
    assert host["reason"] == "held by 77 python3 (container 3f9c2d1ab4e8)"


def test_many_workers_of_one_unit_read_as_the_unit():
    record = ah.clean_h200x8("vllm")
    record["gpu"]["gpus"] = [ah.gpu(i, used=128410) for i in range(8)]
    record["gpu"]["holders"] = [ah.holder(2211 + i, f"VLLM::Worker_TP{i}", [i], unit="vllm.service") for i in range(8)]
    record["gpu"]["clean"] = False
    assert _one(record)["reason"] == "8 GPUs (0, 1, 2, 3, 4, 5, 6, 7) 1027280 MiB in all; held by vllm.service (8 processes)"


def test_more_than_three_owners_are_counted():
    record = ah.clean_h200x8("busy")
    record["gpu"]["holders"] = [ah.holder(100 + i, "python3", [i]) for i in range(5)]
    record["gpu"]["clean"] = False
    assert _one(record)["reason"] == "held by 100 python3, 101 python3, 102 python3 and 2 more"


def test_unknown_memory_leaves_percentages_unknown():
    record = ah.clean_h200x8("wddm")
    record["gpu"]["gpus"][0]["memory_used_mib"] = None
    record["gpu"]["gpus"][0]["clean"] = False
    record["gpu"]["clean"] = False
    host = _one(record)
    assert host["gpus"][0]["used_pct"] is None
    assert host["reason"] == "GPU 0 ? MiB"
    assert host["memory_used_mib"] == 0


def test_a_host_with_fewer_gpus_keeps_the_widest_row_as_width():
    small = ah.clean_h200x8("l40s")
    small["gpu"]["gpus"] = small["gpu"]["gpus"][:4]
    model = gpu_audit_model([small, ah.clean_h200x8()], EPOCH)
    assert model["max_gpu_count"] == 8
    assert gpu_audit_model([ah.unreachable()], EPOCH)["max_gpu_count"] == 1


def test_input_is_not_modified():
    hosts = ah.fleet()
    before = copy.deepcopy(hosts)
    gpu_audit_model(hosts, EPOCH)
    assert hosts == before


def test_generated_at_defaults_to_now():
    model = gpu_audit_model([], None)
    assert model["generated_epoch"] > EPOCH and model["summary"]["hosts_total"] == 0


@pytest.mark.parametrize("hosts, generated_at, message", [
    pytest.param({"host": "a"}, None, "expects a list of host records", id="dict-not-list"),
    pytest.param("node1", None, "expects a list of host records", id="string-not-list"),
    pytest.param(["node1"], None, "each host must be a dictionary", id="name-not-record"),
    pytest.param([{"status": "ok"}], None, "has no 'host'", id="no-host"),
    pytest.param([{"host": "a", "status": "down"}], None, "host a has status 'down'", id="unknown-status"),
    pytest.param([ah.clean_h200x8("a"), ah.unreachable("a")], None, "host a appears twice", id="duplicate"),
    pytest.param([], "yesterday", "generated_at must be seconds since the epoch", id="bad-time"),
])
def test_bad_input_fails_clearly(hosts, generated_at, message):
    with pytest.raises(AnsibleFilterError, match=message):
        gpu_audit_model(hosts, generated_at)


def test_filter_is_registered():
    assert FilterModule().filters() == {"gpu_audit_model": gpu_audit_model}


def test_an_expected_host_without_a_record_is_an_error_not_missing():
    model = gpu_audit_model([ah.clean_h200x8("node1")], EPOCH, expected_hosts=["node1", "node2"])
    assert [(h["host"], h["status"]) for h in model["hosts"]] == [("node1", "clean"), ("node2", "error")]
    assert model["hosts"][1]["reason"] == "no audit result: the audit stopped on this host before recording one"
    assert model["summary"]["hosts_error"] == 1


def test_holder_in_a_container_shows_its_name_and_image_next_to_the_pid():
    record = ah.clean_h200x8("infer")
    vllm = dict(ah.holder(77, "python3", [0, 1], container="3f9c2d1ab4e8a7c6d5e4f3a2"), container_name="vllm",
                container_image="vllm/vllm-openai:v0.11.0", container_runtime="docker", pod=None, pod_uid=None)
    pod = dict(ah.holder(78, "python3", [2], container="9a8b7c6d5e4f3a2b1c0d"), container_name=None, container_image=None,
               container_runtime=None, pod="inference/sglang-0", pod_uid="1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901")
    record["gpu"]["holders"] = [vllm, pod]
    record["gpu"]["clean"] = False
    host = _one(record)
    labels = {h["pid"]: h["container_label"] for h in host["holders"]}
    assert labels == {77: "vllm (vllm/vllm-openai:v0.11.0)", 78: "pod inference/sglang-0: 9a8b7c6d5e4f"}
    assert host["reason"] == ("held by 77 python3 (container vllm (vllm/vllm-openai:v0.11.0)) uses GPUs 0,1, "
                              "78 python3 (container pod inference/sglang-0: 9a8b7c6d5e4f)")


def test_a_holder_on_several_gpus_is_marked_spanning_and_the_reason_says_which():
    record = ah.clean_h200x8("jax")
    record["gpu"]["holders"] = [ah.holder(70, "python3", [0, 1, 2]), ah.holder(71, "python3", [3])]
    record["gpu"]["clean"] = False
    host = _one(record)
    assert {h["pid"]: h["spanning"] for h in host["holders"]} == {70: True, 71: False}
    assert host["reason"] == "held by 70 python3 uses GPUs 0,1,2, 71 python3"


def test_nvml_clients_are_listed_apart_from_gpu_users_and_never_block():
    host = _one(ah.trainer_footprint_and_monitors())
    assert host["status"] == "dirty" and host["reason"] == "GPU 0 41487 MiB; held by 700 python3"
    assert [h["pid"] for h in host["holders"] if h["blocking"]] == [700]
    assert [(h["pid"], h["nvml_client"], h["attribution"]) for h in host["nvml_clients"]] == [
        (701, True, "nvml_client"), (702, True, "nvml_client")]
    assert [h["pid"] for h in host["gpus"][0]["holders"]] == [700] and host["gpus"][1]["holders"] == []


def test_a_gpu_reading_only_the_cross_gpu_footprint_is_clean_and_named():
    host = _one(ah.trainer_footprint_and_monitors())
    gpu1 = host["gpus"][1]
    assert gpu1["clean"] is True and gpu1["cross_gpu_footprint"] is True and gpu1["memory_used_mib"] == 4
    assert host["footprint_gpus"] == [1] and host["dirty_gpus"] == [0]
    assert host["gpus"][0]["cross_gpu_footprint"] is False


def test_a_host_with_only_nvml_clients_is_clean_and_counts_them():
    model = gpu_audit_model([ah.monitors_only(), ah.trainer_footprint_and_monitors()], EPOCH)
    watched = model["hosts"][1]
    assert watched["host"] == "watched-h200" and watched["status"] == "clean" and watched["reason"] is None
    assert [h["pid"] for h in watched["nvml_clients"]] == [801] and not any(h["blocking"] for h in watched["holders"])
    assert model["summary"]["nvml_clients"] == 3 and model["summary"]["holders"] == 1


def test_an_undecided_holder_blocks_although_it_has_no_gpu_index():
    record = ah.monitors_only()
    record["gpu"]["holders"].append(ah.holder(900, "python3", [], attribution="undecided"))
    record["gpu"]["holders"][-1]["candidate_gpu_indexes"] = [0, 1]
    record["gpu"]["clean"] = False
    host = _one(record)
    assert host["status"] == "dirty" and [h["pid"] for h in host["holders"] if h["blocking"]] == [900]
    assert [h["pid"] for h in host["nvml_clients"]] == [801]


def test_a_process_that_did_not_answer_the_scan_blocks_too():
    """gpu_facts' `blocked` holder (a stalled file system): what it holds is unknown."""
    record = ah.monitors_only()
    record["gpu"]["holders"].append(ah.holder(901, "python3", [], attribution="blocked"))
    record["gpu"]["holders"][-1].update(candidate_gpu_indexes=[0, 1], blocked=True, waits_in="mm_access")
    record["gpu"]["clean"] = False
    host = _one(record)
    assert host["status"] == "dirty" and [h["pid"] for h in host["holders"] if h["blocking"]] == [901]


@pytest.mark.parametrize("seconds, text", [(45, "45 s"), (119, "119 s"), (600, "10 min"), (7200, "2 h"), (5 * 86400, "5 d")])
def test_ages_read_in_the_unit_a_person_would_say(seconds, text):
    from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_model import age_text, human_ages

    assert age_text(seconds) == text
    assert human_ages(f"Xid 79 (GPU has fallen off the bus) in the kernel log at {seconds} s ago") == \
        f"Xid 79 (GPU has fallen off the bus) in the kernel log {text} ago"


def test_a_healthy_fully_checked_host_has_no_health_reason():
    host = _one(ah.clean_h200x8())
    assert host["health_reason"] is None and host["unchecked_gpus"] == []


def test_an_idle_mig_host_above_the_audits_baseline_gets_the_roles_advice_with_its_margin():
    # issue 55: the audit gave no advice where the role says to set the baseline; both say 64 for 55 MiB
    from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_model import gpu_audit_model
    from ansible_collections.zeromib.gpu.tests.unit.plugins.filter import audit_hosts as ah

    idle = {"host": "mig-a100", "status": "ok", "error": None, "gpu": ah.facts(ah.gpu(i, used=55, max_used=0, mig="Enabled") for i in range(2))}
    [host] = gpu_audit_model([idle], 0)["hosts"]
    assert host["status"] == "dirty" and host["reason"] == (
        "GPU 0 55 MiB, GPU 1 55 MiB; no process holds them: the idle baseline of MIG mode; set free_gpus_max_used_mib: 64 "
        "(its 55 MiB reading with a margin; per host or group; the audit reads it too)"), host["reason"]
    # not a MIG GPU: leaked memory, no baseline advice
    leak = {"host": "h200", "status": "ok", "error": None, "gpu": ah.facts([ah.gpu(0, used=55, max_used=0)])}
    assert "set free_gpus_max_used_mib" not in gpu_audit_model([leak], 0)["hosts"][0]["reason"]


def test_a_host_with_thousands_of_holders_lists_the_ten_that_matter_and_counts_the_rest():
    """Issue 66: a tenant sets no size of the report. gpu_facts sent its 50 most relevant holders of
    3,000 (truncated); the host lists 10, those that keep a GPU from being free first."""
    holders = [{"pid": 100 + n, "name": "python3", "gpu_indexes": [0] if n < 12 else [], "attribution": "listed" if n < 12 else "nvml_client",
                "protected": False} for n in range(50)]
    record = copy.deepcopy(ah.dirty_with_holders())
    record["gpu"].update(holders=holders, truncated={"holders": 3000})
    host = _one(record)
    assert len(host["holders"]) == 10 and all(h["blocking"] for h in host["holders"]) and host["holders_not_listed"] == 2990
    assert len(host["gpus"][0]["holders"]) == 10


def _ghostly(utilization=100, holders=(), processes=(), used=0):
    """An 8-GPU host whose GPU 3 reads `utilization` % at 101.5 W (a ghost's reading: issue 71)."""
    gpus = [ah.gpu(i) for i in range(8)]
    gpus[3] = dict(ah.gpu(3, used=used), utilization_gpu_pct=utilization, power_draw_w=101.5)
    return {"host": "ghost-h200", "status": "ok", "error": None, "gpu": ah.facts(gpus, holders, processes)}


def test_a_gpu_busy_with_no_process_is_a_ghost_on_its_host_in_the_summary_and_beside_a_monitor():
    """An NVML client (dcgm-exporter, nvidia-smi dmon) opens every GPU and uses none: it hides no ghost."""
    model = gpu_audit_model([_ghostly(holders=[ah.holder(900, "dcgm-exporter", [])]), ah.clean_h200x8()], EPOCH)
    host = model["hosts"][1]
    assert host["host"] == "ghost-h200" and host["status"] == "clean" and host["ghost_busy_gpus"] == [3], host
    [said] = host["ghost_busy"]
    assert said.startswith("GPU 3 (00000000:1B:00.0): 100 % busy at 101.5 W with no process and no memory (ghost-busy"), said
    assert said.endswith("else reset it (nvidia-smi -r -i 3)"), said
    assert (model["summary"]["hosts_ghost_busy"], model["summary"]["gpus_ghost_busy"]) == (1, 1)
    assert model["hosts"][0]["ghost_busy_gpus"] == [] and model["hosts"][0]["ghost_busy"] == []


@pytest.mark.parametrize("record", [
    pytest.param(_ghostly(holders=[ah.holder(495, "python3", [3])], used=4096), id="a-process-works-on-it"),
    pytest.param(_ghostly(holders=[dict(ah.holder(496, "train.py", []), attribution="undecided", candidate_gpu_indexes=[3])]),
                 id="a-process-may-work-on-it"),
    pytest.param(_ghostly(processes=[{"pid": 497, "name": "python3", "used_memory_mib": 0, "gpu_uuid": None, "gpu_index": 3, "alive": True}]),
                 id="a-live-compute-app-listed-on-it"),
    pytest.param(_ghostly(utilization=49), id="below-half-busy"),
    pytest.param(_ghostly(utilization=None), id="utilization-not-given"),
])
def test_a_busy_gpu_with_a_process_or_an_idle_one_is_no_ghost(record):
    host = _one(record)
    assert host["ghost_busy_gpus"] == [] and host["ghost_busy"] == [], host["ghost_busy"]
