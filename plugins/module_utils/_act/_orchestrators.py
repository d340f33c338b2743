# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Work a cluster runtime would start again, stopped only through that runtime (issue 72).

_look/_orchestrators finds the holders Ray or Docker Swarm runs. Killing them frees nothing for
long: Swarm recreates the task as a new container, Ray's GCS restarts an actor with
`max_restarts` here or on a node already proven free. So, before anything is done:
- `services` names it: `swarm:<service glob>` scales the Swarm service to 0 replicas through the
  Docker Engine API (this node must be a Swarm manager; the service's replicas before are in the
  restore record, and gpu_restore scales it back); `ray:` lets gpu_release end the Ray workers on
  the selected GPUs as it ends any launcher's GPU jobs (the Ray node stays up; a restart here fails
  the settle window, one on another host of the play the role's fleet-wide proof);
- otherwise the run fails, naming each runtime, its processes and the command that stops it
  there (`docker service scale NAME=0`, `ray stop`), and the services entry to add. Check mode
  says the same.
Kubernetes pods are refused by _containers (cordon and drain: the kubelet recreates them).
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import time
import typing as t
import urllib.parse

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ray
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _orchestrators as look
from ansible_collections.zeromib.gpu.plugins.module_utils._look._cgroups import DOCKER
from ansible_collections.zeromib.gpu.plugins.module_utils._look._engines import RuntimeUnavailable

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._orchestrators import Orchestrated
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

SWARM, RAY = _services.ORCHESTRATOR_PREFIXES
PREFIXES = _services.ORCHESTRATOR_PREFIXES
# The record's kind of a Swarm service this run scaled down.
SCALED = "swarm_service"
# Seconds beyond kill_timeout that Swarm may take to stop a scaled-down task's container.
STOP_MARGIN_S = 15.0
POLL_S = 0.2
# Where Slurm's clients live beside the system directories (as slurm_node looks for scontrol).
SLURM_DIRS = ("/opt/slurm/bin",)
# Slurm's answer on a job: a note, so a slow slurmctld costs at most this, once per job.
SCONTROL_TIMEOUT_S = 5.0
SCONTROL_MAX_CHARS = 65536


def entries(services: t.Iterable[t.Any] | None) -> list[str]:
    """The `swarm:` and `ray:` entries of `services`, as written (stripped)."""
    return [str(item).strip() for item in services or [] if str(item).strip().startswith(PREFIXES)]


def is_named(found: Orchestrated, named: t.Iterable[str]) -> bool:
    """Whether an entry of `named` (swarm:GLOB, ray:) lets gpu_release stop it."""
    for entry in named:
        if found["kind"] == look.RAY and entry.startswith(RAY):
            return True
        if found["kind"] == look.SWARM and entry.startswith(SWARM) and fnmatch.fnmatchcase(found["name"], entry[len(SWARM):].strip() or "*"):
            return True
    return False


def not_found(named: t.Iterable[str], found: t.Sequence[Orchestrated], services: t.Collection[str]) -> list[str]:
    """Entries that name nothing: a `ray:` with no Ray worker on a selected GPU, a `swarm:` glob
    that matches no service the manager knows (`services`) nor any found here."""
    missing = []
    for entry in named:
        if entry.startswith(RAY):
            hit = any(f["kind"] == look.RAY for f in found)
        else:
            glob = entry[len(SWARM):].strip() or "*"
            hit = any(fnmatch.fnmatchcase(name, glob) for name in list(services) + [f["name"] for f in found if f["kind"] == look.SWARM])
        if not hit:
            missing.append(entry)
    return missing


def plan(holders: t.Sequence[Holder], selected: t.Collection[int], named: t.Sequence[str], proc: str,
         read: t.Callable[[int], t.Any], inspect: t.Callable[[Holder], t.Any],
         main_pid_of: t.Callable[[str], int | None] | None = None,
         ask_ray: t.Callable[[list[Orchestrated]], None] | None = None) -> list[Orchestrated]:
    """The orchestrated holders of the selected GPUs; StepFailed (before anything is done) when
    one is not named in services. `ask_ray(found)`: fills each Ray entry's `actors` (Ray asked)."""
    found = look.group(holders, selected, proc, read, inspect, main_pid_of)
    if ask_ray is not None and any(f["kind"] == look.RAY for f in found):
        ask_ray(found)
    refused = [f for f in found if not is_named(f, named)]
    if refused:
        raise StepFailed(look.refusal(refused))
    return found


def ray_actors(entry: Orchestrated, proc: str, read: t.Callable[[int], t.Any],
               ask: t.Callable[..., dict[str, t.Any]] = _ray.ask) -> list[dict[str, t.Any]]:
    """The actors among a Ray entry's holders that Ray's GCS would start again (_ray.match: the
    GCS's PID and the kernel's process agree), each with its `node`, `command` and `label`.
    Ray is asked once per raylet, and only where a raylet of the vouched node runs the holders.
    RayUnavailable where it cannot be asked."""
    node_record = read(int(entry["node_pid"] or 0)) if entry.get("node_pid") else None
    if not node_record:
        return []
    nodes: dict[int, tuple[_ray.RayNode, dict[int, dict[str, t.Any]]]] = {}
    for pid in entry["pids"]:
        node = _ray.node_for(pid, node_record, proc, read)
        worker = _ray.worker_of(pid, node["raylet_pid"], proc, read) if node else None
        if node is None or worker is None:
            continue
        kept = nodes.setdefault(node["raylet_pid"], (node, {}))[1].setdefault(int(worker["pid"]), dict(worker, holders=[]))
        kept["holders"].append(pid)
    actors = []
    for node, workers in nodes.values():
        answer = ask(node, {"do": "list", "gcs": node["gcs"], "node_id": node["node_id"], "max": _ray.MAX_ACTORS})
        for actor in _ray.match(workers, answer.get("actors") or [], lambda pid: _ray.start_time(pid, proc)):
            if _ray.restartable(actor):
                actors.append(dict(actor, node=node, command=_ray.command(actor), label=_ray.label(actor)))
    return actors


def unnamed_refusal(actors: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    """`ray:` ends through Ray only actors it can find by name (ray.kill needs a handle)."""
    return ("Ray would start again {}, and gpu_release ends an actor through Ray only by its name (ray.kill needs a handle): run {}, "
            "or `ray stop` on this node".format(", ".join(a["label"] for a in actors[:look.NAMED]),
                                                ", ".join("`{}`".format(a["command"]) for a in actors[:look.NAMED])))


def public_actor(actor: t.Mapping[str, t.Any], ended: bool = False) -> dict[str, t.Any]:
    """An actor as the result shows it."""
    return {"id": actor.get("id"), "name": actor.get("name"), "namespace": actor.get("namespace"), "pid": actor.get("pid"),
            "class_name": actor.get("class_name"), "max_restarts": actor.get("max_restarts"), "holders": list(actor.get("holders") or []),
            "command": actor.get("command"), "ended": ended}


def orchestrated_pids(found: t.Iterable[Orchestrated], kind: str) -> set[int]:
    return {pid for f in found if f["kind"] == kind for pid in f["pids"]}


class Swarm:
    """Docker Swarm's services through the Engine API of this node's Docker (a manager)."""

    def __init__(self, request: t.Callable[..., tuple[int, str]]) -> None:
        self.request = request

    def _json(self, method: str, path: str, body: t.Any = None) -> t.Any:
        try:
            status, text = self.request(method, path, body)
        except RuntimeUnavailable as exc:
            # 503 "This node is not a swarm manager", among others.
            raise StepFailed(f"Docker Swarm: {exc}; scale the service from a manager node (docker service scale NAME=0)") from exc
        if status >= 300:
            try:
                said = json.loads(text).get("message") or text
            except (ValueError, AttributeError):
                said = text
            raise StepFailed(f"Docker Swarm: {method} {path} answered {status:d}: {' '.join(str(said).split())[:200]}")
        return json.loads(text) if text.strip() else None

    def names(self) -> list[str]:
        return sorted(str((s.get("Spec") or {}).get("Name")) for s in self._json("GET", "/services") or [])

    def replicas(self, name: str) -> tuple[str, int, int | None, dict[str, t.Any]]:
        """(id, version, replicas or None for a global service, spec)."""
        service = self._json("GET", "/services/" + urllib.parse.quote(name, safe=""))
        spec = service.get("Spec") or {}
        replicated = (spec.get("Mode") or {}).get("Replicated")
        count = int(replicated.get("Replicas") or 0) if isinstance(replicated, dict) else None
        return str(service.get("ID")), int((service.get("Version") or {}).get("Index") or 0), count, spec

    def scale(self, name: str, count: int) -> int | None:
        """Sets a replicated service's replicas -> the count before; None for a global service (unchanged)."""
        sid, version, before, spec = self.replicas(name)
        if before is None:
            return None
        if before != count:
            spec["Mode"]["Replicated"]["Replicas"] = count
            self._json("POST", f"/services/{urllib.parse.quote(sid, safe='')}/update?version={version:d}", spec)
        return before

    def running_here(self, name: str) -> list[str]:
        """Ids of this node's running containers of the service's tasks."""
        filters = urllib.parse.quote(json.dumps({"label": [f"{look.SWARM_SERVICE}={name}"], "status": ["running"]}))
        return [str(c.get("Id")) for c in self._json("GET", f"/containers/json?filters={filters}") or []]


def swarm_of(runtimes: t.Any) -> Swarm:
    """The Swarm API of this node's Docker; StepFailed when only a CLI or nothing answers."""
    client = runtimes.client(DOCKER) if runtimes is not None else None
    request = getattr(client, "_request", None)
    if request is None:
        raise StepFailed("Docker Swarm: gpu_release reaches Swarm only through Docker's API socket (/run/docker.sock), and {}; "
                         "scale the service down by hand (docker service scale NAME=0)".format(
                             "docker answers only through its command" if client is not None else runtimes.error(DOCKER)))
    return Swarm(request)


def scale_down(swarm: Swarm, named: t.Sequence[str], found: t.Sequence[Orchestrated], at: str | None,
               kill_timeout: float, clock: t.Callable[[], float] = time.monotonic,
               sleep: t.Callable[[float], None] = time.sleep) -> tuple[list[dict[str, t.Any]], list[str]]:
    """Scale every Swarm service a `swarm:` entry names to 0, then wait (kill_timeout + margin) for
    its containers here to stop. -> (record entries, services not found). A global service cannot
    be scaled: StepFailed naming it, before any other is changed."""
    globs = [e[len(SWARM):].strip() or "*" for e in named if e.startswith(SWARM)]
    if not globs:
        return [], []
    known = swarm.names()
    targets = sorted({name for name in known if any(fnmatch.fnmatchcase(name, g) for g in globs)})
    missing = [f"{SWARM}{g}" for g in globs if not any(fnmatch.fnmatchcase(name, g) for name in known)]
    done: list[dict[str, t.Any]] = []
    for name in targets:
        try:
            before = swarm.scale(name, 0)
        except StepFailed as exc:
            exc.done = done
            raise
        if before is None:
            raise StepFailed(f"Docker Swarm service {name} is global (one task on every node): it cannot be scaled to 0; add a placement "
                             f"constraint that leaves this node out (docker service update --constraint-add node.hostname!=NODE {name})",
                             done=done)
        if before:
            done.append({"kind": SCALED, "name": name, "replicas": before, "actions": ["stopped"], "released_at": at})
    deadline = clock() + float(kill_timeout or 0) + STOP_MARGIN_S
    waiting = [entry["name"] for entry in done]
    while waiting and clock() < deadline:
        waiting = [name for name in waiting if swarm.running_here(name)]
        if waiting:
            sleep(POLL_S)
    if waiting:
        raise StepFailed("Docker Swarm did not stop the tasks of {} on this node within {:.0f} s of scaling to 0".format(
            ", ".join(waiting), float(kill_timeout or 0) + STOP_MARGIN_S), done=done)
    return done, missing


def scale_back(swarm: Swarm, entry: t.Mapping[str, t.Any]) -> list[str]:
    """gpu_restore: the service's replicas as before the release -> the steps done."""
    before = swarm.scale(str(entry["name"]), int(entry.get("replicas") or 0))
    if before is None:
        raise StepFailed(f"Docker Swarm service {entry['name']} is now global: its replicas were not put back")
    return [] if before == int(entry.get("replicas") or 0) else ["scaled to {}".format(entry.get("replicas"))]


# -- gpu_release's and gpu_restore's call sites (one call each; the state is theirs)

def for_release(release: t.Any, steps: t.Any) -> list[Orchestrated]:
    """gpu_release's plan: the orchestrated targets (refused unless named: StepFailed), the Swarm
    tasks taken out of the targets (Swarm stops them once scaled to 0; a container stopped
    through Docker would be recreated), the `swarm:`/`ray:` entries that name nothing here
    (`steps.orchestrated_missing`) and whether acting has a Swarm service to scale
    (`steps.orchestrated_to_do`)."""
    named = entries(release.options.services)
    runtimes = release.system.runtimes
    swarm_names: list[str] = []
    swarm_error = None
    if any(e.startswith(SWARM) for e in named):
        try:
            swarm_names = swarm_of(runtimes).names()
        except StepFailed as exc:
            # No Docker, or not a manager: in a mixed fleet the entry names nothing here, unless a task of it holds a GPU here.
            swarm_error = exc.msg

    def inspect(holder: Holder) -> t.Any:
        if holder.get("container_runtime") != DOCKER or not holder.get("container"):
            return None
        try:
            return runtimes.inspect(DOCKER, holder["container"])
        except RuntimeUnavailable:
            return None

    proc = release.system.proc

    def read(pid: int) -> t.Any:
        return holders_mod.read_process(pid, proc)

    ray_named = any(e.startswith(RAY) for e in named)

    def ask_ray(found: list[Orchestrated]) -> None:
        for entry in found:
            if entry["kind"] != look.RAY:
                continue
            try:
                entry["actors"] = ray_actors(entry, proc, read)
            except _ray.RayUnavailable as exc:
                if ray_named:
                    raise StepFailed(f"{exc}; gpu_release ends the actors Ray would start again only through Ray, and nothing was done: "
                                     "make Ray answer from this node, or run `ray stop` on it") from exc
                release.result["warnings"].append(f"{exc}: the refusal names Ray's commands without the actors")
                entry["actors"] = []
            entry["command"] = entry["command"] if not entry["actors"] else "; ".join(a["command"] for a in entry["actors"])

    found = plan(steps.targets, steps.selected, named, proc, read, inspect, release.main_pid_of, ask_ray) if steps.targets else []
    steps.ray_actors = [a for f in found if f["kind"] == look.RAY for a in f.get("actors") or []]
    unnamed = [a for a in steps.ray_actors if not a.get("name")]
    if unnamed:
        raise StepFailed(unnamed_refusal(unnamed))
    release.result["ray_actors"] = [public_actor(a) for a in steps.ray_actors]
    by_swarm = orchestrated_pids(found, look.SWARM)
    if by_swarm and swarm_error:
        raise StepFailed(swarm_error)
    steps.targets = [h for h in steps.targets if h["pid"] not in by_swarm]
    release.result["multi_node"] = multi_node(steps.targets, release.system.proc, lambda pid: holders_mod.read_process(pid, release.system.proc),
                                              scontrol_show_job(_commands.which("scontrol", _commands.SYSTEM_DIRS + SLURM_DIRS)))
    if release.result["multi_node"]:
        release.result["warnings"].append(multi_node_warning(release.result["multi_node"]))
    steps.orchestrated_missing = not_found(named, found, swarm_names)
    steps.orchestrated_to_do = bool(swarm_names) and any(e.startswith(SWARM) and e not in steps.orchestrated_missing for e in named)
    release.result["orchestrated"] = [{k: v for k, v in f.items() if k not in ("node_pid", "actors")} for f in found]
    return found


def scontrol_show_job(scontrol: str | None, timeout: float = SCONTROL_TIMEOUT_S) -> t.Callable[[str], str | None]:
    """Slurm's one line on a job (`scontrol show job -o JOB`), asked once per job; None where
    there is no scontrol, no answer in `timeout` or an error: then the rank is not named."""
    said: dict[str, str | None] = {}

    def show_job(job: str) -> str | None:
        if job not in said:
            said[job] = None
            if scontrol:
                try:
                    done = subprocess.run([scontrol, "show", "job", "-o", job], stdin=subprocess.DEVNULL, capture_output=True,
                                          timeout=timeout, check=False, env=_commands.c_locale_env())
                    said[job] = done.stdout.decode("utf-8", "replace")[:SCONTROL_MAX_CHARS] if done.returncode == 0 else None
                except (OSError, subprocess.TimeoutExpired):
                    said[job] = None
        return said[job]
    return show_job


def multi_node(targets: t.Sequence[Holder], proc: str, read: t.Callable[[int], t.Any],
               show_job: t.Callable[[str], str | None] = lambda _job: None) -> list[dict[str, t.Any]]:
    """The targets that are ranks of a multi-node job: [{pid, launcher}] (a note, at most
    look.NAMED). A Slurm job Slurm says spans nodes first (the kernel names the job), else a
    torchrun with --nnodes above 1 (its command line)."""
    found = []
    for holder in targets:
        launcher = look.multi_node_job(holder["pid"], proc, read, show_job) or look.multi_node_launcher(holder["pid"], proc, read)
        if launcher:
            found.append({"pid": holder["pid"], "launcher": launcher})
            if len(found) >= look.NAMED:
                break
    return found


def multi_node_warning(ranks: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    return ("{} of a multi-node job ({}): its ranks on the other nodes keep their GPUs, stuck in a collective, until NCCL's timeout "
            "ends them; free those nodes in the same play (the role's fleet-wide proof reads every host once more)").format(
                "PID {} is a rank".format(ranks[0]["pid"]) if len(ranks) == 1 else "PIDs {} are ranks".format(", ".join(str(r["pid"]) for r in ranks)),
                ranks[0]["launcher"])


def act_for_release(release: t.Any, _steps: t.Any) -> None:
    """gpu_release's act: scale the named Swarm services to 0, recorded for gpu_restore at once
    (also when a later step fails: what was done must be put back)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils import _record
    named = entries(release.options.services)
    swarm = swarm_of(release.system.runtimes)
    path = getattr(release.system, "record_path", None)
    done: list[dict[str, t.Any]] = []
    try:
        done, _missing = scale_down(swarm, named, release.result.get("orchestrated") or [], _record.now_iso(),
                                    release.options.kill_timeout or 0)
    except StepFailed as exc:
        done = list(exc.done or [])
        exc.done = None
        raise
    finally:
        release.result["scaled_services"] = [entry["name"] for entry in done]
        if path and done:
            try:
                _record.add(path, t.cast("t.Any", done))
            except (_record.RecordError, OSError) as exc:
                release.result["warnings"].append(f"the restore record was not written, so gpu_restore cannot scale back {done}: {exc}")
        if done:
            release.result["changed"] = True


def end_ray_actors(release: t.Any, steps: t.Any, ask: t.Callable[..., dict[str, t.Any]] = _ray.ask) -> None:
    """gpu_release's act, before any signal: the actors Ray would start again ended through Ray
    (ray.kill, no_restart), each node's at once, the GCS read until it says they are dead. What
    Ray ended is in the result also when a later node fails (StepFailed, before any signal)."""
    by_node: dict[int, tuple[_ray.RayNode, list[dict[str, t.Any]]]] = {}
    for actor in getattr(steps, "ray_actors", None) or []:
        by_node.setdefault(actor["node"]["raylet_pid"], (actor["node"], []))[1].append(actor)
    for node, actors in by_node.values():
        try:
            answer = ask(node, {"do": "kill", "gcs": node["gcs"], "node_ip": node["node_ip"], "wait_s": _ray.DEAD_WAIT_S,
                                "actors": [{"id": a["id"], "name": a["name"], "namespace": a["namespace"]} for a in actors]})
        except _ray.RayUnavailable as exc:
            raise StepFailed(f"{exc}; no process was signalled: end the actors with {'; '.join(a['command'] for a in actors)}") from exc
        killed = set(answer.get("killed") or [])
        for entry in release.result.get("ray_actors") or []:
            entry["ended"] = entry["ended"] or entry["id"] in killed
        gone = [a for a in actors if a["id"] in set(answer.get("changed") or [])]
        if gone:
            release.result["warnings"].append("Ray no longer knows {} by its name as the same actor: not ended through Ray, its processes "
                                              "are signalled".format(", ".join(a["label"] for a in gone)))
        not_dead = [a for a in actors if a["id"] in set(answer.get("not_dead") or [])]
        if not_dead:
            raise StepFailed("Ray's GCS did not say {} dead within {:.0f} s of ray.kill(no_restart=True): no process was signalled".format(
                ", ".join(a["label"] for a in not_dead), _ray.DEAD_WAIT_S))


def restore_for(restore: t.Any, entry: t.Mapping[str, t.Any]) -> tuple[list[str], str | None]:
    """gpu_restore: a Swarm service back to its replicas -> (steps, why not)."""
    if restore.check_mode:
        return ["scaled to {}".format(entry.get("replicas"))], None
    try:
        return scale_back(swarm_of(restore.system.runtimes), entry), None
    except StepFailed as exc:
        return [], exc.msg
