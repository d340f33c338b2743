# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The controller's action plugins stay thin (issue 68): what they share lives in plugins/plugin_utils/,
no action plugin imports another (one subclassed another), each stays under a size a reader
takes in at once, and their doc stubs share one attributes fragment instead of repeating it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ACTIONS = sorted((REPO / "plugins" / "action").glob("*.py"))
# ~150 lines: a run() and the few methods only its own task needs.
MAX_LINES = 150


def imported(path: Path) -> set[str]:
    """Every module a file imports, as written (`a.b.c`, `a.b.c.name` for `from a.b.c import name`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_there_are_action_plugins_to_check():
    assert len(ACTIONS) >= 5, ACTIONS


@pytest.mark.parametrize("path", ACTIONS, ids=lambda p: p.name)
def test_no_action_plugin_imports_another(path):
    others = sorted(name for name in imported(path) if "zeromib.gpu.plugins.action" in name or name.startswith("plugins.action"))
    assert not others, f"{path.name} imports {others}: move what they share to plugins/plugin_utils/"


@pytest.mark.parametrize("path", ACTIONS, ids=lambda p: p.name)
def test_each_action_plugin_is_thin(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines (at most {MAX_LINES}): move its logic to plugins/plugin_utils/"


@pytest.mark.parametrize("path", sorted((REPO / "plugins" / "modules").glob("*.py")), ids=lambda p: p.name)
def test_action_doc_stubs_take_their_shared_attributes_from_the_fragment(path):
    text = path.read_text()
    if (REPO / "plugins" / "action" / path.name).exists() and "Documentation only" in text:
        assert "zeromib.gpu.controller_action" in text, f"{path.name}: extends_documentation_fragment lacks zeromib.gpu.controller_action"
        assert "bypass_host_loop:" not in text, f"{path.name} repeats the attributes the fragment holds"


# The node's readers: /proc, nvidia-smi, the kernel log, systemd. The controller orders health
# checks and matches unit names from small data modules (_look/_check_names, _act/_unit_kinds);
# importing these into every play's workers cost the gate ~40 ms of CPU (benchmarks/HISTORY.md).
NODE_READERS = ("_look._health", "_look._holders", "_look._nvidia_smi", "_look._kernel_log", "_act._units", "_look._facts")


@pytest.mark.parametrize("path", ACTIONS, ids=lambda p: p.stem)
def test_an_action_plugin_loads_none_of_the_nodes_readers(path):
    import subprocess
    import sys

    root = REPO / ".build" / "collections"
    if not (root / "ansible_collections" / "zeromib" / "gpu").exists():
        pytest.fail("run `make collection` first: .build/collections/ansible_collections/zeromib/gpu is missing")
    name = f"ansible_collections.zeromib.gpu.plugins.action.{path.stem}"
    probe = f"import sys, {name}; print('\\n'.join(m for m in sys.modules if m.startswith('ansible_collections.zeromib.gpu.plugins.module_utils')))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    readers = sorted(m for m in loaded if m.rsplit("module_utils.", 1)[-1] in NODE_READERS)
    assert not readers, f"{path.name} loads the node's readers on the controller: {readers}"
