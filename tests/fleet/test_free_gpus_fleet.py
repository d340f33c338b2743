"""free_gpus.yml and the free_gpus role over SSH against a fleet of real systemd hosts.

Each test is named after the incident it prevents. One busy-fleet run is shared by several
tests (module fixture); the other scenarios each make their own run on the session fleet and
leave every host idle behind them."""
from __future__ import annotations

import time

import pytest

from scenarios import (GATE_TASK, PLAYBOOK, RELEASE_TASK, ROLE, Cast, alive, baseline,
                       main_pid, memory, parallel, summary_lines, summary_status, unit_states,
                       wait_for)

pytestmark = pytest.mark.usefixtures("fleet_baselines")

KILL_TIMEOUT = 2
FOOTPRINT = 4  # MiB a GPU without a context reads while contexts live on other GPUs (H200)


# --------------------------------------------------------------------------- one busy fleet, one run

@pytest.fixture(scope="module")
def busy(fleet, fleet_baselines):
    """Busy workloads on several hosts, then ONE `free_gpus.yml -l gpu_nodes` run."""
    fleet.reset()
    cast = Cast(fleet)
    started = {}

    def persistenced(host):
        return host, fleet.workload(host, "persistenced")

    started["persistenced"] = dict(parallel(persistenced, fleet.names))
    plan = [
        (cast.vllm, "vllm", {}),
        (cast.sglang, "sglang", {}),
        (cast.train, "train", {}),  # every GPU, in the SSH login session's scope
        (cast.stubborn, "ignore-term", {"gpus": "0,1", "mib": 2048}),
        (cast.stubborn, "train", {"gpus": "2", "mib": 1024}),
        (cast.orphan, "orphan", {"gpus": "2", "mib": 4096}),  # on the H100 GPU 2 is /dev/nvidia3
    ]
    if cast.mig:
        plan.append((cast.mig, "train", {"gpus": "1", "mib": 512}))
    for host, name, kw in plan:
        started.setdefault(name, {}).setdefault(host, []).append(fleet.workload(host, name, **kw))
    before = memory(fleet)
    persist_pids = {h: main_pid(fleet, h, "nvidia-persistenced.service") for h in fleet.names}
    run = fleet.ansible_playbook(PLAYBOOK, limit="gpu_nodes", extra_vars={"free_gpus_kill_timeout": KILL_TIMEOUT})
    after = memory(fleet)
    t_after = time.monotonic()
    yield {"cast": cast, "started": started, "before": before, "after": after, "run": run,
           "persist_pids": persist_pids, "t_after": t_after}
    fleet.reset()


def test_one_run_frees_every_gpu_of_a_busy_fleet_to_its_hosts_baseline(busy, fleet):
    run, cast = busy["run"], busy["cast"]
    assert run.rc == 0, run
    for host in fleet.names:
        assert run.stats[host]["failures"] == 0 and run.stats[host]["unreachable"] == 0, run.stats
        assert busy["after"][host] == baseline(fleet, host), f"{host}: {busy['after'][host]}"
    # the busy hosts really were busy, and changed; the idle ones were left alone
    busy_hosts = {cast.vllm, cast.sglang, cast.train, cast.stubborn, cast.orphan} | ({cast.mig} if cast.mig else set())
    for host in fleet.names:
        res = run.result(RELEASE_TASK, host)
        if host in busy_hosts:
            assert busy["before"][host] != baseline(fleet, host), host
            assert res["changed"] is True, (host, res)
        else:
            assert res["changed"] is False and res["killed"] == [] and res["stopped_units"] == [], (host, res)


def test_mig_host_passes_at_its_55_mib_idle_with_max_used_mib_from_group_vars(busy, fleet):
    cast = busy["cast"]
    if not cast.mig:
        pytest.skip("no MIG host in this fleet profile")
    assert set(busy["after"][cast.mig].values()) == {55}
    res = busy["run"].result(RELEASE_TASK, cast.mig)
    assert res["released"] is True and res["invocation"]["module_args"]["max_used_mib"] == 64
    # only the MIG group got the higher threshold
    assert busy["run"].result(RELEASE_TASK, cast.vllm)["invocation"]["module_args"]["max_used_mib"] == 0


def test_restart_always_vllm_is_stopped_through_its_unit_and_has_not_respawned_3s_later(busy, fleet):
    host = busy["cast"].vllm
    res = busy["run"].result(RELEASE_TASK, host)
    assert "vllm.service" in res["stopped_units"], res
    # Restart=always respawns a killed process within ~1-3 s: it must not have been merely killed
    time.sleep(max(0.0, 3.0 - (time.monotonic() - busy["t_after"])))
    assert unit_states(fleet, host, "vllm.service")["vllm.service"][0] == "inactive"
    assert main_pid(fleet, host, "vllm.service") == 0
    assert fleet.gpu_memory(host) == baseline(fleet, host)
    workers = busy["started"]["vllm"][host][0]["workers"]
    assert not any(alive(fleet, host, workers).values())


def test_sglang_owning_unit_is_stopped_not_disabled_when_not_named(busy, fleet):
    host = busy["cast"].sglang
    res = busy["run"].result(RELEASE_TASK, host)
    assert "sglang.service" in res["stopped_units"] and not res.get("disabled_units"), res
    assert unit_states(fleet, host, "sglang.service")["sglang.service"] == ("inactive", "enabled")


def test_stray_session_holders_are_killed_and_a_sigterm_ignorer_gets_sigkill_at_once(busy, fleet):
    cast, run = busy["cast"], busy["run"]
    train = busy["started"]["train"][cast.train][0]
    res = run.result(RELEASE_TASK, cast.train)
    killed = {k["pid"]: k for k in res["killed"]}
    assert killed[train["pid"]]["signal"] == "SIGTERM", res["killed"]
    assert killed[train["pid"]]["unit"] is None or killed[train["pid"]]["unit"].endswith(".scope")
    assert not alive(fleet, cast.train, [train["pid"]])[train["pid"]]

    stubborn = busy["started"]["ignore-term"][cast.stubborn][0]
    res = run.result(RELEASE_TASK, cast.stubborn)
    killed = {k["pid"]: k for k in res["killed"]}
    # Its SIGTERM is ignored (SigIgn): never waited for, SIGKILL at once (issue 31), said in its entry.
    assert killed[stubborn["pid"]]["signal"] == "SIGKILL", res["killed"]
    assert killed[stubborn["pid"]]["sigkill_at_once"] == "ignores SIGTERM", killed[stubborn["pid"]]
    assert killed[stubborn["pid"]]["exited_after_s"] < KILL_TIMEOUT, killed[stubborn["pid"]]
    # the SSH session the holders were started from (its scope) is not stopped: the fleet stays reachable
    assert fleet.ssh(cast.stubborn, "true").returncode == 0


def test_orphaned_child_invisible_to_nvidia_smi_is_found_and_killed(busy, fleet):
    host = busy["cast"].orphan
    orphan = busy["started"]["orphan"][host][0]
    assert busy["before"][host][2] >= 4096
    res = busy["run"].result(RELEASE_TASK, host)
    assert orphan["child_pid"] in {k["pid"] for k in res["killed"]}, res["killed"]
    assert not alive(fleet, host, [orphan["child_pid"]])[orphan["child_pid"]]
    assert busy["after"][host] == baseline(fleet, host)


def test_nvidia_persistenced_survives_on_every_host_with_its_pid_unchanged(busy, fleet):
    for host in fleet.names:
        before = busy["persist_pids"][host]
        assert before > 0
        assert main_pid(fleet, host, "nvidia-persistenced.service") == before, host
        assert unit_states(fleet, host, "nvidia-persistenced.service")["nvidia-persistenced.service"][0] == "active"
        res = busy["run"].result(RELEASE_TASK, host)
        assert before not in {k["pid"] for k in res["killed"]}
        assert "nvidia-persistenced.service" not in res["stopped_units"]


def test_summary_printed_by_free_gpus_limited_to_gpu_nodes_lists_every_host(busy, fleet):
    lines = summary_lines(busy["run"])
    assert lines is not None, "no fleet summary in the run's output:\n" + busy["run"].stdout[-1500:]
    for host in fleet.names:
        assert summary_status(lines, host) in ("freed", "clean"), lines


def test_second_run_on_the_freed_fleet_changes_nothing_and_its_summary_lists_every_host_clean(busy, fleet):
    """Idempotence. Run without -l (inventory `all` is the fleet) so that the summary prints."""
    run = fleet.ansible_playbook(PLAYBOOK, extra_vars={"free_gpus_kill_timeout": KILL_TIMEOUT})
    assert run.rc == 0, run
    for host in fleet.names:
        assert run.stats[host]["changed"] == 0, (host, run.stats[host])
        assert run.result(RELEASE_TASK, host)["killed"] == []
    lines = summary_lines(run)
    assert lines, run
    for host in fleet.names:
        assert summary_status(lines, host) == "clean", "\n".join(lines)
    assert lines[-1] == f"{len(fleet.names)} hosts: {len(fleet.names)} clean"
    # the summary lines are in Ansible's own output too
    assert all(line in run.stdout for line in lines[1:])


# --------------------------------------------------------------------------- single scenarios

def test_service_state_disabled_keeps_sglang_down_across_a_reboot_while_a_control_host_gets_it_back(clean_fleet):
    """One run, two hosts: the first names sglang.service with service_state=disabled, the
    control host gets the role's defaults. Both reboot; only the control's sglang comes back."""
    fleet = clean_fleet
    cast = Cast(fleet)
    target, control = cast.sglang, cast.train
    parallel(lambda h: fleet.workload(h, "sglang"), [target, control])
    play = {
        "name": "Free with and without service_state=disabled", "hosts": f"{target},{control}",
        "gather_facts": False, "become": True,
        "roles": [{"role": ROLE,
                   "free_gpus_services": f"{{{{ ['sglang.service'] if inventory_hostname == '{target}' else [] }}}}",
                   "free_gpus_service_state": f"{{{{ 'disabled' if inventory_hostname == '{target}' else 'stopped' }}}}"}],
    }
    run = fleet.ansible_playbook(play)
    assert run.rc == 0, run
    assert run.result(RELEASE_TASK, target)["disabled_units"] == ["sglang.service"]
    assert "sglang.service" in run.result(RELEASE_TASK, control)["stopped_units"]
    assert not run.result(RELEASE_TASK, control).get("disabled_units")
    for host in (target, control):
        assert fleet.gpu_memory(host) == baseline(fleet, host)
    assert unit_states(fleet, target, "sglang.service")["sglang.service"] == ("inactive", "disabled")

    parallel(fleet.reboot, [target, control])

    assert unit_states(fleet, control, "sglang.service")["sglang.service"] == ("active", "enabled")
    assert wait_for(lambda: all(m >= 30720 for m in fleet.gpu_memory(control).values()), timeout=15)
    time.sleep(1.5)  # RestartSec=1: give a wrongly enabled unit the time to show up
    assert unit_states(fleet, target, "sglang.service")["sglang.service"] == ("inactive", "disabled")
    assert fleet.gpu_memory(target) == baseline(fleet, target)


def test_freeing_gpu_1_only_leaves_the_holders_of_other_gpus_running_and_their_memory_unchanged(clean_fleet):
    fleet = clean_fleet
    host = Cast(fleet).train
    on = {g: fleet.workload(host, "train", gpus=str(g), mib=1000 * (g + 1)) for g in (0, 1, 2)}
    both = fleet.workload(host, "train", gpus="1,3", mib=300)  # holds GPU 1 too: spanning, must go as asked
    fleet.workload(host, "persistenced")
    before = fleet.gpu_memory(host)
    # -v: the gate's task result carries the GPU records (gpus) only then.
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_gpus": [1], "free_gpus_kill_spanning": True}, args=["-v"])
    assert run.rc == 0, run
    res = run.result(RELEASE_TASK, host)
    assert res["selected_gpus"] == [1]
    assert {k["pid"] for k in res["killed"]} == {on[1]["pid"], both["pid"]}
    after = fleet.gpu_memory(host)
    # GPU 1 runs nothing any more; the contexts left on GPUs 0 and 2 put their cross-GPU
    # footprint (4 MiB) on it, and gpu_release counts that clean, saying so per GPU
    assert after[1] == FOOTPRINT
    for g, mib in before.items():
        if g not in (1, 3):
            assert after[g] == mib, (g, before, after)
    assert after[3] == FOOTPRINT  # GPU 3 was held only by the process that also held GPU 1
    gpu1 = [g for g in res["gpus"] if g["index"] == 1][0]
    assert gpu1["clean"] is True and gpu1["cross_gpu_footprint"] is True and res["released"] is True
    live = alive(fleet, host, [on[0]["pid"], on[2]["pid"], on[1]["pid"]])
    assert live == {on[0]["pid"]: True, on[2]["pid"]: True, on[1]["pid"]: False}


def test_per_gpu_freeing_next_to_trainers_and_a_monitor_keeps_them_and_reads_the_footprint(clean_fleet):
    """free_gpus_gpus [2, 3] on two nodes (an H200, and the H100 whose minors differ from its
    indexes when the fleet has one) with a trainer on each of GPUs 0-3 and `nvidia-smi dmon`
    running: only the trainers of GPUs 2 and 3 go; the others and the monitor stay; GPUs 2 and 3
    read the 4 MiB cross-GPU footprint, clean; the summary says freed and why."""
    fleet = clean_fleet
    cast = Cast(fleet)
    hosts = [cast.train] + ([cast.h100] if cast.h100 else [cast.stubborn])

    def start(host):
        trainers = {g: fleet.workload(host, "train", gpus=str(g), mib=1024 * (g + 1)) for g in range(4)}
        return host, {"trainers": trainers, "monitor": fleet.workload(host, "monitor")}

    started = dict(parallel(start, hosts))
    before = memory(fleet, hosts)
    # -v: the gate's task result carries the GPU and holder records only then.
    run = fleet.ansible_playbook(PLAYBOOK, limit=",".join(hosts), extra_vars={"free_gpus_gpus": [2, 3]}, args=["-v"])
    assert run.rc == 0, run
    after = memory(fleet, hosts)
    lines = summary_lines(run)
    assert lines, run
    for host in hosts:
        res = run.result(RELEASE_TASK, host)
        trainers, monitor = started[host]["trainers"], started[host]["monitor"]
        assert res["selected_gpus"] == [2, 3] and res["released"] is True, res
        assert {k["pid"] for k in res["killed"]} == {trainers[2]["pid"], trainers[3]["pid"]}, res["killed"]
        keep = [trainers[0]["pid"], trainers[1]["pid"], monitor["pid"]]
        assert all(alive(fleet, host, keep).values()), (host, alive(fleet, host, keep))
        assert not any(alive(fleet, host, [trainers[2]["pid"], trainers[3]["pid"]]).values())
        assert after[host][2] == after[host][3] == FOOTPRINT, (host, after[host])
        assert after[host][0] == before[host][0] and after[host][1] == before[host][1], (host, before[host], after[host])
        for g in (2, 3):
            gpu = [x for x in res["gpus"] if x["index"] == g][0]
            assert gpu["clean"] is True and gpu["cross_gpu_footprint"] is True, gpu
        [mon] = [h for h in res["holders"] if h["pid"] == monitor["pid"]]
        assert mon["attribution"] == "nvml_client" and mon["gpu_indexes"] == []
        assert summary_status(lines, host) == "freed", "\n".join(lines)
        row = [line for line in lines if line.split()[1:2] == [host]][0]
        assert "GPUs 2,3 (8 MiB): cross-GPU footprint" in row and "1 NVML client kept" in row, row
    assert lines[-1] == f"{len(hosts)} hosts: {len(hosts)} freed"


def test_check_mode_across_the_fleet_changes_nothing_and_reports_the_plan(clean_fleet):
    fleet = clean_fleet
    cast = Cast(fleet)
    parallel(lambda h: fleet.workload(h, "persistenced"), fleet.names)
    vllm = fleet.workload(cast.vllm, "vllm")
    fleet.workload(cast.sglang, "sglang")
    train = fleet.workload(cast.train, "train")
    orphan = fleet.workload(cast.orphan, "orphan", gpus="1", mib=2048)
    before = memory(fleet)
    pids_before = {h: main_pid(fleet, h, "nvidia-persistenced.service") for h in fleet.names}
    run = fleet.ansible_playbook(PLAYBOOK, check=True, extra_vars={
        "free_gpus_services": ["vllm*.service", "sglang.service"], "free_gpus_service_state": "disabled"})
    assert run.rc == 0, run
    assert memory(fleet) == before
    assert unit_states(fleet, cast.vllm, "vllm.service")["vllm.service"][0] == "active"
    assert main_pid(fleet, cast.vllm, "vllm.service") == vllm["pid"]
    assert unit_states(fleet, cast.sglang, "sglang.service")["sglang.service"] == ("active", "enabled")
    assert alive(fleet, cast.train, [train["pid"]])[train["pid"]]
    assert alive(fleet, cast.orphan, [orphan["child_pid"]])[orphan["child_pid"]]
    assert {h: main_pid(fleet, h, "nvidia-persistenced.service") for h in fleet.names} == pids_before
    # the plan
    res = run.result(RELEASE_TASK, cast.vllm)
    assert res["changed"] is True and "vllm.service" in res["stopped_units"] and res["released"] is False
    res = run.result(RELEASE_TASK, cast.sglang)
    assert "sglang.service" in res["stopped_units"] and "sglang.service" in res["disabled_units"]
    res = run.result(RELEASE_TASK, cast.train)
    assert [(k["pid"], k["signal"]) for k in res["killed"]] == [(train["pid"], None)]
    res = run.result(RELEASE_TASK, cast.orphan)
    assert orphan["child_pid"] in {k["pid"] for k in res["killed"]}
    quiet = [h for h in fleet.names if h not in (cast.vllm, cast.sglang, cast.train, cast.orphan)]
    for host in quiet:
        assert run.result(RELEASE_TASK, host)["changed"] is False
    # the dry run asserts too: a host it cannot read fails it; here every host is readable
    assert {t["status"] for t in run.results(task=GATE_TASK)} <= {"ok", "changed"}
    assert len(run.results(task=GATE_TASK)) == len(fleet.names)
    lines = summary_lines(run)
    assert lines, run
    for host in (cast.vllm, cast.sglang, cast.train, cast.orphan):
        assert summary_status(lines, host) == "would free", "\n".join(lines) + "\n" + str(run.result(RELEASE_TASK, host))[:3000]
    for host in quiet:
        assert summary_status(lines, host) == "clean", "\n".join(lines)


def _dirty(fleet, cast):
    fleet.workload(cast.vllm, "vllm")
    fleet.workload(cast.train, "train")
    fleet.workload(cast.orphan, "orphan", gpus="0", mib=1024)
    fleet.workload(cast.stubborn, "train", gpus="3", mib=2048)
    return {cast.vllm, cast.train, cast.orphan, cast.stubborn}


@pytest.mark.parametrize("play_keys", [{"strategy": "free"}, {"serial": 2}], ids=["strategy_free", "serial_2"])
def test_role_frees_a_dirty_fleet_under_strategy_free_and_in_waves(clean_fleet, play_keys):
    fleet = clean_fleet
    cast = Cast(fleet)
    dirty = _dirty(fleet, cast)
    play = {"name": "Free GPUs", "hosts": "gpu_nodes", "gather_facts": False, "become": True,
            **play_keys, "roles": [{"role": ROLE}]}
    run = fleet.ansible_playbook(play)
    assert run.rc == 0, run
    for host, mib in memory(fleet).items():
        assert mib == baseline(fleet, host), host
        assert run.result(RELEASE_TASK, host)["changed"] is (host in dirty), host
    assert unit_states(fleet, cast.vllm, "vllm.service")["vllm.service"][0] == "inactive"
    if "serial" in play_keys:
        # waves of 2: one play start per batch of 2 hosts, the module ran once on each host
        assert run.json["plays"] == ["Free GPUs"] * ((len(fleet.names) + 1) // 2)
        assert sorted(t["host"] for t in run.results(task=RELEASE_TASK)) == sorted(fleet.names)
