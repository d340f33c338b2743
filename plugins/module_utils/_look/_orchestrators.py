# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Holders that a cluster runtime would start again, on this node or another (issue 72).

A process killed under one of these comes back, often elsewhere: Ray's GCS restarts an actor with
`max_restarts` on any node, Docker Swarm recreates a killed task as a new container, the kubelet
recreates a pod's containers (_act/_containers refuses pods already). Recognised from what the
kernel and the runtime say, never from a name alone:
- Ray: an ancestor of the holder is a raylet, `ray start` node or gcs_server that the identity
  rule vouches for (_protect.ProcessNames: root or a system account running a root-owned system
  executable, or a system unit's main process, as `ray start --block` is as a unit's ExecStart=).
  A user's own raylet (their venv, their uid) is theirs to run; its workers are ordinary holders,
  as any user process is. So is a raylet root started by hand from a pip install under
  /usr/local/lib (no system directory): its workers are ended as any launcher's GPU jobs, a
  restart here fails the settle window, one on another host the role's fleet-wide proof.
- Docker Swarm: the holder's container, as Docker's daemon reports it (root's word), carries the
  engine's `com.docker.swarm.service.name` label. The cgroup path alone names no container
  (_container_of confirms it with the runtime first).
- Multi-node jobs: their ranks on other nodes keep their GPUs in a hung collective when this
  node's are killed. A Slurm job from the kernel's word (the slurmstepd cgroup the process runs
  in) and Slurm's own count of its nodes (`scontrol show job`), never its environment; torchrun's
  elastic agent with more than one node from its command line. Only told (named in the result
  and the host's first sentence), never decided on.

What is done with them (stop through the orchestrator when `services` names it, else refuse with
the command) is _act/_orchestrators'.
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import ContainerRecord, Holder

    MainPidOf = t.Callable[[str], t.Optional[int]]
    ReadProcess = t.Callable[[int], t.Optional[t.Mapping[str, t.Any]]]
    # Slurm's answer to `scontrol show job -o JOB` (its one line), None when it gave none.
    ShowJob = t.Callable[[str], t.Optional[str]]

RAY = "ray"
SWARM = "swarm"
# The processes of a Ray node that run every job's workers as their descendants.
RAY_NODE = _protect.ProcessNames("raylet", "ray start", "gcs_server", scripts=True)
# What ends a Ray node's work where its actors are not known (Ray could not be asked).
RAY_COMMAND = "ray stop (on this node), or ray job stop JOB_ID / ray.kill(actor, no_restart=True) from the cluster's head"
SWARM_SERVICE = "com.docker.swarm.service.name"
SWARM_TASK = "com.docker.swarm.task.name"
# torchrun / python -m torch.distributed.run / .launch, and its --nnodes (N, or MIN:MAX).
_TORCHRUN = re.compile(r"(?:^|/|\s)(?:torchrun|torch\.distributed\.(?:run|launch))(?:\s|$)")
_NNODES = re.compile(r"--nnodes[= ](\d+)(?::(\d+))?")
# Slurm's count of a job's nodes and their names, in `scontrol show job -o`'s line.
_NUM_NODES = re.compile(r"(?:^|\s)NumNodes=(\d+)(?:\s|$)")
_NODE_LIST = re.compile(r"(?:^|\s)NodeList=(\S+)")
# A TCP socket's state in /proc/net/tcp: connected.
_ESTABLISHED = "01"
# Bounds on what is read of a process's sockets: its open files, and each TCP table.
MAX_FDS = 4096
MAX_TABLE_BYTES = 1 << 20
# Ancestors walked at most (a deeper tree is no launcher's).
MAX_DEPTH = 32
# Names in a message before "and N more".
NAMED = 5


class Orchestrated(t.TypedDict):
    """Holders one orchestrator runs on this node: `kind` (ray, swarm), `name` (the Swarm service;
    for Ray, the node process's PID and name), `pids`, `gpu_indexes`, `command` (what stops it
    through the orchestrator: for Ray, each actor's own once Ray was asked), `entry` (the services
    entry that lets gpu_release do so), `node_pid` (the vouched Ray node process; None for Swarm) and
    `actors` (Ray's actors of those holders that its GCS would restart, once Ray was asked: _act/_ray)."""

    kind: str
    name: str
    pids: list[int]
    gpu_indexes: list[int]
    command: str
    entry: str
    node_pid: int | None
    actors: list[dict[str, t.Any]]


def swarm_service(record: ContainerRecord | t.Mapping[str, t.Any] | None) -> str | None:
    """The Swarm service of a container, from the labels its runtime reports; None for others."""
    if not record:
        return None
    name = (record.get("labels") or {}).get(SWARM_SERVICE)
    return str(name) if name else None


def is_ray_node(record: t.Mapping[str, t.Any] | None, main_pid_of: MainPidOf | None = None) -> bool:
    """A raylet, `ray start` or gcs_server that the identity rule backs: a system unit's main
    process (`ray start --block` as ExecStart=), or root running it from a system directory."""
    return bool(record) and bool(RAY_NODE.of(record, main_pid_of))


def ray_node(pid: int, proc: str, read: ReadProcess, main_pid_of: MainPidOf | None = None) -> t.Mapping[str, t.Any] | None:
    """The vouched Ray node process above a holder (its nearest ancestor that is one), else None."""
    for ancestor in holders_mod.lineage(pid, proc)[1:MAX_DEPTH]:
        record = read(ancestor)
        if record and is_ray_node(record, main_pid_of):
            return record
    return None


def multi_node_launcher(pid: int, proc: str, read: ReadProcess) -> str | None:
    """`torchrun --nnodes 2 ... (PID 17, connected to 10.0.0.11:29500)` when a torchrun agent
    above the holder says more than one node AND the kernel shows it or the holder connected to
    another host (the rendezvous store, NCCL's sockets); None otherwise. The command line alone
    is its user's word (a one-node `--nnodes 4`, a script named torchrun): never enough."""
    for ancestor in holders_mod.lineage(pid, proc)[1:MAX_DEPTH]:
        record = read(ancestor)
        cmdline = " ".join(str((record or {}).get("cmdline") or "").split())
        if not _TORCHRUN.search(cmdline):
            continue
        nodes = _NNODES.search(cmdline)
        if not nodes or max(int(nodes.group(1)), int(nodes.group(2) or 0)) < 2:
            return None
        peer = remote_peer(ancestor, proc) or remote_peer(pid, proc)
        return f"{cmdline[:120]} (PID {ancestor:d}, connected to {peer})" if peer else None
    return None


def _socket_inodes(pid: int, proc: str) -> set[str]:
    """The inodes of the sockets a process holds open (its /proc/PID/fd links), at most MAX_FDS."""
    base = f"{proc}/{pid:d}/fd"
    try:
        names = os.listdir(base)[:MAX_FDS]
    except OSError:
        return set()
    found = set()
    for name in names:
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            found.add(target[8:-1])
    return found


def _endpoint(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """`0B00000A:6E14` (/proc/net/tcp's hex, each 32-bit word in host order) -> (10.0.0.11, 28180)."""
    address, _sep, port = field.partition(":")
    try:
        raw = bytes.fromhex(address)
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
        return ipaddress.ip_address(words), int(port, 16)
    except ValueError:
        return None


def remote_peer(pid: int, proc: str) -> str | None:
    """`10.0.0.11:29500`: the first established TCP connection of the process to another host
    (not loopback, not one of its own addresses), from the kernel's tables of its network
    namespace; None when there is none. Reads at most MAX_TABLE_BYTES of each table."""
    inodes = _socket_inodes(pid, proc)
    if not inodes:
        return None
    for table in ("net/tcp", "net/tcp6"):
        try:
            with open(f"{proc}/{pid:d}/{table}", "rb") as handle:
                rows = handle.read(MAX_TABLE_BYTES).decode("ascii", "replace").splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) < 10 or fields[3] != _ESTABLISHED or fields[9] not in inodes:
                continue
            local, remote = _endpoint(fields[1]), _endpoint(fields[2])
            if remote and local and not remote[0].is_loopback and remote[0] != local[0]:
                return f"{remote[0]}:{remote[1]:d}"
    return None


def slurm_nodes(job: str, shown: str | None) -> tuple[int, str] | None:
    """(node count, node list) of job JOB from Slurm's `scontrol show job -o` line; None when
    the line is not that job's or says no count."""
    if not shown or not re.search(rf"(?:^|\s)JobId={re.escape(job)}(?:\s|$)", shown):
        return None
    count = _NUM_NODES.search(shown)
    nodes = _NODE_LIST.search(shown)
    return (int(count.group(1)), nodes.group(1) if nodes else "?") if count else None


def multi_node_job(pid: int, proc: str, read: ReadProcess, show_job: ShowJob) -> str | None:
    """`Slurm job 77 on 2 nodes (gpu[01-02])` when the holder runs in a Slurm job (the kernel's
    word: slurmstepd's cgroup, or a vouched slurmstepd ancestor) that Slurm says spans more than
    one node; None otherwise. Never the job's environment (SLURM_JOB_NUM_NODES) or a cgroup its
    user named: those are hers. `read` is unused (one signature with multi_node_launcher)."""
    del read
    job = _jobs.owning_job(pid, proc)
    if job is None:
        return None
    found = slurm_nodes(job, show_job(job))
    if not found or found[0] < 2:
        return None
    return f"Slurm job {job} on {found[0]:d} nodes ({found[1][:120]})"


def _gpus(holders: t.Iterable[Holder], selected: t.Collection[int]) -> list[int]:
    return sorted({i for h in holders for i in h.get("gpu_indexes") or [] if not selected or i in selected})


def group(holders: t.Sequence[Holder], selected: t.Collection[int], proc: str, read: ReadProcess,
          inspect: t.Callable[[Holder], t.Any], main_pid_of: MainPidOf | None = None) -> list[Orchestrated]:
    """The holders of selected GPUs that Ray or Swarm runs, one entry per Ray node or Swarm service.
    `inspect(holder)`: its container's record from the runtime (None when not a container or the
    runtime does not know it)."""
    found: dict[tuple[str, str], tuple[Orchestrated, list[Holder]]] = {}
    for holder in holders:
        uses = set(holder.get("gpu_indexes") or []) | set(holder.get("candidate_gpu_indexes") or [])
        if holder.get("protected") or not uses or (selected and not uses & set(selected)):
            continue
        entry: Orchestrated | None = None
        service = swarm_service(inspect(holder)) if holder.get("container") else None
        if service:
            entry = {"kind": SWARM, "name": service, "pids": [], "gpu_indexes": [], "entry": f"swarm:{service}",
                     "command": f"docker service scale {service}=0", "node_pid": None, "actors": []}
        else:
            node = ray_node(holder["pid"], proc, read, main_pid_of)
            if node:
                entry = {"kind": RAY, "name": "{} (PID {})".format(node.get("name"), node.get("pid")), "pids": [], "gpu_indexes": [],
                         "entry": "ray:", "command": RAY_COMMAND, "node_pid": int(node["pid"]), "actors": []}
        if entry is None:
            continue
        key = (entry["kind"], entry["name"])
        kept, members = found.setdefault(key, (entry, []))
        members.append(holder)
        kept["pids"].append(holder["pid"])
    for kept, members in found.values():
        kept["gpu_indexes"] = _gpus(members, selected)
    return [kept for kept, _members in found.values()]


def refusal(refused: t.Sequence[Orchestrated]) -> str:
    """The run's failure before anything is done, naming each orchestrator, its processes, the
    command that stops it there, and the services entry that lets gpu_release do it."""
    parts = []
    for entry in refused:
        pids = ", ".join(str(p) for p in entry["pids"][:NAMED]) + (f" and {len(entry['pids']) - NAMED} more" if len(entry["pids"]) > NAMED else "")
        what = "Ray node {}".format(entry["name"]) if entry["kind"] == RAY else "Docker Swarm service {}".format(entry["name"])
        said = [f"`{entry['command']}`"]
        if entry.get("actors"):
            # Ray was asked: each actor's own command (from any node of the cluster), then the node's.
            said = ["`{}` ({})".format(a["command"], a["label"]) for a in (entry.get("actors") or [])[:NAMED]] + ["`ray stop` on this node"]
        parts.append("{} (PID {} on GPU {}): run {}, or name it in services as {}".format(
            what, pids, ",".join(str(i) for i in entry["gpu_indexes"]) or "-", ", ".join(said), entry["entry"]))
    return ("GPUs are held by work a cluster runtime starts again, here or on another node, when its processes are killed: {}. "
            "gpu_release stops it only through the runtime, when services names it".format("; ".join(parts)))
