# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""How the host asks a system container's systemd: only as the guest itself would run the
command, never with the host's privileges (issue 65).

Everything in a guest is its root's: its `systemctl` is a file the guest's root writes, its /proc
may be a tmpfs with FIFOs, its systemd says what it likes. So the host runs a guest's command
only confined as the guest is, and reads nothing through the guest's mount namespace:

- through the guest manager's own tool where the host has it (`pct exec ID --`, `lxc-attach -n
  NAME --`, `lxc exec NAME --`, `incus exec NAME --`): they put the command in the guest's
  cgroup, bounding set, seccomp filter, LSM profile and user namespace; for a machine that
  machined registered (`systemctl -M NAME`), the host's own systemctl asks the guest's systemd
  over the guest's bus, and nothing of the guest is executed at all;
- else joined to what confines the guest's init, read in the host's /proc: its cgroup (v2), its
  capability bounding set, no_new_privs, and all its namespaces (its user namespace too) by
  util-linux nsenter, which is itself started with the guest's bounding set: from the moment the
  chain can be seen from the guest, it holds no capability the guest's root lacks;
- refused, before anything is done, where that cannot be reproduced: the init runs under a
  seccomp filter or an LSM label other than this process's, or the node has no cgroup v2. The
  message names the command to run with the guest's manager.

The guest's answers are bounded in time and size. A unit's MainPID is the guest's number: it is
translated to the host's PID through NSpid, among the processes of the guest's own PID namespace
(the host's /proc), and a number with no such process reads 0 (no main process), so nothing is
read under /proc/INIT/root.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import signal
import subprocess
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders

# prctl(2) options (include/uapi/linux/prctl.h).
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# The most a guest's answer may print (a `list-unit-files` of thousands of units is well below).
OUTPUT_LIMIT = 8 * 1024 * 1024
# The environment of what runs in a guest: nothing of the host's (Ansible's variables, proxies).
GUEST_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C", "LANG": "C",
             "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"}
# Where machined records the machines it knows (LEADER=, CLASS=): what `systemctl -M` itself reads.
MACHINES_DIR = "/run/systemd/machines"
# How long the guest's MainPIDs are looked for among its processes (a guest of thousands takes milliseconds).
TRANSLATE_S = 5.0
# rc of a call the host refuses to make (the reason is its stderr).
REFUSED_RC = 126
_MAIN_PID = re.compile(r"^MainPID=(\d+)$", re.MULTILINE)


class Init(t.NamedTuple):
    """What confines a guest's init, read in the host's /proc: its PIDs from the host's namespace
    down to its own (NSpid), CapBnd, Seccomp mode, cgroup v2 path, LSM label."""

    pid: int
    nspid: tuple[int, ...]
    cap_bnd: int
    cap_inh: int
    seccomp: int
    # Seccomp_filters (Linux 5.9+): how many filters it runs under; -1 where the kernel does not say.
    seccomp_filters: int
    cgroup: str | None
    lsm: str | None


def status_of(pid: int, proc: str = "/proc") -> dict[str, str]:
    """/proc/PID/status of the host's /proc through the one reader (_holders.read_status: split at
    "\\n" only, since a guest names its processes at will), under _bounded_reads' budget; {} when
    it fails or does not answer."""
    try:
        return _bounded_reads.call(_holders.read_status, pid, proc)
    except (OSError, _bounded_reads.ReadBlocked):
        return {}


def _read_small(path: str, limit: int = 65536) -> bytes:
    """A kernel file of the host's /proc (status, cgroup, attr/current), opened without
    following a link, at most `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _bounded(path: str) -> bytes | None:
    """_read_small under _bounded_reads' budget; None when it fails or does not answer."""
    try:
        return _bounded_reads.call(_read_small, path)
    except (OSError, _bounded_reads.ReadBlocked):
        return None


def lsm_label(pid: int | str, proc: str = "/proc") -> str | None:
    """The LSM label of a process (AppArmor profile, SELinux context), or None without an LSM."""
    raw = _bounded(f"{proc}/{pid}/attr/current")
    if raw is None:
        return None
    return raw.replace(b"\0", b"").strip().decode("utf-8", "replace") or None


def read_init(pid: int, proc: str = "/proc") -> Init | None:
    """The guest init's confinement from the host's /proc, or None when it cannot be read."""
    fields = status_of(pid, proc)
    cgroup = _bounded(f"{proc}/{pid:d}/cgroup")
    if not fields or cgroup is None:
        return None
    try:
        nspid = tuple(int(word) for word in fields.get("NSpid", "").split())
        cap_bnd = int(fields["CapBnd"], 16)
        cap_inh = int(fields.get("CapInh", "0"), 16)
        seccomp = int(fields.get("Seccomp", "0"))
        filters = int(fields.get("Seccomp_filters", "-1"))
    except (KeyError, ValueError):
        return None
    unified = None
    for line in cgroup.split(b"\n"):
        if line.startswith(b"0::"):
            unified = line[3:].decode("utf-8", "replace")
    return Init(pid, nspid, cap_bnd, cap_inh, seccomp, filters, unified if unified and unified != "/" else None, lsm_label(pid, proc))


# ---------------------------------------------------------------- the guest manager's tools


def _registered(name: str, init_pid: int, machines_dir: str) -> bool:
    """Whether machined knows the machine NAME with this init as its leader."""
    try:
        raw = _read_small(os.path.join(machines_dir, name))
    except OSError:
        return False
    fields = dict(line.partition("=")[::2] for line in raw.decode("utf-8", "replace").split("\n"))
    return fields.get("LEADER") == str(init_pid)


def tool_prefix(guest: t.Mapping[str, t.Any], tools: t.Mapping[str, str], machines_dir: str = MACHINES_DIR) -> list[str] | None:
    """The argv that runs the guest's systemctl through its manager's tool on this host (the
    command follows), or None where the host has none that reaches this guest. For a machine
    machined registered: the host's own systemctl over the guest's bus, `systemctl -M NAME`."""
    kind, name = guest.get("kind"), str(guest.get("name"))
    if kind == _cgroups.LXC:
        if "pct" in tools and name.isdigit():
            return [tools["pct"], "exec", name, "--", "systemctl"]
        if "lxc-attach" in tools:
            return [tools["lxc-attach"], "-n", name, "--", "systemctl"]
    elif kind == _cgroups.LXD:
        for tool in ("lxc", "incus"):
            if tool in tools:
                return [tools[tool], "exec", name, "--", "systemctl"]
        if "lxc-attach" in tools:
            return [tools["lxc-attach"], "-n", name, "--", "systemctl"]
    elif kind == _cgroups.NSPAWN and "systemctl" in tools and _registered(name, int(guest.get("init_pid") or 0), machines_dir):
        return [tools["systemctl"], "-M", name]
    return None


# ---------------------------------------------------------------- else: joined to the init's confinement


def cap_last() -> int:
    """The highest capability this kernel knows."""
    try:
        return int(_read_small("/proc/sys/kernel/cap_last_cap").strip())
    except (OSError, ValueError):
        return 40


def ancestors(pid: int, proc: str = "/proc", depth: int = 64) -> list[int]:
    """A process and its ancestors (PPid of /proc/PID/status, which answers also while the
    process is in execve), at most `depth`."""
    found: list[int] = []
    while pid > 0 and pid not in found and len(found) < depth:
        found.append(pid)
        try:
            pid = int(status_of(pid, proc).get("PPid", "0"))
        except ValueError:
            break
    return found


def filters_of(pid: int, proc: str = "/proc") -> tuple[int, int]:
    """(Seccomp mode, Seccomp_filters) of a process; (-1, -1) where it cannot be read."""
    fields = status_of(pid, proc)
    try:
        return int(fields["Seccomp"]), int(fields.get("Seccomp_filters", "-1"))
    except (KeyError, ValueError):
        return -1, -1


def seccomp_inherited(init: Init, proc: str = "/proc", me: int | None = None) -> bool:
    """Whether the guest init's seccomp filters are the ones this process runs under too, so that
    a command started from here keeps them: none, or exactly those of our nearest common ancestor
    (filters are inherited and only ever added, so a descendant with as many filters as its
    ancestor has the ancestor's). A host whose module runs under no filter meets a filtered
    guest init here as different: refused."""
    if init.seccomp == 0:
        return True
    if init.seccomp != 2 or init.seccomp_filters < 0:
        return False
    mine = set(ancestors(_holders.own_pid(proc) if me is None else me, proc))
    for pid in ancestors(init.pid, proc)[1:]:
        if pid in mine:
            return filters_of(pid, proc) == (2, init.seccomp_filters)
    return False


def why_not_confined(init: Init | None, own: Init | None, cgroup_root: str | None, proc: str = "/proc") -> str | None:
    """Why the host cannot run a command joined to the guest init's confinement (None: it can)."""
    if init is None or own is None:
        return "its init's confinement cannot be read in the host's /proc"
    if not seccomp_inherited(init, proc, own.pid):
        return (f"its init runs under a seccomp filter (Seccomp: {init.seccomp:d}, {init.seccomp_filters:d} filters) that this process does not, "
                "which the host cannot reproduce")
    if init.lsm != own.lsm:
        return f"its init runs under the LSM label {init.lsm!r}, not this process's ({own.lsm!r})"
    if own.cap_inh & ~init.cap_bnd:
        return f"this process's inheritable capabilities ({own.cap_inh:x}) exceed the guest's bounding set"
    if not init.cgroup or not cgroup_root:
        return "this node has no cgroup v2 hierarchy to join the guest's cgroup in"
    if len(init.nspid) < 2 or init.nspid[-1] != 1:
        return "its init is no PID 1 of a namespace of its own"
    return None


def _confine(procs_file: str, drop: t.Sequence[int], prctl: t.Any) -> t.Callable[[], None]:
    """The child's last steps before util-linux nsenter starts (subprocess' preexec_fn): into the
    guest init's cgroup, the capabilities the init's bounding set lacks dropped from this one (so
    nsenter, and everything after it, is started with the guest's bounding set), no ambient
    capabilities, no_new_privs. A failure ends the child: nothing runs."""

    def run() -> None:
        fd = os.open(procs_file, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
        for cap in drop:
            if prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"cannot drop capability {cap:d} from the bounding set")
        if prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 or prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "cannot set no_new_privs")

    return run


def run_bounded(argv: t.Sequence[str], timeout: float, preexec: t.Callable[[], None] | None = None,
                limit: int = OUTPUT_LIMIT) -> tuple[int, str, str]:
    """(rc, out, err) of a command whose output the guest writes: its own session, a clean
    environment, no fd of ours; ended (its process group) past `timeout` (rc 124) or past `limit`
    bytes of output (rc 125)."""
    try:
        process = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=dict(GUEST_ENV), close_fds=True, start_new_session=True, preexec_fn=preexec)
    except (OSError, subprocess.SubprocessError) as exc:
        return REFUSED_RC, "", f"cannot start {os.path.basename(argv[0])}: {exc}"
    chunks: dict[int, list[bytes]] = {process.stdout.fileno(): [], process.stderr.fileno(): []}  # type: ignore[union-attr]
    open_fds, size, deadline, rc = set(chunks), 0, time.monotonic() + timeout, None
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                rc = 124
                break
            ready, _w, _x = select.select(list(open_fds), [], [], left)
            for fd in ready:
                data = os.read(fd, 65536)
                if not data:
                    open_fds.discard(fd)
                chunks[fd].append(data)
                size += len(data)
            if size > limit:
                rc = 125
                break
    finally:
        if rc is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except OSError:
                pass
        process.stdout.close()  # type: ignore[union-attr]
        process.stderr.close()  # type: ignore[union-attr]
    try:
        code = process.wait(max(0.1, deadline - time.monotonic()) if rc is None else 1.0)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
        code = 124
    out, err = (b"".join(chunks[fd]).decode("utf-8", "replace") for fd in chunks)
    if rc == 124:
        return 124, "", f"no answer within {timeout:.0f} s"
    if rc == 125:
        return 125, "", f"more than {limit // 1048576:d} MiB of output"
    return code, out, err


# ---------------------------------------------------------------- the guest's numbers in the host's


def host_pids(init: Init, wanted: t.Collection[int], proc: str = "/proc", mounts: t.Sequence[str] | None = None,
              deadline_s: float = TRANSLATE_S) -> dict[int, int]:
    """{guest PID: host PID} of the processes of the guest's own PID namespace (those of the init's
    depth in the guest's cgroup tree, in the init's namespace) whose guest PID is `wanted`; read
    in the host's /proc, never the guest's. The guest makes as many cgroups and processes as it
    likes: the walk ends after `deadline_s` (what was not found reads 0: no main process)."""
    deadline = time.monotonic() + deadline_s
    ref = _cgroups.guest_ref(init.cgroup) if init.cgroup else None
    if ref is None or not wanted:
        return {}
    try:
        init_ns = _bounded_reads.call(os.stat, f"{proc}/{init.pid:d}/ns/pid").st_ino
    except (OSError, _bounded_reads.ReadBlocked):
        return {}
    found: dict[int, int] = {}
    for mount in (_cgroups.cgroup_mounts() if mounts is None else mounts):
        directory = os.path.join(mount, ref["cgroup"].lstrip("/"))
        for folder, dirs, files in os.walk(directory):
            dirs.sort()
            if time.monotonic() > deadline:
                return found
            if "cgroup.procs" not in files:
                continue
            try:
                pids = [int(word) for word in _read_small(os.path.join(folder, "cgroup.procs"), 1 << 20).split()]
            except (OSError, ValueError):
                continue
            for pid in pids:
                try:
                    nspid = tuple(int(word) for word in status_of(pid, proc).get("NSpid", "").split())
                except ValueError:
                    continue
                if len(nspid) != len(init.nspid) or nspid[-1] not in wanted or nspid[-1] in found:
                    continue
                try:
                    same = _bounded_reads.call(os.stat, f"{proc}/{pid:d}/ns/pid").st_ino == init_ns
                except (OSError, _bounded_reads.ReadBlocked):
                    same = False
                if same:
                    found[nspid[-1]] = pid
                    if len(found) == len(set(wanted)):
                        return found
        if found:
            break
    return found


def host_main_pids(out: str, init: Init, proc: str = "/proc", mounts: t.Sequence[str] | None = None) -> str:
    """`systemctl show` output with each MainPID= in host numbers (0 where the guest's number names
    no process of its own PID namespace)."""
    wanted = {int(m.group(1)) for m in _MAIN_PID.finditer(out)} - {0}
    mapping = host_pids(init, wanted, proc, mounts) if wanted else {}
    return _MAIN_PID.sub(lambda m: f"MainPID={mapping.get(int(m.group(1)), 0):d}", out)


# ---------------------------------------------------------------- one call


def _cgroup_root(mounts: t.Sequence[str]) -> str | None:
    """The cgroup v2 mount of this node (the first cgroup2 line of mountinfo)."""
    for mount in mounts:
        if os.path.exists(os.path.join(mount, "cgroup.controllers")):
            return mount
    return None


def refusal(guest: t.Mapping[str, t.Any], proc: str = "/proc", which: t.Callable[[str], str | None] = _commands.which,
            machines_dir: str = MACHINES_DIR) -> str | None:
    """Why the host cannot reach this guest confined (None: it can), naming what to run instead."""
    tools = _tools(which)
    if tool_prefix(guest, tools, machines_dir):
        return None
    why: str | None = "util-linux nsenter is not on this host"
    if "nsenter" in tools:
        mounts = _cgroups.cgroup_mounts()
        why = why_not_confined(read_init(int(guest.get("init_pid") or 0), proc) if guest.get("init_pid") else None,
                               read_init(_holders.own_pid(proc), proc), _cgroup_root(mounts), proc)
    if why is None:
        return None
    return ("{}: {}, and no tool of its manager on this host reaches it ({}: they run a command confined as the guest); gpu_release "
            "never runs a guest's program with the host's privileges").format(
                _guests.label(guest), why, ", ".join(_guests.ENTER_TOOLS.get(str(guest.get("kind")), ())))


def _tools(which: t.Callable[[str], str | None]) -> dict[str, str]:
    found = {}
    for name in ("pct", "lxc-attach", "lxc", "incus", "machinectl", "nsenter", "systemctl"):
        path = which(name)
        if path:
            found[name] = path
    if "machinectl" not in found:
        found.pop("systemctl", None)  # `systemctl -M` asks machined, which comes with machinectl
    return found


def guest_systemctl(guest: t.Mapping[str, t.Any], args: t.Sequence[str], timeout: float, proc: str = "/proc",
                    which: t.Callable[[str], str | None] = _commands.which, machines_dir: str = MACHINES_DIR) -> tuple[int, str, str]:
    """(rc, out, err) of `systemctl ARGS` in the guest, confined as the guest (see the module's
    doc); rc 126 with the reason where the host cannot, 124 past `timeout`. `show`'s MainPID= in
    host numbers."""
    tools = _tools(which)
    prefix = tool_prefix(guest, tools, machines_dir)
    init = read_init(int(guest.get("init_pid") or 0), proc) if guest.get("init_pid") else None
    if prefix:
        rc, out, err = run_bounded(prefix + list(args), timeout)
    else:
        why = refusal(guest, proc, which, machines_dir)
        if why or init is None:
            return REFUSED_RC, "", why or f"{_guests.label(guest)}: its init is gone"
        mounts = _cgroups.cgroup_mounts()
        root = t.cast(str, _cgroup_root(mounts))
        procs_file = os.path.join(root, t.cast(str, init.cgroup).lstrip("/"), "cgroup.procs")
        drop = [cap for cap in range(cap_last() + 1) if not init.cap_bnd >> cap & 1]
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        argv = [tools["nsenter"], "-t", str(init.pid), "-a", "--", "systemctl"] + list(args)
        rc, out, err = run_bounded(argv, timeout, _confine(procs_file, drop, prctl))
    if rc == 0 and args and args[0] == "show" and "MainPID=" in out:
        # The guest's numbers never name a host process: translated, or 0.
        out = host_main_pids(out, init, proc) if init is not None else _MAIN_PID.sub("MainPID=0", out)
    return rc, out, err
