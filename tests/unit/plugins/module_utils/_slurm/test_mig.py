"""A job given a MIG slice (issue 59): slurmd's SLURM_JOB_GPUS counts slices, not GPUs, so the
slice's MIG UUID in CUDA_VISIBLE_DEVICES names it (AutoDetect=nvml; Slurm 22.05's sources, see
_slurm/_mig.py); the hooks look at the slice's parent GPU, shared with its other slices' jobs, at
the MIG baseline; a job named by numbers on a MIG GPU is refused, naming why."""
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _jobcheck as jobcheck
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _mig
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _shared
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import FakeSmi, FakeSystem, World, params, uuid

HERE = os.path.dirname(os.path.abspath(__file__))
LIST = os.path.join(HERE, os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "nvidia-smi-L", "mig-a100x2.txt")
GPU0 = "GPU-7a3c1f52-0d64-4c1e-9b1e-2f9a4c6d8e01"
GPU1 = "GPU-8b4d2a63-1e75-4d2f-8c2f-3a0b5d7e9f12"
SLICE_1G = "MIG-2d7b0e3c-6a4f-5d9b-9c5e-3f4a5b6c7d82"
SLICE_7G = "MIG-3e8c1f4d-7b5a-5eac-8d6f-4a5b6c7d8e93"


def listing():
    with open(LIST, encoding="utf-8") as handle:
        return handle.read()


def test_nvidia_smi_list_gives_each_mig_device_its_parent_gpu():
    parents = _mig.parse_list(listing())
    assert len(parents) == 4 and parents[SLICE_1G.lower()] == GPU0 and parents[SLICE_7G.lower()] == GPU1


def test_slices_become_their_parent_gpus_once_each_and_listed_only_when_needed():
    calls = []
    assert _mig.parents_of([SLICE_1G, "MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60", SLICE_7G], lambda: calls.append(1) or listing()) == [GPU0, GPU1]
    assert calls == [1]
    # Drivers before 470.42.01: Slurm writes MIG-<parent UUID>/<GI>/<CI>, the parent in it.
    assert _mig.parents_of([f"MIG-{GPU1}/1/0"], lambda: pytest.fail("no listing needed")) == [GPU1]
    assert _mig.parents_of(["3"], lambda: pytest.fail("no listing needed")) == ["3"]


def test_a_slice_nvidia_smi_does_not_list_is_named():
    with pytest.raises(_mig.MigError, match="MIG device MIG-ffffffff-0000-5000-8000-000000000000 is not on this node"):
        _mig.parents_of(["MIG-ffffffff-0000-5000-8000-000000000000"], listing)


# slurmd 22.05's epilog environment for a job given the second A100's 7g.40gb slice, the fourth gres
# device of its list (the first A100's three slices count 0, 1, 2): SLURM_JOB_GPUS is 3.
MIG_EPILOG_ENV = {"SLURM_JOB_ID": "21", "SLURM_JOB_GPUS": "3", "CUDA_VISIBLE_DEVICES": SLICE_7G, "GPU_DEVICE_ORDINAL": SLICE_7G,
                  "SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}


def test_the_slices_uuid_names_the_jobs_gpu_never_slurmds_count_of_slices():
    assert jobcheck.job_gpus(MIG_EPILOG_ENV) == [SLICE_7G]
    old = dict(MIG_EPILOG_ENV, CUDA_VISIBLE_DEVICES=f"MIG-{GPU1}/1/0")
    assert jobcheck.job_gpus(old) == [f"MIG-{GPU1}/1/0"]
    with pytest.raises(jobcheck.JobCheckError, match="is not a GPU index or UUID"):
        jobcheck.job_gpus(dict(MIG_EPILOG_ENV, CUDA_VISIBLE_DEVICES="MIG-x/../1"))


@pytest.fixture
def mig_world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    world = World(root)
    world.mig = True
    world.baseline = {0: 55, 1: 55}  # an idle MIG GPU's reading (H100/H200 MIG: 50-59 MiB)
    return world


JOB_12_TASK = "0::/system.slice/s59-01_slurmstepd.scope/job_12/step_batch/user/task_0\n"


def test_the_epilog_of_a_slice_ends_its_leftover_on_the_parent_and_passes_at_the_mig_baseline_beside_another_slices_job(mig_world):
    mig_world.spawn(300, mem={0: 4000}, cgroup=JOB_12_TASK, comm="other_slice")
    mig_world.spawn(310, mem={0: 2000}, comm="leftover")
    real = FakeSmi(mig_world)
    worker = jobcheck.JobRelease(real, FakeSystem(mig_world), params(gpus=[uuid(0)], max_used_mib=60, settle_timeout=0.5), ending_job="21",
                                 driver_root=str(mig_world.root.parent / "no-driver"))
    worker.smi = _shared.SharedReadings(real, lambda g: g["uuid"] == uuid(0), worker.others, 60)
    result = worker.run()
    assert result["released"] and [k["pid"] for k in result["killed"]] == [310] and 300 in mig_world.procs
    assert mig_world.memory_used(0) == 4055


def test_a_job_named_by_numbers_on_a_mig_gpu_is_refused_before_anything_is_done(mig_world):
    mig_world.spawn(310, mem={0: 2000}, comm="leftover")
    worker = jobcheck.JobRelease(FakeSmi(mig_world), FakeSystem(mig_world), params(gpus=["0"]), ending_job="21", numbered=["0"],
                                 driver_root=str(mig_world.root.parent / "no-driver"))
    with pytest.raises(jobcheck.ReleaseError):
        worker.run()
    assert worker.refusal.startswith("GPU 0 is in MIG mode and Slurm named the job's GPUs by number (0): on a MIG GPU slurmd's numbers count")
    assert 310 in mig_world.procs and mig_world.signals == []


def test_the_mig_baseline_is_an_option_and_a_number():
    assert jobcheck.check_config({})["mig_baseline_mib"] == 60
    with pytest.raises(jobcheck.JobCheckError, match="mig_baseline_mib must be a number"):
        jobcheck.check_config({"mig_baseline_mib": "60"})
