"""gpu_restore's decisions (_restore): which steps put a unit or a container back, in which order,
what is kept when a step fails; on a fake systemd and a fake runtime."""
import json

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _engines
from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils import _restore as restore

AT = "2026-12-01T10:00:00Z"


def unit_entry(name, actions, active=True, file_state="enabled", gpus=()):
    return {"kind": "unit", "name": name, "actions": list(actions), "active": active, "active_state": "active" if active else "inactive",
            "unit_file_state": file_state, "gpu_indexes": list(gpus), "released_at": AT}


def props(active="inactive", file_state="disabled", load="loaded"):
    return {"LoadState": load, "ActiveState": active, "SubState": "dead", "UnitFileState": file_state}


@pytest.mark.parametrize("entry, now, steps", [
    (unit_entry("a", ["stopped", "disabled"]), props(), ["enable", "start"]),
    (unit_entry("a", ["disabled"], active=False), props(), ["enable"]),
    (unit_entry("a", ["stopped"], file_state="disabled"), props(), ["start"]),
    (unit_entry("a", ["stopped", "masked"]), props(file_state="masked", load="masked"), ["unmask", "start"]),
    (unit_entry("a", ["masked"], active=False, file_state="disabled"), props(file_state="masked"), ["unmask"]),
    # already back (someone started it): nothing to do
    (unit_entry("a", ["stopped", "disabled"]), props(active="active", file_state="enabled"), []),
    (unit_entry("a", ["stopped", "disabled"], file_state="enabled-runtime"), props(), ["enable", "start"]),
])
def test_unit_steps_undo_only_what_is_still_undone(entry, now, steps):
    assert restore.unit_steps(entry, now) == steps


def test_container_steps():
    entry = {"kind": "container", "actions": ["stopped", "disabled"], "running": True, "restart_policy": "always"}
    assert restore.container_steps(entry, {"restart_policy": "no", "running": False}) == ["restart_policy", "start"]
    assert restore.container_steps(entry, {"restart_policy": "always", "running": True}) == []
    stopped_only = {"kind": "container", "actions": ["stopped"], "running": True, "restart_policy": "always"}
    assert restore.container_steps(stopped_only, {"restart_policy": "always", "running": False}) == ["start"]


@pytest.mark.parametrize("value, seconds", [(False, 0), (True, 60), ("true", 60), (30, 30), ("12.5", 12.5), ("no", 0), (None, 0)])
def test_wait_for_gpus_reads_bool_or_seconds(value, seconds):
    assert restore.parse_wait(value) == seconds


@pytest.mark.parametrize("value", ["soon", -1])
def test_wait_for_gpus_refuses_anything_else(value):
    with pytest.raises(ValueError, match="wait_for_gpus"):
        restore.parse_wait(value)


class FakeSystemd(restore.System):
    """systemctl show/unmask/enable/start over a dict of units; `broken` units fail to start."""

    def __init__(self, path, units, broken=()):
        super().__init__("/usr/bin/systemctl", runtimes=_engines.Runtimes(which=lambda n: None, sockets={}), record_path=path)
        self.units = units
        self.broken = set(broken)
        self.log = []

    def systemctl(self, args, timeout=30.0):
        verb, names = args[0], [a for a in args[1:] if not a.startswith("-")]
        if verb == "show":
            return 0, "\n".join("Id={}\n{}".format(n, "".join("{}={}\n".format(*kv) for kv in self.units[n].items())) for n in names), ""
        self.log.append((verb, names[0]))
        unit = self.units[names[0]]
        if verb == "unmask":
            unit.update(LoadState="loaded", UnitFileState="enabled")
        elif verb == "enable":
            unit["UnitFileState"] = "enabled"
        elif verb == "start":
            if names[0] in self.broken:
                unit.update(ActiveState="failed", Result="exit-code")
                return 1, "", f"Job for {names[0]} failed because the control process exited with error code."
            unit["ActiveState"] = "active"
        return 0, "", ""


def write(path, entries):
    _record.write({"format": 1, "updated_at": AT, "entries": entries}, str(path))


def test_restore_goes_newest_first_and_a_failed_start_is_named_and_kept(tmp_path):
    path = tmp_path / "d" / "released.json"
    write(path, [unit_entry("first.service", ["stopped"]), unit_entry("broken.service", ["stopped", "disabled"]),
                 unit_entry("last.service", ["stopped", "masked"])])
    system = FakeSystemd(str(path), {"first.service": props(file_state="enabled"), "broken.service": props(),
                                     "last.service": props(file_state="masked", load="masked")}, broken=["broken.service"])
    with pytest.raises(restore.RestoreError) as info:
        restore.Restore(system, {"step_timeout": 5}).run()
    assert system.log == [("unmask", "last.service"), ("start", "last.service"), ("enable", "broken.service"), ("start", "broken.service"),
                          ("start", "first.service")]
    assert "could not restore unit broken.service: systemctl start broken.service failed (rc 1)" in info.value.msg
    result = info.value.result
    assert result["started_units"] == ["last.service", "first.service"] and result["enabled_units"] == ["broken.service"]
    assert [(n["name"], n["steps"]) for n in result["not_restored"]] == [("broken.service", ["start"])]
    assert [e["name"] for e in json.loads(path.read_text())["entries"]] == ["broken.service"]


def test_check_mode_changes_neither_the_node_nor_the_record(tmp_path):
    path = tmp_path / "d" / "released.json"
    write(path, [unit_entry("vllm.service", ["stopped", "disabled"])])
    content = path.read_bytes()
    system = FakeSystemd(str(path), {"vllm.service": props()})
    result = restore.Restore(system, {}, check_mode=True).run()
    assert result["changed"] is True and result["restored"] == [{"kind": "unit", "name": "vllm.service", "steps": ["enable", "start"]}]
    assert system.log == [] and path.read_bytes() == content


def test_no_record_is_nothing_to_do(tmp_path):
    system = FakeSystemd(str(tmp_path / "none" / "released.json"), {})
    result = restore.Restore(system, {}).run()
    assert result["changed"] is False and result["restored"] == [] and not (tmp_path / "none").exists()


def test_a_unit_removed_since_the_release_is_kept_and_forget_drops_it(tmp_path):
    path = tmp_path / "d" / "released.json"
    write(path, [unit_entry("gone.service", ["stopped"])])
    system = FakeSystemd(str(path), {"gone.service": {"LoadState": "not-found", "ActiveState": "inactive", "UnitFileState": ""}})
    with pytest.raises(restore.RestoreError, match="no longer known to systemd"):
        restore.Restore(system, {}).run()
    result = restore.Restore(system, {"forget": ["gone*"]}).run()
    assert result["forgotten"] == [f"gone.service stopped by zeromib at {AT}"] and not path.exists()


def test_a_supervisor_program_without_its_supervisord_running_is_named_and_kept(tmp_path):
    path = tmp_path / "d" / "released.json"
    write(path, [{"kind": "supervisor", "name": "vllm", "actions": ["stopped"], "running": True, "released_at": AT,
                  "config": "/etc/supervisor/supervisord.conf"},
                 unit_entry("a.service", ["stopped"])])
    system = FakeSystemd(str(path), {"a.service": props()})
    (tmp_path / "proc").mkdir()
    system.proc = str(tmp_path / "proc")  # a node without supervisord
    with pytest.raises(restore.RestoreError, match="supervisor vllm: no running supervisord") as info:
        restore.Restore(system, {}).run()
    assert info.value.result["started_units"] == ["a.service"]
    assert [e["name"] for e in json.loads(path.read_text())["entries"]] == ["vllm"]
