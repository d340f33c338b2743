# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Container runtimes: which container a process runs in, what its runtime says about it, and
stopping it through that runtime.

A process killed from outside its container is started again by the runtime when the container
has a restart policy (measured here with Docker 20.10: a `--restart=always` container SIGKILLed
from outside runs again ~1 s later), so the GPUs read 0 MiB for a moment and fill up again.
gpu_release therefore stops Docker and Podman containers through their runtime, and never acts
on a Kubernetes pod: the kubelet would restart it behind the scheduler's back.

1. `container_ref(cgroup path)`: runtime, container id, Kubernetes pod UID (no I/O).
2. `Runtimes`: asks Docker or Podman (their Engine API over the unix socket with http.client,
   else their CLI) for a container's name, image, restart policy and labels; stops it with a
   grace period; sets its restart policy to `no`. crictl, where present, names a pod.
3. `annotate`, `plan`, `act`: what gpu_release does with them.

A cgroup path is what a user can write inside the subtree systemd delegates to them
(`user@UID.service`, or any cgroup directory they own): there they can name a cgroup
`docker-<any id>.scope` or `kubepods.slice`. So a container or pod is believed only from a path
outside such subtrees (`container_ref`, `delegated_to`: the cgroup file system's owners, the
kernel's word), and a container only once its runtime confirms that the process runs in it (its
State.Pid, or a process in the cgroup of State.Pid: `confirmed`). Anything else is an ordinary
holder, reported with a note (docs/security.md).
"""

from __future__ import annotations

import fnmatch
import http.client
import json
import math
import os
import re
import shutil
import socket
import subprocess
import threading
import time

# _holders imports this module too: only parse_cgroup is used, at call time.
from ansible_collections.zeromib.gpu.plugins.module_utils import _holders  # pylint: disable=cyclic-import
from ansible_collections.zeromib.gpu.plugins.module_utils._errors import ReleaseError

DOCKER = "docker"
PODMAN = "podman"
CONTAINERD = "containerd"
CRIO = "cri-o"
# Runtimes gpu_release can ask and stop containers through.
MANAGED = (DOCKER, PODMAN)

SERVICE_PREFIX = "container:"

# Keys each holder record gets (gpu_facts' holders, gpu_release's holders).
HOLDER_KEYS = ("container_runtime", "container_name", "container_image", "pod", "pod_uid")

_HEX_ID = r"([0-9a-f]{64}|[0-9a-f]{12,63})"
_PREFIX_RUNTIME = {
    "docker": DOCKER,
    "libpod": PODMAN,
    "podman": PODMAN,
    "cri-containerd": CONTAINERD,
    "containerd": CONTAINERD,
    "nerdctl": CONTAINERD,
    "crio": CRIO,
    "cri-o": CRIO,
}
_PATTERNS = (
    # systemd cgroup driver: /system.slice/docker-<id>.scope, /machine.slice/libpod-<id>.scope[/container],
    # .../cri-containerd-<id>.scope, .../crio-<id>.scope. (libpod-conmon-<id>.scope is conmon, not the container.)
    re.compile(r"(?:^|/)(docker|cri-containerd|crio|libpod|containerd|podman|nerdctl)-" + _HEX_ID + r"\.scope(?:/|$)"),
    # containerd's systemd cgroup driver when it and runc disagree (kind, k3s):
    # /system.slice/containerd.service/kubepods-...slice:cri-containerd:<id>
    re.compile(r":(cri-containerd|cri-o|crio|docker|containerd):" + _HEX_ID + r"(?:/|$)"),
    # cgroupfs driver: /docker/<id>, /libpod_parent/libpod-<id>, /crio/<id>
    re.compile(r"/(docker|containerd|crio)/" + _HEX_ID + r"(?:/|$)"),
    re.compile(r"/(libpod)-" + _HEX_ID + r"(?:/|$)"),
    # Kubernetes with the cgroupfs driver: /kubepods/<qos>/pod<uid>/<id> (runtime not in the path)
    re.compile(r"/kubepods[^\s]*/pod[0-9a-f_-]+/()" + _HEX_ID + r"(?:/|$)"),
)
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32})(?:\.slice)?(?=[/:]|$)")
_KUBEPODS = re.compile(r"(?:^|/)kubepods(?:[.\-/]|$)")
# The subtree systemd delegates to a user's own manager: everything below it is theirs to name.
_USER_MANAGER = re.compile(r"(?:^|/)user@\d+\.service(?:/|$)")

K8S_NAMESPACE = "io.kubernetes.pod.namespace"
K8S_NAME = "io.kubernetes.pod.name"
K8S_UID = "io.kubernetes.pod.uid"


# ---------------------------------------------------------------- cgroup paths (no I/O)


def container_ref(cgroup_path):
    """The container a cgroup path belongs to: {id, runtime, kubernetes, pod_uid}, or None.
    `runtime` is None where the path does not say (Kubernetes with the cgroupfs driver); a
    process of a pod outside any container cgroup has `id` None."""
    if not cgroup_path or _USER_MANAGER.search(cgroup_path):
        return None
    return _named_ref(cgroup_path)


def _named_ref(cgroup_path):
    """What a cgroup path names, wherever it lies (see container_ref)."""
    if not cgroup_path:
        return None
    kubernetes = bool(_KUBEPODS.search(cgroup_path))
    pod = _POD_UID.search(cgroup_path) if kubernetes else None
    pod_uid = pod.group(1).replace("_", "-") if pod else None
    for pattern in _PATTERNS:
        match = pattern.search(cgroup_path)
        if match:
            return {"id": match.group(2), "runtime": _PREFIX_RUNTIME.get(match.group(1)), "kubernetes": kubernetes, "pod_uid": pod_uid}
    if kubernetes:
        return {"id": None, "runtime": None, "kubernetes": True, "pod_uid": pod_uid}
    return None


def container_of(cgroup_path):
    """The container id of a cgroup path (docker, podman, containerd, CRI-O, Kubernetes), or None."""
    ref = container_ref(cgroup_path)
    return ref["id"] if ref else None


def split_services(services):
    """`services` -> (systemd unit patterns, container name globs): `container:<glob>` names containers."""
    units, containers = [], []
    for item in services or []:
        text = str(item).strip()
        if text.startswith(SERVICE_PREFIX):
            glob = text[len(SERVICE_PREFIX):].strip()
            if glob and glob not in containers:
                containers.append(glob)
        else:
            units.append(item)
    return units, containers


def record_of(inspect):
    """A `docker/podman inspect` object (Engine API or CLI) -> the fields gpu_release uses."""
    config = inspect.get("Config") or {}
    host_config = inspect.get("HostConfig") or {}
    state = inspect.get("State") or {}
    labels = config.get("Labels") or {}
    restart = ((host_config.get("RestartPolicy") or {}).get("Name") or "no").strip() or "no"
    namespace, name = labels.get(K8S_NAMESPACE), labels.get(K8S_NAME)
    return {
        "id": inspect.get("Id") or inspect.get("ID"),
        "name": (inspect.get("Name") or "").lstrip("/") or None,
        "image": config.get("Image") or inspect.get("ImageName") or inspect.get("Image"),
        "restart_policy": restart,
        "restart_max_retries": int((host_config.get("RestartPolicy") or {}).get("MaximumRetryCount") or 0),
        "running": bool(state.get("Running")) or state.get("Status") == "restarting" or bool(state.get("Restarting")),
        "status": state.get("Status"),
        "pod": f"{namespace}/{name}" if namespace and name else (name or None),
        "pod_uid": labels.get(K8S_UID),
        # The container's init process as the runtime reports it (0 when not running).
        "pid": state.get("Pid") or None,
    }


# ---------------------------------------------------------------- talking to a runtime


class RuntimeUnavailable(Exception):
    """The runtime could not be asked (no socket, no CLI, daemon down, timeout)."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class EngineApi:
    """Docker's Engine API, or Podman's Docker-compatible API, on a unix socket (stdlib only)."""

    def __init__(self, runtime, socket_path, timeout=10.0):
        self.runtime = runtime
        self.socket_path = socket_path
        self.timeout = timeout
        self.via = f"{runtime} API at {socket_path}"

    def _request(self, method, path, body=None, timeout=None):
        connection = _UnixConnection(self.socket_path, self.timeout if timeout is None else timeout)
        try:
            headers = {"Host": "localhost"}
            payload = None
            if body is not None:
                payload = json.dumps(body).encode("utf-8")
                headers["Content-Type"] = "application/json"
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise RuntimeUnavailable(f"{self.via}: {exc}")
        finally:
            connection.close()
        text = data.decode("utf-8", "replace")
        if response.status >= 500:
            raise RuntimeUnavailable("%s: %s %s answered %d: %s" % (self.via, method, path, response.status, _message(text)))
        return response.status, text

    def ping(self):
        status, _text = self._request("GET", "/_ping")
        return status == 200

    def inspect(self, cid):
        status, text = self._request("GET", f"/containers/{cid}/json")
        if status == 404:
            return None
        if status != 200:
            raise RuntimeUnavailable("%s: inspect %s answered %d: %s" % (self.via, cid, status, _message(text)))
        return record_of(json.loads(text))

    def list_ids(self):
        status, text = self._request("GET", "/containers/json?all=1")
        if status != 200:
            raise RuntimeUnavailable("%s: list answered %d: %s" % (self.via, status, _message(text)))
        return [item.get("Id") for item in json.loads(text) if item.get("Id")]

    def stop(self, cid, grace):
        seconds = grace_seconds(grace)
        # The daemon waits `t` seconds after the stop signal, then SIGKILLs: allow for both.
        status, text = self._request("POST", "/containers/%s/stop?t=%d" % (cid, seconds), timeout=seconds + STOP_MARGIN_S)
        if status not in (204, 304):
            raise RuntimeUnavailable("%s: stop %s answered %d: %s" % (self.via, cid, status, _message(text)))

    def set_restart_no(self, cid):
        status, text = self._request("POST", f"/containers/{cid}/update", body={"RestartPolicy": {"Name": "no"}})
        if status != 200:
            raise RuntimeUnavailable("%s: update --restart=no %s answered %d: %s" % (self.via, cid, status, _message(text)))

    # gpu_restore puts back what gpu_release changed (_restore).
    def set_restart_policy(self, cid, name, max_retries=0):
        policy = {"Name": name}
        if name == "on-failure" and max_retries:
            policy["MaximumRetryCount"] = int(max_retries)
        status, text = self._request("POST", f"/containers/{cid}/update", body={"RestartPolicy": policy})
        if status != 200:
            raise RuntimeUnavailable("%s: update --restart=%s %s answered %d: %s" % (self.via, name, cid, status, _message(text)))

    def start(self, cid, timeout):
        status, text = self._request("POST", f"/containers/{cid}/start", timeout=timeout)
        if status not in (204, 304):
            raise RuntimeUnavailable("%s: start %s answered %d: %s" % (self.via, cid, status, _message(text)))


class EngineCli:
    """The docker or podman command line, where no API socket answers."""

    def __init__(self, runtime, path, run):
        self.runtime = runtime
        self.path = path
        self.run = run
        self.via = f"{runtime} CLI {path}"

    def _call(self, args, timeout=10.0):
        try:
            rc, out, err = self.run([self.path] + list(args), timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeUnavailable(f"{self.via} {args[0]}: {exc}")
        return rc, out, err

    def ping(self):
        rc, _out, err = self._call(["version", "--format", "{{.Server.Version}}"] if self.runtime == DOCKER else ["info", "--format", "{{.Host.OS}}"])
        if rc != 0:
            raise RuntimeUnavailable("{}: {}".format(self.via, err.strip() or "rc %d" % rc))
        return True

    def inspect(self, cid):
        rc, out, err = self._call(["inspect", "--type", "container", cid])
        if rc != 0:
            if "no such" in (err + out).lower():
                return None
            raise RuntimeUnavailable("%s: inspect %s (rc %d): %s" % (self.via, cid, rc, err.strip()))
        try:
            data = json.loads(out)
        except ValueError as exc:
            raise RuntimeUnavailable(f"{self.via}: inspect {cid}: unreadable output: {exc}")
        return record_of(data[0]) if data else None

    def list_ids(self):
        rc, out, err = self._call(["ps", "-a", "-q", "--no-trunc"])
        if rc != 0:
            raise RuntimeUnavailable("%s: ps (rc %d): %s" % (self.via, rc, err.strip()))
        return [line.strip() for line in out.splitlines() if line.strip()]

    def stop(self, cid, grace):
        seconds = grace_seconds(grace)
        rc, _out, err = self._call(["stop", "-t", str(seconds), cid], timeout=seconds + STOP_MARGIN_S)
        if rc != 0:
            raise RuntimeUnavailable("%s: stop %s (rc %d): %s" % (self.via, cid, rc, err.strip()))

    def set_restart_no(self, cid):
        rc, _out, err = self._call(["update", "--restart=no", cid])
        if rc != 0:
            raise RuntimeUnavailable("%s: update --restart=no %s (rc %d): %s" % (self.via, cid, rc, err.strip()))

    # gpu_restore puts back what gpu_release changed (_restore).
    def set_restart_policy(self, cid, name, max_retries=0):
        value = "%s:%d" % (name, max_retries) if name == "on-failure" and max_retries else name
        rc, _out, err = self._call(["update", "--restart=" + value, cid])
        if rc != 0:
            raise RuntimeUnavailable("%s: update --restart=%s %s (rc %d): %s" % (self.via, value, cid, rc, err.strip()))

    def start(self, cid, timeout):
        rc, _out, err = self._call(["start", cid], timeout=timeout)
        if rc != 0:
            raise RuntimeUnavailable("%s: start %s (rc %d): %s" % (self.via, cid, rc, err.strip()))


# How long a stop may take beyond its grace: the daemon's SIGKILL and exit (seen: < 0.1 s).
STOP_MARGIN_S = 15


def grace_seconds(grace):
    """kill_timeout -> the whole seconds the Engine API and CLIs take (rounded up)."""
    return max(0, int(math.ceil(float(grace or 0))))


def _message(text):
    try:
        return json.loads(text).get("message") or text.strip()
    except (ValueError, AttributeError):
        return text.strip()


def _run(argv, timeout):
    process = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=dict(os.environ, LC_ALL="C", LANG="C"),
        timeout=timeout,
        check=False,
    )
    return process.returncode, process.stdout.decode("utf-8", "replace"), process.stderr.decode("utf-8", "replace")


BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/bin", "/usr/sbin")
SOCKETS = {
    DOCKER: ("DOCKER_HOST", ("/run/docker.sock", "/var/run/docker.sock")),
    PODMAN: ("CONTAINER_HOST", ("/run/podman/podman.sock", "/var/run/podman/podman.sock")),
}


class Runtimes:
    """Docker and Podman as this node has them, found on first use and asked at most once per
    container. The API socket is preferred ($DOCKER_HOST / $CONTAINER_HOST when set, else the
    default paths); the CLI serves where no socket answers."""

    def __init__(self, run=None, environ=None, which=None, sockets=None):
        self.run = run or _run
        self.environ = os.environ if environ is None else environ
        self.which = which or _which
        self.sockets = SOCKETS if sockets is None else sockets
        self._clients = {}
        self._errors = {}
        self._records = {}
        self._pods = {}
        self._lock = threading.Lock()

    def client(self, runtime):
        """A client that answered, or None (the reason is in `error(runtime)`)."""
        with self._lock:
            if runtime not in self._clients:
                self._clients[runtime] = self._connect(runtime)
            return self._clients[runtime]

    def error(self, runtime):
        return self._errors.get(runtime) or f"{runtime} is not on this node"

    def _connect(self, runtime):
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

    def inspect(self, runtime, cid):
        """The runtime's record of a container, None when it does not know it; raises
        RuntimeUnavailable when the runtime cannot be asked."""
        key = (runtime, cid)
        if key not in self._records:
            client = self.client(runtime)
            if client is None:
                raise RuntimeUnavailable(self.error(runtime))
            self._records[key] = client.inspect(cid)
        return self._records[key]

    def find(self, glob):
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

    def forget(self, runtime, cid):
        self._records.pop((runtime, cid), None)

    def stop(self, runtime, cid, grace):
        client = self.client(runtime)
        if client is None:
            raise RuntimeUnavailable(self.error(runtime))
        client.stop(cid, grace)
        self.forget(runtime, cid)

    def set_restart_no(self, runtime, cid):
        client = self.client(runtime)
        if client is None:
            raise RuntimeUnavailable(self.error(runtime))
        client.set_restart_no(cid)
        self.forget(runtime, cid)

    def set_restart_policy(self, runtime, cid, name, max_retries=0):
        client = self.client(runtime)
        if client is None:
            raise RuntimeUnavailable(self.error(runtime))
        client.set_restart_policy(cid, name, max_retries)
        self.forget(runtime, cid)

    def start(self, runtime, cid, timeout):
        client = self.client(runtime)
        if client is None:
            raise RuntimeUnavailable(self.error(runtime))
        client.start(cid, timeout)
        self.forget(runtime, cid)

    def pod_of(self, cid):
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


def _which(name):
    found = shutil.which(name)
    if found:
        return found
    for directory in BIN_DIRS:
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    return None


# ---------------------------------------------------------------- holders


def cgroup_mounts(mountinfo="/proc/self/mountinfo"):
    """Mount points of the cgroup hierarchies systemd paths live in: cgroup2, and v1's
    name=systemd (hybrid nodes)."""
    mounts = []
    try:
        with open(mountinfo, "rb") as handle:
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return mounts
    for line in lines:
        left, _sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        if tail[0] == "cgroup2" or (tail[0] == "cgroup" and "name=systemd" in tail[2].split(",")):
            mounts.append(point)
    return mounts


def delegated_to(cgroup_path, mounts):
    """The uid that owns a cgroup directory on `cgroup_path` (or one above it), or None when
    root owns all of them: only a delegated subtree (a user manager's, or a unit with
    Delegate=yes and User=) is owned by anyone else, and its owner may create and name cgroups
    there at will."""
    parts = [part for part in (cgroup_path or "").split("/") if part]
    for mount in mounts:
        for depth in range(len(parts), 0, -1):
            try:
                owner = os.stat(os.path.join(mount, *parts[:depth])).st_uid
            except OSError:
                continue
            if owner != 0:
                return owner
    return None


def cgroup_reader(proc="/proc"):
    """pid -> its systemd cgroup path (see _holders.parse_cgroup), None when gone."""
    def cgroup_of(pid):
        try:
            with open("%s/%d/cgroup" % (proc, pid), "rb") as handle:
                return _holders.parse_cgroup(handle.read())
        except OSError:
            return None
    return cgroup_of


def confirmed(holder, record, cgroup_of):
    """Whether the runtime's own record places the holder in that container: the holder is its
    State.Pid, or it runs in the cgroup of State.Pid (or below it), which only the runtime (root)
    could have put it in."""
    init = record.get("pid")
    if not init:
        return False
    if init == holder["pid"]:
        return True
    path = cgroup_of(init)
    own = holder.get("cgroup") or ""
    return bool(path) and path != "/" and (own == path or own.startswith(path.rstrip("/") + "/"))


def _ordinary(holder, note):
    for key in HOLDER_KEYS:
        holder[key] = None
    holder["container"] = None
    holder["_container_ref"] = None
    holder["container_note"] = note


def annotate(holders, runtimes, proc="/proc", mounts=None, cgroup_of=None):
    """Add HOLDER_KEYS to each holder (in place; returns the list): the runtime from the cgroup
    path, and name, image and pod from the runtime where it answers. Holders outside containers
    cost a regex each; the runtime is asked once per container. A path in a delegated subtree,
    or a container its runtime does not confirm, makes an ordinary holder with a note."""
    cgroup_of = cgroup_of or cgroup_reader(proc)
    for holder in holders:
        ref = container_ref(holder.get("cgroup"))
        holder["_container_ref"] = ref
        holder.setdefault("container_note", None)
        for key in HOLDER_KEYS:
            holder.setdefault(key, None)
        if ref is None:
            holder["container"] = None
            manager = _USER_MANAGER.search(holder.get("cgroup") or "")
            if manager and _named_ref(holder["cgroup"]) is not None:
                holder["container_note"] = ("cgroup {} lies in the subtree systemd delegates to {}, whose user may name it at will: "
                                            "no container or pod".format(holder["cgroup"], manager.group(0).strip("/")))
            continue
        if mounts is None:
            mounts = cgroup_mounts()
        owner = delegated_to(holder.get("cgroup"), mounts)
        if owner is not None:
            _ordinary(holder, "cgroup %s lies in a subtree owned by uid %d, who may name it at will: no container or pod"
                      % (holder.get("cgroup"), owner))
            continue
        holder["container"] = ref["id"]
        holder["container_runtime"] = ref["runtime"]
        holder["pod_uid"] = ref["pod_uid"]
        record = None
        if ref["id"] and ref["runtime"] in MANAGED:
            try:
                record = runtimes.inspect(ref["runtime"], ref["id"])
            except RuntimeUnavailable:
                record = None
        elif ref["id"] and ref["runtime"] is None and ref["kubernetes"]:
            # Kubernetes on cgroupfs does not name its runtime: dockershim's containers are Docker's.
            try:
                record = runtimes.inspect(DOCKER, ref["id"]) if runtimes.client(DOCKER) else None
            except RuntimeUnavailable:
                record = None
            if record is not None:
                holder["container_runtime"] = DOCKER
        if record is not None and not confirmed(holder, record, cgroup_of):
            _ordinary(holder, "cgroup {0} names {1} container {2}, but {1} does not run this process in it: an ordinary holder".format(
                holder.get("cgroup"), holder.get("container_runtime"), ref["id"][:12]))
            continue
        if record is not None:
            holder["container_name"] = record["name"]
            holder["container_image"] = record["image"]
            holder["pod"] = record["pod"]
            holder["pod_uid"] = holder["pod_uid"] or record["pod_uid"]
            holder["_container_record"] = record
        if ref["kubernetes"] and not holder["pod"] and ref["id"]:
            holder["pod"] = runtimes.pod_of(ref["id"])
    return holders


def describe_container(holder):
    """`vllm-a (docker 4f3c2b1a4f3c, vllm/vllm-openai:latest)`, as far as it is known."""
    name, cid = holder.get("container_name"), holder.get("container")
    runtime, image = holder.get("container_runtime"), holder.get("container_image")
    if not name:
        return "{} ({})".format((cid or "?")[:12], runtime or "unknown runtime")
    inner = " ".join(part for part in (runtime, (cid or "")[:12]) if part)
    if image:
        inner += (", " if inner else "") + image
    return f"{name} ({inner})"


def describe_entry(entry):
    """describe_container for a planned entry (stopped_containers' shape) or a runtime record."""
    return describe_container({"container_name": entry.get("name"), "container": entry.get("id"), "container_runtime": entry.get("runtime"),
                               "container_image": entry.get("image")})


def pod_holders(holders):
    return [h for h in holders if (h.get("_container_ref") or {}).get("kubernetes")]


def pod_message(holders, node=None):
    """The refusal for holders in Kubernetes pods: which pod (namespace/name, else UID), and what to do."""
    node = node or socket.gethostname()
    pods = []
    for holder in holders:
        pod = holder.get("pod") or ("UID {}".format(holder["pod_uid"]) if holder.get("pod_uid") else "of unknown UID")
        text = "pod %s (pid %d %s on GPU %s%s)" % (
            pod,
            holder["pid"],
            holder.get("name"),
            ",".join(str(i) for i in holder.get("gpu_indexes") or []) or "-",
            ", container {}".format(holder["container"][:12]) if holder.get("container") else "",
        )
        if text not in pods:
            pods.append(text)
    return (
        "GPUs are held by Kubernetes pods: {0}. gpu_release never signals or stops a pod's processes: the kubelet would start "
        "them again, and the pod's owner would lose its work without the scheduler knowing. Cordon and drain the node first "
        "(kubectl cordon {1} && kubectl drain {1} --ignore-daemonsets --delete-emptydir-data), then run gpu_release again".format("; ".join(pods), node)
    )


# ---------------------------------------------------------------- plan and act


def _entry(runtime, record, gpu_indexes=()):
    return {
        "name": record["name"],
        "id": record["id"],
        "image": record["image"],
        "runtime": runtime,
        "restart_policy": record["restart_policy"],
        "restart_max_retries": record.get("restart_max_retries") or 0,
        "gpu_indexes": sorted(set(gpu_indexes)),
    }


class Plan:
    """What gpu_release does to containers: stop (found or named), disable (named), and the
    targets left to signal from outside (with why, for the respawn watch)."""

    def __init__(self):
        self.stop = []
        self.disable = []
        self.not_found = []
        self.signal = []
        self.outside = []  # (holder, reason): holders in containers that are signalled from outside
        self.warnings = []

    def __bool__(self):
        return bool(self.stop or self.disable)

    __nonzero__ = __bool__


def plan(runtimes, holders, targets, named_globs, service_state, own_containers, result, stop_found=True):
    """Plan for containers. Raises ReleaseError (carrying `result`) before anything is done when
    a target runs in a Kubernetes pod, or a named container is a pod's or runs this session."""
    pods = pod_holders(targets)
    if pods:
        raise ReleaseError(pod_message(pods), result)
    steps = Plan()
    protected_in = {h.get("container") for h in holders if h.get("protected") and h.get("container")}
    stopping = {}

    def add_stop(runtime, record, gpu_indexes):
        entry = stopping.get(record["id"])
        if entry is None:
            entry = stopping[record["id"]] = _entry(runtime, record, gpu_indexes)
            steps.stop.append(entry)
        else:
            entry["gpu_indexes"] = sorted(set(entry["gpu_indexes"]) | set(gpu_indexes))
        return entry

    for glob in named_globs:
        try:
            matches = runtimes.find(glob)
        except RuntimeUnavailable as exc:
            raise ReleaseError(f"cannot list containers for {SERVICE_PREFIX}{glob}: {exc}", result)
        if not matches:
            steps.not_found.append(SERVICE_PREFIX + glob)
        for runtime, record in matches:
            if record["pod"] or record["pod_uid"]:
                raise ReleaseError(
                    "refusing to stop container {}: it belongs to Kubernetes pod {}; cordon and drain the node instead".format(
                        describe_entry(dict(record, runtime=runtime)), record["pod"] or record["pod_uid"]),
                    result,
                )
            if record["id"] in own_containers:
                raise ReleaseError(f"refusing to stop container {describe_entry(dict(record, runtime=runtime))}: it runs this Ansible session", result)
            if service_state in ("disabled", "masked") and record["restart_policy"] != "no":
                steps.disable.append(_entry(runtime, record))
            if record["running"]:
                add_stop(runtime, record, ())

    for holder in targets:
        ref = holder.get("_container_ref") or {}
        if not holder.get("container"):
            steps.signal.append(holder)
            continue
        cid = holder["container"]
        reason = None
        record = holder.get("_container_record")
        if not stop_found:
            reason = "kill is false"
        elif ref.get("runtime") not in MANAGED and holder.get("container_runtime") not in MANAGED:
            reason = "gpu_release cannot stop %s containers" % (ref.get("runtime") or "its runtime's")
        elif cid in protected_in:
            reason = "it also runs a protected process"
        elif cid in own_containers:
            reason = "it runs this Ansible session"
        elif record is None:
            # Never stopped through a runtime that has not confirmed the holder runs in it (annotate).
            runtime = holder.get("container_runtime")
            try:
                reason = f"{runtime} did not confirm it" if runtimes.inspect(runtime, cid) else f"{runtime} does not know it"
            except RuntimeUnavailable as exc:
                reason = str(exc)
        if reason is None and record is not None:
            add_stop(holder.get("container_runtime"), record, holder.get("gpu_indexes") or ())
            continue
        steps.signal.append(holder)
        steps.outside.append((holder, reason))
    warned = set()
    for holder, reason in steps.outside:
        if holder["container"] in warned or reason == "kill is false":
            continue
        warned.add(holder["container"])
        steps.warnings.append(
            f"container {describe_container(holder)} could not be stopped through its runtime ({reason}): its processes are signalled from outside, and "
            "gpu_release watches whether its restart policy starts them again"
        )
    return steps


def act(runtimes, steps, grace, result, now=time.monotonic):
    """Disable (restart policy `no`) then stop, all containers at once, each with `grace`
    seconds between its stop signal and SIGKILL (the runtime's own escalation). Records into
    result's `disabled_containers` / `stopped_containers` as each step is done. Returns the ids
    that could not be stopped, with the reason."""
    failed = {}
    for entry in steps.disable:
        try:
            runtimes.set_restart_no(entry["runtime"], entry["id"])
        except RuntimeUnavailable as exc:
            hint = ""
            if entry["runtime"] == PODMAN and "unknown flag" in str(exc):
                # Podman 4 (Debian 12's 4.3.1, tried) has no `update --restart`; a later Podman added it.
                hint = (": this Podman cannot change a restart policy; recreate the container with --restart=no, or run it from a "
                        "systemd unit (Quadlet) and name that unit in services")
            raise ReleaseError(f"could not set the restart policy of container {describe_entry(entry)} to no: {exc}{hint}", result)
        result["disabled_containers"].append(dict(entry, restart_policy="no", restart_policy_before=entry["restart_policy"]))

    def stop(entry):
        started = now()
        try:
            runtimes.stop(entry["runtime"], entry["id"], grace)
            record = runtimes.inspect(entry["runtime"], entry["id"])
            if record is not None and record["running"]:
                raise RuntimeUnavailable("still {} after the stop".format(record["status"]))
        except RuntimeUnavailable as exc:
            failed[entry["id"]] = str(exc)
            return
        entry["stopped_after_s"] = round(now() - started, 3)

    threads = [threading.Thread(target=stop, args=(entry,)) for entry in steps.stop]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for entry in steps.stop:
        if entry["id"] in failed:
            result["warnings"].append("could not stop container {} through {}: {}".format(describe_entry(entry), entry["runtime"], failed[entry["id"]]))
        else:
            result["stopped_containers"].append(entry)
    return failed


def own_containers(lineage, proc="/proc"):
    """Ids of the containers this module and its ancestors run in (never to be stopped)."""
    found = set()
    for pid in lineage:
        try:
            with open("%s/%d/cgroup" % (proc, pid)) as handle:
                text = handle.read()
        except OSError:
            continue
        for line in text.splitlines():
            cid = container_of(line.split(":", 2)[-1])
            if cid:
                found.add(cid)
    return found
