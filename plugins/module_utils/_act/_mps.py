# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""CUDA MPS: the control daemon (nvidia-cuda-mps-control) and its server (nvidia-cuda-mps-server).

Measured on a real H200: the server is a compute app (66 MiB) beside each client (8802 MiB, listed
under the client's own PID); the control daemon holds device files without a context (an NVML
client to attribution: never signalled). On a multi-GPU node one server serves the clients of
every GPU it was started on, and nvidia-smi lists it on each of them.

- Clients are freed like any holder, after `terminate_client <server PID> <client PID>` through
  their server's control daemon (NVIDIA's documented early termination of a client: it ends the
  client's outstanding GPU work inside the server, so that the server and its other clients stay
  sound, which a signal to a client in the middle of GPU work does not promise). The client
  process itself goes on (its next CUDA call fails with cudaErrorMpsClientTerminated, "the
  process must be terminated and relaunched"), so it is then signalled as before; one that exited
  meanwhile is not. Which processes are a server's clients is the daemon's answer
  (`get_client_list <server PID>`), never a client's environment. The control daemon is never
  signalled (on a real H200 it maps the GPU's node without a context, so attribution reads it
  undecided): quit ends it.
- The server is stopped through its control daemon when every GPU it serves is selected: `quit`
  sent to the daemon of its pipe directory (CUDA_MPS_PIPE_DIRECTORY from the daemon's environment,
  default /tmp/nvidia-mps), after the clients have been signalled (quit waits for them), through
  the daemon's own client `nvidia-cuda-mps-control`; without that program, `quit` is written into
  the directory's `control` FIFO. A server still alive after kill_timeout is signalled as a holder.
- When it also serves a GPU outside the selection it spans GPUs: freeing the selection must not
  end the clients of the other GPUs, so the run fails before acting, naming the server and the
  unselected GPUs. That is the generic spanning refusal (_release.refuse_spanning): the server's
  GPUs are where nvidia-smi lists it. `kill_spanning: true` ends it anyway, through quit.

Identity, not names: the daemon and the server are MPS only when the identity rule vouches for
them (_holders.identified: root or a system account running a root-owned executable from a
system directory), recognised then by executable, argv[0] or script name (their 15-character
comm, `nvidia-cuda-mps`, is the same for both). A user's process of these names is an ordinary
holder, signalled like any other; a server is quit only through a vouched control daemon (its
parent), with the pipe directory of that daemon's own environment (else the default), never a
client's or the server's. `quit` goes only to a daemon whose servers serve selected GPUs only
(spanning_daemons), and only to a FIFO (opened without following links, checked to be one)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _commands
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

    class Node(t.Protocol):
        """What stopping MPS servers needs of _release.System."""

        proc: str

        def start_time(self, pid: int) -> int | None: ...
        def now(self) -> float: ...
        def sleep(self, seconds: float) -> None: ...

    class MpsDone(t.TypedDict):
        """What stop() did, under the release result's keys (Release folds it in)."""

        stopped_mps_servers: list[dict[str, t.Any]]
        warnings: list[str]

    class ClientsDone(t.TypedDict):
        """What terminate_clients() did (or, in check mode, would do), under the result's keys."""

        terminated_mps_clients: list[dict[str, t.Any]]
        warnings: list[str]

CONTROL = "nvidia-cuda-mps-control"
SERVER = "nvidia-cuda-mps-server"
# What MPS is: root's (or a system account's) own executables, through the identity rule. A user's
# process of these names is an ordinary holder.
CONTROL_NAMES = _protect.ProcessNames(CONTROL, scripts=True, cut=False)
SERVER_NAMES = _protect.ProcessNames(SERVER, scripts=True, cut=False)
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
BIN_DIRS = ("/usr/bin", "/usr/local/nvidia/bin", "/usr/local/bin", "/run/nvidia/driver/usr/bin")
QUIT_TIMEOUT_S = 10.0


def is_server(record: t.Mapping[str, t.Any] | None) -> bool:
    """An MPS server: root's (or a system account's) nvidia-cuda-mps-server (the identity rule)."""
    return SERVER_NAMES.of(record) is not None


def is_control(record: t.Mapping[str, t.Any] | None) -> bool:
    """An MPS control daemon: root's (or a system account's) nvidia-cuda-mps-control."""
    return CONTROL_NAMES.of(record) is not None


def plan(targets: list[Holder], proc: str = "/proc") -> tuple[list[Holder], list[Holder]]:
    """(targets left to signal, MPS servers to quit); control daemons are dropped. Which servers are
    targets at all is the spanning rule's (_release.plan_targets, spanning_daemons): a server that
    also serves GPUs outside the selection, or whose daemon does, is refused before acting, unless
    kill_spanning. A server without a control daemon to quit it through is signalled as a holder."""
    left: list[Holder] = []
    servers: list[Holder] = []
    for holder in targets:
        if is_control(holder):
            # It maps GPU nodes without a context (undecided on a real H200): never signalled; quit
            # ends it with its server.
            continue
        (servers if is_server(holder) and control_of(holder, proc) else left).append(holder)
    return left, servers


def without_daemons(targets: list[Holder], servers: t.Iterable[Holder]) -> list[Holder]:
    """Targets of a re-plan after stops: neither a control daemon (never signalled) nor a server
    already planned to quit through its daemon."""
    planned = {s["pid"] for s in servers}
    return [h for h in targets if not is_control(h) and h["pid"] not in planned]


def control_of(server: t.Mapping[str, t.Any], proc: str = "/proc") -> Holder | None:
    """The server's control daemon (its parent, when the identity rule says that is one), or None."""
    ppid = server.get("ppid") or 0
    parent = holders_mod.read_process(ppid, proc) if ppid > 1 else None
    return parent if parent and is_control(parent) else None


def pipe_directory(server: t.Mapping[str, t.Any], proc: str = "/proc") -> str:
    """CUDA_MPS_PIPE_DIRECTORY of the server's control daemon (vouched), or the default. Never a
    client's or the server's own environment: the directory root sends `quit` to is the one the
    daemon root vouches for reads."""
    control = control_of(server, proc)
    value = holders_mod.environ_of(control["pid"], proc).get("CUDA_MPS_PIPE_DIRECTORY") if control else None
    return value or DEFAULT_PIPE_DIR


def spanning_daemons(servers: t.Iterable[Holder], holders: t.Iterable[Holder], selected: t.Collection[int], proc: str = "/proc"
                     ) -> list[tuple[dict[str, t.Any], list[int]]]:
    """[(control daemon, GPUs outside the selection)] for the daemons of `servers` (to quit) that
    also run a server serving an unselected GPU: `quit` would end that one too (the spanning
    refusal, as for a server that serves them itself). The daemon's GPUs are its servers'."""
    found: list[tuple[dict[str, t.Any], list[int]]] = []
    holders = list(holders)
    for server in servers:
        control = control_of(server, proc)
        if control is None or any(c["pid"] == control["pid"] for c, _outside in found):
            continue
        theirs = [h for h in holders if h.get("ppid") == control["pid"] and is_server(h)]
        used = sorted({g for h in theirs + [server] for g in h.get("gpu_indexes") or []})
        outside = [g for g in used if g not in selected]
        if outside:
            found.append((dict(control, gpu_indexes=used), outside))
    return found


def _which(name: str) -> str | None:
    return _commands.which(name, dirs=BIN_DIRS)


def find_client_program(which: t.Callable[[str], str | None] | None = None) -> str | None:
    which = which or _which
    return which(CONTROL)


def write_to_fifo(path: str, text: str) -> str | None:
    """Write `text` into the FIFO at `path`, never following a link and never into anything but a
    FIFO with a reader. Returns None, or why it could not."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return f"no control daemon reads {path}"
        return f"{path}: {exc.strerror}"
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return f"{path} is not a FIFO"
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return None


def _control(directory: str, text: str, which: t.Callable[[str], str | None] | None, timeout: float
             ) -> tuple[str | None, str | None, str]:
    """`text` (commands, one a line) to the control daemon of `directory` through its own client
    program -> (the program or None when there is none, error or None, what it printed)."""
    program = find_client_program(which)
    if not program:
        return None, None, ""
    env = _commands.c_locale_env(CUDA_MPS_PIPE_DIRECTORY=directory)
    try:
        done = subprocess.run([program], input=text.encode(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return program, f"{program} did not answer within {timeout:.0f} s", ""
    except OSError as exc:
        return program, str(exc), ""
    output = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0:
        return program, f"{program} (rc {done.returncode}): {output.strip()[:200]}", output
    return program, None, output


def send_quit(directory: str, which: t.Callable[[str], str | None] | None = None, timeout: float = QUIT_TIMEOUT_S) -> tuple[str, str | None]:
    """`quit` to the control daemon of `directory` -> (how, error or None)."""
    program, error, _output = _control(directory, "quit\n", which, timeout)
    if program:
        return (program, error) if error else (f"echo quit | {program}", None)
    fifo = os.path.join(directory, "control")
    return f"quit > {fifo}", write_to_fifo(fifo, "quit\n")


def parse_pids(text: str) -> list[int]:
    """`get_client_list` / `get_server_list` output: PIDs, one a line; anything else is skipped."""
    return [int(token) for token in text.split() if token.isdigit()]


def same_pid_namespace(pid: int, proc: str = "/proc") -> bool:
    """Whether PID lives in this module's own PID namespace: the PIDs a control daemon names and
    is told are those of its namespace, which must be ours for them to mean the same processes."""
    own = holders_mod.pid_namespace_of(holders_mod.own_pid(proc), proc)
    return own is not None and holders_mod.pid_namespace_of(pid, proc) == own


def present(holders: t.Iterable[Holder]) -> bool:
    """Whether a vouched MPS daemon or server is among the holders (else nothing here applies)."""
    return any(is_control(h) or is_server(h) for h in holders)


def served_by_daemons(holders: t.Iterable[Holder]) -> list[Holder]:
    """The MPS servers among the holders: vouched ones, and those whose parent is a vouched control
    daemon among the holders. The daemon starts each server with the uid of the clients it serves
    (NVIDIA's MPS documentation), so a server need not be root's; its parent vouches for it here,
    which a user cannot choose. Only the daemon's own answers are acted on for them
    (client_terminations), and client_terminations asks only through a vouched parent."""
    holders = list(holders)
    daemons = {h["pid"] for h in holders if is_control(h)}
    return [h for h in holders if is_server(h) or h.get("ppid") in daemons]


def client_terminations(holders: t.Iterable[Holder], targets: t.Iterable[Holder], proc: str = "/proc",
                        which: t.Callable[[str], str | None] | None = None, timeout: float = QUIT_TIMEOUT_S
                        ) -> tuple[list[dict[str, t.Any]], list[str]]:
    """([{pid, name, server_pid, pipe_directory, gpu_indexes, how: None}] for each target that a
    vouched server's vouched control daemon lists as that server's client, warnings). Asked
    through `get_client_list <server PID>` (a read: check mode asks it too); a daemon in another
    PID namespace is not asked (its PIDs are not ours). The servers asked about are the vouched
    daemons' children among the holders (served_by_daemons)."""
    holders = list(holders)
    servers = served_by_daemons(holders)
    by_pid = {h["pid"]: h for h in targets if not is_server(h) and not is_control(h) and h not in servers}
    planned: list[dict[str, t.Any]] = []
    warnings: list[str] = []
    if not by_pid or not servers:
        return planned, warnings
    if find_client_program(which) is None:
        return planned, [f"MPS clients are signalled without terminate_client first: {CONTROL} was not found"]
    for server in servers:
        control = control_of(server, proc)
        if control is None or not same_pid_namespace(control["pid"], proc):
            continue
        directory = pipe_directory(server, proc)
        _program, error, output = _control(directory, "get_client_list {:d}\n".format(server["pid"]), which, timeout)
        if error:
            warnings.append("MPS server pid {}: its clients are signalled without terminate_client first: get_client_list failed ({})".format(
                server["pid"], error))
            continue
        for pid in parse_pids(output):
            client = by_pid.pop(pid, None)
            if client is not None:
                planned.append({"pid": pid, "name": client.get("name"), "server_pid": server["pid"], "pipe_directory": directory,
                                "gpu_indexes": client.get("gpu_indexes"), "how": None})
    return planned, warnings


def terminate_clients(holders: t.Iterable[Holder], targets: t.Iterable[Holder], proc: str = "/proc",
                      which: t.Callable[[str], str | None] | None = None, timeout: float = QUIT_TIMEOUT_S) -> ClientsDone:
    """`terminate_client <server PID> <client PID>` for each target that is a vouched server's
    client, before any signal (client_terminations says which), one call per daemon -> what was
    done: terminated_mps_clients (`how` None where it failed) and warnings. What is left of the
    clients is then signalled as before."""
    planned, warnings = client_terminations(holders, targets, proc, which, timeout)
    done: ClientsDone = {"terminated_mps_clients": planned, "warnings": warnings}
    for directory in sorted({entry["pipe_directory"] for entry in planned}):
        entries = [e for e in planned if e["pipe_directory"] == directory]
        text = "".join("terminate_client {:d} {:d}\n".format(e["server_pid"], e["pid"]) for e in entries)
        program, error, _output = _control(directory, text, which, timeout)
        for entry in entries:
            if error:
                done["warnings"].append("MPS client pid {}: terminate_client through its control daemon failed ({}); it is signalled "
                                        "as before".format(entry["pid"], error))
            else:
                entry["how"] = "echo terminate_client {} {} | {}".format(entry["server_pid"], entry["pid"], program)
    return done


def stop(system: Node, servers: list[Holder], kill_timeout: float | None, which: t.Callable[[str], str | None] | None = None
         ) -> tuple[list[Holder], MpsDone]:
    """Quit each server's control daemon, wait for those servers to exit at most kill_timeout ->
    (the servers still alive, to be signalled as holders, those whose quit failed first; what was
    done: stopped_mps_servers and warnings)."""
    done: MpsDone = {"stopped_mps_servers": [], "warnings": []}
    failed, waiting = [], []
    for server in servers:
        directory = pipe_directory(server, system.proc)
        how, error = send_quit(directory, which)
        done["stopped_mps_servers"].append({"pid": server["pid"], "name": server.get("name"), "pipe_directory": directory,
                                            "gpu_indexes": server.get("gpu_indexes"), "how": None if error else how})
        if error:
            done["warnings"].append("MPS server pid {}: quit through its control daemon failed ({}); it is signalled instead".format(
                server["pid"], error))
            failed.append(server)
        else:
            waiting.append(server)
    deadline = system.now() + float(kill_timeout or 0)
    while waiting:
        waiting = [s for s in waiting if system.start_time(s["pid"]) == s["start_time"]]
        if not waiting or system.now() >= deadline:
            break
        system.sleep(0.02)
    return failed + waiting, done
