"""gpu_release then gpu_restore of a supervisord program (Debian's supervisor 4.2.5 in a namespace
host, tests/integration/supervisor_rig.py): the program runs again and its configuration file is
byte for byte what it was, read through supervisorctl and the file, twice in a row; wait_for_gpus
waits until the program's process holds its GPU again (issue 33)."""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim")]
from ansible_in_ns import run_module  # noqa: E402
from supervisor_rig import Supervisord  # noqa: E402
from test_gpu_release import used  # noqa: E402
from test_supervisor_release import COPY_NAMES, GROUPED, HOLDER, TRAINER_CONF, spawns_and_stops, start_copies, wait_used  # noqa: E402

CONF = "/etc/supervisor/conf.d/vllm.conf"
RECORD = "/var/lib/zeromib-gpu/released.json"


def test_a_disabled_supervisord_program_comes_back_as_it_was_twice_in_a_row(nshost):
    host = nshost("h200x1")
    sup = Supervisord(host, {"vllm": HOLDER})
    assert wait_used(host, 0, 8192)
    conf_before = sup.read(CONF)
    for round_ in (1, 2):
        run = run_module(host, "gpu_release", {"services": ["supervisor:vllm"], "service_state": "disabled"})
        assert not run.failed and run["released"] is True, run.msg
        assert sup.state("vllm") == "STOPPED" and "autostart=false" in sup.read(CONF)
        [entry] = [e for e in json.loads(host.run(["cat", RECORD]).stdout)["entries"] if e["kind"] == "supervisor"]
        assert entry["gpu_indexes"] == [0], entry  # what its process held at the release: what wait_for_gpus waits for
        plan = run_module(host, "gpu_restore", check=True)
        assert not plan.failed and plan["changed"] is True, plan.msg
        assert plan["started_programs"] == ["vllm"] and plan["plan"] == ["supervisor program vllm: autostart/autorestart as before, start"]
        assert sup.state("vllm") == "STOPPED"
        restore = run_module(host, "gpu_restore", {"wait_for_gpus": 20})
        assert not restore.failed, restore.msg
        assert restore["started_programs"] == ["vllm"], (round_, restore.result)
        assert restore["plan"] == plan["plan"]
        # wait_for_gpus returned once the program's process held its GPU again (issue 33).
        assert restore["gpus_held"] == {"vllm": [0]}, restore["gpus_held"]
        assert sup.state("vllm") == "RUNNING" and sup.read(CONF) == conf_before, round_
        assert wait_used(host, 0, 8192)
        again = run_module(host, "gpu_restore")
        assert not again.failed and again["changed"] is False


def record_names(host):
    proc = host.run(["cat", RECORD])
    return [e["name"] for e in json.loads(proc.stdout)["entries"]] if proc.returncode == 0 and proc.stdout.strip() else None


def test_two_hosts_keep_their_own_restore_records(nshost):
    """Each simulated host has its own /var/lib/zeromib-gpu (a private tmpfs, never the machine's
    /var/lib shown through): a release on one host is never in the other's record, nor in its
    gpu_facts' pending_restore, and restoring one leaves the other's record alone (issue 33)."""
    hosts = {"vllm": nshost("h200x1"), "sglang": nshost("h200x1")}
    for name, host in hosts.items():
        assert host.run(["stat", "-f", "-c", "%T", os.path.dirname(RECORD)]).stdout.strip() == "tmpfs"
        assert record_names(host) is None
        Supervisord(host, {name: HOLDER.replace("--name vllm", f"--name {name}")})
        assert wait_used(host, 0, 8192)
    for name, host in hosts.items():
        run = run_module(host, "gpu_release", {"services": [f"supervisor:{name}"]})
        assert not run.failed and run["released"] is True, run.msg
    assert {name: record_names(host) for name, host in hosts.items()} == {"vllm": ["vllm"], "sglang": ["sglang"]}
    facts = run_module(hosts["sglang"], "gpu_facts")
    assert [e["name"] for e in facts["ansible_facts"]["gpu"]["pending_restore"]["entries"]] == ["sglang"]
    restore = run_module(hosts["vllm"], "gpu_restore")
    assert not restore.failed and restore["started_programs"] == ["vllm"], restore.msg
    assert {name: record_names(host) for name, host in hosts.items()} == {"vllm": None, "sglang": ["sglang"]}


def test_restoring_one_program_of_a_group_never_touches_its_sibling(nshost):
    # Before issue 31: restore ran `supervisorctl update workers`, bouncing the exporter again.
    host = nshost("h200x1")
    sup = Supervisord(host, GROUPED, groups={"workers": ["trainer", "exporter"]})
    assert wait_used(host, 0, 8192)
    trainer_conf = sup.read("/etc/supervisor/conf.d/trainer.conf")
    exporter = sup.pid_of("workers:exporter")
    run = run_module(host, "gpu_release", {"services": ["supervisor:trainer"], "service_state": "disabled"})
    assert not run.failed and run["released"] is True, run.msg
    restore = run_module(host, "gpu_restore", {"wait_for_gpus": 20})
    assert not restore.failed, restore.msg
    assert restore["started_programs"] == ["workers:trainer"] and sup.state("workers:trainer") == "RUNNING"
    assert sup.read("/etc/supervisor/conf.d/trainer.conf") == trainer_conf and wait_used(host, 0, 8192)
    assert sup.pid_of("workers:exporter") == exporter and spawns_and_stops(sup.log(), "exporter") == (1, 0)
    # supervisord never read the release's edit: nothing to warn about.
    assert not any("supervisor:workers:trainer" in w for w in restore.result.get("warnings") or [])


def test_restore_after_a_supervisord_restart_starts_the_program_and_leaves_the_sibling_running(nshost):
    host = nshost("h200x1")
    sup = Supervisord(host, GROUPED, groups={"workers": ["trainer", "exporter"]})
    assert wait_used(host, 0, 8192)
    trainer_conf = sup.read("/etc/supervisor/conf.d/trainer.conf")
    run = run_module(host, "gpu_release", {"services": ["supervisor:trainer"], "service_state": "disabled"})
    assert not run.failed and run["released"] is True, run.msg
    sup.stop()
    sup.start()
    time.sleep(2)
    assert sup.state("workers:trainer") == "STOPPED" and used(host, 0) == 0
    exporter = sup.pid_of("workers:exporter")
    log_before = len(sup.log())
    restore = run_module(host, "gpu_restore", {"wait_for_gpus": 20})
    assert not restore.failed, restore.msg
    assert restore["started_programs"] == ["workers:trainer"] and sup.state("workers:trainer") == "RUNNING"
    assert sup.read("/etc/supervisor/conf.d/trainer.conf") == trainer_conf and wait_used(host, 0, 8192)
    assert sup.pid_of("workers:exporter") == exporter and spawns_and_stops(sup.log()[log_before:], "exporter") == (0, 0)
    # The restarted supervisord read autorestart=false for the trainer: said, with what would restore it now.
    [warning] = [w for w in restore.result.get("warnings") or [] if "supervisor:workers:trainer" in w]
    assert "gets autorestart back at supervisord's next start" in warning and "would also restart workers:exporter" in warning


def test_every_copy_of_a_numprocs_program_is_disabled_together_and_restored_together(nshost):
    host, sup = start_copies(nshost)
    conf = sup.read(TRAINER_CONF)
    run = run_module(host, "gpu_release", {"gpus": ["0", "1"], "services": ["supervisor:trainer"], "service_state": "disabled"})
    assert not run.failed and run["released"] is True and run["spanning"] == [], run.msg
    assert [p["name"] for p in run["stopped_programs"]] == list(COPY_NAMES) and run["killed"] == []
    assert [(d["name"], d["file"], d["section"]) for d in run["disabled_programs"]] == [(n, TRAINER_CONF, "program:trainer") for n in COPY_NAMES]
    edited = sup.read(TRAINER_CONF)
    assert edited.count("autostart=false") == 1 and edited.count("autorestart=false") == 1 and "=true" not in edited
    assert used(host, 0) == 0 and used(host, 1) == 0
    # The file is what supervisord reads at its next start: neither copy comes back.
    sup.stop()
    sup.start()
    time.sleep(2)
    assert [sup.state(name) for name in COPY_NAMES] == ["STOPPED", "STOPPED"] and used(host, 0) == used(host, 1) == 0
    entries = [e for e in json.loads(host.run(["cat", RECORD]).stdout)["entries"] if e["kind"] == "supervisor"]
    assert [(e["name"], e["gpu_indexes"], e["actions"]) for e in entries] == [(n, [i], ["stopped", "disabled"]) for i, n in enumerate(COPY_NAMES)]
    plan = run_module(host, "gpu_restore", check=True)
    assert not plan.failed and sorted(plan["started_programs"]) == sorted(COPY_NAMES), plan.msg
    # The shared section is put back once: by the first entry restored (the newest).
    assert plan["plan"] == ["supervisor program trainer:trainer_1: autostart/autorestart as before, start",
                            "supervisor program trainer:trainer_0: start"]
    restore = run_module(host, "gpu_restore", {"wait_for_gpus": 20})
    assert not restore.failed, restore.msg
    assert restore["plan"] == plan["plan"] and restore["gpus_held"] == {"trainer:trainer_0": [0], "trainer:trainer_1": [1]}
    assert [sup.state(name) for name in COPY_NAMES] == ["RUNNING", "RUNNING"] and sup.read(TRAINER_CONF) == conf
    # The restarted supervisord read autorestart=false at its start: said where the section is put back, with what would apply it now.
    [warning] = [w for w in restore.result.get("warnings") or [] if "gets autorestart back" in w]
    assert warning.startswith("supervisor:trainer:trainer_1: its file is restored") and "supervisorctl update trainer" in warning
    assert not run_module(host, "gpu_restore")["changed"]
