# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Issues 57 and 58 on a real NVIDIA GPU: half-dead holders and what the kills leave in /dev/shm,
through the real modules (ansible ad-hoc, connection local), checked with nvidia-smi.

Run as root on a host with an NVIDIA GPU, PyTorch and ansible-core:
    python3 tests/gpu/half_dead.py --out DIR [--gpu 0] [--mib 4096]
Scenarios (each starts its own holder and ends only what it started, by PID, zombie leaders too):
  floor       a holder that ignores SIGTERM: SIGKILL at once (the floor of a release);
  running     a plain holder: SIGTERM, it exits;
  stopped     a holder stopped with SIGSTOP (Ctrl-Z): SIGKILL at once, not after kill_timeout;
  zombie      a zombie leader whose worker thread holds the GPU: found, attributed, SIGKILLed;
  shm         a holder whose multiprocessing workers share tensors through /dev/shm files: what
              the release leaves there, and the opt-in cleanup (when the modules have it).
Writes results.json and the modules' raw answers into --out. Never resets or reconfigures a GPU.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def smi_used(gpu):
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(gpu)],
                         capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    return int(out) if out.isdigit() else out


def adhoc_result(stdout):
    """An ad-hoc run's one result: its default callback prints `localhost | STATUS => {json}` (the
    json callback left ansible-core for ansible.posix in 2.19)."""
    at = stdout.find("localhost | ") if stdout.startswith("localhost | ") else stdout.find("\nlocalhost | ")
    head, sep, body = stdout[at:].partition(" => ") if at >= 0 else ("", "", "")
    if not sep or "\n" in head.strip():
        raise ValueError("no ad-hoc result")
    return json.JSONDecoder().raw_decode(body.lstrip())[0]


def remove_own_shm(pids, before):
    """Remove what this run's holders left in /dev/shm (PyTorch names its segments torch_<PID>_...)."""
    for name in set(shm_files()) - set(before):
        if any(name.startswith(f"torch_{pid}_") for pid in pids):
            os.unlink(os.path.join("/dev/shm", name))


def read(path):
    with open(path) as handle:
        return handle.read()


def shm_files():
    found = {}
    for name in os.listdir("/dev/shm"):
        try:
            info = os.lstat(os.path.join("/dev/shm", name))
        except OSError:
            continue
        found[name] = info.st_size
    return found


class Run:
    def __init__(self, out, gpu, mib, kill_timeout):
        self.out, self.gpu, self.mib, self.kill_timeout = out, gpu, mib, kill_timeout
        self.started = []
        self.holders_started = 0
        self.results = {"gpu": gpu, "mib": mib, "kill_timeout": kill_timeout, "scenarios": {}}
        tmp = tempfile.mkdtemp(prefix="zeromib-half-dead-")
        collections = os.path.join(tmp, "collections", "ansible_collections", "zeromib")
        os.makedirs(collections)
        os.symlink(REPO, os.path.join(collections, "gpu"))
        self.tmp = tmp
        self.env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=os.path.join(tmp, "collections"), ANSIBLE_LOCALHOST_WARNING="False",
                        ANSIBLE_INVENTORY_UNPARSED_WARNING="False", ANSIBLE_NOCOLOR="1")

    def module(self, name, args, check=False):
        """Run zeromib.gpu.<name> once -> (its result, wall seconds of the ansible command)."""
        argv = (["ansible", "localhost", "-c", "local", "-m", "zeromib.gpu." + name] + (["-a", json.dumps(args)] if args else [])
                + ["-e", "ansible_python_interpreter=" + sys.executable] + (["--check", "--diff"] if check else []))
        started = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=300, check=False)
        wall = round(time.monotonic() - started, 3)
        try:
            result = adhoc_result(done.stdout)
            # Ansible prints a module's warnings on stderr, not in the ad-hoc result.
            result["stderr_of_ansible"] = done.stderr[-4000:]
        except ValueError:
            result = {"unparsed": done.stdout[-4000:], "stderr": done.stderr[-4000:], "rc": done.returncode}
        return result, wall

    def holder(self, *extra):
        # One name per holder of the whole run: end_all empties self.started, and a ready file left
        # by an earlier scenario's holder would make this one look ready before it holds anything.
        self.holders_started += 1
        ready = os.path.join(self.tmp, f"ready-{self.holders_started}")
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "cuda_holder.py"), "--gpu", str(self.gpu), "--mib", str(self.mib),
                                 "--ready", ready, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.started.append(proc.pid)
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"holder {extra} did not get ready (rc {proc.poll()})")
            time.sleep(0.1)
        time.sleep(0.5)  # nvidia-smi lists a context a moment after it exists
        return proc.pid

    def state(self, pid):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return None

    def end_all(self):
        """SIGKILL the thread group of each process this run started (a zombie leader too: SIGKILL
        to its PID ends its live threads), then their children."""
        for pid in self.started:
            try:
                for child in read(f"/proc/{pid}/task/{pid}/children").split():
                    os.kill(int(child), signal.SIGKILL)
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in self.started:
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
        self.started.clear()

    def scenario(self, name, extra=(), before=None, facts_first=False, release_args=None):
        record = {"used_before_mib": None}
        shm_before = shm_files()
        try:
            pid = self.holder(*extra)
            if before:
                before(pid)
            record.update(pid=pid, state_before=self.state(pid), used_before_mib=smi_used(self.gpu))
            if facts_first:
                facts, wall = self.module("gpu_facts", {})
                gpu = facts.get("ansible_facts", {}).get("gpu", {})
                record["facts"] = {"wall_s": wall, "holders": [h for h in gpu.get("holders", []) if h.get("pid") == pid],
                                   "clean": gpu.get("clean"), "shm": gpu.get("shm"), "failed": facts.get("failed"),
                                   "msg": facts.get("msg"), "warnings": facts.get("stderr_of_ansible"), "keys": sorted(facts)}
                plan, wall = self.module("gpu_release", dict({"gpus": [self.gpu], "kill_timeout": self.kill_timeout}, **(release_args or {})),
                                         check=True)
                record["check"] = {"wall_s": wall, "failed": plan.get("failed"), "msg": plan.get("msg"), "diff": plan.get("diff"),
                                   "killed": plan.get("killed")}
            result, wall = self.module("gpu_release", dict({"gpus": [self.gpu], "kill_timeout": self.kill_timeout}, **(release_args or {})))
            record.update(release_wall_s=wall, released=result.get("released"), elapsed_s=result.get("elapsed_s"),
                          timings=result.get("timings"), killed=result.get("killed"), msg=result.get("msg"),
                          shm_removed=result.get("shm_removed"), shm=result.get("shm"), warnings=result.get("stderr_of_ansible"),
                          used_after_mib=smi_used(self.gpu), state_after=self.state(pid))
            if name.startswith("shm"):
                record["shm_left_after_release"] = {k: v for k, v in shm_files().items() if k not in shm_before}
                facts, _wall = self.module("gpu_facts", {})
                record["facts_after"] = facts.get("ansible_facts", {}).get("gpu", {}).get("shm")
            with open(os.path.join(self.out, f"{name}.json"), "w") as handle:
                json.dump({"release": result}, handle, indent=1, default=str)
        finally:
            holders = list(self.started)
            self.end_all()
            if name.startswith("shm"):
                record["shm_left_at_end"] = {k: v for k, v in shm_files().items() if k not in shm_before}
                remove_own_shm(holders, shm_before)
        self.results["scenarios"][name] = record
        print(name, json.dumps({k: record.get(k) for k in ("state_before", "used_before_mib", "released", "elapsed_s", "release_wall_s",
                                                           "used_after_mib", "killed", "msg")}, default=str), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--mib", type=int, default=4096)
    parser.add_argument("--kill-timeout", type=float, default=5)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    run = Run(args.out, args.gpu, args.mib, args.kill_timeout)
    scenarios = [
        ("floor", {"extra": ["--ignore-term"]}),
        ("running", {}),
        ("stopped", {"before": lambda pid: os.kill(pid, signal.SIGSTOP)}),
        ("zombie", {"extra": ["--zombie-leader"], "facts_first": True}),
        ("shm", {"extra": ["--shm-workers", "2"], "facts_first": True, "release_args": {"clean_shm": True}
                 if "clean_shm" in read(os.path.join(REPO, "plugins", "modules", "gpu_release.py")) else None}),
    ]
    try:
        for repeat in range(args.repeat):
            for name, kwargs in scenarios:
                if not args.only or name in args.only:
                    run.scenario(name if repeat == 0 else f"{name}-{repeat}", **kwargs)
    finally:
        run.end_all()
        with open(os.path.join(args.out, "results.json"), "w") as handle:
            json.dump(run.results, handle, indent=1, default=str)


if __name__ == "__main__":
    main()
