# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""The fleet audit's model as Prometheus text (the gpu_audit_prom filter, the gpu_audit_report action).
Documented in plugins/filter/gpu_audit_prom.py."""

from __future__ import annotations

import math
import typing as t
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError

_STATUSES = ("clean", "dirty", "error", "unreachable")

_FAMILIES = (
    ("zeromib_gpu_audit_timestamp_seconds", "Unix time at which the GPU audit report was generated."),
    ("zeromib_gpu_audit_hosts", "Hosts in the GPU audit by status (clean, dirty, error, unreachable)."),
    ("zeromib_gpu_host_up", "1 when the host answered with GPU facts, 0 when unreachable or in error."),
    ("zeromib_gpu_host_clean", "1 when every GPU of the host is clean and no unprotected process holds one."),
    ("zeromib_gpu_host_info", "Audit status and NVIDIA driver version of the host, and the CUDA version where its libcuda says it; always 1."),
    ("zeromib_gpu_devices", "GPUs the host reported."),
    ("zeromib_gpu_holders", "Unprotected processes using a GPU of the host."),
    ("zeromib_gpu_nvml_clients", "NVML clients of the host: they open GPU device files but use no GPU memory."),
    ("zeromib_gpu_pending_restore", "Entries gpu_release stopped, disabled or masked on the host that gpu_restore has not put back yet."),
    ("zeromib_gpu_driver_drift", "1 when the driver library on disk is not the loaded kernel module's version: new CUDA jobs fail there."),
    ("zeromib_gpu_minor_order_differs", "1 when the host's /dev/nvidia<minor> files are not in nvidia-smi's index order (Slurm's File= numbers other GPUs)."),
    ("zeromib_gpu_shm_free_mib", "Free space of the host's /dev/shm in MiB (NCCL and PyTorch keep their shared segments there)."),
    ("zeromib_gpu_shm_unheld_mib", "MiB of /dev/shm taken by files no live process has open or mapped (what killed jobs left)."),
    ("zeromib_gpu_shm_unheld_files", "Files in /dev/shm that no live process has open or mapped."),
    ("zeromib_gpu_memory_used_mib", "GPU memory used in MiB, as nvidia-smi reports memory.used."),
    ("zeromib_gpu_memory_total_mib", "GPU memory installed in MiB."),
    ("zeromib_gpu_clean", "1 when the GPU's memory used is at or below the audit's max_used_mib."),
    ("zeromib_gpu_healthy", "1 when gpu_facts found no health issue on the GPU (ECC, row remaps, PCIe link, slowdown, persistence, MIG, Xid)."),
    ("zeromib_gpu_health_checked", "1 when every health check could run on the GPU; 0 when some could not (its health_unchecked)."),
    ("zeromib_gpu_ecc_uncorrected", "Uncorrected volatile ECC errors of the GPU since the driver loaded."),
    ("zeromib_gpu_xid_recent", "Xid errors of the GPU in the kernel log within the audit's window."),
    ("zeromib_gpu_ghost_busy", "1 when the GPU reads busy with no process and no memory (what a process killed mid-kernel can leave)."),
)


def escape_label_value(value: object) -> str:
    """Escape per the text exposition format: backslash, double quote and line feed."""
    return "" if value is None else str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: list[tuple[str, t.Any]]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs) + "}"


def _number(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    raise TypeError(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_Samples = t.Dict[str, t.List[str]]


def _add(samples: _Samples, name: str, labels: str | list[tuple[str, t.Any]], value: t.Any) -> None:
    # labels: (name, value) pairs, or a label set rendered once (a GPU's, used by several families).
    samples[name].append(f"{name}{labels if isinstance(labels, str) else _labels(labels)} {_number(value)}")


def _gpu_samples(samples: _Samples, name: t.Any, gpu: t.Mapping[str, t.Any]) -> None:
    gpu_labels = [("host", name), ("gpu", gpu.get("index")), ("uuid", gpu.get("uuid")), ("name", gpu.get("name"))]
    named, keyed = _labels(gpu_labels), _labels(gpu_labels[:3])
    if _is_number(gpu.get("memory_used_mib")):
        _add(samples, "zeromib_gpu_memory_used_mib", named, gpu["memory_used_mib"])
    if _is_number(gpu.get("memory_total_mib")):
        _add(samples, "zeromib_gpu_memory_total_mib", named, gpu["memory_total_mib"])
    _add(samples, "zeromib_gpu_clean", keyed, bool(gpu.get("clean")))
    if isinstance(gpu.get("healthy"), bool):
        _add(samples, "zeromib_gpu_healthy", keyed, gpu["healthy"])
    if isinstance(gpu.get("health_checked"), bool):
        _add(samples, "zeromib_gpu_health_checked", keyed, gpu["health_checked"])
    if _is_number(gpu.get("ecc_uncorrected")):
        _add(samples, "zeromib_gpu_ecc_uncorrected", keyed, gpu["ecc_uncorrected"])
    if _is_number(gpu.get("xid_recent")):
        _add(samples, "zeromib_gpu_xid_recent", keyed, gpu["xid_recent"])
    if isinstance(gpu.get("ghost_busy"), bool):
        _add(samples, "zeromib_gpu_ghost_busy", keyed, gpu["ghost_busy"])


def _host_samples(samples: _Samples, host: t.Mapping[str, t.Any]) -> None:
    name = host.get("host")
    up = bool(host.get("up"))
    _add(samples, "zeromib_gpu_host_up", [("host", name)], up)
    _add(samples, "zeromib_gpu_host_clean", [("host", name)], host.get("status") == "clean")
    # An info metric carries only what is known: a version not read (an unreachable host, a driver
    # that does not say its CUDA version) is no label, rather than an empty one.
    _add(samples, "zeromib_gpu_host_info", [(label, value) for label, value in (
        ("host", name), ("status", host.get("status")),
        ("driver_version", host.get("driver_version")), ("cuda_version", host.get("cuda_version")),
    ) if label == "host" or value not in (None, "")], 1)
    if not up:
        return
    if _is_number(host.get("gpu_count")):
        _add(samples, "zeromib_gpu_devices", [("host", name)], host["gpu_count"])
    _add(samples, "zeromib_gpu_holders", [("host", name)], sum(1 for h in host.get("holders") or [] if h.get("blocking")))
    _add(samples, "zeromib_gpu_nvml_clients", [("host", name)], len(host.get("nvml_clients") or []))
    # Read from the host's record by gpu_facts: known only for a host that answered.
    _add(samples, "zeromib_gpu_pending_restore", [("host", name)], sum(1 for e in host.get("pending_restore_entries") or [] if e.get("kind")))
    _add(samples, "zeromib_gpu_driver_drift", [("host", name)], 1 if host.get("driver_drift") else 0)
    if isinstance(host.get("minor_order_differs"), bool):
        _add(samples, "zeromib_gpu_minor_order_differs", [("host", name)], 1 if host["minor_order_differs"] else 0)
    shm = host.get("shm") or {}
    for family, key in (("zeromib_gpu_shm_free_mib", "free_mib"), ("zeromib_gpu_shm_unheld_mib", "unheld_mib"),
                        ("zeromib_gpu_shm_unheld_files", "unheld_files")):
        if _is_number(shm.get(key)):
            _add(samples, family, [("host", name)], shm[key])
    for gpu in host.get("gpus") or []:
        _gpu_samples(samples, name, gpu)


def gpu_audit_prom(model: t.Any) -> str:
    if not isinstance(model, Mapping) or not isinstance(model.get("hosts"), list):
        raise AnsibleFilterError("zeromib.gpu.gpu_audit_prom expects the report model from zeromib.gpu.gpu_audit_model")
    samples: _Samples = {name: [] for name, _help in _FAMILIES}
    _add(samples, "zeromib_gpu_audit_timestamp_seconds", [], float(model.get("generated_epoch") or 0.0))
    for status in _STATUSES:
        _add(samples, "zeromib_gpu_audit_hosts", [("status", status)], sum(1 for h in model["hosts"] if h.get("status") == status))
    for host in model["hosts"]:
        _host_samples(samples, host)
    lines = []
    for name, help_text in _FAMILIES:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        lines.extend(samples[name])
    return "\n".join(lines) + "\n"
