"""Where a clean gate's time goes, beside a one-task `nvidia-smi` call: the controller's AnsiballZ
build of each module (Ansible's module_utils finder parses every file the module imports, then zips
them; each CLI run pays it once, a play once for all its hosts), the module's own run on the node
(the interpreter's start, the payload's unzip and imports, the module's work) and its `elapsed_s`,
and the size of what it returns. Run on the node itself (a real GPU host, or inside a simulated one)
with ansible-core importable:

    python benchmarks/gate_breakdown.py [--reps 7] [--collections PATH] [--module zeromib.gpu.gpu_facts]

PATH holds ansible_collections/zeromib/gpu (default: this checkout's .build/collections). Each
contender is measured --reps times, interleaved; medians in milliseconds are printed and written as
JSON with --out. Nothing is freed: gpu_release is measured only where gpu_facts first reads every GPU
clean (no holder, at most the baseline), else the script stops before running it."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# One fresh interpreter per build: Ansible caches a built payload for the life of its process, and
# every CLI run (ansible, ansible-playbook) starts without it.
BUILD = r"""
import json, os, sys, tempfile, time
os.environ["ANSIBLE_LOCAL_TEMP"] = tempfile.mkdtemp()
from ansible.executor import module_common
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader, module_loader
from ansible.template import Templar
init_plugin_loader()
name, args, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
found = module_loader.find_plugin_with_context(name)
templar = Templar(loader=DataLoader())
start = time.perf_counter()
built = module_common.modify_module(module_name=found.plugin_resolved_name, module_path=found.plugin_resolved_path,
                                    module_args=args, templar=templar, task_vars={"ansible_python_interpreter": sys.executable},
                                    module_compression="ZIP_DEFLATED", environment={})
took = time.perf_counter() - start
with open(out, "wb") as handle:
    handle.write(built.b_module_data)
print(json.dumps({"build_ms": round(took * 1000, 1), "payload_bytes": len(built.b_module_data)}))
"""

CONTENDERS = (("ansible.builtin.command", {"_raw_params": "nvidia-smi"}),)


def build(name, args, env, work):
    payload = os.path.join(work, name.replace(".", "_") + ".py")
    done = subprocess.run([sys.executable, "-c", BUILD, name, json.dumps(args), payload], env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"building {name} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout), payload


def run_payload(payload):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, payload], capture_output=True, check=False)
    took = time.perf_counter() - start
    try:
        result = json.loads(done.stdout)
    except ValueError:
        result = {}
    return round(took * 1000, 1), len(done.stdout), result.get("elapsed_s")


def refuse_unless_clean(env, work):
    """gpu_release frees what holds a GPU: it runs here only on a node gpu_facts reads clean."""
    _built, payload = build("zeromib.gpu.gpu_facts", {}, env, work)
    done = subprocess.run([sys.executable, payload], capture_output=True, check=False)
    try:
        facts = (json.loads(done.stdout).get("ansible_facts") or {}).get("gpu") or {}
    except ValueError:
        facts = {}
    if facts.get("clean") is not True:
        raise SystemExit("gate_breakdown: gpu_facts does not read every GPU of this node clean (or could not read them): "
                         "gpu_release would free what holds them, so it is not run here; measure on an idle GPU host")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--collections", default=os.path.join(REPO, ".build", "collections"))
    parser.add_argument("--module", action="append", default=[], help="a module to measure (default gpu_release and gpu_facts)")
    parser.add_argument("--out")
    args = parser.parse_args()
    modules = args.module or ["zeromib.gpu.gpu_release", "zeromib.gpu.gpu_facts"]
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=os.path.abspath(args.collections))
    rows = list(CONTENDERS) + [(name, {}) for name in modules]
    samples = {name: {"build_ms": [], "run_ms": [], "elapsed_ms": []} for name, _args in rows}
    sizes = {}
    with tempfile.TemporaryDirectory() as work:
        if "zeromib.gpu.gpu_release" in modules:
            refuse_unless_clean(env, work)
        for _rep in range(args.reps):
            for name, margs in rows:
                built, payload = build(name, margs, env, work)
                run_ms, out_bytes, elapsed = run_payload(payload)
                samples[name]["build_ms"].append(built["build_ms"])
                samples[name]["run_ms"].append(run_ms)
                if elapsed is not None:
                    samples[name]["elapsed_ms"].append(round(elapsed * 1000, 1))
                sizes[name] = {"payload_bytes": built["payload_bytes"], "result_bytes": out_bytes}
    report = {}
    for name, parts in samples.items():
        report[name] = {key: statistics.median(values) for key, values in parts.items() if values}
        report[name].update(sizes[name])
    base = report["ansible.builtin.command"]
    print(f"{'module':28s} {'build ms':>9s} {'run ms':>8s} {'elapsed ms':>10s} {'payload':>9s} {'result':>8s}  over command")
    for name, row in report.items():
        over = row["build_ms"] + row["run_ms"] - base["build_ms"] - base["run_ms"]
        print(f"{name:28s} {row['build_ms']:9.1f} {row['run_ms']:8.1f} {row.get('elapsed_ms', float('nan')):10.1f} "
              f"{row['payload_bytes']:9d} {row['result_bytes']:8d}  {over:+.1f} ms")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
