"""`make fleet-up` / `make fleet-down` (issue 67): `fleet.py try` keeps a fleet up to try one's own
playbook on, with vLLM on a host and a Proxmox-LXC-shaped guest whose own systemd runs vLLM on
another; it prints the inventory and commands that work as printed. Run here through the CLI, as
make runs it, under a prefix of its own (never the user's `zmf`), and taken down by `fleet.py down`
(also when the test fails)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

import fleet as rig
import guests

PREFIX = rig.checkout_prefix("k")
CLI = [sys.executable, str(rig.FLEET_DIR / "fleet.py")]


@pytest.fixture
def kept_fleet():
    why = None if os.geteuid() == 0 and shutil.which("systemd-nspawn") else "a fleet needs root and systemd-nspawn"
    if why:
        if os.environ.get("ZEROMIB_FLEET_REQUIRED") == "1" or os.environ.get("CI"):
            pytest.fail(f"fleet required (CI / ZEROMIB_FLEET_REQUIRED=1) but: {why}")
        pytest.skip(why)
    try:
        yield rig.Fleet(PREFIX)
    finally:
        subprocess.run([*CLI, "down", "--name", PREFIX], capture_output=True, text=True, timeout=120, check=False)


def test_fleet_try_prints_commands_that_free_the_host_and_the_lxc_guest_then_down_removes_it(kept_fleet):
    up = subprocess.run([*CLI, "try", "--hosts", "2", "--name", PREFIX], capture_output=True, text=True, timeout=300,
                        check=False)
    assert up.returncode == 0, up.stdout + up.stderr
    fleet = rig.Fleet(PREFIX)
    lines = up.stdout.splitlines()
    assert f"inventory: {fleet.inventory}" in "\n".join(lines) and fleet.inventory.exists(), up.stdout
    assert lines[-1] == "take it down: make fleet-down", up.stdout
    vllm_host, guest_host = fleet.hosts[0]["name"], rig.guest_host(fleet)["name"]
    assert f"{guest_host} holds a Proxmox-LXC-shaped guest 101 (/lxc/101/ns)" in up.stdout, up.stdout
    # The guest as its host's kernel shows it: a real systemd below /lxc/101/ns whose vllm.service holds GPU 7.
    guest = guests.Guest("lxc", "101", "/lxc/101/ns", "/lxc.monitor/101", "", 7)
    init = fleet.ssh(guest_host, f"cat {guests.CG}/lxc/101/ns/init.scope/cgroup.procs", check=True).stdout.split()
    assert init, "no init in the guest's cgroup"
    guest.init_pid = int(init[0])
    assert guests.unit_state(fleet, guest_host, guest)[:2] == ("active", "enabled")
    assert fleet.gpu_memory(guest_host)[7] >= 1000 and min(fleet.gpu_memory(vllm_host).values()) >= 1000

    # The printed free_gpus.yml command, as printed (from the checkout, with the checkout's venv).
    free = next(line.strip() for line in lines if "playbooks/free_gpus.yml" in line)
    argv = shlex.split(free)
    r = subprocess.run([str(rig.REPO / ".venv" / "bin" / argv[0]), *argv[1:]], cwd=rig.REPO, capture_output=True,
                       text=True, timeout=300, env=rig.ansible_env(fleet.ansible_cfg), check=False)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert set(fleet.gpu_memory(vllm_host).values()) == {0} and fleet.gpu_memory(guest_host)[7] == 0
    assert guests.unit_state(fleet, guest_host, guest)[0] == "inactive"

    down = subprocess.run([*CLI, "down", "--name", PREFIX], capture_output=True, text=True, timeout=120, check=False)
    assert down.returncode == 0 and json.loads(down.stdout)["hosts"] == 2, down.stdout + down.stderr
    assert rig.Fleet(PREFIX).leftovers() == [], rig.Fleet(PREFIX).leftovers()
