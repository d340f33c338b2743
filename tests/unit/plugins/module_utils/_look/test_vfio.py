# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""GPUs given to VMs by passthrough (_look/_vfio, issue 70): sysfs as the kernel lays it out, the VM
scopes systemd makes, and the holder of a group node by the file's identity (this test process holds
a file open, read back through the real /proc). Through gpu_facts and the role:
tests/integration/test_vfio_passthrough.py."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _vfio as vfio
from ansible_collections.zeromib.gpu.plugins.plugin_utils._verdict import count_problem, verdict


def device(sys_root, bus, vendor="0x10de", klass="0x030200", driver="vfio-pci", group="42"):
    path = sys_root / "bus" / "pci" / "devices" / bus
    path.mkdir(parents=True)
    (path / "vendor").write_text(vendor + "\n")
    (path / "class").write_text(klass + "\n")
    if driver:
        os.symlink(f"../../../bus/pci/drivers/{driver}", path / "driver")
    os.symlink(f"../../../kernel/iommu_groups/{group}", path / "iommu_group")


def test_only_nvidia_display_devices_bound_to_vfio_pci_are_passthrough_gpus(tmp_path):
    device(tmp_path, "0000:61:00.0")
    device(tmp_path, "0000:5D:00.0", driver="nvidia", group="7")  # the host's own GPU
    device(tmp_path, "0000:63:00.0", vendor="0x8086", klass="0x020000", group="44")  # a NIC given to a VM
    device(tmp_path, "0000:61:00.1", klass="0x040300")  # the GPU's audio function
    device(tmp_path, "0000:62:00.0", driver=None, group="43")  # unbound
    assert vfio.passthrough_gpus(str(tmp_path)) == [("0000:61:00.0", "42")]
    assert vfio.passthrough_gpus(str(tmp_path / "nothing")) == []


@pytest.mark.parametrize(("scope", "slice_name", "said"), [
    ("machine-qemu\\x2d1\\x2dtrain\\x2dvm.scope", "machine.slice", "train-vm (libvirt)"),
    ("101.scope", "qemu.slice", "Proxmox VM 101"),
    ("machine-qemu\\x2d3\\x2dvm.scope", "qemu.slice", "machine-qemu-3-vm"),  # not where libvirt's are: its unit name, unescaped
])
def test_the_vm_is_named_from_the_scope_systemd_made(scope, slice_name, said):
    assert vfio.vm_name(scope, slice_name) == said


def fake_proc(tmp_path, pid, targets):
    """A /proc with PID's fd links pointing at TARGETS."""
    fd_dir = tmp_path / "proc" / str(pid) / "fd"
    fd_dir.mkdir(parents=True)
    for number, target in enumerate(targets):
        os.symlink(target, fd_dir / str(number))
    return str(tmp_path / "proc")


def test_a_group_is_held_by_the_vm_process_that_has_its_node_open_by_identity(tmp_path):
    dev = tmp_path / "dev"
    (dev / "vfio").mkdir(parents=True)
    for group in ("42", "43"):
        (dev / "vfio" / group).write_text("")
    identity = {(os.stat(dev / "vfio" / g).st_dev, os.stat(dev / "vfio" / g).st_ino): g for g in ("42", "43")}
    proc = fake_proc(tmp_path, 812, [str(dev / "vfio" / "42"), str(tmp_path / "disk.qcow2")])
    assert vfio.holder_of(identity, {812: "train-vm (libvirt)"}, proc, str(dev)) == {"42": (812, "train-vm (libvirt)")}
    # a process outside the VM scopes is never asked
    assert vfio.holder_of(identity, {}, proc, str(dev)) == {}


def test_an_fd_that_is_no_vfio_node_is_never_stated(tmp_path, monkeypatch):
    """A VM's disk image on a dead NFS server: a stat of its fd would wait on the server."""
    proc = fake_proc(tmp_path, 812, ["/mnt/nfs/disk.qcow2", "socket:[4242]", "/dev/vfio/42"])
    stated = []
    monkeypatch.setattr(vfio, "_identity", lambda path: stated.append(os.readlink(path)) or None)
    assert vfio.holder_of({(1, 2): "42"}, {812: "train-vm (libvirt)"}, proc) == {}
    assert stated == ["/dev/vfio/42"]


def test_vm_processes_come_only_from_root_owned_vm_scopes_at_the_top(tmp_path):
    scope = tmp_path / "machine.slice" / "machine-qemu\\x2d1\\x2dtrain\\x2dvm.scope" / "libvirt" / "emulator"
    scope.mkdir(parents=True)
    (scope / "cgroup.procs").write_text("4242\n")
    (tmp_path / "qemu.slice" / "101.scope").mkdir(parents=True)
    (tmp_path / "qemu.slice" / "101.scope" / "cgroup.procs").write_text("77\n")
    (tmp_path / "user.slice" / "machine.slice" / "machine-qemu\\x2d9\\x2dfake.scope").mkdir(parents=True)
    (tmp_path / "user.slice" / "machine.slice" / "machine-qemu\\x2d9\\x2dfake.scope" / "cgroup.procs").write_text("99\n")
    found = vfio.vm_processes([str(tmp_path)], systemd(UNITS))
    if os.geteuid() == 0:
        assert found == {4242: "train-vm (libvirt)", 77: "Proxmox VM 101"}
        os.chown(tmp_path / "qemu.slice" / "101.scope", 4242, 4242)  # a delegated directory: a user's names
        assert vfio.vm_processes([str(tmp_path)], systemd(UNITS)) == {4242: "train-vm (libvirt)"}
    else:
        assert found == {}  # owned by this user, not root: nothing is a VM


# What systemd answers for the units it runs (`systemctl show --property=Id,ControlGroup`).
UNITS = {"machine-qemu\\x2d1\\x2dtrain\\x2dvm.scope": "/machine.slice/machine-qemu\\x2d1\\x2dtrain\\x2dvm.scope", "101.scope": "/qemu.slice/101.scope"}


def systemd(units, asked=None):
    """A systemctl that knows `units` ({unit: ControlGroup}); others are not found (ControlGroup empty)."""
    def systemctl(args):
        names = args[args.index("--") + 1:]
        if asked is not None:
            asked.append(names)
        return 0, "\n".join(f"Id={name}\nControlGroup={units.get(name, '')}\n" for name in names), ""
    return systemctl


def test_a_vm_scope_is_read_only_where_systemd_confirms_it_as_its_unit(tmp_path):
    """A directory made outside systemd at the top of the tree (root's, named like libvirt's scope)
    names no VM: systemd has no such unit, or the unit's ControlGroup= is elsewhere."""
    for scope in ("machine-qemu\\x2d1\\x2dtrain\\x2dvm.scope", "machine-qemu\\x2d9\\x2dfake.scope"):
        (tmp_path / "machine.slice" / scope).mkdir(parents=True)
        (tmp_path / "machine.slice" / scope / "cgroup.procs").write_text("4242\n" if "train" in scope else "99\n")
    asked = []
    found = vfio.vm_processes([str(tmp_path)], systemd(UNITS, asked))
    if os.geteuid() == 0:
        assert found == {4242: "train-vm (libvirt)"} and len(asked) == 1  # one systemctl for every scope
        elsewhere = {"machine-qemu\\x2d1\\x2dtrain\\x2dvm.scope": "/system.slice/other.service"}
        assert vfio.vm_processes([str(tmp_path)], systemd(elsewhere)) == {}
        assert vfio.vm_processes([str(tmp_path)], lambda args: (1, "", "System has not been booted with systemd")) == {}
    else:
        assert found == {}


def test_has_vfio_groups_reads_one_directory(tmp_path):
    assert _facts.has_vfio_groups(str(tmp_path)) is False
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").write_text("")  # the container node alone: no group bound
    assert _facts.has_vfio_groups(str(tmp_path)) is False
    (tmp_path / "vfio" / "42").write_text("")
    assert _facts.has_vfio_groups(str(tmp_path)) is True


def test_given_to_vms_without_a_group_node_names_no_vm(tmp_path):
    device(tmp_path, "0000:61:00.0")
    assert vfio.given_to_vms(str(tmp_path), str(tmp_path / "dev"), mounts=[]) == [
        {"bus": "0000:61:00.0", "iommu_group": "42", "vm": None, "pid": None, "mdev": None}]


def vgpu(sys_root, parent, uuid, group, vendor="0x10de", physfn=None):
    """A mediated device as sysfs lays it out: /sys/bus/mdev/devices/UUID -> its directory below PARENT."""
    parent_dir = sys_root / "devices" / "pci0000:60" / parent
    (parent_dir / uuid).mkdir(parents=True, exist_ok=True)
    (parent_dir / "vendor").write_text(vendor + "\n")
    if physfn:
        os.symlink(f"../{physfn}", parent_dir / "physfn")
    os.symlink(f"../../../../kernel/iommu_groups/{group}", parent_dir / uuid / "iommu_group")
    (sys_root / "bus" / "mdev" / "devices").mkdir(parents=True, exist_ok=True)
    os.symlink(f"../../../devices/pci0000:60/{parent}/{uuid}", sys_root / "bus" / "mdev" / "devices" / uuid)


def test_vgpus_are_the_mediated_devices_of_nvidia_gpus_each_with_its_own_group(tmp_path):
    vgpu(tmp_path, "0000:61:00.0", "aa1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f01", "101")
    vgpu(tmp_path, "0000:61:00.4", "bb1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f02", "102", physfn="0000:62:00.0")  # on a VF: its GPU is the PF
    vgpu(tmp_path, "0000:63:00.0", "cc1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f03", "103", vendor="0x8086")  # another vendor's mdev
    assert vfio.vgpus(str(tmp_path)) == [("0000:61:00.0", "101", "aa1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f01"),
                                         ("0000:62:00.0", "102", "bb1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f02")]
    assert vfio.vgpus(str(tmp_path / "none")) == []
    given = vfio.given_to_vms(str(tmp_path), str(tmp_path / "dev"), mounts=[])
    expected = [("0000:61:00.0", "aa1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f01", None), ("0000:62:00.0", "bb1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f02", None)]
    assert [(g["bus"], g["mdev"], g["vm"]) for g in given] == expected


def test_the_vms_of_a_vgpu_hosts_gpu_are_those_holding_its_vgpus():
    given = [{"bus": "0000:61:00.0", "mdev": "a", "vm": "train-vm (libvirt)"}, {"bus": "0000:61:00.0", "mdev": "b", "vm": "train-vm (libvirt)"},
             {"bus": "0000:61:00.0", "mdev": "c", "vm": None}, {"bus": "0000:62:00.0", "mdev": "d", "vm": "Proxmox VM 101"},
             {"bus": "0000:61:00.0", "mdev": None, "vm": "passthrough-vm (libvirt)"}]
    assert vfio.vms_of_gpu(given, "00000000:61:00.0") == (["train-vm (libvirt)"], 1)
    assert vfio.vms_of_gpu(given, "00000000:63:00.0") == ([], 0)
    assert count_problem(2, 1, given[:4]) == "expected 2 GPUs, nvidia-smi shows 1: a GPU may have fallen off the bus"


GIVEN = [{"bus": "0000:61:00.0", "iommu_group": "42", "vm": "train-vm (libvirt)", "pid": 812, "mdev": None},
         {"bus": "0000:62:00.0", "iommu_group": "43", "vm": None, "pid": None, "mdev": None}]


def test_a_count_short_by_gpus_given_to_vms_says_so_with_no_reset_and_nothing_fell_off_the_bus():
    said = count_problem(8, 6, GIVEN)
    assert said == ("expected 8 GPUs, nvidia-smi shows 6: 2 given to VMs by PCI passthrough (vfio-pci): 0000:61:00.0 to VM train-vm (libvirt), "
                    "0000:62:00.0 (IOMMU group 43; no VM systemd names holds it); a VM's GPU is freed in the VM, and no reset is this host's to do")
    assert count_problem(8, 5, GIVEN).endswith("; 1 more may have fallen off the bus")
    assert count_problem(8, 7, []) == "expected 8 GPUs, nvidia-smi shows 7: a GPU may have fallen off the bus"
    many = count_problem(10, 3, [dict(GIVEN[0], bus=f"0000:{i:02x}:00.0") for i in range(7)])
    assert many.count(" to VM ") == 5 and " and 2 more;" in many


def test_the_verdict_of_a_release_uses_its_given_to_vms():
    result = {"released": True, "gpus": [{"index": 0, "memory_used_mib": 0, "clean": True}], "given_to_vms": GIVEN[:1], "killed": []}
    decided = verdict(result, 2)
    assert decided.failed_checks[-1] == "free_gpus_expected_count"
    assert decided.problems[-1].startswith("expected 2 GPUs, nvidia-smi shows 1: 1 given to VMs by PCI passthrough (vfio-pci): 0000:61:00.0 to VM")
