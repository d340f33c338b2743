# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""One look at a node: nvidia-smi records + /proc holders -> the `ansible_facts.gpu` shape."""

from __future__ import annotations

import ctypes
import functools
import os
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _caps
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi_mod

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, DriverGpu, Gpu, Holder

    Systemctl = t.Callable[[t.List[str]], t.Tuple[int, str, str]]

GPU_KEYS = (
    "index",
    "uuid",
    "name",
    "pci_bus_id",
    "minor_number",
    "memory_total_mib",
    "memory_used_mib",
    "memory_reserved_mib",
    "memory_free_mib",
    # How the GPU is proven free: "memory.used" (0 MiB, at most max_used_mib), or "unified memory"
    # (a GPU sharing the host's memory: no compute process and host MemAvailable, _unified_memory).
    "memory_proof",
    "host_memory_available_mib",
    "utilization_gpu_pct",
    "temperature_c",
    "power_draw_w",
    "persistence_mode",
    "mig_mode",
    "clean",
    "cross_gpu_footprint",
    "healthy",
    "health_checked",
    "health_unchecked",
    "health_issues",
    "health",
)

HOLDER_KEYS = (
    "pid",
    "ppid",
    "name",
    "cmdline",
    "user",
    "state",
    "start_time",
    "devices",
    "gpu_indexes",
    "attribution",
    "candidate_gpu_indexes",
    "unit",
    "container",
    "protected",
    "protection_note",
    "container_note",
    # _container_of.HOLDER_KEYS, spelled out: a host whose holders run in no container (and a clean
    # one, which has none) never loads _container_of (tests/unit: test_facts checks they agree).
    "container_runtime",
    "container_name",
    "container_image",
    "pod",
    "pod_uid",
    # The system container the holder runs in, seen from the host (_guests): None elsewhere.
    "guest",
    # Where a holder outside every job, unit and container came from (_origin): None elsewhere.
    "origin",
    # What the holder's own vLLM server answered to GET /is_sleeping (_sleep_mode): its word, None elsewhere.
    "sleep_answer",
    # A process whose /proc entries did not answer (_holders.blocked_record): where it sleeps,
    # and where root's read of it waited.
    "blocked",
    "wchan",
    "waits_in",
)


def gpu_is_clean(gpu: Gpu, max_used_mib: float) -> bool:
    """Unknown memory ([N/A], [Unknown Error]) is never clean; a unified-memory GPU is clean by its
    own proof (_unified_memory: no compute process, enough host MemAvailable)."""
    used = gpu.get("memory_used_mib")
    return used is not None and used <= max_used_mib and not gpu.get("_unified_not_free")


def with_minor_numbers(gpus: t.Iterable[Gpu], minors_by_bus: t.Mapping[str | None, int]) -> list[Gpu]:
    """Add minor_number from the driver's proc files. Where they are absent (no nvidia kernel
    module visible, e.g. some containers) fall back to the index, the driver's default order."""
    result = []
    for gpu in gpus:
        record = t.cast("Gpu", dict(gpu))
        minor = minors_by_bus.get(smi_mod.normalize_bus_id(gpu.get("pci_bus_id")))
        record["minor_number"] = minor if minor is not None else gpu["index"]
        result.append(record)
    return result


def minor_order_differs(gpus: t.Iterable[Gpu], minors_by_bus: t.Mapping[str | None, int]) -> bool | None:
    """Whether the GPUs in the order of their minor numbers (/dev/nvidia<minor>, the order of
    Slurm's `File=/dev/nvidia[0-7]` and of every tool that counts device files) are not in
    nvidia-smi's index order (PCI bus order); None where a GPU's minor number is not the driver's
    word (its files unread: minor_number is then the index, assumed)."""
    minors = [(minors_by_bus.get(smi_mod.normalize_bus_id(gpu.get("pci_bus_id"))), gpu["index"]) for gpu in gpus]
    if not minors or any(minor is None for minor, _index in minors):
        return None
    return [index for _minor, index in sorted(minors, key=lambda pair: t.cast(int, pair[0]))] != sorted(index for _minor, index in minors)


def minor_to_index(gpus: t.Iterable[Gpu]) -> dict[int, int]:
    return {gpu["minor_number"]: gpu["index"] for gpu in gpus}


def public_gpu(gpu: Gpu, max_used_mib: float, footprint: t.Container[int] = ()) -> Gpu:
    """`footprint`: indexes of GPUs whose memory is only the cross-GPU footprint (clean)."""
    record = t.cast("Gpu", {key: gpu.get(key) for key in GPU_KEYS})
    record["memory_proof"] = gpu.get("memory_proof") or "memory.used"
    record["cross_gpu_footprint"] = gpu["index"] in footprint
    record["clean"] = gpu_is_clean(gpu, max_used_mib) or record["cross_gpu_footprint"]
    return record


def public_holder(holder: Holder) -> dict[str, t.Any]:
    return {key: holder.get(key) for key in HOLDER_KEYS}


# The name nvidia-smi gives an owner it cannot find; a dead owner's row lists nobody.
DEAD_OWNER_NAME = "[Not Found]"


def join_apps(apps: t.Iterable[ComputeApp], gpus: t.Iterable[Gpu], alive: t.Callable[[int], bool],
              name_of: t.Callable[[int], str | None] | None = None) -> list[ComputeApp]:
    """Compute apps joined to their GPU by UUID (MIG apps report the parent GPU's UUID). Names
    come from /proc (`name_of`), for display only; a dead owner reads DEAD_OWNER_NAME."""
    index_of: dict[str | None, int] = {gpu["uuid"]: gpu["index"] for gpu in gpus}
    joined: list[ComputeApp] = []
    for app in apps:
        live = alive(app["pid"])
        name = app.get("name")
        if name_of is not None:
            name = (name_of(app["pid"]) if live else None) or DEAD_OWNER_NAME
        joined.append({
            "pid": app["pid"],
            "name": name,
            "used_memory_mib": app.get("used_memory_mib"),
            "gpu_uuid": app.get("gpu_uuid"),
            "gpu_index": index_of.get(app.get("gpu_uuid")),
            "alive": live,
        })
    return joined


def dirty_holders(holders: t.Iterable[Holder], selected: t.Iterable[int] | None = None) -> list[Holder]:
    """Live unprotected processes that use (or, undecided, may use) a GPU (a selected one, if
    given). NVML clients use none."""
    dirty = []
    for holder in holders:
        uses = set(holder["gpu_indexes"]) | set(holder.get("candidate_gpu_indexes") or [])
        if not holder["protected"] and uses and (selected is None or uses & set(selected)):
            dirty.append(holder)
    return dirty


def health_summary(public_gpus: list[Gpu], health: _health.Health | None = None, dcgm: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
    """Host-level health keys: healthy, health_checked, health_issues (each GPU's, prefixed
    with it), and the kernel log read and DCGM's verdict under `health`."""
    if health is None:
        return {"healthy": None, "health_checked": False, "health_issues": [], "health": None}
    healthy, issues = _health.host_verdict(public_gpus, dcgm, health.host_issues)
    return {
        "healthy": healthy and bool(public_gpus),
        "health_checked": all(gpu.get("health_checked") for gpu in public_gpus) and bool(public_gpus),
        "health_issues": issues,
        "health": health.host_record(dcgm),
    }


class Findings(_options.Record):
    """What one look found, and how gpu_facts judges it: assemble's one argument. `gpus` carry
    minor numbers and health, `holders` are attributed; `max_used_mib` and `with_processes` are
    the options'; `cuda_version` the driver's (cuda_driver_version); `footprint`: the GPUs whose
    memory is only the footprint of contexts on other GPUs; `health` the look's _health.Health
    (None: not read) and `dcgm` DCGM's diagnostic; `not_visible`: the driver's GPUs this namespace
    cannot reach (not_visible_gpus); `inside_container`: this look ran in a container
    (_guests.pid_namespace_nested); `unscanned`: how many processes the scan's deadline left unread."""

    _fields = ("gpus", "apps", "holders", "max_used_mib", "with_processes", "cuda_version", "footprint", "health", "dcgm", "not_visible",
               "inside_container", "unscanned")
    __slots__ = _fields
    _defaults = {"apps": (), "holders": (), "max_used_mib": 0, "with_processes": True, "footprint": (), "not_visible": (),
                 "inside_container": False, "unscanned": 0}

    @classmethod
    def of_snapshot(cls, snapshot: Snapshot, **judged: t.Any) -> Findings:
        """A look's Snapshot and how to judge it (max_used_mib, with_processes, cuda_version, dcgm) -> the Findings."""
        return cls(**dict({"gpus": snapshot.gpus, "apps": snapshot.apps, "holders": snapshot.holders, "footprint": snapshot.footprint,
                           "health": snapshot.health, "not_visible": snapshot.not_visible, "inside_container": snapshot.inside_container,
                           "unscanned": len(snapshot.unscanned)}, **judged))


def assemble(found: Findings) -> dict[str, t.Any]:
    """The `ansible_facts.gpu` dict of what one look found. What could not be read (the processes
    the scan's deadline left unread, and processes that did not answer) makes the node unclean
    only where a GPU holds memory that no process read explains
    (_attribution.unexplained_by_readers): a GPU that reads clean with no compute app is free
    whatever else could not be read."""
    gpus, apps, holders, max_used_mib, footprint = found.gpus, list(found.apps), list(found.holders), found.max_used_mib, found.footprint
    health, dcgm, with_processes = found.health, found.dcgm, found.with_processes
    public_gpus = [public_gpu(gpu, max_used_mib, footprint) for gpu in gpus]
    used = [gpu["memory_used_mib"] for gpu in public_gpus]
    clean = bool(public_gpus) and all(gpu["clean"] for gpu in public_gpus)
    if with_processes:
        unread = bool(found.unscanned) or any(h.get("attribution") == _attribution.BLOCKED and not h["protected"] for h in holders)
        readers = [h for h in holders if h.get("attribution") != _attribution.BLOCKED]
        clean = clean and not dirty_holders(readers) and not (
            unread and _attribution.unexplained_by_readers(gpus, apps, holders, [g["index"] for g in gpus], max_used_mib, footprint))
    return dict(health_summary(public_gpus, health, dcgm), **{
        "driver_version": gpus[0].get("driver_version") if gpus else None,
        "cuda_version": found.cuda_version,
        "count": len(public_gpus),
        "clean": clean,
        "memory_used_mib": None if any(u is None for u in used) else sum(u for u in used if u is not None),
        "error": None,
        "not_visible": [gpu["bus"] for gpu in found.not_visible],
        "inside_container": found.inside_container,
        "gpus": public_gpus,
        "processes": apps if with_processes else [],
        "holders": [public_holder(h) for h in holders] if with_processes else [],
    })


def failed_facts(error: str) -> dict[str, t.Any]:
    """What gpu_facts reports with fail_on_error=false when nvidia-smi fails as a whole."""
    return {
        "driver_version": None,
        "cuda_version": None,
        "count": 0,
        "clean": False,
        "memory_used_mib": None,
        "error": error,
        "not_visible": [],
        "given_to_vms": [],
        "inside_container": None,
        "minor_order_differs": None,
        "gpus": [],
        "processes": [],
        "holders": [],
        "healthy": False,
        "health_checked": False,
        "health_issues": [error],
        "health": None,
    }


def cuda_driver_version(library: str = "libcuda.so.1") -> str | None:
    """The CUDA version the driver supports, from libcuda's cuDriverGetVersion (no context,
    no device file opened), so that no third nvidia-smi call is needed. None if unavailable."""
    try:
        libcuda = ctypes.CDLL(library)
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000:d}.{(version.value % 1000) // 10:d}"


def alive(pid: int, proc: str = "/proc") -> bool:
    return holders_mod.start_time_of(pid, proc) is not None


class Snapshot:
    """One look at the node: what gpu_facts returns and what gpu_release plans from."""

    def __init__(self, gpus: list[Gpu], apps: list[ComputeApp], holders: list[Holder], unreadable: list[int] | None = None,
                 footprint: t.Iterable[int] = (), health: _health.Health | None = None, not_visible: list[DriverGpu] | None = None,
                 unscanned: list[int] | None = None) -> None:
        self.gpus = gpus
        # The driver's GPUs this namespace cannot reach (not_visible_gpus): not this node's.
        self.not_visible = not_visible or []
        # The _health.Health of this look: annotates later readings of the same GPUs alike.
        self.health = health
        self.apps = apps
        self.holders = holders
        # PIDs whose device files we may not read (not root): holders may hide among them.
        self.unreadable = unreadable or []
        # GPUs whose memory is only the footprint of contexts on other GPUs.
        self.footprint = set(footprint)
        # Whether this look ran in a container, where GPU memory may be held by processes outside it.
        self.inside_container = False
        # PIDs the scan's deadline left unread (_holders.scan_holders): nothing is clean then.
        self.unscanned = unscanned or []
        # Whether the minor numbers' order is not nvidia-smi's (minor_order_differs); None: unread.
        self.minor_order_differs: bool | None = None
        # GPUs bound to vfio-pci and vGPUs, given to VMs (_vfio.given_to_vms): not this host's to free or reset.
        self.given_to_vms: list[t.Any] = []


def not_visible_gpus(gpus: list[Gpu], driver_gpus: t.Mapping[str | None, DriverGpu], reachable: t.Callable[[int], bool] | None = None) -> list[DriverGpu]:
    """The GPUs the driver has, nvidia-smi left out and this namespace cannot reach (issue 37). The
    driver's proc files are not namespaced: in an LXC container, a Slurm step with a device cgroup
    or `docker --device /dev/nvidia2` they list every GPU of the host, while NVML lists only those
    whose device node it can open (real H200, driver 580.159.04: without /dev/nvidia0 in the
    namespace, "No devices were found" while /proc/driver/nvidia/gpus lists 0000:00:06.0). Only the
    GPUs nvidia-smi left out are asked (`reachable(minor)`, default an open of the node); one
    without a minor number cannot be asked and counts as reachable (then it fails the look)."""
    missing = smi_mod.missing_from_answer(gpus, driver_gpus)
    if not missing:
        return []
    if reachable is None:
        reachable = functools.partial(_devices.gpu_node_reachable, table=_devices.DeviceTable.read())
    hidden = []
    for bus in missing:
        minor = driver_gpus[bus]["minor"]
        if minor is not None and not reachable(minor):
            hidden.append(driver_gpus[bus])
    return hidden


def any_dirty(gpus: t.Iterable[Gpu], max_used_mib: float) -> bool:
    return any(not gpu_is_clean(gpu, max_used_mib) for gpu in gpus)


def unexplained_gpus(gpus: t.Iterable[Gpu], apps: t.Iterable[ComputeApp], holders: t.Iterable[Holder], limit: float) -> list[int]:
    """Indexes of the GPUs above `limit` MiB whose memory the processes found with a device file
    open may not explain: no compute app is listed on it, or one listed is dead (its orphaned
    child may hold the memory) or not among `holders`."""
    holding = {holder["pid"] for holder in holders}
    unexplained = []
    for gpu in gpus:
        if gpu_is_clean(gpu, limit):
            continue
        listed = [app for app in apps if app.get("gpu_index") == gpu["index"]]
        if not listed or not all(app.get("alive") and app["pid"] in holding for app in listed):
            unexplained.append(gpu["index"])
    return unexplained


class DeviceScan(t.NamedTuple):
    """One pass over /proc for open device files: the device numbers it went by, the processes
    with one open (not attributed yet), and the PIDs without (for scan_mapped, if needed)."""
    table: _devices.DeviceTable
    raw: list[Holder]
    others: list[int]


def scan_devices(proc: str = "/proc", unreadable: list[int] | None = None, ours: t.Collection[int] = (),
                 limits: holders_mod.ScanLimits = holders_mod.DEFAULT_LIMITS, unscanned: list[int] | None = None, again: bool = False) -> DeviceScan:
    """`ours`: PIDs this module started (its nvidia-smi calls), left out: they hold the device
    files only while they answer. `limits`, `unscanned`, `again`: as scan_holders'."""
    others: list[int] = []
    table = _devices.DeviceTable.read()
    raw = holders_mod.scan_holders(proc, unreadable, with_maps=False, without_devices=others, table=table, limits=limits, unscanned=unscanned,
                                   again=again)
    return DeviceScan(table, [h for h in raw if h["pid"] not in ours], [pid for pid in others if pid not in ours])


def scan_and_attribute(gpus: list[Gpu], apps: list[ComputeApp] | None, fetch_apps: t.Callable[[], list[ComputeApp]], request: Request, *,
                       protect_names: t.Iterable[str], protect_pids: t.Collection[int], own_lineage: t.Collection[int],
                       unreadable: list[int] | None = None, scanned: DeviceScan | None = None,
                       limits: holders_mod.ScanLimits = holders_mod.DEFAULT_LIMITS, unscanned: list[int] | None = None,
                       again: bool = False) -> tuple[list[Holder], list[ComputeApp]]:
    """The /proc scan, attributed to GPUs and marked protected -> (holders, apps).

    `apps` are joined compute apps, or None when not fetched yet: `fetch_apps()` is then called
    only if the answer depends on them (see _attribution.needs_listing). `request`: the look's
    (its proc, max_used_mib, footprint_mib, main_pid_of). `protect_names`, `protect_pids`: the
    protect option split (_protect.split_protect); `own_lineage`: this module and its ancestors
    (never signalled); `unreadable` gets the PIDs whose files could not be read; `scanned`: the
    device-file pass when it was done already (while nvidia-smi ran); `limits`: how long the scan
    may wait (scan_holders), `unscanned` gets the PIDs it left unread; `again`: a rescan in the
    same run (scan_holders: the processes that had no device file open at the last pass and are
    the same processes now are not read again)."""
    # Processes that mapped a device file and closed it (CUDA never does) matter only where a GPU
    # holds more than the footprint and than what live, listed processes with the device files
    # open explain: only then are the maps of processes without a device file open read. Speed:
    # a busy node with 1,000 processes looked in 120-144 ms reading them all, in about the time of
    # an idle look without (benchmarks/changes.md).
    proc = request.proc
    limit = request.max_used_mib + (request.footprint_mib or 0)
    table, raw, others = scanned if scanned is not None else scan_devices(proc, unreadable, limits=limits, unscanned=unscanned, again=again)
    raw = list(raw)
    if apps is None and (any_dirty(gpus, limit) or _attribution.needs_listing(raw)):
        apps = fetch_apps()
    if unexplained_gpus(gpus, apps or [], raw, limit):
        raw += holders_mod.scan_mapped(others, proc, table, limits, unscanned)
    apps = apps or []
    attributed = _attribution.attribute(raw, apps, minor_to_index(gpus))
    return _protect.protect(attributed, protect_names, protect_pids, own_lineage, request.main_pid_of), apps


def _query_gpus(smi: smi_mod.NvidiaSmi, with_apps: bool, checks: _health.Checks | None, kernel_log_state: str | None = None,
                meanwhile: t.Callable[[], None] | None = None) -> tuple[list[Gpu], list[ComputeApp], _health.Health | None]:
    """nvidia-smi's GPUs and (`with_apps`) raw compute apps; with `checks`, the kernel log read
    for Xids while nvidia-smi runs (only its new lines with `kernel_log_state`, see
    _kernel_log_state), and the GPUs annotated with their health. `meanwhile()` runs while the
    GPU query is out."""
    if checks is None:
        gpus, apps = smi.query_all(with_apps=with_apps, meanwhile=meanwhile)
        return gpus, apps, None
    kernel_log = _kernel_log.KernelLog(checks.xid_window_hours, state_path=kernel_log_state)
    kernel_log.start()
    try:
        gpus, apps = smi.query_all(smi_mod.GPU_FIELDS + smi_mod.HEALTH_FIELDS, with_apps=with_apps, meanwhile=meanwhile)
    except BaseException:
        kernel_log.abandon()
        raise
    xids, history = kernel_log.xids()
    # Fabric Manager is asked only where a GPU sits on an NVSwitch fabric (fabric.state not N/A).
    fabric_manager = _health.read_fabric_manager() if any(_health.has_fabric(g) for g in gpus) else None
    health = _health.Health(checks, xids, kernel_log=kernel_log, history_by_bus=history, fabric_manager=fabric_manager,
                            driver_version=gpus[0].get("driver_version") if gpus else None)
    return health.annotate(gpus), apps, health


# What one look is asked, and where it looks: built once (look's keywords, or from_options for a
# record of the options) and passed whole to what the look calls. Fields: as look's keywords (its
# docstring); with_apps None: as with_processes. A keyword that is no field is a TypeError.
class Request(_options.Record):
    _fields = ("protect", "with_processes", "proc", "driver_root", "with_apps", "max_used_mib", "footprint_mib", "runtimes", "checks",
               "main_pid_of", "runtimes_of", "kernel_log_state", "while_waiting", "systemctl", "unit_cgroups")
    __slots__ = _fields
    _defaults = {"with_processes": True, "proc": "/proc", "driver_root": "/proc/driver/nvidia/gpus", "max_used_mib": 0,
                 "footprint_mib": _attribution.CROSS_GPU_FOOTPRINT_MIB}

    @classmethod
    def from_options(cls, options: t.Any, **where: t.Any) -> Request:
        """A record of the options (_options.LookOptions, or gpu_release's ReleaseOptions) and where
        to look (proc, driver_root, runtimes..., as look's keywords) -> the Request: the options'
        protect, processes, max_used_mib (None: 0), cross_gpu_footprint_mib (None: the default)
        and health checks (_health.Checks.from_options)."""
        footprint = options.cross_gpu_footprint_mib
        return cls(**dict({"protect": options.protect, "with_processes": getattr(options, "processes", True),
                           "max_used_mib": options.max_used_mib or 0,
                           "footprint_mib": _attribution.CROSS_GPU_FOOTPRINT_MIB if footprint is None else footprint,
                           "checks": _health.Checks.from_options(options)}, **where))


def look(smi: smi_mod.NvidiaSmi, protect: t.Iterable[t.Any] | None, **keywords: t.Any) -> Snapshot:
    """nvidia-smi (GPUs and, side by side, compute apps, and the kernel log for Xids) then the
    /proc scan -> Snapshot: look_at with a Request of these keywords (with_processes, proc,
    driver_root, with_apps, max_used_mib, footprint_mib, runtimes, checks, main_pid_of,
    runtimes_of, kernel_log_state, while_waiting, systemctl, unit_cgroups)."""
    return look_at(smi, Request(protect=protect, **keywords))


def look_at(smi: smi_mod.NvidiaSmi, request: Request) -> Snapshot:
    """nvidia-smi (GPUs and, side by side, compute apps, and the kernel log for Xids) then the
    /proc scan -> Snapshot. GPU records carry their health (`request.checks`: a _health.Checks).

    `with_apps` defaults to `with_processes`; gpu_release looks without them and asks for them
    only when some process maps a per-GPU node (a clean node: one nvidia-smi call). Without
    `checks`, health is not read (the GPUs' `healthy` reads None). The container runtimes
    (`runtimes`, or `runtimes_of()`) are asked only about holders, and loaded only then; so is
    systemd, for the unit each holder's cgroup names (_unit_owner.confirm: `systemctl`, the run's,
    else the node's; `unit_cgroups`, the run's answers so far).

    The device-file pass over /proc runs while nvidia-smi answers (neither needs the other);
    when it finds a process mapping a GPU, the compute-apps call starts at once and
    `while_waiting(raw holders)` runs too (gpu_release loads the code that frees them). Speed:
    on the H200 the GPU query waits ~30 ms on the driver, the pass and that loading ~10-40 ms
    (benchmarks/HISTORY.md, "The look's /proc pass beside nvidia-smi")."""
    if request.with_apps is None:
        request = request._replace(with_apps=request.with_processes)
    unreadable: list[int] = []
    unscanned: list[int] = []
    limits = scan_limits(getattr(smi, "timeout", None))
    early: dict[str, t.Any] = {"limits": limits, "unscanned": unscanned}

    def meanwhile() -> None:
        scanned = early["scan"] = scan_devices(request.proc, unreadable, getattr(smi, "pids", ()), limits, unscanned)
        if _attribution.needs_listing(scanned.raw):
            if not request.with_apps:
                early["apps"] = smi.start(smi.app_args())
            if request.while_waiting is not None:
                request.while_waiting(scanned.raw)

    try:
        snapshot = _look(smi, request, early, unreadable, meanwhile if request.with_processes else None)
    except BaseException:
        if early.get("apps") is not None:
            smi.abandon(early["apps"])
        raise
    if has_vfio_groups():
        # GPUs given to VMs (vfio-pci passthrough, issue 70): read, and loaded, only on a node that has one.
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _vfio
        snapshot.given_to_vms = _vfio.given_to_vms(proc=request.proc, systemctl=request.systemctl)
    return snapshot


def has_vfio_groups(dev_root: str = "/dev") -> bool:
    """Whether /dev/vfio has an IOMMU group node (a device bound to vfio-pci): one directory read."""
    try:
        return any(name.isdigit() for name in os.listdir(os.path.join(dev_root, "vfio")))
    except OSError:
        return False


def _look(smi: smi_mod.NvidiaSmi, request: Request, early: dict[str, t.Any], unreadable: list[int],
          meanwhile: t.Callable[[], None] | None) -> Snapshot:
    proc, max_used_mib, footprint_mib = request.proc, request.max_used_mib, request.footprint_mib
    gpus, listed, health = _query_gpus(smi, request.with_apps, request.checks, request.kernel_log_state, meanwhile)
    driver_gpus = smi_mod.read_driver_gpus(request.driver_root)
    if gpus and not driver_gpus:
        # GPUs without the NVIDIA kernel driver: a node shape no run can free (_node_shapes, issue 70).
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _node_shapes
        _node_shapes.refuse_shared_with_windows(gpus, driver_gpus)
    # A GPU the driver has and nvidia-smi left out (rc 0, one row fewer) is never read as clean,
    # unless this namespace cannot reach it: then it is not this node's (not_visible).
    not_visible = not_visible_gpus(gpus, driver_gpus)
    smi_mod.check_against_driver(gpus, driver_gpus, [gpu["bus"] for gpu in not_visible], cmd=[smi.path] if getattr(smi, "path", None) else None)
    minors_by_bus = {bus: gpu["minor"] for bus, gpu in driver_gpus.items() if gpu["minor"] is not None}
    differs = minor_order_differs(gpus, minors_by_bus)
    gpus = with_minor_numbers(gpus, minors_by_bus)
    if not request.with_processes:
        bare = Snapshot(gpus, [], [], health=health, not_visible=not_visible)
        bare.minor_order_differs = differs
        return bare
    names, pids = _protect.split_protect(request.protect)
    lineage = holders_mod.lineage(holders_mod.own_pid(proc), proc)

    def joined(raw_apps: t.Iterable[ComputeApp]) -> list[ComputeApp]:
        return join_apps(raw_apps, gpus, lambda pid: alive(pid, proc), lambda pid: holders_mod.display_name(pid, proc))

    # A dirty GPU always needs the compute apps (see scan_and_attribute): started now unless
    # the device-file pass started them already. Speed: their call overlaps the attribution
    # instead of following it (benchmarks/changes.md).
    if not request.with_apps and early.get("apps") is None and any_dirty(gpus, max_used_mib + (footprint_mib or 0)):
        early["apps"] = smi.start(smi.app_args())

    def fetch_apps() -> list[ComputeApp]:
        started = early.pop("apps", None) or smi.start(smi.app_args())
        return joined(smi_mod.parse_compute_apps(smi.finish(started)))

    holders, apps = scan_and_attribute(
        gpus, joined(listed) if request.with_apps else None, fetch_apps, request, protect_names=names, protect_pids=pids, own_lineage=lineage,
        unreadable=unreadable, scanned=early.get("scan"), limits=early["limits"], unscanned=early["unscanned"],
    )
    if early.get("apps") is not None:
        # Started for a process mapping a GPU, and the answer did not need it after all.
        smi.abandon(early.pop("apps"))
    if holders:
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _container_of
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines
        runtimes_of = request.runtimes_of
        _container_of.annotate(holders, request.runtimes or (runtimes_of() if runtimes_of else _engines.Runtimes()), proc)
        _guests.annotate(holders, proc)
        annotate_units(holders, request.systemctl, request.unit_cgroups)
        # Where a holder outside every job came from (an SSH session, a detached process: issue 70).
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _origin
        _origin.annotate(holders, proc)
        # What its own vLLM server says of its sleep, quoted and deciding nothing (issue 70).
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _sleep_mode
        _sleep_mode.annotate(holders, proc)
    footprint = _attribution.footprint_gpus(gpus, holders, apps, max_used_mib, footprint_mib)
    snapshot = Snapshot(gpus, apps, holders, unreadable, footprint, health, not_visible, early["unscanned"])
    snapshot.inside_container = _guests.pid_namespace_nested(proc)
    snapshot.minor_order_differs = differs
    return snapshot


def annotate_units(holders: list[Holder], systemctl: Systemctl | None = None, unit_cgroups: dict[str, str] | None = None) -> list[Holder]:
    """Each holder's unit as systemd confirms it (_unit_owner, loaded only for holders)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _unit_owner
    return _unit_owner.confirm(holders, systemctl, unit_cgroups)


def scan_limits(timeout: float | None) -> holders_mod.ScanLimits:
    """How long a look's /proc scan may wait: the module's `timeout` in all (what one nvidia-smi
    call may take), and a budget per process of at most a quarter of it."""
    if not timeout or timeout <= 0:
        return holders_mod.DEFAULT_LIMITS
    return holders_mod.ScanLimits(min(holders_mod.DEFAULT_LIMITS.budget, timeout / 4), float(timeout))


def scan_warnings(snapshot: Snapshot) -> list[str]:
    """What to tell of a look's scan: processes not ours to read, processes that did not answer,
    and those its deadline left unread."""
    warnings = [w for w in (unreadable_warning(snapshot.unreadable), unscanned_warning(snapshot.unscanned)) if w]
    blocked = [h for h in snapshot.holders if h.get("blocked")]
    if blocked:
        named = _caps.named([blocked_text(h) for h in blocked])
        warnings.append(f"{named} (a file system that stopped answering, FUSE or NFS, or a process stuck in the kernel): what they hold is "
                        "unknown, so a GPU of this node that holds memory no process read explains is never clean beside them")
    return warnings


def blocked_text(holder: t.Mapping[str, t.Any]) -> str:
    """`pid 123 python3 (uid 4242, state S, wchan request_wait_answer) did not answer: root's read waited in mm_access`."""
    about = ["uid {}".format(holder.get("uid")), "state {}".format(holder.get("state"))]
    if holder.get("wchan"):
        about.append("wchan {}".format(holder["wchan"]))
    text = "pid {} {} ({}) did not answer".format(holder["pid"], holder.get("name"), ", ".join(about))
    return text + (": root's read of its /proc entries waited in {}".format(holder["waits_in"]) if holder.get("waits_in") else "")


def unscanned_warning(unscanned: t.Sized | None) -> str | None:
    if not unscanned:
        return None
    return (f"the /proc scan reached its deadline (the timeout option) with {len(unscanned):d} process(es) not read, after processes that did "
            "not answer: what holds the GPUs is unknown and no GPU is clean")


def unreadable_warning(unreadable: t.Sized | None) -> str | None:
    """What to tell a user who ran without root, or None."""
    if not unreadable:
        return None
    return (
        f"could not read the open files of {len(unreadable):d} process(es) (not root?): a holder among them is invisible to this module; "
        "run with become: true"
    )
