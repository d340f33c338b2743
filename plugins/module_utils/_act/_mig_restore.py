# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""gpu_restore's MIG side (issue 71): the layout a release recorded (_look/_mig_layout, kind
`mig_layout`) against the node now, before anything is restored.

* The same slicing now (each GPU instance's profile and place, its compute instances'): nothing to
  do; the entry leaves the record.
* No instance now (a reboot: only MIG mode persists): with `recreate_mig_layout`, re-created with
  `nvidia-smi mig -i N -cgi PROFILES -C` (profiles in the order of their places, so that the
  driver's first-fit placement gives each its place back), then read again and compared; without
  it, refused.
* Other instances now: never touched (someone sliced the GPU since); refused.

A refusal stops the whole restore before anything is restored, and names the units and containers
the record restores whose configuration names a MIG UUID that no longer exists. After a
re-creation the MIG UUIDs are new (the driver makes new ones): each entry still naming a lost UUID
is not restored, and its reason names the UUID the instance at the same place has now.

Who else controls what is read here. A unit's configuration: its unit file, drop-ins and
EnvironmentFile= files are read only when root owns them and no one else may write them (an
unprivileged user's file, or a link to one, is never read: it is named as skipped); FIFOs and
devices are never opened for reading (O_NONBLOCK, then fstat). A container's device request: its
runtime's record (root's daemon). A system container's unit: the guest's root controls its files and
its systemd's answer, so the host reads none of its files; it asks the guest's systemd, confined as
the guest (_guest_reach), what the unit's Environment= and ExecStart= name; a lie there changes only
whether that guest's own unit starts. A guest whose systemd does not answer keeps its unit stopped,
with the command to check it there; its EnvironmentFile= paths are named with the command that shows
them, never read. A MIG change needs root (nvidia-smi refuses anyone else); it is
refused while any process holds the GPU's device files ("In use by another client": DCGM's
nv-hostengine, any NVML client), and the refusal names them from the holder scan."""

from __future__ import annotations

import glob
import os
import stat
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mig_layout

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act._restore import Restore
    from ansible_collections.zeromib.gpu.plugins.module_utils._record import Entry
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    Outcome = t.Tuple[t.List[str], t.Optional[str]]

KIND = _mig_layout.KIND
# Where systemd reads system units from, in its order of precedence (systemd.unit(5)).
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")
MAX_BYTES = 1 << 20
IN_USE = "In use by another client"
# What a guest's systemd is asked about one of its units (systemd.exec(5), systemd.service(5)).
GUEST_PROPS = ("Environment", "ExecStart", "ExecStartPre", "EnvironmentFiles")
# The most MIG UUIDs or files one message names (a guest's root chooses how many its answer names).
MAX_SAID = 8


class MigRefused(Exception):
    """The layout cannot be put back: the whole restore stops, nothing restored."""


# ---------------------------------------------------------------- a unit's configuration, root's only


def trusted_text(path: str) -> tuple[str | None, str | None]:
    """(text, None) of a root-owned regular file no one else may write; (None, why it was not read);
    (None, None) when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path}: {exc.strerror}"
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            return None, f"{path} is not a regular file: not read"
        if info.st_uid != 0 or info.st_mode & 0o022:
            return None, f"{path} is owned by uid {info.st_uid:d} or writable by others (mode {stat.S_IMODE(info.st_mode):o}): not read"
        return handle.read(MAX_BYTES).decode("utf-8", "replace"), None


def unit_paths(name: str, dirs: t.Sequence[str] = UNIT_DIRS) -> list[str]:
    """The unit's file (the first of `dirs` that has it; a template's for an instance) and every
    drop-in (`NAME.d/*.conf`) of every directory."""
    names = [name]
    if "@" in name:
        prefix, _at, rest = name.partition("@")
        names.append(prefix + "@" + rest[rest.rfind("."):])
    main = next((os.path.join(d, n) for n in names for d in dirs if os.path.lexists(os.path.join(d, n))), None)
    drop_ins = sorted({p for n in names for d in dirs for p in glob.glob(os.path.join(glob.escape(d), glob.escape(n) + ".d", "*.conf"))})
    return ([main] if main else []) + drop_ins


def environment_files(text: str) -> list[str]:
    """EnvironmentFile= paths of a unit's text (`-` prefix: optional)."""
    found = []
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key.strip() == "EnvironmentFile":
            found += [p.lstrip("-") for p in value.split() if p.lstrip("-").startswith("/")]
    return found


def unit_mig_uuids(name: str, dirs: t.Sequence[str] = UNIT_DIRS) -> tuple[set[str], list[str]]:
    """The MIG UUIDs a unit's root-owned configuration names, and the files skipped (and why)."""
    uuids: set[str] = set()
    skipped: list[str] = []
    paths = unit_paths(name, dirs)
    seen: set[str] = set()
    while paths:
        path = paths.pop(0)
        if path in seen:
            continue
        seen.add(path)
        text, why = trusted_text(path)
        if why:
            skipped.append(why)
        if text is None:
            continue
        uuids |= set(_mig_layout.MIG_UUID.findall(text))
        paths += environment_files(text)
    return uuids, skipped


def guest_unit_answer(text: str) -> tuple[set[str], list[str]]:
    """The MIG UUIDs of a guest's `systemctl show -p Environment -p ExecStart -p ExecStartPre -p
    EnvironmentFiles UNIT`, as its own systemd answers, and its EnvironmentFile= paths (the
    guest's files: never read from the host)."""
    uuids: set[str] = set()
    files: list[str] = []
    for line in text.splitlines():
        key, _sep, value = line.partition("=")
        if key == "EnvironmentFiles":
            files += [value.split(" (", 1)[0].strip()] if value.strip() else []
        elif key in GUEST_PROPS:
            uuids |= set(_mig_layout.MIG_UUID.findall(value))
    return uuids, files[:MAX_SAID]


def container_mig_uuids(record: t.Mapping[str, t.Any] | None) -> set[str]:
    """The MIG UUIDs a container's device request names (its runtime's record: _engines.record_of)."""
    return set(_mig_layout.MIG_UUID.findall(" ".join(str(d) for d in (record or {}).get("gpu_devices") or [])))


# ---------------------------------------------------------------- pure: the layout against the node


def verdict(entry: t.Mapping[str, t.Any], now: t.Mapping[str, t.Any] | None) -> str:
    """`same`, `gone` (no instance now) or `changed`."""
    now = now or {}
    if _mig_layout.shape(entry) == _mig_layout.shape(now):
        return "same"
    return "gone" if not now.get("gpu_instances") else "changed"


def create_args(entry: t.Mapping[str, t.Any]) -> list[str] | None:
    """`mig -i N -cgi P,P -C` that re-creates the layout, or None when -C (each GPU instance's one
    default compute instance) cannot give it back (several compute instances in one GPU instance)."""
    gis = sorted(entry.get("gpu_instances") or [], key=lambda gi: int(str(gi.get("placement", "0:0")).partition(":")[0]))
    per_gi: dict[t.Any, int] = {}
    for ci in entry.get("compute_instances") or []:
        per_gi[ci.get("gpu_instance")] = per_gi.get(ci.get("gpu_instance"), 0) + 1
    if not gis or any(per_gi.get(gi.get("id"), 0) != 1 for gi in gis):
        return None
    return ["mig", "-i", str(entry.get("index")), "-cgi", ",".join(str(gi.get("profile_id")) for gi in gis), "-C"]


def moved(entry: t.Mapping[str, t.Any], now: t.Mapping[str, t.Any] | None) -> dict[str, str]:
    """{old MIG UUID: the UUID of the device at the same position among its profile's now}."""
    by_profile: dict[str, list[str]] = {}
    for device in (now or {}).get("mig_devices") or []:
        by_profile.setdefault(device.get("profile"), []).append(device.get("uuid"))
    seen: dict[str, int] = {}
    mapping = {}
    for device in entry.get("mig_devices") or []:
        n = seen.get(device.get("profile"), 0)
        seen[device.get("profile")] = n + 1
        new = by_profile.get(device.get("profile")) or []
        if n < len(new) and new[n] != device.get("uuid"):
            mapping[device.get("uuid")] = new[n]
    return mapping


def blockers(holders: t.Iterable[Holder], index: t.Any) -> list[str]:
    """`nv-hostengine (pid 812, DCGM's host engine, an NVML client)`: who holds the GPU's files."""
    said = []
    for h in holders:
        if h.get("attribution") != "nvml_client" and index not in (h.get("gpu_indexes") or []):
            continue
        what = ["pid {}".format(h.get("pid"))]
        if os.path.basename(str(h.get("name") or "")) == "nv-hostengine":
            what.append("DCGM's host engine")
        what.append("an NVML client" if h.get("attribution") == "nvml_client" else f"using GPU {index}")
        if h.get("unit"):
            what.append("unit {}".format(h.get("unit")))
        said.append("{} ({})".format(h.get("name") or "?", ", ".join(what)))
    return said


# ---------------------------------------------------------------- the run


class MigCheck:
    """The MIG layouts of a restore's record against the node, before anything is restored: which
    entries are done (`outcomes`, by record key) and which MIG UUIDs exist now."""

    def __init__(self, restore: Restore, todo: t.Sequence[Entry]) -> None:
        self.restore = restore
        self.todo = list(todo)
        self.layouts = [e for e in todo if e.get("kind") == KIND]
        self.outcomes: dict[t.Any, Outcome] = {}
        self.present: set[str] = set()
        self.moves: dict[str, str] = {}
        # {record key: why} for the guests' units whose systemd did not answer what they name.
        self.unanswered: dict[t.Any, str] = {}

    def _read(self) -> dict[str, t.Any]:
        from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmiError  # pylint: disable=import-outside-toplevel
        try:
            smi = self.restore._smi()  # pylint: disable=protected-access
            listed = _mig_layout.parse_list(smi.run(["-L"]))
            indexes = [listed[str(e.get("uuid"))]["index"] for e in self.layouts if str(e.get("uuid")) in listed]
            layouts = _mig_layout.read(smi, indexes) if indexes else {}
        except NvidiaSmiError as exc:
            raise MigRefused(f"the record keeps a MIG layout, and the GPUs' layout could not be read to compare: {exc.msg}; nothing was restored") from exc
        for uuid, gpu in listed.items():
            self.present |= {d["uuid"] for d in gpu["mig_devices"]}
            layouts.setdefault(uuid, {"gpu_instances": [], "compute_instances": [], "mig_devices": gpu["mig_devices"], "index": gpu["index"]})
            layouts[uuid]["index"] = gpu["index"]
        return layouts

    def run(self) -> None:
        """Compare, re-create where asked, fill `outcomes`; raises MigRefused."""
        if not self.layouts:
            return
        now = self._read()
        refusals = []
        refused = []
        for entry in self.layouts:
            uuid = str(entry.get("uuid"))
            mine = now.get(uuid)
            name = "GPU {} ({})".format(mine.get("index") if mine else entry.get("index"), uuid)
            if mine is None:
                refusals.append(f"{name} is not on this node now")
                refused.append(entry)
                continue
            found = verdict(entry, mine)
            if found == "same":
                self.moves.update(moved(entry, mine))
                self.outcomes[_key(entry)] = ([], None)
                continue
            if found == "changed":
                then, now_said = _mig_layout.said(entry), _mig_layout.said(mine)
                refusals.append(f"{name}: its MIG layout changed since the release ({then} then, {now_said} now): instances are never destroyed or "
                                "created over others")
                refused.append(entry)
                continue
            problem = self._recreate(entry, dict(mine), name)
            if problem:
                refusals.append(problem)
                refused.append(entry)
        if refusals:
            raise MigRefused(self._refusal(refusals, refused))

    def _recreate(self, entry: Entry, mine: dict[str, t.Any], name: str) -> str | None:
        """Re-create one GPU's layout (opt-in); the refusal's sentence, or None."""
        gone = f"{name}: its MIG layout is gone ({_mig_layout.said(entry)} at the release, none now, as after a reboot)"
        if not self.restore.options.recreate_mig_layout:
            return gone + "; set recreate_mig_layout: true (role: restore_gpus_recreate_mig_layout) to re-create it"
        args = create_args(dict(entry, index=mine.get("index")))
        if args is None:
            return gone + "; it had several compute instances in one GPU instance, which this module does not re-create: create them by hand"
        if self.restore.check_mode:
            self.outcomes[_key(entry)] = (["re-create"], None)
            self.restore.result["recreated_mig_layouts"].append("GPU {} ({}): nvidia-smi {}".format(mine.get("index"), entry.get("uuid"), " ".join(args)))
            return None
        from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmiError  # pylint: disable=import-outside-toplevel
        smi = self.restore._smi()  # pylint: disable=protected-access
        try:
            smi.run(args)
        except NvidiaSmiError as exc:
            text = exc.stdout + exc.stderr
            if IN_USE in text:
                held = blockers(self.restore.look() if self.restore.look else _holders_now(self.restore), mine.get("index"))
                return "{}: nvidia-smi {} was refused ({}){}; stop it and run gpu_restore again".format(
                    name, " ".join(args), IN_USE, ": " + "; ".join(held) + " holds the GPU's device files" if held else
                    ": no holder of the GPU's device files was found")
            return "{}: nvidia-smi {} failed: {}".format(name, " ".join(args), exc.msg)
        after = _mig_layout.read(smi, [t.cast(int, mine.get("index"))]).get(str(entry.get("uuid"))) or {}
        if verdict(entry, after) != "same":
            return f"{name}: re-created, but the layout reads {_mig_layout.said(after)} (the release's: {_mig_layout.said(entry)})"
        self.present |= {d["uuid"] for d in after.get("mig_devices") or []}
        self.moves.update(moved(entry, after))
        self.outcomes[_key(entry)] = (["re-create"], None)
        self.restore.result["recreated_mig_layouts"].append("GPU {} ({}): nvidia-smi {}".format(mine.get("index"), entry.get("uuid"), " ".join(args)))
        return None

    def _pinned(self) -> list[tuple[Entry, list[str]]]:
        """The entries to restore whose configuration names a MIG UUID that does not exist now."""
        found = []
        for entry in self.todo:
            if entry.get("kind") == "unit":
                uuids, skipped = unit_mig_uuids(str(entry.get("name")))
                self.restore.result["warnings"].extend(f"{entry.get('name')}: {why}" for why in skipped)
            elif entry.get("kind") == "container":
                uuids = container_mig_uuids(self._container(entry))
            elif entry.get("kind") == "guest_unit":
                asked = self._guest_unit(entry)
                if asked is None:
                    continue
                uuids = asked
            else:
                continue
            lost = sorted(uuids - self.present)
            if lost:
                found.append((entry, lost[:MAX_SAID]))
        return found

    def _guest_unit(self, entry: Entry) -> set[str] | None:
        """The MIG UUIDs a guest's unit names, as the guest's own systemd answers, asked confined as
        the guest (the guest's root controls its unit files: the host never reads them). None where
        the guest's restore will say why it is not restored (not running, no systemd, not reachable);
        an answer that cannot be had is a refusal of that unit naming the command to run there."""
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _guest_units  # pylint: disable=import-outside-toplevel
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests  # pylint: disable=import-outside-toplevel
        unit, kind, name = str(entry.get("name")), entry.get("guest_kind") or "", str(entry.get("guest"))
        system = self.restore.system
        guests = [g for g in system.running_guests(kind, _glob_escape(name)) if g.get("name") == name]
        if not guests or guests[0].get("manager") != "systemd" or system.guest_refusal(guests[0]):
            return None
        guest = guests[0]
        show = ["show", "--no-pager"] + [a for p in GUEST_PROPS for a in ("-p", p)] + [unit]
        command = _guests.guest_command(guest, ["systemctl", "cat", unit], _guests.host_tools())
        rc, out, err = _guest_units.GuestNode(system, guest, self.restore.step_timeout).systemctl(show)
        if rc != 0:
            # The guest's own words (its systemctl's output) are not repeated: only the host's.
            why = "no answer within step_timeout" if rc == 124 else (err.strip()[:200] if rc == 126 else f"its systemctl exited {rc:d}")
            self.unanswered[_key(entry)] = (f"{_guests.label(guest)} did not say what its unit names ({why}): not started while a MIG layout "
                                            f"changed; check it with `{command}` and run gpu_restore again")
            return set()
        uuids, files = guest_unit_answer(out)
        self.restore.result["warnings"].extend(
            "{}: its EnvironmentFile {} is the guest's and is not read from the host; check the MIG UUIDs it names with `{}`".format(
                entry.get("entry") or unit, path, _guests.guest_command(guest, ["cat", path], _guests.host_tools())) for path in files)
        return uuids

    def _container(self, entry: Entry) -> t.Mapping[str, t.Any] | None:
        try:
            return t.cast("t.Mapping[str, t.Any]", self.restore.system.runtimes.inspect(entry.get("runtime"), entry.get("id")))
        except Exception:  # pylint: disable=broad-exception-caught  # a runtime that cannot be asked: its restore says why
            return None

    def _refusal(self, refusals: list[str], refused: list[Entry]) -> str:
        pinned = self._pinned()
        names = "; ".join("{} names {}".format(_label(e), ", ".join(lost)) for e, lost in pinned)
        if self.unanswered:
            refusals += list(self.unanswered.values())[:MAX_SAID]
        return "{}. {}Nothing was restored. To restore without the layout, drop it from the record: forget: [{}] (role: restore_gpus_forget)".format(
            ". ".join(refusals), f"These would not start, their MIG UUIDs no longer exist: {names}. " if names else "",
            ", ".join(str(e.get("name")) for e in refused))

    def still_pinned(self) -> dict[t.Any, str]:
        """After the layouts are back: {record key: why} for each entry naming a lost MIG UUID."""
        why = {}
        for entry, lost in self._pinned():
            new = [f"{u} (the instance at its place is now {self.moves[u]})" if u in self.moves else u for u in lost]
            why[_key(entry)] = "its configuration names MIG UUID {}, which no longer exists: point it at the UUID of `nvidia-smi -L` and run " \
                               "gpu_restore again".format(", ".join(new))
        why.update(self.unanswered)
        return why


def _key(entry: t.Mapping[str, t.Any]) -> tuple[t.Any, ...]:
    from ansible_collections.zeromib.gpu.plugins.module_utils import _record  # pylint: disable=import-outside-toplevel
    return _record.key(entry)


def _label(entry: t.Mapping[str, t.Any]) -> str:
    if entry.get("kind") == "guest_unit":
        return "guest unit " + str(entry.get("entry") or entry.get("name"))
    return ("container " if entry.get("kind") == "container" else "") + str(entry.get("name"))


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _holders_now(restore: Restore) -> list[Holder]:
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _restore  # pylint: disable=import-outside-toplevel
    return _restore.holders_now(restore._smi(), restore.system.proc)  # pylint: disable=protected-access


def check(restore: Restore, todo: t.Sequence[Entry]) -> MigCheck | None:
    """The MIG check of a restore (None when the record has no MIG layout: no call made)."""
    if not any(e.get("kind") == KIND for e in todo):
        return None
    found = MigCheck(restore, todo)
    found.run()
    return found
