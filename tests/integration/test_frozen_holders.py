"""Holders whose cgroup is frozen (issue 70, paused containers and the cgroup v1 freezer), through the real
gpu_release (ansible-playbook on a namespace host). Under the v1 freezer SIGKILL stays pending until
the cgroup is thawed (this machine's hybrid hierarchy, /sys/fs/cgroup/freezer): such a holder is
"frozen", never "unkillable" with reboot advice; a cgroup a user froze in her delegated subtree is
named as hers, and the run does not thaw it (tests/tenants/frozen_cgroup.py).
"""
import os
import sys

import pytest

from ansible_in_ns import run_module
from test_gpu_release import used
from test_paused_containers import ENDS, said_first_by_free_gpus, said_first_in_own_play

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


def test_check_mode_fails_as_the_real_run_would_naming_the_frozen_holder_and_signals_nothing(nshost):
    """The v1 freezer keeps SIGKILL pending: the real run would wait its timeouts and fail naming the
    holder frozen, so the dry run fails now with the same words, and nothing is signalled or thawed.
    Before this test, check mode planned a SIGTERM and reported "would free"."""
    host = nshost("h200x1", seed="frozencheck")
    with frozen_holder(host, "suspended-dry", mib=2048) as held:
        run = run_module(host, "gpu_release", FAST, check=True)
        msg = run["msg"]
        assert run.get("failed") and msg.startswith("GPUs are held by processes in a frozen cgroup, which no signal ends before it is thawed"), msg
        assert f"frozen (freezer.state FROZEN in {held.directory}): pid {held.pid} " in msg, msg
        assert "every signal stays pending until its cgroup is thawed, SIGKILL included" in msg, msg
        assert f"`echo THAWED > {held.directory}/freezer.state`; no reboot is needed" in msg, msg
        assert held.state() == "FROZEN" and used(host, 0) >= 2048


def test_kill_false_names_the_holder_it_leaves_frozen_and_her_cgroup_hers(nshost):
    host = nshost("h200x1", seed="frozennokill")
    with frozen_holder(host, "bob-lab", mib=1024, uid=USER, delegated=True) as held:
        run = run_module(host, "gpu_release", dict(FAST, kill=False))
        msg = run["msg"]
        assert run.get("failed") and msg.startswith("GPUs are held by processes that kill=false leaves running"), msg
        assert f"frozen (freezer.state FROZEN in {held.directory}): pid {held.pid} " in msg, msg
        assert f"the cgroup is in uid {USER}'s delegated subtree, frozen by that user: this run does not thaw a user's cgroup" in msg, msg
        assert held.state() == "FROZEN" and "THAWED" not in msg


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_the_dry_runs_frozen_holder_is_said_first_and_once_on_both_paths(nshost, tmp_path, core, python):
    """What the operator reads first of a dry run (--check), through free_gpus.yml and the role in a
    user's own play (the recording callback's task records), on the oldest and newest ansible-core."""
    host = nshost("h200x1", seed="frozenpaths")
    with frozen_holder(host, "suspended-paths", mib=2048) as held:
        assert held.state() == "FROZEN"
        head = "GPUs are held by processes in a frozen cgroup, which no signal ends before it is thawed (waiting would not free them)"
        words = f"frozen (freezer.state FROZEN in {held.directory}): pid {held.pid} "

        row = said_first_by_free_gpus(tmp_path, host, core, python, head, head, flags=("--check",))
        assert words in row and "reboot is needed (" not in row, row
        said_first_in_own_play(tmp_path, host, core, python, head, words, flags=("--check",))
        assert held.state() == "FROZEN" and used(host, 0) >= 2048
