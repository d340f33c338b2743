# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""GPUs given to VMs (issue 70): by PCI passthrough, bound to vfio-pci, so absent from the host's
nvidia-smi and from the NVIDIA driver's GPU list; or shared as vGPUs, each a mediated device (mdev)
of the GPU that a VM holds through its own IOMMU group. Such a GPU is not missing and its memory is
not leaked, and a reset is not the host's to do while a VM has it.

Every witness is the kernel's or systemd's, never a name a tenant chose:

- sysfs: /sys/bus/pci/devices/<bus>/ with `vendor` 0x10de (NVIDIA), `class` 0x03xxxx (display),
  `driver` -> .../vfio-pci, `iommu_group` -> .../iommu_groups/<N>; a vGPU:
  /sys/bus/mdev/devices/<uuid> -> the mdev's directory below its parent device (an NVIDIA GPU, or a
  virtual function of one: its `physfn` names the GPU nvidia-smi lists), with its own `iommu_group`;
- the VM that has it: the process holding /dev/vfio/<N> open (the file's identity as the kernel
  gives it through /proc/PID/fd, root's to read), looked for only in the VM scopes systemd made at
  the top of the cgroup tree: libvirt's `machine.slice/machine-qemu\\x2d<id>\\x2d<name>.scope`
  (systemd-machined) and Proxmox's `qemu.slice/<VMID>.scope`, every directory on the way owned by
  root (a user's delegated subtree may name its cgroups at will and is never read as a VM), and
  each one a unit systemd confirms (its ControlGroup= is that directory: a directory made outside
  systemd names no VM). A process's name and command line (`qemu-system-x86_64 -name guest=X`)
  name nothing.

Loaded only where /dev/vfio has a group (_facts.has_vfio_groups): a node without passthrough reads
one directory and loads nothing.
"""

from __future__ import annotations

import os
import re
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _unit_owner

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._unit_owner import Systemctl

NVIDIA_VENDOR = "0x10de"
VFIO_DRIVER = "vfio-pci"
# The VM scopes systemd makes: libvirt's through systemd-machined, Proxmox's qemu-server.
VM_SLICES = ("machine.slice", "qemu.slice")
_LIBVIRT = re.compile(r"^machine-qemu-(\d+)-(.+)\.scope$")
_PROXMOX = re.compile(r"^(\d+)\.scope$")
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
# Bounds of the search for a group's holder (a VM host runs few VM processes, each with few fds).
MAX_PIDS = 256
MAX_FDS = 4096
MAX_DEPTH = 3


class GivenToVm(t.TypedDict):
    """A GPU bound to vfio-pci, or a vGPU of one (`mdev`: its UUID; None for passthrough): the GPU's
    PCI address, the IOMMU group a VM opens, and the VM that holds it (None: none that systemd names)."""

    bus: str
    iommu_group: str
    vm: str | None
    pid: int | None
    mdev: str | None


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            return handle.read(64).decode("ascii", "replace").strip()
    except OSError:
        return None


def _link_name(path: str) -> str | None:
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def passthrough_gpus(sys_root: str = "/sys") -> list[tuple[str, str]]:
    """[(PCI address, IOMMU group)] of the NVIDIA display devices bound to vfio-pci, in address order."""
    devices = os.path.join(sys_root, "bus", "pci", "devices")
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return []
    found = []
    for bus in names:
        path = os.path.join(devices, bus)
        if _read(os.path.join(path, "vendor")) != NVIDIA_VENDOR or not (_read(os.path.join(path, "class")) or "").startswith("0x03"):
            continue
        if _link_name(os.path.join(path, "driver")) != VFIO_DRIVER:
            continue
        group = _link_name(os.path.join(path, "iommu_group"))
        if group:
            found.append((bus.lower(), group))
    return found


def vgpus(sys_root: str = "/sys") -> list[tuple[str, str, str]]:
    """[(PCI address of the GPU, IOMMU group, mdev UUID)] of the vGPUs (mediated devices) of NVIDIA
    GPUs, in UUID order; the GPU of a vGPU on a virtual function is its physical function."""
    devices = os.path.join(sys_root, "bus", "mdev", "devices")
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return []
    found = []
    for uuid in names:
        path = os.path.join(devices, uuid)
        parent = os.path.dirname(os.path.realpath(path))
        if _read(os.path.join(parent, "vendor")) != NVIDIA_VENDOR:
            continue
        physical = os.path.join(parent, "physfn")
        gpu = os.path.basename(os.path.realpath(physical)) if os.path.islink(physical) else os.path.basename(parent)
        group = _link_name(os.path.join(path, "iommu_group"))
        if group:
            found.append((gpu.lower(), group, uuid.lower()))
    return found


def vm_name(scope: str, slice_name: str) -> str:
    """The VM a scope systemd made names: `train-vm (libvirt)`, `Proxmox VM 101`; pure."""
    name = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), scope)
    libvirt = _LIBVIRT.match(name)
    if slice_name == "machine.slice" and libvirt:
        return f"{libvirt.group(2)} (libvirt)"
    proxmox = _PROXMOX.match(name)
    if slice_name == "qemu.slice" and proxmox:
        return f"Proxmox VM {proxmox.group(1)}"
    return name[:-len(".scope")] if name.endswith(".scope") else name


def _root_owned(path: str) -> bool:
    try:
        return os.stat(path).st_uid == 0
    except OSError:
        return False


def _pids_below(directory: str, depth: int = 0) -> list[int]:
    """The PIDs of a cgroup directory and those below it (MAX_DEPTH, MAX_PIDS)."""
    pids = []
    text = _cgroups.read_small(os.path.join(directory, "cgroup.procs")) or ""
    pids += [int(word) for word in text.split() if word.isdigit()]
    if depth < MAX_DEPTH:
        try:
            children = sorted(e.name for e in os.scandir(directory) if e.is_dir(follow_symlinks=False))
        except OSError:
            children = []
        for child in children:
            pids += _pids_below(os.path.join(directory, child), depth + 1)
            if len(pids) >= MAX_PIDS:
                break
    return pids[:MAX_PIDS]


def vm_scopes(mounts: t.Iterable[str]) -> list[tuple[str, str, str]]:
    """[(directory, slice, scope)] of the VM scopes at the top of each cgroup mount, root's all the way."""
    found = []
    for mount in mounts:
        for slice_name in VM_SLICES:
            slice_dir = os.path.join(mount, slice_name)
            if not _root_owned(slice_dir):
                continue
            try:
                scopes = sorted(name for name in os.listdir(slice_dir) if name.endswith(".scope"))
            except OSError:
                continue
            found += [(os.path.join(slice_dir, scope), slice_name, scope) for scope in scopes if _root_owned(os.path.join(slice_dir, scope))]
    return found


def vm_processes(mounts: t.Iterable[str], systemctl: Systemctl | None = None) -> dict[int, str]:
    """{pid: VM} for the processes of the VM scopes systemd made and confirms as its units (one
    `systemctl show` for all of them; a systemd that does not answer confirms none)."""
    scopes = vm_scopes(mounts)
    if not scopes:
        return {}
    groups = _unit_owner.ask([scope for _directory, _slice, scope in scopes], systemctl)
    found: dict[int, str] = {}
    for directory, slice_name, scope in scopes:
        if groups.get(scope) != f"/{slice_name}/{scope}":
            continue
        for pid in _pids_below(directory):
            found.setdefault(pid, vm_name(scope, slice_name))
    return found


def _identity(path: str) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def holder_of(groups: t.Mapping[tuple[int, int], str], processes: t.Mapping[int, str], proc: str = "/proc",
              dev_root: str = "/dev") -> dict[str, tuple[int, str]]:
    """{group: (pid, VM)}: which of `processes` holds each group's /dev/vfio node open, by the
    file's identity (`groups`: {(st_dev, st_ino): group})."""
    held: dict[str, tuple[int, str]] = {}
    for pid, vm in sorted(processes.items()):
        fd_dir = os.path.join(proc, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)[:MAX_FDS]
        except OSError:
            continue
        for fd in fds:
            link = os.path.join(fd_dir, fd)
            # readlink asks no file system's server; a stat of a VM's disk image on a dead NFS server
            # would wait: only an fd whose path is a /dev/vfio node is stat'ed (its identity decides).
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if not target.startswith(os.path.join(dev_root, "vfio") + "/"):
                continue
            group = groups.get(_identity(link) or (-1, -1))
            if group is not None:
                held.setdefault(group, (pid, vm))
    return held


def given_to_vms(sys_root: str = "/sys", dev_root: str = "/dev", proc: str = "/proc", mounts: t.Iterable[str] | None = None,
                 systemctl: Systemctl | None = None) -> list[GivenToVm]:
    """The NVIDIA GPUs bound to vfio-pci, then the vGPUs of NVIDIA GPUs, each with the VM that holds
    its IOMMU group."""
    devices = [(bus, group, None) for bus, group in passthrough_gpus(sys_root)] + list(vgpus(sys_root))
    if not devices:
        return []
    identities = {}
    for _bus, group, _mdev in devices:
        identity = _identity(os.path.join(dev_root, "vfio", group))
        if identity is not None:
            identities[identity] = group
    processes = vm_processes(_cgroups.cgroup_mounts() if mounts is None else mounts, systemctl) if identities else {}
    held = holder_of(identities, processes, proc, dev_root) if processes else {}
    return [{"bus": bus, "iommu_group": group, "vm": held[group][1] if group in held else None,
             "pid": held[group][0] if group in held else None, "mdev": mdev} for bus, group, mdev in devices]


def vms_of_gpu(given: t.Iterable[t.Mapping[str, t.Any]], bus: str | None) -> tuple[list[str], int]:
    """(the VMs holding vGPUs of the GPU at PCI address `bus`, in order, once each; how many of its
    vGPUs no VM systemd names holds); pure."""
    key = str(bus or "").lower()[-12:]
    mine = [entry for entry in given if entry.get("mdev") and str(entry.get("bus") or "").lower()[-12:] == key]
    named = list(dict.fromkeys(str(entry["vm"]) for entry in mine if entry.get("vm")))
    return named, sum(1 for entry in mine if not entry.get("vm"))
