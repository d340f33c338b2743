# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""MPS clients get `terminate_client <server PID> <client PID>` through their server's vouched
control daemon before any signal (issue 57). Which targets are clients is the daemon's answer to
`get_client_list`, asked through the daemon's own client program; here a stand-in program (a
shell script) answers and records what it was sent. The simulated daemon runs it in
tests/integration/test_mps_release.py."""

from __future__ import annotations

import os
import subprocess

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils._act.test_mps import USER, client, control, mps_tree, server

CONTROL_PROGRAM = """#!/bin/sh
# Stands for nvidia-cuda-mps-control: records each command with the pipe directory it was given.
while read -r line; do
  echo "$CUDA_MPS_PIPE_DIRECTORY $line" >> {log}
  case "$line" in
    "get_client_list 40") printf '{clients}' ;;
    get_client_list*) ;;
  esac
done
exit {rc}
"""


@pytest.fixture
def program(tmp_path):
    """make(clients="50\\n51\\n", rc=0) -> (which, the log of what the program was sent)."""
    log = tmp_path / "sent.log"

    def make(clients="50\n", rc=0):
        path = tmp_path / "nvidia-cuda-mps-control"
        path.write_text(CONTROL_PROGRAM.format(log=log, clients=clients.replace("\n", "\\n"), rc=rc))
        path.chmod(0o755)
        return (lambda name: str(path) if name == _mps.CONTROL else None), log

    return make


@pytest.fixture
def same_namespace(monkeypatch):
    # The fake /proc has no ns/pid links: the daemon counts as living in the module's PID namespace.
    monkeypatch.setattr(_mps, "same_pid_namespace", lambda pid, proc="/proc": True)


def sent(log):
    return log.read_text().splitlines() if log.exists() else []


def test_the_daemons_listed_clients_get_terminate_client_in_one_call(tmp_path, program, same_namespace):
    proc = mps_tree(tmp_path / "proc")
    which, log = program(clients="50\n51\n77\n")
    holders = [server([0]), control(), client(50, [0]), client(51, [0]), client(52, [0])]
    # 52 uses the GPU outside MPS; 77 is a client of the server that this run does not free.
    done = _mps.terminate_clients(holders, [client(50, [0]), client(51, [0]), client(52, [0])], proc, which)
    assert [(e["pid"], e["server_pid"], e["pipe_directory"]) for e in done["terminated_mps_clients"]] == [(50, 40, "/var/run/mps"),
                                                                                                          (51, 40, "/var/run/mps")]
    program_path = which(_mps.CONTROL)
    assert [e["how"] for e in done["terminated_mps_clients"]] == [f"echo terminate_client 40 50 | {program_path}",
                                                                  f"echo terminate_client 40 51 | {program_path}"]
    assert sent(log) == ["/var/run/mps get_client_list 40", "/var/run/mps terminate_client 40 50", "/var/run/mps terminate_client 40 51"]
    assert done["warnings"] == []


def test_check_mode_asks_the_client_list_and_terminates_nobody(tmp_path, program, same_namespace):
    proc = mps_tree(tmp_path / "proc")
    which, log = program()
    planned, warnings = _mps.client_terminations([server([0]), client(50, [0])], [client(50, [0])], proc, which)
    assert [(e["pid"], e["how"]) for e in planned] == [(50, None)] and warnings == []
    assert sent(log) == ["/var/run/mps get_client_list 40"]


def test_servers_and_control_daemons_are_never_terminated_as_clients_a_users_look_alike_may_be(tmp_path, program, same_namespace):
    proc = mps_tree(tmp_path / "proc")
    which, log = program(clients="40\n30\n60\n")
    posed = server([0], pid=60, ppid=1, uid=USER)  # uid 4242's job named nvidia-cuda-mps-server: an ordinary holder
    done = _mps.terminate_clients([server([0]), control(), posed], [server([0]), control(), posed], proc, which)
    # The look-alike is an ordinary target, and the daemon lists it: a client like any other.
    assert [e["pid"] for e in done["terminated_mps_clients"]] == [60]
    assert "terminate_client 40 40" not in " ".join(sent(log)) and "terminate_client 40 30" not in " ".join(sent(log))


def test_a_server_the_daemon_started_for_a_users_clients_is_asked_about_not_terminated(tmp_path, program, same_namespace):
    """The daemon starts a server with its clients' uid: uid 4242's server 41 under root's daemon 30
    is a server by its parent (a user cannot choose it), though the identity rule does not vouch for
    the process itself."""
    proc = mps_tree(tmp_path / "proc")
    path = tmp_path / "nvidia-cuda-mps-control"
    log = tmp_path / "sent.log"
    path.write_text(f'#!/bin/sh\nwhile read -r line; do echo "$line" >> {log}; case "$line" in "get_client_list 41") echo 50;; esac; done\n')
    path.chmod(0o755)
    users_server = server([0], pid=41, ppid=30, uid=USER)
    assert not _mps.is_server(users_server) and _mps.served_by_daemons([control(), users_server]) == [users_server]
    done = _mps.terminate_clients([control(), users_server, client(50, [0])], [users_server, client(50, [0])], proc, lambda name: str(path))
    assert [(e["pid"], e["server_pid"]) for e in done["terminated_mps_clients"]] == [(50, 41)]
    assert sent(log) == ["get_client_list 41", "terminate_client 41 50"]


def test_no_vouched_daemon_or_another_pid_namespace_means_no_question_and_no_terminate(tmp_path, program, monkeypatch):
    which, log = program()
    # A user's daemon above the server: not vouched, never asked.
    users = mps_tree(tmp_path / "users", control_uid=USER)
    monkeypatch.setattr(_mps, "same_pid_namespace", lambda pid, proc="/proc": True)
    assert _mps.terminate_clients([server([0]), client(50, [0])], [client(50, [0])], users, which)["terminated_mps_clients"] == []
    # Root's daemon in another PID namespace: its PIDs are not ours.
    monkeypatch.setattr(_mps, "same_pid_namespace", lambda pid, proc="/proc": False)
    roots = mps_tree(tmp_path / "roots")
    assert _mps.terminate_clients([server([0]), client(50, [0])], [client(50, [0])], roots, which)["terminated_mps_clients"] == []
    assert sent(log) == []


def test_without_the_control_program_the_clients_are_signalled_as_before_and_the_run_says_so(tmp_path, same_namespace):
    proc = mps_tree(tmp_path / "proc")
    done = _mps.terminate_clients([server([0]), client(50, [0])], [client(50, [0])], proc, lambda name: None)
    assert done["terminated_mps_clients"] == []
    assert done["warnings"] == ["MPS clients are signalled without terminate_client first: nvidia-cuda-mps-control was not found"]
    # No MPS server among the holders: nothing to ask, nothing said.
    assert _mps.terminate_clients([client(50, [0])], [client(50, [0])], proc, lambda name: None) == {"terminated_mps_clients": [], "warnings": []}


def test_a_failed_terminate_client_is_said_and_the_client_is_still_signalled_after(tmp_path, program, same_namespace):
    proc = mps_tree(tmp_path / "proc")
    which, _log = program(rc=3)
    done = _mps.terminate_clients([server([0]), client(50, [0])], [client(50, [0])], proc, which)
    # get_client_list failed too (rc 3): nothing is known of the clients, so nothing is terminated.
    assert done["terminated_mps_clients"] == [] and "get_client_list failed" in done["warnings"][0]


def test_a_terminate_client_that_fails_after_a_good_client_list_keeps_the_entry_without_how(tmp_path, same_namespace):
    proc = mps_tree(tmp_path / "proc")
    path = tmp_path / "nvidia-cuda-mps-control"
    path.write_text('#!/bin/sh\nread -r line\ncase "$line" in get_client_list*) echo 50; exit 0;; esac\necho "Server 40 not found"; exit 1\n')
    path.chmod(0o755)
    done = _mps.terminate_clients([server([0]), client(50, [0])], [client(50, [0])], proc, lambda name: str(path))
    assert [(e["pid"], e["how"]) for e in done["terminated_mps_clients"]] == [(50, None)]
    assert done["warnings"] == [f"MPS client pid 50: terminate_client through its control daemon failed ({path} (rc 1): Server 40 not found); "
                                "it is signalled as before"]


def test_the_pid_namespace_check_reads_the_kernels_links(tmp_path):
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert _mps.same_pid_namespace(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not _mps.same_pid_namespace(child.pid)  # gone: unknown, so no
    assert not _mps.same_pid_namespace(os.getpid(), str(tmp_path))  # a fake /proc: unknown, so no


def test_client_lists_are_read_as_pids_only():
    assert _mps.parse_pids("50\n51\nServer 40 not found\n 52 \n") == [50, 51, 40, 52]
