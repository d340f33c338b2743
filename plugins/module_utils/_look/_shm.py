# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""What the jobs left in /dev/shm: its size and free space, and the files no live process holds.

A SIGKILLed NCCL, PyTorch or Python multiprocessing job leaves its shared-memory segments behind
(issue 58: a PyTorch job freed by gpu_release left 14 `torch_*` files, 448 MiB, on a real H100).
The GPUs then read 0 MiB while the next job dies in NCCL init with "No space left on device".

A file is held while a live process has it open or mapped, known by the kernel's identity of the
file (st_dev, st_ino), never by its name: a process in a container with its own /dev/shm has its
own files of the same names. Each process's open files are read with `readlink` first (it never
blocks) and only those that point into /dev/shm are stat-ed (tmpfs answers from memory); its
mappings come from the `dev` and `inode` columns of /proc/PID/maps, which the kernel writes
without asking any file system. Nothing else of another process is read: a stalled FUSE mount
blocks a stat of a file on it, and a look must not hang (the troubleshooting guide, "A file system that stops
answering"). The two per-process reads are `fd_targets` and `read_maps`, each in its own try, and
the pass runs in the holder scan's bounded reader (_bounded_reads): the maps of a process in
execve on a FUSE mount that stopped answering wait with it, so such a process is counted
`blocked` (the list is then incomplete, and clean_shm removes nothing) and the pass goes on. The
stat of a file found in /dev/shm asks the kernel's cache only (_bounded_reads.stat_nosync): in
another mount namespace that path may be a user's FUSE mount.

The whole scan runs only when /dev/shm holds a regular file at all: a clean node pays a statvfs
and an empty directory listing."""

from __future__ import annotations

import itertools
import os
import re
import stat as stat_mod
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads

SHM_DIR = "/dev/shm"
MIB = 1024 * 1024
DELETED_SUFFIX = " (deleted)"


class Pattern(t.NamedTuple):
    """A family of segments some job framework names so. `clean`: gpu_release's clean_shm may
    remove an unheld file of it (a job's own scratch, meaningless once its processes are gone)."""

    label: str
    regex: t.Pattern[str]
    clean: bool


# What each framework really names its segments, from its own source (most specific first):
PATTERNS = (
    # NCCL: "/dev/shm/nccl-XXXXXX" through mkstemp, fallocate'd to the buffers' size (NVIDIA/nccl
    # src/misc/shmutils.cc, ncclShmOpen). A full /dev/shm fails there: "failed to extend ... No
    # space left on device".
    Pattern("nccl-*", re.compile(r"^nccl-"), True),
    # PyTorch: "/torch_<pid>_<random>[_<counter>]" for CPU tensors shared with the file_system
    # strategy (aten NewProcessWideShmHandle, torch/csrc StorageSharing) and the CUDA IPC reference
    # counters (torch/csrc/CudaIPCTypes.cpp).
    Pattern("torch_*", re.compile(r"^torch_\d"), True),
    # CUDA IPC handles, "cuda.shm.<id>.<pid in hex>.<n>", 66 bytes each, left by crashed processes
    # (SGLang's own stale-segment sweep removes them: its _ORPHAN_PREFIXES, "CUDA IPC segments").
    Pattern("cuda.shm.*", re.compile(r"^cuda\.shm\."), True),
    # Intel/Cornelis PSM and PSM2 (Omni-Path) shared-memory endpoints: "/psm_shm.<uuid>" and
    # "/psm2_shm.<uid><epid><n>" (ptl_am/am_reqrep_shmem.c).
    Pattern("psm_shm.*", re.compile(r"^psm2?_shm\."), True),
    # Python's multiprocessing.shared_memory: "/psm_" + 8 hex digits (Lib/multiprocessing/
    # shared_memory.py, _SHM_NAME_PREFIX and _make_filename); vLLM's shm_broadcast MessageQueue
    # (vllm/distributed/device_communicators/shm_broadcast.py) is built on it.
    Pattern("psm_*", re.compile(r"^psm_[0-9a-f]{8}$"), True),
    # Python multiprocessing's semaphores: "/mp-<random>" (Lib/multiprocessing/synchronize.py,
    # semprefix "/mp"), which glibc's sem_open keeps as /dev/shm/sem.mp-<random>; with the spawn
    # and forkserver start methods (PyTorch's DataLoader workers) they are unlinked only at a clean
    # exit, so a SIGKILLed job leaves them ("leaked semaphore objects").
    Pattern("sem.mp-*", re.compile(r"^sem\.mp-"), True),
    # Python multiprocessing's heap arenas: mkstemp(prefix="pym-<pid>-", dir="/dev/shm") on Linux
    # (Lib/multiprocessing/heap.py, Arena), unlinked at once: left only by a kill in between.
    Pattern("pym-*", re.compile(r"^pym-\d+-"), True),
    # Any other POSIX named semaphore (sem_open: "sem.<name>"). Named, never removed: a daemon may
    # keep one between its runs on purpose.
    Pattern("sem.*", re.compile(r"^sem\."), False),
)


def pattern_of(name: str) -> Pattern | None:
    for pattern in PATTERNS:
        if pattern.regex.match(name):
            return pattern
    return None


class Entry(t.NamedTuple):
    """A regular file directly in /dev/shm, as lstat saw it."""

    name: str
    dev: int
    ino: int
    uid: int
    bytes: int
    mtime: float


def space(path: str = SHM_DIR) -> tuple[float, float]:
    """(size, free) of the file system in MiB; free is what an unprivileged job may still use."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize / MIB, st.f_bavail * st.f_frsize / MIB


# The walk of /dev/shm reads (lstat) at most this many files, for at most WALK_S seconds: a user
# makes 300,000 empty files in 0.7 s, and one record each made gpu_facts take 37 s and 773 MiB
# (issue 66). Past either bound the rest are counted (names only, also bounded) and not read: they
# are neither listed unheld nor ever removed.
WALK_FILES = 10000
WALK_S = 1.0


class Walk(t.NamedTuple):
    """What a bounded walk of /dev/shm found: the regular files it read that matter (they take
    space, or a job's pattern names them: an empty file of no job is neither space nor anything
    clean_shm would remove, so it is counted, never looked for among the processes' files), how
    many files the directory holds (None: more than it could count in time), and whether it read
    them all."""

    files: list[Entry]
    entries: int | None
    complete: bool


def walk(path: str = SHM_DIR, limit: int = WALK_FILES, seconds: float = WALK_S) -> Walk:
    """The regular files directly in `path`, never following a link (lstat), at most `limit` of
    them and for at most `seconds`; then the other entries counted for as long again. Their size
    is what they take (st_blocks): a sparse segment costs only the pages written."""
    found: list[Entry] = []
    read = regular = 0
    deadline = time.monotonic() + seconds
    with os.scandir(path) as entries:
        for entry in entries:
            if read >= limit or (read % 256 == 0 and time.monotonic() >= deadline):
                rest = _count_rest(entries, time.monotonic() + seconds)
                return Walk(found, None if rest is None else regular + 1 + rest, False)
            read += 1
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if stat_mod.S_ISREG(st.st_mode):
                regular += 1
                if st.st_blocks or pattern_of(entry.name):
                    found.append(Entry(entry.name, st.st_dev, st.st_ino, st.st_uid, st.st_blocks * 512, st.st_mtime))
    return Walk(found, regular, True)


def _count_rest(entries: t.Iterator[t.Any], deadline: float) -> int | None:
    """How many entries are left; None (not known) when counting them outlasts `deadline`."""
    count = 0
    while True:
        block = sum(1 for _entry in itertools.islice(entries, 65536))
        count += block
        if block < 65536:
            return count
        if time.monotonic() >= deadline:
            return None


def list_files(path: str = SHM_DIR) -> list[Entry]:
    """The regular files of a bounded walk of `path` (walk)."""
    return walk(path).files


# ---------------------------------------------------------------- whose /dev/shm it is

# The source Docker, Podman, containerd (Kubernetes' CRI) and CRI-O give the tmpfs they mount for a
# container's or a pod's IPC namespace (unix.Mount("shm", ..., "tmpfs", ...)) and bind into every
# container that joins it: from inside, the one mark that the namespace is a runtime's to share.
CONTAINER_SHM_SOURCE = "shm"

# The kernel's inodes of the initial PID and IPC namespaces (include/linux/proc_ns.h:
# PROC_PID_INIT_INO, PROC_IPC_INIT_INO; _guests reads the first one too).
PROC_PID_INIT_INO = 0xEFFFFFFC
PROC_IPC_INIT_INO = 0xEFFFFFFF


class Mount(t.NamedTuple):
    """One line of /proc/self/mountinfo (proc(5)): `root` is the directory of the file system
    mounted here ("/": all of it), `tags` its propagation (shared:N, master:N)."""

    point: str
    root: str
    tags: list[str]
    fstype: str
    # The mount's source as its mounter named it ("shm": a container runtime's, CONTAINER_SHM_SOURCE).
    source: str = ""


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    # At "\n" only: the kernel escapes it (and space, tab, backslash) in a path, not \x1c or \x85.
    for line in text.split("\n"):
        left, _sep, right = line.partition(" - ")
        # One space between fields (a space in a path is \040); str.split() would also split at a \x0b.
        fields, tail = left.split(" "), right.split(" ")
        if len(fields) < 6 or not tail:
            continue
        mounts.append(Mount(_unescape(fields[4]), _unescape(fields[3]), fields[6:], tail[0], _unescape(tail[1]) if len(tail) > 1 else ""))
    return mounts


def mount_of(path: str, mounts: t.Sequence[Mount]) -> Mount | None:
    """The mount `path` lies on: the longest mount point above it, the last one where several
    are stacked (the one on top)."""
    best: Mount | None = None
    for mount in mounts:
        point = mount.point.rstrip("/") or "/"
        above = point == "/" or path == point or path.startswith(point + "/")
        if above and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = mount
    return best


def not_private(mount: Mount | None, pid_ns: int, ipc_ns: int, shm: str = SHM_DIR) -> str | None:
    """Why processes this run cannot see may hold files of `shm`, or None. Pure.

    A file is unheld only if no process has it open or mapped, and the scan sees only this PID
    namespace's processes. In the kernel's first PID namespace that is every process on the node:
    nothing to fear. In any other (a container), /dev/shm counts as the container's own only when
    nothing the kernel shows says it is reachable from outside:
    - the container shares the node's IPC namespace (docker --ipc=host and the like): its runtime
      gives it the node's /dev/shm with it;
    - /dev/shm is a directory of another file system bound here (mountinfo's root is not "/":
      LXC's `lxc.mount.entry = /dev/shm ...` of a host directory, a dir-backed rootfs): the rest
      of that file system, and whoever uses it, is outside;
    - its mount is a slave (master:N) of a mount elsewhere: a bind of the host's /dev/shm with
      LXC's or nspawn's default rslave propagation; a tmpfs mounted for the container itself is
      no slave of anything. (shared:N alone is not outside: a guest's systemd makes every mount
      shared within the guest.)
    - its tmpfs is a container runtime's (source "shm", CONTAINER_SHM_SOURCE): Docker, Podman,
      containerd and CRI-O make one per IPC namespace, which other containers join (a Kubernetes
      pod's containers all do, docker --ipc=container:NAME) in PID namespaces of their own, so
      their processes are not visible here and nothing shows from inside whether any joined.
    What the kernel does not show from inside is a bind of an outside tmpfs's whole root made
    private, in a container with an IPC namespace of its own (`-v /dev/shm:/dev/shm` without
    --ipc=host), or an IPC namespace a system container shares on purpose (LXC's
    lxc.namespace.share.ipc): those look exactly like a tmpfs of its own, and are said in the
    option's docs."""
    if pid_ns == PROC_PID_INIT_INO:
        return None
    if ipc_ns == PROC_IPC_INIT_INO:
        return "this container shares the node's IPC namespace (as docker --ipc=host does), and with it the node's /dev/shm"
    if mount is None:
        return f"{shm} is on no mount listed in /proc/self/mountinfo"
    if mount.root != "/":
        return f"{shm} is the directory {mount.root} of a file system ({mount.fstype}) mounted from outside this container on {mount.point}"
    if mount.fstype == "tmpfs" and mount.source == CONTAINER_SHM_SOURCE:
        return (f"{shm} is the tmpfs a container runtime made for this container's IPC namespace (source \"shm\"), which other "
                "containers may share (the containers of one Kubernetes pod, docker --ipc=container:NAME) with processes this run cannot see")
    masters = [tag for tag in mount.tags if tag.startswith("master:")]
    if masters:
        return f"{shm}'s mount receives mounts from outside this container ({masters[0]}): a bind of the host's or another container's"
    return None


def shared_with_outside(shm: str = SHM_DIR, proc: str = "/proc") -> str | None:
    """not_private for this run: its PID and IPC namespaces and the mount `shm` is on, read from
    `proc`; where they cannot be read, that is the reason (nothing says the files are private)."""
    try:
        pid_ns = os.stat(f"{proc}/self/ns/pid").st_ino
        ipc_ns = os.stat(f"{proc}/self/ns/ipc").st_ino
        with open(f"{proc}/self/mountinfo", "rb") as handle:
            mounts = parse_mountinfo(handle.read().decode("utf-8", "replace"))
    except OSError as exc:
        return f"whether {shm} is this container's own cannot be read: {exc.strerror or exc}"
    if pid_ns == PROC_PID_INIT_INO:
        return None
    return not_private(mount_of(os.path.realpath(shm), mounts), pid_ns, ipc_ns, shm)


def _pids(proc: str) -> list[int]:
    return sorted(int(name) for name in os.listdir(proc) if name.isdigit())


def fd_targets(base: str) -> list[tuple[str, str]]:
    """[(fd link, target)] of the open files of the process (or thread) at `base`
    (/proc/PID or /proc/PID/task/TID): readlink only, which never blocks. Raises OSError when it
    is gone or not ours to read. The bounded reader of the holder scan replaces this one."""
    fd_dir = base + "/fd"
    links = []
    for fd in os.listdir(fd_dir):
        link = fd_dir + "/" + fd
        try:
            links.append((link, os.readlink(link)))
        except OSError:
            continue
    return links


def read_maps(base: str) -> bytes:
    """`base`/maps. Raises OSError. Waits as long as the process holds its exec lock: in Holding.scan's bounded reader only."""
    with open(base + "/maps", "rb") as handle:
        return handle.read()


def maps_device(dev: int) -> bytes:
    """A device number as /proc/PID/maps spells it: "%02x:%02x" of its major and minor (tmpfs: "00:1a")."""
    return b"%02x:%02x" % (os.major(dev), os.minor(dev))


def mapped_identities(maps: bytes, devices: t.Collection[bytes], inode_numbers: t.Collection[bytes]) -> set[tuple[int, int]]:
    """{(st_dev, st_ino)} of the files a process maps that live on one of `devices` (maps' own
    spelling, maps_device) with an inode number among `inode_numbers`. A byte search for the device
    skips the many processes that map nothing of /dev/shm (a Python process maps ~30 KB of
    libraries); the regex then reads only that device's lines."""
    found: set[tuple[int, int]] = set()
    for device in devices:
        if b" " + device + b" " not in maps:
            continue
        pattern = re.compile(rb"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ " + re.escape(device) + rb" (\d+) ", re.MULTILINE)
        major, minor = (int(part, 16) for part in device.split(b":"))
        found.update((os.makedev(major, minor), int(inode)) for inode in pattern.findall(maps) if inode in inode_numbers)
    return found


class Holding:
    """Which of /dev/shm's files live processes hold: one pass over /proc."""

    def __init__(self, files: t.Sequence[Entry], shm: str = SHM_DIR) -> None:
        self.shm = shm.rstrip("/") + "/"
        self.wanted = {(f.dev, f.ino): f for f in files}
        self.names = {f.name for f in files}
        self.inode_numbers = {str(f.ino).encode() for f in files}
        self.devices = {maps_device(f.dev) for f in files}
        self.held: set[tuple[int, int]] = set()
        # Names open through a path outside /dev/shm (a bind mount of it elsewhere): not stat-ed,
        # and counted as held, since the file cannot be told from another of that name unread.
        self.maybe: set[str] = set()
        self.unreadable = 0
        # Processes whose reads did not answer within the budget, or that the deadline left unread.
        self.blocked = 0

    @property
    def complete(self) -> bool:
        """Whether every process was read: otherwise a file listed unheld may be held."""
        return self.unreadable == 0 and self.blocked == 0

    def done(self) -> bool:
        return len(self.held) == len(self.wanted)

    def add_fds(self, links: t.Iterable[tuple[str, str]]) -> None:
        for link, target in links:
            if target.endswith(DELETED_SUFFIX) or not target.startswith("/"):
                continue  # a deleted file is no file of the directory; sockets, pipes, anon inodes
            if target.startswith(self.shm):
                try:
                    st = _bounded_reads.stat_nosync(link)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in self.wanted:
                    self.held.add((st.st_dev, st.st_ino))
            elif target.rsplit("/", 1)[-1] in self.names:
                self.maybe.add(target.rsplit("/", 1)[-1])

    def add_maps(self, maps: bytes) -> None:
        self.held.update(identity for identity in mapped_identities(maps, self.devices, self.inode_numbers) if identity in self.wanted)

    def scan(self, proc: str = "/proc", deadline_s: float | None = None) -> None:
        """Every process, until every file is found held, in the bounded reader (`deadline_s` for
        the whole pass, _bounded_reads.DEADLINE_S without it)."""

        def one(pid: int) -> None:
            if not self.done():
                self.scan_one(f"{proc}/{pid:d}")

        pids = _pids(proc)
        outcome = _bounded_reads.scan(one, pids, deadline_s=deadline_s, processes=[f"{proc}/{pid:d}" for pid in pids])
        self.blocked += len(outcome.blocked) + len(outcome.unread)

    def scan_one(self, base: str, thread: bool = False) -> None:
        """One process (or one of its threads). A zombie leader reads no fds and no maps while its
        threads live: those are read through its threads."""
        try:
            self.add_fds(fd_targets(base))
            maps = read_maps(base)
        except PermissionError:
            self.unreadable += 1
            return
        except OSError:
            return  # gone
        self.add_maps(maps)
        if not maps and not thread:
            for tid in _other_threads(base):
                self.scan_one(f"{base}/task/{tid}", thread=True)

    def unheld(self) -> list[Entry]:
        return [f for key, f in self.wanted.items() if key not in self.held and f.name not in self.maybe]


def _other_threads(base: str) -> list[str]:
    """The threads of a process other than its leader (kernel threads and zombies alone: none)."""
    leader = base.rsplit("/", 1)[-1]
    try:
        return [tid for tid in os.listdir(base + "/task") if tid != leader]
    except OSError:
        return []


def _user(uid: int, cache: dict[int, str]) -> str:
    if uid not in cache:
        import pwd
        try:
            cache[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            cache[uid] = str(uid)
    return cache[uid]


def unheld_record(files: t.Iterable[Entry], now: float, shm: str = SHM_DIR, limit: int | None = None) -> list[dict[str, t.Any]]:
    """The unheld files, largest and oldest first, each with the job pattern it matches; the
    first `limit` of them, if given."""
    users: dict[int, str] = {}
    ordered = sorted(files, key=lambda f: (-f.bytes, f.mtime, f.name))
    record = []
    for entry in ordered[:limit]:
        pattern = pattern_of(entry.name)
        record.append({
            "path": shm.rstrip("/") + "/" + entry.name,
            "size_mib": round(entry.bytes / MIB, 2),
            "age_s": max(0, int(now - entry.mtime)),
            "pattern": pattern.label if pattern else None,
            "user": _user(entry.uid, users),
        })
    return record


def look(shm: str = SHM_DIR, proc: str = "/proc", processes: bool = True, now: float | None = None,
         deadline_s: float | None = None) -> dict[str, t.Any]:
    """The `shm` record of gpu_facts: {path, size_mib, free_mib, files, unheld, unheld_mib,
    complete, error}. `processes`: find the unheld files (a /proc pass, only when there are files);
    without it `unheld` is None. `complete` is False when some process could not be read (not
    root, or its reads did not answer within the bounded reader's budget; `deadline_s` bounds the
    pass): a file it holds may be listed as unheld."""
    record: dict[str, t.Any] = {"path": shm, "size_mib": None, "free_mib": None, "files": 0, "files_read": 0, "unheld": None, "unheld_count": None,
                                "unheld_mib": None, "complete": None, "error": None}
    try:
        size, free = space(shm)
        found = walk(shm)
    except OSError as exc:
        record["error"] = f"{shm} cannot be read: {exc.strerror or exc}"
        return record
    record.update(size_mib=round(size, 1), free_mib=round(free, 1), files=found.entries, files_read=len(found.files))
    if not processes:
        return record
    holding = scan_holding(found.files, shm, proc, deadline_s)
    unheld = holding.unheld()
    listed = unheld_record(unheld, time.time() if now is None else now, shm, UNHELD_LISTED)
    record.update(unheld=listed, unheld_count=len(unheld), unheld_mib=round(sum(round(f.bytes / MIB, 2) for f in unheld), 2), complete=holding.complete)
    return record


def with_unheld(record: dict[str, t.Any], unheld: list[dict[str, t.Any]], complete: bool) -> dict[str, t.Any]:
    """`record` with its unheld files (unheld_record's): the largest UNHELD_LISTED of them listed,
    their count and MiB over all of them (a user's 300,000 empty files are a count, not 300,000 records)."""
    record.update(unheld=unheld[:UNHELD_LISTED], unheld_count=len(unheld), unheld_mib=round(sum(f["size_mib"] for f in unheld), 2),
                  complete=complete)
    return record


# Unheld files a record lists (the largest first); the rest are in its count and MiB.
UNHELD_LISTED = 50


def scan_holding(files: t.Sequence[Entry], shm: str = SHM_DIR, proc: str = "/proc", deadline_s: float | None = None) -> Holding:
    holding = Holding(files, shm)
    if files:
        holding.scan(proc, deadline_s)
    return holding


# NCCL's shared-memory transport puts one connection's buffers in /dev/shm for each channel and peer
# it reaches through host memory: Simple 4 MiB + LL128 4.7 MiB + LL 0.5 MiB, ~9.2 MiB (NVIDIA/nccl
# src/init.cc, DEFAULT_BUFFSIZE, DEFAULT_LL128_BUFFSIZE, DEFAULT_LL_BUFFSIZE). A ring and a tree on
# 4 channels take ~74 MiB a GPU; with PyTorch's and the proxies' segments, 128 MiB a GPU is the
# floor below which an 8-GPU job's init is at risk (Docker's 64 MiB default fails NCCL outright).
DEFAULT_MIN_FREE_MIB_PER_GPU = 128


def floor_issue(record: t.Mapping[str, t.Any], per_gpu_mib: int | None, gpu_count: int) -> str | None:
    """A health issue when /dev/shm's free space is below `per_gpu_mib` for each GPU, else None
    (0: not checked; an unreadable /dev/shm is no verdict on its space)."""
    free = record.get("free_mib")
    if not per_gpu_mib or free is None or gpu_count <= 0:
        return None
    floor = per_gpu_mib * gpu_count
    if float(free) >= floor:
        return None
    unheld = record.get("unheld") or []
    count = record.get("unheld_count")
    count = len(unheld) if count is None else int(count)
    leftovers = " ({:d} file(s) no live process holds take {:g} MiB)".format(count, float(record.get("unheld_mib") or 0)) if count else ""
    jobs = [f for f in unheld if any(p.clean and p.label == f.get("pattern") for p in PATTERNS)]
    if jobs and count <= len(unheld):
        leftovers += f"; clean_shm (role: free_gpus_clean_shm) removes such files of the jobs its run ends ({len(jobs):d} here match job patterns)"
    elif jobs:
        leftovers += (f"; clean_shm (role: free_gpus_clean_shm) removes such files of the jobs its run ends ({len(jobs):d} among the "
                      f"{len(unheld):d} largest listed match job patterns, and {count - len(unheld):d} more files not listed)")
    return ("{} has {:g} MiB free of {:g} MiB, below the {:d} MiB that {:d} GPU(s) need at {:d} MiB each (shm_min_free_mib_per_gpu): "
            "NCCL init and DataLoader workers fail with \"No space left on device\"{}".format(
                record.get("path"), float(free), float(record.get("size_mib") or 0), floor, gpu_count, per_gpu_mib, leftovers))


def with_floor(summary: dict[str, t.Any], issue: str | None) -> dict[str, t.Any]:
    """Host-level health keys (_facts.health_summary) with the /dev/shm floor's issue added."""
    if issue is None:
        return summary
    summary = dict(summary)
    summary["health_issues"] = list(summary.get("health_issues") or []) + [issue]
    summary["healthy"] = False
    return summary
