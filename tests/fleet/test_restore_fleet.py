"""Putting back what was stopped (issue 24), on real systemd hosts over SSH: free_gpus.yml stops,
disables or masks units, restore_gpus.yml puts every one back to exactly its state before, read
through systemctl (never through the module's return values); a unit whose start fails at restore
is named and kept; the training play restores on every host also when training fails on one; and
the Slurm drain: an admin's drain (reason=maintenance) is kept, only zeromib's are resumed.

Runs on a fleet of 2 or more hosts: `ZEROMIB_FLEET_HOSTS=2 pytest tests/fleet/test_restore_fleet.py`."""
from __future__ import annotations

import json

import pytest

from scenarios import PLAYBOOK, TRAINING, wait_for

pytestmark = pytest.mark.usefixtures("fleet_baselines")

RESTORE = "playbooks/restore_gpus.yml"
RESTORE_TASK = "zeromib.gpu.restore_gpus : Put back the units and containers gpu_release stopped, disabled or masked"
ROLE_SAY_TASK = "zeromib.gpu.restore_gpus : Say what was put back"
FLEET_SUMMARY_TASK = "Fleet restore summary (unreachable and failed hosts first)"
# What a check-mode plan and the real run both report (issue 33): the same values.
PLAN_KEYS = ("changed", "plan", "restored", "started_units", "enabled_units", "unmasked_units", "restored_policies", "started_containers",
             "started_programs", "already_restored", "not_restored", "pending")
RECORD = "/var/lib/zeromib-gpu/released.json"
UNIT_DIR = "/usr/local/lib/systemd/system"  # systemctl mask cannot mask a unit whose file is in /etc
KILL_TIMEOUT = 2

# name -> (GPU, MiB, how it is before the release)
UNITS = {
    "zr-enabled-active": (0, 1000, "enable --now"),
    "zr-enabled-inactive": (1, 1100, "enable"),
    "zr-disabled-active": (2, 1200, "start"),
    "zr-disabled-inactive": (3, 1300, None),
    "zr-masked": (4, 1400, "mask"),
}
UNIT_FILE = """[Unit]
Description=zeromib restore test: {name}
After=nvidia-sim-devices.service
[Service]
ExecStartPre=-/bin/rm -f /run/nvidia-sim/ready/{name}
ExecStart=/usr/local/bin/gpu_holder --gpus {gpu} --mib {mib} --name {name} --ready-file /run/nvidia-sim/ready/{name}
Restart=always
RestartSec=1
[Install]
WantedBy=multi-user.target
"""


def h200(fleet, n=1):
    hosts = [h.name for h in fleet.hosts if h.gpu_count >= 8 and h.idle_mib == 0]
    assert len(hosts) >= n, f"these tests need {n} hosts with 8 GPUs"
    return hosts[:n]


def states(fleet, host, units) -> dict:
    """{unit: (ActiveState, unit file state)}: the file state as the files say (`systemctl
    is-enabled`); `systemctl show` keeps the one systemd last read until a reload, and the
    collection changes unit files without one (issue 69)."""
    out = fleet.ssh(host, "systemctl show -p Id,ActiveState --no-pager " + " ".join(units), check=True).stdout
    files = fleet.ssh(host, "systemctl is-enabled " + " ".join(units)).stdout.split()
    assert len(files) == len(units), files
    found, cur = {}, {}
    for line in out.splitlines() + [""]:
        if not line.strip():
            if cur.get("Id"):
                found[cur["Id"]] = (cur.get("ActiveState"), files[units.index(cur["Id"])])
            cur = {}
            continue
        key, _sep, value = line.partition("=")
        cur[key] = value
    return found


def record(fleet, host):
    r = fleet.ssh(host, f"cat {RECORD} 2>/dev/null")
    return json.loads(r.stdout) if r.stdout.strip() else None


def install_units(fleet, host, extra_failing=False):
    script = [f"mkdir -p {UNIT_DIR}"]
    for name, (gpu, mib, _how) in UNITS.items():
        script.append(f"cat > {UNIT_DIR}/{name}.service <<'EOF'\n{UNIT_FILE.format(name=name, gpu=gpu, mib=mib)}EOF")
    script.append("systemctl daemon-reload")
    for name, (_gpu, _mib, how) in UNITS.items():
        if how:
            script.append(f"systemctl {how} {name}.service")
    fleet.ssh(host, "\n".join(script) + "\n", check=True)


def remove_units(fleet, host):
    names = " ".join(f"{n}.service" for n in UNITS) + " zr-fails.service"
    fleet.ssh(host, f"systemctl unmask {names} 2>/dev/null; systemctl disable --now {names} 2>/dev/null; "
                    f"rm -rf {UNIT_DIR}/zr-* /etc/systemd/system/zr-fails.service.d; systemctl daemon-reload; "
                    f"systemctl reset-failed; rm -f {RECORD}")


@pytest.fixture
def units_host(clean_fleet):
    fleet = clean_fleet
    [host] = h200(fleet)
    fleet.reset([host])
    install_units(fleet, host)
    fleet.ssh(host, "systemctl enable --now vllm.service", check=True)
    # Every holder up, every worker of vllm's among them (its ready file is written after the
    # last): the memory read before the release is the one restore must bring back (read while
    # vllm's workers came up one by one, GPU 2 once read 1,209 MiB before and 42,175 after).
    ready = " ".join(f"/run/nvidia-sim/ready/{n}" for n in ["vllm"] + [n for n, (_g, _m, how) in UNITS.items() if how in ("enable --now", "start")])
    assert wait_for(lambda: fleet.ssh(host, f"ls {ready}").returncode == 0, timeout=20), f"not ready on {host}: {ready}"
    try:
        yield fleet, host
    finally:
        remove_units(fleet, host)


ALL = [f"{n}.service" for n in UNITS]


@pytest.mark.parametrize("service_state", ["disabled", "masked"])
def test_free_then_restore_puts_every_unit_back_to_its_state_before_twice_in_a_row(units_host, service_state):
    fleet, host = units_host
    units = ALL + (["vllm.service"] if service_state == "disabled" else [])  # vllm's file is in /etc: it cannot be masked
    before = states(fleet, host, units)
    assert before["zr-enabled-active.service"] == ("active", "enabled")
    assert before["zr-enabled-inactive.service"] == ("inactive", "enabled")
    assert before["zr-disabled-active.service"] == ("active", "disabled")
    assert before["zr-disabled-inactive.service"] == ("inactive", "disabled")
    assert before["zr-masked.service"] == ("inactive", "masked")
    memory_before = fleet.gpu_memory(host)
    services = ["zr-*"] + (["vllm.service"] if service_state == "disabled" else [])
    for round_ in (1, 2):
        free = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={
            "free_gpus_services": services, "free_gpus_service_state": service_state, "free_gpus_kill_timeout": KILL_TIMEOUT})
        assert free.rc == 0, str(free)
        freed = states(fleet, host, units)
        assert all(s[0] == "inactive" for s in freed.values()), freed
        if service_state == "disabled":
            assert {u: s[1] for u, s in freed.items()} == {u: ("masked" if u == "zr-masked.service" else "disabled") for u in units}
        else:
            assert {u: s[1] for u, s in freed.items() if u != "zr-masked.service"} == {u: "masked" for u in ALL if u != "zr-masked.service"}
        pending = record(fleet, host)
        assert pending is not None and pending["format"] == 1, pending
        assert "zr-masked.service" not in {e["name"] for e in pending["entries"]}  # masked before: nothing changed, nothing recorded
        mode = fleet.ssh(host, f"stat -c '%a %U' {RECORD} $(dirname {RECORD})", check=True).stdout.split("\n")
        assert mode[0] == "600 root", mode

        check = fleet.ansible_playbook(RESTORE, limit=host, check=True)
        assert check.rc == 0, str(check)
        assert states(fleet, host, units) == freed, "check mode changed the node"
        assert record(fleet, host) == pending, "check mode changed the record"

        restore = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_wait_for_gpus": 30})
        assert restore.rc == 0, str(restore)
        assert states(fleet, host, units) == before, (round_, states(fleet, host, units), before)
        assert record(fleet, host) is None, "every entry restored: the record is gone"
        res = restore.result(RESTORE_TASK, host)
        assert set(res["gpus_held"]) >= {"zr-enabled-active.service", "zr-disabled-active.service"}
        assert wait_for(lambda: fleet.gpu_memory(host) == memory_before, timeout=20), (fleet.gpu_memory(host), memory_before)

        again = fleet.ansible_playbook(RESTORE, limit=host)
        assert again.rc == 0 and again.stats[host]["changed"] == 0, str(again)


def test_two_releases_before_one_restore_restore_once_to_the_state_before_the_first(units_host):
    fleet, host = units_host
    units = ["zr-enabled-active.service", "vllm.service"]
    before = states(fleet, host, units)
    first = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_services": units, "free_gpus_kill_timeout": KILL_TIMEOUT})
    second = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={
        "free_gpus_services": units, "free_gpus_service_state": "disabled", "free_gpus_kill_timeout": KILL_TIMEOUT})
    assert first.rc == 0 and second.rc == 0, str(first) + str(second)
    assert states(fleet, host, units) == {u: ("inactive", "disabled") for u in units}
    entries = {e["name"]: e for e in record(fleet, host)["entries"]}
    assert {u: (entries[u]["actions"], entries[u]["active"], entries[u]["unit_file_state"]) for u in units} == {
        u: (["stopped", "disabled"], True, "enabled") for u in units}
    restore = fleet.ansible_playbook(RESTORE, limit=host)
    assert restore.rc == 0, str(restore)
    assert states(fleet, host, units) == before
    res = restore.result(RESTORE_TASK, host)
    # zr-disabled-active held GPU 2: the first release stopped it as the owner of a holder, so it is started again too.
    assert sorted(res["started_units"]) == sorted(units + ["zr-disabled-active.service"]), res["started_units"]
    assert sorted(res["enabled_units"]) == sorted(units), res["enabled_units"]


FAILING_DROPIN = "[Service]\nExecStartPre=/bin/false\n"


def test_a_unit_whose_start_fails_at_restore_is_named_and_kept_and_the_others_come_back(units_host):
    fleet, host = units_host
    fleet.ssh(host, f"cp {UNIT_DIR}/zr-enabled-active.service {UNIT_DIR}/zr-fails.service && "
                    "sed -i 's/zr-enabled-active/zr-fails/g' " + f"{UNIT_DIR}/zr-fails.service && systemctl daemon-reload && "
                    "systemctl enable --now zr-fails.service", check=True)
    units = ["zr-fails.service", "zr-disabled-active.service"]
    before = states(fleet, host, units)
    assert before == {"zr-fails.service": ("active", "enabled"), "zr-disabled-active.service": ("active", "disabled")}
    free = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={
        "free_gpus_services": units, "free_gpus_service_state": "disabled", "free_gpus_kill_timeout": KILL_TIMEOUT})
    assert free.rc == 0, str(free)
    # Between release and restore the unit is broken: its start fails.
    fleet.ssh(host, "mkdir -p /etc/systemd/system/zr-fails.service.d && printf '%s' "
                    f"'{FAILING_DROPIN}' > /etc/systemd/system/zr-fails.service.d/broken.conf && systemctl daemon-reload", check=True)
    restore = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_step_timeout": 10})
    assert restore.rc != 0, str(restore)
    res = restore.result(RESTORE_TASK, host)
    assert "zr-fails.service" in res["msg"] and "could not restore" in res["msg"], res["msg"]
    assert [(n["name"], n["steps"]) for n in res["not_restored"]] == [("zr-fails.service", ["start"])], res["not_restored"]
    assert [e["name"] for e in record(fleet, host)["entries"]] == ["zr-fails.service"], "only the failed entry is kept"
    now = states(fleet, host, units)
    assert now["zr-disabled-active.service"] == ("active", "disabled")
    assert now["zr-fails.service"][1] == "enabled"  # enabled again; only its start failed
    # Repaired, the next restore finishes the job and the record is gone.
    fleet.ssh(host, "rm -rf /etc/systemd/system/zr-fails.service.d && systemctl daemon-reload && systemctl reset-failed zr-fails.service",
              check=True)
    again = fleet.ansible_playbook(RESTORE, limit=host)
    assert again.rc == 0, str(again)
    assert states(fleet, host, units) == before and record(fleet, host) is None


def test_a_check_restore_lists_exactly_what_the_real_run_then_does(clean_fleet):
    """vllm (enabled, running) is stopped as the owner of the GPUs' holders, sglang (enabled,
    running) is named and disabled by the release. `--check --diff` of restore_gpus.yml plans
    enable+start for sglang and start for vllm, prints it in the role's and the playbook's summary,
    changes nothing; the real run then reports exactly that plan and puts both back (issue 33).
    The container half of the plan is checked on real Docker and Podman in
    tests/integration/test_restore_containers.py (these systemd hosts have no container engine)."""
    fleet = clean_fleet
    [host] = h200(fleet)
    fleet.reset([host])
    units = ["vllm.service", "sglang.service"]
    try:
        fleet.ssh(host, "systemctl enable --now vllm.service", check=True)
        fleet.workload(host, "sglang")
        assert wait_for(lambda: fleet.gpu_memory(host)[0] >= 40960 + 30720, timeout=30), fleet.gpu_memory(host)
        before = states(fleet, host, units)
        assert before == {u: ("active", "enabled") for u in units}, before
        free = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={
            "free_gpus_services": ["sglang.service"], "free_gpus_service_state": "disabled", "free_gpus_kill_timeout": KILL_TIMEOUT})
        assert free.rc == 0, str(free)
        freed = states(fleet, host, units)
        assert freed == {"vllm.service": ("inactive", "enabled"), "sglang.service": ("inactive", "disabled")}, freed
        pending = record(fleet, host)

        check = fleet.ansible_playbook(RESTORE, limit=host, check=True, diff=True)
        assert check.rc == 0, str(check)
        assert states(fleet, host, units) == freed and record(fleet, host) == pending, "check mode changed the node or the record"
        plan = check.result(RESTORE_TASK, host)
        assert plan["changed"] is True and sorted(plan["started_units"]) == sorted(units) and plan["enabled_units"] == ["sglang.service"], plan
        assert sorted(plan["plan"]) == ["sglang.service: enable, start", "vllm.service: start"], plan["plan"]
        # issue 55: restore_gpus.yml's summary, one line per host, says the plan's steps
        said = check.result(FLEET_SUMMARY_TASK, host)["msg"]
        assert " ".join(said[1].split()) == f"would put back {host} " + ", ".join(
            f"unit {entry['name']} ({', '.join(entry['steps'])})" for entry in plan["restored"]), said
        assert said[2:] == ["1 host: 1 would put back"], said
        assert {f"{e['name']}: {', '.join(e['steps'])}" for e in plan["restored"]} == set(plan["plan"])
        assert "sglang.service: disabled, stopped" in plan["diff"]["before"] and "sglang.service: enabled, running" in plan["diff"]["after"]

        restore = fleet.ansible_playbook(RESTORE, limit=host)
        assert restore.rc == 0, str(restore)
        done = restore.result(RESTORE_TASK, host)
        assert {k: done[k] for k in PLAN_KEYS} == {k: plan[k] for k in PLAN_KEYS}, (plan, done)
        assert states(fleet, host, units) == before and record(fleet, host) is None
        assert [t["status"] for t in restore.results(ROLE_SAY_TASK, host)] == ["skipped"], "said once, in the summary"

        nothing = fleet.ansible_playbook(RESTORE, limit=host, check=True)
        assert nothing.rc == 0 and nothing.stats[host]["changed"] == 0, str(nothing)
        said = nothing.result(FLEET_SUMMARY_TASK, host)["msg"]
        assert said[1].split() == ["nothing", host, "-"] and said[2:] == ["1 host: 1 nothing"], said
    finally:
        fleet.ssh(host, "systemctl disable --now vllm.service sglang.service; rm -f " + RECORD)


def test_two_hosts_keep_their_own_restore_records(clean_fleet):
    """Each fleet host has its own /var/lib/zeromib-gpu (its own overlay upper dir over a base that
    has none): what one release stopped is never in the other host's record (issue 33)."""
    fleet = clean_fleet
    hosts = h200(fleet, 2) if sum(1 for h in fleet.hosts if h.gpu_count >= 8 and h.idle_mib == 0) >= 2 else [h.name for h in fleet.hosts[:2]]
    assert len(hosts) == 2, "this test needs 2 hosts"
    fleet.reset(hosts)
    unit = {hosts[0]: "vllm.service", hosts[1]: "sglang.service"}
    try:
        for host in hosts:
            fleet.ssh(host, f"rm -f {RECORD}; systemctl enable --now {unit[host]}", check=True)
        free = fleet.ansible_playbook(PLAYBOOK, limit=",".join(hosts), extra_vars={
            "free_gpus_services": "{{ ['vllm.service'] if inventory_hostname == '" + hosts[0] + "' else ['sglang.service'] }}",
            "free_gpus_kill_timeout": KILL_TIMEOUT})
        assert free.rc == 0, str(free)
        assert {h: [e["name"] for e in record(fleet, h)["entries"]] for h in hosts} == {h: [unit[h]] for h in hosts}
        restore = fleet.ansible_playbook(RESTORE, limit=hosts[0])
        assert restore.rc == 0, str(restore)
        assert record(fleet, hosts[0]) is None and [e["name"] for e in record(fleet, hosts[1])["entries"]] == [unit[hosts[1]]]
    finally:
        fleet.ssh_all(f"systemctl disable --now vllm.service sglang.service; rm -f {RECORD}", hosts=hosts)


# --------------------------------------------------------------------------- the training play

def test_training_play_restores_the_servers_on_every_host_when_training_fails_on_one(clean_fleet):
    fleet = clean_fleet
    hosts = h200(fleet, 2)
    fleet.reset(hosts)
    fleet.ssh_all("systemctl enable --now vllm.service && rm -f " + RECORD, hosts=hosts, check=True)
    assert wait_for(lambda: all(fleet.gpu_memory(h)[0] >= 40960 for h in hosts), timeout=20)
    before = {h: states(fleet, h, ["vllm.service", "sglang.service"]) for h in hosts}
    assert all(b["vllm.service"] == ("active", "enabled") for b in before.values())
    memory_before = {h: fleet.gpu_memory(h) for h in hosts}
    failing = hosts[1]
    try:
        run = fleet.ansible_playbook(TRAINING, limit=",".join(hosts), extra_vars={
            "training_command": f"{{{{ 'false' if inventory_hostname == '{failing}' else 'true' }}}}",
            "restore_wait_for_gpus": 30, "free_gpus_kill_timeout": KILL_TIMEOUT})
        assert run.rc != 0, run  # training failed on one host
        assert run.stats[failing]["failures"] == 1, run.stats
        for h in hosts:
            assert states(fleet, h, ["vllm.service", "sglang.service"]) == before[h], h
            assert record(fleet, h) is None, h
            assert wait_for(lambda h=h: fleet.gpu_memory(h) == memory_before[h], timeout=20), h
        freed = [t for t in run.results(task="Start the training job") if t["host"] in hosts]
        assert {t["host"]: t["status"] for t in freed} == {hosts[0]: "changed", failing: "failed"}
    finally:
        fleet.ssh_all("systemctl disable --now vllm.service", hosts=hosts)


# --------------------------------------------------------------------------- Slurm

def node(fleet, host) -> dict:
    out = fleet.ssh(host, f"scontrol show node -o {host}", check=True).stdout
    fields = dict(part.split("=", 1) for part in out.split() if "=" in part)
    reason = out.split("Reason=", 1)[1].strip() if "Reason=" in out else ""
    fields["Reason"] = reason.split(" [", 1)[0]
    return fields


def drained(fields) -> bool:
    return "DRAIN" in fields["State"]


@pytest.fixture
def slurm_host(clean_fleet):
    fleet = clean_fleet
    [host] = h200(fleet)
    fleet.ssh(host, "systemctl start munge slurmctld slurmd", check=True)
    assert wait_for(lambda: fleet.ssh(host, f"scontrol show node -o {host}").returncode == 0, timeout=30)
    fleet.ssh(host, f"scontrol update nodename={host} state=resume 2>/dev/null; true")
    assert wait_for(lambda: not drained(node(fleet, host)), timeout=15), node(fleet, host)
    try:
        yield fleet, host
    finally:
        fleet.clear_faults(host)
        fleet.ssh(host, f"scontrol update nodename={host} state=resume 2>/dev/null; true")


def test_a_node_that_cannot_be_freed_is_drained_with_a_zeromib_reason_and_resumed_after_a_clean_look(slurm_host):
    fleet, host = slurm_host
    fleet.set_fault(host, leak={"0": 4096})  # memory with no holder: a reset or reboot is needed
    free = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_on_failure": "drain", "free_gpus_wait_timeout": 5})
    assert free.rc != 0, str(free)
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"].startswith("zeromib: "), fields
    # The reason is the failure's first sentence, cut to Slurm's 120 characters.
    assert fields["Reason"].startswith("zeromib: GPUs read above free_gpus_max_used_mib with no process"), fields

    # Still dirty: the fresh look keeps it drained.
    kept = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_resume_drained": True})
    assert kept.rc == 0, str(kept)
    assert drained(node(fleet, host)), node(fleet, host)

    fleet.clear_faults(host)
    resumed = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_resume_drained": True})
    assert resumed.rc == 0, str(resumed)
    assert not drained(node(fleet, host)), node(fleet, host)


def test_an_admins_drain_is_never_overwritten_nor_resumed(slurm_host):
    fleet, host = slurm_host
    fleet.ssh(host, f"scontrol update nodename={host} state=drain reason=maintenance", check=True)
    fleet.set_fault(host, leak={"0": 4096})
    free = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_on_failure": "drain", "free_gpus_wait_timeout": 5})
    assert free.rc != 0, str(free)
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"] == "maintenance", fields
    fleet.clear_faults(host)
    restore = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_resume_drained": True})
    assert restore.rc == 0, str(restore)
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"] == "maintenance", fields


def test_a_node_that_frees_cleanly_is_not_drained(slurm_host):
    fleet, host = slurm_host
    fleet.workload(host, "train", gpus="0", mib=1000)
    free = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_on_failure": "drain", "free_gpus_kill_timeout": KILL_TIMEOUT})
    assert free.rc == 0, str(free)
    assert not drained(node(fleet, host)), node(fleet, host)


# --------------------------------------------------------------------------- the audit

def test_the_audit_shows_a_pending_restore_until_gpu_restore_runs(units_host, tmp_path):
    fleet, host = units_host
    free = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={
        "free_gpus_services": ["zr-enabled-active.service"], "free_gpus_service_state": "disabled", "free_gpus_kill_timeout": KILL_TIMEOUT})
    assert free.rc == 0, str(free)

    def audit(name):
        run = fleet.ansible_playbook("playbooks/audit_gpus.yml", limit=host, extra_vars={"gpu_audit_report_dir": str(tmp_path / name)})
        assert run.rc == 0, str(run)
        [entry] = json.loads((tmp_path / name / "report.json").read_text())["hosts"]
        return entry["pending_restore"]

    pending = audit("before")
    assert any(line.startswith("zr-enabled-active.service stopped, disabled by zeromib at 20") for line in pending), pending
    # report.md and report.html show it too (issue 33): who and when, from the node's own record.
    # (vllm.service and zr-disabled-active, running on the GPUs, were stopped too, as owners of their holders.)
    entries = record(fleet, host)["entries"]
    entry = next(e for e in entries if e["name"] == "zr-enabled-active.service")
    assert entry["released_by"] == "root", entry  # Ansible logs in as root over SSH: the kernel's login uid is 0
    since = entry["released_at"]
    md = (tmp_path / "before" / "report.md").read_text()
    row = f"| {host} | zr-enabled-active.service | stopped, disabled | {since} | gpu_release of {since} by root |"
    assert row in md.split("\n## Pending restores\n")[1], md
    names = ", ".join(sorted(e["name"] for e in entries))
    assert f"- **pending restore**, stopped by zeromib, not restored: {names}: 1 host ({host})" in md, md
    html = (tmp_path / "before" / "report.html").read_text()
    assert f'<tr data-host="{host}" data-pending-restore="zr-enabled-active.service">' in html
    assert f'zeromib_gpu_pending_restore{{host="{host}"}} {len(entries)}' in (tmp_path / "before" / "gpu_audit.prom").read_text()
    restore = fleet.ansible_playbook(RESTORE, limit=host)
    assert restore.rc == 0, str(restore)
    assert audit("after") == []
    assert "## Pending restores" not in (tmp_path / "after" / "report.md").read_text()
    assert f'zeromib_gpu_pending_restore{{host="{host}"}} 0' in (tmp_path / "after" / "gpu_audit.prom").read_text()
