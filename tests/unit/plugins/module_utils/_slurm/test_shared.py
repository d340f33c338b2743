"""Shared GPUs (issue 59): what other jobs hold on a GPU of the ending job is theirs. The epilog
deducts their compute apps (and the overhead of their contexts) from the GPU's reading, never
quits an MPS server another job's process uses, and names what it deducted in its cause. The
real-Slurm case (two jobs on one GPU by gres/shard) is tests/fleet/test_slurm_checks_fleet.py."""
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmiError
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _jobcheck as jobcheck
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _shared

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "slurm-22.05.8")

GPU0 = {"index": 0, "uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000000", "memory_used_mib": 3524}
GPU1 = {"index": 1, "uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000000", "memory_used_mib": 2015}
# Two other jobs' contexts on GPU 0 (2000 + 1500 MiB; the H200 adds 15 MiB for two contexts:
# 3515, +9 of the ending job's leftover context freed meanwhile), one on GPU 1.
APPS = [{"pid": 101, "gpu_uuid": GPU0["uuid"], "used_memory_mib": 2000}, {"pid": 102, "gpu_uuid": GPU0["uuid"], "used_memory_mib": 1500},
        {"pid": 103, "gpu_uuid": GPU1["uuid"], "used_memory_mib": 2000}, {"pid": 104, "gpu_uuid": GPU0["uuid"], "used_memory_mib": 9}]
OWNERS = {101: "Slurm job 12", 102: "Slurm job 13", 103: "Slurm job 12"}


def test_a_shard_jobs_epilog_reads_its_gpu_as_a_whole_gpu_jobs_does():
    """Captured from slurmd 22.05.8 (gres.conf Name=shard Count=2 File=/dev/nvidia0 ...): nothing in
    the epilog's environment says the GPU is shared, hence the runner's shared_gpus."""
    with open(os.path.join(FIXTURES, "shard", "epilog-env.txt"), encoding="utf-8") as handle:
        env = dict(line.rstrip("\n").split("=", 1) for line in handle if "=" in line)
    assert jobcheck.job_gpus(env) == ["0"] and jobcheck.mode_of([], env) == "epilog"
    assert not [name for name in env if "SHARD" in name or "MPS" in name]


def test_other_jobs_apps_and_their_context_overhead_are_deducted_per_gpu():
    found = _shared.shares(APPS, {GPU0["uuid"].lower(): 0, GPU1["uuid"].lower(): 1}, OWNERS.get)
    assert found == {0: _shared.Share(3500, 2, ("Slurm job 12", "Slurm job 13")), 1: _shared.Share(2000, 1, ("Slurm job 12",))}
    assert (found[0].allowance_mib, found[1].allowance_mib) == (3520, 2015)
    assert _shared.deducted(GPU0, found[0])["memory_used_mib"] == 4 and _shared.deducted(GPU0, found[0])["memory_used_raw_mib"] == 3524
    assert _shared.deducted(GPU1, found[1])["memory_used_mib"] == 0
    assert _shared.deducted(GPU0, None) is GPU0


def test_the_ending_jobs_and_no_jobs_processes_are_never_deducted():
    found = _shared.shares(APPS, {GPU0["uuid"].lower(): 0}, {101: "Slurm job 12"}.get)
    assert found == {0: _shared.Share(2000, 1, ("Slurm job 12",))}


class FakeSmi:
    def __init__(self, gpus, apps_text=None):
        self.gpus, self.apps_text, self.calls = gpus, apps_text, []

    def query_gpus(self, *args, **kwargs):
        self.calls.append("gpus")
        return [dict(g) for g in self.gpus]

    def query_all(self, *args, with_apps=True, **kwargs):
        self.calls.append("all")
        return [dict(g) for g in self.gpus], []

    def app_args(self):
        return ["--query-compute-apps=pid,gpu_uuid,used_memory"]

    def run(self, args):
        self.calls.append("apps")
        if self.apps_text is None:
            raise NvidiaSmiError("nvidia-smi failed")
        return self.apps_text

    timeout = 10


APPS_TEXT = "".join(f"{a['pid']}, {a['gpu_uuid']}, {a['used_memory_mib']}\n" for a in APPS)


def test_readings_deduct_only_on_the_jobs_gpus_and_only_when_they_read_dirty():
    smi = FakeSmi([GPU0, GPU1], APPS_TEXT)
    readings = _shared.SharedReadings(smi, lambda g: g["index"] == 0, OWNERS.get, limit=0)
    gpus = readings.query_gpus()
    assert [g["memory_used_mib"] for g in gpus] == [4, 2015] and set(readings.last) == {0}
    assert readings.timeout == 10  # everything else is the real nvidia-smi's
    clean = FakeSmi([dict(GPU0, memory_used_mib=0)], APPS_TEXT)
    assert _shared.SharedReadings(clean, lambda g: True, OWNERS.get, limit=0).query_gpus()[0]["memory_used_mib"] == 0
    assert clean.calls == ["gpus"]  # a clean GPU costs no compute-apps call


def test_the_look_through_query_all_is_deducted_too():
    smi = FakeSmi([GPU0], APPS_TEXT)
    gpus, apps = _shared.SharedReadings(smi, lambda g: True, OWNERS.get, limit=0).query_all(with_apps=False)
    assert gpus[0]["memory_used_mib"] == 4 and apps == [] and smi.calls == ["all", "apps"]


def test_no_compute_apps_no_deduction_never_a_guess():
    smi = FakeSmi([GPU0], None)
    assert _shared.SharedReadings(smi, lambda g: True, OWNERS.get, limit=0).query_gpus()[0]["memory_used_mib"] == 3524


ROOT = {"uid": 0, "exe_owner": 0, "exe_verified": True}


def mps_server(gpus, pid=40):
    return dict(ROOT, pid=pid, ppid=30, name="nvidia-cuda-mps", argv0="nvidia-cuda-mps-server", exe="nvidia-cuda-mps-server",
                exe_path="/usr/bin/nvidia-cuda-mps-server", cmdline="nvidia-cuda-mps-server", gpu_indexes=gpus, protected=False)


def test_an_mps_server_another_jobs_process_uses_is_kept_and_named():
    other_client = {"pid": 50, "name": "python3", "gpu_indexes": [0], "protected": True, "protected_reason": "Slurm job 12"}
    own_client = {"pid": 51, "name": "python3", "gpu_indexes": [0], "protected": False}
    spared: dict = {}
    marked = jobcheck.spare_shared_servers([mps_server([0]), other_client, own_client], spared)
    assert marked[0]["protected"] and marked[0]["protected_reason"] == "MPS server for Slurm job 12"
    assert not marked[2]["protected"] and spared == {40: "MPS server for Slurm job 12"}
    alone = jobcheck.spare_shared_servers([mps_server([1]), other_client, own_client])
    assert not alone[0]["protected"]  # a server no other job's process uses is the ending job's to quit


def test_a_users_process_named_like_an_mps_server_is_not_kept():
    posed = dict(mps_server([0]), uid=4242)
    other_client = {"pid": 50, "name": "python3", "gpu_indexes": [0], "protected": True, "protected_reason": "Slurm job 12"}
    assert not jobcheck.spare_shared_servers([posed, other_client])[0]["protected"]


def test_the_cause_on_a_shared_gpu_says_what_other_jobs_hold_there():
    other = {"pid": 50, "name": "train", "gpu_indexes": [0], "protected": True}
    result = {"selected_gpus": [0], "released": False, "holders": [other],
              "gpus": [{"index": 0, "memory_used_mib": 3000, "clean": False}],
              "shared": _shared.record({0: _shared.Share(2000, 1, ("Slurm job 12",))})}
    ok, causes = jobcheck.verdict("epilog", result, "x", {50: "12"})
    assert not ok and causes == ["GPU 0: 3000 MiB beyond the 2015 MiB that Slurm job 12 holds there, no process holds the rest"]
    stray = {"pid": 60, "name": "left", "gpu_indexes": [0], "protected": False}
    ok, causes = jobcheck.verdict("epilog", dict(result, holders=[other, stray]), "x", {50: "12"})
    assert causes == ["GPU 0: 3000 MiB beyond the 2015 MiB that Slurm job 12 holds there, held by pid 60 left"]


@pytest.mark.parametrize("tokens, index, uuid, expected", [
    (["0"], 0, "GPU-a", True), (["1"], 0, "GPU-a", False), (["gpu-A"], 3, "GPU-a", True), (None, 0, "GPU-a", False)])
def test_the_jobs_gpus_are_its_indexes_or_uuids(tokens, index, uuid, expected):
    assert jobcheck.given({"index": index, "uuid": uuid}, tokens) is expected


def test_shared_gpus_is_a_boolean():
    assert jobcheck.check_config({})["shared_gpus"] is False
    with pytest.raises(jobcheck.JobCheckError, match="shared_gpus must be true or false"):
        jobcheck.check_config({"shared_gpus": "yes"})


# ------------------------------------------------------------------ the epilog's run on the fake node

from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import FakeSmi as NodeSmi  # noqa: E402
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import FakeSystem, World, params  # noqa: E402

# Where slurmstepd put a task of job 12, read from a real slurmd 22.05.8 on cgroup v2
# (tests/fixtures/slurm-22.05.8/cgroup-v2/).
JOB_12_TASK = "0::/system.slice/s59-01_slurmstepd.scope/job_12/step_batch/user/task_0\n"


@pytest.fixture
def world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return World(root)


def epilog_run(world, ending="13", shared=True, **options):
    """JobRelease for the ending job on GPU 0, through SharedReadings when `shared` (as check_job wires it)."""
    real = NodeSmi(world)
    worker = jobcheck.JobRelease(real, FakeSystem(world), params(gpus=["0"], settle_timeout=0.5, **options), ending_job=ending,
                                 driver_root=str(world.root.parent / "no-driver"))
    if shared:
        worker.smi = _shared.SharedReadings(real, lambda g: g["index"] == 0, worker.others, 0)
    return worker, worker.run


def test_on_a_shared_gpu_the_epilog_ends_its_leftover_only_and_passes_beside_the_other_job(world):
    world.spawn(300, mem={0: 2000}, cgroup=JOB_12_TASK, comm="train_12")
    world.spawn(310, mem={0: 1500}, comm="leftover")  # the ending job's, reparented out of it: no job's
    worker, run = epilog_run(world)
    result = run()
    assert result["released"] and [k["pid"] for k in result["killed"]] == [310] and 300 in world.procs
    assert worker.smi.last == {0: _shared.Share(2000, 1, ("Slurm job 12",))}
    assert world.memory_used(0) == 2000


def test_without_shared_gpus_the_other_jobs_memory_fails_the_epilog_naming_the_job(world):
    world.spawn(300, mem={0: 2000}, cgroup=JOB_12_TASK, comm="train_12")
    worker, run = epilog_run(world, shared=False)
    with pytest.raises(jobcheck.ReleaseError) as info:
        run()
    ok, causes = jobcheck.verdict("epilog", info.value.result, info.value.msg, worker.spared)
    assert not ok and causes == ["GPU 0: 2000 MiB, held by pid 300 train_12 (Slurm job 12)"] and 300 in world.procs
