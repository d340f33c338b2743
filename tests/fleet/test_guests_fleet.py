"""GPUs shared with system containers, from the host (issue 56), on a real systemd host: real
guests of the three shapes (Proxmox LXC, LXD, systemd-nspawn), each a real systemd booted in its
own namespaces below its boundary cgroup, whose enabled vllm.service (Restart=always) holds a GPU,
beside the host's own vllm.service on GPUs 0-1 (tests/fleet/guests.py says what stands in for
lxc-start and systemd-nspawn). What each test reads back comes from the host's and the guests'
systemd and nvidia-smi, never from the module's own word alone.

    ZEROMIB_FLEET_HOSTS=1 ZEROMIB_FLEET_PROFILE=h200 pytest -n 0 tests/fleet/test_guests_fleet.py"""
from __future__ import annotations

import time

import pytest

import guests as rig

# GPU of each shape's guest; the host's own vllm.service serves on GPUs 0 and 1.
SHAPES = [("lxc", "101", 4), ("lxd", "web", 5), ("nspawn", "build", 6)]
# How the advice reaches each kind's guest when the host has none of the managers' tools (the rig's hosts):
# with the kind's own tool, confined as the guest.
MANAGER = {"lxc": "pct exec 101 -- systemctl ", "lxd": "lxc exec web -- systemctl ", "nspawn": "systemctl -M build "}
# In /run: the guests overlay the host's /etc, not its /run (the drop-in would reach their vllm.service too).
DROP_IN = "/run/systemd/system/vllm.service.d/zeromib-guests-test.conf"


def h200(fleet) -> str:
    hosts = [h.name for h in fleet.hosts if h.gpu_count >= 8 and h.idle_mib == 0]
    assert hosts, "these tests need a host with 8 GPUs"
    return hosts[0]


@pytest.fixture
def node(clean_fleet):
    """(fleet, host, guests booted in the test): every guest torn down through its cgroups after
    the test, also when it fails, and the host's vllm.service back as the fleet has it."""
    fleet = clean_fleet
    host = h200(fleet)
    guests: list[rig.Guest] = []
    try:
        yield fleet, host, guests
    finally:
        rig.teardown(fleet, host, guests)
        fleet.ssh(host, f"rm -f {DROP_IN}; rmdir {DROP_IN.rsplit('/', 1)[0]} 2>/dev/null; systemctl daemon-reload")


def host_vllm(fleet, host: str) -> int:
    """The host's own vllm.service (Restart=always) on GPUs 0 and 1; returns its main PID."""
    fleet.ssh(host, f"mkdir -p {DROP_IN.rsplit('/', 1)[0]} && printf '[Service]\\nExecStart=\\n"
                    "ExecStart=/usr/local/bin/gpu_holder --gpus 0,1 --mib 40960\\n' > " + DROP_IN +
              " && systemctl daemon-reload && systemctl start vllm.service", check=True)
    rig.wait_gpu(fleet, host, 1, lambda mib: mib >= 1000)
    return int(fleet.ssh(host, "systemctl show -p MainPID --value vllm.service", check=True).stdout)


def module(fleet, host: str, name: str, args: dict, check: bool = False) -> dict:
    """zeromib.gpu.NAME on HOST through a play; its result (failed or not)."""
    play = {"hosts": host, "gather_facts": False,
            "tasks": [{"name": "the module", f"zeromib.gpu.{name}": args, "ignore_errors": True}]}
    run = fleet.ansible_playbook(play, check=check)
    record = run.results("the module", host)[-1]
    # The callback keeps the task's status beside its result (fleet_json): `failed` is that status (ignored: failed under ignore_errors).
    return dict(record["result"], failed=record["status"] in ("failed", "ignored"))


def host_unit(fleet, host: str) -> tuple[str, int]:
    out = fleet.ssh(host, "systemctl show -p ActiveState,MainPID --no-pager vllm.service", check=True).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return props["ActiveState"], int(props["MainPID"])


def test_each_shape_names_its_guest_beside_the_hosts_unit_of_the_same_name(node):
    """gpu_facts from the host: three guests' vllm.service and the host's, told apart by the
    kernel's cgroup path; the guests' init and manager found in their PID namespaces."""
    fleet, host, guests = node
    host_pid = host_vllm(fleet, host)
    for kind, name, gpu in SHAPES:
        guests.append(rig.boot(fleet, host, kind, name, gpu))
    gpu = module(fleet, host, "gpu_facts", {})["ansible_facts"]["gpu"]
    by_gpu = {h["gpu_indexes"][0]: h for h in gpu["holders"] if h["gpu_indexes"]}
    assert by_gpu[0]["pid"] == host_pid and by_gpu[0]["unit"] == "vllm.service" and by_gpu[0]["guest"] is None
    for guest in guests:
        holder = by_gpu[guest.gpu]
        assert holder["pid"] in rig.host_pids(fleet, host, guest)
        assert holder["unit"] is None, holder
        assert holder["guest"] == {"kind": guest.kind, "name": guest.name, "unit": "vllm.service", "init_pid": guest.init_pid,
                                   "manager": "systemd"}, holder
    # The rig host is itself an nspawn guest of this machine: it says so.
    assert gpu["inside_container"] is True


@pytest.mark.parametrize("kind, name, gpu", SHAPES, ids=[s[0] for s in SHAPES])
def test_without_an_entry_the_run_refuses_and_the_hosts_unit_of_the_same_name_keeps_serving(node, kind, name, gpu):
    """The incident: services: [vllm.service], gpus: [N] stopped the host's vllm.service on GPUs
    0-1 while the guest's systemd brought its own back. Now nothing is stopped or signalled, in
    check mode and for real, and the message names the guest, the command and the entry."""
    fleet, host, guests = node
    host_pid = host_vllm(fleet, host)
    guest = rig.boot(fleet, host, kind, name, gpu)
    guests.append(guest)
    before = rig.host_pids(fleet, host, guest)
    args = {"services": ["vllm.service"], "gpus": [str(gpu)], "wait_timeout": 5}
    for check in (True, False):
        result = module(fleet, host, "gpu_release", args, check=check)
        assert result["failed"] and result["msg"].startswith(f"refusing to free GPU {gpu}: it is held by a system container's own service")
        assert f"add {guest.entry()} to services" in result["msg"] and f"run `{MANAGER[kind]}stop vllm.service`" in result["msg"]
        assert "nsenter" not in result["msg"]  # never advised: it runs the guest's own program with the host's privileges
        assert f"kill {guest.init_pid}" not in result["msg"]
        assert host_unit(fleet, host) == ("active", host_pid) and rig.host_pids(fleet, host, guest) == before
        assert fleet.gpu_memory(host)[0] >= 1000 and fleet.gpu_memory(host)[gpu] >= 1000


@pytest.mark.parametrize("kind, name, gpu", SHAPES, ids=[s[0] for s in SHAPES])
def test_an_entry_stops_and_disables_the_unit_through_the_guests_systemd_and_restore_brings_it_back(node, kind, name, gpu):
    fleet, host, guests = node
    host_pid = host_vllm(fleet, host)
    guest = rig.boot(fleet, host, kind, name, gpu)
    guests.append(guest)
    args = {"services": [guest.entry("vllm*.service")], "service_state": "disabled", "gpus": [str(gpu)], "kill_timeout": 2}
    planned = module(fleet, host, "gpu_release", args, check=True)
    assert not planned.get("failed"), planned.get("msg")
    assert planned["stopped_guest_units"] == [guest.entry()] and planned["disabled_guest_units"] == [guest.entry()]
    assert planned["killed"] == [] and rig.unit_state(fleet, host, guest)[:2] == ("active", "enabled")

    freed = module(fleet, host, "gpu_release", args)
    assert not freed.get("failed"), freed.get("msg")
    assert freed["released"] is True and freed["stopped_guest_units"] == [guest.entry()] and freed["killed"] == []
    # Read back from the guest's systemd and the host's nvidia-smi: stopped, disabled, GPU free; and it stays so.
    time.sleep(1.5)  # the guest unit's RestartSec is 0.5 s: a kill from outside would have come back by now
    assert rig.unit_state(fleet, host, guest)[:2] == ("inactive", "disabled") and rig.host_pids(fleet, host, guest) == []
    # 4 MiB: the cross-GPU footprint of the host's contexts on GPUs 0-1 (the H200's, tests/gpu/results/README.md), no context of its own.
    assert fleet.gpu_memory(host)[gpu] <= 4 and host_unit(fleet, host) == ("active", host_pid)

    restored = module(fleet, host, "gpu_restore", {"wait_for_gpus": 30})
    assert not restored.get("failed"), restored.get("msg")
    assert restored["started_guest_units"] == [guest.entry()] and restored["enabled_guest_units"] == [guest.entry()]
    assert rig.unit_state(fleet, host, guest)[:2] == ("active", "enabled") and fleet.gpu_memory(host)[gpu] >= 1000
    assert fleet.ssh(host, "cat /var/lib/zeromib-gpu/released.json 2>/dev/null").stdout == ""


def test_a_bare_unit_name_keeps_the_gpu_selection_for_the_hosts_unit(node):
    """Nothing in a guest: freeing GPU 4 never stops the host's vllm.service serving on GPUs 0-1."""
    fleet, host, _guests = node
    host_pid = host_vllm(fleet, host)
    result = module(fleet, host, "gpu_release", {"services": ["vllm.service"], "gpus": ["4"]})
    assert not result.get("failed") and result["stopped_units"] == [], result
    assert result["kept_units"] == [{"unit": "vllm.service", "kind": "other_gpus", "reason": "it holds only GPU 0,1, outside the selection"}]
    assert host_unit(fleet, host) == ("active", host_pid)


def test_a_guest_whose_init_restarts_its_server_is_named_never_its_init_to_kill(node):
    """A guest without a system manager (a shell loop as its init, TEST_RIGS.md): its server is
    signalled as any process; the loop starts it again, and the verdict says to stop it inside
    the guest, never to end the guest's PID 1."""
    fleet, host, guests = node
    guest = rig.stand_in(fleet, host, "102", 7)
    guests.append(guest)
    result = module(fleet, host, "gpu_release", {"gpus": ["7"], "kill_timeout": 2, "wait_timeout": 10})
    assert result.get("failed") and result["killed"], result
    assert result["killed"][0]["unit"] is None
    assert f"pid {guest.init_pid} is the init of LXC guest 102, which starts it again" in result["msg"], result["msg"]
    assert f"kill {guest.init_pid}" not in result["msg"] and "stop the server inside the guest" in result["msg"]
