# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""CONTRIBUTING.md holds the one map of the code, and it stays true to the tree: every Python file
under plugins/ and every role has its line in the map ("### Folders"), and every file or folder
the map names under plugins/ or roles/ exists. A new module_util without its line fails here, and
the message says which line to add."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The map's names stand at the left (two spaces a level); its descriptions, and the lines that
# carry a description on, start at this column or further right.
DESCRIPTION_COLUMN = 20
# What the map must hold, and where what it names must exist.
CHECKED = ("plugins/", "roles/")


def map_block(text: str) -> str:
    """The code block of the section "### Folders"."""
    section = text[text.index("### Folders\n"):]
    found = re.search(r"^```\n(.*?)^```$", section, re.S | re.M)
    assert found, "CONTRIBUTING.md's \"### Folders\" has no code block"
    return found.group(1)


def map_paths(block: str) -> set[str]:
    """Every path the map names: a name indented under a folder is inside it; one line may name
    several (`a.py, b.py`)."""
    paths: set[str] = set()
    parents: list[tuple[int, str]] = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= DESCRIPTION_COLUMN:
            continue
        names = re.split(r"\s{2,}", line.strip())[0]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = "".join(folder for _indent, folder in parents)
        paths.update(base + name for name in names.split(", "))
        if names.endswith("/"):
            parents.append((indent, names))
    return paths


def tree() -> set[str]:
    """What the map must name: the Python files under plugins/ and the roles, as git sees the
    working tree (tracked, or untracked and not ignored)."""
    listing = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard", "--", "plugins", "roles"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    names = {name for name in listing.split("\0") if name and (REPO / name).is_file()}
    files = {name for name in names if name.startswith("plugins/") and name.endswith(".py")
             and not name.endswith("/__init__.py")}
    roles = {"/".join(name.split("/")[:2]) + "/" for name in names if name.startswith("roles/")}
    return files | roles


def unmapped(files: set[str], mapped: set[str]) -> list[str]:
    return sorted(files - mapped)


def stale(mapped: set[str]) -> list[str]:
    return sorted(path for path in mapped if path.startswith(CHECKED) and "*" not in path and not (REPO / path).exists())


def test_every_plugin_file_and_role_has_its_line_in_the_map() -> None:
    mapped = map_paths(map_block((REPO / "CONTRIBUTING.md").read_text()))
    missing = unmapped(tree(), mapped)
    assert not missing, ("CONTRIBUTING.md's map (\"### Folders\") lacks a line for each of these; add one under its "
                         "folder saying what the file does:\n" + "\n".join(missing))


def test_every_file_the_map_names_exists() -> None:
    mapped = map_paths(map_block((REPO / "CONTRIBUTING.md").read_text()))
    gone = stale(mapped)
    assert not gone, "CONTRIBUTING.md's map names files that are gone; remove or rename their lines:\n" + "\n".join(gone)


def test_the_check_reads_nesting_and_lists_and_sees_a_missing_line() -> None:
    """The checks themselves can fail: a file without its line is reported, by its full path."""
    block = ("plugins/module_utils/       on the node\n"
             "  _look/                    reading\n"
             "    _facts.py, _shm.py      one look\n"
             "                            a description carried on: _ghost.py\n"
             "  _types.py                 flat\n"
             "roles/free_gpus/            the role\n")
    mapped = map_paths(block)
    assert mapped == {"plugins/module_utils/", "plugins/module_utils/_look/", "plugins/module_utils/_look/_facts.py",
                      "plugins/module_utils/_look/_shm.py", "plugins/module_utils/_types.py", "roles/free_gpus/"}, mapped
    files = {"plugins/module_utils/_look/_facts.py", "plugins/module_utils/_look/_bounded_reads.py", "roles/free_gpus/"}
    assert unmapped(files, mapped) == ["plugins/module_utils/_look/_bounded_reads.py"]
    assert stale(mapped | {"plugins/module_utils/_gone.py"}) == ["plugins/module_utils/_gone.py"]
