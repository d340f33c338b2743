# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""The role's variables of every host of the play, checked once per play before any host acts
(issue 67: a settings mistake on any host stops every host).

A typo or a wrong type in one host's variables (its host_vars, its group's) used to fail that
host alone while the others stopped and disabled their servers in the same task, and the first
line the user read was another host's warning. Now each host's gate asks, before it does anything,
whether any host of the play has a mistake; if one has, no host acts, and each says which host and
which variable, the offending host's own line saying the whole mistake (said once).

Once per play, not once per host: every gate runs in its own fork of the controller, so the
first to ask checks every host and leaves the answer in the run's private folder (Ansible's local
tmp, 0700, removed at the run's end), under a lock; the others read it. The values are read raw from
the variable manager, as Ansible builds each host's task variables (inventory, groups, play, role,
task, extra vars, set_fact), never templated: a value that is a template is left to its own host's
gate, which templates and checks it before it acts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import typing as t

from ansible.errors import AnsibleError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.plugin_utils import _role_spec
from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_vars import unknown_variables

PREFIX = "free_gpus_"
# How many offending hosts a line names before it counts the rest.
NAMED_HOSTS = 5
_TEMPLATE_MARKS = ("{{", "{%", "{#")


def templated(value: t.Any) -> bool:
    """Whether a raw value holds a Jinja2 template anywhere (its value is known once templated)."""
    if isinstance(value, str):
        return any(mark in value for mark in _TEMPLATE_MARKS)
    if isinstance(value, t.Mapping):
        return any(templated(key) or templated(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(templated(item) for item in value)
    return False


# The role's argument spec, typed, and Ansible's validator built from it: once per spec and process
# (the role's spec is read once, plugin_utils/_role_vars.role_options), not once per host and check.
_CHECKERS: dict[int, tuple[t.Mapping[str, t.Any], dict[str, t.Any], ArgumentSpecValidator]] = {}


def checker(spec: t.Mapping[str, t.Any]) -> tuple[dict[str, t.Any], ArgumentSpecValidator]:
    """(the typed spec, its validator) for a role's options."""
    found = _CHECKERS.get(id(spec))
    if found is None or found[0] is not spec:
        typed_spec = _role_spec.typed(spec)
        found = _CHECKERS[id(spec)] = (spec, typed_spec, ArgumentSpecValidator(typed_spec))
    return found[1], found[2]


def untemplated(values: t.Mapping[str, t.Any], template: t.Callable[[t.Any], t.Any]) -> dict[str, t.Any]:
    """VALUES with each value that holds a template templated by TEMPLATE, the others as they are:
    Ansible's templar wraps every value it is handed, template or not (~half the check's cost)."""
    return {name: template(value) if templated(value) else value for name, value in values.items()}


def range_problems(params: t.Mapping[str, t.Any]) -> list[str]:
    """The role's numeric variables checked as gpu_release checks its options, named as the role names them."""
    plain = {name[len(PREFIX):]: value for name, value in params.items() if name.startswith(PREFIX)}
    return _options.check(plain, PREFIX)


def mistakes(settings: t.Mapping[str, t.Any], spec: t.Mapping[str, t.Any], not_options: t.Container[str] = ()) -> list[str]:
    """One host's free_gpus_* variables (raw) -> its settings mistakes, in the gate's words: the
    typos, then the wrong types, then the values out of range. Templates are not judged here."""
    typos = unknown_variables(settings, spec, not_options=not_options)
    typed_spec, validator = checker(spec)
    known = {name: value for name, value in settings.items() if name in typed_spec and not templated(value)}
    if not known:
        return typos
    checked = validator.validate(known, validate_role_argument_spec=True)
    if checked.error_messages:
        return typos + _role_spec.plain_errors(checked.error_messages, known)
    return typos + range_problems({name: checked.validated_parameters[name] for name in known})


def mistaken_variables(problems: t.Iterable[str]) -> list[str]:
    """The variable each mistake is about (the first it names: not the one "did you mean" offers), each once."""
    found = (re.search(r"\b(free_gpus_\w+)", problem) for problem in problems)
    return list(dict.fromkeys(match.group(1) for match in found if match))


def elsewhere_message(found: t.Mapping[str, t.Sequence[str]]) -> str:
    """What a host with no mistake of its own says: `settings mistake on h2 (free_gpus_wait_timeout),
    nothing was done on any host of the play; its line says what to fix`."""
    hosts = list(found)
    named = ", ".join(hosts[:NAMED_HOSTS]) + (f" and {len(hosts) - NAMED_HOSTS} more" if len(hosts) > NAMED_HOSTS else "")
    names = mistaken_variables(p for problems in found.values() for p in problems)
    return "settings mistake on {}{}, nothing was done on any host of the play; {} what to fix".format(
        named, " ({})".format(", ".join(names)) if names else "", "its line says" if len(hosts) == 1 else "their lines say")


def _play_of(task: t.Any) -> t.Any:
    try:
        return task.get_play()
    except AttributeError:
        return None


def raw_settings(task_vars: t.Mapping[str, t.Any], task: t.Any, hosts: t.Iterable[str]) -> dict[str, dict[str, t.Any]]:
    """{host: its free_gpus_* variables, raw, as Ansible builds them for this task}."""
    hostvars = task_vars.get("hostvars")
    manager = getattr(hostvars, "_variable_manager", None)
    inventory = getattr(manager, "_inventory", None)
    if manager is None or inventory is None:
        return {}
    play = _play_of(task)
    batch = [str(h) for h in task_vars.get("ansible_play_hosts") or []]
    every = [str(h) for h in task_vars.get("ansible_play_hosts_all") or batch]
    found: dict[str, dict[str, t.Any]] = {}
    for name in hosts:
        host = inventory.get_host(name)
        if host is None:
            continue
        try:
            variables = manager.get_vars(play=play, host=host, task=task, include_hostvars=False, _hosts=batch, _hosts_all=every)
        except AnsibleError:
            continue
        found[name] = {key: value for key, value in variables.items() if isinstance(key, str) and key.startswith(PREFIX)}
    return found


def same_settings_key(values: t.Mapping[str, t.Any]) -> str:
    """One key for two hosts' raw settings only when they are the same names with the same values of
    the same types (repr tells 1 from True, 1.0 and "1"): what `mistakes` says depends on nothing else."""
    return repr(sorted((str(name), type(value).__name__, repr(value)) for name, value in values.items()))


def play_mistakes(settings: t.Mapping[str, t.Mapping[str, t.Any]], spec: t.Mapping[str, t.Any],
                  not_options: t.Container[str] = ()) -> dict[str, list[str]]:
    """{host: its mistakes} for each host of SETTINGS that has any, in SETTINGS' order. Hosts with the
    same settings (a fleet's play, role and group variables) are judged once: the first gate of the
    play runs this while every other gate waits on its lock, and Ansible's validator took ~5 ms a
    host (benchmarks/HISTORY.md, "The role's clean path beside one task (issue 68, 2026-12-07)")."""
    found = {}
    judged: dict[str, list[str]] = {}
    for host, values in settings.items():
        key = same_settings_key(values)
        if key not in judged:
            judged[key] = mistakes(values, spec, not_options)
        if judged[key]:
            found[host] = list(judged[key])
    return found


def cache_key(task: t.Any, hosts: t.Sequence[str]) -> str:
    """The play's gate task and its hosts: one answer per play (and per serial batch's hosts)."""
    play = _play_of(task)
    parts = [str(getattr(play, "_uuid", "")), str(getattr(task, "_uuid", "")), *hosts]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _read(path: str) -> dict[str, list[str]] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            answer = json.load(handle)
    except (OSError, ValueError):
        return None
    return {str(host): [str(p) for p in problems] for host, problems in answer.items()} if isinstance(answer, dict) else None


def _write(path: str, answer: dict[str, list[str]]) -> dict[str, list[str]]:
    try:
        with open(path + ".new", "w", encoding="utf-8") as handle:
            json.dump(answer, handle)
        os.replace(path + ".new", path)
    except OSError:
        pass
    return answer


def once(folder: str, key: str, compute: t.Callable[[], dict[str, list[str]]]) -> dict[str, list[str]]:
    """COMPUTE's answer, computed by the first caller of the run with KEY and read by the others
    (the gates of the other hosts, each in its own fork, wait on the lock meanwhile). Without a
    folder to write, computed here."""
    path = os.path.join(folder, f"zeromib-play-settings-{key}.json")
    if not os.path.isdir(folder):
        return compute()
    with open(path + ".lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _read(path)
        return found if found is not None else _write(path, compute())
