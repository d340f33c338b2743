"""Fixtures for tests that run against simulated GPU hosts (tests/sim/nshost.py).

    def test_x(nshost):
        host = nshost("h200x8", minors=[1, 0, 2, 3, 4, 5, 6, 7])
        host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960"])
        host.smi("--query-gpu=index,memory.used", "--format=csv,noheader")

Every host a test creates is torn down when the test ends (pass or fail); NsHost also
registers an atexit hook. The hosts need root, util-linux unshare/nsenter and overlayfs;
without them these tests are skipped.
"""
import os
import shutil
import sys

import pytest

SIM_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sim")
if SIM_DIR not in sys.path:
    sys.path.insert(0, SIM_DIR)

import fake_libcuda  # noqa: E402
from nshost import NsHost  # noqa: E402


def _rig_missing():
    if os.geteuid() != 0:
        return "simulated hosts need root (mount/pid namespaces)"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    return None


requires_nshost = pytest.mark.skipif(_rig_missing() is not None, reason=_rig_missing() or "")


def _hosts():
    """A factory of started NsHosts and the list to stop at the end."""
    reason = _rig_missing()
    if reason:
        pytest.skip(reason)
    hosts = []

    def make(preset="h200x8", **kw):
        h = NsHost(preset=preset, **kw)
        hosts.append(h)
        h.start()
        return h

    return make, hosts


@pytest.fixture(scope="module")
def module_nshost():
    """As `nshost`, for hosts shared by the tests of one module."""
    make, hosts = _hosts()
    yield make
    for h in reversed(hosts):
        h.stop()


@pytest.fixture(scope="module")
def library():
    """The fake libcuda.so.1 (tests/sim/fake_libcuda.c), built once per module with the machine's C compiler."""
    if fake_libcuda.compiler() is None:
        pytest.fail("no C compiler: install gcc and libc6-dev (tests/tools/apt-deps.sh test)")
    return fake_libcuda.build()


@pytest.fixture
def nshost():
    """Factory: nshost(preset="h200x8", **NsHost kwargs) -> started NsHost."""
    make, hosts = _hosts()
    yield make
    for h in reversed(hosts):
        h.stop()
