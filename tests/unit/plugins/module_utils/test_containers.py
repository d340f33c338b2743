# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Container runtimes (_containers): cgroup paths, the Docker Engine API and CLI replayed from
real readings (tests/fixtures/docker), and the plan gpu_release makes for containers."""

from __future__ import annotations

import http.server
import json
import os
import socketserver
import threading
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils import _containers as containers
from ansible_collections.zeromib.gpu.plugins.module_utils import _engines as engines
from ansible_collections.zeromib.gpu.plugins.module_utils._errors import StepFailed

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "fixtures", "docker")
ID64 = "4f3c2b1a" * 8
UID = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"


def fixture(name):
    with open(os.path.join(FIXTURES, name)) as handle:
        return handle.read()


def inspect_fixture(name):
    data = json.loads(fixture(name))
    return data[0] if isinstance(data, list) else data


# ------------------------------------------------------------------ cgroup paths


@pytest.mark.parametrize(
    "path, expected",
    [
        (f"/docker/{ID64}", (ID64, "docker", False, None)),
        (f"/system.slice/docker-{ID64}.scope", (ID64, "docker", False, None)),
        (f"/machine.slice/libpod-{ID64}.scope/container", (ID64, "podman", False, None)),
        # A user's own subtree: whatever they name there is theirs (rootless Podman too): no container.
        (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID64}.scope/container", None),
        (f"/user.slice/user-4242.slice/user@4242.service/app.slice/docker-{ID64}.scope", None),
        ("/user.slice/user-4242.slice/user@4242.service/kubepods.slice/kubepods-besteffort-pod{}.slice".format(UID.replace("-", "_")), None),
        (f"/libpod_parent/libpod-{ID64}", (ID64, "podman", False, None)),
        (f"/machine.slice/libpod-conmon-{ID64}.scope", None),
        ("/system.slice/containerd.service", None),
        (f"/system.slice/nerdctl-{ID64}.scope", (ID64, "containerd", False, None)),
        (
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{}.scope".format(UID.replace("-", "_"), ID64),
            (ID64, "containerd", True, UID),
        ),
        ("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/crio-{}.scope".format(UID.replace("-", "_"), ID64),
         (ID64, "cri-o", True, UID)),
        (f"/kubepods/burstable/pod{UID}/{ID64}", (ID64, None, True, UID)),
        (f"/kubepods/pod{UID}/{ID64}", (ID64, None, True, UID)),
        (f"/kubepods/burstable/pod{UID}", (None, None, True, UID)),
        (
            "/system.slice/containerd.service/kubepods-burstable-pod{}.slice:cri-containerd:{}".format(UID.replace("-", "_"), ID64),
            (ID64, "containerd", True, UID),
        ),
        (f"/kubepods/burstable/pod0123456789abcdef0123456789abcdef/{ID64}", (ID64, None, True, "0123456789abcdef0123456789abcdef")),
        ("/system.slice/vllm.service", None),
        ("/", None),
        ("", None),
        (None, None),
    ],
    ids=[
        "docker-cgroupfs",
        "docker-systemd",
        "podman-systemd",
        "podman-rootless-is-the-users-own",
        "docker-id-named-in-a-user-subtree",
        "kubepods-in-a-user-subtree",
        "podman-cgroupfs",
        "podman-conmon-is-not-the-container",
        "containerd-daemon-itself",
        "nerdctl",
        "k8s-containerd-systemd",
        "k8s-crio-systemd",
        "k8s-cgroupfs-burstable",
        "k8s-cgroupfs-guaranteed",
        "k8s-pod-level",
        "k8s-containerd-under-its-service",
        "k8s-static-pod-hash-uid",
        "system-service",
        "root",
        "empty",
        "none",
    ],
)
def test_container_ref_of_a_cgroup_path(path, expected):
    ref = _cgroups.container_ref(path)
    assert (None if ref is None else (ref["id"], ref["runtime"], ref["kubernetes"], ref["pod_uid"])) == expected
    assert _cgroups.container_of(path) == (expected[0] if expected else None)


def test_real_proc_cgroup_of_a_docker_and_a_dockershim_pod_container():
    from ansible_collections.zeromib.gpu.plugins.module_utils import _holders

    vllm = _cgroups.container_ref(_holders.parse_cgroup(fixture("proc-cgroup-vllm.txt")))
    assert vllm["runtime"] == "docker" and vllm["id"] == inspect_fixture("api-inspect-vllm.json")["Id"] and not vllm["kubernetes"]
    pod = _cgroups.container_ref(_holders.parse_cgroup(fixture("proc-cgroup-k8s.txt")))
    assert pod["kubernetes"] and pod["pod_uid"] == UID and pod["id"] == inspect_fixture("api-inspect-k8s.json")["Id"]


def test_split_services_names_containers_with_a_prefix():
    assert containers.split_services(["vllm*.service", "container:vllm*", " container: sglang ", "container:vllm*", "tgi"]) == (
        ["vllm*.service", "tgi"],
        ["vllm*", "sglang"],
    )


# ------------------------------------------------------------------ records from real readings


def test_record_of_a_running_restart_always_container():
    record = engines.record_of(inspect_fixture("api-inspect-vllm.json"))
    assert record == {
        "id": inspect_fixture("api-inspect-vllm.json")["Id"],
        "name": "vllm",
        "image": "zeromib/holder:test",
        "restart_policy": "always",
        "restart_max_retries": 0,
        "running": True,
        "status": "running",
        "pod": None,
        "pod_uid": None,
        "pid": inspect_fixture("api-inspect-vllm.json")["State"]["Pid"],
    }
    assert engines.record_of(inspect_fixture("cli-inspect-vllm.json")) == record


def test_record_of_a_pod_container_and_of_a_stopped_one():
    pod = engines.record_of(inspect_fixture("api-inspect-k8s.json"))
    assert (pod["pod"], pod["pod_uid"], pod["restart_policy"]) == ("inference/vllm-0", UID, "no")
    stopped = engines.record_of(inspect_fixture("api-inspect-stopped.json"))
    assert (stopped["name"], stopped["running"], stopped["status"], stopped["restart_policy"]) == ("stopped-one", False, "exited", "unless-stopped")


def test_empty_restart_policy_reads_no():
    assert engines.record_of({"Id": ID64, "Name": "/x", "HostConfig": {"RestartPolicy": {"Name": ""}}})["restart_policy"] == "no"
    assert engines.record_of({"Id": ID64, "Name": "/x"})["restart_policy"] == "no"


# ------------------------------------------------------------------ the Engine API over a unix socket


class FakeEngine:
    """A Docker Engine API on a unix socket answering with the captured readings."""

    def __init__(self, path):
        self.path = path
        self.requests = []
        self.stop_delay = 0.0
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, status, body):
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                engine.requests.append(("GET", self.path, None))
                if self.path == "/_ping":
                    return self._answer(200, "OK")
                if self.path == "/containers/json?all=1":
                    return self._answer(200, fixture("api-containers-json-all.json"))
                for name in ("vllm", "k8s", "stopped"):
                    record = inspect_fixture(f"api-inspect-{name}.json")
                    if self.path in ("/containers/{}/json".format(record["Id"]), "/containers/{}/json".format(record["Name"].lstrip("/"))):
                        return self._answer(200, json.dumps(record))
                return self._answer(404, fixture("api-inspect-missing.json"))

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode() if length else None
                engine.requests.append(("POST", self.path, body))
                if "/stop" in self.path:
                    time.sleep(engine.stop_delay)
                    return self._answer(204, "")
                return self._answer(200, fixture("api-update-restart-no.json"))

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.server = Server(path, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine(tmp_path):
    server = FakeEngine(str(tmp_path / "docker.sock"))
    yield server
    server.close()


def test_engine_api_inspects_lists_stops_and_disables(engine):
    api = engines.EngineApi("docker", engine.path)
    vllm = inspect_fixture("api-inspect-vllm.json")
    assert api.ping() is True
    assert api.inspect(vllm["Id"])["name"] == "vllm"
    assert api.inspect("0" * 64) is None
    assert len(api.list_ids()) == 3
    api.stop(vllm["Id"], 2.5)
    api.set_restart_no(vllm["Id"])
    assert engine.requests[-2:] == [
        ("POST", "/containers/{}/stop?t=3".format(vllm["Id"]), None),
        ("POST", "/containers/{}/update".format(vllm["Id"]), '{"RestartPolicy": {"Name": "no"}}'),
    ]


def test_engine_api_on_a_dead_socket_is_unavailable(tmp_path):
    with pytest.raises(engines.RuntimeUnavailable):
        engines.EngineApi("docker", str(tmp_path / "nothing.sock")).ping()


def test_runtimes_prefers_the_socket_and_docker_host_is_the_only_place_asked(engine, tmp_path):
    assert isinstance(engines.Runtimes(environ={}, which=lambda n: None, sockets={"docker": ("DOCKER_HOST", (engine.path,))}).client("docker"),
                      engines.EngineApi)
    elsewhere = engines.Runtimes(environ={"DOCKER_HOST": "unix://" + str(tmp_path / "gone.sock")}, which=lambda n: None,
                                    sockets={"docker": ("DOCKER_HOST", (engine.path,))})
    assert elsewhere.client("docker") is None and "no docker socket" in elsewhere.error("docker")
    named = engines.Runtimes(environ={"DOCKER_HOST": "unix://" + engine.path}, which=lambda n: None, sockets={"docker": ("DOCKER_HOST", ())})
    assert named.client("docker").socket_path == engine.path


class FakeCli:
    """docker CLI answers, from the captures."""

    def __init__(self, daemon_up=True):
        self.calls = []
        self.daemon_up = daemon_up

    def __call__(self, argv, timeout):
        self.calls.append((list(argv), timeout))
        args = argv[1:]
        if not self.daemon_up:
            return 1, "", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?\n"
        if args[0] == "version":
            return 0, "20.10.24+dfsg1\n", ""
        if args[0] == "inspect":
            if args[-1] == inspect_fixture("cli-inspect-vllm.json")["Id"]:
                return 0, fixture("cli-inspect-vllm.json"), ""
            return 1, "[]\n", fixture("cli-inspect-missing.stderr.txt")
        if args[0] == "ps":
            return 0, fixture("cli-ps-a-q-no-trunc.txt"), ""
        if args[0] == "update":
            return 0, fixture("cli-update-restart-no.stdout.txt"), ""
        if args[0] == "stop":
            return 0, args[-1] + "\n", ""
        return 2, "", "unknown"


def test_cli_serves_where_no_socket_answers():
    cli = FakeCli()
    runtimes = engines.Runtimes(run=cli, environ={}, which=lambda n: "/usr/bin/" + n if n == "docker" else None, sockets={"docker": ("DOCKER_HOST", ())})
    vllm_id = inspect_fixture("cli-inspect-vllm.json")["Id"]
    assert runtimes.inspect("docker", vllm_id)["restart_policy"] == "always"
    assert runtimes.inspect("docker", "0" * 64) is None
    runtimes.stop("docker", vllm_id, 10)
    runtimes.set_restart_no("docker", vllm_id)
    assert [c[0][1:] for c in cli.calls[-2:]] == [["stop", "-t", "10", vllm_id], ["update", "--restart=no", vllm_id]]
    # The stop may take its grace and Docker's SIGKILL: the command's own limit allows for both.
    assert cli.calls[-2][1] == 10 + engines.STOP_MARGIN_S


def test_cli_of_a_daemon_that_is_down_is_unavailable_with_its_message():
    runtimes = engines.Runtimes(run=FakeCli(daemon_up=False), environ={}, which=lambda n: "/usr/bin/docker", sockets={"docker": ("DOCKER_HOST", ())})
    assert runtimes.client("docker") is None and "Cannot connect to the Docker daemon" in runtimes.error("docker")
    with pytest.raises(engines.RuntimeUnavailable):
        runtimes.inspect("docker", ID64)


# ------------------------------------------------------------------ annotate, plan, act


class FakeRuntimes:
    """Runtimes with containers in memory: {id: record}, per runtime."""

    def __init__(self, records=None, runtime="docker", reachable=True, pods=None, stop_delay=0.0, fail_stop=()):
        self.records = {(runtime, r["id"]): dict(r) for r in records or []}
        self.reachable = reachable
        self.pods = pods or {}
        self.log = []
        self.stop_delay = stop_delay
        self.fail_stop = set(fail_stop)

    def client(self, runtime):
        return self if self.reachable else None

    def error(self, runtime):
        return f"no {runtime} here"

    # State.Pid of each container: set by annotate() below from the holders in its cgroup.
    members = {}

    def inspect(self, runtime, cid):
        if not self.reachable:
            raise engines.RuntimeUnavailable(f"no {runtime} here")
        record = self.records.get((runtime, cid))
        if not record:
            return None
        return dict(record, pid=record.get("pid", self.members.get(cid)))

    def find(self, glob):
        import fnmatch

        return [(runtime, dict(r)) for (runtime, _cid), r in sorted(self.records.items()) if fnmatch.fnmatchcase(r["name"], glob)]

    def stop(self, runtime, cid, grace):
        self.log.append(("stop", cid, grace))
        time.sleep(self.stop_delay)
        if cid in self.fail_stop:
            raise engines.RuntimeUnavailable("daemon said no")
        self.records[(runtime, cid)]["running"] = False

    def set_restart_no(self, runtime, cid):
        self.log.append(("update", cid))
        self.records[(runtime, cid)]["restart_policy"] = "no"

    def pod_of(self, cid):
        return self.pods.get(cid)


def record(cid, name, restart="always", running=True, pod=None, pod_uid=None, image="vllm/vllm-openai:v0.11.0"):
    return {"id": cid, "name": name, "image": image, "restart_policy": restart, "running": running, "status": "running" if running else "exited",
            "pod": pod, "pod_uid": pod_uid}


def holder(pid, cgroup, gpus=(0,), protected=False, name="python3"):
    return {"pid": pid, "name": name, "cmdline": "python3 -m vllm.entrypoints.openai.api_server", "cgroup": cgroup, "gpu_indexes": list(gpus),
            "protected": protected, "container": _cgroups.container_of(cgroup), "unit": None, "user": "root"}


A, B, C = "a" * 64, "b" * 64, "c" * 64


def annotate(holders, runtimes, mounts=()):
    """containers.annotate on holders whose /proc/PID/cgroup are their `cgroup`; each container's
    State.Pid is its first holder (as Docker reports its init), unless its record says otherwise."""
    cgroups = {h["pid"]: h["cgroup"] for h in holders}
    members = {}
    for h in sorted(holders, key=lambda h: h["pid"]):
        ref = _cgroups.container_ref(h["cgroup"])
        if ref and ref["id"]:
            members.setdefault(ref["id"], h["pid"])
    runtimes.members = members
    return containers.annotate(holders, runtimes, mounts=list(mounts), cgroup_of=cgroups.get)


def test_annotate_names_container_image_and_pod():
    runtimes = FakeRuntimes([record(A, "vllm"), record(B, "k8s_vllm_vllm-0", pod="inference/vllm-0", pod_uid=UID)], pods={C: "ml/trainer-7"})
    holders = annotate(
        [
            holder(1, f"/docker/{A}"),
            holder(2, f"/kubepods/burstable/pod{UID}/{B}"),
            holder(3, "/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{}.scope".format(UID.replace("-", "_"), C)),
            holder(4, "/user.slice/user-0.slice/session-1.scope"),
        ],
        runtimes,
    )
    assert [(h["container_runtime"], h["container_name"], h["container_image"], h["pod"], h["pod_uid"]) for h in holders] == [
        ("docker", "vllm", "vllm/vllm-openai:v0.11.0", None, None),
        ("docker", "k8s_vllm_vllm-0", "vllm/vllm-openai:v0.11.0", "inference/vllm-0", UID),
        ("containerd", None, None, "ml/trainer-7", UID),
        (None, None, None, None, None),
    ]


def test_annotate_without_a_runtime_keeps_what_the_cgroup_says():
    [h] = annotate([holder(1, f"/system.slice/docker-{A}.scope")], FakeRuntimes(reachable=False))
    assert (h["container"], h["container_runtime"], h["container_name"]) == (A, "docker", None)


def plan(runtimes, holders, named=(), state="stopped", own=(), stop_found=True):
    holders = annotate(holders, runtimes)
    targets = [h for h in holders if not h["protected"]]
    return containers.plan(runtimes, holders, targets, list(named), state, set(own), stop_found=stop_found)


def test_found_container_is_stopped_not_signalled_and_bare_process_is_signalled():
    runtimes = FakeRuntimes([record(A, "vllm")])
    steps = plan(runtimes, [holder(1, f"/docker/{A}", gpus=(0, 1)), holder(2, f"/docker/{A}", gpus=(2,)), holder(3, "/user.slice/x.scope")])
    assert [(e["name"], e["gpu_indexes"], e["restart_policy"]) for e in steps.stop] == [("vllm", [0, 1, 2], "always")]
    assert [h["pid"] for h in steps.signal] == [3] and steps.disable == [] and steps.outside == [] and steps.warnings == []


def test_container_the_runtime_cannot_be_asked_for_is_signalled_from_outside_with_a_warning():
    steps = plan(FakeRuntimes(reachable=False), [holder(1, f"/docker/{A}")])
    assert steps.stop == [] and [h["pid"] for h in steps.signal] == [1]
    assert [reason for _h, reason in steps.outside] == ["no docker here"]
    assert f"container {A[:12]} (docker) could not be stopped through its runtime (no docker here)" in steps.warnings[0]


def test_containers_of_runtimes_it_cannot_stop_are_signalled_from_outside():
    steps = plan(FakeRuntimes(), [holder(1, f"/system.slice/nerdctl-{A}.scope")])
    assert [h["pid"] for h in steps.signal] == [1] and [reason for _h, reason in steps.outside] == ["gpu_release cannot stop containerd containers"]


def test_container_that_also_runs_a_protected_process_is_not_stopped():
    steps = plan(FakeRuntimes([record(A, "gpu-tools")]), [holder(1, f"/docker/{A}"), holder(2, f"/docker/{A}", protected=True, name="nv-hostengine")])
    assert steps.stop == [] and [reason for _h, reason in steps.outside] == ["it also runs a protected process"]


def test_kill_false_stops_no_found_container():
    steps = plan(FakeRuntimes([record(A, "vllm")]), [holder(1, f"/docker/{A}")], stop_found=False)
    assert steps.stop == [] and steps.warnings == []


def test_named_containers_get_service_state_and_found_ones_are_only_stopped():
    runtimes = FakeRuntimes([record(A, "vllm-a"), record(B, "vllm-b", restart="no", running=False), record(C, "other")])
    steps = plan(runtimes, [holder(1, f"/docker/{C}")], named=["vllm*", "sglang*"], state="disabled")
    assert [e["name"] for e in steps.disable] == ["vllm-a"]
    assert [e["name"] for e in steps.stop] == ["vllm-a", "other"] and steps.not_found == ["container:sglang*"]


def test_masked_leaves_named_containers_as_disabled_does():
    steps = plan(FakeRuntimes([record(A, "vllm-a", restart="unless-stopped")]), [], named=["vllm-a"], state="masked")
    assert [e["name"] for e in steps.disable] == ["vllm-a"]


def test_a_pod_is_refused_before_anything_is_done():
    runtimes = FakeRuntimes([record(B, "k8s_vllm", pod="inference/vllm-0", pod_uid=UID)])
    with pytest.raises(StepFailed) as info:
        plan(runtimes, [holder(1, f"/docker/{A}"), holder(2, f"/kubepods/burstable/pod{UID}/{B}", gpus=(3,)),
                        holder(3, "/kubepods/besteffort/pod{}/{}".format("9" * 32, C))])
    message = info.value.msg
    assert "pod inference/vllm-0 (pid 2 python3 on GPU 3, container bbbbbbbbbbbb)" in message
    assert "pod UID %s (pid 3" % ("9" * 32) in message and "kubectl cordon" in message and "kubectl drain" in message
    assert runtimes.log == []


def test_a_named_pod_container_or_own_container_is_refused():
    runtimes = FakeRuntimes([record(B, "vllm-pod", pod="inference/vllm-0", pod_uid=UID), record(A, "ansible-runner")])
    with pytest.raises(StepFailed, match="belongs to Kubernetes pod inference/vllm-0"):
        plan(runtimes, [], named=["vllm*"])
    with pytest.raises(StepFailed, match="refusing to stop container ansible-runner .* runs this Ansible session"):
        plan(runtimes, [], named=["ansible*"], own=[A])


def test_act_disables_first_then_stops_every_container_at_once():
    runtimes = FakeRuntimes([record(A, "vllm-a"), record(B, "vllm-b")], stop_delay=0.3)
    steps = plan(runtimes, [], named=["vllm*"], state="disabled")
    started = time.monotonic()
    done = containers.act(runtimes, steps, 7.5)
    assert done["failed"] == {}
    assert time.monotonic() - started < 0.55, "both stops ran side by side"
    assert [entry[0] for entry in runtimes.log[:2]] == ["update", "update"] and sorted(runtimes.log[2:]) == [("stop", A, 7.5), ("stop", B, 7.5)]
    assert [(e["name"], e["restart_policy"], e["restart_policy_before"]) for e in done["disabled"]] == [
        ("vllm-a", "no", "always"),
        ("vllm-b", "no", "always"),
    ]
    assert [e["name"] for e in done["stopped"]] == ["vllm-a", "vllm-b"]
    assert all(e["stopped_after_s"] >= 0.3 for e in done["stopped"])


def test_act_reports_a_container_it_could_not_stop():
    runtimes = FakeRuntimes([record(A, "vllm-a")], fail_stop=[A])
    steps = plan(runtimes, [holder(1, f"/docker/{A}")])
    done = containers.act(runtimes, steps, 1)
    assert done["failed"] == {A: "daemon said no"}
    assert done["stopped"] == [] and "could not stop container vllm-a" in done["warnings"][0]


def test_grace_is_whole_seconds_rounded_up():
    assert [engines.grace_seconds(x) for x in (0, 0.2, 1, 1.5, 10)] == [0, 1, 1, 2, 10]


# ------------------------------------------------------------------ what a user may name (docs/security.md)


def test_cgroup_in_a_directory_a_user_owns_is_no_container(tmp_path):
    """The kernel's word: systemd chowns a delegated subtree to its user, who may then create and
    name cgroups in it (docker-<victim id>.scope, kubepods.slice) without any user@ in the path."""
    mount = tmp_path / "cgroup"
    leaf = mount / "system.slice" / "delegated.service" / (f"docker-{A}.scope")
    leaf.mkdir(parents=True)
    os.chown(str(mount / "system.slice" / "delegated.service"), 4242, 4242)
    path = f"/system.slice/delegated.service/docker-{A}.scope"
    assert _cgroups.delegated_to(path, [str(mount)]) == 4242
    assert _cgroups.delegated_to("/system.slice", [str(mount)]) is None
    runtimes = FakeRuntimes([record(A, "victim-db")])
    [h] = annotate([holder(7, path)], runtimes, mounts=[str(mount)])
    assert h["container"] is None and h["_container_ref"] is None and "owned by uid 4242" in h["container_note"]
    steps = containers.plan(runtimes, [h], [h], [], "stopped", set())
    assert steps.stop == [] and [t["pid"] for t in steps.signal] == [7] and runtimes.log == []


def test_kubepods_cgroup_a_user_made_is_no_pod_and_blocks_nothing(tmp_path):
    mount = tmp_path / "cgroup"
    path = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{}.scope".format(UID.replace("-", "_"), C)
    (mount / path.lstrip("/")).mkdir(parents=True)
    os.chown(str(mount / "kubepods.slice"), 4242, 4242)
    [h] = annotate([holder(8, path)], FakeRuntimes(), mounts=[str(mount)])
    assert containers.pod_holders([h]) == [] and h["pod_uid"] is None
    steps = containers.plan(FakeRuntimes(), [h], [h], [], "stopped", set())
    assert [t["pid"] for t in steps.signal] == [8]


def test_container_its_runtime_does_not_run_the_holder_in_is_never_stopped():
    """A cgroup path naming the victim's container (outside any delegated subtree, e.g. a runtime's
    cgroupfs layout copied) is believed only when Docker's State.Pid, or its cgroup, holds the process."""
    runtimes = FakeRuntimes([dict(record(A, "victim-db"), pid=300)])
    attacker = holder(9, f"/docker/{A}/evil")
    cgroups = {9: attacker["cgroup"], 300: f"/docker/{B}"}
    [h] = containers.annotate([attacker], runtimes, mounts=[], cgroup_of=cgroups.get)
    assert h["container"] is None and "does not run this process in it" in h["container_note"]
    steps = containers.plan(runtimes, [h], [h], [], "stopped", set())
    assert steps.stop == [] and runtimes.log == []


@pytest.mark.parametrize(
    "holder_pid, holder_cgroup, init_cgroup, expected",
    [
        (300, "/docker/" + A, "/docker/" + A, True),  # the container's init itself
        (301, "/docker/" + A, "/docker/" + A, True),  # a process beside it
        (302, f"/system.slice/docker-{A}.scope/sub", f"/system.slice/docker-{A}.scope", True),  # below it
        (303, f"/docker/{A}x", "/docker/" + A, False),  # a sibling whose name starts alike
        (304, "/docker/" + A, None, False),  # State.Pid gone
        (305, "/", "/", False),
    ],
    ids=["init", "beside-init", "below-init", "prefix-sibling", "init-gone", "root-cgroup"],
)
def test_confirmed_by_state_pid_or_its_cgroup(holder_pid, holder_cgroup, init_cgroup, expected):
    cgroups = {300: init_cgroup}
    assert containers.confirmed({"pid": holder_pid, "cgroup": holder_cgroup}, {"pid": 300}, cgroups.get) is expected
    assert containers.confirmed({"pid": holder_pid, "cgroup": holder_cgroup}, {"pid": None}, cgroups.get) is False


def test_cgroup_mounts_are_cgroup2_and_v1_name_systemd(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "25 21 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
        "26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        "27 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,xattr,name=systemd\n"
        "30 25 0:27 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
    )
    assert _cgroups.cgroup_mounts(str(mountinfo)) == ["/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"]


def test_container_named_in_a_user_managers_subtree_is_an_ordinary_holder_with_a_note():
    path = f"/user.slice/user-4242.slice/user@4242.service/app.slice/docker-{A}.scope"
    runtimes = FakeRuntimes([record(A, "victim-db")])
    [h] = annotate([holder(7, path), ], runtimes)
    assert h["container"] is None and "user@4242.service" in h["container_note"] and "no container or pod" in h["container_note"]
    [plain] = annotate([holder(8, "/user.slice/user-4242.slice/user@4242.service/app.slice/foo.service")], runtimes)
    assert plain["container_note"] is None
