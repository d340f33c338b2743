# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Where a clean gate's CPU goes on the fleet: the hosts' side and the controller's, per host.

    .venv/bin/python benchmarks/fleet_cpu.py [--hosts 4,16] [--reps 5] [--markdown]

On the systemd-nspawn fleet of tests/fleet (real sshd, systemd and journalctl; simulated GPUs),
each play below runs in turn, `--reps` times after one warm-up, at each fleet size:

* `free_gpus.yml` as shipped, and the plays that take it apart: the role alone (no fleet summary,
  no final `meta`), the gpu_release module as a plain task (no action plugin), the same with
  `health: false`;
* the one-task nvidia-smi play of benchmarks/run.py, the yardstick of issue 36.

Per play: wall time (`ansible-playbook` start to exit), the hosts' CPU (each container's cgroup
`usage_usec`, before and after: sshd, the module, nvidia-smi, journalctl, every process of the
host) and the controller's (`ansible-playbook`, its workers and ssh clients: rusage of this
script's children), both divided by the number of hosts. With two sizes or more, the
controller's CPU is also split into what one play costs whatever its size and what each host adds
(a least-squares line through the sizes). Medians of the repetitions. Needs root (the rig does);
acts only inside the fleet it creates and tears it down, also on failure.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(REPO, "tests", "fleet"), HERE]
import fleet as rig  # noqa: E402
from run import ONE_TASK  # noqa: E402  (the yardstick, the same play as the fleet benchmark's)

PLAY = """---
- name: {name}
  hosts: gpu_nodes
  gather_facts: false
  become: true
  tasks:
{task}
"""
ROLE_ALONE = """    - name: Run the free_gpus role
      ansible.builtin.import_role:
        name: zeromib.gpu.free_gpus
        rolespec_validate: false
"""
MODULE = """    - name: gpu_release as a plain task
      zeromib.gpu.gpu_release:{args}
"""


def plays(folder: str) -> dict[str, str]:
    """{label: playbook path}, in the order they take turns."""
    written = {
        "role alone (no summary, no meta)": PLAY.format(name="Role alone", task=ROLE_ALONE),
        "gpu_release as a plain task": PLAY.format(name="Module", task=MODULE.format(args="")),
        "gpu_release, health: false": PLAY.format(name="Module without health", task=MODULE.format(args="\n        health: false")),
        "one-task nvidia-smi play": ONE_TASK,
    }
    found = {"free_gpus.yml": os.path.join(REPO, "playbooks", "free_gpus.yml")}
    for index, (label, text) in enumerate(written.items()):
        path = os.path.join(folder, f"play{index}.yml")
        with open(path, "w") as handle:
            handle.write(text)
        found[label] = path
    return found


def hosts_cpu_s(fleet: rig.Fleet) -> float:
    """CPU seconds every host's processes have used so far (cgroup v2 `cpu.stat`)."""
    total = 0
    for host in fleet.hosts:
        with open(os.path.join(host["cgroups"][0], "cpu.stat")) as handle:
            for line in handle:
                if line.startswith("usage_usec "):
                    total += int(line.split()[1])
    return total / 1e6


def children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def one_play(fleet: rig.Fleet, playbook: str, env: dict[str, str]) -> tuple[float, float, float]:
    """(wall s, hosts' CPU s, controller's CPU s) of one run of `playbook`."""
    controller, hosts, began = children_cpu_s(), hosts_cpu_s(fleet), time.monotonic()
    proc = subprocess.run([os.path.join(REPO, ".venv", "bin", "ansible-playbook"), "-i", str(fleet.inventory), playbook, "-l", "gpu_nodes"],
                          capture_output=True, text=True, env=env, cwd=REPO, check=False)
    took = time.monotonic() - began
    if proc.returncode != 0:
        raise SystemExit(f"{playbook} failed on the clean fleet (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    return took, hosts_cpu_s(fleet) - hosts, children_cpu_s() - controller


def line_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (hosts, CPU of a play)."""
    xs, ys = [float(x) for x, _y in points], [y for _x, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def measure(sizes: list[int], reps: int) -> dict[str, dict[int, dict[str, float]]]:
    """{label: {hosts: {wall_s, hosts_ms, controller_ms}}}: medians, CPU per host."""
    rows: dict[str, dict[int, dict[str, float]]] = {}
    fleet = rig.Fleet(rig.checkout_prefix("c"))
    with tempfile.TemporaryDirectory(prefix="fleet-cpu-") as folder:
        contenders = plays(folder)
        try:
            for n in sizes:
                fleet.down()
                fleet.up(n, profile="h200")
                env = dict(rig.ansible_env(fleet.ansible_cfg), ANSIBLE_NOCOLOR="1")
                samples: dict[str, list[tuple[float, float, float]]] = {label: [] for label in contenders}
                for rep in range(reps + 1):
                    for label, playbook in contenders.items():
                        sample = one_play(fleet, playbook, env)
                        if rep:  # the first round warms the hosts' caches and SSH masters
                            samples[label].append(sample)
                for label, values in samples.items():
                    rows.setdefault(label, {})[n] = {
                        "wall_s": round(statistics.median(v[0] for v in values), 3),
                        "hosts_ms": round(1000 * statistics.median(v[1] for v in values) / n, 1),
                        "controller_ms": round(1000 * statistics.median(v[2] for v in values) / n, 1),
                    }
        finally:
            fleet.down()
    return rows


def markdown(rows: dict[str, dict[int, dict[str, float]]]) -> str:
    sizes = sorted(next(iter(rows.values())))
    out = ["| play | " + " | ".join(f"{n} hosts: wall / hosts' CPU a host / controller's CPU a host" for n in sizes) + " |",
           "|---|" + "---|" * len(sizes)]
    for label, by_size in rows.items():
        cells = ["{wall_s:.2f} s / {hosts_ms:.0f} ms / {controller_ms:.0f} ms".format(**by_size[n]) for n in sizes]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    if len(sizes) > 1:
        out += ["", "| play | controller's CPU a play, whatever its size | controller's CPU each host adds |", "|---|---|---|"]
        for label, by_size in rows.items():
            intercept, slope = line_fit([(n, by_size[n]["controller_ms"] * n) for n in sizes])
            out.append(f"| {label} | {intercept:.0f} ms | {slope:.1f} ms |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="4,16", help="fleet sizes, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--markdown", action="store_true", help="a Markdown table instead of JSON")
    args = parser.parse_args()
    sizes = [int(x) for x in args.hosts.split(",") if x.strip()]
    if not sizes or min(sizes) < 1 or args.reps < 1:
        parser.error("--hosts needs sizes of 1 or more and --reps 1 or more")
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = measure(sizes, args.reps)
    if args.markdown:
        print(f"`benchmarks/fleet_cpu.py --hosts {args.hosts} --reps {args.reps}`, {began}, load average at the end "
              + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + "\n")
        print(markdown(rows))
    else:
        print(json.dumps({"date": began, "reps": args.reps, "rows": {k: {str(n): v for n, v in r.items()} for k, r in rows.items()}}, indent=1))


if __name__ == "__main__":
    main()
