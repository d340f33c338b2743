"""tests/conftest.py, loaded by its path for the quality tests that check its functions (the rig
groups, the node-state guard): under pytest, `conftest` in sys.modules is whichever of the suite's
conftest files was imported last."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

PATH = Path(__file__).resolve().parents[1] / "conftest.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("zeromib_tests_conftest", PATH)
    assert spec is not None and spec.loader is not None, PATH
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
