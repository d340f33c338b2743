# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The record of what gpu_release changed on a node, for gpu_restore to put back.

`/var/lib/zeromib-gpu/released.json`, root-only (file 0600, a directory it creates 0700), written
atomically (a temporary file in the same directory, fsync, rename, fsync of the directory) under a
lock, so that a crash or two runs at once never leave half a record. Format (docs/docsite/rst/guide_restore.rst):

    {"format": 1, "updated_at": "...", "entries": [ENTRY, ...]}       # entries in release order
    unit:       {"kind": "unit", "name": "vllm.service", "actions": ["stopped", "disabled"],
                 "active": true, "active_state": "active", "unit_file_state": "enabled",
                 "gpu_indexes": [0, 1], "released_at": "2026-12-01T10:00:00Z"}
    container:  {"kind": "container", "name": "vllm", "id": "<64 hex>", "runtime": "docker",
                 "actions": ["stopped", "disabled"], "running": true, "restart_policy": "always",
                 "restart_max_retries": 0, "gpu_indexes": [0], "released_at": "..."}
    supervisor: {"kind": "supervisor", "name": "vllm", "actions": ["stopped"], "running": true,
                 "gpu_indexes": [0], "released_at": "..."}
    gpu_settings: {"kind": "gpu_settings", "name": "GPU-<uuid>", "index": 1, "pci_bus_id": "...",
                 "actions": ["compute_mode", "power_limit"], "before": {"compute_mode": "Exclusive_Process",
                 "power_limit": 350.0}, "gpu_indexes": [1], "released_at": "..."}
                (settings ready_fix put back to the training-ready profile; "before" gains the
                settings a later release changes, and keeps those of the first)
    guest_unit: {"kind": "guest_unit", "name": "vllm.service", "guest_kind": "lxc", "guest": "101",
                 "entry": "lxc:101:vllm.service", "actions": ["stopped"], "active": true, ...}
                (a system container's own unit, stopped through the guest's systemd: the unit
                keys, and which guest; a record without such entries reads as before)
    swarm_service: {"kind": "swarm_service", "name": "vllm", "actions": ["stopped"], "replicas": 2, "released_at": "..."}
                (a Docker Swarm service scaled to 0: gpu_restore scales it back to `replicas`; _act/_orchestrators)
    mig_layout: {"kind": "mig_layout", "name": "mig:GPU-<uuid>", "uuid": "GPU-<uuid>", "index": 0, "pci_bus_id": "...", "actions": ["layout"],
                 "gpu_instances": [{"profile": "3g.40gb", "profile_id": 9, "id": 1, "placement": "0:4"}, ...],
                 "compute_instances": [{"gpu_instance": 1, "profile": "3g.40gb", "profile_id": 2, "id": 0, "placement": "0:3"}, ...],
                 "mig_devices": [{"profile": "3g.40gb", "uuid": "MIG-..."}, ...], "gpu_indexes": [0], "released_at": "..."}
                (a selected GPU's MIG layout at the release, kept beside what the release changed: a reboot loses it;
                gpu_restore compares it with the node, _look/_mig_layout and _act/_mig_restore)
    every kind: "released_by": "alice" (the login user of the release's session), where known.

Each entry holds the state BEFORE the first release that changed it. A later release that finds
the thing already changed adds only the actions it took itself (merge): a unit stopped by one
release and disabled by the next is restored once, to the state before the first.

Pure functions except `read`, `write` and `locked`, which take the path."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    # One thing a release changed (the formats above), and the whole file.
    Entry = t.Dict[str, t.Any]
    Record = t.Dict[str, t.Any]

PATH = "/var/lib/zeromib-gpu/released.json"
FORMAT = 1
KINDS = ("unit", "container", "supervisor", "guest_unit", "gpu_settings", "swarm_service", "mig_layout")
# Actions in the order a release takes them; a restore undoes them in reverse. The last four are
# a GPU's settings put back to the training-ready profile (_act/_ready_settings.py, ready_fix); "layout":
# a GPU's MIG layout recorded (_look/_mig_layout.py: nothing changed on the GPU, kept for gpu_restore).
ACTIONS = ("stopped", "disabled", "masked", "compute_mode", "power_limit", "app_clocks", "clock_lock", "layout")


class RecordError(Exception):
    """The record cannot be read or written safely (named path, the reason, what to do)."""


def now_iso(clock: t.Callable[[], float] = time.time) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(clock()))


def key(entry: t.Mapping[str, t.Any]) -> tuple[t.Any, ...]:
    """What identifies one thing across releases: a unit by name, a container by runtime and id."""
    if entry.get("kind") == "container":
        return ("container", entry.get("runtime"), entry.get("id"))
    if entry.get("kind") == "guest_unit":
        return ("guest_unit", entry.get("guest_kind"), entry.get("guest"), entry.get("name"))
    return (entry.get("kind"), entry.get("name"))


def empty() -> Record:
    return {"format": FORMAT, "updated_at": None, "entries": []}


def merge(record: Record, new_entries: t.Iterable[Entry], at: str | None = None) -> Record:
    """The record after a release that made `new_entries` (state before it, actions it took).

    An entry already in the record keeps its state before (that of the first release) and gains
    the new actions; a new one is appended, so the entries stay in release order. Returns a new
    record; `record` is not changed."""
    merged: Record = {"format": FORMAT, "updated_at": at or record.get("updated_at"), "entries": [dict(e) for e in record.get("entries") or []]}
    by_key = {key(e): e for e in merged["entries"]}
    for entry in new_entries:
        if not entry.get("actions"):
            continue
        old = by_key.get(key(entry))
        if old is None:
            fresh = dict(entry)
            fresh["actions"] = [a for a in ACTIONS if a in entry["actions"]]
            merged["entries"].append(fresh)
            by_key[key(fresh)] = fresh
            continue
        old["actions"] = [a for a in ACTIONS if a in old.get("actions", []) or a in entry["actions"]]
        if "before" in entry:
            old["before"] = dict(entry["before"], **(old.get("before") or {}))
        old["gpu_indexes"] = sorted(set(old.get("gpu_indexes") or []) | set(entry.get("gpu_indexes") or []))
        old.setdefault("released_again_at", [])
        old["released_again_at"].append(entry.get("released_at"))
    return merged


def without(record: Record, restored_keys: t.Iterable[tuple[t.Any, ...]], at: str | None = None) -> Record:
    """The record without the entries restored."""
    gone = set(restored_keys)
    return {"format": FORMAT, "updated_at": at or record.get("updated_at"),
            "entries": [e for e in record.get("entries") or [] if key(e) not in gone]}


# ---------------------------------------------------------------- what a release changed


def _unit_state(props: t.Mapping[str, str]) -> tuple[bool, str]:
    """(active, ActiveState) of a unit before the release, from systemctl show's props."""
    active_state = props.get("ActiveState") or "unknown"
    return active_state in ("active", "activating", "reloading", "refreshing") or props.get("SubState") == "auto-restart", active_state


def _in_guest_unit(holder: Holder, kind: t.Any, guest: t.Any, unit: t.Any) -> bool:
    found: t.Mapping[str, t.Any] = holder.get("guest") or {}
    return (found.get("kind"), found.get("name"), found.get("unit")) == (kind, guest, unit)


def guest_unit_entries(result: t.Mapping[str, t.Any], before: t.Mapping[str, t.Mapping[str, t.Any]], holders: t.Iterable[Holder],
                       at: str | None) -> list[Entry]:
    """Entries for a guest's units a gpu_release result says it acted on (`stopped_guest_units`,
    ... as `lxc:101:vllm.service`). `before`: {that name: {guest_kind, guest, unit, props}}
    (_guest_units.before). As for the host's units, a unit that was not active and was only
    stopped changed nothing: no entry."""
    actions: dict[str, list[str]] = {}
    for key, action in (("stopped_guest_units", "stopped"), ("disabled_guest_units", "disabled"), ("masked_guest_units", "masked")):
        for name in result.get(key) or []:
            actions.setdefault(name, []).append(action)
    holders = list(holders)
    entries = []
    for name, taken in actions.items():
        known = before.get(name) or {}
        props = known.get("props") or {}
        active, active_state = _unit_state(props)
        taken = [a for a in taken if a != "stopped" or active]
        if not taken or not known:
            continue
        guest_kind, guest, unit = known.get("guest_kind"), known.get("guest"), known.get("unit")
        entries.append({
            "kind": "guest_unit", "name": unit, "guest_kind": guest_kind, "guest": guest, "entry": name,
            "actions": taken, "active": active, "active_state": active_state, "unit_file_state": props.get("UnitFileState") or "",
            "gpu_indexes": sorted({i for h in holders if _in_guest_unit(h, guest_kind, guest, unit) for i in h.get("gpu_indexes") or []}),
            "released_at": at,
        })
    return entries


def unit_entries(result: t.Mapping[str, t.Any], before: t.Mapping[str, t.Mapping[str, str]], holders: t.Iterable[Holder],
                 at: str | None) -> list[Entry]:
    """Entries for the units a gpu_release result says it acted on. `before`: {unit: systemctl
    show props} read when planning; `holders`: the look's holders (which GPUs each unit held).
    A unit that was not active and that the release only stopped changed nothing: no entry."""
    actions: dict[str, list[str]] = {}
    for name, action in (("stopped_units", "stopped"), ("disabled_units", "disabled"), ("masked_units", "masked")):
        for unit in result.get(name) or []:
            actions.setdefault(unit, []).append(action)
    entries = []
    for unit in list(actions):
        props = before.get(unit) or {}
        active, active_state = _unit_state(props)
        taken = [a for a in actions[unit] if a != "stopped" or active]
        if not taken:
            continue
        entries.append({
            "kind": "unit",
            "name": unit,
            "actions": taken,
            "active": active,
            "active_state": active_state,
            "unit_file_state": props.get("UnitFileState") or "",
            "gpu_indexes": sorted({i for h in holders if h.get("unit") == unit for i in h.get("gpu_indexes") or []}),
            "released_at": at,
        })
    return entries


def container_entries(result: t.Mapping[str, t.Any], at: str | None) -> list[Entry]:
    """Entries for the containers a gpu_release result stopped or disabled (restart policy `no`)."""
    entries: dict[str | None, Entry] = {}
    order = []
    for item in result.get("disabled_containers") or []:
        cid = item.get("id")
        entries[cid] = {
            "kind": "container", "name": item.get("name"), "id": cid, "runtime": item.get("runtime"), "image": item.get("image"),
            "actions": ["disabled"], "running": False,
            "restart_policy": item.get("restart_policy_before") or "no",
            "restart_max_retries": item.get("restart_max_retries") or 0,
            "gpu_indexes": list(item.get("gpu_indexes") or []), "released_at": at,
        }
        order.append(cid)
    for item in result.get("stopped_containers") or []:
        cid = item.get("id")
        entry = entries.get(cid)
        if entry is None:
            entry = entries[cid] = {
                "kind": "container", "name": item.get("name"), "id": cid, "runtime": item.get("runtime"), "image": item.get("image"),
                "actions": [], "running": True, "restart_policy": item.get("restart_policy") or "no",
                "restart_max_retries": item.get("restart_max_retries") or 0,
                "gpu_indexes": [], "released_at": at,
            }
            order.append(cid)
        entry["running"] = True
        entry["actions"] = ["stopped"] + [a for a in entry["actions"] if a != "stopped"]
        entry["gpu_indexes"] = sorted(set(entry["gpu_indexes"]) | set(item.get("gpu_indexes") or []))
    return [entries[cid] for cid in order]


def program_gpus(pid: t.Any, holders: t.Iterable[Holder]) -> list[int]:
    """The GPUs a supervisord program held at the release: its process (`pid`) and the holders
    descended from it through other holders (vLLM's EngineCore is the API server's child, its
    workers the EngineCore's)."""
    if not isinstance(pid, int):
        return []
    holders = list(holders)
    family = {pid}
    grown = True
    while grown:
        grown = False
        for h in holders:
            if h.get("pid") not in family and (h.get("ppid") in family):
                family.add(t.cast(int, h.get("pid")))
                grown = True
    return sorted({i for h in holders if h.get("pid") in family for i in h.get("gpu_indexes") or []})


def supervisor_entries(result: t.Mapping[str, t.Any], at: str | None, holders: t.Iterable[Holder] = ()) -> list[Entry]:
    """Entries for supervisord programs (`supervisor:<glob>` in services), from the result keys
    `stopped_programs` ({name, supervisor_pid, config, state_before}) and `disabled_programs`
    (the same, and file, section, autostart_before, autorestart_before, group_updated) of gpu_release's supervisor
    support (module_utils/_act/_supervisor.py), or plain names. The values before are kept for
    gpu_restore."""
    entries: dict[str | None, Entry] = {}
    for name, action in (("stopped_programs", "stopped"), ("disabled_programs", "disabled")):
        for item in result.get(name) or []:
            item = item if isinstance(item, dict) else {"name": item}
            fresh: Entry = {"kind": "supervisor", "name": item.get("name"), "actions": [], "running": action == "stopped", "released_at": at}
            entry = entries.setdefault(item.get("name"), fresh)
            for field in ("supervisor_pid", "config", "state_before", "file", "section", "autostart_before", "autorestart_before", "group_updated"):
                if field in item:
                    entry[field] = item[field]
            if action == "stopped":
                entry["running"] = True
                entry["gpu_indexes"] = program_gpus(item.get("pid"), holders)
            entry["actions"].append(action)
    return list(entries.values())


def release_entries(result: t.Mapping[str, t.Any], unit_before: t.Mapping[str, t.Mapping[str, str]], holders: t.Iterable[Holder],
                    at: str | None, by: str | None = None, guest_before: t.Mapping[str, t.Mapping[str, t.Any]] | None = None) -> list[Entry]:
    """Everything a gpu_release result changed, in the order it acted: containers, then units,
    then a guest's units, then supervisor programs. `by`: who ran the release (login_user), kept
    as `released_by` so that an audit can say which run stopped what (its time and its user).
    `guest_before`: the guest units' state before (guest_unit_entries)."""
    holders = list(holders)
    entries = (container_entries(result, at) + unit_entries(result, unit_before, holders, at)
               + guest_unit_entries(result, guest_before or {}, holders, at) + supervisor_entries(result, at, holders))
    if by:
        for entry in entries:
            entry["released_by"] = by
    return entries


def login_user(proc: str = "/proc") -> str | None:
    """The user who logged in to start this run (the kernel's audit login uid, which sudo and
    Ansible's become keep), by name; None when the session has none (a boot-time service)."""
    try:
        with open(f"{proc}/self/loginuid") as handle:
            uid = int(handle.read().strip())
    except (OSError, ValueError):
        return None
    if uid in (-1, 4294967295):
        return None
    try:
        import pwd  # pylint: disable=import-outside-toplevel

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid:d}"


# ---------------------------------------------------------------- the file


def _check_dir(path: str, create: bool) -> bool:
    """The record's directory: root's (or this user's), not a link, not writable by others."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        os.mkdir(path, 0o700)
        info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise RecordError(f"{path} is not a directory (a link or a file): the restore record is not written there")
    if info.st_uid not in (0, os.geteuid()) or info.st_mode & 0o022:
        raise RecordError(f"{path} is writable by others or not owned by root (mode {stat.S_IMODE(info.st_mode):o}, uid {info.st_uid:d}): "
                          "the restore record is not trusted there")
    return True


def read(path: str = PATH) -> Record:
    """The record at `path` (an empty one when there is none). Raises RecordError when it cannot
    be trusted or read: a link, a file others may write, bad JSON, an unknown format."""
    if not _check_dir(os.path.dirname(path), create=False):
        return empty()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return empty()
    except OSError as exc:
        raise RecordError(f"cannot open the restore record {path}: {exc}") from exc
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid not in (0, os.geteuid()) or info.st_mode & 0o022:
            raise RecordError(f"the restore record {path} is writable by others or not owned by root "
                              f"(mode {stat.S_IMODE(info.st_mode):o}, uid {info.st_uid:d}): not trusted")
        data = handle.read()
    try:
        record = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"the restore record {path} is not valid JSON ({exc}): move it away to start a new one") from exc
    return validated(record, path)


def unit_files_changed(path: str = PATH) -> set[str]:
    """The units whose files a release disabled or masked and no restore has put back yet, by the
    record at `path`; none where it cannot be read (a release then disables or masks as usual)."""
    try:
        record = read(path)
    except (RecordError, OSError):
        return set()
    return {str(e.get("name")) for e in record.get("entries") or []
            if e.get("kind") == "unit" and {"disabled", "masked"} & set(e.get("actions") or [])}


def validated(record: t.Any, path: str = PATH) -> Record:
    if not isinstance(record, dict) or not isinstance(record.get("entries"), list):
        raise RecordError(f"the restore record {path} has no list of entries: move it away to start a new one")
    if record.get("format") != FORMAT:
        raise RecordError("the restore record {} has format {!r}; this version of zeromib.gpu reads format {:d}".format(path, record.get("format"), FORMAT))
    for entry in record["entries"]:
        if not isinstance(entry, dict) or entry.get("kind") not in KINDS or not entry.get("name") and not entry.get("id"):
            raise RecordError(f"the restore record {path} has an entry it cannot read: {entry!r}")
    return t.cast("Record", record)


def write(record: Record, path: str = PATH) -> None:
    """Write `record` atomically (or remove the file when it has no entries)."""
    directory = os.path.dirname(path)
    _check_dir(directory, create=True)
    if not record.get("entries"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _commands.fsync_dir(directory)
        return
    data = (json.dumps(record, indent=1, sort_keys=True) + "\n").encode("utf-8")
    _commands.replace_file(path, data, durable=True)


@contextlib.contextmanager
def locked(path: str = PATH, create: bool = True) -> t.Iterator[None]:
    """Hold an exclusive lock on the record (its `.lock` file) for a read-change-write."""
    directory = os.path.dirname(path)
    if not _check_dir(directory, create=create):
        yield
        return
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def add(path: str, new_entries: t.Iterable[Entry], at: str | None = None) -> Record | None:
    """Merge a release's entries into the record at `path`; returns the record written (None
    when the release changed nothing, and then nothing is written)."""
    new_entries = [e for e in new_entries if e.get("actions")]
    if not new_entries:
        return None
    with locked(path):
        record = merge(read(path), new_entries, at or now_iso())
        write(record, path)
    return record


# ---------------------------------------------------------------- reading it for people


def describe(entry: t.Mapping[str, t.Any]) -> str:
    """`vllm.service stopped, disabled by zeromib at 2026-12-01T10:00:00Z`."""
    what = {"unit": "", "container": "container ", "supervisor": "supervisor program ", "guest_unit": "guest unit ",
            "gpu_settings": "settings of GPU {} ".format(entry.get("index"))}.get(entry.get("kind") or "", "")
    if entry.get("kind") == "mig_layout":
        at = entry.get("released_at") or "an unknown time"
        return "MIG layout of GPU {} ({}) recorded by zeromib at {}".format(entry.get("index"), entry.get("uuid"), at)
    name = (entry.get("entry") if entry.get("kind") == "guest_unit" else None) or entry.get("name") or (entry.get("id") or "")[:12]
    return "{}{} {} by zeromib at {}".format(what, name, ", ".join(entry.get("actions") or []), entry.get("released_at") or "an unknown time")


def pending(path: str = PATH) -> dict[str, t.Any] | None:
    """What gpu_facts reports: {path, entries, summary} of a record waiting for gpu_restore,
    None when there is none, or {path, error} when it cannot be read."""
    try:
        record = read(path)
    except PermissionError:
        return {"path": path, "error": f"{path} is readable by root only (uid {os.geteuid():d}): run with become to see it",
                "entries": [], "summary": []}
    except (RecordError, OSError) as exc:
        return {"path": path, "error": str(exc), "entries": [], "summary": []}
    if not record["entries"]:
        return None
    return {"path": path, "updated_at": record.get("updated_at"), "entries": record["entries"],
            "summary": [describe(e) for e in record["entries"]], "error": None}
