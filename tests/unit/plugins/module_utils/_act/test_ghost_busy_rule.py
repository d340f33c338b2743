# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Ghost-busy GPUs (issue 71): which GPUs are ghosts after a run's kills, and the Slurm drain
reason's short cause, which must fit slurmctld's 120 characters with the job's words before it."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ghost_busy
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _drain


def _gpu(index, utilization=100, clean=True):
    return {"index": index, "pci_bus_id": "00000000:%02X:00.0" % (0x18 + index), "minor_number": index, "utilization_gpu_pct": utilization,
            "power_draw_w": 101.5, "clean": clean}


def _result(gpus, killed_on=(1,), holders=()):
    return {"selected_gpus": [g["index"] for g in gpus], "gpus": gpus, "holders": list(holders),
            "killed": [{"pid": 7, "signal": "SIGKILL", "gpu_indexes": list(killed_on)}]}


def test_only_a_gpu_this_run_killed_on_is_this_runs_ghost():
    assert [g["index"] for g in _ghost_busy.found(_result([_gpu(0), _gpu(1)]))] == [1]


@pytest.mark.parametrize("gpu, holders", [
    pytest.param(_gpu(1, utilization=10), [], id="idle"),
    pytest.param(_gpu(1, clean=False), [], id="memory-above-the-baseline"),
    pytest.param(_gpu(1), [{"pid": 8, "gpu_indexes": [1], "attribution": "listed"}], id="a-process-works-on-it"),
    pytest.param(_gpu(1), [{"pid": 9, "gpu_indexes": [], "candidate_gpu_indexes": [1], "attribution": "undecided"}], id="may-work-on-it"),
    pytest.param(dict(_gpu(1), utilization_gpu_pct=True), [], id="a-bool-is-no-reading"),
])
def test_busy_with_a_process_or_not_busy_is_no_ghost(gpu, holders):
    assert _ghost_busy.busy_with_nothing(gpu, holders) is False


def test_an_nvml_client_on_every_node_hides_no_ghost_and_is_named_as_what_blocks_a_reset():
    monitor = {"pid": 812, "name": "nvidia-persiste", "gpu_indexes": [], "attribution": "nvml_client", "devices": ["/dev/nvidia1"]}
    assert _ghost_busy.busy_with_nothing(_gpu(1), [monitor]) is True
    cause = _ghost_busy.short_cause(dict(_gpu(1), utilization_after_pct=100), [monitor])
    assert cause == ("GPU 1: 100 % busy with no process, also after a CUDA context: reset it (nvidia-smi -r -i 1); "
                     "NVML handles block a reset: stop pid 812 nvidia-persiste first")


@pytest.mark.parametrize("error", [None, "CUDA_ERROR_DEVICES_UNAVAILABLE (46) at cuCtxCreate"])
def test_the_drain_reason_of_a_stuck_ghost_keeps_what_it_reads_and_the_reset_within_slurms_limit(error):
    ghost = dict(_gpu(7), utilization_after_pct=100, error=error)
    reason = _drain.short_reason("epilog job 1234567: " + _ghost_busy.short_cause(ghost, []))
    assert len(reason) <= _drain.REASON_MAX and reason.endswith("reset it (nvidia-smi -r -i 7)"), reason
