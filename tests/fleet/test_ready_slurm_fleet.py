"""The training-ready profile at the job boundary with real Slurm (issue 71): slurmd runs the prolog
the role zeromib.gpu.slurm_gpu_checks installs, on the fleet's one-node cluster of
test_slurm_checks_fleet.py (its GPUs given as gres). A GPU the inference side left in
EXCLUSIVE_PROCESS fails the prolog; the job does not run and the node is drained, its reason's
first sentence naming the GPU and its compute mode. The site's ready_profile, set through the role,
accepts it, and the next job runs. Nothing is changed on the GPU: the hooks check the profile only.

Runs on a fleet of 1 or more hosts: `ZEROMIB_FLEET_HOSTS=1 ZEROMIB_FLEET_PROFILE=h200 pytest tests/fleet/test_ready_slurm_fleet.py`."""
from __future__ import annotations

import json
import shlex

from scenarios import wait_for
from test_slurm_checks_fleet import drained, install, job, node, submit
from test_slurm_checks_fleet import gres_host, slurm_node  # noqa: F401  # pylint: disable=unused-import  # fixtures, used by name

SETTINGS = "/run/nvidia-sim/settings.json"
LEFT = "compute mode is Exclusive_Process, expected Default"


def compute_modes(fleet, host) -> list[str]:
    out = fleet.ssh(host, "nvidia-smi --query-gpu=compute_mode --format=csv,noheader", check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_a_gpu_left_in_exclusive_process_fails_the_prolog_drains_the_node_naming_it_and_the_sites_profile_accepts_it(gres_host):
    fleet, host = gres_host
    # Every GPU of the node: whichever GRES index slurmd gives the job, its GPU is off the profile.
    left = {gpu["uuid"]: {"compute_mode": "Exclusive_Process"} for gpu in fleet.host(host).gpus}
    fleet.ssh(host, f"printf %s {shlex.quote(json.dumps(left))} > {SETTINGS}", check=True)
    try:
        first = submit(fleet, host, "touch /run/zeromib-ready-job-ran")
        assert wait_for(lambda: drained(node(fleet, host)), timeout=60), (node(fleet, host), job(fleet, host, first))
        reason = node(fleet, host)["Reason"]
        assert reason.startswith(f"zeromib: prolog job {first}: GPU "), reason
        assert LEFT in reason.split("; ")[0], reason
        assert fleet.ssh(host, "test -e /run/zeromib-ready-job-ran").returncode != 0, "the job ran on a GPU off the profile"
        assert set(compute_modes(fleet, host)) == {"Exclusive_Process"}, "the prolog changed a setting"
        fleet.ssh(host, f"scancel --quiet --full {first}; true")

        # The site's training runs one process per GPU: its profile accepts any compute mode.
        done = install(fleet, host, ready_profile={"compute_mode": "any"})
        assert done.rc == 0, str(done)
        fleet.ssh(host, f"scontrol update nodename={host} state=resume", check=True)
        after = submit(fleet, host, "touch /run/zeromib-ready-job-ran")
        assert wait_for(lambda: job(fleet, host, after).get("JobState") == "COMPLETED", timeout=60), (job(fleet, host, after), node(fleet, host))
        assert not drained(node(fleet, host)), node(fleet, host)
    finally:
        fleet.ssh(host, f"rm -f {SETTINGS} /run/zeromib-ready-job-ran; scancel --quiet --full -u root; true")
        install(fleet, host)
