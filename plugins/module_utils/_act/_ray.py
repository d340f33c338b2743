# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Ray's actors that its GCS would start again, ended through Ray itself (issue 72).

An actor with `max_restarts` killed from outside comes back within about a second, on this node
or another (measured on the fleet's real two-host cluster). So where `services` names `ray:`,
gpu_release asks Ray's GCS which actor each Ray worker on the selected GPUs is, and ends those Ray
would restart with `ray.kill(actor, no_restart=True)` before any signal. Nothing here rests on
what a tenant (the actor's own code, a user's venv, a file in /tmp) says:
- The Ray installation asked is the node's own: the raylet is the vouched Ray node process or its
  child (the kernel's parent link), its executable as the kernel resolves it names the package
  root, its own argv (written by the vouched node) the GCS address, node id and interpreter; every
  directory of both root-owned and writable by root only. The interpreter runs isolated (`-I`: no
  PYTHONPATH, no user site, no current directory), in a clean environment, from `/`.
- An actor is matched to a holder by the PID the GCS reports AND the kernel: that PID is the Ray
  worker in the holder's parent chain (the raylet's direct child), on this node (the raylet's node
  id), with the start time read before the GCS was asked, read again after.
- Every call is bounded (CLIENT_TIMEOUT_S, its process group killed past it) and its output
  capped; a missing, failing or slow client fails the run naming it, before any signal.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod

if t.TYPE_CHECKING:
    ReadProcess = t.Callable[[int], t.Optional[t.Mapping[str, t.Any]]]

# Where the raylet lives below the directory that holds the `ray` package (pip's layout).
RAYLET_TAIL = "/ray/core/src/ray/raylet/raylet"
# One call of the client: importing Ray takes a few seconds on a busy node; the GCS is asked with
# its own retries, which a lost head would stretch to a minute.
CLIENT_TIMEOUT_S = 45.0
MAX_OUTPUT = 1 << 20
# How long the client waits for the GCS to say a killed actor is dead (within CLIENT_TIMEOUT_S).
DEAD_WAIT_S = 15.0
# Actors of this node one answer carries at most (a node runs a few per GPU).
MAX_ACTORS = 512
MAX_DEPTH = 32
# What the client runs as: nothing of the caller's environment (a user's PYTHONPATH, RAY_* knobs).
CLIENT_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": "/root",
              "RAY_USAGE_STATS_ENABLED": "0"}

# The client, run by the node's own interpreter with the node's own Ray: argv[1] the directory
# that holds the `ray` package, argv[2] the request. One JSON line out.
# `list`: the GCS's actor table, this node's live actors only (no driver is started: nothing is
# added to the cluster). `kill`: a driver joins the cluster (ray.kill needs a handle), each named
# actor is looked up by name and killed only if it is still the actor the list said (its id),
# then the GCS is read until it says DEAD (no_restart is then in force).
CLIENT = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
ask = json.loads(sys.argv[2])
import ray
from ray._private.internal_api import get_state_from_address
from ray.core.generated import gcs_pb2
accessor = get_state_from_address(ask["gcs"])._connect_and_get_accessor()
ALIVE = gcs_pb2.ActorTableData.ALIVE
DEAD = gcs_pb2.ActorTableData.DEAD
if ask["do"] == "list":
    jobs = {}
    for raw in accessor.get_job_table(skip_submission_job_info_field=True, skip_is_running_tasks_field=True):
        job = gcs_pb2.JobTableData.FromString(raw)
        jobs[job.job_id.hex()] = dict(job.config.metadata).get("job_submission_id") or ""
    found = []
    for raw in accessor.get_actor_table(None, None):
        actor = gcs_pb2.ActorTableData.FromString(raw)
        if actor.address.node_id.hex() != ask["node_id"] or actor.state != ALIVE:
            continue
        found.append({"id": actor.actor_id.hex(), "name": actor.name, "namespace": actor.ray_namespace, "pid": actor.pid,
                      "class_name": actor.class_name, "max_restarts": actor.max_restarts, "num_restarts": actor.num_restarts,
                      "detached": actor.is_detached, "job_id": actor.job_id.hex(), "submission_id": jobs.get(actor.job_id.hex(), "")})
        if len(found) >= ask["max"]:
            break
    print(json.dumps({"actors": found}))
else:
    ray.init(address=ask["gcs"], _node_ip_address=ask["node_ip"], log_to_driver=False, logging_level="ERROR",
             include_dashboard=False, namespace="zeromib-gpu")
    killed, changed = [], []
    for want in ask["actors"]:
        try:
            handle = ray.get_actor(want["name"], namespace=want["namespace"])
        except ValueError:
            changed.append(want["id"])
            continue
        if handle._actor_id.hex() != want["id"]:
            changed.append(want["id"])
            continue
        ray.kill(handle, no_restart=True)
        killed.append(want["id"])
    waiting = set(killed)
    deadline = time.monotonic() + ask["wait_s"]
    while waiting and time.monotonic() < deadline:
        for actor_id in list(waiting):
            raw = accessor.get_actor_info(ray.ActorID.from_hex(actor_id))
            if raw is None or gcs_pb2.ActorTableData.FromString(raw).state == DEAD:
                waiting.discard(actor_id)
        if waiting:
            time.sleep(0.1)
    print(json.dumps({"killed": killed, "changed": changed, "not_dead": sorted(waiting)}))
'''


class RayUnavailable(Exception):
    """Ray could not be asked (no installation to trust, no answer in time, an error): the message
    names the node and what failed."""


class RayNode(t.TypedDict):
    """A Ray node of this host as its own processes say: the vouched node process, its raylet, the
    GCS address, node id and IP, and the installation (interpreter, package root) to ask it with."""

    node_pid: int
    raylet_pid: int
    gcs: str
    node_id: str
    node_ip: str
    python: str
    packages: str


def flags(argv: t.Sequence[str]) -> dict[str, str]:
    """`--name=value` arguments of a raylet's argv (Ray writes them so) -> {name: value}; the
    spelling with `-` and `_` both kept as written."""
    found: dict[str, str] = {}
    for arg in argv[1:]:
        name, sep, value = str(arg).partition("=")
        if sep and name.startswith("--") and name not in found:
            found[name] = value
    return found


def raylet_of(holder_pid: int, node: t.Mapping[str, t.Any], proc: str, read: ReadProcess) -> t.Mapping[str, t.Any] | None:
    """The raylet above a holder, run by the vouched node: the node itself when it is the raylet,
    else its direct child in the holder's parent chain whose executable (the kernel's) is Ray's
    raylet, with the node's uid. None where no raylet is there (then nothing of Ray restarts it)."""
    if str(node.get("exe_path") or "").endswith(RAYLET_TAIL):
        return node
    chain = holders_mod.lineage(holder_pid, proc)[:MAX_DEPTH]
    for pid in chain:
        record = read(pid)
        if record and record.get("ppid") == node.get("pid") and str(record.get("exe_path") or "").endswith(RAYLET_TAIL) \
                and record.get("uid") == node.get("uid"):
            return record
    return None


def worker_of(holder_pid: int, raylet_pid: int, proc: str, read: ReadProcess) -> t.Mapping[str, t.Any] | None:
    """The Ray worker a holder is or runs under: the raylet's direct child in its parent chain."""
    for pid in holders_mod.lineage(holder_pid, proc)[:MAX_DEPTH]:
        record = read(pid)
        if record and record.get("ppid") == raylet_pid:
            return record
    return None


def owned_by_root_only(path: str, lstat: t.Callable[[str], os.stat_result] = os.lstat) -> str | None:
    """None when PATH and every directory above it are root's and writable by root only (no
    tenant could have put code there); else why not."""
    current = path
    while True:
        try:
            info = lstat(current)
        except OSError as exc:
            return f"{current}: {exc.strerror or exc}"
        if info.st_uid != 0:
            return f"{current} is owned by uid {info.st_uid:d}"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not stat.S_ISLNK(info.st_mode):
            return f"{current} is writable by others than root"
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def argv_of(pid: int, proc: str) -> list[str]:
    """A raylet's argv (its --python_worker_command is one argument with spaces), at most MAX_OUTPUT."""
    try:
        with open(f"{proc}/{pid:d}/cmdline", "rb") as handle:
            return holders_mod.parse_cmdline(handle.read(MAX_OUTPUT))[0]
    except OSError:
        return []


def node_for(holder_pid: int, node: t.Mapping[str, t.Any], proc: str, read: ReadProcess,
             realpath: t.Callable[[str], str] = os.path.realpath,
             lstat: t.Callable[[str], os.stat_result] = os.lstat) -> RayNode | None:
    """The Ray node a holder runs under, ready to be asked; None where no raylet runs it.
    RayUnavailable where the raylet says too little, or its installation is not root's alone."""
    raylet = raylet_of(holder_pid, node, proc, read)
    if raylet is None:
        return None
    said = flags(argv_of(int(raylet["pid"]), proc))
    gcs = said.get("--gcs-address") or said.get("--gcs_address")
    node_id = said.get("--node_id") or said.get("--node-id")
    node_ip = said.get("--node_ip_address") or said.get("--node-ip-address")
    worker_command = (said.get("--python_worker_command") or "").split()
    where = "Ray node {} (PID {:d}), raylet PID {:d}".format(node.get("name"), int(node.get("pid") or 0), int(raylet["pid"]))
    if not gcs or not node_id or not node_ip or not worker_command:
        raise RayUnavailable(f"{where}: its raylet's command line names no GCS address, node id, node IP or Python")
    packages = str(raylet["exe_path"])[:-len(RAYLET_TAIL)] or "/"
    python = realpath(worker_command[0])
    for path in (packages + "/ray", python):
        why = owned_by_root_only(path, lstat)
        if why:
            raise RayUnavailable(f"{where}: its Ray installation is not root's alone ({why}): gpu_release runs no Ray client from it")
    return {"node_pid": int(node["pid"]), "raylet_pid": int(raylet["pid"]), "gcs": gcs, "node_id": node_id, "node_ip": node_ip,
            "python": python, "packages": packages}


def ask(node: RayNode, request: t.Mapping[str, t.Any], timeout: float = CLIENT_TIMEOUT_S) -> dict[str, t.Any]:
    """One call of the client with the node's own Ray -> its answer. RayUnavailable on no answer
    within `timeout` (its whole process group is killed), an error, or an answer that is not one."""
    where = "Ray's GCS at {} (asked with {} and the Ray of {})".format(node["gcs"], node["python"], node["packages"])
    try:
        child = subprocess.Popen([node["python"], "-I", "-c", CLIENT, node["packages"], json.dumps(dict(request))], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", env=dict(CLIENT_ENV), start_new_session=True)
    except OSError as exc:
        raise RayUnavailable(f"{where}: the Ray client could not start: {exc}") from exc
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        raise RayUnavailable(f"{where}: no answer within {timeout:.0f} s (is the head reachable from this node?)") from None
    finally:
        _kill_group(child)
    # Lines end at a line feed only: a word of the cluster's (an actor's name, an error) may hold
    # other line breaks that splitlines() would cut at.
    lines = [line for line in out[:MAX_OUTPUT].decode("utf-8", "replace").strip().split("\n") if line.strip()]
    if child.returncode != 0 or not lines:
        said = [line for line in err[-MAX_OUTPUT:].decode("utf-8", "replace").split("\n") if line.strip()]
        raise RayUnavailable("{}: the Ray client failed (exit {}): {}".format(where, child.returncode, " ".join((said or ["no output"])[-1].split())[:300]))
    try:
        answer = json.loads(lines[-1])
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise RayUnavailable(f"{where}: the Ray client's answer is not one: {lines[-1][:200]}")
    return answer


def _kill_group(child: subprocess.Popen) -> None:
    """The client and whatever it started (Ray's driver may start helpers), by its own session."""
    if child.poll() is None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:
            pass
        child.wait()


def restartable(actor: t.Mapping[str, t.Any]) -> bool:
    """Whether Ray's GCS would start the actor again if its process died: max_restarts -1
    (forever) or restarts left."""
    most = int(actor.get("max_restarts") or 0)
    return most == -1 or int(actor.get("num_restarts") or 0) < most


def match(workers: t.Mapping[int, t.Mapping[str, t.Any]], actors: t.Iterable[t.Mapping[str, t.Any]],
          start_time_now: t.Callable[[int], t.Any]) -> list[dict[str, t.Any]]:
    """The actors of `actors` (this node's, from the GCS) that are the Ray workers `workers` ({pid:
    its record, read before the GCS was asked}): the GCS's PID is the worker's AND the kernel's
    process at that PID still started when it did (not a PID reused meanwhile). -> each actor with
    `holders` (the holder PIDs it runs) taken from its worker's record."""
    found = []
    for actor in actors:
        worker = workers.get(int(actor.get("pid") or 0))
        if worker is None or worker.get("start_time") is None or start_time_now(int(worker["pid"])) != worker.get("start_time"):
            continue
        found.append(dict(actor, holders=list(worker.get("holders") or [])))
    return found


def command(actor: t.Mapping[str, t.Any]) -> str:
    """Ray's own command that ends the actor for good: ray.kill by its name, else its job's."""
    if actor.get("name"):
        return "ray.kill(ray.get_actor({!r}, namespace={!r}), no_restart=True)".format(str(actor["name"]), str(actor.get("namespace") or ""))
    if actor.get("detached"):
        # A detached actor outlives its job: only a handle ends it.
        return "ray.kill(<its handle>, no_restart=True) from a program that holds a handle of actor {}".format(actor.get("id") or "?")
    if actor.get("submission_id"):
        return "ray job stop {}".format(actor["submission_id"])
    return "ray.kill(<its handle>, no_restart=True) in job {} (its driver holds the handle), or end that driver".format(actor.get("job_id") or "?")


def label(actor: t.Mapping[str, t.Any]) -> str:
    """`actor trainer0 (Trainer, PID 224, max_restarts -1)`."""
    return "actor {} ({}, PID {}, max_restarts {})".format(actor.get("name") or actor.get("id", "?")[:12], actor.get("class_name") or "?",
                                                           actor.get("pid"), actor.get("max_restarts"))


def start_time(pid: int, proc: str) -> t.Any:
    """The kernel's start time of PID now (None when it is gone)."""
    record = holders_mod.read_process(pid, proc)
    return record.get("start_time") if record else None
