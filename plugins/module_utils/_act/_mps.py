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

- Clients are freed like any holder. The control daemon is never signalled (on a real H200 it maps
  the GPU's node without a context, so attribution reads it undecided): quit ends it.
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

CONTROL = "nvidia-cuda-mps-control"
SERVER = "nvidia-cuda-mps-server"
# What MPS is: root's (or a system account's) own executables, through the identity rule. A user's
# process of these names is an ordinary holder.
CONTROL_NAMES = holders_mod.ProcessNames(CONTROL, scripts=True, cut=False)
SERVER_NAMES = holders_mod.ProcessNames(SERVER, scripts=True, cut=False)
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


def send_quit(directory: str, which: t.Callable[[str], str | None] | None = None, timeout: float = QUIT_TIMEOUT_S) -> tuple[str, str | None]:
    """`quit` to the control daemon of `directory` -> (how, error or None)."""
    program = find_client_program(which)
    if program:
        env = _commands.c_locale_env(CUDA_MPS_PIPE_DIRECTORY=directory)
        try:
            done = subprocess.run([program], input=b"quit\n", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return program, f"{program} did not answer within {timeout:.0f} s"
        except OSError as exc:
            return program, str(exc)
        if done.returncode == 0:
            return f"echo quit | {program}", None
        return program, "{} (rc {}): {}".format(program, done.returncode, done.stdout.decode("utf-8", "replace").strip()[:200])
    fifo = os.path.join(directory, "control")
    return f"quit > {fifo}", write_to_fifo(fifo, "quit\n")


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
