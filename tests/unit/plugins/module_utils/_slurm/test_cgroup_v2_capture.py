"""Whose job a process is, read from the cgroup paths a real slurmstepd wrote on cgroup v2
(Slurm 22.05.8, proctrack/cgroup, task/cgroup, PrologFlags=Contain, ConstrainDevices=yes;
tests/fixtures/slurm-22.05.8/cgroup-v2/, with how it was captured). Before these, the cgroup
rule rested on paths nobody had seen slurmstepd write (issue 59)."""
import json
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURE = os.path.join(HERE, os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "slurm-22.05.8", "cgroup-v2", "job7.json")

with open(CAPTURE, encoding="utf-8") as _handle:
    JOB7 = json.load(_handle)
BY_CMDLINE = {p["cmdline"]: p for p in JOB7["processes"]}


@pytest.mark.parametrize("cmdline, job", [
    ("/usr/sbin/slurmstepd infinity", None),  # holds <node>_slurmstepd.scope/system: no job's
    ("slurmstepd: [7.extern]", "7"),
    ("slurmstepd: [7.batch]", "7"),
    ("sleep 302", "7"),
    ("sleep 301", "7"),
])
def test_each_process_slurmstepd_placed_is_read_as_its_job(cmdline, job):
    assert _jobs.job_of_cgroups(BY_CMDLINE[cmdline]["cgroup"]) == job


def test_the_capture_is_of_the_shape_the_docs_describe():
    """Node-named scope (Debian builds multiple-slurmd), job_N, step_batch|step_extern, user/task_N."""
    scope = f"/system.slice/{JOB7['node']}_slurmstepd.scope"
    assert f"{scope}/job_7/step_batch/user/task_0" in JOB7["cgroup_dirs"]
    assert f"{scope}/job_7/step_extern/user/task_special" in JOB7["cgroup_dirs"]
    assert all(d == scope or d.startswith(scope + "/") for d in JOB7["cgroup_dirs"])


def test_a_detached_process_is_its_jobs_by_its_cgroup_even_with_no_slurmstepd_above_it(tmp_path):
    """With proctrack/cgroup a process that leaves the job's process tree (setsid, reparented to
    PID 1) stays in the job's cgroup: only the cgroup names it (under proctrack/linuxproc it
    would be no job's, and another job's epilog would end it)."""
    lines = BY_CMDLINE["sleep 301"]["cgroup"]
    fakeproc.write_process(tmp_path, 936, ppid=1, comm="sleep", argv=("sleep", "301"), cgroup="\n".join(lines) + "\n")
    assert _jobs.owning_job(936, str(tmp_path)) == "7"
    assert _jobs.other_job(_jobs.owning_job(936, str(tmp_path)), "8") and not _jobs.other_job("7", "7")


def test_a_users_delegated_cgroup_copying_the_shape_names_no_job():
    path = "0::/user.slice/user-4242.slice/user@4242.service/app.slice" + BY_CMDLINE["sleep 301"]["cgroup"][-1][3:]
    assert _jobs.job_of_cgroups([path]) is None
