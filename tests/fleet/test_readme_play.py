"""One pattern everywhere (issue 55): README.md's "Real use" play is playbooks/example_training.yml as
shipped, docs/free_gpus.md and docs/docsite/rst/guide_restore.rst show the same, and the README's text itself,
copied, runs on a mixed fleet whose GPU counts and idle baselines are set per group in the
inventory (a play var would beat them: the MIG host was told to set the baseline it had, and the
4-GPU host failed "expected 8"). Works on a fleet of 3 hosts (ZEROMIB_FLEET_HOSTS=3)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from scenarios import TRAINING
from test_failure_paths import counts, recap
from test_failure_paths import trio  # noqa: F401  # pylint: disable=unused-import  # a pytest fixture, used by name

REPO = Path(__file__).resolve().parents[2]
MARKER = "/run/zeromib-training-started"


def readme_play() -> str:
    """The YAML block of README.md's "Real use" section, as a user copies it."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Real use\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"^```yaml\n(.*?)^```$", section, re.S | re.M)
    assert len(blocks) == 1, f"README's Real use has {len(blocks)} YAML blocks"
    return blocks[0]


def test_the_readme_and_both_guides_show_the_shipped_training_play():
    shipped = (REPO / TRAINING).read_text()
    assert readme_play() == shipped
    # The role's reference page (generated, Markdown) and the restore guide (docsite, reStructuredText).
    assert f"```yaml\n{shipped}```" in (REPO / "docs/free_gpus.md").read_text()
    indented = "".join(f"    {line}" if line.strip() else line for line in shipped.splitlines(True))
    assert f".. code-block:: yaml\n\n{indented}" in (REPO / "docs/docsite/rst/guide_restore.rst").read_text()
    # counts and baselines are the inventory's: the play sets neither
    assert "free_gpus_expected_count:" not in shipped and "free_gpus_max_used_mib:" not in shipped


@pytest.fixture
def per_group(trio):
    """The fleet's inventory with what README.md's inventory sets per group: each group's GPU count,
    and the MIG group's idle baseline."""
    fleet, plain, mig = trio
    counts_by_group = {}
    for host in fleet.hosts:
        counts_by_group[host.preset.replace("-", "_")] = host.gpu_count
    for group, count in counts_by_group.items():
        fleet.write_group_vars(group, {"free_gpus_expected_count": count, **({"free_gpus_max_used_mib": 64} if group == "a100_mig" else {})})
    yield fleet, plain, mig
    for group in counts_by_group:
        fleet.remove_group_vars(group)
    fleet.ssh_all(f"rm -f {MARKER}")


def test_the_readmes_play_as_copied_frees_a_mixed_fleet_trains_and_puts_the_servers_back(per_group, tmp_path):
    fleet, (h200, other), mig = per_group
    fleet.workload(h200, "vllm")
    copied = tmp_path / "train.yml"
    copied.write_text(readme_play())
    run = fleet.ansible_playbook(copied, limit=[h200, other, mig], extra_vars={"training_command": f"touch {MARKER}"})
    assert run.rc == 0, run
    for host in (h200, other, mig):
        assert recap(run, host)["failed"] == 0 and recap(run, host)["unreachable"] == 0, run.stdout
    # the 8-GPU, 4-GPU and MIG hosts each passed with their group's count and baseline
    gate = "zeromib.gpu.free_gpus : Free the GPUs and verify that they read at most the baseline"
    assert {host: run.result(gate, host)["ansible_facts"]["free_gpus_result"]["count"] for host in (h200, other, mig)} == {
        host.name: host.gpu_count for host in fleet.hosts if host.name in (h200, other, mig)}
    assert run.result(gate, h200)["ansible_facts"]["free_gpus_result"]["stopped_units"] == ["vllm.service"]
    assert all(r.returncode == 0 for r in fleet.ssh_all(f"test -e {MARKER}", hosts=[h200, other, mig]).values()), "training ran everywhere"
    # and the server stopped for it is back
    assert fleet.ssh(h200, "systemctl is-active vllm.service").stdout.strip() == "active"
    assert json.dumps(run.json).count("censored") == 0


def test_a_var_above_the_inventory_would_beat_the_groups_count_so_the_play_sets_none(per_group):
    """Why the counts are the inventory's: the old README's play var (here -e, which beats it too) fails the
    4-GPU and MIG hosts."""
    fleet, (h200, other), mig = per_group
    run = fleet.ansible_playbook(TRAINING, limit=[h200, other, mig], extra_vars={"training_command": "true"},
                                 args=["-e", "free_gpus_expected_count=8"])
    assert run.rc == 2, run
    assert recap(run, h200) == counts(ok=3), run.stdout
    gpus = {h.name: h.gpu_count for h in fleet.hosts}
    wrong = [host for host in (other, mig) if gpus[host] != 8]
    assert mig in wrong, gpus  # the MIG host has 2: the worker's fleet may give `other` 8 too
    for host in wrong:
        assert "expected 8 GPUs" in run.result("zeromib.gpu.free_gpus : Assert that every selected GPU is free", host)["msg"]


import sys  # noqa: E402

from test_first_sentence import unprivileged  # noqa: E402,F401  # pylint: disable=unused-import  # a pytest fixture, used by name
from test_failure_paths import fatal_lines, host_vars  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

CORES = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]


@pytest.mark.parametrize(("core", "python"), CORES, ids=[f"ansible-core-{c}" for c, _p in CORES])
def test_the_readmes_play_says_no_sudo_and_no_python_in_the_roles_words_where_facts_are_gathered_by_default(unprivileged, tmp_path, core, python):
    """Issue 55: with the play's default fact gathering, Ansible's own Gathering Facts failed first
    with "Module result deserialization failed". The README's play gathers none (gather_facts:
    false), so a controller whose ansible.cfg gathers implicitly (the default) still hears the role."""
    fleet, (nosudo, nopython), mig = unprivileged
    fleet.rig.write_baselines()
    host_vars(fleet, nosudo, {"ansible_user": "zmuser"})
    host_vars(fleet, nopython, {"ansible_python_interpreter": "/usr/bin/python3.13"})
    copied = tmp_path / "train.yml"
    copied.write_text(readme_play())
    bin_dir = matrix.controller_bin(core, python)
    run = fleet.ansible_playbook(copied, limit=[nosudo, nopython, mig], bin_dir=bin_dir,
                                 env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "ANSIBLE_GATHERING": "implicit"})
    assert run.rc == 2, run
    out = run.stdout + run.stderr
    assert "Gathering Facts" not in out and "deserialization" not in out and "No start of json char" not in out, out[-3000:]
    said = {nosudo: "the module could not start on this host: /bin/sh: 1: sudo: not found (rc 127); sudo is not installed",
            nopython: "the module could not start on this host: /bin/sh: 1: /usr/bin/python3.13: not found (rc 127); no working Python"}
    for host, start in said.items():
        [fatal] = fatal_lines(run, host)
        assert json.loads(fatal.partition(" => ")[2])["msg"].startswith(f"{host}: {start}"), fatal
        assert out.count(start) == 1, out[-3000:]
    assert recap(run, mig) == counts(ok=3), run.stdout


@pytest.mark.parametrize(("core", "python"), CORES, ids=[f"ansible-core-{c}" for c, _p in CORES])
def test_the_readmes_play_on_a_dirty_host_a_wrong_type_and_no_sudo_says_each_reason_once(unprivileged, tmp_path, core, python):
    """Issue 55's "done when": the README's play, copied, each failing host's reason its one line in
    the terminal and in the json callback's record; no censored line; nothing trained."""
    fleet, (dirty, nosudo), wrong = unprivileged
    fleet.rig.write_baselines()
    fleet.set_fault(dirty, leak={"0": 1500})
    host_vars(fleet, nosudo, {"ansible_user": "zmuser"})
    host_vars(fleet, wrong, {"free_gpus_wait_timeout": "2m"})
    copied = tmp_path / "train.yml"
    copied.write_text(readme_play())
    bin_dir = matrix.controller_bin(core, python)
    try:
        run = fleet.ansible_playbook(copied, limit=[dirty, nosudo, wrong], bin_dir=bin_dir, extra_vars={"training_command": f"touch {MARKER}"},
                                     env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "ANSIBLE_GATHERING": "implicit"})
    finally:
        fleet.clear_faults(dirty)
    assert run.rc == 2, run
    out = run.stdout + run.stderr
    # issue 67: the wrong type stops every host before any acts; the dirty and the sudo-less host name it, its own line says it
    elsewhere = f"settings mistake on {wrong} (free_gpus_wait_timeout), nothing was done on any host of the play; its line says what to fix"
    said = {dirty: elsewhere, nosudo: elsewhere,
            wrong: "settings mistake, nothing was done: free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"}
    assert "sudo: not found" not in out and "GPUs read above" not in out, out[-3000:]
    verdict = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
    for host, reason in said.items():
        [fatal] = fatal_lines(run, host)
        assert json.loads(fatal.partition(" => ")[2])["msg"].startswith(f"{host}: {reason}"), fatal
        assert out.count(f"{host}: {reason}") == 1, (reason, out[-3000:])
        assert run.result(verdict, host)["msg"].startswith(f"{host}: {reason}")
        assert recap(run, host) == counts(ok=2, failed=1), run.stdout
    for bad in ("censored", "Origin:", "[ERROR]", "deserialization", "_AnsibleTaggedStr"):
        assert bad not in out and bad not in json.dumps(run.json), bad
    assert not any(r.returncode == 0 for r in fleet.ssh_all(f"test -e {MARKER}", hosts=list(said)).values()), "training started"

    # The same play through ansible-runner (what AWX/AAP record): each reason in the host's failed event, nothing censored.
    fleet.set_fault(dirty, leak={"0": 1500})
    try:
        events = runner_events(fleet, copied, [dirty, nosudo, wrong], bin_dir, tmp_path)
    finally:
        fleet.clear_faults(dirty)
    assert "censored" not in json.dumps(events), [e for e in events if "censored" in json.dumps(e)][:2]
    failed = {e["event_data"]["host"]: e for e in events if e.get("event") == "runner_on_failed"}
    assert set(failed) == set(said), sorted(failed)
    for host, reason in said.items():
        assert failed[host]["event_data"]["res"]["msg"].startswith(f"{host}: {reason}"), failed[host]["event_data"]["res"]
        assert failed[host]["stdout"].count(f"{host}: {reason}") == 1 and "Origin:" not in failed[host]["stdout"], failed[host]["stdout"]

    # One typo: the play does nothing on any host, each host says it once.
    typo = fleet.ansible_playbook(copied, limit=[dirty, nosudo, wrong], bin_dir=bin_dir,
                                  extra_vars={"training_command": f"touch {MARKER}", "free_gpus_sevices": ["vllm.service"]},
                                  env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "ANSIBLE_GATHERING": "implicit"})
    assert typo.rc == 2, typo
    out = typo.stdout + typo.stderr
    reason = ("settings mistake, nothing was done: free_gpus_sevices is not a variable of the zeromib.gpu.free_gpus role; "
              "did you mean free_gpus_services?")
    # the first of the hosts with the same mistake says it; the other points to it (issue 67: said once)
    first, other = sorted([dirty, nosudo])
    [fatal] = fatal_lines(typo, first)
    assert json.loads(fatal.partition(" => ")[2])["msg"] == f"{first}: {reason}", fatal
    [fatal] = fatal_lines(typo, other)
    pointer = f"{other}: settings mistake, nothing was done: the same as {first} (free_gpus_sevices), whose line says it"
    assert json.loads(fatal.partition(" => ")[2])["msg"] == pointer, fatal
    # the host with a wrong type says both mistakes, in one line
    assert typo.result(verdict, wrong)["msg"] == f"{wrong}: {reason}; {said[wrong].partition(': ')[2]}"
    assert out.count(reason) == 2 and "censored" not in out and "censored" not in json.dumps(typo.json), out[-3000:]
    assert not any(r.returncode == 0 for r in fleet.ssh_all(f"test -e {MARKER}", hosts=list(said)).values()), "training started"


def runner_events(fleet, playbook, hosts, bin_dir, tmp_path):
    """ansible-runner's job events of PLAYBOOK, run by the ansible-playbook of BIN_DIR (its own callback, awx_display, loads into it)."""
    import shutil

    import ansible_runner

    data = tmp_path / "job"
    data.mkdir()
    env = {key: value for key, value in fleet._env(str(tmp_path / "unused.json")).items() if not key.startswith(("ANSIBLE_CALLBACK",))}
    env.pop("ANSIBLE_LOAD_CALLBACK_PLUGINS", None)
    env.update({"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin", "ANSIBLE_GATHERING": "implicit"})
    assert shutil.which("ansible-playbook", path=env["PATH"]) == str(bin_dir / "ansible-playbook")
    (data / "project").mkdir()
    shutil.copy(playbook, data / "project" / "train.yml")
    r = ansible_runner.run(private_data_dir=str(data), playbook="train.yml", inventory=str(fleet.inventory), limit=",".join(hosts),
                           envvars=env, extravars={"training_command": f"touch {MARKER}"}, quiet=True)
    assert r.rc == 2, r.stdout.read()[-4000:]
    return list(r.events)
