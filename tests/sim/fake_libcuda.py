"""Build the fake libcuda.so.1 (tests/sim/fake_libcuda.c) with the machine's C compiler.

    path = build()                       # .build/fake-libcuda/libcuda.so.1, rebuilt when the source changes
    write_config(state_dir, devices=["0000:00:06.0"], fail={"cuCtxCreate": 802}, hang=["cuInit"])
    calls(state_dir)                     # [(pid, call, argument), ...] from its call log

Stdlib only. Needs `cc` (Debian: gcc and libc6-dev; tests/tools/apt-deps.sh test installs them).
"""
import hashlib
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fake_libcuda.c")
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.path.join(REPO, ".build", "fake-libcuda")
CONFIG_NAME = "libcuda.conf"
LOG_NAME = "libcuda.log"


def compiler():
    return shutil.which("cc") or shutil.which("gcc")


def build(out_dir=BUILD):
    """The built library's path (built once per source version; atomic, so parallel tests agree)."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc): install gcc and libc6-dev (tests/tools/apt-deps.sh test)")
    with open(SOURCE, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:12]
    target_dir = os.path.join(out_dir, digest)
    target = os.path.join(target_dir, "libcuda.so.1")
    if os.path.exists(target):
        return target
    os.makedirs(target_dir, exist_ok=True)
    partial = f"{target}.{os.getpid()}"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", partial, SOURCE], check=True,
                   capture_output=True)
    os.rename(partial, target)
    return target


def write_config(state_dir, devices=(), fail=None, hang=(), free_mib=None):
    lines = [f"device {d}" for d in devices]
    lines += [f"fail {call} {code}" for call, code in (fail or {}).items()]
    lines += [f"hang {call}" for call in hang]
    if free_mib is not None:
        lines.append(f"free_mib {free_mib}")
    with open(os.path.join(state_dir, CONFIG_NAME), "w") as handle:
        handle.write("\n".join(lines) + "\n")


def calls(state_dir):
    try:
        with open(os.path.join(state_dir, LOG_NAME)) as handle:
            return [tuple(line.split(" ", 2)) for line in handle.read().splitlines() if line]
    except OSError:
        return []


def clear_log(state_dir):
    try:
        os.unlink(os.path.join(state_dir, LOG_NAME))
    except OSError:
        pass
