# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""The collection's roles' variables typed as their first task checks them.

roles/free_gpus/meta/argument_specs.yml gives every variable `type: raw` (its description says
what it takes): Ansible's own role argument validation, which runs first unless the play says
`rolespec_validate: false`, then passes, and the gate's check says a mistake in the user's words
("free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"). With the real types
there, Ansible's check failed first, with a Python class name (`_AnsibleTaggedStr`) and a dump of
the whole specification (~45 KB), and the collection's line never came (issue 55). The types live
here, beside the gate; tests/unit/plugins/action/test_role_spec.py holds them to gpu_release's own
argument spec and to the role's file. The restore_gpus and slurm_gpu_checks roles do the same
(RESTORE_TYPES, SLURM_TYPES), checked by the role_settings_problems filter in their first task;
each mistake is said by `plain_errors`, the gate's words.
"""

from __future__ import annotations

import difflib
import json
import re
import typing as t

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.plugin_utils import _plain

# The gpu_release options the role passes (free_gpus_<option>) are typed by the one option table
# (_options.role_types); the role's own variables, and require_healthy (gpu_release's health), here.
TYPES: dict[str, dict[str, t.Any]] = dict(
    _options.role_types("free_gpus_"),
    free_gpus_expected_count={"type": "int"},
    free_gpus_on_failure={"type": "str", "choices": ["none", "drain"]},
    free_gpus_require_healthy={"type": "bool"},
    free_gpus_slurm_node_name={"type": "str"},
    free_gpus_strict={"type": "bool"},
)


RESTORE_TYPES: dict[str, dict[str, t.Any]] = {
    "restore_gpus_forget": {"type": "list", "elements": "str"},
    "restore_gpus_max_used_mib": {"type": "int"},
    "restore_gpus_nvidia_smi": {"type": "str"},
    "restore_gpus_reload_despite_gpu_containers": {"type": "bool"},
    "restore_gpus_recreate_mig_layout": {"type": "bool"},
    "restore_gpus_require_healthy": {"type": "bool"},
    "restore_gpus_resume_drained": {"type": "bool"},
    "restore_gpus_slurm_node_name": {"type": "str"},
    "restore_gpus_step_timeout": {"type": "float"},
    # false, true or seconds: gpu_restore's own check says a wrong one.
    "restore_gpus_wait_for_gpus": {"type": "raw"},
}

SLURM_TYPES: dict[str, dict[str, t.Any]] = {
    "slurm_gpu_checks_config_path": {"type": "path"},
    "slurm_gpu_checks_configless_paths": {"type": "list", "elements": "path"},
    "slurm_gpu_checks_hook_dir": {"type": "path"},
    "slurm_gpu_checks_hook_name": {"type": "str"},
    "slurm_gpu_checks_hooks": {"type": "list", "elements": "str", "choices": ["prolog", "epilog"]},
    "slurm_gpu_checks_manage_slurm_conf": {"type": "bool"},
    # A mapping whose entries the file names (a misspelt one stops the play here); their values are
    # the runner's to check as well, as it reads them from JSON (no conversion: "3" is no number there).
    "slurm_gpu_checks_options": {"type": "dict"},
    "slurm_gpu_checks_prolog_epilog_timeout": {"type": "int"},
    "slurm_gpu_checks_python": {"type": "path"},
    "slurm_gpu_checks_reconfigure": {"type": "bool"},
    "slurm_gpu_checks_runner_path": {"type": "path"},
    "slurm_gpu_checks_slurm_conf": {"type": "path"},
    "slurm_gpu_checks_state": {"type": "str", "choices": ["present", "absent"]},
}

ROLE_TYPES = {"free_gpus_": TYPES, "restore_gpus_": RESTORE_TYPES, "slurm_gpu_checks_": SLURM_TYPES}


def typed(options: t.Mapping[str, t.Mapping[str, t.Any]],
          types: t.Mapping[str, t.Mapping[str, t.Any]] | None = None) -> dict[str, dict[str, t.Any]]:
    """The role file's options with their types, elements and choices as the role's check has them
    (a None in `types` drops the file's key: the role's check leaves that part to another)."""
    types = TYPES if types is None else types
    out = {}
    for name, option in options.items():
        loose = {key: value for key, value in option.items() if key not in ("type", "elements", "choices")}
        merged = dict(loose, **types.get(name, {"type": "raw"}))
        out[name] = {key: value for key, value in merged.items() if value is not None}
    return out


# Ansible's validator words a type mistake for a module author ("argument 'x' is of type str and
# we were unable to convert to float: <class '..._AnsibleTaggedStr'> cannot be ..."): said here as
# the user wrote it, the variable, what it must be and the value given.
# ansible-core 2.17 and 2.18 name the type given as a class (`is of type <class 'str'>`).
_GIVEN = r"is of type (?:\w+|<class '[^']+'>)(?: found in '(?P<parent>[^']+)'\.?)? and we were unable to convert to (?P<type>\w+)"
_TYPE_ERROR = re.compile(r"^argument '(?P<name>[^']+)' " + _GIVEN)
_ELEMENT_ERROR = re.compile(r"^Elements value for option '(?P<name>[^']+)' " + _GIVEN)
# A key a mapping's options do not have (the validator's message, without its caller's prefix).
_UNSUPPORTED = re.compile(r"^(?P<names>[\w.]+(?:, [\w.]+)*)\. Supported parameters include: (?P<known>.*?)\.?$")
_TYPE_WORDS = {"float": "a number", "int": "a whole number", "bool": "true or false", "list": "a list", "dict": "a mapping",
               "str": "a string", "path": "a path (a string)", "raw": "a value"}


def _shown(value: t.Any) -> str:
    plain = _plain.plain(value)
    return repr(plain) if isinstance(plain, str) else json.dumps(plain, default=str)


def _must_be(name: str, kind: str) -> str:
    words = _TYPE_WORDS.get(kind, f"a {kind}")
    if kind in ("float", "int") and name.endswith(("_timeout", "_interval")):
        words += " of seconds (e.g. 120)"
    return words


def _given(found: t.Match[str], provided: t.Mapping[str, t.Any]) -> tuple[str, t.Any]:
    """(the variable as the user names it, the value given) of one validator message."""
    name, parent = found["name"], found["parent"]
    if not parent:
        return name, provided.get(name)
    inner = provided.get(parent)
    return f"{parent}.{name}", inner.get(name) if isinstance(inner, t.Mapping) else None


def plain_errors(messages: t.Iterable[str], provided: t.Mapping[str, t.Any]) -> list[str]:
    """The validator's messages -> one line each, naming the variable, its type and the value given."""
    said = []
    for message in messages:
        text = " ".join(str(message).split())
        found = _TYPE_ERROR.match(text)
        element = _ELEMENT_ERROR.match(text)
        if found:
            name, value = _given(found, provided)
            text = "{} must be {}, got {}".format(name, _must_be(name, found["type"]), _shown(value))
        elif element:
            name, value = _given(element, provided)
            text = "each entry of {} must be {}, got {}".format(name, _must_be(name, element["type"]), _shown(value))
        elif _UNSUPPORTED.match(text):
            said.extend(_unsupported(_UNSUPPORTED.match(text)))  # type: ignore[arg-type]
            continue
        said.append(text)
    return said


def _unsupported(found: t.Match[str]) -> list[str]:
    """`x.kill_timout. Supported parameters include: ...` -> `x.kill_timout is not an option of x; did you mean kill_timeout?`."""
    known = [name.strip() for name in found["known"].split(",")]
    said = []
    for name in found["names"].split(", "):
        parent, _dot, leaf = name.rpartition(".")
        close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
        said.append("{} is not an option{}{}".format(name, f" of {parent}" if parent else "",
                                                     f"; did you mean {close[0]}?" if close else " (its options: {})".format(", ".join(known))))
    return said


def type_problems(settings: t.Mapping[str, t.Any], options: t.Mapping[str, t.Mapping[str, t.Any]],
                  types: t.Mapping[str, t.Mapping[str, t.Any]]) -> list[str]:
    """The role's variables given (`settings`) checked against their types -> one line per mistake."""
    spec = typed(options, types)
    provided = {name: value for name, value in settings.items() if name in spec}
    # The variables' own types first: the validator walks a mapping's options even where the value is
    # no mapping (a TypeError out of ansible-core), so the options are checked only once that passed.
    top = {name: {key: value for key, value in option.items() if key != "options"} for name, option in spec.items()}
    checked = ArgumentSpecValidator(top).validate(provided, validate_role_argument_spec=True)
    if not checked.error_messages:
        checked = ArgumentSpecValidator(spec).validate(provided, validate_role_argument_spec=True)
    return plain_errors(checked.error_messages, provided)
