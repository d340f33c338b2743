"""Said once, seen by every consumer (issue 55): the role in a user's own play, as the README shows it
(playbooks/example_training.yml), on the oldest supported ansible-core and the newest, over real
SSH on the fleet's systemd hosts: each failing host's reason is its one failure line, printed
once, with no `censored` line and no `Origin:` excerpt; the json-recording callback and
ansible-runner's job events receive that same reason; a rescue around the role reads it in
ansible_failed_result.msg. Works on a fleet of 3 hosts (ZEROMIB_FLEET_HOSTS=3)."""
from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from scenarios import TRAINING
from test_failure_paths import counts, fatal_lines, host_vars, recap
from test_failure_paths import trio  # noqa: F401  # pylint: disable=unused-import  # a pytest fixture, used by name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

GATE = "zeromib.gpu.free_gpus : Free the GPUs and verify that they read at most the baseline"
VERDICT = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
# The oldest ansible-core the collection supports, the main venv's, and the newest.
CORES = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.19.", "2.21."))]
LEAK = "reads 1500 MiB, and no process of this container holds it"
WRONG_TYPE = "settings mistake, nothing was done: free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"


@pytest.fixture
def one_of_each(trio):
    """The trio's first host clean, its second with leaked memory, the MIG host (its baseline set)
    with a wrong type."""
    fleet, (good, leaky), mig = trio
    fleet.rig.write_baselines()
    fleet.set_fault(leaky, leak={"0": 1500})
    host_vars(fleet, mig, {"free_gpus_wait_timeout": "2m"})
    yield fleet, good, leaky, mig
    fleet.clear_faults(leaky)


def elsewhere(mig: str) -> str:
    """What a host says whose play another host's mistake stopped (issue 67)."""
    return f"settings mistake on {mig} (free_gpus_wait_timeout), nothing was done on any host of the play; its line says what to fix"


def reasons(good: str, leaky: str, mig: str) -> dict[str, str]:
    """Every host's one reason: the MIG host's wrong type stops the play before any host acts, so
    the leak is never even looked at (issue 67)."""
    return {good: f"{good}: {elsewhere(mig)}", leaky: f"{leaky}: {elsewhere(mig)}", mig: f"{mig}: {WRONG_TYPE}"}


def assert_said_once(out: str, fatal: dict[str, list[str]], why: dict[str, str]) -> None:
    """One failure line per failing host, with its reason as msg; the reason nowhere else."""
    for host, reason in why.items():
        assert len(fatal[host]) == 1, (host, fatal[host], out[-4000:])
        head, _arrow, shown = fatal[host][0].partition(" => ")
        assert head == f"fatal: [{host}]: FAILED!" and json.loads(shown)["msg"].startswith(reason), fatal[host]
        # the reason and nothing more (2.21 also shows "failed": true)
        assert set(json.loads(shown)) <= {"changed", "failed", "msg"}, fatal[host]
    # nothing acted, nothing looked: the leak is not said; the mistake is, once
    assert out.count(LEAK) == 0 and out.count(WRONG_TYPE) == 1, out[-4000:]
    assert "censored" not in out and "Origin:" not in out and "[ERROR]" not in out, out[-4000:]
    assert "memory_total_mib" not in out and "free_gpus_result" not in out, out[-4000:]


@pytest.mark.parametrize(("core", "python"), CORES, ids=[f"ansible-core-{c}" for c, _p in CORES])
def test_each_failing_host_says_its_reason_once_in_the_terminal_and_in_the_json_callback(one_of_each, core, python):
    fleet, good, leaky, mig = one_of_each
    bin_dir = matrix.controller_bin(core, python)
    run = fleet.ansible_playbook(TRAINING, limit=[good, leaky, mig], bin_dir=bin_dir, env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
                                 extra_vars={"training_command": "true"})
    assert run.rc == 2, run
    why = reasons(good, leaky, mig)
    out = run.stdout + run.stderr
    assert_said_once(out, {host: fatal_lines(run, host) for host in why}, why)
    for host in why:
        # the include and the gate, which records the outcome; then the verdict fails the host
        assert recap(run, host) == counts(ok=2, failed=1), run.stdout
        failed = run.results(task=VERDICT, host=host)
        assert [r["status"] for r in failed] == ["failed"] and failed[0]["result"]["msg"].startswith(why[host]), failed
        assert "censored" not in json.dumps(run.results(host=host))
    assert "the play stops here" not in out, out[-3000:]
    assert not run.results(task="Start the training job")


RESCUED = [{
    "name": "A rescue around the role",
    "hosts": "gpu_nodes",
    "gather_facts": False,
    "become": True,
    "tasks": [{
        "name": "Free the GPUs",
        "block": [{"name": "The role", "ansible.builtin.include_role": {"name": "zeromib.gpu.free_gpus", "rolespec_validate": False}}],
        "rescue": [{"name": "Read why", "ansible.builtin.debug": {"msg": "rescued: {{ ansible_failed_result.msg }}"}}],
    }],
}]


@pytest.mark.parametrize(("core", "python"), CORES[:1] + CORES[-1:], ids=lambda v: f"ansible-core-{v}" if v.count(".") == 2 else v)
def test_a_rescue_around_the_role_reads_the_reason_in_ansible_failed_result(one_of_each, core, python):
    fleet, good, leaky, mig = one_of_each
    bin_dir = matrix.controller_bin(core, python)
    run = fleet.ansible_playbook(RESCUED, limit=[good, leaky, mig], bin_dir=bin_dir, env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"})
    assert run.rc == 0, run
    for host, reason in reasons(good, leaky, mig).items():
        assert run.result("Read why", host)["msg"].startswith(f"rescued: {reason}"), run.results(task="Read why")
        assert recap(run, host)["rescued"] == 1


@pytest.mark.parametrize(("core", "python"), CORES[:1] + CORES[1:2], ids=lambda v: f"ansible-core-{v}" if v.count(".") == 2 else v)
def test_ansible_runners_job_events_carry_each_reason_and_nothing_censored(one_of_each, tmp_path, core, python):
    """What AWX/AAP records: ansible-runner's events of the same play, with the ansible-playbook of
    the oldest supported ansible-core and of the main venv."""
    import ansible_runner

    fleet, good, leaky, mig = one_of_each
    bin_dir = matrix.controller_bin(core, python)
    data = tmp_path / "job"
    data.mkdir()
    env = {key: value for key, value in fleet._env(str(tmp_path / "unused.json")).items() if not key.startswith(("ANSIBLE_CALLBACK",))}
    env["PATH"] = f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"
    env.pop("ANSIBLE_LOAD_CALLBACK_PLUGINS", None)
    # ansible-runner starts the ansible-playbook its job's PATH finds (its own callback, awx_display, loads into it)
    assert shutil.which("ansible-playbook", path=env["PATH"]) == str(bin_dir / "ansible-playbook")
    r = ansible_runner.run(private_data_dir=str(data), project_dir=str(matrix.REPO), playbook=TRAINING, inventory=str(fleet.inventory),
                           limit=f"{good},{leaky},{mig}", envvars=env, extravars={"training_command": "true"}, quiet=True)
    assert r.rc == 2, r.stdout.read()[-4000:]
    events = list(r.events)
    assert events and "censored" not in json.dumps(events), [e for e in events if "censored" in json.dumps(e)][:2]
    failed = {e["event_data"]["host"]: e for e in events if e.get("event") == "runner_on_failed"}
    why = reasons(good, leaky, mig)
    assert set(failed) == set(why), sorted(failed)
    for host, reason in why.items():
        assert failed[host]["event_data"]["res"]["msg"].startswith(reason), failed[host]["event_data"]["res"]
        assert failed[host]["stdout"].count(reason) == 1 and "Origin:" not in failed[host]["stdout"], failed[host]["stdout"]


# The role with Ansible's own role argument validation on (rolespec_validate's default), as a user
# who copies the include without that line has it.
VALIDATED = [{
    "name": "Train, with Ansible's role argument validation",
    "hosts": "gpu_nodes",
    "gather_facts": False,
    "become": True,
    "any_errors_fatal": True,
    "pre_tasks": [{"name": "Free the GPUs", "ansible.builtin.include_role": {"name": "zeromib.gpu.free_gpus"},
                   "vars": {"free_gpus_services": ["vllm*.service"]}}],
}]


@pytest.mark.parametrize(("core", "python"), CORES, ids=[f"ansible-core-{c}" for c, _p in CORES])
def test_with_ansibles_role_validation_on_a_wrong_type_is_said_in_the_collections_words_first(trio, core, python):
    """Issue 55: the validation task's `_AnsibleTaggedStr` and 45 KB spec dump are gone; the
    collection's line is the host's one failure."""
    fleet, (good, wrong), choice = trio
    fleet.rig.write_baselines()
    host_vars(fleet, wrong, {"free_gpus_wait_timeout": "2m", "free_gpus_xid_ignore": ["x"]})
    host_vars(fleet, choice, {"free_gpus_service_state": "stoped"})
    bin_dir = matrix.controller_bin(core, python)
    run = fleet.ansible_playbook(VALIDATED, limit=[good, wrong, choice], bin_dir=bin_dir,
                                 env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"})
    assert run.rc == 2, run
    out = run.stdout + run.stderr
    assert "Validating arguments against arg spec 'main'" in out, "Ansible's validation task ran"
    for bad in ("_AnsibleTaggedStr", "<class", "argument_spec_data", "Validation of arguments failed", "censored", "Origin:"):
        assert bad not in out, (bad, out[-3000:])
    assert len(out) < 6000, f"{len(out)} characters: a spec dump?"
    said = {wrong: (f"{wrong}: settings mistake, nothing was done: free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'; "
                    'each entry of free_gpus_xid_ignore must be a whole number, got ["x"]'),
            choice: f"{choice}: settings mistake, nothing was done: value of free_gpus_service_state must be one of: stopped, disabled, masked, got: stoped"}
    # issue 67: the good host stops too, before it acts, naming the offending hosts and variables
    offenders = sorted([wrong, choice])
    names = {wrong: "free_gpus_wait_timeout, free_gpus_xid_ignore", choice: "free_gpus_service_state"}
    said[good] = (f"{good}: settings mistake on {', '.join(offenders)} ({', '.join(names[h] for h in offenders)}), nothing was done on any host "
                  "of the play; their lines say what to fix")
    for host, msg in said.items():
        [fatal] = fatal_lines(run, host)
        assert json.loads(fatal.partition(" => ")[2])["msg"] == msg, fatal
        # the validation task (ok), the include, the gate (ok: it records), then the verdict fails it
        assert recap(run, host) == counts(ok=3, failed=1), run.stdout


# --- restore_gpus (issue 71): a failed restore said once, on both paths.

RECORD = "/var/lib/zeromib-gpu/released.json"
RESTORE = "playbooks/restore_gpus.yml"
RESTORE_TASK = "zeromib.gpu.restore_gpus : Put back the units and containers gpu_release stopped, disabled or masked"
RESTORE_SUMMARY = "Fleet restore summary (unreachable and failed hosts first)"
# A unit a release stopped and someone removed before the restore: its start cannot succeed.
GONE = {"format": 1, "updated_at": "2026-12-07T00:00:00Z", "entries": [
    {"kind": "unit", "name": "zr-gone.service", "actions": ["stopped"], "active": True, "active_state": "active",
     "unit_file_state": "enabled", "gpu_indexes": [0], "released_at": "2026-12-07T00:00:00Z"}]}


@pytest.fixture
def broken_restore(trio):
    """The trio's first host with nothing to restore, its second with a record no restore can finish."""
    fleet, (good, broken), _mig = trio
    fleet.ssh(broken, f"mkdir -p -m 700 /var/lib/zeromib-gpu && printf %s {shlex.quote(json.dumps(GONE))} > {RECORD} && chmod 600 {RECORD}",
              check=True)
    try:
        yield fleet, good, broken
    finally:
        fleet.ssh_all(f"rm -f {RECORD}")


@pytest.mark.parametrize(("core", "python"), CORES, ids=[f"ansible-core-{c}" for c, _p in CORES])
def test_a_failed_restore_is_said_once_by_the_role_in_a_users_play_and_by_restore_gpus_yml(broken_restore, core, python):
    fleet, good, broken = broken_restore
    bin_dir = matrix.controller_bin(core, python)
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}

    # The role in a user's own play (the README's post_tasks): the reason is the host's one failure line.
    play = [{"hosts": f"{good},{broken}", "gather_facts": False, "become": True, "roles": ["zeromib.gpu.restore_gpus"]}]
    own = fleet.ansible_playbook(play, limit=[good, broken], bin_dir=bin_dir, env=env)
    assert own.rc == 2, own
    said = own.result(RESTORE_TASK, broken)["msg"]
    assert "zr-gone.service" in said, said
    reason = said.split("; ")[0]
    [fatal] = fatal_lines(own, broken)
    assert json.loads(fatal.partition(" => ")[2])["msg"] == said, fatal
    out = own.stdout + own.stderr
    assert out.count(reason) == 1, out[-4000:]
    assert "censored" not in out and "Origin:" not in out and "[ERROR]" not in out and "Traceback" not in out, out[-4000:]
    assert fatal_lines(own, good) == [] and f"{good}: nothing to put back" in out, out[-4000:]

    # restore_gpus.yml: the reason in the host's line of the fleet summary, then the host fails pointing there.
    run = fleet.ansible_playbook(RESTORE, limit=[good, broken], bin_dir=bin_dir, env=env)
    assert run.rc == 2, run
    said = run.result(RESTORE_TASK, broken)["msg"]
    reason = said.split("; ")[0]
    lines = run.result(RESTORE_SUMMARY, good)["msg"]
    row = next(line for line in lines if f" {broken} " in line)
    assert row.split()[0] == "failed" and row.split(f"{broken}  ", 1)[1].startswith(f"restore failed: {reason}"), lines
    [fatal] = fatal_lines(run, broken)
    assert json.loads(fatal.partition(" => ")[2])["msg"] == f"{broken}: restore failed (its line in the fleet restore summary above says why)"
    out = run.stdout + run.stderr
    assert out.count(reason) == 1, out[-4000:]
    assert "censored" not in out and "Origin:" not in out and "[ERROR]" not in out and "Traceback" not in out, out[-4000:]
    assert recap(run, broken)["failed"] == 1 and recap(run, good)["failed"] == 0, run.stdout[-2000:]
