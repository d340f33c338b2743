# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""One fleet-wide proof after the last host is freed (issue 72).

Each host's gate proves its own GPUs free and watches its own launchers for a settle window. A
cluster runtime reschedules elsewhere: Ray's GCS restarts an actor with `max_restarts` on another
node, Docker Swarm and the kubelet recreate a killed task, surviving ranks of a multi-node job keep
their GPUs. Host A is proven free, then the work killed on host B lands on A.

So when any host of the batch freed something, the role's verdict (it runs once every host's gate
has answered: the linear strategy's lockstep) reads every host that passed once more with
zeromib.gpu.gpu_facts (memory and holders only, no health), and a host whose selected GPUs hold
memory or a holder again is not free, named with what holds it and which hosts this run freed. A
clean fleet (no host freed anything) reads nothing more: the verdict stays a task without SSH.
Pure functions here; the verdict action (plugins/action/free_gpus_verdict.py) runs the read.
"""

from __future__ import annotations

import typing as t
from collections.abc import Mapping

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _verdict

# What a run that freed something leaves in its outcome (plugin_utils/_outcome.py).
_DID = ("stopped_units", "disabled_units", "masked_units", "stopped_containers", "disabled_containers", "killed")
# Holders named in a message before "and N more" (a user decides how many processes there are).
NAMED = 3
# The proof's outcome status: the summary lists such a host with the failed ones.
BACK = "back"


def freed_something(outcome: t.Any) -> bool:
    """Whether this host's run (not a dry run) stopped, disabled or killed anything."""
    if not isinstance(outcome, Mapping) or outcome.get("check_mode"):
        return False
    return outcome.get("status") == "freed" or any(outcome.get(key) for key in _DID)


def freed_hosts(outcomes: t.Mapping[str, t.Any]) -> list[str]:
    """The hosts of the batch whose run freed something, in the batch's order."""
    return [name for name, outcome in outcomes.items() if freed_something(outcome)]


def needs_proof(own: t.Any, outcomes: t.Mapping[str, t.Any], all_looked: bool, check_mode: bool) -> bool:
    """A host that passed gets the one extra read when some host of the batch freed something and
    every host has answered (under `strategy: free` there is no "after the last host")."""
    return (not check_mode and all_looked and isinstance(own, Mapping) and bool(own.get("ok"))
            and bool(freed_hosts(outcomes)))


# The role's variables the proof's read takes (templated by the verdict).
SETTINGS = tuple("free_gpus_" + option for option in ("nvidia_smi", "timeout", "max_used_mib", "cross_gpu_footprint_mib", "protect"))
# Seconds beyond 3 x free_gpus_timeout (nvidia-smi's two calls and the /proc pass) that the read may take.
MARGIN_S = 40.0


def bound_s(settings: t.Mapping[str, t.Any]) -> float:
    """How long the verdict waits for the proof's read on one host."""
    timeout = settings.get("free_gpus_timeout")
    return 3 * (float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else 10.0) + MARGIN_S


def facts_args(settings: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The role's settings (free_gpus_X, templated) -> gpu_facts' options for the proof: memory and
    holders, no health (the gate judged health; this read only asks whether work came back)."""
    args: dict[str, t.Any] = {"processes": True, "fail_on_error": False, "health": False, "xid_window_hours": 0}
    for name in SETTINGS:
        value = settings.get(name)
        if value is not None and value != "" and value != []:
            args[name[len("free_gpus_"):]] = value
    return args


def _selected(gpus: t.Sequence[t.Mapping[str, t.Any]], selected: t.Sequence[int]) -> list[t.Mapping[str, t.Any]]:
    return [gpu for gpu in gpus if not selected or gpu.get("index") in selected]


def dirty_holders(holders: t.Iterable[t.Mapping[str, t.Any]], selected: t.Sequence[int]) -> list[t.Mapping[str, t.Any]]:
    """Live unprotected processes that use (or may use) a selected GPU; NVML clients use none."""
    found = []
    for holder in holders:
        uses = set(holder.get("gpu_indexes") or []) | set(holder.get("candidate_gpu_indexes") or [])
        if not holder.get("protected") and uses and (not selected or uses & set(selected)):
            found.append(holder)
    return found


def holder_words(holder: t.Mapping[str, t.Any]) -> str:
    """`PID 4242 (python3 worker.py), container ray-worker-1, started by PID 17`: what the kernel and
    the runtimes say of it (the command line is the process's own, quoted as it is, shortened)."""
    command = " ".join(str(holder.get("cmdline") or holder.get("name") or "?").split())
    parts = ["PID {} ({})".format(holder.get("pid"), command[:80] + ("..." if len(command) > 80 else ""))]
    if holder.get("container_name") or holder.get("container"):
        parts.append("container {}".format(holder.get("container_name") or str(holder.get("container"))[:12]))
    if holder.get("pod"):
        parts.append("pod {}".format(holder["pod"]))
    guest = holder.get("guest")
    if isinstance(guest, Mapping) and guest.get("name"):
        parts.append("guest {} {}".format(guest.get("kind"), guest.get("name")))
    if holder.get("unit"):
        parts.append("unit {}".format(holder["unit"]))
    if holder.get("ppid"):
        parts.append("started by PID {}".format(holder["ppid"]))
    return ", ".join(parts)


def judge(facts: t.Any, host: str, selected: t.Sequence[int], freed: t.Sequence[str]) -> str | None:
    """gpu_facts' `ansible_facts.gpu` of the proof -> None when every selected GPU is still free,
    else the host's message: what reads again, who holds it, and the hosts this run freed (where
    the work may have come from)."""
    where = "after this run freed {}".format(", ".join(freed)) if freed else "after the last host was freed"
    if not isinstance(facts, Mapping):
        return f"{host}: the fleet-wide proof {where} gave no reading of the GPUs: not free"
    if facts.get("error"):
        return "{}: the fleet-wide proof {} could not read the GPUs ({}): not free".format(host, where, " ".join(str(facts["error"]).split()))
    gpus = _selected(facts.get("gpus") or [], selected)
    if not gpus:
        return f"{host}: the fleet-wide proof {where} found none of the selected GPUs: not free"
    dirty = [_verdict.dirty_reading(gpu) for gpu in gpus if not gpu.get("clean")]
    holders = dirty_holders(facts.get("holders") or [], selected)
    if not dirty and not holders:
        return None
    said = "; ".join(dirty) if dirty else "the selected GPUs read free"
    if holders:
        named = "; ".join(holder_words(h) for h in holders[:NAMED])
        more = f" and {len(holders) - NAMED} more" if len(holders) > NAMED else ""
        said += f", held by {named}{more}"
    return (f"{host}: not free after the last host was freed: {said} (work started or rescheduled here {where}: a cluster runtime such as "
            "Ray, Docker Swarm or the kubelet restarts what was killed on any node; stop it there, then run again)")


def proven(own: t.Mapping[str, t.Any], message: str | None, freed: t.Sequence[str]) -> dict[str, t.Any]:
    """The host's outcome after the proof: unchanged but for `fleet_proof` when it held, else not
    ok with status `back` and the proof's message (what its own run did stays in it)."""
    outcome = dict(own)
    outcome["fleet_proof"] = {"freed_hosts": list(freed), "free": message is None}
    if message is not None:
        outcome.update({"ok": False, "status": BACK, "message": message})
    return outcome


def summary_line(outcomes: t.Iterable[t.Any]) -> str | None:
    """The fleet summary's line on the proof, None when no host was read again (a clean fleet)."""
    proved = [o for o in outcomes if isinstance(o, Mapping) and isinstance(o.get("fleet_proof"), Mapping)]
    if not proved:
        return None
    back = [str(o.get("host")) for o in proved if not o["fleet_proof"].get("free")]
    freed = list(dict.fromkeys(name for o in proved for name in o["fleet_proof"].get("freed_hosts") or []))
    line = "fleet-wide proof after {} {} freed: {} host{} read once more".format(
        ", ".join(freed), "was" if len(freed) == 1 else "were", len(proved), "" if len(proved) == 1 else "s")
    return line + (", not free again: " + ", ".join(back) if back else ", all still free")


def prove_host(action: t.Any, own: t.Mapping[str, t.Any], outcomes: t.Mapping[str, t.Any], host: str,
               task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
    """The fleet-wide proof on one host, run by the role's verdict action (`action`): one gpu_facts
    read, bounded; no answer is no proof."""
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _gate  # pylint: disable=import-outside-toplevel
    from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain  # pylint: disable=import-outside-toplevel
    freed = freed_hosts(outcomes)
    settings = {name: action._var(task_vars, name, None) for name in SETTINGS}  # pylint: disable=protected-access
    try:
        with _gate.bounded(bound_s(settings)):
            read = action._execute_module(module_name="zeromib.gpu.gpu_facts", module_args=facts_args(settings),  # pylint: disable=protected-access
                                          task_vars=task_vars)
    except _gate.NoAnswer:
        read = {"failed": True, "msg": f"gpu_facts did not answer within {bound_s(settings):.0f} s"}
    facts = {"error": read.get("msg") or "gpu_facts failed"} if read.get("failed") else (read.get("ansible_facts") or {}).get("gpu")
    return proven(own, judge(plain(facts), host, own.get("selected") or [], freed), freed)
