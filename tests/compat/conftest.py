"""Fixtures for the managed-node side of the compatibility matrix (tests/compat/matrix.py).

`nshost` starts a simulated GPU host (tests/sim/nshost.py: private mount, PID and UTS
namespaces, simulated driver) and always stops it. Unlike tests/integration, a host that cannot
be made here fails the test under CI or ZEROMIB_FLEET_REQUIRED=1 instead of skipping it.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # ansible_in_ns: results through the callback
from nshost import NsHost  # noqa: E402


def _rig_missing() -> str | None:
    if os.geteuid() != 0:
        return "simulated hosts need root (mount/pid namespaces)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


@pytest.fixture
def nshost():
    why = _rig_missing()
    if why:
        if os.environ.get("CI") or os.environ.get("ZEROMIB_FLEET_REQUIRED") == "1":
            pytest.fail(f"the compatibility matrix must run here but: {why}")
        pytest.skip(why)
    host = NsHost(preset="h200x8")
    host.start()
    try:
        yield host
    finally:
        host.stop()
