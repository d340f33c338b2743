# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""_health: real capture values -> issues; kernel log Xid lines -> GPUs."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health as health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log as kernel_log_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "nvidia-smi")
FIELDS = smi.GPU_FIELDS + smi.HEALTH_FIELDS
# The 2-GPU capture of 2026-12-01 asked the first 13 health fields; the others (MIG pending, recovery
# action, fabric) come from the single-field capture of the same driver (h200-580.159.04-q-2026-12-01).
CAPTURE_FIELDS = smi.GPU_FIELDS + smi.HEALTH_FIELDS[:13]


def _fields_txt():
    with open(os.path.join(FIXTURES, "h200-580.159.04-q-2026-12-01", "fields.txt")) as handle:
        return dict(line.split(": ", 1) for line in handle.read().splitlines() if ": " in line)


def _capture_rows(name):
    with open(os.path.join(FIXTURES, "h200x2-580.159.04-health", name)) as handle:
        lines = [line for line in handle.read().splitlines() if not line.startswith("###")]
    return smi.parse_gpus("\n".join(lines), CAPTURE_FIELDS)


def _raw(**values):
    """{field: nvidia-smi's text} of an idle H200 of the real captures, some readings changed."""
    captured = _fields_txt()
    base = dict(zip([f for f, _k, _t in FIELDS], (
        "0, GPU-22d6f351-b711-b43e-634b-50b970b6a61e, NVIDIA H200, 00000000:00:06.0, 580.159.04, 143771, 616, 0, 143156, 0, 36, "
        "80.26, Enabled, Disabled, 0, No, No, [N/A], 5, 5, 16, 16, P0, Not Active, Not Active, Not Active, Not Active, Disabled, "
        "{}, {}, {}, N/A, ".format(captured["gpu_recovery_action"], captured["fabric.state"], captured["fabric.status"])
        # The training-ready profile's fields: compute mode, power limits and ECC mode as the H200's nvidia-smi -q
        # of the same day reads them; application clocks as the H200 of the 590 exporter capture prints them.
        + "Default, 700.00, 700.00, " + ", ".join(["[Requested functionality has been deprecated]"] * 4)
        + ", Not Active, Enabled, Enabled").split(", ")))
    base.update(values)
    return base


def _row(**values):
    """An idle H200 of the real captures, with some readings changed (raw nvidia-smi text)."""
    base = _raw(**values)
    return smi.parse_gpus(", ".join(base[f] for f, _k, _t in FIELDS), FIELDS)[0]


def test_real_healthy_h200_capture_reads_healthy():
    gpus = _capture_rows("health_q_gpu_nounits.txt")
    assert [g["pci_bus_id"] for g in gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    for gpu in gpus:
        assert health.gpu_issues(gpu, health.Checks()) == []
        reading = health.readings(gpu)
        assert (reading["ecc_uncorrected_volatile"], reading["remapped_rows_pending"], reading["retired_pages_pending"]) == (0, False, None)
        assert (reading["pcie_link_gen_current"], reading["pcie_link_width_max"], reading["slowdown"]) == (5, 16, [])


CASES = [
    ("ecc", {"ecc.errors.uncorrected.volatile.total": "1"}, health.Checks(), ["1 uncorrectable ECC error since the driver loaded"]),
    ("ecc-many", {"ecc.errors.uncorrected.volatile.total": "3"}, health.Checks(), ["3 uncorrectable ECC errors since the driver loaded"]),
    ("ecc-na-is-not-a-fault", {"ecc.errors.uncorrected.volatile.total": "[N/A]"}, health.Checks(), []),
    ("remap-pending", {"remapped_rows.pending": "Yes"}, health.Checks(), ["a row remap is pending: reset the GPU (or reboot) to apply it"]),
    ("remap-failure", {"remapped_rows.failure": "Yes"}, health.Checks(),
     ["row remapping failed: the GPU has run out of spare rows and needs replacing"]),
    ("retired-pages-pending-pre-ampere", {"retired_pages.pending": "Yes", "remapped_rows.pending": "[N/A]"}, health.Checks(),
     ["a page retirement is pending: reset the GPU (or reboot) to apply it"]),
    ("width-x8", {"pcie.link.width.current": "8"}, health.Checks(), ["PCIe link runs at x8, expected x16"]),
    ("gen4-of-5", {"pcie.link.gen.current": "4"}, health.Checks(), ["PCIe link runs at Gen4, expected Gen5"]),
    ("gen4-accepted", {"pcie.link.gen.current": "4"}, health.Checks(min_pcie_gen=4), []),
    # The RTX 4080 capture at P8 reads Gen1 of 4: a power-saving downshift, not a fault.
    ("idle-p8-downshift", {"pcie.link.gen.current": "1", "pcie.link.gen.max": "4", "pstate": "P8"}, health.Checks(), []),
    ("hw-thermal", {"clocks_event_reasons.hw_slowdown": "Active", "clocks_event_reasons.hw_thermal_slowdown": "Active"}, health.Checks(),
     ["clocks lowered by hardware slowdown", "clocks lowered by hardware thermal slowdown"]),
    ("persistence-off", {"persistence_mode": "Disabled"}, health.Checks(), ["persistence mode is off"]),
    ("persistence-off-accepted", {"persistence_mode": "Disabled"}, health.Checks(require_persistence=False), []),
    ("persistence-na-windows", {"persistence_mode": "[N/A]"}, health.Checks(), []),
    ("mig-expected", {}, health.Checks(expected_mig_mode="enabled"), ["MIG mode is Disabled, expected Enabled"]),
    ("mig-as-expected", {}, health.Checks(expected_mig_mode="disabled"), []),
]


@pytest.mark.parametrize("values,checks,issues", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_readings_to_issues(values, checks, issues):
    assert health.gpu_issues(_row(**values), checks) == issues


# Xid lines as drivers print them: journalctl short-iso, dmesg, older without "PCI:".
XID_LINES = [
    "2026-11-29T09:08:01+0000 node01 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "[ 4321.123456] NVRM: Xid (PCI:0000:2a:00): 13, pid=1234, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0)",
    "2026-11-29T09:09:01+0000 node01 kernel: NVRM: Xid (0000:2A:00): 94, pid=1234, name=python3, Contained: SM (0x1). RST: No, D-RST: No",
    "2026-11-29T09:10:01+0000 node01 kernel: NVRM: GPU at PCI:0000:18:00: GPU-ab0cf4f6",
]


def test_xid_lines_map_to_gpus_by_bus_id():
    found = kernel_log_mod.parse_xids(XID_LINES)
    assert sorted(found) == ["0000:18:00", "0000:2a:00"]
    assert [x["xid"] for x in found["0000:18:00"]] == [79]
    assert [x["xid"] for x in found["0000:2a:00"]] == [13, 94]
    gpu = {"pci_bus_id": "00000000:2A:00.0"}
    assert [x["xid"] for x in kernel_log_mod.xids_of(gpu, found)] == [13, 94]


def test_dmesg_xids_older_than_the_window_are_dropped():
    found = kernel_log_mod.parse_xids(XID_LINES[1:2], uptime_s=4321.0 + 7200, window_s=3600)
    assert found == {}
    found = kernel_log_mod.parse_xids(XID_LINES[1:2], uptime_s=4321.0 + 60, window_s=3600)
    assert found["0000:2a:00"][0]["time"] == "60 s ago"


def test_xid_judged_by_nvidias_catalog_restart_app_is_not_a_fault():
    found = kernel_log_mod.parse_xids(XID_LINES)
    gpu = _row(**{"pci.bus_id": "00000000:2A:00.0"})
    # 13 (graphics engine exception) and 94 (contained ECC error): RESTART_APP in the catalog.
    assert health.gpu_issues(gpu, health.Checks(), kernel_log_mod.xids_of(gpu, found)) == []
    gpu = _row(**{"pci.bus_id": "00000000:18:00.0"})
    assert health.gpu_issues(gpu, health.Checks(), kernel_log_mod.xids_of(gpu, found)) == [
        "Xid 79 (GPU has fallen off the bus) in the kernel log at 2026-11-29T09:08:01+0000; NVIDIA's Xid catalog: RESTART_BM "
        "(reboot the node)"]


@pytest.mark.parametrize("xid,checks,fault", [
    (79, health.Checks(), True),
    (48, health.Checks(), True),  # WORKFLOW_XID_48
    (74, health.Checks(), True),  # WORKFLOW_NVLINK_ERR
    (119, health.Checks(), True),  # RESET_GPU
    (13, health.Checks(), False),  # RESTART_APP
    (31, health.Checks(), False),
    (63, health.Checks(), False),  # IGNORE
    (45, health.Checks(), False),  # logged when a process is killed: see NOT_FAULT_XIDS
    (45, health.Checks(xid_fatal=[45]), True),
    (999, health.Checks(), False),  # not in the catalog: listed, not judged
    (999, health.Checks(xid_fatal=[999]), True),
    (79, health.Checks(xid_ignore=[79]), False),
    (13, health.Checks(xid_fatal=[13]), True),
    (13, health.Checks(xid_fatal=[13], xid_ignore=[13]), True),  # both: fatal
], ids=lambda v: str(v) if isinstance(v, int) else "")
def test_xid_fault_set_from_the_catalog_and_the_overrides(xid, checks, fault):
    assert checks.xid_fault(xid) is fault


def test_xid_fault_set_is_derived_from_the_immediate_action():
    for number, (action, _text) in kernel_log_mod.XID_CATALOG.items():
        if number not in health.NOT_FAULT_XIDS and action != "XID_154":
            assert health.Checks().xid_fault(number) is (action not in ("RESTART_APP", "IGNORE")), number


def test_xid_154_is_history_once_the_gpu_reads_no_recovery_action():
    assert health.Checks().xid_fault(154, "None") is False
    assert health.Checks().xid_fault(154, "Reset") is True
    assert health.Checks().xid_fault(154, None) is True


def test_xid_older_than_the_driver_load_is_history():
    lines = [
        "[  100.000000] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "[  200.000000] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)",
        "[  300.000000] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python3, Graphics Exception",
    ]
    after, before, loaded = kernel_log_mod.split_at_driver_load(lines)
    assert after == lines[2:] and before == lines[:1] and "580.159.04" in loaded
    assert kernel_log_mod.split_at_driver_load(lines[2:]) == (lines[2:], [], None)
    # The proprietary module's banner (public dmesg reports); a line without the reader's prefix starts no message.
    assert "580.105.08" in kernel_log_mod.split_at_driver_load(["[    6.060263] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.105.08"])[2]
    assert kernel_log_mod.split_at_driver_load(["NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.105.08"]) == ([], [], None)


@pytest.mark.parametrize("seconds,text", [(60, "60 s ago"), (7200, "2 h ago"), (600, "10 min ago"), (3 * 86400, "3 days ago")])
def test_xid_age_reads_in_words(seconds, text):
    assert kernel_log_mod.human_age(seconds) == text


def test_real_h200_recovery_action_and_fabric_read_healthy_and_checked():
    gpu = _row()
    assert gpu["recovery_action"] == "None" and gpu["fabric_state"] is None and not health.has_fabric(gpu)
    assert health.gpu_issues(gpu, health.Checks()) == []
    assert health.unchecked_checks(gpu, health.Checks()) == []


FAULT_CASES = [
    ("recovery-reset", {"gpu_recovery_action": "Reset"}, ["the driver asks for a recovery action: Reset"]),
    ("recovery-reboot", {"gpu_recovery_action": "Reboot"}, ["the driver asks for a recovery action: Reboot"]),
    ("fabric-in-progress", {"fabric.state": "In Progress", "fabric.status": "N/A"},
     ["NVSwitch fabric registration is In Progress, expected Completed"]),
    ("fabric-not-started", {"fabric.state": "Not Started"}, ["NVSwitch fabric registration is Not Started, expected Completed"]),
    ("fabric-failed", {"fabric.state": "Completed", "fabric.status": "Failure"}, ["NVSwitch fabric registration failed (Failure)"]),
    ("fabric-completed", {"fabric.state": "Completed", "fabric.status": "Success"}, []),
    ("fabric-na-bracketed", {"fabric.state": "[N/A]", "fabric.status": "[N/A]"}, []),
    ("mig-change-pending", {"mig.mode.pending": "Enabled"}, ["a MIG mode change to Enabled is pending: reset the GPU to apply it"]),
    ("requires-reset", {"ecc.errors.uncorrected.volatile.total": "[GPU requires reset]"},
     ["ecc.errors.uncorrected.volatile.total reads [GPU requires reset]: reset the GPU (or reboot)"]),
    ("unknown-error", {"remapped_rows.pending": "[Unknown Error]"}, ["remapped_rows.pending reads [Unknown Error]"]),
]


@pytest.mark.parametrize("values,starts", [c[1:] for c in FAULT_CASES], ids=[c[0] for c in FAULT_CASES])
def test_recovery_action_fabric_mig_pending_and_error_tokens(values, starts):
    issues = health.gpu_issues(_row(**values), health.Checks())
    assert len(issues) == len(starts) and all(issue.startswith(start) for issue, start in zip(issues, starts)), issues


def test_error_token_is_a_fault_not_a_gap():
    gpu = _row(**{"ecc.errors.uncorrected.volatile.total": "[GPU requires reset]"})
    assert health.unchecked_checks(gpu, health.Checks()) == []


ALL_NA = dict((f, "[N/A]") for f, _k, _t in smi.HEALTH_FIELDS + (("persistence_mode", None, None), ("mig.mode.current", None, None)))


def test_all_na_gpu_says_which_checks_did_not_run():
    gpu = _row(**ALL_NA)
    assert health.gpu_issues(gpu, health.Checks()) == []
    names = [name for name, _why in health.unchecked_checks(gpu, health.Checks())]
    # MIG and the fabric read N/A on GPUs without them: not a gap.
    assert names == ["ecc", "row_remap", "retired_pages", "pcie", "clocks", "persistence", "recovery_action"]
    record = health.Health(health.Checks()).annotate([gpu])[0]
    assert record["health_checked"] is False and record["health_unchecked"] == names
    assert record["health"]["unchecked"][0] == "ecc: ecc.errors.uncorrected.volatile.total reads [N/A]"


def test_row_remapping_and_page_retirement_stand_in_for_each_other():
    assert health.unchecked_checks(_row(), health.Checks()) == []  # Hopper: retired pages [N/A], remaps read
    pre_ampere = _row(**{"remapped_rows.pending": "[N/A]", "remapped_rows.failure": "[N/A]", "retired_pages.pending": "No"})
    assert health.unchecked_checks(pre_ampere, health.Checks()) == []


def test_a_field_the_driver_rejects_is_unchecked_by_name():
    gpu = dict(_row(), mig_mode=None, mig_mode_pending=None, _rejected=["mig.mode.current", "mig.mode.pending"])
    assert health.unchecked_checks(gpu, health.Checks()) == [("mig", "the driver does not know mig.mode.current, mig.mode.pending")]
    assert health.gpu_issues(gpu, health.Checks(expected_mig_mode="enabled")) == []  # unknown, not "not supported"


# The exporter's single-GPU H200 VM on driver 590.48.01 (tests/fixtures/nvidia-smi/exporter-captures): its
# fabric.state, fabric.status and fabric.health.summary as captured.
VM_590 = {"fabric.state": "Completed", "fabric.status": "Success", "fabric.health.summary": "N/A", "driver_version": "590.48.01"}
# What read_fabric_manager records on such hosts (the shapes its own tests below produce).
NO_FM = {"unit": {"load_state": "not-found", "active_state": "inactive", "sub_state": "dead"}, "unit_error": None, "binary": None,
         "version": None, "version_error": None, "note": health.NO_FABRIC_MANAGER}
NO_SYSTEMD = dict(NO_FM, unit=None, unit_error="systemctl show nvidia-fabricmanager failed (rc 1): System has not been booted with "
                  "systemd as init system (PID 1). Can't operate.")
GPU_OPERATOR = dict(NO_FM, binary="/run/nvidia/driver/usr/bin/nv-fabricmanager",
                    note="Fabric Manager of the GPU Operator's driver container (/run/nvidia/driver): no unit of this host")


def _unit(active, sub, version="590.48.01"):
    return dict(NO_FM, unit={"load_state": "loaded", "active_state": active, "sub_state": sub}, binary="/usr/bin/nv-fabricmanager",
                version=version, note=None)


@pytest.mark.parametrize("fabric_manager", [None, NO_FM, NO_SYSTEMD, GPU_OPERATOR, _unit("failed", "failed"), _unit("inactive", "dead")],
                         ids=["not-read", "no-fabric-manager", "no-systemd", "gpu-operator", "unit-failed", "unit-inactive"])
def test_completed_success_fabric_is_healthy_and_checked_whatever_the_host_has(fabric_manager):
    gpu = _row(**VM_590)
    assert health.has_fabric(gpu) and health.fabric_registered(gpu) and gpu["fabric_health_summary"] is None  # N/A: no reading
    record = health.Health(health.Checks(), fabric_manager=fabric_manager, driver_version="590.48.01").annotate([gpu])[0]
    assert record["healthy"] is True and record["health_issues"] == []
    assert record["health_checked"] is True and record["health_unchecked"] == []


FM_FAULTS = [
    # (id, fabric readings, what was found of Fabric Manager, this GPU's issues (their beginnings), the node's)
    ("in-progress-unit-failed", {"fabric.state": "In Progress", "fabric.status": "N/A"}, _unit("failed", "failed"),
     ["NVSwitch fabric registration is In Progress, expected Completed", "nvidia-fabricmanager is failed: NVSwitch jobs fail"],
     ["nvidia-fabricmanager is failed: NVSwitch jobs fail (CUDA error 802) until it runs"]),
    ("not-started-unit-inactive", {"fabric.state": "Not Started", "fabric.status": "N/A"}, _unit("inactive", "dead"),
     ["NVSwitch fabric registration is Not Started", "nvidia-fabricmanager is inactive"], ["nvidia-fabricmanager is inactive: NVSwitch"]),
    ("in-progress-no-fabric-manager", {"fabric.state": "In Progress", "fabric.status": "N/A"}, NO_FM,
     ["NVSwitch fabric registration is In Progress"], []),
    # The GPU reads its fabric registered: another version on the host's PATH explains nothing (the GPU is the authority).
    ("completed-active-other-version", VM_590, _unit("active", "running", "535.161.08"), [], []),
    ("in-progress-active-other-version", {"fabric.state": "In Progress", "fabric.status": "N/A"}, _unit("active", "running", "535.161.08"),
     ["NVSwitch fabric registration is In Progress",
      "nv-fabricmanager is version 535.161.08, the driver 590.48.01: Fabric Manager must match the driver exactly"],
     ["nv-fabricmanager is version 535.161.08, the driver 590.48.01"]),
    ("completed-active-same-version", VM_590, _unit("active", "running"), [], []),
    ("completed-fabric-unhealthy", dict(VM_590, **{"fabric.health.summary": "Unhealthy"}), NO_FM,
     ["NVSwitch fabric health is Unhealthy (fabric.health.summary), expected Healthy"], []),
    ("completed-fabric-healthy", dict(VM_590, **{"fabric.health.summary": "Healthy"}), NO_FM, [], []),
    ("completed-status-failure", dict(VM_590, **{"fabric.status": "Failure"}), _unit("failed", "failed"),
     ["NVSwitch fabric registration failed (Failure)", "nvidia-fabricmanager is failed"], ["nvidia-fabricmanager is failed"]),
]


@pytest.mark.parametrize("values,fabric_manager,starts,node", [c[1:] for c in FM_FAULTS], ids=[c[0] for c in FM_FAULTS])
def test_fabric_manager_is_a_fault_only_where_certain(values, fabric_manager, starts, node):
    gpus = [_row(**dict(values, index=str(i))) for i in range(2)]
    look = health.Health(health.Checks(), fabric_manager=fabric_manager, driver_version="590.48.01")
    records = look.annotate(gpus)
    for record in records:
        issues = record["health_issues"]
        assert len(issues) == len(starts) and all(i.startswith(w) for i, w in zip(issues, starts)), issues
        assert record["health_checked"] is True
    assert len(look.host_issues) == len(node) and all(i.startswith(w) for i, w in zip(look.host_issues, node)), look.host_issues
    healthy, said = health.host_verdict(records, None, look.host_issues)
    assert healthy is (not starts)
    # The node's own fault once, not once per GPU.
    assert all(said.count(issue) == 1 for issue in look.host_issues), said


def test_a_fabric_fault_says_what_was_found_of_fabric_manager():
    gpu = _row(**{"fabric.state": "In Progress", "fabric.status": "N/A"})
    (issue,) = health.gpu_issues(gpu, health.Checks(), fabric_manager=NO_FM)
    assert issue.endswith("; on this host: no unit nvidia-fabricmanager, no nv-fabricmanager; " + health.NO_FABRIC_MANAGER), issue
    (issue, _node) = health.gpu_issues(gpu, health.Checks(), (), health.fabric_manager_issues(_unit("failed", "failed"), "590.48.01", gpu),
                                       _unit("failed", "failed"))
    assert issue.endswith("on this host: unit nvidia-fabricmanager loaded, failed (failed), nv-fabricmanager 590.48.01 at "
                          "/usr/bin/nv-fabricmanager"), issue
    (issue,) = health.gpu_issues(gpu, health.Checks(), fabric_manager=GPU_OPERATOR)
    assert "no unit nvidia-fabricmanager, nv-fabricmanager at /run/nvidia/driver/usr/bin/nv-fabricmanager; Fabric Manager of " \
           "the GPU Operator's driver container" in issue, issue
    (issue,) = health.gpu_issues(gpu, health.Checks(), fabric_manager=NO_SYSTEMD)
    assert "unit nvidia-fabricmanager not asked (systemctl show nvidia-fabricmanager failed (rc 1): System has not" in issue, issue


def test_fabric_is_unchecked_only_when_the_driver_does_not_know_it():
    gpu = dict(_row(), fabric_state=None, fabric_status=None, fabric_health_summary=None,
               _rejected=["fabric.state", "fabric.status", "fabric.health.summary"])
    assert health.unchecked_checks(gpu, health.Checks()) == [("fabric", "the driver does not know fabric.state, fabric.status")]
    # A driver with the registration but without fabric.health.* (older than it) checks the fabric fully.
    older = dict(_row(**VM_590), fabric_health_summary=None, _rejected=["fabric.health.summary"])
    assert health.unchecked_checks(older, health.Checks()) == [] and health.gpu_issues(older, health.Checks()) == []


def test_systemctl_show_of_a_unit_that_does_not_exist_reads_not_found():
    # systemd/systemd#1105: rc 0 and LoadState=not-found for a unit that does not exist.
    assert health.parse_unit_state("LoadState=not-found\nActiveState=inactive\nSubState=dead\n") == {
        "load_state": "not-found", "active_state": "inactive", "sub_state": "dead"}
    assert health.parse_unit_state("ActiveState=failed\nLoadState=loaded\nSubState=failed\n")["active_state"] == "failed"
    assert health.parse_unit_state("System has not been booted with systemd as init system (PID 1). Can't operate.\n") is None
    assert health.parse_fabric_manager_version("Fabric Manager version is : 450.102.04\n") == "450.102.04"


def _tool(directory, name, body):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text("#!/bin/sh\n" + body)
    os.chmod(str(directory / name), 0o755)


def test_read_fabric_manager_asks_load_state_and_finds_the_gpu_operators_binary(tmp_path):
    bin_dir, root = tmp_path / "bin", tmp_path / "driver"
    _tool(bin_dir, "systemctl", 'echo "$*" >> "{}"; printf "LoadState=not-found\\nActiveState=inactive\\nSubState=dead\\n"\n'.format(
        tmp_path / "calls"))
    _tool(root / "usr" / "bin", "nv-fabricmanager", "echo ran >> {}\n".format(tmp_path / "ran"))
    found = health.read_fabric_manager(search_path=str(bin_dir), driver_root=str(root))
    assert (tmp_path / "calls").read_text() == "show -p LoadState,ActiveState,SubState nvidia-fabricmanager\n"
    assert found["unit"] == {"load_state": "not-found", "active_state": "inactive", "sub_state": "dead"}
    assert found["binary"] == str(root / "usr" / "bin" / "nv-fabricmanager") and found["version"] is None
    assert not (tmp_path / "ran").exists()  # the driver container's binary is not run from the host
    assert found["note"].startswith("Fabric Manager of the GPU Operator's driver container")
    nothing = health.read_fabric_manager(search_path=str(bin_dir), driver_root=str(tmp_path / "none"))
    assert nothing["binary"] is None and nothing["note"] == health.NO_FABRIC_MANAGER


def test_read_fabric_manager_without_systemd_and_with_a_host_binary(tmp_path):
    bin_dir = tmp_path / "bin"
    _tool(bin_dir, "systemctl", "echo \"System has not been booted with systemd as init system (PID 1). Can't operate.\" >&2; exit 1\n")
    _tool(bin_dir, "nv-fabricmanager", "echo 'Fabric Manager version is : 590.48.01'\n")
    found = health.read_fabric_manager(search_path=str(bin_dir), driver_root=str(tmp_path / "none"))
    assert found["unit"] is None and found["unit_error"].startswith("systemctl show nvidia-fabricmanager failed (rc 1): System has not")
    assert found["binary"] == str(bin_dir / "nv-fabricmanager") and found["version"] == "590.48.01" and found["note"] is None


def _kernel_log(tmp_path, journalctl, dmesg):
    for name, body in (("journalctl", journalctl), ("dmesg", dmesg)):
        if body is not None:
            (tmp_path / name).write_text("#!/bin/sh\n" + body)
            os.chmod(str(tmp_path / name), 0o755)
    log = kernel_log_mod.KernelLog(1e6, search_path=str(tmp_path))
    log._which = lambda name: str(tmp_path / name) if (tmp_path / name).exists() else None
    log.start()
    return log


DMESG_79 = "echo '[    5.000000] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus.'\n"


def test_journalctl_without_a_journal_rc_0_falls_back_to_dmesg(tmp_path):
    log = _kernel_log(tmp_path, "echo 'No journal files were found.' >&2\nexit 0\n", DMESG_79)
    found, _history = log.xids()
    assert log.source == "dmesg" and log.error is None and [x["xid"] for x in found["0000:18:00"]] == [79]
    assert log.fallback == "journalctl: No journal files were found."


def test_journalctl_with_nothing_while_dmesg_has_lines_reads_dmesg(tmp_path):
    log = _kernel_log(tmp_path, "exit 0\n", DMESG_79)
    found, _history = log.xids()
    assert log.source == "dmesg" and [x["xid"] for x in found["0000:18:00"]] == [79]


def test_no_journal_and_no_dmesg_is_not_checked(tmp_path):
    log = _kernel_log(tmp_path, "echo 'No journal files were found.' >&2\nexit 0\n", "echo 'dmesg: read kernel buffer failed' >&2\nexit 1\n")
    assert log.xids() == ({}, {}) and log.source is None
    assert log.error == "journalctl: No journal files were found.; dmesg failed (rc 1): dmesg: read kernel buffer failed"


def test_empty_journal_and_unreadable_dmesg_keeps_the_empty_answer(tmp_path):
    log = _kernel_log(tmp_path, "exit 0\n", "exit 1\n")
    assert log.xids() == ({}, {}) and log.source == "journalctl" and log.error is None


def test_kernel_log_falls_back_to_dmesg_and_reads_xids(tmp_path):
    (tmp_path / "journalctl").write_text("#!/bin/sh\necho 'No journal files were found.' >&2\nexit 1\n")
    (tmp_path / "dmesg").write_text("#!/bin/sh\necho '[    5.000000] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus.'\n")
    for name in ("journalctl", "dmesg"):
        os.chmod(str(tmp_path / name), 0o755)
    log = kernel_log_mod.KernelLog(1e6, search_path=str(tmp_path))
    log._which = lambda name: str(tmp_path / name)
    log.start()
    found, _history = log.xids()
    assert log.source == "dmesg" and log.error is None and [x["xid"] for x in found["0000:18:00"]] == [79]


def test_unreadable_kernel_log_is_reported_not_healthy_by_default(tmp_path):
    log = kernel_log_mod.KernelLog(24)
    log._which = lambda name: None
    log.start()
    assert log.xids() == ({}, {}) and log.error == "neither journalctl nor dmesg found"
    gpu = health.Health(health.Checks(), {}, kernel_log=log).annotate([_row()])[0]
    assert gpu["healthy"] is True and gpu["health_checked"] is False and gpu["health_unchecked"] == ["xid"]
    assert gpu["health"]["unchecked"] == ["xid: recent Xid errors not checked: neither journalctl nor dmesg found"]


def test_dcgmi_absent_runs_nothing():
    assert health.dcgm_diag(0, lambda name: "/usr/bin/dcgmi") is None
    assert health.dcgm_diag(1, lambda name: None)["summary"] == "dcgmi not installed"


def test_dcgm_diag_verdict():
    table = "| Deployment | Pass |\n| Memory | Fail - GPU 0 |\n"
    assert health.parse_dcgm_diag(0, table) == (False, "failed: Memory")
    assert health.parse_dcgm_diag(0, "| Deployment | Pass |\n") == (True, "passed")
    assert health.parse_dcgm_diag(226, "Error: unable to connect to host engine\n")[0] is False


OLD_DRIVER = """\
echo "$*" >> "{log}"
case "$*" in
  *clocks_event_reasons*) echo 'Field "clocks_event_reasons.hw_slowdown" is not a valid field to query.'; echo; exit 2 ;;
  *remapped_rows.pending*) echo 'Field "remapped_rows.pending" is not a valid field to query.'; echo; exit 2 ;;
  *--query-gpu=*) echo "0, GPU-1, Tesla V100, 00000000:07:00.0, 470.57.02, 32510, 0, 3, 32500, 0, 33, 55.12, Enabled, Disabled, \
0, No, [N/A], 3, 3, 16, 16, P0, Not Active, Not Active, Not Active, Not Active" ;;
esac
"""


def test_older_driver_reads_throttle_names_and_drops_unknown_fields(tmp_path):
    log = tmp_path / "calls.log"
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + OLD_DRIVER.format(log=log))
    os.chmod(str(path), 0o755)
    runner = smi.NvidiaSmi(str(path), timeout=5)
    (gpu,) = runner.query_gpus(CAPTURE_FIELDS)
    assert gpu["_rejected"] == ["remapped_rows.pending"] and gpu["remapped_rows_pending"] is None
    assert gpu["slowdown_hw"] == "Not Active" and runner.old_names
    assert "clocks_throttle_reasons.hw_slowdown" in log.read_text().splitlines()[-1]
    runner.query_gpus(CAPTURE_FIELDS)
    assert runner.calls == 4  # learnt once: the second look is one call


def test_a_driver_without_fabric_state_is_not_asked_for_fabric_health_either(tmp_path):
    # fabric.health.* came after fabric.state: dropped with it, no call of its own. nvidia-smi
    # names the first unknown field it was asked (idle_q_bad_field.txt's message).
    known = [f for f, _k, _t in FIELDS if not f.startswith("fabric.")]
    row = ", ".join(_raw()[f] for f in known)
    log = tmp_path / "calls.log"
    reject = "  *{0}*) echo 'Field \"{0}\" is not a valid field to query.'; echo; exit 2 ;;\n"
    _tool(tmp_path, "nvidia-smi", 'echo "$*" >> "{}"\ncase "$*" in\n{}{}{}  *) echo "{}" ;;\nesac\n'.format(
        log, reject.format("fabric.state"), reject.format("fabric.status"), reject.format("fabric.health.summary"), row))
    runner = smi.NvidiaSmi(str(tmp_path / "nvidia-smi"), timeout=5)
    (gpu,) = runner.query_gpus(FIELDS)
    assert runner.calls == 3, log.read_text()  # fabric.state, fabric.status, then the answer
    assert sorted(gpu["_rejected"]) == ["fabric.health.summary", "fabric.state", "fabric.status"]
    assert gpu["memory_used_mib"] == 0 and health.unchecked_checks(gpu, health.Checks())[0][0] == "fabric"


R440 = """\
case "$*" in
  *mig.mode.current*) echo 'Field "mig.mode.current" is not a valid field to query.'; echo; exit 2 ;;
  *--query-gpu=*) echo "0, GPU-1, Tesla V100, 00000000:07:00.0, 440.33.01, 32510, 3, 32500, 0, 33, 55.12, Enabled" ;;
esac
"""


def test_r440_without_mig_mode_still_reads_memory(tmp_path):
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\n" + R440)
    os.chmod(str(path), 0o755)
    runner = smi.NvidiaSmi(str(path), timeout=5)
    fields = tuple(f for f in smi.GPU_FIELDS if f[0] != "memory.reserved")
    (gpu,) = runner.query_gpus(fields)
    assert gpu["memory_used_mib"] == 3 and gpu["mig_mode"] is None and gpu["_rejected"] == ["mig.mode.current"]


def test_a_rejection_that_names_no_field_drops_the_optional_fields_not_the_memory(tmp_path):
    path = tmp_path / "nvidia-smi"
    path.write_text("#!/bin/sh\ncase \"$*\" in *persistence_mode*) echo 'Invalid combination of input arguments.'; exit 2 ;;\n"
                    "*) echo '0, GPU-1, Tesla V100, 00000000:07:00.0, 440.33.01, 32510, 3, 32500, 0, 33, 55.12' ;; esac\n")
    os.chmod(str(path), 0o755)
    runner = smi.NvidiaSmi(str(path), timeout=5)
    (gpu,) = runner.query_gpus(smi.GPU_FIELDS)
    assert gpu["memory_used_mib"] == 3 and set(gpu["_rejected"]) == {"persistence_mode", "mig.mode.current"}


def test_empty_journal_and_unreadable_dmesg_without_root_is_not_checked(tmp_path, monkeypatch):
    """Review of issue 36: as a user journalctl -q answers nothing (it shows only that user's
    entries) and dmesg is refused: the Xids were not read, never "checked, none"."""
    monkeypatch.setattr(health.os, "geteuid", lambda: 1000)
    log = _kernel_log(tmp_path, "exit 0\n", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2\nexit 1\n")
    assert log.xids() == ({}, {}) and log.source is None
    assert log.error.endswith("not root: the kernel log was not readable (become: true)"), log.error
