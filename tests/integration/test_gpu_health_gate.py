"""GPU health through real Ansible on simulated hosts: each injected fault fails the
free_gpus role's assert with a message naming the host, the GPU and the issue; a healthy
host passes; gpu_facts reports health, and reports it as not checked on an older driver.

Faults go in through the simulator (tests/sim/README.md): `field_values` of nvidia-smi, the
simulated kernel log (`xid`, `no_journal`, `journal_empty`, `driver_loaded_age_s`), an older
driver (`unsupported_fields`), Fabric Manager (`fabricmanager_state`, `fabricmanager_version`), a GPU
fewer than expected (`count`).
"""
import json
import os
import time

import pytest

from ansible_in_ns import COLLECTIONS, VENV_BIN, run_module
from make_config import R440_UNSUPPORTED_FIELDS, make_config

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
            __failed_msg: "{{{{ ansible_failed_result.msg | default('failed') }}}}"
    - name: Write the outcome
      ansible.builtin.copy:
        content: "{{{{ {{'failed': __failed_msg is defined, 'msg': __failed_msg | default(''), 'result': free_gpus_result | default(none)}} | to_json }}}}"
        dest: {out}
        mode: "0600"
      check_mode: false
"""


def run_role(host, variables, timeout=180, check=False):
    host._seq = getattr(host, "_seq", 0) + 1
    out = os.path.join(host.dir, f"role-{host._seq}.json")
    play = os.path.join(host.dir, f"role-{host._seq}.yml")
    with open(play, "w") as handle:
        handle.write(ROLE_PLAY.format(out=json.dumps(out)))
    extra = os.path.join(host.dir, f"role-{host._seq}-vars.json")
    with open(extra, "w") as handle:
        json.dump(dict({"free_gpus_wait_timeout": 5, "free_gpus_kill_timeout": 1}, **variables), handle)
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", play,
           "-e", "ansible_python_interpreter=/usr/bin/python3", "-e", "@" + extra] + (["--check"] if check else [])
    env = {"ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "HOME": "/root", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "False", "ANSIBLE_DEPRECATION_WARNINGS": "False"}
    proc = host.run(cmd, env=env, timeout=timeout)
    try:
        with open(out) as handle:
            return json.load(handle)
    except (OSError, ValueError) as exc:
        raise AssertionError(f"no outcome (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}") from exc


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
    ("no_journal_xid_79_in_dmesg", {"no_journal": True, "xid": [{"gpu": 1, "xid": 79, "age_s": 120}]}, {},
     ["GPU 1 (00000000:00:07.0)", "Xid 79 (GPU has fallen off the bus) in the kernel log 2 min ago", "RESTART_BM"]),
    ("empty_journal_xid_79_in_dmesg", {"journal_empty": True, "xid": [{"gpu": 0, "xid": 79, "age_s": 600}]}, {},
     ["GPU 0 (00000000:00:06.0)", "Xid 79 (GPU has fallen off the bus) in the kernel log 10 min ago"]),
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
    h200x2.set_fault({"no_journal": True, "xid": [{"gpu": 1, "xid": 79, "age_s": 120}]})
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


FABRIC = {"fields": {"fabric.state": "Completed", "fabric.status": "Success"}}  # the exporter's HGX H200 (590.48.01)


@pytest.fixture(scope="module")
def hgx(module_nshost):
    """An NVSwitch node: both GPUs registered with the fabric, nvidia-fabricmanager active, of the driver's version."""
    return module_nshost(config=make_config("h200x2", seed="health05", gpu_overrides={0: FABRIC, 1: FABRIC},
                                            fabric_manager={"state": "active"}))


def test_fabric_node_with_fabric_manager_of_the_drivers_version_passes(hgx):
    hgx.clear_faults()
    outcome = run_role(hgx, {"free_gpus_expected_count": 2})
    assert not outcome["failed"], outcome["msg"]
    facts = run_module(hgx, "gpu_facts", {})
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["health"]["fabric_manager"] == {"state": "active", "installed": True, "version": "580.159.04", "error": None}
    assert [g["health"]["fabric_state"] for g in gpu["gpus"]] == ["Completed", "Completed"] and gpu["health_checked"] is True


FABRIC_FAULTS = [
    ("fabric_in_progress", {"field_values": {"1": {"fabric.state": "In Progress", "fabric.status": "N/A"}}},
     ["GPU 1 (00000000:00:07.0): NVSwitch fabric registration is In Progress, expected Completed"]),
    ("fabric_manager_down", {"fabricmanager_state": "inactive"},
     ["nvidia-fabricmanager is inactive: NVSwitch jobs fail (CUDA error 802)"]),
    ("fabric_manager_failed", {"fabricmanager_state": "failed"}, ["nvidia-fabricmanager is failed"]),
    ("fabric_manager_other_version", {"fabricmanager_version": "535.161.08"},
     ["nv-fabricmanager is version 535.161.08, the driver 580.159.04: Fabric Manager must match the driver exactly"]),
]


@pytest.mark.parametrize("fault,words", [f[1:] for f in FABRIC_FAULTS], ids=[f[0] for f in FABRIC_FAULTS])
def test_fabric_fault_fails_the_gate(hgx, fault, words):
    hgx.set_fault(fault)
    try:
        outcome = run_role(hgx, {})
    finally:
        hgx.clear_faults()
    assert outcome["failed"] and outcome["result"]["status"] == "unhealthy", outcome
    for word in words:
        assert word in outcome["msg"], outcome["msg"]
    # The node's own fault is said once, not once per GPU.
    assert outcome["msg"].count("nvidia-fabricmanager is") <= 1, outcome["msg"]


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
