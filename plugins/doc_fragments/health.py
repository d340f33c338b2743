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
      - Read each GPU's health (ECC, row remaps, retired pages, PCIe link, clocks, persistence, MIG mode, recovery action, NVSwitch
        fabric, Xids in the kernel log) and say whether it is ready for work (C(healthy), C(health_issues)); a check that could not run
        is named in C(health_unchecked). V(false) reads memory and holders only.
        R(More in the gpu_release guide on health, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.health),
        R(the health guide, ansible_collections.zeromib.gpu.docsite.guide_health).
    type: bool
    default: true
  min_pcie_gen:
    description:
      - A GPU whose PCIe link runs below this generation (compared in P-state P0 only) is unhealthy. V(0) expects the GPU's own
        C(pcie.link.gen.max); V(4) accepts Gen4 on a node that never had Gen5.
    type: int
    default: 0
  min_pcie_width:
    description:
      - A GPU whose PCIe link is narrower than this many lanes is unhealthy. V(0) expects the GPU's own C(pcie.link.width.max).
    type: int
    default: 0
  require_persistence:
    description:
      - A GPU with persistence mode off is unhealthy; V(false) accepts it. Where nvidia-smi reports none, it is not checked
        (C(health_unchecked)).
    type: bool
    default: true
  expected_mig_mode:
    description:
      - When set, a GPU whose current MIG mode differs is unhealthy. Not set, MIG mode is not checked.
    type: str
    choices: [enabled, disabled]
  xid_window_hours:
    description:
      - Hours of kernel log searched for each GPU's Xid errors (only those since the driver last loaded count). An Xid is a fault when
        NVIDIA's catalog asks for more than restarting the application; O(xid_ignore) and O(xid_fatal) change that. V(0) reads no log.
        R(More in the gpu_release guide on xid_window_hours, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.xid-window-hours).
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
      - When not V(0), run C(dcgmi diag -r) at this level (V(1) takes seconds, V(3) many minutes); a failed diagnostic makes the host
        unhealthy. Where C(dcgmi) is not installed nothing runs and the health does not change.
    type: int
    choices: [0, 1, 2, 3, 4]
    default: 0
  shm_min_free_mib_per_gpu:
    description:
      - The host is unhealthy when C(/dev/shm) has less free space than this many MiB for each GPU (NCCL's init fails there for want of
        space while every GPU reads 0 MiB). The default suits NCCL on 4 channels; Docker's 64 MiB default fails it. V(0) does not check.
        R(More in the gpu_release guide on shm_min_free_mib_per_gpu, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.shm-min-free-mib-per-gpu).
    type: int
    default: 128
  ready_profile:
    description:
      - The training-ready profile - the settings the next job expects on each GPU. A GPU off it is not healthy (C(health_issues) names
        the setting, what it reads and the nvidia-smi command that sets it back); C(health.ready) shows the readings. They come from the
        same C(nvidia-smi --query-gpu) call as the other health readings. Not given, every suboption takes its default; V(any) skips that
        setting. A driver that does not know a field leaves that check in C(health_unchecked). A pending ECC mode change is always an issue.
        R(More in the health guide, ansible_collections.zeromib.gpu.docsite.guide_health.training-ready-profile).
    type: dict
    suboptions:
      compute_mode:
        description:
          - The compute mode every GPU must be in. In V(exclusive_process) or V(prohibited), a second CUDA process on the GPU fails with
            "all CUDA-capable devices are busy or unavailable" (multi-process training, the smoke test). V(default) - the default.
        type: str
        choices: [default, exclusive_process, prohibited, any]
        default: default
      clocks:
        description:
          - V(default) - application clocks at their defaults and no clocks held down by a user setting (a clock lock,
            C(nvidia-smi -lgc), seen while it holds the clocks - nvidia-smi has no query field for the lock itself). V(any) does not check.
        type: str
        choices: [default, any]
        default: default
      power_limit:
        description:
          - V(default) - a power limit below the GPU's default power limit is an issue. A number is the least watts a GPU
            may be limited to (V(300)). V(any) does not check.
        type: str
        default: default
"""
