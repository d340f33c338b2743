# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""The free_gpus role's variables typed as its gate checks them.

roles/free_gpus/meta/argument_specs.yml gives every variable `type: raw` (its description says
what it takes): Ansible's own role argument validation, which runs first unless the play says
`rolespec_validate: false`, then passes, and the gate's check says a mistake in the user's words
("free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"). With the real types
there, Ansible's check failed first, with a Python class name (`_AnsibleTaggedStr`) and a dump of
the whole specification (~45 KB), and the collection's line never came (issue 55). The types live
here, beside the gate; tests/unit/plugins/action/test_role_spec.py holds them to gpu_release's own
argument spec and to the role's file.
"""

from __future__ import annotations

import typing as t

TYPES: dict[str, dict[str, t.Any]] = {
    "free_gpus_cross_gpu_footprint_mib": {"type": "int"},
    "free_gpus_dcgm_diag": {"type": "int", "choices": [0, 1, 2, 3, 4]},
    "free_gpus_expected_count": {"type": "int"},
    "free_gpus_expected_mig_mode": {"type": "str", "choices": ["", "enabled", "disabled"]},
    "free_gpus_gpus": {"type": "list", "elements": "str"},
    "free_gpus_kill": {"type": "bool"},
    "free_gpus_kill_spanning": {"type": "bool"},
    "free_gpus_kill_timeout": {"type": "float"},
    "free_gpus_launchers": {"type": "list", "elements": "str"},
    "free_gpus_match": {"type": "list", "elements": "str"},
    "free_gpus_max_used_mib": {"type": "int"},
    "free_gpus_min_pcie_gen": {"type": "int"},
    "free_gpus_min_pcie_width": {"type": "int"},
    "free_gpus_nvidia_smi": {"type": "str"},
    "free_gpus_on_failure": {"type": "str", "choices": ["none", "drain"]},
    "free_gpus_poll_interval": {"type": "float"},
    "free_gpus_protect": {"type": "list", "elements": "str"},
    "free_gpus_require_healthy": {"type": "bool"},
    "free_gpus_require_persistence": {"type": "bool"},
    "free_gpus_service_state": {"type": "str", "choices": ["stopped", "disabled", "masked"]},
    "free_gpus_services": {"type": "list", "elements": "str"},
    "free_gpus_shm_min_free_mib_per_gpu": {"type": "int"},
    "free_gpus_clean_shm": {"type": "bool"},
    "free_gpus_settle_timeout": {"type": "float"},
    "free_gpus_slurm_node_name": {"type": "str"},
    "free_gpus_smoke_test": {"type": "bool"},
    "free_gpus_smoke_test_mib": {"type": "int"},
    "free_gpus_stop_owning_units": {"type": "bool"},
    "free_gpus_strict": {"type": "bool"},
    "free_gpus_timeout": {"type": "float"},
    "free_gpus_wait_timeout": {"type": "float"},
    "free_gpus_xid_fatal": {"type": "list", "elements": "int"},
    "free_gpus_xid_ignore": {"type": "list", "elements": "int"},
    "free_gpus_xid_window_hours": {"type": "float"},
}


def typed(options: t.Mapping[str, t.Mapping[str, t.Any]]) -> dict[str, dict[str, t.Any]]:
    """The role file's options with their types, elements and choices as the gate checks them."""
    out = {}
    for name, option in options.items():
        loose = {key: value for key, value in option.items() if key not in ("type", "elements", "choices")}
        out[name] = dict(loose, **TYPES.get(name, {"type": "raw"}))
    return out
