# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Build the Slurm job-boundary runner on the controller: this collection's own module_utils
(the code gpu_release and gpu_facts run) packed into one zip that python3 runs on the node, with
an entry point calling plugins/module_utils/_slurm/_jobcheck.py's main(). Stdlib only: it runs with the
controller's Python from an installed collection or a checkout alike.

Usage: pack_runner.py MODULE_UTILS_DIR OUT"""
import importlib.util
import io
import os
import sys
import zipfile

ENTRY = b"""import os, sys
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _jobcheck
sys.exit(_jobcheck.main(sys.argv[1:], dict(os.environ)))
"""
JOBCHECK = "_slurm/_jobcheck.py"
PACKAGES = ("ansible_collections", "ansible_collections/zeromib", "ansible_collections/zeromib/gpu",
            "ansible_collections/zeromib/gpu/plugins", "ansible_collections/zeromib/gpu/plugins/module_utils")


def unchecked_pyc(source, name):
    """Bytecode of this (the controller's) Python, as an unchecked hash-based .pyc (PEP 552): a
    node whose python3 is the same version imports it without compiling (the zip's sources cost
    ~0.1 s of CPU to compile at every hook run, measured in the fleet); any other version finds
    another magic number and compiles the .py beside it. No time stamp: the bytes stay the same."""
    code = compile(source, name, "exec", dont_inherit=True)
    from importlib import _bootstrap_external
    return _bootstrap_external._code_to_hash_pyc(code, importlib.util.source_hash(source), checked=False)


def sources(module_utils_dir):
    """[(path inside module_utils, e.g. '_look/_holders.py')] of every .py below it, sorted, and its
    subfolders as packages: a wing (folder) is packed whole, or the runner fails at import."""
    found = []
    for folder, dirs, files in os.walk(module_utils_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, module_utils_dir)
        found += [name if rel == "." else rel.replace(os.sep, "/") + "/" + name
                  for name in files if name.endswith(".py") and name != "__init__.py"]
    return sorted(found)


def pack(module_utils_dir):
    """module_utils/**/*.py (and their .pyc for this Python) and the entry point -> the bytes of
    one executable zip. Byte for byte the same for the same sources and Python (fixed times,
    sorted names, hash-based .pyc): the role's copy is idempotent."""
    buffer = io.BytesIO()
    buffer.write(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        def add(name, data):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
        names = sources(module_utils_dir)
        if JOBCHECK not in names:
            raise SystemExit(f"pack_runner.py: {module_utils_dir} has no {JOBCHECK}: not this collection's module_utils")
        wings = sorted({PACKAGES[-1] + "/" + name.rsplit("/", 1)[0] for name in names if "/" in name})
        add("__main__.py", ENTRY)
        for package in PACKAGES + tuple(wings):
            add(package + "/__init__.py", b"")
            add(package + "/__init__.pyc", unchecked_pyc(b"", package + "/__init__.py"))
        for name in names:
            with open(os.path.join(module_utils_dir, *name.split("/")), "rb") as handle:
                source = handle.read()
            add(PACKAGES[-1] + "/" + name, source)
            add(PACKAGES[-1] + "/" + name + "c", unchecked_pyc(source, PACKAGES[-1] + "/" + name))
    return buffer.getvalue()


def main(argv):
    if len(argv) != 2:
        print("usage: pack_runner.py MODULE_UTILS_DIR OUT", file=sys.stderr)
        return 2
    source, out = argv
    data = pack(source)
    tmp = out + ".tmp"
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
