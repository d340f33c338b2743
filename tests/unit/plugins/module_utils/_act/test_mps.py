# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""MPS: which server is quit, which is refused as spanning, where its control pipe is, and that
quit is written only into a FIFO. The daemon itself is in tests/integration/test_mps_release.py."""

from __future__ import annotations

import os

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc


ROOT = {"uid": 0, "exe_owner": 0, "exe_verified": True}
USER = 4242


def server(gpus, pid=40, ppid=30, uid=0):
    return dict(ROOT, uid=uid, pid=pid, ppid=ppid, name="nvidia-cuda-mps", argv0="nvidia-cuda-mps-server", exe="nvidia-cuda-mps-server",
                exe_path="/usr/bin/nvidia-cuda-mps-server", cmdline="nvidia-cuda-mps-server", gpu_indexes=gpus, candidate_gpu_indexes=[])


def control(pid=30, uid=0):
    return dict(ROOT, uid=uid, pid=pid, ppid=1, name="nvidia-cuda-mps", argv0="nvidia-cuda-mps-control", exe="nvidia-cuda-mps-control",
                exe_path="/usr/bin/nvidia-cuda-mps-control", cmdline="nvidia-cuda-mps-control -d", gpu_indexes=[])


def client(pid, gpus):
    return {"pid": pid, "name": "python3", "argv0": "python3", "exe": "python3.12", "cmdline": "python3 serve.py", "gpu_indexes": gpus}


def mps_tree(root, control_uid=0, environ=b"PATH=/usr/bin\0CUDA_MPS_PIPE_DIRECTORY=/var/run/mps\0"):
    """Root's control daemon 30 (its environment: `environ`) in a fake /proc."""
    fakeproc.write_process(root, 30, comm="nvidia-cuda-mps", argv=("nvidia-cuda-mps-control", "-d"), exe="/usr/bin/nvidia-cuda-mps-control",
                           uid=control_uid)
    with open(os.path.join(str(root), "30", "environ"), "wb") as handle:
        handle.write(environ)
    return str(root)


def test_servers_are_quit_clients_signalled_and_the_control_daemon_left_alone(tmp_path):
    proc = mps_tree(tmp_path)
    left, servers = _mps.plan([client(50, [0]), server([0, 1]), control()], proc)
    assert [h["pid"] for h in left] == [50] and [h["pid"] for h in servers] == [40]


def test_comm_alone_does_not_make_an_mps_server():
    # Both MPS programs read `nvidia-cuda-mps` in comm (15 characters).
    assert not _mps.is_server(control()) and _mps.is_control(control())


def test_users_processes_named_like_mps_are_ordinary_holders(tmp_path):
    """A name decides nothing: uid 4242's `nvidia-cuda-mps-server` and `nvidia-cuda-mps-control`
    (also a root-owned python3 from /usr/bin, as `exec -a` gives) are signalled like any holder."""
    proc = mps_tree(tmp_path)
    posed_server = server([1], pid=60, ppid=30, uid=USER)
    posed_control = dict(control(pid=61, uid=USER), exe="python3", exe_path="/usr/bin/python3", gpu_indexes=[1])
    assert not _mps.is_server(posed_server) and not _mps.is_control(posed_control)
    left, servers = _mps.plan([posed_server, posed_control], proc)
    assert [h["pid"] for h in left] == [60, 61] and servers == []
    # Root's name from a user's own executable: not vouched either.
    assert not _mps.is_control(dict(control(), exe_owner=USER)) and not _mps.is_server(dict(server([0]), exe_path="/home/u/nvidia-cuda-mps-server"))


def test_a_server_under_no_vouched_control_daemon_is_signalled_not_quit(tmp_path):
    proc = mps_tree(tmp_path, control_uid=USER)
    left, servers = _mps.plan([server([0])], proc)
    assert [h["pid"] for h in left] == [40] and servers == []


def test_pipe_directory_comes_from_the_vouched_control_daemon_else_the_default(tmp_path):
    proc = mps_tree(tmp_path)
    fakeproc.write_process(tmp_path, 40, comm="nvidia-cuda-mps", ppid=30, argv=("nvidia-cuda-mps-server",))
    with open(os.path.join(proc, "40", "environ"), "wb") as handle:
        handle.write(b"CUDA_MPS_PIPE_DIRECTORY=/home/u/posed\0")
    assert _mps.pipe_directory(server([0]), proc) == "/var/run/mps"
    # No daemon above it: the default, never the server's (or a client's) own environment.
    assert _mps.pipe_directory(server([0], pid=40, ppid=1), proc) == "/tmp/nvidia-mps"
    other = str(tmp_path / "other")
    mps_tree(other, control_uid=USER)
    assert _mps.pipe_directory(server([0]), other) == "/tmp/nvidia-mps"
    assert _mps.pipe_directory(server([0]), mps_tree(tmp_path / "plain", environ=b"PATH=/usr/bin\0")) == "/tmp/nvidia-mps"


def test_a_daemon_with_a_server_of_an_unselected_gpu_is_spanning(tmp_path):
    proc = mps_tree(tmp_path)
    selected_server, other_server = server([0]), server([1], pid=41)
    [(daemon, outside)] = _mps.spanning_daemons([selected_server], [selected_server, other_server, control()], [0], proc)
    assert daemon["pid"] == 30 and daemon["gpu_indexes"] == [0, 1] and outside == [1]
    assert _mps.spanning_daemons([selected_server], [selected_server, other_server], [0, 1], proc) == []
    # A user's look-alike server under root's daemon is no server of it.
    posed = server([1], pid=42, uid=USER)
    assert _mps.spanning_daemons([selected_server], [selected_server, posed], [0], proc) == []


def test_a_replan_after_stops_drops_the_control_daemon_and_the_planned_servers():
    kept = _mps.without_daemons([client(50, [0]), server([0]), control(), dict(control(pid=61, uid=USER), gpu_indexes=[0])], [server([0])])
    assert [h["pid"] for h in kept] == [50, 61]


def test_quit_goes_only_into_a_fifo_never_through_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep\n")
    link = tmp_path / "control"
    link.symlink_to(target)
    assert _mps.write_to_fifo(str(link), "quit\n") is not None and target.read_text() == "keep\n"
    assert "is not a FIFO" in _mps.write_to_fifo(str(target), "quit\n") and target.read_text() == "keep\n"
    fifo = tmp_path / "fifo"
    os.mkfifo(str(fifo))
    assert "no control daemon reads" in _mps.write_to_fifo(str(fifo), "quit\n")
    reader = os.open(str(fifo), os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert _mps.write_to_fifo(str(fifo), "quit\n") is None and os.read(reader, 100) == b"quit\n"
    finally:
        os.close(reader)
