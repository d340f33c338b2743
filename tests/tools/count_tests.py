"""How much the suite checks, per test file (issue 34: nothing removed or weakened): the tests pytest
collects (`pytest --collect-only -q`, parametrized cases counted one by one, with pytest.ini's
testpaths, so exactly what `make test` runs) and the `assert` statements in the file's source.

    .venv/bin/python tests/tools/count_tests.py [CHECKOUT] [--json OUT.json] [--compare BEFORE.json]

CHECKOUT defaults to this one (its own .venv/bin/pytest runs there, else this one's). --compare
prints BEFORE, NOW and the change per file and exits 1 when any file has fewer tests or asserts.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def collected(checkout: Path) -> Counter:
    """{test file: number of collected tests}, as `make test`'s pytest collects them."""
    pytest = checkout / ".venv" / "bin" / "pytest"
    if not pytest.exists():
        pytest = HERE / ".venv" / "bin" / "pytest"
    # No -n: collected in this one process, exactly the items the workers of `make test` share out.
    r = subprocess.run([str(pytest), "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=checkout,
                       capture_output=True, text=True, check=False, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    counts: Counter = Counter()
    for line in r.stdout.splitlines():
        if "::" in line and not line.startswith(" "):
            counts[line.split("::", 1)[0]] += 1
    if r.returncode != 0 or not counts:
        sys.exit(f"pytest --collect-only failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return counts


def asserts(path: Path) -> int:
    """`assert` statements in the file's source (helpers in the file included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sum(isinstance(node, ast.Assert) for node in ast.walk(tree))


def figures(checkout: Path) -> dict[str, dict[str, int]]:
    tests = collected(checkout)
    return {f: {"tests": tests[f], "asserts": asserts(checkout / f)} for f in sorted(tests)}


def followed(now: dict, before: dict) -> dict:
    """`before` with each file that is gone and whose name now lives in one other folder renamed
    to its new path (a file moved with the code it tests, issue 60), so that it is compared with
    itself rather than counted as removed."""
    moved = {}
    for f in set(before) - set(now):
        name = f.rsplit("/", 1)[-1]
        there = [g for g in set(now) - set(before) if g.rsplit("/", 1)[-1] == name]
        if len(there) == 1:
            moved[f] = there[0]
    return {moved.get(f, f): figures for f, figures in before.items()}


def table(now: dict, before: dict | None) -> tuple[str, bool]:
    rows, fewer = [], False
    before = None if before is None else followed(now, before)
    files = sorted(set(now) | set(before or {}))
    width = max(len(f) for f in files)
    if before is None:
        rows.append(f"{'file':<{width}}  tests  asserts")
        for f in files:
            rows.append(f"{f:<{width}}  {now[f]['tests']:5d}  {now[f]['asserts']:7d}")
    else:
        rows.append(f"{'file':<{width}}  tests before/now  asserts before/now")
        for f in files:
            b, n = before.get(f, {"tests": 0, "asserts": 0}), now.get(f, {"tests": 0, "asserts": 0})
            mark = ""
            if n["tests"] < b["tests"] or n["asserts"] < b["asserts"]:
                mark, fewer = "  FEWER", True
            rows.append(f"{f:<{width}}  {b['tests']:6d} {n['tests']:6d}     {b['asserts']:7d} {n['asserts']:7d}{mark}")
    total = {k: sum(v[k] for v in now.values()) for k in ("tests", "asserts")}
    line = f"total: {len(now)} files, {total['tests']} tests, {total['asserts']} asserts"
    if before is not None:
        was = {k: sum(v[k] for v in before.values()) for k in ("tests", "asserts")}
        line += f" (before: {len(before)} files, {was['tests']} tests, {was['asserts']} asserts)"
    rows.append(line)
    return "\n".join(rows), fewer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", nargs="?", default=str(HERE))
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--compare", help="figures written earlier with --json")
    a = p.parse_args()
    now = figures(Path(a.checkout).resolve())
    if a.json:
        Path(a.json).write_text(json.dumps(now, indent=1) + "\n")
    try:
        before = json.loads(Path(a.compare).read_text()) if a.compare else None
    except (OSError, ValueError) as exc:
        p.error(f"--compare {a.compare}: not the figures of an earlier --json run ({exc})")
    text, fewer = table(now, before)
    print(text)
    return 1 if fewer else 0


if __name__ == "__main__":
    sys.exit(main())
