# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Talking to Docker and Podman: their Engine API over the unix socket (http.client, stdlib
only), else their CLI. `Runtimes` asks them for a container's name, image, restart policy,
labels and init process, stops a container with a grace period, and changes its restart policy;
crictl, where present, names a CRI container's pod.

What a runtime answers is root's word (the daemon runs as root): it is what confirms, or not,
what a cgroup path only claims (_cgroups, _container_of.confirmed).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import socket
import subprocess
import threading
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._look._cgroups import DOCKER, PODMAN, under_kubepods

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ContainerRecord

    # (argv, timeout) -> (rc, stdout, stderr)
    Run = t.Callable[[t.List[str], float], t.Tuple[int, str, str]]
    Which = t.Callable[[str], t.Optional[str]]

# Runtimes gpu_release can ask and stop containers through.
MANAGED = (DOCKER, PODMAN)

K8S_NAMESPACE = "io.kubernetes.pod.namespace"
K8S_NAME = "io.kubernetes.pod.name"
K8S_UID = "io.kubernetes.pod.uid"

# How long a stop may take beyond its grace: the daemon's SIGKILL and exit (seen: < 0.1 s).
STOP_MARGIN_S = 15

BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/bin", "/usr/sbin")
SOCKETS = {
    DOCKER: ("DOCKER_HOST", ("/run/docker.sock", "/var/run/docker.sock")),
    PODMAN: ("CONTAINER_HOST", ("/run/podman/podman.sock", "/var/run/podman/podman.sock")),
}


def record_of(inspect: dict[str, t.Any]) -> ContainerRecord:
    """A `docker/podman inspect` object (Engine API or CLI) -> the fields gpu_release uses."""
    config = inspect.get("Config") or {}
    host_config = inspect.get("HostConfig") or {}
    state = inspect.get("State") or {}
    labels = config.get("Labels") or {}
    restart = ((host_config.get("RestartPolicy") or {}).get("Name") or "no").strip() or "no"
    namespace, name = labels.get(K8S_NAMESPACE), labels.get(K8S_NAME)
    claimed = f"{namespace}/{name}" if namespace and name else (name or None)
    # Labels are whoever created the container's (a compose file, any user of the runtime's
    # socket); a kubelet also places it under kubepods, its cgroup parent. Labels alone make no pod.
    kubelet = under_kubepods(str(host_config.get("CgroupParent") or ""))
    return {
        "id": inspect.get("Id") or inspect.get("ID"),
        "name": (inspect.get("Name") or "").lstrip("/") or None,
        "image": config.get("Image") or inspect.get("ImageName") or inspect.get("Image"),
        "restart_policy": restart,
        "restart_max_retries": int((host_config.get("RestartPolicy") or {}).get("MaximumRetryCount") or 0),
        # A paused container is up, as Docker says (Podman 4.3 reads Running false while paused).
        "running": bool(state.get("Running")) or state.get("Status") in ("restarting", "paused") or bool(state.get("Restarting") or state.get("Paused")),
        "status": state.get("Status"),
        # Paused (`docker pause`, `podman pause`): its processes frozen by the runtime, which alone
        # thaws them (`unpause`); Podman's stop refuses a paused container (_act/_paused).
        "paused": bool(state.get("Paused")) or state.get("Status") == "paused",
        "pod": claimed if kubelet else None,
        "pod_uid": labels.get(K8S_UID) if kubelet else None,
        # The pod its labels name where no kubelet placed it (a note in the facts, never a refusal).
        "pod_claim": None if kubelet else claimed,
        # The container's init process as the runtime reports it (0 when not running).
        "pid": state.get("Pid") or None,
        # The engine's own Swarm labels (the service and task a manager created it for: _look/_orchestrators).
        "labels": {str(k): str(v) for k, v in labels.items() if str(k).startswith("com.docker.swarm.")},
        # The GPUs its device request names (`--gpus device=MIG-...`, NVIDIA_VISIBLE_DEVICES): gpu_restore's MIG check (_act/_mig_restore).
        "gpu_devices": [str(d) for r in host_config.get("DeviceRequests") or [] if isinstance(r, dict) for d in r.get("DeviceIDs") or []]
        + [str(e).partition("=")[2] for e in config.get("Env") or [] if str(e).startswith("NVIDIA_VISIBLE_DEVICES=")],
    }


def grace_seconds(grace: float | None) -> int:
    """kill_timeout -> the whole seconds the Engine API and CLIs take (rounded up)."""
    return max(0, int(math.ceil(float(grace or 0))))


class RuntimeUnavailable(Exception):
    """The runtime could not be asked (no socket, no CLI, daemon down, timeout)."""


def _http() -> t.Any:
    """http.client, imported when a runtime is asked, not with this module: a holder outside any
    container never needs it (~18 ms of a dirty look's imports on the H200, benchmarks/HISTORY.md, "The look's /proc pass beside nvidia-smi")."""
    import http.client  # pylint: disable=import-outside-toplevel

    return http.client


def _unix_connection(path: str, timeout: float) -> t.Any:
    """An HTTP connection over a unix socket."""

    class UnixConnection(_http().HTTPConnection):  # type: ignore[misc]
        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                raise
            self.sock = sock

    return UnixConnection("localhost", timeout=timeout)


def _message(text: str) -> str:
    try:
        return json.loads(text).get("message") or text.strip()
    except (ValueError, AttributeError):
        return text.strip()


class EngineApi:
    """Docker's Engine API, or Podman's Docker-compatible API, on a unix socket (stdlib only)."""

    def __init__(self, runtime: str, socket_path: str, timeout: float = 10.0) -> None:
        self.runtime = runtime
        self.socket_path = socket_path
        self.timeout = timeout
        self.via = f"{runtime} API at {socket_path}"

    def _request(self, method: str, path: str, body: dict[str, t.Any] | None = None, timeout: float | None = None) -> tuple[int, str]:
        connection = _unix_connection(self.socket_path, self.timeout if timeout is None else timeout)
        try:
            headers = {"Host": "localhost"}
            payload = None
            if body is not None:
                payload = json.dumps(body).encode("utf-8")
                headers["Content-Type"] = "application/json"
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, _http().HTTPException) as exc:
            raise RuntimeUnavailable(f"{self.via}: {exc}") from exc
        finally:
            connection.close()
        text = data.decode("utf-8", "replace")
        if response.status >= 500:
            raise RuntimeUnavailable(f"{self.via}: {method} {path} answered {response.status:d}: {_message(text)}")
        return response.status, text

    def ping(self) -> bool:
        status, _text = self._request("GET", "/_ping")
        return status == 200

    def inspect(self, cid: str) -> ContainerRecord | None:
        status, text = self._request("GET", f"/containers/{cid}/json")
        if status == 404:
            return None
        if status != 200:
            raise RuntimeUnavailable(f"{self.via}: inspect {cid} answered {status:d}: {_message(text)}")
        return record_of(json.loads(text))

    def list_ids(self) -> list[str]:
        status, text = self._request("GET", "/containers/json?all=1")
        if status != 200:
            raise RuntimeUnavailable(f"{self.via}: list answered {status:d}: {_message(text)}")
        return [item.get("Id") for item in json.loads(text) if item.get("Id")]

    def stop(self, cid: str, grace: float | None) -> None:
        seconds = grace_seconds(grace)
        # The daemon waits `t` seconds after the stop signal, then SIGKILLs: allow for both.
        status, text = self._request("POST", f"/containers/{cid}/stop?t={seconds:d}", timeout=seconds + STOP_MARGIN_S)
        if status not in (204, 304):
            raise RuntimeUnavailable(f"{self.via}: stop {cid} answered {status:d}: {_message(text)}")

    def set_restart_no(self, cid: str) -> None:
        status, text = self._request("POST", f"/containers/{cid}/update", body={"RestartPolicy": {"Name": "no"}})
        if status != 200:
            raise RuntimeUnavailable(f"{self.via}: update --restart=no {cid} answered {status:d}: {_message(text)}")

    # gpu_restore puts back what gpu_release changed (_restore).
    def set_restart_policy(self, cid: str, name: str, max_retries: int = 0) -> None:
        policy: dict[str, t.Any] = {"Name": name}
        if name == "on-failure" and max_retries:
            policy["MaximumRetryCount"] = int(max_retries)
        status, text = self._request("POST", f"/containers/{cid}/update", body={"RestartPolicy": policy})
        if status != 200:
            raise RuntimeUnavailable(f"{self.via}: update --restart={name} {cid} answered {status:d}: {_message(text)}")

    def unpause(self, cid: str) -> None:
        status, text = self._request("POST", f"/containers/{cid}/unpause")
        if status != 204:
            raise RuntimeUnavailable(f"{self.via}: unpause {cid} answered {status:d}: {_message(text)}")

    def start(self, cid: str, timeout: float) -> None:
        status, text = self._request("POST", f"/containers/{cid}/start", timeout=timeout)
        if status not in (204, 304):
            raise RuntimeUnavailable(f"{self.via}: start {cid} answered {status:d}: {_message(text)}")


class EngineCli:
    """The docker or podman command line, where no API socket answers."""

    def __init__(self, runtime: str, path: str, run: Run) -> None:
        self.runtime = runtime
        self.path = path
        self.run = run
        self.via = f"{runtime} CLI {path}"

    def _call(self, args: list[str], timeout: float = 10.0) -> tuple[int, str, str]:
        try:
            rc, out, err = self.run([self.path] + list(args), timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeUnavailable(f"{self.via} {args[0]}: {exc}") from exc
        return rc, out, err

    def ping(self) -> bool:
        rc, _out, err = self._call(["version", "--format", "{{.Server.Version}}"] if self.runtime == DOCKER else ["info", "--format", "{{.Host.OS}}"])
        if rc != 0:
            raise RuntimeUnavailable("{}: {}".format(self.via, err.strip() or f"rc {rc:d}"))
        return True

    def inspect(self, cid: str) -> ContainerRecord | None:
        rc, out, err = self._call(["inspect", "--type", "container", cid])
        if rc != 0:
            if "no such" in (err + out).lower():
                return None
            raise RuntimeUnavailable(f"{self.via}: inspect {cid} (rc {rc:d}): {err.strip()}")
        try:
            data = json.loads(out)
        except ValueError as exc:
            raise RuntimeUnavailable(f"{self.via}: inspect {cid}: unreadable output: {exc}") from exc
        return record_of(data[0]) if data else None

    def list_ids(self) -> list[str]:
        rc, out, err = self._call(["ps", "-a", "-q", "--no-trunc"])
        if rc != 0:
            raise RuntimeUnavailable(f"{self.via}: ps (rc {rc:d}): {err.strip()}")
        return [line.strip() for line in out.splitlines() if line.strip()]

    def stop(self, cid: str, grace: float | None) -> None:
        seconds = grace_seconds(grace)
        rc, _out, err = self._call(["stop", "-t", str(seconds), cid], timeout=seconds + STOP_MARGIN_S)
        if rc != 0:
            raise RuntimeUnavailable(f"{self.via}: stop {cid} (rc {rc:d}): {err.strip()}")

    def set_restart_no(self, cid: str) -> None:
        rc, _out, err = self._call(["update", "--restart=no", cid])
        if rc != 0:
            raise RuntimeUnavailable(f"{self.via}: update --restart=no {cid} (rc {rc:d}): {err.strip()}")

    # gpu_restore puts back what gpu_release changed (_restore).
    def set_restart_policy(self, cid: str, name: str, max_retries: int = 0) -> None:
        value = f"{name}:{max_retries:d}" if name == "on-failure" and max_retries else name
        rc, _out, err = self._call(["update", "--restart=" + value, cid])
        if rc != 0:
            raise RuntimeUnavailable(f"{self.via}: update --restart={value} {cid} (rc {rc:d}): {err.strip()}")

    def unpause(self, cid: str) -> None:
        rc, _out, err = self._call(["unpause", cid])
        if rc != 0:
            raise RuntimeUnavailable(f"{self.via}: unpause {cid} (rc {rc:d}): {err.strip()}")

    def start(self, cid: str, timeout: float) -> None:
        rc, _out, err = self._call(["start", cid], timeout=timeout)
        if rc != 0:
            raise RuntimeUnavailable(f"{self.via}: start {cid} (rc {rc:d}): {err.strip()}")


def _run(argv: list[str], timeout: float) -> tuple[int, str, str]:
    process = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, env=_commands.c_locale_env(), timeout=timeout, check=False)
    return process.returncode, process.stdout.decode("utf-8", "replace"), process.stderr.decode("utf-8", "replace")


def _which(name: str) -> str | None:
    return _commands.which(name, dirs=BIN_DIRS)


class Runtimes:
    """Docker and Podman as this node has them, found on first use and asked at most once per
    container. The API socket is preferred ($DOCKER_HOST / $CONTAINER_HOST when set, else the
    default paths); the CLI serves where no socket answers."""

    def __init__(self, run: Run | None = None, environ: t.Mapping[str, str] | None = None, which: Which | None = None,
                 sockets: t.Mapping[str, tuple[str, t.Sequence[str]]] | None = None) -> None:
        self.run = run or _run
        self.environ = os.environ if environ is None else environ
        self.which = which or _which
        self.sockets = SOCKETS if sockets is None else sockets
        self._clients: dict[str, EngineApi | EngineCli | None] = {}
        self._errors: dict[str, str] = {}
        self._records: dict[tuple[str, str], ContainerRecord | None] = {}
        self._pods: dict[str, str | None] = {}
        self._lock = threading.Lock()

    def client(self, runtime: str) -> EngineApi | EngineCli | None:
        """A client that answered, or None (the reason is in `error(runtime)`)."""
        with self._lock:
            if runtime not in self._clients:
                self._clients[runtime] = self._connect(runtime)
            return self._clients[runtime]

    def error(self, runtime: str) -> str:
        return self._errors.get(runtime) or f"{runtime} is not on this node"

    def _connect(self, runtime: str) -> EngineApi | EngineCli | None:
        if runtime not in self.sockets:
            self._errors[runtime] = f"gpu_release cannot ask {runtime}"
            return None
        variable, defaults = self.sockets[runtime]
        value = self.environ.get(variable) or ""
        # As the docker and podman commands do: a set $DOCKER_HOST / $CONTAINER_HOST is the only
        # place asked (a tcp:// one through the CLI, which knows its TLS settings).
        if value:
            candidates = [value[len("unix://"):]] if value.startswith("unix://") else []
        else:
            candidates = list(defaults)
        reasons = []
        for path in candidates:
            if not os.path.exists(path):
                continue
            api = EngineApi(runtime, path)
            try:
                api.ping()
                return api
            except RuntimeUnavailable as exc:
                reasons.append(str(exc))
        binary = self.which(runtime)
        if binary:
            cli = EngineCli(runtime, binary, self.run)
            try:
                cli.ping()
                return cli
            except RuntimeUnavailable as exc:
                reasons.append(str(exc))
        self._errors[runtime] = "; ".join(reasons) or "no {0} socket ({1}) and no {0} command".format(runtime, ", ".join(candidates))
        return None

    def _answering(self, runtime: str) -> EngineApi | EngineCli:
        client = self.client(runtime)
        if client is None:
            raise RuntimeUnavailable(self.error(runtime))
        return client

    def inspect(self, runtime: str, cid: str) -> ContainerRecord | None:
        """The runtime's record of a container, None when it does not know it; raises
        RuntimeUnavailable when the runtime cannot be asked."""
        key = (runtime, cid)
        if key not in self._records:
            self._records[key] = self._answering(runtime).inspect(cid)
        return self._records[key]

    def find(self, glob: str) -> list[tuple[str, ContainerRecord]]:
        """Containers (any state) whose name matches `glob`, on every runtime that answers:
        [(runtime, record)]."""
        found = []
        for runtime in MANAGED:
            client = self.client(runtime)
            if client is None:
                continue
            for cid in client.list_ids():
                record = self.inspect(runtime, cid)
                if record and record["name"] and fnmatch.fnmatchcase(record["name"], glob):
                    found.append((runtime, record))
        return found

    def forget(self, runtime: str, cid: str) -> None:
        self._records.pop((runtime, cid), None)

    def stop(self, runtime: str, cid: str, grace: float | None) -> None:
        self._answering(runtime).stop(cid, grace)
        self.forget(runtime, cid)

    def unpause(self, runtime: str, cid: str) -> None:
        """Thaw a paused container through its runtime (never through the cgroup file system)."""
        self._answering(runtime).unpause(cid)
        self.forget(runtime, cid)

    def set_restart_no(self, runtime: str, cid: str) -> None:
        self._answering(runtime).set_restart_no(cid)
        self.forget(runtime, cid)

    def set_restart_policy(self, runtime: str, cid: str, name: str, max_retries: int = 0) -> None:
        self._answering(runtime).set_restart_policy(cid, name, max_retries)
        self.forget(runtime, cid)

    def start(self, runtime: str, cid: str, timeout: float) -> None:
        self._answering(runtime).start(cid, timeout)
        self.forget(runtime, cid)

    def pod_of(self, cid: str) -> str | None:
        """namespace/name of the pod a CRI container belongs to, from crictl, or None."""
        if cid not in self._pods:
            self._pods[cid] = None
            crictl = self.which("crictl")
            if crictl:
                try:
                    rc, out, _err = self.run([crictl, "inspect", "-o", "json", cid], 5.0)
                    labels = (json.loads(out).get("status") or {}).get("labels") or {} if rc == 0 else {}
                except (OSError, ValueError, subprocess.TimeoutExpired, AttributeError):
                    labels = {}
                if labels.get(K8S_NAME):
                    self._pods[cid] = "{}/{}".format(labels.get(K8S_NAMESPACE) or "default", labels[K8S_NAME])
        return self._pods[cid]
