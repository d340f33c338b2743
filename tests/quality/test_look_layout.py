# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The reading wing by concept (issue 68): no file of plugins/module_utils/_look/ over LIMIT lines,
and no import circle among them (module-level imports; a function-local import is a load on
demand, not a dependency of the file). `_holders` grew to six concepts in 1,448 lines before the
device tables (_devices), the mount table (_mounts) and the protection rules (_protect) left it,
and `_health` to 1,071 before the kernel log (_kernel_log) did."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOOK = REPO / "plugins" / "module_utils" / "_look"
LIMIT = 950
PACKAGE = "ansible_collections.zeromib.gpu.plugins.module_utils._look"


def _imports(path: Path) -> set[str]:
    """The _look modules a file imports at its top level (TYPE_CHECKING blocks included)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        for child in ast.walk(node) if isinstance(node, ast.If) else (node,):
            if isinstance(child, ast.ImportFrom) and child.module == PACKAGE:
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith(PACKAGE + "."):
                found.add(child.module[len(PACKAGE) + 1:].split(".")[0])
    return found


def _graph() -> dict[str, set[str]]:
    modules = {path.stem: path for path in LOOK.glob("_*.py")}
    return {name: _imports(path) & set(modules) - {name} for name, path in modules.items()}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, as the names along it, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state:
                found = visit(other)
                if found:
                    return found
        state[name] = 2
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def test_no_look_file_is_over_the_limit():
    sizes = {path.name: len(path.read_text().splitlines()) for path in LOOK.glob("*.py")}
    assert sizes and not {name: n for name, n in sizes.items() if n > LIMIT}, f"split by concept, not by line count: {sizes}"


def test_the_look_files_import_no_circle():
    graph = _graph()
    assert {"_devices", "_mounts", "_protect"} <= graph["_holders"] and "_kernel_log" in graph["_health"]
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])


def test_the_circle_finder_finds_one():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
