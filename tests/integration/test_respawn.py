"""The respawn watch through real ansible-playbook on simulated GPU hosts: a holder that its parent
starts again (a shell loop, a torchrun-like elastic agent) is never reported released; a parent
that does not restart costs nothing (it exits with its holder) or only the window (it lives on).
See plugins/module_utils/_act/_settle.py."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytest  # noqa: E402
from ansible_in_ns import run_module  # noqa: E402
from test_gpu_release import killed_pids, used  # noqa: E402
from test_slurm_epilog_smoke import children, cmdline, task_cgroup, twins  # noqa: E402

# A torchrun-shaped elastic agent: starts its worker, restarts it when it dies (up to
# --max-restarts), ends it on SIGTERM. Run as `python3 .../torchrun ...`, so its script name is
# torchrun, as for the real console script.
AGENT = r'''
import signal, subprocess, sys, time
args = sys.argv[1:]
restarts = int(args[1]) if args[:1] == ["--max-restarts"] else 3
worker = args[args.index("--") + 1:]
child = None
def stop(*_):
    if child and child.poll() is None:
        child.terminate()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
for attempt in range(restarts + 1):
    child = subprocess.Popen(worker)
    child.wait()
    time.sleep(0.1)  # monitor_interval of torch 2.x's agent
'''


def wait_used(host, index, at_least, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if used(host, index) >= at_least:
            return True
        time.sleep(0.05)
    return False


def holder_under(host, parent_pid):
    out = host.run(["ps", "-o", "pid=", "--ppid", str(parent_pid)]).stdout.split()
    return [int(pid) for pid in out]


def test_shell_loop_that_restarts_its_holder_fails_naming_the_loop(nshost):
    host = nshost("h200x1")
    loop = host.spawn(["sh", "-c", "while true; do gpu_holder --gpus 0 --mib 4096; done"])
    assert wait_used(host, 0, 4096)
    [first] = holder_under(host, loop.pid)
    run = run_module(host, "gpu_release", {"wait_timeout": 20})
    assert run.failed and run["released"] is False, run.msg
    assert first in killed_pids(run)
    assert f"started again by its parent pid {loop.pid} sh [sh -c while true; do gpu_holder --gpus 0 --mib 4096; done]" in run.msg
    assert f"end pid {loop.pid} first (kill {loop.pid})" in run.msg
    # Named within the watch, not after wait_timeout.
    assert run["elapsed_s"] < 8 and host.alive(loop.pid)


def test_torchrun_like_agent_that_restarts_its_worker_is_named_and_goes_first(nshost):
    host = nshost("h200x1")
    script = os.path.join(host.dir, "torchrun")
    with open(script, "w") as handle:
        handle.write(AGENT)
    agent = host.spawn(["python3", script, "--max-restarts", "3", "--", "gpu_holder", "--gpus", "0", "--mib", "8192"])
    assert wait_used(host, 0, 8192)
    [worker] = holder_under(host, agent.pid)
    run = run_module(host, "gpu_release", {"wait_timeout": 20})
    assert run.failed and run["released"] is False and worker in killed_pids(run), run.msg
    assert f"started again by its parent pid {agent.pid} python3 [python3 {script} --max-restarts 3" in run.msg
    assert f"torchrun's elastic agent restarts its workers (--max-restarts): the agent goes first: end pid {agent.pid}" in run.msg
    # Doing what the message says frees the GPU for good.
    host.kill(agent.pid, 15)
    assert host.wait_gone(agent.pid)
    again = run_module(host, "gpu_release")
    assert not again.failed and again["released"] is True, again.msg
    assert used(host, 0) == 0


def test_parent_that_exits_with_its_holder_costs_no_window(nshost):
    host = nshost("h200x1")
    parent = host.spawn(["sh", "-c", "gpu_holder --gpus 0 --mib 4096; echo worker ended"])
    assert wait_used(host, 0, 4096)
    run = run_module(host, "gpu_release")
    assert not run.failed and run["released"] is True, run.msg
    assert run["timings"]["settle_s"] < 0.5 and not host.alive(parent.pid) and used(host, 0) == 0


def test_parent_that_lives_on_without_restarting_costs_the_window_not_a_failure(nshost):
    host = nshost("h200x1")
    parent = host.spawn(["sh", "-c", "gpu_holder --gpus 0 --mib 4096; sleep 600"])
    assert wait_used(host, 0, 4096)
    run = run_module(host, "gpu_release", {"settle_timeout": 1.5})
    assert not run.failed and run["released"] is True, run.msg
    # sleep is a new child of the parent, but neither the killed command nor a GPU holder.
    assert 1.4 <= run["timings"]["settle_s"] < 2.5 and host.alive(parent.pid) and used(host, 0) == 0


def test_holder_started_by_init_has_no_window(nshost):
    host = nshost("h200x1")
    host.spawn(["gpu_holder", "--gpus", "0", "--mib", "4096"])
    run = run_module(host, "gpu_release")
    assert not run.failed and run["released"] is True and run["timings"]["settle_s"] == 0.0, run.msg


# --- issue 31: a name never stops the watch; a restart from outside the parents is a restart

USER = 4242


def test_users_loop_named_sshd_is_watched_like_any_parent(nshost):
    """`exec -a sshd sh -c 'while true; do train; sleep 1; done'` as uid 4242: the walk up stops
    only at a protected daemon the identity rule vouches for, so the loop is watched and named."""
    host = nshost("h200x1")
    script = 'exec -a sshd sh -c "while true; do gpu_holder --gpus 0 --mib 4096; sleep 1; done"'
    loop = host.spawn_as(USER, ["bash", "-c", script], ready=False)
    assert wait_used(host, 0, 4096)
    assert host.read(f"/proc/{loop.pid}/cmdline").split("\0")[0] == "sshd"
    [first] = holder_under(host, loop.pid)
    run = run_module(host, "gpu_release", {"wait_timeout": 20})
    assert run.failed and run["released"] is False, run.msg
    assert first in killed_pids(run) and run["timings"]["settle_s"] > 0
    assert f"started again by its parent pid {loop.pid} sh [sshd -c while true; do gpu_holder" in run.msg, run.msg
    assert host.alive(loop.pid)


# A double-forked watcher: it restarts its job detached, so the job's parent is init. The job's
# CUDA init takes 3 s (a real one takes 1-3 s): the GPU reads clean while it runs again.
WATCHER = """
while true; do
  if ! kill -0 "$(cat {pidfile} 2>/dev/null)" 2>/dev/null; then
    (gpu_holder --gpus 0 --mib 4096 --init-delay 6 >/dev/null 2>&1 & echo $! > {pidfile})
  fi
  sleep 0.02
done
"""


def test_restart_by_a_double_forked_watcher_outside_the_parent_chain_fails_the_run(nshost):
    host = nshost("h200x1")
    pidfile = os.path.join(host.dir, "job.pid")
    script = os.path.join(host.dir, "watch.sh")
    with open(script, "w") as handle:
        handle.write(WATCHER.format(pidfile=pidfile))
    # Detached itself (setsid, its starter gone): neither it nor the job has a parent to watch.
    host.run(["sh", "-c", f"setsid sh {script} >/dev/null 2>&1 < /dev/null &"], check=True)
    assert wait_used(host, 0, 4096, timeout=30)
    with open(pidfile) as handle:
        first = int(handle.read())
    assert host.read(f"/proc/{first}/stat").split(")")[1].split()[1] == "1"  # the job's parent is init
    # The driver frees a killed context's memory a moment after the process is gone (2 s here), so
    # the restart runs the killed command line when the GPU first reads clean: it is recognised by
    # that command line, and on its way there it is `sh`, then `env python`, then `python` (with a
    # 1 s delay, one run under the whole suite's load said released, most likely read before the
    # restart got there). Its "CUDA init" (6 s) holds no memory before that reading.
    host.set_fault({"release_delay_s": 2})
    run = run_module(host, "gpu_release", {"wait_timeout": 10})
    assert run.failed and run["released"] is False, (run.msg, run.result, host.run(["ps", "-eo", "pid,ppid,lstart,args"]).stdout)
    assert first in killed_pids(run)
    assert f"runs the command line of killed pid {first} again" in run.msg, run.msg
    assert "the GPUs read clean, but something this run killed was started again" in run.msg
    assert "Something outside the holder's parents restarts it" in run.msg
    # No window was needed: no parent of the job survived.
    assert run["timings"]["settle_s"] == 0.0


# --- issue 54: a scheduler's job, where its cgroup says so, is whose a process is


@pytest.mark.parametrize("where, restart", [("another job", False), ("no job", True)])
def test_gpu_release_takes_the_killed_argv_in_another_jobs_cgroup_for_that_jobs_task_not_a_restart(nshost, where, restart):
    """gpu_release frees a leftover of Slurm job 801 (its cgroup, as slurmstepd makes it, read
    before the signal); the same argv started again right after, by root as the same user, is
    job 802's next task in job 802's cgroup (released), or a restart outside any job (fails)."""
    host = nshost("h200x2", seed="twins")
    left, stepd = twins(host, task_cgroup(host, 802) if where == "another job" else None)
    before = cmdline(host, left.pid)
    run = run_module(host, "gpu_release", {"gpus": [0], "wait_timeout": 10})
    assert list(killed_pids(run)) == [left.pid], run.msg
    [task] = children(host, stepd.pid)
    assert cmdline(host, task) == before and host.alive(task)
    if restart:
        assert run.failed and run["released"] is False, run.msg
        assert f"runs the command line of killed pid {left.pid} again, started by pid {stepd.pid} sh" in run.msg, run.msg
    else:
        assert not run.failed and run["released"] is True, run.msg
        assert used(host, 0) == 0
