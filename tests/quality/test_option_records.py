# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Options travel as typed records (issue 68): the engine (_act/) and the look (_look/) read an
option as `options.NAME` of a record made from the one table (_options.ReleaseOptions,
_options.LookOptions) or of gpu_restore's own (_options.RestoreOptions), never `params["NAME"]` or
`params.get("NAME")` of a dict; and a row added
to the table reaches every consumer that derives from it (the modules' specs and defaults, the
records, the range check, the role's types, the Slurm runner's defaults and type checks) with no
other edit: what else it needs is its documentation, the role's spec entry and the guide, which
tests/unit/plugins/module_utils/test_option_table.py holds to the table."""
from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UTILS = REPO / "plugins" / "module_utils"
PACKAGE = "ansible_collections.zeromib.gpu.plugins.module_utils"
READERS = ("params", "options")

# Reads by key that no record can serve: file -> (how many, why). None is left (every reader of
# gpu_release's, gpu_facts' and gpu_restore's options reads a record; the unit tests' stand-ins carry
# one too). A new read of an option by key fails here; read the record's attribute instead.
ALLOWED: dict[str, tuple[int, str]] = {}


def _reader(node: ast.expr) -> str | None:
    """'params' or 'options' where `node` is that name or an attribute of that name (self.params)."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name in READERS else None


def reads_by_key(source: str) -> list[tuple[int, str]]:
    """(line, text) of every `params["x"]`, `params.get("x")`, `options["x"]`, `options.get("x")` in
    `source`, `x` a string literal (self.params and release.options alike)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _reader(node.value):
            key = node.slice if isinstance(node.slice, ast.Constant) else getattr(node.slice, "value", node.slice)  # Python 3.8: an Index
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                found.append((node.lineno, f"{_reader(node.value)}[{key.value!r}]"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and _reader(node.func.value)
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, f"{_reader(node.func.value)}.get({node.args[0].value!r})"))
    return found


def test_the_finder_sees_every_way_of_reading_an_option_by_key():
    source = 'a = params["kill"]\nb = self.params.get("timeout", 1)\nc = release.options["x"]\nd = options.get("y")\ne = self.options.kill\n'
    assert [text for _line, text in reads_by_key(source)] == ["params['kill']", "params.get('timeout')", "options['x']", "options.get('y')"]


def test_the_engine_and_the_look_read_options_as_attributes_of_a_record():
    found = {}
    for path in sorted(list((UTILS / "_act").glob("*.py")) + list((UTILS / "_look").glob("*.py"))):
        reads = reads_by_key(path.read_text())
        if reads:
            found[str(path.relative_to(UTILS))] = reads
    over = {name: reads for name, reads in found.items() if len(reads) > ALLOWED.get(name, (0, ""))[0]}
    assert not over, "read the option as options.NAME of _options.ReleaseOptions/LookOptions, not by key: " + "; ".join(
        f"{name}:{line} {text}" for name, reads in over.items() for line, text in reads)
    # An allowance that is no longer used is taken back, so that it cannot hide a new read.
    assert {name: len(reads) for name, reads in found.items()} == {name: count for name, (count, _why) in ALLOWED.items()}


FAKE_ROW = '    Option("fake_knob", "float", 3, "a knob no module has", low=(0, True), most=DAY, modules=(RELEASE,)),\n'
TABLE_END = "\n)\nBY_NAME = "


def _load(name: str, path: Path, source: str | None = None) -> types.ModuleType:
    """A fresh copy of the module at `path` (or of `source`), run under `name`."""
    module = types.ModuleType(name)
    module.__file__ = str(path)
    exec(compile(source if source is not None else path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102 - the repo's own source
    return module


@pytest.fixture
def table_with_a_new_row(monkeypatch):
    """_options as if a helper had added one gpu_release row, and nothing else, installed where every
    consumer imports it from."""
    importlib.import_module(PACKAGE + "._options")
    source = (UTILS / "_options.py").read_text()
    assert source.count(TABLE_END) == 1
    fake = _load(PACKAGE + "._options", UTILS / "_options.py", source.replace(TABLE_END, "\n" + FAKE_ROW.rstrip("\n") + TABLE_END))
    monkeypatch.setitem(sys.modules, PACKAGE + "._options", fake)
    monkeypatch.setattr(sys.modules[PACKAGE], "_options", fake)
    return fake


def test_a_row_added_to_the_table_reaches_every_consumer(table_with_a_new_row):
    options = table_with_a_new_row
    assert options.argument_spec(options.RELEASE)["fake_knob"] == {"type": "float", "default": 3}
    assert "fake_knob" not in options.argument_spec(options.FACTS)
    # The records: a field at once, the module's value read by attribute, a partial mapping's off value.
    assert "fake_knob" in options.ReleaseOptions._fields and "fake_knob" not in options.LookOptions._fields
    assert options.ReleaseOptions.from_params(options.defaults(options.RELEASE)).fake_knob == 3
    assert options.ReleaseOptions.from_params({"fake_knob": 7.5}).fake_knob == 7.5
    assert options.ReleaseOptions.from_params({}).fake_knob is None
    with pytest.raises(AttributeError):
        options.ReleaseOptions.from_params({}).fake_knob = 1  # frozen
    # The range check, the role's types.
    assert options.check({"fake_knob": -1}) == ["fake_knob must be at least 0, got -1"]
    assert options.check({"fake_knob": 1e9})[0].startswith("fake_knob must be at most 86400 seconds")
    assert options.role_types()["free_gpus_fake_knob"] == {"type": "float"}
    # The entry points that build from the table, loaded afresh over it.
    release = _load("fake_gpu_release", REPO / "plugins" / "modules" / "gpu_release.py")
    assert release.ARGUMENT_SPEC["fake_knob"] == {"type": "float", "default": 3}
    jobcheck = _load("fake_jobcheck", UTILS / "_slurm" / "_jobcheck.py")
    assert "fake_knob" in jobcheck.RELEASE_OPTIONS and "fake_knob" in jobcheck.NUMBERS and jobcheck.RELEASE_DEFAULTS["fake_knob"] == 3
    role_spec = _load("fake_role_spec", REPO / "plugins" / "plugin_utils" / "_role_spec.py")
    assert role_spec.TYPES["free_gpus_fake_knob"] == {"type": "float"}


def test_the_records_take_a_partial_mapping_as_the_engine_always_read_it():
    from ansible_collections.zeromib.gpu.plugins.module_utils import _options
    partial = _options.ReleaseOptions.from_params({"gpus": ["0"], "_match_regexes": ["compiled"]})
    # Left out: None (off), except what the engine always read as on when absent.
    assert partial.gpus == ["0"] and partial.match_regexes == ["compiled"] and partial.clean_shm is None and partial.timeout is None
    assert partial.kill is True and partial.require_persistence is True
    # One conversion at a boundary: a record passes through, the look's record is made from gpu_release's.
    assert _options.ReleaseOptions.of(partial) is partial
    look = _options.LookOptions.of(partial)
    assert look.require_persistence is True and look.processes is True and look.protect is None
    # Every row is a field of the record of each module that takes it.
    for option in _options.OPTIONS:
        assert (option.name in _options.ReleaseOptions._fields) == (_options.RELEASE in option.modules)
        assert (option.name in _options.LookOptions._fields) == (_options.FACTS in option.modules)


def test_a_record_is_frozen_and_names_a_field_it_does_not_have():
    from ansible_collections.zeromib.gpu.plugins.module_utils import _options
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
    request = _facts.Request(protect=["812"], proc="/x")
    assert (request.proc, request.with_processes, request.footprint_mib, request.with_apps) == ("/x", True, 4, None)
    assert request._replace(with_apps=True).with_apps is True and request.with_apps is None
    with pytest.raises(AttributeError, match="frozen"):
        request.proc = "/proc"
    # A keyword of the look's that is no field (a typo) fails at once, naming it.
    with pytest.raises(TypeError, match="no field prcoess"):
        _facts.look(None, [], prcoess=True)
    assert _options.LookOptions.from_params({"timeout": 3}) == _options.LookOptions.from_params({"timeout": 3, "gpus": ["0"]})


def test_gpu_restore_reads_its_own_options_from_a_record_of_every_one_of_them():
    from ansible_collections.zeromib.gpu.plugins.module_utils import _options
    restore = _load("fake_gpu_restore", REPO / "plugins" / "modules" / "gpu_restore.py")
    assert set(_options.RestoreOptions._fields) == set(restore.ARGUMENT_SPEC)
    # A partial mapping (the unit tests') reads None where a key is left out, as params.get did.
    partial = _options.RestoreOptions.of({"forget": ["gone*"], "not_an_option": 1})
    assert partial.forget == ["gone*"] and partial.step_timeout is None and _options.RestoreOptions.of(partial) is partial


def test_the_facts_are_assembled_from_one_record_not_a_dozen_positions():
    import inspect

    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
    assert list(inspect.signature(_facts.assemble).parameters) == ["found"]
    with pytest.raises(TypeError, match="no field max_used"):
        _facts.Findings(gpus=[], max_used=0)
