# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The release engine by job (issue 68): the clean/dirty boundary is a file boundary.

_release.py keeps the run, look, verdict, verify and result; _plan (pure planning), _words (the
failure messages) and _system (the node's side effects) are what a clean host loads beside it;
_freeing (the dirty path's plan and act) imports every freeing module at its top and is itself
imported once, by _release.freeing_room. What a clean host actually loads is checked through real
Ansible in tests/integration/test_gate_cost.py; these read the source."""

from __future__ import annotations

import ast
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _act

ACT = os.path.dirname(_act.__file__)
PACKAGE = "ansible_collections.zeromib.gpu.plugins.module_utils"
# No file of the acting wing over this many lines: a file a reviewer reads whole.
MOST_LINES = 800
# What only a host with something to free needs: imported by the freeing room, at its top.
FREEING = {"_containers", "_units", "_supervisor", "_settle", "_mps", "_guest_units", "_services", "_shm_clean", "_record", "_jobs"}
# The rooms a clean host loads beside _release (test_gate_cost checks it on a simulated host).
CLEAN_ROOMS = ("_release.py", "_plan.py", "_words.py", "_system.py")


def tree_of(name):
    with open(os.path.join(ACT, name)) as handle:
        return ast.parse(handle.read(), name)


def our_modules(node):
    """The module_utils names (last part) an import node brings in."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
        return {node.module.rsplit(".", 1)[-1]} | {alias.name for alias in node.names}
    if isinstance(node, ast.Import):
        return {alias.name.rsplit(".", 1)[-1] for alias in node.names if alias.name.startswith(PACKAGE)}
    return set()


def function_local_imports(tree):
    """[(line, names)] of each import of our module_utils inside a function."""
    found = []
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                names = our_modules(node)
                if names:
                    found.append((node.lineno, sorted(names)))
    return found


def run_time_imports(tree):
    """Our module_utils a file imports at its top level, outside `if t.TYPE_CHECKING:`."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            continue
        found |= our_modules(node)
    return found


def test_release_has_one_function_local_import_the_freeing_room():
    assert [names for _line, names in function_local_imports(tree_of("_release.py"))] == [["_act", "_freeing"]]


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(ACT) if n.endswith(".py")))
def test_no_file_of_the_acting_wing_is_over_the_bound(name):
    with open(os.path.join(ACT, name)) as handle:
        lines = len(handle.read().splitlines())
    assert lines <= MOST_LINES, f"_act/{name} has {lines} lines: split it by job (at most {MOST_LINES})"


@pytest.mark.parametrize("name", CLEAN_ROOMS)
def test_the_clean_rooms_import_no_freeing_code_at_their_top(name):
    assert run_time_imports(tree_of(name)) & FREEING == set()


def test_the_freeing_room_imports_the_freeing_code_at_its_top_and_nothing_in_functions():
    tree = tree_of("_freeing.py")
    assert run_time_imports(tree) >= FREEING
    assert function_local_imports(tree) == []


def test_the_checks_can_fail(tmp_path):
    """The readers see a function-local import and a top-level one behind TYPE_CHECKING."""
    tree = ast.parse(f"import typing as t\nif t.TYPE_CHECKING:\n    from {PACKAGE}._act import _units\n"
                     f"def f():\n    from {PACKAGE}._act import _mps\n    return _mps\n")
    assert function_local_imports(tree) == [(5, ["_act", "_mps"])]
    assert run_time_imports(tree) == set()
