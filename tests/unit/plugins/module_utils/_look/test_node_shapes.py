# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_node_shapes: the refusal on a GPU that Windows paravirtualises (WSL2, a Hyper-V GPU partition),
told from /dev/dxg and the NVIDIA driver's empty list, and that a plain node reads nothing new."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _node_shapes
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmiError

GPUS = [{"index": 0, "pci_bus_id": "00000000:09:00.0", "memory_used_mib": 2844}]
DRIVER = {"0000:09:00.0": {"bus": "0000:09:00.0", "minor": 0, "uuid": "GPU-0"}}


@pytest.fixture
def release(tmp_path):
    path = tmp_path / "osrelease"
    path.write_text("5.15.79.1-microsoft-standard-WSL2\n")
    return str(path)


def test_wsl2_is_refused_with_one_sentence_naming_the_kernel_and_windows(release):
    with pytest.raises(_node_shapes.NodeShapeRefused) as raised:
        _node_shapes.refuse_shared_with_windows(GPUS, {}, dxg="/dev/null", osrelease=release)
    msg = raised.value.msg
    assert isinstance(raised.value, NvidiaSmiError) and raised.value.node_shape
    assert msg.startswith("This node is WSL2 (kernel 5.15.79.1-microsoft-standard-WSL2, /dev/dxg, no NVIDIA kernel driver): "
                          "the GPU is shared with Windows")
    assert msg.endswith("free it on Windows (close the programs using it: Task Manager, Performance, GPU).") and ". " not in msg
    assert "reset" not in msg and "reboot" not in msg


def test_a_custom_kernel_is_named_as_a_gpu_paravirtualised_by_windows(tmp_path):
    path = tmp_path / "osrelease"
    path.write_text("6.6.36-custom\n")
    with pytest.raises(_node_shapes.NodeShapeRefused) as raised:
        _node_shapes.refuse_shared_with_windows(GPUS, {}, dxg="/dev/null", osrelease=str(path))
    assert raised.value.msg.startswith("This node's GPU is paravirtualised by Windows (kernel 6.6.36-custom, /dev/dxg")


def test_no_dxg_character_device_is_no_windows_gpu(tmp_path, release):
    plain = tmp_path / "dxg"
    plain.write_text("")  # a regular file is no device
    for dxg in (str(plain), str(tmp_path / "absent")):
        _node_shapes.refuse_shared_with_windows(GPUS, {}, dxg=dxg, osrelease=release)


def test_a_node_whose_driver_lists_its_gpus_reads_nothing_here(monkeypatch):
    """A plain node (the NVIDIA driver's list, which every look reads) stats no /dev/dxg and reads no release."""
    def no_read(*_args, **_kwargs):
        raise AssertionError("read on a plain node")
    monkeypatch.setattr(os, "stat", no_read)
    monkeypatch.setattr(_node_shapes, "kernel_release", no_read)
    _node_shapes.refuse_shared_with_windows(GPUS, DRIVER, dxg="/dev/null")
    _node_shapes.refuse_shared_with_windows([], {}, dxg="/dev/null")
