# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One option table (_options.OPTIONS, issue 68) read by every entry point, and the literal texts
that must say the same held to it: each module's DOCUMENTATION (ansible-doc and sanity read the
literal, with its doc fragments), the free_gpus role's defaults and argument specs, the Slurm
runner's options. The modules' argument specs, the runner's defaults and type checks and the
role's types are built from the table; these tests check that what is built is what was meant."""

from __future__ import annotations

import importlib
import os

import pytest
import yaml

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _jobcheck
from ansible_collections.zeromib.gpu.plugins.modules import gpu_facts, gpu_release
from ansible_collections.zeromib.gpu.plugins.plugin_utils import _role_spec

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, os.pardir, os.pardir)
MODULES = {_options.FACTS: gpu_facts, _options.RELEASE: gpu_release}


def documented_options(module):
    """The options a module's DOCUMENTATION says, with those of its zeromib.gpu doc fragments."""
    doc = yaml.safe_load(module.DOCUMENTATION)
    options = dict(doc.get("options") or {})
    for fragment in doc.get("extends_documentation_fragment") or []:
        if fragment.startswith("zeromib.gpu."):
            source = importlib.import_module("ansible_collections.zeromib.gpu.plugins.doc_fragments." + fragment.split(".")[-1])
            options.update(yaml.safe_load(source.ModuleDocFragment.DOCUMENTATION).get("options") or {})
    return options


def as_documented(option):
    """A table row as DOCUMENTATION writes it: type, default, choices, elements."""
    entry = option.spec()
    return {key: entry[key] for key in ("type", "default", "choices", "elements") if key in entry}


def role_file(name):
    with open(os.path.join(ROOT, "roles", "free_gpus", name)) as handle:
        return yaml.safe_load(handle)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_documentation_names_the_tables_options_of_the_module_with_the_same_type_default_and_choices(name):
    documented = documented_options(MODULES[name])
    table = {option.name: option for option in _options.OPTIONS if name in option.modules}
    assert sorted(documented) == sorted(table)
    for option in table.values():
        said = {key: documented[option.name][key] for key in ("type", "default", "choices", "elements") if key in documented[option.name]}
        assert said == as_documented(option), option.name


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_modules_argument_spec_is_the_tables(name):
    assert _options.argument_spec(name) == MODULES[name].ARGUMENT_SPEC


def test_the_role_has_a_variable_for_each_option_it_passes_with_the_tables_default():
    specs, defaults = role_file("meta/argument_specs.yml")["argument_specs"]["main"]["options"], role_file("defaults/main.yml")
    for option in _options.OPTIONS:
        if not option.role:
            continue
        variable = "free_gpus_" + option.name
        assert variable in specs and variable in _role_spec.TYPES, variable
        # The role writes an unset path or choice as "", a list as [], an unset mapping as null.
        unset = None if option.type == "dict" else ""
        expected = unset if option.default is None else list(option.default) if isinstance(option.default, tuple) else option.default
        assert defaults[variable] == expected, variable
        assert specs[variable].get("default", expected) == expected, variable


def test_the_slurm_runner_takes_the_tables_slurm_options_with_its_types_and_its_own_job_boundary_defaults():
    config = _jobcheck.check_config({})
    for option in _options.OPTIONS:
        if option.slurm:
            expected = _jobcheck.JOB_DEFAULTS.get(option.name, option.spec().get("default"))
            assert config[option.name] == expected, option.name
    assert _jobcheck.JOB_DEFAULTS["kill_timeout"] < _options.BY_NAME["kill_timeout"].default
    # A wrong type of each kind is said, from the table's types.
    with pytest.raises(_jobcheck.JobCheckError) as info:
        _jobcheck.check_config({"kill_timeout": "3", "clean_shm": "yes", "xid_fatal": ["79"], "expected_mig_mode": "on", "nvidia_smi": 5})
    for words in ("kill_timeout must be a number", "clean_shm must be true or false", "xid_fatal must be a list of Xid numbers",
                  "expected_mig_mode must be enabled, disabled or null", "nvidia_smi must be a path or null"):
        assert words in str(info.value), words


def test_every_row_says_what_it_is_and_every_time_is_bounded():
    for option in _options.OPTIONS:
        assert option.doc and option.modules, option.name
        if option.type == "float" and option.name != "xid_window_hours":
            assert option.most == _options.DAY and option.low is not None, option.name
    assert len(_options.BY_NAME) == len(_options.OPTIONS)
