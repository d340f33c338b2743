# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""A few variables of every host of a play, read once and raw (never templated).

What a play's hosts set for each other (a fact a task returned, a `set_fact`, a `register`) lives
in the variable manager's two caches: `set_fact` and `register` in the non-persistent one, facts a
task returned (`ansible_facts`) in the fact cache. Reading a name there costs nothing per host,
where `hostvars[host]` (in a template, or `HostVars.raw_get`) first merges every variable the
host has: inventory, groups, facts, the play's vars (at 1,000 hosts, ~9 s for one pass of
free_gpus.yml's summary, benchmarks/HISTORY.md, "The audit report at fleet scale (issue 26)"). The caches are the variable manager's own
attributes; a host none of whose names is found there (or an ansible-core without them) is read
through `HostVars.raw_get`, the public way.

A name set both ways reads as the play reads it: `set_fact` over the fact a task returned.
"""

from __future__ import annotations

import typing as t

from ansible.errors import AnsibleError

# Where a play's hosts keep what they set, highest precedence first (a set_fact over a fact).
_CACHES = ("_nonpersistent_fact_cache", "_fact_cache")


def _caches(hostvars: t.Any) -> list[t.Any]:
    manager = getattr(hostvars, "_variable_manager", None)
    return [cache for cache in (getattr(manager, name, None) for name in _CACHES) if cache is not None]


def _cached(caches: list[t.Any], host: str) -> list[t.Mapping[str, t.Any]]:
    found = []
    for cache in caches:
        try:
            values = cache.get(host)
        except (AnsibleError, KeyError, TypeError):
            values = None
        if isinstance(values, t.Mapping):
            found.append(values)
    return found


def play_vars(task_vars: t.Mapping[str, t.Any], hosts: t.Iterable[str], names: t.Iterable[str]) -> dict[str, dict[str, t.Any]]:
    """{host: {name: value}} for each of `names` a host of `hosts` has; a host that has none of
    them maps to {}. A host with none of them in the caches is looked up through `raw_get` (an
    unreachable host's registered result, a name set by the inventory or `-e`), once. Values are
    raw: Ansible's own objects, to be copied (plugin_utils._plain) before anything but reading."""
    names = list(names)
    hostvars = task_vars.get("hostvars")
    caches = _caches(hostvars)
    found: dict[str, dict[str, t.Any]] = {}
    for host in hosts:
        values: dict[str, t.Any] = {}
        layers = _cached(caches, host)
        for name in names:
            layer = next((layer for layer in layers if name in layer), None)
            if layer is not None:
                values[name] = layer[name]
        if not values and hostvars is not None:
            # Not in the caches (an unreachable host's, or one set by the inventory or -e).
            values = _raw(hostvars, host, names)
        found[host] = values
    return found


def _raw(hostvars: t.Any, host: str, names: list[str]) -> dict[str, t.Any]:
    try:
        variables = hostvars.raw_get(host)
    except (AnsibleError, KeyError):
        return {}
    if not isinstance(variables, t.Mapping):
        return {}
    return {name: variables[name] for name in names if name in variables}
