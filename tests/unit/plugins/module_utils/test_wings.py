# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""module_utils by phase, imports one way (CONTRIBUTING.md, "The map of the code").

`_look/` is what gpu_facts runs: it reads the node and imports nothing of `_act/` (what changes the
node) or `_slurm/` (the job boundary), so a look can never stop, signal or drain, and a clean host
loads only reading code. `_act/` may import `_look/`; `_slurm/` may import both. The flat files are
shared by every wing and import only one another. Every import counts, also one inside a function
or under TYPE_CHECKING: the rule is about what a reviewer must read, not what happens to run."""

from __future__ import annotations

import ast
import os

import pytest

from ansible_collections.zeromib.gpu.plugins import module_utils

PACKAGE = "ansible_collections.zeromib.gpu.plugins.module_utils"
HERE = os.path.dirname(module_utils.__file__)
FLAT = ""
# wing -> the wings its files may import
MAY_IMPORT = {FLAT: {FLAT}, "_look": {FLAT, "_look"}, "_act": {FLAT, "_look", "_act"}, "_slurm": {FLAT, "_look", "_act", "_slurm"}}


def sources():
    """(wing, path) of every module_util: '' for the flat files."""
    for folder, dirs, files in os.walk(HERE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        wing = os.path.relpath(folder, HERE).replace(os.sep, ".")
        for name in sorted(files):
            if name.endswith(".py"):
                yield ("" if wing == "." else wing), os.path.join(folder, name)


def imported_wings(path):
    """{(wing, dotted name, line)} of each of our module_utils that the file imports."""
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            rest = node.module[len(PACKAGE):].lstrip(".")
            names = [rest + "." + alias.name if rest else alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name[len(PACKAGE):].lstrip(".") for alias in node.names if alias.name.startswith(PACKAGE + ".")]
        else:
            continue
        for name in names:
            first = name.split(".")[0]
            found.add((first if first in MAY_IMPORT else FLAT, name, node.lineno))
    return found


def test_the_wings_are_folders_and_a_few_files_are_shared():
    wings = {wing for wing, _path in sources()}
    assert wings == set(MAY_IMPORT), wings
    flat = sorted(os.path.basename(path) for wing, path in sources() if wing == FLAT)
    assert len(flat) <= 6, flat


@pytest.mark.parametrize("wing, path", list(sources()), ids=lambda value: os.path.relpath(value, HERE) if os.sep in str(value) else None)
def test_each_module_util_imports_only_what_its_wing_may(wing, path):
    wrong = sorted(f"line {line}: {name}" for other, name, line in imported_wings(path) if other not in MAY_IMPORT[wing])
    assert not wrong, f"{os.path.relpath(path, HERE)} ({wing or 'shared'}) may import only {sorted(MAY_IMPORT[wing])}: {wrong}"


def test_the_rule_sees_a_reading_file_that_imports_the_acting_wing(tmp_path):
    """The check itself can fail: a look file with a function-local import of _act is caught."""
    bad = tmp_path / "_bad.py"
    bad.write_text(f"def f():\n    from {PACKAGE}._act import _units\n    return _units\n")
    assert ("_act", "_act._units", 2) in imported_wings(str(bad))
