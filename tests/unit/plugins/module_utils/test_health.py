# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""_health: real capture values -> issues; kernel log Xid lines -> GPUs."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _health as health
from ansible_collections.zeromib.gpu.plugins.module_utils import _nvidia_smi as smi

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "fixtures", "nvidia-smi")
FIELDS = smi.GPU_FIELDS + smi.HEALTH_FIELDS


def _capture_rows(name):
    with open(os.path.join(FIXTURES, "h200x2-580.159.04-health", name)) as handle:
        lines = [line for line in handle.read().splitlines() if not line.startswith("###")]
    return smi.parse_gpus("\n".join(lines), FIELDS)


def _row(**values):
    """An idle H200 of the real capture, with some readings changed (raw nvidia-smi text)."""
    base = dict(zip([f for f, _k, _t in FIELDS], (
        "0, GPU-22d6f351-b711-b43e-634b-50b970b6a61e, NVIDIA H200, 00000000:00:06.0, 580.159.04, 143771, 616, 0, 143156, 0, 36, "
        "80.26, Enabled, Disabled, 0, No, No, [N/A], 5, 5, 16, 16, P0, Not Active, Not Active, Not Active, Not Active").split(", ")))
    base.update(values)
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
    found = health.parse_xids(XID_LINES)
    assert sorted(found) == ["0000:18:00", "0000:2a:00"]
    assert [x["xid"] for x in found["0000:18:00"]] == [79]
    assert [x["xid"] for x in found["0000:2a:00"]] == [13, 94]
    gpu = {"pci_bus_id": "00000000:2A:00.0"}
    assert [x["xid"] for x in health.xids_of(gpu, found)] == [13, 94]


def test_dmesg_xids_older_than_the_window_are_dropped():
    found = health.parse_xids(XID_LINES[1:2], uptime_s=4321.0 + 7200, window_s=3600)
    assert found == {}
    found = health.parse_xids(XID_LINES[1:2], uptime_s=4321.0 + 60, window_s=3600)
    assert found["0000:2a:00"][0]["time"] == "60 s ago"


def test_critical_xid_is_an_issue_application_xid_is_not():
    found = health.parse_xids(XID_LINES)
    gpu = _row(**{"pci.bus_id": "00000000:2A:00.0"})
    assert health.gpu_issues(gpu, health.Checks(), health.xids_of(gpu, found)) == [
        "Xid 94 (contained ECC error) in the kernel log at 2026-11-29T09:09:01+0000"]


def test_kernel_log_falls_back_to_dmesg_and_reads_xids(tmp_path):
    (tmp_path / "journalctl").write_text("#!/bin/sh\necho 'No journal files were found.' >&2\nexit 1\n")
    (tmp_path / "dmesg").write_text("#!/bin/sh\necho '[    5.000000] NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus.'\n")
    for name in ("journalctl", "dmesg"):
        os.chmod(str(tmp_path / name), 0o755)
    log = health.KernelLog(1e6, search_path=str(tmp_path))
    log._which = lambda name: str(tmp_path / name)
    log.start()
    found = log.xids()
    assert log.source == "dmesg" and log.error is None and [x["xid"] for x in found["0000:18:00"]] == [79]


def test_unreadable_kernel_log_is_reported_not_healthy_by_default(tmp_path):
    log = health.KernelLog(24)
    log._which = lambda name: None
    log.start()
    assert log.xids() == {} and log.error == "neither journalctl nor dmesg found"
    gpu = health.Health(health.Checks(), {}, kernel_log=log).annotate([_row()])[0]
    assert gpu["healthy"] is True and gpu["health_checked"] is False
    assert gpu["health"]["unchecked"] == ["recent Xid errors not checked: neither journalctl nor dmesg found"]


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
    (gpu,) = runner.query_gpus(FIELDS)
    assert gpu["_rejected"] == ["remapped_rows.pending"] and gpu["remapped_rows_pending"] is None
    assert gpu["slowdown_hw"] == "Not Active" and runner.old_names
    assert "clocks_throttle_reasons.hw_slowdown" in log.read_text().splitlines()[-1]
    runner.query_gpus(FIELDS)
    assert runner.calls == 4  # learnt once: the second look is one call
