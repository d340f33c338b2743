"""A user's file system that stops answering never hangs root (issue 54 class 4, issue 57): gpu_facts,
gpu_release (and check mode), the audit's gpu_facts, gpu_restore's wait and the Slurm epilog on a simulated host where
an unprivileged user keeps processes on a FUSE mount whose daemon stopped answering
(tests/sim/stall_fs, tests/integration/stalled_fs.py):
- a process with a file of it open: stat() of its fd would wait for good (D state past SIGKILL);
  the scan reads it from the kernel's cache and moves on, and the process holds no GPU;
- a GPU holder with a thread waiting in a page fault on a mapping of it: read like any holder,
  freed by SIGKILL... except that the faulting thread stays in the kernel: the failure says so;
- a process in execve closing a file of it: its /proc/PID/stat, maps, ns/* wait with it. It is
  reported `blocked`, the host is never clean beside it, gpu_release refuses before acting.
Each run ends within its bound (`timeout: 5`; hangs would meet host.run's 180 s and fail)."""
import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim")]
from ansible_in_ns import run_module  # noqa: E402
from supervisor_rig import Supervisord  # noqa: E402
from test_supervisor_release import HOLDER, wait_used  # noqa: E402
from stalled_fs import EXEC_ON_IT, HOLD_OPEN, StalledFs, spawn_user, waits_in_fuse  # noqa: E402
from test_slurm_epilog_smoke import gres_conf  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# gpu_facts and gpu_release with `timeout: 5` end within it plus Ansible's own start (~2-6 s on
# the 2-core machine, more while the suite runs beside).
BOUND_S = 25


def by_pid(records, pid):
    [record] = [r for r in records if r["pid"] == pid]
    return record


@pytest.fixture
def stalled(nshost):
    """(host, mount): a GPU holder of root's on GPU 1, and the user's process with a file of the
    stalled mount open."""
    host = nshost("h200x2", seed="stalled")
    with StalledFs(host) as mount:
        host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
        mount.holder_of_file = spawn_user(host, HOLD_OPEN, mount.data)
        yield host, mount


def test_a_file_open_on_a_stalled_mount_neither_hangs_gpu_facts_nor_makes_a_holder(nshost):
    host = nshost("h200x2", seed="stalledclean")
    with StalledFs(host) as mount:
        holder_of_file = spawn_user(host, HOLD_OPEN, mount.data)
        mount.stall()
        started = time.monotonic()
        run = run_module(host, "gpu_facts", {"timeout": 5})
        assert not run.failed, run.msg
        facts = run["ansible_facts"]["gpu"]
        assert facts["clean"] is True and facts["holders"] == [], facts["holders"]
        assert time.monotonic() - started < BOUND_S
        assert holder_of_file.pid not in [h["pid"] for h in facts["holders"]]


def test_gpu_facts_reports_a_process_that_does_not_answer_as_blocked_and_never_clean(stalled):
    host, mount = stalled
    # A job's leftover in /dev/shm: the look then also reads every process's fds and maps for it.
    assert host.run(["sh", "-c", "head -c 4096 /dev/zero > /dev/shm/nccl-stalled"]).returncode == 0
    stuck = spawn_user(host, EXEC_ON_IT, mount.data, mount.flag)
    mount.stall()
    time.sleep(0.3)  # its execve reaches the close of the file
    run = run_module(host, "gpu_facts", {"timeout": 5})
    assert not run.failed, run.msg
    assert run.wall_s < BOUND_S
    facts = run["ansible_facts"]["gpu"]
    assert facts["clean"] is False
    blocked = by_pid(facts["holders"], stuck.pid)
    assert blocked["blocked"] is True and blocked["attribution"] == "blocked" and blocked["candidate_gpu_indexes"] == [0, 1]
    assert blocked["user"] == "4242" and blocked["state"] in ("S", "D") and blocked["waits_in"], blocked
    assert blocked["cmdline"] == "" and blocked["start_time"] is None
    # The GPU holder beside it is read as ever; the process with a file open is none.
    [holder] = [h for h in facts["holders"] if not h["blocked"]]
    assert holder["gpu_indexes"] == [1] and holder["attribution"] == "listed"
    assert mount.holder_of_file.pid not in [h["pid"] for h in facts["holders"]]
    assert any(f"pid {stuck.pid} python3 (uid 4242" in w and "did not answer" in w for w in run.get("warnings", [])), run.get("warnings")
    # /dev/shm's pass met the same process: it went on, and says a file it holds may be listed unheld.
    assert (facts["shm"]["files"], facts["shm"]["complete"]) == (1, False), facts["shm"]


def test_the_audits_gpu_facts_reports_it_too(stalled):
    """As audit_gpus.yml asks (fail_on_error: false): the host is listed, not clean, with the blocked process."""
    host, mount = stalled
    stuck = spawn_user(host, EXEC_ON_IT, mount.data, mount.flag)
    mount.stall()
    time.sleep(0.3)
    run = run_module(host, "gpu_facts", {"fail_on_error": False, "timeout": 5, "processes": True})
    assert not run.failed and run.wall_s < BOUND_S, run.msg
    facts = run["ansible_facts"]["gpu"]
    assert facts["clean"] is False and facts["error"] is None and by_pid(facts["holders"], stuck.pid)["blocked"] is True


@pytest.mark.parametrize("check", [True, False], ids=["check-mode", "real"])
def test_gpu_release_refuses_before_acting_naming_the_process_that_does_not_answer(stalled, check):
    host, mount = stalled
    gpu_holder = host.smi("--query-compute-apps=pid", "--format=csv,noheader").stdout.split()
    stuck = spawn_user(host, EXEC_ON_IT, mount.data, mount.flag)
    mount.stall()
    time.sleep(0.3)
    run = run_module(host, "gpu_release", {"timeout": 5, "kill_timeout": 1, "wait_timeout": 5}, check=check)
    assert run.failed and run.wall_s < BOUND_S
    assert run.msg.startswith(f"cannot free GPU 0,1: pid {stuck.pid} python3 (uid 4242, state "), run.msg
    assert "did not answer" in run.msg and "Nothing was stopped or signalled" in run.msg and "/sys/fs/fuse/connections" in run.msg
    assert run.get("killed", []) == []
    assert gpu_holder and all(host.alive(int(pid)) for pid in gpu_holder)


def test_a_holder_faulting_on_the_stalled_mount_is_read_and_its_thread_stuck_after_sigkill_is_said(nshost):
    host = nshost("h200x2", seed="stalledfault")
    with StalledFs(host) as mount:
        holder = host.spawn_as(4242, ["gpu_holder", "--gpus", "0", "--mib", "1024", "--fault-on", mount.data, "--fault-when", mount.flag])
        holder_host_pid = holder.host_pid
        mount.stall()
        assert waits_in_fuse(holder_host_pid), "the page fault did not reach the daemon"
        facts = run_module(host, "gpu_facts", {"timeout": 5})
        assert not facts.failed and facts.wall_s < BOUND_S, facts.msg
        record = by_pid(facts["ansible_facts"]["gpu"]["holders"], holder.pid)
        assert record["blocked"] is False and record["gpu_indexes"] == [0] and record["user"] == "4242"

        run = run_module(host, "gpu_release", {"timeout": 5, "kill_timeout": 1, "wait_timeout": 3})
        assert run.failed and run.wall_s < BOUND_S
        assert f"pid {holder.pid}" in run.msg and "unkillable (outlived SIGKILL: a thread of it stays in the kernel, D state" in run.msg, run.msg
        assert "a reboot is needed" in run.msg
        assert [k["signal"] for k in run["killed"] if k["pid"] == holder.pid] == ["SIGKILL"]
    # The daemon's end aborted the connection: the thread got out and the holder ended.
    assert host.wait_gone(holder.pid, 10)


def pack_runner(tmp_path):
    out = tmp_path / "slurm_gpu_checks.pyz"
    subprocess.run(["/usr/bin/python3", os.path.join(REPO, "roles", "slurm_gpu_checks", "files", "pack_runner.py"),
                    os.path.join(REPO, "plugins", "module_utils"), str(out)], check=True, capture_output=True)
    return str(out)


def epilog(host, runner, tmp_path, job, gpus="0,1", **options):
    """The hook as slurmd calls it (tests/integration/test_slurm_epilog_smoke.py) -> (rc, stderr, log entry, wall s)."""
    config, log = tmp_path / f"config-{job}.json", tmp_path / f"log-{job}.jsonl"
    config.write_text(json.dumps(dict({"drain": False, "log": str(log)}, **options)))
    config.chmod(0o600)
    gres_conf(host)  # the node's gres.conf: Slurm's GPU numbers mapped to GPUs (issue 69)
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd",
           "SLURM_CONF": "/etc/slurm/slurm.conf", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    started = time.monotonic()
    proc = host.run(["/usr/bin/python3", runner, "epilog", f"--config={config}"], env=env, timeout=120)
    return proc.returncode, proc.stderr, json.loads(log.read_text().splitlines()[-1]), time.monotonic() - started


def test_the_epilog_fails_within_its_bound_naming_the_process_that_does_not_answer(stalled, tmp_path):
    host, mount = stalled
    runner = pack_runner(tmp_path)
    stuck = spawn_user(host, EXEC_ON_IT, mount.data, mount.flag)
    mount.stall()
    time.sleep(0.3)
    rc, stderr, entry, wall = epilog(host, runner, tmp_path, "901", timeout=5)
    assert (rc, entry["ok"]) == (1, False) and wall < BOUND_S, stderr
    # Each GPU names what may hold it, the process that did not answer among them; nothing was signalled.
    assert [c.split(", ")[0] for c in entry["causes"]] == ["GPU 0: 4 MiB", "GPU 1: 2057 MiB"], entry["causes"]
    assert all(f"pid {stuck.pid} python3 (did not answer: a stalled file system?)" in c for c in entry["causes"]), entry["causes"]
    assert stderr.startswith("zeromib: epilog job 901: GPU 0: 4 MiB, held by ") and entry["killed"] == []


def test_gpu_restores_wait_for_gpus_ends_beside_a_process_that_does_not_answer(nshost):
    """gpu_restore's wait_for_gpus scans /proc every 0.5 s with the look's bounded reads: the
    restarted program is seen holding its GPU again and the module returns, the user's process
    that does not answer notwithstanding (each scan gives it its budget, then moves on)."""
    host = nshost("h200x1", seed="stalledrestore")
    Supervisord(host, {"vllm": HOLDER})
    assert wait_used(host, 0, 8192)
    run = run_module(host, "gpu_release", {"services": ["supervisor:vllm"]})
    assert not run.failed and run["released"] is True, run.msg
    with StalledFs(host) as mount:
        spawn_user(host, EXEC_ON_IT, mount.data, mount.flag)
        mount.stall()
        time.sleep(0.3)
        restore = run_module(host, "gpu_restore", {"wait_for_gpus": 20})
        assert not restore.failed and restore.wall_s < BOUND_S, restore.msg
        assert restore["started_programs"] == ["vllm"] and restore["gpus_held"] == {"vllm": [0]}, restore.result
        # The user's process is left as it was (not read here: a plain read of its /proc/PID/stat would wait with it).


STAT_IN_A_FORKED_READER = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads
started = time.monotonic()
outcome = _bounded_reads.scan(lambda path: os.stat(path).st_ino, [sys.argv[2], "/"], budget=0.3, isolate=True)
print(json.dumps({"blocked": outcome.blocked, "read": sorted(outcome.results), "left": _bounded_reads._LEFT, "s": time.monotonic() - started}))
"""


def test_a_plain_stat_of_the_stalled_file_waits_in_d_state_and_only_a_forked_reader_is_left_there(nshost):
    """Why stats of other processes' files never run in the module itself: os.stat of the user's
    fd waits in fuse's request_wait_answer, in D state once SIGKILLed. The forked reader is left
    there holding none of the caller's files: the caller's stdout pipe closes when it exits (else
    host.run would wait for good)."""
    host = nshost("h200x1", seed="stalledstat")
    with StalledFs(host) as mount:
        holder_of_file = spawn_user(host, HOLD_OPEN, mount.data)
        link = f"/proc/{holder_of_file.pid}/fd/3"
        mount.stall()
        proc = host.run(["/usr/bin/python3", "-c", STAT_IN_A_FORKED_READER, os.path.join(REPO, ".build", "collections"), link], timeout=60)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["blocked"] == [[0, "request_wait_answer"]] and result["read"] == [1] and result["s"] < 5, result
        [left] = result["left"]
        with open(f"/proc/{host.host_pid(left)}/status") as handle:
            assert "State:\tD (disk sleep)" in handle.read()
