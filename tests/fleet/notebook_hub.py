#!/usr/bin/env python
"""A notebook hub in miniature, for the fleet: it starts "kernels" as its own children, inside
its own systemd unit, as jupyterhub's LocalProcessSpawner does (docs/docsite/rst/guide_design.rst, field behaviour: jupyterhub's kernels
run inside jupyterhub.service). Installed on fleet hosts as /usr/local/bin/jupyterhub, so that
its process is named like the real hub (comm "jupyterhub", `python3 /usr/local/bin/jupyterhub`),
and run by a unit with another name (notebook-hub.service): gpu_release must tell it is a
launcher from its main process, not from its unit's name.

A kernel is asked for by dropping a JSON file into SPOOL: {"gpus": "0", "mib": 1000, "ready":
"/run/nvidia-sim/ready/hub-1"}; the hub starts `gpu_holder` with those and removes the file.
Stdlib only, Python 3.8+.
"""
import json
import os
import subprocess
import sys
import time

SPOOL = "/run/nvidia-sim/hub/spawn"
HOLDER = "/usr/local/bin/gpu_holder"
POLL_S = 0.05


def spawn(request):
    argv = [HOLDER, "--gpus", str(request.get("gpus", "0")), "--mib", str(request.get("mib", 1024)),
            "--name", "ipykernel_launcher"]
    if request.get("ready"):
        argv += ["--ready-file", request["ready"]]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    os.makedirs(SPOOL, exist_ok=True)
    kernels = []
    print(f"hub {os.getpid()}: spawning kernels from {SPOOL}", flush=True)
    while True:
        for name in sorted(os.listdir(SPOOL)):
            if not name.endswith(".json"):
                continue
            path = os.path.join(SPOOL, name)
            try:
                with open(path) as handle:
                    request = json.load(handle)
            except (OSError, ValueError) as exc:
                print(f"bad request {name}: {exc}", file=sys.stderr, flush=True)
                request = None
            os.unlink(path)
            if request is not None:
                kernels.append(spawn(request))
                print(f"kernel {kernels[-1].pid}: {request}", flush=True)
        # A kernel that ended (killed by gpu_release) is reaped; the hub lives on.
        kernels = [k for k in kernels if k.poll() is None]
        time.sleep(POLL_S)


if __name__ == "__main__":
    main()
