# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Each module_util compiled once on the node, not twice.

AnsiballZ runs a module and its module_utils from a zip file, as source, through Python's
zipimporter. For every module it imports, the zipimporter of Python 3.8 to 3.13 compiles the
source twice: first when the import system asks for the module's file name (`spec_from_loader`
calls `get_filename`, which learns the name by getting the code), then again when it loads the
module (`get_code`). On a clean gate without this, gpu_release took 589 ms of CPU on a simulated
node, with it 512 ms (docs/benchmarks.md), on every host of every gate.

A module imports this first, before the collection's other module_utils: from then on the code
the first asking compiled is handed to the second asking, once, and dropped. It is the code
object Python compiles from the same bytes of the same zip, so nothing but the time changes. It
acts only when this module was itself loaded by a zipimporter (AnsiballZ); a module run from
files (ansible-test units, the Slurm hooks) or a Python whose zipimport differs is left as it is.
"""

from __future__ import annotations

import typing as t
import zipimport

# zipimport's private reader (3.8 to 3.13): (importer, module name) -> (code, is a package, path).
_READER = "_get_module_code"

Reader = t.Callable[[t.Any, str], t.Any]


def once(read: Reader) -> Reader:
    """`read`, with each result kept for the next asking of the same module, once."""
    kept: dict[tuple[str, str, str], t.Any] = {}

    def read_once(importer: t.Any, fullname: str) -> t.Any:
        key = (importer.archive, importer.prefix, fullname)
        if key in kept:
            return kept.pop(key)
        found = read(importer, fullname)
        kept[key] = found
        return found

    read_once.compiles_once = True  # type: ignore[attr-defined]
    return read_once


def install(loader: t.Any) -> bool:
    """Compile once from here on, when `loader` (the importing module's) is a zipimporter and
    zipimport reads code as this module knows it; True when installed (or already)."""
    read = getattr(zipimport, _READER, None)
    if not isinstance(loader, zipimport.zipimporter) or not callable(read):
        return False
    if not getattr(read, "compiles_once", False):
        setattr(zipimport, _READER, once(read))
    return True


install(__spec__.loader if __spec__ is not None else None)
