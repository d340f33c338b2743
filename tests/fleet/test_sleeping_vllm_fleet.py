"""A sleeping vLLM (issue 70): a GPU holder whose own server answers vLLM's `GET /is_sleeping` with
`{"is_sleeping": true}` is named with that answer, quoted as its server's word ("its server says it
is asleep: vLLM's sleep mode keeps its CUDA context, N MiB still held"), and freed or refused exactly
as before: through free_gpus.yml and the role in a user's own play, on the oldest and newest
supported ansible-core, over real SSH into the fleet's systemd hosts, with kill on and off.

The attackers first: a server that hangs, one that floods, one whose socket root made (in the fd
table of another user's holder), a holder with no socket beside a server that says asleep, and a
server in a network namespace of its own (asked there). Works on a fleet of 1 host."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from scenarios import PLAYBOOK, TRAINING, fatal_line, host_message, summary_lines, summary_row

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

ENDS = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
IDS = [f"ansible-core-{c}" for c, _p in ENDS]
USER = "zmsleeper"
HEAD = "GPUs are held by processes that free_gpus_kill: false leaves running (waiting would not free them)"
ASLEEP = "its server says it is asleep: vLLM's sleep mode keeps its CUDA context, {mib} MiB still held"
PATH = "PATH=/usr/local/lib/nvidia-sim-argv0:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def play(fleet, playbook: str, hosts: list[str], core: str | None = None, python: str | None = None, **extra):
    if core is None:
        return fleet.ansible_playbook(playbook, limit=hosts, extra_vars=extra)
    bin_dir = matrix.controller_bin(core, python)
    return fleet.ansible_playbook(playbook, limit=hosts, bin_dir=bin_dir, env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
                                  extra_vars=extra)


def about(said: str, pid: int) -> str:
    """What a failure says of one holder: from `pid N ` to its state."""
    found = re.search(rf"pid {pid:d} .*?state [A-Za-z]\)", said)
    assert found, (pid, said)
    return found.group(0)


def serve(fleet, host: str, tag: str, gpu: int, mib: int = 2048, answer: str = "asleep", port: int = 8000, v1: bool = False,
          prefix: str = "", drop_to: int | None = None) -> dict:
    """A GPU holder whose server answers GET /is_sleeping as ANSWER says (tests/sim/gpu_holder),
    started over SSH (setsid nohup): `v1` is vLLM V1's shape (the API server `vllm` listens, its
    VLLM::EngineCore child holds the GPU); `prefix` runs it under a command (`unshare --net ...`).
    Returns gpu_holder's ready record, with `holder` (the GPU's holder) and `log` (its requests)."""
    log, ready = f"/tmp/sleep-{tag}.log", f"/tmp/sleep-{tag}.ready"
    shape = "--name vllm --workers 1 --worker-name VLLM::EngineCore" if v1 else "--name vllm"
    drop = f"--drop-to {drop_to:d}" if drop_to is not None else ""
    cmd = (f"rm -f {ready}; : > {log}; chmod 666 {log}; {PATH} setsid nohup {prefix} /usr/local/bin/gpu_holder --gpus {gpu:d} --mib {mib:d} "
           f"{shape} --http-port {port:d} --http-answer {answer} --http-log {log} {drop} --ready-file {ready} </dev/null >/dev/null 2>&1 & "
           f"for i in $(seq 400); do [ -e {ready} ] && break; sleep 0.025; done; cat {ready}")
    out = fleet.ssh(host, cmd, check=True).stdout
    record = json.loads(out.strip().splitlines()[-1])
    record["holder"] = record["workers"][0] if v1 else record["pid"]
    record["log"] = log
    return record


def requests(fleet, host: str, log: str) -> list[str]:
    return fleet.ssh(host, f"cat {log}", check=True).stdout.splitlines()


@pytest.fixture
def busy(clean_fleet):
    return clean_fleet, clean_fleet.names[0]


@pytest.mark.parametrize(("core", "python"), ENDS, ids=IDS)
def test_a_sleeping_vllm_is_named_with_its_servers_word_and_freed_as_before_on_both_paths(busy, core, python):
    fleet, host = busy
    server = serve(fleet, host, "v1", gpu=0, v1=True)
    note = ASLEEP.format(mib=2048)
    run = play(fleet, PLAYBOOK, [host], core, python, free_gpus_kill=False)
    assert run.rc == 2, run
    said = host_message(run, host)
    assert requests(fleet, host, server["log"]) == ["GET /is_sleeping HTTP/1.0"]  # once a run, whatever its looks
    assert said.startswith(HEAD + ": GPU 0 ("), said
    holder = about(said, server["holder"])
    # comm: 15 bytes of its name
    assert holder.startswith(f"pid {server['holder']} VLLM::EngineCor [") and note in holder, said
    assert "reset" not in said and "reboot" not in said
    # the role in the user's own play: the verdict's one fatal line says the same
    own = play(fleet, TRAINING, [host], core, python, free_gpus_kill=False, training_command="true")
    assert own.rc == 2, own
    line = fatal_line(own, host)
    assert requests(fleet, host, server["log"]) == ["GET /is_sleeping HTTP/1.0"] * 2
    assert f'"msg": "{host}: {HEAD}: GPU 0 (' in line and note in line, line
    # kill on: freed as any holder (its word decides nothing), and the summary quotes it
    freed = play(fleet, PLAYBOOK, [host], core, python)
    assert freed.rc == 0, freed
    row = summary_row(summary_lines(freed), host)
    assert row.startswith("freed") and f"killed pid {server['holder']} VLLM::EngineCor: its server said it was asleep" in row, row
    assert fleet.ssh(host, f"test -e /proc/{server['holder']}").returncode != 0


def test_servers_that_hang_flood_or_are_not_the_holders_own_say_nothing_and_one_in_its_own_netns_is_asked_there(busy):
    fleet, host = busy
    made = fleet.ssh(host, f"id {USER} >/dev/null 2>&1 || useradd -M {USER}; "
                           # the simulator's contexts, where a user's CUDA process registers its own
                           "mkdir -p /run/nvidia-sim/contexts && chmod 1777 /run/nvidia-sim/contexts; "
                           "mkdir -p /tmp/sleep-www && echo '{\"is_sleeping\": true}' > /tmp/sleep-www/is_sleeping")
    assert made.returncode == 0, made.stderr
    uid = int(fleet.ssh(host, f"id -u {USER}", check=True).stdout)
    hang = serve(fleet, host, "hang", gpu=0, answer="hang", port=8001)
    flood = serve(fleet, host, "flood", gpu=1, answer="flood", port=8002)
    # root made the socket, then the holder became another user: root's socket, never its server
    rooted = serve(fleet, host, "rooted", gpu=2, port=8003, drop_to=uid)
    # a holder with no socket, beside a server (not its kin) that says asleep on 8004
    lone = serve(fleet, host, "lone", gpu=3, port=0)
    web = fleet.ssh(host, "setsid nohup python3 -m http.server 8004 --bind 127.0.0.1 --directory /tmp/sleep-www </dev/null "
                          ">/tmp/sleep-web.log 2>&1 & echo $!; for i in $(seq 200); do "
                          "python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8004))' 2>/dev/null && break; sleep 0.025; done; "
                          ": > /tmp/sleep-web.log", check=True).stdout.split()[0]
    # a server in a network namespace of its own (a container's: the fleet's root may not set up a
    # network namespace's loopback without a user namespace of its own): asked there, over its loopback
    own_netns = "unshare --user --map-root-user --net sh -c 'ip link set lo up && exec \"$0\" \"$@\"'"
    netns = serve(fleet, host, "netns", gpu=4, mib=3072, port=8005, prefix=own_netns)
    try:
        run = play(fleet, PLAYBOOK, [host], free_gpus_kill=False)
        assert run.rc == 2, run
        said = host_message(run, host)
        assert said.startswith(HEAD), said
        for quiet in (hang, flood, rooted, lone):
            assert "asleep" not in about(said, quiet["holder"]), said
        assert ASLEEP.format(mib=3072) in about(said, netns["holder"]), said
        # the hanging and flooding servers were asked once, the others never
        assert requests(fleet, host, hang["log"]) == ["GET /is_sleeping HTTP/1.0"]
        assert requests(fleet, host, flood["log"]) == ["GET /is_sleeping HTTP/1.0"]
        assert requests(fleet, host, rooted["log"]) == []
        assert "is_sleeping" not in fleet.ssh(host, "cat /tmp/sleep-web.log", check=True).stdout
        # kill on: every one of them freed as before
        freed = play(fleet, PLAYBOOK, [host])
        assert freed.rc == 0, freed
    finally:
        fleet.ssh(host, f"kill {int(web):d}")
