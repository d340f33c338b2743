"""gpu_release and gpu_facts against a real Docker Engine (Debian's docker.io) on a simulated GPU
host: containers started with --restart=always hold simulated GPUs, and gpu_release must stop
them through Docker, never from outside, and prove that nothing comes back.

The rig is described in docker_rig.py. One dockerd serves the whole module; each test removes
its containers (by id, from that daemon only) and its bare processes, pass or fail."""
import json
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "sim")]
import docker_rig  # noqa: E402
from ansible_in_ns import COLLECTIONS, run_module  # noqa: E402
from docker_rig import IMAGE, used  # noqa: E402
from nshost import NsHost  # noqa: E402

SETTLE_S = 5.0  # plugins/module_utils/_act/_settle.py (settle_timeout default)
POD_UID = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"


@pytest.fixture(scope="module")
def rig():
    with docker_rig.docker_node("h200x8", "dockernode") as dockerd:
        yield dockerd


@pytest.fixture
def docker(rig):
    rig.bare = []
    yield rig
    if rig.pid is None:  # a test stopped the daemon and failed before starting it again
        rig.start()
    rig.remove_all()
    for proc in rig.bare:
        rig.host.kill(proc.pid)
        rig.host.wait_gone(proc.pid, 5)
    for name in os.listdir(rig.host.root.state):
        if name.startswith("ready-"):
            os.unlink(os.path.join(rig.host.root.state, name))


def spawn_bare(rig, gpus, *args):
    proc = rig.host.spawn(["gpu_holder", "--gpus", gpus, "--mib", "10240"] + list(args))
    rig.bare.append(proc)
    return proc


def names(entries):
    return sorted(entry["name"] for entry in entries)


def all_free(host, indexes=range(8)):
    return {i: used(host, i) for i in indexes}


def test_gpu_facts_names_the_container_and_image_of_a_holder(docker):
    docker.run_holder("vllm", [0])
    run = run_module(docker.host, "gpu_facts")
    assert not run.failed, run.msg
    [holder] = [h for h in run["ansible_facts"]["gpu"]["holders"] if 0 in h["gpu_indexes"]]
    record = docker.inspect("vllm")
    assert (holder["container"], holder["container_runtime"], holder["container_name"], holder["container_image"]) == (
        record["Id"], "docker", "vllm", IMAGE)
    assert holder["pod"] is None


def test_docker_restarts_a_container_killed_from_outside_within_the_settle_window(docker):
    # The measurement behind SETTLE_S: Docker's first restart of a killed --restart=always container.
    record = docker.run_holder("respawner", [0])
    first = docker.wait_ready("respawner")
    killed_at = time.monotonic()
    assert docker.host.kill(first)
    again = docker.wait_ready("respawner", not_pid=first, timeout=10)
    delay = time.monotonic() - killed_at
    print(f"docker restarted the killed container in {delay:.2f} s (pid {first} -> {again})")
    assert docker.inspect(record["Id"])["RestartCount"] == 1
    assert delay < SETTLE_S - 1.0


def test_restart_always_container_on_every_gpu_is_stopped_through_docker_and_stays_down(docker):
    record = docker.run_holder("vllm", list(range(8)), holder_args=["--workers", "8"])
    assert all(mib >= 20480 for mib in all_free(docker.host).values())

    plan = run_module(docker.host, "gpu_release", check=True)
    assert not plan.failed, plan.msg
    assert plan["changed"] is True and plan["released"] is False and plan["killed"] == []
    assert names(plan["stopped_containers"]) == ["vllm"] and plan["stopped_containers"][0]["restart_policy"] == "always"
    assert docker.inspect("vllm")["State"]["Running"] is True

    run = run_module(docker.host, "gpu_release", {"kill_timeout": 5})
    assert not run.failed, run.msg
    assert run["released"] is True and run["changed"] is True
    assert names(run["stopped_containers"]) == ["vllm"] and run["killed"] == [], "never signalled from outside"
    [entry] = run["stopped_containers"]
    assert (entry["id"], entry["image"], entry["runtime"], entry["gpu_indexes"]) == (record["Id"], IMAGE, "docker", list(range(8)))
    # Stopped through its runtime: nothing could respawn, so no settle window was spent.
    assert run["timings"]["settle_s"] == 0.0 and run["elapsed_s"] < 10

    time.sleep(5)
    state = docker.inspect("vllm")
    assert state["State"]["Running"] is False and state["RestartCount"] == 0
    assert all_free(docker.host) == {i: 0 for i in range(8)}

    again = run_module(docker.host, "gpu_release")
    assert not again.failed and again["changed"] is False and again["stopped_containers"] == []


def test_container_on_gpu_2_only_is_stopped_and_the_others_are_untouched(docker):
    docker.run_holder("infer-gpu2", [2])
    docker.run_holder("train-01", [0, 1])
    run = run_module(docker.host, "gpu_release", {"gpus": ["2"]})
    assert not run.failed, run.msg
    assert names(run["stopped_containers"]) == ["infer-gpu2"] and run["killed"] == [] and run["released"] is True
    assert docker.inspect("train-01")["State"]["Running"] is True and docker.inspect("infer-gpu2")["State"]["Running"] is False
    assert used(docker.host, 2) == 0 and used(docker.host, 0) >= 20480 and used(docker.host, 1) >= 20480


def test_container_ignoring_sigterm_is_stopped_by_docker_after_kill_timeout(docker):
    docker.run_holder("stubborn", [0], holder_args=["--ignore-term"])
    run = run_module(docker.host, "gpu_release", {"kill_timeout": 1})
    assert not run.failed, run.msg
    [entry] = run["stopped_containers"]
    # docker stop -t 1: SIGTERM, then Docker's own SIGKILL one second later.
    assert entry["name"] == "stubborn" and 1.0 <= entry["stopped_after_s"] < 4.0
    assert run["killed"] == [] and run["released"] is True and used(docker.host, 0) == 0
    assert docker.inspect("stubborn")["State"]["ExitCode"] == 137


def test_container_and_bare_process_each_go_their_way(docker):
    docker.run_holder("vllm-c", [0])
    bare = spawn_bare(docker, "1")
    run = run_module(docker.host, "gpu_release")
    assert not run.failed, run.msg
    assert names(run["stopped_containers"]) == ["vllm-c"]
    assert [(k["pid"], k["signal"], k["container"]) for k in run["killed"]] == [(bare.pid, "SIGTERM", None)]
    assert run["released"] is True and used(docker.host, 0) == 0 and used(docker.host, 1) == 0
    assert run["timings"]["settle_s"] == 0.0


def test_named_containers_disabled_stay_down_across_a_docker_restart(docker):
    docker.run_holder("vllm-a", [0, 1], restart="always")
    docker.run_holder("vllm-b", [2, 3], restart="unless-stopped")
    other = docker.run_holder("other", [4], restart="always")
    args = {"services": ["container:vllm*"], "service_state": "disabled"}
    run = run_module(docker.host, "gpu_release", args)
    assert not run.failed, run.msg
    assert names(run["disabled_containers"]) == ["vllm-a", "vllm-b"]
    assert names(run["stopped_containers"]) == ["other", "vllm-a", "vllm-b"] and run["killed"] == []
    policies = {name: docker.inspect(name)["HostConfig"]["RestartPolicy"]["Name"] for name in ("vllm-a", "vllm-b", "other")}
    assert policies == {"vllm-a": "no", "vllm-b": "no", "other": "always"}, "a container found holding a GPU is stopped only"

    first_other = docker.ready_info("other")["pid"]
    docker.restart()
    # Docker starts `always` containers when the daemon starts, even after a docker stop: the
    # one only stopped comes back; the named ones, disabled, do not.
    docker.wait_ready("other", not_pid=first_other, timeout=30)
    time.sleep(2)
    assert docker.inspect("vllm-a")["State"]["Running"] is False and docker.inspect("vllm-b")["State"]["Running"] is False
    assert docker.inspect(other["Id"])["State"]["Running"] is True
    assert [used(docker.host, i) for i in range(4)] == [0, 0, 0, 0]

    again = run_module(docker.host, "gpu_release", dict(args, gpus=["0", "1", "2", "3"]))
    assert not again.failed and again["changed"] is False
    assert again["disabled_containers"] == [] and again["stopped_containers"] == []


def test_unknown_container_name_is_listed_not_found(docker):
    run = run_module(docker.host, "gpu_release", {"services": ["container:nothing-here*"]})
    assert not run.failed, run.msg
    assert run["services_not_found"] == ["container:nothing-here*"] and run["changed"] is False


def test_kubernetes_pods_are_never_signalled_and_the_message_says_to_drain(docker):
    # dockershim's layout: the kubelet made Docker put the pod's container under its pod cgroup.
    pod = docker.run_holder(
        f"k8s_vllm_vllm-0_inference_{POD_UID}_0", [0],
        run_args=[f"--cgroup-parent=/kubepods/burstable/pod{POD_UID}",
                  "--label", "io.kubernetes.pod.namespace=inference", "--label", "io.kubernetes.pod.name=vllm-0",
                  "--label", f"io.kubernetes.pod.uid={POD_UID}", "--label", "io.kubernetes.container.name=vllm"])
    docker.cgroups.append(f"/kubepods/burstable/pod{POD_UID}")
    pod_pid = docker.ready_info(pod["Name"].lstrip("/"))["pid"]
    # A pod whose runtime cannot be asked: a process in /kubepods/besteffort/pod<uid>/<id>.
    other_uid = "9f8e7d6c-5b4a-3928-1706-f5e4d3c2b1a0"
    bare = spawn_bare(docker, "1")
    docker.make_cgroup("/kubepods/besteffort/pod{}/{}".format(other_uid, "ab" * 32), bare.host_pid)
    starts = {pid: docker.host.read(f"/proc/{pid}/stat").split()[21] for pid in (pod_pid, bare.pid)}

    for check in (True, False):
        run = run_module(docker.host, "gpu_release", check=check)
        assert run.failed, run.result
        assert "pod inference/vllm-0" in run.msg and f"pod UID {other_uid}" in run.msg
        assert "cordon" in run.msg and "drain" in run.msg
        assert run.get("killed") == [] and run.get("stopped_containers") == []
    assert {pid: docker.host.read(f"/proc/{pid}/stat").split()[21] for pid in (pod_pid, bare.pid)} == starts, "never signalled"
    state = docker.inspect(pod["Id"])
    assert state["State"]["Running"] is True and state["RestartCount"] == 0

    facts = run_module(docker.host, "gpu_facts")["ansible_facts"]["gpu"]
    pods = {h["pid"]: (h["pod"], h["pod_uid"]) for h in facts["holders"] if h["pod_uid"]}
    assert pods == {pod_pid: ("inference/vllm-0", POD_UID), bare.pid: (None, other_uid)}


def test_a_container_that_labels_itself_a_pod_is_no_kubelets_and_is_stopped_as_any(docker):
    # Who controls the labels: whoever creates the container (a compose file, a user of the
    # runtime's socket) writes io.kubernetes.pod.* at will. What a kubelet does and they did not:
    # place it under kubepods, which the kernel reports. Labels alone make no pod: gpu_release
    # neither refuses the host nor says "pod" in the facts; the container is stopped as any.
    labels = ["--label", "io.kubernetes.pod.namespace=inference", "--label", "io.kubernetes.pod.name=vllm-0",
              "--label", f"io.kubernetes.pod.uid={POD_UID}", "--label", "io.kubernetes.container.name=vllm"]
    fake = docker.run_holder("fake-pod", [1], run_args=labels)
    facts = run_module(docker.host, "gpu_facts")["ansible_facts"]["gpu"]
    holder = next(h for h in facts["holders"] if h["container"] == fake["Id"])
    assert (holder["pod"], holder["pod_uid"]) == (None, None), holder
    assert "labels name Kubernetes pod inference/vllm-0" in (holder.get("container_note") or ""), holder

    run = run_module(docker.host, "gpu_release", {"services": ["container:fake-pod"]})
    assert not run.failed, run.msg
    assert "kubectl" not in run.msg and [e["name"] for e in run["stopped_containers"]] == ["fake-pod"]
    assert docker.inspect(fake["Id"])["State"]["Running"] is False and used(docker.host, 1) == 0


def test_container_killed_from_outside_that_comes_back_fails_naming_it(docker):
    # gpu_release cannot reach this Docker (DOCKER_HOST names a socket that is not there), so it
    # can only signal the holder from outside; Docker restarts the container within the window.
    record = docker.run_holder("vllm-r", [0], restart="always")
    first = docker.ready_info("vllm-r")["pid"]
    run = run_module(docker.host, "gpu_release", extra_env={"DOCKER_HOST": "unix:///run/nowhere/docker.sock"})
    assert run.failed and run["released"] is False
    assert [k["pid"] for k in run["killed"]] == [first] and run["stopped_containers"] == []
    again = docker.wait_ready("vllm-r", not_pid=first, timeout=10)
    assert "came back" in run.msg and record["Id"][:12] in run.msg and f"pid {again}" in run.msg, run.msg
    assert run["timings"]["settle_s"] < SETTLE_S + 0.5
    assert any("could not be stopped through its runtime" in w for w in run.get("warnings", []) + [run.stdout])


def test_engine_api_and_cli_read_the_same_record(docker):
    record = docker.run_holder("twins", [5], restart="unless-stopped", run_args=["--label", "team=infer"])
    script = (
        "import json, sys; sys.path.insert(0, {!r})\n"
        "from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines as c\n"
        "api = c.EngineApi('docker', {!r}).inspect({!r})\n"
        "cli = c.EngineCli('docker', {!r}, c._run).inspect({!r})\n"
        "print(json.dumps([api, cli]))\n".format(COLLECTIONS, docker_rig.SOCKET, record["Id"], docker_rig.DOCKER, record["Id"])
    )
    result = docker.host.run(["python3", "-c", script], env={"DOCKER_HOST": "unix://" + docker_rig.SOCKET})
    assert result.returncode == 0, result.stderr
    api, cli = json.loads(result.stdout)
    assert api == cli
    assert (api["name"], api["image"], api["restart_policy"], api["running"]) == ("twins", IMAGE, "unless-stopped", True)


# ------------------------------------------------------------------ Podman (Debian's podman 4.3.1)


@pytest.fixture(scope="module")
def podman_rig():
    reason = docker_rig.rig_missing() or docker_rig.missing((docker_rig.PODMAN,))
    if reason:
        pytest.skip(reason)
    host = NsHost(preset="h200x8", count=4, seed="podmannode")
    podman = None
    try:
        host.start()
        podman = docker_rig.PodmanHost(host)
        podman.start()
        podman.build_image()
        yield podman
    finally:
        if podman is not None:
            podman.teardown()
        host.stop()
        if podman is not None:
            podman.remove_cgroups()


@pytest.fixture
def podman(podman_rig):
    podman_rig.bare = []
    yield podman_rig
    podman_rig.remove_all()
    for name in os.listdir(podman_rig.host.root.state):
        if name.startswith("ready-"):
            os.unlink(os.path.join(podman_rig.host.root.state, name))


def test_podman_restart_always_container_is_stopped_through_podman_and_stays_down(podman):
    record = podman.run_holder("pvllm", [0, 1], restart="always")
    run = run_module(podman.host, "gpu_release", {"kill_timeout": 5})
    assert not run.failed, run.msg
    [entry] = run["stopped_containers"]
    assert (entry["name"], entry["id"], entry["runtime"], entry["restart_policy"]) == ("pvllm", record["Id"], "podman", "always")
    assert run["killed"] == [] and run["released"] is True and run["timings"]["settle_s"] == 0.0
    facts_before = run["gpus_before"]
    assert facts_before[0]["memory_used_mib"] >= 20480
    time.sleep(3)
    state = podman.inspect("pvllm")
    assert state["State"]["Running"] is False and state.get("RestartCount", 0) == 0
    assert [used(podman.host, i) for i in range(4)] == [0, 0, 0, 0]


def test_podman_holder_is_named_in_gpu_facts(podman):
    podman.run_holder("pnamed", [3])
    run = run_module(podman.host, "gpu_facts")
    [holder] = [h for h in run["ansible_facts"]["gpu"]["holders"] if 3 in h["gpu_indexes"]]
    assert (holder["container_runtime"], holder["container_name"]) == ("podman", "pnamed") and holder["container_image"].endswith(IMAGE)


def test_podman_disabled_fails_clearly_where_podman_cannot_change_a_restart_policy(podman):
    podman.run_holder("pvllm-d", [2], restart="always")
    run = run_module(podman.host, "gpu_release", {"services": ["container:pvllm*"], "service_state": "disabled"})
    assert run.failed and "could not set the restart policy of container pvllm-d" in run.msg
    assert "this Podman cannot change a restart policy" in run.msg
    # Refused before anything was stopped.
    assert podman.inspect("pvllm-d")["State"]["Running"] is True and run["stopped_containers"] == []


# ------------------------------------------------------------------ what a user may name (issue 19, docs/docsite/rst/guide_security.rst)

USER = 4242


@pytest.mark.parametrize("subtree", ["user-manager", "delegated-unit"])
def test_users_holder_in_a_cgroup_named_after_anothers_container_never_stops_that_container(docker, subtree):
    """Stopping someone else's container: uid 4242 moves its GPU-1 process into a cgroup of its own
    delegated subtree named docker-<victim id>.scope (container ids are world-readable in
    /proc/PID/cgroup). The victim (a database holding no GPU) keeps running; the attacker's holder is
    signalled as the ordinary process it is."""
    out = docker.docker("run", "-d", "--name", "victim-db", "--restart=always", "--pid=host", "--network=none", "-v", "/usr:/usr:ro",
                        IMAGE, "sleep", "1000000").stdout
    victim = out.strip().splitlines()[-1]
    docker.created.append(victim)
    if subtree == "user-manager":
        relative = f"user.slice/user-{USER}.slice/user@{USER}.service/app.slice/docker-{victim}.scope"
    else:  # a unit with Delegate=yes and User=4242: no user@ in the path, the cgroup file system's owner tells
        relative = f"system.slice/delegated.service/docker-{victim}.scope"
    cgroup = docker.host.user_cgroup(relative, owner=USER)
    attacker = docker.host.spawn_as(USER, ["gpu_holder", "--gpus", "1", "--mib", "10240"])
    docker.bare.append(attacker)
    docker.host.move_to_cgroup(attacker.pid, cgroup)
    assert f"docker-{victim}.scope" in docker.host.read(f"/proc/{attacker.pid}/cgroup")

    run = run_module(docker.host, "gpu_release", {"gpus": [1]})
    assert not run.failed, run.msg
    assert run["stopped_containers"] == [] and run["disabled_containers"] == []
    assert [k["pid"] for k in run["killed"]] == [attacker.pid] and run["released"] is True
    assert any("no container or pod" in w for w in run.get("warnings", [])), run.get("warnings")
    state = docker.inspect("victim-db")["State"]
    assert state["Running"] is True and docker.inspect("victim-db")["RestartCount"] == 0
    assert not docker.host.alive(attacker.pid) and used(docker.host, 1) == 0
