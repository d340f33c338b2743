# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations


class ModuleDocFragment:

    # Options shared by every module that reads the GPUs.
    DOCUMENTATION = r"""
options:
  nvidia_smi:
    description:
      - Path of the C(nvidia-smi) to run.
      - When not set, C(nvidia-smi) is searched in E(PATH), then in C(/usr/bin), C(/usr/local/nvidia/bin), C(/usr/local/bin) and
        C(/run/nvidia/driver/usr/bin) (where the NVIDIA GPU Operator's driver container shows it).
    type: path
  timeout:
    description:
      - Seconds each C(nvidia-smi) call may take.
      - A call that takes longer is killed and reported as a failure; a hung driver is never taken for a free GPU.
    type: float
    default: 10
  max_used_mib:
    description:
      - A GPU is clean when its C(memory.used) is at most this many MiB.
      - MIG-enabled GPUs read 50-59 MiB and desktop GPUs a few hundred MiB when idle; set a baseline for them.
      - A GPU whose memory nvidia-smi cannot report (V([N/A]), V([Unknown Error])) is never clean, except a GPU that shares the host's
        memory (see O(min_host_available_mib)).
    type: int
    default: 0
  min_host_available_mib:
    description:
      - For a GPU that shares the host's memory (unified memory, as on GB10 / DGX Spark and Jetson), whose C(memory.used) reads V([N/A]), the
        least MemAvailable of the host (C(/proc/meminfo), MiB) with which it is free. Such a GPU is free when no compute process is on
        it and the host has at least this much memory available; its C(memory_proof) reads V(unified memory).
      - The default 1024 MiB is what a CUDA context, the driver's own allocations and a small job need, and what a Jetson with 4 GiB in
        all can still leave free; set the size of the next job's model on a serving node. Read only where nvidia-smi shows the shape.
    type: int
    default: 1024
  cross_gpu_footprint_mib:
    description:
      - A GPU that no process uses, while contexts live on other GPUs, is clean at O(max_used_mib) plus this many MiB (4 MiB measured
        on H200), reported with C(cross_gpu_footprint=true); so one GPU can be freed while the others train. V(0) turns it off.
    type: int
    default: 4
  protect:
    description:
      - Extra process names or PIDs never signalled and not counted as making a host dirty, added to the built-in list (PID 1, the
        module's session, kernel threads, C(nvidia-persistenced), C(nv-hostengine), Fabric Manager, C(dcgm-exporter), display servers,
        C(sshd), C(systemd)).
      - A name protects only a process whose identity backs it (root or a system account running a root-owned system executable, or
        a system unit's main process); give a PID for any other.
        R(More in the gpu_release guide on protect, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.protect).
    type: list
    elements: str
    default: []
"""
