"""`make demo`: a simulated 4-node GPU fleet with busy GPUs, freed and audited by zeromib.gpu.

Brings up 4 Debian 12 hosts (systemd-nspawn, real systemd and sshd, simulated NVIDIA GPUs; see
tests/fleet/README.md), starts what a busy GPU fleet runs, shows the GPU memory of every host,
runs playbooks/free_gpus.yml (Ansible's own output, ending with the fleet summary), shows the
memory again, puts back what was stopped with playbooks/restore_gpus.yml (as a training play's
`always` does when training ends), runs playbooks/audit_gpus.yml into ./gpu_audit_report (nothing
left pending restore), and tears the fleet down, also on Ctrl-C or failure. Exits non-zero when
freeing or the restore failed. Needs root; stdlib only.

    .venv/bin/python tests/fleet/demo.py [--keep] [--name PREFIX]   # --keep: leave the fleet up afterwards
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet as rig  # noqa: E402

REPO = rig.REPO
VENV_BIN = Path(sys.executable).parent if (Path(sys.executable).parent / "ansible-playbook").exists() \
    else REPO / ".venv" / "bin"
# Its own prefix: never the tests' fleet (t.....), nor another checkout's demo.
PREFIX = "demo" + hashlib.sha1(str(REPO).encode()).hexdigest()[:4]
HOSTS = 4
REPORT_DIR = "gpu_audit_report"


def say(msg: str = "") -> None:
    print(msg, flush=True)


def banner(msg: str) -> None:
    say()
    say(f"==> {msg}")


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def prerequisites() -> str | None:
    if os.geteuid() != 0:
        return "the demo needs root (network namespaces, cgroups, systemd-nspawn): run it as root"
    for tool in ("systemd-nspawn", "mmdebstrap", "ssh", "ip"):
        if not shutil.which(tool):
            return f"{tool} is missing: run `make demo-deps` (tests/tools/apt-deps.sh installs it)"
    if not (VENV_BIN / "ansible-playbook").exists():
        return f"no ansible-playbook in {VENV_BIN}: run `make demo-deps`"
    return None


def ansible_env(fleet: rig.Fleet) -> dict:
    env = rig.ansible_env(fleet.ansible_cfg)
    env.update({"ANSIBLE_DISPLAY_SKIPPED_HOSTS": "0", "PATH": f"{VENV_BIN}:{env.get('PATH', '')}"})
    return env


def gpu_lines(fleet: rig.Fleet, labels: dict[str, str]) -> list[str]:
    """One line per host: its GPUs' MiB used, and what runs on it."""
    query = ("nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | paste -sd' '; "
             "systemctl is-active vllm.service sglang.service | paste -sd' '; "
             "systemctl is-enabled sglang.service 2>/dev/null || true")
    rows = []
    for h in fleet.hosts:
        r = fleet.ssh(h["name"], query)
        out = r.stdout.splitlines() + ["", "", ""]
        mib = [int(x) for x in out[0].split()] if out[0] else []
        vllm, sglang = (out[1].split() + ["?", "?"])[:2]
        units = [f"vllm.service {vllm}"] if vllm != "inactive" else []
        if sglang != "inactive" or out[2] == "enabled":
            units.append(f"sglang.service {sglang}, {out[2] or '?'}")
        what = "; ".join(units + ([labels[h["name"]]] if labels.get(h["name"]) else []))
        rows.append(f"  {h['name']:<13} {h['gpu_count']}x {h['preset']:<9} "
                    f"{sum(mib):>7} MiB  [{' '.join(str(m) for m in mib)}]" + (f"  {what}" if what else ""))
    return rows


def run_streaming(cmd: list[str], env: dict) -> int:
    """Runs CMD with its output going straight to the terminal; ends it (by its PID) if we are
    interrupted meanwhile."""
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    try:
        return p.wait()
    except BaseException:
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", action="store_true", help="leave the fleet up (tear it down with "
                                                        f"`python3 tests/fleet/fleet.py down --name {PREFIX}`)")
    ap.add_argument("--name", default=PREFIX, help="the fleet's prefix (default %(default)s, this checkout's demo; "
                                                   "tests/fleet/test_demo.py gives its own)")
    a = ap.parse_args(argv)
    prefix = a.name
    why = prerequisites()
    if why:
        print(f"demo: {why}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    times: dict[str, float] = {}
    fleet = rig.Fleet(prefix)
    freed_rc = None
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        banner(f"Booting a simulated fleet of {HOSTS} GPU nodes (systemd-nspawn, prefix {prefix})")
        t = time.monotonic()
        fleet.up(HOSTS, "mixed")
        times["up"] = time.monotonic() - t
        say(f"    {len(fleet.hosts)} hosts up in {times['up']:.1f} s; inventory {fleet.inventory}")
        # The MIG node idles at 55 MiB per GPU: an inventory group_vars file gives that group,
        # and only it, a higher threshold (as README.md advises).
        fleet.write_baselines()  # the same group_vars as `fleet.py up`

        banner("Starting what a busy GPU fleet runs")
        names = [h["name"] for h in fleet.hosts]
        labels = {n: "persistenced" for n in names}
        for n in names:
            fleet.workload(n, "persistenced")
        vllm_host, sglang_host, orphan_host = names[0], names[1], names[2]
        fleet.workload(vllm_host, "vllm")
        labels[vllm_host] += ", vLLM EngineCore + 8 workers (Restart=always)"
        fleet.workload(sglang_host, "sglang")
        train = fleet.workload(sglang_host, "train", gpus="0,1", mib=8192)
        labels[sglang_host] += f", SGLang, stray train.py (pid {train['pid']}, SSH session)"
        orphan = fleet.workload(orphan_host, "orphan", gpus="1", mib=16384)
        labels[orphan_host] += f", orphaned CUDA child (pid {orphan['child_pid']}, parent killed)"
        if len(names) > 3:
            labels[names[3]] += "; MIG, idles at 55 MiB per GPU"

        banner("GPU memory before (MiB used per host, then per GPU)")
        for line in gpu_lines(fleet, labels):
            say(line)

        extra = {"free_gpus_services": ["vllm*.service", "sglang.service"],
                 "free_gpus_service_state": "disabled", "free_gpus_kill_timeout": 2}
        cmd = [str(VENV_BIN / "ansible-playbook"), "-i", str(fleet.inventory), "playbooks/free_gpus.yml",
               "-e", json.dumps(extra)]
        banner("Freeing every GPU: ansible-playbook -i " + str(fleet.inventory) + " playbooks/free_gpus.yml"
               + " -e '" + json.dumps(extra) + "'")
        t = time.monotonic()
        freed_rc = run_streaming(cmd, ansible_env(fleet))
        times["free"] = time.monotonic() - t

        banner("GPU memory after")
        time.sleep(1.5)  # vllm.service has Restart=always (RestartSec=1): show that it stays down
        for line in gpu_lines(fleet, {}):
            say(line)

        cmd = [str(VENV_BIN / "ansible-playbook"), "-i", str(fleet.inventory), "playbooks/restore_gpus.yml"]
        banner("Putting back what was stopped (as when training ends): ansible-playbook -i " + str(fleet.inventory)
               + " playbooks/restore_gpus.yml")
        t = time.monotonic()
        restored_rc = run_streaming(cmd, ansible_env(fleet))
        times["restore"] = time.monotonic() - t
        if freed_rc == 0 and restored_rc != 0:
            freed_rc = restored_rc

        banner("GPU memory after the restore (the inference servers are back; the stray and orphaned processes are not)")
        for line in gpu_lines(fleet, {}):
            say(line)

        report_dir = Path.cwd() / REPORT_DIR
        cmd = [str(VENV_BIN / "ansible-playbook"), "-i", str(fleet.inventory), "playbooks/audit_gpus.yml",
               "-e", json.dumps({"gpu_audit_report_dir": str(report_dir)})]
        banner(f"Auditing the fleet as it runs now (read-only; the servers put back hold their GPUs again) into {report_dir}/")
        t = time.monotonic()
        audit_rc = run_streaming(cmd, ansible_env(fleet))
        times["audit"] = time.monotonic() - t
        if (report_dir / "report.html").exists():
            say(f"    Report: {report_dir / 'report.html'} (also report.json, report.md, gpu_audit.prom)")
        else:
            say(f"    audit_gpus.yml wrote no report (rc {audit_rc})")
    except KeyboardInterrupt as e:
        print(f"\ndemo: interrupted ({str(e) or 'Ctrl-C'}); tearing the fleet down", file=sys.stderr)
        freed_rc = freed_rc if freed_rc not in (None, 0) else 130
    except Exception as e:  # noqa: BLE001 - whatever broke, the fleet goes down and we say why
        print(f"\ndemo: {type(e).__name__}: {e}", file=sys.stderr)
        freed_rc = freed_rc if freed_rc not in (None, 0) else 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave half a fleet
        if a.keep and freed_rc is not None:
            say(f"\n    fleet kept: python3 tests/fleet/fleet.py down --name {prefix}")
        else:
            t = time.monotonic()
            try:
                fleet.down()
                times["down"] = time.monotonic() - t
            except Exception as e:  # noqa: BLE001
                print(f"demo: teardown failed: {e}; run `python3 tests/fleet/fleet.py down --name {prefix}`",
                      file=sys.stderr)
                freed_rc = freed_rc or 1
    total = time.monotonic() - t0
    banner("Done: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()) + f"; wall time {total:.1f} s")
    if freed_rc == 130:
        say("    interrupted")
        return 130
    if freed_rc != 0:
        say(f"    FAILED: free_gpus.yml, restore_gpus.yml or the demo itself ended with rc {freed_rc}")
        return freed_rc or 1
    say("    every GPU of every node was freed and verified, and what was stopped was put back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
