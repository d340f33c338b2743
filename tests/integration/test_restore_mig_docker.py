"""A GPU container pinned to a MIG UUID, against a real Docker Engine on simulated A100s in MIG mode
(issue 71; the rig is docker_rig.py's, on the `a100-mig` preset).

Only MIG mode survives a reboot: the instances and their MIG UUIDs are lost, and a container whose
device request names a lost MIG UUID (`--gpus device=MIG-...`, or NVIDIA_VISIBLE_DEVICES=MIG-...,
as the NVIDIA container runtime reads it) cannot start. gpu_release stops the containers and
records the layout; after the simulated reboot gpu_restore refuses before anything starts, naming
the container and the UUID, and leaves every container stopped; with recreate_mig_layout the layout
comes back, a container pinned by the slice's place (`0:0`, which names the same slice again)
starts, and the one pinned to the old MIG UUID stays stopped, its reason naming the UUID the
instance at its place has now (the driver gives re-created instances new UUIDs).

What is read is the runtime's own record of the container (root's daemon, `docker inspect`), never
a file inside the container. What the test reads back comes from Docker and nvidia-smi."""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim")]
import docker_rig  # noqa: E402
from ansible_in_ns import run_module  # noqa: E402


@pytest.fixture(scope="module")
def mig_docker():
    with docker_rig.docker_node("a100-mig", "migdocker") as dockerd:
        yield dockerd


def mig_uuids(host):
    out = host.smi("-L", check=True).stdout
    return [line.split("UUID: ")[1].rstrip(")") for line in out.splitlines() if line.startswith("  MIG ")]


def running(rig, name):
    return rig.inspect(name)["State"]["Running"]


def test_a_container_pinned_to_a_lost_mig_uuid_is_named_and_with_recreate_mig_layout_the_slice_pinned_one_starts(mig_docker):
    rig = mig_docker
    host = rig.host
    uuid = host.config["gpus"][0]["uuid"]
    made = host.run(["nvidia-smi", "mig", "-i", "0", "-cgi", "9,9", "-C"])
    assert made.returncode == 0, made.stdout
    before = mig_uuids(host)
    assert len(before) == 2
    rig.run_holder("infer", [0], mib=10240, run_args=["-e", f"NVIDIA_VISIBLE_DEVICES={before[1]}"])
    rig.run_holder("batch", [0], mib=10240, run_args=["-e", "NVIDIA_VISIBLE_DEVICES=0:0"])
    try:
        # MIG idles at 55 MiB (tests/sim/README.md): the baseline accepted, as the gate's message says to.
        run = run_module(host, "gpu_release", {"kill_timeout": 2, "wait_timeout": 10, "max_used_mib": 64})
        assert not run.failed and run["released"], run.msg
        assert sorted(c["name"] for c in run["stopped_containers"]) == ["batch", "infer"]
        assert not running(rig, "infer") and not running(rig, "batch")
        os.unlink(os.path.join(host.root.state, "mig.json"))  # a reboot, as far as MIG goes: only MIG mode stays

        refused = run_module(host, "gpu_restore", {})
        assert refused.failed
        assert refused.msg.startswith(f"GPU 0 ({uuid}): its MIG layout is gone"), refused.msg
        assert f"These would not start, their MIG UUIDs no longer exist: container infer names {before[1]}." in refused.msg, refused.msg
        assert "container batch" not in refused.msg, refused.msg
        assert not running(rig, "infer") and not running(rig, "batch"), "a refused restore started a container"
        assert mig_uuids(host) == []

        restore = run_module(host, "gpu_restore", {"recreate_mig_layout": True})
        after = mig_uuids(host)
        assert len(after) == 2 and not set(after) & set(before), "re-created instances have new MIG UUIDs"
        assert restore["recreated_mig_layouts"] == [f"GPU 0 ({uuid}): nvidia-smi mig -i 0 -cgi 9,9 -C"], restore.result
        assert running(rig, "batch"), restore.msg
        assert restore["started_containers"] == ["batch"], restore.result
        assert not running(rig, "infer")
        [kept] = restore["not_restored"]
        assert kept["name"] == "infer", kept
        assert f"names MIG UUID {before[1]} (the instance at its place is now {after[1]}), which no longer exists" in kept["reason"], kept
        assert restore.failed and "infer" in restore.msg
        record = json.loads(host.read("/var/lib/zeromib-gpu/released.json"))
        assert [(e["kind"], e["name"]) for e in record["entries"]] == [("container", "infer")], record
    finally:
        rig.remove_all()
        for name in os.listdir(host.root.state):
            if name.startswith("ready-"):
                os.unlink(os.path.join(host.root.state, name))
