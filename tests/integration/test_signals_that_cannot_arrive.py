"""gpu_release on simulated hosts against holders that cannot act on a SIGTERM (issue 57): a stopped
one (SIGSTOP: Ctrl-Z in a tmux pane, a suspended job), one stopped by its tracer (a debugger at its
prompt: PTRACE_SEIZE + PTRACE_INTERRUPT, and no resume) and one in a frozen cgroup v2
(cgroup.freeze, as Slurm's `scontrol suspend` on cgroup v2). A SIGTERM to each stays pending (a
handled one, for the frozen holder), so the release used to wait the whole kill_timeout before its
SIGKILL (real H100: 5.3 s with kill_timeout 5). Each now gets SIGKILL at once, and its `killed`
entry says why; check mode says so first. The tests assert that record, never a wall time (the
times measured are printed with -s). Real processes in the host's PID namespace; each test
continues and SIGKILLs what it stopped, thaws what it froze, also when it fails."""
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402
from test_gpu_release import killed_pids, used  # noqa: E402

# A debugger that stopped its tracee and sits at its prompt: every stop is reported to it and it
# resumes none; the tracee leaves only by dying (then this tracer reaps it and exits).
TRACER = r"""
import ctypes, os, sys
PTRACE_SEIZE, PTRACE_INTERRUPT, WALL = 0x4206, 0x4207, 0x40000000
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
pid = int(sys.argv[1])
for request in (PTRACE_SEIZE, PTRACE_INTERRUPT):
    if libc.ptrace(request, pid, None, None) != 0:
        sys.exit("ptrace %#x: errno %d" % (request, ctypes.get_errno()))
while True:
    _pid, status = os.waitpid(pid, WALL)
    if os.WIFEXITED(status) or os.WIFSIGNALED(status):
        break
"""
KILL_TIMEOUT = 30.0


def state(host, pid):
    try:
        with open(f"/proc/{host.init_pid}/root/proc/{pid}/stat") as handle:
            data = handle.read()
    except OSError:
        return None
    return data[data.rindex(")") + 2:].split()[0]


def wait_for(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def release_twice(host, holder, reason):
    """Check mode, then the real run: both say SIGKILL at once for `reason`; the holder is gone."""
    dry = run_module(host, "gpu_release", {"kill_timeout": KILL_TIMEOUT}, check=True, diff=True)
    assert not dry.failed, dry.msg
    assert [(k["pid"], k["signal"], k["sigkill_at_once"]) for k in dry["killed"]] == [(holder.pid, None, reason)]
    assert f"process {holder.pid} python3: SIGKILL at once: {reason}" in dry["diff"]["after"], dry["diff"]["after"]
    assert host.alive(holder.pid)
    run = run_module(host, "gpu_release", {"kill_timeout": KILL_TIMEOUT}, diff=True)
    assert not run.failed and run["released"] is True, run.msg
    entry = killed_pids(run)[holder.pid]
    assert (entry["signal"], entry["sigkill_at_once"]) == ("SIGKILL", reason), entry
    # Never a SIGTERM first: the holder died of the SIGKILL sent at once.
    assert host.exit_status(holder.pid) == -signal.SIGKILL
    assert run["unkillable"] == [] and not host.alive(holder.pid) and used(host, 0) == 0
    print(f"\n[{reason}] exited_after_s {entry['exited_after_s']}, kill_s {run['timings']['kill_s']}, elapsed_s {run['elapsed_s']}, "
          f"wall {run.wall_s:.2f} s (kill_timeout {KILL_TIMEOUT:g})")
    return run


def test_a_stopped_holder_gets_sigkill_at_once(nshost):
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960"])
    try:
        host.kill(holder.pid, signal.SIGSTOP)
        wait_for(lambda: state(host, holder.pid) == "T", "the holder never stopped")
        release_twice(host, holder, "stopped (state T)")
    finally:
        host.kill(holder.pid, signal.SIGCONT)
        host.kill(holder.pid)


def test_a_holder_stopped_by_its_tracer_gets_sigkill_at_once(nshost):
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960"])
    tracer = host.spawn(["python3", "-c", TRACER, str(holder.pid)], ready=False)
    try:
        wait_for(lambda: state(host, holder.pid) == "t" or not tracer.alive(), "the tracer never stopped the holder")
        assert state(host, holder.pid) == "t", tracer.output()
        release_twice(host, holder, "stopped by its tracer (state t)")
        assert tracer.wait_gone(5)  # it reaped its dead tracee and left
    finally:
        host.kill(tracer.pid)
        host.kill(holder.pid)


@pytest.mark.parametrize("handler", [[], ["--term-handler-stays"]], ids=["default-sigterm", "sigterm-handler"])
def test_a_holder_in_a_frozen_cgroup_gets_sigkill_at_once(nshost, handler):
    """cgroup v2's freezer: the frozen task reads S, so its cgroup says it. A fatal signal reaches a
    frozen task (H100: freed in 0.29 s), a handled SIGTERM stays pending (its handler cannot run
    until the cgroup is thawed): SIGKILL at once for both."""
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960"] + handler)
    try:
        cgroup = host.user_cgroup("frozen-job.scope", owner=None)
    except Exception as exc:  # noqa: BLE001 - any reason the machine gives no cgroup2 directory
        pytest.skip(f"no cgroup v2 directory for the holder here: {exc}")
    directory = os.path.join(cgroup2_mount(), cgroup.lstrip("/"))
    host.move_to_cgroup(holder.pid, cgroup)
    try:
        with open(os.path.join(directory, "cgroup.freeze"), "w") as handle:
            handle.write("1")
        wait_for(lambda: "frozen 1" in read(os.path.join(directory, "cgroup.events")), "the cgroup never froze")
        assert state(host, holder.pid) == "S"  # nothing in its own state says it is frozen
        release_twice(host, holder, "in a frozen cgroup (cgroup.freeze)")
    finally:
        try:
            with open(os.path.join(directory, "cgroup.freeze"), "w") as handle:
                handle.write("0")
        except OSError:
            pass
        host.kill(holder.pid)


def read(path):
    with open(path) as handle:
        return handle.read()


def cgroup2_mount():
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _sep, right = line.partition(" - ")
            if right.split()[:1] == ["cgroup2"]:
                return left.split()[4]
    raise AssertionError("user_cgroup made a cgroup2 directory, yet no cgroup2 mount")
