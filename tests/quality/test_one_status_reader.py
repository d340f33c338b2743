# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""/proc/PID/status has one reader in plugins/: _look/_holders.py's read_status, which splits the
file at "\\n" alone (issue 65). The kernel prints a process's comm on the Name: line with \\r,
\\x0b, \\x0c, \\x1c-\\x1e, \\x85 and U+2028 as they are, and a reader that splits it with
splitlines() (or iterates a text-mode file) reads the fields a user wrote into her process's name:
a second reader is how that came back twice. This test fails on any other code that names the file.

What counts as naming it: a string literal that ends a path in `/status` (also a piece of an
f-string or a concatenation), or "status" joined onto a path (os.path.join, pathlib's `/`)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# (file, function) of the one reader.
READER = ("plugins/module_utils/_look/_holders.py", "read_status")


def _is_status_piece(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.rstrip("'\"").endswith("/status")


def _is_status_word(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "status"


def _joins_status(node: ast.AST) -> bool:
    """os.path.join(..., "status"), posixpath.join, PurePath / "status", or base + "/status"."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("join", "joinpath"):
        return bool(node.args) and _is_status_word(node.args[-1])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return _is_status_word(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _is_status_piece(node.right)
    return False


def status_readers(source: str, path: str = "<source>") -> list[str]:
    """'path:line (function)' for every place in `source` that names /proc/PID/status as a path,
    docstrings aside."""
    tree = ast.parse(source, path)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        named = _joins_status(node) or (isinstance(node, ast.JoinedStr) and any(_is_status_piece(v) for v in node.values[-1:]))
        named = named or (_is_status_piece(node) and id(node) not in docstrings and path_like(node))
        if named:
            found.append(f"{path}:{getattr(node, 'lineno', '?')} ({function})")
            return
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def path_like(node: ast.AST) -> bool:
    """A whole literal that is a path ending in /status (not prose that mentions one)."""
    value = node.value.rstrip("'\"")  # type: ignore[attr-defined]
    return " " not in value


def test_the_finder_sees_every_way_the_old_readers_spelled_it() -> None:
    """The spellings this module's readers used, and the ones a new reader would likely use."""
    snippets = {
        'open(f"{proc}/{pid:d}/status", "rb")': 1,
        'open(f"{proc}/{pid}/status")': 1,
        'open("/proc/%d/status" % pid)': 1,
        'open("/proc/self/status")': 1,
        'os.path.join(proc, str(pid), "status")': 1,
        'Path("/proc") / str(pid) / "status"': 1,
        'open(base + "/status")': 1,
        '"""Reads /proc/PID/status alone."""': 0,
        'x = "the status of a unit"': 0,
        'open(f"{proc}/{pid:d}/stat")': 0,
        'open(f"{proc}/{pid:d}/cgroup")': 0,
    }
    for source, count in snippets.items():
        assert len(status_readers(source)) == count, (source, status_readers(source))


def test_plugins_read_proc_pid_status_only_through_the_one_reader() -> None:
    allowed = f"{READER[0]}:"
    others = []
    for path in sorted((REPO / "plugins").rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        for place in status_readers(path.read_text(encoding="utf-8"), relative):
            if not (place.startswith(allowed) and place.endswith(f"({READER[1]})")):
                others.append(place)
    assert others == [], ("/proc/PID/status is read here outside {} {}; read it with _holders.read_status (split at \"\\n\" only): {}"
                          .format(*READER, "; ".join(others)))
    # And the one reader is still there to be used.
    source = (REPO / READER[0]).read_text(encoding="utf-8")
    assert [p for p in status_readers(source, READER[0]) if p.endswith(f"({READER[1]})")], "read_status no longer reads the file"
