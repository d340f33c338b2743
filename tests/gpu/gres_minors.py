"""Issue 69 on a real NVIDIA node (root, no Slurm needed): Slurm's GPU numbers mapped to GPUs by
_slurm/_gres against the real driver - real /dev/nvidia<minor> nodes (195:minor), the real
/proc/driver/nvidia/gpus/*/information and nvidia-smi. For each GPU, gres.conf `File=` lines
naming the device files in minor order map GRES index N to the GPU whose `Minor Number`
(nvidia-smi -q) is the file's; `AutoDetect=nvml` maps GRES index N to nvidia-smi's GPU N; and
gpu_facts' minor_order_differs agrees with nvidia-smi's own minor numbers. Prints one JSON object.

Usage (repository root): python3 tests/gpu/gres_minors.py OUT_DIR"""
import json
import os
import subprocess
import sys
import time

OUT = sys.argv[1]
ROOT = os.path.join(OUT, "collections")
os.makedirs(os.path.join(ROOT, "ansible_collections", "zeromib"), exist_ok=True)
link = os.path.join(ROOT, "ansible_collections", "zeromib", "gpu")
if not os.path.lexists(link):
    os.symlink(os.getcwd(), link)
sys.path.insert(0, ROOT)

from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _gres  # noqa: E402
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts, _nvidia_smi  # noqa: E402


def smi(*args):
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True).stdout


rows = [line.split(", ") for line in smi("--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader").splitlines()]
minor_of_index = {}
index = None
for line in smi("-q").splitlines():
    if line.startswith("GPU "):
        index = len(minor_of_index)
    if "Minor Number" in line and index is not None:
        minor_of_index[index] = int(line.split(":")[1])
conf_dir = os.path.join(OUT, "slurm")
os.makedirs(conf_dir, exist_ok=True)
env = {"SLURM_CONF": os.path.join(conf_dir, "slurm.conf"), "SLURMD_NODENAME": "node"}
result = {"gpus": [{"index": int(i), "uuid": u, "bus": b, "minor": minor_of_index.get(int(i))} for i, u, b in rows]}
minors = sorted(minor_of_index.values())
for name, text in (("files", "Name=gpu File={}\n".format(",".join(f"/dev/nvidia{m}" for m in minors))), ("nvml", "AutoDetect=nvml\n")):
    with open(os.path.join(conf_dir, "gres.conf"), "w") as handle:
        handle.write(text)
    os.chmod(os.path.join(conf_dir, "gres.conf"), 0o644)
    started = time.perf_counter()
    mapped = _gres.job_gpus(list(range(len(rows))), env, lambda args: smi(*args))
    elapsed = time.perf_counter() - started
    want = ([next(u for i, u, _b in rows if minor_of_index[int(i)] == m) for m in minors] if name == "files" else [u for _i, u, _b in rows])
    result[name] = {"gres.conf": text, "mapped": _gres.describe(mapped), "as_expected": [gpu.uuid for _i, _p, gpu in mapped] == want,
                    "elapsed_ms": round(elapsed * 1000, 2)}
driver = _nvidia_smi.read_driver_gpus()
gpus = [{"index": int(i), "pci_bus_id": b} for i, _u, b in rows]
result["minor_order_differs"] = _facts.minor_order_differs(gpus, {bus: g["minor"] for bus, g in driver.items() if g["minor"] is not None})
result["minor_order_differs_by_nvidia_smi"] = [minor_of_index[i] for i in sorted(minor_of_index)] != minors
print(json.dumps(result, indent=1))
