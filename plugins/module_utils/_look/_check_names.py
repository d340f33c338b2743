# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The names of the health checks, in their documented order (the values of `health_unchecked`),
and the readings each rests on (_health judges them). Data only: the controller's outcome
(plugin_utils/_outcome) orders check names by it without loading the look's readers."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _readiness

# The reasons nvidia-smi gives for lowered clocks that point at the hardware or its cooling.
# (sw_power_cap, gpu_idle and applications_clocks_setting are normal operation.)
SLOWDOWN_REASONS = (
    ("slowdown_hw", "hardware slowdown"),
    ("slowdown_hw_thermal", "hardware thermal slowdown"),
    ("slowdown_hw_power_brake", "hardware power brake slowdown"),
    ("slowdown_sw_thermal", "software thermal slowdown"),
)

# Health checks by name (the values of `health_unchecked`), and the readings each rests on.
CHECK_KEYS = (
    ("ecc", ("ecc_uncorrected_volatile",)),
    ("row_remap", ("remapped_rows_pending", "remapped_rows_failure")),
    ("retired_pages", ("retired_pages_pending",)),
    ("pcie", ("pcie_link_gen_current", "pcie_link_gen_max", "pcie_link_width_current", "pcie_link_width_max", "pstate")),
    ("clocks", tuple(key for key, _text in SLOWDOWN_REASONS)),
    ("persistence", ("persistence_mode",)),
    ("mig", ("mig_mode", "mig_mode_pending")),
    ("recovery_action", ("recovery_action",)),
    ("fabric", ("fabric_state", "fabric_status", "fabric_health_summary")),
)
CHECKS = tuple(name for name, _keys in CHECK_KEYS) + ("xid",) + tuple(name for name, _keys in _readiness.CHECK_KEYS)
