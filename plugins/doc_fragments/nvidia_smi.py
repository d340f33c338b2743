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
      - A GPU whose memory nvidia-smi cannot report (V([N/A]), V([Unknown Error])) is never clean.
    type: int
    default: 0
  cross_gpu_footprint_mib:
    description:
      - While a process has a CUDA context on one GPU, every other GPU of the node that it can see reads a few MiB with no
        compute app on it (4 MiB on H200, driver 580). A GPU that no process uses, while contexts live on other GPUs, is
        clean when it reads at most O(max_used_mib) plus this many MiB; it is then reported with C(cross_gpu_footprint=true).
      - This lets one GPU be freed while the others train. V(0) turns the allowance off.
    type: int
    default: 4
  protect:
    description:
      - Extra process names or PIDs never signalled and not counted as making a host dirty.
      - Added to the built-in list (PID 1, the module and its Ansible session, kernel threads, C(nvidia-persistenced),
        C(nv-hostengine), C(nvidia-fabricmanager), C(nv-fabricmanager), C(dcgm-exporter), C(Xorg), C(Xwayland),
        C(gnome-shell), C(kwin_wayland), C(sshd), C(systemd)).
      - A name matches the executable's basename, the basename of C(argv[0]), or the kernel's C(comm), which is
        truncated to 15 characters (C(nvidia-persistenced) shows as C(nvidia-persiste)).
      - A name (built-in or given here) protects only a process whose identity backs it, since any user can name a process
        so - run by root or a system account (uid up to 999) from a root-owned executable in a system directory (C(/usr/bin),
        C(/usr/sbin), C(/usr/lib...), C(/usr/local/bin), C(/usr/local/nvidia/bin), ...), as the kernel resolved it; or the
        main process of the system unit it runs in. Any other process so named is an ordinary holder, with a warning. Give a
        PID for a daemon that is neither. See the collection's C(docs/docsite/rst/guide_security.rst).
    type: list
    elements: str
    default: []
"""
