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
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _options

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._facts import Snapshot
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Gpu, Holder

    # A GPU's `smoke_test` record: {ok, error, seconds, mib, skipped}, and memory_used_mib_after.
    Record = t.Dict[str, t.Any]

LIBRARY = "libcuda.so.1"
MIB = 1 << 20
# At most this share of the GPU's free memory is allocated, whatever smoke_test_mib asks: the
# test proves that memory can be allocated and written, not that all of it can.
MAX_FREE_SHARE = 0.5
# How long the GPU may take to read free again once the test process has exited. Measured on
# H200: release follows process exit by ~20-130 ms (tests/gpu/results/README.md, "Measured on a real H200").
SETTLE_S = 5.0
# The steps of one GPU's test, in order: what `progress` reports and a failure names.
STEPS = ("cuDeviceGetByPCIBusId", "cuCtxCreate", "cuMemGetInfo", "cuMemAlloc", "cuMemsetD8", "cuCtxSynchronize", "cuMemFree",
         "cuCtxDestroy")


class CudaError(Exception):
    """A CUDA driver API call returned an error (`code`, a CUresult)."""

    def __init__(self, call: str, code: int, name: str | None = None, description: str | None = None) -> None:
        super().__init__(call, code)
        self.call = call
        self.code = code
        self.name = name
        self.description = description

    def __str__(self) -> str:
        return error_text(self.call, self.code, self.name, self.description)


def error_text(call: str, code: int, name: str | None = None, description: str | None = None) -> str:
    """'CUDA_ERROR_SYSTEM_NOT_READY (802) at cuCtxCreate: system not yet initialized'."""
    text = "{} ({:d}) at {}".format(name or "CUDA error", code, call)
    return text + (": " + description if description else "")


def alloc_bytes(requested_mib: int, free_bytes: int) -> int:
    """What to allocate: smoke_test_mib, bounded by a share of the GPU's free memory."""
    return max(0, min(requested_mib * MIB, int(free_bytes * MAX_FREE_SHARE)))


class Driver:
    """The CUDA driver API through ctypes: the one seam of the smoke test. Raises CudaError."""

    def __init__(self, library: str = LIBRARY) -> None:
        # Raises OSError when the driver's library is not there.
        self.lib = ctypes.CDLL(library)

    def _string(self, function: str, code: int) -> str | None:
        text = ctypes.c_char_p()
        try:
            if getattr(self.lib, function)(ctypes.c_int(code), ctypes.byref(text)) != 0 or not text.value:
                return None
        except AttributeError:
            return None
        return str(text.value.decode("utf-8", "replace"))

    def _call(self, step: str, function: str, *args: t.Any) -> None:
        try:
            code = getattr(self.lib, function)(*args)
        except AttributeError:
            raise CudaError(step, -1, "missing entry point", f"libcuda does not export {function}") from None
        if code != 0:
            raise CudaError(step, code, self._string("cuGetErrorName", code), self._string("cuGetErrorString", code))

    def init(self) -> None:
        self._call("cuInit", "cuInit", ctypes.c_uint(0))

    def device(self, bus_id: str) -> int:
        handle = ctypes.c_int(0)
        self._call("cuDeviceGetByPCIBusId", "cuDeviceGetByPCIBusId", ctypes.byref(handle), ctypes.c_char_p(bus_id.encode("ascii")))
        return handle.value

    def create_context(self, device: int) -> ctypes.c_void_p:
        context = ctypes.c_void_p(None)
        self._call("cuCtxCreate", "cuCtxCreate_v2", ctypes.byref(context), ctypes.c_uint(0), ctypes.c_int(device))
        return context

    def free_memory(self) -> int:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._call("cuMemGetInfo", "cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return free.value

    def alloc(self, size: int) -> int:
        pointer = ctypes.c_uint64(0)
        self._call("cuMemAlloc", "cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(size))
        return pointer.value

    def memset(self, pointer: int, value: int, size: int) -> None:
        self._call("cuMemsetD8", "cuMemsetD8_v2", ctypes.c_uint64(pointer), ctypes.c_ubyte(value), ctypes.c_size_t(size))

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize", "cuCtxSynchronize")

    def free(self, pointer: int) -> None:
        self._call("cuMemFree", "cuMemFree_v2", ctypes.c_uint64(pointer))

    def destroy_context(self, context: ctypes.c_void_p) -> None:
        self._call("cuCtxDestroy", "cuCtxDestroy_v2", context)


def test_gpu(driver: t.Any, bus_id: str, mib: int, progress: t.Callable[[str], None] = lambda step: None,
             clock: t.Callable[[], float] = time.monotonic) -> Record:
    """One GPU's test on an initialized driver -> {ok, error, seconds, mib}. What was created is
    torn down also on a failure (a context left behind would keep the GPU's memory)."""
    started = clock()
    context: t.Any = None
    pointer: int | None = None
    size = 0
    error: CudaError | None = None
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
    undos: tuple[tuple[str, t.Callable[[t.Any], None], t.Any], ...] = (
        ("cuMemFree", driver.free, pointer), ("cuCtxDestroy", driver.destroy_context, context))
    for step, undo, handle in undos:
        if handle is None:
            continue
        try:
            progress(step)
            undo(handle)
        except CudaError as exc:
            error = error or exc
    return result(error is None, str(error) if error else None, clock() - started, size // MIB)


def result(ok: bool | None, error: str | None = None, seconds: float | None = None, mib: int | None = None,
           skipped: str | None = None) -> Record:
    """A GPU's `smoke_test` record. `ok` is None for a GPU not tested (then `skipped` says why)."""
    return {"ok": ok, "error": error, "seconds": None if seconds is None else round(seconds, 3), "mib": mib, "skipped": skipped}


# --- the child process


def _child(write_fd: int, bus_ids: list[str], mib: int, library: str, driver_factory: t.Callable[[str], t.Any]) -> t.NoReturn:
    """In the forked child: one JSON line per step started and per GPU done. Never returns."""
    code = 0
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # never write into the module's JSON channel
            os.dup2(null, fd)
        # The test addresses GPUs by bus id: a CUDA_VISIBLE_DEVICES inherited from the
        # session would hide some of them.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)

        def send(record: dict[str, t.Any]) -> None:
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

            def told(step: str, bus_id: str = bus_id) -> None:
                send({"bus": bus_id, "step": step})

            record = test_gpu(driver, bus_id, mib, told)
            send({"bus": bus_id, "result": record})
    except BaseException:  # pylint: disable=broad-except
        code = 70
    os._exit(code)


def _reap(pid: int, timeout: float) -> str:
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
                return f"the test process died of signal {os.WTERMSIG(status):d}"
            return f"the test process exited with status {os.WEXITSTATUS(status):d}"
        if time.monotonic() >= deadline:
            if killed:
                return "the test process could not be reaped (stuck in the kernel?)"
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            killed, deadline = True, time.monotonic() + 1.0
        time.sleep(0.005)


def _start_child(bus_ids: list[str], mib: int, library: str, driver_factory: t.Callable[[str], t.Any]) -> tuple[int, int] | str:
    """Fork the test process, in a process group of its own -> (its pid, the pipe it writes to),
    or why it could not be started."""
    try:
        read_fd, write_fd = os.pipe()
    except OSError as exc:
        return f"cannot start the test process: {exc}"
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        return f"cannot start the test process: {exc}"
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
    return pid, read_fd


class _Progress:
    """What the child has said so far: each GPU's result, cuInit's time, the GPU and the call
    under way, and how the conversation ended (None: it has not; "timeout", "eof", or why
    cuInit failed)."""

    def __init__(self) -> None:
        self.results: dict[str, Record] = {}
        self.init_s: float | None = None
        self.current: str | None = None
        self.step = "cuInit"
        self.ended: str | None = None

    def take(self, record: dict[str, t.Any]) -> bool:
        """One line of the child's; True when a GPU's test began (it has a time bound of its own)."""
        if "init_error" in record:
            self.ended = record["init_error"]
        elif "init_s" in record:
            self.init_s = record["init_s"]
        elif "result" in record:
            self.results[record["bus"]] = record["result"]
            self.current = None
        elif record.get("step") == "start":
            self.current, self.step = record["bus"], "cuDeviceGetByPCIBusId"
            return True
        else:
            self.step = record["step"]
        return False


def _follow(read_fd: int, count: int, timeout: float) -> _Progress:
    """Read the child's lines until `count` GPUs answered, the pipe closed, cuInit failed, or
    cuInit or one GPU's test outlasted `timeout`."""
    progress = _Progress()
    deadline = time.monotonic() + timeout
    buffered = b""
    while len(progress.results) < count and progress.ended is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            progress.ended = "timeout"
            break
        ready, _w, _x = select.select([read_fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:
            progress.ended = "eof"
            break
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            if progress.take(json.loads(line.decode())):
                deadline = time.monotonic() + timeout
    return progress


def _failure(pid: int, progress: _Progress, timeout: float) -> str:
    """End the child that did not answer for every GPU -> what every GPU not answered fails with."""
    if progress.ended == "timeout":
        _reap(pid, 0)
        return f"timed out after {_seconds(timeout)} s in {progress.step} (a hung CUDA call is a failure); the test process was killed"
    if progress.ended == "eof":
        return f"{_reap(pid, timeout)} in {progress.step}"
    # cuInit failed, or libcuda could not be loaded
    _reap(pid, timeout)
    return str(progress.ended)


def run_in_child(bus_ids: list[str], mib: int, timeout: float, library: str = LIBRARY,
                 driver_factory: t.Callable[[str], t.Any] = Driver) -> tuple[dict[str, Record], float | None]:
    """Test each GPU (bus ids, in order) in one forked child -> ({bus id: result}, init_s).

    `timeout` bounds cuInit, and each GPU's test on its own. A GPU whose test outlasts it fails
    naming the call that hung; the child is killed as a process group and the GPUs after it are
    not reached (ok None, skipped says why)."""
    started = _start_child(bus_ids, mib, library, driver_factory)
    if isinstance(started, str):
        return {b: result(False, started) for b in bus_ids}, None
    pid, read_fd = started
    try:
        progress = _follow(read_fd, len(bus_ids), timeout)
    finally:
        os.close(read_fd)
    results = progress.results
    if progress.ended is None:  # every GPU answered
        _reap(pid, timeout)
        return results, progress.init_s
    failure = _failure(pid, progress, timeout)
    # cuInit failed or hung: every GPU fails with it; else the GPU being tested fails and the
    # ones after it are not reached.
    for bus_id in bus_ids:
        if bus_id in results:
            continue
        if progress.current is None or bus_id == progress.current:
            results[bus_id] = result(False, failure, timeout if progress.ended == "timeout" else None)
        else:
            results[bus_id] = result(None, skipped=f"not reached: the test of an earlier GPU failed ({failure})")
    return results, progress.init_s


def _seconds(value: float) -> str:
    return (f"{value:g}") if isinstance(value, float) else str(value)


# --- which GPUs, and the verdict


def users_of(index: int, holders: list[Holder]) -> list[Holder]:
    """Processes that use (or, undecided, may use) a GPU: protected ones too. NVML clients use none."""
    return [h for h in holders if index in set(h.get("gpu_indexes") or []) | set(h.get("candidate_gpu_indexes") or [])]


CHECK_MODE_SKIP = "check mode: the smoke test runs CUDA work and runs only in a real run"


def skip_reason(gpu: Gpu, holders: list[Holder], check_mode: bool, max_used_mib: int, footprint: t.Container[int] = ()) -> str | None:
    """Why a GPU must not be tested now, or None. `footprint`: indexes of GPUs that read only
    the cross-GPU footprint of contexts on other GPUs (free)."""
    if check_mode:
        return CHECK_MODE_SKIP
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
        return f"not free: reads {used} MiB (max_used_mib {max_used_mib:d})"
    return None


def issues(gpus: list[dict[str, t.Any]]) -> list[str]:
    """'GPU 0 (00000000:18:00.0): CUDA_ERROR_... (802) at cuCtxCreate: ...' for each failed GPU."""
    return ["GPU {} ({}): {}".format(g["index"], g.get("pci_bus_id"), g["smoke_test"]["error"])
            for g in gpus if (g.get("smoke_test") or {}).get("ok") is False]


def verdict(gpus: list[dict[str, t.Any]]) -> bool | None:
    """Host-level: False when a GPU failed; True when every GPU asked for passed; None when none
    was tested or some were skipped (a skipped test is never reported as passed)."""
    records = [g["smoke_test"] for g in gpus if g.get("smoke_test")]
    if any(r["ok"] is False for r in records):
        return False
    if records and all(r["ok"] is True for r in records):
        return True
    return None


def settle(tested: dict[int, Record], read_used: t.Callable[[], dict[int, int | None]], limits: dict[int, int], window: float = SETTLE_S,
           interval: float = 0.05, clock: t.Callable[[], float] = time.monotonic, sleep: t.Callable[[float], None] = time.sleep) -> None:
    """Poll memory until every tested GPU (index -> record) reads at most its limit (index ->
    MiB) again, at most `window` seconds; a GPU that does not fails its record.
    `read_used()` -> {index: MiB}."""
    deadline = clock() + window
    while True:
        used = read_used()
        high = {i: used.get(i) for i in tested if _above(used.get(i), limits[i])}
        if not high or clock() >= deadline:
            break
        sleep(interval)
    for index, record in tested.items():
        record["memory_used_mib_after"] = used.get(index)
        if index in high and record["ok"] is not False:
            record["ok"] = False
            record["error"] = (f"the GPU reads {used.get(index)} MiB {_seconds(window)} s after the smoke test "
                               f"(at most {limits[index]:d} expected): the driver did not free its memory")


def _above(used: int | None, limit: int) -> bool:
    """A reading over its limit; no reading is never under it."""
    return used is None or used > limit


def smoke_test(gpus: list[Gpu], holders: list[Holder], mib: int, timeout: float, max_used_mib: int,
               read_used: t.Callable[[], dict[int, int | None]], check_mode: bool = False, selected: t.Container[int] | None = None,
               held_fails: bool = False, footprint: t.Container[int] = (),
               runner: t.Callable[[list[str], int, float], tuple[dict[str, Record], float | None]] = run_in_child,
               ) -> tuple[dict[int, Record], float | None]:
    """Run the test on the `selected` indexes of `gpus` (all when None) -> (records by index, init_s).

    `holders`: a fresh attribution of who uses which GPU. With `held_fails` (gpu_release: the
    GPUs were just proven free) a GPU found in use is a failure, else (gpu_facts) a skip. A GPU
    of `footprint` is free and must read no more than before afterwards; the others at most
    `max_used_mib`."""
    records: dict[int, Record] = {}
    to_test: list[Gpu] = []
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


def annotate(gpus: t.Iterable[t.Mapping[str, t.Any]], records: t.Mapping[int, Record | None]) -> list[dict[str, t.Any]]:
    """GPU records with their `smoke_test` (None for a GPU not asked about)."""
    return [dict(g, smoke_test=records.get(g["index"])) for g in gpus]


# --- the modules' entry points


def summary(gpus: t.Iterable[t.Mapping[str, t.Any]], records: t.Mapping[int, Record | None] | None = None, asked: bool = True,
            seconds: float | None = None) -> dict[str, t.Any]:
    """The host-level keys: `smoke_test_passed` (see verdict; None when not asked),
    `smoke_test_issues`, and `smoke_test_s` (the whole test's time, None when nothing ran)."""
    if not asked:
        return {"smoke_test_passed": None, "smoke_test_issues": []}
    tested = annotate(gpus, records or {})
    chosen = [g for g in tested if g.get("smoke_test")]
    return {"smoke_test_passed": verdict(chosen), "smoke_test_issues": issues(chosen), "smoke_test_s": seconds}


def _read_used(smi: NvidiaSmi) -> t.Callable[[], dict[int, int | None]]:
    def read() -> dict[int, int | None]:
        return {g["index"]: g.get("memory_used_mib") for g in smi.query_gpus()}
    return read


def after_release(smi: NvidiaSmi, params: t.Any, result: dict[str, t.Any], check_mode: bool,
                  look: t.Callable[[], Snapshot]) -> dict[str, t.Any]:
    """gpu_release: test the selected GPUs once they are proven free. `look()` is a fresh
    _facts.Snapshot: who holds what right before the test. Returns gpu_release's result with the
    smoke test's keys added; `result` itself (Release's record) is left as it is."""
    options = _options.LookOptions.of(params)
    result = dict(result)
    if isinstance(result.get("timings"), dict):
        result["timings"] = dict(result["timings"])
    if not options.smoke_test:
        result.update(summary(result.get("gpus") or [], asked=False))
        return result
    selected = result.get("selected_gpus") or []
    started = time.monotonic()
    records: dict[int, Record]
    if check_mode:
        records = {i: result_skipped(CHECK_MODE_SKIP) for i in selected}
    elif not result.get("released"):
        records = {i: result_skipped("not released: the smoke test runs only on GPUs proven free") for i in selected}
    else:
        snapshot = look()
        records, _init_s = smoke_test(snapshot.gpus, snapshot.holders, options.smoke_test_mib, options.timeout,
                                      options.max_used_mib or 0, _read_used(smi), selected=selected, held_fails=True,
                                      footprint=snapshot.footprint)
    seconds = round(time.monotonic() - started, 3) if not check_mode and result.get("released") else None
    result["gpus"] = annotate(result.get("gpus") or [], records)
    result.update(summary(result["gpus"], records))
    del result["smoke_test_s"]  # gpu_release says it in timings, with its other phases
    if seconds is not None and isinstance(result.get("timings"), dict):
        result["timings"]["smoke_test_s"] = seconds
    return result


def for_facts(smi: NvidiaSmi, params: t.Any, facts: dict[str, t.Any], snapshot: Snapshot, check_mode: bool) -> dict[str, t.Any]:
    """gpu_facts: test the GPUs that are free now (read-only otherwise: a GPU in use, or any
    GPU in check mode, is skipped with the reason). Updates `facts` in place."""
    options = _options.LookOptions.of(params)
    if not options.smoke_test or facts.get("error"):
        facts.update(summary(facts.get("gpus") or [], asked=False))
        return facts
    started = time.monotonic()
    records: dict[int, Record]
    if not options.processes:
        records = {g["index"]: result_skipped("holders not read (processes: false): the smoke test needs to know the GPU is free")
                   for g in facts["gpus"]}
    else:
        records, _init_s = smoke_test(facts["gpus"], snapshot.holders, options.smoke_test_mib, options.timeout,
                                      options.max_used_mib or 0, _read_used(smi), check_mode=check_mode,
                                      footprint=snapshot.footprint)
    ran = any(r.get("skipped") is None for r in records.values())
    facts["gpus"] = annotate(facts["gpus"], records)
    facts.update(summary(facts["gpus"], records, seconds=round(time.monotonic() - started, 3) if ran else None))
    return facts


def result_skipped(reason: str) -> Record:
    return result(None, skipped=reason)
