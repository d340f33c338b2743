"""gpu_release then gpu_restore of a supervisord program (Debian's supervisor 4.2.5 in a namespace
host, tests/integration/supervisor_rig.py): the program runs again and its configuration file is
byte for byte what it was, read through supervisorctl and the file, twice in a row; wait_for_gpus
waits until the program's process holds its GPU again (issue 33)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim")]
from ansible_in_ns import run_module  # noqa: E402
from supervisor_rig import Supervisord  # noqa: E402
from test_supervisor_release import HOLDER, wait_used  # noqa: E402

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
