# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_release's words for a process that did not answer the scan (_look/_bounded_reads, issue 57):
it refuses before acting, naming it (tests/integration/test_stalled_fs.py runs it on a real stalled FUSE mount)."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _words as words
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution, _caps


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
    assert "did not answer" in words.describe_holder(record)


def test_a_zombie_leader_is_described_with_its_running_threads():
    holder = {"pid": 12, "name": "python3", "state": "Z", "threads": 3, "protected": False}
    assert "state Z, zombie leader, 2 threads running" in words.describe_holder(holder)


def gpu(index, used):
    return {"index": index, "memory_used_mib": used}


def test_the_verdict_on_a_gpu_comes_from_the_gpu_not_from_what_could_not_be_read():
    """Issue 66: a selected GPU that reads clean with no compute app is free whatever else could
    not be read; one whose memory a process that answered explains is that process's to free; only
    memory nobody readable explains is put down to what could not be read."""
    [blocked] = _attribution.attribute([blocked_holder(4321)], [], {0: 0, 1: 1, 2: 2})
    reader = {"pid": 50, "gpu_indexes": [1], "attribution": "listed"}
    apps = [{"pid": 50, "gpu_index": 1, "alive": True}]
    gpus = [gpu(0, 0), gpu(1, 2048), gpu(2, 512)]
    holders = [blocked, reader]
    assert _attribution.unexplained_by_readers(gpus, apps, holders, [0, 1, 2], 0) == [2]
    assert _attribution.unexplained_by_readers(gpus, apps, holders, [0, 1], 0) == []
    # A listing of a PID that did not answer (or a dead one) explains nothing; neither does an unknown reading.
    listed_blocked = apps + [{"pid": 4321, "gpu_index": 1, "alive": False}]
    assert _attribution.unexplained_by_readers(gpus, listed_blocked, holders, [1], 0) == [1]
    assert _attribution.unexplained_by_readers([gpu(0, None)], [], holders, [0], 0) == [0]
    # At the baseline (MIG) with no compute app: free; the footprint allowance likewise.
    assert _attribution.unexplained_by_readers([gpu(0, 55)], [], holders, [0], 60) == []
    assert _attribution.unexplained_by_readers([gpu(0, 4)], [], holders, [0], 0, footprint={0}) == []


def test_the_message_names_the_gpu_that_holds_unexplained_memory_and_counts_the_rest():
    records = _attribution.attribute([dict(blocked_holder(p), unit="job.service") for p in range(100, 130)], [], {0: 0})
    message = _release.blocked_message(records, 0, [0], 5, [gpu(0, 4096)])
    assert message.count("did not answer: root's read") == _caps.NAMED and "and 25 more that did not answer" in message
    assert ", in unit job.service" in message and "GPU 0 (4096 MiB) holds memory that no process read explains" in message


def refusal(holders, gpus, apps=(), unscanned=()):
    """Release.refuse_blocked on a look's snapshot -> the message it fails with, or None."""
    from types import SimpleNamespace

    from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
    run = SimpleNamespace(options=_options.ReleaseOptions.from_params({"timeout": 5}), result={}, max_used_mib=lambda: 0)
    snapshot = SimpleNamespace(holders=holders, gpus=gpus, apps=list(apps), unscanned=list(unscanned), footprint=set())
    try:
        _release.Release.refuse_blocked(run, snapshot, [g["index"] for g in gpus])
    except StepFailed as exc:
        return exc.msg
    return None


def test_what_could_not_be_read_fails_a_run_only_where_it_may_hold_unexplained_memory():
    """Issue 66, through Release's own refusal: a user's blocked process beside GPUs that read clean
    with no compute app, or another job's (protected) or another guest's beside a dirty GPU, never
    fails this run; a user's beside memory nobody readable holds does, naming it and the GPU."""
    [mine] = _attribution.attribute([blocked_holder(4321)], [], {0: 0, 1: 1})
    [jobs] = _attribution.attribute([dict(blocked_holder(4322), protected=True)], [], {0: 0, 1: 1})
    [guests] = _attribution.attribute([dict(blocked_holder(4323), guest={"kind": "lxd", "name": "g1"})], [], {0: 0, 1: 1})
    assert refusal([mine], [gpu(0, 0), gpu(1, 0)]) is None
    assert refusal([jobs, guests], [gpu(0, 4096), gpu(1, 0)]) is None
    message = refusal([mine, jobs], [gpu(0, 4096), gpu(1, 0)])
    assert message.startswith("cannot free GPU 0,1: pid 4321 python3") and "pid 4322" not in message
    assert "GPU 0 (4096 MiB) holds memory that no process read explains" in message
    assert "3 process(es) not read" in refusal([], [gpu(0, 4096)], unscanned=[1, 2, 3])
    assert refusal([], [gpu(0, 0)], unscanned=[1, 2, 3]) is None
