# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Root's reads of other processes, under a bound: no user can hang gpu_facts, gpu_release, the
audit or the Slurm hooks (issue 54 class 4, issue 57).

A read of another process's /proc entries, or a stat of a file it holds, waits in the kernel for as
long as that process (or its file system) lets it. Measured on Linux 6.18 with a user's FUSE file
system that stops answering (tests/sim/stall_fs):
- stat() of /proc/PID/fd/N, a file on it, asks the daemon (FUSE_GETATTR) and waits: interruptibly
  at first, and once the daemon has read the request, in D state that not even SIGKILL ends;
- a process whose execve is closing an O_CLOEXEC file on it (FUSE_FLUSH unanswered) holds its
  exec_update_lock: /proc/PID/stat, wchan, maps, environ, exe, root, map_files and ns/* of it then
  wait (killably) as long; status, cgroup, cmdline, fd and fdinfo answer;
- a thread of a process waiting in a page fault on a mapping of it blocks no read of the process
  (the fault lets go of mmap_lock while it waits).
Older kernels hold the mmap lock where these do not, and a file system other than FUSE, NFS, CIFS,
Ceph or overlayfs (Lustre, GPFS, 9p) may not honour AT_STATX_DONT_SYNC.

So:
- `stat_nosync`: statx(AT_STATX_DONT_SYNC), the attributes the kernel has, never a request to a
  file system's server; enough to tell a device node by its number and inode.
- `scan`: a pass over many processes, with a budget per process and one deadline for the whole
  pass. A process on which a reader waits longer than the budget, sleeping in the kernel (not
  running: a loaded node only makes it slow), is `blocked`. Readers work in parallel: one found
  sleeping in the kernel on a process is set aside to wait out its budget while another goes on
  with the rest, so thirty processes a user blocked cost one budget, not thirty (issue 66: read one
  after the other, they outlasted the deadline and failed every other job's epilog). A process
  found blocked is waited for once per run: every later reader of it (`scan` or `call` given its
  PID: the holder scan again, namespace members, process stats, /dev/shm's holders) takes that
  answer at once (`BLOCKED`). The readers are threads: the waits of /proc reads are killable (exec_update_lock, mmap_lock), so a thread left
  waiting ends with the module. A stat may not be (a file system that ignores AT_STATX_DONT_SYNC
  and waits in D state): work that would make one raises NeedsIsolation, and those items are read
  again in forked children, which are SIGKILLed and left when they wait (one in D state cannot die;
  it holds none of the module's files, so no pipe of Ansible's or slurmd's stays open). A fork costs
  a few milliseconds: a node without such files pays none.
- `call`: one read of one process, the same way.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import marshal
import mmap
import os
import select
import signal
import stat as stat_mod
import struct
import threading
import time
import typing as t

T = t.TypeVar("T")

# A /proc read of one process takes microseconds; one sleeping in the kernel this long waits on
# that process (a lock it holds, a file system that does not answer), not on a busy node.
PROCESS_BUDGET_S = 0.5
# The whole pass, unless the entry point gives its own (its `timeout`).
DEADLINE_S = 10.0
# How often a waiting caller looks at the reader's progress (a reader that finishes wakes it at once).
POLL_S = 0.05
# Readers of one pass at work at once (besides those set aside): two, so that a reader waiting on a
# process is noticed while the other goes on; more only share the GIL and cost a clean gate their
# start (eight cost its look ~5 ms, benchmarks/HISTORY.md).
READERS = 2
# A reader sleeping in the kernel this long on one process is set aside (another reader goes on
# with the rest); the budget then decides whether it is blocked. A /proc read of a process that
# answers sleeps microseconds (mmap_lock held for a moment by the process itself). Setting a
# reader aside costs a thread's start, and only where a read sleeps; each process a user blocked
# costs the pass about this much before the next reader goes on (issue 66: thirty of them cost
# 0.4 s at 20 ms, benchmarks/HISTORY.md).
ASIDE_S = 0.005
# How often a pass looks at its readers.
WATCH_S = 0.005
# Readers left waiting at most: each is a thread asleep in the kernel until the module ends. Past
# that, the rest of a pass is left unread (said as the deadline says it).
MAX_WAITING = 512

# Processes found blocked in this run, {their /proc directory (/proc/PID): where root's read
# waited}: a later reader of the same process takes this answer instead of waiting on it again.
BLOCKED: dict[str, str | None] = {}

_LENGTH = struct.Struct("<I")
_INDEX = struct.Struct("<q")
# Children left behind: SIGKILLed after a read that did not answer (reaped when they can be).
_LEFT: list[int] = []


class Blocked(t.NamedTuple):
    """An item whose read did not answer within the budget: its index, and where the reader waited
    in the kernel (its wchan: request_wait_answer is FUSE, rpc_wait_bit_killable NFS, mm_access a
    process in execve)."""

    item: int
    waits_in: str | None


class Outcome(t.NamedTuple):
    """What `scan` read: {item index: result} of the items whose work returned something, the
    items that blocked, and the indexes the deadline left unread."""

    results: dict[int, t.Any]
    blocked: list[Blocked]
    unread: list[int]


class NeedsIsolation(Exception):
    """Raised by work that would stat a file a thread may not wait on (see the module's doc): the
    item is read again in a forked child, where `isolated()` is true."""


_ISOLATED: list[bool] = [False]


def isolated() -> bool:
    """Whether this is a forked reader, where any stat may be made (it is killed if it waits)."""
    return _ISOLATED[0]


class ReadBlocked(Exception):
    """`call`'s read did not answer within the budget (not an OSError: the process is there)."""

    def __init__(self, waits_in: str | None) -> None:
        super().__init__(f"the read did not answer (waits in {waits_in or 'the kernel'})")
        self.waits_in = waits_in


# ---------------------------------------------------------------- stat without asking a server


class Stat(t.NamedTuple):
    """The fields of a stat result that identify a file (os.stat_result's names)."""

    st_mode: int
    st_uid: int
    st_dev: int
    st_ino: int
    st_rdev: int


AT_FDCWD = -100
AT_STATX_DONT_SYNC = 0x4000
STATX_BASIC = 0x10B  # STATX_TYPE | STATX_MODE | STATX_UID | STATX_INO
# statx(2) where glibc has no wrapper (before 2.28).
_STATX_SYSCALL = {"x86_64": 332, "aarch64": 291, "ppc64le": 383, "ppc64": 383, "s390x": 379}
_STATX: list[t.Any] = []


def _statx_function() -> t.Any:
    """libc's statx (or syscall(SYS_statx)) as a callable (dirfd, path, flags, mask, buffer) -> rc,
    None where neither is there."""
    if not _STATX:
        function: t.Any = None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if hasattr(libc, "statx"):
                function = libc.statx
            else:
                number = _STATX_SYSCALL.get(os.uname().machine)
                if number is not None:
                    function = functools.partial(libc.syscall, number)
        except (OSError, AttributeError):
            function = None
        _STATX.append(function)
    return _STATX[0]


def stat_nosync(path: str) -> Stat:
    """os.stat of `path` (a /proc magic link is followed) from what the kernel has cached: FUSE,
    NFS, CIFS, Ceph and overlayfs then send no request (a stalled server cannot make root wait). A
    device node's number and inode come from memory on any file system. Where the kernel or C
    library has no statx, os.stat. Raises OSError as os.stat does."""
    function = _statx_function()
    if function is None:
        return _plain_stat(path)
    buffer = ctypes.create_string_buffer(256)
    if function(AT_FDCWD, os.fsencode(path), AT_STATX_DONT_SYNC, STATX_BASIC, buffer) != 0:
        code = ctypes.get_errno()
        if code == errno.ENOSYS:
            _STATX[0] = None
            return _plain_stat(path)
        raise OSError(code, os.strerror(code), path)
    uid, _gid, mode = struct.unpack_from("<IIH", buffer, 20)
    (ino,) = struct.unpack_from("<Q", buffer, 32)
    rdev_major, rdev_minor, dev_major, dev_minor = struct.unpack_from("<IIII", buffer, 128)
    return Stat(mode, uid, os.makedev(dev_major, dev_minor), ino, os.makedev(rdev_major, rdev_minor))


def _plain_stat(path: str) -> Stat:
    st = os.stat(path)
    return Stat(st.st_mode, st.st_uid, st.st_dev, st.st_ino, st.st_rdev)


def is_char_device(st: Stat | os.stat_result) -> bool:
    return stat_mod.S_ISCHR(st.st_mode)


# ---------------------------------------------------------------- a pass over many processes


def scan(work: t.Callable[[t.Any], t.Any], items: t.Sequence[t.Any], budget: float = PROCESS_BUDGET_S, deadline_s: float | None = None,
         isolate: bool = False, processes: t.Sequence[str] | None = None, together: bool = False) -> Outcome:
    """work(item) for each item -> Outcome; `deadline_s` bounds the whole pass. `work` returns None
    for an item with nothing to say; an exception counts as None. `processes`: the /proc directory
    of the process each item reads (items[i] reads processes[i]): one found blocked earlier in the
    run is blocked here at once, and one found blocked here is so for every later reader (BLOCKED).
    `together`: a reader for each item from the start (at most MAX_WAITING), for a few items that
    are expected to wait (the wchans of processes found blocked): their budgets then run at once
    instead of one after another.

    In parallel threads; the items whose work raises NeedsIsolation are read again in forked
    children (all of them with `isolate`), where `work` returns plain data (marshal: dicts, lists,
    str, int, float, bool, None)."""
    _reap()
    deadline = time.monotonic() + (DEADLINE_S if deadline_s is None else deadline_s)
    known = [Blocked(index, BLOCKED[process]) for index, process in enumerate(processes or ()) if process in BLOCKED]
    skip = {b.item for b in known}
    todo = [index for index in range(len(items)) if index not in skip]
    outcome = _scan_todo(work, items, todo, budget, deadline, isolate, min(len(todo), MAX_WAITING) if together else READERS)
    if processes is not None:
        for blocked in outcome.blocked:
            BLOCKED[processes[blocked.item]] = blocked.waits_in
    return Outcome(outcome.results, sorted(outcome.blocked + known), outcome.unread)


def _scan_todo(work: t.Callable[[t.Any], t.Any], items: t.Sequence[t.Any], todo: list[int], budget: float, deadline: float,
               isolate: bool, readers: int = READERS) -> Outcome:
    """scan over items[i] for i in `todo`; the Outcome's indexes are items' own."""
    if isolate:
        rest = _scan(_one_child, work, [items[index] for index in todo], budget, deadline)
        return _renumber(rest, todo)
    needs: list[int] = []

    def in_thread(index: int) -> t.Any:
        try:
            return work(items[index])
        except NeedsIsolation:
            needs.append(index)
            return None

    first = _renumber(_parallel(in_thread, todo, budget, deadline, readers), todo)
    if not needs:
        return first
    needs.sort()
    rest = _renumber(_scan(_one_child, work, [items[index] for index in needs], budget, deadline), needs)
    results = dict(first.results)
    results.update(rest.results)
    return Outcome(results, sorted(first.blocked + rest.blocked), sorted(first.unread + rest.unread))


def _renumber(outcome: Outcome, indexes: t.Sequence[int]) -> Outcome:
    """An Outcome over a sub-list of items, in the whole list's indexes."""
    return Outcome({indexes[i]: result for i, result in outcome.results.items()}, [Blocked(indexes[b.item], b.waits_in) for b in outcome.blocked],
                   [indexes[i] for i in outcome.unread])


class _Reader:
    """One reader thread of a parallel pass: the item it is on (None: between items), since when,
    whether it was set aside (it ends after its item) or left (it is blocked, its result unwanted)."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.item: int | None = None
        self.since = 0.0
        self.aside = False
        self.left = False

    def is_left(self) -> bool:
        """Whether the pass left this reader (its result is no longer wanted): set by the watcher."""
        return self.left


def _parallel(work: t.Callable[[t.Any], t.Any], items: t.Sequence[t.Any], budget: float, deadline: float, at_once: int = READERS) -> Outcome:
    """work(item) over items by up to `at_once` threads at once; a reader sleeping in the kernel on
    one item for ASIDE_S is set aside and another takes the rest, and it is left (the item
    blocked) once it has slept there for `budget`. At the deadline, what is not read is unread."""
    lock = threading.Lock()
    wake = threading.Event()
    results: dict[int, t.Any] = {}
    blocked: list[Blocked] = []
    queue = list(range(len(items)))
    queue.reverse()
    pending = [len(items)]
    readers: list[_Reader] = []

    def run(reader: _Reader) -> None:
        while True:
            with lock:
                if reader.left or reader.aside or not queue:
                    break
                item = reader.item = queue.pop()
                reader.since = time.monotonic()
            try:
                result = work(items[item])
            except Exception:  # pylint: disable=broad-exception-caught
                result = None
            with lock:
                if reader.is_left():
                    return
                if result is not None:
                    results[item] = result
                reader.item = None
                pending[0] -= 1
                if not pending[0]:
                    wake.set()

    def start() -> None:
        reader = _Reader()
        reader.thread = threading.Thread(target=run, args=(reader,), name="zeromib-proc-read", daemon=True)
        readers.append(reader)
        reader.thread.start()

    for _count in range(min(at_once, len(items))):
        start()
    while True:
        with lock:
            if not pending[0]:
                return Outcome(results, sorted(blocked), [])
        now = time.monotonic()
        if now >= deadline:
            return _stop(lock, readers, queue, results, blocked)
        for reader in readers:
            _watch(reader, now, budget, lock, pending, blocked)
        readers[:] = [r for r in readers if not r.left and r.thread is not None and r.thread.is_alive()]
        working = sum(1 for r in readers if not r.aside)
        with lock:
            more = bool(queue)
        if more and working < at_once:
            if len(readers) - working + len(blocked) >= MAX_WAITING:
                return _stop(lock, readers, queue, results, blocked)
            for _count in range(at_once - working):
                start()
        wake.wait(max(0.0, min(WATCH_S, deadline - time.monotonic())))
        wake.clear()


def _watch(reader: _Reader, now: float, budget: float, lock: threading.Lock, pending: list[int], blocked: list[Blocked]) -> None:
    """Set a reader aside once it sleeps in the kernel on its item, and leave it (the item
    blocked) once it has slept there for the budget."""
    item, since, thread = reader.item, reader.since, reader.thread
    if reader.left or item is None or thread is None or now - since < ASIDE_S:
        return
    # A reader set aside is looked at again only once its budget is spent: thirty of them, looked
    # at every WATCH_S, cost a pass 0.1 s of CPU in reads of their state.
    if (reader.aside and now - since < budget) or not _thread_waits(thread):
        return
    reader.aside = True
    if now - since < budget:
        return
    waits_in = _thread_wchan(thread)
    with lock:
        if reader.item == item and not reader.left:
            reader.left = True
            pending[0] -= 1
            blocked.append(Blocked(item, waits_in))


def _stop(lock: threading.Lock, readers: list[_Reader], queue: list[int], results: dict[int, t.Any], blocked: list[Blocked]) -> Outcome:
    """The deadline: every reader left, what it was on and what no reader took unread."""
    with lock:
        unread = list(queue)
        queue[:] = []
        for reader in readers:
            if reader.item is not None and not reader.left:
                unread.append(reader.item)
            reader.left = True
        return Outcome(dict(results), sorted(blocked), sorted(unread))


def _scan(one: t.Callable[..., tuple[int, str | None]], work: t.Callable[[t.Any], t.Any], items: t.Sequence[t.Any], budget: float,
          deadline: float) -> Outcome:
    results: dict[int, t.Any] = {}
    blocked: list[Blocked] = []
    start = 0
    while start < len(items):
        stopped, waits_in = one(work, items, start, results, budget, deadline)
        if stopped >= len(items):
            break
        if waits_in is _DEADLINE:
            return Outcome(results, blocked, list(range(stopped, len(items))))
        if waits_in is not _ENDED:
            blocked.append(Blocked(stopped, waits_in))
        start = stopped + 1
        if time.monotonic() >= deadline and start < len(items):
            return Outcome(results, blocked, list(range(start, len(items))))
    return Outcome(results, blocked, [])


_DEADLINE = "\0deadline"
_ENDED = "\0ended"


def _one_child(work: t.Callable[[t.Any], t.Any], items: t.Sequence[t.Any], start: int, results: dict[int, t.Any], budget: float,
               deadline: float) -> tuple[int, str | None]:
    """One child reading items[start:] -> (the index it stopped at, where it waited); the index
    is len(items) when it read them all, and `waits_in` is _DEADLINE when the deadline stopped it."""
    progress = mmap.mmap(-1, _INDEX.size)
    _INDEX.pack_into(progress, 0, start)
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        progress.close()
        raise
    if pid == 0:  # pragma: no cover - the child (its coverage is not collected)
        _child(work, items, start, progress, read_end, write_end)
    os.close(write_end)
    try:
        return _follow(pid, read_end, progress, results, budget, deadline, len(items))
    finally:
        os.close(read_end)
        progress.close()
        _reap()


def _child(work: t.Callable[[t.Any], t.Any], items: t.Sequence[t.Any], start: int, progress: mmap.mmap, read_end: int,
           write_end: int) -> t.NoReturn:  # pragma: no cover - runs in the child
    try:
        _ISOLATED[0] = True
        os.close(read_end)
        _hold_nothing(write_end)
        for index in range(start, len(items)):
            _INDEX.pack_into(progress, 0, index)
            try:
                result = work(items[index])
                data = marshal.dumps((index, result)) if result is not None else None
            except Exception:  # pylint: disable=broad-exception-caught
                data = None
            if data is not None:
                _write_all(write_end, _LENGTH.pack(len(data)) + data)
        _INDEX.pack_into(progress, 0, len(items))
        _write_all(write_end, _LENGTH.pack(0))
    finally:
        os._exit(0)


def _hold_nothing(keep: int) -> None:  # pragma: no cover - runs in the child
    """The child keeps only its pipe: stdin, stdout and stderr on /dev/null, every other file
    closed (a child stuck in D state must hold no pipe that Ansible or slurmd waits to see closed)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def _write_all(fd: int, data: bytes) -> None:  # pragma: no cover - runs in the child
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _follow(pid: int, read_end: int, progress: mmap.mmap, results: dict[int, t.Any], budget: float, deadline: float, count: int) -> tuple[int, str | None]:
    """Read the child's results until it says it is done, blocks or runs out of time."""
    buffer = b""
    seen, since = -1, time.monotonic()
    while True:
        now = time.monotonic()
        ready, _w, _x = select.select([read_end], [], [], max(0.0, min(POLL_S, deadline - now)))
        if ready:
            chunk = os.read(read_end, 1 << 16)
            buffer, done = _take(buffer + chunk, results)
            if done:
                _reaped(pid)
                return count, None
            if chunk:
                continue
            # The child ended without its last word (killed from outside, out of memory): the item
            # it was on is passed over, the next child goes on after it.
            _reaped(pid)
            return _INDEX.unpack_from(progress)[0], _ENDED
        index = _INDEX.unpack_from(progress)[0]
        now = time.monotonic()
        if index != seen:
            seen, since = index, now
        elif now - since >= budget and _state(pid) != "R":
            return index, _leave(pid)
        if now >= deadline:
            _leave(pid)
            return index, _DEADLINE


def _take(buffer: bytes, results: dict[int, t.Any]) -> tuple[bytes, bool]:
    """Complete messages out of `buffer` into results -> (the rest, whether the end came)."""
    while len(buffer) >= _LENGTH.size:
        (length,) = _LENGTH.unpack_from(buffer)
        if length == 0:
            return b"", True
        if len(buffer) < _LENGTH.size + length:
            break
        index, result = marshal.loads(buffer[_LENGTH.size:_LENGTH.size + length])
        results[index] = result
        buffer = buffer[_LENGTH.size + length:]
    return buffer, False


def _state(pid: int, task: str = "") -> str | None:
    """The scheduler state of our own child or thread (never blocks: it is ours)."""
    try:
        with open(f"/proc/{pid:d}{task}/stat", "rb") as handle:
            data = handle.read()
        return data[data.rindex(b")") + 2:data.rindex(b")") + 3].decode()
    except (OSError, ValueError):
        return None


def _thread_state(thread: threading.Thread) -> str | None:
    return _state(os.getpid(), f"/task/{thread.native_id or 0:d}")


def _thread_waits(thread: threading.Thread) -> bool:
    """Whether a reader thread sleeps in the kernel on something else than this process's own
    locks: a thread waiting for the GIL (a futex) on a loaded node only runs late, it waits on no
    other process."""
    if _thread_state(thread) in ("R", None):
        return False
    wchan = _thread_wchan(thread)
    if wchan is None:
        # No wchan: running again since its state was read (a reader woken from the GIL's futex),
        # or a kernel that shows none; its state, read again, says which.
        return _thread_state(thread) not in ("R", None)
    return not wchan.startswith("futex")


def _thread_wchan(thread: threading.Thread) -> str | None:
    return wchan_of(f"/proc/{os.getpid():d}/task/{thread.native_id or 0:d}/wchan")


def wchan_of(path: str) -> str | None:
    """The kernel function a task of ours sleeps in (/proc/.../wchan; "0" or empty: none)."""
    try:
        with open(path, "rb") as handle:
            text = handle.read().decode("ascii", "replace").strip()
    except OSError:
        return None
    return text if text and text != "0" else None


def _leave(pid: int) -> str | None:
    """SIGKILL a child whose read does not answer, and leave it (reaped later, if it can die)."""
    waits_in = wchan_of(f"/proc/{pid:d}/wchan")
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    _LEFT.append(pid)
    return waits_in


def _reaped(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _reap() -> None:
    for pid in list(_LEFT):
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done == pid:
            _LEFT.remove(pid)


# ---------------------------------------------------------------- one read of one process


def call(function: t.Callable[..., T], *args: t.Any, budget: float = PROCESS_BUDGET_S, process: str | None = None) -> T:
    """function(*args) in a thread, waited for while it runs or for `budget` while it sleeps in
    the kernel; raises ReadBlocked past that (the thread is left: see the module's doc), else
    returns its result or raises its exception. `process`: the /proc directory of the process it
    reads; one found blocked earlier in the run raises ReadBlocked at once, one found blocked here
    is so for later readers."""
    if process is not None and process in BLOCKED:
        raise ReadBlocked(BLOCKED[process])
    try:
        return _call(function, *args, budget=budget)
    except ReadBlocked as exc:
        if process is not None:
            BLOCKED[process] = exc.waits_in
        raise


def _call(function: t.Callable[..., T], *args: t.Any, budget: float = PROCESS_BUDGET_S) -> T:
    box: list[tuple[bool, t.Any]] = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append((True, function(*args)))
        except BaseException as exc:  # pylint: disable=broad-exception-caught
            box.append((False, exc))
        finally:
            done.set()

    thread = threading.Thread(target=run, name="zeromib-proc-read", daemon=True)
    thread.start()
    since = time.monotonic()
    while not done.wait(POLL_S):
        if time.monotonic() - since >= budget and _thread_waits(thread):
            raise ReadBlocked(_thread_wchan(thread))
    ok, value = box[0]
    if ok:
        return t.cast(T, value)
    if not isinstance(value, NeedsIsolation):
        raise value
    outcome = _scan(_one_child, lambda _item: function(*args), [None], budget, time.monotonic() + budget * 4)
    if outcome.blocked or outcome.unread:
        raise ReadBlocked(outcome.blocked[0].waits_in if outcome.blocked else None)
    return t.cast(T, outcome.results.get(0))
