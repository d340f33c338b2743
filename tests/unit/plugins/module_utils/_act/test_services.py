# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""`services` is read once, into units, containers and supervisord programs (_act/_services)."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services


@pytest.mark.parametrize("services, units, containers, programs", [
    pytest.param(["vllm*.service", "container:vllm*", " container: sglang ", "container:vllm*", "tgi"],
                 ["vllm*.service", "tgi"], ["vllm*", "sglang"], [], id="containers-by-prefix-once-each"),
    pytest.param(["vllm.service", "supervisor:vllm*", " supervisor: sglang ", "supervisor:vllm*"],
                 ["vllm.service"], [], ["vllm*", "sglang"], id="programs-by-prefix-once-each"),
    pytest.param(["container:tgi", "supervisor:tgi", "tgi.service"], ["tgi.service"], ["tgi"], ["tgi"], id="one-name-three-owners"),
    pytest.param(["container:", "supervisor:  "], [], [], [], id="a-bare-prefix-names-nothing"),
    pytest.param(None, [], [], [], id="none"),
    pytest.param(["Container:tgi"], ["Container:tgi"], [], [], id="prefixes-are-case-sensitive"),
])
def test_each_entry_goes_to_whoever_stops_what_it_names(services, units, containers, programs):
    assert _services.parse(services) == _services.Services(units, containers, programs)


@pytest.mark.parametrize("entry, kind, guest, unit", [
    pytest.param("lxc:101:vllm*.service", "lxc", "101", "vllm*.service", id="proxmox"),
    pytest.param(" lxd: web : vllm.service ", "lxd", "web", "vllm.service", id="lxd-spaces"),
    pytest.param("machine:build:vllm", "nspawn", "build", "vllm", id="nspawn-unit-without-suffix"),
    pytest.param("lxc:1*:tgi@gpu4.service", "lxc", "1*", "tgi@gpu4.service", id="guest-glob"),
])
def test_a_guests_units_are_named_by_kind_guest_and_unit(entry, kind, guest, unit):
    named = _services.parse([entry, "vllm.service", entry])
    assert named.units == ["vllm.service"] and named.guests == [_services.GuestUnits(kind, guest, unit, f"{entry.split(':')[0].strip()}:{guest}:{unit}")]


@pytest.mark.parametrize("entry, message", [
    pytest.param("lxc:101", "services: lxc:101 names no unit of the guest: write lxc:101:<unit>, e.g. lxc:101:vllm*.service", id="no-unit"),
    pytest.param("machine::vllm.service", "services: machine::vllm.service names no guest and unit: write machine:<guest>:<unit>", id="no-guest"),
    pytest.param("lxd:web: ", "services: lxd:web: names no unit of the guest", id="empty-unit"),
])
def test_a_guest_entry_without_its_guest_or_unit_is_a_clear_error(entry, message):
    with pytest.raises(ValueError, match="^" + message.replace("*", "[*]")):
        _services.parse([entry])
