# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the fleet-wide proof (issue 72) costs: free_gpus.yml on a clean fleet and on a fleet with one
dirty host, this checkout against a `git archive` of the commit before it, alternated in each
repetition; and how many hosts the proof read (its gpu_facts runs, counted from each host's
free_gpus_result). Runs on the systemd-nspawn fleet of tests/fleet (needs root).

    .venv/bin/python benchmarks/fleet_proof.py --hosts 8 --reps 3
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "fleet"))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import fleet as rig  # noqa: E402
from run import before_collection  # noqa: E402

VENV = os.path.join(REPO, ".venv", "bin")
BEFORE_REV = "b0bbbd9"


def play(fleet, before, variant):
    """free_gpus.yml on every host -> (seconds, rc, hosts the proof read: its summary line says how many)."""
    env = dict(rig.ansible_env(fleet.ansible_cfg), ANSIBLE_NOCOLOR="1")
    playbook = "playbooks/free_gpus.yml"
    if variant == "before":
        env["ANSIBLE_COLLECTIONS_PATH"], playbook = before
    started = time.monotonic()
    proc = subprocess.run([os.path.join(VENV, "ansible-playbook"), "-i", str(fleet.inventory), playbook, "-l", "gpu_nodes"],
                          capture_output=True, text=True, check=False, env=env, cwd=REPO)
    seconds = round(time.monotonic() - started, 3)
    found = re.search(r"fleet-wide proof after .* freed: (\d+) hosts? read once more", proc.stdout)
    return seconds, proc.returncode, int(found.group(1)) if found else 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    before = before_collection(BEFORE_REV)
    fleet = rig.Fleet("zbp")
    times = {}
    try:
        fleet.up(args.hosts, "h200")
        dirty = fleet.hosts[0]["name"]
        for rep in range(args.reps):
            for case in ("clean", "dirty"):
                for variant in (("ours", "before") if rep % 2 == 0 else ("before", "ours")):
                    if case == "dirty":
                        fleet.workload(dirty, "train", gpus="0", mib=4096)
                    seconds, rc, proved = play(fleet, before, variant)
                    times.setdefault((case, variant), []).append((seconds, rc, proved))
    finally:
        fleet.down()
    print(f"free_gpus.yml on {args.hosts} hosts (h200 profile), {args.reps} reps; `before` is a git archive of {BEFORE_REV}")
    print("| case | variant | median s | runs (s) | rc | hosts read by the proof |")
    print("|---|---|---|---|---|---|")
    for (case, variant), runs in sorted(times.items()):
        cells = (case, variant, statistics.median(r[0] for r in runs), ", ".join(str(r[0]) for r in runs), sorted({r[1] for r in runs}),
                 sorted({r[2] for r in runs}))
        print("| {} | {} | {} | {} | {} | {} |".format(*cells))


if __name__ == "__main__":
    main()
