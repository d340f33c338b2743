"""The respawn watch through real ansible-playbook on simulated GPU hosts: a holder that its parent
starts again (a shell loop, a torchrun-like elastic agent) is never reported released; a parent
that does not restart costs nothing (it exits with its holder) or only the window (it lives on).
See plugins/module_utils/_settle.py."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402
from test_gpu_release import killed_pids, used  # noqa: E402

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
