"""Captures what a real slurmd and slurmstepd on cgroup v2 give a job, for the fixtures under
tests/fixtures/slurm-<version>/: each process's /proc/PID/cgroup and the cgroups slurmstepd made
(cgroup-v2/jobN.json), and the environment slurmd gives the prolog and epilog
(cgroup-v2/prolog-env.txt, epilog-env.txt).

Runs ON a fleet host whose one-node cluster is already set up for cgroup v2 (as
test_slurm_checks_fleet.py's cgroup_v2_host fixture does it: proctrack/cgroup, task/cgroup,
PrologFlags=Contain, CgroupPlugin=cgroup/v2, ConstrainDevices=yes, Gres=gpu:8, the v2-only shim)
and with no Prolog=/Epilog= of its own: for the capture it points them at an environment dump,
restarts slurmctld and slurmd, and puts slurm.conf back afterwards.

    ssh -i /run/zeromib-fleet/PREFIX/id_ed25519 -o StrictHostKeyChecking=no root@ADDR python3 - \
        < tests/fleet/capture_slurm_v2.py > OUT.json

Stdlib only (the hosts' python3)."""
import json
import os
import re
import subprocess
import sys
import time

CONF = "/etc/slurm/slurm.conf"
DUMP = "/usr/local/sbin/zeromib-capture-env"
OUT = "/run/zeromib-capture"
KEPT = ("ProctrackType", "TaskPlugin", "PrologFlags", "PrologEpilogTimeout", "UnkillableStepTimeout", "GresTypes")
SCRIPT = "setsid nohup sleep 301 </dev/null >/dev/null 2>&1 & exec sleep 302"


def sh(cmd):
    return subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True).stdout


def read(path):
    with open(path) as f:
        return f.read()


def wait(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit("timed out")


def processes():
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode().strip()
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cgroup") as f:
                cgroup = f.read().splitlines()
        except OSError:
            continue
        out[int(pid)] = {"pid": int(pid), "ppid": ppid, "cmdline": cmdline, "cgroup": cgroup}
    return out


def node_up():
    return subprocess.run("scontrol show node -o | grep -q State=IDLE", shell=True, check=False).returncode == 0


def main():
    original = read(CONF)
    if re.search(r"(?m)^(Prolog|Epilog)=", original):
        raise SystemExit(f"{CONF} names a Prolog= or Epilog= already: capture on a node without hooks")
    os.makedirs(OUT, exist_ok=True)
    with open(DUMP, "w") as f:
        f.write(f"#!/bin/sh\nenv | LC_ALL=C sort > {OUT}/$SLURM_SCRIPT_CONTEXT-$SLURM_JOB_ID.txt\n")
    os.chmod(DUMP, 0o755)
    try:
        with open(CONF, "a") as f:
            f.write(f"Prolog={DUMP}\nEpilog={DUMP}\n")
        sh("systemctl restart slurmctld slurmd")
        wait(node_up)
        job = sh(f"sbatch --parsable -o /dev/null --mem=10M --gres=gpu:1 --wrap '{SCRIPT}'").strip().split(";")[0]

        def both():
            procs = processes()
            return procs if {"sleep 301", "sleep 302"} <= {p["cmdline"] for p in procs.values()} else None
        procs = both() or wait(both)
        scope = next(line[3:] for p in procs.values() if p["cmdline"] == "sleep 302"
                     for line in p["cgroup"] if line.startswith("0::")).split(f"/job_{job}/")[0]
        roles = {"/usr/sbin/slurmstepd infinity": "slurmstepd holding the stepd scope (no job)",
                 f"slurmstepd: [{job}.extern]": "the extern step's slurmstepd",
                 f"slurmstepd: [{job}.batch]": "the batch step's slurmstepd",
                 "sleep 302": "the batch script (exec sleep 302)",
                 "sleep 301": "a process the batch script detached (setsid nohup)"}
        captured = []
        for cmdline, role in roles.items():
            for p in sorted(procs.values(), key=lambda p: p["pid"]):
                if p["cmdline"] == cmdline:
                    captured.append({"role": role, **p})
        dirs = sorted(os.path.join(scope, os.path.relpath(d, "/sys/fs/cgroup" + scope)).rstrip("/.")
                      for d, _sub, _files in os.walk("/sys/fs/cgroup" + scope))
        sh(f"scancel {job}")
        time.sleep(2)
        left = [p["cmdline"] for p in processes().values() if p["cmdline"] in ("sleep 301", "sleep 302")]
        wait(lambda: os.path.exists(f"{OUT}/epilog_slurmd-{job}.txt"))
        envs = {}
        for context in ("prolog_slurmd", "epilog_slurmd"):
            envs[context] = read(f"{OUT}/{context}-{job}.txt")
        config = sh("scontrol show config")
        settings = dict(re.findall(r"(?m)^(\w+)\s*=\s*(.*?)\s*$", config))
        version = sh("slurmd -V").split()[-1]
    finally:
        with open(CONF, "w") as f:
            f.write(original)
        sh(f"rm -rf {DUMP} {OUT}; systemctl restart slurmctld slurmd")
    json.dump({
        "slurm": version,
        "node": os.uname().nodename,
        "job": job,
        "config": {k: settings.get(k) for k in KEPT},
        "cgroup.conf": [line.strip() for line in read("/etc/slurm/cgroup.conf").splitlines() if line.strip()],
        "job_script": SCRIPT,
        "processes": captured,
        "cgroup_dirs": [scope] + [d for d in dirs if d != scope],
        "after_scancel": f"still there 2 s after scancel: {left}" if left else
        "sleep 301 and sleep 302 were gone 2 s after scancel: proctrack/cgroup ends the detached process too",
        "env": envs,
    }, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
