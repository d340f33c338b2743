"""What the role says without -v (issue 67): a free host says its one line, a failure says the GPUs
one holder keeps once, a settings mistake of the whole play is said once, and a host without sudo
is said in the role's words, through the role in a user's own play as README.md shows it
(playbooks/example_training.yml, copied) and through free_gpus.yml, on the oldest and newest
supported ansible-core. Works on a fleet of 3 hosts (ZEROMIB_FLEET_HOSTS=3)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from scenarios import PLAYBOOK, summary_lines, summary_status
from test_failure_paths import host_vars, recap
from test_failure_paths import trio  # noqa: F401  # pylint: disable=unused-import  # a pytest fixture, used by name
from test_first_sentence import USER, unprivileged  # noqa: F401  # pylint: disable=unused-import  # a pytest fixture, used by name
from test_readme_play import readme_play

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

CORES = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
IDS = [f"ansible-core-{c}" for c, _p in CORES]
VERDICT = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"


def play(fleet, tmp_path, core: str, python: str, playbook: str, hosts: list[str], **kwargs):
    """PLAYBOOK ("readme": README.md's play copied into a folder of the user's; else a path) under ansible-core CORE."""
    bin_dir = matrix.controller_bin(core, python)
    if playbook == "readme":
        copied = tmp_path / "train.yml"
        copied.write_text(readme_play())
        playbook = copied
        kwargs.setdefault("extra_vars", {}).setdefault("training_command", "true")
    return fleet.ansible_playbook(playbook, limit=hosts, bin_dir=bin_dir, env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}, **kwargs)


def lines_with(run, text: str) -> list[str]:
    return [line for line in (run.stdout + run.stderr).splitlines() if text in line]


@pytest.mark.parametrize(("core", "python"), CORES, ids=IDS)
def test_a_free_host_says_its_one_line_without_v_in_a_users_play(trio, tmp_path, core, python):
    fleet, (served, idle), mig = trio
    fleet.rig.write_baselines()
    fleet.workload(served, "vllm")
    hosts = [served, idle, mig]
    run = play(fleet, tmp_path, core, python, "readme", hosts)
    assert run.rc == 0, run
    gpus = {h.name: h.gpu_count for h in fleet.hosts}
    for host in hosts:
        said = [line for line in run.stdout.splitlines() if line.startswith(f"{host}: ")]
        # one line, the verdict's result's message, and no JSON dump of the result
        assert len(said) == 1, run.stdout[-3000:]
        assert said[0] == run.result(VERDICT, host)["msg"], said
        assert re.fullmatch(rf"{re.escape(host)}: {gpus[host]} GPUs? free \(\d+ -> \d+ MiB\).* in [\d.]+ s", said[0]), said
    assert [line for line in run.stdout.splitlines() if line.startswith(f"{served}: ")][0].count("stopped vllm.service") == 1
    role = run.stdout.split("TASK [Start the training job]")[0]
    assert "\"msg\":" not in role and "free_gpus_result" not in role, role[-3000:]
    # under free_gpus.yml the fleet summary says each host's line, once
    fleet.workload(served, "vllm")
    summary = play(fleet, tmp_path, core, python, PLAYBOOK, hosts)
    assert summary.rc == 0, summary
    lines = summary_lines(summary)
    for host in hosts:
        assert summary_status(lines, host) in ("freed", "clean"), lines
        assert not [line for line in summary.stdout.splitlines() if line.startswith(f"{host}: ")], summary.stdout[-3000:]


@pytest.mark.parametrize(("core", "python"), CORES, ids=IDS)
def test_gpus_one_process_holds_are_said_once_with_the_process(trio, tmp_path, core, python):
    """free_gpus_kill: false with one process on two GPUs: one sentence for the process and its GPUs."""
    fleet, (busy, _idle), mig = trio
    fleet.rig.write_baselines()
    fleet.workload(busy, "train", gpus="0,1", mib=4000)
    for playbook in ("readme", PLAYBOOK):
        run = play(fleet, tmp_path, core, python, playbook, [busy, mig], extra_vars={"free_gpus_kill": False})
        assert run.rc == 2, run
        out = run.stdout + run.stderr
        said = lines_with(run, "kill=false leaves running") or lines_with(run, "free_gpus_kill: false leaves running")
        assert said, out[-3000:]
        assert re.search(r"GPUs 0,1 read \d+ MiB each \(\d+ MiB in all\), held by pid \d+ ", out), out[-3000:]
        assert len(re.findall(r"held by pid \d+", out)) == 1, out[-3000:]


@pytest.mark.parametrize(("core", "python"), CORES, ids=IDS)
def test_a_settings_mistake_of_the_whole_play_is_said_once(trio, tmp_path, core, python):
    """-e sets it for every host: one line says it; the other hosts point to it, and nothing is done anywhere."""
    fleet, (served, idle), mig = trio
    fleet.rig.write_baselines()
    fleet.workload(served, "vllm")
    hosts = [served, idle, mig]
    reason = "free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"
    for playbook in ("readme", PLAYBOOK):
        run = play(fleet, tmp_path, core, python, playbook, hosts, args=["-e", "free_gpus_wait_timeout=2m"])
        assert run.rc == 2, run
        out = run.stdout + run.stderr
        assert out.count(reason) == 1, (playbook, out[-4000:])
        # the other hosts name the variable and the host whose line says it
        pointers = lines_with(run, "settings mistake, nothing was done: the same as ")
        assert len(pointers) == 2 and all("(free_gpus_wait_timeout), whose line says it" in line for line in pointers), (playbook, out[-4000:])
        for host in hosts:
            assert recap(run, host)["failed"] == 1, run.stdout
        assert "censored" not in out and "Origin:" not in out
        assert fleet.ssh(served, "systemctl is-active vllm.service").stdout.strip() == "active", "vllm was stopped"


@pytest.mark.parametrize(("core", "python"), CORES, ids=IDS)
def test_no_sudo_is_said_in_the_roles_words_on_every_path_without_fact_gathering(unprivileged, tmp_path, core, python):
    fleet, (nosudo, _other), mig = unprivileged
    fleet.rig.write_baselines()
    host_vars(fleet, nosudo, {"ansible_user": USER})
    start = "the module could not start on this host: /bin/sh: 1: sudo: not found (rc 127); sudo is not installed"
    for playbook, check in (("readme", False), ("readme", True), (PLAYBOOK, False), (PLAYBOOK, True)):
        run = play(fleet, tmp_path, core, python, playbook, [nosudo, mig], check=check)
        assert run.rc == 2, run
        out = run.stdout + run.stderr
        assert "Premature end of stream" not in out and "deserialization" not in out, (playbook, check, out[-3000:])
        assert out.count(start) == 1, (playbook, check, out[-3000:])
        assert recap(run, mig)["failed"] == 0, run.stdout


@pytest.mark.parametrize(("core", "python"), CORES, ids=IDS)
def test_a_settings_mistake_on_one_host_is_the_first_thing_read(trio, tmp_path, core, python):
    """The README's play (any_errors_fatal), a wrong type in one host's variables: no host acts (issue 67), and whichever line
    Ansible prints first after the verdict's header names that host and the variable; the served host's vLLM still runs."""
    fleet, (served, wrong), mig = trio
    fleet.rig.write_baselines()
    fleet.workload(served, "vllm")
    host_vars(fleet, wrong, {"free_gpus_wait_timeout": "2m"})
    try:
        run = play(fleet, tmp_path, core, python, "readme", [served, wrong, mig])
    finally:
        host_vars(fleet, wrong, None)
    assert run.rc == 2, run
    # issue 67: no host acts; whichever failure line comes first names the host with the mistake and the variable
    verdict = run.stdout.split(f"TASK [{VERDICT}]", 1)[1].split("\n", 1)[1]
    lines = [line for line in verdict.splitlines() if line.strip() and not line.startswith("ok: [")]
    assert lines[0].startswith("fatal: [") and wrong in lines[0] and "free_gpus_wait_timeout" in lines[0], verdict[:3000]
    assert "the play stops here" not in run.stdout + run.stderr, run.stderr[-3000:]
    assert run.result(VERDICT, wrong)["msg"] == (f"{wrong}: settings mistake, nothing was done: free_gpus_wait_timeout must be a number "
                                                 "of seconds (e.g. 120), got '2m'")
    for host in (served, mig):
        assert run.result(VERDICT, host)["msg"] == (f"{host}: settings mistake on {wrong} (free_gpus_wait_timeout), nothing was done on any "
                                                    "host of the play; its line says what to fix")
    assert fleet.ssh(served, "systemctl is-active vllm.service").stdout.strip() == "active", "vllm was stopped"
    assert (run.stdout + run.stderr).count("must be a number of seconds") == 1
