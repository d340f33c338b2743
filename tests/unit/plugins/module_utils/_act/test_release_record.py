"""gpu_release's hook into the restore record: what a run on a fake node (test_release_run's World)
writes to the record, and what it never writes."""
import json

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed

from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import FakeSmi, FakeSystem, World, params


@pytest.fixture
def world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return World(root)


def run(world, path, check_mode=False, **options):
    system = FakeSystem(world)
    system.record_path = str(path)
    return release.Release(FakeSmi(world), system, params(**options), check_mode=check_mode,
                           driver_root=str(world.root.parent / "no-driver")).run()


def entries(path):
    return [(e["name"], e["actions"], e["active"], e["unit_file_state"], e["gpu_indexes"]) for e in json.loads(path.read_text())["entries"]]


def test_disabled_services_record_the_state_before_of_each_unit_changed(world, tmp_path):
    path = tmp_path / "var" / "released.json"
    world.unit("vllm-a.service")  # active, enabled: stop + disable
    world.unit("vllm-b.service", active="inactive", sub="dead")  # enabled, inactive: disable
    world.unit("vllm-c.service", active="inactive", sub="dead", file_state="disabled")  # nothing done, not recorded
    world.unit("sglang.service")  # owns a holder: stopped only
    world.spawn(495, {0: 1000}, unit="vllm-a.service")
    world.spawn(496, {1: 1000}, unit="sglang.service")
    result = run(world, path, services=["vllm*.service"], service_state="disabled")
    assert entries(path) == [
        ("vllm-a.service", ["stopped", "disabled"], True, "enabled", [0]),
        ("sglang.service", ["stopped"], True, "enabled", [1]),
        ("vllm-b.service", ["disabled"], False, "enabled", []),
    ]
    assert result["restore_record"] == {"path": str(path), "entries": 3}


def test_check_mode_and_a_run_that_changes_nothing_write_nothing(world, tmp_path):
    path = tmp_path / "var" / "released.json"
    world.unit("vllm.service")
    world.spawn(495, {0: 1000}, unit="vllm.service")
    plan = run(world, path, check_mode=True, services=["vllm.service"], service_state="disabled")
    assert plan["changed"] is True and not path.exists() and plan["restore_record"] is None
    run(world, path, services=["vllm.service"], service_state="disabled")
    written = path.read_bytes()
    again = run(world, path, services=["vllm.service"], service_state="disabled")
    assert again["changed"] is False and again["restore_record"] is None and path.read_bytes() == written


def test_a_second_release_adds_only_what_it_did_and_keeps_the_first_state_before(world, tmp_path):
    path = tmp_path / "var" / "released.json"
    world.unit("vllm.service")
    world.spawn(495, {0: 1000}, unit="vllm.service")
    run(world, path)  # stop_owning_units: stopped only
    run(world, path, services=["vllm.service"], service_state="masked")  # now inactive: masked only
    assert entries(path) == [("vllm.service", ["stopped", "masked"], True, "enabled", [0])]


def test_an_unwritable_record_is_a_warning_and_the_gpus_are_still_freed(world, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    world.unit("vllm.service")
    world.spawn(495, {0: 1000}, unit="vllm.service")
    result = run(world, blocker / "released.json")
    assert result["released"] is True and result["restore_record"] is None
    assert any("restore record was not written" in w for w in result["warnings"]), result["warnings"]


def test_a_unit_step_that_fails_hands_back_what_it_did_to_the_result_and_the_restore_record(world, tmp_path, monkeypatch):
    """_units.act returns what it did and raises StepFailed with it; Release, the one writer of the
    result, folds it in before the restore record is written and before the one ReleaseError."""
    path = tmp_path / "var" / "released.json"
    world.unit("vllm.service")
    world.spawn(495, {0: 1000}, unit="vllm.service")
    stop_then_fail = _units.act

    def act(system, steps, kill_timeout):
        done = stop_then_fail(system, steps, kill_timeout)
        raise StepFailed("systemctl disable vllm.service failed (rc 1): Access denied", done)

    monkeypatch.setattr(_units, "act", act)
    with pytest.raises(release.ReleaseError) as info:
        run(world, path, services=["vllm"], service_state="disabled")
    assert info.value.msg == "systemctl disable vllm.service failed (rc 1): Access denied"
    assert info.value.result["stopped_units"] == ["vllm.service"] and info.value.result["disabled_units"] == ["vllm.service"]
    assert info.value.result["killed"] == [] and "diff" not in info.value.result
    assert [(name, actions) for name, actions, _a, _f, _g in entries(path)] == [("vllm.service", ["stopped", "disabled"])]
