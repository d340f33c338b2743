# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Every list a result carries, capped: no tenant sets the size of root's answer (issue 66).

A user decides how many processes hold a device file (an NVML client is one), how many files
/dev/shm holds, how many processes stop answering. One record each made a 28 MB result of 300,000
empty files in /dev/shm, and audit_gpus.yml gathers every host at once. So a result keeps the
first LIMIT entries of each list, most relevant first (holders: those that use a GPU and are not
protected, then those that may, then the rest; /dev/shm's files: the largest), and says what it
left out in `truncated` ({list: how many there were}); a message names at most NAMED things, then
"and N more". Totals (MiB, counts) are computed over the whole list before it is cut."""

from __future__ import annotations

import typing as t

# Entries a list of a result keeps (a holder record is ~0.6 KB: 50 of each list keep a result of
# an 8-GPU node well under 256 KB).
LIMIT = 50
# Things a message names before "and N more".
NAMED = 5
# Lists whose length the node's hardware sets, never a tenant: kept whole.
WHOLE = frozenset(("gpus", "gpus_before", "selected_gpus", "not_visible"))


def named(texts: t.Sequence[str], limit: int = NAMED, joiner: str = "; ") -> str:
    """The first `limit` texts joined, then "and N more" for the rest."""
    shown = joiner.join(texts[:limit])
    if len(texts) > limit:
        shown += f"{joiner}and {len(texts) - limit:d} more"
    return shown


def holder_rank(holder: t.Mapping[str, t.Any]) -> int:
    """0: uses a GPU and is not protected (what a run frees); 1: may use one (blocked, undecided);
    2: protected on a GPU; 3: the rest (NVML clients)."""
    uses = bool(holder.get("gpu_indexes"))
    if uses and not holder.get("protected"):
        return 0
    if holder.get("blocked") or holder.get("attribution") in ("blocked", "undecided"):
        return 1
    return 2 if uses else 3


def cap_list(items: list[t.Any], limit: int = LIMIT) -> tuple[list[t.Any], int | None]:
    """(the first `limit` items, how many there were when some were left out, else None)."""
    if len(items) <= limit:
        return items, None
    return items[:limit], len(items)


def cap_result(result: dict[str, t.Any], limit: int = LIMIT) -> dict[str, t.Any]:
    """A copy of a result (gpu_release's, or gpu_facts' `gpu` fact) with each list capped, the
    holders most relevant first, /dev/shm's unheld files too (shm.unheld), and `truncated` added:
    {list: how many there were} for each list cut ({} when none was)."""
    out = dict(result)
    truncated: dict[str, int] = dict(out.get("truncated") or {})
    if isinstance(out.get("holders"), list) and len(out["holders"]) > limit:
        # Cut most relevant first (a stable sort: the PID order within a rank); a list that fits keeps its order.
        out["holders"] = sorted(out["holders"], key=holder_rank)
    for key, value in result.items():
        if key in WHOLE or not isinstance(value, list):
            continue
        kept, count = cap_list(out[key], limit)
        if count is not None:
            out[key], truncated[key] = kept, count
    shm = out.get("shm")
    if isinstance(shm, dict) and isinstance(shm.get("unheld"), list):
        kept, count = cap_list(shm["unheld"], limit)
        if count is not None:
            out["shm"] = dict(shm, unheld=kept)
            truncated["shm.unheld"] = count
    out["truncated"] = truncated
    return out
