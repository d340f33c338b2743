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
import re
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
    """A device file itself (not a link to one), as the kernel or root made it."""
    try:
        return stat.S_ISCHR(os.lstat(path).st_mode)
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


# --- Remote importers: IMEX channels (multi-node NVLink domains) ---------------------------------
#
# On a node of a multi-node NVLink domain (GB200 NVL72 and the like) a process may export GPU memory
# that a process on another node imports through an IMEX channel; the importer keeps it alive after
# the exporter exits (openucx/ucx#11753), so this node's GPU holds memory that no process here
# explains, and a reset here is the wrong cure. The channels are device files the administrator (or
# nvidia-imex) creates in /dev/nvidia-caps-imex-channels/ (NVIDIA's IMEX guide, "IMEX Channels"):
# root's, in the node's /dev. The domain's nodes are listed in nvidia-imex's nodes_config.cfg,
# quoted only from a root-owned file that no one else may write.

IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"
IMEX_NODES_CONFIG = "/etc/nvidia-imex/nodes_config.cfg"
# The most node addresses quoted in a message; nvidia-imex-ctl lists them all.
NODES_QUOTED = 4
_NODE_TOKEN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}$")


class ImexDomain(t.NamedTuple):
    """This node's IMEX channels (their names) and the domain's nodes as root's config lists them."""

    channels: tuple[str, ...]
    nodes: tuple[str, ...] = ()
    nodes_total: int = 0


def imex_channels(directory: str = IMEX_CHANNELS) -> tuple[str, ...]:
    """The channel device files (`channelN`, character devices) of a root-owned channel directory."""
    try:
        if os.lstat(directory).st_uid != 0:
            return ()
        names = sorted(os.listdir(directory))
    except OSError:
        return ()
    return tuple(name for name in names if re.match(r"^channel\d+$", name) and is_char_device(os.path.join(directory, name)))


def root_config_lines(path: str, limit: int = 65536) -> list[str] | None:
    """A config file's lines where root alone can have written it (a regular file, owned by root,
    writable by no one else, not a link); None otherwise. Read at most `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            return None
        return os.read(fd, limit).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    finally:
        os.close(fd)


def imex_nodes(lines: t.Iterable[str] | None) -> list[str]:
    """The node addresses of nodes_config.cfg (one IP or host name a line, `#` comments); pure.
    A line that is no address is left out, so nothing else of the file is ever quoted."""
    nodes = []
    for line in lines or []:
        token = line.split("#", 1)[0].strip()
        if token and _NODE_TOKEN.match(token):
            nodes.append(token)
    return nodes


def imex_domain(directory: str = IMEX_CHANNELS, nodes_config: str = IMEX_NODES_CONFIG) -> ImexDomain | None:
    """This node's IMEX domain, or None without a channel. Read only for a failure (the reset advice's node)."""
    channels = imex_channels(directory)
    if not channels:
        return None
    nodes = imex_nodes(root_config_lines(nodes_config))
    return ImexDomain(channels, tuple(nodes[:NODES_QUOTED]), len(nodes))


def pinned_elsewhere(gpu: Gpu, domain: ImexDomain, dead_pids: t.Sequence[int] = (), inside: bool = False) -> str:
    """The words for a GPU whose memory no process of this node holds, on a node with IMEX
    channels; pure. Follows `GPU 3 (GPU-...) reads 4096 MiB`. `inside`: the run is in a container,
    which sees neither the host's processes nor other guests': they are named as possible holders
    too, and no reset is advised either (the host's operator decides, gpu_facts there names them)."""
    here = "this container" if inside else "this node"
    outside = (", or by a process of the host or of another container sharing it, which this container cannot see (zeromib.gpu.gpu_facts on "
               "the host names it)") if inside else ""
    charged = " (nvidia-smi charges it to exited pid {})".format(", ".join(str(p) for p in dead_pids)) if dead_pids else ""
    if domain.nodes:
        more = f" and {domain.nodes_total - len(domain.nodes):d} more" if domain.nodes_total > len(domain.nodes) else ""
        where = "the other nodes of the domain ({}{}, from {})".format(", ".join(domain.nodes), more, IMEX_NODES_CONFIG)
    else:
        where = "the other nodes of the domain"
    return (f", and no process of {here} holds it{charged}: this node has IMEX channels ({IMEX_CHANNELS}/{domain.channels[0]}), so the "
            "memory is possibly pinned from another node of the NVLink domain, by a process there that imported it and keeps it until it "
            f"exits{outside}; `nvidia-imex-ctl -N -H` lists the domain's nodes: run zeromib.gpu.gpu_facts on {where} to name the importer and "
            "gpu_release there to free it, and no reset here (the importer would keep the memory)")


def short_note(domain: ImexDomain | None) -> str:
    """What follows "no process holds it" in a Slurm hook's short cause on a node with IMEX channels; pure."""
    if domain is None:
        return ""
    return " here: possibly pinned from another node of the NVLink domain (IMEX channels; nvidia-imex-ctl -N -H lists them: run gpu_facts there)"


# --- GPUs and VMs: passthrough and vGPU guests, vGPU hosts ---------------------------------------
#
# `nvidia-smi -q` says per GPU "GPU Virtualization Mode / Virtualization Mode": None (bare metal),
# Pass-Through (a VM given the whole GPU: the lent H100 and H200 VMs read so,
# tests/fixtures/nvidia-smi/h200-580.159.04-q-2026-12-01/q.txt), VGPU (a VM given a vGPU), Host VGPU
# (the hypervisor sharing the GPU as vGPUs; NVIDIA's vGPU guide), Host VSGA. The driver's word, read
# only for a failure that would otherwise advise a reset. Inside a guest the physical GPU is the
# hypervisor's: no reset steps are given there. On a vGPU host the framebuffer of each VM's vGPU is
# reserved with no compute app (canonical/lxd#12128): given to a VM, never leaked.

HOST_VGPU = "Host VGPU"
_GPU_HEADER = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")
_VIRT_MODE = re.compile(r"^\s+Virtualization Mode\s+:\s*(.+?)\s*$")


def virtualization_modes(q_text: str) -> dict[str, str]:
    """{bus id, lower case, 8-digit domain: mode} from `nvidia-smi -q` text; pure."""
    modes: dict[str, str] = {}
    bus = None
    for line in q_text.splitlines():
        header = _GPU_HEADER.match(line)
        if header:
            bus = header.group(1).lower().rjust(16, "0")
            continue
        mode = _VIRT_MODE.match(line)
        if mode and bus is not None and bus not in modes:
            modes[bus] = mode.group(1)
    return modes


def read_virtualization(run_smi: t.Callable[[list[str]], str], gpus: t.Sequence[Gpu]) -> dict[int, str]:
    """{GPU index: Virtualization Mode} of the GPUs whose mode is not None, from one `nvidia-smi -q`
    (`run_smi(args) -> stdout`); {} where nvidia-smi does not answer or has no such line."""
    try:
        modes = virtualization_modes(run_smi(["-q"]))
    except NvidiaSmiError:
        return {}
    found = {}
    for gpu in gpus:
        mode = modes.get(str(gpu.get("pci_bus_id") or "").lower().rjust(16, "0"))
        if mode and mode not in ("None", "N/A"):
            found[int(gpu["index"])] = mode
    return found


def guest_advice(gpu: Gpu, mode: str | None) -> str | None:
    """What frees a GPU's memory inside a VM (instead of reset steps); None elsewhere. Pure."""
    if mode == "Pass-Through":
        return (f"this node is a VM given GPU {gpu['index']} by passthrough (nvidia-smi -q: Virtualization Mode Pass-Through), so a GPU reset "
                "is the hypervisor's, not this VM's: reboot this VM (its hypervisor resets a passed-through GPU when it starts the VM again), "
                "or ask the hypervisor's operator")
    if mode == "VGPU":
        return (f"this node is a VM given a vGPU (nvidia-smi -q: Virtualization Mode VGPU), so GPU {gpu['index']} is a share of a GPU of "
                "the host, which no reset from here may touch: reboot this VM (its vGPU's memory goes back to the host), or ask the host's "
                "operator")
    return None


def given_to_vms(gpu: Gpu, vms: tuple[list[str], int] = ([], 0)) -> str:
    """The words for memory no process holds on a vGPU host's GPU (after `GPU 3 (GPU-...) reads N MiB`);
    `vms`: the VMs holding its vGPUs and how many of them no VM holds (_vfio.vms_of_gpu). Pure."""
    return (f", and no process of this host holds it: GPU {gpu['index']} is shared as vGPUs with VMs (nvidia-smi -q: Virtualization Mode "
            f"Host VGPU), and memory no process here holds is the framebuffer reserved for the vGPUs given to VMs{vgpu_holders(vms)}, not a "
            "leak: `nvidia-smi vgpu` lists them; shut those VMs down (or remove their vGPUs) to free it, never with a GPU reset while they run")


def vgpu_holders(vms: tuple[list[str], int]) -> str:
    """` (its vGPUs are held by train-vm (libvirt), Proxmox VM 101; 1 by no VM systemd names)`, ""
    when none is known; pure."""
    named, unnamed = vms
    parts = [f"held by {', '.join(named[:5])}{' and more' if len(named) > 5 else ''}"] if named else []
    if unnamed:
        parts.append(f"{unnamed:d} by no VM systemd names" if named else f"held by no VM systemd names ({unnamed:d})")
    return f" (its vGPUs are {'; '.join(parts)})" if parts else ""


def short_vgpu(vms: tuple[list[str], int]) -> str:
    """What follows "no process holds it" in a Slurm hook's short cause on a vGPU host's GPU; pure."""
    named, _unnamed = vms
    return " here: vGPUs given to VMs" + (f" ({', '.join(named[:3])}{', ...' if len(named) > 3 else ''})" if named else "") + ", no reset"
