"""The stalled FUSE file system's test support, now the tenant kit's `stalled_fuse`
(tests/tenants/stalled_fuse.py): re-exported here for the tests that import it by this name."""
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from tenants.stalled_fuse import EXEC_ON_IT, HOLD_OPEN, SIM, USER, StalledFs, blocked_in_execve, spawn_user, waits_in_fuse  # noqa: E402

__all__ = ["EXEC_ON_IT", "HOLD_OPEN", "SIM", "USER", "StalledFs", "blocked_in_execve", "spawn_user", "waits_in_fuse"]
