# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What building a module's AnsiballZ payload costs the controller, and what two ways of cutting it
would save (issue 68, item 5). Nothing runs on a node; nothing in the checkout changes.

    .venv/bin/python benchmarks/gate_payload.py [--reps 7] [--module zeromib.gpu.gpu_release] [--json OUT]

For each module, in one Python process (the routing tables loaded first, as in a play; cyclic
garbage collection off, as the gate's worker has it, plugin_utils/_gate.pause_collector_in_worker):

* fresh: Ansible builds the payload from the sources (its finder parses every module_util any
  import reaches, function-local ones included, then zips them), as every ansible-playbook run
  does once per module;
* cached: the same build with Ansible's own entry for it already in the run's local tmp
  (`ansiballz_cache`), as the run's second host gets it: what a build would cost if the entry
  outlived the run (a controller-side cache kept across runs);
* clean path only (`--clean-path-only`): the build from a copy of this collection in a temporary
  directory whose function-local imports of zeromib.gpu's module_utils are replaced by `pass`, so
  that the payload carries only what top-level imports reach: what a small look module, sent first
  and followed by the full module only where something is to be freed, would cost a clean gate. A
  prototype for measuring only: that copy's modules are not run.

Prints one JSON object of medians (milliseconds, bytes) beside ansible.builtin.command's.
"""
from __future__ import annotations

import argparse
import ast
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PREFIX = "ansible_collections.zeromib"

# One fresh interpreter per collections path: Ansible's loaders keep what they found for the life
# of their process.
MEASURE = r"""
import gc, json, os, shutil, statistics, sys, tempfile, time
os.environ["ANSIBLE_LOCAL_TEMP"] = tempfile.mkdtemp()
from ansible import constants as C
from ansible.executor import module_common
from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import init_plugin_loader, module_loader
from ansible.template import Templar
init_plugin_loader()
templar = Templar(loader=DataLoader())

def build(name):
    found = module_loader.find_plugin_with_context(name)
    return module_common.modify_module(module_name=found.plugin_resolved_name, module_path=found.plugin_resolved_path, module_args={},
                                       templar=templar, task_vars={"ansible_python_interpreter": "/usr/bin/python3"},
                                       module_compression="ZIP_DEFLATED", environment={})

build("ansible.builtin.ping")
gc.collect()
gc.freeze()
gc.disable()
reps, out = int(sys.argv[1]), {}
for name in sys.argv[2:]:
    times = {"fresh_ms": [], "fresh_cpu_ms": [], "cached_ms": [], "cached_cpu_ms": []}
    for _ in range(reps):
        shutil.rmtree(os.path.join(C.DEFAULT_LOCAL_TMP, "ansiballz_cache"), ignore_errors=True)
        for kind in ("fresh", "cached"):
            wall, cpu = time.perf_counter(), time.process_time()
            built = build(name)
            times[kind + "_ms"].append(1000.0 * (time.perf_counter() - wall))
            times[kind + "_cpu_ms"].append(1000.0 * (time.process_time() - cpu))
    out[name] = {key: round(statistics.median(values), 1) for key, values in times.items()}
    out[name]["payload_bytes"] = len(built.b_module_data)
shutil.rmtree(C.DEFAULT_LOCAL_TMP, ignore_errors=True)
print(json.dumps(out))
"""


def local_import_spans(source: str) -> list[tuple[int, int, int]]:
    """(first line, last line, column) of every import of zeromib.gpu inside a function, a class or
    an `if TYPE_CHECKING:` block: what Ansible's finder ships though a top-level import does not reach it."""
    spans = set()
    for node in ast.walk(ast.parse(source)):
        nested = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if not nested and not (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
            continue
        for sub in ast.walk(node):
            ours = (isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith(PREFIX)) or (
                isinstance(sub, ast.Import) and any(alias.name.startswith(PREFIX) for alias in sub.names))
            if ours:
                spans.add((sub.lineno, sub.end_lineno or sub.lineno, sub.col_offset))
    return sorted(spans, reverse=True)


def without_local_imports(source: str) -> str:
    lines = source.splitlines(keepends=True)
    for first, last, column in local_import_spans(source):
        lines[first - 1:last] = [" " * column + "pass\n"]
    return "".join(lines)


def clean_path_copy(work: str) -> str:
    """A copy of this collection (plugins, meta, galaxy.yml) under `work` with the function-local
    imports of its modules and module_utils replaced by `pass` -> its collections path."""
    target = os.path.join(work, "ansible_collections", "zeromib", "gpu")
    os.makedirs(target)
    shutil.copytree(os.path.join(REPO, "plugins"), os.path.join(target, "plugins"))
    shutil.copytree(os.path.join(REPO, "meta"), os.path.join(target, "meta"))
    shutil.copy(os.path.join(REPO, "galaxy.yml"), target)
    for folder in ("modules", "module_utils"):
        for root, _dirs, files in os.walk(os.path.join(target, "plugins", folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path, encoding="utf-8") as handle:
                        source = handle.read()
                    with open(path, "w", encoding="utf-8") as handle:
                        handle.write(without_local_imports(source))
    return work


def measure(collections: str, reps: int, modules: list[str]) -> dict[str, dict[str, float]]:
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=collections)
    done = subprocess.run([sys.executable, "-c", MEASURE, str(reps)] + modules, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"building the payloads failed: {done.stderr.strip().splitlines()[-3:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--module", action="append", default=[], help="a module (default zeromib.gpu.gpu_release and gpu_facts)")
    parser.add_argument("--clean-path-only", action="store_true", help="also the prototype payload of the clean path's code only")
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args()
    modules = args.module or ["zeromib.gpu.gpu_release", "zeromib.gpu.gpu_facts"]
    gc.collect()
    load_before = os.getloadavg()[0]
    result: dict[str, object] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": args.reps}
    result["as shipped"] = measure(os.path.join(REPO, ".build", "collections"), args.reps, ["ansible.builtin.command"] + modules)
    if args.clean_path_only:
        with tempfile.TemporaryDirectory(prefix="gate-payload-") as work:
            result["clean path only (prototype)"] = measure(clean_path_copy(work), args.reps, modules)
    result["load average (1 min) at the start / the end"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
