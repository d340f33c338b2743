"""A zombie leader whose thread holds the GPU (issue 57): the main thread of a CUDA process exited
(pthread_exit, SYS_exit) while a worker keeps the context; `ps` shows `Zl <defunct>`, its own
/proc/PID/fd and maps read empty, nvidia-smi lists the PID as `[No data]` with its memory (real
H100, driver 580.159.04: 4706 MiB; a SIGKILL to the thread group freed it in 0.19 s). gpu_facts,
check mode, gpu_release and the Slurm epilog treat it as the live process it is.
(`gpu_holder --zombie-leader`: tests/sim/README.md.)"""
import os
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402
from test_stalled_fs import epilog, pack_runner  # noqa: E402


def used(host, index):
    return int(host.smi("-i", str(index), "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout)


@pytest.fixture
def zombie(nshost):
    """(host, the zombie leader's HostProc) on GPU 0, the user's."""
    host = nshost("h200x2", seed="zombie")
    holder = host.spawn_as(4242, ["gpu_holder", "--gpus", "0", "--mib", "4096", "--zombie-leader"])
    try:
        assert wait_zombie(host, holder.pid), "the leader did not turn zombie"
        yield host, holder
    finally:
        # A zombie leader is not `alive` for NsHost; its threads end with a SIGKILL to the group.
        host.kill(holder.pid, signal.SIGKILL)


def wait_zombie(host, pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if host._state(pid) == "Z":
            return True
        time.sleep(0.01)
    return False


def test_nvidia_smi_lists_it_with_its_memory_and_no_name(zombie):
    host, holder = zombie
    apps = host.smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader").stdout
    assert apps.strip() == f"{holder.pid}, [No data], 4096 MiB" and used(host, 0) >= 4096


def test_gpu_facts_reports_the_zombie_leader_as_the_holder_of_its_gpu(zombie):
    host, holder = zombie
    run = run_module(host, "gpu_facts")
    assert not run.failed, run.msg
    facts = run["ansible_facts"]["gpu"]
    [record] = facts["holders"]
    assert (record["pid"], record["state"], record["gpu_indexes"], record["attribution"], record["user"]) == (holder.pid, "Z", [0], "listed", "4242")
    assert "/dev/nvidia0" in record["devices"] and record["cmdline"].startswith("python3 /usr/bin/gpu_holder")
    assert record["start_time"] and facts["clean"] is False


def test_check_mode_plans_to_signal_it(zombie):
    host, holder = zombie
    run = run_module(host, "gpu_release", check=True)
    assert not run.failed, run.msg
    assert [(k["pid"], k["signal"], k["gpu_indexes"]) for k in run["killed"]] == [(holder.pid, None, [0])]
    assert run["killed"][0]["sigkill_at_once"] == "its main thread has exited (zombie leader, state Z)"
    assert host._state(holder.pid) == "Z" and used(host, 0) >= 4096


def test_gpu_release_frees_it_by_signalling_the_thread_group(zombie):
    host, holder = zombie
    run = run_module(host, "gpu_release", {"kill_timeout": 2})
    assert not run.failed, run.msg
    [entry] = run["killed"]
    # SIGKILL at once: a SIGTERM handler of its (exited) main thread could never run.
    assert (entry["pid"], entry["signal"]) == (holder.pid, "SIGKILL") and entry["exited_after_s"] < 2, entry
    assert run["released"] is True and used(host, 0) == 0


def test_the_epilog_frees_it(zombie, tmp_path):
    host, holder = zombie
    rc, stderr, entry, _wall = epilog(host, pack_runner(tmp_path), tmp_path, "902", gpus="0")
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), stderr
    assert [k["pid"] for k in entry["killed"]] == [holder.pid] and used(host, 0) == 0
