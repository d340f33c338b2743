# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""MPS: which server is quit, which is refused as spanning, where its control pipe is, and that
quit is written only into a FIFO. The daemon itself is in tests/integration/test_mps_release.py."""

from __future__ import annotations

import os

from ansible_collections.zeromib.gpu.plugins.module_utils import _mps
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc


def server(gpus, pid=40, ppid=30):
    return {"pid": pid, "ppid": ppid, "name": "nvidia-cuda-mps", "argv0": "nvidia-cuda-mps-server", "exe": "nvidia-cuda-mps-server",
            "cmdline": "nvidia-cuda-mps-server", "gpu_indexes": gpus, "candidate_gpu_indexes": []}


def client(pid, gpus):
    return {"pid": pid, "name": "python3", "argv0": "python3", "exe": "python3.12", "cmdline": "python3 serve.py", "gpu_indexes": gpus}


def test_servers_are_quit_clients_signalled_and_the_control_daemon_left_alone():
    control = {"pid": 30, "name": "nvidia-cuda-mps", "argv0": "nvidia-cuda-mps-control", "exe": "nvidia-cuda-mps-control",
               "cmdline": "nvidia-cuda-mps-control -d", "gpu_indexes": []}
    left, servers = _mps.plan([client(50, [0]), server([0, 1]), control])
    assert [h["pid"] for h in left] == [50] and [h["pid"] for h in servers] == [40]


def test_comm_alone_does_not_make_an_mps_server():
    # Both MPS programs read `nvidia-cuda-mps` in comm (15 characters).
    assert not _mps.is_server({"name": "nvidia-cuda-mps", "cmdline": "nvidia-cuda-mps-control -d", "argv0": "nvidia-cuda-mps-control"})
    assert _mps.is_control({"name": "nvidia-cuda-mps", "cmdline": "nvidia-cuda-mps-control -d", "argv0": "nvidia-cuda-mps-control"})


def test_pipe_directory_comes_from_the_control_daemon_else_the_default(tmp_path):
    fakeproc.write_process(tmp_path, 30, comm="nvidia-cuda-mps", argv=("nvidia-cuda-mps-control", "-d"), exe="/usr/bin/nvidia-cuda-mps-control")
    with open(os.path.join(str(tmp_path), "30", "environ"), "wb") as handle:
        handle.write(b"PATH=/usr/bin\0CUDA_MPS_PIPE_DIRECTORY=/var/run/mps\0")
    fakeproc.write_process(tmp_path, 40, comm="nvidia-cuda-mps", ppid=30, argv=("nvidia-cuda-mps-server",))
    assert _mps.pipe_directory(server([0]), str(tmp_path)) == "/var/run/mps"
    assert _mps.pipe_directory(server([0], pid=41, ppid=1), str(tmp_path)) == "/tmp/nvidia-mps"


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
