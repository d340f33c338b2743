# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_sleep_mode: what a holder's own vLLM server says of its sleep, asked only on a port the kernel
shows the holder's own kin listening on with a socket of its own user, bounded in time and size,
and quoted as its word. The attackers first: a server that hangs, trickles, floods or lies, a
socket another user made, a holder with no socket beside a server that is not its own. Real
processes listening on this machine's loopback (and in a network namespace of their own)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _words
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _sleep_mode

# A stand-in for vLLM's API server: listens, answers GET /is_sleeping as ANSWER says, logs each
# request's first line, prints "ready PORT" (PID is its own); CHILD: a child that holds no socket.
SERVER = textwrap.dedent(r"""
    import os, socket, sys, threading, time
    answer, log, mode = sys.argv[1], open(sys.argv[2], "a", buffering=1), sys.argv[3]  # opened before a drop to another user
    if mode == "netns":
        import ctypes, fcntl, struct
        ctypes.CDLL(None, use_errno=True).unshare(0x40000000)
        s = socket.socket()
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", 0x1 | 0x8 | 0x40))  # SIOCSIFFLAGS lo UP
        s.close()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    if mode == "drop":
        os.setgid(65534)
        os.setuid(65534)
    bodies = {"asleep": b'{"is_sleeping":true}', "awake": b'{"is_sleeping":false}'}
    def one(conn):
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
        log.write(data.split(b"\r\n", 1)[0].decode() + "\n")
        if answer == "hang":
            time.sleep(60)
        elif answer == "flood":
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b'{"is_sleeping":true' + b" " * (8 << 20) + b"}")
        elif answer == "notfound":
            conn.sendall(b'HTTP/1.1 404 Not Found\r\ncontent-length: 22\r\n\r\n{"detail":"Not Found"}')
        else:
            body = bodies["asleep" if answer == "trickle" else answer]
            text = b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-length: %d\r\ncontent-type: application/json\r\n\r\n%s" % (len(body), body)
            for i in range(len(text)) if answer == "trickle" else [None]:
                conn.sendall(text if i is None else text[i:i + 1])
                if i is not None:
                    time.sleep(0.05)
        conn.close()
    def serve():
        while True:
            conn, _ = sock.accept()
            threading.Thread(target=one, args=(conn,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    child = 0
    if mode == "child":
        sock_fd = sock.fileno()
        child = os.fork()
        if child == 0:
            os.close(sock_fd)
            time.sleep(60)
            os._exit(0)
    print("ready", sock.getsockname()[1], child, flush=True)
    time.sleep(60)
""")
NOBODY = 65534


@pytest.fixture(autouse=True)
def fresh_run():
    """Each test is one run: its answers and its time are its own."""
    _sleep_mode.ANSWERS.clear()
    _sleep_mode._LEFT.update(seconds=_sleep_mode.ASK_S, asks=_sleep_mode.MAX_ASKS)
    yield
    _sleep_mode.ANSWERS.clear()
    _sleep_mode._LEFT.update(seconds=_sleep_mode.ASK_S, asks=_sleep_mode.MAX_ASKS)


@pytest.fixture
def servers(tmp_path):
    """start(answer, mode) -> (pid, port, child pid, log path); every process ended by its PID."""
    started = []

    def start(answer="asleep", mode="plain"):
        log = tmp_path / f"requests-{len(started)}"
        log.write_text("")
        process = subprocess.Popen([sys.executable, "-c", SERVER, answer, str(log), mode], stdout=subprocess.PIPE, text=True)
        started.append(process)
        line = process.stdout.readline().split()
        assert line and line[0] == "ready", line
        if int(line[2]):
            started.append(int(line[2]))
        return process.pid, int(line[1]), int(line[2]), log

    yield start
    for item in started:
        pid = item if isinstance(item, int) else item.pid
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
        if not isinstance(item, int):
            item.wait()


def holder(pid, uid=0):
    with open(f"/proc/{pid:d}/stat", "rb") as handle:
        start = int(handle.read().rsplit(b")", 1)[1].split()[19])
    return {"pid": pid, "name": "vllm", "cmdline": "vllm serve m", "uid": uid, "state": "S", "start_time": start, "gpu_indexes": [0],
            "protected": False}


def asked(log):
    return log.read_text().splitlines()


# ---------------------------------------------------------------- pure parts


TCP = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
       "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0000000000000000 100 0 0 10 0\n"
       "   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 17 1 0000000000000000 100 0 0 10 0\n"
       "   2: 0100007F:1F40 0100007F:A2B4 01 00000000:00000000 00:00000000 00000000  1000        0 0 1 0000000000000000 20 4 30 10 -1\n")
TCP6 = ("  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 00000000000000000000000000000000:1F41 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000"
        "        0 4343 1 0000000000000000 100 0 0 10 0\n")


def test_the_kernels_listen_rows_are_read_up_to_the_first_row_past_them():
    assert _sleep_mode.parse_listeners(TCP) == [_sleep_mode.Listener("127.0.0.1", 8000, 1000, 4242), _sleep_mode.Listener("0.0.0.0", 22, 0, 17)]
    assert _sleep_mode.parse_listeners(TCP6) == [_sleep_mode.Listener("::", 8001, 1000, 4343)]
    assert _sleep_mode.hex_address("7F000001", "big") == "127.0.0.1"  # s390x prints its words as they are
    assert _sleep_mode.target("0.0.0.0") == "127.0.0.1" and _sleep_mode.target("::") == "::1" and _sleep_mode.target("::ffff:10.0.0.2") == "10.0.0.2"


@pytest.mark.parametrize(("data", "said"), [
    (b'HTTP/1.1 200 OK\r\ncontent-length: 20\r\ncontent-type: application/json\r\n\r\n{"is_sleeping":true}', True),
    (b'HTTP/1.1 200 OK\r\n\r\n{"is_sleeping": false}', False),
    (b'HTTP/1.1 404 Not Found\r\n\r\n{"detail":"Not Found"}', None),
    (b'HTTP/1.1 200 OK\r\n\r\n{"is_sleeping":"true"}', None),
    (b'HTTP/1.1 200 OK\r\n\r\n["is_sleeping", true]', None),
    (b'HTTP/1.1 200 OK\r\n\r\n{"is_sleeping":true' + b" " * 5000 + b"}", None),
    (b'SSH-2.0-OpenSSH_9.2\r\n', None),
    (b'', None),
])
def test_only_vllms_own_json_answer_says_anything(data, said):
    assert _sleep_mode.parse_answer(data) is said


def process(pid, ppid, uid=1000, cgroups="0::/system.slice/vllm.service\n", sockets=(), netns=(1, 2)):
    return _sleep_mode.Process(pid, ppid, uid, cgroups, frozenset(sockets), netns)


def test_a_holders_kin_is_its_parent_chain_of_its_own_user_and_cgroups_only():
    processes = {p.pid: p for p in (process(30, 20), process(20, 10), process(10, 5, uid=0), process(5, 1, uid=0))}
    assert [p.pid for p in _sleep_mode.chain_of(30, processes)] == [30, 20]
    processes[20] = process(20, 10, cgroups="0::/user.slice/user-1000.slice/session-3.scope\n")
    assert [p.pid for p in _sleep_mode.chain_of(30, processes)] == [30]


def test_only_a_socket_of_the_holders_user_on_a_port_no_other_user_listens_on_is_asked():
    rows = _sleep_mode.parse_listeners(TCP)
    mine = process(30, 20, sockets=(4242,))
    assert _sleep_mode.asks_for([mine], {(1, 2): rows}) == [_sleep_mode.Ask(30, "127.0.0.1", 8000)]
    # Root's sshd socket, passed into the holder's fd table: root's, never this holder's server.
    assert _sleep_mode.asks_for([process(30, 20, sockets=(17,))], {(1, 2): rows}) == []
    # Another user's socket on the same port: whose answer it would be is not the kernel's word.
    shared = rows + [_sleep_mode.Listener("0.0.0.0", 8000, 4242, 999)]
    assert _sleep_mode.asks_for([mine], {(1, 2): shared}) == []


def test_the_note_quotes_the_server_and_an_awake_or_silent_server_adds_nothing():
    assert _sleep_mode.note({"port": 8000, "asleep": True}, 2048) == (
        "its server says it is asleep: vLLM's sleep mode keeps its CUDA context, 2048 MiB still held")
    assert _sleep_mode.note({"port": 8000, "asleep": False}, 2048) == "" and _sleep_mode.note(None) == ""
    # The Slurm hooks' drain reason: the same words, without the memory.
    assert _sleep_mode.note({"port": 8000, "asleep": True}, 2048, short=True) == (
        "its server says it is asleep: vLLM's sleep mode keeps its CUDA context")
    assert _sleep_mode.note({"port": 8000, "asleep": False}, short=True) == ""
    said = _words.describe_holder(dict(holder(os.getpid()), sleep_answer={"port": 8000, "asleep": True}), 2048)
    assert said.endswith("(its server says it is asleep: vLLM's sleep mode keeps its CUDA context, 2048 MiB still held, state S)"), said


# ---------------------------------------------------------------- real processes


def test_a_holders_own_server_that_says_it_is_asleep_is_quoted_and_asked_once_a_run(servers):
    pid, port, _child, log = servers("asleep")
    # protected (never signalled): not asked
    assert _sleep_mode.annotate([dict(holder(pid), protected=True)])[0]["sleep_answer"] is None and asked(log) == []
    [found] = _sleep_mode.annotate([holder(pid)])
    assert found["sleep_answer"] == {"port": port, "asleep": True}
    assert asked(log) == ["GET /is_sleeping HTTP/1.0"]
    [again] = _sleep_mode.annotate([holder(pid)])  # a rescan of the same run
    assert again["sleep_answer"] == {"port": port, "asleep": True} and len(asked(log)) == 1


def test_vllm_v1s_api_server_answers_for_its_enginecore_child(servers):
    _pid, port, child, log = servers("asleep", "child")
    [found] = _sleep_mode.annotate([holder(child)])
    assert found["sleep_answer"] == {"port": port, "asleep": True} and len(asked(log)) == 1


def test_an_awake_server_and_one_without_the_route_say_nothing_of_sleep(servers):
    awake, _p, _c, _l = servers("awake")
    missing, _p2, _c2, log = servers("notfound")
    found = _sleep_mode.annotate([holder(awake), holder(missing)])
    assert found[0]["sleep_answer"]["asleep"] is False and found[1]["sleep_answer"] is None and len(asked(log)) == 1
    assert "asleep" not in _words.describe_holder(found[0])


def test_servers_that_hang_trickle_or_flood_say_nothing_and_cost_one_bound_together(servers):
    started = [servers(answer) for answer in ("hang", "trickle", "flood")]
    since = time.monotonic()
    found = _sleep_mode.annotate([holder(pid) for pid, _port, _child, _log in started])
    spent = time.monotonic() - since
    assert [h["sleep_answer"] for h in found] == [None, None, None]
    assert all(len(asked(log)) == 1 for _pid, _port, _child, log in started)
    assert spent < _sleep_mode.ASK_S + 0.2, spent
    # The run's time is spent: a later look asks no one.
    late, _port, _child, log = servers("asleep")
    assert _sleep_mode.annotate([holder(late)])[0]["sleep_answer"] is None and asked(log) == []


def test_a_holder_with_no_socket_of_its_own_asks_no_one_though_a_server_beside_it_says_asleep(servers):
    _pid, _port, _child, log = servers("asleep")
    lone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        [found] = _sleep_mode.annotate([holder(lone.pid)])
    finally:
        lone.kill()
        lone.wait()
    assert found["sleep_answer"] is None and asked(log) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a socket root made, in the fd table of another user's process")
def test_a_socket_root_made_is_never_the_server_of_another_users_holder(servers):
    pid, _port, _child, log = servers("asleep", "drop")
    [found] = _sleep_mode.annotate([holder(pid, uid=NOBODY)])
    assert found["sleep_answer"] is None and asked(log) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a network namespace of its own, entered to ask")
def test_a_server_in_a_network_namespace_of_its_own_is_asked_there(servers):
    pid, port, _child, log = servers("asleep", "netns")
    [found] = _sleep_mode.annotate([holder(pid)])
    assert found["sleep_answer"] == {"port": port, "asleep": True} and len(asked(log)) == 1
    # a namespace that is no longer the one read (its PID reused meanwhile) is never entered
    info = os.stat(f"/proc/{pid:d}/ns/net")
    assert _sleep_mode.ask_one("127.0.0.1", port, time.monotonic() + 0.2, f"/proc/{pid:d}/ns/net", (info.st_dev, info.st_ino + 1)) is None
    assert len(asked(log)) == 1
