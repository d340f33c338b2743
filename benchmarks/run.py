# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmarks: how fast a fleet goes from busy to proven-free, against the alternatives.

    make bench                                   # = .venv/bin/python benchmarks/run.py
    .venv/bin/python benchmarks/run.py --hosts 8,16,32 --reps 3 --out docs/benchmarks.md

Runs on the systemd-nspawn fleet of tests/fleet (real sshd, systemd, processes; simulated GPUs)
and on a namespace host of tests/sim. Contenders are alternated within each repetition so that
machine noise hits all of them. Writes a Markdown report with the exact command, machine and date.
Needs root (the rigs do). Acts only inside the hosts it creates.
"""
import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "fleet"))
sys.path.insert(0, os.path.join(REPO, "tests", "sim"))
import fleet as rig  # noqa: E402
from nshost import NsHost  # noqa: E402

VENV = os.path.join(REPO, ".venv", "bin")
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


class Bench(object):
    def __init__(self, args):
        self.args = args
        self.rows = {}
        self.notes = []

    # ------------------------------------------------------------ fleet contenders

    def env(self, fleet):
        return dict(rig.ansible_env(fleet.ansible_cfg), ANSIBLE_NOCOLOR="1")

    def playbook(self, fleet, playbook, extra=None):
        cmd = [os.path.join(VENV, "ansible-playbook"), "-i", str(fleet.inventory), playbook, "-l", "gpu_nodes"]
        if extra:
            cmd += ["-e", json.dumps(extra)]
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=self.env(fleet), cwd=REPO)
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

    def clean_gate(self, fleet, n, play_file):
        results = {"free_gpus.yml": [], "one-task nvidia-smi play": [], "raw parallel ssh": []}
        for _rep in range(self.args.reps):
            took, proc = self.playbook(fleet, os.path.join(REPO, "playbooks", "free_gpus.yml"))
            assert proc.returncode == 0, proc.stdout[-3000:]
            results["free_gpus.yml"].append(took)
            took, proc = self.playbook(fleet, play_file)
            assert proc.returncode == 0, proc.stdout[-3000:]
            results["one-task nvidia-smi play"].append(took)
            took, out = self.parallel_ssh(fleet, QUERY)
            assert all(line.strip() for line in out), "raw ssh got no answer from some host"
            results["raw parallel ssh"].append(took)
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
        ours = {"free_gpus.yml, kill_timeout 2": 2, "free_gpus.yml, kill_timeout 0 (SIGKILL at once, as by hand)": 0}
        results = {name: [] for name in ours}
        results["hand procedure over parallel ssh"] = []
        outcome = {}
        for _rep in range(self.args.reps):
            for name, kill_timeout in ours.items():
                self.make_dirty(fleet)
                daemons = self.daemon_pids(fleet)
                took, proc = self.playbook(fleet, os.path.join(REPO, "playbooks", "free_gpus.yml"),
                                           {"free_gpus_kill_timeout": kill_timeout, "free_gpus_services": ["vllm*.service"]})
                results[name].append(took)
                dirty, lost = self.verdict(fleet, daemons)
                outcome[name] = {"rc": proc.returncode, "dirty_hosts": len(dirty), "lost_persistenced": len(lost)}
                fleet_reset(fleet)
            self.make_dirty(fleet)
            daemons = self.daemon_pids(fleet)
            took, _out = self.parallel_ssh(fleet, HAND)
            results["hand procedure over parallel ssh"].append(took)
            dirty, lost = self.verdict(fleet, daemons)
            outcome["hand procedure over parallel ssh"] = {"rc": None, "dirty_hosts": len(dirty), "lost_persistenced": len(lost)}
            fleet_reset(fleet)
        self.rows.setdefault("dirty", {})[n] = {k: (median(v), outcome[k]) for k, v in results.items()}

    def fleet_part(self):
        sizes = [int(x) for x in self.args.hosts.split(",") if x]
        with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as handle:
            handle.write(ONE_TASK)
            play_file = handle.name
        fleet = rig.Fleet("zmb")
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

    # ------------------------------------------------------------ gpu_facts inside the module

    def facts_part(self):
        harness = r"""
import json, os, sys, time
sys.path.insert(0, %r)
from ansible_collections.zeromib.gpu.plugins.module_utils import _facts, _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._nvidia_smi import NvidiaSmi
times, scans, calls = [], [], []
for _ in range(%d):
    smi = NvidiaSmi(NvidiaSmi.find(None), 10)
    t0 = time.perf_counter()
    snap = _facts.look(smi, [], True, max_used_mib=0)
    _facts.assemble(snap.gpus, snap.apps, snap.holders, 0, True, _facts.cuda_driver_version())
    times.append(time.perf_counter() - t0)
    calls.append(smi.calls)
    t0 = time.perf_counter()
    _holders.scan_holders()
    scans.append(time.perf_counter() - t0)
print(json.dumps({"times": times, "scans": scans, "calls": calls, "pids": len(_holders.list_pids())}))
""" % (os.path.join(REPO, ".build", "collections"), self.args.facts_reps)
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
        out = ["# Benchmarks", "",
               "Generated by `%s` on %s (%s, %d cores, Python %s). Every number is a median of %d runs; contenders "
               "alternate within each run. Hosts are systemd-nspawn Debian 12 containers on this one machine "
               "(real sshd, systemd and processes; simulated GPUs), so Ansible, SSH and the hosts share its cores." % (
                   " ".join(["benchmarks/run.py"] + sys.argv[1:]), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   platform.node() or "this machine", os.cpu_count(), platform.python_version(), self.args.reps), ""]
        if "clean" in self.rows:
            out += ["## Clean-fleet gate (wall seconds, `ansible-playbook` start to exit)", "",
                    "| hosts | bring-up | free_gpus.yml | one-task nvidia-smi play | raw parallel ssh | free_gpus / one-task |",
                    "|---|---|---|---|---|---|"]
            for n, row in sorted(self.rows["clean"].items()):
                out.append("| %d | %.1f s | %.2f s | %.2f s | %.2f s | %.2fx |" % (
                    n, self.rows["bringup"][n], row["free_gpus.yml"], row["one-task nvidia-smi play"], row["raw parallel ssh"],
                    row["free_gpus.yml"] / row["one-task nvidia-smi play"]))
            sizes = sorted(self.rows["clean"])
            if 16 in sizes and 32 in sizes:
                out += ["", "Growth 16 -> 32 hosts: free_gpus.yml x%.2f, one-task play x%.2f." % (
                    self.rows["clean"][32]["free_gpus.yml"] / self.rows["clean"][16]["free_gpus.yml"],
                    self.rows["clean"][32]["one-task nvidia-smi play"] / self.rows["clean"][16]["one-task nvidia-smi play"])]
            out.append("")
        if "dirty" in self.rows:
            out += ["## Dirty fleet: busy to verified clean", "",
                    "Each host: a 40 GiB trainer (cooperative), a 20 GiB holder ignoring SIGTERM (`kill_timeout: 2`), an orphaned "
                    "child forked after CUDA init (10 GiB), on every other host a `Restart=always` vllm.service (TP=2), and "
                    "nvidia-persistenced. Clean is checked 3 s after the contender returns (a respawned unit counts as dirty).", "",
                    "| hosts | contender | wall | hosts dirty after | hosts where nvidia-persistenced was killed | rc |", "|---|---|---|---|---|---|"]
            for n, row in sorted(self.rows["dirty"].items()):
                for name, (took, outcome) in row.items():
                    out.append("| %d | %s | %.2f s | %d | %d | %s |" % (
                        n, name, took, outcome["dirty_hosts"], outcome["lost_persistenced"], outcome["rc"]))
            out += ["", "Hand procedure: `%s`" % HAND, ""]
        if "facts" in self.rows:
            out += ["## gpu_facts inside the module, one host", "",
                    "Time of one look as gpu_facts makes it (two nvidia-smi calls side by side, the /proc scan, assembly), median "
                    "of %d: with idle GPUs (the gate before every job: device files only) and with a 1 GiB holder on each GPU "
                    "(then /proc/PID/maps is read too). Last column: a full fd+maps scan alone. The crowd is idle processes "
                    "(forked Python, ~100 mappings each)." % self.args.facts_reps, "",
                    "| GPUs | processes on the host | idle GPUs | busy GPUs | full fd+maps scan | nvidia-smi calls |",
                    "|---|---|---|---|---|---|"]
            for (preset, _crowd), row in sorted(self.rows["facts"].items(), key=lambda kv: (kv[0][0], kv[0][1])):
                out.append("| %s | %d | %.1f ms | %.1f ms | %.1f ms | %d |" % (
                    preset[-1], row["pids"], row["idle_ms"], row["busy_ms"], row["scan_ms"], row["calls"]))
            out.append("")
        out += self.notes
        changes = os.path.join(REPO, "benchmarks", "changes.md")
        if os.path.exists(changes):
            out += ["", open(changes).read().strip()]
        return "\n".join(out) + "\n"


def fleet_reset(fleet):
    """Every host back to idle GPUs, through the rig."""
    for host in fleet.hosts:
        fleet.ssh(host["name"], "systemctl stop vllm.service sglang.service nvidia-persistenced.service 2>/dev/null; "
                                "systemctl disable sglang.service 2>/dev/null; pkill -9 -f '[g]pu_holder'; true")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="8,16,32", help="fleet sizes for the clean gate")
    parser.add_argument("--dirty-hosts", default="8,16", help="fleet sizes for the dirty-fleet race")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--facts-reps", type=int, default=7)
    parser.add_argument("--skip-fleet", action="store_true")
    parser.add_argument("--skip-facts", action="store_true")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"))
    args = parser.parse_args()
    bench = Bench(args)
    if not args.skip_facts:
        bench.facts_part()
    if not args.skip_fleet:
        bench.fleet_part()
    text = bench.report()
    with open(args.out, "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
