#!/usr/bin/env python3
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Build the Slurm job-boundary runner on the controller: this collection's own module_utils
(the code gpu_release and gpu_facts run) packed into one zip that python3 runs on the node, with
an entry point calling plugins/module_utils/_jobcheck.py's main(). Stdlib only: it runs with the
controller's Python from an installed collection or a checkout alike.

Usage: pack_runner.py MODULE_UTILS_DIR OUT"""
import io
import os
import sys
import zipfile

ENTRY = b"""import os, sys
from ansible_collections.zeromib.gpu.plugins.module_utils import _jobcheck
sys.exit(_jobcheck.main(sys.argv[1:], dict(os.environ)))
"""
PACKAGES = ("ansible_collections", "ansible_collections/zeromib", "ansible_collections/zeromib/gpu",
            "ansible_collections/zeromib/gpu/plugins", "ansible_collections/zeromib/gpu/plugins/module_utils")


def pack(module_utils_dir):
    """module_utils/*.py and the entry point -> the bytes of one executable zip. Byte for byte the
    same for the same sources (fixed times, sorted names): the role's copy is idempotent."""
    buffer = io.BytesIO()
    buffer.write(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        def add(name, data):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
        add("__main__.py", ENTRY)
        for package in PACKAGES:
            add(package + "/__init__.py", b"")
        names = sorted(n for n in os.listdir(module_utils_dir) if n.endswith(".py") and n != "__init__.py")
        if "_jobcheck.py" not in names:
            raise SystemExit(f"pack_runner.py: {module_utils_dir} has no _jobcheck.py: not this collection's module_utils")
        for name in names:
            with open(os.path.join(module_utils_dir, name), "rb") as handle:
                add(PACKAGES[-1] + "/" + name, handle.read())
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
