# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_reset: the advice where only a GPU reset or a reboot frees a GPU, for each thing that refuses a
bare `nvidia-smi --gpu-reset` on a node (persistence mode, daemons holding the node, nvidia_drm, the
NVSwitch reset scope). Pure: the records are what the look returns."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _reset


def gpu(index, persistence="Enabled", fabric=None, name="NVIDIA H100 80GB HBM3"):
    return {"index": index, "minor_number": index, "uuid": f"GPU-{index}", "name": name, "persistence_mode": persistence,
            "fabric_state": fabric, "fabric_status": "Success" if fabric else None}


def daemon(pid, name, devices, unit=None, **extra):
    """A protected daemon as the holder scan records it: root, a root-owned system executable."""
    record = {"pid": pid, "name": name[:15], "argv0": name, "exe": name, "exe_path": "/usr/bin/" + name, "exe_owner": 0, "exe_verified": True,
              "uid": 0, "devices": devices, "gpu_indexes": [], "protected": True, "unit": unit, "system_service": bool(unit), "state": "S"}
    record.update(extra)
    return record


ALL = ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"]
FM_ACTIVE = {"unit": {"load_state": "loaded", "active_state": "active", "sub_state": "running"}}
FM_FAILED = {"unit": {"load_state": "loaded", "active_state": "failed", "sub_state": "failed"}}


def test_nothing_in_the_way_is_a_bare_reset_and_its_check():
    one = gpu(0, persistence="Disabled")
    p = _reset.plan(one, _reset.Node([one]))
    assert (p.reboot, p.blockers, p.steps) == (False, [], ["nvidia-smi --gpu-reset -i 0"])
    assert p.verify == "nvidia-smi -i 0 --query-gpu=index,memory.used --format=csv,noheader"


def test_persistence_mode_and_its_daemon_go_off_first_and_on_last_around_the_stopped_services():
    gpus = [gpu(0), gpu(1)]
    holders = [daemon(812, "nvidia-persistenced", ALL), daemon(900, "nv-hostengine", ALL, unit="nvidia-dcgm.service")]
    p = _reset.plan(gpus[1], _reset.Node(gpus, holders))
    assert p.steps == ["nvidia-smi -i 1 -pm 0", "systemctl stop nvidia-dcgm.service", "nvidia-smi --gpu-reset -i 1",
                       "systemctl start nvidia-dcgm.service", "nvidia-smi -i 1 -pm 1"]
    # nvidia-persistenced lets go of the GPU with its persistence mode: no stop of its own.
    assert p.blockers == ["persistence mode is on", "pid 900 nv-hostengine (nvidia-dcgm.service) holds its device node"]
    text = _reset.text(gpus[1], _reset.Node(gpus, holders))
    assert text.startswith("a GPU reset or a reboot is needed; a bare `nvidia-smi --gpu-reset -i 1` is refused on this node "
                           "(\"In use by another client\"): persistence mode is on, pid 900 nv-hostengine")
    assert text.endswith("then `nvidia-smi -i 1 --query-gpu=index,memory.used --format=csv,noheader` must read 0 MiB")


def test_a_daemon_that_holds_only_other_gpus_nodes_is_no_blocker():
    gpus = [gpu(0, persistence="Disabled"), gpu(1, persistence="Disabled")]
    holders = [daemon(900, "nv-hostengine", ["/dev/nvidia1", "/dev/nvidiactl"], unit="nvidia-dcgm.service")]
    assert _reset.plan(gpus[0], _reset.Node(gpus, holders)).steps == ["nvidia-smi --gpu-reset -i 0"]


def test_containers_pods_user_units_and_bare_processes_are_stopped_their_own_way():
    one = gpu(0, persistence="Disabled")
    holders = [
        daemon(10, "dcgm-exporter", ALL, container="4f3c2b1a4f3c", container_runtime="podman", container_name="dcgm"),
        daemon(11, "nv-hostengine", ALL, container="9e9e9e9e9e9e", pod="gpu-operator/nvidia-dcgm-x7k2p"),
        daemon(12, "Xorg", ALL),
        {"pid": 13, "name": "nvtop", "devices": ALL, "gpu_indexes": [], "protected": False, "state": "S", "unit": "session-3.scope"},
    ]
    p = _reset.plan(one, _reset.Node([one], holders))
    assert p.steps == ["podman stop dcgm", "kubectl label node <this node> nvidia.com/gpu.deploy.operands=false (its pod "
                       "gpu-operator/nvidia-dcgm-x7k2p leaves the node)", "kill 12", "kill 13", "nvidia-smi --gpu-reset -i 0",
                       "start nvtop again as it was started", "start Xorg again as it was started",
                       "kubectl label node <this node> nvidia.com/gpu.deploy.operands-", "podman start dcgm"]
    assert p.blockers[-1] == "pid 13 nvtop (session-3.scope) holds its device node (an NVML client)"


def test_nvidia_drm_in_use_means_reboot_and_unused_is_unloaded_around_the_reset():
    one = gpu(0, persistence="Disabled")
    p = _reset.plan(one, _reset.Node([one], drm=_reset.Drm(2, "nvidia_fbdev")))
    assert p.reboot and p.steps == []
    assert _reset.text(one, _reset.Node([one], drm=_reset.Drm(2, ""))) == (
        "only a reboot frees it on this node: nvidia_drm is loaded and in use (2 user(s): a console or display server on an NVIDIA GPU), "
        "and no GPU can be reset while it is")
    p = _reset.plan(one, _reset.Node([one], drm=_reset.Drm(0, "")))
    assert p.steps == ["modprobe -r nvidia_drm", "nvidia-smi --gpu-reset -i 0", "modprobe nvidia_drm"]


HGX = [gpu(i, persistence="Disabled", fabric="Completed") for i in range(8)]


def test_an_nvswitch_gpu_resets_alone_while_fabric_manager_runs():
    p = _reset.plan(HGX[3], _reset.Node(HGX, fabric_manager=FM_ACTIVE, nvswitch=True))
    assert (p.gpus, p.steps) == ([3], ["nvidia-smi --gpu-reset -i 3"])


def test_without_fabric_manager_the_reset_takes_the_whole_baseboard_or_says_reboot_while_others_work():
    node = _reset.Node(HGX, fabric_manager=FM_FAILED, nvswitch=True)
    p = _reset.plan(HGX[3], node)
    assert p.gpus == list(range(8)) and p.steps == ["nvidia-smi --gpu-reset -i 0,1,2,3,4,5,6,7"]
    assert "the reset must take GPUs 0,1,2,3,4,5,6,7 together: Fabric Manager is not running" in _reset.text(HGX[3], node)
    busy = node._replace(holders=[{"pid": 77, "name": "python3", "devices": [], "gpu_indexes": [5], "protected": False, "state": "R"}])
    text = _reset.text(HGX[3], busy)
    assert text.startswith("only a reboot frees it on this node: Fabric Manager is not running") and "GPU(s) 0,1,2,4,5,6,7 are in use (pid 77 python3)" in text


def test_before_ampere_the_nvlink_peers_go_together_even_with_fabric_manager():
    v100 = [gpu(i, persistence="Disabled", fabric="Completed", name="Tesla V100-SXM3-32GB") for i in range(2)]
    assert _reset.plan(v100[0], _reset.Node(v100, fabric_manager=FM_ACTIVE, nvswitch=True)).gpus == [0, 1]


def test_a_fabric_reading_without_an_nvswitch_is_a_vm_and_resets_alone():
    # The exporter's H200 VM capture reads fabric.state Completed with no NVSwitch at all.
    vm = [gpu(0, persistence="Disabled", fabric="Completed")]
    assert _reset.plan(vm[0], _reset.Node(vm, fabric_manager=None, nvswitch=False)).gpus == [0]


def test_a_later_memory_reading_keeps_the_looks_fabric_and_takes_its_own_persistence():
    looked = [gpu(i, persistence="Enabled", fabric="Completed") for i in range(2)]
    polled = {"index": 0, "persistence_mode": "Disabled", "fabric_state": None}
    p = _reset.plan(polled, _reset.Node(looked, fabric_manager=FM_FAILED, nvswitch=True))
    assert p.gpus == [0, 1] and p.steps[0] == "nvidia-smi -i 1 -pm 0"


def test_nvidia_drm_and_nvswitches_are_read_from_the_kernels_files(tmp_path):
    assert _reset.read_nvidia_drm(str(tmp_path)) is None
    os.makedirs(tmp_path / "nvidia_drm" / "holders" / "nvidia_fbdev")
    (tmp_path / "nvidia_drm" / "refcnt").write_text("3\n")
    assert _reset.read_nvidia_drm(str(tmp_path)) == _reset.Drm(3, "nvidia_fbdev")
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_text("")
    assert _reset.nvswitch_present(str(dev), str(tmp_path / "none")) is False
    (dev / "nvidia-nvswitch0").write_text("")
    assert _reset.nvswitch_present(str(dev), str(tmp_path / "none")) is True


@pytest.mark.parametrize("name", ["nvidia-persistenced"])
def test_a_users_process_named_like_the_persistence_daemon_is_stopped_not_trusted(name):
    one = gpu(0)
    impostor = daemon(4242, name, ALL, uid=4242, protected=False)
    assert "kill 4242" in _reset.plan(one, _reset.Node([one], [impostor])).steps


# ------------------------------------------------------------------ from inside a container


def test_from_inside_a_container_the_sequence_is_the_hosts_and_this_containers_own_steps_are_marked():
    """A container reads the host's kernel and NVML, not the host's processes: the advice is what
    the host's operator runs if nothing there holds the GPU either; a process of this container is
    stopped in it (its PID is not the host's)."""
    gpus = [gpu(0), gpu(1)]
    holders = [daemon(57, "nv-hostengine", ALL)]
    node = _reset.Node(gpus, holders, drm=_reset.Drm(0, ""), inside=True)
    text = _reset.text(gpus[0], node)
    assert text == (
        "if nothing on the host holds it either, a GPU reset or a reboot of the host is needed; a bare `nvidia-smi --gpu-reset -i 0` is "
        "refused on this node (\"In use by another client\"): persistence mode is on, pid 57 nv-hostengine holds its device node, nvidia_drm "
        "is loaded. To reset, as root on the host, in this order: `nvidia-smi -i 0 -pm 0`; `kill 57` (in this container); `modprobe -r "
        "nvidia_drm`; `nvidia-smi --gpu-reset -i 0`; `modprobe nvidia_drm`; `start nv-hostengine again as it was started` (in this "
        "container); `nvidia-smi -i 0 -pm 1`; then `nvidia-smi -i 0 --query-gpu=index,memory.used --format=csv,noheader` must read 0 MiB. "
        "A process of the host or of another guest with the GPU's device node open (DCGM's nv-hostengine, dcgm-exporter) refuses the reset "
        "as well and is not seen from here: zeromib.gpu.gpu_facts on the host names it")
    # The same node seen from the host: no marks, no "if".
    assert _reset.text(gpus[0], node._replace(inside=False)).startswith("a GPU reset or a reboot is needed; a bare")
    assert "(in this container)" not in _reset.text(gpus[0], node._replace(inside=False))


def test_from_inside_a_peer_gpu_with_memory_and_no_holder_here_is_in_use_and_fabric_manager_is_not_asked_of_the_container():
    """Another guest's job on GPU 5: the baseboard reset would take it, so a reboot once it is free."""
    hgx = [dict(g, memory_used_mib=4) for g in HGX]
    hgx[5]["memory_used_mib"] = 40960
    text = _reset.text(hgx[3], _reset.Node(hgx, fabric_manager={"unit": {"load_state": "not-found"}}, nvswitch=True, inside=True))
    assert text == ("if nothing on the host holds it either, only a reboot of the host frees it: Fabric Manager was not found running (a "
                    "container asks its own systemd, not the host's), and without it an NVSwitch GPU is reset only together with its NVLink "
                    "peers: GPU(s) 0,1,2,4,5,6,7 are in use (GPU 5 reads 40960 MiB with no holder in this container); once they are free, "
                    "the reset sequence can take them all")
    # Idle peers (a few MiB of cross-GPU footprint) are no use: the whole baseboard's sequence.
    hgx[5]["memory_used_mib"] = 4
    assert "in this order: `nvidia-smi --gpu-reset -i 0,1,2,3,4,5,6,7`; then" in _reset.text(hgx[3], _reset.Node(hgx, nvswitch=True, inside=True))


def test_from_inside_without_the_kernels_modules_no_sequence_is_given():
    gpus = [gpu(0)]
    node = _reset.Node(gpus, inside=True, kernel_seen=False)
    assert _reset.text(gpus[0], node) == ("if nothing on the host holds it either, gpu_release there says what frees it (this container cannot "
                                          "read the kernel's modules, /sys/module)")


def test_the_driver_module_is_seen_where_sysfs_shows_the_kernels_modules(tmp_path):
    assert _reset.driver_module_seen(str(tmp_path)) is False
    (tmp_path / "nvidia").mkdir()
    assert _reset.driver_module_seen(str(tmp_path)) is True
