# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The Docker Engine API and CLI clients (_engines), replayed from real readings (tests/fixtures/docker)."""

from __future__ import annotations

import http.server
import json
import os
import socketserver
import threading
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines as engines

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "docker")
ID64 = "4f3c2b1a" * 8
UID = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"


def fixture(name):
    with open(os.path.join(FIXTURES, name)) as handle:
        return handle.read()


def inspect_fixture(name):
    data = json.loads(fixture(name))
    return data[0] if isinstance(data, list) else data


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
        "paused": False,
        "pod": None,
        "pod_uid": None,
        "pod_claim": None,
        "pid": inspect_fixture("api-inspect-vllm.json")["State"]["Pid"],
        "labels": {},
        "gpu_devices": [],
    }
    assert engines.record_of(inspect_fixture("cli-inspect-vllm.json")) == record


def test_record_of_a_pod_container_and_of_a_stopped_one():
    pod = engines.record_of(inspect_fixture("api-inspect-k8s.json"))
    assert (pod["pod"], pod["pod_uid"], pod["restart_policy"]) == ("inference/vllm-0", UID, "no")
    stopped = engines.record_of(inspect_fixture("api-inspect-stopped.json"))
    assert (stopped["name"], stopped["running"], stopped["status"], stopped["restart_policy"]) == ("stopped-one", False, "exited", "unless-stopped")


def test_pod_labels_make_a_pod_only_where_a_kubelet_placed_the_container():
    # Attacker: whoever creates a container writes io.kubernetes.* labels at will; a kubelet also
    # sets its cgroup parent under kubepods. Labels alone are a claim, never a pod.
    inspect = inspect_fixture("api-inspect-k8s.json")
    inspect["HostConfig"]["CgroupParent"] = ""
    claimed = engines.record_of(inspect)
    assert (claimed["pod"], claimed["pod_uid"], claimed["pod_claim"]) == (None, None, "inference/vllm-0")
    inspect["HostConfig"]["CgroupParent"] = "kubepods-burstable-pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901.slice"
    placed = engines.record_of(inspect)
    assert (placed["pod"], placed["pod_uid"], placed["pod_claim"]) == ("inference/vllm-0", UID, None)


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
                if self.path.endswith("/unpause"):  # Docker 20.10: 204, or 500 for one that is not paused
                    paused = self.path == "/containers/{}/unpause".format(inspect_fixture("api-inspect-paused.json")["Id"])
                    return self._answer(204, "") if paused else self._answer(500, fixture("api-unpause-not-paused.json"))
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


def test_engine_api_unpauses_and_says_why_not(engine):
    api = engines.EngineApi("docker", engine.path)
    parked = inspect_fixture("api-inspect-paused.json")["Id"]
    api.unpause(parked)
    assert engine.requests[-1] == ("POST", f"/containers/{parked}/unpause", None)
    with pytest.raises(engines.RuntimeUnavailable, match=r"/unpause answered 500: Container .* is not paused"):
        api.unpause(inspect_fixture("api-inspect-vllm.json")["Id"])


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
        if args[0] in ("stop", "unpause"):
            return 0, args[-1] + "\n", ""
        return 2, "", "unknown"


def test_cli_serves_where_no_socket_answers():
    cli = FakeCli()
    runtimes = engines.Runtimes(run=cli, environ={}, which=lambda n: "/usr/bin/" + n if n == "docker" else None, sockets={"docker": ("DOCKER_HOST", ())})
    vllm_id = inspect_fixture("cli-inspect-vllm.json")["Id"]
    assert runtimes.inspect("docker", vllm_id)["restart_policy"] == "always"
    assert runtimes.inspect("docker", "0" * 64) is None
    runtimes.stop("docker", vllm_id, 10)
    runtimes.unpause("docker", vllm_id)
    runtimes.set_restart_no("docker", vllm_id)
    assert [c[0][1:] for c in cli.calls[-3:]] == [["stop", "-t", "10", vllm_id], ["unpause", vllm_id], ["update", "--restart=no", vllm_id]]
    # The stop may take its grace and Docker's SIGKILL: the command's own limit allows for both.
    assert cli.calls[-3][1] == 10 + engines.STOP_MARGIN_S


def test_cli_of_a_daemon_that_is_down_is_unavailable_with_its_message():
    runtimes = engines.Runtimes(run=FakeCli(daemon_up=False), environ={}, which=lambda n: "/usr/bin/docker", sockets={"docker": ("DOCKER_HOST", ())})
    assert runtimes.client("docker") is None and "Cannot connect to the Docker daemon" in runtimes.error("docker")
    with pytest.raises(engines.RuntimeUnavailable):
        runtimes.inspect("docker", ID64)


def test_grace_is_whole_seconds_rounded_up():
    assert [engines.grace_seconds(x) for x in (0, 0.2, 1, 1.5, 10)] == [0, 1, 1, 2, 10]
