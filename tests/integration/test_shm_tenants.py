"""clean_shm and another user's live shared memory (issue 65), through real ansible-playbook on
simulated GPU hosts, with a real unprivileged uid as the tenant (tests/tenants/shm_user.py).

uid 4343's data service made a named block (/dev/shm/psm_<8 hex>) and closed its handle without
unlinking it, as Python documents for a block others attach to by name: no process holds the file,
yet it is live. Freeing another job's GPU with clean_shm removed it, and her next reader got
FileNotFoundError. Now a file goes only when it ties to a process the run ended: its name names
that PID (torch_<pid>_*), or its owner had processes ended and runs none that could open it."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ansible_in_ns import run_module  # noqa: E402
from test_shm_and_reset import JOB, job, names, refusal, shm_files  # noqa: E402

from tests.tenants.shm_user import attach, shm_user  # noqa: E402

KILLED = 4242
HOLDER = ["/usr/bin/gpu_holder", "--gpus", "0", "--mib", "2048"]


def kept(run):
    return [(os.path.basename(k["path"]), k["why"]) for k in run["shm_kept"]]


def test_freeing_another_users_gpu_keeps_her_live_block_and_removes_the_killed_jobs_leftovers(nshost):
    host = nshost("h200x2")
    with shm_user(host, uid=4343, gpu=1) as her:
        # uid 4242's job on GPU 0: its NCCL segment open, a PyTorch segment named with its PID.
        killed = job(host, "open:nccl-Job042:4", "map:torch_{pid}_7_0:8", user=KILLED, then=HOLDER)
        torch = f"torch_{killed.pid}_7_0"
        assert her.block.startswith("psm_") and her.block in shm_files(host) and attach(host, her) is True
        why = [(her.block, "this run ended no process of its owner (uid 4343)")]

        plan = run_module(host, "gpu_release", {"gpus": [0], "clean_shm": True}, check=True)
        assert not plan.failed, plan.msg
        assert names(plan["shm_removed"]) == [torch] and kept(plan) == why

        run = run_module(host, "gpu_release", {"gpus": [0], "clean_shm": True})
        assert not run.failed, run.msg
        assert [k["pid"] for k in run["killed"]] == [killed.pid] and run["released"] is True
        assert names(run["shm_removed"]) == [torch, "nccl-Job042"] and kept(run) == why
        assert run["shm_kept"][0]["user"] == "4343" and run["shm_kept"][0]["pattern"] == "psm_*"
        # Her block is there and her reader finds its data; her job on GPU 1 was never touched.
        assert shm_files(host) == [her.block] and attach(host, her) is True
        assert host.alive(her.service.pid) and host.alive(her.job.pid)
        assert not [w for w in run.get("warnings") or [] if "clean_shm" in w]


def test_her_own_killed_jobs_pid_named_leftover_goes_but_nothing_her_live_service_may_use(nshost):
    """The same uid: her job on GPU 0 is the one ended, her service lives on. Only the file whose
    name names the ended PID goes; her NCCL segment, named by no PID, stays with the reason."""
    host = nshost("h200x2")
    with shm_user(host, uid=4343, gpu=None) as her:
        mine = job(host, "open:nccl-Her001:4", "map:torch_{pid}_3_0:8", user=4343, then=HOLDER)
        run = run_module(host, "gpu_release", {"gpus": [0], "clean_shm": True})
        assert not run.failed, run.msg
        assert names(run["shm_removed"]) == [f"torch_{mine.pid}_3_0"]
        [(first, why_nccl), (second, why_block)] = kept(run)
        assert (first, second) == ("nccl-Her001", her.block), kept(run)
        for why in (why_nccl, why_block):
            assert why.startswith(f"its owner (uid 4343) runs processes this run did not end, which may use it (pid {her.service.pid:d} python3"), why
        assert attach(host, her) is True and sorted(shm_files(host)) == sorted([her.block, "nccl-Her001"])


def test_the_role_says_what_clean_shm_kept_and_why_in_its_line(nshost):
    from test_gpu_health_gate import run_role
    host = nshost("h200x2")
    with shm_user(host, uid=4343, gpu=1) as her:
        killed = job(host, "map:torch_{pid}_7_0:8", user=KILLED, then=HOLDER)
        outcome = run_role(host, {"free_gpus_gpus": [0], "free_gpus_clean_shm": True})
        assert not outcome["failed"], outcome["msg"]
        result = outcome["result"]
        assert result["shm_removed"] == [f"/dev/shm/torch_{killed.pid}_7_0"]
        assert [(k["path"], k["why"]) for k in result["shm_kept"]] == [(f"/dev/shm/{her.block}", "this run ended no process of its owner (uid 4343)")]
        assert (f"kept 1 file of /dev/shm (1 MiB): /dev/shm/{her.block} (this run ended no process of its owner (uid 4343))"
                in result["message"]), result["message"]
        assert attach(host, her) is True


def test_clean_shm_refuses_a_container_whose_ipc_namespace_a_pod_may_share(nshost):
    """A Kubernetes pod's container (docker --ipc=container:NAME alike): its /dev/shm is the tmpfs
    the runtime mounted for the pod's IPC namespace, which the pod's other containers share from
    PID namespaces of their own, so their processes are not visible here. The killed job's own
    leftover ties to this run, and still nothing goes."""
    host = nshost("h200x1", shm_source="shm")
    killed = job(host, "map:torch_{pid}_1_0:4", user=KILLED, then=HOLDER)
    for check in (True, False):
        run = run_module(host, "gpu_release", {"clean_shm": True}, check=check)
        assert not run.failed, run.msg
        assert run["shm_removed"] == [] and shm_files(host) == [f"torch_{killed.pid}_1_0"]
        assert refusal(run) == ("clean_shm: nothing was removed: /dev/shm is the tmpfs a container runtime made for this container's IPC "
                                "namespace (source \"shm\"), which other containers may share (the containers of one Kubernetes pod, docker "
                                "--ipc=container:NAME) with processes this run cannot see, so a process there may hold a file that no process "
                                "here holds (clean it on the host)"), refusal(run)


# Container B of the pod: a PID namespace of its own inside the host, its IPC namespace and /dev/shm
# the host's (container A's, as a pod's containers share the pause container's). B starts her job
# on GPU 0 as uid 4343, waits for its CUDA init, then becomes ansible-playbook ("$@").
POD_SIBLING = ('setpriv --reuid 4343 --regid 4343 --clear-groups -- /usr/bin/python3 "$0" "open:nccl-Pod001:4" "map:torch_{pid}_1_0:4" '
               'exec /usr/bin/gpu_holder --gpus 0 --mib 1024 --ready-file "$READY" & '
               'while [ ! -e "$READY" ]; do sleep 0.05; done; exec "$@"')


def test_a_pods_container_never_removes_a_block_of_a_process_in_another_container_of_the_pod(nshost):
    """The pod for real: her data service runs in container A; her job runs in container B, which
    shares A's IPC namespace and /dev/shm but sees none of A's processes. gpu_release in B ends her
    job; from B her block is held by no process and her uid runs nothing, so only the refusal
    keeps it."""
    host = nshost("h200x1", shm_source="shm")
    with shm_user(host, uid=4343, gpu=None) as her:
        ready = os.path.join(host.dir, "ready", "pod-sibling.json")
        prefix = ["env", f"READY={ready}", "unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "/bin/sh", "-c", POD_SIBLING, JOB]
        run = run_module(host, "gpu_release", {"clean_shm": True}, argv_prefix=prefix)
        assert not run.failed, run.msg
        with open(ready) as handle:
            job_pid = json.load(handle)["pid"]  # as B sees it
        assert [(k["pid"], k["gpu_indexes"]) for k in run["killed"]] == [(job_pid, [0])] and run["released"] is True
        assert run["shm_removed"] == [] and host.alive(her.service.pid) and attach(host, her) is True
        assert sorted(shm_files(host)) == sorted([her.block, "nccl-Pod001", f"torch_{job_pid}_1_0"])
        assert refusal(run).startswith("clean_shm: nothing was removed: /dev/shm is the tmpfs a container runtime made"), refusal(run)
