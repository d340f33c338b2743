# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""System containers seen from the host (_cgroups.guest_ref, _look/_guests): the boundary of each
kind by its cgroup path, never in a user's own subtree; no host unit below it; the guest's init and
manager from a fake /proc; what a person runs to reach a guest."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders

from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fakeproc import write_process


@pytest.mark.parametrize("path, kind, name, unit, boundary", [
    pytest.param("/lxc/101/ns/system.slice/vllm.service", "lxc", "101", "vllm.service", "/lxc/101/ns", id="proxmox"),
    pytest.param("/lxc/101/ns/init.scope", "lxc", "101", "init.scope", "/lxc/101/ns", id="proxmox-guest-init"),
    pytest.param("/lxc/101/ns", "lxc", "101", None, "/lxc/101/ns", id="proxmox-attached-pct-exec"),
    pytest.param("/lxc.payload.web/system.slice/vllm.service", "lxd", "web", "vllm.service", "/lxc.payload.web", id="lxd"),
    pytest.param("/machine.slice/systemd-nspawn@build.service/payload/system.slice/vllm.service", "nspawn", "build", "vllm.service",
                 "/machine.slice/systemd-nspawn@build.service/payload", id="nspawn-unit"),
    pytest.param("/machine.slice/machine-build.scope/payload/system.slice/vllm.service", "nspawn", "build", "vllm.service",
                 "/machine.slice/machine-build.scope/payload", id="machined-scope-payload"),
    pytest.param("/machine.slice/machine-web\\x2d1.scope/system.slice/tgi.service", "nspawn", "web-1", "tgi.service",
                 "/machine.slice/machine-web\\x2d1.scope", id="machined-scope-escaped-name"),
    pytest.param("/lxc/gpu1/system.slice/vllm.service", "lxc", "gpu1", "vllm.service", "/lxc/gpu1", id="lxc3-cgroup-v1"),
    pytest.param("/lxc/101/ns/system.slice/vllm.service/worker", "lxc", "101", "vllm.service", "/lxc/101/ns", id="a-unit-subgroup"),
    # A guest that runs its own LXD: the outermost boundary is the guest; its unit is the deepest.
    pytest.param("/lxc/101/ns/lxc.payload.inner/system.slice/vllm.service", "lxc", "101", "vllm.service", "/lxc/101/ns",
                 id="nested-outermost-wins"),
    # A user's session inside the guest: no system unit the guest's manager could stop.
    pytest.param("/lxc.payload.web/user.slice/user-1000.slice/user@1000.service/app.slice/run.service", "lxd", "web", None,
                 "/lxc.payload.web", id="guest-user-manager"),
])
def test_each_boundary_names_its_guest_and_the_guests_own_unit(path, kind, name, unit, boundary):
    ref = _cgroups.guest_ref(path)
    assert ref is not None and (ref["kind"], ref["name"], ref["unit"], ref["cgroup"]) == (kind, name, unit, boundary)
    # The host's systemd runs no unit of that name: the unit is the guest's.
    assert _holders.unit_of(path) is None and _holders.is_system_service(path) is False


@pytest.mark.parametrize("path", [
    pytest.param("/system.slice/vllm.service", id="host-unit"),
    pytest.param("/user.slice/user-1000.slice/user@1000.service/app.slice/lxc/101/ns/system.slice/vllm.service", id="user-subtree-lxc"),
    pytest.param("/user.slice/user-1000.slice/user@1000.service/lxc.payload.x/system.slice/vllm.service", id="user-subtree-lxd"),
    pytest.param("/machine.slice/machine-qemu\\x2d1\\x2dvm.scope/emulator", id="libvirt-vm"),
    pytest.param("/lxc.monitor.web", id="lxc-monitor"),
    pytest.param("/system.slice/lxc-net.service", id="lxc-net"),
    pytest.param("", id="empty"),
    pytest.param(None, id="none"),
])
def test_no_guest_outside_a_boundary_or_in_a_users_own_subtree(path):
    assert _cgroups.guest_ref(path) is None


def test_the_host_unit_of_the_same_name_stays_the_hosts():
    assert _holders.unit_of("/system.slice/vllm.service") == "vllm.service"
    assert _holders.is_system_service("/system.slice/vllm.service") is True


@pytest.mark.parametrize("cgroup, unit", [
    pytest.param("0::/lxc/101/ns/system.slice/vllm.service\n", "vllm.service", id="v2"),
    # Hybrid (and v1) nodes: the name=systemd line carries the path, the controllers the same boundary.
    pytest.param("12:devices:/lxc/101/ns\n1:name=systemd:/lxc/101/ns/system.slice/vllm.service\n0::/\n", "vllm.service", id="v1-named"),
])
def test_the_path_the_holder_record_reads_names_the_guest(cgroup, unit):
    path = _holders.parse_cgroup(cgroup)
    ref = _cgroups.guest_ref(path)
    assert ref is not None and ref["unit"] == unit and _holders.unit_of(path) is None


# ------------------------------------------------------------------ the guest's init, from /proc


def _mount(tmp_path, *groups):
    """A fake cgroup2 mount: {cgroup path: [pids]}."""
    root = tmp_path / "cgroup"
    for group in groups:
        for path, pids in group.items():
            directory = root / path.lstrip("/")
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
    return str(root)


def _guest_tree(proc, init_argv=("/sbin/init",), init_comm="systemd", shape="/lxc/101/ns"):
    """A guest: its init (host pid 4000, pid 1 inside), its server (4100 in vllm.service, pid 57
    inside) and the server's worker (4101); the host's lxc-start (3990) outside."""
    write_process(proc, 3990, comm="lxc-start", ppid=1, cgroup="0::/lxc.monitor/101\n", argv=("lxc-start",))
    write_process(proc, 4000, comm=init_comm, ppid=3990, cgroup=f"0::{shape}/init.scope\n", argv=init_argv, nspid=(4000, 1),
                  exe="/usr/lib/systemd/systemd" if init_comm == "systemd" else "/bin/sh")
    write_process(proc, 4100, comm="python3", ppid=4000, cgroup=f"0::{shape}/system.slice/vllm.service\n", nspid=(4100, 57))
    write_process(proc, 4101, comm="python3", ppid=4100, cgroup=f"0::{shape}/system.slice/vllm.service\n", nspid=(4101, 58))


def _holder(proc, pid):
    record = _holders.read_process(pid, str(proc))
    assert record is not None
    return record


def test_annotate_finds_the_guests_systemd_from_the_holders_lineage(tmp_path):
    proc = tmp_path / "proc"
    _guest_tree(proc)
    holders = _guests.annotate([_holder(proc, 4101)], str(proc), mounts=[_mount(tmp_path, {"/lxc/101/ns/init.scope": [4000]})])
    assert holders[0]["unit"] is None and holders[0]["system_service"] is False
    assert holders[0]["guest"] == {"kind": "lxc", "name": "101", "unit": "vllm.service", "init_pid": 4000, "manager": "systemd"}


def test_a_process_attached_from_outside_finds_the_init_through_the_guests_cgroup(tmp_path):
    """`pct exec 101 -- python3 serve.py`: its parent is the host's lxc-attach, its pid inside is not 1."""
    proc = tmp_path / "proc"
    _guest_tree(proc)
    write_process(proc, 4300, comm="lxc-attach", ppid=1, cgroup="0::/user.slice/user-0.slice/session-3.scope\n", argv=("lxc-attach",))
    write_process(proc, 4301, comm="python3", ppid=4300, cgroup="0::/lxc/101/ns\n", nspid=(4301, 90))
    mount = _mount(tmp_path, {"/lxc/101/ns": [4301], "/lxc/101/ns/init.scope": [4000], "/lxc/101/ns/system.slice/vllm.service": [4100, 4101]})
    holders = _guests.annotate([_holder(proc, 4301)], str(proc), mounts=[mount])
    assert holders[0]["guest"] == {"kind": "lxc", "name": "101", "unit": None, "init_pid": 4000, "manager": "systemd"}


def test_a_shell_as_the_guests_init_is_no_manager(tmp_path):
    proc = tmp_path / "proc"
    _guest_tree(proc, init_argv=("/bin/sh", "-c", "while :; do python3 serve.py; done"), init_comm="sh", shape="/lxc.payload.app")
    holders = _guests.annotate([_holder(proc, 4100)], str(proc), mounts=[_mount(tmp_path, {"/lxc.payload.app/init.scope": [4000]})])
    assert holders[0]["guest"]["manager"] is None and holders[0]["guest"]["init_pid"] == 4000


def test_a_boundary_in_a_subtree_another_uid_owns_is_no_guest(tmp_path):
    """A unit with Delegate=yes and User=alice may create `lxc.payload.x` below it: a name, not a guest."""
    proc = tmp_path / "proc"
    write_process(proc, 5000, comm="python3", ppid=1, cgroup="0::/system.slice/alice-job.service/lxc.payload.x/system.slice/vllm.service\n")
    mount = _mount(tmp_path, {"/system.slice/alice-job.service/lxc.payload.x/system.slice/vllm.service": [5000]})
    os.chown(os.path.join(mount, "system.slice", "alice-job.service"), 1000, 1000)
    holders = _guests.annotate([_holder(proc, 5000)], str(proc), mounts=[mount])
    assert holders[0]["guest"] is None and "owned by uid 1000" in holders[0]["container_note"]


def test_running_lists_each_kind_by_name_with_its_init(tmp_path):
    proc = tmp_path / "proc"
    _guest_tree(proc)
    write_process(proc, 6000, comm="systemd", ppid=1, cgroup="0::/machine.slice/systemd-nspawn@build.service/payload/init.scope\n",
                  argv=("/sbin/init",), nspid=(6000, 1), exe="/usr/lib/systemd/systemd")
    mount = _mount(tmp_path, {"/lxc/101/ns/init.scope": [4000], "/lxc/101/ns/system.slice/vllm.service": [4100, 4101],
                              "/lxc/102/ns": [],
                              "/machine.slice/systemd-nspawn@build.service/payload/init.scope": [6000],
                              "/machine.slice/systemd-nspawn@build.service/supervisor": [5990]})
    assert [(g["name"], g["init_pid"]) for g in _guests.running("lxc", "*", [mount], str(proc))] == [("101", 4000)]
    assert [(g["name"], g["init_pid"], g["manager"]) for g in _guests.running("nspawn", "b*", [mount], str(proc))] == [("build", 6000, "systemd")]
    assert _guests.running("lxd", "*", [mount], str(proc)) == []


@pytest.mark.parametrize("kind, name, tools, command", [
    pytest.param("lxc", "101", {"pct", "lxc-attach", "nsenter"}, "pct exec 101 -- systemctl stop vllm.service", id="proxmox"),
    pytest.param("lxc", "101", {"lxc-attach"}, "lxc-attach -n 101 -- systemctl stop vllm.service", id="plain-lxc"),
    pytest.param("lxd", "web", {"lxc", "nsenter"}, "lxc exec web -- systemctl stop vllm.service", id="lxd"),
    pytest.param("lxd", "web", {"incus"}, "incus exec web -- systemctl stop vllm.service", id="incus"),
    pytest.param("nspawn", "build", {"machinectl"}, "systemctl -M build stop vllm.service", id="machined"),
    # Without the manager's tool here, the kind's own (never nsenter -a: the guest's program with the host's privileges).
    pytest.param("nspawn", "build", {"nsenter"}, "systemctl -M build stop vllm.service", id="nspawn-without-machinectl"),
    pytest.param("lxd", "we b", set(), "lxc exec 'we b' -- systemctl stop vllm.service", id="no-tool"),
    pytest.param("lxc", "101", set(), "pct exec 101 -- systemctl stop vllm.service", id="proxmox-without-pct"),
    pytest.param("lxc", "web", {"pct"}, "lxc-attach -n web -- systemctl stop vllm.service", id="pct-names-only-numbered-guests"),
    pytest.param("nspawn", "build", {"machinectl"}, "machinectl shell build", id="a-shell", marks=[]),
])
def test_the_command_to_run_uses_the_guests_manager(kind, name, tools, command):
    guest = {"kind": kind, "name": name, "unit": "vllm.service", "init_pid": 4000, "manager": "systemd"}
    words = ["sh"] if command == "machinectl shell build" else ["systemctl", "stop", "vllm.service"]
    assert _guests.guest_command(guest, words, tools) == command
    assert "nsenter" not in command


def test_host_tools_are_looked_up_not_assumed():
    found = {"pct": "/usr/sbin/pct", "nsenter": "/usr/bin/nsenter"}
    assert _guests.host_tools(found.get) == {"pct": "/usr/sbin/pct"}


@pytest.mark.parametrize("kind, entry", [("lxc", "lxc:101:vllm.service"), ("lxd", "lxd:101:vllm.service"), ("nspawn", "machine:101:vllm.service")])
def test_the_services_entry_for_a_guests_unit(kind, entry):
    assert _guests.entry({"kind": kind, "name": "101", "unit": "vllm.service"}) == entry


def test_this_kernels_first_pid_namespace_is_told_by_its_inode(tmp_path):
    (tmp_path / "self" / "ns").mkdir(parents=True)
    (tmp_path / "self" / "ns" / "pid").write_text("")
    assert _guests.pid_namespace_nested(str(tmp_path)) is True
    assert _guests.pid_namespace_nested(str(tmp_path / "missing")) is False
