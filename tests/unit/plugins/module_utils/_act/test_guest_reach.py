# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""How the host reaches a guest's systemd (issue 65): through the manager's tool, else joined to
the init's confinement, else refused; the guest's MainPID in host numbers, read in the host's
/proc. The pure parts on a fake /proc; the real confinement is tests/fleet/test_guest_root_fleet.py's."""

from __future__ import annotations

import os
import sys

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_reach as reach
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders

FULL = 0x1FFFFFFFFFF
GUEST_BND = FULL & ~(1 << 16) & ~(1 << 17)  # no CAP_SYS_MODULE, CAP_SYS_RAWIO


def write_status(proc, pid, ppid=1, nspid=None, cap_bnd=FULL, seccomp=0, filters=0, cap_inh=0, name="systemd"):
    base = proc / str(pid)
    (base / "ns").mkdir(parents=True, exist_ok=True)
    (base / "status").write_bytes(
        f"Name:\t{name}\nPPid:\t{ppid}\nNSpid:\t{chr(9).join(str(p) for p in (nspid or (pid,)))}\nCapInh:\t{cap_inh:016x}\n"
        f"CapBnd:\t{cap_bnd:016x}\nNoNewPrivs:\t0\nSeccomp:\t{seccomp}\nSeccomp_filters:\t{filters}\n".encode("utf-8"))
    return base


def init_of(proc, pid=7000, **kw):
    base = write_status(proc, pid, nspid=(pid, 1), **kw)
    (base / "cgroup").write_text("0::/lxc.payload.web/init.scope\n")
    return reach.read_init(pid, str(proc))


@pytest.mark.parametrize("brk", ["\r", "\v", "\f", "\x1c", "\x85", "\u2028", "\u2029"])
def test_a_process_name_forges_no_status_field(brk):
    """The guest names its processes at will: only "\\n" ends a line of /proc/PID/status."""
    raw = f"Name:\tx{brk}CapBnd:\t0000000000000000{brk}Seccomp:\t0\nCapBnd:\t{GUEST_BND:016x}\nSeccomp:\t2\n".encode("utf-8")
    fields = _holders.parse_status(raw)
    assert int(fields["CapBnd"], 16) == GUEST_BND and fields["Seccomp"] == "2"


def test_the_inits_confinement_is_read_in_the_hosts_proc(tmp_path):
    init = init_of(tmp_path, cap_bnd=GUEST_BND, seccomp=2, filters=3)
    assert init == reach.Init(7000, (7000, 1), GUEST_BND, 0, 2, 3, "/lxc.payload.web/init.scope", None)
    assert reach.read_init(7001, str(tmp_path)) is None


def test_joined_to_the_init_when_nothing_of_its_confinement_is_lost(tmp_path):
    init, own = init_of(tmp_path, cap_bnd=GUEST_BND), reach.Init(100, (100,), FULL, 0, 0, 0, None, None)
    assert reach.why_not_confined(init, own, "/sys/fs/cgroup", str(tmp_path)) is None


def test_refused_where_the_init_has_a_seccomp_filter_this_process_does_not(tmp_path):
    write_status(tmp_path, 1, ppid=0)
    write_status(tmp_path, 100, ppid=1)
    init = init_of(tmp_path, seccomp=2, filters=1, ppid=1)
    own = reach.Init(100, (100,), FULL, 0, 0, 0, None, None)
    assert "seccomp filter (Seccomp: 2, 1 filters)" in (reach.why_not_confined(init, own, "/sys/fs/cgroup", str(tmp_path)) or "")


def test_a_filter_inherited_from_our_common_ancestor_is_ours_too(tmp_path):
    """Both under the filters of the container the module runs in (the rig's nspawn host): the
    nearest common ancestor has as many filters as the init, so the init has exactly those."""
    write_status(tmp_path, 1, ppid=0, seccomp=2, filters=5)
    write_status(tmp_path, 50, ppid=1, seccomp=2, filters=5)   # the guest's launcher
    write_status(tmp_path, 100, ppid=1, seccomp=2, filters=5)  # this module
    init = init_of(tmp_path, seccomp=2, filters=5, ppid=50)
    assert reach.seccomp_inherited(init, str(tmp_path), me=100)
    # One filter more on the way (the launcher's own): not ours.
    write_status(tmp_path, 50, ppid=1, seccomp=2, filters=6)
    init = init_of(tmp_path, seccomp=2, filters=6, ppid=50)
    assert not reach.seccomp_inherited(init, str(tmp_path), me=100)
    # Strict mode, or a kernel that does not count the filters: refused.
    assert not reach.seccomp_inherited(init._replace(seccomp=1), str(tmp_path), me=100)
    assert not reach.seccomp_inherited(init._replace(seccomp_filters=-1), str(tmp_path), me=100)


@pytest.mark.parametrize("change, words", [
    ({"lsm": "lxc-container-default-cgns (enforce)"}, "LSM label 'lxc-container-default-cgns (enforce)'"),
    ({"cgroup": None}, "no cgroup v2"),
    ({"nspid": (7000,)}, "no PID 1"),
])
def test_refused_where_the_init_cannot_be_joined(tmp_path, change, words):
    init = init_of(tmp_path)._replace(**change)
    own = reach.Init(100, (100,), FULL, 0, 0, 0, None, None)
    assert words in (reach.why_not_confined(init, own, "/sys/fs/cgroup", str(tmp_path)) or "")


def test_refused_where_our_inheritable_capabilities_exceed_the_guests_bounding_set(tmp_path):
    init = init_of(tmp_path, cap_bnd=GUEST_BND)
    own = reach.Init(100, (100,), FULL, 1 << 16, 0, 0, None, None)
    assert "inheritable" in (reach.why_not_confined(init, own, "/sys/fs/cgroup", str(tmp_path)) or "")


@pytest.mark.parametrize("kind, name, tools, prefix", [
    ("lxc", "101", {"pct": "/usr/sbin/pct", "lxc-attach": "/usr/bin/lxc-attach"}, ["/usr/sbin/pct", "exec", "101", "--", "systemctl"]),
    ("lxc", "web", {"pct": "/usr/sbin/pct", "lxc-attach": "/usr/bin/lxc-attach"}, ["/usr/bin/lxc-attach", "-n", "web", "--", "systemctl"]),
    ("lxd", "web", {"lxc": "/snap/bin/lxc"}, ["/snap/bin/lxc", "exec", "web", "--", "systemctl"]),
    ("lxd", "web", {"incus": "/usr/bin/incus"}, ["/usr/bin/incus", "exec", "web", "--", "systemctl"]),
    ("lxd", "web", {"nsenter": "/usr/bin/nsenter"}, None),
    ("nspawn", "build", {"systemctl": "/usr/bin/systemctl"}, ["/usr/bin/systemctl", "-M", "build"]),
    ("nspawn", "other", {"systemctl": "/usr/bin/systemctl"}, None),
])
def test_the_managers_tool_where_the_host_has_it(tmp_path, kind, name, tools, prefix):
    (tmp_path / "build").write_text("NAME=build\nLEADER=4000\nCLASS=container\n")
    (tmp_path / "other").write_text("NAME=other\nLEADER=4999\nCLASS=container\n")  # another leader: not this guest
    guest = {"kind": kind, "name": name, "init_pid": 4000}
    assert reach.tool_prefix(guest, tools, str(tmp_path)) == prefix


def test_main_pid_in_host_numbers_or_zero(tmp_path):
    """The guest says MainPID=57 (its server) and 4321 (a PID whose /proc is FIFOs in its own
    /proc): 57 is its server's host PID, found in the host's /proc among the processes of the
    guest's own PID namespace; 4321 names none and reads 0."""
    proc, mount = tmp_path / "proc", tmp_path / "cgroup"
    init = init_of(proc, 7000)
    write_status(proc, 7100, ppid=7000, nspid=(7100, 57))
    write_status(proc, 7200, ppid=7000, nspid=(7200, 57, 1))   # 57's namesake in a nested namespace
    write_status(proc, 7300, ppid=1, nspid=(7300, 4321))        # PID 4321 of another guest's namespace
    (proc / "7000" / "ns" / "pid").write_text("")
    for pid in (7100, 7200):
        os.link(proc / "7000" / "ns" / "pid", proc / str(pid) / "ns" / "pid")
    (proc / "7300" / "ns" / "pid").write_text("")
    for path, pids in {"lxc.payload.web/init.scope": [7000], "lxc.payload.web/system.slice/vllm.service": [7100],
                       "lxc.payload.web/system.slice/nested.service": [7200], "lxc.payload.web/system.slice/x.service": [7300]}.items():
        (mount / path).mkdir(parents=True)
        (mount / path / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    out = "Id=vllm.service\nMainPID=57\n\nId=evil.service\nMainPID=4321\n\nId=idle.service\nMainPID=0\n"
    assert reach.host_main_pids(out, init, str(proc), [str(mount)]) == (
        "Id=vllm.service\nMainPID=7100\n\nId=evil.service\nMainPID=0\n\nId=idle.service\nMainPID=0\n")


def test_a_refused_call_runs_nothing(tmp_path):
    guest = {"kind": "lxd", "name": "web", "init_pid": 7000}
    rc, out, err = reach.guest_systemctl(guest, ["show", "vllm.service"], 5, str(tmp_path), which=lambda name: None)
    assert (rc, out) == (reach.REFUSED_RC, "") and "util-linux nsenter is not on this host" in err
    assert "no tool of its manager on this host reaches it (lxc, incus, lxc-attach" in err


def test_what_the_guest_prints_is_bounded_in_time_and_size():
    rc, _out, err = reach.run_bounded(["/bin/sh", "-c", "sleep 30"], 0.5)
    assert rc == 124 and "no answer within" in err
    rc, _out, err = reach.run_bounded([sys.executable, "-c", "import sys\nwhile True: sys.stdout.write('x' * 65536)"], 10, limit=1 << 20)
    assert rc == 125 and "MiB of output" in err


def test_the_guests_command_gets_none_of_the_hosts_environment(monkeypatch):
    monkeypatch.setenv("ANSIBLE_SECRET_TOKEN", "do-not-leak")
    rc, out, _err = reach.run_bounded(["/usr/bin/env"], 10)
    assert rc == 0 and "do-not-leak" not in out and "LC_ALL=C" in out
