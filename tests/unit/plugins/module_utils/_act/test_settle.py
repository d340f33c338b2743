# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The respawn watch's pure parts: which parents are watched, what kind of restarter each is and
what stops it, and who counts as having come back (fake /proc trees)."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _settle
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc


def process(root, pid, ppid, argv, comm=None, session=None, fds=(), maps=(), environ=None, exe="/usr/bin/python3.12", uid=0,
            cgroup=fakeproc.SESSION):
    """A process whose session id is `session` (its own PID by default: a session leader)."""
    fakeproc.write_process(root, pid, comm=comm or os.path.basename(argv[0])[:15], ppid=ppid, start_time=1000 + pid, argv=argv,
                           fds=fds, maps=maps, exe=exe, uid=uid, cgroup=cgroup)
    path = os.path.join(str(root), str(pid), "stat")
    with open(path) as handle:
        fields = handle.read().split(" ")
    # "pid (comm) state ppid pgrp session ...": comm has no spaces here.
    fields[5] = str(pid if session is None else session)
    with open(path, "w") as handle:
        handle.write(" ".join(fields))
    if environ:
        with open(os.path.join(str(root), str(pid), "environ"), "wb") as handle:
            handle.write(b"".join(("{}={}".format(*item)).encode() + b"\0" for item in sorted(environ.items())))


def holder(pid, ppid, cmdline="python3 train.py"):
    return {"pid": pid, "ppid": ppid, "cmdline": cmdline, "cgroup": "/user.slice/user-0.slice/session-3.scope"}


class Clock:
    """The system's clock for Watch.settle: sleeping moves it, nothing waits."""
    t = 0.0

    def now(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds


@pytest.fixture
def proc(tmp_path):
    fakeproc.write_process(tmp_path, 1, comm="systemd", ppid=0, argv=("/sbin/init",), exe="/usr/lib/systemd/systemd")
    return tmp_path


@pytest.mark.parametrize("argv, kind", [
    (("/usr/bin/python3", "/usr/bin/supervisord", "-n", "-c", "/etc/supervisor/supervisord.conf"), "supervisord"),
    (("PM2 v5.3.0: God Daemon (/root/.pm2)",), "pm2"),
    (("runsv", "vllm"), "runit"),
    (("s6-supervise", "vllm"), "s6"),
    (("/usr/bin/python3", "/usr/bin/circusd", "/etc/circus.ini"), "circus"),
    (("/usr/bin/monit", "-I"), "monit"),
    (("/opt/venv/bin/python3", "/opt/venv/bin/torchrun", "--nproc-per-node", "8", "train.py"), "torchrun"),
    (("python3", "-m", "torch.distributed.run", "--nproc-per-node", "8", "train.py"), "torchrun"),
    (("sh", "-c", "while true; do python3 train.py; done"), None),
    (("-bash",), None),
], ids=["supervisord", "pm2", "runsv", "s6", "circus", "monit", "torchrun", "torch.distributed.run", "shell-loop", "login-shell"])
def test_known_supervisors_are_recognised_by_what_they_run(argv, kind):
    record = {"name": os.path.basename(argv[0])[:15], "cmdline": " ".join(argv), "argv0": os.path.basename(argv[0]), "exe": None}
    assert _settle.supervisor_kind(record) == kind


def test_supervisord_names_the_program_and_its_stop_command():
    env = {"SUPERVISOR_PROCESS_NAME": "vllm", "SUPERVISOR_GROUP_NAME": "vllm"}
    hint = _settle.stop_hint("supervisord", {"pid": 77}, env)
    assert "`supervisorctl stop vllm`" in hint and "supervisor:vllm" in hint
    grouped = {"SUPERVISOR_PROCESS_NAME": "worker_01", "SUPERVISOR_GROUP_NAME": "serve"}
    assert _settle.supervisor_program(grouped) == "serve:worker_01"
    assert "`pm2 stop api`" in _settle.stop_hint("pm2", {"pid": 5}, {"name": "api", "pm_id": "0"})
    assert "the agent goes first: end pid 9 (kill -TERM 9" in _settle.stop_hint("torchrun", {"pid": 9}, {})


def test_a_shell_loop_is_watched_up_to_its_session_leader(proc):
    process(proc, 100, 1, ("-bash",), comm="bash")                        # tmux pane: session leader
    process(proc, 200, 100, ("sh", "-c", "while true; do python3 train.py; done"), session=100)
    process(proc, 300, 200, ("python3", "train.py"), session=100)
    table = _settle.read_table(str(proc))
    chain = _settle.parent_chain(holder(300, 200), table, own_lineage=set(), signalled={300}, proc=str(proc))
    assert [p["pid"] for p in chain] == [200, 100]
    found = _settle.restarters([holder(300, 200)], own_lineage=(), proc=str(proc))
    assert sorted(found) == [100, 200] and found[200]["depth"] == 0 and found[200]["killed"] == {300: "python3 train.py"}


def test_no_parent_is_watched_for_pid_1_the_ansible_session_or_a_protected_daemon(proc):
    process(proc, 300, 1, ("python3", "train.py"))
    assert _settle.restarters([holder(300, 1)], own_lineage=(), proc=str(proc)) == {}
    process(proc, 400, 1, ("sshd: root@notty",), comm="sshd", exe="/usr/sbin/sshd")
    process(proc, 401, 400, ("python3", "train.py"), session=400)
    assert _settle.restarters([holder(401, 400)], own_lineage=(), proc=str(proc)) == {}
    process(proc, 500, 1, ("/usr/bin/python3", "AnsiballZ_gpu_release.py"))
    process(proc, 501, 500, ("python3", "train.py"), session=500)
    assert _settle.restarters([holder(501, 500)], own_lineage=(500,), proc=str(proc)) == {}


def test_walk_stops_at_a_launcher_and_passes_over_other_signalled_holders(proc):
    process(proc, 10, 1, ("/usr/bin/python3", "/usr/bin/supervisord", "-n"), comm="supervisord")
    process(proc, 20, 10, ("python3", "-m", "vllm.entrypoints.openai.api_server"), session=10,
            environ={"SUPERVISOR_PROCESS_NAME": "vllm", "SUPERVISOR_GROUP_NAME": "vllm"})
    process(proc, 30, 20, ("VLLM::Worker_TP0",), session=10)
    found = _settle.restarters([holder(20, 10, "python3 -m vllm"), holder(30, 20, "VLLM::Worker_TP0")], own_lineage=(), proc=str(proc))
    assert list(found) == [10] and found[10]["kind"] == "supervisord" and "supervisorctl stop vllm" in found[10]["hint"]


def test_a_restart_is_the_killed_command_line_or_a_new_gpu_holder_under_the_parent(proc):
    process(proc, 200, 1, ("sh", "-c", "while true; do python3 train.py; done"))
    process(proc, 300, 200, ("python3", "train.py"), session=200)
    watch = _settle.Watch({}, str(proc), _settle.restarters([holder(300, 200)], (), str(proc)), minors={0})
    assert watch and watch.respawned() == []
    fakeproc.remove_process(proc, 300)
    process(proc, 301, 200, ("sleep", "1"), session=200)                     # a new child, not a restart
    assert watch.respawned() == []
    process(proc, 302, 200, ("python3", "train.py"), session=200)            # the same command again
    process(proc, 303, 301, ("python3", "other.py"), session=200, fds=("/dev/nvidia0",), maps=(("/dev/nvidia0", 2176),))
    again = watch.respawned()
    assert [(root, record["pid"]) for root, record in again] == [(200, 302), (200, 303)]
    message = watch.message([], [], 0.3, again)
    assert "pid 302 python3 [python3 train.py], started again by its parent pid 200 sh [sh -c while true; do python3 train.py; done]" \
        in message and "end pid 200 first (kill 200)" in message


def test_a_parent_that_exited_leaves_no_window(proc):
    process(proc, 200, 1, ("sh", "-c", "python3 train.py; echo done"))
    process(proc, 300, 200, ("python3", "train.py"), session=200)
    watch = _settle.Watch({}, str(proc), _settle.restarters([holder(300, 200)], (), str(proc)), minors={0})
    fakeproc.remove_process(proc, 300)
    fakeproc.remove_process(proc, 200)

    clock = Clock()
    assert watch.settle(clock, lambda: [], seconds=5.0) is None and clock.t == 0.0


def test_a_users_loop_named_like_a_protected_daemon_or_a_supervisor_is_watched_and_the_walk_goes_on(proc):
    """issue 31: `exec -a sshd sh -c 'while true; do train; sleep 1; done'` as uid 4242 is a parent
    like any other; a user's `supervisord` or `cron` does not end the walk either."""
    process(proc, 200, 1, ("sshd", "-c", "while true; do python3 train.py; sleep 1; done"), comm="sh", exe="/usr/bin/dash", uid=4242)
    process(proc, 300, 200, ("python3", "train.py"), session=200, uid=4242)
    assert list(_settle.restarters([holder(300, 200)], own_lineage=(), proc=str(proc))) == [200]
    process(proc, 400, 1, ("sh", "-c", "while true; do cron; done"), exe="/usr/bin/dash", uid=4242)
    process(proc, 410, 400, ("supervisord", "-c", "x"), comm="supervisord", session=400, uid=4242)
    process(proc, 420, 410, ("python3", "train.py"), session=400, uid=4242)
    assert sorted(_settle.restarters([holder(420, 410)], own_lineage=(), proc=str(proc))) == [400, 410]
    # Root's (vouched) sshd still ends the walk, as before.
    process(proc, 500, 1, ("sshd: root@notty",), comm="sshd", exe="/usr/sbin/sshd")
    process(proc, 501, 500, ("python3", "train.py"), session=500)
    assert _settle.restarters([holder(501, 500)], own_lineage=(), proc=str(proc)) == {}


def test_the_killed_command_line_started_again_by_anyone_is_a_restart(proc):
    """issue 31: a double-forked watcher restarts the job under init: no parent to watch, but the
    killed command line running again in a process new since the signals fails the run."""
    process(proc, 250, 1, ("python3", "train.py"))                             # alive before: not a restart
    process(proc, 300, 1, ("python3", "train.py"))
    watch = _settle.Watch({}, str(proc), _settle.restarters([holder(300, 1)], (), str(proc)), minors={0}, killed=[holder(300, 1)])
    assert not watch and watch.restarted_outside() == []
    fakeproc.remove_process(proc, 300)
    process(proc, 310, 1, ("python3", "train.py", "--resume"))               # another command line
    assert watch.restarted_outside() == []
    process(proc, 320, 1, ("python3", "train.py"))
    again = watch.restarted_outside()
    assert [(killed, record["pid"]) for killed, record in again] == [(300, 320)]
    message = watch.outside_message(again)
    assert "pid 320 python3 [python3 train.py] runs the command line of killed pid 300 again, its parent gone" in message


def test_the_same_command_line_started_by_another_user_is_no_restart(proc):
    """Review of issue 31: another user's job that runs the same command line (or copies it to
    make every release fail) is not the killed holder started again; the same user's is."""
    process(proc, 300, 1, ("python3", "train.py"), uid=4242)
    killed = dict(holder(300, 1), uid=4242)
    watch = _settle.Watch({}, str(proc), _settle.restarters([killed], (), str(proc)), minors={0}, killed=[killed])
    fakeproc.remove_process(proc, 300)
    process(proc, 330, 1, ("python3", "train.py"), uid=5151)
    assert watch.restarted_outside() == []
    process(proc, 340, 1, ("python3", "train.py"), uid=4242)
    assert [(k, record["pid"]) for k, record in watch.restarted_outside()] == [(300, 340)]


# --- issue 54: whose a new process is, by the caller's word (an epilog's: the ending job's, or no job's)


def job(number):
    """A task's cgroup as slurmstepd writes it (cgroup v2), as /proc/PID/cgroup shows it."""
    return f"0::/system.slice/slurmstepd.scope/job_{number}/step_0/user/task_0\n"


USER_CLAIM = "0::/user.slice/user-4242.slice/user@4242.service/app.slice/slurmstepd.scope/job_8/step_0/user/task_0\n"


def epilog_of(ending, proc):
    """The predicate an epilog gives the watch (_jobcheck.JobRelease.foreign)."""
    return lambda pid, _killed: _jobs.other_job(_jobs.owning_job(pid, str(proc)), ending)


def test_another_jobs_task_that_runs_the_killed_command_line_is_no_restart_but_the_same_jobs_is(proc):
    """The epilog of job 7 killed its leftover; job 8 of the same user starts its next array task
    (the same argv: the task id is only in the environment): no restart. The same command line in
    job 7, in no job, or in a cgroup of the user's own manager named `job_8`, is one."""
    process(proc, 300, 1, ("python3", "train.py"), uid=4242, cgroup=job(7))
    killed = dict(holder(300, 1), uid=4242)
    watch = _settle.Watch({}, str(proc), _settle.restarters([killed], (), str(proc)), minors={0}, killed=[killed], foreign=epilog_of("7", proc))
    fakeproc.remove_process(proc, 300)
    process(proc, 310, 1, ("python3", "train.py"), uid=4242, cgroup=job(8))
    assert watch.restarted_outside() == []
    for pid, cgroup in ((320, job(7)), (330, fakeproc.SESSION), (340, USER_CLAIM)):
        process(proc, pid, 1, ("python3", "train.py"), uid=4242, cgroup=cgroup)
    assert [(k, record["pid"]) for k, record in watch.restarted_outside()] == [(300, 320), (300, 330), (300, 340)]


def test_without_the_callers_word_every_new_process_may_be_a_restart(proc):
    """gpu_release where no job is known (no `foreign`): the killed command line again is a
    restart, whatever cgroup it runs in, as before issue 54."""
    process(proc, 300, 1, ("python3", "train.py"), uid=4242)
    killed = dict(holder(300, 1), uid=4242)
    watch = _settle.Watch({}, str(proc), {}, minors={0}, killed=[killed])
    fakeproc.remove_process(proc, 300)
    process(proc, 310, 1, ("python3", "train.py"), uid=4242, cgroup=job(8))
    assert [(k, record["pid"]) for k, record in watch.restarted_outside()] == [(300, 310)]


def test_the_callers_word_is_asked_per_killed_holder_and_only_for_a_command_line_that_matches(proc):
    """gpu_release: a new process is passed over only when it is someone else's than every
    killed holder whose command line it runs; nothing is asked about other new processes."""
    process(proc, 300, 1, ("python3", "train.py"), uid=4242)
    process(proc, 301, 1, ("python3", "train.py"), uid=4242)
    targets = [dict(holder(300, 1), uid=4242), dict(holder(301, 1), uid=4242)]
    jobs = {300: "7", 301: "9"}
    asked = []

    def foreign(pid, killed):
        asked.append((pid, killed))
        return _jobs.other_job(_jobs.owning_job(pid, str(proc)), jobs[killed])

    watch = _settle.Watch({}, str(proc), {}, minors={0}, killed=targets, foreign=foreign)
    for pid in (300, 301):
        fakeproc.remove_process(proc, pid)
    process(proc, 310, 1, ("python3", "other.py"), uid=4242, cgroup=job(8))
    process(proc, 320, 1, ("python3", "train.py"), uid=4242, cgroup=job(8))   # neither job's
    process(proc, 330, 1, ("python3", "train.py"), uid=4242, cgroup=job(9))   # 301's job
    assert [(k, record["pid"]) for k, record in watch.restarted_outside()] == [(301, 330)]
    assert {pid for pid, _killed in asked} == {320, 330}


def test_a_parent_that_starts_the_killed_command_line_in_another_job_has_not_restarted_it(proc):
    """The parent walk too: a new child of a watched parent that the caller calls another job's
    is passed over, by its command line or as a new holder of a selected GPU."""
    process(proc, 200, 1, ("sh", "-c", "while true; do python3 train.py; done"), uid=4242)
    process(proc, 300, 200, ("python3", "train.py"), session=200, uid=4242, cgroup=job(7))
    watch = _settle.Watch({}, str(proc), _settle.restarters([holder(300, 200)], (), str(proc)), minors={0}, foreign=epilog_of("7", proc))
    fakeproc.remove_process(proc, 300)
    process(proc, 310, 200, ("python3", "train.py"), session=200, uid=4242, cgroup=job(8))
    process(proc, 311, 200, ("python3", "other.py"), session=200, uid=4242, cgroup=job(8), fds=("/dev/nvidia0",), maps=(("/dev/nvidia0", 2176),))
    assert watch.respawned() == []
    process(proc, 320, 200, ("python3", "train.py"), session=200, uid=4242, cgroup=job(7))
    process(proc, 321, 200, ("python3", "other.py"), session=200, uid=4242, fds=("/dev/nvidia0",), maps=(("/dev/nvidia0", 2176),))
    assert [(root, record["pid"]) for root, record in watch.respawned()] == [(200, 320), (200, 321)]


def test_the_callers_word_reaches_the_watch_through_watch_for(proc):
    process(proc, 300, 1, ("python3", "train.py"), uid=4242, cgroup=job(7))
    killed = dict(holder(300, 1), uid=4242)
    watch = _settle.watch_for([killed], {}, None, (), {0}, str(proc), foreign=epilog_of("7", proc))
    fakeproc.remove_process(proc, 300)
    process(proc, 310, 1, ("python3", "train.py"), uid=4242, cgroup=job(8))
    assert watch.restarted_outside() == []


def test_a_restart_that_comes_while_the_gpus_are_read_names_its_parent(proc):
    """Seen in a full run under load: the worker restarted between the table read and the GPU
    read, and the message named only the memory ("came back"), not the agent that restarts it."""
    process(proc, 200, 1, ("sh", "-c", "while true; do python3 train.py; done"))
    process(proc, 300, 200, ("python3", "train.py"), session=200)
    watch = _settle.Watch({}, str(proc), _settle.restarters([holder(300, 200)], (), str(proc)), minors={0})
    fakeproc.remove_process(proc, 300)

    def read_dirty():
        process(proc, 310, 200, ("python3", "train.py"), session=200)  # restarted while nvidia-smi answered
        return [{"index": 0, "memory_used_mib": 8201}]

    message = watch.settle(Clock(), read_dirty, seconds=5.0)
    assert "pid 310 python3 [python3 train.py], started again by its parent pid 200 sh" in message and "GPU 0 reads 8201 MiB again" in message


CONTAINER = "/system.slice/docker-3492ce7770ce.scope"


def in_container(root, pid, ppid, argv, comm=None):
    fakeproc.write_process(root, pid, comm=comm or os.path.basename(argv[0])[:15], ppid=ppid, start_time=1000 + pid, argv=argv,
                           cgroup=f"0::{CONTAINER}\n")


def test_a_container_that_came_back_is_named_by_the_process_it_started_not_its_runtimes_helpers(proc):
    """Seen in a full run under load: the first read of Docker's restarted container found only
    runc's init stages, and the message named them instead of the holder the user would find."""
    watch = _settle.Watch({CONTAINER: "container 3492ce7770ce"}, str(proc))
    steps = iter([
        lambda: (fakeproc.remove_process(proc, 2330), fakeproc.remove_process(proc, 2331),
                 in_container(proc, 2332, 1, ("runc", "init"), comm="runc:[2:INIT]")),
        lambda: (fakeproc.remove_process(proc, 2332), in_container(proc, 2332, 1, ("python3", "holder.py"))),
    ])

    class Runtime(Clock):
        def sleep(self, seconds):
            super().sleep(seconds)
            next(steps, lambda: None)()

    in_container(proc, 2330, 1, ("runc", "init"), comm="runc:[0:PARENT]")
    in_container(proc, 2331, 2330, ("runc", "init"), comm="runc:[1:CHILD]")
    clock = Runtime()
    message = watch.settle(clock, lambda: [], seconds=5.0)
    assert "pid 2332 python3 [python3 holder.py] in container 3492ce7770ce" in message and "2330" not in message, message
    assert clock.t <= _settle.NAME_SETTLE_S + 1e-9


def test_naming_what_came_back_waits_no_longer_than_its_bound(proc):
    watch = _settle.Watch({CONTAINER: "container 3492ce7770ce"}, str(proc))
    counter = iter(range(3000, 4000))

    class Churn(Clock):
        def sleep(self, seconds):  # a newcomer every read: never the same twice
            super().sleep(seconds)
            in_container(proc, next(counter), 1, ("sh", "-c", "true"))

    in_container(proc, 2999, 1, ("sh", "-c", "true"))
    clock = Churn()
    message = watch.settle(clock, lambda: [], seconds=5.0)
    assert "came back" in message and "in container 3492ce7770ce" in message
    assert abs(clock.t - _settle.NAME_SETTLE_S) < _settle.NAME_POLL_S + 1e-9


# --- issue 66: the watch knows what ran before the signals by the /proc entries, not by a read of each


def test_a_pid_used_again_since_the_signals_is_new_and_an_old_process_seen_under_a_new_entry_is_not(proc):
    tick = os.sysconf("SC_CLK_TCK")
    (proc / "uptime").write_text("2000.00 100.00\n")
    process(proc, 250, 1, ("python3", "train.py"))                             # alive before (started at tick 1250)
    process(proc, 300, 1, ("python3", "train.py"))
    watch = _settle.Watch({}, str(proc), {}, minors={0}, killed=[holder(300, 1)])
    assert watch.since == 2000 * tick
    fakeproc.remove_process(proc, 300)
    # 250's entry made again (the kernel's cache dropped it): the same process, started before the watch.
    os.rename(proc / "250", proc / "250.old")
    process(proc, 250, 1, ("python3", "train.py"))
    assert watch.restarted_outside() == []
    # PID 300 used again by a process started since the watch began, running the killed command line.
    fakeproc.write_process(proc, 300, ppid=1, start_time=2000 * tick + 5, argv=("python3", "train.py"))
    assert [(k, record["pid"]) for k, record in watch.restarted_outside()] == [(300, 300)]


def test_the_walk_reads_only_the_ancestors_of_the_holders(proc):
    process(proc, 100, 1, ("-bash",), comm="bash")
    process(proc, 200, 100, ("sh", "-c", "while true; do python3 train.py; done"), session=100)
    process(proc, 300, 200, ("python3", "train.py"), session=100)
    process(proc, 400, 1, ("sleep", "infinity"))
    table = _settle.ancestors_table([holder(300, 200)], str(proc))
    assert sorted(table) == [100, 200]
    assert table == {pid: row for pid, row in _settle.read_table(str(proc)).items() if pid in (100, 200)}
    assert _settle.restarters([holder(300, 200)], (), str(proc), table=table) == _settle.restarters([holder(300, 200)], (), str(proc))
