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
      - Prove that each free GPU really runs CUDA, through the driver's own C(libcuda.so.1) (no toolkit, no Python package) - create a
        context, allocate and write O(smoke_test_mib), free it, and read the GPU free again; a failure names the CUDA error and call.
      - Runs in a bounded child process; never in check mode, on a GPU in use or on a GPU in MIG mode (C(smoke_test.skipped) says why).
        About 0.2 s per GPU on an H200. R(More in the gpu_release guide on smoke_test, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.smoke-test),
        R(the smoke test guide, ansible_collections.zeromib.gpu.docsite.guide_smoke_test).
    type: bool
    default: false
  smoke_test_mib:
    description:
      - MiB of device memory each GPU's smoke test allocates and writes; at most half of the GPU's free memory
        (C(cuMemGetInfo)) is taken, whatever is asked. V(0) creates a context and synchronizes only.
    type: int
    default: 1024
"""
