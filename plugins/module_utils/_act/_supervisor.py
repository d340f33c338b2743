# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""supervisord programs named in `services` as `supervisor:<program glob>`.

A program of supervisord with `autorestart=true` comes back within about a second when its
process is killed from outside, so it is stopped through supervisord (`supervisorctl stop`),
like a unit through systemd. With service_state `disabled` (or `masked`: supervisord has no
mask) its section in supervisord's configuration gets `autostart=false` and `autorestart=false`:
the file is what a restart of supervisord, or a reboot, reads again, so the program stays stopped
across both. The running supervisord is not made to re-read it: `supervisorctl update GROUP`
removes and re-adds the whole group, which stops and starts every other program in it (an
exporter beside the trainer), and a stopped program is never restarted by supervisord anyway
(autorestart acts on an exit, autostart on a start of supervisord). Stopping or disabling one
program never stops, starts or re-adds another.

A program with `numprocs` > 1 runs several copies (`trainer:trainer_0`, `trainer:trainer_1`)
from one section, so its autostart and autorestart are those of every copy: one copy is never
disabled by rewriting that section. Disabling some copies but not all refuses before anything is
done (naming the program stops and disables every copy; stopping one copy stops that copy only),
and a program named whole whose copies hold selected GPUs and GPUs outside the selection is a
spanning program (spanning_copies), refused like a spanning unit unless kill_spanning says so.
Which status name comes from which section is worked out as supervisord does it (its `[group:]`
sections, `numprocs`, `numprocs_start`, `process_name`), from the files of its configuration that
only root can write, and by the names supervisord itself lists: copies of one group that no
section names otherwise are copies of the group's program.

Only supervisord processes of root (real uid 0) are acted on, through their own configuration
(`-c FILE` of their command line): a user's supervisord and its files are the user's to change,
and root never edits a file a user controls, nor lets one decide which section a name comes from. Every supervisorctl call is bounded in time: a stop
that outlasts kill_timeout is left to supervisord (it has been asked: it will not restart the
program) and the holders that remain are signalled as usual."""

from __future__ import annotations

import configparser
import fnmatch
import glob
import os
import platform
import re
import shlex
import stat
import subprocess
import tempfile
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed

if t.TYPE_CHECKING:
    Run = t.Callable[[t.List[str], float], t.Tuple[t.Optional[int], str]]
    Which = t.Callable[[str, t.Optional[str]], t.Optional[str]]

    class ProgramPlan(t.TypedDict):
        """plan(): programs to stop and to disable (entries: {name, supervisor_pid, config,
        state_before, pid, _supervisor, _section, _copies}), the globs that matched none, and the
        plan's warnings."""

        stop: list[dict[str, t.Any]]
        disable: list[dict[str, t.Any]]
        not_found: list[str]
        warnings: list[str]

    class ProgramsDone(t.TypedDict):
        """What act() did, under the release result's keys (Release folds it in)."""

        stopped_programs: list[dict[str, t.Any]]
        disabled_programs: list[dict[str, t.Any]]
        warnings: list[str]

SERVICE_PREFIX = _services.SUPERVISOR
BIN_DIRS = ("/usr/bin", "/usr/local/bin", "/bin")
# Where supervisord looks for its configuration when none is given (supervisor's options.py).
DEFAULT_CONFIGS = ("/etc/supervisord.conf", "/etc/supervisor/supervisord.conf")
RUNNING_STATES = ("RUNNING", "STARTING", "BACKOFF")
# supervisorctl's own start-up and its round trips to supervisord, beyond the stop itself.
CALL_MARGIN_S = 5.0
MARK = "; set by zeromib.gpu gpu_release (service_state=disabled)"
_SECTION = re.compile(r"^\s*\[([^\]]+)\]\s*(?:[;#].*)?$")
_OPTION = re.compile(r"^(\s*)(autostart|autorestart)\s*[=:]\s*([^;#\s]*)", re.IGNORECASE)
# numprocs beyond this is no configuration supervisord would start: the names are not worked out.
MAX_NUMPROCS = 10000
# Sections that make processes, and may have numprocs (supervisor's options.py).
PROCESS_SECTIONS = ("program", "fcgi-program", "eventlistener")
_STATUS = re.compile(r"^(\S+)\s+(STOPPED|STARTING|RUNNING|BACKOFF|STOPPING|EXITED|FATAL|UNKNOWN)\b(.*)$")


def config_of(cmdline_args: list[str]) -> str | None:
    """The configuration file of a supervisord command line (`-c F`, `-cF`, `--configuration[=] F`), or None."""
    for position, arg in enumerate(cmdline_args):
        if arg in ("-c", "--configuration") and position + 1 < len(cmdline_args):
            return cmdline_args[position + 1]
        if arg.startswith("--configuration="):
            return arg.split("=", 1)[1]
        if arg.startswith("-c") and len(arg) > 2 and not arg.startswith("--"):
            return arg[2:]
    return None


def parse_status(text: str) -> list[dict[str, t.Any]]:
    """`supervisorctl status` -> [{name, state, pid}] (pid None unless RUNNING)."""
    programs = []
    for line in text.splitlines():
        match = _STATUS.match(line.strip())
        if not match:
            continue
        pid = re.search(r"\bpid (\d+)", match.group(3))
        programs.append({"name": match.group(1), "state": match.group(2), "pid": int(pid.group(1)) if pid else None})
    return programs


def program_matches(name: str, pattern: str) -> bool:
    """A status name (`prog`, `group:prog`, `prog:prog_00`) against a program glob."""
    parts = [name] + name.split(":")
    return any(fnmatch.fnmatchcase(part, pattern) for part in parts)


def section_names(name: str) -> list[str]:
    """The `[program:X]` sections that may define a status name, most likely first."""
    group, _sep, process = name.partition(":")
    candidates = [process, group] if process else [group]
    return [f"program:{c}" for c in candidates if c]


def include_globs(text: str, config_dir: str) -> list[str]:
    """`[include] files = a/*.conf /etc/b.conf` of a configuration -> absolute globs."""
    section, globs = None, []
    for line in text.splitlines():
        header = _SECTION.match(line)
        if header:
            section = header.group(1).strip()
            continue
        if section == "include":
            key, sep, value = line.partition("=")
            if sep and key.strip() == "files":
                for item in shlex.split(value.split(" ;")[0]):
                    globs.append(item if os.path.isabs(item) else os.path.join(config_dir, item))
    return globs


def namespec(group: str, process: str) -> str:
    """The name supervisorctl prints for a process of a group (supervisor's make_namespec)."""
    return process if group == process else f"{group}:{process}"


def read_sections(files: t.Iterable[tuple[str, str]]) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """[(path, text)] in supervisord's reading order -> ({section: {option: raw value}}, {section:
    the file that defines it first}), parsed as supervisord parses them (`;` and `#` start
    inline comments; a section seen again adds to the first). A file that does not parse is
    left out: its sections are not known."""
    sections: dict[str, dict[str, str]] = {}
    where: dict[str, str] = {}
    for path, text in files:
        parser = configparser.RawConfigParser(inline_comment_prefixes=(";", "#"), strict=False)
        try:
            parser.read_string(text, source=path)
        except configparser.Error:
            continue
        for section in parser.sections():
            sections.setdefault(section.strip(), {}).update(parser.items(section))
            where.setdefault(section.strip(), path)
    return sections, where


def copy_names(program: str, group: str, values: t.Mapping[str, str], here: str, node: str) -> list[str]:
    """The process names supervisord makes of one program section's values (numprocs, numprocs_start,
    process_name expanded as its options.py does), or [] when they cannot be worked out here
    (an %(ENV_X)s of supervisord's environment, a value that is no number). The section's values,
    as supervisord's documentation names them ("[program:x] Section Values"): no module option."""
    try:
        numprocs = int(values.get("numprocs", "1"))
        start = int(values.get("numprocs_start", "0"))
    except ValueError:
        return []
    if not 0 < numprocs <= MAX_NUMPROCS:
        return []
    template = values.get("process_name", "%(program_name)s")
    names = []
    for number in range(start, start + numprocs):
        expansions = {"program_name": program, "group_name": group, "host_node_name": node, "here": here,
                      "process_num": number, "numprocs": numprocs}
        try:
            names.append(str(template % expansions).strip())
        except (KeyError, ValueError, TypeError):
            return []
    return names


def names_by_section(sections: t.Mapping[str, t.Mapping[str, str]], where: t.Mapping[str, str], node: str) -> dict[str, str]:
    """{status name: the section it comes from}: a program listed in a `[group:G]` runs in group
    G, any other in a group of its own name (supervisor's process_groups_from_parser)."""
    group_of: dict[str, str] = {}
    for section, values in sections.items():
        kind, _sep, group = section.partition(":")
        if kind != "group" or not group.strip():
            continue
        for program in [p.strip() for p in (values.get("programs") or "").split(",") if p.strip()]:
            found = next((f"{k}:{program}" for k in ("program", "fcgi-program") if f"{k}:{program}" in sections), None)
            if found:
                group_of.setdefault(found, group.strip())
    names: dict[str, str] = {}
    for section, values in sections.items():
        kind, _sep, program = section.partition(":")
        if kind not in PROCESS_SECTIONS or not program.strip():
            continue
        group = group_of.get(section, program.strip())
        here = os.path.dirname(os.path.abspath(where.get(section) or "/"))
        for process in copy_names(program.strip(), group, values, here, node):
            names.setdefault(namespec(group, process), section)
    return names


def sections_of(listed: t.Iterable[str], sections: t.Collection[str], names: t.Mapping[str, str]) -> dict[str, str | None]:
    """{status name: its section, None when unknown}: as worked out from the configuration
    (`names`), else the `[program:NAME]` or `[program:GROUP]` that exists (a group of copies
    whose process_name this cannot expand; a name supervisord runs from a section edited since
    it read it)."""
    found: dict[str, str | None] = {}
    for name in listed:
        found[name] = names.get(name) or next((s for s in section_names(name) if s in sections), None)
    return found


def copies_of(name: str, found: t.Mapping[str, str | None]) -> list[str]:
    """The status names that share NAME's section (NAME included), in supervisord's order."""
    section = found.get(name)
    if section is None:
        return [name]
    return [other for other, its in found.items() if its == section]


def partial_disables(entries: t.Sequence[t.Mapping[str, t.Any]]) -> list[str]:
    """Why disabling these entries would disable copies that were not named: for each section
    shared by several copies of which some, not all, are among `entries`, what the user asked
    and what to ask instead. [] when nothing is refused."""
    named: dict[tuple[int, str], list[str]] = {}
    copies: dict[tuple[int, str], list[str]] = {}
    whole: dict[tuple[int, str], list[str]] = {}
    for entry in entries:
        if entry.get("_section") and len(entry.get("_copies") or []) > 1:
            key = (entry["supervisor_pid"], entry["_section"])
            named.setdefault(key, []).append(entry["name"])
            copies[key] = list(entry["_copies"])
            whole[key] = list(entry.get("_whole") or entry["_copies"])
    reasons = []
    for key, names in named.items():
        left = [c for c in copies[key] if c not in names]
        if not left:
            continue
        section, all_copies = key[1], copies[key]
        reasons.append(
            "{} {} of the {} copies of [{}] (numprocs), whose autostart and autorestart hold for every copy: disabling {} would also keep {}, "
            "not named, stopped from supervisord's next start. Name the program to stop and disable every copy (services: [{}]; refused "
            "when a copy holds a GPU outside the selection), or set service_state: stopped to stop {} only".format(
                ", ".join(SERVICE_PREFIX + n for n in names), "is one" if len(names) == 1 else f"are {len(names)}", len(all_copies), section,
                "it" if len(names) == 1 else "them", ", ".join(left), ", ".join(SERVICE_PREFIX + p for p in whole[key]),
                "it" if len(names) == 1 else "them"))
    return reasons


def whole_program(copies: t.Sequence[str], listed: t.Iterable[str]) -> list[str]:
    """Globs that name every copy and nothing else: `GROUP:*` when the copies are all its group
    holds (a [program:X] with numprocs runs in group X), else each copy."""
    groups = {c.partition(":")[0] for c in copies}
    if len(groups) == 1 and all(":" in c for c in copies):
        group = groups.pop()
        if all(n in copies for n in listed if n.partition(":")[0] == group):
            return [f"{group}:*"]
    return list(copies)


def with_options_off(text: str, section: str) -> tuple[str, dict[str, str | None]] | None:
    """`text` with autostart and autorestart false in `section` -> (new text, {option: value
    before or None}); None when the section is not there."""
    lines = text.splitlines(True)
    start = None
    for number, line in enumerate(lines):
        header = _SECTION.match(line)
        if header and header.group(1).strip() == section:
            start = number
            break
    if start is None:
        return None
    end = len(lines)
    for number in range(start + 1, len(lines)):
        if _SECTION.match(lines[number]):
            end = number
            break
    before: dict[str, str | None] = {"autostart": None, "autorestart": None}
    body = []
    for line in lines[start + 1:end]:
        match = _OPTION.match(line)
        if match:
            option = match.group(2).lower()
            before[option] = match.group(3)
            body.append(f"{match.group(1)}{option}=false {MARK}\n")
        else:
            body.append(line)
    added = [f"{option}=false {MARK}\n" for option in ("autostart", "autorestart") if before[option] is None]
    heading = lines[start] if lines[start].endswith("\n") else lines[start] + "\n"
    return "".join(lines[:start] + [heading] + added + body + lines[end:]), before


def is_off(value: str | None) -> bool:
    return value is not None and value.strip().lower() == "false"


def write_atomically(path: str, text: str) -> None:
    """Replace a root-owned file by a new one with the same mode, never through a link."""
    info = os.lstat(path)
    handle, tmp = tempfile.mkstemp(prefix=".zeromib-", dir=os.path.dirname(path))
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.chmod(tmp, stat.S_IMODE(info.st_mode))
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _which(name: str, near: str | None = None) -> str | None:
    """supervisorctl in PATH, BIN_DIRS, then next to supervisord (`near`)."""
    return _commands.which(name, dirs=BIN_DIRS + ((near,) if near else ()))


def _run(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """(rc, output) of a bounded command; rc None when it was killed at `timeout`."""
    try:
        process = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=_commands.c_locale_env(), timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        return None, (exc.output or b"").decode("utf-8", "replace")
    except OSError as exc:
        return 127, str(exc)
    return process.returncode, process.stdout.decode("utf-8", "replace")


class Supervisor:
    """One running supervisord of root: its pid, configuration and supervisorctl."""

    def __init__(self, pid: int, config: str | None, ctl: str | None, run: Run = _run) -> None:
        self.pid = pid
        self.config = config
        self.ctl = ctl
        self.run = run

    def call(self, args: list[str], timeout: float) -> tuple[int | None, str]:
        argv = [self.ctl or "supervisorctl"] + (["-c", self.config] if self.config else []) + list(args)
        return self.run(argv, timeout)

    def status(self, timeout: float = 10.0) -> list[dict[str, t.Any]]:
        rc, out = self.call(["status"], timeout)
        programs = parse_status(out)
        # supervisorctl status exits 3 when some program is not running: the listing decides.
        if not programs and rc not in (0, 3):
            raise StepFailed(f"supervisorctl status (supervisord pid {self.pid}) failed (rc {rc}): {out.strip()[:300]}")
        return programs

    def configuration(self) -> list[tuple[str, str, bool]]:
        """(path, text, whether only root can write it) of each readable file of config_files(),
        in the order supervisord reads them."""
        files = []
        for path in self.config_files():
            real = os.path.realpath(path)
            try:
                with open(real) as handle:
                    info = os.fstat(handle.fileno())
                    text = handle.read()
            except (OSError, UnicodeDecodeError):
                continue
            files.append((real, text, root_only(info)))
        return files

    def config_files(self) -> list[str]:
        """The main configuration and its includes, in the order supervisord reads them."""
        main = self.config or next((path for path in DEFAULT_CONFIGS if os.path.exists(path)), None)
        if not main:
            return []
        files = [main]
        try:
            with open(main) as handle:
                globs = include_globs(handle.read(), os.path.dirname(main))
        except OSError:
            return files
        for pattern in globs:
            files.extend(sorted(glob.glob(pattern)))
        return files


def root_only(info: os.stat_result) -> bool:
    """A file root owns that no group or other may write: one a user cannot have changed."""
    return info.st_uid == 0 and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class Layout:
    """Which section each program of one supervisord comes from, from the files of its
    configuration that only root can write (`untrusted`: {section: file} of the others)."""

    def __init__(self, listed: list[str], files: t.Sequence[tuple[str, str, bool]], node: str) -> None:
        sections, where = read_sections((path, text) for path, text, trusted in files if trusted)
        self.listed = listed
        self.where = where
        self.files = [path for path, _text, _trusted in files]
        self.section = sections_of(listed, sections, names_by_section(sections, where, node))
        _other, self.untrusted = read_sections((path, text) for path, text, trusted in files if not trusted)

    def fields(self, name: str) -> dict[str, t.Any]:
        """The private fields of a plan entry: _section, _copies (the names sharing it), _whole
        (the globs that name every copy)."""
        copies = copies_of(name, self.section)
        return {"_section": self.section.get(name), "_copies": copies, "_whole": whole_program(copies, self.listed)}

    def unknown(self, name: str) -> str:
        """Why NAME's section is not known, for a refusal."""
        for section in section_names(name):
            if section in self.untrusted:
                return f"its [{section}] is in {self.untrusted[section]}, not a file only root can write: not editing it"
        if not self.files:
            return "no file of supervisord's configuration could be read to find its [program:...] section"
        return "no [program:...] section for it in {}".format(", ".join(self.files))


SUPERVISORD = _protect.ProcessNames("supervisord", scripts=True)


def find_supervisors(proc: str = "/proc", which: Which = _which, run: Run = _run) -> list[Supervisor]:
    """Running supervisord processes of root (not their children: supervisord forks once)."""
    found = []
    for pid in holders_mod.list_pids(proc):
        record = holders_mod.read_process(pid, proc)
        if record is None or record.get("state") in ("Z", "X"):
            continue
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as handle:
                args = [a.decode("utf-8", "replace") for a in handle.read().split(b"\0") if a]
        except OSError:
            continue
        # Root's own supervisord only, through the identity rule: root acts on its config and
        # runs supervisorctl against it; a user's process named supervisord is nothing to it.
        if not SUPERVISORD.of(record) or _real_uid(pid, proc) != 0:
            continue
        script = next((a for a in args[:2] if os.path.basename(a) == "supervisord"), None)
        ctl = which("supervisorctl", os.path.dirname(script) if script and os.path.isabs(script) else None)
        found.append(Supervisor(pid, config_of(args[1:]), ctl, run))
    # A daemonizing supervisord forks: keep the one whose parent is not a supervisord.
    pids = {s.pid for s in found}
    return [s for s in found if _ppid(s.pid, proc) not in pids]


def _real_uid(pid: int, proc: str) -> int | None:
    try:
        uids = holders_mod.status_ints(holders_mod.read_status(pid, proc), "Uid")
    except OSError:
        return None
    return uids[0] if uids else None


def _ppid(pid: int, proc: str) -> int | None:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as handle:
            return holders_mod.parse_stat(handle.read())[2]
    except (OSError, ValueError, IndexError):
        return None


def _listed(supervisors: list[Supervisor], warnings: list[str]) -> list[tuple[Supervisor, dict[str, t.Any]]]:
    """(supervisord, program) of every supervisord that has a supervisorctl."""
    listed: list[tuple[Supervisor, dict[str, t.Any]]] = []
    for supervisor in supervisors:
        if not supervisor.ctl:
            warnings.append(f"supervisord pid {supervisor.pid} runs, but no supervisorctl was found to stop its programs")
            continue
        try:
            programs = supervisor.status()
        except StepFailed as exc:
            raise StepFailed(exc.msg, {"warnings": warnings}) from exc
        listed.extend((supervisor, program) for program in programs)
    return listed


def plan(patterns: list[str], service_state: str | None, supervisors: list[Supervisor], node: str | None = None) -> ProgramPlan:
    """{stop: [entry], disable: [entry], not_found: [supervisor:<glob>], warnings} for the named
    programs. An entry: {name, supervisor_pid, config, state_before, pid}, and the private
    _supervisor, _section, _copies, _whole. Raises StepFailed before anything is done when a
    program to disable has no section root alone can write, or shares it with copies not named
    (numprocs)."""
    steps: ProgramPlan = {"stop": [], "disable": [], "not_found": [], "warnings": []}
    if not patterns:
        return steps
    listed = _listed(supervisors, steps["warnings"])
    layouts: dict[int, Layout] = {}
    for pattern in patterns:
        matched = [(s, p) for s, p in listed if program_matches(p["name"], pattern)]
        if not matched:
            steps["not_found"].append(SERVICE_PREFIX + pattern)
        for supervisor, program in matched:
            if any(e["name"] == program["name"] and e["supervisor_pid"] == supervisor.pid for e in steps["stop"] + steps["disable"]):
                continue
            if supervisor.pid not in layouts:
                layouts[supervisor.pid] = Layout([p["name"] for s, p in listed if s is supervisor], supervisor.configuration(),
                                                 node if node is not None else platform.node())
            # pid: the program's process now, so that the release record can say which GPUs it held (wait_for_gpus).
            entry = dict({"name": program["name"], "supervisor_pid": supervisor.pid, "config": supervisor.config,
                          "state_before": program["state"], "pid": program.get("pid"), "_supervisor": supervisor},
                         **layouts[supervisor.pid].fields(program["name"]))
            if program["state"] in RUNNING_STATES:
                steps["stop"].append(entry)
            if service_state in ("disabled", "masked"):
                steps["disable"].append(dict(entry))
    refusals = ["supervisor:{}: {}".format(e["name"], layouts[e["supervisor_pid"]].unknown(e["name"])) for e in steps["disable"] if not e["_section"]]
    refusals += partial_disables(steps["disable"])
    if refusals:
        raise StepFailed("not disabling: {}. Nothing was stopped or changed".format("; ".join(refusals)), {"warnings": steps["warnings"]})
    return steps


def spanning_copies(steps: ProgramPlan, holders: t.Sequence[t.Mapping[str, t.Any]], selected: t.Collection[int],
                    ancestry: t.Callable[[int], t.Sequence[int]]) -> list[dict[str, t.Any]]:
    """Copies of one program (numprocs) that the plan stops or disables together, when together
    they hold a selected GPU and a GPU outside the selection: each copy that holds an outside GPU,
    as {program, section, pids, gpu_indexes, outside_gpus}. Named whole, a program is every copy;
    freeing some GPUs must not end the copies that work on the others unless kill_spanning says
    so. `ancestry(pid)`: the pid and its parents (a copy's GPU processes are it or below it)."""
    together: dict[tuple[int, str], dict[str, t.Mapping[str, t.Any]]] = {}
    for entry in steps["stop"] + steps["disable"]:
        if entry.get("_section") and len(entry.get("_copies") or []) > 1:
            together.setdefault((entry["supervisor_pid"], entry["_section"]), {}).setdefault(entry["name"], entry)
    found: list[dict[str, t.Any]] = []
    lines: dict[int, t.Sequence[int]] = {}
    for (_pid, section), copies in together.items():
        if len(copies) < 2:
            continue
        for h in holders:
            if h["pid"] not in lines:
                lines[h["pid"]] = ancestry(h["pid"])
        held = {name: [h for h in holders if e.get("pid") and e["pid"] in lines[h["pid"]]] for name, e in copies.items()}
        used = {g for family in held.values() for h in family for g in h.get("gpu_indexes") or []}
        if not used & set(selected) or not used - set(selected):
            continue
        for name, family in held.items():
            gpus = sorted({g for h in family for g in h.get("gpu_indexes") or []})
            outside = [g for g in gpus if g not in selected]
            if outside:
                found.append({"program": name, "section": section, "pids": sorted(h["pid"] for h in family), "gpu_indexes": gpus,
                              "outside_gpus": outside})
    return found


def public(entry: dict[str, t.Any]) -> dict[str, t.Any]:
    return {k: v for k, v in entry.items() if not k.startswith("_")}


def disable(entry: dict[str, t.Any]) -> dict[str, t.Any] | None:
    """autostart/autorestart false in the program's section (the plan's _section) -> the file
    changed, the section and the values before, or None when both already read false. Raises
    StepFailed naming the file when the section is not found or the file is not root's."""
    supervisor = entry["_supervisor"]
    candidates = [entry["_section"]] if entry.get("_section") else section_names(entry["name"])
    for path in supervisor.config_files():
        real = os.path.realpath(path)
        try:
            with open(real) as handle:
                text = handle.read()
        except OSError:
            continue
        for section in candidates:
            changed = with_options_off(text, section)
            if changed is None:
                continue
            new_text, before = changed
            if is_off(before["autostart"]) and is_off(before["autorestart"]):
                return None
            if not root_only(os.stat(real)):
                raise StepFailed("supervisor:{}: not editing {}: it is not a file only root can write".format(entry["name"], real))
            write_atomically(real, new_text)
            return {"file": real, "section": section, "autostart_before": before["autostart"], "autorestart_before": before["autorestart"]}
    where = ", ".join(supervisor.config_files()) or "supervisord's configuration"
    raise StepFailed("supervisor:{}: no [{}] section for it in {}".format(entry["name"], candidates[0] if candidates else "program:...", where))


def _stop(steps: ProgramPlan, kill_timeout: float | None, done: ProgramsDone) -> None:
    """One bounded supervisorctl stop per supervisord."""
    by_supervisor: dict[int, tuple[Supervisor, list[dict[str, t.Any]]]] = {}
    for entry in steps["stop"]:
        by_supervisor.setdefault(entry["_supervisor"].pid, (entry["_supervisor"], []))[1].append(entry)
    for supervisor, entries in by_supervisor.values():
        rc, out = supervisor.call(["stop"] + [e["name"] for e in entries], float(kill_timeout or 0) + CALL_MARGIN_S)
        done["stopped_programs"].extend(public(e) for e in entries)
        if rc is None:
            done["warnings"].append(
                "supervisorctl stop {} did not finish within {:.0f} s: supervisord keeps stopping it (it will not restart it), and its "
                "processes left holding GPUs are signalled".format(" ".join(e["name"] for e in entries), float(kill_timeout or 0) + CALL_MARGIN_S))
        elif rc != 0 and "ERROR" in out and "not running" not in out:
            raise StepFailed("supervisorctl stop {} failed (rc {}): {}".format(" ".join(e["name"] for e in entries), rc, out.strip()[:300]), done)


def act(steps: ProgramPlan, kill_timeout: float | None) -> ProgramsDone:
    """Stop the programs (one bounded supervisorctl call per supervisord), then turn autostart and
    autorestart off in the files of the ones to disable -> what was done (stopped_programs,
    disabled_programs, warnings); a failure raises StepFailed with it. No `reread`/`update`: the
    file edit waits for supervisord's next start (module docstring)."""
    done: ProgramsDone = {"stopped_programs": [], "disabled_programs": [], "warnings": []}
    _stop(steps, kill_timeout, done)
    # The copies of a numprocs program share one section: edited once, and each copy is reported.
    edits: dict[tuple[int, str], dict[str, t.Any] | None] = {}
    for entry in steps["disable"]:
        key = (entry["supervisor_pid"], entry.get("_section") or entry["name"])
        if key not in edits:
            try:
                edits[key] = disable(entry)
            except StepFailed as exc:
                raise StepFailed(exc.msg, done) from exc
        edit = edits[key]
        if edit is None:
            continue
        # group_updated false tells gpu_restore that the running supervisord never read the edit.
        done["disabled_programs"].append(dict(public(entry), group_updated=False, **edit))
    return done
