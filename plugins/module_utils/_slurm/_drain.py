# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Slurm: drain a node whose GPUs cannot be freed, and resume only the nodes zeromib drained;
and whose job a process is.

As LBNL NHC does: our drains carry a reason that starts with `zeromib:`; a drain with any other
reason (an admin's `maintenance`) is never overwritten and never resumed. Pure parsing and
decisions here; `scontrol` and `slurmd` run through one `run(argv) -> (rc, out, err)` callable.

Whose job a process runs in (`owning_job`) is the kernel's word or a vouched slurmstepd's, never
the user's: its cgroup as slurmstepd makes it (`job_<id>`, outside any subtree systemd delegates
to a user), else its nearest slurmstepd ancestor that the identity rule vouches for. The epilog
spares other jobs' processes by it (_jobcheck), and the respawn watch of the epilog and of
gpu_release passes over another job's new task by it (_settle's `foreign`)."""

from __future__ import annotations

import re
import socket
import typing as t


if t.TYPE_CHECKING:
    # One node of `scontrol show node -o`: {key: value}.
    Node = t.Dict[str, str]
    # argv -> (rc, stdout, stderr)
    Runner = t.Callable[[t.List[str]], t.Tuple[int, str, str]]

PREFIX = "zeromib:"
# Slurm keeps a reason as given; a long one makes sinfo -R unreadable.
REASON_MAX = 120
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:]*)=")


class SlurmError(Exception):
    pass


def parse_node(text: str) -> Node:
    """One node of `scontrol show node -o NAME` (one line, KEY=VALUE; Reason's value has spaces,
    and runs to the next KEY=) -> {key: value}."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    fields: Node = {}
    matches = list(_FIELD.finditer(line))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        fields[match.group(1)] = line[match.end():end].strip()
    return fields


def parse_nodes(text: str) -> list[Node]:
    return [parse_node(line) for line in text.splitlines() if line.strip()]


def slurmd_node_name(text: str | None) -> str | None:
    """NodeName= of `slurmd -C` (the first line)."""
    match = re.search(r"(?:^|\s)NodeName=(\S+)", text or "")
    return match.group(1) if match else None


def states(node: t.Mapping[str, str]) -> set[str]:
    """`IDLE+DRAIN` -> {"IDLE", "DRAIN"}; `DRAINED`, `DRAINING` count as DRAIN."""
    words = set(re.split(r"[+*~#!%$@^-]", (node.get("State") or "").upper())) - {""}
    if words & {"DRAINED", "DRAINING"}:
        words.add("DRAIN")
    return words


def reason_text(node: t.Mapping[str, str]) -> str:
    """The reason without Slurm's ` [user@time]` suffix."""
    reason = node.get("Reason") or ""
    return re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", reason).strip()


def ours(node: t.Mapping[str, str]) -> bool:
    return reason_text(node).startswith(PREFIX)


def short_reason(text: t.Any) -> str:
    """`zeromib: <text>`, one line, at most REASON_MAX characters."""
    text = " ".join(str(text or "").split())
    if text.startswith(PREFIX):
        text = text[len(PREFIX):].strip()
    reason = "{} {}".format(PREFIX, text or "GPUs could not be freed")
    # scontrol takes the reason as one argument; a double quote would end it in slurm.conf-style output.
    # An = would read as the start of another field in scontrol show node's one-line output.
    reason = reason.replace('"', "'").replace("=", " ")
    return reason if len(reason) <= REASON_MAX else reason[:REASON_MAX - 3].rstrip() + "..."


# States an admin (or Slurm itself) sets with a reason of their own: never overwritten.
ADMIN_STATES = {"DOWN", "FAIL", "FAILING", "REBOOT_REQUESTED", "REBOOT_ISSUED", "MAINT", "RESERVED"}


def drain_decision(node: t.Mapping[str, str], reason: str) -> tuple[bool, str]:
    """(act, why): whether to drain `node` with `reason`. A reason not zeromib's (an admin's
    DOWN or FAIL, Slurm's "Not responding") is never replaced: resume would later read it as
    someone else's and never resume, so the node is left as the admin set it."""
    if reason_text(node) and not ours(node):
        held = sorted(states(node) & (ADMIN_STATES | {"DRAIN"})) or sorted(states(node))
        return False, "{} already by someone else (reason {!r}): left as it is".format("+".join(held).lower() or "set", reason_text(node))
    if "DRAIN" in states(node):
        if not ours(node):
            return False, f"drained already by someone else (reason {reason_text(node)!r}): left as it is"
        if reason_text(node) == reason:
            return False, "drained already by zeromib with the same reason"
        return True, "drained by zeromib before: the reason is updated"
    return True, "not drained"


def resume_decision(node: t.Mapping[str, str]) -> tuple[bool, str]:
    """(act, why): whether to resume `node`."""
    if "DRAIN" not in states(node):
        return False, "not drained"
    if not ours(node):
        return False, f"drained by someone else (reason {reason_text(node)!r}): never resumed by zeromib"
    return True, f"drained by zeromib (reason {reason_text(node)!r})"


class Slurm:
    def __init__(self, run: Runner, scontrol: str, slurmd: str | None = None, hostname: str | None = None) -> None:
        self.run = run
        self.scontrol = scontrol
        self.slurmd = slurmd
        self.hostname = hostname or socket.gethostname().split(".")[0]

    def show(self, name: str) -> tuple[Node | None, str | None]:
        rc, out, err = self.run([self.scontrol, "show", "node", "-o", name])
        if rc != 0 or not out.strip():
            return None, (err or out).strip()
        return parse_node(out), None

    def node_name(self, given: str | None = None) -> tuple[str, Node]:
        """The Slurm node name of this host: `given`, else slurmd -C's NodeName if scontrol knows it,
        else the node whose NodeHostName or NodeName is this host's short name."""
        if given:
            node, err = self.show(given)
            if node is None:
                raise SlurmError(f"Slurm does not know node {given}: {err}")
            return given, node
        candidates: list[str] = []
        if self.slurmd:
            rc, out, _err = self.run([self.slurmd, "-C"])
            named = slurmd_node_name(out) if rc == 0 else None
            if named:
                candidates.append(named)
        if self.hostname not in candidates:
            candidates.append(self.hostname)
        for name in candidates:
            node, _why = self.show(name)
            if node is not None and node.get("NodeName") == name:
                return name, node
        rc, out, err = self.run([self.scontrol, "show", "node", "-o"])
        if rc == 0:
            for node in parse_nodes(out):
                # A line without NodeName= names no node that scontrol update could be given.
                found = node.get("NodeName")
                if found and self.hostname in (node.get("NodeHostName"), node.get("NodeAddr")):
                    return found, node
        raise SlurmError("cannot tell the Slurm node name of {} (tried {}; {}): set it (free_gpus_slurm_node_name, "
                         "restore_gpus_slurm_node_name)".format(self.hostname, ", ".join(candidates), (err or "").strip() or "no node has that host name"))

    def update(self, name: str, *args: str) -> None:
        rc, out, err = self.run([self.scontrol, "update", "nodename=" + name] + list(args))
        if rc != 0:
            raise SlurmError("scontrol update nodename={} {} failed (rc {:d}): {}".format(name, " ".join(args), rc, (err or out).strip()))
