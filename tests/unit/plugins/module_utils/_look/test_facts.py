# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_facts: nvidia-smi records + /proc holders -> ansible_facts.gpu, and when a host is clean."""

from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts as facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

BUSES = [
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
    "00000000:9A:00.0",
    "00000000:AB:00.0",
    "00000000:BA:00.0",
    "00000000:DB:00.0",
]


def uuid(index):
    return f"GPU-{0xAB0CF4F6 + index:08x}-818d-be7e-f16b-963690d7c5c{index:d}"


def h200_row(index, used=0, **overrides):
    """One GPU as parse_gpus returns it (H200, driver 580.159.04)."""
    free = "[N/A]" if used == "[N/A]" else 143771 - 616 - used
    text = f"{index:d}, {uuid(index)}, NVIDIA H200, {BUSES[index]}, 580.159.04, 143771, 616, {used}, {free}, 0, 37, 126.02, Enabled, Disabled"
    (record,) = smi.parse_gpus(text)
    record.update(overrides)
    return record


def h200_host(used=None, count=8):
    used = used or {}
    return facts.with_minor_numbers([h200_row(i, used.get(i, 0)) for i in range(count)], {})


def holder(pid, gpu_indexes, protected=False, devices=None, name="python3", unit=None):
    devices = devices if devices is not None else [f"/dev/nvidia{i:d}" for i in gpu_indexes] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    return {
        "pid": pid,
        "ppid": 1,
        "name": name,
        "cmdline": f"{name} train.py",
        "user": "root",
        "state": "S",
        "start_time": 5000 + pid,
        "devices": devices,
        "gpu_indexes": gpu_indexes,
        "unit": unit,
        "container": None,
        "protected": protected,
        # internal keys that must not leak into the facts
        "exe": "python3.12",
        "argv0": name,
        "cgroup": "/",
        "system_service": False,
        "protected_reason": "protect" if protected else None,
    }


# ------------------------------------------------------------------ assemble


def test_clean_8_gpu_h200_reads_clean():
    gpu = facts.assemble(facts.Findings(gpus=h200_host(), max_used_mib=0, with_processes=True, cuda_version="13.0"))
    assert (gpu["clean"], gpu["count"], gpu["memory_used_mib"], gpu["driver_version"], gpu["cuda_version"], gpu["error"]) == (
        True,
        8,
        0,
        "580.159.04",
        "13.0",
        None,
    )
    assert [g["index"] for g in gpu["gpus"]] == list(range(8)) and all(g["clean"] for g in gpu["gpus"])
    assert set(gpu["gpus"][0]) == set(facts.GPU_KEYS)
    assert gpu["gpus"][0]["memory_reserved_mib"] == 616 and gpu["gpus"][0]["minor_number"] == 0


def test_dirty_host_names_the_dirty_gpu():
    gpus = h200_host({3: 10267})
    apps = facts.join_apps([{"pid": 426, "name": "python3", "used_memory_mib": 6662, "gpu_uuid": uuid(3)}], gpus, lambda pid: True)
    gpu = facts.assemble(facts.Findings(gpus=gpus, apps=apps, holders=[holder(426, [3])], max_used_mib=0, with_processes=True))
    assert (gpu["clean"], gpu["memory_used_mib"]) == (False, 10267)
    assert [g["index"] for g in gpu["gpus"] if not g["clean"]] == [3]
    assert gpu["processes"] == [{"pid": 426, "name": "python3", "used_memory_mib": 6662, "gpu_uuid": uuid(3), "gpu_index": 3, "alive": True}]
    assert gpu["holders"][0]["gpu_indexes"] == [3]


def test_holders_and_gpus_carry_only_the_documented_keys():
    gpu = facts.assemble(facts.Findings(gpus=h200_host(), holders=[holder(426, [3])], max_used_mib=0, with_processes=True))
    assert set(gpu["holders"][0]) == set(facts.HOLDER_KEYS)
    assert "exe" not in gpu["holders"][0] and "_unavailable" not in gpu["gpus"][0] and "driver_version" not in gpu["gpus"][0]


@pytest.mark.parametrize("limit", [0, 10**9], ids=["strict", "any-baseline"])
def test_wddm_memory_na_is_never_clean(limit):
    gpus = facts.with_minor_numbers([h200_row(0, "[N/A]")], {})
    assert gpus[0]["memory_used_mib"] is None and gpus[0]["_unavailable"]["memory_used_mib"] == "[N/A]"
    gpu = facts.assemble(facts.Findings(gpus=gpus, max_used_mib=limit, with_processes=True))
    assert (gpu["clean"], gpu["memory_used_mib"], gpu["gpus"][0]["clean"], gpu["gpus"][0]["memory_used_mib"]) == (False, None, False, None)


def test_one_unknown_gpu_makes_the_memory_sum_unknown_not_smaller():
    gpus = facts.with_minor_numbers([h200_row(0, 500), h200_row(1, "[N/A]")], {})
    assert facts.assemble(facts.Findings(gpus=gpus, max_used_mib=10**9, with_processes=True))["memory_used_mib"] is None


@pytest.mark.parametrize(
    "used, limit, clean",
    [(59, 64, True), (64, 64, True), (65, 64, False), (1, 0, False)],
    ids=["mig-idle-under-baseline", "at-baseline", "over-baseline", "one-mib-is-dirty"],
)
def test_max_used_mib_is_the_baseline(used, limit, clean):
    assert facts.assemble(facts.Findings(gpus=h200_host({0: used}, count=1), max_used_mib=limit, with_processes=True))["clean"] is clean


def test_processes_false_decides_by_memory_alone():
    gpu = facts.assemble(facts.Findings(gpus=h200_host(), apps=[{"pid": 1}], holders=[holder(426, [3])], max_used_mib=0, with_processes=False))
    assert (gpu["clean"], gpu["processes"], gpu["holders"]) == (True, [], [])


def test_live_unprotected_holder_makes_a_zero_mib_host_dirty():
    # A fork child with device files open but no context yet reads 0 MiB: still not clean.
    assert facts.assemble(facts.Findings(gpus=h200_host(), holders=[holder(495, [0])], max_used_mib=0, with_processes=True))["clean"] is False


def test_protected_holder_with_all_device_files_does_not_make_host_dirty():
    persistenced = holder(812, list(range(8)), protected=True, name="nvidia-persiste")
    gpu = facts.assemble(facts.Findings(gpus=h200_host(), holders=[persistenced], max_used_mib=0, with_processes=True))
    assert gpu["clean"] is True and gpu["holders"][0]["protected"] is True


def test_control_node_only_holder_does_not_make_host_dirty():
    dcgm = holder(900, [], devices=["/dev/nvidiactl", "/dev/nvidia-caps/nvidia-cap1"], name="dcgm-exporter")
    nvml_client = holder(901, [], devices=["/dev/nvidiactl"], name="node_exporter")
    gpu = facts.assemble(facts.Findings(gpus=h200_host(), holders=[dcgm, nvml_client], max_used_mib=0, with_processes=True))
    assert gpu["clean"] is True and [h["gpu_indexes"] for h in gpu["holders"]] == [[], []]


def test_dirty_holders_of_selected_gpus_only():
    hs = [holder(1, [0]), holder(2, [1]), holder(3, [0, 1], protected=True), holder(4, [])]
    assert [h["pid"] for h in facts.dirty_holders(hs)] == [1, 2]
    assert [h["pid"] for h in facts.dirty_holders(hs, selected=[1])] == [2]


def test_host_without_gpus_is_not_clean():
    gpu = facts.assemble(facts.Findings(gpus=[], max_used_mib=0, with_processes=True))
    assert (gpu["clean"], gpu["count"], gpu["driver_version"], gpu["memory_used_mib"]) == (False, 0, None, 0)


def test_failed_facts_shape():
    assert facts.failed_facts("nvidia-smi timed out after 10 s") == {
        "driver_version": None,
        "cuda_version": None,
        "count": 0,
        "clean": False,
        "memory_used_mib": None,
        "error": "nvidia-smi timed out after 10 s",
        "not_visible": [],
        "given_to_vms": [],
        "inside_container": None,
        "minor_order_differs": None,
        "gpus": [],
        "processes": [],
        "holders": [],
        "healthy": False,
        "health_checked": False,
        "health_issues": ["nvidia-smi timed out after 10 s"],
        "health": None,
    }


# ------------------------------------------------------------------ joins and minor numbers


def test_join_apps_by_uuid_not_by_position():
    gpus = h200_host(count=2)
    apps = [
        {"pid": 11, "name": "python3", "used_memory_mib": 100, "gpu_uuid": uuid(1)},
        {"pid": 12, "name": "[Not Found]", "used_memory_mib": 3590, "gpu_uuid": uuid(0)},
        {"pid": 13, "name": "python3", "used_memory_mib": None, "gpu_uuid": "GPU-not-on-this-host"},
    ]
    joined = facts.join_apps(apps, gpus, lambda pid: pid != 12)
    assert [(a["pid"], a["gpu_index"], a["alive"], a["used_memory_mib"]) for a in joined] == [(11, 1, True, 100), (12, 0, False, 3590), (13, None, True, None)]


def test_mig_apps_join_to_the_parent_gpu():
    # With MIG on, compute apps report the parent GPU's UUID.
    gpus = [h200_row(0, 59, mig_mode="Enabled")]
    (app,) = facts.join_apps(
        [{"pid": 7, "name": "python3", "used_memory_mib": 4000, "gpu_uuid": uuid(0)}], facts.with_minor_numbers(gpus, {}), lambda pid: True
    )
    assert app["gpu_index"] == 0


def test_with_minor_numbers_from_the_driver_and_fallback_to_index():
    gpus = [h200_row(0), h200_row(1), h200_row(2)]
    minors = {"0000:18:00.0": 1, "0000:2a:00.0": 0}  # GPU 2 missing from /proc/driver/nvidia
    result = facts.with_minor_numbers(gpus, minors)
    assert [(g["index"], g["minor_number"]) for g in result] == [(0, 1), (1, 0), (2, 2)]
    assert "minor_number" not in gpus[0], "with_minor_numbers must not change its input"
    assert facts.minor_to_index(result) == {1: 0, 0: 1, 2: 2}


def test_minor_order_differs_only_by_the_drivers_word():
    """A node whose /dev/nvidia0 is not nvidia-smi's GPU 0 (Slurm's File= order is then not
    nvidia-smi's): said; the same order: not; a GPU without the driver's minor: unknown, never false."""
    gpus = [h200_row(0), h200_row(1), h200_row(2)]
    assert facts.minor_order_differs(gpus, {"0000:18:00.0": 1, "0000:2a:00.0": 0, "0000:3a:00.0": 2}) is True
    assert facts.minor_order_differs(gpus, {"0000:18:00.0": 0, "0000:2a:00.0": 1, "0000:3a:00.0": 2}) is False
    # A container given GPUs 2 and 3 of the host: their minors keep nvidia-smi's order.
    assert facts.minor_order_differs(gpus[:2], {"0000:18:00.0": 2, "0000:2a:00.0": 3}) is False
    assert facts.minor_order_differs(gpus, {"0000:18:00.0": 1, "0000:2a:00.0": 0}) is None
    assert facts.minor_order_differs([], {}) is None


def test_without_driver_proc_files_minor_is_the_index():
    assert [g["minor_number"] for g in facts.with_minor_numbers([h200_row(i) for i in range(4)], {})] == [0, 1, 2, 3]


def test_cuda_version_without_libcuda_is_none():
    assert facts.cuda_driver_version("libcuda-that-does-not-exist.so.1") is None


# ------------------------------------------------------------------ look() on a fake node


class CannedSmi:
    def __init__(self, gpus, apps):
        self.gpus, self.apps, self.calls = gpus, apps, []

    def query_all(self, fields=smi.GPU_FIELDS, with_apps=True, meanwhile=None):
        self.calls.append(with_apps)
        if meanwhile is not None:
            meanwhile()
        return [dict(g) for g in self.gpus], ([dict(a) for a in self.apps] if with_apps else [])


@pytest.fixture
def node(tmp_path, monkeypatch):
    # look() protects its own PID and its ancestors: the test runner's real PID, looked up in
    # this fake /proc, must not be one of the fake processes (a runner that happened to be PID
    # 426 saw the fake trainer protected once). PID 1 is never a fake process here.
    monkeypatch.setattr(facts.os, "getpid", lambda: 1)
    proc, driver = tmp_path / "proc", tmp_path / "driver"
    proc.mkdir()
    # GPU index 0 is /dev/nvidia1 and index 1 is /dev/nvidia0 on this node.
    for bus, minor in (("0000:18:00.0", 1), ("0000:2a:00.0", 0)):
        (driver / bus).mkdir(parents=True)
        (driver / bus / "information").write_text(f"Bus Location: \t {bus}\nDevice Minor: \t {minor:d}\n")
    fds, maps = fakeproc.cuda_process(1, [1, 0])  # its context on /dev/nvidia1, GPU index 0
    fakeproc.write_process(proc, 426, fds=fds, maps=maps, start_time=7000)
    fakeproc.write_process(
        proc,
        812,
        comm="nvidia-persiste",
        exe="/usr/bin/nvidia-persistenced",
        argv=("/usr/bin/nvidia-persistenced", "--user", "nvidia-persistenced"),
        fds=("/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"),
    )
    gpus = [h200_row(0, 6662), h200_row(1, 0)]
    apps = [
        {"pid": 426, "name": "python3", "used_memory_mib": 6662, "gpu_uuid": uuid(0)},
        {"pid": 427, "name": "[Not Found]", "used_memory_mib": 3590, "gpu_uuid": uuid(0)},
    ]
    return proc, driver, CannedSmi(gpus, apps)


def test_look_attributes_holders_by_minor_number(node):
    proc, driver, canned = node
    snapshot = facts.look(canned, protect=[], proc=str(proc), driver_root=str(driver))
    assert [(g["index"], g["minor_number"]) for g in snapshot.gpus] == [(0, 1), (1, 0)]
    by_pid = {h["pid"]: h for h in snapshot.holders}
    assert (by_pid[426]["gpu_indexes"], by_pid[426]["attribution"], by_pid[426]["protected"]) == ([0], "listed", False)
    # nvidia-persistenced opens every GPU's node and maps none: an NVML client, using no GPU.
    assert (by_pid[812]["gpu_indexes"], by_pid[812]["attribution"], by_pid[812]["protected"]) == ([], "nvml_client", True)
    assert [(a["pid"], a["gpu_index"], a["alive"]) for a in snapshot.apps] == [(426, 0, True), (427, 0, False)]


def test_look_with_user_protect_by_pid(node):
    proc, driver, canned = node
    snapshot = facts.look(canned, protect=["426"], proc=str(proc), driver_root=str(driver))
    assert all(h["protected"] for h in snapshot.holders)


def test_look_without_processes_scans_nothing(node):
    proc, driver, canned = node
    snapshot = facts.look(canned, protect=[], with_processes=False, proc=str(proc), driver_root=str(driver))
    assert (snapshot.apps, snapshot.holders, canned.calls) == ([], [], [False])
    assert [g["minor_number"] for g in snapshot.gpus] == [1, 0]


class ReleaseLikeSmi(CannedSmi):
    """gpu_release's way: GPUs first, the compute apps started apart (start/finish); every step
    in `events`, so that a test sees what ran while the GPU query was out."""

    def __init__(self, gpus, apps, pids=()):
        super().__init__(gpus, apps)
        self.events, self.pids = [], set(pids)

    def query_all(self, fields=smi.GPU_FIELDS, with_apps=True, meanwhile=None):
        assert not with_apps
        self.events.append("gpu query out")
        if meanwhile is not None:
            meanwhile()
        self.events.append("gpu query answered")
        return [dict(g) for g in self.gpus], []

    def app_args(self):
        return smi.NvidiaSmi.app_args()

    def start(self, args):
        self.events.append("apps started")
        return args

    def finish(self, started):
        self.events.append("apps read")
        return "".join(f"{a['pid']}, {a['gpu_uuid']}, {a['used_memory_mib']}\n" for a in self.apps)

    def abandon(self, started):
        self.events.append("apps abandoned")


def _own_nvidia_smi(proc, pid=950):
    """nvidia-smi while it answers: /dev/nvidiactl and every GPU node open, none mapped (NVML)."""
    fakeproc.write_process(proc, pid, comm="nvidia-smi", exe="/usr/bin/nvidia-smi", argv=("nvidia-smi", "--query-gpu=index"),
                           fds=("/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"), start_time=9500)


def test_the_device_pass_runs_while_nvidia_smi_answers_and_starts_the_apps_call_at_once(node):
    """A process maps a GPU: the compute-apps call and while_waiting (gpu_release loads its
    freeing code there) start before the GPU query is back, not after it."""
    proc, driver, canned = node
    worker = ReleaseLikeSmi(canned.gpus, canned.apps)
    seen = []
    snapshot = facts.look(worker, protect=[], proc=str(proc), driver_root=str(driver), with_apps=False,
                          while_waiting=lambda raw: (seen.extend(sorted(h["pid"] for h in raw)), worker.events.append("while_waiting")))
    assert worker.events == ["gpu query out", "apps started", "while_waiting", "gpu query answered", "apps read"]
    assert seen == [426, 812] and 426 in {h["pid"] for h in snapshot.holders}


def test_a_clean_node_starts_no_apps_call_and_runs_no_while_waiting(node):
    """Only NVML clients about (nvidia-persistenced) and clean GPUs: one nvidia-smi call."""
    proc, driver, canned = node
    (proc / "426").rename(proc / "gone-426")
    worker = ReleaseLikeSmi([h200_row(0, 0), h200_row(1, 0)], [])
    called = []
    facts.look(worker, protect=[], proc=str(proc), driver_root=str(driver), with_apps=False, while_waiting=called.append)
    assert (worker.events, called) == (["gpu query out", "gpu query answered"], [])


def test_the_modules_own_nvidia_smi_holding_the_nodes_is_no_holder(node):
    """The pass runs while nvidia-smi holds the device files: the calls this module started
    (smi.pids) are left out; a nvidia-smi it did not start (a user's `watch nvidia-smi`) is not."""
    proc, driver, canned = node
    _own_nvidia_smi(proc)
    ours = facts.look(ReleaseLikeSmi(canned.gpus, canned.apps, pids={950}), protect=[], proc=str(proc), driver_root=str(driver), with_apps=False)
    assert 950 not in {h["pid"] for h in ours.holders}
    theirs = facts.look(ReleaseLikeSmi(canned.gpus, canned.apps), protect=[], proc=str(proc), driver_root=str(driver), with_apps=False)
    assert {h["pid"]: h["attribution"] for h in theirs.holders}[950] == "nvml_client"


def test_a_failed_gpu_query_abandons_the_apps_call_started_meanwhile(node):
    proc, driver, canned = node

    class Lost(ReleaseLikeSmi):
        def query_all(self, fields=smi.GPU_FIELDS, with_apps=True, meanwhile=None):
            meanwhile()
            raise smi.NvidiaSmiError("Unable to determine the device handle for GPU0000:18:00.0: GPU is lost", cmd=["nvidia-smi"], rc=15)

    worker = Lost(canned.gpus, canned.apps)
    with pytest.raises(smi.NvidiaSmiError):
        facts.look(worker, protect=[], proc=str(proc), driver_root=str(driver), with_apps=False)
    assert worker.events == ["apps started", "apps abandoned"]


def _mapping_only_process(proc, pid, minor):
    """A process that mapped a GPU's device file with a context-sized mapping, then closed every
    device file: only a scan of /proc/PID/maps finds it."""
    fakeproc.write_process(proc, pid, maps=((f"/dev/nvidia{minor:d}", 2176),), start_time=9000)


def test_busy_gpu_explained_by_its_listed_live_holder_does_not_read_other_maps(node):
    proc, driver, canned = node
    canned.apps = canned.apps[:1]  # 426 listed and alive on GPU 0: it explains GPU 0
    _mapping_only_process(proc, 900, 0)  # maps GPU index 1's node, which reads 0 MiB
    snapshot = facts.look(canned, protect=[], proc=str(proc), driver_root=str(driver))
    assert 900 not in {h["pid"] for h in snapshot.holders}


def test_dirty_gpu_with_a_dead_owner_reads_every_maps_and_finds_the_mapping_only_holder(node):
    proc, driver, canned = node
    _mapping_only_process(proc, 900, 1)  # index 0 is /dev/nvidia1; 427 ([Not Found]) is listed there
    snapshot = facts.look(canned, protect=[], proc=str(proc), driver_root=str(driver))
    by_pid = {h["pid"]: h for h in snapshot.holders}
    assert (by_pid[900]["gpu_indexes"], by_pid[900]["attribution"]) == ([0], "mapped")


def test_dirty_gpu_without_any_listed_app_reads_every_maps(node):
    proc, driver, canned = node
    canned.gpus = [h200_row(0, 0), h200_row(1, 2048)]
    canned.apps = []
    _mapping_only_process(proc, 900, 0)  # GPU index 1
    snapshot = facts.look(canned, protect=[], proc=str(proc), driver_root=str(driver))
    assert 900 in {h["pid"] for h in snapshot.holders}


def test_unexplained_gpus_are_those_above_the_limit_without_only_live_listed_holders():
    gpus = h200_host({0: 1000, 1: 1000, 2: 1000, 3: 4}, count=4)
    apps = [{"pid": 1, "gpu_index": 0, "alive": True}, {"pid": 2, "gpu_index": 1, "alive": False},
            {"pid": 3, "gpu_index": 2, "alive": True}]
    holding = [{"pid": 1}, {"pid": 2}]  # 3 is listed but has no device file open
    assert facts.unexplained_gpus(gpus, apps, holding, 4) == [1, 2]


# ------------------------------------------------------------------ the driver's own list of GPUs (docs/docsite/rst/guide_security.rst)


def _information(bus, minor, excluded="No"):
    return f"Model: \t\t NVIDIA H200\nBus Location: \t {bus}\nDevice Minor: \t {minor:d}\nGPU Excluded:\t {excluded}\n"


def test_gpu_the_driver_has_and_nvidia_smi_omits_is_an_error_naming_its_bus(tmp_path):
    for bus, minor, excluded in (("0000:00:06.0", 0, "No"), ("0000:00:07.0", 1, "No"), ("0000:00:08.0", 2, "Yes")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(_information(bus, minor, excluded))
    driver = smi.read_driver_gpus(str(tmp_path))
    # an excluded GPU is not the driver's to show
    assert driver == {"0000:00:06.0": {"bus": "0000:00:06.0", "minor": 0, "uuid": None}, "0000:00:07.0": {"bus": "0000:00:07.0", "minor": 1, "uuid": None}}
    smi.check_against_driver([{"pci_bus_id": "00000000:00:06.0"}, {"pci_bus_id": "00000000:00:07.0"}], driver)
    with pytest.raises(smi.GpuMissing, match=r"0000:00:07\.0 missing"):
        smi.check_against_driver([{"pci_bus_id": "00000000:00:06.0"}], driver)
    smi.check_against_driver([{"pci_bus_id": "00000000:00:06.0"}], {})  # no driver files (a container): nothing to check


def test_compute_apps_are_named_from_proc_and_a_dead_owner_reads_not_found():
    gpus = [{"uuid": "GPU-a", "index": 0}]
    apps = [{"pid": 7, "gpu_uuid": "GPU-a", "used_memory_mib": 5, "name": None}, {"pid": 8, "gpu_uuid": "GPU-a", "used_memory_mib": 6, "name": None}]
    joined = facts.join_apps(apps, gpus, lambda pid: pid == 7, lambda pid: "python3" if pid == 7 else "never asked")
    assert [(a["pid"], a["name"], a["alive"], a["gpu_index"]) for a in joined] == [(7, "python3", True, 0), (8, "[Not Found]", False, 0)]


def _driver(*minors):
    """The driver's list of a machine's GPUs at buses 0000:0<minor>:00.0."""
    return {f"0000:0{m:d}:00.0": {"bus": f"0000:0{m:d}:00.0", "minor": m, "uuid": f"GPU-{m:d}"} for m in minors}


def test_gpus_nvidia_smi_left_out_are_not_visible_only_where_their_node_cannot_be_reached():
    """A container given GPU 3 of 4: nvidia-smi lists one, the driver four (issue 37)."""
    listed = [{"pci_bus_id": "00000000:03:00.0"}]
    asked = []

    def reachable(minor):
        asked.append(minor)
        return minor == 2

    hidden = facts.not_visible_gpus(listed, _driver(0, 1, 2, 3), reachable)
    assert [gpu["bus"] for gpu in hidden] == ["0000:00:00.0", "0000:01:00.0"] and asked == [0, 1, 2]  # only the left-out GPUs are asked
    with pytest.raises(smi.GpuMissing, match=r"at 0000:02:00\.0 missing from its answer .* although this namespace can open their device nodes") as info:
        smi.check_against_driver(listed, _driver(0, 1, 2, 3), [gpu["bus"] for gpu in hidden])
    assert "(2 of them not visible in this namespace)" in info.value.msg and "0000:00:00.0" not in info.value.msg
    smi.check_against_driver(listed, _driver(0, 1, 3), ["0000:00:00.0", "0000:01:00.0"])  # nothing reachable left out: no error
    assert facts.not_visible_gpus([{"pci_bus_id": "00000000:00:00.0"}], _driver(0), lambda minor: False) == []  # nothing left out: nothing asked


def test_a_left_out_gpu_without_a_minor_number_cannot_be_asked_and_stays_an_error():
    driver = {"0000:05:00.0": {"bus": "0000:05:00.0", "minor": None, "uuid": None}}
    assert facts.not_visible_gpus([], driver, lambda minor: False) == []
    with pytest.raises(smi.GpuMissing, match="0000:05:00.0"):
        smi.check_against_driver([], driver, [])


def test_assembled_facts_name_the_gpus_not_visible_here():
    gpu = {"index": 0, "uuid": "GPU-3", "pci_bus_id": "00000000:03:00.0", "minor_number": 3, "memory_used_mib": 0}
    out = facts.assemble(facts.Findings(gpus=[gpu], max_used_mib=0, with_processes=True, not_visible=list(_driver(0, 1).values())))
    assert out["not_visible"] == ["0000:00:00.0", "0000:01:00.0"] and out["count"] == 1 and out["clean"] is True
