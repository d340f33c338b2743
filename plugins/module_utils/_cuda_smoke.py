# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The CUDA smoke test: can each free GPU really run CUDA?

A GPU can read 0 MiB and pass every nvidia-smi health field and still fail the first CUDA call
of a training job (a driver/library mismatch after an upgrade without reboot, a context that
cannot be created after an Xid, a fabric that never registered: CUDA_ERROR_SYSTEM_NOT_READY).
The node already has what a test needs: the driver's own libcuda.so.1. Per GPU, addressed by
PCI bus id (CUDA's device order can differ from nvidia-smi's): create a context, allocate,
write (memset), synchronize, free, destroy.

The CUDA calls run in a forked child process (its own process group), never in the module's
process: a hung call is killed with its group after the time bound and is a failure, never a
pass, and the module itself never holds a CUDA context (it reads the GPUs free afterwards).

Seams: `Driver` (the ctypes calls, faked in unit tests) and `run_in_child` (the process).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import time

try:
    from typing import Any, Callable, Dict, List, Optional, Tuple  # noqa: F401 (type comments)
except ImportError:  # pragma: no cover
    pass

LIBRARY = "libcuda.so.1"
MIB = 1 << 20
# At most this share of the GPU's free memory is allocated, whatever smoke_test_mib asks: the
# test proves that memory can be allocated and written, not that all of it can.
MAX_FREE_SHARE = 0.5
# How long the GPU may take to read free again once the test process has exited. Measured on
# H200: release follows process exit by ~20-130 ms (docs/design.md).
SETTLE_S = 5.0
# The steps of one GPU's test, in order: what `progress` reports and a failure names.
STEPS = ("cuDeviceGetByPCIBusId", "cuCtxCreate", "cuMemGetInfo", "cuMemAlloc", "cuMemsetD8", "cuCtxSynchronize", "cuMemFree",
         "cuCtxDestroy")


class CudaError(Exception):
    """A CUDA driver API call returned an error (`code`, a CUresult)."""

    def __init__(self, call, code, name=None, description=None):
        super().__init__(call, code)
        self.call = call
        self.code = code
        self.name = name
        self.description = description

    def __str__(self):
        return error_text(self.call, self.code, self.name, self.description)


def error_text(call, code, name=None, description=None):
    # type: (str, int, Optional[str], Optional[str]) -> str
    """'CUDA_ERROR_SYSTEM_NOT_READY (802) at cuCtxCreate: system not yet initialized'."""
    text = "%s (%d) at %s" % (name or "CUDA error", code, call)
    return text + (": " + description if description else "")


def alloc_bytes(requested_mib, free_bytes):
    # type: (int, int) -> int
    """What to allocate: smoke_test_mib, bounded by a share of the GPU's free memory."""
    return max(0, min(requested_mib * MIB, int(free_bytes * MAX_FREE_SHARE)))


class Driver:
    """The CUDA driver API through ctypes: the one seam of the smoke test. Raises CudaError."""

    def __init__(self, library=LIBRARY):
        # Raises OSError when the driver's library is not there.
        self.lib = ctypes.CDLL(library)

    def _string(self, function, code):
        text = ctypes.c_char_p()
        try:
            if getattr(self.lib, function)(ctypes.c_int(code), ctypes.byref(text)) != 0 or not text.value:
                return None
        except AttributeError:
            return None
        return text.value.decode("utf-8", "replace")

    def _call(self, step, function, *args):
        try:
            code = getattr(self.lib, function)(*args)
        except AttributeError:
            raise CudaError(step, -1, "missing entry point", f"libcuda does not export {function}")
        if code != 0:
            raise CudaError(step, code, self._string("cuGetErrorName", code), self._string("cuGetErrorString", code))

    def init(self):
        self._call("cuInit", "cuInit", ctypes.c_uint(0))

    def device(self, bus_id):
        handle = ctypes.c_int(0)
        self._call("cuDeviceGetByPCIBusId", "cuDeviceGetByPCIBusId", ctypes.byref(handle), ctypes.c_char_p(bus_id.encode("ascii")))
        return handle.value

    def create_context(self, device):
        context = ctypes.c_void_p(None)
        self._call("cuCtxCreate", "cuCtxCreate_v2", ctypes.byref(context), ctypes.c_uint(0), ctypes.c_int(device))
        return context

    def free_memory(self):
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._call("cuMemGetInfo", "cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value

    def alloc(self, size):
        pointer = ctypes.c_uint64(0)
        self._call("cuMemAlloc", "cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(size))
        return pointer.value

    def memset(self, pointer, value, size):
        self._call("cuMemsetD8", "cuMemsetD8_v2", ctypes.c_uint64(pointer), ctypes.c_ubyte(value), ctypes.c_size_t(size))

    def synchronize(self):
        self._call("cuCtxSynchronize", "cuCtxSynchronize")

    def free(self, pointer):
        self._call("cuMemFree", "cuMemFree_v2", ctypes.c_uint64(pointer))

    def destroy_context(self, context):
        self._call("cuCtxDestroy", "cuCtxDestroy_v2", context)


def test_gpu(driver, bus_id, mib, progress=lambda step: None, clock=time.monotonic):
    # type: (Any, str, int, Callable[[str], None], Callable[[], float]) -> Dict[str, Any]
    """One GPU's test on an initialized driver -> {ok, error, seconds, mib}. What was created is
    torn down also on a failure (a context left behind would keep the GPU's memory)."""
    started = clock()
    context = pointer = None
    size = 0
    error = None
    try:
        progress("cuDeviceGetByPCIBusId")
        device = driver.device(bus_id)
        progress("cuCtxCreate")
        context = driver.create_context(device)
        progress("cuMemGetInfo")
        size = alloc_bytes(mib, driver.free_memory())
        if size:
            progress("cuMemAlloc")
            pointer = driver.alloc(size)
            progress("cuMemsetD8")
            driver.memset(pointer, 0xA5, size)
        progress("cuCtxSynchronize")
        driver.synchronize()
    except CudaError as exc:
        error = exc
    for step, undo, handle in (("cuMemFree", driver.free, pointer), ("cuCtxDestroy", driver.destroy_context, context)):
        if handle is None:
            continue
        try:
            progress(step)
            undo(handle)
        except CudaError as exc:
            error = error or exc
    return result(error is None, str(error) if error else None, clock() - started, size // MIB)


def result(ok, error=None, seconds=None, mib=None, skipped=None):
    # type: (Optional[bool], Optional[str], Optional[float], Optional[int], Optional[str]) -> Dict[str, Any]
    """A GPU's `smoke_test` record. `ok` is None for a GPU not tested (then `skipped` says why)."""
    return {"ok": ok, "error": error, "seconds": None if seconds is None else round(seconds, 3), "mib": mib, "skipped": skipped}


# --- the child process


def _child(write_fd, bus_ids, mib, library, driver_factory):
    """In the forked child: one JSON line per step started and per GPU done. Never returns."""
    code = 0
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # never write into the module's JSON channel
            os.dup2(null, fd)
        # The test addresses GPUs by bus id: a CUDA_VISIBLE_DEVICES inherited from the
        # session would hide some of them.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)

        def send(record):
            os.write(write_fd, (json.dumps(record) + "\n").encode())

        send({"step": "cuInit"})
        started = time.monotonic()
        try:
            driver = driver_factory(library)
            driver.init()
        except OSError as exc:
            send({"init_error": f"cannot load {library}: {exc}"})
            os._exit(0)
        except CudaError as exc:
            send({"init_error": str(exc)})
            os._exit(0)
        send({"init_s": round(time.monotonic() - started, 3)})
        for bus_id in bus_ids:
            send({"bus": bus_id, "step": "start"})
            record = test_gpu(driver, bus_id, mib, lambda step, bus_id=bus_id: send({"bus": bus_id, "step": step}))
            send({"bus": bus_id, "result": record})
    except BaseException:  # pylint: disable=broad-except
        code = 70
    os._exit(code)


def _reap(pid, timeout):
    """Wait at most `timeout` s for the child to end -> how it ended; past that SIGKILL its
    process group (its own: set on both sides of the fork) and give it 1 s more. A child stuck
    in the kernel (D state) is left to the init to reap."""
    deadline = time.monotonic() + timeout
    killed = False
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except OSError:
            return "the test process ended"
        if done:
            if os.WIFSIGNALED(status):
                return "the test process died of signal %d" % os.WTERMSIG(status)
            return "the test process exited with status %d" % os.WEXITSTATUS(status)
        if time.monotonic() >= deadline:
            if killed:
                return "the test process could not be reaped (stuck in the kernel?)"
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            killed, deadline = True, time.monotonic() + 1.0
        time.sleep(0.005)


def run_in_child(bus_ids, mib, timeout, library=LIBRARY, driver_factory=Driver):
    # type: (List[str], int, float, str, Callable[[str], Any]) -> Tuple[Dict[str, Dict[str, Any]], Optional[float]]
    """Test each GPU (bus ids, in order) in one forked child -> ({bus id: result}, init_s).

    `timeout` bounds cuInit, and each GPU's test on its own. A GPU whose test outlasts it fails
    naming the call that hung; the child is killed as a process group and the GPUs after it are
    not reached (ok None, skipped says why)."""
    try:
        read_fd, write_fd = os.pipe()
    except OSError as exc:
        return {b: result(False, f"cannot start the test process: {exc}") for b in bus_ids}, None
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        return {b: result(False, f"cannot start the test process: {exc}") for b in bus_ids}, None
    if pid == 0:
        os.close(read_fd)
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        _child(write_fd, bus_ids, mib, library, driver_factory)
    os.close(write_fd)
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child did it first, or has already exited
        pass
    results = {}
    init_s = None
    current, step = None, "cuInit"
    deadline = time.monotonic() + timeout
    buffered = b""
    ended = None
    try:
        while len(results) < len(bus_ids) and ended is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ended = "timeout"
                break
            ready, _w, _x = select.select([read_fd], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(read_fd, 65536)
            if not chunk:
                ended = "eof"
                break
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                record = json.loads(line.decode())
                if "init_error" in record:
                    ended = record["init_error"]
                elif "init_s" in record:
                    init_s = record["init_s"]
                elif "result" in record:
                    results[record["bus"]] = record["result"]
                    current = None
                elif record.get("step") == "start":
                    current, step = record["bus"], "cuDeviceGetByPCIBusId"
                    deadline = time.monotonic() + timeout
                else:
                    step = record["step"]
    finally:
        os.close(read_fd)
    if ended is None:  # every GPU answered
        _reap(pid, timeout)
        return results, init_s
    if ended == "timeout":
        _reap(pid, 0)
        failure = f"timed out after {_seconds(timeout)} s in {step} (a hung CUDA call is a failure); the test process was killed"
    elif ended == "eof":
        failure = f"{_reap(pid, timeout)} in {step}"
    else:  # cuInit failed, or libcuda could not be loaded
        _reap(pid, timeout)
        failure = ended
    # cuInit failed or hung: every GPU fails with it; else the GPU being tested fails and the
    # ones after it are not reached.
    for bus_id in bus_ids:
        if bus_id in results:
            continue
        if current is None or bus_id == current:
            results[bus_id] = result(False, failure, timeout if ended == "timeout" else None)
        else:
            results[bus_id] = result(None, skipped=f"not reached: the test of an earlier GPU failed ({failure})")
    return results, init_s


def _seconds(value):
    return (f"{value:g}") if isinstance(value, float) else str(value)


# --- which GPUs, and the verdict


def users_of(index, holders):
    """Processes that use (or, undecided, may use) a GPU: protected ones too. NVML clients use none."""
    return [h for h in holders if index in set(h.get("gpu_indexes") or []) | set(h.get("candidate_gpu_indexes") or [])]


def skip_reason(gpu, holders, check_mode, max_used_mib, footprint=()):
    # type: (Dict[str, Any], List[Dict[str, Any]], bool, int, Any) -> Optional[str]
    """Why a GPU must not be tested now, or None. `footprint`: indexes of GPUs that read only
    the cross-GPU footprint of contexts on other GPUs (free)."""
    if check_mode:
        return "check mode: the smoke test runs CUDA work and runs only in a real run"
    if gpu.get("mig_mode") == "Enabled":
        return ("MIG mode is enabled: the smoke test addresses whole GPUs, not MIG instances; "
                "test the instances with a CUDA program of your own")
    if not gpu.get("pci_bus_id"):
        return "no PCI bus id: the GPU cannot be addressed without guessing CUDA's order"
    users = users_of(gpu["index"], holders)
    if users:
        return "in use by {}".format(", ".join("PID {} ({})".format(h["pid"], h.get("name")) for h in users[:5]))
    used = gpu.get("memory_used_mib")
    if (used is None or used > max_used_mib) and gpu["index"] not in footprint:
        return "not free: reads %s MiB (max_used_mib %d)" % (used, max_used_mib)
    return None


def issues(gpus):
    # type: (List[Dict[str, Any]]) -> List[str]
    """'GPU 0 (00000000:18:00.0): CUDA_ERROR_... (802) at cuCtxCreate: ...' for each failed GPU."""
    return ["GPU {} ({}): {}".format(g["index"], g.get("pci_bus_id"), g["smoke_test"]["error"])
            for g in gpus if (g.get("smoke_test") or {}).get("ok") is False]


def verdict(gpus):
    # type: (List[Dict[str, Any]]) -> Optional[bool]
    """Host-level: False when a GPU failed; True when every GPU asked for passed; None when none
    was tested or some were skipped (a skipped test is never reported as passed)."""
    records = [g["smoke_test"] for g in gpus if g.get("smoke_test")]
    if any(r["ok"] is False for r in records):
        return False
    if records and all(r["ok"] is True for r in records):
        return True
    return None


def settle(tested, read_used, limits, window=SETTLE_S, interval=0.05, clock=time.monotonic, sleep=time.sleep):
    """Poll memory until every tested GPU (index -> record) reads at most its limit (index ->
    MiB) again, at most `window` seconds; a GPU that does not fails its record.
    `read_used()` -> {index: MiB}."""
    deadline = clock() + window
    while True:
        used = read_used()
        high = {i: used.get(i) for i in tested if used.get(i) is None or used[i] > limits[i]}
        if not high or clock() >= deadline:
            break
        sleep(interval)
    for index, record in tested.items():
        record["memory_used_mib_after"] = used.get(index)
        if index in high and record["ok"] is not False:
            record["ok"] = False
            record["error"] = "the GPU reads %s MiB %s s after the smoke test (at most %d expected): the driver did not free its memory" % (
                used.get(index), _seconds(window), limits[index])


def smoke_test(gpus, holders, mib, timeout, max_used_mib, read_used, check_mode=False, selected=None, held_fails=False,
               footprint=(), runner=run_in_child):
    """Run the test on the `selected` indexes of `gpus` (all when None) -> (records by index, init_s).

    `holders`: a fresh attribution of who uses which GPU. With `held_fails` (gpu_release: the
    GPUs were just proven free) a GPU found in use is a failure, else (gpu_facts) a skip. A GPU
    of `footprint` is free and must read no more than before afterwards; the others at most
    `max_used_mib`."""
    records = {}
    to_test = []
    for gpu in gpus:
        if selected is not None and gpu["index"] not in selected:
            continue
        reason = skip_reason(gpu, holders, check_mode, max_used_mib, footprint)
        if reason and held_fails and reason.startswith(("in use", "not free")):
            records[gpu["index"]] = result(False, reason + " right before the smoke test: not tested")
        elif reason:
            records[gpu["index"]] = result(None, skipped=reason)
        else:
            to_test.append(gpu)
    init_s = None
    if to_test:
        by_bus, init_s = runner([g["pci_bus_id"] for g in to_test], mib, timeout)
        for gpu in to_test:
            records[gpu["index"]] = by_bus[gpu["pci_bus_id"]]
        limits = {g["index"]: max(max_used_mib, g.get("memory_used_mib") or 0) if g["index"] in footprint else max_used_mib
                  for g in to_test}
        settle({g["index"]: records[g["index"]] for g in to_test}, read_used, limits)
    return records, init_s


def annotate(gpus, records):
    """GPU records with their `smoke_test` (None for a GPU not asked about)."""
    return [dict(g, smoke_test=records.get(g["index"])) for g in gpus]


# --- the modules' entry points


def summary(gpus, records=None, asked=True, seconds=None):
    """The host-level keys: `smoke_test_passed` (see verdict; None when not asked),
    `smoke_test_issues`, and `smoke_test_s` (the whole test's time, None when nothing ran)."""
    if not asked:
        return {"smoke_test_passed": None, "smoke_test_issues": []}
    tested = annotate(gpus, records or {})
    chosen = [g for g in tested if g.get("smoke_test")]
    return {"smoke_test_passed": verdict(chosen), "smoke_test_issues": issues(chosen), "smoke_test_s": seconds}


def _read_used(smi):
    def read():
        return {g["index"]: g.get("memory_used_mib") for g in smi.query_gpus()}
    return read


def after_release(smi, params, result, check_mode, look):
    """gpu_release: test the selected GPUs once they are proven free. `look()` is a fresh
    _facts.Snapshot: who holds what right before the test. Updates `result` in place."""
    if not params.get("smoke_test"):
        result.update(summary(result.get("gpus") or [], asked=False))
        return result
    selected = result.get("selected_gpus") or []
    started = time.monotonic()
    if check_mode:
        records = {i: result_skipped(skip_reason({}, [], True, 0)) for i in selected}
    elif not result.get("released"):
        records = {i: result_skipped("not released: the smoke test runs only on GPUs proven free") for i in selected}
    else:
        snapshot = look()
        records, _init_s = smoke_test(snapshot.gpus, snapshot.holders, params["smoke_test_mib"], params["timeout"],
                                      params.get("max_used_mib") or 0, _read_used(smi), selected=selected, held_fails=True,
                                      footprint=snapshot.footprint)
    seconds = round(time.monotonic() - started, 3) if not check_mode and result.get("released") else None
    result["gpus"] = annotate(result.get("gpus") or [], records)
    result.update(summary(result["gpus"], records))
    del result["smoke_test_s"]  # gpu_release says it in timings, with its other phases
    if seconds is not None and isinstance(result.get("timings"), dict):
        result["timings"]["smoke_test_s"] = seconds
    return result


def for_facts(smi, params, facts, snapshot, check_mode):
    """gpu_facts: test the GPUs that are free now (read-only otherwise: a GPU in use, or any
    GPU in check mode, is skipped with the reason). Updates `facts` in place."""
    if not params.get("smoke_test") or facts.get("error"):
        facts.update(summary(facts.get("gpus") or [], asked=False))
        return facts
    started = time.monotonic()
    if not params.get("processes", True):
        records = {g["index"]: result_skipped("holders not read (processes: false): the smoke test needs to know the GPU is free")
                   for g in facts["gpus"]}
    else:
        records, _init_s = smoke_test(facts["gpus"], snapshot.holders, params["smoke_test_mib"], params["timeout"],
                                      params.get("max_used_mib") or 0, _read_used(smi), check_mode=check_mode,
                                      footprint=snapshot.footprint)
    ran = any(r.get("skipped") is None for r in records.values())
    facts["gpus"] = annotate(facts["gpus"], records)
    facts.update(summary(facts["gpus"], records, seconds=round(time.monotonic() - started, 3) if ran else None))
    return facts


def result_skipped(reason):
    return result(None, skipped=reason)
