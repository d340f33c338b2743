"""GPU health through real Ansible on simulated hosts: each injected fault fails the
free_gpus role's assert with a message naming the host, the GPU and the issue; a healthy
host passes; gpu_facts reports health, and reports it as not checked on an older driver.

Faults go in through the simulator (tests/sim/README.md): `field_values` of nvidia-smi, the
simulated kernel log (`xid`), a GPU fewer than expected (`count`).
"""
import json
import os

import pytest

from ansible_in_ns import COLLECTIONS, VENV_BIN, run_module

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
    out = os.path.join(host.dir, "role-%d.json" % host._seq)
    play = os.path.join(host.dir, "role-%d.yml" % host._seq)
    with open(play, "w") as handle:
        handle.write(ROLE_PLAY.format(out=json.dumps(out)))
    extra = os.path.join(host.dir, "role-%d-vars.json" % host._seq)
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
    except (OSError, ValueError):
        raise AssertionError("no outcome (rc %s):\n%s\n%s" % (proc.returncode, proc.stdout[-4000:], proc.stderr[-4000:]))


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
    from make_config import make_config

    old = ["remapped_rows.pending", "remapped_rows.failure", "clocks_event_reasons.hw_slowdown",
           "clocks_event_reasons.hw_thermal_slowdown", "clocks_event_reasons.hw_power_brake_slowdown",
           "clocks_event_reasons.sw_thermal_slowdown", "memory.reserved"]
    host = nshost(config=make_config("h200x2", seed="health03", unsupported_fields=old, driver_version="470.57.02"))
    result = run_module(host, "gpu_facts", {})
    gpu = result["ansible_facts"]["gpu"]
    assert gpu["healthy"] is True and gpu["health_checked"] is False
    notes = gpu["gpus"][0]["health"]["unchecked"]
    assert notes == ["the driver does not know remapped_rows.failure, remapped_rows.pending: not checked"], notes
    assert gpu["gpus"][0]["health"]["slowdown"] == []  # read through the clocks_throttle_reasons names
