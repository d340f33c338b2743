"""The tenant `other_job`: another Slurm job on the same node, its processes in its own cgroup, some
of them blocked. The kernel's cgroup path is the witness of whose job a process is (_look/_jobs):
slurmstepd makes `.../slurmstepd.scope/job_N/step_S/user/task_T` with cgroup v2, root's. Test
support, not collected.

- `task_cgroup(host, job)`: such a cgroup of `job` on a namespace host (real cgroup v2 directories
  below the host's own, removed with the host).
- `leftover(host, job, gpu, mib)`: what a job left on a GPU, a process of the user in the job's cgroup.
- `blocked_processes(host, mount, job, count)`: `count` processes of the user stuck in execve on
  her own stalled FUSE mount (tenants.stalled_fuse), in `job`'s cgroup: what its user can do to
  every other job's epilog on the node.

Every process is the host's (started through it, ended with it); the FUSE daemon's end (the
mount's stop) lets the blocked ones go on.
"""
import time

from tenants.stalled_fuse import USER, blocked_in_execve, move_to_cgroup


def task_cgroup(host, job, step="0", task="0"):
    """A task cgroup of `job` as slurmstepd makes it (cgroup v2, root's) -> its path as
    /proc/PID/cgroup shows it."""
    return host.user_cgroup(f"system.slice/slurmstepd.scope/job_{job}/step_{step}/user/task_{task}", owner=None)


def leftover(host, job, gpu=0, mib=2048, uid=USER, timeout=15.0):
    """What `job` left: the user's CUDA process on GPU `gpu` (holding `mib`), in the job's task
    cgroup; returned once nvidia-smi charges its memory."""
    proc = host.spawn_as(uid, ["gpu_holder", "--gpus", str(gpu), "--mib", str(mib)])
    move_to_cgroup(proc, task_cgroup(host, job))
    deadline = time.monotonic() + timeout
    while _used(host, gpu) < mib:
        assert time.monotonic() < deadline, f"GPU {gpu} never read {mib} MiB"
        time.sleep(0.05)
    return proc


def blocked_processes(host, mount, job, count=30):
    """`count` processes of `job`'s user stuck in execve on her stalled mount, in `job`'s cgroup
    (the mount is stalled here) -> their HostProcs."""
    return blocked_in_execve(host, mount, count, cgroup=task_cgroup(host, job, step="batch"))


def _used(host, gpu):
    out = host.smi("--query-gpu=index,memory.used", "--format=csv,noheader,nounits").stdout
    return {int(i): int(m) for i, m in (line.split(", ") for line in out.strip().splitlines())}.get(gpu, 0)
