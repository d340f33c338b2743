# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Readers for the real nvidia-smi captures under tests/fixtures/nvidia-smi (no test here).

h200-580.159.04/*.txt: `### <command>` first, `### rc=N` last, the output in between.
exporter-captures/*.txt: sections opened by a `#####` rule, `# <phase> :: <kind>`,
`# $ <command>` and another rule.
"""

from __future__ import annotations

import os
import re
import shlex
from collections import namedtuple

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, os.pardir, os.pardir, os.pardir, "fixtures", "nvidia-smi")
H200_DIR = os.path.join(FIXTURES, "h200-580.159.04")
EXPORTER_DIR = os.path.join(FIXTURES, "exporter-captures")

Capture = namedtuple("Capture", "name command args output rc")
Section = namedtuple("Section", "model phase kind command output")
Query = namedtuple("Query", "switch fields header units")

_RULE = "#" * 80
_BANNER = re.compile(r"^# (?P<phase>[^:]+?) :: (?P<kind>.+)$")


def h200_names():
    return sorted(name for name in os.listdir(H200_DIR) if name.endswith(".txt"))


def h200(name):
    with open(os.path.join(H200_DIR, name)) as handle:
        lines = handle.read().splitlines()
    assert lines[0].startswith("### ") and lines[-1].startswith("### rc="), name
    command = lines[0][4:]
    return Capture(name, command, shlex.split(command)[1:], "\n".join(lines[1:-1]) + "\n", int(lines[-1][len("### rc=") :]))


def query_of(args):
    """`--query-<switch>=a,b,c --format=csv[,noheader][,nounits]` -> Query, or None."""
    switch = fields = None
    header, units = True, True
    for arg in args:
        if arg.startswith("--query-"):
            switch, _sep, value = arg[len("--query-") :].partition("=")
            fields = value.split(",")
        elif arg.startswith("--format="):
            flags = arg[len("--format=") :].split(",")
            header = "noheader" not in flags
            units = "nounits" not in flags
    return Query(switch, fields, header, units) if switch else None


def exporter_names():
    return sorted(name for name in os.listdir(EXPORTER_DIR) if name.endswith(".txt"))


def model_of(name):
    """'linux-x86_64__nvidia-h200__590.48.01.txt' -> 'linux-h200-590.48.01'."""
    system, model, driver = name[: -len(".txt")].split("__")
    return "{}-{}-{}".format(system.split("-")[0], model.replace("nvidia-", ""), driver)


def exporter_sections(name):
    with open(os.path.join(EXPORTER_DIR, name)) as handle:
        lines = handle.read().splitlines()
    sections = []
    index = 0
    while index < len(lines):
        match = _BANNER.match(lines[index])
        if match and index > 0 and lines[index - 1] == _RULE and index + 2 < len(lines) and lines[index + 1].startswith("# $ ") and lines[index + 2] == _RULE:
            body = []
            cursor = index + 3
            while cursor < len(lines) and not (lines[cursor] == _RULE and cursor + 1 < len(lines) and _BANNER.match(lines[cursor + 1])):
                body.append(lines[cursor])
                cursor += 1
            sections.append(Section(model_of(name), match.group("phase"), match.group("kind"), lines[index + 1][len("# $ ") :], "\n".join(body) + "\n"))
            index = cursor
        else:
            index += 1
    return sections


def exporter_section(name, phase, kind_prefix):
    found = [s for s in exporter_sections(name) if s.phase == phase and s.kind.startswith(kind_prefix)]
    assert len(found) == 1, (name, phase, kind_prefix, [s.kind for s in found])
    return found[0]
