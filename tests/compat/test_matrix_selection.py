"""The ansible-core/Python matrix on a plain Debian 12 machine (issue 67): with pyenv hidden
(TEST_RIGS.md section 8: PYENV_ROOT at an empty folder, no pyenv shims on PATH) only Debian's
Python 3.11 is left. `make test` then runs the entries on 3.11, skips the others with their reason
and ends with one line naming them and how to add them; `make test-matrix` (ZEROMIB_MATRIX=all)
fails on each missing one instead. Never a skipped entry counted as passed."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import matrix

REPO = matrix.REPO
sys.path.insert(0, str(REPO / "tests" / "quality"))
import suite_conftest  # noqa: E402

PLAIN_DEBIAN = ("3.8", "3.9", "3.10", "3.12", "3.13")


def plain_debian_env(tmp_path: Path, **extra: str) -> dict:
    """This machine's environment as a fresh Debian 12's: no pyenv (an empty PYENV_ROOT, no shims
    or pyenv on PATH), the distribution's own python3.11 only."""
    empty = tmp_path / "no-pyenv"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYENV", "PYTEST_", "ZEROMIB_MATRIX"))}
    env.update(PYENV_ROOT=str(empty), PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


@pytest.fixture
def debian_python():
    if not Path("/usr/bin/python3.11").exists():
        pytest.skip("not a Debian 12 machine: no /usr/bin/python3.11 to stand for its only Python")


def test_without_pyenv_only_debians_python_is_found_and_the_rest_named(tmp_path, debian_python):
    r = subprocess.run([sys.executable, "tests/compat/matrix.py", "--check"], cwd=REPO, capture_output=True, text=True,
                       env=plain_debian_env(tmp_path), timeout=60, check=False)
    assert r.returncode == 1, r
    assert f"not on this machine: Python {', '.join(PLAIN_DEBIAN)};" in r.stdout, r.stdout
    assert "pyenv install 3.8 3.9 3.10 3.12 3.13" in r.stdout and "make test-matrix" in r.stdout, r.stdout


def test_the_matrix_line_names_each_missing_python_once_and_counts_its_skips():
    conftest = suite_conftest.load()
    reasons = [f"Python 3.8 {matrix.NOT_HERE}: x", f"Python 3.13 {matrix.NOT_HERE}: x", f"Python 3.8 {matrix.NOT_HERE}: x",
               "simulated hosts need root (mount/pid namespaces)"]
    line = conftest.matrix_line(reasons)
    assert line is not None and "\n" not in line
    assert line.startswith("ansible-core/Python matrix: not run on Python 3.8, 3.13 (3 tests skipped"), line
    assert "pyenv install 3.8 3.13" in line and "make test-matrix" in line, line
    assert conftest.matrix_line(["simulated hosts need root (mount/pid namespaces)"]) is None


def run_pytest(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(matrix.MAIN_VENV_BIN / "pytest"), "-n", "0", "-p", "no:cacheprovider", "-q", *args],
                          cwd=REPO, capture_output=True, text=True, env=env, timeout=300, check=False)


def test_plain_debian_runs_the_present_entry_skips_the_missing_one_and_says_so(tmp_path, debian_python):
    """One small real run of the managed-node matrix (a namespace host, the modules under 3.11),
    and the 3.8 entry: skipped under `make test`, failed under `make test-matrix`."""
    if os.geteuid() != 0:
        pytest.skip("the namespace host of the real entry needs root")
    selection = ["tests/compat/test_managed_pythons.py", "-k", "py3.8 or py3.11"]
    r = run_pytest(selection, plain_debian_env(tmp_path, ZEROMIB_MATRIX="present"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert lines[-1].startswith("1 passed, 1 skipped"), out[-4000:]
    assert lines[-2].startswith("ansible-core/Python matrix: not run on Python 3.8 (1 test skipped"), out[-4000:]
    assert re.search(rf"^SKIPPED \[1\] tests/compat/test_managed_pythons.py:\d+: Python 3.8 {re.escape(matrix.NOT_HERE)}",
                     r.stdout, re.M), out[-4000:]

    r = run_pytest(["tests/compat/test_managed_pythons.py", "-k", "py3.8"], plain_debian_env(tmp_path, ZEROMIB_MATRIX="all"))
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "1 failed" in out, out[-4000:]
    assert "MissingInterpreter: Python 3.8 is part of the tested matrix" in out and "skipped" not in out, out[-4000:]
