"""A system container's root as the attacker (issue 65, items 2 and 3), on a real systemd host:
the host runs nothing of the guest's unconfined, reads nothing of the guest's without a bound,
and still stops and restores the guest's vllm.service, confined as the guest.

The tenants are tests/tenants/guest_root.py's: a guest with a real systemd whose root put its own
systemctl first in every PATH (it writes down what confines it, then does the real one's job),
and a guest whose init is a shell named systemd, with a tmpfs of FIFOs over its /proc and a
systemctl that says MainPID=4321 (a PID whose /proc files are those FIFOs). Each guest's bounding
set is smaller than the host's (as LXC's), so a command the host ran unconfined shows.

    ZEROMIB_FLEET_HOSTS=1 ZEROMIB_FLEET_PROFILE=h200 pytest -n 0 tests/fleet/test_guest_root_fleet.py"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import guests as rig
from test_guests_fleet import h200, module

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tenants import guest_root  # noqa: E402

# Generous: a run here takes seconds; an unbounded read of a FIFO never ends.
BOUND_S = 120


@pytest.fixture
def node(clean_fleet):
    """(fleet, host, guests): every guest torn down through its cgroups after the test, also when
    it fails, with the tenant's files."""
    fleet = clean_fleet
    host = h200(fleet)
    guests: list[rig.Guest] = []
    try:
        yield fleet, host, guests
    finally:
        for guest in guests:
            guest_root.teardown(fleet, host, guest)


def status(fleet, host: str, pid: int) -> dict[str, str]:
    out = fleet.ssh(host, f"cat /proc/{pid:d}/status", check=True).stdout
    return {k: v.strip() for k, _s, v in (line.partition(":") for line in out.split("\n")) if _s}


def timed(fleet, host: str, name: str, args: dict, check: bool = False) -> tuple[dict, float]:
    since = time.monotonic()
    result = module(fleet, host, name, args, check=check)
    return result, time.monotonic() - since


def assert_confined_as_the_guest(fleet, host: str, guest: rig.Guest, host_bnd: str) -> list[dict]:
    """Every run of the guest's systemctl had its init's bounding set (not the host's), its
    init's cgroup, no_new_privs, the init's seccomp filters, and ran in the guest's PID namespace."""
    runs = guest_root.records(fleet, host, guest)
    assert runs, "the guest's systemctl never ran"
    init = status(fleet, host, guest.init_pid)
    assert init["CapBnd"] != host_bnd, "the rig's guest must have a smaller bounding set than the host"
    for run in runs:
        me, its_init = run["self"], run["init"]
        assert its_init["CapBnd"] == init["CapBnd"], run
        assert me["CapBnd"] == init["CapBnd"], f"ran with the bounding set {me['CapBnd']}, the guest's is {init['CapBnd']}: {run['argv']}"
        assert me["NoNewPrivs"] == "1" and me["Seccomp"] == its_init["Seccomp"], run
        assert int(me["Seccomp_filters"]) >= int(its_init["Seccomp_filters"]), run
        assert run["self_cgroup"].split("\n")[-2:] == run["init_cgroup"].split("\n")[-2:], run  # the 0:: line, as the guest sees it
        assert len(me["NSpid"].split()) == 1, run  # numbered in the guest's own PID namespace, read there
    return runs


def test_the_guests_own_systemctl_runs_only_confined_and_its_unit_is_stopped_and_restored(node):
    """Legitimate, with a hostile-looking systemctl: services: [lxd:web:vllm.service] stops the
    guest's unit and gpu_restore starts it again; each systemctl the host ran in the guest had the
    guest's confinement, and the restored server runs in the guest's cgroup with its bounding set."""
    fleet, host, guests = node
    guest = rig.boot(fleet, host, "lxd", "web", 5, bounding=guest_root.DROPPED)
    guests.append(guest)
    guest_root.record_systemctl(fleet, host, guest)
    host_bnd = status(fleet, host, 1)["CapBnd"]
    args = {"services": [guest.entry()], "gpus": ["5"], "kill_timeout": 2}

    planned, _s = timed(fleet, host, "gpu_release", args, check=True)
    assert not planned.get("failed"), planned.get("msg")
    assert planned["stopped_guest_units"] == [guest.entry()] and guest_root.unit_state(fleet, host, guest) == "active"
    freed, _s = timed(fleet, host, "gpu_release", args)
    assert not freed.get("failed"), freed.get("msg")
    assert freed["released"] is True and freed["stopped_guest_units"] == [guest.entry()] and freed["killed"] == []
    assert guest_root.unit_state(fleet, host, guest) == "inactive" and fleet.gpu_memory(host)[5] <= 4

    restored, _s = timed(fleet, host, "gpu_restore", {"wait_for_gpus": 30})
    assert not restored.get("failed"), restored.get("msg")
    assert restored["started_guest_units"] == [guest.entry()] and fleet.gpu_memory(host)[5] >= 1000
    runs = assert_confined_as_the_guest(fleet, host, guest, host_bnd)
    assert {r["argv"].split()[0] for r in runs} >= {"show", "stop", "start"}
    # The server the guest's systemd started again: in the guest's cgroup, with the guest's bounding set.
    pids = rig.host_pids(fleet, host, guest)
    assert pids
    for pid in pids:
        cgroup = fleet.ssh(host, f"cat /proc/{pid}/cgroup", check=True).stdout
        assert "0::/lxc.payload.web/system.slice/vllm.service" in cgroup
        assert status(fleet, host, pid)["CapBnd"] == status(fleet, host, guest.init_pid)["CapBnd"]


def test_a_guest_whose_proc_is_fifos_and_whose_systemd_names_a_fifod_pid_hangs_no_entry_point(node):
    """The guest's root: a tmpfs of FIFOs over its /proc, MainPID=4321 for every unit, its own
    systemctl. gpu_facts, gpu_release (check mode and real) and gpu_restore each end within a
    bound, read nothing of 4321 (the guest's number names no process of its namespace on the host),
    and what they ran in the guest ran confined as the guest."""
    fleet, host, guests = node
    guest = guest_root.fifo_proc(fleet, host, "evil", 3)
    guests.append(guest)
    host_bnd = status(fleet, host, 1)["CapBnd"]

    facts, took = timed(fleet, host, "gpu_facts", {})
    assert not facts.get("failed") and took < BOUND_S, (took, facts.get("msg"))
    held = [h for h in facts["ansible_facts"]["gpu"]["holders"] if 3 in h["gpu_indexes"]]
    assert held and held[0]["guest"]["name"] == "evil" and held[0]["guest"]["manager"] == "systemd", held

    args = {"services": [guest.entry()], "gpus": ["3"], "kill_timeout": 2, "wait_timeout": 20}
    planned, took = timed(fleet, host, "gpu_release", args, check=True)
    assert took < BOUND_S and not planned.get("failed"), (took, planned.get("msg"))
    assert planned["stopped_guest_units"] == [guest.entry()]
    freed, took = timed(fleet, host, "gpu_release", args)
    assert took < BOUND_S and not freed.get("failed"), (took, freed.get("msg"))
    assert freed["stopped_guest_units"] == [guest.entry()] and fleet.gpu_memory(host)[3] <= 4

    # Its systemctl says started, but its server does not come back: a clear failure, in time.
    restored, took = timed(fleet, host, "gpu_restore", {"wait_for_gpus": 5})
    assert took < BOUND_S and restored["failed"], (took, restored)
    assert "not holding a GPU again" in restored["msg"] and restored["started_guest_units"] == [guest.entry()], restored["msg"]
    assert_confined_as_the_guest(fleet, host, guest, host_bnd)


def test_a_guest_under_a_seccomp_filter_of_its_own_is_refused_with_the_command(node):
    """An nspawn-shaped guest whose init runs under a seccomp filter the host's module does not
    (as systemd-nspawn adds one), on a host without machinectl: nothing of the guest is run, in
    check mode or for real; the unit keeps serving; the message names `systemctl -M`."""
    fleet, host, guests = node
    guest = rig.boot(fleet, host, "nspawn", "build", 6, bounding=guest_root.DROPPED, props=("SystemCallFilter=~kexec_load",))
    guests.append(guest)
    guest_root.record_systemctl(fleet, host, guest)
    guest_root.clear_records(fleet, host, guest)
    assert fleet.ssh(host, "command -v machinectl").returncode != 0, "this test is about a host without machinectl"
    args = {"services": [guest.entry()], "gpus": ["6"], "kill_timeout": 2}
    for check in (True, False):
        result, took = timed(fleet, host, "gpu_release", args, check=check)
        assert result["failed"] and took < BOUND_S, result.get("msg")
        assert "its init runs under a seccomp filter" in result["msg"], result["msg"]
        assert "Run `systemctl -M build stop vllm.service` there yourself. Nothing was stopped or signalled" in result["msg"], result["msg"]
        assert guest_root.records(fleet, host, guest) == []
        assert guest_root.unit_state(fleet, host, guest) == "active" and fleet.gpu_memory(host)[6] >= 1000
