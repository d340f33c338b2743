"""One user cannot take the node down, with real Slurm (issue 66): job B's user leaves 30 of her
job's processes stuck in execve on her own FUSE mount (each closing an O_CLOEXEC fd of it while the
daemon stops answering: root's reads of their /proc/PID/stat, maps, environ and ns/* wait). Job A
on the same node leaves a holder on its GPU and ends: slurmd runs the epilog the role
zeromib.gpu.slurm_gpu_checks installs, which must free A's leftover and pass within its bound.
Before issue 66 it failed on the processes it could not read and slurmd drained the node for
everyone. Job B's own epilog then fails alone, saying why (its processes do not answer). Where
Slurm's own end of job B waits with her processes (slurm_waits_on_them: slurmd never gets to the
epilog), that is asserted to be Slurm's wait, and the epilog is run as slurmd would run it.

The fleet's hosts have no /dev/fuse: the FUSE daemon (tests/sim/stall_fs, the tenant kit's
stalled file system) runs on this machine, opens its /dev/fuse and mounts in the host's mount
namespace (nspawn's propagation directory does not reach the host here: this machine's mounts are
not shared); the processes that block on it are the job user's, started by her job through sbatch. Teardown (also on failure):
the daemon is killed (the connection aborts, every waiter goes on), the mount unmounted, the
user's processes ended by the PIDs her job wrote.

Slurm's proctrack/cgroup on cgroup v2 (test_slurm_checks_fleet's cgroup_v2_host): with the fleet's
default proctrack/linuxproc, Slurm itself is taken down first. Measured here: job A's slurmstepd,
ending the job, walks every process of the node and waits in do_task_stat on /proc/PID/stat of a
blocked one; job A stays RUNNING and its epilog never runs until the daemon dies. No hook can
help there: the guide's advice (proctrack/cgroup) is what avoids it.

Runs on a fleet of 1 or more hosts: `ZEROMIB_FLEET_HOSTS=1 ZEROMIB_FLEET_PROFILE=h200 pytest tests/fleet/test_slurm_blocked_fleet.py`."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios import wait_for
from test_slurm_checks_fleet import JOB_USER, as_user, cgroup_of, drained, ended, hook_runs, job, leave_behind, node, ready_pid, submit, submit_as_user
from test_slurm_checks_fleet import cgroup_v2_host, gres_host, slurm_node  # noqa: F401  # pylint: disable=unused-import  # fixtures, used by name

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
from tenants.stalled_fuse import EXEC_ON_IT  # noqa: E402

STALL_FS = TESTS / "sim" / "stall_fs"
# Where the role puts the hooks slurm.conf names (roles/slurm_gpu_checks/defaults/main.yml).
HOOK_DIR = "/usr/local/libexec/zeromib-gpu"
COUNT = 30
STUCK = "/run/zeromib-stuck"
# The epilog's own deadline is 60 s (PrologEpilogTimeout); the one with one leftover takes a few
# seconds. Far below what failed before: the scan's 10 s deadline, then the failure and the drain.
BOUND_S = 30


class HostStall:
    """stall_fs mounted in `host`'s mount namespace at `self.inside`, owned by the job user
    (allow_other); the daemon runs on this machine (it opens this machine's /dev/fuse, then enters
    the host's mount namespace to mount), so it is in no process table the host's hooks read."""

    def __init__(self, fleet, host: str):
        self.fleet, self.host = fleet, host
        self.inside = f"{STUCK}/fuse"
        self.flag = f"{STUCK}/stall"
        self.daemon: subprocess.Popen | None = None

    def __enter__(self):
        uid = int(self.fleet.ssh(self.host, f"id -u {JOB_USER}", check=True).stdout)
        self.fleet.ssh(self.host, f"mkdir -p {self.inside}", check=True)
        init = host_init(self.fleet, self.host)
        self.daemon = subprocess.Popen([sys.executable, str(STALL_FS), self.inside, "--flag", self.flag, "--uid", str(uid),
                                        "--ready", f"{STUCK}/fuse.ready", "--allow-other", "--enter", str(init)],
                                       stdin=subprocess.DEVNULL)
        try:
            assert wait_for(lambda: self.fleet.ssh(self.host, f"test -e {STUCK}/fuse.ready && test -f {self.inside}/data").returncode == 0,
                            timeout=15), "stall_fs did not mount in the host"
        except BaseException:
            self.stop()
            raise
        return self

    def stall(self):
        self.fleet.ssh(self.host, f"touch {self.flag}", check=True)

    def stop(self):
        if self.daemon is not None:
            try:
                os.kill(self.daemon.pid, signal.SIGKILL)  # aborts the connection: every waiter goes on
            except ProcessLookupError:
                pass
            self.daemon.wait(timeout=30)
            self.daemon = None
        self.fleet.ssh(self.host, f"umount -l {self.inside} 2>/dev/null; true")

    def __exit__(self, *exc):
        self.stop()


def host_init(fleet, host: str) -> int:
    """The host's PID 1 as this machine numbers it: the child of its systemd-nspawn, the child of
    the fleet's supervisor shell."""
    pid = int(fleet.rig.host(host)["supervisor_pid"])
    for _level in ("systemd-nspawn", "systemd"):
        children = Path(f"/proc/{pid:d}/task/{pid:d}/children").read_text().split()
        assert len(children) == 1, (pid, children)
        pid = int(children[0])
    assert Path(f"/proc/{pid:d}/comm").read_text().strip() == "systemd", pid
    return pid


def blocking_job(data: str) -> str:
    """Job B's script: COUNT of the user's processes (the job's own tasks, children of its batch
    script) each holding an O_CLOEXEC fd on `data`, told to exec by STUCK/exec; the job runs until
    STUCK/go."""
    return (f"for i in $(seq {COUNT}); do python3 {STUCK}/exec_on_it.py {data} {STUCK}/exec > {STUCK}/out.$i 2>&1 & echo $! >> {STUCK}/pids; done; "
            f"until [ $(cat {STUCK}/out.* 2>/dev/null | grep -c ready) -ge {COUNT} ]; do sleep 0.05; done; touch {STUCK}/all-ready; "
            f"while [ ! -e {STUCK}/go ]; do sleep 0.05; done")


def slurm_processes(fleet, host) -> str:
    """What Slurm's processes wait in, each thread, read without waiting with them (comm, status,
    wchan, kernel stack), then slurmd's own log: a failure's message, as one string (pytest would
    shorten a tuple's repr to its ends)."""
    return fleet.ssh(host, "for d in /proc/[0-9]*; do c=$(timeout -s KILL 1 cat $d/comm 2>/dev/null); case $c in slurm*) "
                           "for t in $d/task/*; do echo == ${d#/proc/} ${t##*/} $c $(grep State $d/status) WCHAN=$(timeout -s KILL 1 cat $t/wchan); "
                           "timeout -s KILL 1 cat $t/stack | head -6; done;; esac; done; "
                           "journalctl -u slurmd -u slurmctld -n 80 --no-pager -o short-monotonic", timeout=120).stdout


def slurm_waits_on_them(fleet, host, blocker: str):
    """Job B's end as Slurm 22.05 can leave it under load (seen once in 5 CI runs; its code allows
    it): the step daemon's monitor drained the node and told slurmctld the job ended, but slurmd's
    end of the job asked that daemon to signal the job's processes before it closed its socket;
    the daemon reads each one's /proc/PID/stat first and waits with them, and slurmd waits for its
    answer with no timeout. The epilog runs only when the file system answers. Asserted: the job
    is COMPLETING, the drain is Slurm's, and no epilog of ours ever started for it (the hook is not
    what waits)."""
    waiting = slurm_processes(fleet, host)
    assert job(fleet, host, blocker)["JobState"] == "COMPLETING", f"{job(fleet, host, blocker)}\n{waiting}"
    assert node(fleet, host)["Reason"] == "Kill task failed", f"{node(fleet, host)}\n{waiting}"
    ours = fleet.ssh(host, f"ps -eo pid,args | grep -F {HOOK_DIR}/epilog | grep -v grep; true").stdout
    assert not ours.strip() and not hook_runs(fleet, host, blocker, "epilog"), f"{ours}\n{waiting}"


def run_epilog_as_slurmd_would(fleet, host, blocker: str, gpu: str):
    """The role's epilog for job B, run as slurmd runs it (root, the environment slurmd 22.05 gives
    an epilog: tests/fixtures/slurm-22.05.8/shard/epilog-env.txt), while her processes still wait:
    the run under test, when slurmd itself cannot get to it."""
    uid = fleet.ssh(host, f"id -u {JOB_USER}", check=True).stdout.strip()
    environ = {"SLURM_JOB_ID": blocker, "SLURM_JOBID": blocker, "SLURM_JOB_GPUS": gpu, "CUDA_VISIBLE_DEVICES": gpu,
               "SLURM_JOB_UID": uid, "SLURM_JOB_USER": JOB_USER, "SLURMD_NODENAME": host, "SLURM_CLUSTER_NAME": host,
               "SLURM_CONF": "/etc/slurm/slurm.conf", "SLURM_SCRIPT_CONTEXT": "epilog_slurmd", "PWD": "/var/lib/slurm/slurmd"}
    pairs = " ".join(shlex.quote(f"{k}={v}") for k, v in environ.items())
    fleet.ssh(host, f"cd /var/lib/slurm/slurmd && env -i {pairs} {HOOK_DIR}/epilog", timeout=120)


def waits(fleet, host, pid: int) -> bool:
    """Whether a read of the process's /proc/PID/stat waits (its execve holds the lock it takes)."""
    return fleet.ssh(host, f"timeout -s KILL 0.5 cat /proc/{pid:d}/stat >/dev/null").returncode == 137


@pytest.fixture
def any_gres_host(gres_host):
    """cgroup_v2_host on the session fleet's Slurm 22.05 only (the Debian 13 host's 24.11 would
    boot a second fleet for this one test)."""
    return gres_host


def test_thirty_blocked_processes_of_another_job_leave_this_jobs_epilog_passing_and_theirs_failing_alone(cgroup_v2_host):
    fleet, host = cgroup_v2_host
    as_user(fleet, host)
    fleet.ssh(host, f"rm -rf {STUCK}; install -d -m 755 -o {JOB_USER} {STUCK}; printf %s {shlex.quote(EXEC_ON_IT)} > {STUCK}/exec_on_it.py",
              check=True)
    stuck: list[int] = []
    try:
        with HostStall(fleet, host) as mount:
            blocker = submit_as_user(fleet, host, blocking_job(f"{mount.inside}/data"))
            assert wait_for(lambda: fleet.ssh(host, f"test -e {STUCK}/all-ready").returncode == 0, timeout=60), \
                (job(fleet, host, blocker), fleet.ssh(host, f"cat {STUCK}/out.* | head").stdout)
            stuck = [int(p) for p in fleet.ssh(host, f"cat {STUCK}/pids", check=True).stdout.split()]
            assert len(stuck) == COUNT
            blocked_gpus = ended(fleet, host, blocker, "prolog")["gpus"]
            # Job B's by the kernel's word: slurmstepd's cgroup for B (what the epilog reads; their
            # /proc/PID/stat, environ, maps will not answer).
            assert cgroup_of(fleet, host, stuck[0]) == f"0::/system.slice/{host}_slurmstepd.scope/job_{blocker}/step_batch/user/task_0"
            mount.stall()
            fleet.ssh(host, f"touch {STUCK}/exec", check=True)
            assert wait_for(lambda: all(waits(fleet, host, p) for p in stuck), timeout=30), "the processes did not block in execve"

            # Job A leaves a holder on its GPU, out of its cgroup (Slurm's own kill of the job's
            # cgroup misses it), and ends beside them: its epilog frees it and passes.
            ending = submit(fleet, host, 'mkdir -p /sys/fs/cgroup/escaped.slice; export CUDA_VISIBLE_DEVICES="$SLURM_JOB_GPUS"; ' + leave_behind(
                "beside_stuck", 2048).replace(" & for i", " & echo $! > /sys/fs/cgroup/escaped.slice/cgroup.procs; for i", 1))
            mine = ready_pid(fleet, host, "beside_stuck")
            assert ended(fleet, host, ending, "prolog")["ok"], hook_runs(fleet, host, ending, "prolog")
            run = ended(fleet, host, ending)
            assert run["ok"] and [k["pid"] for k in run["killed"]] == [mine] and not run.get("causes"), run
            assert run["gpus"] != blocked_gpus, run
            assert run["elapsed_s"] < BOUND_S, run
            assert not drained(node(fleet, host)), node(fleet, host)
            assert job(fleet, host, blocker)["JobState"] == "RUNNING", job(fleet, host, blocker)

            # Job B's GPU holds memory charged to one of its blocked processes; none of them answers.
            # Its epilog fails alone, naming them, signals nothing, and the node drains for it.
            [gpu] = blocked_gpus
            fleet.set_fault(host, {"leak": {gpu: {"mib": 4096, "pid": stuck[0]}}})
            fleet.ssh(host, f"touch {STUCK}/go", check=True)
            # slurmstepd's SIGKILL cannot end them (a flush is waited out): Slurm's own
            # UnkillableStepTimeout (60 s) passes before B's step ends and its epilog runs.
            if not wait_for(lambda: hook_runs(fleet, host, blocker, "epilog"), timeout=150):
                slurm_waits_on_them(fleet, host, blocker)
                run_epilog_as_slurmd_would(fleet, host, blocker, gpu)
            theirs = ended(fleet, host, blocker)
            assert not theirs["ok"] and theirs["killed"] == [], theirs
            [cause] = theirs["causes"]
            assert cause.startswith(f"GPU {gpu}: 4096 MiB, held by pid ") and "(did not answer: a stalled file system?)" in cause, cause
            assert theirs["elapsed_s"] < BOUND_S, theirs
            fields = node(fleet, host)
            # Drained for job B alone: by Slurm for its unkillable step (first: an existing drain
            # is never overwritten by the hooks), or by the epilog naming job B's GPU.
            reason = fields["Reason"]
            assert drained(fields) and (reason == "Kill task failed" or reason.startswith(f"zeromib: epilog job {blocker}: GPU {gpu}")), fields
            assert all(waits(fleet, host, p) for p in stuck), "the epilog's run let them go on"
    finally:
        fleet.clear_faults(host)
        pids = " ".join(map(str, stuck))
        fleet.ssh(host, f"scancel --quiet --full -u {JOB_USER}; [ -z '{pids}' ] || kill -9 {pids} 2>/dev/null; rm -rf {STUCK}; true")
        assert wait_for(lambda: fleet.ssh(host, f"squeue -h -u {JOB_USER}").stdout.strip() == "", timeout=90), \
            fleet.ssh(host, "squeue").stdout
