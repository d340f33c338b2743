"""Ghost-busy GPUs through the real gpu_release on a simulated host (issue 71): a GPU this run killed a
process on that still reads 100 % busy at ~100 W with no process and 0 MiB (Datura-ai/lium-io #1140)
gets a CUDA context opened and closed from a fresh process (the smoke test's path, through the fake
libcuda.so.1), is read again and said with what was seen and done; one that stays busy is a health
issue with the reset advice. The simulated driver's state: tests/sim/nvidia-smi settings.json
`ghost_busy` ("clears" once a context was opened and closed on it, "stuck" until a reset).
"""
import json
import os

import pytest

from ansible_in_ns import run_module
from test_smoke_test_gate import configure, cuda_calls

BUS = "00000000:00:07.0"  # GPU 1 of the h200x2 preset


@pytest.fixture(scope="module")
def host(module_nshost, library):
    return module_nshost("h200x2", seed="ghost01", libcuda=library)


def ghost(host, kind):
    with open(os.path.join(host.root.state, "settings.json"), "w") as handle:
        json.dump({host.config["gpus"][1]["uuid"]: {"ghost_busy": kind}} if kind else {}, handle)


@pytest.mark.parametrize("kind", ["clears", "stuck"])
def test_a_gpu_busy_with_no_process_after_the_kill_gets_a_context_and_is_said(host, kind):
    configure(host)
    ghost(host, kind)
    try:
        holder = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
        run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5})
    finally:
        ghost(host, None)
    assert not run.failed, run.msg
    assert run["released"] is True and not host.alive(holder.pid)
    [said] = run["ghost_busy"]
    assert said.startswith(f"GPU 1 ({BUS}) read 100 % busy at 101.5 W with no process and no memory after this run's kills; "
                           "a CUDA context was opened and closed on it from a fresh process"), said
    calls = cuda_calls(host)
    assert [c for c, _a in calls if c in ("cuDeviceGetByPCIBusId", "cuCtxCreate", "cuCtxDestroy")] == [
        "cuDeviceGetByPCIBusId", "cuCtxCreate", "cuCtxDestroy"], calls
    if kind == "clears":
        assert said.endswith(", and it now reads 0 % at 126.02 W (cleared)"), said
        assert run["healthy"] is True, run["health_issues"]
    else:
        assert said.endswith("still reads 100 % busy: reset it (nvidia-smi -r -i 1); nothing holds its device node now"), said
        assert run["healthy"] is False and any("reset it (nvidia-smi -r -i 1)" in issue for issue in run["health_issues"]), run["health_issues"]


def test_a_gpu_busy_before_the_run_and_never_killed_on_is_not_touched(host):
    """Without this run's kill on it, a busy GPU is not this run's ghost: no CUDA context is opened."""
    configure(host)
    ghost(host, "stuck")
    try:
        run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5})
    finally:
        ghost(host, None)
    assert run["ghost_busy"] == [] and cuda_calls(host) == []


def test_a_stuck_ghost_names_the_nvml_handle_holders_that_block_a_reset(host):
    """nvidia-persistenced keeps every GPU's device node open (NVML handles): a reset is refused while it
    runs, so the advice names it. gpu_release never signals it."""
    configure(host)
    ghost(host, "stuck")
    daemon = host.spawn(["gpu_holder", "--persistence-daemon", "--name", "nvidia-persistenced"])
    try:
        holder = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
        run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5})
        assert host.alive(daemon.pid) and not host.alive(holder.pid)
    finally:
        ghost(host, None)
        host.kill(daemon.pid)
        host.wait_gone(daemon.pid, 5)
    [said] = run["ghost_busy"]
    assert f"reset it (nvidia-smi -r -i 1); a reset is refused while NVML handles are open: stop pid {daemon.pid} nvidia-persiste" in said, said


def test_a_stuck_ghost_is_said_first_through_the_role_and_a_cleared_one_passes_the_gate(host):
    """The role's gate (free_gpus in a play, as a user runs it): a GPU that stays busy after the
    context is the host's failure, its first sentence naming the GPU and what it still reads; one the
    context cleared passes, and the outcome keeps what was seen and done."""
    from test_gpu_health_gate import run_role  # pylint: disable=import-outside-toplevel

    for kind in ("stuck", "clears"):
        configure(host)
        ghost(host, kind)
        try:
            holder = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
            outcome = run_role(host, {})
        finally:
            ghost(host, None)
        assert not host.alive(holder.pid)
        if kind == "stuck":
            assert outcome["failed"], outcome
            first = outcome["msg"].split("; ")[0]
            assert outcome["msg"].startswith("localhost: ") and f"GPU 1 ({BUS}) read 100 % busy at 101.5 W with no process" in first, outcome["msg"]
            assert "reset it (nvidia-smi -r -i 1)" in outcome["msg"], outcome["msg"]
        else:
            assert not outcome["failed"], outcome["msg"]
            [said] = outcome["result"]["ghost_busy"]
            assert said.endswith("(cleared)"), said


@pytest.mark.parametrize("kind", ["clears", "stuck"])
def test_a_users_nvml_client_open_during_the_clear_is_never_signalled_and_never_steers_it(host, kind):
    """A tenant (uid 4242) keeps an NVML client (a `dmon`-like monitor) open on every GPU while the
    ghost is cleared: the context is opened by the module's own child all the same, the client is
    never signalled, the cleared GPU reads cleared, and a stuck one's reset advice names the client
    as what blocks a reset (never as something root stopped)."""
    configure(host)
    ghost(host, kind)
    monitor = host.spawn_as(4242, ["gpu_holder", "--monitor", "dmon", "--name", "user-dmon"])
    try:
        holder = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
        run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5})
        assert host.alive(monitor.pid), "root signalled a user's NVML client"
    finally:
        ghost(host, None)
        host.kill(monitor.pid)
        host.wait_gone(monitor.pid, 5)
    assert not run.failed and not host.alive(holder.pid), run.msg
    assert all(k["pid"] != monitor.pid for k in run["killed"]), run["killed"]
    [said] = run["ghost_busy"]
    assert "a CUDA context was opened and closed on it from a fresh process" in said, said
    if kind == "clears":
        assert said.endswith("(cleared)"), said
    else:
        assert f"stop pid {monitor.pid} user-dmon" in said, said
