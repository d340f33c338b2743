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
    _node_shapes.refuse_shared_with_windows(GPUS, {}, dxg="/dev/stdin", osrelease=release)  # a link to a device is none
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
    monkeypatch.setattr(os, "lstat", no_read)
    monkeypatch.setattr(_node_shapes, "kernel_release", no_read)
    _node_shapes.refuse_shared_with_windows(GPUS, DRIVER, dxg="/dev/null")
    _node_shapes.refuse_shared_with_windows([], {}, dxg="/dev/null")


def test_imex_channels_are_root_s_character_devices_named_channel_n(tmp_path):
    channels = tmp_path / "nvidia-caps-imex-channels"
    channels.mkdir()
    os.symlink("/dev/null", channels / "channel0")  # a link is no device file of this directory
    (channels / "channel1").write_text("")
    assert _node_shapes.imex_channels(str(channels)) == ()  # no character device (and not root's when run unprivileged)
    assert _node_shapes.imex_channels(str(tmp_path / "absent")) == ()
    assert _node_shapes.imex_domain(str(tmp_path / "absent")) is None


def test_imex_nodes_quote_only_addresses():
    lines = ["# the domain", "10.0.0.1", " node-02.rack7 # comment", "rm -rf /", "$(evil)", "", "fe80::1"]
    assert _node_shapes.imex_nodes(lines) == ["10.0.0.1", "node-02.rack7", "fe80::1"]
    assert _node_shapes.imex_nodes(None) == []


def test_a_config_anyone_else_may_write_is_not_read(tmp_path):
    path = tmp_path / "nodes_config.cfg"
    path.write_text("10.0.0.1\n")
    path.chmod(0o666)
    assert _node_shapes.root_config_lines(str(path)) is None
    path.chmod(0o644)
    expected = ["10.0.0.1"] if os.geteuid() == 0 else None  # root's file only
    assert _node_shapes.root_config_lines(str(path)) == expected
    os.symlink(str(path), tmp_path / "link")
    assert _node_shapes.root_config_lines(str(tmp_path / "link")) is None


def test_pinned_elsewhere_names_the_channel_the_nodes_and_what_to_run_there_and_no_reset():
    domain = _node_shapes.ImexDomain(("channel0",), ("10.0.0.1", "10.0.0.2"), 9)
    text = _node_shapes.pinned_elsewhere({"index": 1, "uuid": "GPU-1", "memory_used_mib": 4096}, domain, [77])
    assert text.startswith(", and no process of this node holds it (nvidia-smi charges it to exited pid 77): this node has IMEX channels "
                           "(/dev/nvidia-caps-imex-channels/channel0), so the memory is possibly pinned from another node of the NVLink domain")
    assert "(10.0.0.1, 10.0.0.2 and 7 more, from /etc/nvidia-imex/nodes_config.cfg)" in text and "nvidia-imex-ctl -N -H" in text
    assert "--gpu-reset" not in text and "reboot" not in text


Q_TEXT = """
==============NVSMI LOG==============

Attached GPUs                                          : 2
GPU 00000000:00:06.0
    Product Name                                       : NVIDIA H200
    GPU Virtualization Mode
        Virtualization Mode                            : Pass-Through
        Host VGPU Mode                                 : N/A
GPU 00000000:00:07.0
    GPU Virtualization Mode
        Virtualization Mode                            : None
        Host VGPU Mode                                 : N/A
"""


def test_virtualization_modes_per_gpu_from_q_text_as_the_h200_vm_reads():
    assert _node_shapes.virtualization_modes(Q_TEXT) == {"00000000:00:06.0": "Pass-Through", "00000000:00:07.0": "None"}
    gpus = [{"index": 0, "pci_bus_id": "00000000:00:06.0"}, {"index": 1, "pci_bus_id": "00000000:00:07.0"}]
    assert _node_shapes.read_virtualization(lambda args: Q_TEXT, gpus) == {0: "Pass-Through"}

    def fails(args):
        raise NvidiaSmiError("timed out")
    assert _node_shapes.read_virtualization(fails, gpus) == {}


def test_the_real_h200_vm_capture_reads_pass_through():
    path = os.path.join(os.path.dirname(__file__), *[os.pardir] * 4, "fixtures", "nvidia-smi", "h200-580.159.04-q-2026-12-01", "q.txt")
    with open(path) as handle:
        assert list(_node_shapes.virtualization_modes(handle.read()).values()) == ["Pass-Through"]


def test_guest_and_host_words_give_no_reset_steps():
    gpu = {"index": 0, "uuid": "GPU-0", "memory_used_mib": 4096}
    for mode in ("Pass-Through", "VGPU"):
        words = _node_shapes.guest_advice(gpu, mode)
        assert words.startswith("this node is a VM given") and "reboot this VM" in words and "--gpu-reset" not in words
    assert _node_shapes.guest_advice(gpu, None) is None and _node_shapes.guest_advice(gpu, "Host VGPU") is None
    host = _node_shapes.given_to_vms(gpu)
    assert "framebuffer reserved for the vGPUs given to VMs, not a leak" in host and "nvidia-smi vgpu" in host and "--gpu-reset" not in host


def test_the_slurm_hooks_short_note_names_the_shape_only_with_channels():
    assert _node_shapes.short_note(None) == ""
    note = _node_shapes.short_note(_node_shapes.ImexDomain(("channel0",)))
    assert note.startswith(" here: possibly pinned from another node of the NVLink domain") and "reset" not in note


def test_a_vgpu_hosts_words_name_the_vms_that_hold_its_vgpus():
    gpu = {"index": 1, "uuid": "GPU-1", "memory_used_mib": 24576}
    both = _node_shapes.given_to_vms(gpu, (["train-vm (libvirt)", "Proxmox VM 101"], 1))
    assert ("reserved for the vGPUs given to VMs (its vGPUs are held by train-vm (libvirt), Proxmox VM 101; 1 by no VM systemd "
            "names), not a leak") in both, both
    assert "(its vGPUs are held by no VM systemd names (2)), not a leak" in _node_shapes.given_to_vms(gpu, ([], 2))
    assert _node_shapes.short_vgpu((["train-vm (libvirt)"], 0)) == " here: vGPUs given to VMs (train-vm (libvirt)), no reset"
