"""Cost of the health readings on a real node: gpu_facts' look with and without health
(the extra --query-gpu fields and the kernel log read), 20 runs each, medians in ms, and
one look's GPU health as JSON. Read-only. Stdlib only; run from the repository root:

    python3 tests/gpu/health_bench.py [OUT_DIR]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

repo = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
root = tempfile.mkdtemp(prefix="zeromib-bench-")
os.makedirs(os.path.join(root, "ansible_collections", "zeromib"))
os.symlink(repo, os.path.join(root, "ansible_collections", "zeromib", "gpu"))
sys.path.insert(0, root)

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts, _health  # noqa: E402
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi  # noqa: E402


def timed(fn, runs=20):
    times = []
    for _run in range(runs):
        began = time.monotonic()
        fn()
        times.append((time.monotonic() - began) * 1000.0)
    return round(statistics.median(times), 1), round(min(times), 1)


smi = NvidiaSmi(NvidiaSmi.find(), 10)
checks = _health.Checks()
report = {
    "look_ms_without_health": timed(lambda: _facts.look(smi, [], with_processes=True)),
    "look_ms_with_health": timed(lambda: _facts.look(smi, [], with_processes=True, checks=checks)),
    "query_gpu_ms_base": timed(smi.query_gpus),
    "query_gpu_ms_with_health": timed(lambda: smi.query_gpus(_facts.smi_mod.GPU_FIELDS + _facts.smi_mod.HEALTH_FIELDS)),
}
# What each health field adds to the one query (a field may cost the driver an NVML call of its own).
base_fields = _facts.smi_mod.GPU_FIELDS
report["query_gpu_ms_base_plus_field"] = {
    field: timed(lambda extra=(entry,): smi.query_gpus(base_fields + extra), runs=10) for entry in _facts.smi_mod.HEALTH_FIELDS for field in [entry[0]]
}
report["dmesg_ms"] = timed(lambda: subprocess.run(["dmesg"], capture_output=True, check=False))
report["dmesg_bytes"] = len(subprocess.run(["dmesg"], capture_output=True, check=False).stdout)


def read_log():
    reader = _health.KernelLog(24)
    reader.start()
    reader.xids()
    return reader


report["kernel_log_ms"] = timed(read_log)
last = read_log()
report["kernel_log"] = {"source": last.source, "error": last.error, "elapsed_s": last.elapsed_s}
snapshot = _facts.look(smi, [], with_processes=True, checks=checks)
facts = _facts.assemble(_facts.Findings(gpus=snapshot.gpus, apps=snapshot.apps, holders=snapshot.holders, max_used_mib=0, with_processes=True,
                                        footprint=snapshot.footprint, health=snapshot.health))
report["facts_health"] = {
    "healthy": facts["healthy"], "health_checked": facts["health_checked"], "health_issues": facts["health_issues"],
    "health": facts["health"],
    "gpus": [{k: g[k] for k in ("index", "pci_bus_id", "persistence_mode", "mig_mode", "healthy", "health_checked", "health_issues", "health")}
             for g in facts["gpus"]],
}
text = json.dumps(report, indent=2)
print(text)
if len(sys.argv) > 1:
    with open(os.path.join(sys.argv[1], "health_bench.json"), "w") as handle:
        handle.write(text + "\n")
