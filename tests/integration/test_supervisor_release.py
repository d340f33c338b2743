"""supervisord (Debian's supervisor package, running in a namespace host) through real
ansible-playbook: a program with autorestart=true holding a GPU comes back when its process is
killed, so a run without `supervisor:` fails naming supervisord and `supervisorctl stop NAME`;
with `services: [supervisor:NAME]` it is stopped through supervisorctl and, with
service_state=disabled, stays stopped, also across a restart of supervisord."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402
from supervisor_rig import Supervisord  # noqa: E402
from test_gpu_release import used  # noqa: E402
from test_respawn import wait_used  # noqa: E402

HOLDER = "/usr/bin/gpu_holder --gpus 0 --mib 8192 --name vllm"


def test_autorestart_program_fails_the_run_naming_supervisord_and_its_stop_command(nshost):
    host = nshost("h200x1")
    sup = Supervisord(host, {"vllm": HOLDER})
    assert wait_used(host, 0, 8192)
    first = sup.pid_of("vllm")
    run = run_module(host, "gpu_release", {"wait_timeout": 20})
    assert run.failed and run["released"] is False, run.msg
    assert first in [k["pid"] for k in run["killed"]]
    assert f"started again by its parent pid {sup.proc.pid} python3 [/usr/bin/python3 " in run.msg
    assert "/usr/bin/supervisord -n -c...] (supervisord)" in run.msg or "(supervisord): supervisord restarts" in run.msg, run.msg
    assert "supervisord restarts program vllm (autorestart): stop it with `supervisorctl stop vllm`" in run.msg
    assert "supervisor:vllm" in run.msg
    # It did come back: the message was not a guess.
    assert wait_used(host, 0, 8192) and sup.pid_of("vllm") not in (None, first)


def test_named_program_is_stopped_disabled_and_stays_stopped(nshost):
    host = nshost("h200x1")
    sup = Supervisord(host, {"vllm": HOLDER})
    assert wait_used(host, 0, 8192)
    run = run_module(host, "gpu_release", {"services": ["supervisor:vll*"], "service_state": "disabled"})
    assert not run.failed and run["released"] is True and run["changed"] is True, run.msg
    assert [p["name"] for p in run["stopped_programs"]] == ["vllm"] and run["killed"] == []
    [disabled] = run["disabled_programs"]
    assert disabled["name"] == "vllm" and disabled["file"] == "/etc/supervisor/conf.d/vllm.conf"
    assert disabled["autostart_before"] == "true" and disabled["autorestart_before"] == "true"
    conf = sup.read("/etc/supervisor/conf.d/vllm.conf")
    assert "autostart=false" in conf and "autorestart=false" in conf and "autostart=true" not in conf
    assert run["timings"]["settle_s"] == 0.0
    time.sleep(10)
    assert sup.state("vllm") == "STOPPED" and used(host, 0) == 0
    # What a reboot or `systemctl restart supervisor` does: supervisord reads the file again.
    sup.stop()
    sup.start()
    time.sleep(2)
    assert sup.state("vllm") == "STOPPED" and used(host, 0) == 0
    again = run_module(host, "gpu_release", {"services": ["supervisor:vllm"], "service_state": "disabled"})
    assert not again.failed and again["changed"] is False and again["stopped_programs"] == [] and again["disabled_programs"] == []


def test_stopped_only_and_a_glob_that_matches_nothing(nshost):
    host = nshost("h200x1")
    sup = Supervisord(host, {"vllm": HOLDER})
    assert wait_used(host, 0, 8192)
    check = run_module(host, "gpu_release", {"services": ["supervisor:vllm", "supervisor:sglang*"]}, check=True)
    assert not check.failed and check["changed"] is True and [p["name"] for p in check["stopped_programs"]] == ["vllm"]
    assert sup.state("vllm") == "RUNNING"
    run = run_module(host, "gpu_release", {"services": ["supervisor:vllm", "supervisor:sglang*"]})
    assert not run.failed and run["released"] is True, run.msg
    assert run["services_not_found"] == ["supervisor:sglang*"] and run["disabled_programs"] == []
    assert sup.state("vllm") == "STOPPED" and "autostart=true" in sup.read("/etc/supervisor/conf.d/vllm.conf")


# A sibling that holds no GPU, as a metrics exporter beside the trainer in one [group:].
EXPORTER = "/bin/sleep 100000"
GROUPED = {"trainer": HOLDER, "exporter": EXPORTER}


def spawns_and_stops(log, name):
    """(spawns, stops) supervisord logged of program `name` (4.2.5: "spawned: 'NAME' with pid N",
    "stopped: NAME (...)", "waiting for NAME to stop")."""
    return log.count(f"spawned: '{name}' "), log.count(f"stopped: {name} ") + log.count(f"waiting for {name} to stop")


def test_disabling_one_program_of_a_group_never_touches_its_sibling_and_survives_a_restart(nshost):
    # Before issue 31: `supervisorctl update workers` stopped and re-added the whole group, the exporter too.
    host = nshost("h200x1")
    sup = Supervisord(host, GROUPED, groups={"workers": ["trainer", "exporter"]})
    assert wait_used(host, 0, 8192)
    exporter = sup.pid_of("workers:exporter")
    assert exporter and spawns_and_stops(sup.log(), "exporter") == (1, 0)
    run = run_module(host, "gpu_release", {"services": ["supervisor:trainer"], "service_state": "disabled"})
    assert not run.failed and run["released"] is True and run["changed"] is True, run.msg
    assert [p["name"] for p in run["stopped_programs"]] == ["workers:trainer"] and run["killed"] == []
    [disabled] = run["disabled_programs"]
    assert (disabled["name"], disabled["file"], disabled["group_updated"]) == ("workers:trainer", "/etc/supervisor/conf.d/trainer.conf", False)
    assert "autostart=false" in sup.read("/etc/supervisor/conf.d/trainer.conf")
    assert "autostart=true" in sup.read("/etc/supervisor/conf.d/exporter.conf")
    time.sleep(3)
    assert sup.state("workers:trainer") == "STOPPED" and used(host, 0) == 0
    assert sup.pid_of("workers:exporter") == exporter and sup.state("workers:exporter") == "RUNNING"
    assert spawns_and_stops(sup.log(), "exporter") == (1, 0)  # never stopped, never started again
    # A restart of supervisord (a reboot, `systemctl restart supervisor`) reads the file: the trainer stays stopped.
    sup.stop()
    sup.start()
    time.sleep(2)
    assert sup.state("workers:trainer") == "STOPPED" and used(host, 0) == 0
    assert sup.state("workers:exporter") == "RUNNING"


# Two copies of one program (numprocs=2), each on the GPU of its number, as a trainer per GPU is run.
COPIES = {"command": "/usr/bin/gpu_holder --gpus %(process_num)d --mib 8192 --name trainer", "numprocs": 2,
          "process_name": "%(program_name)s_%(process_num)d"}
TRAINER_CONF = "/etc/supervisor/conf.d/trainer.conf"
COPY_NAMES = ("trainer:trainer_0", "trainer:trainer_1")


def start_copies(nshost):
    host = nshost("h200x2")
    sup = Supervisord(host, {"trainer": COPIES})
    assert wait_used(host, 0, 8192) and wait_used(host, 1, 8192)
    assert [sup.state(name) for name in COPY_NAMES] == ["RUNNING", "RUNNING"]
    return host, sup


def test_disabling_one_copy_of_a_numprocs_program_is_refused_and_changes_nothing(nshost):
    # Issue 54: autostart/autorestart=false went into [program:trainer], which trainer_1 (GPU 1, never named) shares.
    host, sup = start_copies(nshost)
    pids, conf = {name: sup.pid_of(name) for name in COPY_NAMES}, sup.read(TRAINER_CONF)
    args = {"gpus": ["0"], "services": ["supervisor:trainer:trainer_0"], "service_state": "disabled"}
    for check in (True, False):
        run = run_module(host, "gpu_release", args, check=check)
        assert run.failed, (check, run.result)
        assert ("not disabling: supervisor:trainer:trainer_0 is one of the 2 copies of [program:trainer] (numprocs), whose autostart and "
                "autorestart hold for every copy: disabling it would also keep trainer:trainer_1, not named, stopped") in run.msg, run.msg
        assert "services: [supervisor:trainer:*]" in run.msg and "service_state: stopped to stop it only" in run.msg
        assert "Nothing was stopped or changed" in run.msg
        assert not run.result.get("stopped_programs") and not run.result.get("disabled_programs") and not run.result.get("killed")
    assert {name: sup.pid_of(name) for name in COPY_NAMES} == pids and sup.read(TRAINER_CONF) == conf
    assert used(host, 0) >= 8192 and used(host, 1) >= 8192
    assert spawns_and_stops(sup.log(), "trainer_0") == spawns_and_stops(sup.log(), "trainer_1") == (1, 0)
    assert host.run(["test", "-e", "/var/lib/zeromib-gpu/released.json"]).returncode != 0  # nothing to restore: nothing was done


def test_stopping_one_copy_stops_that_copy_only(nshost):
    host, sup = start_copies(nshost)
    sibling = sup.pid_of("trainer:trainer_1")
    run = run_module(host, "gpu_release", {"gpus": ["0"], "services": ["supervisor:trainer:trainer_0"]})
    assert not run.failed and run["released"] is True, run.msg
    assert [p["name"] for p in run["stopped_programs"]] == ["trainer:trainer_0"] and run["disabled_programs"] == [] and run["killed"] == []
    assert sup.state("trainer:trainer_0") == "STOPPED" and "autostart=true" in sup.read(TRAINER_CONF)
    # GPU 0 is free (but for the 4 MiB that trainer_1's context on GPU 1 puts on every other GPU); GPU 1 is still trainer_1's.
    assert used(host, 0) <= 4 and used(host, 1) >= 8192
    assert sup.pid_of("trainer:trainer_1") == sibling and spawns_and_stops(sup.log(), "trainer_1") == (1, 0)


def test_naming_the_program_with_a_copy_on_an_unselected_gpu_is_a_spanning_refusal(nshost):
    host, sup = start_copies(nshost)
    pids, conf = {name: sup.pid_of(name) for name in COPY_NAMES}, sup.read(TRAINER_CONF)
    args = {"gpus": ["0"], "services": ["supervisor:trainer"], "service_state": "disabled"}
    for check in (True, False):
        run = run_module(host, "gpu_release", args, check=check)
        assert run.failed, (check, run.result)
        assert run.msg.startswith("refusing to free GPU 0: ending these would also end their work on GPUs outside the selection: "
                                  f"supervisor:trainer:trainer_1 (pids {pids['trainer:trainer_1']}), a copy of [program:trainer] that naming "
                                  "the program stops too, holds GPU 1, outside the selection"), run.msg
        assert "Nothing was stopped or signalled" in run.msg
        assert [(s["program"], s["outside_gpus"]) for s in run["spanning"]] == [("trainer:trainer_1", [1])]
    assert {name: sup.pid_of(name) for name in COPY_NAMES} == pids and sup.read(TRAINER_CONF) == conf
    assert used(host, 0) >= 8192 and used(host, 1) >= 8192
