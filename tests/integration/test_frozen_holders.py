"""Holders whose cgroup is frozen (issue 70, paused containers and the cgroup v1 freezer), through the real
gpu_release (ansible-playbook on a namespace host). Under the v1 freezer SIGKILL stays pending until
the cgroup is thawed (this machine's hybrid hierarchy, /sys/fs/cgroup/freezer): such a holder is
"frozen", never "unkillable" with reboot advice; a cgroup a user froze in her delegated subtree is
named as hers, and the run does not thaw it (tests/tenants/frozen_cgroup.py).
"""
import os
import sys

from ansible_in_ns import run_module
from test_gpu_release import used

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tenants.frozen_cgroup import frozen_holder  # noqa: E402  # pylint: disable=wrong-import-position

USER = 4242
FAST = {"kill_timeout": 0.5, "wait_timeout": 1, "settle_timeout": 0}


def test_a_holder_root_froze_is_frozen_with_the_thaw_command_not_unkillable(nshost):
    host = nshost("h200x1", seed="frozenroot")
    with frozen_holder(host, "suspended-job", mib=2048) as held:
        run = run_module(host, "gpu_release", FAST)
        msg = run["msg"]
        assert run.get("failed") and f"frozen (freezer.state FROZEN in {held.directory}): pid {held.pid} " in msg, msg
        assert f"`echo THAWED > {held.directory}/freezer.state`; no reboot is needed" in msg, msg
        assert "unkillable (outlived SIGKILL" not in msg and "a reboot is needed" not in msg, msg
        assert [e["pid"] for e in run["unkillable"]] == [held.pid]  # the result's key is unchanged
        assert held.state() == "FROZEN"  # the run thaws nothing itself


def test_a_cgroup_a_user_froze_in_her_delegated_subtree_is_named_hers_and_never_thawed(nshost):
    host = nshost("h200x1", seed="frozenuser")
    with frozen_holder(host, "alice-lab", mib=1024, uid=USER, delegated=True) as held:
        run = run_module(host, "gpu_release", FAST)
        msg = run["msg"]
        assert run.get("failed") and f"frozen (freezer.state FROZEN in {held.directory}): pid {held.pid} " in msg, msg
        assert f"the cgroup is in uid {USER}'s delegated subtree, frozen by that user: this run does not thaw a user's cgroup" in msg, msg
        assert "THAWED" not in msg and "a reboot is needed" not in msg, msg
        assert held.state() == "FROZEN" and used(host, 0) >= 1024
