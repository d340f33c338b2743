"""Paused containers holding GPUs (issue 70), through the real gpu_release and gpu_restore on the
Docker rig (docker_rig.py): `docker pause` freezes a container's processes (the cgroup v1 freezer on
this machine), where no signal arrives until it is thawed.

- Named in `services`: unpaused through Docker, then stopped as any container (its own stop signal
  handled at once); gpu_restore starts it again (not paused).
- Not named: refused before anything is done, naming `docker unpause NAME`.
- Podman (4.3), whose stop refuses a paused container ("container state improper"): the same.
- The attacker: a user who freezes her own delegated cgroup and names it like a real paused
  container gets no runtime call (the container stays paused) and is named as her own frozen cgroup
  (tests/tenants/frozen_cgroup.py).
"""
import json
import os
import stat
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim"), os.path.dirname(HERE)]
from ansible_in_ns import COLLECTIONS, results_env, run_module  # noqa: E402
from docker_rig import IMAGE, used  # noqa: E402
from tenants.frozen_cgroup import frozen_holder  # noqa: E402
from test_container_engines import docker, podman, podman_rig, rig, spawn_bare  # noqa: E402,F401  # pylint: disable=unused-import  # fixtures, used by name

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "compat"))
import matrix  # noqa: E402

USER = 4242
REPO = os.path.dirname(os.path.dirname(HERE))
# The oldest ansible-core the collection supports and the newest.
ENDS = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
SUMMARY_TASK = "Fleet summary (unreachable, failed and dirty hosts first)"
VERDICT = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
OWN_PLAY = [{"name": "Train on the GPU nodes", "hosts": "gpu_nodes", "gather_facts": False, "become": False,
             "pre_tasks": [{"name": "Free the GPUs", "ansible.builtin.include_role": {"name": "zeromib.gpu.free_gpus"}}],
             "tasks": [{"name": "Train", "ansible.builtin.command": "true", "changed_when": True}]}]


def paused(docker, name):
    return docker.inspect(name)["State"]["Paused"]


def test_a_paused_container_named_in_services_is_unpaused_through_docker_then_stopped_and_restored(docker):
    record = docker.run_holder("parked-vllm", [0], restart="always")
    first = docker.ready_info("parked-vllm")["pid"]
    docker.docker("pause", "parked-vllm")
    assert paused(docker, "parked-vllm") is True
    args = {"services": ["container:parked-*"], "kill_timeout": 5}

    plan = run_module(docker.host, "gpu_release", args, check=True)
    assert not plan.failed, plan.msg
    assert [(e["name"], e.get("unpaused")) for e in plan["stopped_containers"]] == [("parked-vllm", True)]
    assert paused(docker, "parked-vllm") is True, "check mode thaws nothing"

    run = run_module(docker.host, "gpu_release", args)
    assert not run.failed, run.msg
    [entry] = run["stopped_containers"]
    assert (entry["id"], entry["image"], entry["runtime"], entry["unpaused"]) == (record["Id"], IMAGE, "docker", True)
    assert run["killed"] == [] and run["released"] is True and used(docker.host, 0) == 0
    # Thawed first, so its SIGTERM ended it at once (exit 143), well within the 5 s grace.
    state = docker.inspect("parked-vllm")["State"]
    assert entry["stopped_after_s"] < 4.0 and state["ExitCode"] != 137, (entry, state)
    assert state["Running"] is False and state["Paused"] is False

    restore = run_module(docker.host, "gpu_restore")
    assert not restore.failed, restore.msg
    assert restore["started_containers"] == ["parked-vllm"]
    docker.wait_ready("parked-vllm", not_pid=first)
    state = docker.inspect("parked-vllm")["State"]
    assert state["Running"] is True and state["Paused"] is False, "put back as started, not paused"


def test_a_paused_container_not_named_is_refused_naming_docker_unpause_and_nothing_is_done(docker):
    record = docker.run_holder("suspended", [0])
    docker.docker("pause", "suspended")
    bare = spawn_bare(docker, "1")
    run = run_module(docker.host, "gpu_release", {"kill_timeout": 1})
    assert run.failed
    assert run.msg.startswith("GPUs are held by paused containers: suspended (docker {}, {}) on GPU 0: its container is paused: "
                              "`docker unpause suspended` thaws it".format(record["Id"][:12], IMAGE)), run.msg
    assert "services (container:suspended)" in run.msg, run.msg
    assert "reboot" not in run.msg and "reset" not in run.msg, run.msg
    # Refused before anything was done: the container is still paused, the bare holder alive.
    assert paused(docker, "suspended") is True and used(docker.host, 0) >= 20480
    assert docker.host.alive(bare.pid) and used(docker.host, 1) >= 10240


def test_a_user_who_freezes_her_cgroup_and_names_it_like_a_paused_container_gets_no_runtime_call(docker):
    bystander = docker.run_holder("bystander", [1])
    docker.docker("pause", "bystander")
    with frozen_holder(docker.host, "zm-alice", mib=1024, uid=USER, delegated=True, named=f"docker/{bystander['Id']}") as held:
        facts = run_module(docker.host, "gpu_facts")
        [holder] = [h for h in facts["ansible_facts"]["gpu"]["holders"] if h["pid"] == held.pid]
        assert holder["container"] is None and holder["container_runtime"] is None, holder
        assert f"owned by uid {USER}" in (holder["container_note"] or ""), holder

        run = run_module(docker.host, "gpu_release", {"gpus": ["0"], "kill_timeout": 0.5, "wait_timeout": 1, "settle_timeout": 0})
        assert run.failed
        assert f"frozen (freezer.state FROZEN in {held.directory}): pid {held.pid} " in run.msg, run.msg
        assert f"the cgroup is in uid {USER}'s delegated subtree" in run.msg, run.msg
        assert "unpause" not in run.msg and "paused containers" not in run.msg, run.msg
        assert paused(docker, "bystander") is True, "no runtime call thawed the container she named"
        assert held.state() == "FROZEN" and run["stopped_containers"] == []


def test_podman_a_named_paused_container_is_unpaused_then_stopped_and_an_unnamed_one_is_refused(podman):
    podman.run_holder("pparked", [0], restart="no")
    podman.run_holder("psuspended", [1], restart="no")
    podman.docker("pause", "pparked")
    podman.docker("pause", "psuspended")

    refused = run_module(podman.host, "gpu_release", {"gpus": ["0", "1"], "services": ["container:pparked"], "kill_timeout": 5})
    assert refused.failed and "`podman unpause psuspended` thaws it" in refused.msg, refused.msg
    assert "pparked" not in refused.msg.split(".")[0] and paused(podman, "pparked") is True, "refused before anything was done"

    run = run_module(podman.host, "gpu_release", {"gpus": ["0"], "services": ["container:pparked"], "kill_timeout": 5})
    assert not run.failed, run.msg
    [entry] = run["stopped_containers"]
    assert (entry["name"], entry["runtime"], entry["unpaused"]) == ("pparked", "podman", True) and run["killed"] == []
    state = podman.inspect("pparked")["State"]
    assert state["Running"] is False and state["Paused"] is False and used(podman.host, 0) == 0
    assert paused(podman, "psuspended") is True and used(podman.host, 1) >= 20480


def controller_play(tmp_path, host, core, python, playbook, node_vars=None, flags=(), **extra):
    """ansible-playbook of ansible-core CORE on this machine, the simulated HOST as `node` of gpu_nodes
    (its Python enters the host's namespaces, as over SSH on a node) -> (rc, stdout, task records).
    `flags`: more of ansible-playbook's own options (--check)."""
    python_in = tmp_path / "python3"
    python_in.write_text(f"#!/bin/sh\nexec nsenter -t {host.init_pid:d} -m -u -p -- /usr/bin/python3 \"$@\"\n")
    python_in.chmod(stat.S_IRWXU)
    node = {"ansible_connection": "local", "ansible_python_interpreter": str(python_in), "free_gpus_kill_timeout": 1, "free_gpus_wait_timeout": 2,
            **(node_vars or {})}
    inventory = {"all": {"children": {"gpu_nodes": {"hosts": {"node": node}}}}}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    out = tmp_path / f"results-{os.path.basename(playbook)}.json"
    env = dict(os.environ, **results_env(str(out)))
    env.update(ANSIBLE_INVENTORY_ENABLED="yaml", ANSIBLE_COLLECTIONS_PATH=COLLECTIONS)
    argv = [str(matrix.controller_bin(core, python) / "ansible-playbook"), "-i", str(tmp_path / "inventory.json"), playbook, *flags]
    for key, value in extra.items():
        argv += ["-e", json.dumps({key: value})]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    with open(out) as handle:
        return proc.returncode, proc.stdout + proc.stderr, json.load(handle)["tasks"]


def said_first_by_free_gpus(tmp_path, host, core, python, head, once, flags=()):
    """free_gpus.yml fails the host, and its fleet summary's row for it starts with `head`; `once`
    is in the whole output once -> that row."""
    rc, output, tasks = controller_play(tmp_path, host, core, python, os.path.join(REPO, "playbooks", "free_gpus.yml"), flags=flags)
    assert rc == 2, output[-3000:]
    [summary] = [t for t in tasks if t["task"] == SUMMARY_TASK]
    [row] = [line for line in summary["result"]["msg"] if "node: " in line]
    assert row.split("node: ", 1)[1].startswith(head), row
    assert output.count(once) == 1, output[-4000:]
    return row


def said_first_in_own_play(tmp_path, host, core, python, head, once, flags=()):
    """The role in a user's own play: its verdict fails the host starting with `head`, the one fatal
    line carries it, `once` is in the whole output once, and training never starts."""
    (tmp_path / "train.yml").write_text(json.dumps(OWN_PLAY))
    rc, output, tasks = controller_play(tmp_path, host, core, python, str(tmp_path / "train.yml"), flags=flags)
    assert rc == 2, output[-3000:]
    [verdict] = [t for t in tasks if t["task"] == VERDICT]
    assert verdict["status"] == "failed" and verdict["result"]["msg"].startswith(f"node: {head}"), verdict["result"]
    [fatal] = [line for line in output.splitlines() if line.startswith(("fatal: [node]", "[ERROR]"))]
    assert head in fatal and output.count(once) == 1, output[-4000:]
    assert not [t for t in tasks if t["task"] == "Train"], "training never started"


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_the_refusal_of_a_paused_container_is_said_first_and_once_on_both_paths(docker, tmp_path, core, python):
    record = docker.run_holder("suspended", [0])
    docker.docker("pause", "suspended")
    head = ("GPUs are held by paused containers: suspended (docker {}, {}) on GPU 0: its container is paused: `docker unpause suspended` "
            "thaws it. gpu_release does not thaw a container it was not told to stop").format(record["Id"][:12], IMAGE)

    said_first_by_free_gpus(tmp_path, docker.host, core, python, head, "`docker unpause suspended` thaws it")
    said_first_in_own_play(tmp_path, docker.host, core, python, head, "`docker unpause suspended` thaws it")
    assert paused(docker, "suspended") is True and used(docker.host, 0) >= 20480
