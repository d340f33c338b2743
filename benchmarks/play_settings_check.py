# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The free_gpus gate's play-wide settings check (plugin_utils/_play_settings.play_mistakes) on a fleet.

    .venv/bin/python benchmarks/play_settings_check.py [--checkout DIR ...] [--hosts 8,32] [--reps 7]

The first gate of a play checks every host's free_gpus_* variables while every other gate waits on
its lock (issue 67), so its time is the clean gate's at fleet scale. Each host's settings here are
the role's defaults as Ansible's loader reads them (tagged values, as the variable manager hands
them over), the same on every host, as a fleet's group variables are. Prints the CPU of one check,
median of --reps, per checkout and host count; the checkouts take turns, each in its own
interpreter (the validator is built once per process in both)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

ONE = r"""
import json, statistics, sys, time
checkout, hosts, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, checkout + "/.build/collections")
from ansible.parsing.dataloader import DataLoader
from ansible_collections.zeromib.gpu.plugins.plugin_utils import _play_settings
from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_vars import role_options
spec = role_options(checkout + "/roles/free_gpus")
defaults = DataLoader().load_from_file(checkout + "/roles/free_gpus/defaults/main.yml")
settings = {f"h{n}": dict(defaults) for n in range(hosts)}
_play_settings.play_mistakes(settings, spec)
times = []
for _ in range(reps):
    began = time.process_time()
    found = _play_settings.play_mistakes(settings, spec)
    times.append(time.process_time() - began)
print(json.dumps({"ms": round(1000 * statistics.median(times), 2), "mistakes": len(found)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", action="append", help="a checkout with .build/collections (repeatable; default this one)")
    parser.add_argument("--hosts", default="8,32")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    checkouts = [os.path.abspath(c) for c in args.checkout or [REPO]]
    print("| hosts | " + " | ".join(os.path.basename(c.rstrip("/")) for c in checkouts) + " |")
    print("|---:|" + "---:|" * len(checkouts))
    for hosts in [int(h) for h in args.hosts.split(",")]:
        cells = []
        for checkout in checkouts:
            out = subprocess.run([sys.executable, "-c", ONE, checkout, str(hosts), str(args.reps)], capture_output=True, text=True, check=True)
            cells.append("{ms} ms".format(**json.loads(out.stdout)))
        print(f"| {hosts} | " + " | ".join(cells) + " |")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
