# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_release's words for a process that did not answer the scan (_look/_bounded_reads, issue 57):
it refuses before acting, naming it (tests/integration/test_stalled_fs.py runs it on a real stalled FUSE mount)."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution


def blocked_holder(pid=777):
    return {"pid": pid, "name": "python3", "cmdline": "", "state": "S", "uid": 4242, "user": "4242", "blocked": True, "wchan": None,
            "waits_in": "mm_access", "devices": [], "mapped": None, "protected": False}


def test_gpu_release_refuses_naming_it():
    [record] = _attribution.attribute([blocked_holder(4321)], [], {0: 0, 1: 1})
    message = _release.blocked_message([record], 0, [0, 1], 5)
    assert message.startswith("cannot free GPU 0,1: pid 4321 python3 (uid 4242, state S) did not answer: root's read of its /proc entries "
                              "waited in mm_access; what it holds is unknown")
    assert "Nothing was stopped or signalled" in message and "umount -l" in message
    assert "the scan reached its deadline (5 s, the timeout option) with 3 process(es) not read" in _release.blocked_message([], 3, [0], 5)
    assert "did not answer" in _release.describe_holder(record)


def test_a_zombie_leader_is_described_with_its_running_threads():
    holder = {"pid": 12, "name": "python3", "state": "Z", "threads": 3, "protected": False}
    assert "state Z, zombie leader, 2 threads running" in _release.describe_holder(holder)
