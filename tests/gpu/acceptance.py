# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Acceptance run on a real NVIDIA host: real CUDA holders (PyTorch), the real modules and role
through real ansible-playbook (connection: local), checked independently with nvidia-smi.

Run as root on a host with an NVIDIA GPU, PyTorch and ansible-core on the controller Python:
    python3 tests/gpu/acceptance.py --out /tmp/zeromib-gpu-run [--gpu 0] [--mib 40960]
It starts its own holders and ends only them (by PID). It never runs `fuser -k`: the hand
procedure is reproduced with `fuser -v`'s list restricted to the processes this run started.
Writes results.json, the raw logs and the nvidia-smi captures it saw into --out.
"""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GPU_QUERY = (
    "index,uuid,name,pci.bus_id,driver_version,memory.total,memory.reserved,memory.used,memory.free,"
    "utilization.gpu,temperature.gpu,power.draw,persistence_mode,mig.mode.current"
)
STATIC_FIELDS = {
    "index": "index", "uuid": "uuid", "name": "name", "pci.bus_id": "pci_bus_id", "driver_version": None,
    "memory.total": "memory_total_mib", "memory.reserved": "memory_reserved_mib", "memory.used": "memory_used_mib",
    "memory.free": "memory_free_mib", "persistence_mode": "persistence_mode", "mig.mode.current": "mig_mode",
}


class Run:
    def __init__(self, out, gpu, mib, repeat=1, only=None):
        self.only = only
        self.repeat = repeat
        self.out = out
        self.gpu = gpu
        self.mib = mib
        self.started = []  # Popen objects and bare PIDs of what this run started
        self.results = {"scenarios": [], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.tmp = tempfile.mkdtemp(prefix="zeromib-gpu-")
        collections = os.path.join(self.tmp, "collections", "ansible_collections", "zeromib")
        os.makedirs(collections)
        os.symlink(REPO, os.path.join(collections, "gpu"))
        self.env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=os.path.join(self.tmp, "collections"),
                        ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_NOCOLOR="1", ANSIBLE_DEPRECATION_WARNINGS="False",
                        ANSIBLE_LOCALHOST_WARNING="False", ANSIBLE_INVENTORY_UNPARSED_WARNING="False")
        os.makedirs(os.path.join(out, "captures"), exist_ok=True)
        # The run's log: open for the whole run, the holders and supervisord write to it too.
        self.log = open(os.path.join(out, "run.log"), "a")  # noqa: SIM115

    # ---- helpers

    def say(self, text):
        line = f"[{time.monotonic() % 100000:8.3f}] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def smi(self, *args):
        proc = subprocess.run(["nvidia-smi"] + list(args), capture_output=True, text=True, check=False, env=dict(os.environ, LC_ALL="C"))
        return proc.returncode, proc.stdout

    def capture(self, name, *args):
        rc, out = self.smi(*args)
        with open(os.path.join(self.out, "captures", name + ".txt"), "w") as handle:
            handle.write("### nvidia-smi {}\n{}### rc={}\n".format(" ".join(args), out, rc))
        return out

    def used(self):
        rc, out = self.smi("-i", str(self.gpu), "--query-gpu=memory.used", "--format=csv,noheader,nounits")
        return int(out.strip()) if rc == 0 else None

    def holder(self, *extra, mib=None, gpu=None, env=None, prefix=()):
        """A PyTorch holder, started under `prefix` (e.g. unshare --pid --fork) when given."""
        ready = os.path.join(self.tmp, f"ready-{len(self.started)}-{int(time.time() * 1000)}")
        cmd = [sys.executable, os.path.join(HERE, "cuda_holder.py"), "--gpu", str(self.gpu if gpu is None else gpu), "--ready", ready,
               "--mib", str(mib if mib is not None else self.mib)] + list(extra)
        cmd = list(prefix) + cmd
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=dict(os.environ, **(env or {})))
        self.started.append(proc)
        return proc, ready

    def wait_ready(self, ready, child=False, timeout=120, under=None):
        """The holder's PIDs once ready. `under`: the Popen of a `unshare --pid --fork --mount-proc`
        prefix, whose holder numbers itself 1: its PID here is the prefix's only child."""
        deadline = time.monotonic() + timeout
        paths = [ready] + ([ready + ".child"] if child else [])
        while time.monotonic() < deadline:
            if all(os.path.exists(p) for p in paths):
                pids = [int(Path(p).read_text()) for p in paths]
                if under is not None:
                    pids[0] = self.only_child(under.pid)
                self.started.extend(pids[1:])
                return pids
            time.sleep(0.05)
        raise RuntimeError(f"holder not ready after {timeout} s")

    @staticmethod
    def only_child(pid):
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            [child] = [int(c) for c in handle.read().split()]
        return child

    def alive(self, pid):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    def reap(self):
        for item in self.started:
            if isinstance(item, subprocess.Popen):
                item.poll()

    def end(self, pid):
        """SIGKILL a process this run started (never anything else)."""
        known = {p.pid if isinstance(p, subprocess.Popen) else p for p in self.started}
        if pid not in known:
            raise RuntimeError(f"refusing to signal pid {pid}: not started by this run")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.reap()

    def end_all(self):
        for item in self.started:
            pid = item.pid if isinstance(item, subprocess.Popen) else item
            if self.alive(pid):
                self.end(pid)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(self.used_all().values()) > 0:
            time.sleep(0.05)

    def wait_free(self, since, timeout=30):
        """Bare poll loop: seconds from `since` until memory.used reads 0."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.used() == 0:
                return round(time.monotonic() - since, 3)
        return None

    def playbook(self, name, check=False, prefix=(), **extra):
        """`prefix`: a wrapper the run goes through (tests/gpu/subset_namespace.sh KEEP --)."""
        result_file = os.path.join(self.tmp, f"result-{name}.json")
        extra = dict(extra, result_file=result_file)
        cmd = list(prefix) + [shutil.which("ansible-playbook") or "ansible-playbook", "-i", "localhost,", "-c", "local",
                              os.path.join(HERE, "release.yml"), "-e", json.dumps(extra)]
        if check:
            cmd.append("--check")
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=self.env)
        wall = round(time.monotonic() - started, 3)
        slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
        while "--" in slug:
            slug = slug.replace("--", "-")
        with open(os.path.join(self.out, f"ansible-{slug}.log"), "w") as handle:
            handle.write("$ {}\n{}\n{}\nrc={} wall={:.3f} s\n".format(" ".join(cmd), proc.stdout, proc.stderr, proc.returncode, wall))
        self.reap()
        try:
            with open(result_file) as handle:
                return json.load(handle), wall
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"{name}: ansible-playbook rc {proc.returncode}, no result:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}") from exc

    def record(self, name, ok, **fields):
        entry = dict(name=name, ok=bool(ok), **fields)
        self.results["scenarios"].append(entry)
        self.say("{} {} {}".format("PASS" if ok else "FAIL", name, json.dumps(fields, default=str)[:400]))

    # ---- measurements outside Ansible

    def floor(self, signum, *extra, child=False, prefix=()):
        """Signal-to-0-MiB with a bare poll loop (the physical floor): every process holding the
        memory (the orphan too) is signalled at once, then nvidia-smi is polled back to back."""
        proc, ready = self.holder(*extra, prefix=prefix)
        pids = self.wait_ready(ready, child=child, under=proc if prefix else None)
        self.started.extend(pids[:1] if prefix else [])  # the holder below `unshare`, ours to end
        t0 = time.monotonic()
        for pid in pids:
            os.kill(pid, signum)
        took = self.wait_free(t0)
        self.end_all()
        return took

    def hand_procedure(self, *extra, child=False):
        """kill -9 the server; fuser -k /dev/nvidia* (here: only the PIDs this run started that
        hold a device file); sleep 2; nvidia-smi. Returns (seconds, MiB it then read)."""
        proc, ready = self.holder(*extra)
        pids = self.wait_ready(ready, child=child)
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        if shutil.which("fuser"):
            listed = subprocess.run(["fuser", f"/dev/nvidia{self.gpu}"], capture_output=True, text=True, check=False).stdout.split()
            holders = [int(p.rstrip("cefFrm")) for p in listed if p.rstrip("cefFrm").isdigit()]
        else:
            holders = [p for p in pids if self.alive(p)]
        for pid in holders:
            if pid in pids:
                self.end(pid)
        time.sleep(2)
        mib = self.used()
        took = round(time.monotonic() - t0, 3)
        self.end_all()
        return took, mib

    def pkill_only(self, *extra):
        """`pkill -9 -f <server>; sleep 2; nvidia-smi` without fuser: MiB left behind."""
        proc, ready = self.holder(*extra)
        pids = self.wait_ready(ready, child=True)
        os.kill(pids[0], signal.SIGKILL)
        time.sleep(2)
        mib = self.used()
        self.end_all()
        return mib

    # ---- scenarios

    def facts_agree(self, facts, name):
        out = self.capture(name, "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits")
        rows = [r.split(", ") for r in out.strip().splitlines()]
        fields = GPU_QUERY.split(",")
        mismatches = []
        for row in rows:
            direct = dict(zip(fields, row))
            gpu = [g for g in facts["gpus"] if g["index"] == int(direct["index"])][0]
            for field, key in STATIC_FIELDS.items():
                want = direct[field]
                if key is None:
                    got = facts["driver_version"]
                else:
                    got = gpu[key]
                if field.startswith("memory.") and got is not None and abs(int(want) - int(got)) <= 2:
                    continue
                if str(got) != want:
                    mismatches.append(f"{field}: facts {got!r}, nvidia-smi {want!r}")
        rc, version = self.smi("--version")
        cuda = [l.split(":", 1)[1].strip() for l in version.splitlines() if l.startswith("CUDA Version")]
        if cuda and facts["cuda_version"] != cuda[0]:
            mismatches.append("cuda_version: facts {!r}, nvidia-smi {!r}".format(facts["cuda_version"], cuda[0]))
        info = "/proc/driver/nvidia/gpus"
        if os.path.isdir(info):
            for entry in os.listdir(info):
                text = Path(info, entry, "information").read_text()
                minor = int([l.split(":")[1] for l in text.splitlines() if l.startswith("Device Minor")][0])
                gpu = [g for g in facts["gpus"] if g["pci_bus_id"].lower().endswith(entry.lower()[-12:])]
                if not gpu or gpu[0]["minor_number"] != minor:
                    mismatches.append("minor of {}: facts {!r}, driver {!r}".format(entry, gpu and gpu[0]["minor_number"], minor))
        return mismatches

    def scenario_idle(self):
        self.capture("idle_q_gpu_nounits", "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits")
        self.capture("idle_q_apps", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv")
        result, wall = self.playbook("idle", action="facts")
        facts = result["ansible_facts"]["gpu"]
        mismatches = self.facts_agree(facts, "idle_q_gpu_agree")
        self.record("idle GPU reads clean; gpu_facts agrees with nvidia-smi field by field", facts["clean"] and not mismatches,
                    clean=facts["clean"], count=facts["count"], memory_used_mib=facts["memory_used_mib"],
                    reserved=[g["memory_reserved_mib"] for g in facts["gpus"]], cuda_version=facts["cuda_version"],
                    mismatches=mismatches, wall_s=wall)

    def scenario_busy_facts(self):
        proc, ready = self.holder()
        pid = self.wait_ready(ready)[0]
        self.capture("held_q_gpu_nounits", "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits")
        self.capture("held_apps_live_csv", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv")
        result, wall = self.playbook("busy-facts", action="facts")
        facts = result["ansible_facts"]["gpu"]
        mismatches = self.facts_agree(facts, "held_q_gpu_agree")
        holder = [h for h in facts["holders"] if h["pid"] == pid]
        app = [a for a in facts["processes"] if a["pid"] == pid]
        ok = (not facts["clean"]) and holder and holder[0]["gpu_indexes"] == [self.gpu] and app and app[0]["alive"] and not mismatches
        self.record("busy GPU: gpu_facts lists the holder and its compute app", ok, clean=facts["clean"],
                    holder=holder[0] if holder else None, app=app[0] if app else None, mismatches=mismatches, wall_s=wall)
        self.end_all()

    def scenario_release(self, label, holder_args, kill_timeout, floor_signal, child=False, budget=None):
        floor = self.floor(floor_signal, *holder_args, child=child)
        hand_s, hand_mib = self.hand_procedure(*holder_args, child=child)
        pkill_only_mib = self.pkill_only(*holder_args) if child else None
        proc, ready = self.holder(*holder_args)
        pids = self.wait_ready(ready, child=child)
        if child:
            self.end(pids[0])
            time.sleep(0.5)
            self.capture("orphan_apps_dead_owner_csv", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv")
            self.capture("orphan_q_gpu_nounits", "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits")
            facts, _wall = self.playbook(label + "-facts", action="facts")
            facts = facts["ansible_facts"]["gpu"]
            seen = [h for h in facts["holders"] if h["pid"] == pids[1]]
            dead = [a for a in facts["processes"] if a["pid"] == pids[0]]
            self.record("orphaned child found through /proc while nvidia-smi names only its dead parent",
                        bool(seen and seen[0]["gpu_indexes"] == [self.gpu] and dead and not dead[0]["alive"]),
                        child=seen[0] if seen else None, dead_owner_app=dead[0] if dead else None)
        result, wall = self.playbook(label, action="release", kill_timeout=kill_timeout)
        after = self.used()
        targets = pids[1:] if child else pids
        killed = {k["pid"]: k for k in result.get("killed", [])}
        ok = result.get("released") and after == 0 and all(p in killed for p in targets) and not any(self.alive(p) for p in targets)
        elapsed = result.get("elapsed_s")
        if budget is not None and elapsed is not None:
            ok = ok and elapsed < budget
        self.record(label, ok, elapsed_s=elapsed, timings=result.get("timings"), floor_s=floor,
                    over_floor_s=round(elapsed - floor, 3) if elapsed is not None and floor is not None else None,
                    hand_procedure_s=hand_s, hand_procedure_mib_after=hand_mib, pkill_only_mib_after=pkill_only_mib,
                    signals=[(k["pid"], k["signal"], k["exited_after_s"]) for k in killed.values()],
                    memory_used_after_mib=after, ansible_wall_s=wall, msg=result.get("msg"))
        self.end_all()

    # ---- a signal that cannot arrive is not waited for (issue 31)

    def scenario_sigkill_at_once_ignored(self):
        """A PyTorch holder with SIGTERM set to SIG_IGN: SIGKILL at once, not after kill_timeout."""
        self.sigkill_at_once("holder ignoring SIGTERM (SIG_IGN), kill_timeout 10", ["--ignore-term"], (), "ignores SIGTERM")

    def scenario_sigkill_at_once_unshare(self):
        """A PyTorch holder under `unshare --pid --fork --mount-proc`: PID 1 of its namespace, no
        SIGTERM handler, so the kernel drops SIGTERM from outside (before issue 31: the whole
        kill_timeout). --mount-proc as a container has it: without it CUDA fails to initialise
        (error 304 on the H200, driver 580.159.04; the holder's /proc is then not its namespace's)."""
        self.sigkill_at_once("holder under unshare --pid --fork (init of its PID namespace), kill_timeout 10", [],
                             ("unshare", "--pid", "--fork", "--mount-proc"), "init of its PID namespace, no SIGTERM handler")

    def sigkill_at_once(self, label, holder_args, prefix, reason, kill_timeout=10):
        """Each run: the floor (SIGKILL of a twin holder, started the same way, to 0 MiB), then
        gpu_release through ansible-playbook; passes when the holder got SIGKILL at once with
        `reason` and the release took well under kill_timeout. `within_floor_plus_0_1` says
        whether it met the issue's floor + 0.1 s."""
        for run in range(1, self.repeat + 1):
            floor = self.floor(signal.SIGKILL, *holder_args, prefix=prefix)
            proc, ready = self.holder(*holder_args, prefix=prefix)
            [pid] = self.wait_ready(ready, under=proc if prefix else None)
            if prefix:
                self.started.append(pid)
            result, wall = self.playbook(f"{label}, run {run}", action="release", kill_timeout=kill_timeout)
            after = self.used()
            entry = {k["pid"]: k for k in result.get("killed", [])}.get(pid) or {}
            elapsed = result.get("elapsed_s")
            over = round(elapsed - floor, 3) if elapsed is not None and floor is not None else None
            ok = (result.get("released") and after == 0 and not self.alive(pid) and entry.get("signal") == "SIGKILL"
                  and entry.get("sigkill_at_once") == reason and elapsed is not None and elapsed < kill_timeout / 2)
            self.record(f"{label}, run {run}", ok, elapsed_s=elapsed, floor_s=floor, over_floor_s=over,
                        within_floor_plus_0_1=over is not None and over <= 0.1, killed=entry, timings=result.get("timings"),
                        memory_used_after_mib=after, ansible_wall_s=wall, msg=result.get("msg"))
            self.end_all()

    def scenario_protected(self):
        guard, guard_ready = self.holder("--no-context", "--name", "nvidia-persistenced", mib=0)
        guard_pid = self.wait_ready(guard_ready)[0]
        proc, ready = self.holder(mib=1024)
        pid = self.wait_ready(ready)[0]
        result, wall = self.playbook("protected", action="release", kill_timeout=5)
        # It opens the device files and maps none: an NVML client, left alone, and protected besides.
        guard = [h for h in result.get("holders", []) if h["pid"] == guard_pid]
        ok = (result.get("released") and self.alive(guard_pid) and not self.alive(pid) and self.used() == 0 and guard
              and guard[0]["protected"] and guard[0]["attribution"] == "nvml_client")
        self.record("a process named nvidia-persistenced holding the device files survives; the holder beside it is freed", ok,
                    guard=guard, comm=Path(f"/proc/{guard_pid}/comm").read_text().strip() if self.alive(guard_pid) else None,
                    killed=[k["pid"] for k in result.get("killed", [])], elapsed_s=result.get("elapsed_s"), wall_s=wall)
        self.end_all()

    def scenario_check_mode(self):
        proc, ready = self.holder()
        pid = self.wait_ready(ready)[0]
        before = self.used()
        result, wall = self.playbook("check-mode", check=True, action="release", kill_timeout=2)
        planned = [k for k in result.get("killed", []) if k["pid"] == pid]
        ok = result.get("changed") and not result.get("released") and planned and planned[0]["signal"] is None and self.alive(pid) \
            and self.used() == before
        self.record("check mode kills nothing and reports the plan", ok, changed=result.get("changed"), planned=planned,
                    still_alive=self.alive(pid), memory_used_mib=self.used(), elapsed_s=result.get("elapsed_s"), wall_s=wall)
        self.end_all()

    def gpu_count(self):
        return len([line for line in self.smi("-L")[1].splitlines() if line.startswith("GPU ")])

    def smi_q_mapping(self):
        """index -> (minor, uuid, bus id) from `nvidia-smi -q`, the driver's own long report."""
        rc, out = self.smi("-q")
        mapping, index, record = {}, -1, {}
        for line in out.splitlines():
            text = line.strip()
            if line.startswith("GPU ") and line[4:5].isdigit():  # "GPU 00000000:00:06.0" opens a GPU's section
                index += 1
                record = {}
                mapping[index] = record
            key, _sep, value = text.partition(":")
            key = key.strip()
            if key == "Minor Number" and index >= 0:
                record["minor"] = int(value) if value.strip().isdigit() else None
            elif key == "GPU UUID" and index >= 0:
                record["uuid"] = value.strip()
            elif key == "Bus Id" and index >= 0:
                record["bus"] = value.strip()
        return mapping

    def scenario_multi_gpu(self, mib=8192):
        """A holder on every GPU from its own process (like TP workers); free a subset with
        `gpus:`, check the others are untouched, then free all. Runs on 1 GPU too."""
        count = self.gpu_count()
        facts, _wall = self.playbook("multi-facts", action="facts")
        facts = facts["ansible_facts"]["gpu"]
        q_map = self.smi_q_mapping()
        mapping_errors = []
        for gpu in facts["gpus"]:
            want = q_map.get(gpu["index"], {})
            got = (gpu["minor_number"], gpu["uuid"], gpu["pci_bus_id"])
            if (want.get("minor"), want.get("uuid"), want.get("bus")) != got:
                mapping_errors.append("GPU {}: facts {!r}, nvidia-smi -q {!r}".format(gpu["index"], got, want))
        holders = {index: self.holder(mib=mib, gpu=index)[1] for index in range(count)}
        pids = {index: self.wait_ready(ready)[0] for index, ready in holders.items()}
        subset = list(range(count // 2)) if count > 1 else [0]
        before = self.used_all()
        result, wall = self.playbook("multi-subset", action="release", gpus=[str(i) for i in subset], kill_timeout=5)
        after = self.used_all()
        killed = sorted(k["pid"] for k in result.get("killed", []))
        others = [i for i in range(count) if i not in subset]
        # A freed GPU next to GPUs that keep their contexts reads their cross-GPU footprint (4 MiB on H200).
        ok_subset = (result.get("released") and killed == sorted(pids[i] for i in subset)
                     and all(after[i] <= (4 if others else 0) for i in subset)
                     and all(self.alive(pids[i]) and after[i] == before[i] for i in others))
        self.record(f"free GPUs {subset} of {count} with gpus:, the others keep their holders and memory", ok_subset,
                    elapsed_s=result.get("elapsed_s"), killed=killed, before_mib=before, after_mib=after, wall_s=wall,
                    mapping_errors=mapping_errors)
        result, wall = self.playbook("multi-all", action="release", kill_timeout=5)
        after = self.used_all()
        ok_all = result.get("released") and all(v == 0 for v in after.values()) and not mapping_errors
        self.record(f"free all {count} GPUs, every one reads 0 MiB; index/minor/UUID/bus id agree with nvidia-smi -q", ok_all,
                    elapsed_s=result.get("elapsed_s"), timings=result.get("timings"), after_mib=after, wall_s=wall,
                    mapping=[(g["index"], g["minor_number"], g["uuid"], g["pci_bus_id"]) for g in facts["gpus"]],
                    mapping_errors=mapping_errors)
        self.end_all()

    # ---- attribution on a multi-GPU node (issue 11): which process uses which GPU

    def scenario_subset(self, mib=4096):
        """Issue 37: a namespace given some of the GPUs' device nodes (tests/gpu/subset_namespace.sh:
        an overlay /dev without the other /dev/nvidia<minor>; /proc/driver/nvidia unmasked, as in an
        LXC container). Without any GPU node nvidia-smi finds no device while the driver lists every
        GPU (1 GPU suffices); with --gpu's node only, gpu_facts sees that GPU as index 0 and lists
        the others as not_visible, a holder started inside is freed, and `gpus:` naming another GPU
        fails saying it is not visible (2 GPUs or more)."""
        wrap = os.path.join(HERE, "subset_namespace.sh")
        driver = sorted(os.listdir("/proc/driver/nvidia/gpus"))
        env = dict(os.environ, LC_ALL="C")
        bare = subprocess.run([wrap, "-", "--", "nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                              capture_output=True, text=True, check=False, env=env)
        listed = subprocess.run([wrap, "-", "--", "ls", "/proc/driver/nvidia/gpus"], capture_output=True, text=True, check=False).stdout.split()
        self.record("no GPU node in the namespace: nvidia-smi finds no device, the driver still lists every GPU",
                    bare.returncode == 6 and "No devices were found" in bare.stdout and listed == driver,
                    rc=bare.returncode, stdout=bare.stdout.strip(), driver_lists=listed)
        mapping = self.smi_q_mapping()
        if len(mapping) < 2:
            self.record("one GPU of several in a namespace (needs 2 GPUs or more)", True, skipped=f"{len(mapping)} GPU(s) on this host")
            return
        keep = mapping[self.gpu]["minor"]
        prefix = [wrap, str(keep), "--"]
        others = sorted(b for b in driver if b != mapping[self.gpu]["bus"].lower()[4:])
        rows = subprocess.run(prefix + ["nvidia-smi", "--query-gpu=index,pci.bus_id,memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=False, env=env).stdout.splitlines()
        ready = os.path.join(self.tmp, f"ready-subset-{int(time.time() * 1000)}")
        proc = subprocess.Popen(prefix + [sys.executable, os.path.join(HERE, "cuda_holder.py"), "--gpu", "0", "--ready", ready, "--mib", str(mib)],
                                stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        self.started.append(proc)
        pid = self.wait_ready(ready)[0]
        self.started.append(pid)
        facts, wall = self.playbook("subset-facts", prefix=prefix, action="facts")
        gpu = facts.get("ansible_facts", {}).get("gpu", {})
        holder = [h for h in gpu.get("holders", []) if h["pid"] == pid]
        self.record("one GPU of several: gpu_facts sees it as index 0 and lists the others as not visible",
                    gpu.get("count") == 1 and gpu.get("not_visible") == others and gpu.get("error") is None and bool(holder)
                    and holder[0]["gpu_indexes"] == [0] and [g["minor_number"] for g in gpu.get("gpus", [])] == [keep],
                    rows=rows, count=gpu.get("count"), not_visible=gpu.get("not_visible"), expected_not_visible=others,
                    holder=holder[0] if holder else None, msg=facts.get("msg"), wall_s=wall)
        refused, _wall = self.playbook("subset-other-gpu", prefix=prefix, action="release", gpus=[str(len(mapping) - 1)])
        self.record("one GPU of several: gpus naming another GPU is refused as not visible, nothing signalled",
                    "is not visible on this node" in (refused.get("msg") or "") and not refused.get("released") and self.alive(pid),
                    msg=refused.get("msg"))
        result, wall = self.playbook("subset-release", prefix=prefix, action="release", gpus=["0"])
        self.record("one GPU of several: gpu_release frees and proves it, the others listed as not visible",
                    bool(result.get("released")) and pid in [k["pid"] for k in result.get("killed", [])] and not self.alive(pid)
                    and result.get("not_visible") == others and self.used() == 0,
                    elapsed_s=result.get("elapsed_s"), not_visible=result.get("not_visible"), msg=result.get("msg"), wall_s=wall)
        self.end_all()

    def start(self, *extra, gpu=0, mib=2048, env=None, child=False):
        """A holder (or monitor) started and ready -> its PIDs ([pid] or [pid, child])."""
        return self.wait_ready(self.holder(*extra, mib=mib, gpu=gpu, env=env)[1], child=child)

    def monitor_dmon(self):
        proc = subprocess.Popen(["nvidia-smi", "dmon", "-d", "1"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.started.append(proc)
        time.sleep(1.5)  # dmon opens the devices on its first sample
        return proc.pid

    def placed(self, facts):
        return {h["pid"]: (h["gpu_indexes"], h.get("attribution")) for h in facts["holders"]}

    def attribution_case(self, name, ok, **fields):
        self.record("attribution: " + name, ok, **fields)

    def scenario_attribution(self):
        """Multi-GPU cases of issue 11. Needs 2 GPUs for all but the monitor cases; on 1 GPU the
        others are listed under not_run, never as passed."""
        count = self.gpu_count()
        self.results.setdefault("not_run", [])
        dmon = self.monitor_dmon()
        nvml = self.start("--nvml-loop")[0]
        facts = self.playbook("attr-monitors-facts", action="facts")[0]["ansible_facts"]["gpu"]
        placed = self.placed(facts)
        self.attribution_case("nvidia-smi dmon and a pynvml loop are NVML clients; a host with only them is clean",
                              placed.get(dmon) == ([], "nvml_client") and placed.get(nvml) == ([], "nvml_client") and facts["clean"],
                              placed={str(k): v for k, v in placed.items()}, clean=facts["clean"],
                              devices={str(h["pid"]): h["devices"] for h in facts["holders"]})
        trainer = self.start(gpu=0)[0]
        result, wall = self.playbook("attr-monitors-release", action="release", kill_timeout=5)
        killed = sorted(k["pid"] for k in result.get("killed", []))
        self.attribution_case("freeing every GPU kills the holder, never the monitors",
                              killed == [trainer] and self.alive(dmon) and self.alive(nvml) and result.get("released"),
                              killed=killed, monitors_alive=[self.alive(dmon), self.alive(nvml)], elapsed_s=result.get("elapsed_s"),
                              after_mib=self.used_all())
        if count < 2:
            self.results["not_run"] += ["process per GPU, gpus subsets both ways", "CUDA_VISIBLE_DEVICES-restricted process",
                                        "orphan on GPU 1 next to a live process on GPU 0"]
            self.end_all()
            return
        # One process per GPU (torch.cuda.set_device), as in the readings' two_holders.
        pid0, pid1 = self.start(gpu=0)[0], self.start(gpu=1)[0]
        facts = self.playbook("attr-two-facts", action="facts")[0]["ansible_facts"]["gpu"]
        placed = self.placed(facts)
        self.attribution_case("process per GPU: each attributed to its own GPU (listed), monitors apart",
                              placed.get(pid0) == ([0], "listed") and placed.get(pid1) == ([1], "listed")
                              and placed.get(dmon) == ([], "nvml_client"),
                              placed={str(k): v for k, v in placed.items()}, used=self.used_all())
        before = self.used_all()
        result, wall = self.playbook("attr-two-free-1", action="release", gpus=["1"], kill_timeout=5)
        after = self.used_all()
        gpu1 = [g for g in result.get("gpus", []) if g["index"] == 1]
        killed = sorted(k["pid"] for k in result.get("killed", []))
        self.attribution_case("gpus [1]: only GPU 1's process is signalled; GPU 0 keeps its trainer and MiB; GPU 1 clean",
                              killed == [pid1] and self.alive(pid0) and after.get(0) == before.get(0) and result.get("released")
                              and self.alive(dmon) and self.alive(nvml),
                              killed=killed, before_mib=before, after_mib=after, gpu1=gpu1, elapsed_s=result.get("elapsed_s"), wall_s=wall)
        result, wall = self.playbook("attr-two-free-0", action="release", gpus=["0"], kill_timeout=5)
        killed = sorted(k["pid"] for k in result.get("killed", []))
        self.attribution_case("gpus [0] the other way: only GPU 0's process is signalled",
                              killed == [pid0] and result.get("released"), killed=killed, after_mib=self.used_all(),
                              elapsed_s=result.get("elapsed_s"))
        # CUDA_VISIBLE_DEVICES=0: opens GPU 1's node too, maps only GPU 0's.
        cvd = self.start(gpu=0, env={"CUDA_VISIBLE_DEVICES": "0"})[0]
        other = self.start(gpu=1)[0]
        facts = self.playbook("attr-cvd-facts", action="facts")[0]["ansible_facts"]["gpu"]
        placed = self.placed(facts)
        result, wall = self.playbook("attr-cvd-free-1", action="release", gpus=["1"], kill_timeout=5)
        killed = sorted(k["pid"] for k in result.get("killed", []))
        self.attribution_case("CUDA_VISIBLE_DEVICES=0 process attributed to GPU 0 and left alone by gpus [1]",
                              placed.get(cvd) == ([0], "listed") and killed == [other] and self.alive(cvd) and result.get("released"),
                              placed={str(k): v for k, v in placed.items()}, killed=killed, after_mib=self.used_all(),
                              devices=[h["devices"] for h in facts["holders"] if h["pid"] == cvd])
        self.end(cvd)
        self.wait_gone_mib()
        # The orphan: a child forked after CUDA init on GPU 1, its parent SIGKILLed; a live process on GPU 0.
        parent, orphan = self.start("--fork-child", gpu=1, child=True)
        live = self.start(gpu=0)[0]
        self.end(parent)
        time.sleep(0.5)
        facts = self.playbook("attr-orphan-facts", action="facts")[0]["ansible_facts"]["gpu"]
        placed = self.placed(facts)
        result, wall = self.playbook("attr-orphan-free-0", action="release", gpus=["0"], kill_timeout=5)
        killed0 = sorted(k["pid"] for k in result.get("killed", []))
        ok0 = killed0 == [live] and self.alive(orphan) and result.get("released")
        live2 = self.start(gpu=0)[0]
        result, wall = self.playbook("attr-orphan-free-1", action="release", gpus=["1"], kill_timeout=5)
        killed1 = sorted(k["pid"] for k in result.get("killed", []))
        after = self.used_all()
        self.attribution_case("orphan on GPU 1 (parent [Not Found]) is mapped to GPU 1: left alone by gpus [0], freed by gpus [1]",
                              placed.get(orphan) == ([1], "mapped") and ok0 and killed1 == [orphan] and self.alive(live2)
                              and result.get("released") and after.get(1, -1) <= 4,
                              placed={str(k): v for k, v in placed.items()}, killed_gpus0=killed0, killed_gpus1=killed1, after_mib=after,
                              apps=facts["processes"], gpus_after=result.get("gpus"))
        self.end_all()

    def scenario_health(self):
        """Issue 15 on real hardware: an idle, healthy GPU reads healthy, health read in the same
        nvidia-smi call (the raw facts are in the ansible log of this run)."""
        facts, wall = self.playbook("health-facts", action="facts")
        gpu = facts["ansible_facts"]["gpu"]
        per_gpu = [(g["index"], g.get("healthy"), g.get("health_issues"), g.get("health")) for g in gpu["gpus"]]
        ok = gpu.get("healthy") is True and all(h is True for _i, h, _issues, _raw in per_gpu)
        self.record("health: an idle GPU reads healthy (ECC, row remaps, PCIe link, slowdown, persistence, MIG, Xids)", ok,
                    host_healthy=gpu.get("healthy"), health_checked=gpu.get("health_checked"), gpus=per_gpu, wall_s=wall)

    def scenario_fabric(self):
        """Issue 30 on real hardware: the fabric verdict is the GPU's. Driver 580.159.04 knows
        fabric.health.summary (no rejected field, `fabric` checked); a GPU reading N/A has no fabric
        and the look runs no Fabric Manager command (health.fabric_manager null); a GPU reading
        Completed/Success is healthy whatever the host has of Fabric Manager (recorded)."""
        rc, raw = self.smi("--query-gpu=index,fabric.state,fabric.status,fabric.health.summary", "--format=csv,noheader")
        facts, wall = self.playbook("fabric-facts", action="facts")
        gpu = facts["ansible_facts"]["gpu"]
        per_gpu = [(g["index"], g["health"].get("fabric_state"), g["health"].get("fabric_status"), g["health"].get("fabric_health_summary"),
                    g.get("health_unchecked"), g.get("health_issues")) for g in gpu["gpus"]]
        registered = [s == "Completed" and st in (None, "Success") for _i, s, st, _h, _u, _x in per_gpu]
        no_fabric = all(s is None for _i, s, _st, _h, _u, _x in per_gpu)
        fm = gpu["health"].get("fabric_manager")
        ok = rc == 0 and all("fabric" not in (u or []) for _i, _s, _st, _h, u, _x in per_gpu) and (
            (no_fabric and fm is None) or (all(registered) and gpu.get("healthy") is True))
        self.record("fabric: the GPU's registration decides; no Fabric Manager command without a fabric", ok, raw=raw.strip(),
                    gpus=per_gpu, fabric_manager=fm, host_healthy=gpu.get("healthy"), wall_s=wall)

    def wait_gone_mib(self, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and sum(v for v in self.used_all().values()) > 8:
            time.sleep(0.05)

    def used_all(self):
        rc, out = self.smi("--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
        return {int(a): int(b) for a, b in (line.split(", ") for line in out.strip().splitlines())} if rc == 0 else {}

    def scenario_role(self):
        proc, ready = self.holder()
        pid = self.wait_ready(ready)[0]
        cmd = [shutil.which("ansible-playbook") or "ansible-playbook", "-i", "localhost,", "-c", "local",
               os.path.join(REPO, "playbooks", "free_gpus.yml"), "-e", "free_gpus_hosts=localhost", "-e", "ansible_python_interpreter=" + sys.executable]
        started = time.monotonic()
        run = subprocess.run(cmd, capture_output=True, text=True, check=False, env=self.env)
        wall = round(time.monotonic() - started, 3)
        self.reap()
        with open(os.path.join(self.out, "ansible-free_gpus-playbook.log"), "w") as handle:
            handle.write("$ {}\n{}\n{}\nrc={} wall={:.3f} s\n".format(" ".join(cmd), run.stdout, run.stderr, run.returncode, wall))
        summary = [l for l in run.stdout.splitlines() if "MIB BEFORE" in l or "localhost" in l and "->" in l]
        ok = run.returncode == 0 and not self.alive(pid) and self.used() == 0
        self.record(f"playbooks/free_gpus.yml (the role) frees a real {self.mib} MiB holder", ok, rc=run.returncode, wall_s=wall, summary=summary)
        self.end_all()

    # ---- what comes back (issue 20): restarters, supervisord, MPS, JAX, the watch's cost

    def holder_argv(self, ready, mib, *extra):
        return [sys.executable, os.path.join(HERE, "cuda_holder.py"), "--gpu", str(self.gpu), "--ready", ready, "--mib", str(mib)] + list(extra)

    def under_shell(self, script_format, mib, name):
        """`sh -c SCRIPT` in a session of its own, SCRIPT holding the holder's command line where
        {holder} is: -> (Popen of the shell, ready file)."""
        ready = os.path.join(self.tmp, f"ready-{name}")
        holder = " ".join(shlex.quote(a) for a in self.holder_argv(ready, mib))
        proc = subprocess.Popen(["sh", "-c", script_format.format(holder=holder, ready=shlex.quote(ready))], stdin=subprocess.DEVNULL,
                                stdout=self.log, stderr=self.log, start_new_session=True)
        self.started.append(proc)
        return proc, ready

    def descendants(self, pid):
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as handle:
                        children.setdefault(int(handle.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
                except (OSError, ValueError, IndexError):
                    pass
        found, stack = [], [pid]
        while stack:
            kids = children.get(stack.pop(), [])
            found += kids
            stack += kids
        return found

    def end_tree(self, proc):
        """SIGKILL a process this run started, then everything it started (parent first, so that
        nothing is restarted in between)."""
        below = self.descendants(proc.pid)
        self.end(proc.pid)
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.reap()

    def wait_used_above(self, mib, timeout):
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            used = self.used()
            if used is not None and used > mib:
                return round(time.monotonic() - started, 3)
            time.sleep(0.05)
        return None

    def scenario_shell_loop_sleep(self):
        """The same loop with a restart delay: `sleep 3` between runs, inside the settle window."""
        self.scenario_shell_loop("while true; do rm -f {ready}; {holder}; sleep 3; done", " with sleep 3")

    def scenario_shell_loop(self, script="while true; do rm -f {ready}; {holder}; done", label=""):
        """The measured false release: `while true; do python holder.py; done`."""
        loop, ready = self.under_shell(script, 4096, "loop" + str(len(label)))
        first = self.wait_ready(ready)[0]
        self.started.append(first)
        result, wall = self.playbook("respawn-shell-loop" + label.replace(" ", "-"), action="release", wait_timeout=30)
        msg = result.get("msg") or ""
        came_back_s = self.wait_used_above(1000, 20)
        named = f"started again by its parent pid {loop.pid} sh" in msg
        ok = result.get("released") is False and named and first in [k["pid"] for k in result.get("killed", [])] and came_back_s is not None
        self.record(f"shell loop{label} restarting a PyTorch holder: caught and named, never released: true", ok, released=result.get("released"),
                    elapsed_s=result.get("elapsed_s"), timings=result.get("timings"), gpu_dirty_again_after_s=came_back_s, msg=msg[:700],
                    wall_s=wall)
        self.end_tree(loop)
        self.wait_gone_mib()

    def supervisord_path(self):
        site_bins = [os.path.join(p, "bin") for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        for directory in os.environ.get("PATH", "").split(os.pathsep) + site_bins:
            path = os.path.join(directory, "supervisord")
            if directory and os.access(path, os.X_OK):
                return path
        return None

    def scenario_supervisor(self):
        supervisord = self.supervisord_path()
        if not supervisord:
            self.results.setdefault("not_run", []).append("supervisord: the supervisor package is not installed here")
            return
        base = os.path.join(self.tmp, "supervisor")
        os.makedirs(os.path.join(base, "conf.d"))
        ready = os.path.join(base, "ready")
        conf = os.path.join(base, "supervisord.conf")
        with open(conf, "w") as handle:
            handle.write(f"[unix_http_server]\nfile={base}/sock\n[supervisord]\nlogfile={base}/supervisord.log\npidfile={base}/pid\nchildlogdir={base}\n"
                         "[rpcinterface:supervisor]\nsupervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface\n"
                         f"[supervisorctl]\nserverurl=unix://{base}/sock\n[include]\nfiles = conf.d/*.conf\n")
        with open(os.path.join(base, "conf.d", "gpuholder.conf"), "w") as handle:
            command = " ".join(self.holder_argv(ready, 4096))
            handle.write(f"[program:gpuholder]\ncommand={command}\nautostart=true\nautorestart=true\nstartsecs=0\nstopwaitsecs=5\n")
        daemon = subprocess.Popen([supervisord, "-n", "-c", conf], stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                  start_new_session=True)
        self.started.append(daemon)
        ctl = [os.path.join(os.path.dirname(supervisord), "supervisorctl"), "-c", conf]
        try:
            first = self.wait_ready(ready)[0]
            result, wall = self.playbook("supervisor-not-named", action="release", wait_timeout=30)
            msg = result.get("msg") or ""
            back_s = self.wait_used_above(1000, 20)
            ok = (result.get("released") is False and "supervisorctl stop gpuholder" in msg and "(supervisord)" in msg
                  and back_s is not None)
            self.record("supervisord autorestart=true, not named: the run fails naming supervisord and supervisorctl stop NAME", ok,
                        released=result.get("released"), killed=[k["pid"] for k in result.get("killed", [])], first=first,
                        gpu_dirty_again_after_s=back_s, elapsed_s=result.get("elapsed_s"), timings=result.get("timings"), msg=msg[:700],
                        wall_s=wall)
            result, wall = self.playbook("supervisor-named", action="release", services=["supervisor:gpuholder"],
                                         service_state="disabled", wait_timeout=30)
            time.sleep(10)
            status = subprocess.run(ctl + ["status", "gpuholder"], capture_output=True, text=True, check=False).stdout.strip()
            after = self.used()
            conf_text = Path(base, "conf.d", "gpuholder.conf").read_text()
            ok = (result.get("released") is True and [p["name"] for p in result.get("stopped_programs", [])] == ["gpuholder"]
                  and "STOPPED" in status and after == 0 and "autorestart=false" in conf_text)
            self.record("supervisor:gpuholder with service_state disabled: stopped through supervisorctl, still stopped and 0 MiB 10 s later",
                        ok, released=result.get("released"), stopped_programs=result.get("stopped_programs"),
                        disabled_programs=result.get("disabled_programs"), status_10s_later=status, memory_used_10s_later_mib=after,
                        elapsed_s=result.get("elapsed_s"), timings=result.get("timings"), msg=result.get("msg"), wall_s=wall)
        finally:
            self.end_tree(daemon)
            self.wait_gone_mib()

    def processes_named(self, name):
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as handle:
                        argv0 = handle.read().split(b"\0")[0].decode("utf-8", "replace")
                except OSError:
                    continue
                if os.path.basename(argv0) == name:
                    found.append(int(entry))
        return found

    def scenario_mps(self):
        ctl = shutil.which("nvidia-cuda-mps-control") or "/usr/local/nvidia/bin/nvidia-cuda-mps-control"
        if not os.access(ctl, os.X_OK):
            self.results.setdefault("not_run", []).append("MPS: nvidia-cuda-mps-control not found")
            return
        env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.tmp, "mps"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.tmp, "mps-log")}
        for path in env.values():
            os.makedirs(path, exist_ok=True)
        full_env = dict(os.environ, **env)
        started = subprocess.run([ctl, "-d"], env=full_env, capture_output=True, text=True, check=False)
        try:
            client = self.wait_ready(self.holder(mib=8192, env=env)[1])[0]
            apps = self.capture("mps_apps_csv", "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv")
            daemons, servers = self.processes_named("nvidia-cuda-mps-control"), self.processes_named("nvidia-cuda-mps-server")
            self.started.extend(daemons + servers)
            facts = self.playbook("mps-facts", action="facts")[0]["ansible_facts"]["gpu"]
            placed = {h["pid"]: (h["gpu_indexes"], h.get("attribution")) for h in facts["holders"]}
            result, wall = self.playbook("mps-release", action="release")
            time.sleep(0.5)
            stopped = result.get("stopped_mps_servers", [])
            ok = (result.get("released") is True and [k["pid"] for k in result.get("killed", [])] == [client]
                  and [s["pid"] for s in stopped] == servers and stopped and stopped[0]["how"]
                  and not any(self.alive(p) for p in daemons + servers) and self.used() == 0)
            self.record("MPS: client freed as a holder, server stopped through its control daemon's quit, 0 MiB", ok,
                        daemon_start_rc=started.returncode, apps=apps.strip().splitlines(), daemons=daemons, servers=servers,
                        placed={str(k): v for k, v in placed.items()}, killed=[k["pid"] for k in result.get("killed", [])],
                        stopped_mps_servers=stopped, alive_after=[p for p in daemons + servers if self.alive(p)], memory_used_after_mib=self.used(),
                        elapsed_s=result.get("elapsed_s"), timings=result.get("timings"), msg=result.get("msg"), wall_s=wall)
        finally:
            if self.processes_named("nvidia-cuda-mps-control"):
                subprocess.run([ctl], input="quit\n", env=full_env, capture_output=True, text=True, check=False, timeout=30)
            self.end_all()

    def scenario_jax(self):
        proc, ready = self.holder("--jax", mib=0)
        pid = self.wait_ready(ready, timeout=180)[0]
        before = self.used_all()
        result, wall = self.playbook("jax-release", action="release")
        after = self.used_all()
        ok = result.get("released") is True and [k["pid"] for k in result.get("killed", [])] == [pid] and all(v == 0 for v in after.values())
        self.record("JAX process preallocating on every visible GPU (here: one): freed, 0 MiB", ok, before_mib=before, after_mib=after,
                    elapsed_s=result.get("elapsed_s"), timings=result.get("timings"), wall_s=wall, msg=result.get("msg"))
        if self.gpu_count() < 2:
            self.results.setdefault("not_run", []).append("JAX process spanning GPUs with a partial selection (needs 2 GPUs)")
        self.end_all()

    def scenario_watch_cost(self, runs=2):
        """A cooperative holder's release time over the floor: no parent to watch (started by this
        run, which is the Ansible session's ancestor), a parent that exits with it, a parent that
        lives on (the whole settle window)."""
        for run in range(1, runs + 1):
            floor = self.floor(signal.SIGTERM)
            for label, script in (("off: no parent to watch", None), ("on: parent exits with the holder", "{holder}; true"),
                                  ("on: parent lives on (window spent)", "{holder}; sleep 600")):
                if script is None:
                    proc, ready = self.holder()
                else:
                    proc, ready = self.under_shell(script, self.mib, f"cost-{run}-{len(label)}")
                pid = self.wait_ready(ready)[0]
                self.started.append(pid)
                result, wall = self.playbook("watch-cost-{}-{}".format(run, label.split(":", maxsplit=1)[0] + str(len(label))), action="release")
                elapsed = result.get("elapsed_s")
                ok = result.get("released") is True and self.used() == 0
                self.record(f"respawn watch {label}, cooperative {self.mib} MiB holder, run {run}", ok, elapsed_s=elapsed,
                            floor_s=floor, over_floor_s=round(elapsed - floor, 3) if elapsed is not None and floor is not None else None,
                            settle_s=(result.get("timings") or {}).get("settle_s"), timings=result.get("timings"), wall_s=wall,
                            msg=result.get("msg"))
                if isinstance(proc, subprocess.Popen):
                    self.end_tree(proc)
                self.end_all()

    def bare_smoke(self, mib, repeat):
        """The smoke test's own cost, without Ansible: _cuda_smoke.run_in_child on every GPU."""
        collections = os.path.join(self.tmp, "collections")
        code = (f"import json, sys, time; sys.path.insert(0, {collections!r})\n"
                "from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cuda_smoke as s\n"
                "bus = [l.split(', ')[1] for l in sys.argv[1].splitlines()]\n"
                f"t = time.monotonic(); r, init = s.run_in_child(bus, {mib}, 30)\n"
                "print(json.dumps({'results': r, 'init_s': init, 'wall_s': round(time.monotonic() - t, 3)}))\n")
        rows = self.smi("--query-gpu=index,pci.bus_id", "--format=csv,noheader")[1].strip()
        runs = []
        for _run in range(repeat):
            proc = subprocess.run([sys.executable, "-c", code, rows], capture_output=True, text=True, check=False)
            runs.append(json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]})
            runs[-1]["used_after"] = self.used_all()
        return runs

    def scenario_smoke(self):
        """Issue 27: the CUDA smoke test through the driver's own libcuda.so.1, on every idle GPU:
        passes, costs < 1 s per GPU at the default 1024 MiB, and each GPU reads 0 MiB after it."""
        before = self.used_all()
        bare = self.bare_smoke(1024, 3)
        bare_big = self.bare_smoke(16384, 1)
        facts, facts_wall = self.playbook("smoke-facts", action="facts", smoke_test=True)
        after_facts = self.used_all()
        release, release_wall = self.playbook("smoke-release", action="release", smoke_test=True)
        after_release = self.used_all()
        facts_gpus = facts["ansible_facts"]["gpu"]["gpus"]
        per_gpu = [(g["index"], g.get("smoke_test")) for g in facts_gpus + release.get("gpus", [])]
        seconds = [r["seconds"] for _i, r in per_gpu if r and r.get("ok")]
        bare_seconds = [r["seconds"] for run in bare for r in (run.get("results") or {}).values() if r.get("ok")]
        ok = (all(v == 0 for v in before.values()) and facts["ansible_facts"]["gpu"].get("smoke_test_passed") is True
              and release.get("smoke_test_passed") is True and seconds and max(seconds) < 1
              and all(v == 0 for v in list(after_facts.values()) + list(after_release.values()))
              and all(r.get("memory_used_mib_after") == 0 for _i, r in per_gpu)
              and bare_seconds and max(bare_seconds) < 1 and all(v == 0 for run in bare for v in run["used_after"].values()))
        self.record("smoke test: every idle GPU runs CUDA (context, 1024 MiB alloc + memset, sync, free) in < 1 s and reads 0 MiB after",
                    ok, before=before, per_gpu=per_gpu, after_facts=after_facts, after_release=after_release,
                    facts_wall_s=facts_wall, release_wall_s=release_wall, release_timings=release.get("timings"),
                    bare_1024=bare, bare_16384=bare_big)
        # The role, as a training play's pre_tasks run it.
        cmd = [shutil.which("ansible-playbook") or "ansible-playbook", "-i", "localhost,", "-c", "local",
               os.path.join(REPO, "playbooks", "free_gpus.yml"), "-e", "free_gpus_hosts=localhost", "-e", "ansible_python_interpreter=" + sys.executable,
               "-e", json.dumps({"free_gpus_smoke_test": True})]
        started = time.monotonic()
        run = subprocess.run(cmd, capture_output=True, text=True, check=False, env=self.env)
        wall = round(time.monotonic() - started, 3)
        with open(os.path.join(self.out, "ansible-smoke-free_gpus-playbook.log"), "w") as handle:
            handle.write("$ {}\n{}\n{}\nrc={} wall={:.3f} s\n".format(" ".join(cmd), run.stdout, run.stderr, run.returncode, wall))
        lines = [l.strip() for l in run.stdout.splitlines() if "smoke test" in l]
        self.record("smoke test: playbooks/free_gpus.yml with free_gpus_smoke_test passes and says so", run.returncode == 0 and
                    any("smoke test passed" in l for l in lines), rc=run.returncode, wall_s=wall, lines=lines[:4],
                    used_after=self.used_all())
        # A GPU in use is never tested: a real PyTorch holder on the GPU, gpu_facts skips it.
        try:
            proc, ready = self.holder(mib=2048)
            pid = self.wait_ready(ready)[0]
        except Exception as exc:  # no PyTorch here: say so, never a pass
            self.record("smoke test: a GPU in use is skipped, never tested", False, error=f"no holder: {exc!r}")
            return
        busy, _wall = self.playbook("smoke-busy-facts", action="facts", smoke_test=True)
        self.end_all()
        record = busy["ansible_facts"]["gpu"]["gpus"][self.gpu].get("smoke_test") or {}
        self.record("smoke test: a GPU in use is skipped, never tested", record.get("ok") is None and
                    str(record.get("skipped", "")).startswith(f"in use by PID {pid}"), smoke_test=record)

    def main(self):
        rc, out = self.smi("--version")
        self.results["nvidia_smi_version"] = out
        self.results["gpu"] = self.smi("-L")[1].strip()
        self.results["command"] = " ".join(sys.argv)
        releases = []
        for run in range(1, self.repeat + 1):
            releases += [
                lambda run=run: self.scenario_release(f"cooperative {self.mib} MiB holder (SIGTERM), run {run}", [], 10,
                                                      signal.SIGTERM, budget=0.5),
                lambda run=run: self.scenario_release(f"holder ignoring SIGTERM (SIGKILL at once), kill_timeout 2, run {run}", ["--ignore-term"], 2,
                                                      signal.SIGKILL, budget=2.5),
                lambda run=run: self.scenario_release(f"orphaned child forked after CUDA init, parent killed, run {run}",
                                                      ["--fork-child"], 10, signal.SIGKILL, child=True),
            ]
        scenarios = [self.scenario_idle, self.scenario_busy_facts] + releases + [
            self.scenario_sigkill_at_once_ignored,
            self.scenario_sigkill_at_once_unshare,
            self.scenario_protected,
            self.scenario_check_mode,
            self.scenario_role,
            self.scenario_multi_gpu,
            self.scenario_attribution,
            self.scenario_health,
            self.scenario_fabric,
            self.scenario_smoke,
        ]
        if self.only:
            scenarios = [getattr(self, "scenario_" + name) for name in self.only]
        try:
            for scenario in scenarios:
                try:
                    scenario()
                except Exception as exc:  # one broken scenario must not hide the others
                    self.record(getattr(scenario, "__name__", "scenario"), False, error=repr(exc))
                    self.end_all()
        finally:
            self.end_all()
            self.results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            with open(os.path.join(self.out, "results.json"), "w") as handle:
                json.dump(self.results, handle, indent=2, default=str)
            shutil.rmtree(self.tmp, ignore_errors=True)
        failed = [s["name"] for s in self.results["scenarios"] if not s["ok"]]
        print("{} passed, {} failed".format(len(self.results["scenarios"]) - len(failed), len(failed)))
        return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--mib", type=int, default=40960)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each release scenario")
    parser.add_argument("--only", action="append", help="run only this scenario (idle, multi_gpu, ...); repeatable")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the modules need to see and signal every holder")
    os.makedirs(args.out, exist_ok=True)
    sys.exit(Run(args.out, args.gpu, args.mib, args.repeat, args.only).main())


if __name__ == "__main__":
    main()
