"""The training-ready profile through real Ansible on simulated hosts (issue 71): each setting an
inference side leaves on a GPU that reads 0 MiB (a compute mode other than Default, a power limit
below the default, application clocks off their defaults, clocks held by a user setting, a pending
ECC mode change) fails the free_gpus role's gate, said in its first sentence with the host, the GPU,
what it reads and the command that sets it back; gpu_facts shows the readings; free_gpus_ready_profile
overrides or skips each setting; an older driver that rejects a field leaves that check unchecked and
still frees memory; a wrong profile is one line, before anything is done.

States go in through the simulator's `field_values` (tests/sim/README.md), in the words nvidia-smi
prints them: compute_mode values of R580's --help-query-gpu ("0: Default", "2: Prohibited",
"3: Exclusive_Process"), power limits and ECC modes as the H200's nvidia-smi -q reads them
(tests/fixtures/nvidia-smi/h200-580.159.04-q-2026-12-01/q.txt), the event reason's Active/Not Active.

Who else controls these readings: only root (nvidia-smi -c/-pl/-lgc/-ac need it), and the driver prints
them; no user-written text (process names) is asked for in this query, so none is an attacker's input.
"""
import json
import os

import pytest

from ansible_in_ns import run_module
from make_config import make_config
from test_gpu_health_gate import run_role

# (test id, field values of GPU 1, the words the gate's message must contain)
STATES = [
    ("exclusive_process", {"compute_mode": "Exclusive_Process"},
     ["GPU 1 (00000000:00:07.0): compute mode is Exclusive_Process, expected Default", "all CUDA-capable devices are busy or unavailable",
      "nvidia-smi -i 1 -c DEFAULT"]),
    ("prohibited", {"compute_mode": "Prohibited"}, ["GPU 1 (00000000:00:07.0): compute mode is Prohibited, expected Default"]),
    ("power_limit_below_default", {"power.limit": "350.00", "power.default_limit": "700.00"},
     ["GPU 1 (00000000:00:07.0): power limit is 350 W, below the default 700 W", "nvidia-smi -i 1 -pl 700"]),
    ("application_clocks", {"clocks.applications.graphics": "1410", "clocks.default_applications.graphics": "1980"},
     ["GPU 1 (00000000:00:07.0): application clocks (graphics) are 1410 MHz, the default is 1980 MHz", "-rac"]),
    ("clocks_locked", {"clocks_event_reasons.applications_clocks_setting": "Active"},
     ["GPU 1 (00000000:00:07.0): clocks are held down by a user setting", "nvidia-smi -i 1 -rgc -rmc"]),
    ("ecc_change_pending", {"ecc.mode.current": "Enabled", "ecc.mode.pending": "Disabled"},
     ["GPU 1 (00000000:00:07.0): an ECC mode change to Disabled is pending"]),
]


@pytest.fixture(scope="module")
def h200x2(module_nshost):
    return module_nshost("h200x2", seed="ready01")


def test_gpu_facts_shows_the_profile_and_an_idle_h200_is_ready(h200x2):
    h200x2.clear_faults()
    h200x2.set_fault({"field_values": {"power.limit": "700.00", "power.default_limit": "700.00"}})
    try:
        facts = run_module(h200x2, "gpu_facts", {})["ansible_facts"]["gpu"]
    finally:
        h200x2.clear_faults()
    assert facts["healthy"] is True, facts["health_issues"]
    ready = facts["gpus"][0]["health"]["ready"]
    assert ready["compute_mode"] == "Default" and ready["power_limit_w"] == 700.0 and ready["power_default_limit_w"] == 700.0
    assert ready["clocks_user_limited"] is False and ready["profile"] == {"compute_mode": "default", "clocks": "default", "power_limit": "default"}
    assert facts["gpus"][0]["health_unchecked"] == []


@pytest.mark.parametrize("values,words", [s[1:] for s in STATES], ids=[s[0] for s in STATES])
def test_each_state_fails_the_gate_in_its_first_sentence(h200x2, values, words):
    h200x2.clear_faults()
    h200x2.set_fault({"field_values": {"1": values}})
    try:
        outcome = run_role(h200x2, {})
    finally:
        h200x2.clear_faults()
    assert outcome["failed"], outcome
    first = outcome["msg"].split("; ")[0]
    assert outcome["msg"].startswith("localhost: ") and "unhealthy: " in first, outcome["msg"]
    assert words[0] in first, outcome["msg"]
    for word in words[1:]:
        assert word in outcome["msg"], outcome["msg"]
    assert outcome["result"]["status"] == "unhealthy" and outcome["result"]["healthy"] is False


def test_gpu_release_reports_the_state_and_the_profile_overrides_it(h200x2):
    h200x2.clear_faults()
    h200x2.set_fault({"field_values": {"0": {"compute_mode": "Exclusive_Process", "power.limit": "450.00", "power.default_limit": "700.00"}}})
    try:
        run = run_module(h200x2, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5})
        assert run["released"] is True and run["healthy"] is False
        assert run["health_issues"][0].startswith("GPU 0 (00000000:00:06.0): compute mode is Exclusive_Process, expected Default"), run["health_issues"]
        assert run["health_issues"][1].startswith("GPU 0 (00000000:00:06.0): power limit is 450 W, below the default 700 W"), run["health_issues"]
        # A site whose training runs one process per GPU, with a power cap of 400 W.
        run = run_module(h200x2, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5,
                                                 "ready_profile": {"compute_mode": "exclusive_process", "power_limit": "400"}})
        assert run["gpus"][0]["healthy"] is True, run["health_issues"]
        assert run["gpus"][0]["health"]["ready"]["profile"] == {"compute_mode": "exclusive_process", "clocks": "default", "power_limit": 400.0}
        # GPU 1 reads Default: off this profile, which every GPU must match.
        assert run["health_issues"] == ["GPU 1 (00000000:00:07.0): compute mode is Default, expected Exclusive_Process; "
                                        "nvidia-smi -i 1 -c EXCLUSIVE_PROCESS sets it"]
        outcome = run_role(h200x2, {"free_gpus_ready_profile": {"compute_mode": "any", "power_limit": "any"}})
        assert not outcome["failed"], outcome["msg"]
    finally:
        h200x2.clear_faults()


@pytest.mark.parametrize("profile,words", [
    ({"compute_mode": "exclusive"}, "compute_mode"),
    ({"power_limit": "fast"}, "ready_profile.power_limit must be default, any or the least watts"),
], ids=["unknown_compute_mode", "power_limit_not_a_number"])
def test_a_wrong_profile_is_one_line_and_nothing_is_done(h200x2, profile, words):
    holder = h200x2.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024"])
    try:
        run = run_module(h200x2, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5, "ready_profile": profile})
        assert run.failed and words in run.msg and "\n" not in run.msg and "Traceback" not in run.msg, run.msg
        assert h200x2.alive(holder.pid)
    finally:
        h200x2.kill(holder.pid)
        h200x2.wait_gone(holder.pid, 5)


def test_an_older_driver_without_compute_mode_frees_memory_and_says_not_checked(nshost):
    host = nshost(config=make_config("h200x2", seed="ready02", unsupported_fields=["compute_mode", "power.default_limit"],
                                     driver_version="470.57.02"))
    holder = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5})
    assert not run.failed, run.msg
    assert run["released"] is True and not host.alive(holder.pid)
    gpu = run["gpus"][1]
    assert "compute_mode" in gpu["health_unchecked"] and "power_limit" in gpu["health_unchecked"], gpu["health_unchecked"]
    assert "compute_mode: the driver does not know compute_mode" in gpu["health"]["unchecked"], gpu["health"]["unchecked"]
    # Skipped settings are not "unchecked".
    run = run_module(host, "gpu_facts", {"ready_profile": {"compute_mode": "any", "power_limit": "any"}})
    assert "compute_mode" not in run["ansible_facts"]["gpu"]["gpus"][1]["health_unchecked"]


# --- ready_fix: put back to the profile, recorded; gpu_restore puts the inference side's settings back.

def _settings(host, values=None):
    """The simulated driver's settings (tests/sim/nvidia-smi settings.json): write `values` {uuid: {...}}, or read them."""
    path = os.path.join(host.root.state, "settings.json")
    if values is not None:
        with open(path, "w") as handle:
            json.dump(values, handle)
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return {}


def _setters(host):
    try:
        with open(os.path.join(host.root.state, "setters.log")) as handle:
            return handle.read().splitlines()
    except FileNotFoundError:
        return []


def test_ready_fix_sets_the_profile_records_it_and_gpu_restore_puts_the_inference_side_back(nshost):
    host = nshost("h200x2", seed="ready03")
    uuid = host.config["gpus"][1]["uuid"]
    inference = {"compute_mode": "Exclusive_Process", "power.limit": "350.00", "power.default_limit": "700.00",
                 "clocks.applications.graphics": "1410", "clocks.default_applications.graphics": "1980",
                 "clocks.applications.memory": "2619", "clocks.default_applications.memory": "2619"}
    _settings(host, {uuid: inference})
    holder = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048"])
    # Without the opt-in: found and said, nothing set.
    check = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5}, check=True)
    assert check["ready_fixed"] == [] and _setters(host) == []
    run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5, "ready_fix": True})
    assert not run.failed, run.msg
    assert run["released"] is True and not host.alive(holder.pid)
    assert _setters(host) == [f"-i {uuid} -c 0", f"-i {uuid} -pl 700", f"-i {uuid} -rac"]
    [fixed] = run["ready_fixed"]
    assert fixed["index"] == 1
    assert fixed["changes"] == ["compute mode Exclusive_Process -> Default", "power limit 350 W -> 700 W", "application clocks reset to their defaults"]
    # Read again: the GPU now matches the profile.
    assert run["healthy"] is True and run["health_issues"] == [], run["health_issues"]
    assert run["gpus"][1]["health"]["ready"]["compute_mode"] == "Default"
    record = run_module(host, "gpu_facts", {})["ansible_facts"]["gpu"]["pending_restore"]
    [entry] = [e for e in record["entries"] if e["kind"] == "gpu_settings"]
    assert entry["name"] == uuid and entry["actions"] == ["compute_mode", "power_limit", "app_clocks"]
    assert entry["before"] == {"compute_mode": "Exclusive_Process", "power_limit": 350.0, "app_clocks": {"graphics": 1410, "memory": 2619}}
    restore = run_module(host, "gpu_restore", {})
    assert not restore.failed, restore.msg
    assert restore["restored_gpu_settings"] == [f"GPU 1 ({uuid}): compute mode Exclusive_Process, power limit 350 W, application clocks 2619,1410 MHz"]
    assert _setters(host)[3:] == [f"-i {uuid} -c 3", f"-i {uuid} -pl 350", f"-i {uuid} -ac 2619,1410"]
    now = _settings(host)[uuid]
    assert now["compute_mode"] == "Exclusive_Process" and now["power.limit"] == "350.00" and now["clocks.applications.graphics"] == "1410"
    assert run_module(host, "gpu_facts", {})["ansible_facts"]["gpu"]["pending_restore"] is None


def test_a_clock_lock_is_removed_and_restore_says_it_does_not_lock_it_again(nshost):
    host = nshost("h200x2", seed="ready04")
    uuid = host.config["gpus"][0]["uuid"]
    _settings(host, {uuid: {"locked_gpu": "1200,1200"}})
    run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5, "ready_fix": True})
    assert run["ready_fixed"][0]["changes"] == ["clock lock removed"] and run["healthy"] is True, run["health_issues"]
    assert _setters(host) == [f"-i {uuid} -rgc -rmc"]
    restore = run_module(host, "gpu_restore", {})
    assert not restore.failed, restore.msg
    assert any("not locked again" in w for w in restore.get("warnings", [])), restore.result


def test_the_simulated_setters_refuse_an_unprivileged_user_as_the_driver_does(nshost):
    """Who else could change these settings: only root. The simulated driver refuses an unprivileged
    caller's setter as a real one does (rc 4, Insufficient Permissions) and changes nothing, so that a
    test of ready_fix exercises what root alone can do."""
    host = nshost("h200x2", seed="ready05")
    uuid = host.config["gpus"][0]["uuid"]
    _settings(host, {uuid: {"compute_mode": "Prohibited"}})
    done = host.run(["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "nvidia-smi", "-i", "0", "-c", "0"])
    assert done.returncode == 4 and "Insufficient Permissions" in done.stdout
    assert _settings(host)[uuid]["compute_mode"] == "Prohibited" and _setters(host) == []


def test_the_audit_shows_a_gpu_off_the_profile(h200x2):
    """gpu_facts' answer of a host whose GPU 1 was left in Exclusive_Process, through the audit's model
    (plugin_utils/_audit_model, what playbooks/audit_gpus.yml reports): GPU 1 unhealthy, the host's
    health reason naming the GPU and the setting."""
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _audit_model

    h200x2.clear_faults()
    h200x2.set_fault({"field_values": {"1": {"compute_mode": "Exclusive_Process"}}})
    try:
        facts = run_module(h200x2, "gpu_facts", {})["ansible_facts"]["gpu"]
    finally:
        h200x2.clear_faults()
    [record] = _audit_model.model_of([{"host": "node01", "status": "ok", "gpu": facts}])["hosts"]
    assert record["unhealthy_gpus"] == [1], record
    assert record["health_reason"].startswith("GPU 1 (00000000:00:07.0): compute mode is Exclusive_Process, expected Default"), record
    assert record["gpus"][1]["health_issues"][0].startswith("compute mode is Exclusive_Process"), record["gpus"][1]
