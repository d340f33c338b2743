"""Which process uses which GPU, through real ansible-playbook on simulated multi-GPU hosts.

Every CUDA process opens (and maps) every GPU's node, NVML clients open them all too (measured on
a real 2-GPU H200, see tests/gpu/results/README.md, "Measured on a real 2-GPU H200 node"): gpu_facts and gpu_release
must go by `attribution` (listed, mapped, nvml_client), never by the device files alone; a GPU
next to a context on another GPU reads the 4 MiB cross-GPU footprint and is clean."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402

FOOTPRINT = 4


def used(host, index):
    out = host.smi("-i", str(index), "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout
    return int(out.strip())


def killed_pids(run):
    return [k["pid"] for k in run["killed"]]


def facts(run):
    assert not run.failed, run.msg
    return run["ansible_facts"]["gpu"]


def by_pid(records, pid):
    [record] = [r for r in records if r["pid"] == pid]
    return record


def gpu_rec(run_or_facts, index):
    [gpu] = [g for g in run_or_facts["gpus"] if g["index"] == index]
    return gpu


@pytest.mark.parametrize("preset", ["h200x2", "h200x8"])
def test_freeing_gpu_1_kills_its_holder_keeps_the_gpu0_trainer_and_reads_the_footprint_clean(nshost, preset):
    host = nshost(preset)
    trainer = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2566"])
    other = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2566"])
    assert used(host, 0) == 2566 + 9 and used(host, 1) == 2566 + 9
    run = run_module(host, "gpu_release", {"gpus": ["1"]})
    assert not run.failed, run.msg
    assert run["selected_gpus"] == [1] and killed_pids(run) == [other.pid]
    assert run["released"] is True and run["changed"] is True
    assert host.alive(trainer.pid) and not host.alive(other.pid)
    assert used(host, 1) == FOOTPRINT and used(host, 0) == 2566 + 9
    gpu1 = gpu_rec(run, 1)
    assert gpu1["memory_used_mib"] == FOOTPRINT and gpu1["clean"] is True and gpu1["cross_gpu_footprint"] is True
    assert gpu_rec(run, 0)["clean"] is False and gpu_rec(run, 0)["cross_gpu_footprint"] is False
    # the next run finds GPU 1 free: nothing to do, the trainer is still not touched
    again = run_module(host, "gpu_release", {"gpus": ["1"]})
    assert not again.failed, again.msg
    assert again["changed"] is False and again["killed"] == [] and again["released"] is True and host.alive(trainer.pid)


def test_gpus_1_with_only_a_gpu0_trainer_running_kills_nothing(nshost):
    # tests/gpu/results/README.md: with the 2026-11-29 code, `gpus: ["1"]` with only a GPU-0 training process
    # running killed that process (it has GPU 1's node open and mapped, 128 KiB).
    host = nshost("h200x2")
    trainer = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2566"])
    run = run_module(host, "gpu_release", {"gpus": ["1"]})
    assert not run.failed, run.msg
    assert run["killed"] == [] and run["changed"] is False and run["released"] is True
    assert host.alive(trainer.pid) and used(host, 1) == FOOTPRINT
    assert gpu_rec(run, 1)["cross_gpu_footprint"] is True and gpu_rec(run, 1)["clean"] is True
    record = by_pid(run["holders"], trainer.pid)
    assert record["gpu_indexes"] == [0] and record["attribution"] == "listed"


def test_cuda_visible_devices_holder_is_attributed_to_its_one_gpu_and_left_alone_for_the_other(nshost):
    host = nshost("h200x2")
    # CUDA_VISIBLE_DEVICES=1 --gpus 0: logical GPU 0 is physical GPU 1; GPU 0 is hidden from it.
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2566"], env={"CUDA_VISIBLE_DEVICES": "1"})
    assert used(host, 1) == 2566 + 9 and used(host, 0) == 0  # no footprint from a restricted process
    gpu = facts(run_module(host, "gpu_facts"))
    record = by_pid(gpu["holders"], holder.pid)
    assert record["gpu_indexes"] == [1] and record["attribution"] == "listed"
    assert gpu_rec(gpu, 0)["clean"] is True and gpu_rec(gpu, 0)["cross_gpu_footprint"] is False
    assert gpu_rec(gpu, 1)["clean"] is False and gpu["clean"] is False

    run = run_module(host, "gpu_release", {"gpus": ["0"]})
    assert not run.failed, run.msg
    assert run["killed"] == [] and run["changed"] is False and host.alive(holder.pid)

    run = run_module(host, "gpu_release", {"gpus": ["1"]})
    assert not run.failed, run.msg
    assert killed_pids(run) == [holder.pid] and run["released"] is True and used(host, 1) == 0


@pytest.mark.parametrize("preset", ["h200x2", "h200x8"])
def test_orphan_of_a_dead_gpu1_owner_is_left_alone_for_gpu_0_and_freed_for_gpu_1(nshost, preset):
    host = nshost(preset)
    parent = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2566", "--fork-child"])
    [child] = parent.children
    host.kill(parent.pid)
    assert host.wait_gone(parent.pid)
    assert used(host, 1) == 2566 + 9 and used(host, 0) == FOOTPRINT  # the child keeps the parent's maps

    gpu = facts(run_module(host, "gpu_facts"))
    orphan = by_pid(gpu["holders"], child)
    assert orphan["gpu_indexes"] == [1] and orphan["attribution"] == "mapped" and orphan["ppid"] == 1
    [app] = gpu["processes"]
    assert app["pid"] == parent.pid and app["alive"] is False and app["gpu_index"] == 1
    assert gpu_rec(gpu, 0)["clean"] is True and gpu_rec(gpu, 0)["cross_gpu_footprint"] is True

    run = run_module(host, "gpu_release", {"gpus": ["0"]})
    assert not run.failed, run.msg
    assert run["killed"] == [] and host.alive(child) and run["released"] is True

    run = run_module(host, "gpu_release", {"gpus": ["1"]})
    assert not run.failed, run.msg
    assert killed_pids(run) == [child] and not host.alive(child) and run["released"] is True
    assert all(used(host, i) == 0 for i in range(len(host.config["gpus"])))


@pytest.mark.parametrize("preset", ["h200x2", "h200x8"])
def test_nvml_monitors_survive_every_run_and_a_host_with_only_monitors_is_clean(nshost, preset):
    host = nshost(preset)
    dmon = host.spawn(["gpu_holder", "--monitor", "dmon"])
    pynvml = host.spawn(["gpu_holder", "--monitor", "pynvml"])
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["clean"] is True and gpu["memory_used_mib"] == 0
    for pid in (dmon.pid, pynvml.pid):
        record = by_pid(gpu["holders"], pid)
        assert record["attribution"] == "nvml_client" and record["gpu_indexes"] == [], record
        assert any(d.startswith("/dev/nvidia") and d[len("/dev/nvidia"):].isdigit() for d in record["devices"])
    assert not any(g["cross_gpu_footprint"] for g in gpu["gpus"])

    trainer = host.spawn(["gpu_holder", "--gpus", "0,1", "--mib", "1024"])
    # the trainer spans GPUs 0 and 1: freeing GPU 1 alone is refused, and nothing is signalled
    refused = run_module(host, "gpu_release", {"gpus": ["1"]})
    assert refused.failed and f"pid {trainer.pid}" in refused.msg and refused["killed"] == []
    for args in ({}, {"gpus": ["0"]}):
        run = run_module(host, "gpu_release", args)
        assert not run.failed, (args, run.msg)
        assert dmon.pid not in killed_pids(run) and pynvml.pid not in killed_pids(run), args
        assert host.alive(dmon.pid) and host.alive(pynvml.pid), args
        assert run["released"] is True
    assert not host.alive(trainer.pid)
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["clean"] is True and {h["pid"] for h in gpu["holders"]} == {dmon.pid, pynvml.pid}


def test_gpu_facts_says_per_holder_why_it_uses_which_gpu(nshost):
    host = nshost("h200x8", minors=[1, 0, 2, 3, 4, 5, 6, 7])
    trainer = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "4096"])
    parent = host.spawn(["gpu_holder", "--gpus", "2", "--mib", "2048", "--fork-child"])
    [child] = parent.children
    host.kill(parent.pid)
    assert host.wait_gone(parent.pid)
    dmon = host.spawn(["gpu_holder", "--monitor", "dmon"])
    gpu = facts(run_module(host, "gpu_facts"))
    got = {pid: (by_pid(gpu["holders"], pid)["attribution"], by_pid(gpu["holders"], pid)["gpu_indexes"])
           for pid in (trainer.pid, child, dmon.pid)}
    assert got == {trainer.pid: ("listed", [0]), child: ("mapped", [2]), dmon.pid: ("nvml_client", [])}
    assert gpu["clean"] is False
    assert [g["index"] for g in gpu["gpus"] if not g["clean"]] == [0, 2]
    footprint = [g["index"] for g in gpu["gpus"] if g["cross_gpu_footprint"]]
    assert footprint == [1, 3, 4, 5, 6, 7]
    assert all(g["memory_used_mib"] == FOOTPRINT and g["clean"] for g in gpu["gpus"] if g["index"] in footprint)


# --------------------------------------------------------------------------- spanning (issue 20.3)


@pytest.mark.parametrize("preset", ["h200x2", "h200x8"])
@pytest.mark.parametrize("check", [False, True], ids=["real", "check-mode"])
def test_process_listed_on_gpus_0_and_1_is_not_signalled_for_gpu_1_and_the_failure_names_it(nshost, preset, check):
    # JAX preallocates on every visible GPU; a DataParallel trainer holds several: nvidia-smi lists
    # the one PID on GPU 0 and on GPU 1. Freeing GPU 1 must not end its work on GPU 0.
    host = nshost(preset)
    spanning = host.spawn(["gpu_holder", "--gpus", "0,1", "--mib", "3000", "--name", "jax_train"])
    alone = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "1000"])
    before = (used(host, 0), used(host, 1))
    run = run_module(host, "gpu_release", {"gpus": ["1"]}, check=check)
    assert run.failed, run.result
    assert run.msg.startswith("refusing to free GPU 1:"), run.msg
    assert f"pid {spanning.pid} jax_train" in run.msg and "uses GPUs 0,1; GPU 0 is outside the selection" in run.msg, run.msg
    assert "Nothing was stopped or signalled" in run.msg and "kill_spanning" in run.msg
    assert run["killed"] == [] and run["stopped_units"] == []
    [entry] = run["spanning"]
    assert (entry["pid"], entry["gpu_indexes"], entry["outside_gpus"]) == (spanning.pid, [0, 1], [0])
    # nothing was signalled, not even the holder of GPU 1 alone: the run failed before acting
    assert host.alive(spanning.pid) and host.alive(alone.pid) and (used(host, 0), used(host, 1)) == before


@pytest.mark.parametrize("preset", ["h200x2", "h200x8"])
def test_kill_spanning_frees_gpu_1_by_ending_the_process_on_gpus_0_and_1(nshost, preset):
    host = nshost(preset)
    spanning = host.spawn(["gpu_holder", "--gpus", "0,1", "--mib", "3000", "--name", "jax_train"])
    check = run_module(host, "gpu_release", {"gpus": ["1"], "kill_spanning": True}, check=True)
    assert not check.failed, check.msg
    assert [k["pid"] for k in check["killed"]] == [spanning.pid] and host.alive(spanning.pid)
    run = run_module(host, "gpu_release", {"gpus": ["1"], "kill_spanning": True})
    assert not run.failed, run.msg
    assert killed_pids(run) == [spanning.pid] and run["released"] is True and not host.alive(spanning.pid)
    assert run["spanning"][0]["pid"] == spanning.pid and run["spanning"][0]["outside_gpus"] == [0]
    assert all(used(host, i) == 0 for i in range(len(host.config["gpus"])))


def test_selecting_every_gpu_a_process_uses_frees_it_without_kill_spanning(nshost):
    host = nshost("h200x8")
    spanning = host.spawn(["gpu_holder", "--gpus", "2,5", "--mib", "2000"])
    refused = run_module(host, "gpu_release", {"gpus": ["2", "3"]})
    assert refused.failed and "GPU 5 is outside the selection" in refused.msg and host.alive(spanning.pid)
    run = run_module(host, "gpu_release", {"gpus": ["2", "5"]})
    assert not run.failed, run.msg
    assert killed_pids(run) == [spanning.pid] and run["spanning"] == [] and run["released"] is True
