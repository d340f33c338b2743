# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_frozen: a holder's frozen cgroup from /proc/PID/cgroup and the freezer's state, and who thaws it."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _frozen

HYBRID = "9:name=systemd:/\n6:freezer:/suspended-job\n4:memory:/x\n0::/user.slice\n"


def test_the_v2_and_v1_freezer_paths_are_read_from_proc_pid_cgroup():
    assert _frozen.cgroup_paths(HYBRID) == ("/user.slice", "/suspended-job")
    assert _frozen.cgroup_paths("0::/system.slice/a.service\n") == ("/system.slice/a.service", None)
    assert _frozen.cgroup_paths(None) == (None, None)


def test_a_v1_frozen_holder_is_found_with_its_owner(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "freezer"
    (proc / "self").mkdir(parents=True)
    (proc / "812").mkdir()
    (proc / "812" / "cgroup").write_text(HYBRID)
    (proc / "self" / "mountinfo").write_text(f"40 30 0:35 / {cg} rw,relatime shared:15 - cgroup cgroup rw,freezer\n")
    (cg / "suspended-job").mkdir(parents=True)
    (cg / "suspended-job" / "freezer.state").write_text("FROZEN\n")
    found = _frozen.frozen_of(812, str(proc))
    assert found is not None and found.directory == f"{cg}/suspended-job" and found.reading == "freezer.state FROZEN"
    (cg / "suspended-job" / "freezer.state").write_text("THAWED\n")
    assert _frozen.frozen_of(812, str(proc)) is None


def test_the_advice_names_the_runtime_the_user_or_roots_thaw_and_never_a_reboot():
    root = _frozen.Frozen("/sys/fs/cgroup/freezer/job", "freezer.state FROZEN", 0)
    user = root._replace(owner=4242)
    assert "`docker unpause vllm`" in _frozen.advice("pid 1 x", root, "docker", "vllm")
    assert "uid 4242's delegated subtree" in _frozen.advice("pid 1 x", user) and "THAWED" not in _frozen.advice("pid 1 x", user)
    assert "`echo THAWED > /sys/fs/cgroup/freezer/job/freezer.state`" in _frozen.advice("pid 1 x", root)
    v2 = _frozen.Frozen("/sys/fs/cgroup/job", "cgroup.events frozen 1", 0)
    assert "`echo 0 > /sys/fs/cgroup/job/cgroup.freeze`" in _frozen.advice("pid 1 x", v2)
    assert all("a reboot is needed" not in _frozen.advice("pid 1 x", f) for f in (root, user, v2))


def test_a_holder_not_signalled_is_told_what_a_signal_meets_and_who_thaws_it():
    root = _frozen.Frozen("/sys/fs/cgroup/freezer/job", "freezer.state FROZEN", 0)
    v2 = _frozen.Frozen("/sys/fs/cgroup/job", "cgroup.events frozen 1", 0)
    said = _frozen.not_signalled("pid 1 x", root)
    assert said == ("frozen (freezer.state FROZEN in /sys/fs/cgroup/freezer/job): pid 1 x, every signal stays pending until its "
                    "cgroup is thawed, SIGKILL included; whoever froze it (a scheduler's suspend, a paused container) thaws it, or root: "
                    "`echo THAWED > /sys/fs/cgroup/freezer/job/freezer.state`; no reboot is needed")
    assert _frozen.keeps_sigkill_pending(root) and not _frozen.keeps_sigkill_pending(v2)
    assert "only SIGKILL reaches it before" in _frozen.not_signalled("pid 1 x", v2) and "THAWED" not in _frozen.not_signalled("pid 1 x", v2)
    assert "uid 4242's delegated subtree" in _frozen.not_signalled("pid 1 x", root._replace(owner=4242))
