# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_holders: who holds /dev/nvidia*, read from a fake /proc in a temporary directory."""

from __future__ import annotations

import errno
import os
import pwd
import signal
import subprocess
import sys

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

ID64 = "4f3c2b1a" * 8
POD = "pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901"

# ------------------------------------------------------------------ /proc/PID/stat


@pytest.mark.parametrize(
    "comm",
    ["python3", "tmux: server", "evil) (x", ") (", "(sd-pam)", "VLLM::Worker_TP", "kworker/0:1H", ""],
    ids=["plain", "spaces", "paren-space-paren", "only-parens", "sd-pam", "vllm-worker", "kworker-slash", "empty"],
)
def test_comm_with_spaces_and_parens_does_not_shift_the_fields(comm):
    assert holders.parse_stat(fakeproc.stat_line(4242, comm, "S", 1, 987654)) == (comm, "S", 1, 987654)


# Linux 6.1's /proc/PID/status of a process started by `unshare --pid --fork sleep 60` (read as
# root from the parent namespace; other lines left out) and of one after `trap '' TERM`.
NAMESPACE_INIT_STATUS = b"Name:\tsleep\nPid:\t48213\nNSpid:\t48213\t1\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000000000\n"
IGNORING_STATUS = b"Name:\tbash\nNSpid:\t48300\nSigIgn:\t0000000000384004\nSigCgt:\t0000000000010002\n"


@pytest.mark.parametrize("status, facts", [
    (NAMESPACE_INIT_STATUS, ("default", True)),
    (IGNORING_STATUS, ("ignored", False)),
    (b"NSpid:\t48213\t1\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000004000\n", ("caught", True)),
    (b"NSpid:\t1\nSigIgn:\t0\nSigCgt:\t0\n", ("default", False)),  # PID 1 of our own namespace
    (b"NSpid:\t7\t1\t1\nSigIgn:\t0\nSigCgt:\t0\n", ("default", True)),  # two namespaces down
    (b"Name:\tx\n", (None, False)),  # a kernel without the lines: nothing is assumed
    (b"SigIgn:\tzz\nSigCgt:\t0\n", (None, False)),
], ids=["unshare-init", "trap-TERM", "init-with-handler", "own-pid-1", "nested", "no-lines", "garbled"])
def test_signal_facts_of_a_status(status, facts):
    assert holders.signal_facts(status) == facts


def test_signal_facts_of_this_kernels_processes():
    script = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    ignoring = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    plain = subprocess.Popen(["sleep", "60"])
    try:
        ignoring.stdout.readline()
        assert (holders.read_process(ignoring.pid)["sigterm"], holders.read_process(ignoring.pid)["pid_namespace_init"]) == ("ignored", False)
        assert holders.read_process(plain.pid)["sigterm"] == "default"
    finally:
        for process in (ignoring, plain):
            process.send_signal(signal.SIGKILL)
            process.wait()


def test_parse_stat_on_this_very_process():
    with open("/proc/self/stat") as handle:
        comm, state, ppid, start_time = holders.parse_stat(handle.read())
    assert ppid == os.getppid() and state in "RS" and start_time > 0


# ------------------------------------------------------------------ cgroups


@pytest.mark.parametrize(
    "text, path",
    [
        ("0::/system.slice/vllm.service\n", "/system.slice/vllm.service"),
        ("12:cpu,cpuacct:/system.slice/vllm.service\n1:name=systemd:/system.slice/vllm.service\n0::/\n", "/system.slice/vllm.service"),
        ("1:name=systemd:/user.slice/user-0.slice/session-4.scope\n0::/system.slice/vllm.service\n", "/system.slice/vllm.service"),
        (f"11:memory:/docker/{ID64}\n1:name=systemd:/docker/{ID64}\n", f"/docker/{ID64}"),
        ("4:cpu:/x\n", None),
        ("0::/\n", "/"),
        ("", None),
        ("garbage without colons\n", None),
    ],
    ids=["pure-v2", "hybrid-v1-name-systemd-and-v2-root", "hybrid-v2-wins", "v1-only", "v1-without-name-systemd", "v2-root", "empty", "garbage"],
)
def test_parse_cgroup(text, path):
    assert holders.parse_cgroup(text) == path


@pytest.mark.parametrize(
    "path, unit, system_service, container",
    [
        ("/system.slice/vllm.service", "vllm.service", True, None),
        ("/system.slice/system-vllm.slice/vllm@1.service", "vllm@1.service", True, None),
        ("/init.scope", "init.scope", False, None),
        ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope", False, None),
        # systemd's unit is the user's manager: below it, every name is its user's (_unit_owner)
        ("/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service", "user@1000.service", False, None),
        ("/user.slice/user-1000.slice/user@1000.service/init.scope", "user@1000.service", False, None),
        (f"/system.slice/docker-{ID64}.scope", f"docker-{ID64}.scope", False, ID64),
        (f"/docker/{ID64}", None, False, ID64),
        (f"/machine.slice/libpod-{ID64}.scope/container", f"libpod-{ID64}.scope", False, ID64),
        # A user's own subtree: they may name a cgroup docker-<anyone's id>.scope there (docs/docsite/rst/guide_security.rst).
        (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID64}.scope/container", "user@1000.service", False, None),
        (f"/user.slice/user-4242.slice/user@4242.service/app.slice/docker-{ID64}.scope", "user@4242.service", False, None),
        (f"/user.slice/user-4242.slice/user@4242.service/kubepods.slice/kubepods-{POD}.slice/cri-containerd-{ID64}.scope",
         "user@4242.service", False, None),
        # A unit with Delegate=yes and User=: she names the directories below it (tests/tenants/delegated_user.py)
        ("/system.slice/lab-alice.service/networking.service", "lab-alice.service", True, None),
        ("/system.slice/lab-alice.service/user@0.service/x.scope", "lab-alice.service", True, None),
        # A container's root below a unit of its own (systemd-nspawn --keep-unit): root-owned, still the container's names
        ("/system.slice/lab-box.service/payload/system.slice/networking.service", "lab-box.service", True, None),
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-{POD}.slice/cri-containerd-{ID64}.scope",
            f"cri-containerd-{ID64}.scope",
            False,
            ID64,
        ),
        (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-{POD}.slice/crio-{ID64}.scope", f"crio-{ID64}.scope", False, ID64),
        (f"/kubepods/burstable/pod1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901/{ID64}", None, False, ID64),
        (f"/kubepods/pod1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901/{ID64}", None, False, ID64),
        ("/", None, False, None),
        ("", None, False, None),
        (None, None, False, None),
    ],
    ids=[
        "system-service",
        "template-instance",
        "init-scope",
        "session-scope",
        "user-manager-service-is-not-a-system-service",
        "user-manager-itself",
        "docker-systemd-driver",
        "docker-cgroupfs",
        "podman",
        "podman-rootless-is-the-users-own",
        "docker-id-named-in-a-user-subtree",
        "kubepods-in-a-user-subtree",
        "delegated-unit-names-below-it-are-its-users",
        "delegated-unit-a-user-manager-named-below-it",
        "keep-unit-container-names-below-its-unit",
        "k8s-cri-containerd",
        "k8s-crio",
        "k8s-cgroupfs-burstable",
        "k8s-cgroupfs-besteffort",
        "root",
        "empty",
        "none",
    ],
)
def test_unit_and_container_of_a_cgroup_path(path, unit, system_service, container):
    assert holders.unit_of(path) == unit
    assert holders.is_system_service(path) is system_service
    assert holders.container_of(path) == container


# ------------------------------------------------------------------ names and protection


def _record(pid=500, ppid=1, name="python3", exe="python3.12", argv0="python3", kernel_thread=False, uid=0, exe_path=None,
            exe_owner=0, exe_verified=True):
    """A process record; by default one the kernel vouches for (root, a root-owned executable in
    /usr/bin, verified by inode)."""
    return {"pid": pid, "ppid": ppid, "name": name, "exe": exe, "argv0": argv0, "kernel_thread": kernel_thread, "uid": uid,
            "exe_path": exe_path or "/usr/bin/%s" % (exe or "python3.12"), "exe_owner": exe_owner, "exe_verified": exe_verified}


@pytest.mark.parametrize(
    "record, names, expected",
    [
        (_record(name="nvidia-persiste", exe=None, argv0=None), ["nvidia-persistenced"], True),
        (_record(name="nv-fabricmanage", exe=None, argv0=None), ["nv-fabricmanager"], True),
        (_record(name="x", exe="nvidia-persistenced", argv0=None), ["nvidia-persistenced"], True),
        (_record(name="x", exe=None, argv0="dcgm-exporter"), ["dcgm-exporter"], True),
        (_record(name="Xorg", exe=None, argv0=None), ["Xorg"], True),
        (_record(name="python3"), ["python"], False),
        (_record(name="nvidia-persiste", exe=None, argv0=None), ["nvidia-persist"], False),
        (_record(name="train", exe="python3.12", argv0="python3"), [], False),
        (_record(name=None, exe=None, argv0=None), ["python3"], False),
    ],
    ids=[
        "comm-truncated-to-15",
        "fabricmanager-truncated",
        "exe-basename",
        "argv0-basename",
        "exact-comm",
        "prefix-is-not-a-match",
        "short-name-is-not-truncated-match",
        "no-names",
        "nothing-known",
    ],
)
def test_name_matches(record, names, expected):
    assert _protect.name_matches(record, names) is expected


def test_comm_truncated_to_15_chars_still_protects_persistenced():
    record = _record(pid=812, name="nvidia-persiste", exe=None, argv0=None)
    assert _protect.protection_reason(record, [], set(), [4242]) == "protected daemon"


@pytest.mark.parametrize(
    "record, names, pids, expected",
    [
        (_record(pid=1, name="systemd"), [], set(), "PID 1"),
        (_record(pid=4000, name="sshd"), [], set(), "this Ansible session"),
        (_record(pid=4242, name="python3"), [], set(), "this Ansible session"),
        (_record(pid=77, ppid=2, name="nvidia-modeset/", exe=None, argv0=None, kernel_thread=True), [], set(), "kernel thread"),
        (_record(pid=2, ppid=0, name="kthreadd", exe=None, argv0=None, kernel_thread=True), [], set(), "kernel thread"),
        (_record(pid=2, ppid=0, name="python3"), [], set(), None),
        (_record(pid=60, ppid=2, name="python3"), [], set(), None),
        (_record(pid=900), [], {900}, "protect"),
        (_record(pid=901, name="Xwayland", exe="Xwayland"), [], set(), "protected daemon"),
        (_record(pid=902, name="gnome-shell"), [], set(), "protected daemon"),
        (_record(pid=903, name="jupyter-lab", exe="python3.12", argv0="jupyter-lab"), ["jupyter-lab"], set(), "protect"),
        (_record(pid=904, name="a-very-long-nam", exe=None, argv0=None), ["a-very-long-name-indeed"], set(), "protect"),
        (_record(pid=905), ["jupyter-lab"], {1234}, None),
    ],
    ids=[
        "pid-1",
        "session-sshd",
        "the-module-itself",
        "kernel-thread",
        "kthreadd",
        "pid-2-in-a-container-is-a-process",
        "child-of-pid-2-in-a-container-is-a-process",
        "user-pid",
        "xwayland",
        "gnome-shell",
        "user-name-via-argv0",
        "user-name-via-truncated-comm",
        "unprotected",
    ],
)
def test_protection_reason(record, names, pids, expected):
    assert _protect.protection_reason(record, names, pids, [4242, 4000, 1]) == expected


@pytest.mark.parametrize(
    "record, names",
    [
        (_record(pid=950, name="python3", argv0="Xorg", uid=4242), []),  # exec -a Xorg python3 ...
        (_record(pid=951, name="nvidia-persiste", argv0="nvidia-persistenced", uid=4242), []),  # prctl(PR_SET_NAME) + argv[0]
        (_record(pid=952, name="Xorg", exe="Xorg", argv0="Xorg", uid=4242, exe_path="/home/u/bin/Xorg", exe_owner=4242), []),  # a copy
        (_record(pid=953, name="Xorg", exe="Xorg", uid=0, exe_path="/tmp/Xorg", exe_owner=0), []),  # root's file, not a system dir
        (_record(pid=954, name="Xorg", exe="Xorg", uid=0, exe_path="/usr/bin/Xorg", exe_verified=False), []),  # a bind mount of python3
        (_record(pid=955, name="jupyter-lab", argv0="jupyter-lab", uid=4242), ["jupyter-lab"]),  # protect: by name, same check
        (_record(pid=956, name="Xorg", exe=None, argv0=None, uid=0, exe_path="", exe_owner=None, exe_verified=False), []),  # exe unreadable
    ],
    ids=["exec-a-xorg", "prctl-persistenced", "copied-interpreter", "root-file-outside-system-dirs", "bind-mounted-over-a-system-path",
         "protect-name-run-by-a-user", "executable-unreadable"],
)
def test_a_name_alone_protects_nobody_and_says_so(record, names):
    assert _protect.protection_reason(record, names, set(), [1]) is None
    assert "not protected" in record["protection_note"] and "uid {}".format(record["uid"]) in record["protection_note"]


def test_system_account_running_a_system_daemon_is_protected():
    record = _record(pid=960, name="nvidia-persiste", exe="nvidia-persistenced", argv0="nvidia-persistenced", uid=116)
    assert _protect.protection_reason(record, [], set(), [1]) == "protected daemon"


def test_impostor_in_a_system_unit_is_protected_only_as_its_main_process():
    record = dict(_record(pid=961, name="Xorg", exe="Xorg", uid=4242, exe_path="/home/u/Xorg", exe_owner=4242), unit="display.service",
                  system_service=True)
    assert _protect.protection_reason(dict(record), [], set(), [1], main_pid_of=lambda unit: 961) == "protected daemon"
    assert _protect.protection_reason(dict(record), [], set(), [1], main_pid_of=lambda unit: 7) is None
    assert _protect.protection_reason(dict(record, system_service=False), [], set(), [1], main_pid_of=lambda unit: 961) is None


def test_executable_identity_is_read_from_the_kernels_link(tmp_path):
    """read_executable on this very process: the path /proc/self/exe shows, its owner, verified by inode."""
    path, owner, verified = holders.read_executable("/proc/self")
    assert path == os.path.realpath("/proc/self/exe") and owner == os.stat(path).st_uid and verified is True


def test_split_protect_tells_pids_from_names():
    assert _protect.split_protect(["nvidia-persistenced", "812", " 9 ", "", 42, "my app"]) == (["nvidia-persistenced", "my app"], {812, 9, 42})
    assert _protect.split_protect(None) == ([], set())


def test_protect_marks_daemons_and_never_changes_its_input():
    raw = [
        dict(_record(pid=500), devices=["/dev/nvidia-uvm", "/dev/nvidia1", "/dev/nvidiactl"], gpu_indexes=[], protected=False),
        dict(_record(pid=812, name="nvidia-persiste", exe=None, argv0=None), devices=["/dev/nvidia0", "/dev/nvidia1"], gpu_indexes=[], protected=False),
        dict(_record(pid=4242), devices=["/dev/nvidia0"], gpu_indexes=[], protected=False),
    ]
    result = _protect.protect(raw, [], set(), [4242])
    assert [(h["pid"], h["protected"], h["protected_reason"]) for h in result] == [
        (500, False, None),
        (812, True, "protected daemon"),
        (4242, True, "this Ansible session"),
    ]
    assert raw[1]["protected"] is False, "protect must not change its input"


@pytest.mark.parametrize(
    "device, minor",
    [
        ("/dev/nvidia0", 0),
        ("/dev/nvidia15", 15),
        ("/dev/nvidiactl", None),
        ("/dev/nvidia-uvm", None),
        ("/dev/nvidia-caps/nvidia-cap1", None),
        ("/dev/nvidia0 (deleted)", None),
    ],
    ids=repr,
)
def test_gpu_minor(device, minor):
    assert _devices.gpu_minor(device) == minor


def test_parse_cmdline_keeps_arguments_with_spaces():
    assert holders.parse_cmdline(b"python3\0-m\0vllm.entrypoints.openai.api_server\0--served-model-name\0my model\0\0") == (
        ["python3", "-m", "vllm.entrypoints.openai.api_server", "--served-model-name", "my model"],
        "python3 -m vllm.entrypoints.openai.api_server --served-model-name my model",
    )
    assert holders.parse_cmdline(b"") == ([], "")
    assert holders.parse_cmdline(b"\xff\xfe\0")[0] == ["\ufffd\ufffd"]


# ------------------------------------------------------------------ a fake /proc


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    (root / "self").symlink_to("100")
    (root / "sys").mkdir()
    fakeproc.write_process(root, 1, comm="systemd", ppid=0, argv=("/sbin/init",), cgroup="0::/init.scope\n", exe="/usr/lib/systemd/systemd")
    fakeproc.write_process(root, 3, comm="kworker/0:0", ppid=2, argv=(), exe=None, cgroup="0::/\n", kernel_thread=True)
    fakeproc.write_process(
        root,
        100,
        comm="python3",
        argv=("/opt/vllm/bin/python3", "-m", "vllm.entrypoints.openai.api_server"),
        cgroup="0::/system.slice/vllm.service\n",
        fds=fakeproc.cuda_fds(0),
        maps=fakeproc.CUDA_MAPS,
        start_time=5000,
    )
    fakeproc.write_process(root, 101, comm="python3", state="Z", fds=fakeproc.cuda_fds(0))  # zombie
    fakeproc.write_process(root, 102, comm="pt_data_worker", maps=("/dev/nvidia1", "/dev/nvidiactl"), uid=4242)  # maps only
    fakeproc.write_process(root, 103, comm="bash", argv=("-bash",))  # holds nothing
    os.makedirs(str(root / "104" / "fd"))  # vanished mid-scan: fd dir listed, stat gone
    os.symlink("/dev/nvidia0", str(root / "104" / "fd" / "3"))
    fakeproc.write_process(root, 106, comm="nv-hostengine", fds=("/dev/nvidiactl",), exe="/usr/bin/nv-hostengine")  # NVML client
    fakeproc.write_process(
        root, 107, comm="python3", fds=fakeproc.cuda_fds(1), exe="/opt/venv/bin/python3.12 (deleted)", cgroup=f"0::/system.slice/docker-{ID64}.scope\n"
    )
    return root


def test_scan_finds_fd_and_maps_holders_and_skips_zombies_and_vanished(proc):
    found = {h["pid"]: h for h in holders.scan_holders(str(proc))}
    assert sorted(found) == [100, 102, 106, 107]
    vllm = found[100]
    assert vllm["devices"] == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidiactl"]
    assert (vllm["unit"], vllm["system_service"], vllm["container"], vllm["user"], vllm["state"], vllm["start_time"]) == (
        "vllm.service",
        True,
        None,
        "root",
        "S",
        5000,
    )
    assert vllm["cmdline"] == "/opt/vllm/bin/python3 -m vllm.entrypoints.openai.api_server" and vllm["argv0"] == "python3"
    assert found[102]["devices"] == ["/dev/nvidia1", "/dev/nvidiactl"]
    assert found[106]["devices"] == ["/dev/nvidiactl"] and found[106]["exe"] == "nv-hostengine"
    assert found[107]["exe"] == "python3.12" and found[107]["container"] == ID64 and found[107]["system_service"] is False


def test_kernel_thread_is_told_by_its_flags_not_its_pid(proc):
    fakeproc.write_process(proc, 108, comm="nvidia-modeset/", ppid=2, exe=None, argv=(), fds=("/dev/nvidia0",), kernel_thread=True)
    fakeproc.write_process(proc, 109, comm="python3", ppid=2, fds=("/dev/nvidia0",))  # PID 2's child in a container
    found = {h["pid"]: h for h in _protect.protect(holders.scan_holders(str(proc)), [], set(), [4242])}
    assert (found[108]["protected"], found[108]["protected_reason"]) == (True, "kernel thread")
    assert (found[109]["protected"], found[109]["protected_reason"]) == (False, None)


def test_zombie_holds_nothing(proc):
    assert holders.start_time_of(101, str(proc)) is None
    assert 101 not in [h["pid"] for h in holders.scan_holders(str(proc))]


def test_unknown_uid_is_reported_as_a_number(proc):
    try:
        pwd.getpwuid(4242)
    except KeyError:
        pass
    else:
        pytest.skip("uid 4242 exists on this machine")
    (holder,) = [h for h in holders.scan_holders(str(proc)) if h["pid"] == 102]
    assert holder["user"] == "4242"


def test_open_devices_of_a_vanished_process_raises_oserror(proc):
    with pytest.raises(OSError):
        holders.open_devices(999, str(proc))
    assert holders.read_process(104, str(proc)) is None
    assert holders.start_time_of(999, str(proc)) is None


def test_open_devices_reads_fds_and_maps(proc):
    assert holders.open_devices(100, str(proc)) == {"/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert holders.open_devices(103, str(proc)) == set()


def test_list_pids_ignores_non_numeric_entries(proc):
    assert holders.list_pids(str(proc)) == [1, 3, 100, 101, 102, 103, 104, 106, 107]


def test_lineage_walks_up_to_pid_1(tmp_path):
    fakeproc.write_process(tmp_path, 1, comm="systemd", ppid=0)
    fakeproc.write_process(tmp_path, 4000, comm="sshd", ppid=1)
    fakeproc.write_process(tmp_path, 4100, comm="sshd", ppid=4000)
    fakeproc.write_process(tmp_path, 4242, comm="python3", ppid=4100)
    assert holders.lineage(4242, str(tmp_path)) == [4242, 4100, 4000, 1]


def test_lineage_stops_at_a_missing_parent_and_at_a_cycle(tmp_path):
    fakeproc.write_process(tmp_path, 4242, comm="python3", ppid=999)
    assert holders.lineage(4242, str(tmp_path)) == [4242, 999]
    fakeproc.write_process(tmp_path, 5, ppid=6)
    fakeproc.write_process(tmp_path, 6, ppid=5)
    assert holders.lineage(5, str(tmp_path)) == [5, 6]


def test_lineage_of_this_process_on_the_real_proc():
    chain = holders.lineage(os.getpid())
    assert chain[0] == os.getpid() and os.getppid() in chain


def test_own_pid_is_the_kernels_self_link_of_that_proc_and_os_getpid_without_one(tmp_path):
    assert holders.own_pid() == os.getpid()
    assert holders.own_pid(str(tmp_path)) == os.getpid()
    (tmp_path / "self").symlink_to("4199")
    assert holders.own_pid(str(tmp_path)) == 4199


# ------------------------------------------------------------------ regressions of bugs found in review

# containerd >= 1.5 with the systemd cgroup driver but runc not using it (kind, k3s, a common
# kubelet/containerd mismatch) puts pods under containerd.service with a colon form.
CONTAINERD_COLON = f"/system.slice/containerd.service/kubepods-burstable-{POD}.slice:cri-containerd:{ID64}"


def test_pod_under_containerd_service_is_a_container_not_a_containerd_service():
    assert holders.container_of(CONTAINERD_COLON) == ID64
    assert holders.is_system_service(CONTAINERD_COLON) is False


def test_maps_scan_finds_device_mappings():
    maps = (
        "7f1a2c000000-7f1a2c200000 rw-s 00000000 00:05 1107 /dev/nvidiactl\n"
        "7f1a2e000000-7f1a2e001000 rw-s 00000000 00:05 1112 /dev/nvidia0\n"
        "7f1a30000000-7f1a30001000 rw-s 00000000 00:05 1113 /dev/nvidia-uvm (deleted)\n"
        "7f1a32000000-7f1a32100000 r-xp 00000000 08:01 5524 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n"
    )
    assert set(_devices.mapped_devices(maps.encode())) == {"/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia-uvm"}


def test_library_under_a_dev_nvidia_named_directory_is_not_a_device():
    maps = "7f1a32000000-7f1a32100000 r-xp 00000000 08:01 5524 /home/alice/dev/nvidia-apex/build/amp_C.so\n"
    assert _devices.mapped_devices(maps.encode()) == {}


def test_processes_we_may_not_read_are_counted_so_a_non_root_run_can_say_so(monkeypatch, tmp_path):
    # Root reads every fd directory, so the denial is injected at the one place it happens.
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts

    for pid in (10, 11):
        (tmp_path / str(pid)).mkdir()

    def denied(pid, proc, table):
        raise PermissionError(13, "Permission denied", f"{proc}/{pid:d}/fd")

    monkeypatch.setattr(holders, "_open_devices", denied)
    unreadable = []
    assert holders.scan_holders(str(tmp_path), unreadable) == []
    assert unreadable == [10, 11]
    assert "2 process(es)" in _facts.unreadable_warning(unreadable) and "become: true" in _facts.unreadable_warning(unreadable)
    assert _facts.unreadable_warning([]) is None


# ------------------------------------------------------------------ spellings and bytes


@pytest.mark.parametrize(
    "target, device",
    [
        ("/dev/nvidia0", "/dev/nvidia0"),
        ("/dev/nvidia0 (deleted)", "/dev/nvidia0"),  # a node removed while held
        ("/run/nvidia/driver/dev/nvidia3", "/dev/nvidia3"),  # GPU Operator: the driver container's /dev
        ("/run/nvidia/driver/dev/nvidiactl (deleted)", "/dev/nvidiactl"),
        ("/dev/nvidia-uvm-tools", "/dev/nvidia-uvm-tools"),
        ("/dev/nvidia-caps/nvidia-cap2", "/dev/nvidia-caps/nvidia-cap2"),
        ("/dev/nvidia-apex/lib.so", None),
        ("/home/u/dev/nvidia0", None),
        ("/dev/null", None),
        ("socket:[43126]", None),
    ],
    ids=repr,
)
def test_device_path_knows_every_spelling_of_a_device_file(target, device):
    assert _devices.device_path(target) == device


def test_mapped_devices_counts_mappings_and_kib_per_device():
    maps = (
        b"7f0000000000-7f0000200000 rw-s 00000000 00:05 11 /dev/nvidia0\n"
        b"7f0000300000-7f0000320000 rw-s 00000000 00:05 11 /dev/nvidia0\n"
        b"7f0000400000-7f0000410000 rw-s 00000000 00:05 12 /run/nvidia/driver/dev/nvidia1 (deleted)\n"
        b"7f0000500000-7f0000501000 r--p 00000000 08:01 13 /opt/x/dev/nvidia-apex/lib.so\n"
        b"7ffd4a1c2000-7ffd4a1e3000 rw-p 00000000 00:00 0 [stack]\n"
    )
    assert _devices.mapped_devices(maps) == {"/dev/nvidia0": [2, 2176], "/dev/nvidia1": [1, 64]}


def test_operator_and_deleted_spellings_are_found_by_the_scan(proc):
    fakeproc.write_process(proc, 700, fds=("/run/nvidia/driver/dev/nvidia0", "/run/nvidia/driver/dev/nvidiactl"),
                           maps=(("/run/nvidia/driver/dev/nvidia0", 2176),))
    fakeproc.write_process(proc, 701, fds=("/dev/nvidia1 (deleted)",), maps=(("/dev/nvidia1 (deleted)", 2176),))
    found = {h["pid"]: h for h in holders.scan_holders(str(proc), with_maps=False)}
    assert found[700]["devices"] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert found[700]["mapped"] == {"/dev/nvidia0": {"count": 1, "kib": 2176}}
    assert found[701]["devices"] == ["/dev/nvidia1"]


def test_comm_cut_inside_a_multibyte_character_is_read_not_skipped(proc):
    """A 15-byte comm ends inside a CJK character: reading /proc as text raised, the process was
    skipped, and the run waited 60 s for memory it could not explain."""
    comm = "训练脚本" + "\u3042"  # 12 + 3 bytes; the kernel keeps 15 bytes
    base = fakeproc.write_process(proc, 702, comm="x", fds=("/dev/nvidia0",), maps=(("/dev/nvidia0", 2176),))
    with open(base + "/stat", "rb") as handle:
        stat = handle.read()
    raw = comm.encode("utf-8")[:14]  # the last character cut in two
    with open(base + "/stat", "wb") as handle:
        handle.write(stat.replace(b"(x)", b"(" + raw + b")"))
    (found,) = [h for h in holders.scan_holders(str(proc), with_maps=False) if h["pid"] == 702]
    assert found["name"] == "训练脚本\ufffd" and found["devices"] == ["/dev/nvidia0"]
    assert holders.start_time_of(702, str(proc)) == 1000


# ------------------------------------------------------------------ device files by kernel identity (docs/docsite/rst/guide_security.rst)

PROC_DEVICES = """Character devices:
  1 mem
195 nvidia-frontend
195 nvidia
234 nvidia-uvm
237 nvidia-caps
238 nvidia-nvswitch

Block devices:
  7 loop
234 fake-block
"""


def test_proc_devices_gives_the_drivers_majors():
    majors = _devices.parse_proc_devices(PROC_DEVICES)
    assert (majors["nvidia-frontend"], majors["nvidia-uvm"], majors["nvidia-caps"]) == (195, 234, 237) and "loop" not in majors


class _Stat:
    def __init__(self, rdev, dev=99, ino=1, mode=0o020666):
        self.st_rdev, self.st_dev, self.st_ino, self.st_mode = rdev, dev, ino, mode


@pytest.mark.parametrize(
    "rdev, name",
    [
        (os.makedev(195, 0), "/dev/nvidia0"),
        (os.makedev(195, 7), "/dev/nvidia7"),
        (os.makedev(195, 255), "/dev/nvidiactl"),
        (os.makedev(195, 254), "/dev/nvidia-modeset"),
        (os.makedev(234, 0), "/dev/nvidia-uvm"),
        (os.makedev(234, 1), "/dev/nvidia-uvm-tools"),
        (os.makedev(1, 5), None),  # /dev/zero under any name
        (os.makedev(196, 0), None),
    ],
)
def test_device_number_names_the_device_whatever_its_path(tmp_path, rdev, name):
    devices = tmp_path / "devices"
    devices.write_text(PROC_DEVICES)
    table = _devices.DeviceTable.read(dev_dirs=(), proc_devices=str(devices))
    assert table.name_of(_Stat(rdev)) == name
    assert table.name_of(_Stat(rdev, mode=0o100644)) is None  # a regular file is no device, whatever it is called


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_table_knows_only_root_owned_character_nodes(tmp_path):
    dev = tmp_path / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    os.mknod(str(dev / "nvidia0"), 0o666 | 0o020000, os.makedev(1, 5))
    os.mknod(str(dev / "nvidia-caps" / "nvidia-cap1"), 0o666 | 0o020000, os.makedev(1, 5))
    os.mknod(str(dev / "nvidia1"), 0o666 | 0o020000, os.makedev(1, 5))
    os.chown(str(dev / "nvidia1"), 4242, 4242)  # only root makes nodes; this one is a user's (a test stand-in)
    (dev / "nvidiactl").write_text("")  # a regular file named like the control node
    table = _devices.DeviceTable.read(dev_dirs=(str(dev),), proc_devices=str(tmp_path / "none"))
    assert sorted(table.by_inode.values()) == ["/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia0"]
    assert table.name_of(os.stat(str(dev / "nvidia0"))) == "/dev/nvidia0"
    assert table.name_of(os.stat(str(dev / "nvidia1"))) is None


def test_open_file_is_known_by_its_inode_not_its_path():
    """This very process opens /dev/null; a table that knows /dev/null's inode as /dev/nvidia0 finds
    it through /proc/self/fd, although no path says nvidia (a bind mount elsewhere reads the same)."""
    st = os.stat("/dev/null")
    table = _devices.DeviceTable(by_inode={(st.st_dev, st.st_ino): "/dev/nvidia0"})
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        assert "/dev/nvidia0" in holders.open_devices(os.getpid(), "/proc", table)
        assert "/dev/nvidia0" not in holders.open_devices(os.getpid(), "/proc", _devices.DeviceTable())
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="/proc/PID/map_files needs CAP_SYS_ADMIN")
def test_mapping_is_known_by_its_inode_through_map_files():
    import mmap

    st = os.stat("/dev/zero")
    table = _devices.DeviceTable(by_inode={(st.st_dev, st.st_ino): "/dev/nvidia3"})
    with open("/dev/zero", "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 8 * 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        found = holders.read_maps(os.getpid(), "/proc", table)
        assert found.get("/dev/nvidia3", [0, 0])[1] >= 32
    finally:
        mapping.close()


def test_maps_line_spelled_like_a_device_counts_only_where_map_files_cannot_say(tmp_path):
    line = b"7f0000000000-7f0000220000 r--s 00000000 00:05 1234 /dev/nvidia0\n"
    assert _devices.mapped_by_identity(line, _devices.DeviceTable()) == {"/dev/nvidia0": [1, 2176]}
    # map_files answers: the mapped file is a regular file (a user's, mounted at /dev/nvidia0 in a
    # namespace of their own): the spelling decides nothing.
    (tmp_path / "7f0000000000-7f0000220000").write_text("")
    assert _devices.mapped_by_identity(line, _devices.DeviceTable(), map_files=str(tmp_path).encode()) == {}


# ------------------------------------------------------------------ which GPUs this namespace reaches (issue 37)


def _null_as(name):
    """A table that knows /dev/null's inode as the simulator's node `name` (a root-owned char node)."""
    st = os.stat("/dev/null")
    return _devices.DeviceTable(by_inode={(st.st_dev, st.st_ino): name})


def _dev(tmp_path, **nodes):
    """A /dev of symlinks (nvidia4="/dev/null") or regular files (nvidia4=None)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, target in nodes.items():
        if target is None:
            (dev / name).write_text("not a device")
        else:
            os.symlink(target, str(dev / name))
    return (str(dev),)


def test_gpu_node_the_drivers_device_that_opens_is_reachable(tmp_path):
    dirs = _dev(tmp_path, nvidia4="/dev/null")
    assert _devices.gpu_node_reachable(4, _null_as("/dev/nvidia4"), dirs)
    assert not _devices.gpu_node_reachable(5, _null_as("/dev/nvidia4"), dirs)  # no /dev/nvidia5 here: a container given GPU 4
    assert not _devices.gpu_node_reachable(4, _null_as("/dev/nvidia2"), dirs)  # a node, but GPU 2's by identity
    assert not _devices.gpu_node_reachable(4, _devices.DeviceTable(), dirs)  # a char device, but none of the driver's


def test_gpu_node_that_is_no_device_is_not_reachable(tmp_path):
    """A bind of a regular file over /dev/nvidia4: NVML cannot use it, nor can it be the GPU."""
    assert not _devices.gpu_node_reachable(4, _null_as("/dev/nvidia4"), _dev(tmp_path, nvidia4=None))


@pytest.mark.parametrize("error, reachable", [
    (errno.EACCES, False),  # file permissions (mode 000 for a non-root user), a nodev mount
    (errno.EPERM, False),  # a device cgroup (v1 devices.deny, a v2 eBPF program)
    (errno.ENOENT, False),  # removed between the stat and the open
    (errno.ENXIO, True),  # the driver answered: this namespace reaches it
    (errno.EIO, True),
    (errno.EBUSY, True),
], ids=["permissions", "device-cgroup", "gone", "driver-enxio", "driver-eio", "driver-ebusy"])
def test_open_refused_before_the_driver_is_not_reachable_any_other_error_is(tmp_path, monkeypatch, error, reachable):
    dirs = _dev(tmp_path, nvidia4="/dev/null")
    table = _null_as("/dev/nvidia4")
    asked = []

    def refuse(path, flags, *args):
        asked.append((path, flags))
        raise OSError(error, os.strerror(error))

    with monkeypatch.context() as patch:
        patch.setattr(holders.os, "open", refuse)
        assert _devices.gpu_node_reachable(4, table, dirs) is reachable
    [(path, flags)] = asked
    assert path == dirs[0] + "/nvidia4" and flags & os.O_NONBLOCK and flags & (os.O_WRONLY | os.O_RDWR) == 0  # read-only, never blocking


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_real_driver_node_must_carry_the_gpus_minor(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(str(dev / "nvidia4"), 0o666 | 0o020000, os.makedev(195, 3))  # GPU 3's device under GPU 4's name
    assert not _devices.gpu_node_reachable(4, _devices.DeviceTable(), (str(dev),))


def _fake_process(proc, pid, ppid, namespace):
    """/proc/PID/stat and /proc/PID/ns/pid, the latter a hard link to NAMESPACE (one inode per
    namespace, as the kernel's nsfs gives)."""
    base = proc / str(pid)
    (base / "ns").mkdir(parents=True)
    (base / "stat").write_text(f"{pid} (p{pid}) S {ppid} " + " ".join(["0"] * 17) + " 1234 0 0\n")
    os.link(namespace, base / "ns" / "pid")


def test_namespace_members_are_its_namespace_and_what_is_forked_below_it(tmp_path):
    proc = tmp_path / "proc"
    ours, theirs, nested, other = (tmp_path / n for n in ("ours", "theirs", "nested", "other"))
    for namespace in (ours, theirs, nested, other):
        namespace.write_text("")
    _fake_process(proc, 1, 0, ours)
    _fake_process(proc, 10, 1, theirs)     # the init
    _fake_process(proc, 11, 10, theirs)    # its child
    _fake_process(proc, 12, 11, nested)    # a namespace nested in it
    _fake_process(proc, 13, 1, other)      # another namespace beside it
    _fake_process(proc, 14, 1, theirs)     # entered from outside (setns), parent outside
    _fake_process(proc, 15, 14, nested)    # a child of the one that entered
    _fake_process(proc, 16, 1, ours)       # ours
    assert holders.namespace_members(10, str(proc)) == [11, 12, 14, 15]
    assert holders.namespace_members(13, str(proc)) == []
    assert holders.namespace_members(99, str(proc)) == []  # gone: nothing known, nothing claimed


# A comm or a cgroup name is the user's: the kernel prints \x1c-\x1e and \x85 in them as they are
# (reproduced on Linux 6.18 by the review of issue 54), and str.splitlines() would start a line there.
FORGED_STATUS = "Name:\tx\x1cUid:\t0\t0\t0\t0\x1cNSpid:\t1\nUmask:\t0022\nState:\tS (sleeping)\nNSpid:\t4321\nUid:\t4242\t4242\t4242\t4242\n"


@pytest.mark.parametrize("separator", ["\x1c", "\x1d", "\x1e", "\x85", "\u2028"])
def test_a_comm_that_spells_a_status_line_is_no_status_line(separator):
    status = FORGED_STATUS.replace("\x1c", separator)
    assert holders._uid_from_status(status) == 4242
    assert holders._uid_from_status(status.encode()) == 4242


def test_a_forged_namespace_line_in_a_comm_does_not_make_an_init(tmp_path):
    (tmp_path / "4321").mkdir()
    (tmp_path / "4321" / "status").write_text(FORGED_STATUS)
    assert holders._nspid_depth(4321, str(tmp_path)) == 1


@pytest.mark.parametrize("separator", ["\x1c", "\x85"])
def test_a_user_cgroup_named_like_a_system_unit_stays_in_the_users_subtree(tmp_path, separator):
    own = "/user.slice/user-4242.slice/user@4242.service/app.slice/a" + separator + "0::/system.slice/vllm.service"
    text = f"0::{own}\n"
    assert holders.parse_cgroup(text) == own
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "cgroup").write_text(text)
    assert holders.cgroup_paths(77, str(tmp_path)) == [own]


# --- issue 66: a rescan in the same run reads what may have changed, not every process again


def born_again(root, pid, **process):
    """Process `pid` gone and the PID used again by another process: a new /proc entry (the old
    directory is kept until the new one exists, so that the file system cannot hand out its inode
    number again, as the kernel never does for /proc)."""
    base = os.path.join(str(root), str(pid))
    os.rename(base, base + ".gone")
    fakeproc.write_process(root, pid, **process)
    subprocess.run(["rm", "-rf", base + ".gone"], check=True)


def test_a_rescan_reads_the_looks_holders_and_every_process_new_since_but_not_the_quiet_ones_again(proc, monkeypatch):
    monkeypatch.setattr(holders, "QUIET", {})
    look = {h["pid"] for h in holders.scan_holders(str(proc), with_maps=False)}
    assert look == {100, 106, 107}
    fakeproc.write_process(proc, 100, comm="python3", fds=())                   # the look's holder let go of its GPU
    fakeproc.write_process(proc, 200, comm="python3", fds=fakeproc.cuda_fds(1))  # started since
    born_again(proc, 103, comm="python3", fds=fakeproc.cuda_fds(0))              # a PID used again
    read = []
    open_devices = holders._open_devices
    monkeypatch.setattr(holders, "_open_devices", lambda pid, *args: read.append(pid) or open_devices(pid, *args))
    others: list[int] = []
    again = {h["pid"] for h in holders.scan_holders(str(proc), with_maps=False, without_devices=others, again=True)}
    assert again == {103, 106, 107, 200}
    assert sorted(read) == [100, 103, 106, 107, 200]
    # The quiet processes are still handed on for a maps pass (scan_mapped), read or not.
    assert {1, 3, 100, 102} <= set(others) and not {103, 200} & set(others)


def test_only_a_rescan_takes_the_last_passes_answer(proc, monkeypatch):
    monkeypatch.setattr(holders, "QUIET", {})
    holders.scan_holders(str(proc), with_maps=False)
    fakeproc.write_process(proc, 103, comm="bash", argv=("-bash",), fds=("/dev/nvidia0",))  # the same process opens a GPU
    assert 103 in {h["pid"] for h in holders.scan_holders(str(proc), with_maps=False)}
    assert 103 in {h["pid"] for h in holders.scan_holders(str(proc))}
