# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Where a holder outside every job, unit and container came from (issue 70, work that escaped its
job): an SSH session into the node, or a process that left its login (parent PID 1, a session of its
own: `setsid`, `nohup ... &`, an Apptainer instance, a rank whose torchrun agent is gone).
An Apptainer instance is named where root's starter is one of the holder's ancestors (_apptainer).

Only root's witnesses name it: the kernel's cgroup path `/user.slice/user-U.slice/session-N.scope`
(a place only logind has systemd make; a user's own manager makes its scopes below
`user@U.service`, which is the holder's unit then, never `session-N.scope`), systemd's word that
the unit's ControlGroup= is that directory (the look's _unit_owner), logind's record of session N
(/run/systemd/sessions/N, root's file that sd-login reads: its PAM service and remote host, which
sshd gave PAM), and the kernel's parent and
session ids. A process's name, command line and environment name nothing here: the environment's
torchrun variables are quoted as what it says of itself, a note and no more.

Loaded only for a look that found holders: a clean host reads nothing here.
"""

from __future__ import annotations

import os
import re
import stat
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _apptainer
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder


# logind's session ids: a number, or "c" and a number for sessions it made without a login (c1).
_SESSION_PATH = re.compile(r"^/user\.slice/user-(\d+)\.slice/session-(c?\d{1,10})\.scope$")
# The PAM services of an SSH login (sshd's PAM service is "sshd" on Debian, Ubuntu and RHEL).
SSH_SERVICES = frozenset(("sshd", "ssh"))
# logind's records of its sessions (root's files, read by sd-login), and the most read of one.
SESSIONS = "/run/systemd/sessions"
RECORD_MAX = 65536
_PLAIN = re.compile(r"^[A-Za-z0-9.:_@-]{1,255}$")
# What a rank of torch.distributed's elastic agent (torchrun) carries in its environment.
_RANK_KEYS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")


class Session(t.NamedTuple):
    """A login session as logind records it."""

    number: str
    uid: int
    user: str | None
    service: str | None
    remote_host: str | None


def session_of(holder: t.Mapping[str, t.Any]) -> tuple[int, str] | None:
    """(uid, session id) of a holder that the kernel places in a login session's scope and systemd
    confirms in it (its `unit` is that scope), else None; pure."""
    match = _SESSION_PATH.match(holder.get("cgroup") or "")
    if not match or holder.get("unit") != f"session-{match.group(2)}.scope":
        return None
    return int(match.group(1)), match.group(2)


def parse_session_file(text: str) -> dict[str, str]:
    """logind's record of a session (/run/systemd/sessions/N, KEY=VALUE lines) -> {key: value}; pure."""
    found = {}
    for line in text.split("\n"):
        key, sep, value = line.partition("=")
        if sep:
            found[key] = value
    return found


def sessions_dir(proc: str) -> str:
    """Where logind keeps its sessions' records beside `proc` (the node's: /run/systemd/sessions)."""
    return SESSIONS if proc == "/proc" else os.path.join(os.path.dirname(proc.rstrip("/")), SESSIONS.lstrip("/"))


def read_session(number: str, uid: int, directory: str = "/run/systemd/sessions") -> Session:
    """logind's record of session `number` (what sd_session_get_service(3) reads): only a file root
    owns and no one else may write, for the uid the kernel's path names; its service and host None
    otherwise."""
    props: dict[str, str] = {}
    try:
        handle = os.open(os.path.join(directory, number), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        handle = -1
    if handle >= 0:
        try:
            info = os.fstat(handle)
            if stat.S_ISREG(info.st_mode) and info.st_uid == 0 and not info.st_mode & 0o022:
                props = parse_session_file(os.read(handle, RECORD_MAX).decode("utf-8", "replace"))
        except OSError:
            props = {}
        finally:
            os.close(handle)
    if props.get("UID") != str(uid):
        return Session(number, uid, None, None, None)
    return Session(number, uid, plain(props.get("USER")), plain(props.get("SERVICE")), plain(props.get("REMOTE_HOST")))


def plain(value: str | None) -> str | None:
    """A user, PAM service or host name as it may stand in a message (letters, digits, `.:_@-`), else None."""
    return value if value and _PLAIN.match(value) else None


def stat_ids(data: bytes | None) -> tuple[int, int] | None:
    """(parent PID, session id) from the kernel's /proc/PID/stat; None when gone or unread; pure."""
    try:
        rest = (data or b"")[(data or b"").rindex(b")") + 2:].split()
        return int(rest[1]), int(rest[3])
    except (ValueError, IndexError):
        return None


def detached(pid: int, ids: tuple[int, int] | None) -> bool:
    """Whether a process left whatever started it: its parent is PID 1 (its starter ended or it
    daemonised) and it leads a session of its own (setsid)."""
    return ids is not None and ids[0] == 1 and ids[1] == pid


def user_words(uid: t.Any, name: str | None) -> str:
    """`user alice`, else `uid 4242` (a uid without a name)."""
    return f"user {name}" if name and str(name) != str(uid) else f"uid {uid}"


def rank_note(environ: t.Mapping[str, str]) -> str:
    """What a process's environment says of a torchrun rank (its own words, quoted as such), or ""."""
    if not all(environ.get(key) for key in _RANK_KEYS) or not (environ["RANK"] + environ["WORLD_SIZE"]).isdigit():
        return ""
    rank, world = int(environ["RANK"][:9]), int(environ["WORLD_SIZE"][:9])
    return f"; its environment says it is rank {rank} of {world} of a torchrun run (its agent is gone: a detached multi-node rank)"


def session_origin(session: Session, gone: bool) -> dict[str, t.Any]:
    """The origin of a holder in login session `session`; pure."""
    # The session's user (the kernel's path, logind's name), not the holder's: `su` inside one changes the latter.
    who = user_words(session.uid, session.user)
    if session.service in SSH_SERVICES:
        kind, text = "ssh_session", f"SSH session {session.number} of {who}" + (f" from {session.remote_host}" if session.remote_host else "")
    elif session.service:
        kind, text = "login_session", f"login session {session.number} ({session.service}) of {who}"
    else:
        kind, text = "login_session", f"login session {session.number} of {who}"
    if gone:
        text += ", detached from it (parent PID 1, a session of its own)"
    return {"kind": kind, "session": session.number, "text": text + ", outside any job",
            "stop": f"loginctl terminate-session {session.number}"}


def instance_origin(instance: _apptainer.Instance, session: Session | None) -> dict[str, t.Any]:
    """The origin of a holder in Apptainer instance `instance` (started in login session `session`,
    where the kernel places it in one); pure."""
    who = user_words(instance.uid, instance.user)
    where = ""
    if session is not None:
        where = f", started in {session_origin(session, False)['text'][:-len(', outside any job')]}"
    # The user's name as this node's passwd gives it (a uid without one reads as its number: none).
    user = plain(instance.user) if str(instance.user) != str(instance.uid) else None
    return {"kind": "apptainer_instance", "session": session.number if session is not None else None,
            "text": f"{instance.product} instance {instance.name} of {who} (the name is its user's word; its starter is pid {instance.pid:d}){where}, "
                    "outside any job",
            "stop": f"{instance.product.lower()} instance stop {instance.name}", "user": user}


def stop_words(origin: t.Mapping[str, t.Any]) -> str:
    """What follows an origin's text in a failure: `: `CMD` ends it` (as user U for an instance,
    with root's form), "" for a detached process (what the run itself would send); pure."""
    if origin.get("kind") == "detached" or not origin.get("stop"):
        return ""
    if origin.get("kind") != "apptainer_instance":
        return f": `{origin['stop']}` ends it"
    user = origin.get("user")
    if not user:
        return f": `{origin['stop']}` run as its user ends it"
    tool, _sub, name = str(origin["stop"]).partition(" instance stop ")
    return f": `{origin['stop']}` as user {user} (root: `{tool} instance stop -u {user} {name}`) ends it"


def detached_origin(holder: t.Mapping[str, t.Any], note: str) -> dict[str, t.Any]:
    """The origin of a holder in no unit, job, container or guest that left its starter; pure."""
    who = user_words(holder.get("uid"), holder.get("user"))
    return {"kind": "detached", "session": None, "text": f"a process of {who} started outside any job (parent PID 1, own session){note}",
            "stop": f"kill {holder['pid']:d}"}


def in_job_or_guest(holder: t.Mapping[str, t.Any], proc: str) -> bool:
    """Whether someone else already answers for the holder: a container, a system container, a Slurm
    job (its cgroup paths), or a unit of the host's systemd other than a login session."""
    if holder.get("container") or holder.get("guest"):
        return True
    if holder.get("unit") and not str(holder.get("unit")).startswith("session-"):
        return True
    return _jobs.job_of_cgroups(_holders.cgroup_paths(int(holder["pid"]), proc) or []) is not None


def annotate(holders: list[Holder], proc: str = "/proc", sessions: str | None = None) -> list[Holder]:
    """Each holder's `origin` ({kind, session, text, stop}: where it came from and what ends it), or
    None where a job, unit, container or guest answers for it, or nothing says where it came from.
    `sessions`: logind's records (default: beside `proc`)."""
    directory = sessions_dir(proc) if sessions is None else sessions
    # The kernel's parent and session ids, in one bounded pass (a process in execve does not answer).
    stats = _holders.read_stats([int(h["pid"]) for h in holders if not h.get("blocked")], proc)
    walks = _apptainer.Walks()
    for holder in holders:
        holder["origin"] = None
        # A protected process is never signalled: where it came from changes nothing.
        if holder.get("kernel_thread") or holder.get("protected") or holder.get("blocked") or in_job_or_guest(holder, proc):
            continue
        ids = stat_ids(stats.get(int(holder["pid"])))
        gone = detached(int(holder["pid"]), ids)
        found = session_of(holder)
        session = read_session(found[1], found[0], directory) if found is not None else None
        instance = _apptainer.instance_of(holder, proc, walks)
        if instance is not None:
            holder["origin"] = instance_origin(instance, session)
        elif session is not None:
            holder["origin"] = session_origin(session, gone)
        elif gone and not holder.get("unit"):
            holder["origin"] = detached_origin(holder, rank_note(_holders.environ_of(int(holder["pid"]), proc)))
    return holders
