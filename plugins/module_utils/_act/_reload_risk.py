# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Which running GPU containers a `systemctl daemon-reload` would cut off their GPUs.

On cgroup v2, systemd enforces a unit's DevicePolicy=/DeviceAllow= with a BPF device program
on the unit's cgroup, and a reload attaches that program again on every unit (systemd 252 at
the reload, 257 at the next start of a unit in the same slice after it). A container
engine on the systemd cgroup driver (Docker's default on cgroup v2, containerd's and
Kubernetes' usual one) runs each container in a unit with DevicePolicy=strict and the devices
it knows of in DeviceAllow=; the NVIDIA runtime's hook grants /dev/nvidia* on top, outside
systemd's knowledge, and a reload takes that access away: the container's next NVML call fails
with "Failed to initialize NVML: Unknown Error" until it is recreated. A DeviceAllow= entry
systemd cannot resolve (`/dev/char/195:0` on a node without that link) is dropped the same way.
NVIDIA's fix: /dev/char links for the NVIDIA device nodes (`nvidia-ctk system
create-dev-char-symlinks --create-all`) and the GPUs passed to the container as devices.

`at_risk` reads, never runs anything in a container: each running unit's device policy
(`systemctl show`), the NVIDIA device nodes of the node and, by the same names, of the unit's
first process (`/proc/PID/root/dev/NAME`, lstat only), and what the unit's DeviceAllow=
resolves to now, as systemd would resolve it. A container's root owns its /dev: it may lie,
which can only name it at risk; a /dev that is not a memory file system (a FUSE mount whose
daemon stops answering would hold the lstat) is not read, and the unit counts as at risk.
"""

from __future__ import annotations

import fnmatch
import os
import stat
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mounts

if t.TYPE_CHECKING:
    Systemctl = t.Callable[[t.List[str]], t.Tuple[int, str, str]]

FIX = "nvidia-ctk system create-dev-char-symlinks --create-all"
# What DevicePolicy=closed (and auto with DeviceAllow=) allows besides DeviceAllow= (systemd.resource-control(5)).
CLOSED_DEFAULTS = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx")
# Bounds: a node with thousands of units or a cgroup tree without end is read this far, no further.
MAX_CGROUPS_PER_UNIT = 64
# A container's /dev is read only on these (what engines mount there): nothing in them waits on a server.
MEMORY_FS = ("tmpfs", "devtmpfs", "ramfs")


class Risk(t.NamedTuple):
    unit: str
    pid: int
    devices: list[str]


def nvidia_nodes(dev: str = "/dev") -> dict[str, int]:
    """{path under dev: device number} of the node's NVIDIA character devices."""
    found = {}
    for folder in (dev, os.path.join(dev, "nvidia-caps")):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for entry in names:
            path = os.path.join(folder, entry)
            if not entry.startswith("nvidia"):
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode):
                found[os.path.relpath(path, dev)] = st.st_rdev
    return found


def char_majors(proc: str = "/proc") -> dict[str, int]:
    """{driver name: major} of the character devices in /proc/devices."""
    majors: dict[str, int] = {}
    try:
        with open(os.path.join(proc, "devices"), encoding="utf-8", errors="replace") as handle:
            text = handle.read(65536)
    except OSError:
        return majors
    section = ""
    for line in text.splitlines():
        if line.endswith(":"):
            section = line
            continue
        fields = line.split()
        if section.startswith("Character") and len(fields) == 2 and fields[0].isdigit():
            majors[fields[1]] = int(fields[0])
    return majors


def allowed(policy: str, entries: t.Iterable[str], majors: t.Mapping[str, int],
            resolve: t.Callable[[str], int | None]) -> tuple[set[int], set[int]] | None:
    """What systemd's device program for this unit lets through: (device numbers, whole majors),
    or None when systemd attaches no device program (policy auto and no DeviceAllow=)."""
    entries = [e for e in entries if e]
    if policy not in ("strict", "closed") and not entries:
        return None
    devices: set[int] = set()
    whole: set[int] = set()
    paths = [e.split()[0] for e in entries]
    if policy != "strict":
        paths += list(CLOSED_DEFAULTS)
    for path in paths:
        if path.startswith("char-"):
            whole |= {major for name, major in majors.items() if fnmatch.fnmatchcase(name, path[len("char-"):])}
        elif path.startswith("/dev/"):
            number = resolve(path)  # systemd drops an entry it cannot stat: so does this
            if number is not None:
                devices.add(number)
    return devices, whole


def _gpus_first(path: str) -> tuple[int, int, str]:
    """nvidia0, nvidia1, ..., nvidia10, then nvidiactl, then the rest (uvm, caps)."""
    number = path[len("nvidia"):]
    if number.isdigit():
        return 0, int(number), path
    return (1 if path == "nvidiactl" else 2), 0, path


def uncovered(nodes: t.Mapping[str, int], grant: tuple[set[int], set[int]]) -> list[str]:
    """The NODES (path under /dev: device number) that GRANT does not let through, GPUs first."""
    devices, whole = grant
    return sorted((path for path, number in nodes.items() if number not in devices and os.major(number) not in whole), key=_gpus_first)


def parse_units(text: str) -> list[dict[str, t.Any]]:
    """`systemctl show -p Id,ControlGroup,DevicePolicy,DeviceAllow` of many units (one
    DeviceAllow= line per entry) -> [{Id, ControlGroup, DevicePolicy, DeviceAllow: [...]}]."""
    units: list[dict[str, t.Any]] = []
    current: dict[str, t.Any] = {"DeviceAllow": []}
    for line in text.splitlines() + [""]:
        if not line.strip():
            if current.get("Id"):
                units.append(current)
            current = {"DeviceAllow": []}
            continue
        key, _sep, value = line.partition("=")
        if key == "DeviceAllow":
            current["DeviceAllow"] += [value] if value else []
        else:
            current[key] = value
    return units


def first_pid(cgroup: str) -> int | None:
    """The first process in CGROUP or below it (bounded)."""
    for count, (folder, _dirs, _files) in enumerate(os.walk(cgroup)):
        if count >= MAX_CGROUPS_PER_UNIT:
            return None
        try:
            with open(os.path.join(folder, "cgroup.procs"), encoding="ascii", errors="replace") as handle:
                for line in handle:
                    if line.strip().isdigit():
                        return int(line)
        except OSError:
            continue
    return None


def container_nodes(proc: str, pid: int, names: t.Iterable[str]) -> dict[str, int] | str:
    """{name: device number} of the node's NVIDIA device NAMES as PID's /dev has them (lstat by
    name, never a listing), or why its /dev is not read."""
    try:
        with open(os.path.join(proc, str(pid), "mountinfo"), "rb") as handle:
            fstype = _mounts.MountTable(handle.read(1 << 20)).fstype("/dev/nvidiactl")
    except OSError:
        return "its mounts cannot be read"
    if fstype not in MEMORY_FS:
        return f"its /dev is on {fstype or 'no file system it lists'}, not read"
    found = {}
    for name in names:
        try:
            st = os.lstat(os.path.join(proc, str(pid), "root", "dev", name))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            found[name] = st.st_rdev
    return found


def _resolver(root: str) -> t.Callable[[str], int | None]:
    def resolve(path: str) -> int | None:
        try:
            st = os.stat(root + path)
        except OSError:
            return None
        return st.st_rdev if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else None
    return resolve


def at_risk(systemctl: Systemctl, cgroup_root: str = "/sys/fs/cgroup", proc: str = "/proc", root: str = "") -> list[Risk]:
    """The running units a daemon-reload would cut off NVIDIA devices their processes see.
    `root` prefixes the node's own paths (/dev, for a test's simulated node)."""
    if not os.path.exists(os.path.join(cgroup_root, "cgroup.controllers")):
        return []  # cgroup v1: no device programs to attach again
    host_nodes = nvidia_nodes(root + "/dev")
    if not host_nodes:
        return []
    rc, out, _err = systemctl(["list-units", "--type=service,scope", "--state=running", "--plain", "--no-legend", "--no-pager"])
    names = [line.split()[0] for line in out.splitlines() if line.split()] if rc == 0 else []
    if not names:
        return []
    rc, out, _err = systemctl(["show", "--property=Id,ControlGroup,DevicePolicy,DeviceAllow", "--no-pager"] + names)
    if rc != 0:
        return []
    majors = char_majors(proc)
    resolve = _resolver(root)
    risks = []
    for unit in parse_units(out):
        grant = allowed(unit.get("DevicePolicy") or "auto", unit["DeviceAllow"], majors, resolve)
        if grant is None or not unit.get("ControlGroup"):
            continue
        pid = first_pid(cgroup_root + unit["ControlGroup"])
        if pid is None:
            continue
        seen = container_nodes(proc, pid, host_nodes)
        if isinstance(seen, str):
            risks.append(Risk(unit["Id"], pid, [seen]))
            continue
        lost = uncovered(seen, grant)
        if lost:
            risks.append(Risk(unit["Id"], pid, ["/dev/" + p for p in lost]))
    return risks


def describe(risks: t.Sequence[Risk]) -> str:
    """`box.service (pid 412: /dev/nvidia0, /dev/nvidiactl), ...`"""
    return ", ".join("{} (pid {}: {})".format(r.unit, r.pid, ", ".join(r.devices[:4]) + (", ..." if len(r.devices) > 4 else "")) for r in risks)
