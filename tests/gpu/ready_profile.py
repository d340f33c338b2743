"""The training-ready profile on a real node, read-only (issue 71): what gpu_facts' look reads of each
GPU's compute mode, power limit against the default, application clocks against the defaults, the
user-clocks event reason, ECC mode and pending change, persistence, MIG mode and pending, utilization
and power draw, and what the default profile says of them; the cost of the profile's fields in the one
--query-gpu call (medians of 20, in ms); and the nvidia-smi -q sections they come from, as captures.

NEVER changes a setting: it runs only nvidia-smi --query-gpu and nvidia-smi -q (no -c, -pl, -lgc,
-rgc, -ac, -rac, -r, -mig). Stdlib only; prints one JSON object; run from the repository root:

    python3 tests/gpu/ready_profile.py [OUT_DIR]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

repo = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
root = tempfile.mkdtemp(prefix="zeromib-ready-")
os.makedirs(os.path.join(root, "ansible_collections", "zeromib"))
os.symlink(repo, os.path.join(root, "ansible_collections", "zeromib", "gpu"))
sys.path.insert(0, root)

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts, _health, _readiness  # noqa: E402
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi_mod  # noqa: E402

# nvidia-smi -q sections the profile's fields stand for (read-only displays).
Q_SECTIONS = ("COMPUTE", "CLOCK", "POWER", "ECC", "PERFORMANCE")


def timed(fn, runs=20):
    times = []
    for _run in range(runs):
        began = time.monotonic()
        fn()
        times.append((time.monotonic() - began) * 1000.0)
    return round(statistics.median(times), 1), round(min(times), 1)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
    smi = smi_mod.NvidiaSmi(smi_mod.NvidiaSmi.find(), 10)
    checks = _health.Checks()
    snapshot = _facts.look(smi, [], with_processes=True, checks=checks)
    gpus = []
    for gpu in snapshot.gpus:
        health = gpu.get("health") or {}
        gpus.append({
            "index": gpu.get("index"), "name": gpu.get("name"), "driver_version": gpu.get("driver_version"),
            "memory_used_mib": gpu.get("memory_used_mib"), "persistence_mode": gpu.get("persistence_mode"),
            "mig_mode": gpu.get("mig_mode"), "mig_mode_pending": health.get("mig_mode_pending"),
            "ready": health.get("ready"),
            "ready_issues": _readiness.issues(gpu, checks.ready_profile),
            "health_issues": gpu.get("health_issues"), "health_unchecked": gpu.get("health_unchecked"),
            "rejected_fields": gpu.get("_rejected"),
            "unavailable": {k: v for k, v in (gpu.get("_unavailable") or {}).items() if k in _readiness.readings(gpu)},
        })
    without_ready = tuple(f for f in smi_mod.HEALTH_FIELDS if f not in smi_mod.READY_FIELDS)
    report = {
        "gpus": gpus,
        "processes": len(snapshot.apps),
        "nvidia_smi_calls_of_one_look": smi.calls,
        "query_gpu_ms_health_without_ready": timed(lambda: smi.query_gpus(smi_mod.GPU_FIELDS + without_ready)),
        "query_gpu_ms_health_with_ready": timed(lambda: smi.query_gpus(smi_mod.GPU_FIELDS + smi_mod.HEALTH_FIELDS)),
        "look_ms_with_health": timed(lambda: _facts.look(smi, [], with_processes=True, checks=checks)),
    }
    report["query_gpu_ms_per_ready_field"] = {
        field: timed(lambda extra=(entry,): smi.query_gpus(smi_mod.GPU_FIELDS + extra), runs=10) for entry in smi_mod.READY_FIELDS for field in [entry[0]]
    }
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        for section in Q_SECTIONS:
            done = subprocess.run([smi.path, "-q", "-d", section], capture_output=True, text=True, check=False, timeout=30)
            with open(os.path.join(out_dir, f"q_{section.lower()}.txt"), "w") as handle:
                handle.write(done.stdout + done.stderr)
        names = ",".join(f for f, _k, _t in smi_mod.READY_FIELDS)
        done = subprocess.run([smi.path, "--query-gpu=index," + names, "--format=csv"], capture_output=True, text=True, check=False, timeout=30)
        with open(os.path.join(out_dir, "query_ready_fields.csv"), "w") as handle:
            handle.write(done.stdout + done.stderr)
        with open(os.path.join(out_dir, "ready_profile.json"), "w") as handle:
            json.dump(report, handle, indent=1, default=str)
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
