"""The CUDA smoke test through real Ansible on simulated hosts with a fake libcuda.so.1.

The fake (tests/sim/fake_libcuda.c, built here with the machine's C compiler) answers the
driver API's entry points with the real CUresult codes, fails a chosen call with a chosen code
or hangs in it (its config file in the host's /run/nvidia-sim), and logs every call: the log
proves what ran, on which bus id, and that check mode ran nothing. The host finds it where the
driver's packages put libcuda (the multiarch lib dir, inside the host's overlay).
"""
import os

import pytest

import fake_libcuda
from ansible_in_ns import run_module
from test_gpu_health_gate import run_role

BUS = {0: "00000000:00:06.0", 1: "00000000:00:07.0"}  # the h200x2 preset's GPUs


@pytest.fixture(scope="module")
def h200x2(module_nshost, library):
    return module_nshost("h200x2", seed="smoke01", libcuda=library)


def configure(host, **faults):
    host.clear_faults()
    fake_libcuda.clear_log(host.root.state)
    fake_libcuda.write_config(host.root.state, devices=[g["pci_bus_id"] for g in host.config["gpus"]], **faults)


def cuda_calls(host):
    return [(call, arg) for _pid, call, arg in fake_libcuda.calls(host.root.state) if call != "cuDriverGetVersion"]


def test_smoke_test_passes_on_every_freed_gpu_by_bus_id(h200x2):
    configure(h200x2)
    outcome = run_role(h200x2, {"free_gpus_smoke_test": True})
    assert not outcome["failed"], outcome["msg"]
    assert outcome["result"]["smoke_test_passed"] is True
    assert "smoke test passed on 2 GPUs (1024 MiB" in outcome["result"]["message"], outcome["result"]["message"]
    calls = cuda_calls(h200x2)
    assert [arg for call, arg in calls if call == "cuDeviceGetByPCIBusId"] == [BUS[0], BUS[1]]
    assert [call for call, _arg in calls] == ["cuInit"] + [
        "cuDeviceGetByPCIBusId", "cuCtxCreate", "cuMemGetInfo", "cuMemAlloc", "cuMemsetD8", "cuCtxSynchronize", "cuMemFree",
        "cuCtxDestroy"] * 2
    assert ("cuMemAlloc", str(1024 << 20)) in calls


def test_gpu_release_returns_each_gpus_smoke_test(h200x2):
    configure(h200x2)
    result = run_module(h200x2, "gpu_release", {"smoke_test": True, "smoke_test_mib": 64, "gpus": ["1"]})
    assert result["released"] and result["smoke_test_passed"] is True and result["smoke_test_issues"] == []
    by_index = {g["index"]: g for g in result["gpus"]}
    record = by_index[1]["smoke_test"]
    assert record["ok"] is True and record["mib"] == 64 and record["error"] is None and record["seconds"] < 1
    assert record["memory_used_mib_after"] == 0
    assert by_index[0].get("smoke_test") is None  # not selected: not tested
    assert [arg for call, arg in cuda_calls(h200x2) if call == "cuDeviceGetByPCIBusId"] == [BUS[1]]
    assert result["timings"]["smoke_test_s"] < 5


# (failing call, CUresult, its name): each fails the gate naming the GPU and the error
FAILURES = [
    ("cuInit", 3, "CUDA_ERROR_NOT_INITIALIZED"),
    ("cuDeviceGetByPCIBusId", 101, "CUDA_ERROR_INVALID_DEVICE"),
    ("cuCtxCreate", 802, "CUDA_ERROR_SYSTEM_NOT_READY"),
    ("cuMemAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY"),
    ("cuMemsetD8", 700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
    ("cuCtxSynchronize", 719, "CUDA_ERROR_LAUNCH_FAILED"),
]


@pytest.mark.parametrize("call,code,name", FAILURES, ids=[f[0] for f in FAILURES])
def test_each_failing_cuda_call_fails_the_gate_naming_gpu_and_error(h200x2, call, code, name):
    configure(h200x2, fail={call: code})
    outcome = run_role(h200x2, {"free_gpus_smoke_test": True})
    assert outcome["failed"], outcome
    message = outcome["msg"]
    assert message.startswith("localhost: ") and "smoke test failed: " in message, message
    for index in (0, 1):
        assert f"GPU {index} ({BUS[index]}): {name} ({code}) at {call}" in message, message
    assert outcome["result"]["status"] == "unhealthy" and outcome["result"]["smoke_test_passed"] is False
    calls = [c for c, _a in cuda_calls(h200x2)]
    if call not in ("cuInit", "cuDeviceGetByPCIBusId", "cuCtxCreate"):
        # What was created is torn down also after a failure.
        assert calls.count("cuCtxDestroy") == 2, calls


def test_a_hung_call_fails_within_the_timeout_and_its_process_is_killed(h200x2):
    configure(h200x2, hang=["cuCtxSynchronize"])
    outcome = run_role(h200x2, {"free_gpus_smoke_test": True, "free_gpus_timeout": 2})
    assert outcome["failed"], outcome
    assert f"GPU 0 ({BUS[0]}): timed out after 2 s in cuCtxSynchronize" in outcome["msg"], outcome["msg"]
    assert "a hung CUDA call is a failure" in outcome["msg"]
    hung = {int(pid) for pid, call, _arg in fake_libcuda.calls(h200x2.root.state) if call == "cuCtxSynchronize"}
    assert hung and not any(h200x2.alive(pid) for pid in hung), hung
    # GPU 1 was not reached: not tested, never reported as passed.
    assert [arg for call, arg in cuda_calls(h200x2) if call == "cuDeviceGetByPCIBusId"] == [BUS[0]]
    # The module's own clock (Ansible's start-up on a loaded 2-core machine is not the bound):
    # the timeout, the kill, the memory read after it.
    fake_libcuda.clear_log(h200x2.root.state)
    release = run_module(h200x2, "gpu_release", {"smoke_test": True, "timeout": 2})
    assert release["smoke_test_passed"] is False and 2 <= release["timings"]["smoke_test_s"] < 2 + 3, release["timings"]


def test_check_mode_never_runs_it(h200x2):
    configure(h200x2)
    outcome = run_role(h200x2, {"free_gpus_smoke_test": True}, check=True)
    release = run_module(h200x2, "gpu_release", {"smoke_test": True}, check=True)
    facts = run_module(h200x2, "gpu_facts", {"smoke_test": True}, check=True)
    assert cuda_calls(h200x2) == []
    assert release["smoke_test_passed"] is None
    for gpu in release["gpus"] + facts["ansible_facts"]["gpu"]["gpus"]:
        assert gpu["smoke_test"]["ok"] is None and gpu["smoke_test"]["skipped"].startswith("check mode"), gpu
    assert not outcome["failed"], outcome["msg"]


def test_a_held_gpu_is_never_tested(h200x2):
    configure(h200x2)
    holder = h200x2.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    try:
        facts = run_module(h200x2, "gpu_facts", {"smoke_test": True})["ansible_facts"]["gpu"]
        # gpu_release of GPU 0 only: GPU 1's holder stays, GPU 0 reads its cross-GPU footprint.
        release = run_module(h200x2, "gpu_release", {"smoke_test": True, "gpus": ["0"]})
        assert h200x2.alive(holder.pid)
    finally:
        h200x2.kill(holder.pid)
        h200x2.wait_gone(holder.pid, 5)
    gpus = {g["index"]: g for g in facts["gpus"]}
    assert gpus[1]["smoke_test"]["ok"] is None
    assert gpus[1]["smoke_test"]["skipped"] == f"in use by PID {holder.pid} (gpu_holder)" or \
        gpus[1]["smoke_test"]["skipped"].startswith(f"in use by PID {holder.pid} "), gpus[1]["smoke_test"]
    assert gpus[0]["smoke_test"]["ok"] is True
    assert facts["smoke_test_passed"] is None  # a skipped GPU is never reported as passed
    assert release["released"] and release["smoke_test_passed"] is True, release.get("smoke_test_issues")
    assert [arg for call, arg in cuda_calls(h200x2) if call == "cuDeviceGetByPCIBusId"] == [BUS[0], BUS[0]]


def test_a_mig_gpu_is_skipped_with_the_reason(h200x2):
    configure(h200x2)
    h200x2.set_fault({"field_values": {"1": {"mig.mode.current": "Enabled", "mig.mode.pending": "Enabled"}}})
    try:
        outcome = run_role(h200x2, {"free_gpus_smoke_test": True})
    finally:
        h200x2.clear_faults()
    assert not outcome["failed"], outcome["msg"]
    assert "smoke test skipped on GPU 1: MIG mode is enabled" in outcome["result"]["message"], outcome["result"]["message"]
    assert outcome["result"]["smoke_test_passed"] is None
    assert [arg for call, arg in cuda_calls(h200x2) if call == "cuDeviceGetByPCIBusId"] == [BUS[0]]


def test_without_libcuda_every_gpu_fails_saying_so(nshost):
    host = nshost("h200x2", seed="smoke02")
    result = run_module(host, "gpu_release", {"smoke_test": True})
    assert result["smoke_test_passed"] is False
    assert "cannot load libcuda.so.1" in result["smoke_test_issues"][0], result["smoke_test_issues"]


def test_smoke_test_mib_below_zero_is_refused(h200x2):
    result = run_module(h200x2, "gpu_release", {"smoke_test": True, "smoke_test_mib": -1})
    assert result["failed"] and result["msg"] == "smoke_test_mib must be at least 0, got -1"


def test_fake_libcuda_is_only_inside_the_host(h200x2):
    assert not os.path.exists("/usr/lib/x86_64-linux-gnu/libcuda.so.1") or os.path.realpath(
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1") != os.path.realpath(fake_libcuda.build())


def test_the_audit_shows_each_gpus_last_smoke_test(h200x2):
    import json

    from ansible_in_ns import REPO, VENV_BIN, playbook_env

    configure(h200x2, fail={"cuMemAlloc": 2})
    out = os.path.join(h200x2.dir, "audit")
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", os.path.join(REPO, "playbooks", "audit_gpus.yml"),
           "-e", "ansible_python_interpreter=/usr/bin/python3", "-e", json.dumps({"gpu_audit_smoke_test": True, "gpu_audit_report_dir": out})]
    proc = h200x2.run(cmd, env=playbook_env(), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out, "report.json")) as handle:
        gpus = json.load(handle)["hosts"][0]["gpus"]
    assert [g["smoke_test"]["result"] for g in gpus] == ["FAILED", "FAILED"]
    with open(os.path.join(out, "report.md")) as handle:
        markdown = handle.read()
    assert "## CUDA smoke test" in markdown
    assert f"| localhost | 0 | {BUS[0]} | FAILED |" in markdown and "CUDA_ERROR_OUT_OF_MEMORY (2) at cuMemAlloc" in markdown
    with open(os.path.join(out, "report.html")) as handle:
        assert "CUDA smoke test: FAILED: CUDA_ERROR_OUT_OF_MEMORY (2) at cuMemAlloc" in handle.read()
