# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The restore_gpus and slurm_gpu_checks roles' first check (issue 55): a typo or a value of the
wrong type said in the collection's words, with the role files typed raw so that Ansible's own
role argument validation, which runs first, lets it speak."""

from __future__ import annotations

import os

import pytest
import yaml

from ansible_collections.zeromib.gpu.plugins.action.role_variables_check import problems
from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_spec import RESTORE_TYPES, SLURM_TYPES

ROLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, os.pardir, os.pardir, "roles")
RESTORE = os.path.join(ROLES, "restore_gpus")
SLURM = os.path.join(ROLES, "slurm_gpu_checks")


def options(role):
    with open(os.path.join(role, "meta", "argument_specs.yml")) as handle:
        return yaml.safe_load(handle)["argument_specs"]["main"]["options"]


def role_settings_problems(settings, role, prefix):
    return problems(settings, options(role), prefix)


def defaults(role):
    with open(os.path.join(role, "defaults", "main.yml")) as handle:
        return yaml.safe_load(handle)


@pytest.mark.parametrize("role, types", [(RESTORE, RESTORE_TYPES), (SLURM, SLURM_TYPES)], ids=["restore_gpus", "slurm_gpu_checks"])
def test_the_roles_file_types_every_variable_raw_and_the_check_has_a_type_for_each(role, types):
    spec = options(role)
    assert sorted(spec) == sorted(types), "one type for each variable of the role, and none other"
    assert {name: option.get("type") for name, option in spec.items() if option.get("type") != "raw" or "elements" in option
            or "choices" in option} == {}


@pytest.mark.parametrize("role, prefix", [(RESTORE, "restore_gpus_"), (SLURM, "slurm_gpu_checks_")], ids=["restore_gpus", "slurm_gpu_checks"])
def test_the_roles_defaults_pass_their_own_check(role, prefix):
    assert role_settings_problems(defaults(role), role, prefix) == []


@pytest.mark.parametrize("role, prefix, given, said", [
    (RESTORE, "restore_gpus_", {"restore_gpus_step_timeout": "2m"},
     "restore_gpus_step_timeout must be a number of seconds (e.g. 120), got '2m'"),
    (RESTORE, "restore_gpus_", {"restore_gpus_resume_drained": "maybe"}, "restore_gpus_resume_drained must be true or false, got 'maybe'"),
    (RESTORE, "restore_gpus_", {"restore_gpus_forget": {"a": 1}}, "restore_gpus_forget must be a list, got {\"a\": 1}"),
    (SLURM, "slurm_gpu_checks_", {"slurm_gpu_checks_prolog_epilog_timeout": "1m"},
     "slurm_gpu_checks_prolog_epilog_timeout must be a whole number of seconds (e.g. 120), got '1m'"),
    (SLURM, "slurm_gpu_checks_", {"slurm_gpu_checks_options": ["max_used_mib", 64]},
     "slurm_gpu_checks_options must be a mapping, got [\"max_used_mib\", 64]"),
    (SLURM, "slurm_gpu_checks_", {"slurm_gpu_checks_state": "installed"}, "value of slurm_gpu_checks_state must be one of: present, absent, got: installed"),
], ids=["float", "bool", "list", "int", "dict", "choices"])
def test_a_wrong_type_is_said_in_the_collections_words(role, prefix, given, said):
    assert role_settings_problems(given, role, prefix) == [said]
    assert "<class" not in said and "Tagged" not in said


def test_a_typo_comes_first_and_the_types_after():
    said = role_settings_problems({"restore_gpus_resume_drainned": True, "restore_gpus_step_timeout": "2m"}, RESTORE, "restore_gpus_")
    assert said == ["restore_gpus_resume_drainned is not a variable of the zeromib.gpu.restore_gpus role; did you mean restore_gpus_resume_drained?",
                    "restore_gpus_step_timeout must be a number of seconds (e.g. 120), got '2m'"]


def test_a_misspelt_runner_option_is_named_with_the_closest_one():
    said = role_settings_problems({"slurm_gpu_checks_options": {"kill_timout": 3}}, SLURM, "slurm_gpu_checks_")
    assert said == ["slurm_gpu_checks_options.kill_timout is not an option of slurm_gpu_checks_options; did you mean kill_timeout?"]
    assert role_settings_problems({"slurm_gpu_checks_options": {"kill_timeout": "3m"}}, SLURM, "slurm_gpu_checks_") == [
        "slurm_gpu_checks_options.kill_timeout must be a number of seconds (e.g. 120), got '3m'"]
    # "3" converts here; the runner, reading JSON, refuses it on the node with its own line.
    assert role_settings_problems({"slurm_gpu_checks_options": {"kill_timeout": "3"}}, SLURM, "slurm_gpu_checks_") == []
