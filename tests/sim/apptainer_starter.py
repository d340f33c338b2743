"""Build the Apptainer starter stand-in (tests/sim/apptainer_starter.c) with the machine's C compiler,
statically linked so that it runs in any test host (an NsHost, a fleet host).

    path = build()                # .build/apptainer-starter/<digest>/starter-suid, rebuilt when the source changes
    argv = start_argv(path, "alice", "train")   # exec the starter with apptainer's argv[0]

Stdlib only. Needs `cc` and a static libc (Debian: gcc and libc6-dev; tests/tools/apt-deps.sh test).
"""
import hashlib
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "apptainer_starter.c")
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(REPO, ".build", "apptainer-starter")
# Where Debian's, Ubuntu's and EPEL's apptainer packages install it.
INSTALLED = "/usr/libexec/apptainer/bin/starter-suid"
# An execv that sets argv[0], as apptainer's CLI execs the starter (sh's `exec -a` is bash's only).
EXEC_AS = "import os, sys; os.execv(sys.argv[1], sys.argv[2:])"


def build(out_dir=BUILD):
    """The built starter's path (built once per source version; atomic, so parallel tests agree)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc): install gcc and libc6-dev (tests/tools/apt-deps.sh test)")
    with open(SOURCE, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:12]
    target = os.path.join(out_dir, digest, "starter-suid")
    if os.path.exists(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.{os.getpid()}"
    subprocess.run([cc, "-static", "-O1", "-Wall", "-Werror", "-o", partial, SOURCE], check=True, capture_output=True)
    os.rename(partial, target)
    return target


def progname(user, name):
    """argv[0] of an instance's starter: `Apptainer instance: alice [train]`."""
    return f"Apptainer instance: {user} [{name}]"


def start_argv(starter, user, name):
    """The argv that starts an instance NAME of USER through STARTER (its command in ZEROMIB_STARTER_CMD)."""
    return ["python3", "-c", EXEC_AS, starter, progname(user, name)]
