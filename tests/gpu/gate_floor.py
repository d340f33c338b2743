# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The clean gate against its floor on a real NVIDIA host: ad-hoc `ansible` calls of gpu_release and
gpu_facts on an idle GPU, and the free_gpus role's gate in a play, each timed end to end against a
one-task `nvidia-smi` call made the same way, interleaved, on the same machine in the same minutes.

Run as root on an idle GPU host with ansible-core on the controller Python:
    python3 tests/gpu/gate_floor.py --out DIR [--runs 7] [--collections LABEL=PATH ...]
PATH is a folder holding ansible_collections/zeromib/gpu (default: this checkout's .build/collections,
label "this"); several let a change be measured against the commit before it. Reads only: no module
is given anything to free (an idle GPU), no setting of the GPU is touched. Writes gate_floor.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

ONE_TASK_PLAY = """- hosts: localhost
  connection: local
  gather_facts: false
  tasks:
    - ansible.builtin.command: nvidia-smi
      changed_when: false
"""
ROLE_PLAY = """- hosts: localhost
  connection: local
  gather_facts: false
  roles:
    - zeromib.gpu.free_gpus
"""


def timed(argv, env):
    start = time.monotonic()
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    wall = time.monotonic() - start
    return wall, done.returncode, done.stdout[-2000:]


def contenders(collections, work):
    """(label, argv, collections path) for every call, in the order one round runs them."""
    one_task = os.path.join(work, "one_task.yml")
    role = os.path.join(work, "role.yml")
    with open(one_task, "w", encoding="utf-8") as handle:
        handle.write(ONE_TASK_PLAY)
    with open(role, "w", encoding="utf-8") as handle:
        handle.write(ROLE_PLAY)
    adhoc = ["ansible", "localhost", "-c", "local", "-e", "ansible_python_interpreter=" + sys.executable]
    first = collections[0][1]
    rows = [("ansible -m command -a nvidia-smi", adhoc + ["-m", "command", "-a", "nvidia-smi"], first),
            ("one-task nvidia-smi play", ["ansible-playbook", one_task, "-e", "ansible_python_interpreter=" + sys.executable], first)]
    for label, path in collections:
        rows += [(f"gpu_release [{label}]", adhoc + ["-m", "zeromib.gpu.gpu_release"], path),
                 (f"gpu_facts [{label}]", adhoc + ["-m", "zeromib.gpu.gpu_facts"], path),
                 (f"role gate play [{label}]", ["ansible-playbook", role, "-e", "ansible_python_interpreter=" + sys.executable], path)]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--collections", action="append", default=[], help="LABEL=PATH holding ansible_collections/")
    args = parser.parse_args()
    collections = [tuple(item.split("=", 1)) for item in args.collections] or [("this", os.path.join(REPO, ".build", "collections"))]
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gate-floor-")
    rows = contenders(collections, work)
    times = {label: [] for label, _argv, _path in rows}
    failures = {}
    for _run in range(args.runs + 1):  # the first round warms caches and is dropped
        for label, argv, path in rows:
            env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=os.path.abspath(path), ANSIBLE_STDOUT_CALLBACK="minimal",
                       ANSIBLE_PIPELINING="true", ANSIBLE_HOST_KEY_CHECKING="false", ANSIBLE_LOCALHOST_WARNING="false",
                       ANSIBLE_INVENTORY_UNPARSED_WARNING="false")
            wall, rc, tail = timed(argv, env)
            if rc != 0:
                failures.setdefault(label, tail)
            if _run:
                times[label].append(round(wall, 3))
    floor_adhoc = statistics.median(times["ansible -m command -a nvidia-smi"])
    floor_play = statistics.median(times["one-task nvidia-smi play"])
    summary = {}
    for label, values in times.items():
        median = statistics.median(values)
        floor = floor_play if "play" in label else floor_adhoc
        summary[label] = {"median_s": round(median, 3), "runs_s": values, "over_floor": round(median / floor, 3)}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.used", "--format=csv,noheader"],
                         stdout=subprocess.PIPE, text=True, check=False).stdout.strip()
    report = {"gpus": smi, "runs": args.runs, "collections": dict(collections), "summary": summary, "failures": failures}
    with open(os.path.join(args.out, "gate_floor.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    for label, row in summary.items():
        print(f"{label:40s} {row['median_s']:7.3f} s  x{row['over_floor']}")
    for label, tail in failures.items():
        print(f"FAILED {label}: {tail[-400:]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
