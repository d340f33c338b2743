# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The Slurm epilog's time end to end (python start included), run ON the node as slurmd runs it:
`python3 RUNNER epilog` with the environment slurmd sets (SLURM_JOB_ID, SLURM_JOB_GPUS,
SLURM_SCRIPT_CONTEXT, SLURMD_NODENAME). Beside it, DeepOps' epilog procedure (50-exclusive-gpu:
`kill -9` every PID nvidia-smi lists, `sleep 5`, check again), timed the same way.

  python3 epilog_time.py --runner /usr/local/lib/zeromib-gpu/slurm_gpu_checks.pyz --gpus 0,1 \
      [--runs 10] [--leave-behind 'CMD'] [--ready FILE] [--deepops]

--leave-behind CMD: before each run, start CMD (a holder that has left its job, e.g.
`python3 tests/gpu/cuda_holder.py --gpu 0 --mib 4096 --ready /tmp/r`) with setsid, wait for
--ready to appear, then time the epilog that frees it. Stdlib only; prints one JSON object."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def leave_behind(cmd, ready, timeout=120.0):
    """Start CMD in a session of its own -> the PIDs it wrote (READY, and READY.child when it
    forked one), the processes this benchmark must end if the epilog does not."""
    for path in (ready, ready + ".child"):
        if os.path.exists(path):
            os.unlink(path)
    subprocess.Popen(["setsid", "sh", "-c", cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):
        if time.monotonic() > deadline:
            raise SystemExit(f"not ready after {timeout} s: {cmd}")
        time.sleep(0.02)
    pids = []
    for path in (ready, ready + ".child"):
        if os.path.exists(path):
            with open(path) as handle:
                pids.append(int(handle.read()))
    return pids


def end(pids, timeout=10.0):
    """SIGKILL each of our PIDs still alive, and wait until they are gone."""
    for pid in pids:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in pids):
        time.sleep(0.05)


def zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def used_mib(gpus, nvidia_smi="nvidia-smi"):
    rows = subprocess.run([nvidia_smi, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True,
                          check=False).stdout.splitlines()
    wanted = set(gpus.split(","))
    return sum(int(mib) for index, mib in (row.split(", ") for row in rows) if index in wanted)


def epilog(runner, gpus, job, python, config=None):
    env = {"SLURM_JOB_ID": str(job), "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd",
           "SLURMD_NODENAME": os.uname()[1].split(".")[0], "SLURM_JOB_UID": "0", "SLURM_JOB_USER": "root"}
    started = time.monotonic()
    process = subprocess.Popen([python, runner, "epilog"] + ([f"--config={config}"] if config else []), env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    err = process.stderr.read()
    # This child's own CPU (a holder's CUDA init, reaped elsewhere, must not count).
    _pid, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return time.monotonic() - started, process.returncode, err.strip(), usage.ru_utime + usage.ru_stime


def deepops(nvidia_smi="nvidia-smi"):
    """DeepOps' 50-exclusive-gpu, as it reads (kill -9 each listed PID, sleep 5, list again)."""
    started = time.monotonic()
    listed = subprocess.run([nvidia_smi, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, check=False).stdout
    for pid in [int(p) for p in listed.split() if p.strip().isdigit()]:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    time.sleep(5)
    again = subprocess.run([nvidia_smi, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, check=False).stdout
    return time.monotonic() - started, 0 if not again.strip() else 1


def summary(times):
    times = sorted(times)
    return {"runs": len(times), "median_s": round(statistics.median(times), 3), "min_s": round(times[0], 3),
            "max_s": round(times[-1], 3), "p90_s": round(times[max(0, int(len(times) * 0.9) - 1)], 3)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runner", required=True)
    parser.add_argument("--gpus", required=True, help="the job's GPUs, as SLURM_JOB_GPUS: 0,1")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--python", default="/usr/bin/python3")
    parser.add_argument("--leave-behind")
    parser.add_argument("--ready", default="/tmp/zeromib-epilog-bench.ready")
    parser.add_argument("--deepops", action="store_true")
    parser.add_argument("--config", help="the runner's config (root-owned, mode 0600); default its own path")
    args = parser.parse_args()
    out = {"gpus": args.gpus, "leave_behind": args.leave_behind, "load_avg": os.getloadavg()}
    times, failures, cpu, left = [], [], [], []
    for i in range(args.runs):
        ours = leave_behind(args.leave_behind, args.ready) if args.leave_behind else []
        seconds, rc, err, cpu_s = epilog(args.runner, args.gpus, 900000 + i, args.python, args.config)
        times.append(seconds)
        cpu.append(cpu_s)
        left.append(used_mib(args.gpus))
        if rc != 0:
            failures.append(err)
        end(ours)
    out["epilog"] = summary(times)
    out["epilog_failures"] = failures
    out["epilog_cpu_s_per_run"] = round(statistics.median(cpu), 3)
    out["mib_after_each_epilog"] = left
    if args.deepops:
        ours = leave_behind(args.leave_behind, args.ready) if args.leave_behind else []
        seconds, rc = deepops()
        out["deepops_50_exclusive_gpu"] = {"s": round(seconds, 3), "apps_listed_after": rc != 0, "mib_left": used_mib(args.gpus)}
        end(ours)
        out["mib_after_ending_ours"] = used_mib(args.gpus)
    print(json.dumps(out, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
