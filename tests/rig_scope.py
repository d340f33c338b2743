"""How a shared rig is scheduled under pytest-xdist (tests/conftest.py reads what this marks)."""
from __future__ import annotations


def per_worker(func):
    """Marks a session fixture of which every xdist worker may bring up its own (a fleet named
    after the worker): its tests are grouped by file, as a module-scoped rig's are, so its files
    spread over the workers instead of queueing in one. Put it under @pytest.fixture."""
    func.rig_per_worker = True
    return func
