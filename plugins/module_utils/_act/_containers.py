# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Containers of GPU holders: what gpu_release does about them. Which container a holder runs in
(confirmed by its runtime) is read by the look (_look/_container_of).

A process killed from outside its container is started again by the runtime when the container
has a restart policy (measured here with Docker 20.10: a `--restart=always` container SIGKILLed
from outside runs again ~1 s later), so the GPUs read 0 MiB for a moment and fill up again.
gpu_release therefore stops Docker and Podman containers through their runtime, and never acts
on a Kubernetes pod: the kubelet would restart it behind the scheduler's back.

1. `plan`: the containers to stop or disable, the targets left to signal; a pod is refused.
2. `act`: disable, then stop, all at once; returns what it did.
"""

from __future__ import annotations

import socket
import threading
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look._engines import MANAGED, PODMAN, RuntimeUnavailable
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _paused
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._engines import Runtimes
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import (
        ContainerEntry,
        ContainerRecord,
        ContainersDone,
        Holder,
    )

SERVICE_PREFIX = _services.CONTAINER


def holder_entry(holder: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """A holder's container in the shape of a planned entry (describe_entry's)."""
    return {"name": holder.get("container_name"), "id": holder.get("container"), "runtime": holder.get("container_runtime"),
            "image": holder.get("container_image")}


def describe_entry(entry: t.Mapping[str, t.Any]) -> str:
    """`vllm-a (docker 4f3c2b1a4f3c, vllm/vllm-openai:latest)`, as far as it is known, for a
    planned entry (stopped_containers' shape), a runtime record with its runtime, or a holder's
    container (holder_entry): the one way a container is named in messages."""
    name, cid, runtime, image = entry.get("name"), entry.get("id"), entry.get("runtime"), entry.get("image")
    if not name:
        return "{} ({})".format((cid or "?")[:12], runtime or "unknown runtime")
    inner = " ".join(part for part in (runtime, (cid or "")[:12]) if part)
    if image:
        inner += (", " if inner else "") + image
    return f"{name} ({inner})"


def pod_holders(holders: t.Iterable[Holder]) -> list[Holder]:
    return [h for h in holders if (h.get("_container_ref") or {"kubernetes": False})["kubernetes"]]


def pod_message(holders: t.Iterable[Holder], node: str | None = None) -> str:
    """The refusal for holders in Kubernetes pods: which pod (namespace/name, else UID), and what to do."""
    node = node or socket.gethostname()
    pods: list[str] = []
    for holder in holders:
        pod = holder.get("pod") or ("UID {}".format(holder["pod_uid"]) if holder.get("pod_uid") else "of unknown UID")
        text = "pod {} (pid {:d} {} on GPU {}{})".format(
            pod,
            holder["pid"],
            holder.get("name"),
            ",".join(str(i) for i in holder.get("gpu_indexes") or []) or "-",
            ", container {}".format((holder.get("container") or "")[:12]) if holder.get("container") else "",
        )
        if text not in pods:
            pods.append(text)
    return (
        "GPUs are held by Kubernetes pods: {0}. gpu_release never signals or stops a pod's processes: the kubelet would start "
        "them again, and the pod's owner would lose its work without the scheduler knowing. Cordon and drain the node first "
        "(kubectl cordon {1} && kubectl drain {1} --ignore-daemonsets --delete-emptydir-data), then run gpu_release again".format("; ".join(pods), node)
    )


def own_containers(lineage: t.Iterable[int], proc: str = "/proc") -> set[str]:
    """Ids of the containers this module and its ancestors run in (never to be stopped). Every
    hierarchy line counts, not only the systemd-managed one: on a cgroup v1 node a runtime may
    name the container on a controller line alone, and missing it here would stop our own."""
    found = set()
    for pid in lineage:
        for path in _holders.cgroup_paths(pid, proc) or []:
            cid = _cgroups.container_of(path)
            if cid:
                found.add(cid)
    return found


# ---------------------------------------------------------------- plan and act


def _entry(runtime: str | None, record: ContainerRecord, gpu_indexes: t.Iterable[int] = ()) -> ContainerEntry:
    return t.cast("ContainerEntry", {
        "name": record["name"],
        "id": record["id"],
        "image": record["image"],
        "runtime": runtime,
        "restart_policy": record["restart_policy"],
        "restart_max_retries": record.get("restart_max_retries") or 0,
        "gpu_indexes": sorted(set(gpu_indexes)),
    })


class Plan:
    """What gpu_release does to containers: stop (found or named), disable (named), and the
    targets left to signal from outside (with why, for the respawn watch)."""

    def __init__(self) -> None:
        self.stop: list[ContainerEntry] = []
        self.disable: list[ContainerEntry] = []
        self.not_found: list[str] = []
        self.signal: list[Holder] = []
        self.outside: list[tuple[Holder, str | None]] = []  # holders in containers that are signalled from outside, and why
        self.warnings: list[str] = []
        self.named_ids: set[str | None] = set()  # containers services names (a paused one is unpaused before its stop)
        self._stopping: dict[str | None, ContainerEntry] = {}

    def __bool__(self) -> bool:
        return bool(self.stop or self.disable)

    def add_stop(self, runtime: str | None, record: ContainerRecord, gpu_indexes: t.Iterable[int]) -> None:
        """Stop the container once, for the GPUs of all its holders."""
        entry = self._stopping.get(record["id"])
        if entry is None:
            entry = self._stopping[record["id"]] = _entry(runtime, record, gpu_indexes)
            if _paused.is_paused(record):
                entry["unpaused"] = True
            self.stop.append(entry)
        else:
            entry["gpu_indexes"] = sorted(set(entry["gpu_indexes"]) | set(gpu_indexes))


def _plan_named(steps: Plan, runtimes: Runtimes, named_globs: t.Iterable[str], service_state: str | None, own: t.Container[str | None]) -> None:
    """Containers named in services (`container:<glob>`): stopped when running, disabled when
    service_state says so. A pod's container or this session's own is refused (StepFailed)."""
    for glob in named_globs:
        try:
            matches = runtimes.find(glob)
        except RuntimeUnavailable as exc:
            raise StepFailed(f"cannot list containers for {SERVICE_PREFIX}{glob}: {exc}") from exc
        if not matches:
            steps.not_found.append(SERVICE_PREFIX + glob)
        for runtime, record in matches:
            if record["pod"] or record["pod_uid"]:
                raise StepFailed("refusing to stop container {}: it belongs to Kubernetes pod {}; cordon and drain the node instead".format(
                    describe_entry(dict(record, runtime=runtime)), record["pod"] or record["pod_uid"]))
            if record["id"] in own:
                raise StepFailed(f"refusing to stop container {describe_entry(dict(record, runtime=runtime))}: it runs this Ansible session")
            if service_state in ("disabled", "masked") and record["restart_policy"] != "no":
                steps.disable.append(_entry(runtime, record))
            steps.named_ids.add(record["id"])
            if record["running"]:
                steps.add_stop(runtime, record, ())


def _outside_reason(holder: Holder, runtimes: Runtimes, protected_in: t.Container[str | None], own: t.Container[str | None],
                    stop_found: bool) -> str | None:
    """Why a holder's container is not stopped through its runtime (it is signalled from
    outside instead), or None when it is."""
    ref = holder.get("_container_ref")
    ref_runtime = ref["runtime"] if ref else None
    cid = holder["container"] or ""
    if not stop_found:
        return "kill is false"
    if ref_runtime not in MANAGED and holder.get("container_runtime") not in MANAGED:
        return "gpu_release cannot stop {} containers".format(ref_runtime or "its runtime's")
    if cid in protected_in:
        return "it also runs a protected process"
    if cid in own:
        return "it runs this Ansible session"
    if holder.get("_container_record") is None:
        # Never stopped through a runtime that has not confirmed the holder runs in it (annotate).
        runtime = holder.get("container_runtime")
        try:
            return f"{runtime} did not confirm it" if runtimes.inspect(runtime, cid) else f"{runtime} does not know it"  # type: ignore[arg-type]
        except RuntimeUnavailable as exc:
            return str(exc)
    return None


def _outside_warnings(outside: t.Iterable[tuple[Holder, str | None]]) -> list[str]:
    """One warning per container signalled from outside (none when kill is false)."""
    warned, warnings = set(), []
    for holder, reason in outside:
        if holder["container"] in warned or reason == "kill is false":
            continue
        warned.add(holder["container"])
        warnings.append(
            f"container {describe_entry(holder_entry(holder))} could not be stopped through its runtime ({reason}): its processes are signalled "
            "from outside, and gpu_release watches whether its restart policy starts them again"
        )
    return warnings


def plan(runtimes: Runtimes, holders: t.Iterable[Holder], targets: t.Iterable[Holder], named_globs: t.Iterable[str], service_state: str | None,
         own_containers: t.Container[str | None], stop_found: bool = True) -> Plan:
    """Plan for containers. Raises StepFailed before anything is done when a target runs in a
    Kubernetes pod or in a paused container services does not name, or a named container is a
    pod's or runs this session."""
    targets = list(targets)
    pods = pod_holders(targets)
    if pods:
        raise StepFailed(pod_message(pods))
    steps = Plan()
    paused: list[Holder] = []
    protected_in = {h["container"] for h in holders if h.get("protected") and h.get("container")}
    _plan_named(steps, runtimes, named_globs, service_state, own_containers)
    for holder in targets:
        if not holder.get("container"):
            steps.signal.append(holder)
            continue
        reason = _outside_reason(holder, runtimes, protected_in, own_containers, stop_found)
        if reason is None and _paused.unnamed([holder], steps.named_ids):
            paused.append(holder)  # its runtime's to thaw, and nobody said to: refused below
            continue
        if reason is None:
            steps.add_stop(holder.get("container_runtime"), holder["_container_record"], holder.get("gpu_indexes") or ())
            continue
        steps.signal.append(holder)
        steps.outside.append((holder, reason))
    if paused:
        raise StepFailed(_paused.refusal(paused, describe_entry))
    steps.warnings = _outside_warnings(steps.outside)
    return steps


def _disable(runtimes: Runtimes, entries: t.Iterable[ContainerEntry], done: ContainersDone) -> None:
    """Restart policy `no` for each entry, recorded in `done` as each is set; StepFailed on the
    first that cannot be set (with `done` so far)."""
    for entry in entries:
        try:
            runtimes.set_restart_no(entry["runtime"], entry["id"])
        except RuntimeUnavailable as exc:
            hint = ""
            if entry["runtime"] == PODMAN and "unknown flag" in str(exc):
                # Podman 4 (Debian 12's 4.3.1, tried) has no `update --restart`; a later Podman added it.
                hint = (": this Podman cannot change a restart policy; recreate the container with --restart=no, or run it from a "
                        "systemd unit (Quadlet) and name that unit in services")
            raise StepFailed(f"could not set the restart policy of container {describe_entry(entry)} to no: {exc}{hint}", done=done) from exc
        done["disabled"].append(t.cast("ContainerEntry", dict(entry, restart_policy="no", restart_policy_before=entry["restart_policy"])))


def act(runtimes: Runtimes, steps: Plan, grace: float | None, now: t.Callable[[], float] = time.monotonic) -> ContainersDone:
    """Disable (restart policy `no`) then stop, all containers at once, each with `grace`
    seconds between its stop signal and SIGKILL (the runtime's own escalation). Returns what
    it did: containers disabled and stopped, a warning for each it could not stop, and the ids
    of those with the reason (`failed`). StepFailed (with what was done) when a restart policy
    cannot be set: nothing is stopped then."""
    done: ContainersDone = {"disabled": [], "stopped": [], "warnings": [], "failed": {}}
    _disable(runtimes, steps.disable, done)
    failed = done["failed"]

    def stop(entry: ContainerEntry) -> None:
        started = now()
        try:
            if entry.get("unpaused"):
                _paused.thaw(runtimes, entry)
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
            done["warnings"].append("could not stop container {} through {}: {}".format(describe_entry(entry), entry["runtime"], failed[entry["id"]]))
        else:
            done["stopped"].append(entry)
    return done
