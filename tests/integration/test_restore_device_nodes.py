"""gpu_restore checks the NVIDIA device nodes before it restores anything (issue 71): after a reboot or
a driver reload /dev/nvidia-uvm-tools is missing until something runs nvidia-modprobe, and a restored
GPU container or guest fails to start (NVIDIA/nvidia-docker #288). On a simulated host whose node is
gone: without the driver's helper the restore fails naming the node and restores nothing; with it
(tests/sim/nvidia-modprobe) the node is created, said, and the restore goes on. The record to
restore is a release's ready_fix (tests/sim/nvidia-smi settings.json), so that no service is needed.
"""
import json
import os

from ansible_in_ns import run_module

HERE = os.path.dirname(os.path.abspath(__file__))
MODPROBE = os.path.join(os.path.dirname(HERE), "sim", "nvidia-modprobe")


def setters(host):
    path = os.path.join(host.root.state, "setters.log")
    return open(path).read().splitlines() if os.path.exists(path) else []


def test_a_missing_uvm_node_stops_the_restore_until_the_drivers_helper_creates_it(nshost):
    host = nshost("h200x2", seed="nodes01")
    uuid = host.config["gpus"][0]["uuid"]
    with open(os.path.join(host.root.state, "settings.json"), "w") as handle:
        json.dump({uuid: {"compute_mode": "Exclusive_Process"}}, handle)
    run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5, "ready_fix": True})
    assert run["ready_fixed"] and setters(host) == [f"-i {uuid} -c 0"], run.result
    # A driver reload: the UVM nodes are gone until something creates them.
    host.run(["rm", "-f", "/dev/nvidia-uvm-tools", "/dev/nvidia-uvm"], check=True)
    plan = run_module(host, "gpu_restore", {}, check=True)
    assert plan.failed and plan.msg.startswith("NVIDIA device node(s) /dev/nvidia-uvm, /dev/nvidia-uvm-tools missing and nvidia-modprobe is "
                                               "not installed"), plan.msg
    failed = run_module(host, "gpu_restore", {})
    assert failed.failed and "/dev/nvidia-uvm-tools" in failed.msg and failed.msg.endswith("; nothing was restored"), failed.msg
    assert setters(host) == [f"-i {uuid} -c 0"], "nothing restored"
    host.run(["ln", "-s", MODPROBE, "/usr/bin/nvidia-modprobe"], check=True)
    restore = run_module(host, "gpu_restore", {})
    assert not restore.failed, restore.msg
    assert restore["device_nodes"]["created"] == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"], restore["device_nodes"]
    assert host.run(["test", "-c", "/dev/nvidia-uvm-tools"]).returncode == 0
    assert setters(host)[-1] == f"-i {uuid} -c 3" and restore["restored_gpu_settings"]
    with open(os.path.join(host.root.state, "modprobe.log")) as handle:
        assert handle.read().splitlines() == ["-u -c=0"]
