# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Reset advice that works on this node: when only a GPU reset or a reboot frees a GPU, what would
refuse a bare `nvidia-smi --gpu-reset -i N` here, and the exact sequence that gets past it, or
"reboot" where no reset can. Pure: it reads what the look already has (the GPUs, the holders, Fabric
Manager's record) and two small facts of the node the callers read (read_nvidia_drm,
nvswitch_present). No module resets a GPU.

What refuses a reset (each seen on real nodes):
- persistence mode: "The following GPUs could not be reset: GPU 00000000:1A:00.0: In use by
  another client" until `nvidia-smi -pm 0 -i <gpu>`, after which the same reset succeeds
  (NVIDIA/NVSentinel#1690, #1692); nvidia-persistenced then lets go of that GPU's node (it held
  /dev/nvidia1 before, not after, in a public write-up of an H100 reset), so one `-pm 0` covers the
  mode and the daemon, and `-pm 1` puts both back;
- any process with the GPU's node open: nvidia-persistenced (NVIDIA/gpu-operator#118: "GPU ... is
  currently in use by another process ... (e.g., Fabric Manager, CUDA application, graphics
  application such as an X server, or a monitoring application such as another instance of
  nvidia-smi)"), DCGM's nv-hostengine, dcgm-exporter and the GPU Operator's pods, Xorg;
- nvidia_drm loaded: "In use by another client" for every GPU until `rmmod nvidia_drm`
  (NVIDIA/mig-parted#181); while a console or display server uses it (its use count,
  /sys/module/nvidia_drm/refcnt), it cannot be unloaded, and only a reboot frees the GPU;
- the NVSwitch reset scope (nvidia-smi(1), --gpu-reset): on NVSwitch systems an Ampere or later GPU
  can be reset alone while Fabric Manager runs; without it, or before Ampere, every GPU with NVLink
  connections to it must be reset in the same command.

From inside a container (a PID namespace of its own) the GPU may be held by the host or another
guest, which the container cannot see; the advice is then what the host's operator runs if nothing
there holds it either. It is given only where the container reads the host's own facts: the
kernel's modules (/sys/module/nvidia, there whenever the driver is loaded: sysfs' modules are the
kernel's, no namespace's, so nvidia_drm's absence there is the host's) and the GPUs' persistence mode
(NVML's, the same from anywhere). Processes of the host that hold a GPU's node, and the host's
Fabric Manager, are not seen from inside: the advice says so rather than guess.
"""

from __future__ import annotations

import os
import re
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Gpu, Holder

# A daemon whose hold on a GPU's node is the persistence mode itself: `-pm 0` lets go of it.
PERSISTENCED = _protect.ProcessNames("nvidia-persistenced")
# Fabric Manager facilitates the reset of a GPU of an NVSwitch system (nvidia-smi(1)): never stopped for it.
FABRIC_MANAGER = _protect.ProcessNames("nv-fabricmanager", "nvidia-fabricmanager")
# A peer GPU reading more than this holds memory of someone (MIG's idle baseline is 50-59 MiB: gpu_release's BASELINE_MAX_MIB).
IDLE_MIB = 64
# GPUs before Ampere on NVSwitch baseboards (DGX-2/HGX-2: V100) reset only with all their NVLink peers.
_PRE_AMPERE = re.compile(r"\b(?:V100|P100|Tesla V|Tesla P)", re.IGNORECASE)


class Drm(t.NamedTuple):
    """nvidia_drm as the kernel shows it: its use count (a modeset console, a display server) and users."""

    users: int
    used_by: str


class Node(t.NamedTuple):
    """What the advice needs of the node beyond the GPU itself."""

    gpus: t.Sequence[Gpu] = ()
    holders: t.Sequence[Holder] = ()
    # _health.read_fabric_manager's record, None when not read (no fabric, health off).
    fabric_manager: dict[str, t.Any] | None = None
    # None: nvidia_drm not loaded (or /sys/module unreadable, said as not loaded).
    drm: Drm | None = None
    nvswitch: bool = False
    # This look ran in a container (_guests.pid_namespace_nested): the advice is the host's.
    inside: bool = False
    # The kernel's modules were readable (driver_module_seen): nvidia_drm's state is known.
    kernel_seen: bool = True
    # _node_shapes.imex_domain(): this node's IMEX channels, where memory no process here holds may be
    # another node's import (no reset advised then); None: no channel.
    imex: t.Any = None
    # _node_shapes.read_virtualization(): {GPU index: Virtualization Mode} where not None (VMs and
    # vGPU hosts: no reset steps there); None: not read.
    virtualization: t.Any = None
    # _vfio.given_to_vms(): the GPUs and vGPUs given to VMs, with the VMs that hold them ([]: none).
    given_to_vms: t.Sequence[t.Mapping[str, t.Any]] = ()


def driver_module_seen(sys_module: str = "/sys/module") -> bool:
    """Whether this look reads the kernel's own module state: /sys/module/nvidia is there whenever
    the driver is loaded, in a container too. Where it is missing (sysfs not mounted, or masked),
    whether nvidia_drm is loaded is unknown."""
    return os.path.isdir(os.path.join(sys_module, "nvidia"))


def read_nvidia_drm(sys_module: str = "/sys/module") -> Drm | None:
    """nvidia_drm's use count (/sys/module/nvidia_drm/refcnt, the count lsmod shows as "Used by")
    and who uses it (its holders/), or None when it is not loaded."""
    base = os.path.join(sys_module, "nvidia_drm")
    try:
        with open(os.path.join(base, "refcnt")) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    try:
        users = int(text)
    except ValueError:
        users = 1  # unreadable: it may be in use
    try:
        used_by = ",".join(sorted(os.listdir(os.path.join(base, "holders"))))
    except OSError:
        used_by = ""
    return Drm(users, used_by)


def nvswitch_present(dev: str = "/dev", proc_driver: str = "/proc/driver/nvidia-nvswitch/devices") -> bool:
    """Whether the node has an NVSwitch: the driver's nvswitch devices, or its /dev/nvidia-nvswitch<N>
    nodes. (A GPU's fabric state alone is no NVSwitch: an H200 VM reads Completed without one.)"""
    try:
        if os.listdir(proc_driver):
            return True
    except OSError:
        pass
    try:
        return any(re.match(r"^nvidia-nvswitch\d+$", name) for name in os.listdir(dev))
    except OSError:
        return False


class Plan(t.NamedTuple):
    """`reboot`: no reset can free the GPU here (`why`). Otherwise `steps` (shell commands, as root,
    in order; `gpus` are the GPUs the reset takes), `blockers` (what a bare reset would meet)."""

    reboot: bool
    why: str
    blockers: list[str]
    steps: list[str]
    gpus: list[int]
    verify: str
    # Steps that stop or start a process of this container (run there: its PIDs are not the host's).
    here: frozenset[str] = frozenset()


def _fm_running(fabric_manager: dict[str, t.Any] | None) -> bool | None:
    unit = (fabric_manager or {}).get("unit")
    if not unit or unit.get("load_state") != "loaded":
        return None
    return unit.get("active_state") == "active"


def reset_scope(gpu: Gpu, node: Node) -> tuple[list[int], str | None]:
    """(the GPUs one reset command must take, why more than this one, or None)."""
    if not node.nvswitch or not _health.has_fabric(gpu):
        return [gpu["index"]], None
    peers = sorted(g["index"] for g in node.gpus if _health.has_fabric(g)) or [gpu["index"]]
    if _PRE_AMPERE.search(str(gpu.get("name") or "")):
        return peers, "before Ampere, an NVSwitch GPU is reset only together with its NVLink peers"
    running = _fm_running(node.fabric_manager)
    if running:
        return [gpu["index"]], None
    said = "Fabric Manager is not running" if running is False else "Fabric Manager was not found running on this host"
    if running is None and node.inside:
        said = "Fabric Manager was not found running (a container asks its own systemd, not the host's)"
    return peers, f"{said}, and without it an NVSwitch GPU is reset only together with its NVLink peers"


def _holds_node(holder: Holder, minors: t.Collection[int]) -> bool:
    return any(_devices.gpu_minor(device) in minors for device in holder.get("devices") or [])


def _label(holder: Holder) -> str:
    where = holder.get("unit") or holder.get("pod") or holder.get("container_name") or (holder.get("container") or "")[:12]
    return "pid {} {}{}".format(holder["pid"], holder.get("name"), f" ({where})" if where else "")


def _stop_start(holder: Holder) -> tuple[str, str]:
    """How to stop a process that holds the GPU's node, and start it again."""
    unit = holder.get("unit") or ""
    if holder.get("pod"):
        return ("kubectl label node <this node> nvidia.com/gpu.deploy.operands=false (its pod {} leaves the node)".format(holder["pod"]),
                "kubectl label node <this node> nvidia.com/gpu.deploy.operands-")
    if holder.get("container"):
        runtime = holder.get("container_runtime") or "docker"
        name = holder.get("container_name") or str(holder["container"])[:12]
        return f"{runtime} stop {name}", f"{runtime} start {name}"
    if unit.endswith(".service") and holder.get("system_service"):
        return f"systemctl stop {unit}", f"systemctl start {unit}"
    return "kill {}".format(holder["pid"]), "start {} again as it was started".format(holder.get("name"))


def _merged(gpu: Gpu, looked: Gpu | None) -> Gpu:
    """A later reading of a GPU (gpu_release polls memory only) over the look's record of it (the
    fabric fields are read with health)."""
    record = t.cast("dict[str, t.Any]", dict(looked or {}))
    record.update((key, value) for key, value in gpu.items() if value is not None)
    return t.cast("Gpu", record)


def plan(gpu: Gpu, node: Node) -> Plan:
    """What frees this GPU where only a reset or a reboot can."""
    by_index = {g["index"]: g for g in node.gpus}
    gpu = _merged(gpu, by_index.get(gpu["index"]))
    by_index[gpu["index"]] = gpu
    gpus, wider = reset_scope(gpu, node)
    taken = [by_index.get(i, gpu) for i in gpus]
    minors = {g.get("minor_number", g["index"]) for g in taken}
    ids = ",".join(str(i) for i in gpus)
    verify = f"nvidia-smi -i {ids} --query-gpu=index,memory.used --format=csv,noheader"
    if node.drm is not None and node.drm.users > 0:
        users = f", used by {node.drm.used_by}" if node.drm.used_by else ""
        return Plan(True, f"nvidia_drm is loaded and in use ({node.drm.users:d} user(s){users}: a console or display server on an NVIDIA GPU), "
                          "and no GPU can be reset while it is", [], [], gpus, verify)
    others = [h for h in node.holders if not h.get("protected") and set(h.get("gpu_indexes") or []) & (set(gpus) - {gpu["index"]})]
    in_use = [_label(h) for h in others[:3]]
    if node.inside:
        # A peer's memory held by the host or another guest: no holder here, but in use all the same.
        held_here = {i for h in node.holders for i in h.get("gpu_indexes") or []}
        readings = {i: by_index[i].get("memory_used_mib") for i in gpus if i in by_index and i != gpu["index"] and i not in held_here}
        in_use += [f"GPU {i} reads {used} MiB with no holder in this container" for i, used in readings.items() if (used or 0) > IDLE_MIB]
    if wider and in_use:
        return Plan(True, "{}: GPU(s) {} are in use ({}); once they are free, the reset sequence can take them all".format(
            wider, ",".join(str(i) for i in sorted(set(gpus) - {gpu["index"]})), "; ".join(in_use)), [], [], gpus, verify)
    blockers: list[str] = []
    pm = [g["index"] for g in taken if str(g.get("persistence_mode") or "").lower() == "enabled"]
    if pm:
        blockers.append("persistence mode is on")
    stops: list[tuple[str, str]] = []
    fm_helps = bool(_fm_running(node.fabric_manager)) and node.nvswitch
    for holder in node.holders:
        if not _holds_node(holder, minors) or holder.get("state") in ("Z", "X"):
            continue
        if holder.get("protected") and PERSISTENCED.of(holder) and pm:
            continue  # `-pm 0` makes it let go of the GPU
        if holder.get("protected") and FABRIC_MANAGER.of(holder) and fm_helps:
            continue
        blockers.append(_label(holder) + " holds its device node" + ("" if holder.get("protected") else " (an NVML client)"))
        pair = _stop_start(holder)
        if pair not in stops:
            stops.append(pair)
    if node.drm is not None:
        blockers.append("nvidia_drm is loaded")
        stops.append(("modprobe -r nvidia_drm", "modprobe nvidia_drm"))
    pm_ids = ",".join(str(i) for i in pm)
    # Persistence off first and on last, around the services that may need it: the order of
    # NVIDIA/NVSentinel#1692 (restored on the way out) and of the public H100 write-up.
    steps = ([f"nvidia-smi -i {pm_ids} -pm 0"] if pm else []) + [stop for stop, _start in stops] + ["nvidia-smi --gpu-reset -i " + ids]
    steps += [start for _stop, start in reversed(stops)] + ([f"nvidia-smi -i {pm_ids} -pm 1"] if pm else [])
    here = frozenset(step for pair in stops[:len(stops) - (node.drm is not None)] for step in pair) if node.inside else frozenset()
    return Plan(False, wider or "", blockers, steps, gpus, verify, here)


# Said of the host's operator from inside a container: the advice holds only if the host has no holder either.
FROM_INSIDE = "if nothing on the host holds it either, "


def text(gpu: Gpu, node: Node) -> str:
    """The advice as the failure message says it (from inside a container: what the host's
    operator runs, the container's own steps marked)."""
    if node.virtualization:
        # Inside a VM the physical GPU is the hypervisor's: no reset steps (_node_shapes, issue 70).
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _node_shapes
        words = _node_shapes.guest_advice(gpu, node.virtualization.get(gpu["index"]))
        if words:
            return words
    if node.inside and not node.kernel_seen:
        return f"{FROM_INSIDE}gpu_release there says what frees it (this container cannot read the kernel's modules, /sys/module)"
    p = plan(gpu, node)
    if p.reboot:
        if node.inside:
            return f"{FROM_INSIDE}only a reboot of the host frees it: {p.why}"
        return f"only a reboot frees it on this node: {p.why}"
    ids = ",".join(str(i) for i in p.gpus)
    scope = f"; the reset must take GPUs {ids} together: {p.why}" if len(p.gpus) > 1 else ""
    blocked = "; a bare `nvidia-smi --gpu-reset -i {}` is refused on this node (\"In use by another client\"): {}".format(
        ids, ", ".join(p.blockers)) if p.blockers else ""
    steps = "; ".join("`{}`{}".format(s, " (in this container)" if s in p.here else "") for s in p.steps)
    if node.inside:
        return (f"{FROM_INSIDE}a GPU reset or a reboot of the host is needed{scope}{blocked}. To reset, as root on the host, in this order: "
                f"{steps}; then `{p.verify}` must read 0 MiB. A process of the host or of another guest with the GPU's device node open "
                "(DCGM's nv-hostengine, dcgm-exporter) refuses the reset as well and is not seen from here: zeromib.gpu.gpu_facts on the "
                "host names it")
    return f"a GPU reset or a reboot is needed{scope}{blocked}. To reset, as root, in this order: {steps}; then `{p.verify}` must read 0 MiB"
