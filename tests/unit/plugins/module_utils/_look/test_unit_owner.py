# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Which unit of the host's systemd a holder runs in (_look/_unit_owner): the first unit of its
cgroup path (_holders.unit_of), kept only where systemd's ControlGroup= of that unit is that very
directory. Pure logic, with systemctl answered by a recorder; the same rules through the real
module on real systemd are tests/fleet/test_delegated_units_fleet.py."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _unit_owner


class Systemd:
    """systemctl show --property=Id,ControlGroup as systemd answers it: {unit: ControlGroup}."""

    def __init__(self, groups, rc=0):
        self.groups, self.rc, self.calls = groups, rc, []

    def __call__(self, args):
        self.calls.append(list(args))
        assert args[:4] == ["show", "--property=Id,ControlGroup", "--no-pager", "--"], args
        blocks = ["Id={}\nControlGroup={}\n".format(unit, self.groups.get(unit, "")) for unit in args[4:]]
        return self.rc, "\n".join(blocks), "" if self.rc == 0 else "Failed to connect to bus"


def holder(cgroup, pid=700):
    return {"pid": pid, "cgroup": cgroup, "unit": _holders.unit_of(cgroup), "system_service": _holders.is_system_service(cgroup)}


ALICE = "/system.slice/lab-alice.service"
RUNNING = {"lab-alice.service": ALICE, "networking.service": "/system.slice/networking.service",
           "openibd.service": "/system.slice/openibd.service", "lab-box.service": "/system.slice/lab-box.service",
           "user@1000.service": "/user.slice/user-1000.slice/user@1000.service", "vllm.service": "/system.slice/vllm.service"}


@pytest.mark.parametrize("cgroup, unit, system_service", [
    pytest.param(ALICE + "/networking.service", "lab-alice.service", True, id="her-sub-cgroup-named-like-a-host-unit"),
    pytest.param(ALICE + "/openibd.service/deeper/x.service", "lab-alice.service", True, id="nested-deeper"),
    pytest.param(ALICE, "lab-alice.service", True, id="her-unit-itself"),
    pytest.param("/system.slice/lab-box.service/payload/system.slice/networking.service", "lab-box.service", True,
                 id="keep-unit-container-payload"),
    pytest.param("/user.slice/user-1000.slice/user@1000.service/app.slice/networking.service", "user@1000.service", False,
                 id="user-manager-is-no-system-service"),
    pytest.param("/system.slice/vllm.service", "vllm.service", True, id="plain-system-service"),
    # A directory made outside systemd (root made it and gave it to a user): its names name no unit.
    pytest.param("/alice/networking.service", None, False, id="cgroup-made-outside-systemd"),
    pytest.param("/system.slice/stopped.service/x", None, False, id="unit-without-a-cgroup-now"),
])
def test_a_holder_keeps_the_unit_only_where_systemd_places_it(cgroup, unit, system_service):
    systemd = Systemd(RUNNING)
    [record] = _unit_owner.confirm([holder(cgroup)], systemd)
    assert (record["unit"], record["system_service"]) == (unit, system_service)
    assert len(systemd.calls) <= 1


def test_one_call_for_every_holder_and_none_again_for_the_same_units():
    systemd = Systemd(RUNNING)
    known: dict[str, str] = {}
    holders = [holder(ALICE + "/networking.service", 1), holder(ALICE + "/openibd.service", 2), holder("/system.slice/vllm.service", 3)]
    _unit_owner.confirm(holders, systemd, known)
    assert systemd.calls == [["show", "--property=Id,ControlGroup", "--no-pager", "--", "lab-alice.service", "vllm.service"]]
    again = _unit_owner.confirm([holder(ALICE + "/x", 4)], systemd, known)
    assert again[0]["unit"] == "lab-alice.service" and len(systemd.calls) == 1


def test_no_holder_with_a_unit_asks_nothing():
    systemd = Systemd(RUNNING)
    assert _unit_owner.confirm([holder("/"), holder(None)], systemd) and systemd.calls == []


def test_a_systemd_that_does_not_answer_confirms_no_unit():
    systemd = Systemd(RUNNING, rc=1)
    [record] = _unit_owner.confirm([holder("/system.slice/vllm.service")], systemd)
    assert (record["unit"], record["system_service"]) == (None, False)


def test_a_name_that_is_no_unit_name_is_never_asked():
    # Directories made outside systemd can carry any name: never an option or argument of systemctl.
    systemd = Systemd({"--host=x.service": "/--host=x.service"})
    records = _unit_owner.confirm([holder("/--host=x.service/y"), holder("/a b.service")], systemd)
    assert systemd.calls == [] and [r["unit"] for r in records] == [None, None]


def test_at_most_so_many_units_in_one_call():
    systemd = Systemd({})
    many = [holder(f"/system.slice/u{i}.service", i) for i in range(_unit_owner.ASK_AT_MOST + 5)]
    _unit_owner.confirm(many, systemd)
    assert len(systemd.calls) == 1 and len(systemd.calls[0]) == 4 + _unit_owner.ASK_AT_MOST
    assert all(r["unit"] is None for r in many)


def test_the_claimed_directory_is_the_path_up_to_the_first_directory_of_that_name():
    assert _unit_owner.claimed_cgroup(ALICE + "/lab-alice.service", "lab-alice.service") == ALICE
    assert _unit_owner.claimed_cgroup("/system.slice/a.service", "b.service") is None
    assert _unit_owner.claimed_cgroup(None, "a.service") is None


def test_parse_control_groups_reads_each_block_by_its_id():
    text = "Id=a.service\nControlGroup=/system.slice/a.service\n\nId=b.service\nControlGroup=\n"
    assert _unit_owner.parse_control_groups(text) == {"a.service": "/system.slice/a.service", "b.service": ""}
