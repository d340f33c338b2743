# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""Text a user chose (unit, container and process names, command lines) made inert in Markdown.

Anyone on a GPU node picks their process's name and command line (`exec -a`, prctl), and a
report.md goes into tickets and chats: `<svg onload=...>` must not become HTML there, nor `|` a
new table cell, `*`/`_` emphasis, `[x](y)` a link or a newline a new row."""

from __future__ import annotations

import re

# HTML first (as entities: they read as text in every Markdown renderer), then the characters
# that start inline Markdown, escaped with a backslash (CommonMark: any ASCII punctuation). An
# underscore only where it could open or close emphasis: CommonMark ignores one between two
# letters or digits, so CUDA_ERROR_OUT_OF_MEMORY and VLLM::Worker_TP0 stay readable.
_HTML = (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"))
_INLINE = re.compile(r"([\\`*\[\]|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def markdown_escape(value: object, missing: str = "-") -> str:
    """One value -> inert Markdown on one line (a table cell, a heading). None -> `missing`."""
    if value is None:
        return missing
    text = " ".join(line for line in str(value).splitlines() if line)
    for char, entity in _HTML:
        text = text.replace(char, entity)
    return _INLINE.sub(r"\\\1", text)


def markdown_code(value: object) -> str:
    """A command line inside a Markdown code span of a table cell: spans take no backslash escapes,
    so a backtick (which would end the span) becomes a quote and a pipe (which would end the cell) is escaped."""
    return " ".join(line for line in str(value or "").splitlines() if line).replace("`", "'").replace("|", "\\|")
