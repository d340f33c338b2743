# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Where one host's clean gate goes: controller side and node side, for any checkout.

    .venv/bin/python benchmarks/gate_profile.py [--checkout DIR] [--reps N] [--json OUT]

On a simulated clean 8-GPU namespace host (tests/sim/nshost.py, health on: the default):

* controller: `playbooks/free_gpus.yml` on that host (`-c local`) under timing wrappers around
  Ansible's own steps (the task in the worker, the gate's action plugin, building the AnsiballZ
  payload, running it), next to the one-task nvidia-smi play;
* node: the gpu_release AnsiballZ payload the gate sends (kept with ANSIBLE_KEEP_REMOTE_FILES),
  run by the node's python3: its size, interpreter start to exit, the interpreter alone,
  `python -X importtime` (ansible.module_utils.basic and each zeromib.gpu module_util), and
  every subprocess it starts (`strace -f -ttt -e trace=execve,exit_group`: nvidia-smi,
  journalctl/dmesg, systemctl, nv-fabricmanager), plus the /proc scan of gpu_release's look.

`--checkout DIR` profiles another checkout (its collection through its .build/collections and its
tests/sim rigs), so that before and after are measured in the same minutes. Needs root (the rig
does). Acts only inside the host it creates. Prints one JSON object; `--markdown` a table.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VENV_BIN = os.path.join(REPO, ".venv", "bin")
PREFIX = "ansible_collections.zeromib.gpu.plugins.module_utils."

# Wrapped around ansible-playbook: each wrapper appends "name seconds" to $GATE_PROFILE_OUT, from
# the worker process that runs it (forked per host), so the controller's steps are timed as they run.
CONTROLLER = r"""
import os, sys, time
from ansible.executor import task_executor
from ansible.plugins import action

OUT = os.environ["GATE_PROFILE_OUT"]

def timed(owner, name, label):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            with open(OUT, "a") as handle:
                handle.write("%s %.6f\n" % (label, time.perf_counter() - began))
    setattr(owner, name, wrapper)

timed(task_executor.TaskExecutor, "run", "task")
timed(action.ActionBase, "_execute_module", "execute_module")
timed(action.ActionBase, "_configure_module", "build_payload")
timed(action.ActionBase, "_low_level_execute_command", "run_on_node")
began = time.perf_counter()
from ansible.cli.playbook import main
try:
    main(["ansible-playbook"] + sys.argv[1:])
finally:
    import resource
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    with open(OUT, "a") as handle:
        handle.write("playbook %.6f\n" % (time.perf_counter() - began))
        # CPU of the whole play (workers and, with -c local, the module): steadier than wall time.
        handle.write("cpu %.6f\n" % sum(u.ru_utime + u.ru_stime for u in used))
"""

ONE_TASK = """---
- name: One nvidia-smi task
  hosts: all
  gather_facts: false
  tasks:
    - name: Read memory
      ansible.builtin.command: nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
      changed_when: false
"""

# Run inside the host by its python3: the payload's wall time, start to exit, N times.
NODE_TIMER = r"""
import json, resource, subprocess, sys, time
argv, reps = json.loads(sys.argv[1]), int(sys.argv[2])
times, cpu = [], []
for _ in range(reps):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    times.append(time.perf_counter() - began)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    if proc.returncode != 0:
        sys.exit(proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:])
print(json.dumps({"times": times, "cpu": cpu, "last": proc.stdout.decode()}))
"""

# Run inside the host by its python3: the payload with every compile() call counted and timed (the
# AnsiballZ wrapper, its zipimporter's compiles of each module); the counts go to stderr as JSON.
COMPILES = r"""
import builtins, json, runpy, sys, time
compile_ = builtins.compile
seen = {"all": 0, "all_ms": 0.0, "ours": 0, "ours_ms": 0.0}
def timed_compile(source, filename, *args, **kwargs):
    began = time.perf_counter()
    try:
        return compile_(source, filename, *args, **kwargs)
    finally:
        spent = 1000.0 * (time.perf_counter() - began)
        seen["all"] += 1
        seen["all_ms"] += spent
        if "/zeromib/gpu/" in str(filename):
            seen["ours"] += 1
            seen["ours_ms"] += spent
builtins.compile = timed_compile
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    sys.stderr.write("\n" + json.dumps(seen) + "\n")
"""

# The /proc scan of gpu_release's clean look (device files only), with the checkout's code.
SCAN = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
try:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
except ImportError:  # a checkout before the device tables left _holders (issue 68)
    _devices = _holders
times = []
for _ in range(int(sys.argv[2])):
    began = time.perf_counter()
    table = _devices.DeviceTable.read()
    _holders.scan_holders("/proc", [], with_maps=False, without_devices=[], table=table)
    times.append(time.perf_counter() - began)
print(json.dumps({"times": times}))
"""


def median_ms(values: list[float]) -> float:
    return round(1000.0 * statistics.median(values), 1) if values else 0.0


def parse_importtime(stderr: str) -> dict[str, tuple[int, int]]:
    """`python -X importtime` lines -> {module: (self us, cumulative us)}; the first import wins."""
    found: dict[str, tuple[int, int]] = {}
    for line in stderr.splitlines():
        match = re.match(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|\s+(\S.*)$", line)
        if match:
            name = match.group(3).strip()
            found.setdefault(name, (int(match.group(1)), int(match.group(2))))
    return found


def ours_total_us(stderr: str) -> int:
    """Cumulative import time of zeromib.gpu's outermost imports (a module and what it pulls in)."""
    entries = []
    for line in stderr.splitlines():
        match = re.match(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|( *)(\S+)$", line)
        if match:
            entries.append((len(match.group(3)), match.group(4), int(match.group(2))))
    total, stack = 0, []  # importtime prints a module after what it imports: walk it backwards
    for depth, name, cumulative in reversed(entries):
        while stack and stack[-1][0] >= depth:
            stack.pop()
        ours = name.startswith(PREFIX)
        if ours and not any(n.startswith(PREFIX) for _d, n in stack):
            total += cumulative
        stack.append((depth, name))
    return total


def parse_strace(text: str) -> list[dict[str, Any]]:
    """strace -f -ttt -e trace=execve,exit_group output -> [{pid, program, argv, start, end}] in exec
    order; a process that execs again (a #! script's interpreter) is one span."""
    by_pid: dict[str, dict[str, Any]] = {}
    order: list[dict[str, Any]] = []
    for line in text.splitlines():
        match = re.match(r"^(\d+)\s+(\d+\.\d+)\s+(.*)$", line)
        if not match:
            continue
        pid, stamp, rest = match.group(1), float(match.group(2)), match.group(3)
        exec_call = re.match(r'^execve\("([^"]+)", \[(.*?)\]', rest)
        if exec_call and "= 0" in rest.rsplit(")", 1)[-1]:
            argv = re.findall(r'"((?:[^"\\]|\\.)*)"', exec_call.group(2))
            if pid in by_pid and by_pid[pid]["end"] is None:
                by_pid[pid].update(program=os.path.basename(exec_call.group(1)), argv=argv)
                continue
            entry = {"pid": pid, "program": os.path.basename(exec_call.group(1)), "argv": argv, "start": stamp, "end": None}
            by_pid[pid] = entry
            order.append(entry)
        elif rest.startswith(("exit_group(", "+++ exited", "+++ killed")) and pid in by_pid and by_pid[pid]["end"] is None:
            by_pid[pid]["end"] = stamp
    return order


def subprocess_rows(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The payload's children, by what they are: [{what, calls, ms (start to exit, summed)}]."""
    rows: dict[str, dict[str, Any]] = {}
    for span in spans[1:]:
        argv = span["argv"]
        program = str(span["program"])
        if program.startswith("python") and len(argv) > 1:
            program = os.path.basename(argv[1])  # a #!python script (the sim's tools)
            if program.startswith("python"):
                continue
        what = program
        if program == "nvidia-smi":
            what = "nvidia-smi " + next((a.split("=")[0] for a in argv if a.startswith("--query")), " ".join(argv[1:3]))
        elif program == "systemctl":
            what = "systemctl " + " ".join(a for a in argv[1:3] if not a.startswith("-"))
        row = rows.setdefault(what, {"what": what, "calls": 0, "ms": 0.0})
        row["calls"] += 1
        if span["end"] is not None:
            row["ms"] = round(row["ms"] + 1000.0 * (span["end"] - span["start"]), 1)
    return sorted(rows.values(), key=lambda r: -r["ms"])


class Profile:
    """One checkout on its own clean host; `sample()` takes one of each reading, so that the
    checkouts of a run take turns (the machine's noise hits them alike)."""

    def __init__(self, checkout: str) -> None:
        self.checkout = checkout
        self.collections = os.path.join(checkout, ".build", "collections")
        spec = importlib.util.spec_from_file_location(f"nshost_{abs(hash(checkout)):x}", os.path.join(checkout, "tests", "sim", "nshost.py"))
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.join(checkout, "tests", "sim"))
        spec.loader.exec_module(module)
        self.host = module.NsHost(preset="h200x8", seed="profiled")
        self.payload = ""
        self.payload_bytes = 0
        self.command_payload = ""
        self.samples: dict[str, list[Any]] = {}

    def env(self, **extra: str) -> dict[str, str]:
        env = {"ANSIBLE_COLLECTIONS_PATH": self.collections, "HOME": "/root", "ANSIBLE_NOCOLOR": "1",
               "ANSIBLE_LOCALHOST_WARNING": "False", "ANSIBLE_DEPRECATION_WARNINGS": "False", "ANSIBLE_PIPELINING": "True"}
        env.update(extra)
        return env

    def playbook_argv(self, playbook: str) -> list[str]:
        # free_gpus.yml acts on gpu_nodes unless told otherwise (never `all`).
        return ["-i", "localhost,", "-c", "local", playbook, "-e", "ansible_python_interpreter=/usr/bin/python3",
                "-e", "ansible_become=false", "-e", "free_gpus_hosts=localhost"]

    def start(self) -> None:
        self.host.start()
        for name, text in (("timed_playbook.py", CONTROLLER), ("one-task.yml", ONE_TASK), ("node_timer.py", NODE_TIMER)):
            with open(os.path.join(self.host.dir, name), "w") as handle:
                handle.write(text)
        self.payload = self.keep_payload()
        self.payload_bytes = os.path.getsize(self.payload)
        self.command_payload = self.keep_payload(os.path.join(self.host.dir, "one-task.yml"), "command")

    def stop(self) -> None:
        self.host.stop()

    def keep_payload(self, play: str = "", module: str = "gpu_release") -> str:
        """The AnsiballZ file of `module` as `play` sends it (default: gpu_release, the gate's, with
        the role's defaults)."""
        remote_tmp = os.path.join(self.host.dir, "remote-tmp-" + module)
        os.makedirs(remote_tmp, exist_ok=True)
        play = play or os.path.join(self.checkout, "playbooks", "free_gpus.yml")
        proc = self.host.run([os.path.join(VENV_BIN, "ansible-playbook")] + self.playbook_argv(play), timeout=300,
                             env=self.env(ANSIBLE_KEEP_REMOTE_FILES="1", ANSIBLE_REMOTE_TMP=remote_tmp, ANSIBLE_PIPELINING="False"))
        if proc.returncode != 0:
            raise SystemExit(f"{play} failed on the clean host:\n" + proc.stdout[-3000:] + proc.stderr[-3000:])
        for root, _dirs, files in os.walk(remote_tmp):
            if f"AnsiballZ_{module}.py" in files:
                return os.path.join(root, f"AnsiballZ_{module}.py")
        raise SystemExit(f"no AnsiballZ_{module}.py was kept")

    def add(self, key: str, value: Any) -> None:
        self.samples.setdefault(key, []).append(value)

    def sample(self) -> None:
        self.sample_controller()
        self.sample_node()

    def sample_controller(self) -> None:
        out = os.path.join(self.host.dir, "controller-times.txt")
        for name, play in (("gate", os.path.join(self.checkout, "playbooks", "free_gpus.yml")), ("one", os.path.join(self.host.dir, "one-task.yml"))):
            if os.path.exists(out):
                os.unlink(out)
            proc = self.host.run([os.path.join(VENV_BIN, "python"), os.path.join(self.host.dir, "timed_playbook.py")] + self.playbook_argv(play),
                                 timeout=300, env=self.env(GATE_PROFILE_OUT=out))
            if proc.returncode != 0:
                raise SystemExit(f"{play} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            sums: dict[str, float] = {}
            with open(out) as handle:
                for line in handle:
                    label, seconds = line.split()
                    sums[label] = sums.get(label, 0.0) + float(seconds)
            self.add(name, sums)

    def sample_node(self) -> None:
        python, payload = "/usr/bin/python3", self.payload
        timer = os.path.join(self.host.dir, "node_timer.py")
        data = json.loads(self.host.run([python, timer, json.dumps([python, payload]), "1"], timeout=300).stdout.strip().splitlines()[-1])
        self.add("start_to_exit", data["times"][0])
        self.add("node_cpu", data["cpu"][0])
        self.add("result", json.loads(data["last"]))
        command = json.loads(self.host.run([python, timer, json.dumps([python, self.command_payload]), "1"], timeout=300).stdout)
        self.add("command_start_to_exit", command["times"][0])
        self.add("command_cpu", command["cpu"][0])
        compiles = self.host.run([python, "-c", COMPILES, payload], timeout=120).stderr.strip().splitlines()
        self.add("compiles", json.loads(compiles[-1]))
        self.add("python_alone", json.loads(self.host.run([python, timer, json.dumps([python, "-c", "pass"]), "1"]).stdout)["times"][0])
        importtime = self.host.run([python, "-X", "importtime", payload], timeout=120).stderr
        imports = parse_importtime(importtime)
        self.add("imports", {name[len(PREFIX):]: cum / 1000.0 for name, (_self, cum) in imports.items() if name.startswith(PREFIX)})
        self.add("import_basic", imports.get("ansible.module_utils.basic", (0, 0))[1] / 1000.0)
        self.add("import_ours", ours_total_us(importtime) / 1000.0)
        trace = os.path.join(self.host.dir, "strace.txt")
        self.host.run(["strace", "-f", "-ttt", "-qq", "-e", "trace=execve,exit_group", "-o", trace, python, payload], timeout=120)
        with open(trace) as handle:
            self.add("subprocesses", subprocess_rows(parse_strace(handle.read())))
        self.add("scan", json.loads(self.host.run([os.path.join(VENV_BIN, "python"), "-c", SCAN, self.collections, "1"]).stdout)["times"][0])

    def result(self) -> dict[str, Any]:
        def med(values: list[float]) -> float:
            return round(statistics.median(values), 1)
        sam = self.samples
        controller = {name: {label: med([1000.0 * s.get(label, 0.0) for s in sam[name]]) for label in sam[name][0]} for name in ("gate", "one")}
        for name in ("gate", "one"):
            controller[name]["ratio_samples"] = [s["playbook"] for s in sam[name]]
            controller[name]["cpu_samples"] = [s["cpu"] for s in sam[name]]
        ours = sorted({name for sample in sam["imports"] for name in sample})
        rows: dict[str, dict[str, list[float]]] = {}
        for run in sam["subprocesses"]:
            for row in run:
                entry = rows.setdefault(row["what"], {"calls": [], "ms": []})
                entry["calls"].append(row["calls"])
                entry["ms"].append(row["ms"])
        last = sam["result"][-1]
        return {
            "checkout": self.checkout,
            "reps": len(sam["result"]),
            "node": {
                "payload_bytes": self.payload_bytes,
                "interpreter_start_to_exit_ms": med([1000.0 * x for x in sam["start_to_exit"]]),
                "cpu_ms": med([1000.0 * x for x in sam["node_cpu"]]),
                "command_start_to_exit_ms": med([1000.0 * x for x in sam["command_start_to_exit"]]),
                "command_cpu_ms": med([1000.0 * x for x in sam["command_cpu"]]),
                "compiles_ours": statistics.median([c["ours"] for c in sam["compiles"]]),
                "compile_ours_ms": med([c["ours_ms"] for c in sam["compiles"]]),
                "compiles_all": statistics.median([c["all"] for c in sam["compiles"]]),
                "compile_all_ms": med([c["all_ms"] for c in sam["compiles"]]),
                "python_alone_ms": med([1000.0 * x for x in sam["python_alone"]]),
                "elapsed_s": statistics.median([r.get("elapsed_s") or 0.0 for r in sam["result"]]),
                "look_s": statistics.median([(r.get("timings") or {}).get("look_s") or 0.0 for r in sam["result"]]),
                "kernel_log": (last.get("health") or {}).get("kernel_log"),
                "import_basic_ms": med(sam["import_basic"]),
                "import_module_ms": med(sam["import_ours"]),
                "import_ours_ms": {name: med([s[name] for s in sam["imports"] if name in s]) for name in ours},
                "subprocesses": {what: {"calls": statistics.median(v["calls"]), "ms": round(statistics.median(v["ms"]), 1)}
                                 for what, v in rows.items()},
                "proc_scan_ms": med([1000.0 * x for x in sam["scan"]]),
            },
            "controller": controller,
        }


def markdown(profiles: list[dict[str, Any]]) -> str:
    """One table, a column per profile (before, after)."""
    names = [os.path.basename(p["checkout"].rstrip("/")) for p in profiles]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(profiles)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def ms(value: Any) -> str:
        return "-" if value is None else f"{float(value):.1f} ms"
    row("load average (1 min) at the start / the end (`uptime`)", [f"{p['load_before'][0]:.2f} / {p['load'][0]:.2f}" for p in profiles])
    row("samples (the checkouts took turns)", [str(p["reps"]) for p in profiles])
    row("**controller**: free_gpus.yml, ansible-playbook start to exit", [ms(p["controller"]["gate"].get("playbook")) for p in profiles])
    row("one-task nvidia-smi play, start to exit", [ms(p["controller"]["one"].get("playbook")) for p in profiles])
    row("gate / one-task (median of the ratios)", ["{:.2f}x".format(statistics.median(
        g / o for g, o in zip(p["controller"]["gate"]["ratio_samples"], p["controller"]["one"]["ratio_samples"]))) for p in profiles])
    row("CPU of the whole play (user + sys, module included): gate / one-task",
        ["{:.0f} / {:.0f} ms, {:.2f}x".format(p["controller"]["gate"]["cpu"], p["controller"]["one"]["cpu"], statistics.median(
            g / o for g, o in zip(p["controller"]["gate"]["cpu_samples"], p["controller"]["one"]["cpu_samples"]))) for p in profiles])
    row("the host's tasks in the worker (gate: 1)", [ms(p["controller"]["gate"].get("task")) for p in profiles])
    row("action plugin and verdict (task minus gpu_release)",
        [ms(p["controller"]["gate"]["task"] - p["controller"]["gate"]["execute_module"]) for p in profiles])
    row("building the AnsiballZ payload", [ms(p["controller"]["gate"].get("build_payload")) for p in profiles])
    row("sending and running it (pipelined, `-c local`)", [ms(p["controller"]["gate"].get("run_on_node")) for p in profiles])
    row("**node**: AnsiballZ payload size", ["{:,} bytes".format(p["node"]["payload_bytes"]) for p in profiles])
    row("gpu_release, interpreter start to exit", [ms(p["node"]["interpreter_start_to_exit_ms"]) for p in profiles])
    row("  its CPU (user + sys, subprocesses included)", [ms(p["node"]["cpu_ms"]) for p in profiles])
    row("the one-task play's `ansible.builtin.command` payload, interpreter start to exit", [ms(p["node"].get("command_start_to_exit_ms")) for p in profiles])
    row("  its CPU (user + sys, nvidia-smi included)", [ms(p["node"].get("command_cpu_ms")) for p in profiles])
    row("gpu_release: source compiled on the node (`compile` calls, time): zeromib.gpu's", [
        "{:g}, {}".format(p["node"]["compiles_ours"], ms(p["node"]["compile_ours_ms"])) if "compiles_ours" in p["node"] else "-" for p in profiles])
    row("  all (ansible-core's module_utils, the wrapper, ours)", [
        "{:g}, {}".format(p["node"]["compiles_all"], ms(p["node"]["compile_all_ms"])) if "compiles_all" in p["node"] else "-" for p in profiles])
    row("python3 alone (`-c pass`)", [ms(p["node"]["python_alone_ms"]) for p in profiles])
    row("import ansible.module_utils.basic (cumulative)", [ms(p["node"]["import_basic_ms"]) for p in profiles])
    row("import of zeromib.gpu's module_utils, all (cumulative)", [ms(p["node"]["import_module_ms"]) for p in profiles])
    ours = sorted({name for p in profiles for name in p["node"]["import_ours_ms"]})
    for name in ours:
        row(f"  import {name} (cumulative)", [ms(p["node"]["import_ours_ms"].get(name)) if name in p["node"]["import_ours_ms"] else "not imported"
                                              for p in profiles])
    row("gpu_release's own `elapsed_s`", [ms(1000.0 * p["node"]["elapsed_s"]) for p in profiles])
    row("  the look (`timings.look_s`)", [ms(1000.0 * p["node"]["look_s"]) for p in profiles])
    row("  the /proc scan (device files)", [ms(p["node"]["proc_scan_ms"]) for p in profiles])
    subs = sorted({what for p in profiles for what in p["node"]["subprocesses"]})
    for what in subs:
        row(f"subprocess `{what}`: calls, start to exit (summed)",
            ["{:g}, {}".format(p["node"]["subprocesses"][what]["calls"], ms(p["node"]["subprocesses"][what]["ms"]))
             if what in p["node"]["subprocesses"] else "none" for p in profiles])

    def kernel_log(p: dict[str, Any]) -> str:
        log = p["node"]["kernel_log"] or {}
        return "{}, {}".format(log.get("source"), "new lines only" if log.get("incremental") else "whole window")
    row("kernel log read (`health.kernel_log`)", [kernel_log(p) for p in profiles])
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", help="a checkout to profile (repeatable; default this one); they take turns")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="write the profiles here too")
    parser.add_argument("--markdown", action="store_true", help="print the table as benchmarks/HISTORY.md quotes it")
    args = parser.parse_args()
    profiles = [Profile(os.path.abspath(checkout)) for checkout in args.checkout or [REPO]]
    load_before = os.getloadavg()
    try:
        for profile in profiles:
            profile.start()
        for _rep in range(args.reps):
            for profile in profiles:
                profile.sample()
    finally:
        for profile in profiles:
            profile.stop()
    load = os.getloadavg()
    results = [dict(p.result(), load=load, load_before=load_before, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())) for p in profiles]
    print(json.dumps(results), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    if args.markdown:
        print(markdown(results))


if __name__ == "__main__":
    main()
