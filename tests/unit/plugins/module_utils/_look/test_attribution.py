# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Which process uses which GPU: the rule of _attribution, and every reading of the real
2-GPU H200 node (tests/fixtures/h200x2-proc/maps_probe.json) replayed as a /proc tree through
the real scan, the real parsers and the real planner."""

from __future__ import annotations

import re

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _attribution as attribution
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts as facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

READINGS = fakeproc.h200x2_readings()
# GPU 0 is bus 00000000:00:06.0, GPU 1 is 00000000:00:07.0 (README of the readings).
INDEX_OF_BUS = {"00000000:00:06.0": 0, "00000000:00:07.0": 1}
MINOR_TO_INDEX = {0: 0, 1: 1}
GPUS = [{"index": 0, "minor_number": 0}, {"index": 1, "minor_number": 1}]
# The PIDs of the readings' compute apps; processes nvidia-smi did not list get these.
UNLISTED_PIDS = {"child_after": 752, "child_before_parent_death": 752, "dmon": 801, "pynvml": 802}


def apps_of(case):
    """The case's compute-apps rows ("bus, pid, name, MiB") joined as _facts.join_apps does;
    a PID is alive when the case has a process for it."""
    alive = {pid_of(case, name) for name in processes_of(case)}
    rows = []
    for line in READINGS[case].get("apps", []):
        bus, pid, name, mib = [field.strip() for field in line.split(",")]
        rows.append({"pid": int(pid), "name": name, "used_memory_mib": int(mib.split()[0]), "gpu_index": INDEX_OF_BUS[bus],
                     "alive": int(pid) in alive})
    return rows


def processes_of(case):
    return [name for name, value in READINGS[case].items() if isinstance(value, dict) and "fds" in value]


def pid_of(case, name):
    """Listed processes get the PID nvidia-smi listed, in the order of the apps rows."""
    if name in UNLISTED_PIDS:
        return UNLISTED_PIDS[name]
    listed = [int(line.split(",")[1]) for line in READINGS[case].get("apps", [])]
    return listed[processes_of(case).index(name)]


def used_of(case):
    return {int(index): int(mib) for index, mib in (line.split(",") for line in READINGS[case]["used"])}


def replay(tmp_path, case, names=None):
    """The case's processes as a /proc tree -> attributed holders by process name."""
    proc = tmp_path / "proc"
    proc.mkdir(exist_ok=True)
    by_pid = {}
    for name in names or processes_of(case):
        reading = READINGS[case][name]
        fds, maps = fakeproc.expand(reading)
        pid = pid_of(case, name)
        fakeproc.write_process(proc, pid, ppid=reading["ppid"], fds=fds, maps=maps, argv=("python3", name + ".py"))
        by_pid[pid] = name
    scanned = holders.scan_holders(str(proc), with_maps=False)
    attributed = attribution.attribute(scanned, apps_of(case), MINOR_TO_INDEX)
    return {by_pid[h["pid"]]: h for h in attributed}


# ------------------------------------------------------------------ the real readings


@pytest.mark.parametrize(
    "case, name, gpus, why",
    [
        ("two_holders", "gpu0_holder", [0], "listed"),
        ("two_holders", "gpu1_holder", [1], "listed"),
        ("cvd0_holder", "holder", [0], "listed"),
        ("cvd1_holder", "holder", [1], "listed"),
        # The dead parent is listed as [Not Found]; the orphan is placed by its context-sized mapping.
        ("orphan_child_gpu1", "child_after", [1], "mapped"),
        ("monitors", "dmon", [], "nvml_client"),
        ("monitors", "pynvml", [], "nvml_client"),
    ],
)
def test_real_readings_are_attributed_to_the_gpu_really_used(tmp_path, case, name, gpus, why):
    holder = replay(tmp_path, case, [name])[name]
    assert (holder["gpu_indexes"], holder["attribution"], holder["candidate_gpu_indexes"]) == (gpus, why, [])
    # Every one of them has BOTH GPUs' nodes open: the open files alone would blame both GPUs.
    assert {"/dev/nvidia0", "/dev/nvidia1"} <= set(holder["devices"])


@pytest.mark.parametrize("case, name, gpu", [("two_holders", "gpu0_holder", 0), ("two_holders", "gpu1_holder", 1),
                                             ("cvd0_holder", "holder", 0), ("cvd1_holder", "holder", 1),
                                             ("orphan_child_gpu1", "child_before_parent_death", 1)])
def test_unlisted_process_is_placed_by_its_context_sized_mapping_alone(tmp_path, case, name, gpu):
    """The same processes with nvidia-smi's list left out (a forked child is never listed)."""
    reading = READINGS[case][name]
    fds, maps = fakeproc.expand(reading)
    fakeproc.write_process(tmp_path, 900, fds=fds, maps=maps)
    holder = attribution.attribute(holders.scan_holders(str(tmp_path), with_maps=False), [], MINOR_TO_INDEX)[0]
    assert (holder["gpu_indexes"], holder["attribution"]) == ([gpu], "mapped")


# The GPU each CUDA process of the readings had its context on.
CONTEXT_GPU = {("two_holders", "gpu0_holder"): 0, ("two_holders", "gpu1_holder"): 1, ("cvd0_holder", "holder"): 0,
               ("cvd1_holder", "holder"): 1, ("orphan_child_gpu1", "child_before_parent_death"): 1,
               ("orphan_child_gpu1", "child_after"): 1}


def test_every_cuda_process_maps_its_context_gpu_above_and_the_others_below_the_threshold():
    """The threshold sits between what the readings show, with room on both sides."""
    context, other = [], []
    for (case, name), gpu in CONTEXT_GPU.items():
        for path, kib in READINGS[case][name]["map_kib"].items():
            minor = _devices.gpu_minor(path)
            if minor is not None:
                (context if minor == gpu else other).append(kib)
    assert len(context) == 6 and len(other) == 4
    assert min(context) >= 2 * attribution.CONTEXT_MAP_MIN_KIB
    assert max(other) * 8 <= attribution.CONTEXT_MAP_MIN_KIB


@pytest.mark.parametrize("selected, freed", [([1], ["gpu1_holder"]), ([0], ["gpu0_holder"]), ([0, 1], ["gpu0_holder", "gpu1_holder"])])
def test_freeing_one_gpu_signals_only_the_process_on_it(tmp_path, selected, freed):
    """The incident: gpus ["1"] with a trainer on GPU 0 killed the GPU-0 trainer."""
    placed = replay(tmp_path, "two_holders")
    protected = _protect.protect(list(placed.values()), [], set(), [])
    targets, _protected = release.plan_targets(protected, selected, [])
    assert sorted(h["cmdline"].split()[1][:-3] for h in targets) == freed


def test_cuda_visible_devices_process_is_left_alone_when_the_other_gpu_is_freed(tmp_path):
    placed = replay(tmp_path, "cvd0_holder")
    targets, _protected = release.plan_targets(_protect.protect(list(placed.values()), [], set(), []), [1], [])
    assert targets == []


@pytest.mark.parametrize("selected, signalled", [([1], True), ([0], False)])
def test_orphan_is_freed_with_its_gpu_and_left_alone_otherwise(tmp_path, selected, signalled):
    placed = replay(tmp_path, "orphan_child_gpu1", ["child_after"])
    targets, _protected = release.plan_targets(_protect.protect(list(placed.values()), [], set(), []), selected, [])
    assert bool(targets) is signalled


@pytest.mark.parametrize("selected", [[0], [1], [0, 1]])
def test_nvml_monitors_are_never_signalled_and_never_dirty(tmp_path, selected):
    placed = replay(tmp_path, "monitors")
    monitors = _protect.protect(list(placed.values()), [], set(), [])
    assert release.plan_targets(monitors, selected, [])[0] == []
    assert facts.dirty_holders(monitors) == []


def test_monitor_named_by_match_is_signalled(tmp_path):
    placed = replay(tmp_path, "monitors")
    targets, _protected = release.plan_targets(_protect.protect(list(placed.values()), [], set(), []), [0], [re.compile("dmon")])
    assert [h["pid"] for h in targets] == [UNLISTED_PIDS["dmon"]]


# ------------------------------------------------------------------ the cross-GPU footprint


def footprint_of(tmp_path, case, names=None, max_used_mib=0, footprint_mib=attribution.CROSS_GPU_FOOTPRINT_MIB):
    placed = replay(tmp_path, case, names)
    gpus = [dict(gpu, memory_used_mib=used_of(case)[gpu["index"]]) for gpu in GPUS]
    return attribution.footprint_gpus(gpus, list(placed.values()), apps_of(case), max_used_mib, footprint_mib)


def test_gpu_next_to_the_orphan_reads_the_footprint_and_is_free(tmp_path):
    """Measured: the orphaned child of a GPU-1 owner puts 4 MiB on GPU 0 (no app on GPU 0)."""
    assert used_of("orphan_child_gpu1")[0] == attribution.CROSS_GPU_FOOTPRINT_MIB
    assert footprint_of(tmp_path, "orphan_child_gpu1", ["child_after"]) == {0}


def test_footprint_allowance_is_explicit(tmp_path):
    assert footprint_of(tmp_path, "orphan_child_gpu1", ["child_after"], footprint_mib=0) == set()
    assert footprint_of(tmp_path, "orphan_child_gpu1", ["child_after"], footprint_mib=3) == set()


def test_gpus_with_their_own_context_never_count_as_footprint(tmp_path):
    assert footprint_of(tmp_path, "two_holders") == set()


@pytest.mark.parametrize(
    "used, apps, users, expected",
    [
        ({0: 2575, 1: 4}, [0], [], {1}),
        ({0: 2575, 1: 5}, [0], [], set()),  # more than the footprint: something holds it
        ({0: 2575, 1: 4}, [], [], set()),  # no context anywhere: 4 MiB is unexplained
        ({0: 2575, 1: 4}, [0], [1], set()),  # a process uses GPU 1 itself
        ({0: 2575, 1: None}, [0], [], set()),  # unknown memory is never clean
        ({0: 2575, 1: 0}, [0], [], set()),  # already clean: nothing to allow
    ],
    ids=["footprint", "above", "no-context-elsewhere", "own-user", "unknown", "already-clean"],
)
def test_footprint_rule(used, apps, users, expected):
    gpus = [{"index": i, "memory_used_mib": mib} for i, mib in used.items()]
    app_rows = [{"pid": 10 + i, "gpu_index": i, "alive": True} for i in apps]
    users = [{"pid": 20 + i, "gpu_indexes": [i], "attribution": "mapped"} for i in users]
    assert attribution.footprint_gpus(gpus, users, app_rows, 0) == expected


def test_footprint_stacks_on_a_baseline():
    gpus = [{"index": 0, "memory_used_mib": 2630}, {"index": 1, "memory_used_mib": 59}]
    assert attribution.footprint_gpus(gpus, [], [{"pid": 1, "gpu_index": 0, "alive": True}], 55) == {1}


# ------------------------------------------------------------------ the rule, one process at a time


@pytest.mark.parametrize(
    "listed, mapped_kib, open_gpus, expected",
    [
        ({3}, {3: 2176, 0: 128}, {0, 3}, ([3], "listed", [])),
        ({0, 1}, {0: 2176, 1: 2176}, {0, 1}, ([0, 1], "listed", [])),
        # Listed on GPU 1, context-sized on GPU 0 only: the PID a dead GPU-1 owner left to nvidia-smi's list,
        # reused by a GPU-0 trainer (issue 19). The listing on a GPU it maps only as a peer moves nothing.
        ({0, 1}, {0: 2176, 1: 128}, {0, 1}, ([0], "listed", [])),
        ({1}, {0: 2176, 1: 128}, {0, 1}, ([0], "mapped", [])),
        ({2}, {0: 2176}, {0}, ([0], "mapped", [])),  # listed on a GPU whose device it does not hold
        ({2}, {}, set(), ([], "nvml_client", [])),
        ({1}, None, {0, 1}, ([1], "listed", [])),  # maps unreadable: the listing of a held device counts
        ({1}, None, {0}, ([], "undecided", [0])),
        ({1}, {0: 512, 1: 512}, {0, 1}, ([1], "listed", [])),  # no context-sized mapping (another driver): held is enough
        (None, {1: 2176, 0: 128}, {0, 1}, ([1], "mapped", [])),
        (None, {0: 2176, 1: 2176}, {0, 1}, ([0, 1], "mapped", [])),  # an orphan of a process that used two GPUs
        (None, {0: 128, 1: 128}, {0, 1}, ([], "undecided", [0, 1])),
        (None, None, {0, 1}, ([], "undecided", [0, 1])),  # maps unreadable
        (None, {}, {0, 1}, ([], "nvml_client", [])),
        (None, {}, set(), ([], "nvml_client", [])),  # control nodes only
        (None, None, set(), ([], "nvml_client", [])),
    ],
    ids=["listed", "listed-two-gpus", "reused-pid-listed-on-its-gpu-and-a-peer", "reused-pid-listed-on-a-peer-only",
         "listed-without-the-device", "listed-holding-nothing", "listed-maps-unreadable", "listed-other-gpu-maps-unreadable",
         "listed-unmeasured-mapping-sizes", "mapped", "mapped-two", "undecided-small-maps", "undecided-unreadable",
         "nvml-client", "control-only", "control-only-unreadable"],
)
def test_place(listed, mapped_kib, open_gpus, expected):
    assert attribution.place(listed, mapped_kib, open_gpus) == expected


@pytest.mark.parametrize("selected, signalled", [([0], False), ([1], False), ([0, 1], True)])
def test_undecided_process_is_signalled_only_when_every_gpu_it_may_use_is_selected(selected, signalled):
    holder = {"pid": 5, "gpu_indexes": [], "attribution": "undecided", "candidate_gpu_indexes": [0, 1], "protected": False}
    assert attribution.may_signal_for(holder, selected) is signalled
    assert bool(attribution.undecided_for([holder], selected)) is not signalled


@pytest.mark.parametrize(
    "attribution_, gpus, selected, kill_spanning, signalled, outside",
    [
        ("listed", [0], [0], False, True, []),
        ("listed", [0], [1], False, False, []),  # uses only an unselected GPU: not ours
        ("listed", [0, 1], [1], False, False, [0]),  # spans: JAX on every visible GPU
        ("listed", [0, 1], [1], True, True, [0]),  # kill_spanning ends it anyway
        ("listed", [0, 1], [0, 1], False, True, []),  # every GPU it uses is selected
        ("listed", [0, 1, 2, 3], [1, 2], False, False, [0, 3]),
        ("mapped", [0, 1], [0], False, False, [1]),  # context-sized maps on both
        ("mapped", [1], [1], False, True, []),
        ("nvml_client", [], [0, 1], False, False, []),
        ("nvml_client", [], [0], True, False, []),
    ],
    ids=["one-gpu-selected", "other-gpu", "spans", "spans-kill-spanning", "spans-all-selected", "spans-two-outside", "mapped-spans",
         "mapped-one", "nvml-client", "nvml-client-kill-spanning"],
)
def test_spanning_holder_is_signalled_only_for_every_gpu_it_uses_or_with_kill_spanning(
        attribution_, gpus, selected, kill_spanning, signalled, outside):
    holder = {"pid": 5, "gpu_indexes": gpus, "attribution": attribution_, "candidate_gpu_indexes": [], "protected": False}
    assert attribution.may_signal_for(holder, selected, kill_spanning) is signalled
    assert attribution.outside_gpus(holder, selected) == outside
    assert attribution.spanning_for([holder], selected) == ([holder] if outside else [])


def test_undecided_holder_never_spans_it_is_reported_as_undecided():
    holder = {"pid": 5, "gpu_indexes": [], "attribution": "undecided", "candidate_gpu_indexes": [0, 1], "protected": False}
    assert attribution.spanning_for([holder], [1]) == [] and attribution.may_signal_for(holder, [1], kill_spanning=True) is False


def test_dead_owner_lists_nobody():
    apps = [{"pid": 751, "gpu_index": 1, "alive": False}, {"pid": 576, "gpu_index": 0, "alive": True}]
    assert attribution.listed_gpus(apps) == {576: {0}}


def test_listing_is_asked_for_only_when_it_can_change_the_answer():
    monitor = {"mapped": {"/dev/nvidiactl": {"count": 2, "kib": 8}}}
    trainer = {"mapped": {"/dev/nvidia0": {"count": 3, "kib": 2176}}}
    assert not attribution.needs_listing([monitor, {"mapped": {}}])
    assert attribution.needs_listing([monitor, trainer])
    assert attribution.needs_listing([{"mapped": None}])


def test_gpu_of_a_minor_that_differs_from_its_index():
    record = {"pid": 7, "devices": ["/dev/nvidia0", "/dev/nvidia1"],
              "mapped": {"/dev/nvidia0": {"count": 3, "kib": 2176}, "/dev/nvidia1": {"count": 2, "kib": 128}}}
    assert attribution.attribute([record], [], {1: 0, 0: 1})[0]["gpu_indexes"] == [1]
