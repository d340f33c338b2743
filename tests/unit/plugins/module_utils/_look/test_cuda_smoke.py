# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The CUDA smoke test's pure parts, with the driver seam faked: error naming, result shaping,
which GPUs are tested, the verdict, the memory check afterwards; and the child process bound
(a real fork, with a fake driver in it)."""

from __future__ import annotations

import os
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cuda_smoke as smoke
from ansible_collections.zeromib.gpu.plugins.module_utils._look._cuda_smoke import CudaError

BUS0, BUS1 = "00000000:18:00.0", "00000000:2A:00.0"


class FakeDriver:
    """The seam's methods; `fail` = {step: (code, name)}, `hang` = a step that sleeps."""

    def __init__(self, fail=None, hang=None, free_mib=143771, crash=None):
        self.fail = fail or {}
        self.hang = hang
        self.crash = crash
        self.free_bytes = free_mib * smoke.MIB
        self.calls = []

    def _step(self, step, value=None):
        self.calls.append(step)
        if step == self.hang:
            time.sleep(3600)
        if step == self.crash:
            os._exit(9)
        if step in self.fail:
            code, name = self.fail[step]
            raise CudaError(step, code, name, "described")
        return value

    def init(self):
        return self._step("cuInit")

    def device(self, bus_id):
        return self._step("cuDeviceGetByPCIBusId", {BUS0: 0, BUS1: 1}[bus_id])

    def create_context(self, device):
        return self._step("cuCtxCreate", f"ctx{device:d}")

    def free_memory(self):
        return self._step("cuMemGetInfo", self.free_bytes)

    def alloc(self, size):
        self.size = size
        return self._step("cuMemAlloc", 0x7F00)

    def memset(self, pointer, value, size):
        return self._step("cuMemsetD8")

    def synchronize(self):
        return self._step("cuCtxSynchronize")

    def free(self, pointer):
        return self._step("cuMemFree")

    def destroy_context(self, context):
        return self._step("cuCtxDestroy")


def test_error_names_the_cuda_error_by_name_and_number_and_the_call():
    assert str(CudaError("cuCtxCreate", 802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized")) == (
        "CUDA_ERROR_SYSTEM_NOT_READY (802) at cuCtxCreate: system not yet initialized")
    # A code the driver cannot name (cuGetErrorName fails) still says its number and where.
    assert smoke.error_text("cuMemAlloc", 12345) == "CUDA error (12345) at cuMemAlloc"


@pytest.mark.parametrize("mib, free_mib, expected_mib", [(1024, 143771, 1024), (1024, 1000, 500), (0, 143771, 0), (1024, 0, 0)])
def test_allocation_is_bounded_by_half_the_free_memory(mib, free_mib, expected_mib):
    assert smoke.alloc_bytes(mib, free_mib * smoke.MIB) == expected_mib * smoke.MIB


def test_a_healthy_gpu_runs_every_step_in_order_and_passes():
    driver = FakeDriver()
    record = smoke.test_gpu(driver, BUS0, 1024)
    assert driver.calls == list(smoke.STEPS)
    assert record["ok"] is True and record["error"] is None and record["mib"] == 1024 and record["skipped"] is None
    assert driver.size == 1024 * smoke.MIB


@pytest.mark.parametrize("step", ["cuDeviceGetByPCIBusId", "cuCtxCreate", "cuMemGetInfo", "cuMemAlloc", "cuMemsetD8", "cuCtxSynchronize",
                                  "cuMemFree", "cuCtxDestroy"])
def test_each_failing_step_fails_the_gpu_naming_it_and_still_tears_down(step):
    driver = FakeDriver(fail={step: (999, "CUDA_ERROR_UNKNOWN")})
    record = smoke.test_gpu(driver, BUS0, 1024)
    assert record["ok"] is False
    assert record["error"] == f"CUDA_ERROR_UNKNOWN (999) at {step}: described"
    created_context = smoke.STEPS.index(step) > smoke.STEPS.index("cuCtxCreate")
    if created_context:
        # A context left behind would keep the GPU's memory: destroyed also after a failure.
        assert driver.calls.count("cuCtxDestroy") == 1
    if step in ("cuMemsetD8", "cuCtxSynchronize"):
        assert "cuMemFree" in driver.calls


def test_zero_mib_creates_a_context_and_synchronizes_only():
    driver = FakeDriver()
    record = smoke.test_gpu(driver, BUS0, 0)
    assert "cuMemAlloc" not in driver.calls and record["ok"] is True and record["mib"] == 0


GPU0 = {"index": 0, "pci_bus_id": BUS0, "memory_used_mib": 0, "mig_mode": "Disabled"}
GPU1 = {"index": 1, "pci_bus_id": BUS1, "memory_used_mib": 0, "mig_mode": "Disabled"}


def holder(pid, gpus, protected=False, candidates=()):
    return {"pid": pid, "name": "python3", "gpu_indexes": list(gpus), "candidate_gpu_indexes": list(candidates), "protected": protected}


@pytest.mark.parametrize("gpu, holders, check_mode, reason", [
    (GPU0, [], False, None),
    (GPU0, [], True, "check mode: the smoke test runs CUDA work and runs only in a real run"),
    (dict(GPU0, mig_mode="Enabled"), [], False, "MIG mode is enabled"),
    (dict(GPU0, pci_bus_id=None), [], False, "no PCI bus id"),
    (GPU0, [holder(42, [0])], False, "in use by PID 42 (python3)"),
    (GPU0, [holder(42, [0], protected=True)], False, "in use by PID 42 (python3)"),  # protected: still in use
    (GPU0, [holder(42, [], candidates=[0, 1])], False, "in use by PID 42 (python3)"),  # undecided: may use it
    (GPU0, [holder(42, [1])], False, None),  # uses another GPU only
    (GPU0, [holder(42, [])], False, None),  # an NVML client uses no GPU
    (dict(GPU0, memory_used_mib=700), [], False, "not free: reads 700 MiB (max_used_mib 0)"),
    (dict(GPU0, memory_used_mib=None), [], False, "not free: reads None MiB"),
], ids=["free", "check_mode", "mig", "no_bus_id", "held", "held_by_protected", "maybe_held", "other_gpu", "nvml_client", "not_free",
        "unknown_memory"])
def test_which_gpus_are_tested(gpu, holders, check_mode, reason):
    found = smoke.skip_reason(gpu, holders, check_mode, 0)
    assert found == reason if reason is None else found.startswith(reason), found


def test_a_gpu_at_the_cross_gpu_footprint_is_free():
    assert smoke.skip_reason(dict(GPU0, memory_used_mib=4), [], False, 0, footprint={0}) is None


def records(*oks):
    return [{"index": i, "pci_bus_id": f"b{i:d}", "smoke_test": smoke.result(ok, "CUDA_ERROR_X (1) at cuInit" if ok is False else None,
                                                                                 0.2 if ok else None, 1024 if ok else None,
                                                                                 skipped="MIG" if ok is None else None)}
            for i, ok in enumerate(oks)]


@pytest.mark.parametrize("oks, passed", [((True, True), True), ((True, False), False), ((True, None), None), ((None,), None),
                                         ((False, None), False), ((), None)])
def test_verdict_never_reports_a_skipped_test_as_passed(oks, passed):
    assert smoke.verdict(records(*oks)) is passed


def test_issues_name_gpu_bus_id_and_error():
    assert smoke.issues(records(True, False)) == ["GPU 1 (b1): CUDA_ERROR_X (1) at cuInit"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def test_memory_must_read_free_again_after_the_test():
    clock = Clock()
    readings = iter([{0: 520, 1: 0}, {0: 0, 1: 0}])
    tested = {0: smoke.result(True), 1: smoke.result(True)}
    smoke.settle(tested, lambda: next(readings), {0: 0, 1: 0}, clock=clock, sleep=clock.sleep)
    assert tested[0]["ok"] is True and tested[0]["memory_used_mib_after"] == 0


def test_memory_left_after_the_test_fails_the_gpu():
    clock = Clock()
    tested = {0: smoke.result(True)}
    smoke.settle(tested, lambda: {0: 520}, {0: 0}, window=1.0, clock=clock, sleep=clock.sleep)
    assert tested[0]["ok"] is False and tested[0]["memory_used_mib_after"] == 520
    assert tested[0]["error"] == "the GPU reads 520 MiB 1 s after the smoke test (at most 0 expected): the driver did not free its memory"


def fake_runner(calls):
    def run(bus_ids, mib, timeout):
        calls.append((list(bus_ids), mib, timeout))
        return {b: smoke.result(True, seconds=0.2, mib=mib) for b in bus_ids}, 0.1
    return run


def test_gpu_release_treats_a_gpu_held_right_before_as_a_failure_and_tests_the_rest():
    calls = []
    found, _init = smoke.smoke_test([GPU0, GPU1], [holder(7, [1])], 1024, 10, 0, lambda: {0: 0, 1: 0}, held_fails=True,
                                    runner=fake_runner(calls))
    assert calls == [([BUS0], 1024, 10)]
    assert found[0]["ok"] is True
    assert found[1]["ok"] is False and found[1]["error"] == "in use by PID 7 (python3) right before the smoke test: not tested"


def test_gpu_facts_skips_a_held_gpu_and_only_the_selected_are_tested():
    calls = []
    found, _init = smoke.smoke_test([GPU0, GPU1], [holder(7, [1])], 64, 10, 0, lambda: {0: 0, 1: 0}, runner=fake_runner(calls))
    assert found[1]["ok"] is None and found[1]["skipped"] == "in use by PID 7 (python3)"
    found, _init = smoke.smoke_test([GPU0, GPU1], [], 64, 10, 0, lambda: {0: 0, 1: 0}, selected=[1], runner=fake_runner(calls))
    assert list(found) == [1] and calls[-1][0] == [BUS1]


def test_check_mode_runs_nothing():
    calls = []
    found, _init = smoke.smoke_test([GPU0, GPU1], [], 64, 10, 0, lambda: {}, check_mode=True, runner=fake_runner(calls))
    assert calls == [] and all(r["ok"] is None and r["skipped"].startswith("check mode") for r in found.values())


# --- the child process: a real fork, a fake driver inside it


def factory(driver):
    return lambda library: driver


def test_child_runs_every_gpu_and_reports_each():
    by_bus, init_s = smoke.run_in_child([BUS0, BUS1], 1024, 5, driver_factory=factory(FakeDriver()))
    assert by_bus[BUS0]["ok"] is True and by_bus[BUS1]["ok"] is True and by_bus[BUS0]["mib"] == 1024
    assert init_s is not None


def test_a_hung_call_fails_within_the_timeout_naming_it_and_later_gpus_are_not_reached():
    started = time.monotonic()
    by_bus, _init = smoke.run_in_child([BUS0, BUS1], 1024, 0.5, driver_factory=factory(FakeDriver(hang="cuCtxSynchronize")))
    assert time.monotonic() - started < 3
    assert by_bus[BUS0]["ok"] is False
    assert by_bus[BUS0]["error"] == "timed out after 0.5 s in cuCtxSynchronize (a hung CUDA call is a failure); the test process was killed"
    assert by_bus[BUS1]["ok"] is None and by_bus[BUS1]["skipped"].startswith("not reached: the test of an earlier GPU failed")


def test_a_hung_cuinit_fails_every_gpu():
    by_bus, init_s = smoke.run_in_child([BUS0, BUS1], 1024, 0.3, driver_factory=factory(FakeDriver(hang="cuInit")))
    assert init_s is None
    assert all(r["ok"] is False and "in cuInit" in r["error"] for r in by_bus.values())


def test_a_failed_cuinit_fails_every_gpu_with_its_error():
    driver = FakeDriver(fail={"cuInit": (802, "CUDA_ERROR_SYSTEM_NOT_READY")})
    by_bus, _init = smoke.run_in_child([BUS0, BUS1], 1024, 5, driver_factory=factory(driver))
    assert [r["error"] for r in by_bus.values()] == ["CUDA_ERROR_SYSTEM_NOT_READY (802) at cuInit: described"] * 2


def test_a_crashed_test_process_fails_the_gpu_it_was_on():
    by_bus, _init = smoke.run_in_child([BUS0, BUS1], 1024, 5, driver_factory=factory(FakeDriver(crash="cuMemsetD8")))
    assert by_bus[BUS0]["ok"] is False and by_bus[BUS0]["error"] == "the test process exited with status 9 in cuMemsetD8"
    assert by_bus[BUS1]["ok"] is None


def test_a_missing_libcuda_fails_every_gpu_saying_so():
    by_bus, _init = smoke.run_in_child([BUS0], 1024, 5, library="/nonexistent/libcuda.so.1")
    assert by_bus[BUS0]["error"].startswith("cannot load /nonexistent/libcuda.so.1: ")
