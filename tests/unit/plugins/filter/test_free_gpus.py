# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The role's per-host outcome and the playbook's fleet summary (pure functions)."""

from __future__ import annotations

import pytest

from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.filter.free_gpus import free_gpus_outcome, free_gpus_summary


def gpu(index, used, clean=None):
    return {"index": index, "uuid": f"GPU-{index}", "memory_used_mib": used, "clean": (used == 0) if clean is None else clean}


def release(before, after, **kw):
    result = {"changed": True, "released": all(g["clean"] for g in after), "selected_gpus": [g["index"] for g in after],
              "gpus_before": before, "gpus": after, "stopped_units": [], "killed": [], "elapsed_s": 0.41}
    result.update(kw)
    return result


def test_freed_host_reports_mib_before_and_after_and_what_was_done():
    result = release([gpu(0, 40970), gpu(1, 0)], [gpu(0, 0), gpu(1, 0)], stopped_units=["vllm.service"],
                     killed=[{"pid": 495, "name": "python3", "signal": "SIGKILL"}])
    outcome = free_gpus_outcome(result, "node01", 2)
    assert outcome["ok"] and outcome["status"] == "freed"
    assert (outcome["mib_before"], outcome["mib_after"]) == (40970, 0)
    assert outcome["message"] == "node01: 2 GPUs free (40970 -> 0 MiB), stopped vllm.service, killed 1 process in 0.41 s"


def test_a_guests_unit_stopped_through_its_systemd_reads_as_a_unit_by_its_entry():
    result = release([gpu(4, 40969)], [gpu(4, 0)], stopped_guest_units=["lxc:101:vllm.service"], disabled_guest_units=["lxc:101:vllm.service"])
    outcome = free_gpus_outcome(result, "pve01", 1)
    assert outcome["stopped_units"] == ["lxc:101:vllm.service"] and outcome["disabled_units"] == ["lxc:101:vllm.service"]
    assert "stopped lxc:101:vllm.service" in outcome["message"]


def test_clean_host_is_clean_not_freed():
    outcome = free_gpus_outcome(release([gpu(0, 0)], [gpu(0, 0)], changed=False), "node02")
    assert outcome["ok"] and outcome["status"] == "clean"


def test_dirty_verdict_names_the_host_and_keeps_the_module_message():
    result = release([gpu(0, 3072)], [gpu(0, 3072)], failed=True, changed=False,
                     msg="GPUs still in use after 60.0 s: GPU 0 (GPU-0) reads 3072 MiB, ... a GPU reset or a reboot is needed")
    outcome = free_gpus_outcome(result, "node03")
    assert not outcome["ok"] and outcome["status"] == "dirty"
    assert outcome["message"].startswith("node03: GPUs still in use after 60.0 s: GPU 0 (GPU-0) reads 3072 MiB")


def test_broken_driver_before_any_reading_is_failed():
    outcome = free_gpus_outcome({"failed": True, "msg": "nvidia-smi timed out after 2 s"}, "node04")
    assert outcome["status"] == "failed" and outcome["message"] == "node04: nvidia-smi timed out after 2 s"


def test_host_that_lost_a_gpu_is_not_clean():
    outcome = free_gpus_outcome(release([gpu(i, 0) for i in range(7)], [gpu(i, 0) for i in range(7)], changed=False), "node05", 8)
    assert not outcome["ok"] and outcome["status"] == "failed"
    assert "expected 8 GPUs, nvidia-smi shows 7" in outcome["message"]


def test_check_mode_says_what_it_would_do():
    result = release([gpu(0, 40970)], [gpu(0, 40970)], released=False)
    outcome = free_gpus_outcome(result, "node06", 0, True)
    assert outcome["ok"] and outcome["status"] == "would free" and outcome["check_mode"] is True


def test_outcome_rejects_what_is_not_a_release_result():
    with pytest.raises(AnsibleFilterError, match="registered result of zeromib.gpu.gpu_release"):
        free_gpus_outcome("oops", "node07")


def test_summary_lists_worst_hosts_first_and_the_ones_that_never_reported():
    outcomes = [
        free_gpus_outcome(release([gpu(0, 0)], [gpu(0, 0)], changed=False), "node-a"),
        free_gpus_outcome(release([gpu(0, 40970)], [gpu(0, 0)]), "node-b"),
        free_gpus_outcome({"failed": True, "msg": "nvidia-smi timed out after 2 s"}, "node-c"),
    ]
    lines = free_gpus_summary(outcomes, ["node-a", "node-b", "node-c", "node-d"])
    assert lines[0].split()[:2] == ["STATUS", "HOST"]
    assert [line.split()[1] for line in lines[1:5]] == ["node-d", "node-c", "node-b", "node-a"]
    assert "unreachable" in lines[1] and "nvidia-smi timed out" in lines[2] and "40970 -> 0" in lines[3]
    assert lines[-1] == "4 hosts: 1 unreachable (node-d), 1 failed, 1 freed, 1 clean"  # issue 55: named


def test_summary_reads_outcomes_from_hostvars_and_tolerates_hosts_without_one():
    hostvars = {
        "node-a": {"free_gpus_result": free_gpus_outcome(release([gpu(0, 0)], [gpu(0, 0)], changed=False), "node-a")},
        "node-b": {"inventory_hostname": "node-b"},  # unreachable: the role never set its fact
    }
    lines = free_gpus_summary(hostvars, ["node-a", "node-b", "node-c"])
    assert [line.split()[:2] for line in lines[1:4]] == [["unreachable", "node-b"], ["unreachable", "node-c"], ["clean", "node-a"]]


def test_summary_names_a_stopped_and_disabled_unit_once():
    result = release([gpu(0, 30000)], [gpu(0, 0)], stopped_units=["sglang.service"], disabled_units=["sglang.service"])
    lines = free_gpus_summary([free_gpus_outcome(result, "node-a")], ["node-a"])
    assert "sglang.service (disabled)" in lines[1] and lines[1].count("sglang.service") == 1


def test_containers_stopped_and_disabled_show_name_and_image():
    vllm = {"name": "vllm", "id": "a" * 64, "image": "vllm/vllm-openai:v0.11.0", "runtime": "docker", "restart_policy": "always"}
    tgi = {"name": "tgi", "id": "b" * 64, "image": "ghcr.io/huggingface/text-generation-inference:3.3", "runtime": "podman"}
    result = release([gpu(0, 40970)], [gpu(0, 0)], stopped_containers=[vllm, tgi], disabled_containers=[dict(vllm, restart_policy="no")])
    outcome = free_gpus_outcome(result, "node07", 1)
    assert outcome["stopped_containers"] == ["vllm (vllm/vllm-openai:v0.11.0)", "tgi (ghcr.io/huggingface/text-generation-inference:3.3)"]
    assert outcome["message"] == ("node07: 1 GPU free (40970 -> 0 MiB), stopped containers vllm (vllm/vllm-openai:v0.11.0), "
                                  "tgi (ghcr.io/huggingface/text-generation-inference:3.3), disabled container vllm (vllm/vllm-openai:v0.11.0) "
                                  "in 0.41 s")
    lines = free_gpus_summary([outcome])
    assert "UNITS/CONTAINERS STOPPED" in lines[0]
    assert "container vllm (vllm/vllm-openai:v0.11.0) (disabled), container tgi (ghcr.io/huggingface/text-generation-inference:3.3)" in lines[1]


def test_gpu_freed_next_to_a_trainer_reads_the_footprint_and_the_summary_says_why():
    # gpus: ["1"] on a 2-GPU H200 with a trainer on GPU 0: GPU 1 reads 4 MiB, clean by the footprint.
    after = [gpu(0, 41487, clean=False), dict(gpu(1, 4, clean=True), cross_gpu_footprint=True)]
    result = release([gpu(0, 41487, clean=False), gpu(1, 2575, clean=False)], after, selected_gpus=[1], released=True,
                     killed=[{"pid": 812, "name": "python3", "signal": "SIGTERM"}],
                     holders=[{"pid": 700, "name": "python3", "attribution": "listed", "gpu_indexes": [0]},
                              {"pid": 701, "name": "nvidia-smi", "attribution": "nvml_client", "gpu_indexes": []}])
    outcome = free_gpus_outcome(result, "node01", 2)
    assert outcome["ok"] and outcome["status"] == "freed"
    assert (outcome["mib_before"], outcome["mib_after"]) == (2575, 4)
    assert outcome["footprint_gpus"] == [1] and outcome["nvml_clients"] == [{"pid": 701, "name": "nvidia-smi"}]
    assert outcome["message"] == ("node01: 1 GPU free (2575 -> 4 MiB), killed 1 process, GPU 1 (4 MiB) at the cross-GPU footprint, "
                                  "1 NVML client left running in 0.41 s")
    lines = free_gpus_summary([outcome], ["node01"])
    assert lines[1].split()[:2] == ["freed", "node01"]
    assert lines[1].endswith("GPU 1 (4 MiB): cross-GPU footprint; 1 NVML client kept")
    assert lines[-1] == "1 host: 1 freed"


def test_clean_host_with_only_monitors_notes_them_and_stays_clean():
    result = release([gpu(0, 0), gpu(1, 0)], [gpu(0, 0), gpu(1, 0)], changed=False,
                     holders=[{"pid": 9, "name": "nvidia-smi", "attribution": "nvml_client"},
                              {"pid": 10, "name": "python3", "attribution": "nvml_client"}])
    outcome = free_gpus_outcome(result, "node02")
    assert outcome["ok"] and outcome["status"] == "clean" and outcome["footprint_gpus"] == []
    line = free_gpus_summary([outcome], ["node02"])[1]
    assert line.split()[:2] == ["clean", "node02"] and line.endswith("2 NVML clients kept")


def test_summary_of_one_host_says_host_not_hosts():
    lines = free_gpus_summary([free_gpus_outcome(release([gpu(0, 40970)], [gpu(0, 0)]), "node-a")], ["node-a"])
    assert lines[-1] == "1 host: 1 freed"
    lines = free_gpus_summary([], ["node-a", "node-b"])
    assert lines[-1] == "2 hosts: 2 unreachable (node-a, node-b)"


def test_rescued_host_keeps_its_gates_outcome_with_the_message_put_back():
    from ansible_collections.zeromib.gpu.plugins.filter.free_gpus import free_gpus_rescued
    failed = {"msg": "n2: GPU 1 reads 2000 MiB", "ansible_facts": {"free_gpus_result": {"host": "n2", "ok": False, "status": "dirty"}}}
    outcome = free_gpus_rescued(failed, "n2", None, {"action": "zeromib.gpu.free_gpus_gate"})
    assert outcome == {"host": "n2", "ok": False, "status": "dirty", "message": "n2: GPU 1 reads 2000 MiB"}


def test_rescued_host_without_an_outcome_gets_one_from_its_message():
    from ansible_collections.zeromib.gpu.plugins.filter.free_gpus import free_gpus_rescued
    outcome = free_gpus_rescued({"msg": "Validation of arguments failed:\nvalue of x"}, "n2", None, {"action": "zeromib.gpu.free_gpus_gate"})
    assert (outcome["status"], outcome["ok"], outcome["message"]) == ("failed", False, "n2: Validation of arguments failed: value of x")


def test_host_stopped_by_another_hosts_failure_says_which_host():
    from ansible_collections.zeromib.gpu.plugins.filter.free_gpus import free_gpus_rescued
    hostvars = {"n1": {"free_gpus_result": {"host": "n1", "ok": True}},
                "n2": {"ansible_failed_task": {"action": "zeromib.gpu.free_gpus_gate"}},
                "n3": {}}
    own = {"host": "n1", "ok": True, "status": "freed", "message": "n1: 8 GPUs free"}
    outcome = free_gpus_rescued(None, "n1", own, None, hostvars, ["n1", "n2", "n3"], ["n2"])
    assert outcome["status"] == "stopped" and outcome["stopped_by"] == ["n2"]
    assert outcome["message"] == "n1: its GPUs are free, but the play stops here because n2 failed (any_errors_fatal)"
    unreachable = free_gpus_rescued(None, "n1", own, None, {"n1": {}, "n3": {}}, ["n1", "n3"], [])
    assert unreachable["message"].endswith("because n3 failed or was unreachable (any_errors_fatal)")


def test_summary_from_hostvars_lists_a_host_without_a_result_of_this_run_with_its_error():
    from ansible_collections.zeromib.gpu.plugins.filter.free_gpus import free_gpus_summary
    ok = free_gpus_outcome(release([gpu(0, 0)], [gpu(0, 0)], changed=False), "n1")
    hostvars = {"n1": {"free_gpus_result": ok}, "n2": {"_free_gpus_failure": "template error in free_gpus_gpus"},
                "n3": {"free_gpus_result": dict(ok, host="n3")}}
    lines = free_gpus_summary(hostvars, ["n1", "n2", "n3"], ["n1", "n2"])
    assert lines[1].split()[:2] == ["unreachable", "n3"]  # a cached result of an earlier run is not read
    assert lines[2].split()[:3] == ["failed", "n2", "-"] and lines[2].endswith("n2: template error in free_gpus_gpus")
    assert lines[-1] == "3 hosts: 1 unreachable (n3), 1 failed, 1 clean"


def test_checks_that_could_not_run_are_said_in_the_message_and_the_summary():
    after = [dict(gpu(i, 0), healthy=True, health_checked=False, health_unchecked=["row_remap", "mig"]) for i in range(8)]
    after[0]["health_unchecked"] = ["xid", "mig"]
    result = release([gpu(i, 0) for i in range(8)], after, changed=False, healthy=True, health_checked=False)
    outcome = free_gpus_outcome(result, "node01", 8, require_healthy=True)
    assert outcome["ok"] and outcome["health_unchecked"] == ["row_remap", "mig", "xid"]
    assert outcome["message"] == "node01: 8 GPUs free (0 -> 0 MiB) in 0.41 s; not checked on this driver or GPU: row_remap, mig, xid"
    line = [row for row in free_gpus_summary([outcome]) if row.startswith("clean")][0]
    assert line.endswith("not checked: row_remap, mig, xid")


def test_every_check_ran_says_nothing_more():
    after = [dict(gpu(0, 0), healthy=True, health_checked=True, health_unchecked=[])]
    outcome = free_gpus_outcome(release([gpu(0, 0)], after, changed=False, healthy=True, health_checked=True), "node01", 1, require_healthy=True)
    assert outcome["message"] == "node01: 1 GPU free (0 -> 0 MiB) in 0.41 s" and outcome["health_unchecked"] == []


def test_spanning_holders_are_in_the_outcome_and_the_summary():
    refused = {"failed": True, "msg": "refusing to free GPU 1: pid 700 python3 [python3 jax.py] (state S) uses GPUs 0,1; GPU 0 is "
               "outside the selection", "selected_gpus": [1], "gpus": [], "spanning": [
                   {"pid": 700, "name": "python3", "cmdline": "python3 jax.py", "unit": None, "container": None, "pids": [700],
                    "gpu_indexes": [0, 1], "outside_gpus": [0]}]}
    outcome = free_gpus_outcome(refused, "node1")
    assert outcome["ok"] is False and outcome["spanning"][0]["outside_gpus"] == [0] and "uses GPUs 0,1" in outcome["message"]
    ended = {"changed": True, "released": True, "selected_gpus": [1], "gpus": [{"index": 1, "memory_used_mib": 0, "clean": True}],
             "gpus_before": [{"index": 1, "memory_used_mib": 60000}], "killed": [{"pid": 700, "name": "python3", "signal": "SIGTERM"}],
             "spanning": [{"pid": None, "unit": "vllm.service", "gpu_indexes": [0, 1], "outside_gpus": [0]}], "elapsed_s": 0.3}
    outcome = free_gpus_outcome(ended, "node2")
    assert outcome["ok"] is True and "ended spanning vllm.service uses GPUs 0,1 (kill_spanning)" in outcome["message"]
    lines = free_gpus_summary([outcome])
    assert "spanning: vllm.service uses GPUs 0,1" in lines[1]


def test_unknown_role_variables_names_each_typo_of_a_role_with_the_closest_known_name():
    import os

    import pytest
    from ansible.errors import AnsibleFilterError

    from ansible_collections.zeromib.gpu.plugins.filter.role_variables import unknown_role_variables

    roles = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "roles")
    names = ["restore_gpus_resume_drainned", "restore_gpus_forget", "restore_gpus_result"]
    assert unknown_role_variables(names, os.path.join(roles, "restore_gpus"), "restore_gpus_", not_options=["restore_gpus_result"]) == [
        "restore_gpus_resume_drainned is not a variable of the zeromib.gpu.restore_gpus role; did you mean restore_gpus_resume_drained?"]
    assert unknown_role_variables(["slurm_gpu_checks_state"], os.path.join(roles, "slurm_gpu_checks"), "slurm_gpu_checks_") == []
    with pytest.raises(AnsibleFilterError, match="no meta/argument_specs.yml"):
        unknown_role_variables([], os.path.join(roles, "nonexistent"), "x_")


def test_restore_summary_is_one_line_per_host_worst_first():
    from ansible_collections.zeromib.gpu.plugins.filter.restore_gpus import restore_gpus_summary

    hostvars = {
        "a": {"restore_gpus_result": {"changed": True, "restored": [{"kind": "unit", "name": "vllm.service", "steps": ["start"]},
                                                                    {"kind": "container", "name": "tgi", "steps": ["restart policy", "start"]}]}},
        "b": {"restore_gpus_result": {"changed": False, "restored": []}},
        "c": {"restore_gpus_result": {"failed": True, "msg": "vllm.service: start failed:\nJob failed"}},
        "d": {},
    }
    lines = restore_gpus_summary(hostvars, ["a", "b", "c", "d"])
    assert [line.split()[:2] for line in lines[1:5]] == [["unreachable", "d"], ["failed", "c"], ["put", "back"], ["nothing", "b"]]
    assert " ".join(lines[2].split()) == "failed c restore failed: vllm.service: start failed: Job failed"
    assert " ".join(lines[3].split()) == "put back a unit vllm.service (start), container tgi (restart policy, start)"
    assert lines[-1] == "4 hosts: 1 unreachable, 1 failed, 1 put back, 1 nothing"
    assert restore_gpus_summary(hostvars, ["a"], True)[1].startswith("would put back  a     unit vllm.service (start)")


def test_check_mode_says_an_nvml_client_of_a_unit_it_stops_ends_with_it():
    """Issue 55: check mode read '1 NVML client kept' for vllm.service's API server, which the real
    run's stop of vllm.service ends."""
    api = {"pid": 300, "name": "vllm", "attribution": "nvml_client", "gpu_indexes": [], "unit": "vllm.service", "guest": None}
    monitor = {"pid": 9, "name": "nvidia-smi", "attribution": "nvml_client", "gpu_indexes": [], "unit": None, "guest": None}
    result = release([gpu(0, 40970)], [gpu(0, 40970)], released=False, stopped_units=["vllm.service"], holders=[api, monitor])
    outcome = free_gpus_outcome(result, "node06", 1, True)
    assert outcome["nvml_clients"] == [{"pid": 9, "name": "nvidia-smi"}]
    assert outcome["nvml_clients_with_units"] == [{"pid": 300, "name": "vllm", "unit": "vllm.service"}]
    assert "1 NVML client stops with vllm.service, 1 NVML client left running" in outcome["message"], outcome["message"]
    line = free_gpus_summary([outcome], ["node06"])[1]
    assert line.endswith("1 NVML client stops with vllm.service; 1 NVML client kept"), line
    # The real run lists only what it left: a client still there after its unit's stop is kept.
    real = free_gpus_outcome(dict(result, released=True, gpus=[gpu(0, 0)]), "node06", 1)
    assert real["nvml_clients_with_units"] == [] and len(real["nvml_clients"]) == 2


def test_a_unit_killed_through_systemd_and_left_failed_is_named_in_the_message_and_the_summary():
    """Issue 55: systemd leaves a unit it SIGKILLed `failed`; nothing said so."""
    result = release([gpu(0, 4096)], [gpu(0, 0)], stopped_units=["stubborn.service"], killed_units=["stubborn.service"],
                     failed_units=["stubborn.service"])
    outcome = free_gpus_outcome(result, "node01", 1)
    assert outcome["message"] == ("node01: 1 GPU free (4096 -> 0 MiB), stopped stubborn.service, left stubborn.service failed (killed "
                                  "through systemd; restore_gpus resets it) in 0.41 s")
    assert "stubborn.service (left failed)" in free_gpus_summary([outcome], ["node01"])[1]


def test_check_mode_says_the_signal_the_real_run_sends_each_holder():
    """Issue 55: the plan said 'killed 1 process' and nothing of the signal; a stopped holder gets SIGKILL at once."""
    killed = [{"pid": 495, "name": "python3", "signal": None, "sigkill_at_once": None},
              {"pid": 512, "name": "python3", "signal": None, "sigkill_at_once": "stopped (state T)"}]
    result = release([gpu(0, 40970)], [gpu(0, 40970)], released=False, killed=killed)
    outcome = free_gpus_outcome(result, "node06", 1, True)
    assert ("would signal 2 processes (1 SIGTERM, then SIGKILL after kill_timeout; 512 python3 SIGKILL at once: stopped (state T))"
            in outcome["message"]), outcome["message"]
    assert "killed" not in outcome["message"]
    line = free_gpus_summary([outcome], ["node06"])[1]
    assert line.split()[:3] == ["would", "free", "node06"] and "512 python3 SIGKILL at once: stopped (state T)" in line, line


def test_the_dev_shm_files_clean_shm_removed_are_in_the_result_the_message_and_the_summary():
    """Issue 58: gpu_release's shm_removed reached only the module's result; the role's fact and its line said nothing of it."""
    removed = [{"path": "/dev/shm/torch_4242_1_0", "size_mib": 8.0, "age_s": 3, "pattern": "torch_*", "user": "alice"},
               {"path": "/dev/shm/nccl-Xb3kLq", "size_mib": 36.5, "age_s": 12, "pattern": "nccl-*", "user": "alice"}]
    result = release([gpu(0, 4623)], [gpu(0, 0)], killed=[{"pid": 495, "name": "python3", "signal": "SIGKILL"}], shm_removed=removed)
    outcome = free_gpus_outcome(result, "node01", 1)
    assert outcome["shm_removed"] == ["/dev/shm/torch_4242_1_0", "/dev/shm/nccl-Xb3kLq"] and outcome["shm_removed_mib"] == 44.5
    assert outcome["message"] == "node01: 1 GPU free (4623 -> 0 MiB), killed 1 process, removed 2 files of /dev/shm (44.5 MiB) in 0.41 s"
    assert free_gpus_summary([outcome], ["node01"])[1].endswith("removed 2 files of /dev/shm (44.5 MiB)")
    planned = free_gpus_outcome(dict(result, released=False, gpus=[gpu(0, 4623)], shm_removed=removed[:1]), "node01", 1, True)
    assert "would remove 1 file of /dev/shm (8.0 MiB)" in planned["message"], planned["message"]
    # Without clean_shm the module returns no list: nothing is said, and the keys read empty.
    plain = free_gpus_outcome(release([gpu(0, 0)], [gpu(0, 0)], changed=False), "node01", 1)
    assert (plain["shm_removed"], plain["shm_removed_mib"]) == ([], 0) and "/dev/shm" not in plain["message"]


def test_the_dev_shm_files_clean_shm_kept_are_said_with_their_reason_in_one_line():
    """Issue 65: a file nothing ties to a process the run ended stays; the fact, the message and the summary say which and why."""
    why = "this run ended no process of its owner (uid 4343)"
    kept = [{"path": "/dev/shm/psm_1a2b3c4d", "size_mib": 1.0, "age_s": 600, "pattern": "psm_*", "user": "bob", "why": why},
            {"path": "/dev/shm/nccl-Q7mZp2", "size_mib": 4.0, "age_s": 9, "pattern": "nccl-*", "user": "root",
             "why": "its owner (uid 0) runs processes this run did not end, which may use it (pid 1 systemd)"}]
    result = release([gpu(0, 4623)], [gpu(0, 0)], killed=[{"pid": 495, "name": "python3", "signal": "SIGKILL"}], shm_kept=kept)
    outcome = free_gpus_outcome(result, "node01", 1)
    assert outcome["shm_kept"] == [{"path": k["path"], "size_mib": k["size_mib"], "why": k["why"]} for k in kept]
    said = ("kept 2 files of /dev/shm (5 MiB): /dev/shm/psm_1a2b3c4d (this run ended no process of its owner (uid 4343)); /dev/shm/nccl-Q7mZp2 "
            "(its owner (uid 0) runs processes this run did not end, which may use it (pid 1 systemd))")
    assert outcome["message"] == f"node01: 1 GPU free (4623 -> 0 MiB), killed 1 process, {said} in 0.41 s", outcome["message"]
    assert "\n" not in outcome["message"] and free_gpus_summary([outcome], ["node01"])[1].endswith(said)
    plain = free_gpus_outcome(release([gpu(0, 0)], [gpu(0, 0)], changed=False), "node01", 1)
    assert plain["shm_kept"] == [] and "/dev/shm" not in plain["message"]


def test_a_result_cut_to_its_first_entries_is_counted_whole_in_the_outcome_and_the_summary():
    """Issue 66: gpu_release lists at most 50 of each list and counts them in `truncated`."""
    result = release([gpu(0, 40970)], [gpu(0, 0)], killed=[{"pid": n, "name": "python3", "signal": "SIGKILL"} for n in range(50)],
                     truncated={"killed": 3000, "shm_removed": 120}, shm_removed=[{"path": f"/dev/shm/nccl-{n}", "size_mib": 1.0} for n in range(50)],
                     shm_removed_mib=120.0)
    outcome = free_gpus_outcome(result, "node09")
    assert (outcome["killed_count"], outcome["shm_removed_count"], outcome["shm_removed_mib"]) == (3000, 120, 120.0)
    assert "killed 3000 processes" in outcome["message"]
    [line] = [line for line in free_gpus_summary([outcome], ["node09"]) if "node09" in line]
    assert " 3000 " in line


def test_the_kept_dev_shm_files_are_named_five_then_counted_whatever_a_user_made():
    """A user sets how many files of job patterns stay in /dev/shm: the line names five with their
    reason, then counts the rest (gpu_release lists 50 of them, `truncated` counts them all)."""
    why = "this run ended no process of its owner (uid 4343)"
    kept = [{"path": f"/dev/shm/psm_{n:08x}", "size_mib": 0.0, "why": why} for n in range(50)]
    result = release([gpu(0, 4623)], [gpu(0, 0)], killed=[{"pid": 495, "name": "python3", "signal": "SIGKILL"}],
                     shm_kept=kept, truncated={"shm_kept": 300000})
    outcome = free_gpus_outcome(result, "node01", 1)
    assert outcome["shm_kept_count"] == 300000
    assert "kept 300000 files of /dev/shm (0 MiB listed): /dev/shm/psm_00000000 (" in outcome["message"]
    assert outcome["message"].count("/dev/shm/psm_") == 5 and "; and 299995 more" in outcome["message"]
    assert len(outcome["message"]) < 600, len(outcome["message"])


def test_ranks_of_a_multi_node_job_are_named_in_the_first_sentence_and_the_summary():
    # The survivors on the other nodes hang in a collective holding their GPUs: the operator
    # reads which job in the host's first sentence, not only in a warning further down.
    result = release([gpu(0, 30000)], [gpu(0, 0)], killed=[{"pid": 70, "name": "python3", "signal": "SIGTERM"}],
                     multi_node=[{"pid": 70, "launcher": "Slurm job 77 on 2 nodes (gpu[01-02])"},
                                 {"pid": 71, "launcher": "Slurm job 77 on 2 nodes (gpu[01-02])"}])
    outcome = free_gpus_outcome(result, "gpu01", 1)
    assert outcome["ok"] and outcome["multi_node"] == ["Slurm job 77 on 2 nodes (gpu[01-02])"]
    assert outcome["message"].split(" in 0.41 s")[0] == (
        "gpu01: 1 GPU free (30000 -> 0 MiB), killed 1 process, ranks of multi-node Slurm job 77 on 2 nodes (gpu[01-02]) "
        "(their ranks on the other nodes hang in a collective until freed)")
    assert "multi-node: Slurm job 77 on 2 nodes (gpu[01-02])" in free_gpus_summary([outcome])[1]
    assert free_gpus_outcome(release([gpu(0, 3)], [gpu(0, 0)]), "gpu02", 1)["multi_node"] == []


def test_actors_ended_through_ray_are_named_in_the_first_sentence():
    # Issue 72: what Ray would have started again was ended through Ray, before the signals.
    actors = [{"id": "a1", "name": "trainer0", "pid": 224, "ended": True}, {"id": "a2", "name": "", "pid": 225, "ended": False}]
    result = release([gpu(0, 3000)], [gpu(0, 0)], killed=[{"pid": 285, "name": "gpu_holder", "signal": "SIGTERM"}], ray_actors=actors)
    outcome = free_gpus_outcome(result, "gpu01", 1)
    assert outcome["ok"] and outcome["ray_actors"] == ["trainer0"]
    assert outcome["message"].split(" in 0.41 s")[0] == (
        "gpu01: 1 GPU free (3000 -> 0 MiB), ended Ray actor trainer0 through Ray (no_restart), killed 1 process")
    assert free_gpus_outcome(release([gpu(0, 3)], [gpu(0, 0)]), "gpu02", 1)["ray_actors"] == []
