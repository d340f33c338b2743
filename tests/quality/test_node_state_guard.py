"""The suite's guard on this machine's own node state (tests/conftest.py): a run in which a test
writes where a module keeps its state on a node fails, whatever its tests say."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import suite_conftest

REPO = Path(__file__).resolve().parents[2]


conftest = suite_conftest.load()


def test_node_state_lists_what_is_there_but_the_ignored_file(tmp_path):
    (tmp_path / "bytecode").mkdir()
    (tmp_path / "bytecode" / "m.py").write_bytes(b"x" * 7)
    (tmp_path / "apt-installed.txt").write_text("podman\n")
    state = conftest.node_state([tmp_path, tmp_path / "missing"], {tmp_path / "apt-installed.txt"})
    assert sorted(state) == [str(tmp_path / "bytecode"), str(tmp_path / "bytecode" / "m.py")]
    assert state[str(tmp_path / "bytecode" / "m.py")][0] == 7


def test_changed_node_state_names_added_removed_and_rewritten_paths():
    before = {"/a": (1, 10), "/b": (2, 20), "/c": (3, 30)}
    after = {"/a": (1, 10), "/b": (2, 21), "/d": (4, 40)}
    assert conftest.changed_node_state(before, after) == ["/b", "/c", "/d"]
    assert conftest.changed_node_state(before, dict(before)) == []


def _run(tmp_path, body):
    state = tmp_path / "node-state"
    state.mkdir()
    (tmp_path / "test_x.py").write_text(textwrap.dedent(body))
    env = dict(os.environ, ZEROMIB_TEST_NODE_STATE=str(state), PYTHONPATH=str(REPO / "tests"))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "-n", "0",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_x.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_run_that_writes_the_machines_node_state_fails_and_names_the_path(tmp_path):
    proc = _run(tmp_path, """\
        import os
        def test_writes():
            os.mkdir(os.path.join(os.environ["ZEROMIB_TEST_NODE_STATE"], "bytecode"))
        """)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
    assert "the tests changed this machine's own node state" in proc.stdout
    assert str(tmp_path / "node-state" / "bytecode") in proc.stdout


def test_a_run_that_leaves_it_alone_passes(tmp_path):
    proc = _run(tmp_path, """\
        def test_reads_only():
            assert True
        """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "node state" not in proc.stdout
