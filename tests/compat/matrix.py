"""The compatibility matrix of zeromib.gpu: which ansible-core runs the controller on which
Python, and which Pythons run the modules on managed nodes. Every entry is really run by
`make test` (tests/fleet/test_compat.py, tests/compat/test_managed_pythons.py); README.md,
CONTRIBUTING.md and meta/runtime.yml state exactly this.

Controller venvs are built once per entry (ansible-core and jmespath, pinned) and reused while
their recipe is unchanged, in the user's cache, ~/.cache/zeromib-gpu/compat: every checkout of the
machine shares them, as ansible-test shares ~/.ansible/test and the fleet its base image, so that a
fresh clone's `make test` builds none (four venvs, ~35 s of CPU on the 2-core machine).

Each venv installs its entry's ansible-core and jmespath with the entry's lock
(tests/compat/constraints/, written by `make lock` beside constraints.txt), so that a transitive
release (cryptography 51's DSA warning) reaches no entry unseen.

Interpreters: `make test` runs the entries whose Pythons this machine has and skips the others,
each with the reason, and ends with one line naming them and how to add them (tests/conftest.py);
`make test-matrix` (ZEROMIB_MATRIX=all) requires every one: a missing interpreter fails its tests.
"""
from __future__ import annotations

import fcntl
import functools
import glob
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAIN_VENV_BIN = REPO / ".venv" / "bin"
PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv")))


def own_dir(path: Path) -> bool:
    """Whether PATH is a real directory (no link) of this user's that no one else may write: the
    venvs' code runs as this user (root, under `make test`)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def shared_cache() -> Path:
    """~/.cache/zeromib-gpu/compat, made 0700 where missing; .build/compat of this checkout when it
    (or ~/.cache/zeromib-gpu) is not this user's own."""
    shared = Path.home() / ".cache" / "zeromib-gpu" / "compat"
    try:
        shared.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return REPO / ".build" / "compat"
    return shared if own_dir(shared.parent) and own_dir(shared) else REPO / ".build" / "compat"


def cache_dir() -> Path:
    """Where the controller venvs are: $ZEROMIB_COMPAT_CACHE, else shared_cache()."""
    return Path(os.environ["ZEROMIB_COMPAT_CACHE"]) if os.environ.get("ZEROMIB_COMPAT_CACHE") else shared_cache()


# (ansible-core, controller Python). The oldest Python each release supports on the controller
# where the machine has it, so that the matrix spans controller Pythons 3.10-3.13 as well.
# 2.19.14 is requirements.txt's: the main .venv, which runs every other test too.
CONTROLLER = (
    ("2.17.14", "3.10"),
    ("2.18.19", "3.11"),
    ("2.19.14", "3.11"),
    ("2.20.10", "3.12"),
    ("2.21.5", "3.13"),
)
# Managed-node Pythons: the modules run under each (ansible-core 2.19 supports targets 3.8-3.14).
MANAGED_PYTHONS = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13")
JMESPATH = "jmespath==1.1.0"
LOCKS = REPO / "tests" / "compat" / "constraints"
# What every test of the matrix says when it skips for a missing interpreter; tests/conftest.py
# counts the skips by it for the run's last line.
NOT_HERE = "not on this machine (tests/compat/matrix.py)"


class MissingInterpreter(RuntimeError):
    pass


def every_python() -> list[str]:
    """Every Python the matrix runs, controller and managed nodes, oldest first."""
    return sorted({p for _c, p in CONTROLLER} | set(MANAGED_PYTHONS), key=lambda v: tuple(map(int, v.split("."))))


def every_required() -> bool:
    """Whether this run must run every entry (`make test-matrix`, CI): ZEROMIB_MATRIX=all."""
    return os.environ.get("ZEROMIB_MATRIX", "present") == "all"


@functools.lru_cache(maxsize=None)
def present(minor: str) -> Path | None:
    """The CPython MINOR (e.g. "3.8") of this machine: pythonMINOR on PATH (not pyenv's shim,
    which may name a version pyenv does not have), else pyenv's newest build; None without one."""
    found = shutil.which(f"python{minor}")
    candidates = [found] if found and "/shims/" not in found else []
    candidates += sorted(glob.glob(str(PYENV_ROOT / "versions" / f"{minor}.*" / "bin" / f"python{minor}")), reverse=True)
    for c in candidates:
        r = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True, check=False)
        if r.returncode == 0 and r.stdout.strip() == minor:
            return Path(c)
    return None


def missing() -> list[str]:
    """The matrix's Pythons this machine does not have, oldest first."""
    return [minor for minor in every_python() if present(minor) is None]


def how_to_add(minors: list[str]) -> str:
    """What to run so that MINORS are found."""
    on_path = f"python{minors[0]}" if len(minors) == 1 else "pythonX.Y"
    return (f"`pyenv install {' '.join(minors)}` (or {on_path} on PATH), "
            "then `make test-matrix` requires every one")


def find_python(minor: str) -> Path:
    """The CPython MINOR of this machine (present()); MissingInterpreter, saying what to install, without one."""
    found = present(minor)
    if found is None:
        raise MissingInterpreter(
            f"Python {minor} is part of the tested matrix (tests/compat/matrix.py) but is not on this machine: "
            f"neither python{minor} on PATH nor {PYENV_ROOT}/versions/{minor}.*; install it: {how_to_add([minor])}")
    return found


def lock_file(core: str, minor: str) -> Path:
    """The whole resolved set of an entry's controller venv (`make lock` writes it)."""
    return LOCKS / f"ansible-core-{core}-py{minor}.txt"


def controller_bin(core: str, minor: str) -> Path:
    """The bin dir of a venv with ansible-core CORE on Python MINOR, built when missing."""
    if f"ansible-core=={core}" in (REPO / "requirements.txt").read_text().split():
        have = subprocess.run([str(MAIN_VENV_BIN / "python"), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, check=False).stdout.strip()
        if have == minor:
            return MAIN_VENV_BIN
    python = find_python(minor)
    cache = cache_dir()
    lock = lock_file(core, minor)
    pins = lock.read_text() if lock.exists() else ""
    recipe = {"python": str(python), "requirements": [f"ansible-core=={core}", JMESPATH],
              "lock": hashlib.sha256(pins.encode()).hexdigest()[:12]}
    # The lock's digest in the name: checkouts of another lock (branches) keep venvs of their own in
    # the shared cache instead of rebuilding one another's.
    venv = cache / f"ansible-core-{core}-py{minor}-{recipe['lock']}"
    stamp = venv / ".zeromib-recipe.json"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if stamp.exists() and json.loads(stamp.read_text()) == recipe and (venv / "bin" / "ansible-playbook").exists():
            return venv / "bin"
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([str(python), "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
        r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                            *recipe["requirements"], *(["-c", str(lock)] if pins else [])],
                           capture_output=True, text=True, check=False)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            raise RuntimeError(f"cannot build {venv.name}: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        stamp.write_text(json.dumps(recipe))
    return venv / "bin"


def main(argv: list[str]) -> int:
    """python tests/compat/matrix.py: build every venv, print the matrix; --check: exit 1 when an
    interpreter is missing (.ci/run's test), saying which."""
    if "--check" in argv:
        gone = missing()
        print(f"matrix: every interpreter present ({', '.join(every_python())})" if not gone
              else f"matrix: not on this machine: Python {', '.join(gone)}; {how_to_add(gone)}")
        return 1 if gone else 0
    for core, minor in CONTROLLER:
        print(core, minor, controller_bin(core, minor))
    for minor in MANAGED_PYTHONS:
        print("managed", minor, find_python(minor))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
