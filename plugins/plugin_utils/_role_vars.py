# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""A role's variables as its meta/argument_specs.yml names them, and the ones it does not know.

A misspelled variable (`free_gpus_sevices`, `restore_gpus_resume_drainned`) would be ignored:
its role runs on its default, the opposite of what was asked. Each role of the collection fails
a host that has one before anything is done (issue 55: typos stop the play), naming the closest
known name. Used by the free_gpus gate and by the unknown_role_variables filter (restore_gpus,
slurm_gpu_checks).
"""

from __future__ import annotations

import difflib
import os
import typing as t

import yaml

# The C loader when PyYAML was built with libyaml (the argument specs load faster).
_YamlLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

ENTRY_POINT = "main"
_SPECS: dict[str, dict[str, t.Any] | None] = {}


def role_options(role_path: str) -> dict[str, t.Any] | None:
    """The `options` of the role's main entry point, or None without a spec file. Cached: the
    strategy imports the free_gpus gate on the controller before it forks a worker per host, and
    that role is read there at import, so no worker parses the YAML again (~10 ms each with
    Ansible's loader)."""
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


def unknown_variables(names: t.Iterable[str], spec: t.Mapping[str, t.Any], prefix: str = "free_gpus_", role: str = "zeromib.gpu.free_gpus",
                      not_options: t.Container[str] = ()) -> list[str]:
    """Variables with the role's prefix that the role does not know -> one sentence each, naming
    the closest known one."""
    problems = []
    # Compared without the prefix they all share, which would make every name look close.
    known = sorted(name[len(prefix):] for name in spec if name.startswith(prefix))
    for name in sorted({str(n) for n in names if str(n).startswith(prefix) and n not in spec and n not in not_options}):
        close = difflib.get_close_matches(name[len(prefix):], known, n=1, cutoff=0.6)
        problems.append("{} is not a variable of the {} role{}".format(
            name, role, f"; did you mean {prefix}{close[0]}?" if close else " (its variables: meta/argument_specs.yml)"))
    return problems
