# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A pathological node against a plain one (issue 66): gpu_facts, gpu_release and the Slurm epilog on
one simulated host (tests/sim NsHost, h200x2), first plain, then with what its tenants can make of
it: 10,000 processes holding 100,000 open files, 300,000 empty files in /dev/shm, 1,000 job
cgroups, a 100 MB kernel log, 30 processes of another job blocked in execve on their user's stalled
FUSE mount, and 20 system-container guests (the tenant kit, tests/tenants/). Time, peak memory and
result size of each case, on each host, and the targets:

- each case within TARGET_EXTRA_S seconds and TARGET_EXTRA_MIB MiB more than on the plain host;
- every result under TARGET_BYTES;
- the Slurm epilog of a job with one leftover within TARGET_EPILOG_S beside the 30 blocked
  processes of another job (and passing).

    make bench            # runs it after the fleet benchmarks (benchmarks/run.py)
    .venv/bin/python benchmarks/pathological_node.py [--reps 3] [--processes 10000] [--out FILE] [--before DIR]

`--before DIR` runs another checkout's modules and Slurm runner (DIR/plugins) on the same hosts,
taking turns with this one's, rep by rep: a before and after in the same minutes of one machine.

Each module runs as Ansible runs it on the node (its main(), its arguments from a file), in a driver
process that reports the module's wall time, its peak resident memory (ru_maxrss; the forked
readers' apart) and the bytes of its JSON answer; Ansible's own start (~2 s here) is left out, as it
is the same on both hosts. Needs root (the rig does). Acts only inside the host it creates; the
host's end ends every process it made.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "sim")]
from nshost import NsHost, _cgroup2_mount  # noqa: E402
from tenants import other_job, shm_flood, stalled_fuse  # noqa: E402

VENV_PYTHON = os.path.join(REPO, ".venv", "bin", "python")
COLLECTIONS = os.path.join(REPO, ".build", "collections")
TARGET_EXTRA_S = 2.0
TARGET_EXTRA_MIB = 100.0
TARGET_BYTES = 256 * 1024
TARGET_EPILOG_S = 5.0

# The module as Ansible runs it on the node: its main() with the arguments from a file (AnsibleModule
# reads sys.argv[1]), its JSON answer captured; then the driver's own figures.
DRIVER = r"""
import contextlib, io, json, resource, runpy, sys, tempfile, time
module, args = sys.argv[1], sys.argv[2]
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
    handle.write(json.dumps({"ANSIBLE_MODULE_ARGS": json.loads(args)}))
sys.argv = [module, handle.name]
out = io.StringIO()
started = time.monotonic()
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module("ansible_collections.zeromib.gpu.plugins.modules." + module, run_name="__main__")
    except SystemExit:
        pass
wall = time.monotonic() - started
text = out.getvalue()
try:
    answer = json.loads(text)
except ValueError:
    answer = {"failed": True, "msg": text[-2000:]}
own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall_s": round(wall, 3), "peak_mib": round(own.ru_maxrss / 1024, 1),
                  "cpu_s": round(own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, 3),
                  "bytes": len(text), "failed": bool(answer.get("failed")), "msg": str(answer.get("msg") or "")[:300],
                  "released": answer.get("released"), "killed": [k.get("pid") for k in answer.get("killed") or []],
                  "truncated": answer.get("truncated") or (answer.get("ansible_facts") or {}).get("gpu", {}).get("truncated"),
                  "shm": {k: v for k, v in ((answer.get("ansible_facts") or {}).get("gpu", {}).get("shm") or {}).items() if k != "unheld"}}))
"""

# The epilog as slurmd runs it, timed with its peak memory (the runner is this driver's child).
EPILOG = r"""
import json, resource, subprocess, sys, time
started = time.monotonic()
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall_s": round(time.monotonic() - started, 3), "rc": proc.returncode, "stderr": proc.stderr[-500:],
                  "peak_mib": round(kids.ru_maxrss / 1024, 1), "cpu_s": round(kids.ru_utime + kids.ru_stime, 3)}))
"""

# Processes of the node: N children of one parent, each with F files open (/dev/null), the first G
# also /dev/nvidiactl (NVML clients, in the guests); all pause until the host ends.
SWARM_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int n = atoi(argv[1]), files = atoi(argv[2]), clients = atoi(argv[3]);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[4]);
    FILE *out = fopen(tmp, "w");
    for (int i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid == 0) {
            for (int j = 0; j < files; j++) open("/dev/null", O_RDONLY);
            if (i < clients) open("/dev/nvidiactl", O_RDWR);
            for (;;) pause();
        }
        if (pid < 0) { perror("fork"); break; }
        fprintf(out, "%d\n", pid);
    }
    fclose(out);
    rename(tmp, argv[4]);
    for (;;) pause();
}
"""


def module_run(host, module, args, collections=COLLECTIONS):
    env = {"PYTHONPATH": collections, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
    proc = host.run([VENV_PYTHON, "-c", DRIVER, module, json.dumps(args)], env=env, timeout=300)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"{module}: no answer: {proc.stdout[-1000:]} {proc.stderr[-2000:]}") from None


def epilog_run(host, runner, workdir, job, gpus):
    config, log = os.path.join(workdir, f"config-{job}.json"), os.path.join(workdir, f"log-{job}.jsonl")
    with open(config, "w") as handle:
        json.dump({"drain": False, "log": log}, handle)
    os.chmod(config, 0o600)
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus, "SLURM_SCRIPT_CONTEXT": "epilog_slurmd",
           "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = host.run(["/usr/bin/python3", "-c", EPILOG, "/usr/bin/python3", runner, "epilog", f"--config={config}"], env=env, timeout=300)
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(log) as handle:
        entry = json.loads(handle.read().splitlines()[-1])
    figures.update(ok=entry["ok"], causes=entry.get("causes"), killed=[k["pid"] for k in entry.get("killed") or []], bytes=len(json.dumps(entry)))
    return figures


def cases(host, code, workdir, reps, tag):
    """Each case `reps` times for each checkout of `code` ({name: (its collections, its packed
    runner)}, taking turns) -> {name: {case: [figures, ...]}}; gpu_release and the epilog each free
    one leftover (a new one each time: a process on GPU 0; the epilog's in its job's cgroup)."""
    out = {name: {"gpu_facts": [], "gpu_release": [], "epilog": []} for name in code}
    for rep in range(reps):
        for turn, (name, (collections, runner)) in enumerate(sorted(code.items())):
            out[name]["gpu_facts"].append(module_run(host, "gpu_facts", {"timeout": 10}, collections))
            left = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
            run = module_run(host, "gpu_release", {"gpus": ["0"], "timeout": 10, "kill_timeout": 2, "wait_timeout": 10}, collections)
            run["freed_leftover"] = left.pid in run["killed"]
            out[name]["gpu_release"].append(run)
            job = f"{tag}{rep:d}{turn:d}"
            left = other_job.leftover(host, job, gpu=0, mib=2048)
            run = epilog_run(host, runner, workdir, job, "0")
            run["freed_leftover"] = left.pid in run["killed"]
            out[name]["epilog"].append(run)
    return out


def swarm(host, workdir, processes, files_each, clients):
    """The node's processes -> their host pids (children of one parent, found by PPid in
    /proc/PID/status, which every process answers)."""
    source, binary, pids = (os.path.join(workdir, name) for name in ("swarm.c", "swarm", "swarm.pids"))
    with open(source, "w") as handle:
        handle.write(SWARM_C)
    subprocess.run(["cc", "-O2", "-o", binary, source], check=True)
    parent = host.spawn([binary, str(processes), str(files_each), str(clients), pids], ready=False)
    deadline = time.monotonic() + 300
    while not os.path.exists(pids):
        if time.monotonic() > deadline:
            raise SystemExit("the swarm did not start")
        time.sleep(0.2)
    with open(pids) as handle:
        started = len(handle.read().split())
    if started < processes:
        raise SystemExit(f"the swarm started {started:d} of {processes:d} processes (the machine's pid_max?)")
    time.sleep(1.0)  # the last children open their files
    parent_host = parent.host_pid
    children = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as handle:
                    if f"\nPPid:\t{parent_host}\n" in handle.read():
                        children.append(int(name))
            except OSError:
                continue
    return sorted(children)


def place(host, children, cgroups, guests):
    """The first `guests` children in system containers' cgroups (LXD's lxc.payload.<name>), the
    next `cgroups` each in a job's task cgroup."""
    mount = _cgroup2_mount()
    for index, pid in enumerate(children[:guests + cgroups]):
        if index < guests:
            path = host.user_cgroup(f"lxc.payload.guest{index:d}/system.slice/app.service", owner=None)
        else:
            path = other_job.task_cgroup(host, str(5000 + index))
        with open(os.path.join(mount, path.lstrip("/"), "cgroup.procs"), "w") as handle:
            handle.write(str(pid))


def big_kernel_log(host, workdir, mib):
    """A kernel log of `mib` MiB (none of it the NVIDIA driver's): journalctl and dmesg inside the
    host print it whole, whatever they are asked."""
    path = os.path.join(workdir, "kernel.log")
    line = "2026-12-06T10:00:00+0000 node kernel: usb 1-1: device descriptor read/64, error -71 {:08d}\n"
    with open(path, "w") as handle:
        written, n = 0, 0
        while written < mib << 20:
            text = line.format(n)
            handle.write(text)
            written, n = written + len(text), n + 1
    script = os.path.join(workdir, "print-kernel-log")
    with open(script, "w") as handle:
        handle.write(f"#!/bin/sh\nexec cat {path}\n")
    os.chmod(script, 0o755)
    for tool in ("journalctl", "dmesg"):
        where = host.run(["sh", "-c", f"command -v {tool}"]).stdout.strip()
        if where:
            host.run(["mount", "--bind", script, where], check=True)


def summary(runs):
    return {"wall_s": round(statistics.median(r["wall_s"] for r in runs), 3), "cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 3),
            "peak_mib": max(r["peak_mib"] for r in runs), "bytes": max(r["bytes"] for r in runs)}


def report(args, plain, bad, built_s, started):
    """The page: one table for each checkout (this one's first), its verdict this one's."""
    names = ["this"] + sorted(name for name in plain if name != "this")
    tables, met = [], True
    for name in names:
        rows, verdict = table(plain[name], bad[name])
        if name != "this":
            tables += ["", f"Before ({args.before}), the same hosts, taking turns with this checkout:", ""]
        tables += ["| case | plain s | pathological s | extra s | plain CPU s | pathological CPU s | extra CPU s | plain peak MiB | pathological peak MiB "
                   "| extra MiB | plain bytes | pathological bytes | target (wall) |",
                   "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"] + rows
        met = met and verdict if name == "this" else met
    return page(args, plain, bad, built_s, started, tables), met


def table(plain, bad):
    rows, verdicts = [], []
    for case in ("gpu_facts", "gpu_release", "epilog"):
        p, b = summary(plain[case]), summary(bad[case])
        extra_s, extra_mib = round(b["wall_s"] - p["wall_s"], 3), round(b["peak_mib"] - p["peak_mib"], 1)
        ok = extra_s <= TARGET_EXTRA_S and extra_mib <= TARGET_EXTRA_MIB and b["bytes"] < TARGET_BYTES
        if case == "epilog":
            ok = ok and b["wall_s"] <= TARGET_EPILOG_S and all(r["ok"] and r["freed_leftover"] for r in bad[case])
        elif case == "gpu_release":
            ok = ok and all(not r["failed"] and r["freed_leftover"] for r in bad[case])
        verdicts.append(ok)
        extra_cpu = round(b["cpu_s"] - p["cpu_s"], 3)
        rows.append(f"| {case} | {p['wall_s']} | {b['wall_s']} | +{extra_s} | {p['cpu_s']} | {b['cpu_s']} | +{extra_cpu} | {p['peak_mib']} | "
                    f"{b['peak_mib']} | +{extra_mib} | {p['bytes']} | {b['bytes']} | {'met' if ok else 'MISSED'} |")
    return rows, all(verdicts)


def page(args, plain, bad, built_s, started, tables):
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        "# Pathological node against a plain one (benchmarks/pathological_node.py)", "",
        f"- date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime(started))}; machine: {platform.node()}, {os.cpu_count()} cores, "
        f"{platform.platform()}, Python {platform.python_version()}; load average at the end {load}",
        f"- command: {' '.join(sys.argv)}; load average at the start {args.load_at_start}",
        "- CPU s: the module's and its children's CPU time (user + system): what the node pays, less bent by a loaded machine "
        "than the wall time",
        f"- node: {args.processes} processes with {args.processes * args.files_each} open files, {args.shm_files} files in /dev/shm, "
        f"{args.cgroups} job cgroups, a {args.kernel_log_mib} MiB kernel log, {args.blocked} blocked processes of another job, "
        f"{args.guests} guests (built in {built_s:.1f} s)",
        f"- medians of {args.reps} runs (peak and size: the largest); targets: +{TARGET_EXTRA_S:g} s and +{TARGET_EXTRA_MIB:g} MiB over "
        f"the plain host, results under {TARGET_BYTES // 1024} KB, the epilog within {TARGET_EPILOG_S:g} s and passing", "",
    ] + tables + ["", "Raw runs:", "", "```json", json.dumps({"plain": plain, "pathological": bad}, indent=1, sort_keys=True)[:20000], "```", ""]
    return "\n".join(lines)


def packed_runner(checkout, path):
    """The Slurm runner of a checkout, packed as the role installs it."""
    subprocess.run(["/usr/bin/python3", os.path.join(REPO, "roles", "slurm_gpu_checks", "files", "pack_runner.py"),
                    os.path.join(checkout, "plugins", "module_utils"), path], check=True, capture_output=True)
    return path


def collections_of(checkout, workdir):
    """A collections path whose zeromib.gpu is `checkout` (its own .build/collections may be missing)."""
    top = os.path.join(workdir, "before-collections")
    os.makedirs(os.path.join(top, "ansible_collections", "zeromib"), exist_ok=True)
    link = os.path.join(top, "ansible_collections", "zeromib", "gpu")
    if not os.path.islink(link):
        os.symlink(checkout, link)
    return top


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--processes", type=int, default=10000)
    parser.add_argument("--files-each", type=int, default=10, help="open files per process (100,000 with 10,000 processes)")
    parser.add_argument("--shm-files", type=int, default=300000)
    parser.add_argument("--cgroups", type=int, default=1000)
    parser.add_argument("--kernel-log-mib", type=int, default=100)
    parser.add_argument("--blocked", type=int, default=30)
    parser.add_argument("--guests", type=int, default=20)
    parser.add_argument("--before", help="another checkout (its plugins/) run on the same hosts, taking turns with this one")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", time.strftime("pathological-%Y-%m-%d-%H%M.md", time.gmtime())))
    args = parser.parse_args()
    args.load_at_start = " ".join(f"{x:.1f}" for x in os.getloadavg())
    started = time.time()
    workdir = tempfile.mkdtemp(prefix="zeromib-patho-")
    code = {"this": (COLLECTIONS, packed_runner(REPO, os.path.join(workdir, "slurm_gpu_checks.pyz")))}
    if args.before:
        before = os.path.abspath(args.before)
        code["before"] = (collections_of(before, workdir), packed_runner(before, os.path.join(workdir, "before.pyz")))
    with NsHost(preset="h200x2", seed="pathological") as host:
        plain = cases(host, code, workdir, args.reps, "71")
        building = time.monotonic()
        children = swarm(host, workdir, args.processes, args.files_each, args.guests)
        place(host, children, args.cgroups, args.guests)
        shm_flood.flood(host, args.shm_files)
        big_kernel_log(host, workdir, args.kernel_log_mib)
        with stalled_fuse.StalledFs(host) as mount:
            other_job.blocked_processes(host, mount, "902", count=args.blocked)
            built_s = time.monotonic() - building
            bad = cases(host, code, workdir, args.reps, "81")
    text, met = report(args, plain, bad, built_s, started)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(text)
    print(text)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
