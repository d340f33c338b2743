# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""unknown_role_variables: a role's variables that its meta/argument_specs.yml does not know (typos)."""

from __future__ import annotations

import typing as t

from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_vars import role_options, unknown_variables


def unknown_role_variables(names: t.Any, role_path: str, prefix: str, role: str = "", not_options: t.Iterable[str] = ()) -> list[str]:
    """Names of the role's prefix that its argument spec lacks -> one sentence each, with the closest known name."""
    if not isinstance(names, (list, tuple)):
        raise AnsibleFilterError(f"unknown_role_variables expects a list of variable names, got {type(names).__name__}")
    spec = role_options(str(role_path))
    if spec is None:
        raise AnsibleFilterError(f"unknown_role_variables: no meta/argument_specs.yml in {role_path}")
    return unknown_variables(names, spec, prefix, role or "zeromib.gpu." + prefix.rstrip("_"), frozenset(not_options))


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"unknown_role_variables": unknown_role_variables}
