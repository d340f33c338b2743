# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""markdown_escape: user-chosen text made inert in Markdown (the audit's report.md)."""

from __future__ import annotations

import typing as t

from ansible_collections.zeromib.gpu.plugins.plugin_utils._markdown import markdown_escape


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"markdown_escape": markdown_escape}
