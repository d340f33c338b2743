# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_compile_once (issue 36): a module imported from a zip, as AnsiballZ imports the collection's
module_utils on the node, is compiled once instead of twice, and is the same module. The real
payload is measured by benchmarks/gate_profile.py; here, a zip of our own and Python's own
zipimport."""

from __future__ import annotations

import collections
import importlib
import sys
import zipfile
import zipimport

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _compile_once

SOURCES = {
    "zmbpkg/__init__.py": "NAME = 'package'\n",
    "zmbpkg/first.py": "from zmbpkg import second\n\ndef twice(value):\n    return second.double(value)\n",
    "zmbpkg/second.py": "def double(value):\n    return 2 * value\n",
}


@pytest.fixture
def zipped(tmp_path, monkeypatch):
    """A zip of a small package on sys.path (as AnsiballZ's payload is) and a count of the
    compiles of zipimport's reader, per module; the package forgotten afterwards."""
    archive = tmp_path / "payload.zip"
    with zipfile.ZipFile(archive, "w") as payload:
        for name, text in SOURCES.items():
            payload.writestr(name, text)
    compiles: collections.Counter[str] = collections.Counter()
    read = zipimport._get_module_code  # pylint: disable=protected-access

    def counted(importer, fullname):
        compiles[fullname] += 1
        return read(importer, fullname)

    monkeypatch.setattr(zipimport, "_get_module_code", counted)
    monkeypatch.syspath_prepend(str(archive))
    importlib.invalidate_caches()
    yield compiles
    for name in [name for name in sys.modules if name == "zmbpkg" or name.startswith("zmbpkg.")]:
        del sys.modules[name]
    sys.path_importer_cache.pop(str(archive), None)


def test_python_compiles_each_zipped_module_twice_without_it(zipped):
    """Why the module_util exists: if a Python stops doing this, it can go."""
    first = importlib.import_module("zmbpkg.first")
    assert first.twice(21) == 42
    assert dict(zipped) == {"zmbpkg": 2, "zmbpkg.first": 2, "zmbpkg.second": 2}


def test_with_it_each_zipped_module_is_compiled_once_and_is_the_same_module(zipped, monkeypatch):
    monkeypatch.setattr(zipimport, "_get_module_code", _compile_once.once(zipimport._get_module_code))  # pylint: disable=protected-access
    first = importlib.import_module("zmbpkg.first")
    assert dict(zipped) == {"zmbpkg": 1, "zmbpkg.first": 1, "zmbpkg.second": 1}
    assert first.twice(21) == 42
    assert sys.modules["zmbpkg"].NAME == "package"
    assert first.__file__.endswith("payload.zip/zmbpkg/first.py")
    assert isinstance(first.__loader__, zipimport.zipimporter)
    # A module imported again after it was forgotten is read afresh, not from a stale copy.
    del sys.modules["zmbpkg.second"]
    assert importlib.import_module("zmbpkg.second").double(4) == 8
    assert zipped["zmbpkg.second"] == 2


def test_it_installs_only_for_a_module_loaded_from_a_zip_and_only_once(monkeypatch):
    read = zipimport._get_module_code  # pylint: disable=protected-access
    monkeypatch.setattr(zipimport, "_get_module_code", read)
    # Loaded from files (ansible-test units, the Slurm hooks): zipimport is left as it is.
    assert _compile_once.install(_compile_once.__spec__.loader) is False
    assert _compile_once.install(None) is False
    assert zipimport._get_module_code is read  # pylint: disable=protected-access
    importer = zipimport.zipimporter.__new__(zipimport.zipimporter)
    assert _compile_once.install(importer) is True
    installed = zipimport._get_module_code  # pylint: disable=protected-access
    assert installed is not read and installed.compiles_once
    # A second module importing it (or a second import) does not wrap the reader again.
    assert _compile_once.install(importer) is True
    assert zipimport._get_module_code is installed  # pylint: disable=protected-access


def test_a_python_without_the_reader_is_left_as_it_is(monkeypatch):
    monkeypatch.delattr(zipimport, "_get_module_code")
    assert _compile_once.install(zipimport.zipimporter.__new__(zipimport.zipimporter)) is False
    assert not hasattr(zipimport, "_get_module_code")
