"""One wedged node never holds the fleet (issue 57): the free_gpus role in a play over three
simulated hosts, each with a GPU holder to free, run by real ansible-playbook on this machine;
each host's Python enters its host's namespaces (its interpreter is `nsenter ... python3`), so
gpu_release sees that host's /proc, GPUs and file systems, as over SSH on a node.

- A node with a user's process that does not answer /proc reads (in execve on a FUSE mount that
  stopped answering: tests/tenants/stalled_fuse.py) and that the driver lists on the selected GPU
  with memory no readable process explains: gpu_release's bounded scan reports it and refuses
  before acting; the host fails alone, within its timeouts, the other two are freed.
- A node where gpu_release itself never answers (its Python waits on the stalled file system
  before the module starts, as on a node whose site-packages or home is on a dead NFS server):
  the role's gate stops waiting at the bound of the host's own timeouts (plugins/action/
  free_gpus_gate.py, gate_bound_s) and the host fails alone with "gpu_release did not answer
  within N s", said once, in the terminal and in the json-recording callback; the other two are
  freed meanwhile.
"""
import json
import os
import stat
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import VENV_BIN, results_env  # noqa: E402
from stalled_fs import EXEC_ON_IT, StalledFs, spawn_user  # noqa: E402

GATE = "zeromib.gpu.free_gpus : Free the GPUs and verify that they read at most the baseline"
VERDICT = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
# Small timeouts keep the gate's bound short: 6 x 2 + 2 x 1 + 3 + 0 + 40 = 57 s.
TIMEOUTS = {"free_gpus_timeout": 2, "free_gpus_kill_timeout": 1, "free_gpus_wait_timeout": 3, "free_gpus_settle_timeout": 0}
BOUND_S = 57
PLAY = [{"name": "Free the GPUs of the fleet", "hosts": "all", "gather_facts": False, "become": False,
         "roles": [{"role": "zeromib.gpu.free_gpus"}]}]


def interpreter(host, path, env=None):
    """A python3 that runs inside `host`'s namespaces (the module's Python, as on the node)."""
    setting = " ".join(f"{key}={value}" for key, value in (env or {}).items())
    with open(path, "w") as handle:
        handle.write(f"#!/bin/sh\nexec nsenter -t {host.init_pid:d} -m -u -p -- env {setting} /usr/bin/python3 \"$@\"\n")
    os.chmod(path, stat.S_IRWXU)
    return path


def play(tmp_path, hosts, timeout=240):
    """ansible-playbook of PLAY over `hosts` ({name: interpreter}) -> (rc, output, {(task, host): (status, result)}, wall s)."""
    inventory = {"all": {"hosts": {name: dict(TIMEOUTS, ansible_connection="local", ansible_python_interpreter=python)
                                   for name, python in hosts.items()}}}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    (tmp_path / "play.yml").write_text(json.dumps(PLAY))
    out = str(tmp_path / "results.json")
    env = dict(os.environ, **results_env(out))
    env["ANSIBLE_INVENTORY_ENABLED"] = "yaml"
    started = time.monotonic()
    proc = subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", str(tmp_path / "inventory.json"), str(tmp_path / "play.yml")],
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.monotonic() - started
    with open(out) as handle:
        tasks = json.load(handle)["tasks"]
    return proc.returncode, proc.stdout + proc.stderr, {(t["task"], t["host"]): (t["status"], t["result"]) for t in tasks}, wall


@pytest.fixture
def fleet(nshost, tmp_path):
    """Three hosts, each with root's GPU holder on GPU 0, and a FUSE mount of a user on the third
    (`wedged`) -> (hosts by name, the mount)."""
    hosts = {name: nshost("h200x1", seed=name) for name in ("node-a", "node-b", "node-c")}
    for host in hosts.values():
        host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    with StalledFs(hosts["node-c"]) as mount:
        yield hosts, mount


def holders(host):
    return host.smi("--query-compute-apps=pid", "--format=csv,noheader").stdout.split()


def test_a_node_whose_proc_does_not_answer_fails_alone_and_the_others_are_freed(fleet, tmp_path):
    hosts, mount = fleet
    stuck = spawn_user(hosts["node-c"], EXEC_ON_IT, mount.data, mount.flag)
    # The driver lists it on GPU 0 with memory of its own: a GPU that reads clean with no compute
    # process would be free whatever could not be read (issue 66); this one holds memory that no
    # process that answered explains.
    hosts["node-c"].set_fault(leak={"0": {"mib": 4096, "pid": stuck.pid}})
    mount.stall()
    time.sleep(0.3)  # its execve reaches the close of the file
    pythons = {name: interpreter(host, str(tmp_path / f"python-{name}")) for name, host in hosts.items()}
    rc, out, results, wall = play(tmp_path, pythons)
    assert rc == 2 and wall < 120, out[-4000:]
    for name in ("node-a", "node-b"):
        assert results[(VERDICT, name)][0] == "ok", results[(VERDICT, name)]
        assert holders(hosts[name]) == []
    status, result = results[(VERDICT, "node-c")]
    assert status == "failed" and result["msg"].startswith(f"node-c: cannot free GPU 0: pid {stuck.pid} python3 (uid 4242, state "), result
    assert "did not answer" in result["msg"] and holders(hosts["node-c"]) != []


def test_a_node_whose_gpu_release_never_answers_fails_alone_at_the_bound_of_its_timeouts(fleet, tmp_path):
    hosts, mount = fleet
    mount.stall()
    pythons = {name: interpreter(host, str(tmp_path / f"python-{name}")) for name, host in hosts.items() if name != "node-c"}
    # Its Python looks for modules on the stalled mount first: it waits there before the module starts.
    pythons["node-c"] = interpreter(hosts["node-c"], str(tmp_path / "python-node-c"), {"PYTHONPATH": mount.mountpoint})
    rc, out, results, wall = play(tmp_path, pythons)
    assert rc == 2, out[-4000:]
    # The bound, Ansible's start and the verdict; far from "for good".
    assert BOUND_S <= wall < BOUND_S + 60, wall
    for name in ("node-a", "node-b"):
        assert results[(VERDICT, name)][0] == "ok", results[(VERDICT, name)]
        assert holders(hosts[name]) == []
    first = f"node-c: gpu_release did not answer within {BOUND_S:d} s, the bound of this host's free_gpus_* timeouts"
    status, result = results[(VERDICT, "node-c")]
    assert status == "failed" and result["msg"].startswith(first), result
    # The gate recorded the outcome and did not fail; the verdict said it, once.
    assert results[(GATE, "node-c")][0] == "ok" and results[(GATE, "node-c")][1]["ansible_facts"]["free_gpus_result"]["status"] == "failed"
    assert out.count("gpu_release did not answer within") == 1, out[-4000:]
    said = [line for line in out.splitlines() if "did not answer" in line]
    assert len(said) == 1 and said[0].startswith("fatal: [node-c]: FAILED!"), said
