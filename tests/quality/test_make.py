"""The Makefile keeps its promises: `make demo` installs only what the demo uses, `make clean`
removes what make made (the fleet's base rootfs cache included, unless another checkout's fleet
still runs on it)."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "fleet"))
import fleet as rig  # noqa: E402
import suite_conftest  # noqa: E402 (beside this file)

TEST_ONLY_PACKAGES = ("chromium", "prometheus", "shellcheck")


def plain_make_env() -> dict[str, str]:
    """The environment of a make the user starts: none of the variables of the make that runs this
    suite (`make test-matrix` exports MATRIX=all to its `make test`, and MAKEFLAGS carries it on)."""
    return {k: v for k, v in os.environ.items() if k not in ("MATRIX", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}


def make_dry_run(target: str, tmp_path: Path) -> str:
    r = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True, text=True,
                       check=True, env=plain_make_env())
    return r.stdout


def test_demo_installs_only_ansible_core_jmespath_and_the_fleet_rig(tmp_path):
    recipe = make_dry_run("demo", tmp_path)
    assert "-r requirements.txt" in recipe and "tests/tools/apt-deps.sh demo" in recipe, recipe
    assert "requirements-dev" not in recipe and "requirements-lint" not in recipe, recipe
    runtime = [line.split("==")[0] for line in (REPO / "requirements.txt").read_text().splitlines()
               if line and not line.startswith("#")]
    assert runtime == ["ansible-core", "jmespath"]
    packages = subprocess.run([str(REPO / "tests/tools/apt-deps.sh"), "--list", "demo"], capture_output=True, text=True,
                              check=True).stdout.split()
    assert not set(packages) & set(TEST_ONLY_PACKAGES), packages
    assert {"mmdebstrap", "systemd-container", "openssh-client"} <= set(packages)
    test_packages = subprocess.run([str(REPO / "tests/tools/apt-deps.sh"), "--list", "test"], capture_output=True,
                                   text=True, check=True).stdout
    assert "prometheus" not in test_packages.split(), "prometheus.service must never be installed: unpack promtool only"


def test_clean_recipe_downs_fleets_and_removes_venv_build_and_reports(tmp_path):
    recipe = make_dry_run("clean", tmp_path)
    assert "tests/fleet/fleet.py clean" in recipe
    for path in (str(tmp_path / "venv"), ".build", "gpu_audit_report", "tests/output", ".pytest_cache"):
        assert f" {path}" in recipe, (path, recipe)


def test_fleet_clean_keeps_the_cache_while_another_checkouts_fleet_uses_it(tmp_path, monkeypatch):
    state, cache = tmp_path / "run", tmp_path / "cache"
    monkeypatch.setattr(rig, "STATE_ROOT", state)
    monkeypatch.setattr(rig, "CACHE_DIR", cache)
    (cache / "base-bookworm-x").mkdir(parents=True)
    (cache / "base-bookworm-x.tar").write_bytes(b"x" * 2048)
    # A leftover fleet of this checkout (killed before its teardown) and a live one of another.
    for prefix, source in (("tmine", rig.SIM_DIR), ("tother", Path("/elsewhere/tests/sim"))):
        (state / prefix).mkdir(parents=True)
        (state / prefix / "state.json").write_text(json.dumps({"prefix": prefix, "sim_source": str(source), "hosts": []}))
    out = rig.clean()
    assert out["fleets_down"] == ["tmine"] and out["cache_kept_for"] == ["tother"]
    assert not (state / "tmine").exists() and (cache / "base-bookworm-x.tar").exists()
    (state / "tother" / "state.json").unlink()
    (state / "tother").rmdir()
    out = rig.clean()
    assert out["cache_removed_mib"] >= 0 and not cache.exists(), out


def test_pytest_ini_runs_every_test_directory():
    """`make test` runs plain `pytest`, whose testpaths set the order: a test directory missing
    from them would never run."""
    ini = (REPO / "pytest.ini").read_text()
    testpaths = next(line for line in ini.splitlines() if line.startswith("testpaths")).split("=", 1)[1].split()
    with_tests = {str(p.parent.relative_to(REPO)) for p in (REPO / "tests").glob("*/test_*.py")}
    with_tests |= {"tests/unit"} if any((REPO / "tests" / "unit").rglob("test_*.py")) else set()
    assert with_tests - {"tests/gpu"} <= set(testpaths), sorted(with_tests - set(testpaths))


def test_clean_removes_what_the_tests_leave_and_only_that(tmp_path):
    """__pycache__ of the checkout, finished pytest temp folders (not a running pytest's), and
    ~/.ansible/test only when sanity.sh made it: a fake HOME and TMPDIR, the real script."""
    assert "tests/tools/clean-test-leftovers.sh" in make_dry_run("clean", tmp_path)
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    root = tmp / ("pytest-of-" + subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip())
    finished, running = root / "pytest-7", root / "pytest-8"
    for d in (finished, running, home / ".ansible" / "test" / "venv"):
        d.mkdir(parents=True)
    (running / ".lock").write_text(str(os.getpid()))
    (finished / ".lock").write_text("999999999")
    env = dict(os.environ, HOME=str(home), TMPDIR=str(tmp))
    # The script cleans the checkout it lies in: a copy in a checkout of the test's own, so that
    # the suite's __pycache__ (`make test` keeps bytecode) is not removed under the other workers.
    checkout = tmp_path / "checkout"
    script = checkout / "tests" / "tools" / "clean-test-leftovers.sh"
    script.parent.mkdir(parents=True)
    shutil.copy2(REPO / "tests" / "tools" / "clean-test-leftovers.sh", script)
    made, kept_caches = checkout / "plugins" / "modules" / "__pycache__", [checkout / d / "lib" / "__pycache__" for d in (".venv", ".build")]
    for d in (made, *kept_caches):
        d.mkdir(parents=True)
        (d / "x.cpython-311.pyc").write_bytes(b"")
    subprocess.run([str(script)], env=env, check=True)
    assert not made.exists() and all(d.exists() for d in kept_caches), "the checkout's __pycache__ goes, .venv's and .build's stay"
    assert not finished.exists() and running.exists()
    assert (home / ".ansible" / "test" / "venv").exists(), "not created by sanity.sh: kept"
    (home / ".ansible" / "test" / ".created-by-zeromib-gpu").touch()
    # With an ansible-test running (pgrep finds one), sanity.sh's venvs stay; once none runs, they go.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for found, kept in ((0, True), (1, False)):
        (bin_dir / "pgrep").write_text(f"#!/bin/sh\nexit {found}\n")
        (bin_dir / "pgrep").chmod(0o755)
        subprocess.run([str(script)], env=dict(env, PATH="{}:{}".format(bin_dir, env["PATH"])), check=True)
        assert (home / ".ansible").exists() is kept
    # The matrix's controller venvs (tests/compat/matrix.py): kept while a run holds their lock, then removed.
    compat = home / ".cache" / "zeromib-gpu" / "compat"
    (compat / "ansible-core-2.17.14-py3.10" / "bin").mkdir(parents=True)
    with open(compat / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([str(script)], env=env, check=True)
        assert (compat / "ansible-core-2.17.14-py3.10").exists(), "a running test's venvs stay"
    subprocess.run([str(script)], env=env, check=True)
    assert not (home / ".cache" / "zeromib-gpu").exists()


def test_contributing_lists_every_package_make_test_installs():
    """What make installs on the machine is said where a contributor looks (the README keeps to
    stable facts and points there)."""
    packages = subprocess.run([str(REPO / "tests/tools/apt-deps.sh"), "--list", "test"], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    contributing = " ".join((REPO / "CONTRIBUTING.md").read_text().split())
    for package in packages:
        name = package.split()[0]
        assert name in contributing, (name, "CONTRIBUTING.md does not name it")
    assert "CONTRIBUTING.md" in (REPO / "README.md").read_text(), "the README points to what make installs"


def test_every_test_file_has_a_basename_of_its_own():
    """`make test` collects every test folder in one pytest session without packages: two test
    files of one basename (tests/unit/.../test_mps.py and tests/integration/test_mps.py) stop the
    whole run at collection ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in sorted(REPO.glob("tests/**/test_*.py")):
        if "output" in path.relative_to(REPO).parts:
            continue
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_make_test_runs_the_whole_suite_on_workers_and_test_quick_lint_and_unit_tests(tmp_path):
    """`make test` stays the whole suite (pytest with pytest.ini's testpaths, no path of its own), on
    xdist workers, after make lint and one collection of the same suite (the bytecode caches, written
    once); `make test-quick` is `make lint` and tests/unit only."""
    dry = make_dry_run("test", tmp_path)
    assert "ruff check" in dry and "mypy" in dry, dry
    pytest_lines = [line for line in dry.splitlines() if "bin/pytest" in line]
    collect = [line for line in pytest_lines if "--collect-only" in line]
    test = [line for line in pytest_lines if line not in collect]
    assert len(test) == 1 and " -n " in test[0] + " " and "tests/" not in test[0], test
    arguments = collect[0].split("bin/pytest", 1)[1] if len(collect) == 1 else ""
    assert len(collect) == 1 and "tests/" not in arguments and dry.index(collect[0]) < dry.index(test[0]), collect
    quick = make_dry_run("test-quick", tmp_path)
    assert "ruff check" in quick and "mypy" in quick, quick
    pytest_lines = [line for line in quick.splitlines() if "bin/pytest" in line]
    assert len(pytest_lines) == 1 and pytest_lines[0].split()[-1] == "tests/unit", pytest_lines
    assert "apt-deps.sh" not in quick, "test-quick needs no Debian package"
    addopts = next(line for line in (REPO / "pytest.ini").read_text().splitlines() if line.startswith("addopts"))
    assert "--dist loadgroup" in addopts, "under -n, the tests of one rig must run in one worker"


def test_rig_groups_join_the_tests_that_share_a_rig():
    groups = suite_conftest.load().rig_groups([
        {"fixture:fleet"}, {"file:tests/fleet/test_a.py", "fixture:fleet"}, {"file:tests/fleet/test_a.py"},
        {"file:tests/integration/test_b.py"}, set(), {"file:tests/integration/test_b.py"},
        {"file:tests/integration/test_c.py", "fixture:collections_path"}, {"fixture:collections_path"},
    ])
    assert groups == ["fleet", "fleet", "fleet", "tests/integration/test_b.py", None,
                      "tests/integration/test_b.py", "collections_path", "collections_path"]


def test_every_test_of_a_shared_rig_gets_its_group_from_its_fixtures(tmp_path):
    """The groups of the real suite, as pytest collects it: every test using the fleet (which each
    worker brings up its own of) is in the group of its file; a file's module-scoped rig keeps the
    file's tests together; a test with a function-scoped namespace host or none is free; the
    ansible-test gates keep theirs."""
    plugin = tmp_path / "zeromib_show_groups.py"
    plugin.write_text(
        "def pytest_collection_finish(session):\n"
        "    for item in session.items:\n"
        "        mark = item.get_closest_marker('xdist_group')\n"
        "        print('GROUP', mark.args[0] if mark else '-', 'fleet' in item.fixturenames, item.nodeid)\n")
    r = subprocess.run([str(REPO / ".venv" / "bin" / "pytest"), "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "zeromib_show_groups", "tests/fleet", "tests/integration/test_container_engines.py",
                        "tests/integration/test_trust.py", "tests/quality/test_gates.py"],
                       cwd=REPO, capture_output=True, text=True, check=False,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONDONTWRITEBYTECODE="1"))
    rows = [line.split(" ", 3)[1:] for line in r.stdout.splitlines() if line.startswith("GROUP ")]
    assert r.returncode == 0 and rows, r.stdout[-2000:] + r.stderr[-2000:]
    fleet = [(group, node) for group, uses, node in rows if uses == "True"]
    assert len(fleet) > 50 and all(group == node.split("::")[0] for group, node in fleet), \
        sorted({(g, node.split("::")[0]) for g, node in fleet if g != node.split("::")[0]})
    assert len({group for group, _node in fleet}) > 5, "the fleet's files are groups of their own"
    engines = {group for group, _uses, node in rows if node.startswith("tests/integration/test_container_engines.py")}
    assert engines == {"tests/integration/test_container_engines.py"}
    assert {group for group, _uses, node in rows if node.startswith("tests/integration/test_trust.py")} == {"-"}
    gates = {node.split("::")[1]: group for group, _uses, node in rows if node.startswith("tests/quality/")}
    assert gates["test_sanity"] == gates["test_units"] == "ansible-test" and gates["test_changelog_fragments_lint"] == "-"


def test_fleet_up_keeps_the_demos_fleet_with_the_demos_installs_and_fleet_down_takes_it_down(tmp_path):
    """`make fleet-up` installs what `make demo` does (no test tooling), then `fleet.py try` (the
    fleet, its LXC guest and the printed commands: tests/fleet/test_fleet_try.py); `make fleet-down`
    downs the same fleet by name."""
    up = make_dry_run("fleet-up", tmp_path)
    assert "-r requirements.txt" in up and "tests/tools/apt-deps.sh demo" in up, up
    assert "requirements-dev" not in up and "apt-deps.sh test" not in up, up
    assert "tests/fleet/fleet.py try --hosts 4 --name zmf" in up, up
    down = make_dry_run("fleet-down", tmp_path)
    assert "tests/fleet/fleet.py down --name zmf" in down, down
    named = subprocess.run(["make", "-n", "fleet-down", "FLEET_NAME=mine", f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout
    assert "fleet.py down --name mine" in named, named


def test_make_test_runs_the_matrix_present_and_test_matrix_requires_every_entry(tmp_path):
    """`make test` runs the matrix entries whose Python is here (tests/conftest.py skips the rest
    and names them); `make test-matrix` is the same run with every entry required, and CI's
    .ci/run runs it where the machine has every Python."""
    test = [line for line in make_dry_run("test", tmp_path).splitlines() if "bin/pytest -n" in line and "--collect-only" not in line]
    assert len(test) == 1 and "ZEROMIB_MATRIX=present" in test[0], test
    matrix = subprocess.run(["make", "-n", "test-matrix", f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                            text=True, check=True, env=plain_make_env()).stdout
    assert "ZEROMIB_MATRIX=all" in matrix and "ZEROMIB_MATRIX=present" not in matrix, matrix
    ci = (REPO / ".ci" / "run").read_text()
    assert "tests/compat/matrix.py --check" in ci and "make test-matrix" in ci, ci
