# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Run nvidia-smi and turn its CSV output into typed records.

Parsing is pure: text in, dicts out, :class:`NvidiaSmiError` subclasses for everything that
is not a clean answer. Nothing here knows about AnsibleModule.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ComputeApp, DriverGpu, Gpu

    # (nvidia-smi field, record key, kind: "int", "float", "str" or "raw")
    Field = t.Tuple[str, str, str]
    # A call under way: (its command line, the process, when it started)
    Started = t.Tuple[t.List[str], "subprocess.Popen[bytes]", float]

# Health readings, asked in the same --query-gpu call as GPU_FIELDS by a look that checks
# health (they cost nothing measurable there; docs/docsite/rst/guide_health.rst), not by gpu_release's memory
# polls. Read by _health.py. A driver that rejects one (rc 2) is asked again without it, and
# the GPU's health is reported as not fully checked.
HEALTH_FIELDS: tuple[Field, ...] = (
    ("ecc.errors.uncorrected.volatile.total", "ecc_uncorrected_volatile", "int"),
    ("remapped_rows.pending", "remapped_rows_pending", "str"),
    ("remapped_rows.failure", "remapped_rows_failure", "str"),
    ("retired_pages.pending", "retired_pages_pending", "str"),
    ("pcie.link.gen.current", "pcie_link_gen_current", "int"),
    ("pcie.link.gen.max", "pcie_link_gen_max", "int"),
    ("pcie.link.width.current", "pcie_link_width_current", "int"),
    ("pcie.link.width.max", "pcie_link_width_max", "int"),
    ("pstate", "pstate", "str"),
    ("clocks_event_reasons.hw_slowdown", "slowdown_hw", "str"),
    ("clocks_event_reasons.hw_thermal_slowdown", "slowdown_hw_thermal", "str"),
    ("clocks_event_reasons.hw_power_brake_slowdown", "slowdown_hw_power_brake", "str"),
    ("clocks_event_reasons.sw_thermal_slowdown", "slowdown_sw_thermal", "str"),
    ("mig.mode.pending", "mig_mode_pending", "str"),
    # R550+ (the H200 capture of 580.159.04 answers "None"); N/A where the GPU has none.
    ("gpu_recovery_action", "recovery_action", "str"),
    # NVSwitch fabric registration; "N/A" on a GPU without a fabric (the same capture). The
    # fabric's own health summary (590.48.01 exporter capture: "N/A" beside Completed/Success).
    ("fabric.state", "fabric_state", "str"),
    ("fabric.status", "fabric_status", "str"),
    ("fabric.health.summary", "fabric_health_summary", "str"),
)

# The training-ready profile's readings (_readiness.py; docs/docsite/rst/guide_health.rst), asked in
# the same call as HEALTH_FIELDS: settings an inference side leaves behind. Every one is optional:
# a driver that rejects one (rc 2) is asked again without it, and that check reads "not checked".
# Application clocks read [Requested functionality has been deprecated] on Hopper (the H200
# capture of 580.159.04): no value, no issue. A clock lock has no field of its own (R580's
# --help-query-gpu): NVML reports it as the applications_clocks_setting event reason.
READY_FIELDS = (
    ("compute_mode", "compute_mode", "str"),
    ("power.limit", "power_limit_w", "float"),
    ("power.default_limit", "power_default_limit_w", "float"),
    ("clocks.applications.graphics", "app_clocks_graphics_mhz", "int"),
    ("clocks.default_applications.graphics", "app_clocks_graphics_default_mhz", "int"),
    ("clocks.applications.memory", "app_clocks_memory_mhz", "int"),
    ("clocks.default_applications.memory", "app_clocks_memory_default_mhz", "int"),
    ("clocks_event_reasons.applications_clocks_setting", "clocks_user_limited", "str"),
    ("ecc.mode.current", "ecc_mode", "str"),
    ("ecc.mode.pending", "ecc_mode_pending", "str"),
)
HEALTH_FIELDS = HEALTH_FIELDS + READY_FIELDS

# Fields an older driver may not know: asked again without them (value None). Drivers before
# R535 know the clock reasons only by their old name, so those are renamed first. Every health
# reading is optional, MIG mode and persistence mode included (an R440 driver knows no
# mig.mode.current): a driver that rejects one loses that check only, never memory freeing.
OPTIONAL_FIELDS = frozenset(["memory.reserved", "persistence_mode", "mig.mode.current"] + [f for f, _k, _t in HEALTH_FIELDS])
RENAMED_FIELDS = {"clocks_event_reasons.": "clocks_throttle_reasons."}
# A driver that rejects the first field predates the others too (fabric.health.* came after
# fabric.state): they are dropped with it, one rejected call instead of two.
REJECTED_WITH = {"fabric.state": ("fabric.health.summary",)}

# nvidia-smi fields we ask for, mapped to the record keys of gpu_facts' RETURN (docs/gpu_facts.md). The order is the
# order of the CSV columns.
GPU_FIELDS = (
    ("index", "index", "int"),
    ("uuid", "uuid", "str"),
    ("name", "name", "str"),
    ("pci.bus_id", "pci_bus_id", "str"),
    ("driver_version", "driver_version", "str"),
    ("memory.total", "memory_total_mib", "int"),
    ("memory.reserved", "memory_reserved_mib", "int"),
    ("memory.used", "memory_used_mib", "int"),
    ("memory.free", "memory_free_mib", "int"),
    ("utilization.gpu", "utilization_gpu_pct", "int"),
    ("temperature.gpu", "temperature_c", "int"),
    ("power.draw", "power_draw_w", "float"),
    ("persistence_mode", "persistence_mode", "str"),
    ("mig.mode.current", "mig_mode", "str"),
)

# No process_name: nvidia-smi prints a process's name as the process set it (argv[0], comm),
# commas and line feeds included, so a name could add a row that "lists" another user's PID on
# any GPU (docs/docsite/rst/guide_security.rst). Without it every cell is the driver's: a number or a UUID, and a
# row either parses as exactly these typed columns or the answer is rejected. Names for display
# come from /proc (_facts.join_apps).
APP_FIELDS = (
    ("pid", "pid", "int"),
    ("gpu_uuid", "gpu_uuid", "str"),
    ("used_memory", "used_memory_mib", "int"),
)

# nvidia-smi prints canonical names in its header, not the aliases that were asked for
# (asking for used_memory prints "used_gpu_memory [MiB]"; the H200 captures show it).
HEADER_ALIASES = {
    "used_memory": ("used_gpu_memory",),
    "used_gpu_memory": ("used_memory",),
    "process_name": ("name",),
    "name": ("process_name", "gpu_name"),
    "gpu_name": ("name",),
    "uuid": ("gpu_uuid",),
    "gpu_uuid": ("uuid",),
    "pci.bus_id": ("gpu_bus_id",),
    "gpu_bus_id": ("pci.bus_id",),
    "clocks.sm": ("clocks.current.sm",),
    "clocks.gr": ("clocks.current.graphics",),
    "clocks.mem": ("clocks.current.memory",),
}

_UNIT_SUFFIX = re.compile(r"\s+(?:MiB|MB|%|W|MHz|C)$")
_HEADER_UNIT = re.compile(r"\s*\[[^\]]*\]$")
_TOKEN = re.compile(r"^\[[^\]]*\]$")
_BAD_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query')
# "Failed to initialize NVML: Driver/library version mismatch" and, on current drivers, a second
# line "NVML library version: 580.178" (public reports); nvidia-smi then exits with NVML's own
# code, NVML_ERROR_LIB_RM_VERSION_MISMATCH (18), as it does with 9 and 15.
_MISMATCH = re.compile(r"Driver/library version mismatch", re.IGNORECASE)
_NVML_LIBRARY_VERSION = re.compile(r"NVML library version:\s*(\d[\w.-]*)")
RC_MISMATCH = 18
MODULE_VERSION_FILE = "/proc/driver/nvidia/version"
# "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.173.02  Tue Jun 23 ..." or
# "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ...".
# The same words open the kernel's "NVRM: loading NVIDIA UNIX ..." line that _health reads.
KERNEL_MODULE_NAMED = r"NVIDIA UNIX .*?Kernel Module(?: for \S+)?\s+(?P<version>\d[\w.-]*)"
_MODULE_VERSION = re.compile(r"^NVRM version: " + KERNEL_MODULE_NAMED, re.MULTILINE)
# Where the driver's libnvidia-ml.so.1 lives (Debian/Ubuntu, RHEL/SUSE, the GPU Operator's and
# NVIDIA's container toolkit's mount): the version it points to is the installed driver's.
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64", "/run/nvidia/driver/usr/lib64")
_LIBRARY_VERSION = re.compile(r"^libnvidia-ml\.so\.(\d+\.\d[\w.-]*)$")


def loaded_module_version(path: str = MODULE_VERSION_FILE) -> str | None:
    """The loaded kernel module's version (/proc/driver/nvidia/version), None when unknown."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            match = _MODULE_VERSION.search(handle.read(4096))
    except OSError:
        return None
    return match.group(1) if match else None


def installed_library_version(dirs: t.Iterable[str] = LIBRARY_DIRS) -> tuple[str | None, str | None]:
    """(version, path) of the driver library on disk (libnvidia-ml.so.1 -> libnvidia-ml.so.<version>),
    (None, None) when there is none: the first directory that has it decides, as the loader's order would."""
    for folder in dirs:
        link = os.path.join(folder, "libnvidia-ml.so.1")
        if os.path.lexists(link):
            target = os.path.realpath(link)
            match = _LIBRARY_VERSION.match(os.path.basename(target))
            return (match.group(1) if match else None), target
    return None, None


def driver_versions(module_file: str = MODULE_VERSION_FILE, dirs: t.Iterable[str] = LIBRARY_DIRS) -> dict[str, t.Any]:
    """The loaded module's and the installed library's versions, and whether they differ: the node
    drifting towards "Driver/library version mismatch" (new CUDA jobs fail; running ones go on)."""
    loaded = loaded_module_version(module_file)
    library, path = installed_library_version(dirs)
    return {"loaded": loaded, "library": library, "library_path": path, "mismatch": bool(loaded and library and loaded != library)}


def mismatch_message(library: str | None, loaded: str | None) -> str:
    """The first sentence of a driver/library mismatch: what happened, what it means, the cure."""
    versions = ", ".join(part for part in (f"kernel module {loaded}" if loaded else "", f"library {library}" if library else "") if part)
    return ("the NVIDIA driver was upgraded under its loaded kernel module (Driver/library version mismatch{}): jobs already running are "
            "unaffected, but new CUDA jobs and nvidia-smi fail until the node is rebooted, or the nvidia kernel modules are reloaded once "
            "its GPUs are free".format(f": {versions}" if versions else ""))


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a command started in a session of its own and everything it forked; wait for it
    at most 1 s and close its pipes."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    # A child stuck in the driver (D state) cannot die; do not wait on it forever.
    try:
        process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        pass
    for stream in (process.stdout, process.stderr):
        if stream is None:  # not piped
            continue
        try:
            stream.close()
        except (OSError, AttributeError):
            pass


class NvidiaSmiError(Exception):
    """nvidia-smi did not give a usable answer. Carries what it printed."""

    def __init__(self, msg: str, cmd: list[str] | None = None, rc: int | None = None, stdout: str = "", stderr: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.cmd = cmd
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr

    def details(self) -> dict[str, t.Any]:
        """Keyword arguments for fail_json: msg plus the command's output."""
        return {"msg": self.msg, "cmd": self.cmd, "rc": self.rc, "stdout": self.stdout, "stderr": self.stderr}


class NvidiaSmiNotFound(NvidiaSmiError):
    pass


class NvidiaSmiTimeout(NvidiaSmiError):
    pass


class BadField(NvidiaSmiError):
    def __init__(self, msg: str, field: str | None = None, **kwargs: t.Any) -> None:
        super().__init__(msg, **kwargs)
        self.field = field


class NoDevicesFound(NvidiaSmiError):
    pass


class DriverNotLoaded(NvidiaSmiError):
    pass


class GpuLost(NvidiaSmiError):
    pass


class UnparsableOutput(NvidiaSmiError):
    pass


class DriverLibraryMismatch(NvidiaSmiError):
    """The driver's user-space library (NVML) is not the version of the loaded kernel module: the
    driver package was upgraded under the running module (an unattended upgrade, most often)."""


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def classify_failure(cmd: list[str], rc: int, stdout: str, stderr: str) -> NvidiaSmiError:
    """Exception for a non-zero exit of nvidia-smi, by its documented return codes."""
    said = _first_line(stdout) or _first_line(stderr) or "no output"
    kwargs: dict[str, t.Any] = {"cmd": cmd, "rc": rc, "stdout": stdout, "stderr": stderr}
    if rc == RC_MISMATCH or _MISMATCH.search(stdout + stderr):
        library = _NVML_LIBRARY_VERSION.search(stdout + stderr)
        return DriverLibraryMismatch(mismatch_message(library.group(1) if library else None, loaded_module_version()), **kwargs)
    if rc == 2:
        match = _BAD_FIELD.search(stdout + stderr)
        field = match.group(1) if match else None
        return BadField(f"nvidia-smi rejected a query field (rc 2): {said}", field=field, **kwargs)
    if rc == 6:
        return NoDevicesFound(f"nvidia-smi found no GPU (rc 6): {said}", **kwargs)
    if rc == 9:
        return DriverNotLoaded(f"the NVIDIA driver is not loaded (nvidia-smi rc 9): {said}", **kwargs)
    if rc == 15:
        return GpuLost(f"a GPU has fallen off the bus (nvidia-smi rc 15): {said}", **kwargs)
    return NvidiaSmiError(f"nvidia-smi failed with rc {rc}: {said}", **kwargs)


def _strip_header_unit(name: str) -> str:
    return _HEADER_UNIT.sub("", name.strip())


def _header_matches(cells: list[str], fields: list[str]) -> bool:
    if len(cells) != len(fields):
        return False
    for cell, field in zip(cells, fields):
        name = _strip_header_unit(cell)
        if name != field and name not in HEADER_ALIASES.get(field, ()):
            return False
    return True


def _looks_like_header(cells: list[str]) -> bool:
    return all(re.match(r"^[a-z][a-z0-9_.]*(\s*\[[^\]]*\])?$", cell.strip()) for cell in cells) and any(
        "[" in cell or "." in cell or "_" in cell for cell in cells
    )


def _split_row(line: str, width: int, name_column: int | None) -> list[str]:
    """Split one CSV row. nvidia-smi does not quote, so a ", " inside a process name would
    add cells: give the surplus back to the name column."""
    cells = [cell.strip() for cell in line.split(",")]
    surplus = len(cells) - width
    if surplus > 0 and name_column is not None:
        name = ",".join(line.split(",")[name_column:name_column + surplus + 1]).strip()
        cells = cells[:name_column] + [name] + cells[name_column + surplus + 1:]
    return cells


def parse_value(text: str, kind: str) -> t.Any:
    """One CSV cell -> Python value. Bracketed tokens ([N/A], [Not Supported], ...) -> None.

    Raises ValueError for a cell that is neither a token nor of the expected kind.
    """
    text = text.strip()
    if kind == "raw":
        return text
    if _TOKEN.match(text) or text in ("N/A", ""):
        return None
    if kind == "str":
        return text
    number = _UNIT_SUFFIX.sub("", text)
    if not math.isfinite(float(number)):
        raise ValueError(f"not a finite number: {text!r}")
    if kind == "int":
        # Some drivers print whole numbers of a float field ("126.00 W" vs "126 W").
        value = float(number)
        if value != int(value):
            raise ValueError(f"not a whole number: {text!r}")
        return int(value)
    if kind == "float":
        return float(number)
    raise ValueError(f"unknown kind {kind!r}")


def unavailable_reason(text: str) -> str | None:
    """The token nvidia-smi printed instead of a value, or None if it printed a value."""
    text = text.strip()
    return text if _TOKEN.match(text) else None


def parse_csv(text: str, fields: t.Sequence[Field], cmd: list[str] | None = None) -> list[dict[str, t.Any]]:
    """Parse `--format=csv[,noheader][,nounits]` output of a query for `fields`.

    `fields` is a sequence of (nvidia-smi field, record key, kind). Returns a list of dicts
    keyed by record key. A header line, if present, must name the same columns.
    """
    names = [field for field, _key, _kind in fields]
    name_column = None
    for position, (_field, _key, kind) in enumerate(fields):
        if kind == "raw":
            name_column = position
    lines = [line for line in text.splitlines() if line.strip()]
    if lines:
        first = [cell.strip() for cell in lines[0].split(",")]
        if _header_matches(first, names):
            lines = lines[1:]
        elif _looks_like_header(first):
            raise UnparsableOutput(
                "nvidia-smi printed the columns {}, expected {}".format(", ".join(first), ", ".join(names)), cmd=cmd, rc=0, stdout=text
            )
    records = []
    for line in lines:
        cells = _split_row(line, len(fields), name_column)
        if len(cells) != len(fields):
            raise UnparsableOutput(
                f"nvidia-smi printed a line with {len(cells):d} columns, expected {len(fields):d}: {line!r}", cmd=cmd, rc=0, stdout=text
            )
        record: dict[str, t.Any] = {}
        unavailable: dict[str, str] = {}
        for cell, (field, key, kind) in zip(cells, fields):
            try:
                record[key] = parse_value(cell, kind)
            except ValueError:
                raise UnparsableOutput(f"nvidia-smi printed {cell!r} for {field} in line {line!r}", cmd=cmd, rc=0, stdout=text) from None
            reason = unavailable_reason(cell) if kind != "raw" else None
            if reason:
                unavailable[key] = reason
        record["_unavailable"] = unavailable
        records.append(record)
    return records


def parse_gpus(text: str, fields: t.Sequence[Field] = GPU_FIELDS, cmd: list[str] | None = None) -> list[Gpu]:
    """Records of a --query-gpu answer. A GPU without index or uuid is output we must not trust."""
    records = parse_csv(text, fields, cmd=cmd)
    if not records:
        raise UnparsableOutput("nvidia-smi printed no GPU and no error", cmd=cmd, rc=0, stdout=text)
    for record in records:
        if record.get("index") is None or record.get("uuid") is None:
            raise UnparsableOutput(f"nvidia-smi printed a GPU without index or UUID: {record!r}", cmd=cmd, rc=0, stdout=text)
    return t.cast("list[Gpu]", records)


_GPU_UUID = re.compile(r"^GPU-[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}$")


def parse_compute_apps(text: str, fields: t.Sequence[Field] = APP_FIELDS, cmd: list[str] | None = None) -> list[ComputeApp]:
    """Records of a --query-compute-apps answer (no rows at all is a valid, idle answer). Each
    row must be exactly the typed columns asked: a positive PID and, where asked, a GPU UUID in
    the driver's form; anything else rejects the answer (it is not the driver's)."""
    records = parse_csv(text, fields, cmd=cmd)
    for record in records:
        if record.get("pid") is None or (isinstance(record["pid"], int) and record["pid"] <= 0):
            raise UnparsableOutput(f"nvidia-smi printed a compute app without PID: {record!r}", cmd=cmd, rc=0, stdout=text)
        uuid = record.get("gpu_uuid")
        if "gpu_uuid" in record and (uuid is None or not _GPU_UUID.match(uuid)):
            raise UnparsableOutput(f"nvidia-smi printed a compute app with GPU UUID {uuid!r}, not a GPU UUID", cmd=cmd, rc=0, stdout=text)
        record.setdefault("name", None)
    return t.cast("list[ComputeApp]", records)


def normalize_bus_id(bus_id: str | None) -> str | None:
    """'00000000:18:00.0' (nvidia-smi) and '0000:18:00.0' (/proc) -> '0000:18:00.0'."""
    if not bus_id:
        return None
    domain, _sep, rest = bus_id.strip().lower().rpartition(":")
    domain, _sep2, bus = domain.rpartition(":")
    try:
        return "{:04x}:{}:{}".format(int(domain or "0", 16), bus, rest)
    except ValueError:
        return bus_id.strip().lower()


def parse_gpu_information(text: str) -> tuple[str | None, int | None]:
    """/proc/driver/nvidia/gpus/<bus>/information -> (bus location, device minor)."""
    bus: str | None = None
    minor: int | None = None
    for line in text.splitlines():
        key, _sep, value = line.partition(":")
        key = key.strip()
        if key == "Device Minor":
            try:
                minor = int(value.strip())
            except ValueError:
                minor = None
        elif key == "Bus Location":
            bus = value.strip()
    return bus, minor


def read_driver_gpus(root: str = "/proc/driver/nvidia/gpus") -> dict[str | None, DriverGpu]:
    """{normalized bus id: {bus, minor, uuid}} of every GPU the driver has (its proc files), without
    the GPUs it excludes (`GPU Excluded: Yes`, NVreg_ExcludedGpus); {} where there are none. No
    namespace masks these files: in a container given some of the host's GPUs they list them all."""
    gpus: dict[str | None, DriverGpu] = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return gpus
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "information")) as handle:
                text = handle.read()
        except OSError:
            continue
        bus, minor = parse_gpu_information(text)
        if re.search(r"^GPU Excluded:\s*Yes", text, re.MULTILINE):
            continue
        uuid = re.search(r"^GPU UUID:\s*(GPU-[0-9A-Fa-f-]+)\s*$", text, re.MULTILINE)
        key = normalize_bus_id(bus or entry)
        gpus[key] = {"bus": key or entry, "minor": minor, "uuid": uuid.group(1) if uuid else None}
    return gpus


class GpuMissing(NvidiaSmiError):
    pass


def missing_from_answer(gpus: t.Sequence[t.Mapping[str, t.Any]], driver_gpus: t.Mapping[str | None, t.Any]) -> list[str]:
    """Bus ids (the driver's spelling) of the GPUs the driver has and nvidia-smi's answer left out."""
    listed = {normalize_bus_id(gpu.get("pci_bus_id")) for gpu in gpus}
    return sorted(bus for bus in driver_gpus if bus is not None and bus not in listed)


def check_against_driver(gpus: t.Sequence[t.Mapping[str, t.Any]], driver_gpus: t.Mapping[str | None, t.Any], not_visible: t.Collection[str] = (),
                         cmd: list[str] | None = None) -> None:
    """Raise GpuMissing when the driver has a GPU that nvidia-smi's answer (rc 0) left out although
    this namespace reaches its device node (every GPU not in `not_visible`): such a GPU is never
    clean, and its processes' small mappings would be read as another GPU's. A GPU in
    `not_visible` is not this node's (a container or job given other GPUs), never an error."""
    missing = [bus for bus in missing_from_answer(gpus, driver_gpus) if bus not in not_visible]
    if missing:
        hidden = f" ({len(not_visible):d} of them not visible in this namespace)" if not_visible else ""
        raise GpuMissing(
            f"nvidia-smi listed {len(gpus):d} GPU(s) but the driver has {len(driver_gpus):d}{hidden}: GPU(s) at {', '.join(missing)} missing from its "
            "answer (/proc/driver/nvidia/gpus) although this namespace can open their device nodes; a GPU nvidia-smi cannot see cannot be proven free",
            cmd=cmd, rc=0,
        )


def read_minor_numbers(root: str = "/proc/driver/nvidia/gpus") -> dict[str | None, int]:
    """{normalized bus id: minor number} from the driver's proc files; {} where there are none."""
    minors: dict[str | None, int] = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return minors
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "information")) as handle:
                bus, minor = parse_gpu_information(handle.read())
        except OSError:
            continue
        if minor is not None:
            minors[normalize_bus_id(bus or entry)] = minor
    return minors


def shows_unified_memory(records: t.Iterable[t.Mapping[str, t.Any]]) -> bool:
    """Whether a GPU answered `[N/A]` for memory.used and memory.total, as a GPU that shares the
    host's memory does (GB10, Jetson: _unified_memory checks the rest). Reads nothing."""
    return any((r.get("_unavailable") or {}).get("memory_used_mib") == "[N/A]" == (r.get("_unavailable") or {}).get("memory_total_mib")
               for r in records)


class NvidiaSmi:
    """The one seam through which nvidia-smi runs: bounded in time, in the C locale."""

    # The last one is where the NVIDIA GPU Operator's driver container shows its tools on the host.
    SEARCH_PATHS = ("/usr/bin", "/usr/local/nvidia/bin", "/usr/local/bin", "/run/nvidia/driver/usr/bin")

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self.calls = 0
        # Optional fields this driver rejected, and whether it wants the old clock-reason names:
        # learnt once, so that polls do not pay for the rejected call again.
        self.rejected: set[str] = set()
        self.old_names = False
        # The nvidia-smi processes this module started: they hold the device files while they
        # run, and a /proc pass made meanwhile must not take them for holders.
        self.pids: set[int] = set()
        # The least host MemAvailable a unified-memory GPU is free with (_unified_memory; the
        # modules set their min_host_available_mib option here).
        self.min_host_available_mib = 1024

    @classmethod
    def find(cls, path: str | None = None, search_path: str | None = None) -> str:
        """Resolve the binary: an explicit path must exist; else PATH, then the usual places."""
        if path:
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
            raise NvidiaSmiNotFound(f"nvidia-smi not found or not executable at {path}", cmd=[path])
        found = _commands.which("nvidia-smi", dirs=cls.SEARCH_PATHS, search_path=search_path)
        if found:
            return found
        raise NvidiaSmiNotFound(
            "nvidia-smi not found in PATH or {}: is the NVIDIA driver installed? Set nvidia_smi to its path.".format(", ".join(cls.SEARCH_PATHS)),
            cmd=["nvidia-smi"],
        )

    def start(self, args: t.Sequence[str]) -> Started:
        cmd = [self.path] + list(args)
        env = _commands.c_locale_env()
        self.calls += 1
        try:
            # A session of its own, so that a hung nvidia-smi and anything it forked can be
            # killed as a group.
            process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
            )
        except OSError as exc:
            raise NvidiaSmiNotFound(f"cannot run {self.path}: {exc}", cmd=cmd) from exc
        self.pids.add(process.pid)
        return cmd, process, time.monotonic()

    def finish(self, started: Started) -> str:
        """Wait for a started call; returns stdout or raises the classified error."""
        cmd, process, since = started
        # A call collected late (the compute apps started during the /proc pass, read after the
        # kernel log) has finished long ago: it gets a moment to be read, never a false timeout.
        remaining = max(0.5, self.timeout - (time.monotonic() - since))
        try:
            out, err = process.communicate(timeout=remaining)
        except subprocess.TimeoutExpired:
            self._kill(process)
            raise NvidiaSmiTimeout(
                f"nvidia-smi timed out after {_seconds(self.timeout)} s (a hung driver or a GPU that fell off the bus); it was killed",
                cmd=cmd,
                rc=None,
            ) from None
        self.pids.discard(process.pid)  # gone: its PID may be anyone's now
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        if process.returncode != 0:
            raise classify_failure(cmd, process.returncode, stdout, stderr)
        return stdout

    def run(self, args: t.Sequence[str]) -> str:
        return self.finish(self.start(args))

    def abandon(self, started: Started) -> None:
        """A started call whose answer is no longer wanted: killed, never left behind."""
        self._kill(started[1])

    def _kill(self, process: subprocess.Popen[bytes]) -> None:
        kill_group(process)
        self.pids.discard(process.pid)

    # The queries the modules make.
    @staticmethod
    def gpu_args(fields: t.Iterable[Field], gpus: t.Iterable[int | str] | None = None) -> list[str]:
        args = ["--query-gpu=" + ",".join(f for f, _k, _t in fields), "--format=csv,noheader,nounits"]
        if gpus:
            args = ["-i", ",".join(str(g) for g in gpus)] + args
        return args

    @staticmethod
    def app_args(fields: t.Iterable[Field] = APP_FIELDS) -> list[str]:
        return ["--query-compute-apps=" + ",".join(f for f, _k, _t in fields), "--format=csv,noheader,nounits"]

    def _spelled(self, field: str) -> str:
        if self.old_names:
            for new_prefix, old_prefix in RENAMED_FIELDS.items():
                if field.startswith(new_prefix):
                    return old_prefix + field[len(new_prefix):]
        return field

    def _learn(self, bad_field: str | None) -> bool:
        """Remember a rejected optional field; False when it is not one we can do without."""
        if bad_field is None:
            return False
        for new_prefix, old_prefix in RENAMED_FIELDS.items():
            if bad_field.startswith(new_prefix) and not self.old_names:
                self.old_names = True
                return True
            if bad_field.startswith(old_prefix):
                bad_field = new_prefix + bad_field[len(old_prefix):]
        if bad_field in OPTIONAL_FIELDS and bad_field not in self.rejected:
            self.rejected.add(bad_field)
            self.rejected.update(REJECTED_WITH.get(bad_field, ()))
            return True
        return False

    def _reject_unnamed(self, bad_field: str | None, fields: t.Iterable[Field]) -> bool:
        """rc 2 with a message that names no field (not the wording of any capture): ask again
        without every optional field at once rather than lose the memory reading. False when
        there is none left to drop."""
        left = [f for f, _k, _t in fields if f in OPTIONAL_FIELDS and f not in self.rejected]
        if bad_field is not None or not left:
            return False
        self.rejected.update(left)
        return True

    def query_gpus(self, fields: t.Sequence[Field] = GPU_FIELDS, gpus: t.Iterable[int | str] | None = None,
                   meanwhile: t.Callable[[], None] | None = None) -> list[Gpu]:
        """--query-gpu. Optional fields the driver rejects (memory.reserved before R5xx, health
        fields) read None, and each record lists them in `_rejected`. `meanwhile()` runs once,
        while the first call is out (work that does not depend on its answer)."""
        while True:
            asked = tuple((self._spelled(f), k, t) for f, k, t in fields if f not in self.rejected)
            args = self.gpu_args(asked, gpus)
            started = self.start(args)
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException:
                    self._kill(started[1])
                    raise
                meanwhile = None
            try:
                records = parse_gpus(self.finish(started), asked, cmd=[self.path] + args)
            except BadField as exc:
                if not self._learn(exc.field) and not self._reject_unnamed(exc.field, fields):
                    raise
                continue
            dropped = [(f, k) for f, k, _t in fields if f in self.rejected]
            for record in records:
                for _field, key in dropped:
                    t.cast("dict[str, t.Any]", record)[key] = None
                record["_rejected"] = [f for f, _k in dropped if f != "memory.reserved"]
            if shows_unified_memory(records):
                self.prove_unified(records)
            return records

    def prove_unified(self, records: list[Gpu]) -> None:
        """Unified-memory GPUs (memory [N/A]): their proof from the compute apps and the host's
        MemAvailable (_unified_memory, loaded only on that shape; one more call there)."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _unified_memory  # pylint: disable=import-outside-toplevel
        args = self.app_args()
        apps = parse_compute_apps(self.run(args), cmd=[self.path] + args)
        _unified_memory.fill(records, apps, self.min_host_available_mib, _unified_memory.host_available_mib())

    def query_all(self, fields: t.Sequence[Field] = GPU_FIELDS, with_apps: bool = True,
                  meanwhile: t.Callable[[], None] | None = None) -> tuple[list[Gpu], list[ComputeApp]]:
        """GPUs and compute apps, the two calls run side by side (each ~24 ms on an H200);
        `meanwhile` as in query_gpus."""
        if not with_apps:
            return self.query_gpus(fields, meanwhile=meanwhile), []
        app_call = self.start(self.app_args())
        try:
            gpus = self.query_gpus(fields, meanwhile=meanwhile)
        except BaseException:
            self._kill(app_call[1])
            raise
        apps_text = self.finish(app_call)
        return gpus, parse_compute_apps(apps_text, cmd=app_call[0])


def _seconds(value: float) -> str:
    return (f"{value:g}") if isinstance(value, float) else str(value)
