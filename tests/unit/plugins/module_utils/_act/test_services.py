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
