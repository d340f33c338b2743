# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Per-host audit records in the shape audit_gpus.yml gives gpu_audit_model: {host, status, error, gpu},
gpu being ansible_facts.gpu exactly as gpu_facts' RETURN (docs/gpu_facts.md) fixes it (values from the real H200 captures)."""

from __future__ import annotations

import copy

H200_TOTAL = 143771


def gpu(index, used=0, max_used=0, mig="Disabled", total=H200_TOTAL, footprint=False):
    return {
        "index": index,
        "uuid": f"GPU-ab0cf4f6-818d-be7e-f16b-96369{index:07x}",
        "name": "NVIDIA H200",
        "pci_bus_id": "00000000:%02X:00.0" % (0x18 + index),
        "minor_number": 7 - index,
        "memory_total_mib": total,
        "memory_used_mib": used,
        "memory_reserved_mib": 616,
        "memory_free_mib": total - used - 616,
        "utilization_gpu_pct": 0,
        "temperature_c": 37,
        "power_draw_w": 126.02,
        "persistence_mode": "Enabled",
        "mig_mode": mig,
        "cross_gpu_footprint": footprint,
        "clean": used <= max_used or footprint,
    }


def facts(gpus, holders=(), processes=(), clean=None):
    gpus = list(gpus)
    holders = list(holders)
    blocking = any(h["gpu_indexes"] and not h["protected"] for h in holders)
    return {
        "driver_version": "580.159.04",
        "cuda_version": "13.0",
        "count": len(gpus),
        "clean": (all(g["clean"] for g in gpus) and not blocking) if clean is None else clean,
        "memory_used_mib": sum(g["memory_used_mib"] for g in gpus),
        "error": None,
        "gpus": gpus,
        "processes": list(processes),
        "holders": holders,
    }


def holder(pid, name, gpu_indexes, cmdline=None, unit=None, container=None, user="root", protected=False, attribution=None):
    """Every process, CUDA or NVML client, opens every GPU's node (measured on a 2-GPU H200):
    `attribution` says which GPUs it really uses (listed or mapped), or none (nvml_client)."""
    return {
        "pid": pid, "ppid": 1, "name": name, "cmdline": cmdline or name, "user": user, "state": "S",
        "start_time": 123456 + pid,
        "devices": [f"/dev/nvidia{minor}" for minor in range(8)] + ["/dev/nvidiactl", "/dev/nvidia-uvm"],
        "gpu_indexes": list(gpu_indexes), "unit": unit, "container": container, "protected": protected,
        "attribution": attribution or ("listed" if gpu_indexes else "nvml_client"), "candidate_gpu_indexes": [],
    }


def clean_h200x8(host="clean-h200"):
    return {"host": host, "status": "ok", "error": None, "gpu": facts(gpu(i) for i in range(8))}


def dirty_with_holders(host="dirty-h200"):
    gpus = [gpu(0, used=10267)] + [gpu(i) for i in range(1, 8)]
    uuid = gpus[0]["uuid"]
    return {"host": host, "status": "ok", "error": None, "gpu": facts(
        gpus,
        holders=[
            holder(495, "python3", [0], cmdline="python3 train.py", unit="vllm.service"),
            holder(812, "nvidia-persistenced", [], cmdline="/usr/bin/nvidia-persistenced --user nvidia-persistenced", protected=True),
            holder(903, "dcgm-exporter", [], cmdline="/usr/bin/dcgm-exporter"),
        ],
        processes=[
            {"pid": 495, "name": "python3", "used_memory_mib": 6662, "gpu_uuid": uuid, "gpu_index": 0, "alive": True},
            {"pid": 427, "name": "[Not Found]", "used_memory_mib": 3590, "gpu_uuid": uuid, "gpu_index": 0, "alive": False},
        ],
    )}


def trainer_footprint_and_monitors(host="trainer-h200"):
    """A trainer on GPU 0; GPU 1 reads the 4 MiB cross-GPU footprint (clean); `nvidia-smi dmon`
    and a pynvml exporter are NVML clients."""
    gpus = [gpu(0, used=41487), gpu(1, used=4, footprint=True)]
    uuid = gpus[0]["uuid"]
    return {"host": host, "status": "ok", "error": None, "gpu": facts(
        gpus,
        holders=[
            holder(700, "python3", [0], cmdline="python3 train.py"),
            holder(701, "nvidia-smi", [], cmdline="nvidia-smi dmon"),
            holder(702, "python3", [], cmdline="python3 gpu_exporter.py", unit="gpu-exporter.service"),
        ],
        processes=[{"pid": 700, "name": "python3", "used_memory_mib": 41478, "gpu_uuid": uuid, "gpu_index": 0, "alive": True}],
    )}


def monitors_only(host="watched-h200"):
    """Only NVML clients: the host is clean."""
    return {"host": host, "status": "ok", "error": None, "gpu": facts(
        [gpu(0), gpu(1)], holders=[holder(801, "nvidia-smi", [], cmdline="nvidia-smi dmon")])}


def mig_baseline(host="mig-h200"):
    return {"host": host, "status": "ok", "error": None, "gpu": facts(gpu(i, used=55, max_used=60, mig="Enabled") for i in range(8))}


def nvidia_smi_timeout(host="hung-driver"):
    return {"host": host, "status": "ok", "error": None, "gpu": {
        "driver_version": None, "cuda_version": None, "count": 0, "clean": False, "memory_used_mib": None,
        "error": "nvidia-smi timed out after 10 s", "gpus": [], "processes": [], "holders": [],
    }}


def unreachable(host="gone"):
    return {"host": host, "status": "unreachable", "gpu": None,
            "error": "Task failed: Failed to connect to the host via ssh: ssh: connect to host 10.0.3.29 port 22: No route to host"}


def module_failure(host="no-python"):
    return {"host": host, "status": "error", "gpu": None,
            "error": "MODULE FAILURE: /bin/sh: 1: /usr/bin/python3: not found\nSee stdout/stderr for the exact error"}


def fleet():
    return copy.deepcopy([clean_h200x8(), dirty_with_holders(), mig_baseline(), nvidia_smi_timeout(), unreachable()])
