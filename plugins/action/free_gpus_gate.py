# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The free_gpus role's gate in one task per host (documented in plugins/modules/free_gpus_gate.py).

On the controller: validate the role's variables against its meta/argument_specs.yml, run
zeromib.gpu.gpu_release once on the node, turn its result into the `free_gpus_result` fact with
the free_gpus_outcome filter, and record the verdict in it. It never fails the host itself: the
role's next task (plugins/action/free_gpus_verdict.py) fails each host that is not free with
that fact's message, once, when every host's outcome is known.

Why an action and not four tasks (validation, module, set_fact, assert): every task costs
Ansible a worker process per host on the controller (~0.05-0.1 s of CPU each on 2 cores,
docs/benchmarks.md); the three that ran no SSH were most of the gate's cost over a one-task play.
"""

from __future__ import annotations

import difflib
import gc
import multiprocessing
import json
import os
import re
import typing as t

import yaml
from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.plugin_utils import _plain
from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import failed, in_role_words, outcome_of
from ansible_collections.zeromib.gpu.plugins.plugin_utils._verdict import Verdict, verdict

# The C loader when PyYAML was built with libyaml (the argument specs load faster).
_YamlLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

ROLE_PREFIX = "free_gpus_"
ENTRY_POINT = "main"
# Role variables that are not gpu_release options: the gate itself uses them.
GATE_ONLY = frozenset(["free_gpus_expected_count", "free_gpus_require_healthy", "free_gpus_strict"])
# Role variables of the role's rescue (tasks/drain.yml), not of gpu_release.
GATE_ONLY = GATE_ONLY | frozenset(["free_gpus_on_failure", "free_gpus_slurm_node_name"])
# Options dropped when empty, so that gpu_release's own default applies (search PATH for nvidia-smi).
OMIT_WHEN_EMPTY = frozenset(["nvidia_smi", "expected_mig_mode"])
# free_gpus_* names that are not role variables and are no typo: the fact the role sets, and
# free_gpus.yml's host pattern.
NOT_OPTIONS = frozenset(["free_gpus_result", "free_gpus_hosts"])
# What a gate's result leaves out without -v: the GPU and holder records (a screen each on an
# 8-GPU node; free_gpus_result keeps their figures) and the role's whole argument spec.
RECORD_KEYS = ("gpus", "gpus_before", "holders", "argument_spec_data")


def unknown_variables(names: t.Iterable[str], spec: t.Mapping[str, t.Any]) -> list[str]:
    """free_gpus_* variables the role does not know -> warnings naming the closest known one."""
    warnings = []
    # Compared without the prefix they all share, which would make every name look close.
    known = sorted(name[len(ROLE_PREFIX):] for name in spec if name.startswith(ROLE_PREFIX))
    for name in sorted(n for n in names if n.startswith(ROLE_PREFIX) and n not in spec and n not in NOT_OPTIONS):
        close = difflib.get_close_matches(name[len(ROLE_PREFIX):], known, n=1, cutoff=0.6)
        warnings.append("{} is not a variable of the zeromib.gpu.free_gpus role and is ignored{}".format(
            name, f"; did you mean {ROLE_PREFIX}{close[0]}?" if close else " (its variables: meta/argument_specs.yml)"))
    return warnings


# Ansible's validator words a type mistake for a module author ("argument 'x' is of type str and
# we were unable to convert to float: <class '..._AnsibleTaggedStr'> cannot be ..."): said here as
# the user wrote it, the variable, what it must be and the value given.
# ansible-core 2.17 and 2.18 name the type given as a class (`is of type <class 'str'>`).
_GIVEN = r"is of type (?:\w+|<class '[^']+'>) and we were unable to convert to (?P<type>\w+)"
_TYPE_ERROR = re.compile(r"^argument '(?P<name>[^']+)' " + _GIVEN)
_ELEMENT_ERROR = re.compile(r"^Elements value for option '(?P<name>[^']+)' " + _GIVEN)
_TYPE_WORDS = {"float": "a number", "int": "a whole number", "bool": "true or false", "list": "a list", "dict": "a mapping",
               "str": "a string", "raw": "a value"}


def _shown(value: t.Any) -> str:
    plain = _plain.plain(value)
    return repr(plain) if isinstance(plain, str) else json.dumps(plain, default=str)


def _must_be(name: str, kind: str) -> str:
    words = _TYPE_WORDS.get(kind, f"a {kind}")
    if kind in ("float", "int") and name.endswith(("_timeout", "_interval")):
        words += " of seconds (e.g. 120)"
    return words


def plain_errors(messages: t.Iterable[str], provided: t.Mapping[str, t.Any]) -> list[str]:
    """The validator's messages -> one line each, naming the variable, its type and the value given."""
    said = []
    for message in messages:
        text = " ".join(str(message).split())
        found = _TYPE_ERROR.match(text)
        element = _ELEMENT_ERROR.match(text)
        if found:
            name = found["name"]
            text = "{} must be {}, got {}".format(name, _must_be(name, found["type"]), _shown(provided.get(name)))
        elif element:
            name = element["name"]
            text = "each entry of {} must be {}, got {}".format(name, _must_be(name, element["type"]), _shown(provided.get(name)))
        said.append(text)
    return said


def warning_text(warning: t.Any) -> t.Any:
    """A module's warning as text (ansible-core 2.19 hands the action a WarningSummary, whose text
    is its event's msg); anything else unchanged."""
    if isinstance(warning, str):
        return warning
    msg = getattr(getattr(warning, "event", None), "msg", None)
    return msg if isinstance(msg, str) else warning


def not_found_warnings(not_found: t.Iterable[str], known: t.Iterable[str], warnings: t.Iterable[str]) -> list[str]:
    """services entries gpu_release found nothing for -> one warning each (unless it already warned
    about it), naming the closest unit, container or program name the host has."""
    names = sorted(set(known))
    said = []
    for entry in not_found:
        if any(isinstance(w, str) and entry in w for w in warnings):
            continue
        close = difflib.get_close_matches(entry, names, n=1, cutoff=0.6)
        said.append("free_gpus_services: {} matches no unit, container or supervisord program on this host{}".format(
            entry, f"; did you mean {close[0]}?" if close else ""))
    return said


def strict_problems(unknown: t.Iterable[str], not_found: t.Iterable[str], known: t.Iterable[str]) -> list[str]:
    """free_gpus_strict: the typos and the services entries that match nothing, as one sentence each."""
    names = sorted(set(known))
    # Not ignored here: the run stops.
    problems = [u.replace(" and is ignored", "") for u in unknown]
    for entry in not_found:
        close = difflib.get_close_matches(entry, names, n=1, cutoff=0.6)
        problems.append("free_gpus_services: {} matches no unit, container or supervisord program on this host{}".format(
            entry, f"; did you mean {close[0]}?" if close else ""))
    return problems


def range_problems(params: t.Mapping[str, t.Any]) -> list[str]:
    """The role's numeric variables checked as gpu_release checks its options, named as the role names them."""
    plain = {name[len(ROLE_PREFIX):]: value for name, value in params.items() if name.startswith(ROLE_PREFIX)}
    return _options.check(plain, ROLE_PREFIX)


def without_records(result: dict[str, t.Any], verbosity: int) -> dict[str, t.Any]:
    """A gate's result as the task returns it without -v: no GPU or holder records. Nothing shows
    them at that verbosity, and the controller's main process walks every key of every host's
    result for its callbacks (~12 ms of CPU a clean 8-GPU host on the 2-core benchmark machine,
    docs/benchmarks.md). -v returns them all."""
    if verbosity > 0:
        return result
    return {key: value for key, value in result.items() if key not in RECORD_KEYS}


def gate_failures(release: t.Mapping[str, t.Any], params: t.Mapping[str, t.Any], check_mode: bool) -> list[str]:
    """The role's verdict on one host -> the names of the checks that fail (empty: the host passes)."""
    return role_verdict(release, params, check_mode).failed_checks


def role_verdict(release: t.Mapping[str, t.Any], params: t.Mapping[str, t.Any], check_mode: bool) -> Verdict:
    """The one verdict (plugin_utils/_verdict.py) with the role's settings."""
    return verdict(release, params.get("free_gpus_expected_count"), check_mode, params.get("free_gpus_require_healthy", True))


def module_args(params: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """Validated role variables -> gpu_release's options (free_gpus_X -> X)."""
    args = {}
    for name, value in params.items():
        if not name.startswith(ROLE_PREFIX) or name in GATE_ONLY:
            continue
        option = name[len(ROLE_PREFIX):]
        if option in OMIT_WHEN_EMPTY and not value:
            continue
        args[option] = value
    return args


_SPECS: dict[str, dict[str, t.Any] | None] = {}


def role_options(role_path: str) -> dict[str, t.Any] | None:
    """The `options` of the role's main entry point, or None without a spec file. Cached: the
    strategy imports this plugin on the controller before it forks a worker per host, and the
    collection's own role is read here at import, so no worker parses the YAML again
    (~10 ms each with Ansible's loader)."""
    role_path = os.path.realpath(role_path)
    if role_path not in _SPECS:
        _SPECS[role_path] = None
        for ext in (".yml", ".yaml"):
            path = os.path.join(role_path, "meta", "argument_specs" + ext)
            if os.path.exists(path):
                with open(path, "rb") as handle:
                    specs = yaml.load(handle, Loader=_YamlLoader) or {}
                _SPECS[role_path] = ((specs.get("argument_specs") or {}).get(ENTRY_POINT) or {}).get("options") or {}
                break
    return _SPECS[role_path]


try:
    role_options(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "roles", "free_gpus"))
except (OSError, yaml.YAMLError):
    pass


class _Invalid(Exception):
    """The role's variables fail their checks: `result` is the task's failed result."""

    def __init__(self, result: dict[str, t.Any]) -> None:
        super().__init__(result["msg"])
        self.result = result


def pause_collector_in_worker() -> None:
    """In Ansible's worker (a fork of the controller that ends with this one task), no cyclic
    garbage collection: Ansible builds gpu_release's payload here (the `ast` of every module_util
    it packs, ~0.9 MB of source), and each collection walked the whole inherited heap; the process
    exits before its garbage matters. Measured on one host (benchmarks/gate_profile.py): the build
    took 297 ms, 188 ms with the inherited objects frozen, ~130 ms with collection off. Anywhere
    else (a test calling the plugin in its own process) nothing changes."""
    if multiprocessing.parent_process() is not None:
        gc.freeze()
        gc.disable()


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset()
    _supports_check_mode = True
    _supports_async = False

    def _recorded(self, result: dict[str, t.Any]) -> dict[str, t.Any]:
        """The gate's result on a host that is not free: recorded, not failed. The role's next task
        (zeromib.gpu.free_gpus_verdict) fails the host with this message, once, where every host's
        outcome is known; free_gpus.yml's fleet summary says it instead."""
        verbosity = Display().verbosity
        if verbosity < 3:
            # -vvv keeps the module's traceback.
            result.pop("exception", None)
        # An ok result is printed with -v only. "failed" stays, False: Ansible fails a result
        # without it whose rc is not 0 (no sudo).
        result["failed"] = False
        return without_records(result, verbosity)

    def _dry_run(self, args: dict[str, t.Any], task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        """gpu_release in check mode (it changes nothing): what a strict run checks first."""
        was = self._task.check_mode
        self._task.check_mode = True
        try:
            return self._execute_module(module_name="zeromib.gpu.gpu_release", module_args=dict(args), task_vars=task_vars)
        finally:
            self._task.check_mode = was

    def _known_names(self, task_vars: dict[str, t.Any]) -> list[str]:
        """The host's systemd unit names (service units), for "did you mean"; asked only when a
        services entry matched nothing. Empty when systemctl cannot be asked."""
        listed = self._low_level_execute_command("systemctl list-unit-files --type=service --plain --no-legend --no-pager 2>/dev/null; "
                                                 "systemctl list-units --type=service --all --plain --no-legend --no-pager 2>/dev/null")
        names = []
        for line in str(listed.get("stdout") or "").splitlines():
            fields = line.split()
            if fields and fields[0].endswith(".service") and "@." not in fields[0]:
                names.append(fields[0])
        return names

    def _strict_failure(self, result: dict[str, t.Any], host: str, unknown: list[str], missing: list[str],
                        known: t.Iterable[str] = ()) -> dict[str, t.Any]:
        problems = strict_problems(unknown, missing, known)
        msg = "settings mistake, nothing was done (free_gpus_strict): " + "; ".join(problems)
        result.update({"failed": True, "msg": msg, "argument_errors": problems,
                       "ansible_facts": {"free_gpus_result": failed(host, msg, "invalid")}})
        result["warnings"] = []
        return result

    def _argument_spec(self, task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        role_path = task_vars.get("role_path")
        if not role_path:
            raise AnsibleActionFail("zeromib.gpu.free_gpus_gate runs inside the zeromib.gpu.free_gpus role only")
        spec = role_options(role_path)
        if spec is None:
            raise AnsibleActionFail(f"no meta/argument_specs.yml in {role_path}")
        return spec

    def _validated(self, task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        """The role's variables, checked and typed as Ansible's automatic validation task checks
        them (ansible.builtin.validate_argument_spec: same validator, same message), then their
        ranges as gpu_release checks them."""
        spec = self._argument_spec(task_vars)
        try:
            provided = self._templar.template({name: task_vars[name] for name in spec if name in task_vars})
        except AnsibleError as exc:
            raise _Invalid({"failed": True, "msg": "settings mistake, nothing was done: a free_gpus_* variable cannot be templated: {}".format(
                " ".join(str(getattr(exc, "message", exc)).split()))}) from exc
        validator = ArgumentSpecValidator(spec)
        checked = validator.validate(provided, validate_role_argument_spec=True)
        if checked.error_messages:
            errors = plain_errors(checked.error_messages, provided)
            raise _Invalid({
                "failed": True,
                "msg": "settings mistake, nothing was done: {}".format("; ".join(errors)),
                "argument_errors": errors,
                "argument_spec_data": spec,
            })
        problems = range_problems(checked.validated_parameters)
        if problems:
            raise _Invalid({"failed": True, "msg": "settings mistake, nothing was done: " + "; ".join(problems), "argument_errors": problems})
        return checked.validated_parameters

    def run(self, tmp: str | None = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        pause_collector_in_worker()
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        # Ansible sets it for every task.
        host = t.cast(str, task_vars.get("inventory_hostname"))
        warnings = [f"{host}: {warning}" for warning in unknown_variables(task_vars, self._argument_spec(task_vars))]
        try:
            params = self._validated(task_vars)
        except _Invalid as exc:
            invalid = exc.result
            result.update(invalid)
            # The summary of free_gpus.yml lists this host with its error, as any failed host.
            result["ansible_facts"] = {"free_gpus_result": failed(host, invalid["msg"], "invalid")}
            result["warnings"] = warnings
            return self._recorded(result)
        strict = bool(params.get("free_gpus_strict"))
        if strict and warnings:
            return self._recorded(self._strict_failure(result, host, unknown_variables(task_vars, self._argument_spec(task_vars)), []))
        if strict and params.get("free_gpus_services") and not self._task.check_mode:
            # A dry run first: a services entry that matches nothing fails before anything is done.
            dry = self._dry_run(module_args(params), task_vars)
            missing = list(dry.get("services_not_found") or [])
            if missing:
                return self._recorded(self._strict_failure(result, host, [], missing, self._known_names(task_vars)))
        release = self._execute_module(module_name="zeromib.gpu.gpu_release", module_args=module_args(params),
                                       task_vars=task_vars)
        missing = list(release.get("services_not_found") or [])
        if missing:
            if strict:
                # check mode: the dry run is this run
                return self._recorded(self._strict_failure(result, host, [], missing, self._known_names(task_vars)))
            release_warnings = [warning_text(w) for w in release.get("warnings") or []]
            release["warnings"] = release_warnings + [f"{host}: {w}" for w in not_found_warnings(missing, self._known_names(task_vars), release_warnings)]
        check_mode = bool(self._task.check_mode)
        found = role_verdict(release, params, check_mode)
        outcome = outcome_of(release, host, found, check_mode)
        # Said as the role's user sets them: free_gpus_max_used_mib, not the module's max_used_mib.
        outcome["message"] = in_role_words(outcome["message"])
        result.update(release)
        result["warnings"] = warnings + [in_role_words(text) if isinstance(text := warning_text(w), str) else w
                                         for w in release.get("warnings") or []]
        # Set on every host, free or not: this task never fails (Ansible drops a failed task's facts).
        result["ansible_facts"] = {"free_gpus_result": outcome}
        result["msg"] = outcome["message"]
        if found.failed_checks:
            result["failed_checks"] = found.failed_checks
            return self._recorded(result)
        result.pop("failed", None)
        return without_records(result, Display().verbosity)
