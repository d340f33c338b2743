# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Which unit a run stops for the holders it owns (issue 65): systemd's unit of each holder (the
look's _unit_owner), never a name a tenant gave a cgroup below her delegated unit; a unit without a
main process only when services names it; the refusals of essential and node-keeping units for
owned units too. Release.run end to end on the fake node (fake_node.py), and the pure rule
(_units.owned_refusal). The same cases through the real module on real systemd:
tests/fleet/test_delegated_units_fleet.py."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import World, fail, run, stops


@pytest.fixture
def world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return World(root)


ALICE = "/system.slice/lab-alice.service"


def host_units_without_main(world, *names):
    """Host units that run (active, exited) with no process: networking.service's shape."""
    for name in names:
        world.unit(name, sub="exited")


def delegated_alice(world, subs, main=700):
    """lab-alice.service (Delegate=yes, User=4242): her shell as its main process, one GPU holder
    per sub-cgroup she named, each her shell's child."""
    world.unit("lab-alice.service")
    world.spawn(main, {}, unit="lab-alice.service", cgroup=f"0::{ALICE}\n", comm="sh", argv=("/bin/sh", "job.sh"), exe="/usr/bin/dash",
                devices=[])
    pids = {}
    for number, sub in enumerate(subs):
        pids[sub] = main + 1 + number
        world.spawn(pids[sub], {number: 1000}, unit="lab-alice.service", cgroup=f"0::{ALICE}/{sub}\n", ppid=main)
    return pids


def test_sub_cgroups_named_like_host_units_stop_none_of_them_and_her_unit_is_freed(world):
    host_units_without_main(world, "networking.service", "openibd.service")
    pids = delegated_alice(world, ["networking.service", "openibd.service"])
    result = run(world, gpus=["0", "1"])
    stopped = [args[-1] for args in stops(world)]
    assert "networking.service" not in stopped and "openibd.service" not in stopped, world.systemctl_log
    assert result["stopped_units"] == ["lab-alice.service"] and result["released"] is True
    assert not set(pids.values()) & set(world.procs)
    assert world.units["networking.service"]["props"]["ActiveState"] == "active"


def test_the_look_reports_her_holders_in_her_unit_as_systemd_says(world):
    host_units_without_main(world, "networking.service")
    pids = delegated_alice(world, ["networking.service"])
    result = run(world, gpus=["0"], check_mode=True)
    by_pid = {h["pid"]: h for h in result["holders"]}
    assert by_pid[pids["networking.service"]]["unit"] == "lab-alice.service"
    assert result["stopped_units"] == ["lab-alice.service"] and stops(world) == []


def test_a_path_made_outside_systemd_names_no_unit_and_its_holder_is_signalled(world):
    # A directory root made and gave to a user, outside any unit: systemd knows no unit there.
    host_units_without_main(world, "networking.service")
    world.spawn(720, {0: 1000}, cgroup="0::/alice/networking.service\n")
    result = run(world, gpus=["0"])
    assert stops(world) == [] and result["stopped_units"] == []
    assert [(pid, name) for _t, pid, name in world.signals] == [(720, "SIGTERM")]
    assert [(k["pid"], k["unit"]) for k in result["killed"]] == [(720, None)]


def test_a_unit_without_a_main_process_is_not_stopped_for_its_holders_unless_named(world):
    world.unit("gpu-prep.service", sub="exited")
    world.spawn(730, {0: 1000}, unit="gpu-prep.service")
    world.units["gpu-prep.service"]["main"] = None  # oneshot, RemainAfterExit=yes: its ExecStart ended, its child stayed
    result = run(world, gpus=["0"])
    assert stops(world) == [] and result["stopped_units"] == []
    assert [(pid, name) for _t, pid, name in world.signals] == [(730, "SIGTERM")]
    [entry] = result["launchers"]
    assert entry["unit"] == "gpu-prep.service" and entry["pids"] == [730] and "no main process" in entry["reason"]


def test_a_unit_without_a_main_process_named_in_services_is_stopped(world):
    world.unit("gpu-prep.service", sub="exited")
    world.spawn(730, {0: 1000}, unit="gpu-prep.service")
    world.units["gpu-prep.service"]["main"] = None
    result = run(world, gpus=["0"], services=["gpu-prep.service"])
    assert result["stopped_units"] == ["gpu-prep.service"] and world.signals == [] and result["launchers"] == []


@pytest.mark.parametrize("unit, named, stopped", [
    ("systemd-gpu-probe.service", [], False),
    ("tailscaled.service", [], False),
    ("tailscaled.service", ["tailscaled.service"], True),
    ("tailscaled.service", ["tail*"], False),
])
def test_an_owned_unit_the_node_needs_is_refused_as_a_named_one_is(world, unit, named, stopped):
    world.unit(unit)
    world.spawn(740, {}, unit=unit, comm="sleep", argv=("sleep", "infinity"), exe="/usr/bin/sleep", devices=[])
    world.spawn(741, {0: 1000}, unit=unit, ppid=740)
    result = run(world, gpus=["0"], services=named)
    assert (unit in result["stopped_units"]) is stopped, result
    if not stopped:
        assert [(pid, name) for _t, pid, name in world.signals] == [(741, "SIGTERM")] and 740 in world.procs
        assert [e["unit"] for e in result["launchers"]] == [unit]


@pytest.mark.parametrize("unit, has_main, named, explicit, refused", [
    ("vllm.service", True, (), (), None),
    ("vllm.service", False, (), (), "no main process"),
    ("vllm.service", False, ("vllm.service",), (), None),
    ("networking.service", True, (), ("networking.service",), "essential"),
    ("sshd.service", True, (), (), "essential"),
    ("user@1000.service", True, (), (), "essential"),
    ("nfs-server.service", True, ("nfs-server.service",), (), "storage"),
    ("nfs-server.service", True, (), ("nfs-server.service",), None),
    ("openibd.service", True, (), (), None),
])
def test_owned_refusal(unit, has_main, named, explicit, refused):
    reason = _units.owned_refusal(unit, has_main, named, explicit)
    assert (reason is None) if refused is None else (refused in (reason or "")), reason


def test_the_reset_advice_names_her_unit_never_the_host_unit_her_sub_cgroup_is_named_after(world):
    # GPU 0 leaked (no live context) while her NVML client, in her sub-cgroup `networking.service`,
    # keeps its node open: the advice stops what holds the node, as systemd names it.
    host_units_without_main(world, "networking.service")
    world.unit("lab-alice.service")
    world.spawn(700, {}, unit="lab-alice.service", cgroup=f"0::{ALICE}\n", comm="sh", argv=("/bin/sh", "job.sh"), devices=[])
    world.spawn(701, {}, unit="lab-alice.service", cgroup=f"0::{ALICE}/networking.service\n", ppid=700,
                devices=["/dev/nvidia0", "/dev/nvidiactl"])
    world.leaked.append((0, 427, "[Not Found]", 3590))
    for check_mode in (True, False):
        error = fail(world, gpus=["0"], check_mode=check_mode)
        assert "pid 701 python3 (lab-alice.service) holds its device node" in error.msg, error.msg
        assert "`systemctl stop lab-alice.service`" in error.msg and "networking.service" not in error.msg
        assert stops(world) == []
