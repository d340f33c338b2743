"""Every Python package of the controller and the test tooling is locked (issue 67): constraints.txt
holds the whole resolved set of requirements*.txt (`make lock`), every pip install of the Makefile
uses it, each matrix venv has its own lock, and no ansible command prints a warning before a play
(cryptography 51's DSA deprecation, through ansible-core, was the first line of every command)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
sys.path.insert(0, str(REPO / "tests" / "compat"))
import matrix  # noqa: E402

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """{package: version} of a lock; every line that is not a comment must be one `name==version`."""
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = PIN.match(line.strip())
            assert m, f"{path.name}: not a pin: {line!r}"
            found[canonical(m.group(1))] = m.group(2)
    return found


def direct(path: Path) -> dict[str, str]:
    """The pins a requirements file names itself (its -r and -c lines left out)."""
    return {canonical(k): v for line in path.read_text().splitlines() if (m := PIN.match(line.split("#")[0].strip()))
            for k, v in [m.groups()]}


def test_the_lock_holds_every_direct_dependency_at_its_pin_and_cryptography_without_the_dsa_warning():
    lock = pins(REPO / "constraints.txt")
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-lint.txt"):
        named = direct(REPO / name)
        assert named and {k: lock.get(k) for k in named} == named, name
    # What the direct ones bring is there too: a lock of only the direct pins would be no lock.
    assert {"cryptography", "jinja2", "pyyaml", "resolvelib", "packaging", "markupsafe", "cffi"} <= set(lock), sorted(lock)
    assert int(lock["cryptography"].split(".")[0]) < 51, lock["cryptography"]


def test_each_matrix_venv_has_its_lock_with_its_ansible_core():
    for core, minor in matrix.CONTROLLER:
        lock = pins(matrix.lock_file(core, minor))
        assert lock["ansible-core"] == core and lock["jmespath"] == matrix.JMESPATH.split("==")[1], (core, minor)
        assert int(lock["cryptography"].split(".")[0]) < 51, (core, minor, lock["cryptography"])


def test_every_pip_install_of_the_makefile_uses_the_lock(tmp_path):
    for target in ("install", "venv"):
        recipe = subprocess.run(["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout
        installs = [line for line in recipe.splitlines() if "pip install" in line]
        assert installs and all("-c constraints.txt" in line for line in installs), recipe
    assert "tests/tools/lock.py" in subprocess.run(["make", "-n", "lock"], cwd=REPO, capture_output=True, text=True,
                                                   check=True).stdout


def test_the_venv_has_what_the_lock_says():
    """`make deps` installs the lock (its stamp depends on constraints.txt): a package of .venv at
    another version than the lock's means the lock is not what runs."""
    freeze = subprocess.run([str(VENV_BIN / "python"), "-m", "pip", "freeze", "--disable-pip-version-check"],
                            capture_output=True, text=True, check=True).stdout
    installed = {canonical(m.group(1)): m.group(2) for line in freeze.splitlines() if (m := PIN.match(line.strip()))}
    lock = pins(REPO / "constraints.txt")
    differ = {k: (installed[k], v) for k, v in lock.items() if k in installed and installed[k] != v}
    assert not differ, f"{differ}: run `make deps`"
    assert set(lock) - set(installed) == set(), "locked but not installed: run `make deps`"


def user_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PYTEST_", "PYTHONWARNINGS"))}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    return env


def test_no_ansible_command_prints_a_warning_before_a_play(tmp_path):
    """The README's and the demo's commands start as these do: `ansible-playbook --version` and a play
    on the controller itself (one debug task: no module runs on this machine), from the checkout
    (its ansible.cfg) and from a folder of the user's. Any warning, Python's or Ansible's, fails."""
    play = tmp_path / "hello.yml"
    play.write_text("- name: Hello\n  hosts: localhost\n  gather_facts: false\n  tasks:\n"
                    "    - name: Say hello\n      ansible.builtin.debug:\n        msg: hello\n")
    for cwd in (REPO, tmp_path):
        for argv in (["ansible-playbook", "--version"],
                     ["ansible-playbook", "-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}", str(play)]):
            r = subprocess.run(argv, cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=120, check=False)
            assert r.returncode == 0, (argv, r.stdout, r.stderr)
            assert r.stderr == "", (cwd, argv, r.stderr)
            assert "WARNING" not in r.stdout.upper().replace("WARNINGS", ""), (cwd, argv, r.stdout)
