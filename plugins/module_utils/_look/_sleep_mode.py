# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""What a GPU holder's own vLLM server says of its sleep (issue 70, a sleeping vLLM).

vLLM's sleep mode (`POST /sleep`) frees a server's weights and KV cache but keeps its CUDA context:
a sleeping server still holds memory, and the driver shows it exactly as an idle one. vLLM answers
`GET /is_sleeping` with `{"is_sleeping": true}` (served with VLLM_SERVER_DEV_MODE=1, as its
sleep-mode docs ask). That answer is the server's own word, and whoever runs the server writes it:
it is QUOTED in the holder's description, a note that decides nothing (the holder is freed or
refused exactly as any other).

Who controls what, and so what root does:
- The port is the kernel's, never a name or a file: a socket inode in the fd table of the holder,
  or of its parent chain (vLLM V1's API server listens while its EngineCore child holds the GPU)
  as far as a process of the same uid in the same cgroups, matched against the LISTEN rows of
  /proc/PID/net/tcp{,6} of that process's network namespace, whose uid column (the socket's
  owner) is the holder's. A socket another user made (passed or inherited) is never this holder's
  server, nor is a port another user's socket also listens on.
- Only for holders a look found: a clean host reads nothing here (only _facts and the freeing
  room import it, for holders).
- Bounded: every /proc read in _bounded_reads' readers; the asks in parallel, all of them under
  one deadline for the whole run (ASK_S), each answer read to ANSWER_BYTES at most, each holder
  asked once a run; at most MAX_ASKS asks. A server that hangs, trickles, floods or answers
  anything but vLLM's JSON says nothing.
- Over loopback, in the server's own network namespace (entered by the asking thread only, for
  its one socket): root sends `GET /is_sleeping` and nothing else, carrying no secret.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import socket
import sys
import threading
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _bounded_reads
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

# All asks of a run together, with the /proc reads that find them. A vLLM server answers in
# milliseconds, but a loaded node's scheduler holds a thread, or the server, for hundreds: a
# quarter of a second missed a server in its own network namespace under CI's load (16 on 2 cores).
ASK_S = 1.0
# The most of one answer read (vLLM's is about 140 bytes with its headers).
ANSWER_BYTES = 4096
# At most this many asks in a run, and ports asked of one holder.
MAX_ASKS = 16
PORTS_PER_HOLDER = 2
# How far up the parent chain a holder's server may be (vLLM V1: API server -> EngineCore -> worker).
ANCESTORS = 3
# The most fds of one process looked at (a server's listening socket is among its first), and of
# one namespace's TCP table read (its LISTEN rows come first: the kernel lists them before the rest).
FDS_MAX = 4096
TABLE_BYTES = 1 << 20
PATH = "/is_sleeping"
CLONE_NEWNET = 0x40000000
LISTEN = "0A"
_SOCKET = re.compile(r"^socket:\[(\d{1,20})\]$")


class Listener(t.NamedTuple):
    """A LISTEN row of /proc/net/tcp{,6}: where it listens, the socket's owner uid, its inode."""

    address: str
    port: int
    uid: int
    inode: int


class Process(t.NamedTuple):
    """What the kernel says of one process of a holder's chain."""

    pid: int
    ppid: int
    uid: int | None
    cgroups: str | None
    sockets: frozenset[int]
    netns: tuple[int, int] | None


class Ask(t.NamedTuple):
    """One question to put: the process whose socket listens (its namespace is where it is put), where."""

    owner: int
    address: str
    port: int


# Each holder's answer in this run, by (pid, start time): asked once, whatever the rescans.
ANSWERS: dict[tuple[int, int], dict[str, t.Any] | None] = {}
# The time the run's asks may still take (ASK_S in all), and how many may still be put.
_LEFT = {"seconds": ASK_S, "asks": MAX_ASKS}


# ---------------------------------------------------------------- pure parts


def parse_listeners(text: str) -> list[Listener]:
    """The LISTEN rows of /proc/net/tcp or tcp6 (header first; the kernel lists listening sockets
    before every other) -> Listeners, up to the first row in another state; pure."""
    found = []
    for line in text.split("\n")[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        if fields[3] != LISTEN:
            break
        address, _sep, port = fields[1].partition(":")
        try:
            found.append(Listener(hex_address(address), int(port, 16), int(fields[7]), int(fields[9])))
        except ValueError:
            continue
    return found


def hex_address(text: str, byteorder: str = sys.byteorder) -> str:
    """/proc/net/tcp's address (the network-order bytes printed as host-order 32-bit words, hex)
    -> its usual spelling; pure."""
    raw = bytes.fromhex(text)
    words = raw if byteorder == "big" else b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(words) == 4 else socket.AF_INET6, words)


def target(address: str) -> str:
    """Where to reach a listener from its own namespace: loopback for a wildcard; pure."""
    if address == "0.0.0.0":
        return "127.0.0.1"
    if address == "::":
        return "::1"
    return address[len("::ffff:"):] if address.startswith("::ffff:") and "." in address else address


def request(address: str, port: int) -> bytes:
    host = f"[{address}]" if ":" in address else address
    return f"GET {PATH} HTTP/1.0\r\nHost: {host}:{port:d}\r\nAccept: application/json\r\nConnection: close\r\n\r\n".encode("ascii")


def parse_answer(data: bytes) -> bool | None:
    """vLLM's answer to GET /is_sleeping -> True (asleep) or False (awake); None for anything
    else (another status, a body that is not its JSON, an answer cut at ANSWER_BYTES); pure."""
    head, sep, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or not status[0].startswith(b"HTTP/1.") or status[1] != b"200" or len(data) > ANSWER_BYTES:
        return None
    try:
        said = json.loads(body.decode("utf-8"))
    except ValueError:
        return None
    value = said.get("is_sleeping") if isinstance(said, dict) else None
    return value if isinstance(value, bool) else None


def chain_of(pid: int, processes: t.Mapping[int, Process]) -> list[Process]:
    """The holder and the ancestors that are its kin (same uid, same cgroups): where its server
    may listen; pure."""
    first = processes.get(pid)
    if first is None or first.uid is None:
        return []
    chain = [first]
    while len(chain) <= ANCESTORS:
        parent = processes.get(chain[-1].ppid)
        if parent is None or parent.pid <= 1 or parent.uid != first.uid or parent.cgroups != first.cgroups or parent in chain:
            break
        chain.append(parent)
    return chain


def asks_for(chain: t.Sequence[Process], tables: t.Mapping[tuple[int, int], list[Listener]]) -> list[Ask]:
    """The ports the holder's own kin listen on, from the kernel's tables: sockets in their fd
    tables, owned by the holder's uid, on a port no other user's socket listens on; pure."""
    asks: list[Ask] = []
    for process in chain:
        rows = tables.get(process.netns or (-1, -1)) or []
        for row in rows:
            if row.inode not in process.sockets or row.uid != process.uid:
                continue
            if any(other.port == row.port and other.uid != row.uid for other in rows):
                continue
            ask = Ask(process.pid, target(row.address), row.port)
            if ask not in asks:
                asks.append(ask)
    return asks[:PORTS_PER_HOLDER]


def note(answer: t.Mapping[str, t.Any] | None, mib: int | None = None, short: bool = False) -> str:
    """The words a holder's description quotes, or "" (awake, or nothing said); `short`: without
    the memory (the Slurm hooks' drain reason); pure."""
    if not answer or not answer.get("asleep"):
        return ""
    said = "its server says it is asleep: vLLM's sleep mode keeps its CUDA context"
    if short:
        return said
    return said + (f", {mib:d} MiB still held" if mib else ", its memory still held")


# ---------------------------------------------------------------- the kernel's word


def read_process(pid: int, proc: str) -> Process | None:
    """One process's uid, parent, cgroups, socket inodes and network namespace (bounded by the caller)."""
    base = f"{proc}/{pid:d}"
    try:
        status = _holders.read_status(pid, proc)
    except OSError:
        return None
    uids = _holders.status_ints(status, "Uid")
    ppid = _holders.status_field(status, "PPid")
    sockets = set()
    try:
        with os.scandir(base + "/fd") as entries:
            for count, entry in enumerate(entries):
                if count >= FDS_MAX:
                    break
                try:
                    match = _SOCKET.match(os.readlink(entry.path))
                except OSError:
                    continue
                if match:
                    sockets.add(int(match.group(1)))
    except OSError:
        pass
    netns = None
    if sockets:
        try:
            info = os.stat(base + "/ns/net")
            netns = (info.st_dev, info.st_ino)
        except OSError:
            netns = None
    return Process(pid, ppid or 0, uids[0] if uids else None, _holders.cgroup_text(pid, proc), frozenset(sockets), netns)


def read_processes(pids: t.Iterable[int], proc: str, deadline: float) -> dict[int, Process]:
    """read_process of each holder and its parents, ANCESTORS deep, in bounded passes."""
    found: dict[int, Process] = {}
    todo = sorted(set(pids))
    for _depth in range(ANCESTORS + 1):
        todo = [pid for pid in todo if pid > 1 and pid not in found]
        if not todo or time.monotonic() >= deadline:
            break
        outcome = _bounded_reads.scan(lambda pid: read_process(pid, proc), todo, deadline_s=max(0.0, deadline - time.monotonic()),
                                      processes=[f"{proc}/{pid:d}" for pid in todo])
        read = [t.cast(Process, outcome.results[index]) for index in sorted(outcome.results)]
        found.update((p.pid, p) for p in read)
        todo = [p.ppid for p in read]
    return found


def read_table(pid: int, proc: str) -> list[Listener]:
    """The LISTEN rows of the network namespace `pid` is in (tcp and tcp6), TABLE_BYTES each at most."""
    rows: list[Listener] = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/{pid:d}/net/{name}", "rb") as handle:
                text = _listening_part(handle)
        except OSError:
            continue
        rows.extend(parse_listeners(text))
    return rows


def _listening_part(handle: t.BinaryIO) -> str:
    """The start of a TCP table up to its first row past the LISTEN ones (or TABLE_BYTES)."""
    data = b""
    while len(data) < TABLE_BYTES:
        chunk = handle.read(65536)
        if not chunk:
            break
        data += chunk
        rows = data.split(b"\n")
        if any(len(row.split()) > 3 and row.split()[3] != LISTEN.encode() for row in rows[1:-1]):
            break
    return data[:TABLE_BYTES].decode("ascii", "replace")


def read_tables(owners: t.Mapping[tuple[int, int], int], proc: str, deadline: float) -> dict[tuple[int, int], list[Listener]]:
    """{network namespace: its LISTEN rows}, each read through one process in it, bounded."""
    keys = list(owners)
    if not keys:
        return {}
    outcome = _bounded_reads.scan(lambda key: read_table(owners[key], proc), keys, deadline_s=max(0.0, deadline - time.monotonic()),
                                  processes=[f"{proc}/{owners[key]:d}" for key in keys])
    return {keys[index]: rows for index, rows in outcome.results.items()}


# ---------------------------------------------------------------- the asks


def own_netns() -> tuple[int, int] | None:
    """This module's network namespace (where an ask needs no setns)."""
    try:
        info = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return info.st_dev, info.st_ino


def ask_one(address: str, port: int, deadline: float, netns: str | None = None, expected: tuple[int, int] | None = None) -> bool | None:
    """GET /is_sleeping of address:port, in the network namespace at path `netns` (None: ours),
    which must still be `expected` (the one its /proc read named: a PID reused meanwhile names
    another), by the calling thread; the answer (parse_answer), None past the deadline or on any error."""
    try:
        if netns is not None:
            enter_netns(netns, expected)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect((address, port))
            sock.sendall(request(address, port))
            data = b""
            while len(data) <= ANSWER_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                sock.settimeout(left)
                chunk = sock.recv(ANSWER_BYTES + 1 - len(data))
                if not chunk:
                    break
                data += chunk
    except (OSError, ValueError):
        return None
    return parse_answer(data)


def enter_netns(path: str, expected: tuple[int, int] | None = None) -> None:
    """Move the calling thread (only it: setns(2) of a network namespace is per thread) into the
    network namespace at `path`, if it is `expected` (nsfs device, inode); raises OSError."""
    handle = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        info = os.fstat(handle)
        if expected is not None and (info.st_dev, info.st_ino) != expected:
            raise OSError(f"{path} is no longer the namespace read")
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(handle, CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
    finally:
        os.close(handle)


def ask_all(asks: t.Sequence[tuple[Ask, str | None, tuple[int, int] | None]], seconds: float) -> dict[Ask, bool | None]:
    """Every ask at once, each in a thread of its own (one that enters a namespace ends with its
    ask), all under one deadline `seconds` away; an ask still running then says nothing."""
    deadline = time.monotonic() + seconds
    answers: dict[Ask, bool | None] = {}
    threads = []
    for ask, netns, expected in asks:
        def run(ask: Ask = ask, netns: str | None = netns, expected: tuple[int, int] | None = expected) -> None:
            answers[ask] = ask_one(ask.address, ask.port, deadline, netns, expected)
        thread = threading.Thread(target=run, name="zeromib-sleep-ask", daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {ask: answers.get(ask) for ask, _netns, _expected in asks}


# ---------------------------------------------------------------- the holders


def annotate(holders: list[Holder], proc: str = "/proc") -> list[Holder]:
    """Each holder's `sleep_answer`: {port, asleep} where its own vLLM server answered GET
    /is_sleeping, else None. Each holder is asked once a run, all asks under ASK_S together."""
    todo = []
    for holder in holders:
        key = (int(holder["pid"]), int(holder.get("start_time") or 0))
        # A protected process is never signalled (an exporter such as dcgm-exporter listens too): nothing to ask it.
        if key in ANSWERS or holder.get("kernel_thread") or holder.get("blocked") or holder.get("protected") or holder.get("uid") is None:
            holder["sleep_answer"] = ANSWERS.get(key)
        else:
            todo.append(holder)
    if not todo or _LEFT["seconds"] <= 0 or _LEFT["asks"] <= 0:
        for holder in todo:
            holder["sleep_answer"] = None
        return holders
    started = time.monotonic()
    deadline = started + _LEFT["seconds"]
    processes = read_processes([int(h["pid"]) for h in todo], proc, deadline)
    chains = {int(h["pid"]): chain_of(int(h["pid"]), processes) for h in todo}
    owners = {p.netns: p.pid for chain in chains.values() for p in chain if p.netns is not None and p.sockets}
    tables = read_tables(owners, proc, deadline)
    ours = own_netns()
    # One ask per server, whichever of its kin hold GPUs or share its socket (vLLM V1's API server
    # is an NVML client holder itself, its EngineCore and workers hold contexts): keyed by where.
    wanted = {int(h["pid"]): asks_for(chains[int(h["pid"])], tables) for h in todo}
    puts: dict[tuple[t.Any, str, int], tuple[Ask, str | None, tuple[int, int] | None]] = {}
    for ask in (a for found in wanted.values() for a in found):
        netns = processes[ask.owner].netns
        if len(puts) < _LEFT["asks"] and (netns, ask.address, ask.port) not in puts:
            puts[(netns, ask.address, ask.port)] = (ask, None, None) if netns == ours else (ask, f"{proc}/{ask.owner:d}/ns/net", netns)
    asks = list(puts.values())
    put = ask_all(asks, max(0.0, deadline - time.monotonic())) if asks else {}
    answers = {where: put.get(ask) for where, (ask, _netns, _expected) in puts.items()}
    _LEFT["asks"] -= len(asks)
    _LEFT["seconds"] -= time.monotonic() - started
    for holder in todo:
        said = [(ask.port, answers.get((processes[ask.owner].netns, ask.address, ask.port))) for ask in wanted[int(holder["pid"])]]
        said = [(port, answer) for port, answer in said if answer is not None]
        record = {"port": said[0][0], "asleep": said[0][1]} if said else None
        holder["sleep_answer"] = record
        ANSWERS[(int(holder["pid"]), int(holder.get("start_time") or 0))] = record
    return holders
