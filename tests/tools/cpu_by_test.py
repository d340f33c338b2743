"""Where the suite's CPU goes, by test file (issue 34): a pytest plugin, and its report.

    PYTHONPATH=tests/tools CPU_BY_TEST_OUT=/tmp/cpu .venv/bin/pytest -n 6 -p cpu_by_test
    python3 tests/tools/cpu_by_test.py /tmp/cpu [--top N] [--markdown]

The plugin writes one JSON line per test to OUT.<worker> (OUT.main without xdist): the CPU of
the pytest process itself ("self") and of the children it reaped meanwhile ("children": every
`ansible-playbook`, simulated host and tool a test runs, with whatever they reaped in turn), and
the test's wall time, setup and teardown included. The report sums them by file.

A process is counted when it is reaped, so a rig that lives across tests is counted where it
ends: a module fixture's hosts in its file's last test, and a session's rigs (each worker's fleet,
whose containers' whole CPU arrives when their nspawn is reaped) in the last test's teardown,
which is reported as a row of its own. Per file the sums are right but for what ran in a session
rig (the fleet's modules, sshd and sims, in that row). tests/tools/cpu_by_process.py gives CPU by program
instead, from the kernel's process accounting. Stdlib and pytest only.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import sys
import time
from collections import defaultdict

OUT_ENV = "CPU_BY_TEST_OUT"


def _now() -> tuple[float, float, float]:
    """(own CPU, reaped children's CPU, monotonic time)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime, time.monotonic()


def _since(start: tuple[float, float, float], less: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> tuple[float, float, float]:
    """What _now() gained since START, less LESS."""
    return tuple(now - then - minus for now, then, minus in zip(_now(), start, less))  # type: ignore[return-value]


try:
    import pytest
except ImportError:  # the report alone runs without pytest
    pytest = None  # type: ignore[assignment]

SESSION_END = "(the session's rigs, torn down after each worker's last test)"


def _write(test: str, own: float, reaped: float, wall: float) -> None:
    out = os.environ.get(OUT_ENV)
    if out:
        row = {"test": test, "self_s": round(own, 3), "children_s": round(reaped, 3), "wall_s": round(wall, 3)}
        with open(f"{out}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


if pytest is not None:
    _LAST_TEARDOWN = pytest.StashKey[tuple]()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = _now()
        try:
            return (yield)
        finally:
            end = item.stash.get(_LAST_TEARDOWN, (0.0, 0.0, 0.0))
            _write(item.nodeid, *_since(start, end))
            if nextitem is None:
                _write(SESSION_END, *end)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(item, nextitem):
        # The last test's teardown also ends the session's fixtures (a worker's fleet: every
        # process its containers ran arrives when its nspawn is reaped): a row of its own.
        start = _now()
        try:
            return (yield)
        finally:
            if nextitem is None:
                item.stash[_LAST_TEARDOWN] = _since(start)


def rows(out: str) -> list[dict]:
    found = []
    for path in sorted(glob.glob(f"{glob.escape(out)}.*")):
        with open(path, encoding="utf-8") as handle:
            found += [json.loads(line) for line in handle if line.strip()]
    return found


def by_file(tests: list[dict]) -> list[dict]:
    """One row per test file (and the session's row), the most CPU first."""
    files: dict[str, dict] = defaultdict(lambda: {"tests": 0, "self_s": 0.0, "children_s": 0.0, "wall_s": 0.0})
    for row in tests:
        entry = files[row["test"].split("::", 1)[0]]
        entry["tests"] += row["test"] != SESSION_END
        for key in ("self_s", "children_s", "wall_s"):
            entry[key] += row[key]
    table = [{"file": name, **entry, "cpu_s": entry["self_s"] + entry["children_s"]} for name, entry in files.items()]
    return sorted(table, key=lambda r: (-r["cpu_s"], r["file"]))


def report(table: list[dict], top: int, markdown: bool) -> str:
    cpu_total = sum(r["cpu_s"] for r in table)
    total = cpu_total or 1.0  # the shares' denominator
    lines = ["| file | tests | CPU | share | wall (sum) |", "|---|---|---|---|---|"] if markdown else []
    shown = table[:top]
    for r in shown:
        cells = (f"`{r['file']}`", str(r["tests"]), f"{r['cpu_s']:.1f} s", f"{100 * r['cpu_s'] / total:.1f} %", f"{r['wall_s']:.0f} s")
        lines.append("| " + " | ".join(cells) + " |" if markdown else "{:>8} {:>6} {:>7} {:>7}  {}".format(cells[2], cells[1], cells[3], cells[4], r["file"]))
    rest = table[top:]
    if rest:
        cpu = sum(r["cpu_s"] for r in rest)
        cells = (f"{len(rest)} other files", str(sum(r["tests"] for r in rest)), f"{cpu:.1f} s", f"{100 * cpu / total:.1f} %", "")
        lines.append("| " + " | ".join(cells) + " |" if markdown else f"{cells[2]:>8} {cells[1]:>6} {cells[3]:>7}          {cells[0]}")
    lines.append(f"{sum(r['tests'] for r in table)} tests, {cpu_total:.1f} s of CPU")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out", help="the plugin's CPU_BY_TEST_OUT")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    tests = rows(args.out)
    if not tests:
        print(f"cpu_by_test: no rows under {args.out}.* (was the plugin loaded with {OUT_ENV} set?)", file=sys.stderr)
        return 1
    print(report(by_file(tests), args.top, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
