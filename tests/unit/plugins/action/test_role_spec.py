# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The free_gpus role's argument spec and defaults against gpu_release's argument spec, for every
variable the gate (the free_gpus_gate action) hands to the module."""

from __future__ import annotations

import os

import pytest
import yaml

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _gate as free_gpus_gate
from ansible_collections.zeromib.gpu.plugins.modules import gpu_release
from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_spec import TYPES, typed

ROLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, os.pardir, os.pardir, "roles", "free_gpus")


def _role_file_spec():
    with open(os.path.join(ROLE, "meta", "argument_specs.yml")) as handle:
        return yaml.safe_load(handle)["argument_specs"]["main"]["options"]


def _role_spec():
    """The role's variables as the gate checks them: the file's, with the gate's types."""
    return typed(_role_file_spec())


def _role_defaults():
    with open(os.path.join(ROLE, "defaults", "main.yml")) as handle:
        return yaml.safe_load(handle)


def _passed_through():
    """free_gpus_X -> X for every role variable the gate hands to gpu_release."""
    return {name: name[len(free_gpus_gate.ROLE_PREFIX):] for name in _role_spec() if name not in free_gpus_gate.GATE_ONLY}


def test_the_role_passes_through_only_options_gpu_release_has():
    assert sorted(option for option in _passed_through().values() if option not in gpu_release.ARGUMENT_SPEC) == []


@pytest.mark.parametrize("name", sorted(_passed_through()))
def test_each_role_variable_has_the_type_default_and_choices_of_its_gpu_release_option(name):
    role, module = _role_spec()[name], gpu_release.ARGUMENT_SPEC[_passed_through()[name]]
    option = _passed_through()[name]
    if option in free_gpus_gate.OMIT_WHEN_EMPTY:
        # Empty in the role means "not given": the gate leaves it out and gpu_release's default
        # (None: search PATH, no MIG check) applies. A path option is a plain string there.
        assert role.get("default") == "" and module.get("default") is None
        assert role.get("type", "str") == "str" and module.get("type") in ("str", "path")
        assert [c for c in role.get("choices") or [] if c != ""] == (module.get("choices") or [])
        return
    assert role.get("type", "str") == module.get("type", "str")
    assert role.get("elements") == module.get("elements")
    assert role.get("choices") == module.get("choices")
    assert role.get("default") == module.get("default")


def test_the_role_defaults_are_its_argument_spec_defaults():
    spec, defaults = _role_spec(), _role_defaults()
    assert sorted(defaults) == sorted(spec)
    assert {name: value for name, value in defaults.items() if value != spec[name].get("default")} == {}


def test_the_roles_file_types_every_variable_raw_so_that_ansibles_own_check_lets_the_gates_speak():
    spec = _role_file_spec()
    assert sorted(spec) == sorted(TYPES), "one type for each variable of the role, and none other"
    assert {name: option.get("type") for name, option in spec.items() if option.get("type") != "raw" or "elements" in option
            or "choices" in option} == {}


@pytest.mark.parametrize("name", sorted(TYPES))
def test_each_variables_description_says_what_it_takes(name):
    description = " ".join(_role_file_spec()[name]["description"])
    kind = TYPES[name]
    if "choices" in kind:
        said = "One of " + ", ".join('V("")' if c == "" else f"V({c})" for c in kind["choices"]) + "."
    else:
        said = {"float": "A number.", "int": "A whole number.", "bool": "V(true) or V(false).", "str": "A string.", "dict": "A mapping.",
                "list": "A list of whole numbers." if kind.get("elements") == "int" else "A list of strings."}[kind["type"]]
    assert description.endswith(said), (name, description[-80:])
