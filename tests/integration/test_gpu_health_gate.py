"""GPU health through real Ansible on simulated hosts: each injected fault fails the
free_gpus role's assert with a message naming the host, the GPU and the issue; a healthy
host passes; gpu_facts reports health, and reports it as not checked on an older driver.

Faults go in through the simulator (tests/sim/README.md): `field_values` of nvidia-smi, the
simulated kernel log (`xid`, `no_journal`, `journal_empty`, `driver_loaded_age_s`), an older
driver (`unsupported_fields`), Fabric Manager (config `fabric_manager`: its unit, its binary;
faults `fabricmanager_state`, `fabricmanager_version`), a GPU fewer than expected (`count`).
"""
import json
import os
import time

import pytest

from ansible_in_ns import REPO, VENV_BIN, playbook_env, results_env, run_module, task_result
from make_config import H200_VM_590_CAPTURE, R440_UNSUPPORTED_FIELDS, captured_fields, make_config

ROLE_PLAY = """---
- hosts: localhost
  gather_facts: false
  tasks:
    - name: The role under test
      block:
        - name: Free and verify
          ansible.builtin.include_role:
            name: zeromib.gpu.free_gpus
      rescue:
        - name: Keep the failure message
          ansible.builtin.set_fact:
            __failed_msg: "{{ ansible_failed_result.msg | default('failed') }}"
    - name: The outcome
      ansible.builtin.debug:
        msg: "{{ {'failed': __failed_msg is defined, 'msg': __failed_msg | default(''), 'result': free_gpus_result | default(none)} }}"
"""


def run_role(host, variables, timeout=180, check=False):
    host._seq = getattr(host, "_seq", 0) + 1
    out = os.path.join(host.dir, f"role-{host._seq}.json")
    play = os.path.join(host.dir, f"role-{host._seq}.yml")
    with open(play, "w") as handle:
        handle.write(ROLE_PLAY)
    extra = os.path.join(host.dir, f"role-{host._seq}-vars.json")
    with open(extra, "w") as handle:
        json.dump(dict({"free_gpus_wait_timeout": 5, "free_gpus_kill_timeout": 1}, **variables), handle)
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", play,
           "-e", "ansible_python_interpreter=/usr/bin/python3", "-e", "@" + extra] + (["--check"] if check else [])
    proc = host.run(cmd, env=results_env(out), timeout=timeout)
    return task_result(out, "The outcome", proc)["msg"]


def dmesg_age(wanted):
    """WANTED ((age in seconds, how the message says it)) when a dmesg line can be that old on this
    machine, else a line 100 s old, which reads "2 min ago". dmesg holds only lines since boot: the
    simulated one prints an older line at the boot's time ("3 min ago" on a machine up 3 min, seen
    on a fresh one), so an age is used only when the machine has been up for it and a minute more.
    The uptime only grows: an age that fits when the tests are collected fits when they run."""
    with open("/proc/uptime") as handle:
        up = float(handle.read().split()[0])
    return wanted if wanted[0] + 60 <= up else (100, "2 min ago")


# dmesg Xids 10 min and 2 min old, where the machine has been up for that long.
DMESG_LONG = dmesg_age((600, "10 min ago"))
DMESG_SHORT = dmesg_age((120, "2 min ago"))


# (test id, fault, role variables, the words the failure message must contain)
FAULTS = [
    ("ecc_uncorrected", {"field_values": {"1": {"ecc.errors.uncorrected.volatile.total": "1"}}}, {},
     ["GPU 1 (00000000:00:07.0)", "1 uncorrectable ECC error since the driver loaded"]),
    ("remap_pending", {"field_values": {"0": {"remapped_rows.pending": "Yes"}}}, {},
     ["GPU 0 (00000000:00:06.0)", "row remap is pending"]),
    ("xid_79_in_kernel_log", {"xid": [{"gpu": 1, "xid": 79, "age_s": 120}]}, {},
     ["GPU 1 (00000000:00:07.0)", "Xid 79 (GPU has fallen off the bus)"]),
    ("pcie_downtrained_width", {"field_values": {"0": {"pcie.link.width.current": "8"}}}, {},
     ["GPU 0 (00000000:00:06.0)", "PCIe link runs at x8, expected x16"]),
    ("pcie_downtrained_gen", {"field_values": {"1": {"pcie.link.gen.current": "3"}}}, {},
     ["GPU 1 (00000000:00:07.0)", "PCIe link runs at Gen3, expected Gen5"]),
    ("persistence_off", {"field_values": {"0": {"persistence_mode": "Disabled"}}}, {},
     ["GPU 0 (00000000:00:06.0)", "persistence mode is off"]),
    ("hw_thermal_slowdown", {"field_values": {"1": {"clocks_event_reasons.hw_slowdown": "Active",
                                                    "clocks_event_reasons.hw_thermal_slowdown": "Active"}}}, {},
     ["GPU 1 (00000000:00:07.0)", "clocks lowered by hardware thermal slowdown"]),
    ("mig_mode_not_expected", {}, {"free_gpus_expected_mig_mode": "enabled"},
     ["GPU 0 (00000000:00:06.0)", "MIG mode is Disabled, expected Enabled"]),
    # journald keeps nothing (systemd 252: "No journal files were found." on stderr, rc 0): the Xid is in dmesg.
    ("no_journal_xid_79_in_dmesg", {"no_journal": True, "xid": [{"gpu": 1, "xid": 79, "age_s": DMESG_SHORT[0]}]}, {},
     ["GPU 1 (00000000:00:07.0)", f"Xid 79 (GPU has fallen off the bus) in the kernel log {DMESG_SHORT[1]}", "RESTART_BM"]),
    ("empty_journal_xid_79_in_dmesg", {"journal_empty": True, "xid": [{"gpu": 0, "xid": 79, "age_s": DMESG_LONG[0]}]}, {},
     ["GPU 0 (00000000:00:06.0)", f"Xid 79 (GPU has fallen off the bus) in the kernel log {DMESG_LONG[1]}"]),
    ("requires_reset_in_a_field", {"field_values": {"1": {"ecc.errors.uncorrected.volatile.total": "[GPU requires reset]"}}}, {},
     ["GPU 1 (00000000:00:07.0)", "ecc.errors.uncorrected.volatile.total reads [GPU requires reset]"]),
    ("unknown_error_in_a_field", {"field_values": {"0": {"remapped_rows.pending": "[Unknown Error]"}}}, {},
     ["GPU 0 (00000000:00:06.0)", "remapped_rows.pending reads [Unknown Error]"]),
    ("recovery_action_reset", {"field_values": {"0": {"gpu_recovery_action": "Reset"}}}, {},
     ["GPU 0 (00000000:00:06.0)", "the driver asks for a recovery action: Reset"]),
    ("recovery_action_reboot", {"field_values": {"1": {"gpu_recovery_action": "Reboot"}}}, {},
     ["GPU 1 (00000000:00:07.0)", "the driver asks for a recovery action: Reboot"]),
    ("xid_13_made_fatal", {"xid": [{"gpu": 1, "xid": 13, "age_s": 60}]}, {"free_gpus_xid_fatal": [13]},
     ["GPU 1 (00000000:00:07.0)", "Xid 13 (graphics engine exception)"]),
    ("xid_after_the_driver_load", {"driver_loaded_age_s": 7200, "xid": [{"gpu": 0, "xid": 79, "age_s": 600}]}, {},
     ["GPU 0 (00000000:00:06.0)", "Xid 79"]),
    ("mig_change_pending", {"field_values": {"0": {"mig.mode.pending": "Enabled"}}}, {},
     ["GPU 0 (00000000:00:06.0)", "a MIG mode change to Enabled is pending"]),
]


@pytest.fixture(scope="module")
def h200x2(module_nshost):
    return module_nshost("h200x2", seed="health01")


def test_healthy_h200_host_passes_the_gate(h200x2):
    h200x2.clear_faults()
    outcome = run_role(h200x2, {"free_gpus_expected_count": 2})
    assert not outcome["failed"], outcome["msg"]
    assert outcome["result"]["healthy"] is True and outcome["result"]["health_issues"] == []


@pytest.mark.parametrize("fault,variables,words", [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_fault_fails_the_gate_naming_host_gpu_and_issue(h200x2, fault, variables, words):
    h200x2.clear_faults()
    if fault:
        h200x2.set_fault(fault)
    try:
        outcome = run_role(h200x2, variables)
    finally:
        h200x2.clear_faults()
    assert outcome["failed"], outcome
    assert outcome["msg"].startswith("localhost: ") and "unhealthy: " in outcome["msg"], outcome["msg"]
    for word in words:
        assert word in outcome["msg"], outcome["msg"]
    assert outcome["result"]["status"] == "unhealthy" and outcome["result"]["healthy"] is False


def test_fault_is_reported_not_fatal_without_require_healthy(h200x2):
    h200x2.set_fault({"field_values": {"1": {"ecc.errors.uncorrected.volatile.total": "2"}}})
    try:
        outcome = run_role(h200x2, {"free_gpus_require_healthy": False})
    finally:
        h200x2.clear_faults()
    assert not outcome["failed"], outcome["msg"]
    assert outcome["result"]["healthy"] is False
    assert outcome["result"]["health_issues"] == ["GPU 1 (00000000:00:07.0): 2 uncorrectable ECC errors since the driver loaded"]


def test_thresholds_accept_a_gen4_link_and_persistence_off(h200x2):
    h200x2.set_fault({"field_values": {"pcie.link.gen.current": "4", "persistence_mode": "Disabled"}})
    try:
        outcome = run_role(h200x2, {"free_gpus_min_pcie_gen": 4, "free_gpus_require_persistence": False})
    finally:
        h200x2.clear_faults()
    assert not outcome["failed"], outcome["msg"]


def test_no_journal_is_said_in_the_facts_and_dmesg_is_read(h200x2):
    h200x2.set_fault({"no_journal": True, "xid": [{"gpu": 1, "xid": 79, "age_s": DMESG_SHORT[0]}]})
    try:
        facts = run_module(h200x2, "gpu_facts", {})
    finally:
        h200x2.clear_faults()
    log = facts["ansible_facts"]["gpu"]["health"]["kernel_log"]
    assert (log["source"], log["error"], log["fallback"]) == ("dmesg", None, "journalctl: No journal files were found.")
    gpu1 = facts["ansible_facts"]["gpu"]["gpus"][1]
    assert [(x["xid"], x["action"], x["fault"]) for x in gpu1["health"]["xids"]] == [(79, "RESTART_BM", True)]
    assert gpu1["health_checked"] is True and gpu1["health_unchecked"] == []


def test_restart_app_xid_is_not_a_fault_and_xid_ignore_overrides_the_catalog(h200x2):
    h200x2.set_fault({"xid": [{"gpu": 1, "xid": 13, "age_s": 60}, {"gpu": 0, "xid": 79, "age_s": 60}]})
    try:
        ignored = run_role(h200x2, {"free_gpus_xid_ignore": [79]})
        facts = run_module(h200x2, "gpu_facts", {"xid_ignore": [79]})
    finally:
        h200x2.clear_faults()
    assert not ignored["failed"], ignored["msg"]
    gpus = facts["ansible_facts"]["gpu"]["gpus"]
    assert [(x["xid"], x["action"], x["fault"]) for x in gpus[1]["health"]["xids"]] == [(13, "RESTART_APP", False)]
    assert [(x["xid"], x["fault"]) for x in gpus[0]["health"]["xids"]] == [(79, False)] and gpus[0]["healthy"] is True


def test_xid_older_than_the_driver_load_does_not_count(h200x2):
    h200x2.set_fault({"driver_loaded_age_s": 600, "xid": [{"gpu": 0, "xid": 79, "age_s": 3600}]})
    try:
        outcome = run_role(h200x2, {})
        facts = run_module(h200x2, "gpu_facts", {})
    finally:
        h200x2.clear_faults()
    assert not outcome["failed"], outcome["msg"]
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["gpus"][0]["health"]["xids"] == [] and [x["xid"] for x in gpu["gpus"][0]["health"]["xids_before_driver_load"]] == [79]
    assert "NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04" in gpu["health"]["kernel_log"]["driver_loaded"]


def test_all_na_gpu_says_which_checks_did_not_run(h200x2):
    fields = ["ecc.errors.uncorrected.volatile.total", "remapped_rows.pending", "remapped_rows.failure", "retired_pages.pending",
              "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current", "pcie.link.width.max", "pstate",
              "clocks_event_reasons.hw_slowdown", "clocks_event_reasons.hw_thermal_slowdown",
              "clocks_event_reasons.hw_power_brake_slowdown", "clocks_event_reasons.sw_thermal_slowdown", "persistence_mode",
              "mig.mode.current", "mig.mode.pending", "gpu_recovery_action", "fabric.state", "fabric.status"]
    h200x2.set_fault({"field_values": {"1": dict((f, "[N/A]") for f in fields)}})
    try:
        outcome = run_role(h200x2, {})
        facts = run_module(h200x2, "gpu_facts", {})
    finally:
        h200x2.clear_faults()
    names = ["ecc", "row_remap", "retired_pages", "pcie", "clocks", "persistence", "recovery_action"]
    assert not outcome["failed"], outcome["msg"]
    message = outcome["result"]["message"]  # the gate's success message
    assert message.endswith("; not checked on this driver or GPU: " + ", ".join(names)), message
    assert outcome["result"]["health_unchecked"] == names
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["healthy"] is True and gpu["health_checked"] is False
    assert gpu["gpus"][1]["health_unchecked"] == names and gpu["gpus"][1]["health_checked"] is False
    assert gpu["gpus"][0]["health_unchecked"] == [] and gpu["gpus"][0]["health_checked"] is True
    assert gpu["gpus"][1]["health"]["unchecked"][0] == "ecc: ecc.errors.uncorrected.volatile.total reads [N/A]"


def test_old_xid_outside_the_window_and_application_xid_do_not_fail(h200x2):
    h200x2.set_fault({"xid": [{"gpu": 0, "xid": 79, "age_s": 3 * 3600}, {"gpu": 1, "xid": 13, "age_s": 60}]})
    try:
        outcome = run_role(h200x2, {"free_gpus_xid_window_hours": 1})
        facts = run_module(h200x2, "gpu_facts", {"xid_window_hours": 1})
    finally:
        h200x2.clear_faults()
    assert not outcome["failed"], outcome["msg"]
    gpus = facts["ansible_facts"]["gpu"]["gpus"]
    assert gpus[0]["health"]["xids"] == [] and [x["xid"] for x in gpus[1]["health"]["xids"]] == [13]
    assert facts["ansible_facts"]["gpu"]["health"]["kernel_log"]["source"] == "journalctl"


def test_dcgm_diag_without_dcgmi_says_so_and_does_not_fail(h200x2):
    h200x2.clear_faults()
    outcome = run_role(h200x2, {"free_gpus_dcgm_diag": 1})
    assert not outcome["failed"], outcome["msg"]
    facts = run_module(h200x2, "gpu_release", {"dcgm_diag": 1})
    assert facts["health"]["dcgm_diag"]["summary"] == "dcgmi not installed" and facts["healthy"] is True


def test_gpu_facts_reads_health_from_the_same_call(h200x2):
    h200x2.set_fault({"field_values": {"0": {"remapped_rows.failure": "Yes"}}})
    try:
        result = run_module(h200x2, "gpu_facts", {})
    finally:
        h200x2.clear_faults()
    gpu = result["ansible_facts"]["gpu"]
    assert gpu["healthy"] is False and gpu["health_checked"] is True
    assert gpu["gpus"][0]["health_issues"] == ["row remapping failed: the GPU has run out of spare rows and needs replacing"]
    assert gpu["gpus"][1]["healthy"] is True
    assert gpu["gpus"][1]["health"]["pcie_link_width_current"] == 16 and gpu["gpus"][1]["health"]["retired_pages_pending"] is None


def test_unreadable_kernel_log_is_said_not_taken_for_healthy(h200x2):
    h200x2.set_fault({"kernel_log_unreadable": True})
    try:
        result = run_module(h200x2, "gpu_facts", {})
    finally:
        h200x2.clear_faults()
    gpu = result["ansible_facts"]["gpu"]
    assert gpu["health_checked"] is False and gpu["health"]["kernel_log"]["source"] is None
    assert "recent Xid errors not checked: dmesg failed (rc 1)" in gpu["gpus"][0]["health"]["unchecked"][0]


def test_a_gpu_missing_fails_the_gate_naming_the_host(nshost):
    host = nshost("h200x8", count=7, seed="health02")
    outcome = run_role(host, {"free_gpus_expected_count": 8})
    assert outcome["failed"]
    assert outcome["msg"].startswith("localhost: ") and "expected 8 GPUs, nvidia-smi shows 7" in outcome["msg"], outcome["msg"]


def test_older_driver_without_health_fields_reports_health_unchecked(nshost):
    old = ["remapped_rows.pending", "remapped_rows.failure", "clocks_event_reasons.hw_slowdown",
           "clocks_event_reasons.hw_thermal_slowdown", "clocks_event_reasons.hw_power_brake_slowdown",
           "clocks_event_reasons.sw_thermal_slowdown", "memory.reserved"]
    host = nshost(config=make_config("h200x2", seed="health03", unsupported_fields=old, driver_version="470.57.02"))
    result = run_module(host, "gpu_facts", {})
    gpu = result["ansible_facts"]["gpu"]
    assert gpu["healthy"] is True and gpu["health_checked"] is False
    # Remaps unknown and retired pages [N/A] (Hopper): neither memory-repair reading is there.
    assert gpu["gpus"][0]["health_unchecked"] == ["row_remap", "retired_pages"]
    notes = gpu["gpus"][0]["health"]["unchecked"]
    assert notes[0] == "row_remap: the driver does not know remapped_rows.pending, remapped_rows.failure", notes
    assert gpu["gpus"][0]["health"]["slowdown"] == []  # read through the clocks_throttle_reasons names


def test_r440_like_driver_still_frees_memory_and_reports_mig_unchecked(nshost):
    host = nshost(config=make_config("h200x2", seed="health04", unsupported_fields=R440_UNSUPPORTED_FIELDS, driver_version="440.33.01"))
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "4096"])
    run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5})
    assert not run.failed, run.msg
    assert run["released"] is True and [k["pid"] for k in run["killed"]] == [holder.pid] and not host.alive(holder.pid)
    assert [g["memory_used_mib"] for g in run["gpus"]] == [0, 0]
    unchecked = ["row_remap", "retired_pages", "mig", "recovery_action", "fabric"]
    assert all(g["health_unchecked"] == unchecked and g["mig_mode"] is None for g in run["gpus"]), run["gpus"]
    assert run["healthy"] is True and run["health_checked"] is False
    holder = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    outcome = run_role(host, {"free_gpus_expected_count": 2})
    assert not outcome["failed"], outcome["msg"]
    message = outcome["result"]["message"]
    assert "2 GPUs free" in message and message.endswith("; not checked on this driver or GPU: " + ", ".join(unchecked)), message
    assert not host.alive(holder.pid)


# The single-GPU H200 VM of the exporter's capture on driver 590.48.01: every fabric.* field as
# captured (Completed, Success, cliqueId 0, a zero clusterUuid, fabric.health.* N/A).
VM_FABRIC = captured_fields(H200_VM_590_CAPTURE, "fabric.")
VM_DRIVER = captured_fields(H200_VM_590_CAPTURE, "driver_version")["driver_version"]
NO_FABRIC_MANAGER = ("no Fabric Manager on this host: it may run in a container (GPU Operator) or not be needed (VM, GB200 "
                     "compute tray)")
NO_SYSTEMD = "systemctl show nvidia-fabricmanager failed (rc 1): System has not been booted with systemd as init system (PID 1)."
ROOT_BINARY = "/run/nvidia/driver/usr/bin/nv-fabricmanager"


def vm_config(seed, **fabric_manager):
    """The capture's VM; `fabric_manager` as tests/sim/fabricmanager takes it (none: no Fabric
    Manager and no systemd: the machine's own systemctl answers, as without systemd as PID 1)."""
    return make_config("h200x1", seed=seed, driver_version=VM_DRIVER, gpu_overrides={0: {"fields": dict(VM_FABRIC)}},
                       **({"fabric_manager": fabric_manager} if fabric_manager else {}))


def fabric_manager_calls(host):
    try:
        with open(os.path.join(host.root.state, "fabricmanager.log")) as handle:
            return handle.read().splitlines()
    except FileNotFoundError:
        return []


def run_playbook(host, playbook, variables, timeout=180):
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", os.path.join(REPO, "playbooks", playbook),
           "-e", "ansible_python_interpreter=/usr/bin/python3", "-e", "free_gpus_hosts=localhost", "-e", json.dumps(variables)]
    return host.run(cmd, env=playbook_env(), timeout=timeout)


@pytest.fixture(scope="module")
def h200_vm(module_nshost):
    """The capture's VM with no Fabric Manager, no unit and no systemd."""
    return module_nshost(config=vm_config("health06"))


def test_h200_vm_of_the_590_capture_answers_every_fabric_field_as_captured(h200_vm):
    fields = list(VM_FABRIC)
    proc = h200_vm.run(["nvidia-smi", "--query-gpu=" + ",".join(fields), "--format=csv,noheader"])
    assert proc.returncode == 0 and dict(zip(fields, proc.stdout.strip().split(", "))) == VM_FABRIC, proc.stdout
    assert VM_FABRIC["fabric.state"] == "Completed" and VM_FABRIC["fabric.status"] == "Success" and VM_FABRIC["fabric.cliqueId"] == "0"
    assert VM_FABRIC["fabric.clusterUuid"] == "00000000-0000-0000-0000-000000000000" and VM_FABRIC["fabric.health.summary"] == "N/A"


def test_h200_vm_without_fabric_manager_or_systemd_reads_healthy_and_fully_checked(h200_vm):
    gpu = run_module(h200_vm, "gpu_facts", {})["ansible_facts"]["gpu"]
    assert gpu["healthy"] is True and gpu["health_checked"] is True and gpu["health_issues"] == [], gpu["health_issues"]
    (one,) = gpu["gpus"]
    assert gpu["driver_version"] == "590.48.01" and one["health_unchecked"] == [] and one["health"]["unchecked"] == []
    assert (one["health"]["fabric_state"], one["health"]["fabric_status"], one["health"]["fabric_health_summary"]) == ("Completed", "Success", None)
    fm = gpu["health"]["fabric_manager"]
    assert fm["unit"] is None and fm["unit_error"].startswith(NO_SYSTEMD), fm
    assert fm["binary"] is None and fm["version"] is None and fm["note"] == NO_FABRIC_MANAGER


def test_h200_vm_passes_free_gpus_yml_and_the_audit_shows_it_healthy(h200_vm):
    proc = run_playbook(h200_vm, "free_gpus.yml", {"free_gpus_expected_count": 1})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 host: 1 clean" in proc.stdout and "failed=0" in proc.stdout and "not checked" not in proc.stdout, proc.stdout[-3000:]
    out = os.path.join(h200_vm.dir, "audit")
    proc = run_playbook(h200_vm, "audit_gpus.yml", {"gpu_audit_report_dir": out})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "report.json")) as handle:
        report = json.load(handle)
    (host,) = report["hosts"]
    assert host["healthy"] is True and host["unhealthy_gpus"] == [], host
    assert (report["summary"]["hosts_unhealthy"], report["summary"]["gpus_unhealthy"], report["summary"]["hosts_health_unchecked"]) == (0, 0, 0)


# What each host has of Fabric Manager, and what gpu_facts records of it (GPUs as the VM's).
CONTEXTS = [
    # A systemd host without the unit: systemctl show answers LoadState=not-found (rc 0).
    ("no_unit_no_binary", {"unit": "not-found", "binary": None},
     {"unit": {"load_state": "not-found", "active_state": "inactive", "sub_state": "dead"}, "unit_error": None, "binary": None,
      "version": None, "version_error": None, "note": NO_FABRIC_MANAGER},
     ["systemctl show -p LoadState,ActiveState,SubState nvidia-fabricmanager"]),
    # GPU Operator: Fabric Manager in the driver container, its binary under the driver root, no unit on the host.
    ("gpu_operator", {"unit": "not-found", "binary": "driver_root"},
     {"unit": {"load_state": "not-found", "active_state": "inactive", "sub_state": "dead"}, "unit_error": None, "binary": ROOT_BINARY,
      "version": None, "version_error": None,
      "note": "Fabric Manager of the GPU Operator's driver container (/run/nvidia/driver): no unit of this host"},
     ["systemctl show -p LoadState,ActiveState,SubState nvidia-fabricmanager"]),
    # A host binary and an inactive unit: with the fabric Completed, context only.
    ("unit_inactive", {"unit": "inactive", "version": "590.48.01"},
     {"unit": {"load_state": "loaded", "active_state": "inactive", "sub_state": "dead"}, "unit_error": None,
      "binary": "/usr/bin/nv-fabricmanager", "version": "590.48.01", "version_error": None, "note": None},
     ["systemctl show -p LoadState,ActiveState,SubState nvidia-fabricmanager", "nv-fabricmanager --version"]),
]


@pytest.mark.parametrize("fabric_manager,recorded,calls", [c[1:] for c in CONTEXTS], ids=[c[0] for c in CONTEXTS])
def test_completed_success_fabric_is_healthy_whatever_the_host_has_of_fabric_manager(nshost, fabric_manager, recorded, calls):
    host = nshost(config=vm_config("health07", **fabric_manager))
    gpu = run_module(host, "gpu_facts", {})["ansible_facts"]["gpu"]
    assert gpu["healthy"] is True and gpu["health_checked"] is True, gpu["health_issues"]
    assert gpu["health"]["fabric_manager"] == recorded
    assert fabric_manager_calls(host) == calls
    outcome = run_role(host, {"free_gpus_expected_count": 1})
    assert not outcome["failed"] and "not checked" not in outcome["result"]["message"], outcome


def test_a_host_whose_gpus_have_no_fabric_asks_nothing_of_fabric_manager(nshost):
    # Fabric Manager installed (unit and binary), the GPUs N/A as the H200 of the 580.159.04 capture.
    host = nshost(config=make_config("h200x2", seed="health08", fabric_manager={"unit": "active"}))
    gpu = run_module(host, "gpu_facts", {})["ansible_facts"]["gpu"]
    assert gpu["healthy"] is True and gpu["health_checked"] is True and gpu["health"]["fabric_manager"] is None
    assert fabric_manager_calls(host) == []


FABRIC = {"fields": {"fabric.state": "Completed", "fabric.status": "Success"}}  # the fabric as the 590.48.01 capture reads it


@pytest.fixture(scope="module")
def hgx(module_nshost):
    """An NVSwitch node: both GPUs registered with the fabric, nvidia-fabricmanager active, of the driver's version."""
    return module_nshost(config=make_config("h200x2", seed="health05", gpu_overrides={0: FABRIC, 1: FABRIC},
                                            fabric_manager={"unit": "active"}))


def test_fabric_node_with_fabric_manager_of_the_drivers_version_passes(hgx):
    hgx.clear_faults()
    outcome = run_role(hgx, {"free_gpus_expected_count": 2})
    assert not outcome["failed"], outcome["msg"]
    facts = run_module(hgx, "gpu_facts", {})
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["health"]["fabric_manager"] == {
        "unit": {"load_state": "loaded", "active_state": "active", "sub_state": "running"}, "unit_error": None,
        "binary": "/usr/bin/nv-fabricmanager", "version": "580.159.04", "version_error": None, "note": None}
    assert [g["health"]["fabric_state"] for g in gpu["gpus"]] == ["Completed", "Completed"] and gpu["health_checked"] is True


@pytest.mark.parametrize("state", ["failed", "inactive"])
def test_a_stopped_fabric_manager_beside_a_completed_fabric_is_not_a_fault(hgx, state):
    hgx.set_fault({"fabricmanager_state": state})
    try:
        outcome = run_role(hgx, {"free_gpus_expected_count": 2})
    finally:
        hgx.clear_faults()
    assert not outcome["failed"] and "not checked" not in outcome["result"]["message"], outcome


def test_another_fabric_manager_version_beside_a_registered_fabric_is_recorded_not_a_fault(hgx):
    """The GPUs read Completed/Success: a binary on PATH of another version (an upgraded package
    not yet restarted) explains nothing; the GPU's reading is the authority."""
    hgx.set_fault({"fabricmanager_version": "535.161.08"})
    try:
        outcome = run_role(hgx, {"free_gpus_expected_count": 2})
        facts = run_module(hgx, "gpu_facts", {})
    finally:
        hgx.clear_faults()
    assert not outcome["failed"] and outcome["result"]["status"] == "clean", outcome
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["healthy"] is True and gpu["health"]["fabric_manager"]["version"] == "535.161.08"


FABRIC_FAULTS = [
    ("unit_failed_fabric_in_progress", {"fabricmanager_state": "failed",
                                        "field_values": {"1": {"fabric.state": "In Progress", "fabric.status": "N/A"}}},
     ["GPU 1 (00000000:00:07.0): NVSwitch fabric registration is In Progress, expected Completed",
      "on this host: unit nvidia-fabricmanager loaded, failed (failed), nv-fabricmanager 580.159.04 at /usr/bin/nv-fabricmanager",
      "nvidia-fabricmanager is failed: NVSwitch jobs fail (CUDA error 802) until it runs"], ["GPU 0 ("]),
    ("unit_active_other_version_fabric_in_progress", {"fabricmanager_version": "535.161.08",
                                                      "field_values": {"1": {"fabric.state": "In Progress", "fabric.status": "N/A"}}},
     ["GPU 1 (00000000:00:07.0): NVSwitch fabric registration is In Progress, expected Completed",
      "nv-fabricmanager is version 535.161.08, the driver 580.159.04: Fabric Manager must match the driver exactly"], ["GPU 0 ("]),
    # No capture of an unhealthy fabric: the word is NVML's (nvmlGpuFabricHealthSummary), the field the capture's.
    ("fabric_health_unhealthy", {"field_values": {"0": {"fabric.health.summary": "Unhealthy"}}},
     ["GPU 0 (00000000:00:06.0): NVSwitch fabric health is Unhealthy (fabric.health.summary), expected Healthy"], ["GPU 1 ("]),
]


@pytest.mark.parametrize("fault,words,absent", [f[1:] for f in FABRIC_FAULTS], ids=[f[0] for f in FABRIC_FAULTS])
def test_fabric_fault_fails_the_gate(hgx, fault, words, absent):
    hgx.set_fault(fault)
    try:
        outcome = run_role(hgx, {})
    finally:
        hgx.clear_faults()
    assert outcome["failed"] and outcome["result"]["status"] == "unhealthy", outcome
    for word in words:
        assert word in outcome["msg"], outcome["msg"]
    for word in absent:
        assert word not in outcome["msg"], outcome["msg"]
    # The node's own fault is said once, not once per GPU.
    assert outcome["msg"].count("nvidia-fabricmanager is") <= 1 and outcome["msg"].count("nv-fabricmanager is version") <= 1, outcome["msg"]


def test_fabric_in_progress_without_fabric_manager_says_what_was_found(nshost):
    host = nshost(config=vm_config("health09", unit="not-found", binary=None))
    host.set_fault({"field_values": {"0": {"fabric.state": "In Progress", "fabric.status": "N/A"}}})
    outcome = run_role(host, {})
    assert outcome["failed"] and outcome["result"]["status"] == "unhealthy", outcome
    assert ("GPU 0 (00000000:00:06.0): NVSwitch fabric registration is In Progress, expected Completed: NCCL jobs fail (CUDA error "
            "802, system not yet initialized) until Fabric Manager completes it; on this host: no unit nvidia-fabricmanager, no "
            "nv-fabricmanager; " + NO_FABRIC_MANAGER) in outcome["msg"], outcome["msg"]
    assert "nvidia-fabricmanager is" not in outcome["msg"]


# --- the kernel log read incrementally (issue 36): the same verdict as a whole read


def _health_of(host, args=None):
    facts = run_module(host, "gpu_facts", args or {})["ansible_facts"]["gpu"]
    return facts["health"]["kernel_log"]["incremental"], {
        "healthy": facts["healthy"], "issues": facts["health_issues"],
        "xids": [[(x["xid"], x["time"], x["fault"]) for x in g["health"]["xids"]] for g in facts["gpus"]],
        "history": [[x["xid"] for x in g["health"]["xids_before_driver_load"]] for g in facts["gpus"]],
        "driver_loaded": facts["health"]["kernel_log"]["driver_loaded"]}


def _whole_read(host, args=None):
    host.run(["rm", "-f", host.KERNEL_LOG_STATE], check=True)
    return _health_of(host, args)


def test_a_gate_that_reads_only_new_lines_gives_the_verdict_of_a_whole_read(h200x2):
    now = time.time()
    h200x2.set_fault({"driver_loaded_at": now - 7200, "xid": [{"gpu": 0, "xid": 79, "at": now - 3600}, {"gpu": 1, "xid": 13, "at": now - 1800}]})
    try:
        first = _health_of(h200x2)
        # The log grows after that read (set_fault would forget the state: the file is rewritten
        # as a journal appends): a second Xid on GPU 1 (a fault), Xid 79 again.
        faults = h200x2.faults()
        faults["xid"] += [{"gpu": 1, "xid": 48, "at": now - 2}, {"gpu": 0, "xid": 79, "at": now - 1}]
        with open(h200x2.root.faults, "w") as handle:  # the log grows: the kept state stays
            json.dump(faults, handle)
        incremental, grown = _health_of(h200x2)
        whole_incremental, whole = _whole_read(h200x2)
    finally:
        h200x2.clear_faults()
    assert first[0] is False and first[1]["healthy"] is False
    assert (incremental, whole_incremental) == (True, False)
    assert grown == whole
    assert grown["healthy"] is False and [len(x) for x in grown["xids"]] == [2, 2]
    assert any("Xid 48" in issue for issue in grown["issues"]) and any("Xid 79" in issue and "2 times" in issue for issue in grown["issues"])


def test_a_driver_reload_since_the_last_read_counts_as_in_a_whole_read(h200x2):
    now = time.time()
    h200x2.set_fault({"driver_loaded_at": now - 7200, "xid": [{"gpu": 0, "xid": 79, "at": now - 600}]})
    try:
        before = _health_of(h200x2)
        faults = h200x2.faults()
        faults["driver_loaded_at"] = now - 1  # reloaded after the Xid (and after the first read)
        # The sim prints one load line: as a log that kept both, the first is before the Xid.
        with open(h200x2.root.faults, "w") as handle:
            json.dump(faults, handle)
        incremental, reloaded = _health_of(h200x2)
        _whole, whole = _whole_read(h200x2)
    finally:
        h200x2.clear_faults()
    assert before[1]["healthy"] is False and before[1]["xids"][0]
    assert incremental is True and reloaded == whole
    assert reloaded["healthy"] is True and reloaded["xids"] == [[], []] and reloaded["history"][0] == [79]


@pytest.mark.parametrize("state", ["{corrupt", json.dumps({"format": 1, "boot_id": "another-boot", "window_hours": 24.0, "read_at": 0,
                                                          "cursor": "s=zeromib-sim;t=99999999999", "lines": []})])
def test_a_corrupt_or_foreign_state_reads_the_whole_window_and_hides_no_xid(h200x2, state):
    h200x2.set_fault({"xid": [{"gpu": 0, "xid": 79, "age_s": 60}]})
    try:
        h200x2.run(["sh", "-c", f"mkdir -p -m 700 /var/lib/zeromib-gpu && umask 077 && printf %s '{state}' > {h200x2.KERNEL_LOG_STATE}"],
                   check=True)
        incremental, seen = _health_of(h200x2)
    finally:
        h200x2.clear_faults()
    assert incremental is False and seen["healthy"] is False and [x[0] for x in seen["xids"][0]] == [79]


def test_check_mode_writes_no_kernel_log_state_and_a_real_look_does(h200x2):
    # Check mode changes nothing on the node, the kernel log's cursor cache included (a whole read).
    h200x2.set_fault({"xid": [{"gpu": 0, "xid": 79, "age_s": 60}]})
    try:
        exists = ["test", "-e", h200x2.KERNEL_LOG_STATE]
        for module in ("gpu_facts", "gpu_release"):
            run = run_module(h200x2, module, {}, check=True)
            assert h200x2.run(exists).returncode != 0, (module, run.msg)
        facts = run_module(h200x2, "gpu_facts", {})["ansible_facts"]["gpu"]
        assert facts["healthy"] is False and h200x2.run(exists).returncode == 0
    finally:
        h200x2.clear_faults()
