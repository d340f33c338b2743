# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations


class ModuleDocFragment:

    # Options of the GPU health verdict, shared by every module that reads the GPUs.
    DOCUMENTATION = r"""
options:
  health:
    description:
      - Read each GPU's health (in the same C(nvidia-smi --query-gpu) call) and the kernel log's Xid errors, and say whether
        the GPU is ready for work (C(healthy), C(health_issues)).
      - Checks - C(ecc), C(row_remap), C(retired_pages), C(pcie), C(clocks), C(persistence), C(mig) (the expected mode, and a
        pending change), C(recovery_action) (C(gpu_recovery_action) other than V(None)), C(fabric) (the GPU's NVSwitch registration and
        fabric health, where it has a fabric; Fabric Manager is context), C(xid). Each GPU's C(health_unchecked) names those that could not run
        (a field the driver does not know or reads V([N/A]), an unreadable kernel log); C(health_checked) is V(true) only when it
        is empty. A reading of V([GPU requires reset]) or V([Unknown Error]) is a fault, naming the field.
      - V(false) reads memory and holders only; C(healthy) is then V(null).
    type: bool
    default: true
  min_pcie_gen:
    description:
      - A GPU whose PCIe link runs below this generation is unhealthy. V(0) expects the GPU's own C(pcie.link.gen.max)
        (the most that the GPU and its slot support together).
      - Compared only while the GPU is in P-state P0, since idle GPUs in a power-saving P-state train their link down
        (a desktop GPU at P8 reads Gen1); data-center GPUs idle at P0 at full speed.
      - Set V(4) to accept Gen4 on a node that never had Gen5.
    type: int
    default: 0
  min_pcie_width:
    description:
      - A GPU whose PCIe link is narrower than this many lanes is unhealthy. V(0) expects the GPU's own C(pcie.link.width.max).
    type: int
    default: 0
  require_persistence:
    description:
      - A GPU with persistence mode off is unhealthy (the driver state is torn down between jobs, and the first CUDA call pays
        for it). V(false) accepts it. Where nvidia-smi reports no persistence mode (V([N/A]), Windows), nothing is checked
        and C(persistence) is listed in the GPU's C(health_unchecked).
    type: bool
    default: true
  expected_mig_mode:
    description:
      - When set, a GPU whose current MIG mode differs is unhealthy. Not set, MIG mode is not checked.
    type: str
    choices: [enabled, disabled]
  xid_window_hours:
    description:
      - Hours of kernel log searched for Xid errors of each GPU (C(journalctl -k); C(dmesg) when journalctl is missing,
        fails, says V(No journal files were found.) or answers with no line; read-only, bounded to 5 s and 32 MiB). An upper
        bound - only Xids logged since the NVIDIA driver last loaded count (its C(loading NVIDIA UNIX ... Kernel Module)
        line, when it is in the window); older ones are listed in C(health.xids_before_driver_load).
      - An Xid is a fault when NVIDIA's Xid catalog gives it an immediate action other than C(RESTART_APP) or C(IGNORE)
        (C(RESET_GPU), C(RESTART_BM), C(WORKFLOW_*), ...; see the collection's C(docs/docsite/rst/guide_health.rst)); the others (13, 31, 43, 45,
        63, 94, ...) and Xids the catalog does not list are in C(health.xids) only. O(xid_ignore) and O(xid_fatal) change that.
      - V(0) does not read the kernel log.
    type: float
    default: 24
  xid_ignore:
    description:
      - Xid numbers never counted as a fault of the GPU, whatever NVIDIA's catalog says (they stay in C(health.xids)).
    type: list
    elements: int
    default: []
  xid_fatal:
    description:
      - Xid numbers always counted as a fault of the GPU (also ones the catalog does not list). A number in both lists is fatal.
    type: list
    elements: int
    default: []
  dcgm_diag:
    description:
      - When not V(0), run C(dcgmi diag -r) at this level (V(1) takes seconds, V(3) many minutes) and report its verdict in
        C(health.dcgm_diag); a failed diagnostic makes the host unhealthy.
      - Where C(dcgmi) is not installed nothing runs, C(health.dcgm_diag.summary) says V(dcgmi not installed), and the host's
        health does not change.
    type: int
    choices: [0, 1, 2, 3, 4]
    default: 0
  shm_min_free_mib_per_gpu:
    description:
      - The host is unhealthy when C(/dev/shm) has less free space than this many MiB for each GPU nvidia-smi shows (C(shm.free_mib)
        below it times C(count)) - NCCL puts its buffers there and fails its init with V(No space left on device), PyTorch DataLoader
        workers with bus errors, while every GPU reads 0 MiB.
      - The default, 128 MiB a GPU (1 GiB on an 8-GPU node), is what NCCL's shared-memory transport takes there for a ring and a tree
        on 4 channels (~9.2 MiB of buffers a channel and peer at NCCL's default buffer sizes), with room for PyTorch's segments;
        Docker's 64 MiB default fails NCCL outright. V(0) does not check. Checked only with O(health).
      - See the collection's C(docs/docsite/rst/guide_health.rst) and C(docs/docsite/rst/guide_troubleshooting.rst).
    type: int
    default: 128
"""
