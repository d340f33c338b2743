"""gpu_release then gpu_restore of a supervisord program (Debian's supervisor 4.2.5 in a namespace
host, tests/integration/supervisor_rig.py): the program runs again and its configuration file is
byte for byte what it was, read through supervisorctl and the file, twice in a row."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim")]
from ansible_in_ns import run_module  # noqa: E402
from supervisor_rig import Supervisord  # noqa: E402
from test_supervisor_release import HOLDER, wait_used  # noqa: E402

CONF = "/etc/supervisor/conf.d/vllm.conf"


def test_a_disabled_supervisord_program_comes_back_as_it_was_twice_in_a_row(nshost):
    host = nshost("h200x1")
    sup = Supervisord(host, {"vllm": HOLDER})
    assert wait_used(host, 0, 8192)
    conf_before = sup.read(CONF)
    for round_ in (1, 2):
        run = run_module(host, "gpu_release", {"services": ["supervisor:vllm"], "service_state": "disabled"})
        assert not run.failed and run["released"] is True, run.msg
        assert sup.state("vllm") == "STOPPED" and "autostart=false" in sup.read(CONF)
        plan = run_module(host, "gpu_restore", check=True)
        assert not plan.failed and plan["changed"] is True, plan.msg
        assert sup.state("vllm") == "STOPPED"
        restore = run_module(host, "gpu_restore", {"wait_for_gpus": 20})
        assert not restore.failed, restore.msg
        assert restore["started_programs"] == ["vllm"], (round_, restore.result)
        assert sup.state("vllm") == "RUNNING" and sup.read(CONF) == conf_before, round_
        assert wait_used(host, 0, 8192)
        again = run_module(host, "gpu_restore")
        assert not again.failed and again["changed"] is False
