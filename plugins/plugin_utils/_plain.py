# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

from __future__ import annotations

import typing as t
from collections.abc import Mapping, Sequence


_SCALARS = frozenset([str, int, float, bool, type(None)])


def plain(value: t.Any) -> t.Any:
    """Ansible's tagged str/list/dict subclasses confuse JMESPath's type checks; copy to plain types."""
    # Exact types first: a 4,000-host audit holds millions of values, and the ABC checks below
    # cost several times the copy itself.
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        return {str(k): plain(v) for k, v in value.items()}
    if kind is list:
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (str, bytes)):
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, (Sequence, set, frozenset)):
        return [plain(v) for v in value]
    return value
