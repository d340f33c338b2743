# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""Text a user chose (unit, container and process names, command lines) made inert in Markdown.

Anyone on a GPU node picks their process's name and command line (`exec -a`, prctl), and a
report.md goes into tickets and chats: `<svg onload=...>` must not become HTML there, nor `|` a
new table cell, `*`/`_` emphasis, `[x](y)` a link or a newline a new row."""

from __future__ import annotations

# HTML first (as entities: they read as text in every Markdown renderer), then the characters
# that start inline Markdown, escaped with a backslash (CommonMark: any ASCII punctuation).
_HTML = (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"))
_INLINE = "\\`*_[]|~"


def markdown_escape(value, missing="-"):
    """One value -> inert Markdown on one line (a table cell, a heading). None -> `missing`."""
    if value is None:
        return missing
    text = " ".join(line for line in str(value).splitlines() if line)
    for char, entity in _HTML:
        text = text.replace(char, entity)
    return "".join("\\" + char if char in _INLINE else char for char in text)
