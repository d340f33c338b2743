"""A user's FUSE file system that stops answering, inside a simulated host (tests/sim/stall_fs), and
the processes a user keeps on it. Test support, not collected.

Teardown is in `StalledFs.stop()` (also on failure: use it as a context manager): the daemon is
SIGKILLed by the host pid found before anything stalled (finding a pid reads every process's
/proc/PID/ns/pid, which a process in execve on the stalled mount holds), which aborts the FUSE
connection so every waiter goes on, then the mount point is unmounted lazily.
"""
import os
import signal
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
