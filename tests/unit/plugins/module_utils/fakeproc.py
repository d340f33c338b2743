# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A fake /proc in a temporary directory: the files _holders reads, written as the kernel
writes them (no test here)."""

from __future__ import annotations

import json
import os
import shutil

# Real per-process readings of a 2-GPU H200 node (driver 580.159.04): fd counts per device
# path, mapping counts and KiB per path, compute apps, memory.used (README beside it).
H200X2_PROC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "fixtures", "h200x2-proc", "maps_probe.json")


def h200x2_readings():
    with open(H200X2_PROC) as handle:
        return json.load(handle)


SESSION = "0::/user.slice/user-0.slice/session-1.scope\n"


USER_FLAGS = 0x00400100  # PF_RANDOMIZE | PF_FORKNOEXEC, as for a process forked by a shell
KTHREAD_FLAGS = 0x00208040  # PF_KTHREAD | PF_NOFREEZE | PF_WQ_WORKER, as for a kworker


def stat_line(pid, comm, state, ppid, start_time, flags=USER_FLAGS):
    # Fields 3..22 of proc(5) then a few more; field 9 is flags, field 22 is starttime.
    return (f"{pid:d} ({comm}) {state} {ppid:d} {pid:d} {pid:d} 34816 {pid:d} {flags:d} 1000 0 0 0 10 5 0 0 20 0 4 0 {start_time:d} "
            "123456789 4096 18446744073709551615\n")


def write_process(
    root,
    pid,
    comm="python3",
    state="S",
    ppid=1,
    start_time=1000,
    argv=("python3", "train.py"),
    uid=0,
    cgroup=SESSION,
    fds=(),
    maps=(),
    exe="/usr/bin/python3.12",
    kernel_thread=False,
    exe_owner=0,
    sig_ign=0,
    sig_cgt=0,
    nspid=None,
):
    """One /proc/<pid> directory. `fds` are device paths (one fd each; repeat a path for more);
    `maps` are device paths (one 4 KiB mapping) or (path, KiB) pairs; a few ordinary fds and
    mappings are always there, as in a real process. `exe` is a file of `exe_owner` under the
    tree's own file system root `<root>-fs` (see _holders._fs_root), so that /proc/PID/exe
    resolves to a real inode with an owner, as the kernel's does."""
    base = os.path.join(str(root), str(pid))
    if os.path.exists(base):
        shutil.rmtree(base)
    os.makedirs(os.path.join(base, "fd"))
    with open(os.path.join(base, "stat"), "w") as handle:
        handle.write(stat_line(pid, comm, state, ppid, start_time, KTHREAD_FLAGS if kernel_thread else USER_FLAGS))
    with open(os.path.join(base, "cmdline"), "wb") as handle:
        handle.write(b"".join(arg.encode("utf-8") + b"\0" for arg in argv))
    with open(os.path.join(base, "status"), "w") as handle:
        handle.write(
            f"Name:\t{comm[:15]}\nUmask:\t0022\nState:\t{state} (sleeping)\nTgid:\t{pid:d}\nPid:\t{pid:d}\nPPid:\t{ppid:d}\n"
            f"Uid:\t{uid:d}\t{uid:d}\t{uid:d}\t{uid:d}\nGid:\t0\t0\t0\t0\n"
            # As Linux 6.x writes them: NSpid from the reader's namespace down; the masks in hex.
            "NSpid:\t{}\n".format("\t".join(str(p) for p in (nspid or (pid,))))
            + f"SigQ:\t0/95681\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\nSigBlk:\t0000000000000000\n"
            f"SigIgn:\t{sig_ign:016x}\nSigCgt:\t{sig_cgt:016x}\n"
        )
    with open(os.path.join(base, "cgroup"), "w") as handle:
        handle.write(cgroup)
    lines = ["55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.12\n"]
    address = 0
    for number, mapping in enumerate(maps):
        device, kib = (mapping, 4) if isinstance(mapping, str) else mapping
        lines.append(f"7f{address:010x}-7f{address + kib * 1024:010x} rw-s 00000000 00:05 {1000 + number:d} {device}\n")
        address += kib * 1024 + 4096
    lines.append("7ffd4a1c2000-7ffd4a1e3000 rw-p 00000000 00:00 0 [stack]\n")
    with open(os.path.join(base, "maps"), "w") as handle:
        handle.writelines(lines)
    ordinary = ["/dev/null", "pipe:[43125]", "socket:[43126]"]
    for number, target in enumerate(ordinary + list(fds)):
        os.symlink(target, os.path.join(base, "fd", str(number)))
    if exe:
        os.symlink(executable(root, exe, exe_owner), os.path.join(base, "exe"))
    return base


def executable(root, path, owner=0):
    """The file `path` (e.g. /usr/bin/Xorg) under the fake tree's file system root, owned by `owner`."""
    real = str(root).rstrip("/") + "-fs" + path
    os.makedirs(os.path.dirname(real), exist_ok=True)
    if not os.path.exists(real):
        with open(real, "w") as handle:
            handle.write("#!/bin/sh\n")
        os.chmod(real, 0o755)
    if os.stat(real).st_uid != owner:
        os.chown(real, owner, owner)
    return real


def remove_process(root, pid):
    shutil.rmtree(os.path.join(str(root), str(pid)), ignore_errors=True)


def expand(reading):
    """One process of maps_probe.json -> (fds, maps) for write_process: each fd path repeated
    its count, each mapped path split into its count of mappings with its total KiB."""
    fds = [path for path, count in sorted(reading["fds"].items()) for _copy in range(count)]
    maps = []
    for path, count in sorted(reading.get("maps", {}).items()):
        total = reading["map_kib"][path]
        sizes = [total // count] * count
        sizes[0] += total - sum(sizes)
        maps.extend((path, size) for size in sizes)
    return fds, maps


def _node(reading, source, node):
    """(fds, maps) of one GPU node, shaped as `source` is in `reading`."""
    fds = [node] * reading["fds"].get(source, 0)
    count = reading["maps"].get(source, 0)
    if not count:
        return fds, []
    return fds, expand({"fds": {}, "maps": {node: count}, "map_kib": {node: reading["map_kib"][source]}})[1]


def cuda_process(context_minor, minors, visible=None):
    """(fds, maps) of a CUDA process with its context on `context_minor` (one minor or several)
    on a node whose GPUs have `minors`, as measured on the H200 pair: each context GPU's node as GPU 0's in the
    `two_holders` reading, every other node as GPU 1's there; with `visible` (the minors that
    CUDA_VISIBLE_DEVICES leaves), the hidden ones as in `cvd0_holder` (open, never mapped)."""
    readings = h200x2_readings()
    own = readings["two_holders"]["gpu0_holder"]
    hidden = readings["cvd0_holder"]["holder"]
    contexts = {context_minor} if isinstance(context_minor, int) else set(context_minor)
    fds, maps = expand({"fds": {p: n for p, n in own["fds"].items() if not p[-1].isdigit() or "caps" in p},
                        "maps": {p: n for p, n in own["maps"].items() if not p[-1].isdigit()},
                        "map_kib": own["map_kib"]})
    for minor in minors:
        node = f"/dev/nvidia{minor:d}"
        if minor in contexts:
            node_fds, node_maps = _node(own, "/dev/nvidia0", node)
        elif visible is not None and minor not in visible:
            node_fds, node_maps = _node(hidden, "/dev/nvidia1", node)
        else:
            node_fds, node_maps = _node(own, "/dev/nvidia1", node)
        fds.extend(node_fds)
        maps.extend(node_maps)
    return tuple(fds), tuple(maps)


def nvml_client(minors, kind="dmon"):
    """(fds, maps) of an NVML client as measured (`monitors`: nvidia-smi dmon or a pynvml loop),
    its GPU-1 pattern repeated for every GPU after the first."""
    reading = h200x2_readings()["monitors"][kind]
    fds = [path for path, count in sorted(reading["fds"].items()) if not path[-1].isdigit() or "caps" in path for _copy in range(count)]
    for number, minor in enumerate(minors):
        source = "/dev/nvidia0" if number == 0 else "/dev/nvidia1"
        fds.extend([f"/dev/nvidia{minor:d}"] * reading["fds"][source])
    return tuple(fds), tuple(expand({"fds": {}, "maps": reading["maps"], "map_kib": reading["map_kib"]})[1])


def cuda_fds(minor):
    """A process that opened one GPU's node and the control nodes and mapped nothing (the shape
    of processes before the multi-GPU readings; today: an unplaceable process)."""
    return (f"/dev/nvidia{minor:d}", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


CUDA_MAPS = ("/dev/nvidiactl", "/dev/nvidia-uvm")
