# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations


class ModuleDocFragment:

    # Options of the CUDA smoke test, shared by gpu_facts and gpu_release.
    DOCUMENTATION = r"""
options:
  smoke_test:
    description:
      - Prove that each free GPU really runs CUDA, through the driver's own C(libcuda.so.1) (the CUDA driver API via ctypes; no
        toolkit, no Python package) - per GPU, addressed by PCI bus id, C(cuInit), C(cuDeviceGetByPCIBusId), C(cuCtxCreate),
        C(cuMemGetInfo), C(cuMemAlloc) of O(smoke_test_mib), C(cuMemsetD8) over it, C(cuCtxSynchronize), C(cuMemFree),
        C(cuCtxDestroy); then the GPU must read free again (C(nvidia-smi), polled for up to 5 s).
      - Catches what memory and health readings cannot - a driver and library that do not match after an upgrade without reboot,
        a GPU that cannot create a context after an Xid, memory that cannot be allocated or written, a fabric that never
        registered (C(CUDA_ERROR_SYSTEM_NOT_READY (802))).
      - The calls run in a child process of their own, bounded by O(timeout) for C(cuInit) and for each GPU; a hung call is
        killed with its process group and fails the GPU, never passes it. A failure names the CUDA error by name and number
        and the call, for example C(CUDA_ERROR_SYSTEM_NOT_READY (802) at cuCtxCreate).
      - Never runs in check mode, never on a GPU that a process uses (checked right before), never on a GPU in MIG mode (its
        instances would have to be addressed one by one); those GPUs are skipped and C(smoke_test.skipped) says why.
      - Costs about 0.2 s per GPU on an H200 at the default size (measured 0.17-0.20 s from context creation to destruction; the
        memset itself takes milliseconds, 16 GiB cost the same), plus 0.1-0.2 s once for C(cuInit) and a C(nvidia-smi) read after
        it; see the collection's C(docs/docsite/rst/guide_smoke_test.rst).
    type: bool
    default: false
  smoke_test_mib:
    description:
      - MiB of device memory each GPU's smoke test allocates and writes; at most half of the GPU's free memory
        (C(cuMemGetInfo)) is taken, whatever is asked. V(0) creates a context and synchronizes only.
    type: int
    default: 1024
"""
