"""Apptainer instances that outlive their job (issue 70, work that escaped its job), through the
real gpu_facts and gpu_release on a namespace host with the simulated driver.

Apptainer is not installable on these machines: its starter is the stand-in of
tests/sim/apptainer_starter.c, installed as root's /usr/libexec/apptainer/bin/starter-suid in the
host's own mount namespace (an overlay on /usr/libexec there), exec'd with apptainer's argv[0]
(`Apptainer instance: USER [NAME]`) as a user's `apptainer instance start` does; it detaches and
runs the container's process (a gpu_holder) below it.

The attacker: a user runs her own copy of the same binary, named starter-suid in her home (~/apptainer/bin/), with the
same argv[0], naming an instance of root's: her process names no instance and is advised nothing.
"""
import json
import os
import shutil
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim")]
from ansible_in_ns import run_module  # noqa: E402
from apptainer_starter import INSTALLED, build, start_argv  # noqa: E402
from test_gpu_release import used  # noqa: E402

USER = 4242
FAST = {"kill_timeout": 0.5, "wait_timeout": 1, "settle_timeout": 0}


def install_starter(host):
    """Root's starter in the host's /usr/libexec (an overlay in its mount namespace only)."""
    base = os.path.join(host.dir, "libexec")
    host.run(["mkdir", "-p", base + "/upper", base + "/work"], check=True)
    host.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir=/usr/libexec,upperdir={base}/upper,workdir={base}/work", "/usr/libexec"],
             check=True)
    host.run(["install", "-D", "-o", "0", "-g", "0", "-m", "755", build(), INSTALLED], check=True)


def start_instance(host, share, starter, name, mib=2048, user="alice", gpus="0"):
    """An instance NAME started by USER through STARTER, its container's process a gpu_holder on
    GPUS -> (the holder's pid, the starter's pid)."""
    ready = os.path.join(share, f"{name}.json")
    cmd = f"exec gpu_holder --gpus {gpus} --mib {mib:d} --ready-file {ready}"
    started = host.spawn_as(USER, start_argv(starter, user, name), env={"ZEROMIB_STARTER_CMD": cmd}, ready=False)
    deadline = time.monotonic() + 15
    while not os.path.exists(ready):
        assert time.monotonic() < deadline, f"instance {name} not started: {started.argv}"
        time.sleep(0.02)
    with open(ready) as handle:
        pid = int(json.load(handle)["pid"])
    stat = host.run(["cat", f"/proc/{pid}/stat"], check=True).stdout
    return pid, int(stat[stat.rindex(")") + 2:].split()[1])


@pytest.fixture
def share():
    """A directory the user may write her holder's ready file to."""
    path = tempfile.mkdtemp(prefix="zm-apptainer-", dir="/tmp")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_holder_in_an_apptainer_instance_is_named_with_the_instance_and_its_stop_command(nshost, share):
    host = nshost("h200x1", seed="apptainerinst")
    install_starter(host)
    pid, starter = start_instance(host, share, INSTALLED, "train")
    facts = run_module(host, "gpu_facts")
    assert not facts.failed, facts.msg
    [holder] = [h for h in facts["ansible_facts"]["gpu"]["holders"] if h["pid"] == pid]
    assert holder["origin"] == {
        "kind": "apptainer_instance", "session": None, "stop": "apptainer instance stop train", "user": None,
        "text": f"Apptainer instance train of uid {USER} (the name is its user's word; its starter is pid {starter}), outside any job"}

    kept = run_module(host, "gpu_release", dict(FAST, kill=False))
    assert kept.failed and kept.msg.startswith("GPUs are held by processes that kill=false leaves running"), kept.msg
    assert (f"held by pid {pid} python3 [" in kept.msg and f"Apptainer instance train of uid {USER} (the name is its user's word; its "
            f"starter is pid {starter}), outside any job: `apptainer instance stop train` run as its user ends it, state S)") in kept.msg, kept.msg
    assert "reset" not in kept.msg and "reboot" not in kept.msg, kept.msg

    freed = run_module(host, "gpu_release", FAST)  # kill on: signalled as any of the user's processes
    assert not freed.failed, freed.msg
    assert [k["pid"] for k in freed["killed"]] == [pid] and used(host, 0) == 0
    assert host.wait_gone(starter), "the instance's starter ends with its container's process"


def test_a_users_own_starter_suid_names_no_instance(nshost, share):
    """Attacker: the user's own copy of the starter, named starter-suid in her home, exec'd with the
    argv[0] of an instance of root's: her process, never an instance, and no instance command."""
    host = nshost("h200x1", seed="apptainerfake")
    install_starter(host)
    home = os.path.join(share, "home")
    host.run(["install", "-D", "-o", str(USER), "-g", str(USER), "-m", "755", build(), home + "/apptainer/bin/starter-suid"], check=True)
    pid, _starter = start_instance(host, share, home + "/apptainer/bin/starter-suid", "system-vllm", user="root")
    facts = run_module(host, "gpu_facts")
    [holder] = [h for h in facts["ansible_facts"]["gpu"]["holders"] if h["pid"] == pid]
    assert holder["origin"] is None or holder["origin"]["kind"] != "apptainer_instance", holder["origin"]
    kept = run_module(host, "gpu_release", dict(FAST, kill=False))
    assert kept.failed and f"held by pid {pid} " in kept.msg, kept.msg
    assert "instance" not in kept.msg and "system-vllm" not in kept.msg, kept.msg
