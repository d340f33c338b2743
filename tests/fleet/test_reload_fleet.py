"""No daemon-reload behind a running GPU container's back (issue 69), on a real systemd host
whose systemd manages device access (fleet.py up --device-bpf, TEST_RIGS §8).

The container: a unit with DevicePolicy=strict and DeviceAllow=/dev/null only, as a container
engine on the systemd cgroup driver makes one, given the simulated GPU /dev/nvidia0 by a
stand-in for the NVIDIA runtime's hook (device_hook.py: an allow-all device program attached
from the machine's side, systemd's detached). A plain `systemctl daemon-reload` takes that
access away ("Failed to initialize NVML: Unknown Error" on a real node); gpu_release with
service_state disabled and masked, and gpu_restore, must not.

One host of its own for this module, on Debian 12 (systemd 252) and 13 (257) in turn (conftest's
device_bpf_fleet), torn down at the end, the device programs with it (they go with their cgroups)."""
from __future__ import annotations

import json
import typing as t
from pathlib import Path

import pytest

import device_hook
from scenarios import wait_for

if t.TYPE_CHECKING:
    from conftest import FleetHandle

UNIT_DIR = "/usr/local/lib/systemd/system"  # systemctl mask cannot mask a unit whose file is in /etc
RECORD = "/var/lib/zeromib-gpu/released.json"
BOX = "zr-box.service"
SERVER = "zr-server.service"
BATCH = "zr-batch.service"
UNIT_FILE = """[Unit]
Description=zeromib reload test: {name}
After=nvidia-sim-devices.service
[Service]
ExecStart=/usr/local/bin/gpu_holder --gpus {gpu} --mib 1000 --name {name}
Restart=always
RestartSec=1
[Install]
WantedBy=multi-user.target
"""
# A process put into the container's cgroup opens the simulated GPU (char 1:5): exit 0 when it may.
PROBE = (f"sh -c 'echo $$ > /sys/fs/cgroup/system.slice/{BOX}/cgroup.procs && exec sh -c \": < /dev/nvidia0\"' 2>&1")


def box_cgroup(fleet: FleetHandle, host: str) -> str:
    """The container's cgroup seen from the machine (the cgroup2 tree that holds the host)."""
    for top in fleet.rig.host(host)["cgroups"]:
        found = [p for p in Path(top).rglob(BOX) if p.is_dir()]
        if found and (found[0] / "cgroup.controllers").exists():
            return str(found[0])
    raise AssertionError(f"no cgroup2 directory for {BOX} under {fleet.rig.host(host)['cgroups']}")


def start_container(fleet: FleetHandle, host: str) -> None:
    fleet.ssh(host, f"systemctl stop {BOX} 2>/dev/null; systemctl reset-failed {BOX} 2>/dev/null; "
                    f"systemd-run --unit={BOX} -p DevicePolicy=strict -p 'DeviceAllow=/dev/null rw' sleep 600", check=True)
    assert not may_open(fleet, host), "systemd's device program should keep the container off /dev/nvidia0 before the hook"
    names = [p["name"] for p in device_hook.grant(box_cgroup(fleet, host))]
    assert names == ["zeromib_hook"], names
    assert may_open(fleet, host), "the hook's program should give the container /dev/nvidia0"


def may_open(fleet: FleetHandle, host: str) -> bool:
    r = fleet.ssh(host, PROBE)
    assert r.returncode == 0 or "Operation not permitted" in r.stdout, (r.returncode, r.stdout, r.stderr)
    return r.returncode == 0


def unit_state(fleet: FleetHandle, host: str, unit: str) -> tuple[str, str]:
    """(ActiveState, the unit file state on disk: `systemctl is-enabled`, which systemctl show may lag)."""
    active = fleet.ssh(host, f"systemctl show -p ActiveState --value {unit}").stdout.strip()
    return active, fleet.ssh(host, f"systemctl is-enabled {unit}").stdout.strip()


def module(fleet: FleetHandle, host: str, name: str, args: dict) -> dict:
    run = fleet.ansible(host, f"zeromib.gpu.{name}", args)
    found = run.results(host=host)
    assert found and "does not support" not in str(found[-1]["result"].get("msg")), str(run)
    return dict(found[-1]["result"], failed=found[-1]["status"] == "failed")


# Debian 12's systemd 252 (the fleet's) and Debian 13's 257 (the newest the rigs carry).
@pytest.fixture(params=["bookworm", "trixie"])
def reload_host(request, device_bpf_fleet):
    fleet = device_bpf_fleet(request.param)
    host = fleet.names[0]
    assert fleet.ssh(host, "systemctl --version").stdout.split()[1] == {"bookworm": "252", "trixie": "257"}[request.param]
    script = [f"mkdir -p {UNIT_DIR}"]
    for name, gpu in ((SERVER, 0), (BATCH, 1)):
        script.append(f"cat > {UNIT_DIR}/{name} <<'EOF'\n{UNIT_FILE.format(name=name, gpu=gpu)}EOF")
    script += ["systemctl daemon-reload", f"systemctl enable --now {SERVER} {BATCH}"]
    fleet.ssh(host, "\n".join(script) + "\n", check=True)
    try:
        yield fleet, host
    finally:
        # The container's cgroup goes with its unit, and the device programs attached to it with it.
        fleet.ssh(host, f"systemctl stop {BOX} 2>/dev/null; systemctl unmask {SERVER} {BATCH} 2>/dev/null; "
                        f"systemctl disable --now {SERVER} {BATCH} 2>/dev/null; rm -f {UNIT_DIR}/zr-*; systemctl daemon-reload; "
                        f"systemctl reset-failed; rm -f {RECORD}")
        fleet.reset([host])


def test_a_plain_daemon_reload_cuts_the_container_off_its_gpu(reload_host):
    """The rig: what the field reports, reproduced. systemd attaches its device program again at the
    reload (252), or at the next start of a unit beside the container after the reload (257)."""
    fleet, host = reload_host
    start_container(fleet, host)
    fleet.ssh(host, "systemctl daemon-reload && systemd-run --unit=zr-sibling.service --wait true", check=True)
    assert not may_open(fleet, host)
    assert "sd_devices" in [p["name"] for p in device_hook.programs(box_cgroup(fleet, host))]


@pytest.mark.parametrize("service_state", ["disabled", "masked"])
def test_release_and_restore_leave_a_running_gpu_container_its_gpu(reload_host, service_state):
    fleet, host = reload_host
    start_container(fleet, host)
    freed = module(fleet, host, "gpu_release", {"services": [SERVER], "service_state": service_state, "kill_timeout": 2})
    assert freed.get("failed") is not True, freed
    assert freed[f"{service_state}_units"] == [SERVER], freed
    assert may_open(fleet, host), f"gpu_release with service_state={service_state} cut the container off its GPU"
    assert unit_state(fleet, host, SERVER) == ("inactive", service_state)
    if service_state == "masked":
        # Enabled, so wanted by multi-user.target: systemd keeps it loaded until a reload, and the run says so.
        assert any(f"{SERVER} is stopped and masked on disk" in w for w in freed.get("warnings", [])), freed.get("warnings")
    restored = module(fleet, host, "gpu_restore", {"step_timeout": 30})
    assert restored.get("failed") is not True, restored
    assert may_open(fleet, host), "gpu_restore cut the container off its GPU"
    assert wait_for(lambda: unit_state(fleet, host, SERVER) == ("active", "enabled"), timeout=10), unit_state(fleet, host, SERVER)
    assert fleet.ssh(host, f"cat {RECORD}").returncode != 0, "every entry restored: the record is gone"


def test_what_was_disabled_or_masked_without_a_reload_stays_down_at_boot_and_a_reload_restore_needs_is_refused(reload_host):
    """At boot systemd reads the unit files: disabled stays down, masked reads masked. A unit masked
    when systemd loaded it and wanted by its target needs a reload to start again: with a GPU
    container at risk gpu_restore refuses, naming it and NVIDIA's fix, unless told to go ahead."""
    fleet, host = reload_host
    assert module(fleet, host, "gpu_release", {"services": [BATCH], "service_state": "disabled", "kill_timeout": 2})["disabled_units"] == [BATCH]
    assert module(fleet, host, "gpu_release", {"services": [SERVER], "service_state": "masked", "kill_timeout": 2})["masked_units"] == [SERVER]
    fleet.reboot(host)
    assert unit_state(fleet, host, BATCH) == ("inactive", "disabled")
    assert unit_state(fleet, host, SERVER) == ("inactive", "masked")
    assert fleet.ssh(host, f"systemctl show -p LoadState --value {SERVER}").stdout.strip() == "masked"
    start_container(fleet, host)

    refused = module(fleet, host, "gpu_restore", {"step_timeout": 30})
    assert refused.get("failed") is True, refused
    assert f"{BOX} (pid " in refused["msg"] and "nvidia-ctk system create-dev-char-symlinks --create-all" in refused["msg"], refused["msg"]
    assert may_open(fleet, host), "a refused restore reloaded systemd all the same"
    assert unit_state(fleet, host, BATCH) == ("active", "enabled")  # the other entry is put back
    assert unit_state(fleet, host, SERVER) == ("inactive", "enabled")  # unmasked on disk, not started
    assert [e["name"] for e in json.loads(fleet.ssh(host, f"cat {RECORD}", check=True).stdout)["entries"]] == [SERVER]

    forced = module(fleet, host, "gpu_restore", {"step_timeout": 30, "reload_despite_gpu_containers": True})
    assert forced.get("failed") is not True, forced
    assert wait_for(lambda: unit_state(fleet, host, SERVER) == ("active", "enabled"), timeout=10), unit_state(fleet, host, SERVER)
    assert any("reloaded" in w for w in forced.get("warnings", [])), forced.get("warnings")
    assert not may_open(fleet, host), "told to go ahead, the reload takes the container's GPU, as the option says"
