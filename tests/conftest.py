"""Shared by every test directory.

Tools that `make deps` unpacks into .build/tools/bin (promtool, out of Debian's prometheus
package, so that no prometheus service is ever installed) are put on PATH for the tests.

`make test` runs the suite on several pytest-xdist workers with `--dist loadgroup`
(CONTRIBUTING.md, "How the suite runs in parallel"). Each worker is a process of its own, so
a session-scoped fixture would come up once per worker that meets it, and a module-scoped one
once per worker that runs one of the module's tests. `pytest_collection_modifyitems` below
therefore puts every test into the xdist group of the rig it shares, from the fixtures it uses,
not from a list of names, so tests written later are grouped the same way:

- tests that share a session-, package- or class-scoped fixture of this repository are one
  group, in one worker, which brings the rig up once;
- tests that use a module-scoped fixture of this repository (a dockerd, a module_nshost), or a
  session one marked `per_worker` (tests/rig_scope.py: the fleet of tests/fleet/conftest.py, which
  each worker brings up under a name of its own), are one group with the other tests of their file;
- these groups are joined where they overlap (a test using two of them joins both);
- a test with an explicit `@pytest.mark.xdist_group(name)` keeps it (tests that must not run
  beside their own kind, e.g. the ansible-test gates);
- every other test is free: xdist gives it to whichever worker is idle.

Without xdist (`pytest` alone, `-n 0`, `-p no:xdist`) the markers change nothing.

The ansible-core/Python matrix (tests/compat/matrix.py): a test parametrized on `python` (an
interpreter of the matrix, "X.Y") that this machine does not have is skipped at collection, before
its rig comes up, with the reason; the run ends with one line naming those Pythons and how to add
them. Under ZEROMIB_MATRIX=all (`make test-matrix`, CI) nothing is skipped: a missing interpreter
fails its tests.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "compat"))
import matrix  # noqa: E402
TOOLS = REPO / ".build" / "tools" / "bin"
if TOOLS.is_dir() and str(TOOLS) not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = f"{TOOLS}{os.pathsep}{os.environ.get('PATH', '')}"

SHARED_SCOPES = ("session", "package", "class")

# What the modules keep on a node. The tests' modules run on simulated hosts, each with its own
# (tests/sim/nshost.py, tests/fleet): these folders of the machine itself must come out of a run
# as they went in. apt-installed.txt is tests/tools/apt-deps.sh's list of the packages it added.
# ZEROMIB_TEST_NODE_STATE (folders, ':'-separated) replaces them, for this guard's own test.
NODE_STATE = tuple(Path(p) for p in os.environ.get("ZEROMIB_TEST_NODE_STATE", "/var/lib/zeromib-gpu:/var/log/zeromib-gpu").split(":"))
NOT_NODE_STATE = {Path("/var/lib/zeromib-gpu/apt-installed.txt")}
_NODE_STATE_BEFORE = pytest.StashKey[dict]()


def node_state(roots=NODE_STATE, ignored=frozenset(NOT_NODE_STATE)) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime in ns)} of everything under ROOTS but IGNORED, without following links."""
    found = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                path = Path(folder, name)
                if path not in ignored:
                    st = path.lstat()
                    found[str(path)] = (st.st_size, st.st_mtime_ns)
    return found


def changed_node_state(before: dict, after: dict) -> list[str]:
    """The paths added, removed or rewritten between two node_state() readings, sorted."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist registers it too; registered here so that --strict-markers accepts the markers
    # this file adds also under `-p no:xdist`.
    config.addinivalue_line("markers", "xdist_group(name): run in one xdist worker with the rest of group NAME")
    if _controller(config):
        config.stash[_NODE_STATE_BEFORE] = node_state()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run when a test wrote the machine's own node state (a module run on the machine
    instead of on a simulated host: the audit test of 2026-12-04 wrote its bytecode cache there)."""
    config = session.config
    if not _controller(config) or _NODE_STATE_BEFORE not in config.stash:
        return
    changed = changed_node_state(config.stash[_NODE_STATE_BEFORE], node_state())
    if changed:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        line = "the tests changed this machine's own node state (it must be the simulated hosts'): " + ", ".join(changed[:10])
        if reporter is not None:
            reporter.write_line(line, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _ours(fixturedef) -> bool:
    """A fixture defined in this repository's tests (not pytest's, a plugin's or a venv's)."""
    path = getattr(getattr(fixturedef, "func", None), "__code__", None)
    if path is None:
        return False
    source = Path(path.co_filename).resolve()
    return REPO / "tests" in source.parents and ".venv" not in source.parts


def rig_keys(item: pytest.Item) -> set[str]:
    """What ITEM shares with other tests: 'fixture:NAME' for a session-, package- or class-scoped
    fixture of ours, 'file:PATH' for a module-scoped one (its tests share it within the file) and
    for a session one marked per worker (tests/rig_scope.py: each worker brings up its own)."""
    keys: set[str] = set()
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return keys
    for name in info.names_closure:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if not _ours(fixturedef):
                continue
            per_worker = getattr(fixturedef.func, "rig_per_worker", False)
            if fixturedef.scope in SHARED_SCOPES and not per_worker:
                keys.add(f"fixture:{name}")
            elif fixturedef.scope == "module" or per_worker:
                keys.add(f"file:{item.path.relative_to(REPO) if REPO in item.path.parents else item.path}")
    return keys


def rig_groups(keyed: list[set[str]]) -> list[str | None]:
    """For each test's rig keys, the group it joins (None: no rig, free). Overlapping keys are
    one group (union-find), named after its first key (fixtures before files), without its kind
    ('fleet', 'tests/integration/test_container_engines.py')."""
    parent: dict[str, str] = {}

    def order(k: str) -> tuple[bool, str]:
        return (not k.startswith("fixture:"), k)

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for keys in keyed:
        first, *rest = sorted(keys, key=order) or [None]
        if first is None:
            continue
        for k in rest:
            a, b = find(first), find(k)
            if a != b:
                a, b = sorted((a, b), key=order)
                parent[b] = a
    return [find(min(keys, key=order)).split(":", 1)[1] if keys else None for keys in keyed]


GROUPS_FILE = "zeromib_groups_file"


def matrix_python(item: pytest.Item) -> str | None:
    """The matrix interpreter ITEM runs on: its `python` parameter, where it is one ("3.8")."""
    value = getattr(getattr(item, "callspec", None), "params", {}).get("python")
    return value if isinstance(value, str) and value in matrix.every_python() else None


def skip_missing_pythons(items: list[pytest.Item]) -> None:
    """Skips the matrix tests whose interpreter this machine lacks (not under ZEROMIB_MATRIX=all)."""
    if matrix.every_required():
        return
    for item in items:
        minor = matrix_python(item)
        if minor is not None and matrix.present(minor) is None:
            item.add_marker(pytest.mark.skip(reason=f"Python {minor} {matrix.NOT_HERE}: {matrix.how_to_add([minor])}"))


def matrix_line(skip_reasons: list[str]) -> str | None:
    """The run's one line on the matrix Pythons it could not run, from its skips' reasons."""
    minors = sorted({m.group(1) for r in skip_reasons for m in [re.search(rf"Python (\S+) {re.escape(matrix.NOT_HERE)}", r)] if m},
                    key=lambda v: tuple(map(int, v.split("."))))
    if not minors:
        return None
    count = sum(matrix.NOT_HERE in r for r in skip_reasons)
    return (f"ansible-core/Python matrix: not run on Python {', '.join(minors)} ({count} test{'s' * (count != 1)} "
            f"skipped, not on this machine); to add them: {matrix.how_to_add(minors)}")


def _skip_reason(report) -> str:
    longrepr = getattr(report, "longrepr", None)
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr or "")


# The outermost wrapper: its line comes after the terminal reporter's own summaries (-ra's skips
# included), right above pytest's last line.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config):
    result = yield
    line = matrix_line([_skip_reason(r) for r in terminalreporter.stats.get("skipped", [])])
    if line:
        terminalreporter.write_line(line, yellow=True, bold=True)
    return result


# A wrapper: its part before `yield` runs before every plain implementation; after it, the items
# are the ones this run keeps (-k, -m and deselection done).
@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    skip_missing_pythons(items)
    free = [item for item in items if item.get_closest_marker("xdist_group") is None]
    for item, group in zip(free, rig_groups([rig_keys(item) for item in free])):
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    result = yield
    where = getattr(config, "workerinput", {}).get(GROUPS_FILE)
    if where:  # an xdist worker: tell the controller's scheduler (below) each test's group
        groups = {}
        for item in items:
            mark = item.get_closest_marker("xdist_group")
            if mark is not None:
                groups[item.nodeid] = str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        mine = Path(f"{where}.{config.workerinput['workerid']}")
        # A temporary name of this worker's own (with_suffix would give every worker groups.tmp:
        # two workers renaming one file, seen once as a FileNotFoundError at collection).
        tmp = Path(f"{mine}.tmp")
        tmp.write_text(json.dumps(groups))
        tmp.rename(mine)
    return result


# pytest-xdist 3.8's own loadgroup turns the markers into an `@group` suffix of the test id, which
# pytest 9 ignores (it keeps ids in Node._id, not _nodeid): every grouped test was scheduled alone
# and two workers booted one fleet (measured). So the scheduler is ours: LoadScope, whose work
# unit is a group, read from what the workers wrote when they collected (the controller collects
# nothing itself); a test with no group is a unit of its own, as in loadgroup.
_GROUPS_PATH = pytest.StashKey[Path]()


def _groups_path(config: pytest.Config) -> Path:
    """Where the workers of this controller write their groups (a private folder, removed at the end)."""
    if _GROUPS_PATH not in config.stash:
        folder = Path(tempfile.mkdtemp(prefix="zeromib-xdist-groups-"))
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
        config.stash[_GROUPS_PATH] = folder / "groups"
    return config.stash[_GROUPS_PATH]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    if node.config.getvalue("dist") == "loadgroup":
        node.workerinput[GROUPS_FILE] = str(_groups_path(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    where = _groups_path(config)

    class RigGroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # every worker has collected by now: their files are written
                self.groups = {}
                for path in (p for p in where.parent.glob("groups.gw*") if p.suffix != ".tmp"):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid, nodeid)

    return RigGroupScheduling(config, log)
