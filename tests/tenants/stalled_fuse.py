"""The tenant `stalled_fuse`: a user whose FUSE file system stops answering, inside a simulated host
(the daemon is tests/sim/stall_fs), and the processes she keeps on it. Root's reads of those
processes then wait in the kernel (_bounded_reads's doc says which): what every entry point must
bound. Test support, not collected (moved here from tests/integration/stalled_fs.py, which
re-exports it).

- `StalledFs(host)`: the mount, owned by USER, allow_other; `stall()` from then on answers nothing.
- `spawn_user(host, code, ...)`: a process of the user, its host pid found while nothing stalls.
- `blocked_in_execve(host, mount, count, cgroup=None)`: `count` processes of the user stuck in
  execve on the mount (each closing an O_CLOEXEC fd of it: /proc/PID/stat, maps, environ, ns/* of
  each then wait), placed in `cgroup` first (another job's: tenants.other_job); `still_blocked`
  asks after one without waiting with it. Never call host.alive, host.kill or host.host_pid on
  them: those read what waits.

Teardown is in `StalledFs.stop()` (also on failure: use it as a context manager): the daemon is
SIGKILLed by the host pid found before anything stalled (finding a pid reads every process's
/proc/PID/ns/pid, which a process in execve on the stalled mount holds), which aborts the FUSE
connection so every waiter goes on (the processes in execve become `sleep`, ended with the host),
then the mount point is unmounted lazily.
"""
import os
import signal
import threading
import time

SIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sim")
USER = 4242

# A user's process with a file open on the mount (an sshfs data file, a log): holds no GPU.
HOLD_OPEN = "import sys, time\nf = open(sys.argv[1], 'rb')\nprint('ready', flush=True)\ntime.sleep(3600)\n"
# A user's process that execs while an O_CLOEXEC file of the mount is open: once the mount stalls,
# execve waits in FUSE_FLUSH holding the process's exec_update_lock, and root's reads of its
# /proc/PID/stat, maps, environ, exe and ns/* wait with it (measured on 6.18: _bounded_reads's doc).
EXEC_ON_IT = ("import os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY | os.O_CLOEXEC)\nprint('ready', flush=True)\n"
              "while not os.path.exists(sys.argv[2]):\n    time.sleep(0.01)\nos.execv('/bin/sleep', ['sleep', '3600'])\n")


class StalledFs:
    """stall_fs mounted at HOST.dir/fuse-N (allow_other, owned by USER) in the host's namespaces."""

    def __init__(self, host, uid=USER):
        self.host = host
        self.uid = uid
        tag = f"{time.monotonic_ns():d}"
        self.mountpoint = os.path.join(host.dir, "fuse-" + tag)
        self.flag = os.path.join(host.dir, "fuse-stall-" + tag)
        self.data = os.path.join(self.mountpoint, "data")
        self.daemon_host_pid = None

    def start(self):
        os.makedirs(self.mountpoint)
        ready = self.flag + ".ready"
        daemon = self.host.spawn(["/usr/bin/python3", os.path.join(SIM, "stall_fs"), self.mountpoint, "--flag", self.flag,
                                  "--uid", str(self.uid), "--ready", ready, "--allow-other"], ready=False)
        deadline = time.monotonic() + 15
        while not os.path.exists(ready):
            assert time.monotonic() < deadline, "stall_fs did not mount: " + _text(daemon.log)
            time.sleep(0.01)
        self.daemon_host_pid = daemon.host_pid
        return self

    def stall(self):
        """From now on no request is answered."""
        open(self.flag, "w").close()

    def stop(self):
        if self.daemon_host_pid is not None:
            try:
                os.kill(self.daemon_host_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.daemon_host_pid = None
            self.host.run(["umount", "-l", self.mountpoint], timeout=30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def spawn_user(host, code, *args, uid=USER):
    """python3 -c CODE ARGS as the user, once it printed `ready`; its host pid found now, while
    nothing has stalled (see the module's doc)."""
    proc = host.spawn_as(uid, ["/usr/bin/python3", "-c", code] + list(args), ready=False)
    deadline = time.monotonic() + 15
    while "ready" not in _text(proc.log):
        assert time.monotonic() < deadline, f"{code!r} did not start: " + _text(proc.log)
        time.sleep(0.01)
    proc.host_pid  # noqa: B018 - cached now
    return proc


def _text(path):
    with open(path) as handle:
        return handle.read()


def waits_in_fuse(host_pid, timeout=10.0):
    """Wait until a thread of the process sleeps in a FUSE request (its page fault is under way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for tid in os.listdir(f"/proc/{host_pid}/task"):
            try:
                with open(f"/proc/{host_pid}/task/{tid}/wchan") as handle:
                    if handle.read().strip() == "request_wait_answer":
                        return True
            except OSError:
                pass
        time.sleep(0.02)
    return False


def blocked_in_execve(host, mount, count, cgroup=None, settle_s=10.0):
    """`count` processes of the user stuck in execve on `mount` (EXEC_ON_IT), each moved into
    `cgroup` first when given (a path host.user_cgroup returned); the mount is stalled here.
    Returns their HostProcs once a read of each one's /proc/PID/stat waits (its exec reached the
    close of the file), or fails after `settle_s`."""
    procs = [spawn_user(host, EXEC_ON_IT, mount.data, mount.flag) for _n in range(count)]
    if cgroup is not None:
        for proc in procs:
            move_to_cgroup(proc, cgroup)
    mount.stall()
    deadline = time.monotonic() + settle_s
    for proc in procs:
        while not _waits_in_exec(proc.host_pid):
            assert time.monotonic() < deadline, f"pid {proc.pid} did not reach the stalled close"
            time.sleep(0.02)
    return procs


def move_to_cgroup(proc, cgroup):
    """host.move_to_cgroup by the host pid the process was found by (cached): that method looks the
    pid up again, reading other processes' /proc/PID/ns/pid, which waits on any process in execve
    on a stalled mount (another test's, too)."""
    from nshost import _cgroup2_mount
    with open(os.path.join(_cgroup2_mount(), cgroup.lstrip("/"), "cgroup.procs"), "w") as handle:
        handle.write(str(proc.host_pid))


def still_blocked(proc):
    """Whether a process blocked_in_execve returned is still there, not yet exec'd: read from
    /proc/PID/status on the machine, which answers (host.alive reads its stat, which waits with
    it until the daemon ends)."""
    try:
        with open(f"/proc/{proc.host_pid}/status") as handle:
            status = handle.read()
    except OSError:
        return False
    return "\nName:\tpython3\n" in "\n" + status and "\nState:\tZ" not in status


def _waits_in_exec(host_pid, budget_s=0.2):
    """Whether a read of the process's /proc/PID/stat (on the machine) waits: its execve holds the
    lock that read takes. The read runs in a daemon thread left waiting until the daemon's end lets
    the process go on (a killable wait: it never outlives the test run)."""
    done = threading.Event()

    def read():
        try:
            with open(f"/proc/{host_pid}/stat", "rb") as handle:
                handle.read()
        except OSError:
            pass
        done.set()

    threading.Thread(target=read, daemon=True).start()
    return not done.wait(budget_s)
