# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_origin: where a holder outside every job came from, named only from the kernel's cgroup path,
systemd's confirmation of the unit, logind's root-owned record and the kernel's parent and session
ids; never from the process's name, command line or a file a user wrote."""

from __future__ import annotations

import os
import pwd

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _words
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _apptainer
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _origin
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fakeproc import write_process

SESSION_5 = "0::/user.slice/user-1000.slice/session-5.scope\n"
# What logind writes for an SSH login (systemd 252, the fleet's): only the keys read here matter.
SSH_RECORD = "# This is private data. Do not parse.\nUID=1000\nUSER=alice\nACTIVE=1\nSTATE=closing\nREMOTE=1\nTYPE=tty\nCLASS=user\n" \
             "SCOPE=session-5.scope\nREMOTE_HOST=10.0.0.9\nSERVICE=sshd\nLEADER=700\n"


def holder(pid, cgroup="/user.slice/user-1000.slice/session-5.scope", unit="session-5.scope", **extra):
    return dict({"pid": pid, "name": "python3", "cmdline": "python3 train.py", "uid": 1000, "user": "alice", "state": "S",
                 "gpu_indexes": [0], "protected": False, "cgroup": cgroup, "unit": unit}, **extra)


def sessions(tmp_path, text=SSH_RECORD, number="5", mode=0o644, owner=0):
    directory = tmp_path / "run" / "systemd" / "sessions"
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / number
    record.write_text(text)
    os.chmod(record, mode)
    os.chown(record, owner, owner)
    return str(directory)


def test_an_ssh_leftover_is_named_with_its_session_its_user_and_the_command_that_ends_it(tmp_path):
    proc = tmp_path / "proc"
    write_process(proc, 812, ppid=1, uid=1000, cgroup=SESSION_5)  # setsid: its own session, parent 1
    [found] = _origin.annotate([holder(812)], str(proc), sessions(tmp_path))
    assert found["origin"] == {"kind": "ssh_session", "session": "5", "stop": "loginctl terminate-session 5",
                               "text": "SSH session 5 of user alice from 10.0.0.9, detached from it (parent PID 1, a session of its own), "
                                       "outside any job"}
    said = _words.describe_holder(found)
    assert "(SSH session 5 of user alice from 10.0.0.9, detached from it" in said
    assert said.endswith("outside any job: `loginctl terminate-session 5` ends it, state S)"), said
    assert "unit session-5.scope" not in said


def test_a_session_holder_still_under_its_shell_is_not_said_detached(tmp_path):
    proc = tmp_path / "proc"
    write_process(proc, 812, ppid=700, uid=1000, cgroup=SESSION_5)
    [found] = _origin.annotate([holder(812)], str(proc), sessions(tmp_path))
    assert found["origin"]["text"] == "SSH session 5 of user alice from 10.0.0.9, outside any job"


def test_a_session_that_is_not_ssh_says_its_pam_service_and_an_unreadable_record_says_only_the_session(tmp_path):
    proc = tmp_path / "proc"
    write_process(proc, 812, ppid=700, uid=1000, cgroup=SESSION_5)
    local = sessions(tmp_path, SSH_RECORD.replace("SERVICE=sshd", "SERVICE=login"))
    assert _origin.annotate([holder(812)], str(proc), local)[0]["origin"]["text"] == "login session 5 (login) of user alice, outside any job"
    missing = str(tmp_path / "nowhere")
    found = _origin.annotate([holder(812)], str(proc), missing)[0]["origin"]
    assert found["text"] == "login session 5 of uid 1000, outside any job" and found["stop"] == "loginctl terminate-session 5"


def test_a_record_a_user_could_write_or_one_of_another_uid_names_no_ssh_session(tmp_path):
    """logind's record counts only as root's file that no one else may write, for the uid the kernel's path names."""
    proc = tmp_path / "proc"
    write_process(proc, 812, ppid=700, uid=1000, cgroup=SESSION_5)
    for directory in (sessions(tmp_path, owner=1000), sessions(tmp_path, mode=0o666), sessions(tmp_path, SSH_RECORD.replace("UID=1000", "UID=0"))):
        text = _origin.annotate([holder(812)], str(proc), directory)[0]["origin"]["text"]
        assert text == "login session 5 of uid 1000, outside any job", text


def test_a_scope_a_user_made_in_their_own_manager_is_no_login_session(tmp_path):
    """Attacker: `systemd-run --user --scope --unit session-99` puts a process in a directory named like
    logind's below user@1000.service; systemd confirms the delegating unit, never session-99.scope,
    and a path without systemd's confirmation names nothing, whatever the process calls itself."""
    proc = tmp_path / "proc"
    fake = "/user.slice/user-1000.slice/user@1000.service/app.slice/session-99.scope"
    write_process(proc, 812, comm="sshd", argv=("sshd: root@pts/0",), ppid=1, uid=1000, cgroup=f"0::{fake}\n")
    records = sessions(tmp_path, SSH_RECORD.replace("UID=1000", "UID=1000").replace("SCOPE=session-5", "SCOPE=session-99"), number="99")
    [mine] = _origin.annotate([holder(812, cgroup=fake, unit="user@1000.service")], str(proc), records)
    assert mine["origin"] is None
    [unconfirmed] = _origin.annotate([holder(812, cgroup="/user.slice/user-1000.slice/session-99.scope", unit=None)], str(proc), records)
    assert unconfirmed["origin"]["kind"] == "detached" and "SSH" not in unconfirmed["origin"]["text"]


def test_a_detached_process_outside_any_unit_is_said_so_and_its_environment_is_quoted_as_its_own(tmp_path):
    proc = tmp_path / "proc"
    write_process(proc, 812, ppid=1, uid=1000, cgroup="0::/\n")
    (proc / "812" / "environ").write_bytes(b"TORCHELASTIC_RUN_ID=r1\0RANK=3\0WORLD_SIZE=16\0")
    [found] = _origin.annotate([holder(812, cgroup="/", unit=None)], str(proc), str(tmp_path / "none"))
    assert found["origin"]["text"] == ("a process of user alice started outside any job (parent PID 1, own session); its environment says it is "
                                       "rank 3 of 16 of a torchrun run (its agent is gone: a detached multi-node rank)")
    assert found["origin"]["stop"] == "kill 812"
    (proc / "812" / "environ").write_bytes(b"TORCHELASTIC_RUN_ID=r1\0RANK=3\x1b[2J\0WORLD_SIZE=16\0")
    assert "rank" not in _origin.annotate([holder(812, cgroup="/", unit=None)], str(proc), "/nonexistent")[0]["origin"]["text"]


def test_what_a_job_unit_container_or_guest_answers_for_has_no_origin_and_neither_has_a_protected_process(tmp_path):
    proc = tmp_path / "proc"
    write_process(proc, 812, ppid=1, uid=1000, cgroup="0::/\n4:freezer:/slurm/uid_1000/job_42/step_0\n")
    write_process(proc, 813, ppid=1, uid=1000, cgroup="0::/system.slice/vllm.service\n")
    write_process(proc, 814, ppid=1, uid=1000, cgroup=SESSION_5)
    found = _origin.annotate([holder(812, cgroup="/", unit=None), holder(813, cgroup="/system.slice/vllm.service", unit="vllm.service"),
                              holder(814, container="4f3c"), holder(814, guest={"kind": "lxc"}), holder(814, protected=True)],
                             str(proc), sessions(tmp_path))
    assert [h["origin"] for h in found] == [None] * 5


STARTER = "/usr/libexec/apptainer/bin/starter-suid"


def instance_tree(proc, starter_exe=STARTER, starter_owner=0, progname="Apptainer instance: alice [train]"):
    """An instance as apptainer leaves it: its starter (argv[0] its progname, detached, parent 1) and
    the container's process below it, holding the GPU, in the SSH session it was started from."""
    write_process(proc, 811, comm="starter-suid", argv=(progname,), ppid=1, uid=1000, cgroup=SESSION_5, exe=starter_exe, exe_owner=starter_owner)
    write_process(proc, 812, ppid=811, uid=1000, cgroup=SESSION_5)


def test_an_apptainer_instance_is_named_from_roots_starter_with_its_name_quoted_and_its_stop_command(tmp_path):
    proc = tmp_path / "proc"
    instance_tree(proc)
    # The user is the starter's real uid as this machine names it (the kernel's), not argv[0]'s "alice".
    try:
        user = pwd.getpwuid(1000).pw_name
    except KeyError:
        user = None
    who = f"user {user}" if user else "uid 1000"
    [found] = _origin.annotate([holder(812, ppid=811)], str(proc), sessions(tmp_path))
    assert found["origin"] == {
        "kind": "apptainer_instance", "session": "5", "stop": "apptainer instance stop train", "user": user,
        "text": f"Apptainer instance train of {who} (the name is its user's word; its starter is pid 811), started in SSH session 5 of "
                "user alice from 10.0.0.9, outside any job"}
    said = _words.describe_holder(found)
    root = f" as user {user} (root: `apptainer instance stop -u {user} train`)" if user else " run as its user"
    assert said.endswith(f"outside any job: `apptainer instance stop train`{root} ends it, state S)"), said


def test_a_users_own_starter_suid_is_no_apptainer_instance(tmp_path):
    """Attacker: a user's own binary named starter-suid (in her home, or hers in a system directory),
    its argv[0] apptainer's progname: her program, so no instance is named and no command advised."""
    proc = tmp_path / "proc"
    for exe, owner in (("/home/alice/bin/starter-suid", 1000), (STARTER, 1000), ("/home/alice/apptainer/bin/starter-suid", 0)):
        instance_tree(proc, starter_exe=exe, starter_owner=owner, progname="Apptainer instance: root [system-vllm]")
        [found] = _origin.annotate([holder(812, ppid=811)], str(proc), sessions(tmp_path))
        assert found["origin"]["kind"] == "ssh_session" and "instance" not in found["origin"]["text"], (exe, owner, found["origin"])


def test_a_starter_whose_argv0_is_no_progname_names_no_instance(tmp_path):
    proc = tmp_path / "proc"
    for progname in ("Apptainer instance: alice [tr ain]", "Apptainer instance: alice [`reboot`]", "starter-suid"):
        instance_tree(proc, progname=progname)
        [found] = _origin.annotate([holder(812, ppid=811)], str(proc), sessions(tmp_path))
        assert found["origin"]["kind"] == "ssh_session", (progname, found["origin"])


def test_the_walks_up_the_ancestors_share_one_deadline_and_read_each_ancestor_once(tmp_path, monkeypatch):
    """Attacker: many holders below long chains of processes that do not answer (in execve on her
    stalled file system): the run's walks stop at one deadline for all of them, and an ancestor
    shared by several holders is read once."""
    proc = tmp_path / "proc"
    instance_tree(proc)
    reads = []
    real = _apptainer._holders.read_process
    monkeypatch.setattr(_apptainer._holders, "read_process", lambda pid, root: reads.append(pid) or real(pid, root))
    walks = _apptainer.Walks()
    assert [_apptainer.instance_of({"pid": 812 + n, "ppid": 811}, str(proc), walks).name for n in range(3)] == ["train"] * 3
    assert reads == [811]
    clock = iter([0.0, 5.0])
    late = _apptainer.Walks(bound_s=2.0, now=lambda: next(clock))
    assert _apptainer.instance_of({"pid": 812, "ppid": 811}, str(proc), late) is None
