"""The restore record (_record): what a release changed, merged over several releases, written
atomically and root-only. Pure logic and the file on a temporary directory."""
import json
import os
import stat

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _record as record_mod

AT1, AT2 = "2026-12-01T10:00:00Z", "2026-12-01T11:00:00Z"
ACTIVE_ENABLED = {"Id": "vllm.service", "LoadState": "loaded", "ActiveState": "active", "SubState": "running", "UnitFileState": "enabled"}


def unit_release(stopped=(), disabled=(), masked=(), before=None, holders=(), at=AT1):
    result = {"stopped_units": list(stopped), "disabled_units": list(disabled), "masked_units": list(masked)}
    return record_mod.release_entries(result, before or {}, list(holders), at)


def test_a_stopped_and_disabled_unit_records_its_state_before_and_the_gpus_it_held():
    [entry] = unit_release(["vllm.service"], ["vllm.service"], before={"vllm.service": ACTIVE_ENABLED},
                           holders=[{"unit": "vllm.service", "gpu_indexes": [0, 1]}, {"unit": None, "gpu_indexes": [2]}])
    assert entry == {"kind": "unit", "name": "vllm.service", "actions": ["stopped", "disabled"], "active": True, "active_state": "active",
                     "unit_file_state": "enabled", "gpu_indexes": [0, 1], "released_at": AT1}


def test_a_unit_that_was_not_active_and_was_only_stopped_changed_nothing_and_is_not_recorded():
    before = {"x.service": dict(ACTIVE_ENABLED, Id="x.service", ActiveState="inactive", SubState="dead")}
    assert unit_release(["x.service"], before=before) == []


def test_a_restarting_unit_counts_as_active():
    before = {"x.service": dict(ACTIVE_ENABLED, Id="x.service", ActiveState="activating", SubState="auto-restart")}
    [entry] = unit_release(["x.service"], before=before)
    assert entry["active"] is True


def test_containers_stopped_and_disabled_record_their_policy_before_and_that_they_ran():
    result = {"disabled_containers": [{"name": "vllm", "id": "a" * 64, "runtime": "docker", "restart_policy": "no", "restart_policy_before": "always",
                                       "gpu_indexes": []},
                                      {"name": "idle", "id": "b" * 64, "runtime": "docker", "restart_policy": "no",
                                       "restart_policy_before": "unless-stopped", "gpu_indexes": []}],
              "stopped_containers": [{"name": "vllm", "id": "a" * 64, "runtime": "docker", "restart_policy": "always", "gpu_indexes": [0, 1]},
                                     {"name": "found", "id": "c" * 64, "runtime": "podman", "restart_policy": "on-failure",
                                      "restart_max_retries": 3, "gpu_indexes": [2]}]}
    entries = record_mod.release_entries(result, {}, [], AT1)
    summary = [(e["name"], e["actions"], e["running"], e["restart_policy"], e["gpu_indexes"]) for e in entries]
    assert summary == [("vllm", ["stopped", "disabled"], True, "always", [0, 1]), ("idle", ["disabled"], False, "unless-stopped", []),
                       ("found", ["stopped"], True, "on-failure", [2])]
    assert entries[2]["restart_max_retries"] == 3


def test_a_release_that_changed_nothing_adds_nothing(tmp_path):
    path = str(tmp_path / "state" / "released.json")
    assert record_mod.add(path, []) is None
    assert record_mod.add(path, unit_release()) is None
    assert not os.path.exists(os.path.dirname(path)) or not os.path.exists(path)


def test_two_releases_merge_to_the_state_before_the_first():
    # The first release stops vllm (active, enabled); the second finds it stopped and disables it.
    first = unit_release(["vllm.service"], before={"vllm.service": ACTIVE_ENABLED}, at=AT1)
    second_before = {"vllm.service": dict(ACTIVE_ENABLED, ActiveState="inactive", SubState="dead")}
    second = unit_release([], ["vllm.service"], before=second_before, at=AT2)
    merged = record_mod.merge(record_mod.merge(record_mod.empty(), first, AT1), second, AT2)
    [entry] = merged["entries"]
    assert (entry["actions"], entry["active"], entry["unit_file_state"], entry["released_at"]) == (["stopped", "disabled"], True, "enabled", AT1)
    assert entry["released_again_at"] == [AT2]
    assert merged["updated_at"] == AT2


def test_merge_keeps_release_order_and_appends_new_things():
    first = unit_release(["a.service"], before={"a.service": dict(ACTIVE_ENABLED, Id="a.service")})
    second = unit_release(["b.service", "a.service"], before={"b.service": dict(ACTIVE_ENABLED, Id="b.service"),
                                                              "a.service": dict(ACTIVE_ENABLED, Id="a.service")})
    merged = record_mod.merge(record_mod.merge(record_mod.empty(), first), second)
    assert [e["name"] for e in merged["entries"]] == ["a.service", "b.service"]


def test_file_is_root_only_and_written_atomically(tmp_path):
    path = str(tmp_path / "zeromib-gpu" / "released.json")
    record_mod.add(path, unit_release(["vllm.service"], before={"vllm.service": ACTIVE_ENABLED}), AT1)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert sorted(os.listdir(os.path.dirname(path))) == ["released.json", "released.json.lock"]  # no temporary file left
    with open(path) as handle:
        data = json.loads(handle.read())
    assert data["format"] == record_mod.FORMAT and data["updated_at"] == AT1 and data["entries"][0]["name"] == "vllm.service"
    assert record_mod.read(path) == data


def test_an_empty_record_removes_the_file(tmp_path):
    path = str(tmp_path / "d" / "released.json")
    record = record_mod.add(path, unit_release(["vllm.service"], before={"vllm.service": ACTIVE_ENABLED}))
    record_mod.write(record_mod.without(record, [("unit", "vllm.service")]), path)
    assert not os.path.exists(path)
    assert record_mod.read(path) == record_mod.empty()
    assert record_mod.pending(path) is None


@pytest.mark.parametrize("content, words", [
    (b"{not json", "not valid JSON"),
    (b'{"format": 99, "entries": []}', "format 99"),
    (b'{"format": 1}', "no list of entries"),
    (b'{"format": 1, "entries": [{"kind": "rocket", "name": "x"}]}', "cannot read"),
])
def test_a_record_that_cannot_be_read_is_an_error_naming_it_never_an_empty_one(tmp_path, content, words):
    directory = tmp_path / "d"
    directory.mkdir(mode=0o700)
    path = directory / "released.json"
    path.write_bytes(content)
    with pytest.raises(record_mod.RecordError, match=words) as info:
        record_mod.read(str(path))
    assert str(path) in str(info.value)
    # and a release does not overwrite it
    with pytest.raises(record_mod.RecordError):
        record_mod.add(str(path), unit_release(["vllm.service"], before={"vllm.service": ACTIVE_ENABLED}))
    assert path.read_bytes() == content


def test_a_directory_others_may_write_or_a_link_is_not_trusted(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(str(loose), 0o777)
    with pytest.raises(record_mod.RecordError, match="writable by others"):
        record_mod.add(str(loose / "released.json"), unit_release(["vllm.service"], before={"vllm.service": ACTIVE_ENABLED}))
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(record_mod.RecordError, match="not a directory"):
        record_mod.add(str(tmp_path / "link" / "released.json"), unit_release(["vllm.service"], before={"vllm.service": ACTIVE_ENABLED}))
    target = real / "elsewhere.json"
    target.write_text("{}")
    os.symlink(str(target), str(real / "released.json"))
    with pytest.raises(record_mod.RecordError, match="cannot open"):
        record_mod.read(str(real / "released.json"))


def test_pending_describes_each_entry_for_the_audit(tmp_path):
    path = str(tmp_path / "d" / "released.json")
    record_mod.add(path, unit_release(["vllm.service"], ["vllm.service"], before={"vllm.service": ACTIVE_ENABLED}), AT1)
    found = record_mod.pending(path)
    assert found["summary"] == [f"vllm.service stopped, disabled by zeromib at {AT1}"] and found["error"] is None


def test_supervisor_programs_are_recorded_with_their_options_before():
    # The keys of gpu_release's supervisor support (respawn's _supervisor.act).
    result = {"stopped_programs": [{"name": "vllm", "supervisor_pid": 42, "config": "/etc/supervisor/supervisord.conf", "state_before": "RUNNING"}],
              "disabled_programs": [{"name": "vllm", "supervisor_pid": 42, "config": "/etc/supervisor/supervisord.conf", "state_before": "RUNNING",
                                     "file": "/etc/supervisor/conf.d/vllm.conf", "autostart_before": "true", "autorestart_before": None}]}
    [entry] = record_mod.release_entries(result, {}, [], AT1)
    assert (entry["kind"], entry["name"], entry["actions"], entry["running"]) == ("supervisor", "vllm", ["stopped", "disabled"], True)
    assert (entry["file"], entry["autostart_before"], entry["autorestart_before"]) == ("/etc/supervisor/conf.d/vllm.conf", "true", None)
    assert record_mod.describe(entry) == f"supervisor program vllm stopped, disabled by zeromib at {AT1}"


def test_a_supervisor_program_is_recorded_with_the_gpus_its_process_family_held():
    # supervisord runs the API server (pid 500); its EngineCore (501) and the workers (502, 503) hold GPUs 0-2.
    holders = [{"pid": 501, "ppid": 500, "gpu_indexes": [0]}, {"pid": 502, "ppid": 501, "gpu_indexes": [1]},
               {"pid": 503, "ppid": 501, "gpu_indexes": [2]}, {"pid": 900, "ppid": 1, "gpu_indexes": [3]}]
    result = {"stopped_programs": [{"name": "vllm", "supervisor_pid": 42, "config": None, "state_before": "RUNNING", "pid": 500}]}
    [entry] = record_mod.release_entries(result, {}, holders, AT1)
    assert entry["gpu_indexes"] == [0, 1, 2]
    assert record_mod.program_gpus(None, holders) == []


# ---------------------------------------------------------------- the one atomic writer (_commands.replace_file)


def test_replace_file_fsyncs_file_and_directory_only_when_durable(tmp_path, monkeypatch):
    from ansible_collections.zeromib.gpu.plugins.module_utils import _commands

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(_commands.os, "fsync", lambda fd: synced.append(os.path.realpath(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    target = tmp_path / "state.json"
    _commands.replace_file(str(target), b"one", durable=False)
    assert (target.read_bytes(), synced) == (b"one", [])
    _commands.replace_file(str(target), b"two", durable=True)
    assert target.read_bytes() == b"two" and oct(target.stat().st_mode & 0o777) == "0o600"
    assert synced[-1] == str(tmp_path) and len(synced) == 2  # the new file (under its temporary name), then the directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_replace_file_never_writes_through_a_link_planted_at_its_temporary_name(tmp_path):
    from ansible_collections.zeromib.gpu.plugins.module_utils import _commands

    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "state.json"
    (tmp_path / f"state.json.{os.getpid():d}.tmp").symlink_to(victim)
    _commands.replace_file(str(target), b"new", durable=True)
    assert victim.read_text() == "keep" and target.read_bytes() == b"new" and not target.is_symlink()
