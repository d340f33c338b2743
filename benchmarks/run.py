# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmarks: how fast a fleet goes from busy to proven-free, against the alternatives.

    make bench                                   # = .venv/bin/python benchmarks/run.py
                                                 #   (then benchmarks/pathological_node.py, issue 66)
    .venv/bin/python benchmarks/run.py --hosts 8,16,32 --reps 3 --out benchmarks/results/run-DATE.md

Runs on the systemd-nspawn fleet of tests/fleet (real sshd, systemd, processes; simulated GPUs)
and on a namespace host of tests/sim. Contenders are alternated within each repetition so that
machine noise hits all of them. Writes a Markdown report with the exact command, machine and date,
by default benchmarks/results/run-<UTC date and time>.md; what it shows goes into
benchmarks/HISTORY.md as a dated section.
Needs root (the rigs do). Acts only inside the hosts it creates.
"""
import argparse
import concurrent.futures
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "fleet"))
sys.path.insert(0, os.path.join(REPO, "tests", "sim"))
import fleet as rig  # noqa: E402
from nshost import NsHost  # noqa: E402

VENV = os.path.join(REPO, ".venv", "bin")
CALLBACKS = os.path.join(REPO, "tests", "fleet", "callback_plugins")
# The role as it was before issue 14 (an argument-validation task, the module, a set_fact and an
# assert per host), run side by side from a `git archive` of this commit.
BEFORE_REV = "caeff72"
OURS = "free_gpus.yml"
BEFORE = f"free_gpus.yml before ({BEFORE_REV}, 4 tasks a host)"
ONE = "one-task nvidia-smi play"
MITO = "free_gpus.yml, mitogen_linear"
ONE_MITO = "one-task play, mitogen_linear"
RAW = "raw parallel ssh"
# Targets of issue 14 (ratios in one run).
TARGET_GATE = 1.2
TARGET_GROWTH = 2.0
TARGET_DIRTY = 1.5
TARGET_FACTS_MS = 50.0
ONE_TASK = """---
- name: One nvidia-smi task
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Read memory
      ansible.builtin.command: nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
      changed_when: false
"""
QUERY = "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader"
# The hand procedure of the field, as engineers type it (pattern bracketed so that pkill does
# not match the shell that runs it).
HAND = "pkill -9 -f '[g]pu_holder'; fuser -k /dev/nvidia* >/dev/null 2>&1; sleep 2; " + QUERY


def median(values):
    return round(statistics.median(values), 3) if values else None


def mitogen_strategy_dir():
    """<site-packages>/ansible_mitogen/plugins/strategy of the venv, or None without mitogen."""
    found = glob.glob(os.path.join(REPO, ".venv", "lib", "python*", "site-packages", "ansible_mitogen", "plugins", "strategy"))
    return found[0] if found else None


def before_collection(rev):
    """A `git archive` of `rev` as a collection tree -> (collections path, its free_gpus.yml)."""
    root = tempfile.mkdtemp(prefix="zeromib-before-")
    tree = os.path.join(root, "ansible_collections", "zeromib", "gpu")
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    return root, os.path.join(tree, "playbooks", "free_gpus.yml")


class Bench:
    def __init__(self, args):
        self.args = args
        self.rows = {}
        self.notes = []
        self.mitogen = mitogen_strategy_dir()
        self.before = before_collection(args.before) if args.before else None

    # ------------------------------------------------------------ fleet contenders

    def env(self, fleet, variant=None, json_out=None):
        env = dict(rig.ansible_env(fleet.ansible_cfg), ANSIBLE_NOCOLOR="1")
        if variant == "mitogen":
            env.update(ANSIBLE_STRATEGY_PLUGINS=self.mitogen, ANSIBLE_STRATEGY="mitogen_linear")
        elif variant == "before":
            env["ANSIBLE_COLLECTIONS_PATH"] = self.before[0]
        if json_out:
            env.update(ANSIBLE_CALLBACK_PLUGINS=CALLBACKS, ANSIBLE_CALLBACKS_ENABLED="fleet_json",
                       ANSIBLE_LOAD_CALLBACK_PLUGINS="1", ZEROMIB_FLEET_JSON_OUT=json_out)
        return env

    def playbook(self, fleet, playbook, extra=None, variant=None, json_out=None):
        if variant == "before" and playbook.endswith("free_gpus.yml"):
            playbook = self.before[1]
        cmd = [os.path.join(VENV, "ansible-playbook"), "-i", str(fleet.inventory), playbook, "-l", "gpu_nodes"]
        if extra:
            cmd += ["-e", json.dumps(extra)]
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=self.env(fleet, variant, json_out), cwd=REPO)
        return round(time.monotonic() - started, 3), proc

    def parallel_ssh(self, fleet, command):
        started = time.monotonic()
        procs = [subprocess.Popen(fleet.ssh_argv(h["name"], command), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for h in fleet.hosts]
        outputs = [p.communicate()[0] for p in procs]
        return round(time.monotonic() - started, 3), outputs

    def fleet_memory(self, fleet):
        """{host: [MiB per GPU]} read over SSH."""
        _took, outputs = self.parallel_ssh(fleet, "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits")
        return {h["name"]: [int(x) for x in out.split()] for h, out in zip(fleet.hosts, outputs)}

    def gate_contenders(self, play_file):
        """name -> (playbook, variant), alternated within each repetition."""
        ours = os.path.join(REPO, "playbooks", "free_gpus.yml")
        contenders = {OURS: (ours, None), ONE: (play_file, None)}
        if self.before:
            contenders[BEFORE] = (ours, "before")
        if self.mitogen:
            contenders[MITO] = (ours, "mitogen")
            contenders[ONE_MITO] = (play_file, "mitogen")
        return contenders

    def clean_gate(self, fleet, n, play_file):
        contenders = self.gate_contenders(play_file)
        results = {name: [] for name in list(contenders) + [RAW]}
        for _rep in range(self.args.reps):
            for name, (playbook, variant) in contenders.items():
                took, proc = self.playbook(fleet, playbook, variant=variant)
                assert proc.returncode == 0, (name, proc.stdout[-3000:], proc.stderr[-2000:])
                results[name].append(took)
            took, out = self.parallel_ssh(fleet, QUERY)
            assert all(line.strip() for line in out), "raw ssh got no answer from some host"
            results[RAW].append(took)
        self.rows.setdefault("clean", {})[n] = {k: median(v) for k, v in results.items()}
        self.rows.setdefault("clean_runs", {})[n] = results

    def make_dirty(self, fleet):
        """Every host busy: a cooperative trainer, a SIGTERM-ignoring holder, an orphaned child,
        and on every other host a Restart=always vllm.service."""
        def one(index_host):
            index, host = index_host
            fleet.workload(host["name"], "train", gpus="0", mib=40960)
            fleet.workload(host["name"], "ignore-term", gpus="1", mib=20480)
            fleet.workload(host["name"], "orphan", gpus="2", mib=10240)
            if index % 2 == 0:
                fleet.workload(host["name"], "vllm")
            fleet.workload(host["name"], "persistenced")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(one, enumerate(fleet.hosts)))

    def daemon_pids(self, fleet):
        _took, outputs = self.parallel_ssh(fleet, "systemctl show -p MainPID --value nvidia-persistenced.service")
        return {h["name"]: out.strip() for h, out in zip(fleet.hosts, outputs)}

    def verdict(self, fleet, daemons_before, settle_s=3.0):
        """Clean after `settle_s` (a Restart=always unit respawns within ~1 s), and was the
        protected daemon killed (its unit restarts it here, so compare its PID)?"""
        time.sleep(settle_s)
        memory = self.fleet_memory(fleet)
        dirty = sorted(h for h, mibs in memory.items() if any(m > 0 for m in mibs))
        after = self.daemon_pids(fleet)
        lost_daemon = sorted(h for h, pid in daemons_before.items() if after.get(h) != pid)
        return dirty, lost_daemon

    def dirty_fleet(self, fleet, n):
        ours = {"free_gpus.yml, kill_timeout 2": (2, None),
                "free_gpus.yml, kill_timeout 0 (SIGKILL at once, as by hand)": (0, None)}
        if self.mitogen:
            ours["free_gpus.yml, kill_timeout 0, mitogen_linear"] = (0, "mitogen")
        if self.before:
            ours[f"free_gpus.yml before ({BEFORE_REV}), kill_timeout 0"] = (0, "before")
        results = {name: [] for name in ours}
        results["hand procedure over parallel ssh"] = []
        outcome = {}
        playbook = os.path.join(REPO, "playbooks", "free_gpus.yml")
        for _rep in range(self.args.reps):
            for name, (kill_timeout, variant) in ours.items():
                self.make_dirty(fleet)
                daemons = self.daemon_pids(fleet)
                took, proc = self.playbook(fleet, playbook, {"free_gpus_kill_timeout": kill_timeout,
                                                             "free_gpus_services": ["vllm*.service"]}, variant=variant)
                results[name].append(took)
                dirty, lost = self.verdict(fleet, daemons)
                worst = outcome.get(name, {"rc": 0, "dirty_hosts": 0, "lost_persistenced": 0})
                outcome[name] = {"rc": proc.returncode or worst["rc"], "dirty_hosts": max(len(dirty), worst["dirty_hosts"]),
                                 "lost_persistenced": max(len(lost), worst["lost_persistenced"])}
                fleet_reset(fleet)
            self.make_dirty(fleet)
            daemons = self.daemon_pids(fleet)
            took, _out = self.parallel_ssh(fleet, HAND)
            results["hand procedure over parallel ssh"].append(took)
            dirty, lost = self.verdict(fleet, daemons)
            outcome["hand procedure over parallel ssh"] = {"rc": None, "dirty_hosts": len(dirty), "lost_persistenced": len(lost)}
            fleet_reset(fleet)
        self.rows.setdefault("dirty", {})[n] = {k: (median(v), outcome[k]) for k, v in results.items()}
        self.rows.setdefault("profile", {})[n] = self.dirty_profile(fleet, playbook)

    def dirty_profile(self, fleet, playbook):
        """One more kill_timeout 0 run, with every task result recorded: where the wall time goes
        (module time on the node, by step, against ansible-playbook's start to exit)."""
        self.make_dirty(fleet)
        with tempfile.TemporaryDirectory(prefix="zeromib-profile-") as tmp:
            out = os.path.join(tmp, "result.json")
            took, proc = self.playbook(fleet, playbook, {"free_gpus_kill_timeout": 0, "free_gpus_services": ["vllm*.service"]},
                                       json_out=out)
            data = json.loads(Path(out).read_text()) if os.path.exists(out) else {"tasks": []}
        fleet_reset(fleet)
        gates = [t["result"] for t in data["tasks"] if t["action"].endswith("free_gpus_gate")]
        steps = ("look_s", "plan_s", "stop_s", "kill_s", "wait_s")
        row = {"wall": took, "rc": proc.returncode, "hosts": len(gates),
               "elapsed_max": max((g.get("elapsed_s") or 0 for g in gates), default=None),
               "elapsed_median": median([g.get("elapsed_s") or 0 for g in gates])}
        for step in steps:
            row[step] = median([(g.get("timings") or {}).get(step) or 0 for g in gates])
        return row

    def fleet_part(self):
        sizes = [int(x) for x in self.args.hosts.split(",") if x]
        with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as handle:
            handle.write(ONE_TASK)
            play_file = handle.name
        # A prefix of this checkout: two checkouts benchmarking on one machine never share a fleet.
        fleet = rig.Fleet(rig.checkout_prefix("b"))
        try:
            for n in sizes:
                fleet.down()
                started = time.monotonic()
                fleet.up(n, profile="h200")
                self.rows.setdefault("bringup", {})[n] = round(time.monotonic() - started, 2)
                self.clean_gate(fleet, n, play_file)
                if n in [int(x) for x in self.args.dirty_hosts.split(",") if x]:
                    self.dirty_fleet(fleet, n)
        finally:
            fleet.down()
            os.unlink(play_file)
            if self.before:
                shutil.rmtree(self.before[0], ignore_errors=True)

    # ------------------------------------------------------------ gpu_facts inside the module

    def facts_part(self):
        collections = os.path.join(REPO, ".build", "collections")
        harness = f"COLLECTIONS, REPS = {collections!r}, {self.args.facts_reps}\n" + r"""
import json, os, sys, time
sys.path.insert(0, COLLECTIONS)
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts, _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi
times, scans, calls = [], [], []
for _ in range(REPS):
    smi = NvidiaSmi(NvidiaSmi.find(None), 10)
    t0 = time.perf_counter()
    snap = _facts.look(smi, [], with_processes=True, max_used_mib=0)
    _facts.assemble(_facts.Findings(gpus=snap.gpus, apps=snap.apps, holders=snap.holders, max_used_mib=0, with_processes=True,
                                    cuda_version=_facts.cuda_driver_version()))
    times.append(time.perf_counter() - t0)
    calls.append(smi.calls)
    t0 = time.perf_counter()
    _holders.scan_holders()
    scans.append(time.perf_counter() - t0)
print(json.dumps({"times": times, "scans": scans, "calls": calls, "pids": len(_holders.list_pids())}))
"""
        crowd = r"""
import os, signal, sys, time
n = int(sys.argv[1])
for _ in range(n):
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
open(sys.argv[2], "w").write("ready")
signal.pause()
"""
        results = {}
        for preset in ("h200x1", "h200x8"):
            for crowd_size in (0, 100, 1000, 5000):
                with NsHost(preset) as host:
                    if crowd_size:
                        ready = os.path.join(host.dir, "crowd-ready")
                        host.spawn(["/usr/bin/python3", "-c", crowd, str(crowd_size), ready], ready=False)
                        deadline = time.monotonic() + 120
                        while not os.path.exists(ready):
                            assert time.monotonic() < deadline, "crowd did not start"
                            time.sleep(0.05)
                    row = {}
                    for phase in ("idle", "busy"):
                        if phase == "busy":
                            for gpu in range(int(preset[-1])):
                                host.spawn(["gpu_holder", "--gpus", str(gpu), "--mib", "1024"])
                        proc = host.run([os.path.join(VENV, "python"), "-c", harness], timeout=600)
                        data = json.loads(proc.stdout.strip().splitlines()[-1])
                        row.update({"pids": data["pids"], phase + "_ms": round(1000 * statistics.median(data["times"]), 1),
                                    "scan_ms": round(1000 * statistics.median(data["scans"]), 1), "calls": max(data["calls"])})
                    results[(preset, crowd_size)] = row
                    print("facts", preset, crowd_size, row, flush=True)
        self.rows["facts"] = results

    # ------------------------------------------------------------ report

    def report(self):
        load = os.getloadavg()
        out = ["# Benchmarks", "",
               "Generated by `{}` on {} ({}, {} cores, Python {}; load average at the start {:.2f} / {:.2f} / {:.2f}, at the end "
               "{:.2f} / {:.2f} / {:.2f}). Every number is a median of {} runs; contenders alternate within each run. Hosts are "
               "systemd-nspawn Debian 12 containers on this one machine (real sshd, systemd and processes; simulated GPUs), "
               "so Ansible, SSH and the hosts share its cores.".format(
                   " ".join(["benchmarks/run.py"] + sys.argv[1:]), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   platform.node() or "this machine", os.cpu_count(), platform.python_version(),
                   self.load_at_start[0], self.load_at_start[1], self.load_at_start[2], load[0], load[1], load[2],
                   self.args.reps), ""]
        if self.before:
            what = ("(before issue 14), run from a `git archive` of it: the role was an argument-validation task, gpu_release, "
                    "a set_fact and an assert per host" if BEFORE_REV == "caeff72" else "run from a `git archive` of it")
            mitogen = f"mitogen {mitogen_version()}, `ANSIBLE_STRATEGY=mitogen_linear`" if self.mitogen else "not installed, not measured"
            out += [f"`{BEFORE}` is the collection at commit {BEFORE_REV} {what}. mitogen: {mitogen}.", ""]
        out += self.targets()
        if "clean" in self.rows:
            names = [OURS, BEFORE, ONE, MITO, ONE_MITO, RAW]
            names = [name for name in names if name in next(iter(self.rows["clean"].values()))]
            out += ["## Clean-fleet gate (wall seconds, `ansible-playbook` start to exit)", "",
                    "| hosts | bring-up | " + " | ".join(names) + " | free_gpus / one-task |" + (
                        " mitogen: free_gpus / one-task |" if MITO in names else ""),
                    "|---|---|" + "---|" * (len(names) + 1 + (MITO in names))]
            for n, row in sorted(self.rows["clean"].items()):
                cells = [f"{row[name]:.2f} s" for name in names]
                line = "| {} | {:.1f} s | {} | {:.2f}x |".format(n, self.rows["bringup"][n], " | ".join(cells), row[OURS] / row[ONE])
                if MITO in names:
                    line += " %.2fx |" % (row[MITO] / row[ONE_MITO])
                out.append(line)
            sizes = sorted(self.rows["clean"])
            if 16 in sizes and 32 in sizes:
                growth = ["{} x{:.2f}".format(name, self.rows["clean"][32][name] / self.rows["clean"][16][name]) for name in names if name != RAW]
                out += ["", "Growth 16 -> 32 hosts: " + ", ".join(growth) + "."]
            out.append("")
        if "dirty" in self.rows:
            out += ["## Dirty fleet: busy to verified clean", "",
                    "Each host: a 40 GiB trainer (cooperative), a 20 GiB holder ignoring SIGTERM (`kill_timeout: 2`), an orphaned "
                    "child forked after CUDA init (10 GiB), on every other host a `Restart=always` vllm.service (TP=2), and "
                    "nvidia-persistenced. Clean is checked 3 s after the contender returns (a respawned unit counts as dirty); the "
                    "dirty and killed counts are the worst of the runs.", "",
                    "| hosts | contender | wall | / hand | hosts dirty after | hosts where nvidia-persistenced was killed | rc |",
                    "|---|---|---|---|---|---|---|"]
            for n, row in sorted(self.rows["dirty"].items()):
                hand = row["hand procedure over parallel ssh"][0]
                for name, (took, outcome) in row.items():
                    out.append("| {} | {} | {:.2f} s | {:.2f}x | {} | {} | {} |".format(
                        n, name, took, took / hand, outcome["dirty_hosts"], outcome["lost_persistenced"], outcome["rc"]))
            out += ["", f"Hand procedure: `{HAND}`", ""]
        if "profile" in self.rows:
            out += ["### Where the dirty fleet's seconds go (one more kill_timeout 0 run, every result recorded)", "",
                    "Module time is gpu_release's `elapsed_s` on each node (median and slowest host), by step (`timings`, "
                    "medians over hosts); the rest of the wall time is Ansible (start-up, connections, module transfer, "
                    "results) and the summary.", "",
                    "| hosts | wall | module median | module slowest | look | plan | systemd stop | signals | verify loop | Ansible and the rest |",
                    "|---|---|---|---|---|---|---|---|---|---|"]
            for n, row in sorted(self.rows["profile"].items()):
                out.append("| {} | {:.2f} s | {:.2f} s | {:.2f} s | {:.3f} s | {:.3f} s | {:.3f} s | {:.3f} s | {:.3f} s | {:.2f} s |".format(
                    n, row["wall"], row["elapsed_median"] or 0, row["elapsed_max"] or 0, row["look_s"], row["plan_s"],
                    row["stop_s"], row["kill_s"], row["wait_s"], row["wall"] - (row["elapsed_max"] or 0)))
            out.append("")
        if "facts" in self.rows:
            out += ["## gpu_facts inside the module, one host", "",
                    "Time of one look as gpu_facts makes it (two nvidia-smi calls side by side, the /proc scan, assembly), median "
                    f"of {self.args.facts_reps}: with idle GPUs (the gate before every job: device files only) and with a 1 GiB holder on each GPU "
                    "(listed by nvidia-smi, so the maps of processes without a device file open are not read). Last column: a "
                    "full fd+maps scan alone. The crowd is idle processes (forked Python, ~100 mappings each).", "",
                    "| GPUs | processes on the host | idle GPUs | busy GPUs | full fd+maps scan | nvidia-smi calls |",
                    "|---|---|---|---|---|---|"]
            for (preset, _crowd), row in sorted(self.rows["facts"].items(), key=lambda kv: (kv[0][0], kv[0][1])):
                out.append("| {} | {} | {:.1f} ms | {:.1f} ms | {:.1f} ms | {} |".format(
                    preset[-1], row["pids"], row["idle_ms"], row["busy_ms"], row["scan_ms"], row["calls"]))
            out.append("")
        out += self.notes
        changes = os.path.join(REPO, "benchmarks", "changes.md")
        if os.path.exists(changes):
            out += ["", Path(changes).read_text().strip()]
        return "\n".join(out) + "\n"

    def facts_slope(self, preset, phase):
        """ms per 1,000 processes over the smallest crowd, at the largest crowd measured."""
        rows = sorted(((c, r) for (p, c), r in self.rows["facts"].items() if p == preset), key=lambda cr: cr[0])
        (_c0, low), (_c1, high) = rows[0], rows[-1]
        return 1000.0 * (high[phase + "_ms"] - low[phase + "_ms"]) / max(1, high["pids"] - low["pids"])

    def targets(self):
        """Issue 14's targets, each with what this run measured and met / not met."""
        lines = ["## Against the targets (issue 14, this run)", ""]

        def verdict(ok):
            return "**met**" if ok else "**not met**"
        clean = self.rows.get("clean", {})
        for n in sorted(clean):
            ratio = clean[n][OURS] / clean[n][ONE]
            lines.append("- Clean gate <= {:.1f}x the one-task nvidia-smi play, {} hosts: {} - {:.2f}x ({:.2f} s against {:.2f} s{}).".format(
                TARGET_GATE, n, verdict(ratio <= TARGET_GATE), ratio, clean[n][OURS], clean[n][ONE],
                "; before: %.2fx" % (clean[n][BEFORE] / clean[n][ONE]) if BEFORE in clean[n] else ""))
        if 16 in clean and 32 in clean:
            growth = clean[32][OURS] / clean[16][OURS]
            lines.append(f"- 32 hosts <= {TARGET_GROWTH:.0f}x 16 hosts: {verdict(growth <= TARGET_GROWTH)} - x{growth:.2f}.")
        for n, row in sorted(self.rows.get("dirty", {}).items()):
            hand = row["hand procedure over parallel ssh"]
            took, outcome = row["free_gpus.yml, kill_timeout 0 (SIGKILL at once, as by hand)"]
            ok = took / hand[0] <= TARGET_DIRTY and outcome["dirty_hosts"] == 0 and outcome["lost_persistenced"] == 0 and outcome["rc"] == 0
            lines.append("- Dirty fleet to verified clean (kill_timeout 0) <= {:.1f}x the hand procedure, {} hosts, 0 dirty 3 s later, no "
                         "daemon killed: {} - {:.2f}x ({:.2f} s against {:.2f} s), {} dirty, {} daemons killed (hand: {} dirty, {} killed).".format(
                             TARGET_DIRTY, n, verdict(ok), took / hand[0], took, hand[0], outcome["dirty_hosts"],
                             outcome["lost_persistenced"], hand[1]["dirty_hosts"], hand[1]["lost_persistenced"]))
        if "facts" in self.rows:
            for preset in sorted({p for p, _c in self.rows["facts"]}):
                slope = self.facts_slope(preset, "busy")
                lines.append("- gpu_facts with busy GPUs <= {:.0f} ms per 1,000 processes, {} GPUs: {} - {:.1f} ms per 1,000 (idle: {:.1f}).".format(
                    TARGET_FACTS_MS, preset[-1], verdict(slope <= TARGET_FACTS_MS), slope, self.facts_slope(preset, "idle")))
        lines.append("- Real H200, a cooperative 40 GiB holder within floor + 0.1 s on 1 and 2 GPUs: not measured by this script "
                     "(no GPU here; see tests/gpu/results/README.md).")
        return lines + [""]


def mitogen_version():
    proc = subprocess.run([os.path.join(VENV, "python"), "-c", "import mitogen; print('.'.join(map(str, mitogen.__version__)))"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "?"


def fleet_reset(fleet):
    """Every host back to idle GPUs, through the rig."""
    for host in fleet.hosts:
        fleet.ssh(host["name"], "systemctl stop vllm.service sglang.service nvidia-persistenced.service 2>/dev/null; "
                                "systemctl disable sglang.service 2>/dev/null; pkill -9 -f '[g]pu_holder'; true")


def name_before(rev):
    """Another commit side by side (a change measured against the commit before it)."""
    global BEFORE, BEFORE_REV  # the contenders' names, read everywhere
    BEFORE_REV = rev
    BEFORE = f"free_gpus.yml before ({rev})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="8,16,32", help="fleet sizes for the clean gate")
    parser.add_argument("--dirty-hosts", default="8,16", help="fleet sizes for the dirty-fleet race")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--facts-reps", type=int, default=7)
    parser.add_argument("--skip-fleet", action="store_true")
    parser.add_argument("--skip-facts", action="store_true")
    parser.add_argument("--skip-pathological", action="store_true", help="leave out benchmarks/pathological_node.py (issue 66)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", time.strftime("run-%Y-%m-%d-%H%M.md", time.gmtime())))
    parser.add_argument("--before", default=BEFORE_REV, help="commit to run side by side as 'before' ('' for none)")
    args = parser.parse_args()
    if args.before and args.before != BEFORE_REV:
        name_before(args.before)
    bench = Bench(args)
    bench.load_at_start = os.getloadavg()
    if not args.skip_facts:
        bench.facts_part()
    if not args.skip_fleet:
        bench.fleet_part()
    text = bench.report()
    if not args.skip_pathological:
        # A node whose tenants do their worst against a plain one: its own report, appended here.
        patho = args.out[:-3] + "-pathological.md" if args.out.endswith(".md") else args.out + "-pathological"
        subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "pathological_node.py"), "--out", patho], check=False)
        if os.path.exists(patho):
            with open(patho) as handle:
                text += "\n\n" + handle.read()
    with open(args.out, "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
