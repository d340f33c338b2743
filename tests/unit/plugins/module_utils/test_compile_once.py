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
import marshal
import os
import stat
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


# ------------------------------------------------------------------ the bytecode cache


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """zipimport's compiler counted per module (the reader compiling once), the cache installed for a payload at
    tmp_path/run-N/payload.zip (N from `payload(n)`), entries in tmp_path/state/bytecode; each
    run's modules forgotten before the next, as the next AnsiballZ run starts afresh."""
    compiles: collections.Counter[str] = collections.Counter()
    compile_source = zipimport._compile_source  # pylint: disable=protected-access
    # As installed: compiled (or loaded) once per import, not twice.
    monkeypatch.setattr(zipimport, "_get_module_code", _compile_once.once(zipimport._get_module_code))  # pylint: disable=protected-access

    def counted(pathname, source):
        compiles[pathname.rsplit("payload.zip/", 1)[-1]] += 1
        return compile_source(pathname, source)

    directory = tmp_path / "state" / "bytecode"
    archives = []

    def forget():
        for name in [name for name in sys.modules if name == "zmbpkg" or name.startswith("zmbpkg.")]:
            del sys.modules[name]
        for archive in archives:
            sys.path_importer_cache.pop(str(archive), None)
            monkeypatch.delitem(sys.path, sys.path.index(str(archive)), raising=False)

    def payload(run, sources=None):
        """A new run's payload: its zip on sys.path, a fresh cache over it -> that cache."""
        forget()
        compiles.clear()
        archive = tmp_path / f"run-{run}" / "payload.zip"
        archive.parent.mkdir()
        with zipfile.ZipFile(archive, "w") as zipped_payload:
            for name, text in (sources or SOURCES).items():
                zipped_payload.writestr(name, text)
        archives.append(archive)
        cache = _compile_once.CodeCache(str(directory), str(archive))
        monkeypatch.setattr(zipimport, "_compile_source", cache.wrap(counted))
        monkeypatch.syspath_prepend(str(archive))
        importlib.invalidate_caches()
        return cache

    payload.compiles = compiles
    payload.directory = directory
    yield payload
    forget()


def entry(directory, inner):
    return directory / _compile_once.entry_name(inner)


def test_a_kept_run_is_loaded_by_the_next_without_compiling_and_names_the_new_payload(cached):
    first = cached(1)
    assert importlib.import_module("zmbpkg.first").twice(21) == 42
    assert dict(cached.compiles) == {"zmbpkg/__init__.py": 1, "zmbpkg/first.py": 1, "zmbpkg/second.py": 1}
    assert first.keep() == 3
    # Root-only, as the release record's directory: the directory 0700, each entry 0600.
    assert stat.S_IMODE(os.stat(cached.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(cached.directory.parent).st_mode) == 0o700
    assert sorted(p.name for p in cached.directory.iterdir()) == sorted(
        _compile_once.entry_name(name) for name in SOURCES)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in cached.directory.iterdir())
    assert first.keep() == 0  # nothing new

    second = cached(2)
    module = importlib.import_module("zmbpkg.first")
    assert module.twice(21) == 42 and sys.modules["zmbpkg"].NAME == "package"
    assert dict(cached.compiles) == {}
    assert second.loaded == 3 and second.keep() == 0
    # Tracebacks name this run's payload, not the run that compiled it.
    assert module.twice.__code__.co_filename.endswith("run-2/payload.zip/zmbpkg/first.py")
    assert module.__file__.endswith("run-2/payload.zip/zmbpkg/first.py")


def kept(cached):
    """A first run that imports the package and keeps it -> {entry path: inode}."""
    first = cached(1)
    importlib.import_module("zmbpkg.first")
    assert first.keep() == 3
    return {path: path.stat().st_ino for path in cached.directory.iterdir()}


def test_a_changed_source_is_compiled_and_replaces_only_its_own_entry(cached):
    before = kept(cached)
    changed = dict(SOURCES, **{"zmbpkg/second.py": "def double(value):\n    return value + value\n"})
    cache = cached(2, changed)
    assert importlib.import_module("zmbpkg.first").twice(4) == 8
    assert dict(cached.compiles) == {"zmbpkg/second.py": 1}
    assert cache.keep() == 1
    after = {path: path.stat().st_ino for path in cached.directory.iterdir()}
    second = entry(cached.directory, "zmbpkg/second.py")
    assert after[second] != before[second]
    assert {p: i for p, i in after.items() if p != second} == {p: i for p, i in before.items() if p != second}
    cached(3, changed)
    importlib.import_module("zmbpkg.first")
    assert dict(cached.compiles) == {}


def corrupt(path):
    path.write_bytes(path.read_bytes()[:40])


def other_python(path):
    path.write_bytes(b"\0\0\r\n" + path.read_bytes()[4:])


def other_source(path):
    data = path.read_bytes()
    path.write_bytes(data[:4] + bytes(32) + data[36:])


def not_code(path):
    path.write_bytes(path.read_bytes()[:36] + marshal.dumps({"a": "dict"}))


def writable_by_others(path):
    path.chmod(0o666)


def a_link(path):
    target = path.with_name("elsewhere")
    path.rename(target)
    path.symlink_to(target)


def a_users(path):
    os.chown(path, 4242, 4242)


@pytest.mark.parametrize("spoil", [corrupt, other_python, other_source, not_code, writable_by_others, a_link, a_users])
def test_an_entry_that_is_not_exactly_root_only_and_this_sources_is_compiled_from_the_source(cached, spoil):
    if spoil is a_users and os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    kept(cached)
    spoil(entry(cached.directory, "zmbpkg/second.py"))
    cache = cached(2)
    assert importlib.import_module("zmbpkg.first").twice(21) == 42
    assert dict(cached.compiles) == {"zmbpkg/second.py": 1}
    assert cache.loaded == 2


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_no_entry_is_read_or_written_in_a_directory_others_may_write(cached, mode):
    before = kept(cached)
    cached.directory.chmod(mode)
    cache = cached(2)
    assert importlib.import_module("zmbpkg.first").twice(21) == 42
    assert dict(cached.compiles) == {"zmbpkg/__init__.py": 1, "zmbpkg/first.py": 1, "zmbpkg/second.py": 1}
    assert cache.keep() == 0
    assert {path: path.stat().st_ino for path in cached.directory.iterdir()} == before


def test_no_entry_is_read_through_a_linked_directory_or_below_one_others_may_write(cached, tmp_path):
    kept(cached)
    state = tmp_path / "state"
    state.rename(tmp_path / "real-state")
    state.symlink_to(tmp_path / "real-state")
    cached(2)
    importlib.import_module("zmbpkg.first")
    assert len(cached.compiles) == 3
    state.unlink()
    (tmp_path / "real-state").rename(state)
    state.chmod(0o777)  # above the cache: another user could swap the directory below
    cached(3)
    importlib.import_module("zmbpkg.first")
    assert len(cached.compiles) == 3
    state.chmod(0o700)
    cached(4)
    importlib.import_module("zmbpkg.first")
    assert len(cached.compiles) == 0


def test_a_root_sticky_directory_above_is_trusted_and_a_users_directory_is_not(tmp_path):
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "cache").mkdir(mode=0o700)
    assert _compile_once.trusted_dir(str(sticky / "cache")) is (os.stat(sticky).st_uid == 0)
    # The directory itself is never one others may write, sticky or not.
    assert _compile_once.trusted_dir(str(sticky)) is False
    if os.geteuid() == 0:
        os.chown(sticky / "cache", 4242, 4242)
        assert _compile_once.trusted_dir(str(sticky / "cache")) is False


def test_nothing_is_kept_where_the_state_directory_cannot_be_made(cached, tmp_path):
    cache = cached(1)
    importlib.import_module("zmbpkg.first")
    (tmp_path / "state").write_text("a file where the directory should be")
    assert cache.keep() == 0
    assert not cached.directory.exists()


def test_install_puts_the_cache_before_zipimports_compiler_once_for_the_payloads_zip(tmp_path, monkeypatch):
    archive = tmp_path / "payload.zip"
    with zipfile.ZipFile(archive, "w") as payload:
        payload.writestr("zmbpkg/__init__.py", "")
    monkeypatch.setattr(zipimport, "_get_module_code", zipimport._get_module_code)  # pylint: disable=protected-access
    monkeypatch.setattr(zipimport, "_compile_source", zipimport._compile_source)  # pylint: disable=protected-access
    assert _compile_once.keep() == 0  # not installed (loaded from files): nothing to keep
    importer = zipimport.zipimporter(str(archive))
    assert _compile_once.install(importer, str(tmp_path / "bytecode")) is True
    wrapped = zipimport._compile_source  # pylint: disable=protected-access
    assert wrapped.cache.directory == str(tmp_path / "bytecode") and wrapped.cache.prefix == str(archive) + os.sep
    assert _compile_once.install(importer) is True
    assert zipimport._compile_source is wrapped  # pylint: disable=protected-access
    assert _compile_once.keep() == 0  # nothing compiled yet
