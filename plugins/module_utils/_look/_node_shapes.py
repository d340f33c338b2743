# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Node shapes where "every GPU reads 0 MiB, or name the holder" cannot hold (issue 70), told from
what the kernel and the driver say, never from a name a user chose.

Loaded only where nvidia-smi's answer already shows the shape: a plain node (the NVIDIA kernel
driver's GPU list in /proc/driver/nvidia/gpus, which every look reads) reads nothing here.

A GPU paravirtualised by Windows (WSL2; a Hyper-V GPU partition): Linux has no NVIDIA kernel driver
and no /dev/nvidia*, only Microsoft's dxgkrnl device /dev/dxg, through which nvidia-smi and CUDA
reach the Windows driver (NVIDIA's CUDA on WSL user guide). The GPU is Windows': its memory reading
counts what Windows' programs hold (the desktop, browsers: 2844 MiB of 8192 on an idle RTX 3070,
XuehaiPan/nvitop#49), nvidia-smi lists no process (microsoft/WSL#7162: per-process statistics are not
available under WDDM), and nothing run here can free it or prove it free. The witnesses are the
kernel's and root's: /dev/dxg a character device (only root creates device nodes in the node's
/dev; a user's own mount namespace changes nothing root sees) and no GPU in the NVIDIA driver's list;
the kernel release (`*-microsoft-standard-WSL2`, /proc/sys/kernel/osrelease: not namespaced, no
tenant's to write) only names it.
"""

from __future__ import annotations

import os
import stat
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmiError

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import DriverGpu, Gpu

DXG = "/dev/dxg"
OSRELEASE = "/proc/sys/kernel/osrelease"


class NodeShapeRefused(NvidiaSmiError):
    """A node whose GPUs no run here can free or prove free: its one sentence says why and where to
    free them. An NvidiaSmiError, so that every entry point (gpu_facts, gpu_release, gpu_restore, the
    Slurm hooks) stops on it before judging any reading; `node_shape` lets the hooks give its sentence
    first, without the "nvidia-smi:" of a failed call."""

    node_shape = True


def is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def kernel_release(path: str = OSRELEASE) -> str | None:
    """The running kernel's release (uname -r), from procfs: answers at once, no tenant's to write."""
    try:
        with open(path) as handle:
            return handle.read(256).strip() or None
    except OSError:
        return None


def windows_gpu_sentence(release: str | None) -> str:
    """The refusal on a GPU paravirtualised by Windows; pure. `release`: the kernel's, or None."""
    if release and "microsoft" in release.lower():
        what = f"This node is WSL2 (kernel {release}, /dev/dxg, no NVIDIA kernel driver)"
    else:
        kernel = f"kernel {release}, " if release else ""
        what = f"This node's GPU is paravirtualised by Windows ({kernel}/dev/dxg, no NVIDIA kernel driver: WSL2 or a Hyper-V GPU partition)"
    return (what + ": the GPU is shared with Windows, whose programs hold its memory where this node can neither see them (nvidia-smi lists no "
            "process here) nor stop them, so nothing run here can free it or prove it free; free it on Windows (close the programs using it: "
            "Task Manager, Performance, GPU).")


def refuse_shared_with_windows(gpus: t.Sequence[Gpu], driver_gpus: t.Mapping[str | None, DriverGpu], dxg: str = DXG,
                               osrelease: str = OSRELEASE) -> None:
    """Raise NodeShapeRefused where nvidia-smi lists GPUs that the NVIDIA kernel driver does not
    have and /dev/dxg is a character device. Reads nothing while the driver lists a GPU."""
    if not gpus or driver_gpus or not is_char_device(dxg):
        return
    raise NodeShapeRefused(windows_gpu_sentence(kernel_release(osrelease)))
