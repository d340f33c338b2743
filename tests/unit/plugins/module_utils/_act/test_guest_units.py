# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""GPUs shared with system containers, from the host (issue 56), on the fake node: a guest's
service is never the host's, is refused with the command to run when services does not name it,
is stopped through the guest's systemd when it does; a bare unit name is the host's and the GPU
selection holds for it; inside a container, memory no process holds is said to be held outside.
The real processes, cgroups and namespaces are tests/fleet/test_guests_fleet.py's."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _words as words
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _restore
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import FakeSmi, FakeSystem, World, params

GUEST = "/lxc/101/ns"
INIT = 7000


class GuestSystem(FakeSystem):
    """The fake node with one Proxmox guest, 101, whose systemd runs `world.guest_units` (a table
    of _units' shape): its systemctl is FakeSystem's over that table, as _guest_reach would reach it."""

    def running_guests(self, kind, name_glob):
        if kind != "lxc" or not self.world.guest_running:
            return []
        return [{"kind": "lxc", "name": "101", "unit": None, "init_pid": INIT, "manager": self.world.guest_manager}]

    def guest_systemctl(self, guest, args, timeout):
        assert guest["init_pid"] == INIT and timeout >= _guest_units.CALL_S
        world = self.world
        world.guest_log.append(list(args))
        host, world.units, logged = world.units, world.guest_units, len(world.systemctl_log)
        try:
            return self.systemctl(args)
        finally:
            world.units = host
            del world.systemctl_log[logged:]  # the guest's systemd was asked, not the host's

    def guest_refusal(self, guest):
        return self.world.guest_refusal


@pytest.fixture
def world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    node = World(root, gpus=8)
    node.guest_units, node.guest_log, node.guest_running, node.guest_manager = {}, [], True, "systemd"
    node.guest_refusal = None
    fakeproc.write_process(root, 6990, comm="lxc-start", ppid=1, cgroup="0::/lxc.monitor/101\n", argv=("lxc-start", "-F", "-n", "101"))
    fakeproc.write_process(root, INIT, comm="systemd", ppid=6990, cgroup=f"0::{GUEST}/init.scope\n", argv=("/sbin/init",),
                           nspid=(INIT, 1), exe="/usr/lib/systemd/systemd")
    return node


def guest_server(world, pid=7100, gpu=4, restart=False):
    """The guest's own vllm.service on GPU `gpu` (pid 57 inside the guest)."""
    host, world.units = world.units, world.guest_units
    try:
        if "vllm.service" not in world.units:
            world.unit("vllm.service", restart=restart)
        return world.spawn(pid, {gpu: 40960}, unit="vllm.service", cgroup=f"0::{GUEST}/system.slice/vllm.service\n", ppid=INIT,
                           nspid=(pid, 57))
    finally:
        world.units = host


def host_server(world):
    """The host's own vllm.service, serving on GPUs 0 and 1."""
    world.unit("vllm.service", restart=True)
    return world.spawn(900, {0: 40960, 1: 40960}, unit="vllm.service")


def run(world, check_mode=False, **options):
    return release.Release(FakeSmi(world), GuestSystem(world), params(**options), check_mode=check_mode,
                           driver_root=str(world.root.parent / "no-driver")).run()


def fail(world, **options):
    with pytest.raises(release.ReleaseError) as info:
        run(world, **options)
    return info.value


def host_stops(world):
    return [args for args in world.systemctl_log if args[0] in ("stop", "disable", "mask", "kill")]


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_the_hosts_unit_of_the_same_name_is_not_stopped_for_the_guests_holder_and_the_run_refuses_with_the_command(world, check_mode):
    """The incident: services: [vllm.service], gpus: [4] stopped the host's vllm.service on GPUs 0-1
    while the guest's systemd brought its own back on GPU 4."""
    host_server(world)
    guest_server(world)
    error = fail(world, services=["vllm.service"], gpus=["4"], check_mode=check_mode)
    assert world.signals == [] and world.guest_log == [] and not [a for a in host_stops(world) if a[0] != "show"]
    assert 900 in world.procs and 7100 in world.procs
    assert error.msg.startswith("refusing to free GPU 4: it is held by a system container's own service")
    assert "vllm.service of LXC guest 101 (pids 7100, GPU 4; its systemd would start it again)" in error.msg
    assert "run `pct exec 101 -- systemctl stop vllm.service` (and `" in error.msg and "nsenter" not in error.msg
    assert "systemctl disable vllm.service` to keep it" in error.msg
    assert "add lxc:101:vllm.service to services" in error.msg and "kill 7000" not in error.msg


def test_a_bare_unit_name_is_the_hosts_and_the_gpu_selection_holds_for_it(world):
    """Nothing in a guest: the host's vllm.service serves on GPUs 0-1; freeing GPU 4 keeps it."""
    host_server(world)
    result = run(world, services=["vllm.service"], gpus=["4"])
    assert result["released"] is True and result["stopped_units"] == [] and 900 in world.procs
    assert result["kept_units"] == [{"unit": "vllm.service", "kind": "other_gpus", "reason": "it holds only GPU 0,1, outside the selection"}]
    assert any("kept vllm.service" in w for w in result["warnings"])
    # Selecting its GPUs stops it, as named.
    result = run(world, services=["vllm.service"], gpus=["0", "1"])
    assert result["stopped_units"] == ["vllm.service"] and 900 not in world.procs


@pytest.mark.parametrize("service_state, key", [("stopped", None), ("disabled", "disabled_guest_units"), ("masked", "masked_guest_units")])
def test_a_services_entry_stops_the_guests_unit_through_the_guests_systemd_and_leaves_the_hosts(world, tmp_path, service_state, key):
    host_server(world)
    guest_server(world)
    system = GuestSystem(world)
    system.record_path = str(tmp_path / "state" / "released.json")
    result = release.Release(FakeSmi(world), system, params(services=["lxc:101:vllm*.service"], gpus=["4"], service_state=service_state),
                             driver_root=str(world.root.parent / "no-driver")).run()
    assert result["released"] is True and result["changed"] is True
    assert result["stopped_guest_units"] == ["lxc:101:vllm.service"] and result["stopped_units"] == [] and result["killed"] == []
    if key:
        assert result[key] == ["lxc:101:vllm.service"]
    assert 7100 not in world.procs and 900 in world.procs and world.signals == []
    assert ["stop", "--no-block", "--no-ask-password", "vllm.service"] in world.guest_log and not host_stops(world)
    entry = _record.read(system.record_path)["entries"][0]
    assert (entry["kind"], entry["guest_kind"], entry["guest"], entry["name"], entry["entry"], entry["gpu_indexes"]) == (
        "guest_unit", "lxc", "101", "vllm.service", "lxc:101:vllm.service", [4])


def test_check_mode_says_what_the_guests_systemd_would_be_asked(world):
    guest_server(world)
    result = run(world, check_mode=True, services=["lxc:101:vllm.service"], gpus=["4"], service_state="disabled")
    assert result["changed"] is True and result["stopped_guest_units"] == ["lxc:101:vllm.service"]
    assert result["disabled_guest_units"] == ["lxc:101:vllm.service"] and result["killed"] == []
    assert 7100 in world.procs and not [a for a in world.guest_log if a[0] in ("stop", "disable")]
    assert "guest unit lxc:101:vllm.service: stopped, disabled" in result["diff"]["after"]


def test_an_entry_for_a_guest_that_is_not_running_is_not_found(world):
    world.guest_running = False
    result = run(world, services=["lxc:101:vllm.service"])
    assert result["services_not_found"] == ["lxc:101:vllm.service"] and result["released"] is True


def test_a_guest_whose_init_is_no_systemd_is_refused_by_name_and_not_entered(world):
    world.guest_manager = "openrc-init"
    guest_server(world)
    error = fail(world, services=["lxc:101:vllm.service"], gpus=["4"])
    assert "LXC guest 101 runs openrc-init as its init, not systemd" in error.msg and world.guest_log == [] and world.signals == []


def test_a_holder_in_a_guest_without_a_manager_is_signalled_as_any_process(world):
    fakeproc.write_process(world.root, INIT, comm="sh", ppid=6990, cgroup=f"0::{GUEST}\n", argv=("/bin/sh", "-c", "exec python3 serve.py"),
                           nspid=(INIT, 1), exe="/bin/sh")
    world.spawn(7100, {4: 40960}, cgroup=f"0::{GUEST}/system.slice/vllm.service\n", ppid=INIT, nspid=(7100, 57))
    result = run(world, gpus=["4"])
    assert result["released"] is True and [k["pid"] for k in result["killed"]] == [7100] and result["killed"][0]["unit"] is None


def test_inside_a_container_memory_no_process_holds_is_said_to_be_held_outside_and_no_reset_is_advised(world):
    """gpu_release run in an LXC guest: the host's process on the shared GPU is a PID the guest
    cannot see; a reset from inside would take the GPU from it."""
    (world.root / "self" / "ns").mkdir(parents=True)
    (world.root / "self" / "ns" / "pid").write_text("")  # any inode but the kernel's first namespace's
    world.leaked.append((0, 3000000, "[Not Found]", 3590))
    error = fail(world, wait_timeout=60.0)
    assert error.msg.startswith("GPUs read above max_used_mib with no process of this container holding them")
    assert "nvidia-smi charges it to pid 3000000, which does not exist here" in error.msg
    assert "may be held outside it, by the host or another guest sharing it" in error.msg and "zeromib.gpu.gpu_facts there" in error.msg
    assert "reset" not in error.msg and "reboot" not in error.msg
    checked = fail(world, check_mode=True)
    assert "held outside" in checked.msg and "reset" not in checked.msg


def test_on_a_node_that_is_no_container_the_same_leak_gets_the_reset_advice_first(world):
    """The initial PID namespace sees every process: memory nobody holds is the driver's, and the
    GPU's part says the reset advice at once, with no word of a holder outside."""
    world.leaked.append((0, 3000000, "[Not Found]", 3590))
    for check_mode in (False, True):
        error = fail(world, wait_timeout=60.0, check_mode=check_mode)
        assert error.msg.startswith(words.EARLY_HEADS["no_holder"] + ": GPU 0 ("), error.msg
        part = error.msg.split(" reads ", 1)[1]
        assert part.startswith("3590 MiB, attributed to exited process(es) 3000000 [Not Found] and no live process holds the GPU: the driver "
                               "has not freed this context; a GPU reset or a reboot is needed"), part
        assert "To reset, as root, in this order: " in part and "container" not in error.msg and "if nothing on the host" not in error.msg


def test_inside_a_container_an_idle_mig_baseline_is_still_told_as_one(world):
    """An nspawn or LXC node with MIG GPUs reads 55 MiB idle: the baseline advice stands."""
    (world.root / "self" / "ns").mkdir(parents=True)
    (world.root / "self" / "ns" / "pid").write_text("")
    world.mig, world.baseline = True, {0: 55, 1: 55}
    error = fail(world, wait_timeout=60.0)
    assert error.msg.startswith(words.EARLY_HEADS["no_holder"]) and "idle baseline (MIG mode is enabled)" in error.msg
    assert "held outside" not in error.msg


# ------------------------------------------------------------------ pure parts


def test_keep_outside_selection_keeps_only_named_units_whose_gpus_are_all_unselected():
    steps = {"stop": ["a.service", "b.service", "c.service", "d.service"], "disable": ["a.service"], "mask": [], "not_found": [],
             "before": {}, "kept_units": [], "warnings": []}
    kept = _units.keep_outside_selection(steps, {"a.service": {0, 1}, "b.service": {4}, "c.service": {1, 4}, "d.service": set()}, [4])
    assert kept == ["a.service"] and steps["stop"] == ["b.service", "c.service", "d.service"] and steps["disable"] == []
    assert _units.keep_outside_selection(steps, {"b.service": {0}}, [4], owned=["b.service"]) == []


def test_refusal_without_a_manager_or_outside_a_service_is_none():
    def holder(pid, guest_unit, manager="systemd"):
        return {"pid": pid, "gpu_indexes": [4], "guest": {"kind": "lxd", "name": "web", "unit": guest_unit, "init_pid": 1, "manager": manager}}
    targets = [holder(1, "vllm.service"), holder(2, "session-3.scope"), holder(3, None), holder(4, "vllm.service", manager=None),
               {"pid": 5, "gpu_indexes": [4], "guest": None}]
    assert [h["pid"] for h in _guest_units.refused_holders(targets, [])] == [1]
    plans = [{"guest": {"kind": "lxd", "name": "web"}, "entries": ["lxd:web:vllm.service"], "steps": {"stop": ["vllm.service"]}}]
    assert _guest_units.refused_holders(targets, plans) == []
    message = _guest_units.refusal([targets[0]], [4], {"lxc"})
    assert "run `lxc exec web -- systemctl stop vllm.service` (and `lxc exec web -- systemctl disable vllm.service`" in message
    assert "add lxd:web:vllm.service to services" in message


def test_a_guest_unit_entry_is_kept_by_guest_and_read_back_by_describe_and_merge():
    result = {"stopped_guest_units": ["lxc:101:vllm.service"], "disabled_guest_units": ["lxc:101:vllm.service"]}
    before = {"lxc:101:vllm.service": {"guest_kind": "lxc", "guest": "101", "unit": "vllm.service",
                                       "props": {"ActiveState": "active", "UnitFileState": "enabled"}}}
    holders = [{"pid": 1, "gpu_indexes": [4], "guest": {"kind": "lxc", "name": "101", "unit": "vllm.service"}},
               {"pid": 2, "gpu_indexes": [0], "unit": "vllm.service", "guest": None}]
    entries = _record.release_entries(result, {}, holders, "2026-12-05T10:00:00Z", None, before)
    assert [(e["kind"], e["name"], e["actions"], e["gpu_indexes"]) for e in entries] == [("guest_unit", "vllm.service", ["stopped", "disabled"], [4])]
    record = _record.merge(_record.empty(), entries)
    # The host's vllm.service of the same name is another entry.
    record = _record.merge(record, [{"kind": "unit", "name": "vllm.service", "actions": ["stopped"]}])
    assert len(_record.validated(record)["entries"]) == 2
    assert _record.describe(entries[0]).startswith("guest unit lxc:101:vllm.service stopped, disabled by zeromib")


class RestoreSystem(_restore.System):
    def __init__(self, tmp_path, running=True):
        super().__init__(systemctl_path=None, runtimes=object(), record_path=str(tmp_path / "state" / "released.json"), proc=str(tmp_path))
        self.props = {"Id": "vllm.service", "LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "UnitFileState": "disabled"}
        self.calls, self.running, self.refused = [], running, None

    def guest_refusal(self, guest):
        return self.refused

    def running_guests(self, kind, name_glob):
        return [{"kind": "lxc", "name": "101", "unit": None, "init_pid": INIT, "manager": "systemd"}] if self.running else []

    def guest_systemctl(self, guest, args, timeout):
        self.calls.append(list(args))
        if args[0] == "show":
            return 0, "".join(f"{k}={v}\n" for k, v in self.props.items()), ""
        self.props.update({"enable": {"UnitFileState": "enabled"}, "start": {"ActiveState": "active", "SubState": "running"}}.get(args[0], {}))
        return 0, "", ""


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_restore_starts_and_enables_the_guests_unit_through_its_systemd(tmp_path, check_mode):
    system = RestoreSystem(tmp_path)
    _record.add(system.record_path, [{"kind": "guest_unit", "name": "vllm.service", "guest_kind": "lxc", "guest": "101",
                                      "entry": "lxc:101:vllm.service", "actions": ["stopped", "disabled"], "active": True,
                                      "unit_file_state": "enabled", "gpu_indexes": [4]}])
    result = _restore.Restore(system, {"step_timeout": 30}, check_mode=check_mode).run()
    assert result["enabled_guest_units"] == ["lxc:101:vllm.service"] and result["started_guest_units"] == ["lxc:101:vllm.service"]
    assert result["plan"] == ["guest unit lxc:101:vllm.service: enable, start"]
    if check_mode:
        assert [c[0] for c in system.calls] == ["show", "is-enabled"] and _record.read(system.record_path)["entries"]
    else:
        assert [c[0] for c in system.calls] == ["show", "is-enabled", "enable", "start", "show"] and not _record.read(system.record_path)["entries"]


def test_restore_keeps_the_entry_of_a_guest_that_is_not_running(tmp_path):
    system = RestoreSystem(tmp_path, running=False)
    _record.add(system.record_path, [{"kind": "guest_unit", "name": "vllm.service", "guest_kind": "lxc", "guest": "101",
                                      "entry": "lxc:101:vllm.service", "actions": ["stopped"], "active": True, "unit_file_state": "enabled"}])
    with pytest.raises(_restore.RestoreError) as info:
        _restore.Restore(system, {"step_timeout": 30}).run()
    assert "LXC guest 101 is not running: start it, then run gpu_restore again" in info.value.msg
    assert _record.read(system.record_path)["entries"]


def test_restore_refuses_a_guest_it_cannot_reach_confined_and_keeps_the_entry(tmp_path):
    """No tool of the guest's manager and an init the host cannot join (a seccomp filter of its
    own): nothing is run in the guest, the entry stays, the message names the command."""
    system = RestoreSystem(tmp_path)
    system.refused = "LXC guest 101: its init runs under a seccomp filter"
    _record.add(system.record_path, [{"kind": "guest_unit", "name": "vllm.service", "guest_kind": "lxc", "guest": "101",
                                      "entry": "lxc:101:vllm.service", "actions": ["stopped"], "active": True,
                                      "unit_file_state": "enabled", "gpu_indexes": [4]}])
    with pytest.raises(_restore.RestoreError) as caught:
        _restore.Restore(system, {"step_timeout": 30}).run()
    assert system.calls == []
    assert "seccomp filter" in caught.value.msg and "Run `pct exec 101 -- systemctl start vllm.service` there yourself" in caught.value.msg
    assert [e["name"] for e in _record.read(system.record_path)["entries"]] == ["vllm.service"]


@pytest.mark.parametrize("check_mode", [False, True], ids=["run", "check"])
def test_release_refuses_a_guest_it_cannot_reach_confined_before_anything_is_done(world, check_mode):
    guest_server(world)
    world.guest_refusal = "LXC guest 101: its init runs under a seccomp filter"
    error = fail(world, services=["lxc:101:vllm.service"], gpus=["4"], check_mode=check_mode)
    assert world.guest_log == [] and world.signals == [] and 7100 in world.procs
    assert error.msg.startswith("services: lxc:101:vllm.service: LXC guest 101: its init runs under a seccomp filter")
    assert "Run `pct exec 101 -- systemctl stop vllm.service` there yourself. Nothing was stopped or signalled" in error.msg
