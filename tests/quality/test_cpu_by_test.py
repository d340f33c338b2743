"""tests/tools/cpu_by_test.py: a real pytest run with the plugin, whose tests spend known CPU in
a child and in themselves, then the report over what it wrote."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tests" / "tools"

# A span of CPU time, not a count of steps (a fast machine would shrink the steps toward the
# bounds below: tests/quality/test_cpu_by_process.py's failure on CI).
BURN = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.2:\n    pass\n"
SUITE = f'''
import subprocess, sys

def test_child_burns():
    subprocess.run([sys.executable, "-c", {BURN!r}], check=True)

def test_itself_burns():
    exec({BURN!r})

def test_idle():
    pass
'''


SESSION_RIG = f'''
import subprocess, sys
import pytest

@pytest.fixture(scope="session")
def session_rig():
    yield
    subprocess.run([sys.executable, "-c", {BURN!r}], check=True)
'''


def test_the_plugin_counts_a_tests_children_and_itself_and_the_report_sums_by_file(tmp_path):
    (tmp_path / "test_a.py").write_text(SUITE)
    (tmp_path / "test_b.py").write_text("def test_idle(session_rig):\n    pass\n")
    (tmp_path / "conftest.py").write_text(SESSION_RIG)
    out = tmp_path / "cpu"
    env = dict(os.environ, PYTHONPATH=str(TOOLS), CPU_BY_TEST_OUT=str(out), PYTEST_ADDOPTS="")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "cpu_by_test", "-p", "no:cacheprovider", "-c", os.devnull,
                          "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    sys.path.insert(0, str(TOOLS))
    try:
        import cpu_by_test
    finally:
        sys.path.remove(str(TOOLS))
    rows_by_name = {row["test"]: row for row in cpu_by_test.rows(str(out))}
    tests = {name.split("::")[1] + "@" + name.split("::")[0]: row for name, row in rows_by_name.items() if "::" in name}
    # A session fixture that burns CPU in a child at its end: counted in the session's row, not in the last test.
    assert sorted(tests) == ["test_child_burns@test_a.py", "test_idle@test_a.py", "test_idle@test_b.py", "test_itself_burns@test_a.py"]
    assert rows_by_name[cpu_by_test.SESSION_END]["children_s"] > 0.05
    assert tests["test_idle@test_b.py"]["children_s"] < rows_by_name[cpu_by_test.SESSION_END]["children_s"] / 5
    child, itself, idle = tests["test_child_burns@test_a.py"], tests["test_itself_burns@test_a.py"], tests["test_idle@test_a.py"]
    # The same loop: in a reaped child in one test, in pytest itself in the other; the idle test has neither.
    assert child["children_s"] > 0.05 and child["children_s"] > 5 * idle["children_s"]
    assert itself["self_s"] > 0.05 and itself["self_s"] > 5 * idle["self_s"]
    assert itself["children_s"] < child["children_s"] / 5
    table = cpu_by_test.by_file(list(rows_by_name.values()))
    assert [r["file"] for r in table if r["file"].endswith(".py")] == ["test_a.py", "test_b.py"]
    assert table[0]["file"] == "test_a.py" and table[0]["tests"] == 3
    assert abs(table[0]["cpu_s"] - sum(r["self_s"] + r["children_s"] for r in (child, itself, idle))) < 1e-6
    report = subprocess.run([sys.executable, str(TOOLS / "cpu_by_test.py"), str(out), "--markdown", "--top", "1"],
                            capture_output=True, text=True, check=True).stdout
    assert "| `test_a.py` | 3 |" in report and "| 2 other files | 1 |" in report
    assert report.rstrip().splitlines()[-1].startswith("4 tests, ")


def test_the_report_says_when_the_plugin_wrote_nothing(tmp_path):
    run = subprocess.run([sys.executable, str(TOOLS / "cpu_by_test.py"), str(tmp_path / "none")], capture_output=True, text=True, check=False)
    assert run.returncode == 1 and "no rows under" in run.stderr and "Traceback" not in run.stderr
