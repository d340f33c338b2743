# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""A fake /proc in a temporary directory: the files _holders reads, written as the kernel
writes them (no test here)."""

from __future__ import annotations

import os
import shutil

SESSION = "0::/user.slice/user-0.slice/session-1.scope\n"


USER_FLAGS = 0x00400100  # PF_RANDOMIZE | PF_FORKNOEXEC, as for a process forked by a shell
KTHREAD_FLAGS = 0x00208040  # PF_KTHREAD | PF_NOFREEZE | PF_WQ_WORKER, as for a kworker


def stat_line(pid, comm, state, ppid, start_time, flags=USER_FLAGS):
    # Fields 3..22 of proc(5) then a few more; field 9 is flags, field 22 is starttime.
    return "%d (%s) %s %d %d %d 34816 %d %d 1000 0 0 0 10 5 0 0 20 0 4 0 %d 123456789 4096 18446744073709551615\n" % (
        pid,
        comm,
        state,
        ppid,
        pid,
        pid,
        pid,
        flags,
        start_time,
    )


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
):
    """One /proc/<pid> directory. `fds` and `maps` are device paths; a few ordinary fds and
    mappings are always there, as in a real process."""
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
            "Name:\t%s\nUmask:\t0022\nState:\t%s (sleeping)\nTgid:\t%d\nPid:\t%d\nPPid:\t%d\nUid:\t%d\t%d\t%d\t%d\nGid:\t0\t0\t0\t0\n"
            % (comm[:15], state, pid, pid, ppid, uid, uid, uid, uid)
        )
    with open(os.path.join(base, "cgroup"), "w") as handle:
        handle.write(cgroup)
    lines = ["55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 131 /usr/bin/python3.12\n"]
    for number, device in enumerate(maps):
        lines.append("7f%010x-7f%010x rw-s 00000000 00:05 %d %s\n" % (number * 4096, number * 4096 + 4096, 1000 + number, device))
    lines.append("7ffd4a1c2000-7ffd4a1e3000 rw-p 00000000 00:00 0 [stack]\n")
    with open(os.path.join(base, "maps"), "w") as handle:
        handle.writelines(lines)
    ordinary = ["/dev/null", "pipe:[43125]", "socket:[43126]"]
    for number, target in enumerate(ordinary + list(fds)):
        os.symlink(target, os.path.join(base, "fd", str(number)))
    if exe:
        os.symlink(exe, os.path.join(base, "exe"))
    return base


def remove_process(root, pid):
    shutil.rmtree(os.path.join(str(root), str(pid)), ignore_errors=True)


def cuda_fds(minor):
    """What a CUDA process holds: its GPU node, the control node, UVM and a caps node."""
    return ("/dev/nvidia%d" % minor, "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


CUDA_MAPS = ("/dev/nvidiactl", "/dev/nvidia-uvm")
