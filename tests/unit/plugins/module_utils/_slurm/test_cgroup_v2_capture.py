"""Whose job a process is, read from the cgroup paths a real slurmstepd wrote on cgroup v2
(proctrack/cgroup, task/cgroup, PrologFlags=Contain, ConstrainDevices=yes), from Slurm 22.05.8
(Debian 12) and 24.11.5 (Debian 13): tests/fixtures/slurm-<version>/cgroup-v2/, with how each was
captured (tests/fleet/capture_slurm_v2.py). Before these, the cgroup rule rested on paths nobody
had seen slurmstepd write (issue 59)."""
import json
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _jobcheck as jobcheck
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, os.pardir, os.pardir, os.pardir, os.pardir, "fixtures")
CAPTURES = {"22.05.8": os.path.join("slurm-22.05.8", "cgroup-v2", "job7.json"),
            "24.11.5": os.path.join("slurm-24.11.5", "cgroup-v2", "job1.json")}


def capture(version):
    with open(os.path.join(FIXTURES, CAPTURES[version]), encoding="utf-8") as handle:
        return json.load(handle)


def by_cmdline(job):
    return {p["cmdline"]: p for p in job["processes"]}


def test_each_capture_is_of_the_slurm_it_is_filed_under():
    for version in CAPTURES:
        assert capture(version)["slurm"].split()[0] == version


@pytest.mark.parametrize("version", sorted(CAPTURES))
@pytest.mark.parametrize("cmdline, owned", [
    ("/usr/sbin/slurmstepd infinity", False),  # holds <node>_slurmstepd.scope/system: no job's
    ("slurmstepd: [{job}.extern]", True),
    ("slurmstepd: [{job}.batch]", True),
    ("sleep 302", True),
    ("sleep 301", True),
])
def test_each_process_slurmstepd_placed_is_read_as_its_job(version, cmdline, owned):
    job = capture(version)
    process = by_cmdline(job)[cmdline.format(job=job["job"])]
    assert _jobs.job_of_cgroups(process["cgroup"]) == (job["job"] if owned else None)


@pytest.mark.parametrize("version", sorted(CAPTURES))
def test_the_capture_is_of_the_shape_the_docs_describe(version):
    """Node-named scope (Debian builds multiple-slurmd), job_N, step_batch|step_extern, user/task_N:
    the same in 22.05 and 24.11."""
    job = capture(version)
    scope = f"/system.slice/{job['node']}_slurmstepd.scope"
    assert f"{scope}/job_{job['job']}/step_batch/user/task_0" in job["cgroup_dirs"]
    assert f"{scope}/job_{job['job']}/step_extern/user/task_special" in job["cgroup_dirs"]
    assert all(d == scope or d.startswith(scope + "/") for d in job["cgroup_dirs"])


def test_22_05_and_24_11_place_each_process_alike():
    def shape(job):
        return sorted((p["role"], p["cgroup"][-1].replace(job["node"], "NODE").replace(f"job_{job['job']}/", "job_N/"))
                      for p in job["processes"])
    assert shape(capture("22.05.8")) == shape(capture("24.11.5"))


@pytest.mark.parametrize("version", sorted(CAPTURES))
def test_a_detached_process_is_its_jobs_by_its_cgroup_even_with_no_slurmstepd_above_it(version, tmp_path):
    """With proctrack/cgroup a process that leaves the job's process tree (setsid, reparented to
    PID 1) stays in the job's cgroup: only the cgroup names it (under proctrack/linuxproc it
    would be no job's, and another job's epilog would end it)."""
    job = capture(version)
    detached = by_cmdline(job)["sleep 301"]
    fakeproc.write_process(tmp_path, detached["pid"], ppid=1, comm="sleep", argv=("sleep", "301"), cgroup="\n".join(detached["cgroup"]) + "\n")
    assert _jobs.owning_job(detached["pid"], str(tmp_path)) == job["job"]
    assert _jobs.other_job(job["job"], str(int(job["job"]) + 1)) and not _jobs.other_job(job["job"], job["job"])


@pytest.mark.parametrize("version", sorted(CAPTURES))
def test_a_users_delegated_cgroup_copying_the_shape_names_no_job(version):
    path = "0::/user.slice/user-4242.slice/user@4242.service/app.slice" + by_cmdline(capture(version))["sleep 301"]["cgroup"][-1][3:]
    assert _jobs.job_of_cgroups([path]) is None


@pytest.mark.parametrize("context, mode", [("prolog", "prolog"), ("epilog", "epilog")])
def test_the_runner_reads_slurmd_24_11s_hook_environment_as_22_05s(context, mode):
    """slurmd 24.11.5 adds SLURM_JOB_START_TIME, SLURM_JOB_END_TIME, SLURM_JOB_OVERSUBSCRIBE and
    the core-spec variables to the hooks' environment; what the runner reads (SLURM_JOB_ID,
    SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES, SLURM_SCRIPT_CONTEXT) is as 22.05.8 gives it."""
    with open(os.path.join(FIXTURES, "slurm-24.11.5", "cgroup-v2", f"{context}-env.txt"), encoding="utf-8") as handle:
        env = dict(line.rstrip("\n").split("=", 1) for line in handle if "=" in line)
    assert env["SLURM_SCRIPT_CONTEXT"] == f"{context}_slurmd"
    assert jobcheck.mode_of([], env) == mode and jobcheck.job_id(env) == "1" and jobcheck.job_gpus(env) == ["0"]
    assert {"SLURM_JOB_START_TIME", "SLURM_JOB_END_TIME"} <= set(env)
