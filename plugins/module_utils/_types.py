# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The records the rooms of zeromib.gpu pass to each other, as types for mypy.

At run time these are plain dicts (what AnsibleModule returns as JSON): import this module only
under `typing.TYPE_CHECKING` (`if t.TYPE_CHECKING: from ..._types import Holder`), so that a
managed node never loads it; with `from __future__ import annotations` the annotations that name
these types are never evaluated there (Python 3.8 included). The public keys are those of
the modules' RETURN (docs/gpu_facts.md, docs/gpu_release.md); keys that start with "_" are internal and never returned (the modules' `public_*`
functions copy only public keys).
"""

from __future__ import annotations

import typing as t


class Gpu(t.TypedDict, total=False):
    """One GPU as nvidia-smi reads it (gpu_facts' `gpus`, gpu_release's `gpus_before`/`gpus`)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    minor_number: int
    memory_total_mib: int | None
    memory_used_mib: int | None
    memory_reserved_mib: int | None
    memory_free_mib: int | None
    utilization_gpu_pct: int | None
    temperature_c: int | None
    power_draw_w: float | None
    persistence_mode: str | None
    mig_mode: str | None
    clean: bool
    cross_gpu_footprint: bool
    healthy: bool | None
    health_checked: bool
    health_unchecked: list[str]
    health_issues: list[str]
    health: dict[str, t.Any]
    # nvidia-smi's own tokens for fields that had no value ([N/A], [GPU requires reset], ...).
    _unavailable: dict[str, str]
    driver_version: str | None
    # The health readings of a look that checks health (_nvidia_smi.HEALTH_FIELDS; None: [N/A]).
    ecc_uncorrected_volatile: int | None
    remapped_rows_pending: str | None
    remapped_rows_failure: str | None
    retired_pages_pending: str | None
    pcie_link_gen_current: int | None
    pcie_link_gen_max: int | None
    pcie_link_width_current: int | None
    pcie_link_width_max: int | None
    pstate: str | None
    slowdown_hw: str | None
    slowdown_hw_thermal: str | None
    slowdown_hw_power_brake: str | None
    slowdown_sw_thermal: str | None
    mig_mode_pending: str | None
    recovery_action: str | None
    fabric_state: str | None
    fabric_status: str | None
    fabric_health_summary: str | None
    # The training-ready profile's readings (_nvidia_smi.READY_FIELDS; _readiness.py).
    compute_mode: str | None
    power_limit_w: float | None
    power_default_limit_w: float | None
    app_clocks_graphics_mhz: int | None
    app_clocks_graphics_default_mhz: int | None
    app_clocks_memory_mhz: int | None
    app_clocks_memory_default_mhz: int | None
    clocks_user_limited: str | None
    ecc_mode: str | None
    ecc_mode_pending: str | None
    # Internal: the optional nvidia-smi fields this driver rejected (memory.reserved aside).
    _rejected: list[str]
    # A GPU sharing the host's memory (_look/_unified_memory): its proof, the host's MemAvailable and
    # the least it must be; internal: why it is not free (None: free).
    memory_proof: str | None
    host_memory_available_mib: int | None
    min_host_available_mib: int | None
    _unified_not_free: str | None


class ComputeApp(t.TypedDict, total=False):
    """A row of --query-compute-apps joined to its GPU (gpu_facts' `processes`). `name` is what
    the process calls itself: workload-written, for display only."""

    pid: int
    name: str | None
    used_memory_mib: int | None
    gpu_uuid: str | None
    gpu_index: int | None
    alive: bool


class Holder(t.TypedDict, total=False):
    """A process with a /dev/nvidia* node open or mapped (gpu_facts' `holders`).

    Who wrote each key: the kernel (pid, ppid, state, start_time, uid, devices, mapped, exe_path,
    exe_owner, cgroup), the process itself (name, cmdline: never a reason to signal or spare it),
    zeromib.gpu's attribution (gpu_indexes, attribution, candidate_gpu_indexes, protected), systemd
    (unit, system_service: the unit its ControlGroup= places the process in, _look/_unit_owner) and
    a container runtime's API (container, container_*, pod, pod_uid)."""

    pid: int
    ppid: int
    name: str
    cmdline: str
    user: str | None
    uid: int | None
    state: str
    start_time: int
    devices: list[str]
    gpu_indexes: list[int]
    attribution: str | None
    candidate_gpu_indexes: list[int]
    unit: str | None
    system_service: bool
    cgroup: str | None
    container: str | None
    container_runtime: str | None
    container_name: str | None
    container_image: str | None
    container_note: str | None
    pod: str | None
    pod_uid: str | None
    # The system container (Proxmox LXC, LXD, nspawn) the process runs in, from the host (_guests).
    guest: Guest | None
    # Where a holder outside every job, unit and container came from (_look/_origin, issue 70):
    # {kind, session, text, stop}, None elsewhere.
    origin: dict[str, t.Any] | None
    # What its own vLLM server answered to GET /is_sleeping (_look/_sleep_mode, issue 70): {port,
    # asleep}, the server's word, deciding nothing; None where nothing was asked or answered.
    sleep_answer: dict[str, t.Any] | None
    protected: bool
    protection_note: str | None
    kernel_thread: bool
    exe: str | None
    exe_path: str | None
    exe_owner: int | None
    exe_verified: bool
    # {device path: {"count": mappings, "kib": KiB}} of the NVIDIA nodes this process maps (None: maps unreadable).
    mapped: dict[str, dict[str, int]] | None
    # Internal: the container id a cgroup path names (unconfirmed) and the runtime's record.
    _container_ref: ContainerRef | None
    _container_record: ContainerRecord
    argv0: str | None
    protected_reason: str | None
    # From /proc/PID/status: what SIGTERM does ("ignored", "caught", "default"), and whether the
    # process is the init of a PID namespace below ours (_signals sends such a one SIGKILL at once).
    sigterm: str | None
    pid_namespace_init: bool
    # /proc/PID/status `Threads:`: a zombie leader (state Z) with more than one runs on in them.
    threads: int | None
    # Its /proc entries did not answer within the scan's budget (_bounded_reads): `waits_in` is where
    # root's read waited, `wchan` where the process itself sleeps (None where that did not answer).
    blocked: bool
    wchan: str | None
    waits_in: str | None


class ContainerEntry(t.TypedDict, total=False):
    """A container gpu_release stopped or disabled (`stopped_containers`, `disabled_containers`)."""

    id: str
    name: str
    runtime: str
    image: str | None
    restart_policy: str
    restart_policy_before: str
    running: bool
    gpu_indexes: list[int]
    pod: str | None
    pod_uid: str | None
    restart_max_retries: int
    # Seconds from the stop request until the runtime reported the container stopped.
    stopped_after_s: float
    # It was paused: unpaused through its runtime right before its stop (_act/_paused).
    unpaused: bool


class KilledEntry(t.TypedDict, total=False):
    """A process gpu_release signalled (`killed`); `signal` None in check mode."""

    pid: int
    name: str
    cmdline: str
    unit: str | None
    container: str | None
    gpu_indexes: list[int]
    signal: str | None
    # Why SIGKILL went out first (_signals.IGNORES_SIGTERM, NAMESPACE_INIT, STOPPED, TRACED, FROZEN), None when SIGTERM can arrive.
    sigkill_at_once: str | None
    exited_after_s: float | None
    # Internal: when the first signal went out, and whether the PID was reused meanwhile.
    _first_signal: float
    _reused: bool


class Timings(t.TypedDict):
    look_s: float
    plan_s: float
    stop_s: float
    kill_s: float
    wait_s: float
    settle_s: float


class DriverGpu(t.TypedDict):
    """One GPU as the driver lists it (/proc/driver/nvidia/gpus/<bus>/information): its bus id in
    the driver's spelling (0000:18:00.0), its minor number (/dev/nvidia<minor>) and UUID where the
    file gives them."""

    bus: str
    minor: int | None
    uuid: str | None


class ReleaseResult(t.TypedDict, total=False):
    """What gpu_release returns (docs/gpu_release.md). Written by Release only."""

    changed: bool
    released: bool
    selected_gpus: list[int]
    # Bus ids of the GPUs the driver has and this namespace cannot reach (issue 37).
    not_visible: list[str]
    # GPUs bound to vfio-pci, given to VMs (_look/_vfio.GivenToVm records).
    given_to_vms: list[t.Any]
    stopped_units: list[str]
    disabled_units: list[str]
    masked_units: list[str]
    # A system container's own units, named as their services entry (`lxc:101:vllm.service`).
    stopped_guest_units: list[str]
    killed_guest_units: list[str]
    disabled_guest_units: list[str]
    masked_guest_units: list[str]
    killed_units: list[str]
    failed_units: list[str]
    kept_units: list[dict[str, t.Any]]
    launchers: list[dict[str, t.Any]]
    services_not_found: list[str]
    stopped_containers: list[ContainerEntry]
    disabled_containers: list[ContainerEntry]
    stopped_programs: list[dict[str, t.Any]]
    disabled_programs: list[dict[str, t.Any]]
    stopped_mps_servers: list[dict[str, t.Any]]
    terminated_mps_clients: list[dict[str, t.Any]]
    killed: list[KilledEntry]
    protected: list[dict[str, t.Any]]
    skipped: list[dict[str, t.Any]]
    reused_pids: list[int]
    unkillable: list[dict[str, t.Any]]
    undecided: list[dict[str, t.Any]]
    spanning: list[dict[str, t.Any]]
    restore_record: dict[str, t.Any] | None
    # /dev/shm at the end (_shm.look's record) and what clean_shm removed (or, in check mode, would).
    shm: dict[str, t.Any] | None
    shm_removed: list[dict[str, t.Any]]
    # The files of killed jobs' patterns clean_shm kept, each with `why` (nothing ties it to a process this run ended).
    shm_kept: list[dict[str, t.Any]]
    shm_removed_mib: float
    truncated: dict[str, int]
    warnings: list[str]
    gpus_before: list[Gpu]
    gpus: list[Gpu]
    holders: list[Holder]
    elapsed_s: float
    timings: Timings
    smoke_test: dict[str, t.Any] | None


class ContainerRef(t.TypedDict):
    """What a cgroup path names (_cgroups.container_ref): a claim until the runtime confirms it.
    `id` None for a pod's process outside any container cgroup; `runtime` None where the path
    does not say."""

    id: str | None
    runtime: str | None
    kubernetes: bool
    pod_uid: str | None


class GuestRef(t.TypedDict):
    """The system container a cgroup path lies in (_cgroups.guest_ref): kind (lxc, lxd, nspawn),
    name (Proxmox's VMID, LXD's or the machine's name), the guest's own unit of the process, the
    boundary cgroup and the cgroup above it."""

    kind: str
    name: str
    unit: str | None
    cgroup: str
    parent: str


class Guest(t.TypedDict):
    """A holder's system container, seen from the host (gpu_facts' holders[].guest, _guests):
    its kind and name, the guest's own unit of the process, the host PID of the guest's init and
    the system manager that init is (systemd, init, openrc-init...; None when it is none)."""

    kind: str
    name: str
    unit: str | None
    init_pid: int | None
    manager: str | None


class ContainerRecord(t.TypedDict):
    """A container as its runtime reports it (_engines.record_of: `docker/podman inspect`)."""

    id: str | None
    name: str | None
    image: str | None
    restart_policy: str
    restart_max_retries: int
    running: bool
    status: str | None
    # Paused by its runtime (`docker pause`): frozen until the runtime unpauses it.
    paused: bool
    pod: str | None
    pod_uid: str | None
    # The pod its io.kubernetes.* labels name when no kubelet placed it under kubepods, else None.
    pod_claim: str | None
    # The container's init process as the runtime reports it (None when not running).
    pid: int | None
    # Its com.docker.swarm.* labels (a Swarm task's service and task), {} for others.
    labels: dict[str, str]
    # The GPUs its device request and NVIDIA_VISIBLE_DEVICES name (MIG UUIDs among them).
    gpu_devices: list[str]


class ContainersDone(t.TypedDict):
    """What _containers.act did: containers disabled and stopped, warnings for those it could not
    stop, and {id: reason} of those (signalled from outside instead)."""

    disabled: list[ContainerEntry]
    stopped: list[ContainerEntry]
    warnings: list[str]
    failed: dict[str, str]
