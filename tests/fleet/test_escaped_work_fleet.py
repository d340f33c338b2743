"""Work that escaped its job (issue 70): a process left behind by an SSH login into a node holds its
GPU; the failure names where it came from (the SSH session, its user and host, as systemd and logind
say) and the command that ends it, through free_gpus.yml and the role in a user's own play, on the
oldest and newest supported ansible-core, over real SSH into the fleet's systemd hosts (pam_systemd
puts an SSH login in session-N.scope there, as on a real node). A user's process that calls itself
sshd is said as that user's. An Apptainer instance a user starts over SSH is named as that instance,
with the command that stops it (Apptainer is not installable here: its starter is the stand-in of
tests/sim/apptainer_starter.c, installed as root's /usr/libexec/apptainer/bin/starter-suid). Works
on a fleet of 2 hosts (ZEROMIB_FLEET_HOSTS=2)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios import PLAYBOOK, TRAINING, fatal_line, host_message

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
from apptainer_starter import EXEC_AS, INSTALLED, build, progname  # noqa: E402

# The oldest ansible-core the collection supports and the newest.
ENDS = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
IDS = [f"ansible-core-{c}" for c, _p in ENDS]
USER = "zmescaped"
HEAD = "GPUs are held by processes that free_gpus_kill: false leaves running (waiting would not free them)"


def play(fleet, core: str, python: str, playbook: str, hosts: list[str], **extra):
    bin_dir = matrix.controller_bin(core, python)
    return fleet.ansible_playbook(playbook, limit=hosts, bin_dir=bin_dir, env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
                                  extra_vars={"free_gpus_kill": False, **extra})


def session_of(fleet, host: str, pid: int) -> str:
    """The login session the kernel places PID in (session-N.scope), as N."""
    text = fleet.ssh(host, f"grep ^0:: /proc/{pid}/cgroup", check=True).stdout
    found = re.search(r"^0::/user\.slice/user-\d+\.slice/session-(\d+)\.scope$", text, re.M)
    assert found, text
    return found.group(1)


def remote_host(fleet, host: str, session: str) -> str:
    """The host logind recorded for the session (sshd's client address)."""
    text = fleet.ssh(host, f"loginctl show-session {session} --property=RemoteHost --value", check=True).stdout.strip()
    assert text, f"logind has no remote host for session {session}"
    return text


def own_login(fleet, host: str, user: str, cmd: str) -> subprocess.CompletedProcess:
    """CMD over an SSH login of its own as USER (not the fleet's multiplexed connection)."""
    argv = ["ControlMaster=no" if arg == "ControlMaster=auto" else "ControlPath=none" if arg.startswith("ControlPath=") else arg
            for arg in fleet.rig.ssh_argv(host, cmd)]
    argv[-2] = argv[-2].replace("root@", f"{user}@", 1)
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def pair(clean_fleet):
    fleet = clean_fleet
    assert len(fleet.names) >= 2, "these tests need 2 hosts"
    return fleet, fleet.names[0], fleet.names[1]


@pytest.mark.parametrize(("core", "python"), ENDS, ids=IDS)
def test_an_ssh_leftover_is_named_with_its_session_and_the_command_that_ends_it_on_both_paths(pair, core, python):
    fleet, busy, idle = pair
    train = fleet.workload(busy, "train", gpus="0", mib=2048)  # setsid nohup over SSH, as root
    session = session_of(fleet, busy, train["pid"])
    origin = (f"SSH session {session} of user root from {remote_host(fleet, busy, session)}, detached from it (parent PID 1, a session of "
              f"its own), outside any job: `loginctl terminate-session {session}` ends it")
    run = play(fleet, core, python, PLAYBOOK, [busy, idle])
    assert run.rc == 2, run
    said = host_message(run, busy)
    assert said.startswith(HEAD + ": GPU 0 ("), said
    assert f"held by pid {train['pid']} train.py [" in said and origin in said, said
    assert "reset" not in said and "reboot" not in said
    # the role in the user's own play: the verdict's one fatal line says the same
    own = play(fleet, core, python, TRAINING, [busy, idle], training_command="true")
    assert own.rc == 2, own
    line = fatal_line(own, busy)
    assert f'"msg": "{busy}: {HEAD}: GPU 0 (' in line and origin in line, line
    # the advice is right: the command ends the session's leftover, and the host is free
    # (from a login of its own: the fleet's multiplexed SSH connection is the session that ends)
    ended = own_login(fleet, busy, "root", f"loginctl terminate-session {session}")
    assert ended.returncode == 0, ended.stderr
    fleet.ssh(busy, f"for i in $(seq 100); do [ -e /proc/{train['pid']} ] || exit 0; sleep 0.05; done; exit 1", check=True)
    again = play(fleet, core, python, PLAYBOOK, [busy, idle])
    assert again.rc == 0, again


def test_a_users_process_that_calls_itself_sshd_is_that_users_ssh_session_never_roots(pair):
    """Attacker: a user logs in and leaves a GPU holder named `sshd: root@pts/0`. Its name decides
    nothing: the session is the user's (the kernel's path, logind's record), and the holder is
    signalled as any of that user's processes when kill is on."""
    fleet, busy, idle = pair
    key = "/root/.ssh/authorized_keys"
    made = fleet.ssh(busy, f"id {USER} >/dev/null 2>&1 || useradd -m {USER}; install -d -m 700 -o {USER} ~{USER}/.ssh; "
                           f"install -m 600 -o {USER} {key} ~{USER}/.ssh/authorized_keys; "
                           # the simulator's contexts, where a user's CUDA process registers its own
                           "mkdir -p /run/nvidia-sim/contexts && chmod 1777 /run/nvidia-sim/contexts")
    assert made.returncode == 0, made.stderr
    # As the user, over SSH (a login of its own): a holder named like root's sshd, detached from the login.
    cmd = ("f=$HOME/escaped-ready; rm -f $f; setsid nohup /usr/local/bin/gpu_holder --gpus 1 --mib 1024 --name sshd --ready-file $f "
           "</dev/null >/dev/null 2>&1 & for i in $(seq 400); do [ -e $f ] && break; sleep 0.025; done; cat $f")
    out = own_login(fleet, busy, USER, cmd)
    assert out.returncode == 0 and '"pid"' in out.stdout, (out.stdout, out.stderr)
    pid = int(re.search(r'"pid":\s*(\d+)', out.stdout).group(1))
    session = session_of(fleet, busy, pid)
    run = fleet.ansible_playbook(PLAYBOOK, limit=[busy, idle], extra_vars={"free_gpus_kill": False})
    assert run.rc == 2, run
    said = host_message(run, busy)
    assert f"held by pid {pid} sshd" in said and f"SSH session {session} of user {USER} from " in said, said
    assert "of user root" not in said and "protected" not in said, said
    # kill on: signalled as any of the user's processes
    freed = fleet.ansible_playbook(PLAYBOOK, limit=[busy, idle])
    assert freed.rc == 0, freed
    assert fleet.ssh(busy, f"test -e /proc/{pid}").returncode != 0


def add_user(fleet, host: str) -> None:
    """USER, who may log in over SSH with the fleet's key, and may run a (simulated) CUDA process."""
    key = "/root/.ssh/authorized_keys"
    made = fleet.ssh(host, f"id {USER} >/dev/null 2>&1 || useradd -m {USER}; install -d -m 700 -o {USER} ~{USER}/.ssh; "
                           f"install -m 600 -o {USER} {key} ~{USER}/.ssh/authorized_keys; "
                           "mkdir -p /run/nvidia-sim/contexts && chmod 1777 /run/nvidia-sim/contexts")
    assert made.returncode == 0, made.stderr


@pytest.fixture
def starter(pair):
    """Root's Apptainer starter (the stand-in) on the first host; removed afterwards."""
    fleet, busy, idle = pair
    with open(build(), "rb") as handle:
        binary = handle.read()
    put = subprocess.run(fleet.rig.ssh_argv(busy, f"mkdir -p {Path(INSTALLED).parent} && cat > {INSTALLED} && chmod 755 {INSTALLED}"),
                         input=binary, capture_output=True, timeout=60, check=False)
    assert put.returncode == 0, put.stderr
    try:
        yield fleet, busy, idle
    finally:
        fleet.ssh(busy, f"rm -f {INSTALLED}")


@pytest.mark.parametrize(("core", "python"), ENDS, ids=IDS)
def test_an_apptainer_instance_left_by_an_ssh_login_is_named_with_its_stop_command_on_both_paths(starter, core, python):
    fleet, busy, idle = starter
    add_user(fleet, busy)
    # As the user, over SSH (a login of its own): `apptainer instance start IMAGE train` execs root's starter so.
    cmd = (f"f=$HOME/instance-ready; rm -f $f; ZEROMIB_STARTER_CMD=\"exec /usr/local/bin/gpu_holder --gpus 0 --mib 2048 --ready-file $f\" "
           f"python3 -c '{EXEC_AS}' {INSTALLED} '{progname(USER, 'train')}' >/dev/null; "
           "for i in $(seq 400); do [ -e $f ] && break; sleep 0.025; done; cat $f")
    out = own_login(fleet, busy, USER, cmd)
    assert out.returncode == 0 and '"pid"' in out.stdout, (out.stdout, out.stderr)
    pid = int(re.search(r'"pid":\s*(\d+)', out.stdout).group(1))
    session = session_of(fleet, busy, pid)
    starter_pid = int(fleet.ssh(busy, f"cut -d' ' -f4 /proc/{pid}/stat", check=True).stdout)
    origin = (f"Apptainer instance train of user {USER} (the name is its user's word; its starter is pid {starter_pid}), started in SSH "
              f"session {session} of user {USER} from {remote_host(fleet, busy, session)}, outside any job: `apptainer instance stop train` as "
              f"user {USER} (root: `apptainer instance stop -u {USER} train`) ends it")
    run = play(fleet, core, python, PLAYBOOK, [busy, idle])
    assert run.rc == 2, run
    said = host_message(run, busy)
    assert said.startswith(HEAD + ": GPU 0 (") and f"held by pid {pid} " in said and origin in said, said
    assert "reset" not in said and "reboot" not in said
    own = play(fleet, core, python, TRAINING, [busy, idle], training_command="true")
    assert own.rc == 2, own
    line = fatal_line(own, busy)
    assert f'"msg": "{busy}: {HEAD}: GPU 0 (' in line and origin in line, line
    # kill on: the instance's process is signalled as any of the user's, and its starter ends with it
    freed = fleet.ansible_playbook(PLAYBOOK, limit=[busy, idle])
    assert freed.rc == 0, freed
    fleet.ssh(busy, f"for i in $(seq 100); do [ -e /proc/{starter_pid} ] || exit 0; sleep 0.05; done; exit 1", check=True)
