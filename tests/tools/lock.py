"""`make lock`: the whole resolved set of every Python package the controller and the test tooling
use, so that a transitive release never changes what a user sees (issue 67: cryptography 51 made
every ansible command print a DSA deprecation warning).

requirements.txt, requirements-dev.txt and requirements-lint.txt stay the direct dependencies;
this resolves them in a fresh venv of the Python the Makefile makes .venv from, with HELD_BACK
below, and writes what got installed, every package pinned, to:

- constraints.txt: the main .venv (every pip install of the Makefile uses it with `-c`);
- tests/compat/constraints/ansible-core-X-pyY.txt: each controller venv of the ansible-core/Python
  matrix (tests/compat/matrix.py), resolved on its own Python; an entry whose Python this machine
  lacks keeps its file, and is named.

    python3 tests/tools/lock.py [--python /usr/bin/python3]

Stdlib only: it runs before any venv exists.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "compat"))
import matrix  # noqa: E402

# Releases kept out of every lock, with why. cryptography 51 deprecates DSA, which ansible-core 2.19
# imports on start (ansible/_internal/_ssh/_ssh_agent.py): a CryptographyDeprecationWarning before
# every play (tests/quality/test_lock.py). 50.0.2 imports it silently.
HELD_BACK = ("cryptography<51",)
HEADER = """# The whole resolved set: every package {what} installs, pinned.
# Written by `make lock` (tests/tools/lock.py) from {sources}; do not edit by hand.
# Held back: {held}
"""


def resolve(python: str, requirements: list[str]) -> list[str]:
    """`pip freeze` of a fresh venv of PYTHON after installing REQUIREMENTS (pip's own arguments)
    with HELD_BACK: the resolved set, sorted by name, pip and setuptools left out."""
    with tempfile.TemporaryDirectory(prefix="zeromib-lock-") as tmp:
        held = Path(tmp, "held-back.txt")
        held.write_text("\n".join(HELD_BACK) + "\n")
        venv = Path(tmp, "venv")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", "--disable-pip-version-check", *requirements, "-c", str(held)],
                       check=True, cwd=REPO)
        out = subprocess.run([*pip, "freeze", "--disable-pip-version-check", "--exclude", "pip", "--exclude", "setuptools"],
                             check=True, capture_output=True, text=True).stdout
    return sorted((line for line in out.splitlines() if line and not line.startswith("#")), key=lambda x: x.lower())


def write(path: Path, what: str, sources: str, pins: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER.format(what=what, sources=sources, held=", ".join(HELD_BACK)) + "\n".join(pins) + "\n")
    print(f"lock: {path.relative_to(REPO)} ({len(pins)} packages)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="the Python .venv is made from (the Makefile's VENV_PYTHON)")
    a = ap.parse_args(argv)
    pins = resolve(a.python, ["-r", "requirements-dev.txt", "-r", "requirements-lint.txt"])
    write(REPO / "constraints.txt", "the main .venv (make install, make deps)",
          "requirements.txt, requirements-dev.txt and requirements-lint.txt", pins)
    not_here = []
    for core, minor in matrix.CONTROLLER:
        python = matrix.present(minor)
        if python is None:
            not_here.append(f"{core} on {minor}")
            continue
        pins = resolve(str(python), [f"ansible-core=={core}", matrix.JMESPATH])
        write(matrix.lock_file(core, minor), f"the matrix's ansible-core {core} venv on Python {minor}",
              "tests/compat/matrix.py", pins)
    if not_here:
        print(f"lock: kept the locks of {', '.join(not_here)}: {matrix.how_to_add(sorted({e.split()[-1] for e in not_here}))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
