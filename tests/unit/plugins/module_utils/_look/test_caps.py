# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Every list a result carries is capped (issue 66): no tenant sets the size of root's answer."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _caps


def holder(pid, gpus=(), protected=False, attribution="nvml_client", blocked=False):
    return {"pid": pid, "gpu_indexes": list(gpus), "protected": protected, "attribution": attribution, "blocked": blocked}


def test_a_result_keeps_the_most_relevant_entries_of_each_list_and_counts_them_all():
    clients = [holder(pid) for pid in range(1000, 4000)]
    result = {"holders": clients + [holder(7, [0], attribution="listed"), holder(8, blocked=True, attribution="blocked")],
              "killed": [{"pid": n} for n in range(60)], "gpus": [{"index": n} for n in range(64)], "selected_gpus": list(range(64)),
              "shm": {"unheld": [{"path": str(n)} for n in range(70)], "unheld_count": 70}, "released": True}
    capped = _caps.cap_result(result)
    assert [h["pid"] for h in capped["holders"][:2]] == [7, 8] and len(capped["holders"]) == _caps.LIMIT
    assert len(capped["killed"]) == _caps.LIMIT and len(capped["gpus"]) == 64 and len(capped["selected_gpus"]) == 64
    assert capped["truncated"] == {"holders": 3002, "killed": 60, "shm.unheld": 70}
    assert len(result["holders"]) == 3002 and capped["released"] is True


def test_a_result_that_fits_is_left_as_it_is_and_says_so():
    result = {"holders": [holder(9), holder(3, [0], attribution="listed")], "killed": []}
    capped = _caps.cap_result(result)
    assert capped["holders"] == result["holders"] and capped["truncated"] == {}


def test_a_message_names_five_then_counts_the_rest():
    assert _caps.named([f"pid {n}" for n in range(8)]) == "pid 0; pid 1; pid 2; pid 3; pid 4; and 3 more"
    assert _caps.named(["a", "b"], 3, ", ") == "a, b"
