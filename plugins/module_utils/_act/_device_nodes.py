# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The NVIDIA device nodes a restore needs, before it starts anything.

After a reboot or a driver reload, /dev/nvidia-uvm and /dev/nvidia-uvm-tools appear only when
something runs nvidia-modprobe, nvidia-persistenced or nvidia-smi; a GPU container or an LXC guest
restored before that fails to start ("lstat /dev/nvidia-uvm-tools: no such file or directory",
NVIDIA/nvidia-docker #288, canonical/lxd #5618). So gpu_restore checks that the control node, the
UVM nodes and every GPU's node the driver lists exist as character devices; creates the missing ones
with the driver's own helper (nvidia-modprobe -u -c=<minor>: the UVM module and its nodes, the
GPU's node and nvidiactl) where it is installed; and otherwise fails naming them, before anything
is restored.

Who else controls these paths: only root (a user cannot create nodes in /dev). A path that exists
but is no character device (a file someone left there) is "missing" too: nvidia-modprobe does not
replace it, so the restore stops naming it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands

CONTROL = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
MODPROBE_TIMEOUT_S = 10.0


def needed(minors: t.Iterable[int], dev: str = "/dev") -> list[str]:
    """The nodes the restored units, containers and guests need: the control and UVM nodes, and each
    GPU's /dev/nvidia<minor>."""
    base = [os.path.join(dev, os.path.basename(path)) for path in CONTROL]
    return base + [os.path.join(dev, f"nvidia{minor:d}") for minor in sorted(set(minors))]


def missing(paths: t.Iterable[str]) -> list[str]:
    """The paths that are not character devices (absent, or something else in their place)."""
    out = []
    for path in paths:
        try:
            if stat.S_ISCHR(os.lstat(path).st_mode):
                continue
        except OSError:
            pass
        out.append(path)
    return out


def modprobe_args(absent: t.Iterable[str], dev: str = "/dev") -> list[list[str]]:
    """nvidia-modprobe's arguments that create `absent`: -u for the UVM nodes, -c=<minor> for a GPU's
    node (it creates nvidiactl with it); -c=0 for nvidiactl alone."""
    calls: list[list[str]] = []
    names = [os.path.basename(path) for path in absent]
    uvm = any(name.startswith("nvidia-uvm") for name in names)
    minors = sorted(int(name[len("nvidia"):]) for name in names if name[len("nvidia"):].isdigit())
    if not minors and "nvidiactl" in names:
        minors = [0]
    for position, minor in enumerate(minors):
        calls.append((["-u"] if uvm and position == 0 else []) + [f"-c={minor:d}"])
    if uvm and not minors:
        calls.append(["-u", "-c=0"])
    return calls


def ensure(minors: t.Iterable[int], check_mode: bool, dev: str = "/dev", search_path: str | None = None,
           run: t.Callable[[list[str]], tuple[int, str]] | None = None) -> dict[str, t.Any]:
    """{needed, missing, created, helper, error}: the nodes checked, those absent at first, those the
    helper created (or would create, in check mode), and a sentence when some stay missing."""
    paths = needed(minors, dev)
    absent = missing(paths)
    report: dict[str, t.Any] = {"needed": paths, "missing": absent, "created": [], "helper": None, "error": None}
    if not absent:
        return report
    helper = _commands.which("nvidia-modprobe", search_path=search_path)
    report["helper"] = helper
    if helper is None:
        report["error"] = ("NVIDIA device node(s) {} missing and nvidia-modprobe is not installed: restored GPU containers and guests would fail "
                           "to start (lstat ...: no such file or directory); run nvidia-smi or load nvidia-uvm to create them").format(", ".join(absent))
        return report
    if check_mode:
        report["created"] = absent
        return report
    runner = run or _run
    said = []
    for args in modprobe_args(absent, dev):
        rc, text = runner([helper] + args)
        if rc != 0:
            said.append("{} {} (rc {}): {}".format(helper, " ".join(args), rc, text.strip()[:200] or "no output"))
    still = missing(absent)
    report["created"] = [path for path in absent if path not in still]
    if still:
        report["error"] = "NVIDIA device node(s) {} missing after {}{}".format(
            ", ".join(still), os.path.basename(helper), ": " + "; ".join(said) if said else " (it created none of them)")
    return report


def _run(argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_commands.c_locale_env(),
                              timeout=MODPROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return 124, f"did not answer within {MODPROBE_TIMEOUT_S:g} s"
    except OSError as exc:
        return 127, str(exc)
    return done.returncode, done.stdout.decode("utf-8", "replace")
