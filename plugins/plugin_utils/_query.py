# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""JMESPath over fleet data (the fleet_query filter, the gpu_audit_report action). Documented in
plugins/filter/fleet_query.py."""

from __future__ import annotations

import typing as t

from ansible.errors import AnsibleFilterError

try:
    import jmespath
except ImportError:  # pragma: no cover - exercised through a test that hides the module
    jmespath = None  # type: ignore[assignment]  # the filter says so when it is used

NO_JMESPATH = ("zeromib.gpu.fleet_query needs the 'jmespath' Python library on the controller "
               "(pip install jmespath in the Python that runs ansible-playbook)")


def search_plain(data: t.Any, expr: str) -> t.Any:
    """One query over data that is plain Python already (no copy); the report plugin's way in."""
    if jmespath is None:
        raise AnsibleFilterError(NO_JMESPATH)
    return search(data, expr)


def search(data: t.Any, expr: str) -> t.Any:
    if not isinstance(expr, str) or not expr.strip():
        raise AnsibleFilterError(f"zeromib.gpu.fleet_query needs a non-empty JMESPath expression, got {expr!r}")
    try:
        compiled = jmespath.compile(str(expr))
    except jmespath.exceptions.JMESPathError as exc:
        raise AnsibleFilterError(f"zeromib.gpu.fleet_query: bad JMESPath expression {str(expr)!r}: {exc}") from exc
    try:
        return compiled.search(data)
    except jmespath.exceptions.JMESPathError as exc:
        raise AnsibleFilterError(f"zeromib.gpu.fleet_query: JMESPath expression {str(expr)!r} failed on this data: {exc}") from exc
