"""Launchers and units on real systemd hosts (issue 12): Debian's atd and cron, a one-node Slurm
cluster per host (slurmd, slurmctld, munge), a notebook hub whose kernels are its children, a
vLLM-V1-shaped unit, a unit that ignores SIGTERM with systemd's default stop timeout, and
masking. Written in terms of GPU memory, PIDs and unit states, never of which /dev/nvidiaN a
process has open (a CUDA process opens every GPU's node on real hardware).

Runs on any fleet size: `ZEROMIB_FLEET_HOSTS=1 pytest tests/fleet/test_launchers_fleet.py`."""
from __future__ import annotations

import time

import pytest

from scenarios import (FAIL_TASK, PLAYBOOK, RELEASE_TASK, alive, baseline, failure_messages, main_pid, summary_lines, summary_row,
                       summary_status, unit_states, wait_for)

pytestmark = pytest.mark.usefixtures("fleet_baselines")

RESTORE = "playbooks/restore_gpus.yml"
RESTORE_TASK = "zeromib.gpu.restore_gpus : Put back the units and containers gpu_release stopped, disabled or masked"

KILL_TIMEOUT = 2
LAUNCHERS = ("atd.service", "cron.service", "slurmd.service", "slurmctld.service", "notebook-hub.service")


def gpu_host(fleet, count=4) -> str:
    """A host with at least COUNT GPUs that idle at 0 MiB."""
    return next(h.name for h in fleet.hosts if h.gpu_count >= count and h.idle_mib == 0)


def main_pids(fleet, host, units) -> dict:
    return {u: main_pid(fleet, host, u) for u in units}


# --------------------------------------------------------------------------- one host, every launcher

@pytest.fixture(scope="module")
def launched(fleet, fleet_baselines):
    """On one host: an `at` job on GPU 0, a cron job on GPU 1, a Slurm batch job on GPU 2, a hub
    kernel on GPU 3, and vllm-v1.service (API server without GPU, EngineCore on GPU 0). First
    `free_gpus.yml --check`, then the real run, both limited to that host."""
    fleet.reset()
    host = gpu_host(fleet)
    jobs = {
        "at-job": fleet.workload(host, "at-job", gpus="0", mib=1000),
        "cron-job": fleet.workload(host, "cron-job", gpus="1", mib=2000),
        "slurm-job": fleet.workload(host, "slurm-job", gpus="2", mib=3000),
        "hub-kernel": fleet.workload(host, "hub-kernel", gpus="3", mib=4000),
    }
    v1 = fleet.workload(host, "vllm-v1")
    before = fleet.gpu_memory(host)
    launchers_before = main_pids(fleet, host, LAUNCHERS)
    check = fleet.ansible_playbook(PLAYBOOK, limit=host, check=True, extra_vars={"free_gpus_kill_timeout": KILL_TIMEOUT})
    after_check = fleet.gpu_memory(host)
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_kill_timeout": KILL_TIMEOUT})
    t_run = time.monotonic()
    try:
        yield {"host": host, "jobs": jobs, "v1": v1, "before": before, "after_check": after_check, "check": check, "run": run,
               "launchers_before": launchers_before, "t_run": t_run, "after": fleet.gpu_memory(host)}
    finally:
        fleet.reset()


def test_launchers_stay_active_with_their_pids_and_only_their_gpu_jobs_are_gone(launched, fleet):
    host, run = launched["host"], launched["run"]
    assert run.rc == 0, run
    assert launched["before"][0] >= 1000 + 20480 and launched["before"][3] >= 4000
    assert launched["after"] == baseline(fleet, host)
    states = unit_states(fleet, host, *LAUNCHERS)
    assert {u: s[0] for u, s in states.items()} == {u: "active" for u in LAUNCHERS}
    assert main_pids(fleet, host, LAUNCHERS) == launched["launchers_before"]
    jobs = {name: job["pid"] for name, job in launched["jobs"].items()}
    assert not any(alive(fleet, host, jobs.values()).values()), jobs
    res = run.result(RELEASE_TASK, host)
    assert not set(res["stopped_units"]) & set(LAUNCHERS), res["stopped_units"]
    assert {k["pid"] for k in res["killed"]} >= set(jobs.values())


def test_each_launcher_is_named_in_the_result_and_the_slurm_job_with_its_id(launched, fleet):
    host = launched["host"]
    res = launched["run"].result(RELEASE_TASK, host)
    by_unit = {e["unit"]: e for e in res["launchers"]}
    jobs = launched["jobs"]
    assert by_unit["atd.service"]["pids"] == [jobs["at-job"]["pid"]]
    assert by_unit["cron.service"]["pids"] == [jobs["cron-job"]["pid"]]
    assert by_unit["notebook-hub.service"]["pids"] == [jobs["hub-kernel"]["pid"]]
    assert "jupyterhub" in by_unit["notebook-hub.service"]["reason"]  # known by its main process, not its unit's name
    slurm = by_unit["slurmd.service"]
    assert slurm["pids"] == [jobs["slurm-job"]["pid"]] and slurm["slurm_job_id"] and slurm["slurm_job_id"].isdigit()
    # the job is gone from Slurm's queue too (its batch step ended with its task)
    assert wait_for(lambda: fleet.ssh(host, "squeue -h -j {} 2>/dev/null".format(slurm["slurm_job_id"])).stdout.strip() == "", timeout=10)


def test_vllm_v1_shaped_unit_is_stopped_through_systemd_and_not_respawned(launched, fleet):
    host = launched["host"]
    res = launched["run"].result(RELEASE_TASK, host)
    assert res["stopped_units"] == ["vllm-v1.service"], res["stopped_units"]
    assert launched["v1"]["pid"] not in {k["pid"] for k in res["killed"]}  # stopped, not signalled
    time.sleep(max(0.0, 3.0 - (time.monotonic() - launched["t_run"])))  # Restart=always, RestartSec=1
    assert unit_states(fleet, host, "vllm-v1.service")["vllm-v1.service"][0] == "inactive"
    assert main_pid(fleet, host, "vllm-v1.service") == 0
    assert not any(alive(fleet, host, [launched["v1"]["pid"], *launched["v1"]["workers"]]).values())
    assert fleet.gpu_memory(host) == baseline(fleet, host)


def test_check_mode_lists_the_same_plan_and_acts_on_nothing(launched):
    host = launched["host"]
    assert launched["check"].rc == 0, launched["check"]
    assert launched["after_check"] == launched["before"]
    planned = launched["check"].result(RELEASE_TASK, host)
    done = launched["run"].result(RELEASE_TASK, host)
    assert planned["stopped_units"] == done["stopped_units"]
    assert sorted(k["pid"] for k in planned["killed"]) == sorted(k["pid"] for k in done["killed"])
    assert [(e["unit"], e["pids"], e["slurm_job_id"]) for e in planned["launchers"]] == [
        (e["unit"], e["pids"], e["slurm_job_id"]) for e in done["launchers"]]


# --------------------------------------------------------------------------- single scenarios

def test_freeing_gpu_1_leaves_launcher_jobs_on_other_gpus_running(clean_fleet):
    fleet = clean_fleet
    host = gpu_host(fleet)
    keep = [fleet.workload(host, "at-job", gpus="0", mib=1000), fleet.workload(host, "hub-kernel", gpus="2", mib=3000)]
    go = [fleet.workload(host, "at-job", gpus="1", mib=1500), fleet.workload(host, "slurm-job", gpus="1", mib=500)]
    before = fleet.gpu_memory(host)
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_gpus": [1], "free_gpus_kill_timeout": KILL_TIMEOUT})
    assert run.rc == 0, run
    after = fleet.gpu_memory(host)
    # GPU 1 reads the cross-GPU footprint (4 MiB) of the jobs kept on GPUs 0 and 2.
    assert after[1] == 4 and (after[0], after[2]) == (before[0], before[2]), (before, after)
    live = alive(fleet, host, [j["pid"] for j in keep + go])
    assert live == {keep[0]["pid"]: True, keep[1]["pid"]: True, go[0]["pid"]: False, go[1]["pid"]: False}
    states = unit_states(fleet, host, "atd.service", "slurmd.service", "notebook-hub.service")
    assert {s[0] for s in states.values()} == {"active"}, states
    res = run.result(RELEASE_TASK, host)
    assert res["stopped_units"] == [] and {e["unit"] for e in res["launchers"]} == {"atd.service", "slurmd.service"}


def test_term_ignoring_unit_with_the_default_90s_stop_timeout_is_freed_within_kill_timeout(clean_fleet):
    fleet = clean_fleet
    host = gpu_host(fleet)
    stubborn = fleet.workload(host, "stubborn-unit")
    props = fleet.ssh(host, "systemctl show -p TimeoutStopUSec,Restart stubborn.service", check=True).stdout.splitlines()
    assert sorted(props) == ["Restart=always", "TimeoutStopUSec=1min 30s"], props  # not the fleet's DefaultTimeoutStopSec=5s
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_kill_timeout": KILL_TIMEOUT})
    assert run.rc == 0, run
    res = run.result(RELEASE_TASK, host)
    assert res["stopped_units"] == ["stubborn.service"] and res["killed_units"] == ["stubborn.service"], res
    assert KILL_TIMEOUT <= res["timings"]["stop_s"] < KILL_TIMEOUT + 3, res["timings"]
    assert res["elapsed_s"] < KILL_TIMEOUT + 5, res["elapsed_s"]
    time.sleep(2.5)  # RestartSec=1: a respawn would show by now
    assert unit_states(fleet, host, "stubborn.service")["stubborn.service"][0] == "failed"
    assert not alive(fleet, host, [stubborn["pid"]])[stubborn["pid"]]
    assert fleet.gpu_memory(host) == baseline(fleet, host)
    # Issue 55: systemd leaves the unit it SIGKILLed failed; the run says so, and restore resets it before its start.
    assert res["failed_units"] == ["stubborn.service"], res
    said = ("stubborn.service was killed through systemd (the stop outlasted free_gpus_kill_timeout, 2 s) and is left failed: gpu_restore "
            "(the restore_gpus role) resets it before starting it again (by hand: systemctl reset-failed stubborn.service)")
    assert said in " ".join((run.stdout + run.stderr).split()), run
    assert "stubborn.service (left failed)" in summary_row(summary_lines(run), host)
    restore = fleet.ansible_playbook(RESTORE, limit=host)
    assert restore.rc == 0, restore
    back = restore.result(RESTORE_TASK, host)
    assert back["reset_failed_units"] == ["stubborn.service"] and back["started_units"] == ["stubborn.service"], back
    assert unit_states(fleet, host, "stubborn.service")["stubborn.service"][0] == "active"
    assert fleet.ssh(host, "systemctl show -p Result --value stubborn.service", check=True).stdout.strip() == "success"


def test_masked_is_refused_before_acting_for_a_unit_whose_file_is_in_etc(clean_fleet):
    fleet = clean_fleet
    host = gpu_host(fleet)
    v1 = fleet.workload(host, "vllm-v1")
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={
        "free_gpus_services": ["vllm-v1"], "free_gpus_service_state": "masked", "free_gpus_wait_timeout": 5})
    assert run.rc != 0, run
    res = run.result(RELEASE_TASK, host)
    assert "cannot mask vllm-v1.service (/etc/systemd/system/vllm-v1.service)" in res["msg"], res["msg"]
    assert "Move the unit file to /usr/local/lib/systemd/system/" in res["msg"]
    assert res["stopped_units"] == [] and res["killed"] == []
    # nothing was done: the unit still runs its processes, the GPU is still held
    assert unit_states(fleet, host, "vllm-v1.service")["vllm-v1.service"] == ("active", "disabled")
    assert alive(fleet, host, [v1["pid"]])[v1["pid"]] and fleet.gpu_memory(host)[0] >= 20480
    # issue 32: said once, in the summary; the task that fails the host points to it
    assert "cannot mask" in summary_row(summary_lines(run), host), summary_lines(run)
    assert failure_messages(run, host) == [f"{host}: not free (its line in the fleet summary above says why)"]


PACKAGED = "/usr/local/lib/systemd/system"
LLM_SERVICE = """[Unit]
Description=An LLM server installed under /usr/local/lib (simulated)
[Service]
ExecStartPre=-/bin/rm -f /run/nvidia-sim/ready/llm-packaged
ExecStart=/usr/local/bin/gpu_holder --gpus 1 --mib 6000 --name llm_serve --ready-file /run/nvidia-sim/ready/llm-packaged
Restart=always
RestartSec=1
[Install]
WantedBy=multi-user.target
"""
LLM_SOCKET = """[Unit]
Description=Starts llm-packaged.service on a connection (simulated)
[Socket]
ListenStream=127.0.0.1:18123
[Install]
WantedBy=sockets.target
"""


@pytest.fixture
def packaged_unit(clean_fleet):
    """llm-packaged.service and the socket that triggers it, installed in /usr/local/lib/systemd/system."""
    fleet = clean_fleet
    host = gpu_host(fleet)
    fleet.ssh(host, f"mkdir -p {PACKAGED} && cat > {PACKAGED}/llm-packaged.service <<'EOF'\n{LLM_SERVICE}EOF\n"
                    f"cat > {PACKAGED}/llm-packaged.socket <<'EOF'\n{LLM_SOCKET}EOF\n"
                    "systemctl daemon-reload && systemctl enable --now llm-packaged.socket llm-packaged.service", check=True)
    assert wait_for(lambda: fleet.gpu_memory(host)[1] >= 6000, timeout=15)
    yield fleet, host
    fleet.ssh(host, "systemctl unmask llm-packaged.service llm-packaged.socket; systemctl disable --now llm-packaged.socket "
                    f"llm-packaged.service; rm -f {PACKAGED}/llm-packaged.*; systemctl daemon-reload; systemctl reset-failed")


def test_masked_works_for_a_unit_in_usr_local_lib_and_takes_the_socket_that_triggers_it(packaged_unit):
    fleet, host = packaged_unit
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={
        "free_gpus_services": ["llm-packaged"], "free_gpus_service_state": "masked"})
    assert run.rc == 0, run
    res = run.result(RELEASE_TASK, host)
    assert res["stopped_units"] == ["llm-packaged.service", "llm-packaged.socket"], res
    assert res["masked_units"] == ["llm-packaged.service", "llm-packaged.socket"], res
    states = unit_states(fleet, host, "llm-packaged.service", "llm-packaged.socket")
    # A stop that outlasts kill_timeout (a loaded CI machine) ends in SIGKILL through systemd, which
    # leaves the unit failed: then the run must have said so (failed_units, killed_units), never silently.
    ended = "failed" if "llm-packaged.service" in (res.get("failed_units") or []) else "inactive"
    assert ended == "inactive" or "llm-packaged.service" in (res.get("killed_units") or []), res
    assert states == {"llm-packaged.service": (ended, "masked"), "llm-packaged.socket": ("inactive", "masked")}, (states, res)
    # Masked without a daemon-reload (issue 69): both are enabled, so systemd keeps them loaded as they
    # were until its next reload or boot, and the run says so.
    assert any("llm-packaged.service, llm-packaged.socket are stopped and masked on disk" in w for w in res.get("warnings", [])), res
    # a connection to the old socket address starts nothing; from systemd's next reload on, a start is refused
    fleet.ssh(host, "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 18123), 1)' 2>/dev/null; true")
    assert fleet.gpu_memory(host) == baseline(fleet, host)
    fleet.ssh(host, "systemctl daemon-reload", check=True)
    started = fleet.ssh(host, "systemctl start llm-packaged.service")
    assert started.returncode != 0 and "masked" in started.stderr, started.stderr
    # idempotent: a second run has nothing left to do
    again = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={
        "free_gpus_services": ["llm-packaged"], "free_gpus_service_state": "masked"})
    assert again.rc == 0 and again.stats[host]["changed"] == 0, again


# --------------------------------------------------------------------------- check mode on a broken node

@pytest.mark.parametrize("fault", ["nvidia-smi missing", "nvidia-smi hung"])
def test_check_mode_fails_on_a_node_whose_nvidia_smi_is_missing_or_hung(clean_fleet, fault):
    fleet = clean_fleet
    host = gpu_host(fleet)
    train = fleet.workload(host, "train", gpus="0", mib=1000)
    if fault == "nvidia-smi missing":
        fleet.ssh(host, "mv /usr/bin/nvidia-smi /usr/bin/nvidia-smi.away", check=True)
    else:
        fleet.set_fault(host, hang=True)
    try:
        run = fleet.ansible_playbook(PLAYBOOK, limit=host, check=True, extra_vars={"free_gpus_timeout": 2})
    finally:
        if fault == "nvidia-smi missing":
            fleet.ssh(host, "mv /usr/bin/nvidia-smi.away /usr/bin/nvidia-smi", check=True)
        else:
            fleet.clear_faults(host)
    assert run.rc != 0, run
    assert run.stats[host]["failures"] >= 1, run.stats
    # issue 32: under free_gpus.yml the gate records the outcome (ok) and the summary says why, once;
    # the playbook's last task fails the host
    assert [t["status"] for t in run.results(task=RELEASE_TASK, host=host)] == ["ok"]
    assert [t["status"] for t in run.results(task=FAIL_TASK, host=host)] == ["failed"]
    assert summary_status(summary_lines(run), host) == "failed", summary_lines(run)
    messages = summary_row(summary_lines(run), host)
    assert ("not found" in messages) if fault == "nvidia-smi missing" else ("timed out" in messages), messages
    assert alive(fleet, host, [train["pid"]])[train["pid"]]  # a dry run never acts


def test_check_mode_plans_sigkill_at_once_for_a_stopped_holder_as_the_real_run_sends_it(clean_fleet):
    """Issue 55: check mode's plan says the signal the real run will send; a stopped holder (Ctrl-Z,
    SIGSTOP) cannot act on SIGTERM and gets SIGKILL at once."""
    fleet = clean_fleet
    host = gpu_host(fleet)
    train = fleet.workload(host, "train", gpus="0", mib=2048)
    fleet.ssh(host, f"kill -STOP {train['pid']}", check=True)
    try:
        check = fleet.ansible_playbook(PLAYBOOK, limit=host, check=True, extra_vars={"free_gpus_kill_timeout": KILL_TIMEOUT})
        assert check.rc == 0, check
        planned = run_entry(check.result(RELEASE_TASK, host), train["pid"])
        assert (planned["signal"], planned["sigkill_at_once"]) == (None, "stopped (state T)"), planned
        row = summary_row(summary_lines(check), host)
        assert row.split()[:2] == ["would", "free"] and f"{train['pid']} " in row and "SIGKILL at once: stopped (state T)" in row, row
        assert alive(fleet, host, [train["pid"]])[train["pid"]]
        run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_kill_timeout": KILL_TIMEOUT})
        assert run.rc == 0, run
        done = run_entry(run.result(RELEASE_TASK, host), train["pid"])
        assert (done["signal"], done["sigkill_at_once"]) == ("SIGKILL", "stopped (state T)"), done
    finally:
        fleet.ssh(host, f"kill -KILL {train['pid']} 2>/dev/null; true")


def run_entry(result, pid):
    [entry] = [k for k in result["killed"] if k["pid"] == pid]
    return entry
