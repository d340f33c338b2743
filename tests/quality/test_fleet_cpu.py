"""benchmarks/fleet_cpu.py's pure parts: the split of a play's controller CPU into what a play
costs and what each host adds, and the table (the fleet runs themselves are the benchmark's)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests" / "fleet"), str(REPO / "tests" / "sim")]
_spec = importlib.util.spec_from_file_location("fleet_cpu", REPO / "benchmarks" / "fleet_cpu.py")
fleet_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fleet_cpu)


def test_a_play_splits_into_its_fixed_cost_and_each_hosts():
    # 900 ms a play and 30 ms a host, read back from three sizes.
    intercept, slope = fleet_cpu.line_fit([(4, 900 + 4 * 30), (16, 900 + 16 * 30), (32, 900 + 32 * 30)])
    assert intercept == pytest.approx(900) and slope == pytest.approx(30)


def test_the_table_gives_every_play_at_every_size_and_the_split():
    rows = {"free_gpus.yml": {4: {"wall_s": 1.62, "hosts_ms": 298.0, "controller_ms": 255.0},
                              16: {"wall_s": 3.83, "hosts_ms": 313.0, "controller_ms": 86.25}},
            "one-task nvidia-smi play": {4: {"wall_s": 1.49, "hosts_ms": 294.0, "controller_ms": 247.0},
                                         16: {"wall_s": 3.17, "hosts_ms": 267.0, "controller_ms": 85.0}}}
    text = fleet_cpu.markdown(rows)
    assert "| free_gpus.yml | 1.62 s / 298 ms / 255 ms | 3.83 s / 313 ms / 86 ms |" in text
    # 1020 ms at 4 hosts, 1380 ms at 16: 30 ms a host over 900 ms a play.
    assert "| free_gpus.yml | 900 ms | 30.0 ms |" in text
    assert "| one-task nvidia-smi play |" in text.split("whatever its size")[1]


def test_one_size_gives_no_split():
    rows = {"free_gpus.yml": {8: {"wall_s": 2.0, "hosts_ms": 300.0, "controller_ms": 150.0}}}
    assert "whatever its size" not in fleet_cpu.markdown(rows)
