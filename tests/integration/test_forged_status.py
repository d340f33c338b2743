"""A process name that spells /proc/PID/status fields (issue 65), through real ansible-playbook on
a simulated GPU host.

A user's CUDA job names itself "x\\x0bThreads:\\t9" (prctl, 11 bytes): the kernel prints the \\x0b
of the Name: line as it is, and a reader that splits the file with str.splitlines() read the
forged Threads: line first. The job's parent never reaps it, so once signalled it is a zombie with
no thread left; read with the forged count it was a live zombie leader, and gpu_release waited on
it past kill_timeout, sent SIGKILL, waited again and called it unkillable ("a reboot is needed").
Read at "\\n" only (the one reader, _holders.read_status) it is gone at once."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402

USER = 4242
FORGED_NAME = "x\x0bThreads:\t9"
# The job's parent: starts the holder with the forged name and never waits for it (its zombie stays).
PARENT = """
import subprocess, sys, time
subprocess.Popen(["/usr/bin/gpu_holder", "--gpus", "0", "--mib", "2048", "--name", sys.argv[1], "--ready-file", sys.argv[3]])
while True:
    time.sleep(3600)
"""


def state(host, pid):
    return host._state(pid)


def test_a_job_named_like_a_status_line_is_freed_at_once_and_never_called_unkillable(nshost):
    host = nshost("h200x2")
    parent = host.spawn_as(USER, ["/usr/bin/python3", "-c", PARENT, FORGED_NAME], ready=True)
    job = parent.info["pid"]
    try:
        with open(f"/proc/{host.host_pid(job)}/status", "rb") as handle:
            assert handle.read().startswith(b"Name:\tx\x0bThreads:\t9\n")  # the kernel's line, \x0b raw
        kill_timeout = 5
        run = run_module(host, "gpu_release", {"gpus": [0], "kill_timeout": kill_timeout, "settle_timeout": 1})
        assert not run.failed, run.msg
        [entry] = run["killed"]
        assert entry["pid"] == job and entry["name"] == FORGED_NAME and entry["signal"] == "SIGTERM", entry
        assert run["unkillable"] == [] and run["released"] is True
        # Gone as soon as it exited: no wait for kill_timeout (the old reading waited about twice it).
        timings = run["timings"]
        assert entry["exited_after_s"] < kill_timeout and timings["kill_s"] + timings["wait_s"] < kill_timeout, (entry, timings)
        assert state(host, job) == "Z"  # still unreaped: its parent never waits
        assert host.alive(parent.pid)
    finally:
        host.kill(parent.pid)
