"""The nvidia-smi simulator behaves like the real driver (tests/fixtures/nvidia-smi).

Byte-for-byte comparisons against the H200 captures, the live memory model measured on a
real H200 (tests/gpu/results/README.md), the per-process device files and mappings of a real 2-GPU H200
(tests/fixtures/h200x2-proc, replayed case by case), fault injection, and the namespace
rig itself.
"""
import json
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

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(TESTS, "fixtures", "nvidia-smi", "h200-580.159.04")
IDLE_UUID = "GPU-f07bb63c-cd2e-fe8d-534a-d4b919fe9734"   # idle_* captures
HELD_UUID = "GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5"   # held_* captures (another boot)
MEM = ("--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
APPS = ("--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits")

# Real readings of a 2-GPU H200 node: what each process holds, compute apps, memory.used.
with open(os.path.join(TESTS, "fixtures", "h200x2-proc", "maps_probe.json")) as _f:
    REAL = json.load(_f)


def _mib(row):
    """'0, 2575', '..., 2566 MiB' or '2566 MiB' -> 2575 / 2566 / 2566."""
    return int(row.rsplit(", ", 1)[-1].split()[0])


# memory.used over the app with one context: "0, 2575" for one 2566 MiB app (cvd0_holder)
OVH = _mib(REAL["cvd0_holder"]["used"][0]) - _mib(REAL["cvd0_holder"]["apps"][0])
# a GPU without a context beside a process that maps its node: "0, 4" (orphan_child_gpu1)
FOOT = _mib(REAL["orphan_child_gpu1"]["used"][0])


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
            raise AssertionError(f"condition not met after {timeout:.1f} s")
        time.sleep(step)


# /proc of some pids as seen inside the namespace: /dev/nvidia* fds (count per path), maps
# (count and KiB per path), ppid, pgid, sid -- the shape of maps_probe.json's readings
PROBE = r"""
import json, os, sys
out = {}
for pid in sys.argv[1:]:
    r = {"fds": {}, "maps": {}, "map_kib": {}}
    d = "/proc/%s/fd" % pid
    for fd in os.listdir(d):
        try:
            t = os.readlink(d + "/" + fd)
        except OSError:
            continue
        if t.startswith("/dev/nvidia"):
            r["fds"][t] = r["fds"].get(t, 0) + 1
    with open("/proc/%s/maps" % pid) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/nvidia"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                r["maps"][parts[5]] = r["maps"].get(parts[5], 0) + 1
                r["map_kib"][parts[5]] = r["map_kib"].get(parts[5], 0) + (end - start) // 1024
    with open("/proc/%s/stat" % pid) as f:
        st = f.read()
    rest = st[st.rindex(")") + 2:].split()
    r.update(ppid=int(rest[1]), pgid=int(rest[2]), sid=int(rest[3]))
    out[pid] = r
print(json.dumps(out))
"""


def probe(host, pids):
    """{pid: reading} read from inside the namespace (see PROBE)."""
    r = host.run(["python3", "-c", PROBE] + [str(p) for p in pids])
    assert r.returncode == 0, r.stderr
    return dict((int(k), v) for k, v in json.loads(r.stdout).items())


def devices(reading):
    """The device part of a reading (fds, maps, map_kib), as compared with the fixture."""
    return dict((k, reading[k]) for k in ("fds", "maps", "map_kib"))


def _gpu_node(path):
    return path.startswith("/dev/nvidia") and path[len("/dev/nvidia"):].isdigit()


def _node(cfg, index):
    return "/dev/nvidia{}".format(next(g["minor"] for g in cfg["gpus"] if g["index"] == index))


def cuda_view(cfg, ctx, visible=None):
    """What a CUDA process with contexts on GPU indexes ctx holds on host cfg, generalised
    from the real readings: two_holders' gpu0_holder (a context GPU and a visible peer) and
    cvd0_holder (a hidden GPU); nvidiactl gains one mapping per visible GPU (28 with two
    visible, 27 with one)."""
    full, cvd = REAL["two_holders"]["gpu0_holder"], REAL["cvd0_holder"]["holder"]
    ctx_node, other = "/dev/nvidia0", "/dev/nvidia1"
    vis = [g["index"] for g in cfg["gpus"]] if visible is None else visible
    out = {"fds": {}, "maps": {}, "map_kib": {}}
    for k in out:
        for path, v in cvd[k].items():
            if not _gpu_node(path):
                out[k][path] = v + (len(vis) - 1) * (full[k][path] - v)
    for g in cfg["gpus"]:
        i, path = g["index"], _node(cfg, g["index"])
        if i in ctx:
            src, node = full, ctx_node
        elif i in vis:
            src, node = full, other
        else:
            src, node = cvd, other
        for k in out:
            if node in src[k]:
                out[k][path] = src[k][node]
    return out


def nvml_view(cfg, real):
    """What an NVML client (maps_probe's dmon or pynvml reading) holds on host cfg: the
    first GPU's node as /dev/nvidia0 there, every other one as /dev/nvidia1; mappings of
    control nodes scale with the GPU count (two in the reading)."""
    n = len(cfg["gpus"])
    out = {"fds": {}, "maps": {}, "map_kib": {}}
    for k in out:
        for path, v in real[k].items():
            if not _gpu_node(path):
                out[k][path] = v if k == "fds" else v * n // 2
    for g in cfg["gpus"]:
        as_in_reading = "/dev/nvidia0" if g["index"] == 0 else "/dev/nvidia1"
        out["fds"][_node(cfg, g["index"])] = real["fds"][as_in_reading]
    return out


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
        expected = expected.replace("427, ", f"{a.pid}, ").replace("426, ", f"{b.pid}, ")
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
    # its context on GPU 0; it maps every other GPU's node: the cross-GPU footprint there
    assert used(host8) == [40960 + OVH] + [FOOT] * 7
    assert apps(host8) == [[str(p.pid), "python3", "40960", host8.config["gpus"][0]["uuid"]]]
    t0 = time.monotonic()
    assert host8.kill(p.pid)
    assert p.wait_gone(2)
    wait_for(lambda: used(host8) == [0] * 8, timeout=10)  # a deadline, not a measured lag: each read is a run of the simulated nvidia-smi
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
    (r,) = probe(host8, [p.pid]).values()
    # index 0 is /dev/nvidia1: the context-sized node; /dev/nvidia0 (index 1) is a peer
    assert (r["fds"]["/dev/nvidia1"], r["maps"]["/dev/nvidia1"]) == (23, 3)
    assert (r["fds"]["/dev/nvidia0"], r["maps"]["/dev/nvidia0"]) == (7, 2)
    assert used(host8)[:2] == [1000 + OVH, FOOT]


def test_forked_child_keeps_memory_owner_shown_not_found(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "1", "--mib", "2048", "--fork-child"])
    (child,) = p.children
    host8.kill(p.pid)
    p.wait_gone(2)
    time.sleep(0.2)  # well past the release delay: the child still holds the context
    assert used(host8, 1) == 2048 + OVH
    # The real driver names the dead owner [Not Found] right after the kill and [No data] 0.5 s
    # later (both read on the H200); a loaded machine may read past that switch.
    [(pid, name, mib, uuid)] = apps(host8)
    assert (pid, mib, uuid) == (str(p.pid), "2048", host8.config["gpus"][1]["uuid"]) and name in ("[Not Found]", "[No data]"), name
    assert host8.alive(child)
    ppid = host8.run(["ps", "-o", "ppid=", "-p", str(child)]).stdout.strip()
    assert ppid == "1"  # reparented to the namespace's init
    host8.kill(child)
    wait_for(lambda: used(host8, 1) == 0, timeout=10)  # a deadline, not a measured lag: each read is a run of the simulated nvidia-smi


def test_vllm_workers_outlive_the_api_server(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "4,5", "--mib", "30000", "--workers", "2",
                     "--worker-name", "VLLM::Worker_TP{i}"])
    assert sorted(a[1] for a in apps(host8)) == ["VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    host8.kill(p.pid)
    p.wait_gone(2)
    time.sleep(0.2)
    assert used(host8) == [FOOT] * 4 + [30000 + OVH] * 2 + [FOOT] * 2
    comm = host8.read(f"/proc/{p.workers[0]}/comm").strip()
    assert comm == "VLLM::Worker_TP"  # 15 characters, as the kernel truncates


def test_vllm_api_server_is_an_nvml_client_and_workers_cuda_processes(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "4,5", "--mib", "1000", "--workers", "2"])
    got = probe(host8, [p.pid] + p.workers)
    assert devices(got[p.pid]) == nvml_view(host8.config, REAL["monitors"]["pynvml"])
    for i, w in enumerate(p.workers):
        assert devices(got[w]) == cuda_view(host8.config, [4 + i])


def test_control_nodes_and_bare_device_holders_use_no_memory(host8):
    d = host8.spawn(["gpu_holder", "--no-context", "--name", "nvidia-persistenced"])
    c = host8.spawn(["gpu_holder", "--control-only"])
    s = host8.spawn(["sh", "-c", "exec sleep 1000 </dev/nvidia2"])
    wait_for(lambda: "/dev/nvidia2" in host8.run(["ls", "-l", f"/proc/{s.pid}/fd"]).stdout)
    assert used(host8) == [0] * 8 and apps(host8) == []
    got = probe(host8, [d.pid, c.pid])
    # nvidia-persistenced: one fd on every GPU node and on nvidiactl, no mapping
    assert devices(got[d.pid]) == {"fds": dict([("/dev/nvidiactl", 1)] + [
        (f"/dev/nvidia{m}", 1) for m in range(8)]), "maps": {}, "map_kib": {}}
    assert devices(got[c.pid]) == {"fds": {"/dev/nvidiactl": 1, "/dev/nvidia-uvm": 1},
                                   "maps": {}, "map_kib": {}}
    cmdline = host8.read(f"/proc/{d.pid}/cmdline").split("\0")
    assert cmdline[0] == "nvidia-persistenced"
    assert host8.read(f"/proc/{d.pid}/comm").strip() == "nvidia-persiste"


def test_map_only_holder(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "6", "--mib", "512", "--map-only"])
    (r,) = probe(host8, [p.pid]).values()
    full = cuda_view(host8.config, [6])
    assert r["fds"] == {} and (r["maps"], r["map_kib"]) == (full["maps"], full["map_kib"])
    assert used(host8) == [FOOT] * 6 + [512 + OVH, FOOT]


def test_ignore_term(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "7", "--mib", "100", "--ignore-term"])
    host8.kill(p.pid, signal.SIGTERM)
    time.sleep(0.3)
    assert p.alive() and used(host8, 7) == 100 + OVH
    host8.kill(p.pid, signal.SIGKILL)
    wait_for(lambda: used(host8, 7) == 0, timeout=10)  # a deadline, not a measured lag: each read is a run of the simulated nvidia-smi


# ------------------------------------------------------------------ the real 2-GPU H200
# Each case of tests/fixtures/h200x2-proc/maps_probe.json replayed on the h200x2 preset: the
# same processes, then the same /proc readings, compute apps and memory.used.
APPS_BUS = ("--query-compute-apps=gpu_bus_id,pid,process_name,used_memory", "--format=csv,noheader")


@pytest.fixture(scope="module")
def h200x2_host():
    with NsHost(preset="h200x2", seed="h200x2-node") as h:
        yield h


@pytest.fixture
def host2(h200x2_host):
    """The shared 2-GPU host, reset after each test like host8."""
    before = set(_ns_pids(h200x2_host))
    yield h200x2_host
    h200x2_host.clear_faults()
    for pid in set(_ns_pids(h200x2_host)) - before:
        h200x2_host.kill(pid)
    wait_for(lambda: used(h200x2_host) == [0, 0], timeout=10)


def used_rows(host):
    r = host.smi(*MEM)
    assert r.returncode == 0, r.stdout
    return r.stdout.splitlines()


def app_rows(host):
    r = host.smi(*APPS_BUS)
    assert r.returncode == 0, r.stdout
    return r.stdout.splitlines()


def expected_rows(case, pids):
    """The case's compute-apps rows with each real pid replaced by the sim's (pids: real
    pid -> sim pid)."""
    out = []
    for row in REAL[case]["apps"]:
        bus, pid, rest = row.split(", ", 2)
        out.append(", ".join((bus, str(pids[int(pid)]), rest)))
    return out


def _app(case, index):
    """(real pid, process name, MiB) of the case's compute-apps row on GPU index."""
    bus = make_config("h200x2")["gpus"][index]["pci_bus_id"]
    (row,) = [r for r in REAL[case]["apps"] if r.startswith(bus + ", ")]
    _bus, pid, name, mib = row.split(", ")
    return int(pid), name, _mib(mib)


def holder(host, case, index, gpus=None, env=None, extra=()):
    """Spawn the case's CUDA process of GPU index: its MiB and process name from the row."""
    _pid, name, mib = _app(case, index)
    argv = ["gpu_holder", "--gpus", str(index if gpus is None else gpus), "--mib", str(mib)]
    if not name.startswith("["):
        argv += ["--name", name]
    return host.spawn(argv + list(extra), env=env)


def test_h200x2_preset_is_the_measured_node(host2):
    buses = [g["pci_bus_id"] for g in host2.config["gpus"]]
    assert buses == ["00000000:00:06.0", "00000000:00:07.0"]
    assert [r.split(", ")[0] for r in REAL["two_holders"]["apps"]] == buses
    assert host2.config["driver_version"] == "580.159.04"
    assert host2.run(["ls", "/dev/nvidia-caps"]).stdout.split() == ["nvidia-cap1", "nvidia-cap2"]


def test_real_two_holders(host2):
    case = REAL["two_holders"]
    a = holder(host2, "two_holders", 0)
    b = holder(host2, "two_holders", 1)
    got = probe(host2, [a.pid, b.pid])
    assert devices(got[a.pid]) == devices(case["gpu0_holder"])
    assert devices(got[b.pid]) == devices(case["gpu1_holder"])
    assert app_rows(host2) == expected_rows("two_holders", {
        _app("two_holders", 0)[0]: a.pid, _app("two_holders", 1)[0]: b.pid})
    assert used_rows(host2) == case["used"]


@pytest.mark.parametrize("name,cvd", [("cvd0_holder", "0"), ("cvd1_holder", "1")])
def test_real_cuda_visible_devices_holder(host2, name, cvd):
    case = REAL[name]
    index = int(cvd)
    # --gpus 0 is the first VISIBLE GPU: physical GPU cvd
    p = holder(host2, name, index, gpus=0, env={"CUDA_VISIBLE_DEVICES": cvd})
    (got,) = probe(host2, [p.pid]).values()
    assert devices(got) == devices(case["holder"])
    assert app_rows(host2) == expected_rows(name, {_app(name, index)[0]: p.pid})
    assert used_rows(host2) == case["used"]  # no cross-GPU footprint: the peer is not mapped


def test_real_orphan_child(host2):
    case = REAL["orphan_child_gpu1"]
    dead, _name, mib = _app("orphan_child_gpu1", 1)
    assert dead == case["dead_parent"]
    p = host2.spawn(["gpu_holder", "--gpus", "1", "--mib", str(mib), "--fork-child"])
    (child,) = p.children
    got = probe(host2, [p.pid, child])
    before = case["child_before_parent_death"]
    assert devices(got[child]) == devices(before)  # nvidia-uvm's mapping is not inherited
    assert before["ppid"] == dead and got[child]["ppid"] == p.pid
    # process group and session are the parent's, and stay so
    assert (got[child]["pgid"], got[child]["sid"]) == (got[p.pid]["pgid"], got[p.pid]["sid"])
    assert host2.kill(p.pid) and p.wait_gone(2)
    after = case["child_after"]
    (now,) = probe(host2, [child]).values()
    assert devices(now) == devices(after)
    assert (after["ppid"], now["ppid"]) == (1, 1)
    assert (after["pgid"], after["sid"]) == (before["pgid"], before["sid"])
    assert (now["pgid"], now["sid"]) == (got[child]["pgid"], got[child]["sid"])
    assert app_rows(host2) == expected_rows("orphan_child_gpu1", {dead: p.pid})  # [Not Found]
    assert used_rows(host2) == case["used"]  # the orphan maps GPU 0: the footprint there


def test_real_monitors(host2):
    case = REAL["monitors"]
    dmon = host2.spawn(["gpu_holder", "--monitor", "dmon"])
    nvml = host2.spawn(["gpu_holder", "--monitor", "pynvml"])
    got = probe(host2, [dmon.pid, nvml.pid])
    assert devices(got[dmon.pid]) == devices(case["dmon"])
    assert devices(got[nvml.pid]) == devices(case["pynvml"])
    assert app_rows(host2) == expected_rows("monitors", {}) == []
    assert used_rows(host2) == case["used"]


def test_real_final_idle_after_all_killed(host2):
    procs = [holder(host2, "two_holders", 0), holder(host2, "two_holders", 1),
             holder(host2, "cvd1_holder", 1, gpus=0, env={"CUDA_VISIBLE_DEVICES": "1"}),
             host2.spawn(["gpu_holder", "--gpus", "1", "--fork-child"]),
             host2.spawn(["gpu_holder", "--monitor", "dmon"]),
             host2.spawn(["gpu_holder", "--monitor", "pynvml"])]
    assert used_rows(host2) != REAL["final"]["used"]
    for p in procs:
        for pid in [p.pid] + p.children:
            host2.kill(pid)
    wait_for(lambda: used_rows(host2) == REAL["final"]["used"], timeout=3)
    assert app_rows(host2) == REAL["final"]["apps"]


def test_footprint_is_per_gpu_not_per_process(host2):
    # tests/gpu/results/README.md: 4 MiB on GPU 1 "also with two such processes"
    holder(host2, "two_holders", 0)
    holder(host2, "two_holders", 0)
    assert used(host2)[1] == FOOT


def test_cross_gpu_footprint_on_8_gpus(host8):
    p = host8.spawn(["gpu_holder", "--gpus", "3", "--mib", "1000"])
    (got,) = probe(host8, [p.pid]).values()
    assert devices(got) == cuda_view(host8.config, [3])
    assert used(host8) == [FOOT] * 3 + [1000 + OVH] + [FOOT] * 4  # nothing extra on GPU 3
    assert apps(host8) == [[str(p.pid), "python3", "1000", host8.config["gpus"][3]["uuid"]]]
    host8.spawn(["gpu_holder", "--gpus", "5", "--mib", "1000"])
    assert used(host8) == [FOOT] * 3 + [1000 + OVH, FOOT, 1000 + OVH] + [FOOT] * 2


def test_cuda_visible_devices_holder_leaves_no_footprint(host8):
    # index 0 is /dev/nvidia1 on this host
    p = host8.spawn(["gpu_holder", "--gpus", "0", "--mib", "1000"],
                    env={"CUDA_VISIBLE_DEVICES": "0"})
    (got,) = probe(host8, [p.pid]).values()
    assert devices(got) == cuda_view(host8.config, [0], visible=[0])
    assert used(host8) == [1000 + OVH] + [0] * 7
    host8.kill(p.pid)
    wait_for(lambda: used(host8) == [0] * 8)
    # UUIDs, in CUDA's order: logical 1 is physical 2; GPU 5 is visible (mapped), the rest hidden
    uuids = [g["uuid"] for g in host8.config["gpus"]]
    p = host8.spawn(["gpu_holder", "--gpus", "1", "--mib", "1000"],
                    env={"CUDA_VISIBLE_DEVICES": f"{uuids[5]},{uuids[2]}"})
    (got,) = probe(host8, [p.pid]).values()
    assert devices(got) == cuda_view(host8.config, [2], visible=[5, 2])
    assert used(host8) == [0, 0, 1000 + OVH, 0, 0, FOOT, 0, 0]
    with pytest.raises(Exception, match="CUDA_VISIBLE_DEVICES"):
        host8.spawn(["gpu_holder", "--gpus", "1"], env={"CUDA_VISIBLE_DEVICES": "4"})


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


def test_a_half_written_context_is_skipped_and_a_complete_one_counts(host8):
    """The simulator reads its JSON through json's C scanner (tests/sim/nvidia-smi, json_load):
    a context file cut short (a holder mid write) is left out of that reading, as with json."""
    contexts = "/run/nvidia-sim/contexts"
    holder = host8.spawn(["gpu_holder", "--gpus", "3", "--mib", "2048"])
    (name,) = [n for n in host8.run(["ls", contexts]).stdout.split() if n.endswith(".json")]
    whole = host8.read(f"{contexts}/{name}")
    assert used(host8)[3] == 2048 + OVH
    for cut in (whole[: len(whole) // 2], whole + " {}", "", "\ufeff" + whole):
        host8.run(["sh", "-c", f"cat > {contexts}/{name}"], input=cut, check=True)
        assert used(host8)[3] == 0, cut  # as a GPU with no context
    host8.run(["sh", "-c", f"cat > {contexts}/{name}"], input=whole + "\n", check=True)
    assert used(host8)[3] == 2048 + OVH
    host8.kill(holder.pid, signal.SIGKILL)


@pytest.mark.parametrize("argv", [["nvidia-smi", "-L"], ["journalctl", "-k", "--since", "-5min"], ["dmesg"]],
                         ids=["nvidia-smi", "journalctl", "dmesg"])
def test_the_simulated_tools_start_without_json_or_re(host8, argv):
    """Called thousands of times a suite: json (with re and enum) cost ~10 ms of CPU at each start
    on the 2-core machine, a third of a call (issue 34). A structural check, not a timing."""
    path = host8.run(["sh", "-c", f"command -v {argv[0]}"]).stdout.strip()
    run = host8.run(["python", "-X", "importtime", path, *argv[1:]])
    assert run.returncode == 0, run.stdout + run.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "os" in imported, run.stderr  # importtime did report
    assert not imported & {"json", "re", "enum", "socket"}, sorted(imported)


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
    for h in (a, b):  # MIG or not (the real non-MIG H200 has them)
        assert h.run(["ls", "/dev/nvidia-caps"]).stdout.split() == ["nvidia-cap1", "nvidia-cap2"]
    init, d = a.init_pid, a.dir
    a.stop()
    assert not os.path.exists(f"/proc/{init}") and not os.path.exists(d)
    assert [os.path.exists(p) for p in ("/dev/nvidia-caps", "/usr/bin/nvidia-smi")] == real
