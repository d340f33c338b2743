"""gpu_restore's decisions (_restore): which steps put a unit or a container back, in which order,
what is kept when a step fails; on a fake systemd and a fake runtime."""
import json

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines
from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _reload_risk
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _restore as restore

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
    # killed through systemd by the release (issue 55): left failed, reset before its start
    (unit_entry("a", ["stopped"]), props(active="failed", file_state="enabled"), ["reset-failed", "start"]),
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
        if verb == "is-enabled":
            state = self.units[names[0]].get("DiskState") or self.units[names[0]].get("UnitFileState")
            return (0 if state.startswith("enabled") else 1), state + "\n", ""
        assert "--no-reload" in args or verb in ("start", "reset-failed", "daemon-reload"), f"an implicit daemon-reload: {args}"
        self.log.append((verb, names[0] if names else None))
        if verb == "daemon-reload":
            for unit in self.units.values():
                unit.update(LoadState=unit.pop("DiskLoad", unit["LoadState"]), UnitFileState=unit.pop("DiskState", unit["UnitFileState"]))
            return 0, "", ""
        unit = self.units[names[0]]
        if verb == "unmask" and unit.get("Wanted"):
            # systemd 252/257: a unit another unit wants stays loaded as it was until a reload
            unit.update(DiskLoad="loaded", DiskState="enabled")
        elif verb == "unmask":
            unit.update(LoadState="loaded", UnitFileState="enabled")
        elif verb == "enable":
            unit["UnitFileState"] = "enabled"
        elif verb == "reset-failed":
            unit.update(ActiveState="inactive", Result="success")
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


class FakeRuntimes:
    """inspect/set_restart_policy/start over a dict of containers {id: {name, running, restart_policy}}."""

    def __init__(self, containers):
        self.containers = containers
        self.log = []

    def inspect(self, runtime, cid):
        return dict(self.containers[cid]) if cid in self.containers else None

    def set_restart_policy(self, runtime, cid, policy, retries):
        self.log.append(("restart_policy", cid, policy))
        self.containers[cid]["restart_policy"] = policy

    def start(self, runtime, cid, timeout):
        self.log.append(("start", cid))
        self.containers[cid]["running"] = True


def container_entry(name, cid, actions, running=True, policy="always"):
    return {"kind": "container", "name": name, "id": cid, "runtime": "podman", "actions": list(actions), "running": running,
            "restart_policy": policy, "restart_max_retries": 0, "gpu_indexes": [3], "released_at": AT}


PLAN_KEYS = ("changed", "restored", "plan", "unmasked_units", "enabled_units", "started_units", "restored_policies", "started_containers",
             "started_programs", "already_restored", "forgotten", "not_restored", "pending", "diff")


def node(path):
    """vllm (enabled, running) stopped and disabled by the release; sglang (running, disabled before) stopped and
    disabled; a running container stopped with restart policy no; tgi already started again by hand."""
    write(path, [unit_entry("vllm.service", ["stopped", "disabled"]),
                 unit_entry("sglang.service", ["stopped", "disabled"], file_state="disabled"),
                 container_entry("vllm-c", "c" * 64, ["stopped", "disabled"]),
                 unit_entry("tgi.service", ["stopped"])])
    system = FakeSystemd(str(path), {"vllm.service": props(), "sglang.service": props(), "tgi.service": props(active="active")})
    system.runtimes = FakeRuntimes({"c" * 64: {"name": "vllm-c", "running": False, "restart_policy": "no"}})
    return system


def test_check_mode_reports_exactly_what_the_real_run_then_does_under_the_same_keys(tmp_path):
    path = tmp_path / "d" / "released.json"
    system = node(path)
    content = path.read_bytes()
    plan = restore.Restore(system, {}, check_mode=True).run()
    assert system.log == [] and system.runtimes.log == [] and path.read_bytes() == content
    assert plan["started_units"] == ["sglang.service", "vllm.service"] and plan["enabled_units"] == ["vllm.service"]
    assert plan["started_containers"] == ["vllm-c"] and plan["restored_policies"][0]["restart_policy"] == "always"
    assert plan["already_restored"] == [f"tgi.service stopped by zeromib at {AT}"]
    assert plan["plan"] == ["tgi.service: already as before, dropped from the record", "container vllm-c: restart policy always, start",
                            "sglang.service: start", "vllm.service: enable, start"]
    done = restore.Restore(system, {}).run()
    assert {k: done[k] for k in PLAN_KEYS} == {k: plan[k] for k in PLAN_KEYS}
    assert system.log == [("start", "sglang.service"), ("enable", "vllm.service"), ("start", "vllm.service")]
    again = restore.Restore(system, {}, check_mode=True).run()
    assert again["changed"] is False and again["plan"] == [] and again["started_units"] == []


def test_the_diff_shows_each_entry_before_and_after(tmp_path):
    path = tmp_path / "d" / "released.json"
    result = restore.Restore(node(path), {}, check_mode=True).run()
    assert result["diff"]["before"].splitlines() == [
        "tgi.service: in the restore record", "container vllm-c: restart policy no, stopped", "sglang.service: stopped",
        "vllm.service: disabled, stopped"]
    assert result["diff"]["after"].splitlines() == [
        "tgi.service: dropped from the record (already as before)", "container vllm-c: restart policy always, running",
        "sglang.service: running", "vllm.service: enabled, running"]


def test_a_masked_unit_plans_unmask_enable_start(tmp_path):
    path = tmp_path / "d" / "released.json"
    write(path, [unit_entry("vllm.service", ["stopped", "masked"])])
    system = FakeSystemd(str(path), {"vllm.service": props(file_state="masked", load="masked")})
    system.units["vllm.service"]["UnitFileState"] = "masked"
    plan = restore.Restore(system, {}, check_mode=True).run()
    assert (plan["unmasked_units"], plan["started_units"]) == (["vllm.service"], ["vllm.service"])
    done = restore.Restore(system, {}).run()
    assert {k: done[k] for k in PLAN_KEYS if k != "diff"} == {k: plan[k] for k in PLAN_KEYS if k != "diff"}


def test_wait_for_gpus_finds_a_programs_gpus_through_its_process_family(tmp_path):
    proc = tmp_path / "proc"
    for pid, ppid in ((500, 42), (501, 500), (42, 1), (900, 1)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (x) S {ppid} 0 0 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n")
        (proc / str(pid) / "status").write_text(f"Name:\tx\nState:\tS (sleeping)\nPid:\t{pid}\nPPid:\t{ppid}\n")
    entry = {"kind": "supervisor", "name": "vllm"}
    assert restore.ancestry(501, str(proc)) == [501, 500, 42]
    assert restore._holds(entry, {"pid": 501}, {"vllm": 500}, str(proc)) is True
    assert restore._holds(entry, {"pid": 900}, {"vllm": 500}, str(proc)) is False
    assert restore._holds(entry, {"pid": 501}, {}, str(proc)) is False


class FakeSupervisor:
    def __init__(self, pid):
        self.pid = pid

    def status(self, timeout=10.0):
        return [{"name": "vllm", "state": "RUNNING", "pid": self.pid}]


def test_wait_for_gpus_waits_for_a_program_until_its_process_family_holds_its_gpus(tmp_path):
    proc = tmp_path / "proc"
    for pid, ppid in ((500, 42), (501, 500), (42, 1)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (x) S {ppid} 0 0 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n")
        (proc / str(pid) / "status").write_text(f"Name:\tx\nState:\tS (sleeping)\nPid:\t{pid}\nPPid:\t{ppid}\n")
    system = FakeSystemd(str(tmp_path / "d" / "released.json"), {})
    system.proc = str(proc)
    entry = {"kind": "supervisor", "name": "vllm", "gpu_indexes": [0], "actions": ["stopped"], "running": True}
    looks = iter([[], [{"pid": 501, "gpu_indexes": [0]}]])  # the EngineCore child comes up at the second look
    run = restore.Restore(system, {}, look=lambda: next(looks))
    run.supervisors["vllm"] = FakeSupervisor(500)
    run.wait_for_gpus([entry], 5)
    assert run.result["gpus_held"] == {"vllm": [0]}
    # Its supervisord now runs it as another process, whose family holds nothing: named after the wait.
    run = restore.Restore(system, {}, look=lambda: [{"pid": 501, "gpu_indexes": [0]}])
    run.supervisors["vllm"] = FakeSupervisor(777)
    with pytest.raises(restore.RestoreError, match=r"vllm is not holding a GPU again after 0 s .*vllm: 0"):
        run.wait_for_gpus([entry], 0.1)


def test_a_unit_the_release_left_failed_is_reset_then_started(tmp_path):
    """Issue 55: a unit killed through systemd reads failed (Result=signal) until reset-failed."""
    path = tmp_path / "d" / "released.json"
    write(path, [unit_entry("stubborn.service", ["stopped"])])
    system = FakeSystemd(str(path), {"stubborn.service": dict(props(active="failed", file_state="enabled"), Result="signal")})
    planned = restore.Restore(system, {}, check_mode=True).run()
    assert planned["reset_failed_units"] == ["stubborn.service"] and planned["plan"] == ["stubborn.service: reset-failed, start"]
    result = restore.Restore(system, {"step_timeout": 5}).run()
    assert system.log == [("reset-failed", "stubborn.service"), ("start", "stubborn.service")]
    assert result["reset_failed_units"] == result["started_units"] == ["stubborn.service"]
    assert system.units["stubborn.service"]["ActiveState"] == "active"


def test_a_unit_masked_without_a_reload_is_unmasked_though_systemd_still_reports_it_enabled(tmp_path):
    """After `systemctl mask --no-reload` of a unit its target wants, `systemctl show` keeps
    reading LoadState=loaded, UnitFileState=enabled; `is-enabled` reads the files: masked."""
    path = tmp_path / "d" / "released.json"
    write(path, [unit_entry("vllm.service", ["stopped", "masked"])])
    unit = dict(props(file_state="enabled"), DiskState="masked", Wanted=True)
    system = FakeSystemd(str(path), {"vllm.service": unit})
    result = restore.Restore(system, {"step_timeout": 5}).run()
    assert system.log == [("unmask", "vllm.service"), ("start", "vllm.service")]
    assert result["unmasked_units"] == ["vllm.service"] and result["started_units"] == ["vllm.service"]


class RiskySystemd(FakeSystemd):
    def __init__(self, path, units, risks):
        super().__init__(path, units)
        self.risks = risks

    def reload_risk(self, systemctl):
        return self.risks


BOX = [_reload_risk.Risk("docker-4f2a.scope", 812, ["/dev/nvidia4", "/dev/nvidiactl"])]


@pytest.mark.parametrize("risks, allow, reloaded", [([], False, True), (BOX, False, False), (BOX, True, True)],
                         ids=["no-gpu-container", "gpu-container-refused", "gpu-container-allowed"])
def test_a_unit_systemd_holds_masked_is_started_after_a_reload_only_when_no_gpu_container_loses_its_gpus(tmp_path, risks, allow, reloaded):
    """Masked at boot and wanted by its target: unmask leaves it masked in systemd until a reload."""
    path = tmp_path / "d" / "released.json"
    write(path, [unit_entry("vllm.service", ["stopped", "masked"])])
    system = RiskySystemd(str(path), {"vllm.service": dict(props(file_state="masked", load="masked"), Wanted=True)}, risks)
    params = {"step_timeout": 5, "reload_despite_gpu_containers": allow}
    if reloaded:
        result = restore.Restore(system, params).run()
        assert system.log == [("unmask", "vllm.service"), ("daemon-reload", None), ("start", "vllm.service")]
        assert result["started_units"] == ["vllm.service"] and any("reloaded" in w for w in result["warnings"])
        return
    with pytest.raises(restore.RestoreError) as info:
        restore.Restore(system, params).run()
    assert system.log == [("unmask", "vllm.service")]
    assert "docker-4f2a.scope (pid 812: /dev/nvidia4, /dev/nvidiactl)" in info.value.msg
    assert "nvidia-ctk system create-dev-char-symlinks --create-all" in info.value.msg and "reload_despite_gpu_containers" in info.value.msg
    assert [e["name"] for e in json.loads(path.read_text())["entries"]] == ["vllm.service"]


def test_a_unit_disabled_without_a_reload_is_enabled_again_though_systemd_still_reports_it_enabled(tmp_path):
    """systemd keeps the UnitFileState it last read until a reload: after `disable --no-reload`
    of a unit whose state it had read, `systemctl show` still says enabled; `is-enabled` reads the files."""
    path = tmp_path / "d" / "released.json"
    write(path, [unit_entry("vllm.service", ["stopped", "disabled"])])
    system = FakeSystemd(str(path), {"vllm.service": dict(props(file_state="enabled"), DiskState="disabled")})
    result = restore.Restore(system, {"step_timeout": 5}).run()
    assert system.log == [("enable", "vllm.service"), ("start", "vllm.service")]
    assert result["enabled_units"] == ["vllm.service"] and result["started_units"] == ["vllm.service"]
