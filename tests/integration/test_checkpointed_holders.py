"""CUDA-checkpointed holders (issue 70, NVIDIA cuda-checkpoint), through the real gpu_release
(ansible-playbook on a namespace host, tests/sim/cuda-checkpoint as root's tool in /usr/bin).

A running holder is locked and checkpointed before it is signalled (killing a restored process can
hard-hang the host: NVIDIA/cuda-checkpoint#53), then proven at 0 MiB; a checkpointed one (its memory
in host memory, taken back at restore) is refused before anything is done unless kill_checkpointed.
The tool is root's or nobody's: a tenant's cuda-checkpoint is never run; a hung or failing one never
blocks the run past its bound and never decides the verdict.
"""
import json
import os
import time

import pytest

from ansible_in_ns import run_module
from test_gpu_release import used
from test_paused_containers import ENDS, said_first_by_free_gpus, said_first_in_own_play
from test_slurm_epilog_smoke import epilog
from test_slurm_epilog_smoke import runner  # noqa: F401  # pylint: disable=unused-import  # a pytest fixture, used by name

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(os.path.dirname(HERE), "sim", "cuda-checkpoint")
USER = 4242
FAST = {"kill_timeout": 0.5, "wait_timeout": 3, "settle_timeout": 0}


def install(host):
    host.run(["ln", "-s", TOOL, "/usr/bin/cuda-checkpoint"], check=True)


def calls(host):
    try:
        with open(os.path.join(host.root.state, "cuda-checkpoint.log")) as handle:
            return [tuple(line.split()) for line in handle.read().split("\n") if line]
    except FileNotFoundError:
        return []


def faults(host, **fault):
    with open(os.path.join(host.root.state, "cuda-checkpoint.faults.json"), "w") as handle:
        json.dump(fault, handle)


def test_a_running_holder_is_locked_and_checkpointed_before_its_signal_then_proven_free(nshost):
    host = nshost("h200x1", seed="ckptrun")
    install(host)
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "4096"])
    run = run_module(host, "gpu_release", FAST)
    assert not run.failed, run.msg
    pid = str(holder.pid)
    # The lock and the checkpoint found the process alive: they came before its signal.
    assert calls(host) == [("get-state", pid), ("lock", pid), ("checkpoint", pid)], calls(host)
    assert [(e["pid"], e["state_before"]) for e in run["checkpointed_holders"]] == [(holder.pid, "running")]
    assert [k["pid"] for k in run["killed"]] == [holder.pid] and run["released"] is True
    assert not host.alive(holder.pid) and used(host, 0) == 0


def test_a_checkpointed_holder_is_refused_by_name_and_nothing_is_done(nshost):
    host = nshost("h200x1", seed="ckptdormant")
    install(host)
    busy = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    dormant = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8192"])
    host.run(["cuda-checkpoint", "--toggle", "--pid", str(dormant.pid)], check=True)
    assert used(host, 0) < 8192  # its memory left the GPU
    run = run_module(host, "gpu_release", FAST)
    msg = run["msg"]
    assert run.failed and msg.startswith("CUDA-checkpointed process(es) hold the selected GPUs' memory in host memory"), msg
    assert f"pid {dormant.pid} (" in msg and f"pid {busy.pid} (" not in msg, msg
    assert "kill_checkpointed: true" in msg and "reset" not in msg and "reboot" not in msg, msg
    assert run["killed"] == [] and host.alive(busy.pid) and host.alive(dormant.pid)
    assert ("lock", str(busy.pid)) not in calls(host)  # refused before anything was done
    checked = run_module(host, "gpu_release", FAST, check=True)  # check mode predicts the same refusal
    assert checked.failed and checked.msg == msg, checked.msg


def test_kill_checkpointed_ends_the_dormant_holder_and_frees_the_gpu(nshost):
    host = nshost("h200x1", seed="ckptkill")
    install(host)
    busy = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    dormant = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8192"])
    host.run(["cuda-checkpoint", "--toggle", "--pid", str(dormant.pid)], check=True)
    run = run_module(host, "gpu_release", dict(FAST, kill_checkpointed=True))
    assert not run.failed, run.msg
    assert {k["pid"] for k in run["killed"]} == {busy.pid, dormant.pid}
    assert any("saved state is lost" in w for w in run["warnings"]), run["warnings"]
    assert not host.alive(dormant.pid) and used(host, 0) == 0


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_the_refusal_of_a_checkpointed_holder_is_said_first_and_once_on_both_paths(nshost, tmp_path, core, python):
    """What the operator reads first, through free_gpus.yml and the role in a user's own play
    (the recording callback's task records), on the oldest and newest ansible-core: the refusal's
    sentence, naming the dormant holder, and nothing done."""
    host = nshost("h200x1", seed="ckptpaths")
    install(host)
    busy = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    dormant = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8192"])
    host.run(["cuda-checkpoint", "--toggle", "--pid", str(dormant.pid)], check=True)
    head = (f"CUDA-checkpointed process(es) hold the selected GPUs' memory in host memory and take it back when restored: pid {dormant.pid} "
            "(python3, root); nothing was done.")

    row = said_first_by_free_gpus(tmp_path, host, core, python, head, head)
    assert "reset" not in row and "reboot" not in row, row
    said_first_in_own_play(tmp_path, host, core, python, head, head)
    assert host.alive(busy.pid) and host.alive(dormant.pid) and ("lock", str(busy.pid)) not in calls(host)


def test_a_tenants_cuda_checkpoint_is_never_run(nshost):
    """Attacker: a user's cuda-checkpoint (her file in root's directory, or first on PATH) answers
    "checkpointed" for everyone, to have her holder refused or spared: root never runs it."""
    host = nshost("h200x1", seed="ckpttenant")
    host.run(["cp", TOOL, "/usr/bin/cuda-checkpoint"], check=True)
    host.run(["chown", str(USER), "/usr/bin/cuda-checkpoint"], check=True)
    host.run(["mkdir", "-p", "/tmp/tenant-bin"], check=True)
    host.run(["cp", TOOL, "/tmp/tenant-bin/cuda-checkpoint"], check=True)
    host.run(["chown", "-R", str(USER), "/tmp/tenant-bin"], check=True)
    faults(host, say="checkpointed")
    holder = host.spawn_as(USER, ["gpu_holder", "--gpus", "0", "--mib", "2048"])
    run = run_module(host, "gpu_release", FAST, extra_env={"PATH": "/tmp/tenant-bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"})
    assert not run.failed, run.msg
    assert calls(host) == [] and "checkpointed_holders" not in run.result
    assert [k["pid"] for k in run["killed"]] == [holder.pid] and used(host, 0) == 0


def test_a_hung_cuda_checkpoint_is_bounded_and_the_gpu_reading_decides(nshost):
    host = nshost("h200x1", seed="ckpthang")
    install(host)
    faults(host, hang=["get-state"])
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    started = time.monotonic()
    run = run_module(host, "gpu_release", FAST)
    assert not run.failed, run.msg
    assert time.monotonic() - started < 60
    assert any("cuda-checkpoint did not answer in time" in w for w in run["warnings"]), run["warnings"]
    assert [k["pid"] for k in run["killed"]] == [holder.pid] and run["released"] is True and used(host, 0) == 0


def test_a_failing_checkpoint_is_said_and_the_holder_signalled_as_without_the_tool(nshost):
    host = nshost("h200x1", seed="ckptfail")
    install(host)
    faults(host, fail=["checkpoint"])
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    run = run_module(host, "gpu_release", FAST)
    assert not run.failed, run.msg
    assert any(f"pid {holder.pid} (" in w and "was not checkpointed before its signal: cuda-checkpoint failed (rc 1" in w
               for w in run["warnings"]), run["warnings"]
    assert run["checkpointed_holders"] == [] and [k["pid"] for k in run["killed"]] == [holder.pid] and used(host, 0) == 0


def test_without_the_tool_nothing_is_asked(nshost):
    host = nshost("h200x1", seed="ckptnone")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    run = run_module(host, "gpu_release", FAST)
    assert not run.failed and "checkpointed_holders" not in run.result and [k["pid"] for k in run["killed"]] == [holder.pid]


def test_the_slurm_epilog_checkpoints_a_running_leftover_before_its_signal(nshost, runner, tmp_path):  # noqa: F811
    host = nshost("h200x2", seed="ckptepi")
    install(host)
    left = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "4096"])
    rc, stderr, entry = epilog(host, runner, tmp_path, "901")
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), (stderr, entry)
    assert ("lock", str(left.pid)) in calls(host) and ("checkpoint", str(left.pid)) in calls(host)
    assert [k["pid"] for k in entry["killed"]] == [left.pid] and not host.alive(left.pid) and used(host, 1) == 0


def test_the_slurm_epilog_refuses_a_checkpointed_leftover_with_the_sentence_first(nshost, runner, tmp_path):  # noqa: F811
    host = nshost("h200x2", seed="ckptepidormant")
    install(host)
    busy = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    dormant = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "8192"])
    host.run(["cuda-checkpoint", "--toggle", "--pid", str(dormant.pid)], check=True)
    rc, stderr, entry = epilog(host, runner, tmp_path, "902")
    assert rc != 0 and not entry["ok"], (stderr, entry)
    cause = " ".join(entry["causes"])
    assert entry["causes"][0].startswith("CUDA-checkpointed process(es) hold the selected GPUs' memory in host memory"), entry
    assert f"pid {dormant.pid} (" in cause and "reset" not in cause.lower(), entry
    assert host.alive(busy.pid) and host.alive(dormant.pid)
