# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""slurm_node's parameter checking, through its main(): refused before scontrol is looked for."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.modules import slurm_node
from ansible_collections.zeromib.gpu.tests.unit.plugins.modules.utils import fail_of


@pytest.mark.parametrize("args, option", [
    ({}, "state"),
    ({"state": "drain"}, "state"),
    ({"state": "Drained"}, "state"),
    ({"state": "resumed", "node": "gpu-01"}, "node"),
])
def test_a_missing_or_bad_option_is_named(monkeypatch, args, option):
    result = fail_of(slurm_node.main, args, monkeypatch)
    assert option in result["msg"] and "Traceback" not in result["msg"] and "exception" not in result
    assert "scontrol" not in result["msg"]
