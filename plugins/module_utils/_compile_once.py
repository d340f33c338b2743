# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Each module_util compiled once on the node, not twice, and not again on the next run.

AnsiballZ runs a module and its module_utils from a zip file, as source, through Python's
zipimporter, which writes no bytecode. Two costs follow, on every host of every gate:

* For every module it imports, the zipimporter of Python 3.8 to 3.13 compiles the source twice:
  first when the import system asks for the module's file name (`spec_from_loader` calls
  `get_filename`, which learns the name by getting the code), then again when it loads the module
  (`get_code`). From this module's import on, the code the first asking compiled is handed to the
  second asking, once, and dropped.
* Every run compiles the same sources again (~280 KB of the collection's on a clean gate). From
  this module's import on, the code compiled from the payload's sources is looked up first in
  root's bytecode cache on the node, `/var/lib/zeromib-gpu/bytecode` (a directory 0700 in the
  release record's directory, a file 0600 per module, kept by `keep()`): an entry is used only when
  it holds the SHA-256 of the very source being imported and this Python's magic number, and only
  when the directory and every directory above it are root's (or the running user's), real
  directories, and writable by no one else, and the file is a regular file of the same owner,
  opened without following a link. Anything else (missing, stale, corrupt, untrusted) is compiled
  from the source, as without the cache. gpu_release and gpu_facts write it at exit, not in check
  mode (where they keep the kernel log's state too); gpu_restore and slurm_node only read it.

Either way the code is the code Python compiles from the same bytes; only the time changes. It
acts only when this module was itself loaded by a zipimporter (AnsiballZ); a module run from
files (ansible-test units, the Slurm hooks) or a Python whose zipimport differs is left as it is.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import stat
import sys
import types
import typing as t
import zipimport

from importlib.util import MAGIC_NUMBER

try:
    import _imp
except ImportError:  # not CPython
    _imp = None  # type: ignore[assignment]

# CPython's own fixer of a loaded module's file name (what importlib calls for a .pyc); without it,
# no cache.
_fix_co_filename: t.Callable[[t.Any, str], None] | None = getattr(_imp, "_fix_co_filename", None)

# zipimport's private reader (3.8 to 3.13): (importer, module name) -> (code, is a package, path).
_READER = "_get_module_code"
# zipimport's private compiler of a module's source (3.8 to 3.13): (path, source bytes) -> code.
_COMPILER = "_compile_source"
CACHE_DIR = "/var/lib/zeromib-gpu/bytecode"
# No module's code is larger (the largest, _release, is ~0.1 MB).
MAX_BYTES = 4 * 1024 * 1024
# An entry: this Python's magic number, the SHA-256 of the source, then the marshalled code.
_DIGEST_BYTES = 32

Reader = t.Callable[[t.Any, str], t.Any]
Compiler = t.Callable[[str, bytes], t.Any]


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


def _writable_by_others(info: os.stat_result, above: bool) -> bool:
    # Above the directory, root's sticky one (/tmp) is allowed: no one else may rename or remove
    # what is not theirs in it.
    if above and info.st_uid == 0 and info.st_mode & stat.S_ISVTX:
        return False
    return bool(info.st_mode & 0o022)


def trusted_dir(path: str) -> bool:
    """Whether `path` and every directory above it are real directories (no link) of root's or
    the running user's that no one else may write: what root may load code from."""
    path, above = os.path.abspath(path), False
    while True:
        try:
            info = os.lstat(path)
        except OSError:
            return False
        if not stat.S_ISDIR(info.st_mode) or info.st_uid not in (0, os.geteuid()) or _writable_by_others(info, above):
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path, above = parent, True


def entry_name(inner: str) -> str:
    """The cache file of a module at `inner` (its path in the payload) for this Python."""
    return "{}.{}".format(inner.replace("/", "."), sys.implementation.cache_tag)


def load(path: str, digest: bytes) -> t.Any:
    """The code kept at `path` for a source of SHA-256 `digest`, or None (no file, a link, not a
    regular file of the running user's, writable by others, another Python's, another source's,
    corrupt)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022 or info.st_size > MAX_BYTES:
                return None
            data = handle.read(MAX_BYTES + 1)
    except OSError:
        return None
    head = len(MAGIC_NUMBER)
    if data[:head] != MAGIC_NUMBER or data[head:head + _DIGEST_BYTES] != digest:
        return None
    try:
        code = marshal.loads(data[head + _DIGEST_BYTES:])
    except (ValueError, EOFError, TypeError):
        return None
    return code if isinstance(code, types.CodeType) else None


def dump(code: t.Any, digest: bytes) -> bytes:
    return MAGIC_NUMBER + digest + marshal.dumps(code)


class CodeCache:
    """The payload's compiled modules, looked up in `directory` and kept there by `keep()`."""

    def __init__(self, directory: str, archive: str) -> None:
        self.directory = directory
        self.prefix = archive + os.sep
        self._trusted: bool | None = None
        # entry name -> (digest, code) compiled this run and not found in the cache.
        self.compiled: dict[str, tuple[bytes, t.Any]] = {}
        self.loaded = 0

    def trusted(self) -> bool:
        if self._trusted is None:
            self._trusted = trusted_dir(self.directory)
        return self._trusted

    def wrap(self, compile_source: Compiler) -> Compiler:
        """zipimport's compiler, looking in the cache first for the payload's own modules."""

        def cached(pathname: str, source: bytes) -> t.Any:
            if not pathname.startswith(self.prefix) or not isinstance(source, bytes):
                return compile_source(pathname, source)
            name = entry_name(pathname[len(self.prefix):])
            digest = hashlib.sha256(source).digest()
            code = load(os.path.join(self.directory, name), digest) if self.trusted() else None
            if code is not None:
                # Tracebacks name this run's payload, as a compiled module's would.
                _fix_co_filename(code, pathname)  # type: ignore[misc]  # installed only with it
                self.loaded += 1
                return code
            code = compile_source(pathname, source)
            self.compiled[name] = (digest, code)
            return code

        cached.cache = self  # type: ignore[attr-defined]
        return cached

    def keep(self) -> int:
        """Write what this run compiled and did not find: the number of entries written. Nothing
        when the directory cannot be made root's and root-only; a failed write costs the next run
        a compile, never the run."""
        if not self.compiled:
            return 0
        try:
            # Imported by gpu_release before: at exit the payload's zip may be gone.
            from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
            parent = os.path.dirname(self.directory)
            for directory in (parent, self.directory):
                if not os.path.lexists(directory):
                    os.mkdir(directory, 0o700)
            if not trusted_dir(self.directory):
                return 0
            written = 0
            for name, (digest, code) in sorted(self.compiled.items()):
                _commands.replace_file(os.path.join(self.directory, name), dump(code, digest), durable=False)
                written += 1
        except (ImportError, OSError, ValueError):
            return 0
        self.compiled.clear()
        return written


def install(loader: t.Any, directory: str = CACHE_DIR) -> bool:
    """Compile once from here on, and look in the bytecode cache first, when `loader` (the
    importing module's) is a zipimporter and zipimport reads code as this module knows it; True
    when installed (or already)."""
    read = getattr(zipimport, _READER, None)
    if not isinstance(loader, zipimport.zipimporter) or not callable(read):
        return False
    if not getattr(read, "compiles_once", False):
        setattr(zipimport, _READER, once(read))
    compile_source, archive = getattr(zipimport, _COMPILER, None), getattr(loader, "archive", None)
    # Without CPython's fixer of file names, no cache: only the compile-once above.
    if callable(compile_source) and not hasattr(compile_source, "cache") and isinstance(archive, str) and _fix_co_filename is not None:
        setattr(zipimport, _COMPILER, CodeCache(directory, archive).wrap(compile_source))
    return True


def keep() -> int:
    """Keep what this run compiled in the bytecode cache (gpu_release and gpu_facts at exit, not in
    check mode): the number of entries written; 0 when not installed."""
    cache = getattr(getattr(zipimport, _COMPILER, None), "cache", None)
    return cache.keep() if isinstance(cache, CodeCache) else 0


install(__spec__.loader if __spec__ is not None else None)
