"""The nvidia-smi simulator behaves like the real driver (tests/fixtures/nvidia-smi).

Byte-for-byte comparisons against the H200 captures, the live memory model measured on a
real H200 (DESIGN.md), fault injection, and the namespace rig itself.
"""
import os
import re
import shlex
import shutil
import signal
import subprocess
import time

import pytest

from make_config import make_config  # tests/sim, put on sys.path by conftest.py
from nshost import NsHost

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"),
    reason="simulated hosts need root, unshare and nsenter")

FIX = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "fixtures", "nvidia-smi", "h200-580.159.04")
IDLE_UUID = "GPU-f07bb63c-cd2e-fe8d-534a-d4b919fe9734"   # idle_* captures
HELD_UUID = "GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5"   # held_* captures (another boot)
OVH = 10  # memory.used over the apps' sum with one context (5 + 5 per context)
MEM = ("--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
APPS = ("--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits")


def capture(name):
    """(argv after 'nvidia-smi', expected stdout, rc) of a capture file."""
    with open(os.path.join(FIX, name)) as f:
        lines = f.read().split("\n")
    assert lines[0].startswith("### ") and lines[-1] == ""
    cmd = lines[0][4:]
    if cmd.startswith("bash -c "):
        cmd = cmd[len("bash -c "):]
    argv = shlex.split(cmd)
    assert argv[0] == "nvidia-smi"
    rc = int(re.match(r"### rc=(\d+)$", lines[-2]).group(1))
    body = lines[1:-2]
    return argv[1:], "".join(l + "\n" for l in body), rc


def used(host, index=None):
    args = list(MEM) + (["-i", str(index)] if index is not None else [])
    r = host.smi(*args)
    assert r.returncode == 0, r.stdout
    vals = [int(l.split(", ")[1]) for l in r.stdout.splitlines()]
    return vals[0] if index is not None else vals


def apps(host):
    r = host.smi(*APPS)
    assert r.returncode == 0, r.stdout
    return [l.split(", ") for l in r.stdout.splitlines()]


def wait_for(pred, timeout=5.0, step=0.02):
    t0 = time.monotonic()
    while True:
        v = pred()
        if v:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not met after %.1f s" % timeout)
        time.sleep(step)


# ------------------------------------------------------------------ shared hosts
@pytest.fixture(scope="module")
def idle_host():
    """One H200 configured as the idle captures' machine (driver 580.159.04)."""
    with NsHost(config=make_config("h200x1", seed="h200-capture",
                                   gpu_overrides={0: {"uuid": IDLE_UUID}})) as h:
        yield h


@pytest.fixture(scope="module")
def h200x8_host():
    """8 GPUs whose minor numbers differ from their indexes (index 0 -> /dev/nvidia1)."""
    with NsHost(preset="h200x8", minors=[1, 0, 2, 3, 4, 5, 6, 7], seed="node01") as h:
        yield h


@pytest.fixture
def host8(h200x8_host):
    """The shared 8-GPU host, reset after each test: faults cleared, every process the
    test started killed and every GPU back to 0 MiB."""
    before = set(_ns_pids(h200x8_host))
    yield h200x8_host
    h200x8_host.clear_faults()
    for pid in set(_ns_pids(h200x8_host)) - before:
        h200x8_host.kill(pid)
    wait_for(lambda: used(h200x8_host) == [0] * 8, timeout=10)


def _ns_pids(host):
    return [int(p) for p in os.listdir(host.root.inside + "/proc") if p.isdigit() and p != "1"]


# ------------------------------------------------------------------ formats
IDLE_CAPTURES = ["idle_q_gpu_csv.txt", "idle_q_gpu_noheader.txt", "idle_q_gpu_nounits.txt",
                 "idle_q_seed.txt", "idle_q_apps_empty.txt", "idle_q_apps_empty_nh.txt",
                 "idle_q_bad_field.txt", "idle_q_bad_index.txt", "idle_smi_L.txt",
                 "idle_smi_version.txt"]


@pytest.mark.parametrize("name", IDLE_CAPTURES)
def test_idle_output_matches_capture_byte_for_byte(idle_host, name):
    argv, expected, rc = capture(name)
    r = idle_host.smi(*argv)
    assert (r.stdout, r.returncode) == (expected, rc)


@pytest.mark.parametrize("name,skip_line", [("idle_smi_plain.txt", 0), ("idle_smi_q_mem.txt", 3)])
def test_idle_reports_match_capture_but_the_clock(idle_host, name, skip_line):
    argv, expected, rc = capture(name)
    r = idle_host.smi(*argv)
    got, exp = r.stdout.split("\n"), expected.split("\n")
    del got[skip_line], exp[skip_line]
    assert (got, r.returncode) == (exp, rc)


def test_held_output_matches_capture(nshost):
    # the held capture: two python3 processes, 3590 MiB (started first) and 6662 MiB;
    # on that boot the driver read one MiB more free than total - reserved - used
    host = nshost(config=make_config("h200x1", seed="held", gpu_overrides={
        0: {"uuid": HELD_UUID, "memory_free_adjust_mib": 2}}))
    a = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "3590"])
    b = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "6662"])
    argv, expected, rc = capture("held_q_gpu_nounits.txt")
    r = host.smi(*argv)
    assert (r.stdout, r.returncode) == (expected, rc)
    for name in ("held_apps_live_csv.txt", "held_apps_live_nh.txt"):
        argv, expected, rc = capture(name)
        expected = expected.replace("427, ", "%d, " % a.pid).replace("426, ", "%d, " % b.pid)
        r = host.smi(*argv)
        assert (r.stdout, r.returncode) == (expected, rc)


def test_every_documented_field_is_accepted(idle_host):
    with open(os.path.join(FIX, "idle_help_query_gpu.txt")) as f:
        names = re.findall(r'^"([a-z][^"]*)"(?: or "([^"]+)")?', f.read(), re.M)
    fields = sorted(set(n for pair in names for n in pair if n))
    r = idle_host.smi("--query-gpu=" + ",".join(fields), "--format=csv")
    assert r.returncode == 0, r.stdout
    header, row = r.stdout.splitlines()
    assert len(header.split(", ")) == len(fields) == len(row.split(", "))
    assert "clocks.current.sm [MHz]" in header and "gpu_name" not in header


# ------------------------------------------------------------------ memory model
def test_holder_raises_memory_and_sigkill_frees_it(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960"])
    assert used(host8) == [40960 + OVH] + [0] * 7
    assert apps(host8) == [[str(p.pid), "python3", "40960", host8.config["gpus"][0]["uuid"]]]
    t0 = time.monotonic()
    assert host8.kill(p.pid)
    assert p.wait_gone(2)
    wait_for(lambda: used(host8, 0) == 0, timeout=2)
    assert time.monotonic() - t0 < 2
    assert apps(host8) == []


def test_process_list_empties_before_memory(host8):
    host8.set_fault(release_delay_s=0.8)
    p = host8.spawn(["gpu_holder", "--gpus", "3", "--mib", "40960"])
    host8.kill(p.pid)
    p.wait_gone(2)
    t0 = time.monotonic()
    assert apps(host8) == []             # the driver drops the process first...
    assert used(host8, 3) == 40960 + OVH  # ...and frees the memory a little later
    wait_for(lambda: used(host8, 3) == 0, timeout=3)
    assert time.monotonic() - t0 >= 0.7


def test_index_and_minor_differ(host8):
    info = host8.read("/proc/driver/nvidia/gpus/0000:18:00.0/information")
    assert "Device Minor: \t 1\n" in info and "Bus Location: \t 0000:18:00.0\n" in info
    p = host8.spawn(["gpu_holder", "--gpus", "0", "--mib", "1000"])
    fds = host8.run(["ls", "-l", "/proc/%d/fd" % p.pid]).stdout
    assert "/dev/nvidia1" in fds and "/dev/nvidia0" not in fds
    assert used(host8)[:2] == [1000 + OVH, 0]


def test_forked_child_keeps_memory_owner_shown_not_found(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048", "--fork-child"])
    (child,) = p.children
    host8.kill(p.pid)
    p.wait_gone(2)
    time.sleep(0.2)  # well past the release delay: the child still holds the context
    assert used(host8, 1) == 2048 + OVH
    assert apps(host8) == [[str(p.pid), "[Not Found]", "2048", host8.config["gpus"][1]["uuid"]]]
    assert host8.alive(child)
    ppid = host8.run(["ps", "-o", "ppid=", "-p", str(child)]).stdout.strip()
    assert ppid == "1"  # reparented to the namespace's init
    host8.kill(child)
    wait_for(lambda: used(host8, 1) == 0, timeout=2)


def test_vllm_workers_outlive_the_api_server(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "4,5", "--mib", "30000", "--workers", "2",
                     "--worker-name", "VLLM::Worker_TP{i}"])
    assert sorted(a[1] for a in apps(host8)) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    host8.kill(p.pid)
    p.wait_gone(2)
    time.sleep(0.2)
    assert used(host8)[4:6] == [30000 + OVH] * 2
    comm = host8.read("/proc/%d/comm" % p.workers[0]).strip()
    assert comm == "VLLM::Worker_TP"  # 15 characters, as the kernel truncates


def test_control_nodes_and_bare_device_holders_use_no_memory(host8):
    d = host8.spawn(["gpu_holder", "--control-only", "--name", "nvidia-persistenced"])
    s = host8.spawn(["sh", "-c", "exec sleep 1000 </dev/nvidia2"])
    wait_for(lambda: "/dev/nvidia2" in host8.run(["ls", "-l", "/proc/%d/fd" % s.pid]).stdout)
    assert used(host8) == [0] * 8 and apps(host8) == []
    cmdline = host8.read("/proc/%d/cmdline" % d.pid).split("\0")
    assert cmdline[0] == "nvidia-persistenced"
    assert host8.read("/proc/%d/comm" % d.pid).strip() == "nvidia-persiste"


def test_map_only_holder(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "6", "--mib", "512", "--map-only"])
    fds = host8.run(["ls", "-l", "/proc/%d/fd" % p.pid]).stdout
    maps = host8.read("/proc/%d/maps" % p.pid)
    assert "/dev/nvidia6" not in fds and "/dev/nvidia6" in maps
    assert used(host8, 6) == 512 + OVH


def test_ignore_term(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "7", "--mib", "100", "--ignore-term"])
    host8.kill(p.pid, signal.SIGTERM)
    time.sleep(0.3)
    assert p.alive() and used(host8, 7) == 100 + OVH
    host8.kill(p.pid, signal.SIGKILL)
    wait_for(lambda: used(host8, 7) == 0, timeout=2)


# ------------------------------------------------------------------ faults
def test_faults_give_the_real_messages(host8):
    host8.set_fault(driver_not_loaded=True)
    r = host8.smi(*MEM)
    assert r.returncode == 9 and r.stdout.startswith(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    host8.clear_faults()
    host8.set_fault(no_devices=True)
    r = host8.smi(*MEM)
    assert (r.stdout, r.returncode) == ("No devices were found\n", 6)
    host8.clear_faults()
    host8.set_fault(gpu_lost=[2])
    r = host8.smi(*MEM)
    assert r.returncode == 15
    assert r.stdout == ("Unable to determine the device handle for GPU0000:3A:00.0: GPU is lost.  "
                        "Reboot the system to recover this GPU\n")
    assert host8.smi(*(MEM + ("-i", "1"))).returncode == 0
    host8.clear_faults()
    host8.set_fault(field_values={"utilization.gpu": "[Not Supported]"})
    r = host8.smi("--query-gpu=utilization.gpu", "--format=csv", "-i", "0")
    assert r.stdout == "utilization.gpu [%]\n[Not Supported]\n"
    host8.clear_faults()
    host8.set_fault(garbage=True)
    r = host8.smi(*MEM)
    assert r.returncode == 0 and not re.match(r"^\d+, \d+$", r.stdout.splitlines()[0])


def test_leak_without_holder(host8):
    host8.set_fault(leak={"5": 3000})
    assert used(host8)[5] == 3000
    (row,) = apps(host8)
    assert row[1:] == ["[Not Found]", "3000", host8.config["gpus"][5]["uuid"]]
    assert not host8.alive(int(row[0]))


def test_hang_is_a_hang(host8):
    host8.set_fault(hang=True)
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        host8.smi(*MEM, timeout=1.0)
    assert time.monotonic() - t0 < 3
    host8.clear_faults()
    # the hung nvidia-smi was killed with its nsenter
    assert "nvidia-smi" not in host8.run(["ps", "-eo", "args"]).stdout


# ------------------------------------------------------------------ the rig
def test_hosts_are_isolated_and_torn_down(nshost):
    real = [os.path.exists(p) for p in ("/dev/nvidia-caps", "/usr/bin/nvidia-smi")]
    a = nshost("h200x1")
    b = nshost("a100-mig")
    a.spawn(["gpu_holder", "--gpus", "0", "--mib", "100"])
    assert used(a) == [100 + OVH] and used(b) == [55, 55]  # MIG idles above 0
    assert "nvidia-cap1" in a.run(["ls", "/dev"]).stdout + b.run(["ls", "/dev/nvidia-caps"]).stdout
    init, d = a.init_pid, a.dir
    a.stop()
    assert not os.path.exists("/proc/%d" % init) and not os.path.exists(d)
    assert [os.path.exists(p) for p in ("/dev/nvidia-caps", "/usr/bin/nvidia-smi")] == real
