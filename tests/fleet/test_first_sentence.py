"""When something is off, the first sentence is the right one (issue 32): real ansible-playbook over
SSH on the fleet's systemd hosts, one host wrong one way next to hosts that are fine.

Each test asserts the recap of EVERY host, the FIRST sentence of the failing host's message (its
line in free_gpus.yml's summary, or Ansible's [ERROR] line when the role runs in a user's own play)
and how many times that message is printed. Works on a fleet of 3 hosts (ZEROMIB_FLEET_HOSTS=3)."""
from __future__ import annotations

import json
import re

import pytest

from scenarios import PLAYBOOK, TRAINING, summary_lines, summary_row, summary_status
from test_failure_paths import ALL_FREE, FREE, NOT_FREE, counts, expect, fatal_lines, host_vars, recap
from test_failure_paths import trio  # noqa: F401  # pylint: disable=unused-import  # a pytest fixture, used by name

USER = "zmuser"


def message_of(lines: list[str], host: str) -> str:
    """The message of HOST's summary line: what follows `HOST: ` after the columns."""
    row = summary_row(lines, host)
    assert row and f"{host}: " in row, lines
    return row.split(f"{host}: ", 1)[1]


def first_sentence(message: str) -> str:
    return re.split(r"[:;] ", message, maxsplit=1)[0]


def errors(run) -> list[str]:
    """Ansible's [ERROR] lines (2.19 prints one per failed task)."""
    return [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("[ERROR]")]


@pytest.fixture
def unprivileged(trio):
    """The trio, with a real unprivileged user (USER, the fleet's SSH key, no sudo on the hosts)."""
    fleet, plain, mig = trio
    key = "/root/.ssh/authorized_keys"
    for host in fleet.names:
        done = fleet.ssh(host, f"id {USER} >/dev/null 2>&1 || useradd -m {USER}; install -d -m 700 -o {USER} ~{USER}/.ssh; "
                               f"install -m 600 -o {USER} {key} ~{USER}/.ssh/authorized_keys; ! command -v sudo")
        assert done.returncode == 0, (host, done.stdout, done.stderr)
    return fleet, plain, mig


def test_not_root_is_said_first_and_no_reset_is_advised(unprivileged):
    """(1) ansible_user=USER, become false: a GPU that root's training holds is not "leaked"."""
    fleet, (busy, idle), _mig = unprivileged
    fleet.workload(busy, "train", gpus="0", mib=8009)
    for check in (False, True):
        run = fleet.ansible_playbook(PLAYBOOK, limit=[busy, idle], check=check,
                                     extra_vars={"ansible_user": USER, "ansible_become": False})
        assert run.rc == 2, run
        expect(run, busy, NOT_FREE)
        expect(run, idle, FREE)
        lines = summary_lines(run)
        said = message_of(lines, busy)
        assert first_sentence(said) == "cannot see other users' processes", said
        assert said.startswith("cannot see other users' processes: run as root (become: true); could not read the open files of "), said
        assert "reset" not in said and "reboot" not in said and "set free_gpus_max_used_mib" not in said, said
        assert re.search(r"GPU 0 \([^)]*\) reads 80\d\d MiB", said), said
        # said once: in the summary; the permission warning is not repeated for that host
        assert run.stdout.count("cannot see other users' processes") == 1, run.stdout[-4000:]
        assert f"{busy}: could not read the open files" not in run.stdout + run.stderr
        assert summary_status(lines, idle) == "clean", lines
    # as root the same host is freed: the advice was the right one
    run = fleet.ansible_playbook(PLAYBOOK, limit=[busy, idle])
    assert run.rc == 0 and summary_status(summary_lines(run), busy) == "freed", run


def test_no_sudo_and_a_missing_python_show_their_cause_not_a_deserialization_error(unprivileged):
    """(2) become through a sudo that is not installed, and a Python that is not there."""
    fleet, (nosudo, nopython), mig = unprivileged
    host_vars(fleet, nosudo, {"ansible_user": USER})
    host_vars(fleet, nopython, {"ansible_python_interpreter": "/usr/bin/python3.13"})
    fleet.rig.write_baselines()
    run = fleet.ansible_playbook(PLAYBOOK, limit=[nosudo, nopython, mig])
    assert run.rc == 2, run
    for host in (nosudo, nopython):
        expect(run, host, NOT_FREE)
    expect(run, mig, FREE)
    lines = summary_lines(run)
    sudo = message_of(lines, nosudo)
    assert sudo.startswith("the module could not start on this host: /bin/sh: 1: sudo: not found (rc 127); sudo is not installed"), sudo
    python = message_of(lines, nopython)
    assert python.startswith("the module could not start on this host: /bin/sh: 1: /usr/bin/python3.13: not found (rc 127); "
                             "no working Python"), python
    assert "ansible_python_interpreter" in python
    out = run.stdout + run.stderr
    assert "deserialization" not in out and "No start of json char" not in out, out[-3000:]
    for host, text in ((nosudo, "sudo: not found"), (nopython, "python3.13: not found")):
        assert out.count(text) == 1, (host, out[-4000:])
        # no GPU read: "-", never "0/0"
        assert summary_row(lines, host).split()[2] == "-", lines


def test_a_wrong_type_is_one_line_naming_the_variable_once_and_not_not_free(trio):
    """(5) free_gpus_wait_timeout=2m."""
    fleet, (good, bad), mig = trio
    fleet.rig.write_baselines()
    host_vars(fleet, bad, {"free_gpus_wait_timeout": "2m"})
    run = fleet.ansible_playbook(PLAYBOOK, limit=[good, bad, mig])
    assert run.rc == 2, run
    # issue 67: every host stops before any acts; the others' first sentence names the host and the variable
    for host in (bad, good, mig):
        expect(run, host, NOT_FREE)
    lines = summary_lines(run)
    assert summary_status(lines, bad) == "invalid", lines
    assert message_of(lines, bad) == "settings mistake, nothing was done: free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"
    for host in (good, mig):
        assert first_sentence(message_of(lines, host)) == f"settings mistake on {bad} (free_gpus_wait_timeout), nothing was done on any host of the play"
    out = run.stdout + run.stderr
    assert "_AnsibleTaggedStr" not in out and "<class" not in out and "\\n" not in out, out[-3000:]
    assert out.count("free_gpus_wait_timeout must be") == 1, out[-3000:]
    for host in (bad, good, mig):
        fatal = fatal_lines(run, host)
        assert len(fatal) == 1 and "settings mistake, nothing was done (its line in the fleet summary above says why)" in fatal[0], fatal
        assert "not free" not in fatal[0]


def test_said_once_under_free_gpus_yml_and_in_a_users_own_play(trio):
    """(6) and (7): the MIG host with the default baseline; the fix named as the role's variable."""
    fleet, (good, _other), mig = trio
    run = fleet.ansible_playbook(PLAYBOOK, limit=[good, mig])
    assert run.rc == 2, run
    expect(run, mig, NOT_FREE)
    expect(run, good, FREE)
    said = message_of(summary_lines(run), mig)
    assert said.startswith("GPUs read above free_gpus_max_used_mib with no process holding them"), said
    # issue 55: with a margin over the exact reading, as the audit says it too
    assert "set free_gpus_max_used_mib: 64 (its 55 MiB reading with a margin; per host or group)" in said
    assert "role:" not in said and "set max_used_mib" not in said
    assert run.stdout.count("reads 55 MiB, and no process holds") == 2  # its two GPUs, in one line
    assert len([line for line in run.stdout.splitlines() if "reads 55 MiB" in line]) == 1, run.stdout[-4000:]
    assert "End the hosts whose GPUs are free" not in run.stdout and "free_gpus_result" not in run.stdout
    assert not errors(run) and "Origin:" not in run.stdout + run.stderr, errors(run)  # issue 55: the last task says one line a host
    # every host free: the play ends with one line after the summary
    fleet.rig.write_baselines()
    clean = fleet.ansible_playbook(PLAYBOOK, limit=[good, mig])
    assert clean.rc == 0, clean
    for host in (good, mig):
        expect(clean, host, ALL_FREE)
    assert clean.stdout.count("TASK [End the play, every reachable host's GPUs are free]") == 1, clean.stdout[-2000:]
    assert "End the hosts" not in clean.stdout and "Fail the hosts" not in clean.stdout
    # the role in the user's own play (pre_tasks, any_errors_fatal): the verdict's one fatal line
    # with the reason (what a rescue around the role reads), no [ERROR] excerpt, nothing censored (issue 55)
    fleet.remove_group_vars("a100_mig")
    own = fleet.ansible_playbook(TRAINING, limit=[good, mig], extra_vars={"training_command": "true"})
    assert own.rc == 2, own
    assert recap(own, mig) == counts(ok=2, failed=1), own.stdout
    assert recap(own, good) == counts(ok=3), own.stdout
    [fatal] = fatal_lines(own, mig)
    assert fatal.startswith(f'fatal: [{mig}]: FAILED! => {{"changed": false, "msg": "{mig}: GPUs read above free_gpus_max_used_mib'), fatal
    assert not errors(own) and "censored" not in own.stdout + own.stderr and "Origin:" not in own.stdout + own.stderr
    assert "free_gpus_result" not in own.stdout and "memory_total_mib" not in own.stdout
    assert len([line for line in own.stdout.splitlines() if "reads 55 MiB" in line]) == 1, own.stdout[-4000:]


def test_role_messages_name_role_variables_and_the_modules_name_its_options(trio):
    """(7) the same MIG host through gpu_release directly: the module's option, with the role's name."""
    fleet, _plain, mig = trio
    run = fleet.ansible(mig, "zeromib.gpu.gpu_release", {"max_used_mib": 0})
    text = run.stdout + run.stderr
    # issue 55: the module gives the same margin as the role and the audit
    assert "set max_used_mib: 64 (its 55 MiB reading with a margin; role: free_gpus_max_used_mib, per host or group)" in text, text[-3000:]


def test_the_audit_honours_the_roles_baseline_when_its_own_is_unset_and_its_own_wins(trio, tmp_path):
    """(3) One baseline: free_gpus_max_used_mib: 64 alone makes the idle MIG host clean in the audit
    too; gpu_audit_max_used_mib, when set, wins."""
    fleet, (good, _other), mig = trio
    fleet.write_group_vars("a100_mig", {"free_gpus_max_used_mib": 64})
    freed = fleet.ansible_playbook(PLAYBOOK, limit=[good, mig])
    assert freed.rc == 0, freed
    for host in (good, mig):
        expect(freed, host, ALL_FREE)

    def audit(name: str, extra: dict) -> dict:
        run = fleet.ansible_playbook("playbooks/audit_gpus.yml", limit=[good, mig], extra_vars={
            "gpu_audit_fail_on_dirty": True, "gpu_audit_report_dir": str(tmp_path / name), **extra})
        report = json.loads((tmp_path / name / "report.json").read_text())
        return {"rc": run.rc, "status": {h["host"]: h["status"] for h in report["hosts"]}}

    assert audit("role", {}) == {"rc": 0, "status": {good: "clean", mig: "clean"}}
    # the audit's own variable wins over the role's
    assert audit("own", {"gpu_audit_max_used_mib": 0}) == {"rc": 2, "status": {good: "clean", mig: "dirty"}}


def test_strict_fails_a_host_for_a_services_entry_that_matches_nothing_there_before_anything_is_done(trio):
    """(4) free_gpus_strict keeps its per-host meaning: an entry that matches nothing on this host fails
    it, even where another host matches it; without it, that is no mistake in a mixed fleet (issue 55)."""
    fleet, (strict, lax), mig = trio
    fleet.rig.write_baselines()
    fleet.workload(strict, "vllm")
    try:
        assert fleet.ssh(mig, "printf '[Service]\\nExecStart=/bin/sleep infinity\\n' > /etc/systemd/system/tgi.service && "
                              "systemctl daemon-reload").returncode == 0
        for host in (strict, lax):
            host_vars(fleet, host, {"free_gpus_services": ["vllm*.service", "tgi.service"], "free_gpus_kill": False,
                                    **({"free_gpus_strict": True} if host == strict else {})})
        host_vars(fleet, mig, {"free_gpus_services": ["vllm*.service", "tgi.service"]})
        run = fleet.ansible_playbook(PLAYBOOK, limit=[strict, lax, mig])
        assert run.rc == 2, run
        expect(run, strict, NOT_FREE)
        for host in (lax, mig):
            expect(run, host, FREE)
        lines = summary_lines(run)
        assert message_of(lines, strict) == ("settings mistake, nothing was done (free_gpus_strict): free_gpus_services: tgi.service matches "
                                             "no unit, container or supervisord program on this host"), lines
        assert summary_status(lines, strict) == "invalid"
        # nothing was done there: vllm still runs
        assert fleet.ssh(strict, "systemctl is-active vllm.service").stdout.strip() == "active"
        assert run.stdout.count(f"{strict}: settings mistake, nothing was done (free_gpus_strict)") == 1
        # no line about tgi.service for the hosts that lack it: it matches on the MIG host
        assert "matches no unit" not in " ".join((run.stdout + run.stderr).replace(message_of(lines, strict), "").split()), run.stdout[-3000:]
    finally:
        fleet.ssh(mig, "rm -f /etc/systemd/system/tgi.service && systemctl daemon-reload")


RESTORE = "playbooks/restore_gpus.yml"
VERDICT = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
SAY_RESTORED = "zeromib.gpu.restore_gpus : Say what was put back"
RESTORE_SUMMARY = "Fleet restore summary (unreachable and failed hosts first)"


def test_restore_says_what_it_put_back_per_host_and_any_errors_fatal_says_how(trio):
    """(8) A freed host stopped by another host's failure is told how to restore; restore_gpus.yml
    then says, per host, what it put back."""
    fleet, (served, leaky), mig = trio
    fleet.rig.write_baselines()
    fleet.workload(served, "vllm")
    fleet.set_fault(leaky, leak={"0": 1500})
    run = fleet.ansible_playbook(TRAINING, limit=[served, leaky, mig], extra_vars={"training_command": "true"})
    assert run.rc == 2, run
    assert recap(run, leaky)["failed"] == 1 and recap(run, served)["failed"] == 0 and recap(run, mig)["failed"] == 0, run.stdout
    said = run.result(VERDICT, served)["msg"]
    assert said.startswith(f"{served}: its GPUs are free, but the play stops here because {leaky} failed (any_errors_fatal)"), said
    assert said.endswith(f"put it back with `ansible-playbook playbooks/restore_gpus.yml -l {served}` (or the zeromib.gpu.restore_gpus role)")
    # nothing was stopped on the MIG host: no restore advice there
    assert "restore_gpus" not in run.result(VERDICT, mig)["msg"]
    assert fleet.ssh(served, "systemctl is-active vllm.service").stdout.strip() != "active"
    fleet.clear_faults(leaky)
    back = fleet.ansible_playbook(RESTORE, limit=[served, leaky, mig])
    assert back.rc == 0, back
    for host in (served, leaky, mig):
        assert recap(back, host)["failed"] == 0, back.stdout
    # issue 55: one summary, as free_gpus.yml's (was a task per host saying it, and 16 skipping lines)
    lines = back.result(RESTORE_SUMMARY, served)["msg"]
    quiet = sorted([leaky, mig])
    assert [line.split()[:3] for line in lines[1:4]] == [["put", "back", served], ["nothing", quiet[0], "-"], ["nothing", quiet[1], "-"]], lines
    assert lines[1].endswith("unit vllm.service (start)") and lines[-1] == "3 hosts: 1 put back, 2 nothing", lines
    assert back.stdout.count("unit vllm.service (start)") == 1
    assert [t["status"] for t in back.results(SAY_RESTORED)] == ["skipped"] * 3
    assert fleet.ssh(served, "systemctl is-active vllm.service").stdout.strip() == "active"


def test_an_unreachable_host_points_to_its_ssh_error_and_a_wrong_index_is_a_clear_error_not_0_of_0(trio):
    """(9) Words with a key: the summary's unreachable line says where the SSH error is; a GPU index
    the host does not have is named, with the host's indexes, and GPUS reads "-" (was 0/0)."""
    fleet, (down, wrong), mig = trio
    fleet.rig.write_baselines()
    host_vars(fleet, wrong, {"free_gpus_gpus": [99]})
    with fleet.unreachable(down):
        run = fleet.ansible_playbook(PLAYBOOK, limit=[down, wrong, mig])
    assert run.rc == 4, run
    expect(run, down, counts(unreachable=1))
    expect(run, wrong, NOT_FREE)
    expect(run, mig, FREE)
    lines = summary_lines(run)
    # issue 55: the line quotes the SSH error the gate's registered result holds
    unreachable = message_of(lines, down)
    assert unreachable.startswith("unreachable, or failed before gpu_release ran: ") and "can be reached over ssh" in unreachable, lines
    assert lines[-1].startswith(f"3 hosts: 1 unreachable ({down})"), lines
    assert re.search(rf"^fatal: \[{re.escape(down)}\]: UNREACHABLE! .*ssh", run.stdout, re.M | re.I), run.stdout[-3000:]
    said = message_of(lines, wrong)
    assert said.startswith("GPU '99' is not on this host: it has indexes 0, 1"), said
    assert summary_row(lines, wrong).split()[2] == "-" and "0/0" not in summary_row(lines, wrong), lines
    assert run.stdout.count("GPU '99' is not on this host") == 1
