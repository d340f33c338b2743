"""Typos stop the play before anything is done (issue 55), through the role in a user's own play
(playbooks/example_training.yml) over real SSH on the fleet's systemd hosts: a misspelled
free_gpus_* variable fails every host that has it; a free_gpus_services entry that matches nothing
on any host of the play fails the play before any host acts, with the closest unit that exists;
one that matches on some hosts only is how a mixed fleet looks, and says nothing.
Works on a fleet of 3 hosts (ZEROMIB_FLEET_HOSTS=3)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from scenarios import PLAYBOOK, TRAINING, summary_lines, summary_row, summary_status
from test_failure_paths import counts, fatal_lines, host_vars, recap
from test_failure_paths import trio  # noqa: F401  # pylint: disable=unused-import  # a pytest fixture, used by name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

VERDICT = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
MARKER = "/run/zeromib-training-started"
CORES = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.19."))]
# The oldest ansible-core the collection supports and the newest.
ENDS = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
WRONG_TYPE = "free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"
TYPO = "free_gpus_servic_state is not a variable of the zeromib.gpu.free_gpus role; did you mean free_gpus_service_state?"


@pytest.fixture
def busy(trio):
    """vLLM runs on the first host, an enabled SGLang on the second; the MIG host's baseline set."""
    fleet, (vllm, sglang), mig = trio
    fleet.rig.write_baselines()
    fleet.workload(vllm, "vllm")
    fleet.workload(sglang, "sglang")
    yield fleet, vllm, sglang, mig
    fleet.ssh_all(f"rm -f {MARKER}")


def untouched(fleet, vllm: str, sglang: str) -> None:
    assert fleet.ssh(vllm, "systemctl is-active vllm.service").stdout.strip() == "active"
    assert fleet.ssh(sglang, "systemctl is-active sglang.service; systemctl is-enabled sglang.service").stdout.split() == ["active", "enabled"]
    assert not any(r.returncode == 0 for r in fleet.ssh_all(f"test -e {MARKER}").values()), "training started somewhere"


def test_a_misspelled_variable_fails_every_host_that_has_it_and_nothing_is_done(busy):
    fleet, vllm, sglang, mig = busy
    hosts = [vllm, sglang, mig]
    run = fleet.ansible_playbook(TRAINING, limit=hosts, extra_vars={"training_command": f"touch {MARKER}",
                                                                    "free_gpus_servic_state": "disabled"})
    assert run.rc == 2, run
    said = ("settings mistake, nothing was done: free_gpus_servic_state is not a variable of the zeromib.gpu.free_gpus role; "
            "did you mean free_gpus_service_state?")
    # said once (issue 67): the first host of the play says it, the others point to a host before
    # them in the play's order that has the same mistake (the first one, unless its outcome had not
    # reached that host's verdict yet: then the next, whose own line points on to the first)
    ordered = sorted(hosts)  # the inventory lists the fleet in name order
    for position, host in enumerate(ordered):
        assert recap(run, host) == counts(ok=2, failed=1), run.stdout
        [fatal] = fatal_lines(run, host)
        if position == 0:
            assert f'"msg": "{host}: {said}"' in fatal, fatal
        else:
            assert any(f'"msg": "{host}: settings mistake, nothing was done: the same as {earlier} (free_gpus_servic_state), whose line says it"'
                       in fatal for earlier in ordered[:position]), fatal
    assert (run.stdout + run.stderr).count("free_gpus_servic_state is not a variable") == 1
    untouched(fleet, vllm, sglang)


@pytest.mark.parametrize(("core", "python"), CORES, ids=[f"ansible-core-{c}" for c, _p in CORES])
def test_a_services_entry_no_host_matches_fails_the_play_before_any_host_acts(busy, core, python):
    fleet, vllm, sglang, mig = busy
    hosts = [vllm, sglang, mig]
    bin_dir = matrix.controller_bin(core, python)
    services = ["vllm*.service", "sglang.service", "vllm-server.service"]
    run = fleet.ansible_playbook(TRAINING, limit=hosts, bin_dir=bin_dir, env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
                                 extra_vars={"training_command": f"touch {MARKER}", "free_gpus_services": services})
    assert run.rc == 2, run
    said = ("settings mistake, nothing was done: free_gpus_services: vllm-server.service matches no unit, container or supervisord program "
            "on any host of the play; did you mean vllm.service?")
    for host in hosts:
        # the gate held it back (nothing done), the verdict fails it: one line each
        assert recap(run, host) == counts(ok=2, failed=1), run.stdout
        assert run.result(VERDICT, host)["msg"] == f"{host}: {said}"
        assert len(fatal_lines(run, host)) == 1
    out = run.stdout + run.stderr
    assert "on this host" not in out and "censored" not in out, out[-3000:]
    untouched(fleet, vllm, sglang)


def test_an_entry_that_matches_on_some_hosts_only_is_a_mixed_fleet_and_every_host_is_freed(busy):
    fleet, vllm, sglang, mig = busy
    hosts = [vllm, sglang, mig]
    try:
        # tgi.service exists on the MIG host only
        assert fleet.ssh(mig, "printf '[Service]\\nExecStart=/bin/sleep infinity\\n' > /etc/systemd/system/tgi.service && "
                              "systemctl daemon-reload").returncode == 0
        run = fleet.ansible_playbook(TRAINING, limit=hosts, extra_vars={
            "training_command": f"touch {MARKER}", "free_gpus_services": ["vllm*.service", "sglang.service", "tgi.service"]})
        assert run.rc == 0, run
        for host in hosts:
            assert recap(run, host)["failed"] == 0, run.stdout
        # the hosts without tgi.service were held back by the gate and freed by the verdict
        assert run.result(VERDICT, vllm)["msg"].startswith(f"{vllm}: 8 GPUs free") and "vllm.service" in run.result(VERDICT, vllm)["msg"]
        assert run.result(VERDICT, vllm)["ansible_facts"]["free_gpus_result"]["stopped_units"] == ["vllm.service"]
        assert "sglang.service" in run.result(VERDICT, sglang)["ansible_facts"]["free_gpus_result"]["disabled_units"]
        out = " ".join((run.stdout + run.stderr).split())
        assert "tgi.service" not in out and "matches no unit" not in out, out[-3000:]
        assert all(r.returncode == 0 for r in fleet.ssh_all(f"test -e {MARKER}", hosts=hosts).values()), "training ran everywhere"
    finally:
        fleet.ssh(mig, "rm -f /etc/systemd/system/tgi.service && systemctl daemon-reload")


def test_a_misspelled_restore_or_slurm_variable_fails_the_host_before_anything_is_done(busy):
    fleet, vllm, _sglang, _mig = busy
    freed = fleet.ansible_playbook("playbooks/free_gpus.yml", limit=[vllm], extra_vars={"free_gpus_services": ["vllm*.service"]})
    assert freed.rc == 0, freed
    typo = fleet.ansible_playbook("playbooks/restore_gpus.yml", limit=[vllm], extra_vars={"restore_gpus_resume_drainned": True})
    assert typo.rc == 2, typo
    assert recap(typo, vllm)["failed"] == 1, typo.stdout
    [fatal] = fatal_lines(typo, vllm)
    assert ("settings mistake, nothing was done: restore_gpus_resume_drainned is not a variable of the zeromib.gpu.restore_gpus role; "
            "did you mean restore_gpus_resume_drained?") in fatal, fatal
    # nothing was put back yet; spelt right, it is
    assert fleet.ssh(vllm, "systemctl is-active vllm.service").stdout.strip() != "active"
    back = fleet.ansible_playbook("playbooks/restore_gpus.yml", limit=[vllm])
    assert back.rc == 0 and fleet.ssh(vllm, "systemctl is-active vllm.service").stdout.strip() == "active", back
    slurm = fleet.ansible_playbook([{"name": "Slurm hooks", "hosts": vllm, "gather_facts": False, "become": True, "tasks": [
        {"name": "The role", "ansible.builtin.include_role": {"name": "zeromib.gpu.slurm_gpu_checks"},
         "vars": {"slurm_gpu_checks_stat": "absent"}}]}])
    assert slurm.rc == 2 and recap(slurm, vllm)["failed"] == 1, slurm
    assert ("settings mistake, nothing was done: slurm_gpu_checks_stat is not a variable of the zeromib.gpu.slurm_gpu_checks role; "
            "did you mean slurm_gpu_checks_state?") in fatal_lines(slurm, vllm)[0]


@pytest.mark.parametrize(("core", "python"), CORES, ids=[f"ansible-core-{c}" for c, _p in CORES])
def test_a_wrong_type_for_restore_or_slurm_is_said_in_the_collections_words_with_ansibles_validation_on(busy, core, python):
    """Issue 55, point 5 for the other roles: with Ansible's role argument validation on (the
    default; restore_gpus.yml imports the role, the Slurm play includes it), a value of the wrong
    type fails the host before anything is done with the collection's line, not Ansible's (a Python
    class name and a dump of the specification)."""
    fleet, vllm, _sglang, _mig = busy
    bin_dir = matrix.controller_bin(core, python)
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}
    freed = fleet.ansible_playbook("playbooks/free_gpus.yml", limit=[vllm], extra_vars={"free_gpus_services": ["vllm*.service"]})
    assert freed.rc == 0, freed
    typed = fleet.ansible_playbook("playbooks/restore_gpus.yml", limit=[vllm], bin_dir=bin_dir, env=env,
                                   extra_vars={"restore_gpus_step_timeout": "2m"})
    assert typed.rc == 2 and recap(typed, vllm)["failed"] == 1, typed
    [fatal] = fatal_lines(typed, vllm)
    said = "settings mistake, nothing was done: restore_gpus_step_timeout must be a number of seconds (e.g. 120), got '2m'"
    assert said in fatal, fatal
    out = typed.stdout + typed.stderr
    for bad in ("Tagged", "<class", "argument_spec_data", "censored", "[ERROR]", "Origin:"):
        assert bad not in out, (bad, out[-3000:])
    assert out.count("restore_gpus_step_timeout must be") == 1, out[-3000:]
    # nothing was put back
    assert fleet.ssh(vllm, "systemctl is-active vllm.service").stdout.strip() != "active"
    slurm = fleet.ansible_playbook([{"name": "Slurm hooks", "hosts": vllm, "gather_facts": False, "become": True, "tasks": [
        {"name": "The role", "ansible.builtin.include_role": {"name": "zeromib.gpu.slurm_gpu_checks"},
         "vars": {"slurm_gpu_checks_prolog_epilog_timeout": "1m", "slurm_gpu_checks_state": "absent"}}]}], bin_dir=bin_dir, env=env)
    assert slurm.rc == 2 and recap(slurm, vllm)["failed"] == 1, slurm
    [fatal] = fatal_lines(slurm, vllm)
    assert ("settings mistake, nothing was done: slurm_gpu_checks_prolog_epilog_timeout must be a whole number of seconds (e.g. 120), "
            "got '1m'") in fatal, fatal
    out = slurm.stdout + slurm.stderr
    for bad in ("Tagged", "<class", "argument_spec_data", "censored", "[ERROR]", "Origin:"):
        assert bad not in out, (bad, out[-3000:])
    assert out.count("slurm_gpu_checks_prolog_epilog_timeout must be") == 1, out[-3000:]
    back = fleet.ansible_playbook("playbooks/restore_gpus.yml", limit=[vllm])
    assert back.rc == 0 and fleet.ssh(vllm, "systemctl is-active vllm.service").stdout.strip() == "active", back


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_a_mistake_in_one_hosts_variables_stops_every_host_before_any_acts(busy, core, python):
    """Issue 67: a wrong type on one host (its host_vars) and a typo on another stop every host of
    the play before any acts, through the role in a user's own play (any_errors_fatal) and through
    free_gpus.yml; the good host's servers still run, and every host's line names the offending
    hosts and variables first, each mistake said whole once."""
    fleet, vllm, sglang, mig = busy
    hosts = [vllm, sglang, mig]
    host_vars(fleet, sglang, {"free_gpus_wait_timeout": "2m"})
    host_vars(fleet, mig, {"free_gpus_servic_state": "disabled"})
    bin_dir = matrix.controller_bin(core, python)
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}
    offenders = sorted([sglang, mig])
    variables = {sglang: "free_gpus_wait_timeout", mig: "free_gpus_servic_state"}
    elsewhere = (f"{vllm}: settings mistake on {', '.join(offenders)} ({', '.join(variables[h] for h in offenders)}), "
                 "nothing was done on any host of the play; their lines say what to fix")
    own = {sglang: f"{sglang}: settings mistake, nothing was done: {WRONG_TYPE}", mig: f"{mig}: settings mistake, nothing was done: {TYPO}"}

    run = fleet.ansible_playbook(TRAINING, limit=hosts, bin_dir=bin_dir, env=env, extra_vars={"training_command": f"touch {MARKER}"})
    assert run.rc == 2, run
    for host in hosts:
        assert recap(run, host) == counts(ok=2, failed=1), run.stdout
        assert run.result(VERDICT, host)["msg"] == (elsewhere if host == vllm else own[host]), run.result(VERDICT, host)
    out = run.stdout + run.stderr
    assert out.count(WRONG_TYPE) == 1 and out.count("free_gpus_servic_state is not a variable") == 1, out[-4000:]
    # the first failure line the user reads names an offending host and its variable
    first = next(line for line in run.stdout.splitlines() if line.startswith("fatal: "))
    assert any(h in first and variables[h] in first for h in offenders), first
    assert "play stops here" not in out and "censored" not in out and "Origin:" not in out, out[-4000:]
    untouched(fleet, vllm, sglang)

    run = fleet.ansible_playbook(PLAYBOOK, limit=hosts, bin_dir=bin_dir, env=env)
    assert run.rc == 2, run
    lines = summary_lines(run)
    assert lines, run
    for host in hosts:
        assert summary_status(lines, host) == "invalid", lines
        assert len(fatal_lines(run, host)) == 1, run.stdout[-4000:]
    assert f"settings mistake on {', '.join(offenders)}" in summary_row(lines, vllm), lines
    assert WRONG_TYPE in summary_row(lines, sglang) and TYPO in summary_row(lines, mig), lines
    out = run.stdout + run.stderr
    assert out.count(WRONG_TYPE) == 1 and out.count("free_gpus_servic_state is not a variable") == 1, out[-4000:]
    untouched(fleet, vllm, sglang)
