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

Only supervisord processes of root (real uid 0) are acted on, through their own configuration
(`-c FILE` of their command line): a user's supervisord and its files are the user's to change,
and root never edits a file a user controls. Every supervisorctl call is bounded in time: a stop
that outlasts kill_timeout is left to supervisord (it has been asked: it will not restart the
program) and the holders that remain are signalled as usual."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shlex
import stat
import subprocess
import tempfile
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _services
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed

if t.TYPE_CHECKING:
    Run = t.Callable[[t.List[str], float], t.Tuple[t.Optional[int], str]]
    Which = t.Callable[[str, t.Optional[str]], t.Optional[str]]

    class ProgramPlan(t.TypedDict):
        """plan(): programs to stop and to disable (entries: {name, supervisor_pid, config,
        state_before, _supervisor}), the globs that matched none, and the plan's warnings."""

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


SUPERVISORD = holders_mod.ProcessNames("supervisord", scripts=True)


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
        with open(f"{proc}/{pid}/status") as handle:
            for line in handle:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


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


def plan(patterns: list[str], service_state: str | None, supervisors: list[Supervisor]) -> ProgramPlan:
    """{stop: [entry], disable: [entry], not_found: [supervisor:<glob>], warnings} for the named
    programs. An entry: {name, supervisor_pid, config, state_before, pid}."""
    steps: ProgramPlan = {"stop": [], "disable": [], "not_found": [], "warnings": []}
    if not patterns:
        return steps
    listed = _listed(supervisors, steps["warnings"])
    for pattern in patterns:
        matched = [(s, p) for s, p in listed if program_matches(p["name"], pattern)]
        if not matched:
            steps["not_found"].append(SERVICE_PREFIX + pattern)
        for supervisor, program in matched:
            # pid: the program's process now, so that the release record can say which GPUs it held (wait_for_gpus).
            entry = {"name": program["name"], "supervisor_pid": supervisor.pid, "config": supervisor.config,
                     "state_before": program["state"], "pid": program.get("pid"), "_supervisor": supervisor}
            if any(e["name"] == entry["name"] and e["supervisor_pid"] == supervisor.pid for e in steps["stop"] + steps["disable"]):
                continue
            if program["state"] in RUNNING_STATES:
                steps["stop"].append(entry)
            if service_state in ("disabled", "masked"):
                steps["disable"].append(dict(entry))
    return steps


def public(entry: dict[str, t.Any]) -> dict[str, t.Any]:
    return {k: v for k, v in entry.items() if not k.startswith("_")}


def disable(entry: dict[str, t.Any]) -> dict[str, t.Any] | None:
    """autostart/autorestart false in the program's section -> the file changed and the values
    before, or None when both already read false. Raises StepFailed naming the file when the
    section is not found or the file is not root's."""
    supervisor = entry["_supervisor"]
    for path in supervisor.config_files():
        real = os.path.realpath(path)
        try:
            with open(real) as handle:
                text = handle.read()
        except OSError:
            continue
        for section in section_names(entry["name"]):
            changed = with_options_off(text, section)
            if changed is None:
                continue
            new_text, before = changed
            if is_off(before["autostart"]) and is_off(before["autorestart"]):
                return None
            info = os.stat(real)
            if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise StepFailed("supervisor:{}: not editing {}: it is not a file only root can write".format(entry["name"], real))
            write_atomically(real, new_text)
            return {"file": real, "autostart_before": before["autostart"], "autorestart_before": before["autorestart"]}
    where = ", ".join(supervisor.config_files()) or "supervisord's configuration"
    raise StepFailed("supervisor:{}: no [program:...] section for it in {}".format(entry["name"], where))


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
    for entry in steps["disable"]:
        try:
            edit = disable(entry)
        except StepFailed as exc:
            raise StepFailed(exc.msg, done) from exc
        if edit is None:
            continue
        # group_updated false tells gpu_restore that the running supervisord never read the edit.
        done["disabled_programs"].append(dict(public(entry), group_updated=False, **edit))
    return done
