# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""markdown_escape: names chosen by any user of a node, made inert for report.md."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.plugin_utils._markdown import markdown_escape


@pytest.mark.parametrize("raw, escaped", [
    ("<svg onload=alert(1)>", "&lt;svg onload=alert(1)&gt;"),
    ("a|b", "a\\|b"),
    ("*bold* _em_", "\\*bold\\* \\_em\\_"),
    ("`code`", "\\`code\\`"),
    ("[x](http://y)", "\\[x\\](http://y)"),
    ("line1\nline2\r\nline3\rline4", "line1 line2 line3 line4"),
    ("back\\slash", "back\\\\slash"),
    ("~~strike~~ &amp;", "\\~\\~strike\\~\\~ &amp;amp;"),
    ("VLLM::Worker_TP0", "VLLM::Worker_TP0"),
    ("sglang (lmsysorg/sglang:v0.4.9-cu124)", "sglang (lmsysorg/sglang:v0.4.9-cu124)"),
], ids=["html", "pipe", "emphasis", "backticks", "link", "newlines", "backslash", "strike-entity", "underscore", "plain"])
def test_markdown_escape(raw, escaped):
    assert markdown_escape(raw) == escaped


def test_missing_values_read_as_a_dash_and_numbers_as_text():
    assert markdown_escape(None) == "-" and markdown_escape(0) == "0" and markdown_escape(None, missing="n/a") == "n/a"
