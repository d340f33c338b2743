"""A fleet of real systemd hosts with simulated NVIDIA GPUs, for tests of zeromib.gpu.

Each host is a booted Debian 12 (or, with --suite trixie, 13) container (systemd-nspawn, real systemd, sshd, python3) on its
own network namespace, reachable over SSH exactly as Ansible reaches a GPU node. All hosts share
one read-only base rootfs (built once with mmdebstrap and cached as a tarball); each host writes
into its own overlay upper dir, which also carries the GPU simulator and the workload units.

    python3 tests/fleet/fleet.py up --hosts 8 [--profile mixed|h200] [--name PREFIX] [--suite bookworm|trixie] [--device-bpf]
    fleet.py status [--name PREFIX]
    fleet.py workload HOST NAME [--name PREFIX] [--gpus 0,1] [--mib N]
    fleet.py reboot HOST [--name PREFIX]
    fleet.py ssh HOST COMMAND... [--name PREFIX]
    fleet.py guest HOST [--kind lxc|lxd|nspawn] [--guest 101] [--gpu N] [--name PREFIX]
    fleet.py try [--hosts 4] [--name PREFIX]   # `make fleet-up`: a fleet to try your own playbook on
    fleet.py down [--name PREFIX]
    fleet.py base [--suite trixie]
    fleet.py clean              # every fleet of this checkout down, the base rootfs cache removed

Everything a fleet creates is written to its state dir (default /run/zeromib-fleet/PREFIX/)
before it is created, and `down` acts only on what that state dir records: processes are ended
by PID after checking they live in the fleet's own cgroups, or through those cgroups.
Stdlib only; importable (see Fleet) and used by tests/fleet/conftest.py.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLEET_DIR = Path(__file__).resolve().parent
SIM_DIR = REPO / "tests" / "sim"
COLLECTIONS_PATH = REPO / ".build" / "collections"

CACHE_DIR = Path(os.environ.get("ZEROMIB_FLEET_CACHE", "/var/cache/zeromib-fleet"))
STATE_ROOT = Path(os.environ.get("ZEROMIB_FLEET_STATE", "/run/zeromib-fleet"))
DEFAULT_PREFIX = "zmf"
MAX_HOSTS = 32

# The one place the Debian archive is named; override with ZEROMIB_FLEET_MIRROR.
DEBIAN_MIRROR = os.environ.get("ZEROMIB_FLEET_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"  # every fleet's hosts, unless `up` is given another suite
# Debian 13 (Slurm 24.11, Python 3.13, systemd 257): a second base, built the first time a test
# (or `fleet.py up --suite trixie`) asks for it and cached beside the bookworm one.
SUITES = ("bookworm", "trixie")
PACKAGES = [
    "systemd", "systemd-sysv", "dbus", "libpam-systemd", "openssh-server", "python3",
    "iproute2", "procps", "usr-is-merged", "psmisc",
    # Launchers: what starts GPU jobs on real nodes and must never be stopped for them.
    "at", "cron", "munge", "slurmd", "slurmctld", "slurm-client",
]
# Installed but not started at boot: a test starts them on the hosts it uses (each host its own
# single-node Slurm cluster), so that a fleet of 32 does not run 32 controllers for nothing.
NOT_AT_BOOT = ["munge.service", "slurmd.service", "slurmctld.service"]
# Units that only cost time or CPU in a test host, or wait for a console nobody attaches.
MASKED_UNITS = [
    "apt-daily.timer", "apt-daily-upgrade.timer", "systemd-tmpfiles-clean.timer",
    "e2scrub_all.timer", "fstrim.timer", "console-getty.service", "getty@tty1.service",
    "systemd-networkd-wait-online.service",
]
HOST_MASKED_UNITS = ["user@.service", "dpkg-db-backup.timer"]
# mmdebstrap customize hooks; "$1" is the new root. Per-fleet things (the SSH key, the GPU
# simulator, the workloads) go into each host's overlay upper dir instead, so changing them
# never rebuilds the base.
CUSTOMIZE_HOOKS = [
    'rm -f "$1/etc/hostname"',
    ': > "$1/etc/machine-id"',
    'rm -f "$1/var/lib/dbus/machine-id"',
    *[f'ln -sf /dev/null "$1/etc/systemd/system/{u}"' for u in MASKED_UNITS],
    'mkdir -p "$1/etc/systemd/journald.conf.d"',
    "printf '[Journal]\\nStorage=volatile\\nRuntimeMaxUse=8M\\nForwardToConsole=no\\n' "
    '> "$1/etc/systemd/journald.conf.d/zeromib-fleet.conf"',
    # Ansible with N forks opens many sessions at once.
    "printf 'PermitRootLogin prohibit-password\\nPasswordAuthentication no\\nUseDNS no\\n"
    "MaxStartups 200:30:400\\nMaxSessions 200\\n' > \"$1/etc/ssh/sshd_config.d/zeromib-fleet.conf\"",
    *[f'rm -f "$1/etc/systemd/system/multi-user.target.wants/{u}"' for u in NOT_AT_BOOT],
    'rm -rf "$1/var/lib/apt/lists/"* "$1/var/cache/apt/"*.bin',
]
BASE_RECIPE = {
    "version": 1,
    "variant": "minbase",
    "suite": SUITE,
    "mirror": DEBIAN_MIRROR,
    "packages": PACKAGES,
    "hooks": CUSTOMIZE_HOOKS,
}

# `up --device-bpf`: hosts whose systemd manages device access, as on a real node: without bpf()
# (EPERM in a default nspawn host) systemd attaches no device program to any unit (TEST_RIGS §8).
DEVICE_BPF_ARGS = ["--capability=CAP_BPF,CAP_SYS_ADMIN,CAP_PERFMON", "--system-call-filter=bpf"]

SUBNET_PREFIX = "10.213"  # 10.213.<slot>.<4*i+1|2>/30 per host; only on our own veth pairs
NSPAWN_REBOOT_RC = 133
PROFILES = ("mixed", "h200")


def ansible_env(ansible_cfg: Path) -> dict:
    """The environment for ansible-playbook against a fleet: its ansible.cfg and this checkout's
    collection on the path (the link is what `make collection` makes)."""
    collections = REPO / ".build" / "collections"
    link = collections / "ansible_collections" / "zeromib" / "gpu"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("../../../..")
    env = dict(os.environ)
    env.update({"ANSIBLE_CONFIG": str(ansible_cfg), "ANSIBLE_COLLECTIONS_PATH": str(collections),
                "ANSIBLE_DEPRECATION_WARNINGS": "0"})
    return env


def checkout_prefix(kind: str = "t") -> str:
    """A fleet prefix of this checkout: two checkouts on one machine never share a fleet, and
    a test run that was killed is cleaned up by the next run in the same checkout."""
    return kind + hashlib.sha1(str(REPO).encode()).hexdigest()[:5]


class FleetError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("stdin", subprocess.DEVNULL)
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    r = subprocess.run(cmd, check=False, **kw)
    if check and r.returncode != 0:
        raise FleetError(f"{shlex.join(cmd)} -> rc {r.returncode}: {(r.stderr or '').strip()}")
    return r


# ---------------------------------------------------------------------------- base rootfs

def base_recipe(suite: str = SUITE) -> dict:
    """BASE_RECIPE for SUITE: the same packages and hooks (bookworm's is BASE_RECIPE itself, so
    its hash, and the cached base, stay what they were)."""
    if suite not in SUITES:
        raise FleetError(f"unknown suite {suite!r}; choose from {SUITES}")
    return dict(BASE_RECIPE, suite=suite)


def recipe_hash(suite: str = SUITE) -> str:
    return hashlib.sha256(json.dumps(base_recipe(suite), sort_keys=True).encode()).hexdigest()[:12]


def base_paths(suite: str = SUITE) -> tuple[Path, Path]:
    h = recipe_hash(suite)
    return CACHE_DIR / f"base-{suite}-{h}.tar", CACHE_DIR / f"base-{suite}-{h}"


def ensure_base(timings: dict | None = None, suite: str = SUITE) -> Path:
    """The extracted base rootfs of SUITE, built (mmdebstrap) and restored (tar) only when missing."""
    timings = timings if timings is not None else {}
    tarball, root = base_paths(suite)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".zeromib-complete").exists():
            return root
        if not tarball.exists():
            t0 = time.monotonic()
            tmp = tarball.with_suffix(".tar.tmp")
            cmd = ["mmdebstrap", "--quiet", "--mode=root", "--format=tar",
                   f"--variant={BASE_RECIPE['variant']}", "--include=" + ",".join(PACKAGES)]
            cmd += [f"--customize-hook={h}" for h in CUSTOMIZE_HOOKS]
            cmd += [suite, str(tmp), DEBIAN_MIRROR]
            log(f"building base rootfs {tarball.name} (mmdebstrap, ~20-40 s)")
            run(cmd, capture_output=False, stdout=subprocess.DEVNULL)
            tmp.rename(tarball)
            timings["base_build_s"] = round(time.monotonic() - t0, 2)
            log(f"base built in {timings['base_build_s']} s ({tarball.stat().st_size >> 20} MiB)")
        t0 = time.monotonic()
        tmpdir = root.with_name(root.name + ".tmp")
        if tmpdir.exists():
            shutil.rmtree(tmpdir)
        tmpdir.mkdir()
        run(["tar", "-C", str(tmpdir), "--numeric-owner", "--xattrs", "--xattrs-include=*",
             "-xpf", str(tarball)])
        (tmpdir / ".zeromib-complete").touch()
        if root.exists():
            shutil.rmtree(root)
        tmpdir.rename(root)
        timings["base_restore_s"] = round(time.monotonic() - t0, 2)
        log(f"base restored in {timings['base_restore_s']} s")
        return root


# ---------------------------------------------------------------------------- GPU simulator

def profile_presets(profile: str, n: int) -> list[str]:
    if profile == "h200":
        return ["h200x8"] * n
    if profile == "mixed":
        if n == 1:
            return ["h200x8"]
        if n == 2:
            return ["h200x8", "h100x4"]
        return ["h200x8"] * (n - 2) + ["h100x4", "a100-mig"]
    raise FleetError(f"unknown profile {profile!r}; choose from {PROFILES}")


def make_config(preset: str, host: str, minors: list[int] | None = None) -> dict:
    """tests/sim/make_config.py's config for PRESET, seeded with the host name."""
    global _make_config
    if _make_config is None:
        spec = importlib.util.spec_from_file_location("_nvidia_sim_make_config", SIM_DIR / "make_config.py")
        mod = importlib.util.module_from_spec(spec)
        dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
        try:
            spec.loader.exec_module(mod)
        finally:
            sys.dont_write_bytecode = dont_write
        _make_config = mod.make_config
    return _make_config(preset, seed=host, minors=minors)


_make_config = None


def config_gpus(config: dict) -> list[dict]:
    """index, minor, bus id, uuid, name of each simulated GPU, whatever the config calls them."""
    out = []
    for i, g in enumerate(config.get("gpus", [])):
        idx = int(g.get("index", i))
        minor = int(g.get("minor_number", g.get("minor", idx)))
        bus = str(g.get("pci_bus_id", g.get("pci.bus_id", f"00000000:{0x18 + idx:02X}:00.0")))
        out.append({"index": idx, "minor": minor, "pci_bus_id": bus,
                    "uuid": g.get("uuid", ""), "name": g.get("name", "NVIDIA GPU")})
    return out


DEVICES_SCRIPT = r'''#!/usr/bin/python3
# Creates the simulated GPUs' device nodes and /proc/driver/nvidia at boot, as the NVIDIA
# driver does (same layout as tests/sim/nshost.py). The nodes are char 1:5 (/dev/zero
# semantics: holders can open and map them; fuser and /proc/*/fd and /proc/*/maps see them).
import json, os, subprocess
cfg = json.load(open("/etc/nvidia-sim/config.json"))
driver = cfg.get("driver_version", "")

def node(path):
    if os.path.lexists(path):
        os.unlink(path)
    os.mknod(path, 0o666 | 0o020000, os.makedev(1, 5))
    os.chmod(path, 0o666)

for g in cfg["gpus"]:
    node("/dev/nvidia%d" % g["minor"])
for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
    node("/dev/" + n)
# every host, MIG or not, as on the real 2-GPU H200 (tests/fixtures/h200x2-proc)
os.makedirs("/dev/nvidia-caps", exist_ok=True)
for n in ("nvidia-cap1", "nvidia-cap2"):
    node("/dev/nvidia-caps/" + n)

# A tmpfs over /proc/driver, inside this host only; gone at reboot, like the real one.
if os.path.ismount("/proc/driver"):
    subprocess.run(["umount", "/proc/driver"], check=False)
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755,size=1m", "nvidia-sim", "/proc/driver"], check=True)
os.makedirs("/proc/driver/nvidia/gpus")
with open("/proc/driver/nvidia/version", "w") as f:
    f.write("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  %s  Release Build  "
            "(dvs-builder@U22-I3-AF03-09-1)  Tue Jul  8 17:52:20 UTC 2025\n"
            "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n" % driver)
for g in cfg["gpus"]:
    dom, rest = g["pci_bus_id"].lower().split(":", 1)
    loc = "%s:%s" % (dom[-4:], rest)
    os.makedirs("/proc/driver/nvidia/gpus/" + loc)
    with open("/proc/driver/nvidia/gpus/%s/information" % loc, "w") as f:
        f.write("Model: \t\t %s\n" % g["name"] +
                "IRQ:   \t\t %d\n" % (150 + g["index"]) +
                "GPU UUID: \t %s\n" % g["uuid"] +
                "Video BIOS: \t %s\n" % str(g.get("vbios_version", "??.??.??.??.??")).lower() +
                "Bus Type: \t PCIe\n"
                "DMA Size: \t 52 bits\n"
                "DMA Mask: \t 0xfffffffffffff\n" +
                "Bus Location: \t %s\n" % loc +
                "Device Minor: \t %d\n" % g["minor"] +
                "GPU Firmware: \t %s\n" % driver +
                "GPU Excluded:\t No\n")
subprocess.run(["mount", "-o", "remount,ro", "/proc/driver"], check=True)
'''

DEVICES_UNIT = """[Unit]
Description=Simulated NVIDIA device nodes and /proc/driver/nvidia
DefaultDependencies=no
After=systemd-tmpfiles-setup-dev.service
Before=sysinit.target shutdown.target
Conflicts=shutdown.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/nvidia-sim-devices

[Install]
WantedBy=sysinit.target
"""

# Workload units. ${ALL_GPUS} and ${GPU_COUNT} come from /etc/nvidia-sim/workloads.env.
WORKLOAD_UNITS = {
    "vllm.service": """[Unit]
Description=vLLM OpenAI-compatible server (simulated)
After=nvidia-sim-devices.service

[Service]
EnvironmentFile=/etc/nvidia-sim/workloads.env
# gpu_holder re-execs itself as "VLLM::EngineCore"; Python then finds no sys.executable unless
# that name is on PATH, and cannot start the workers (see VLLM_ARGV0_WORKAROUND in fleet.py).
Environment=PATH=/usr/local/lib/nvidia-sim-argv0:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ExecStartPre=-/bin/rm -f /run/nvidia-sim/ready/vllm
ExecStart=/usr/local/bin/gpu_holder --gpus ${ALL_GPUS} --mib 40960 --name VLLM::EngineCore \\
    --workers ${GPU_COUNT} --worker-name VLLM::Worker_TP{i} --ready-file /run/nvidia-sim/ready/vllm
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
""",
    "sglang.service": """[Unit]
Description=SGLang server (simulated)
After=nvidia-sim-devices.service

[Service]
EnvironmentFile=/etc/nvidia-sim/workloads.env
ExecStartPre=-/bin/rm -f /run/nvidia-sim/ready/sglang
ExecStart=/usr/local/bin/gpu_holder --gpus ${ALL_GPUS} --mib 30720 --name sglang::scheduler --ready-file /run/nvidia-sim/ready/sglang
Restart=on-failure
RestartSec=1

[Install]
WantedBy=multi-user.target
""",
    # vLLM V1's shape: the API server (the unit's main process) holds no GPU, its EngineCore
    # child does (docs/docsite/rst/guide_design.rst,
    # "Known field behaviour elsewhere"). Stopped through the unit, never merely killed.
    "vllm-v1.service": """[Unit]
Description=vLLM V1 server (simulated): API server without GPU, EngineCore child on the GPU
After=nvidia-sim-devices.service

[Service]
EnvironmentFile=/etc/nvidia-sim/workloads.env
Environment=PATH=/usr/local/lib/nvidia-sim-argv0:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
ExecStartPre=-/bin/rm -f /run/nvidia-sim/ready/vllm-v1
ExecStart=/usr/local/bin/gpu_holder --gpus 0 --mib 20480 --name vllm --workers 1 --worker-name VLLM::EngineCore \\
    --ready-file /run/nvidia-sim/ready/vllm-v1
Restart=always
RestartSec=1

[Install]
WantedBy=multi-user.target
""",
    # A main process that ignores SIGTERM, with systemd's default stop timeout (90 s) rather than
    # the fleet's DefaultTimeoutStopSec=5s: an unbounded `systemctl stop` would wait it out.
    "stubborn.service": """[Unit]
Description=A GPU server that ignores SIGTERM (simulated)
After=nvidia-sim-devices.service

[Service]
ExecStartPre=-/bin/rm -f /run/nvidia-sim/ready/stubborn
ExecStart=/usr/local/bin/gpu_holder --gpus 0 --mib 4096 --ignore-term --name stubborn_serve --ready-file /run/nvidia-sim/ready/stubborn
Restart=always
RestartSec=1
TimeoutStopSec=90s

[Install]
WantedBy=multi-user.target
""",
    # A hub whose kernels are its children, in its unit; named unlike jupyterhub.service on
    # purpose (its main process is what says it is a launcher). See notebook_hub.py.
    "notebook-hub.service": """[Unit]
Description=Notebook hub (simulated): kernels are children of the hub, in this unit
After=nvidia-sim-devices.service

[Service]
ExecStart=/usr/local/bin/jupyterhub
Restart=always

[Install]
WantedBy=multi-user.target
""",
    "nvidia-persistenced.service": """[Unit]
Description=NVIDIA Persistence Daemon (simulated)
After=nvidia-sim-devices.service

[Service]
EnvironmentFile=/etc/nvidia-sim/workloads.env
ExecStartPre=-/bin/rm -f /run/nvidia-sim/ready/nvidia-persistenced
ExecStart=/usr/local/bin/gpu_holder --gpus ${ALL_GPUS} --no-context --name nvidia-persistenced --ready-file /run/nvidia-sim/ready/nvidia-persistenced
Restart=always

[Install]
WantedBy=multi-user.target
""",
}

# name -> (what it is, how it starts). Session workloads run over SSH with setsid nohup, so
# they end up in the login session's scope, as a stray `python train.py &` does.
WORKLOADS = {
    "vllm": "vllm.service (Restart=always), EngineCore + one worker per GPU on all GPUs",
    "sglang": "sglang.service, enabled (starts again at boot) and started",
    "persistenced": "nvidia-persistenced.service: holds every device file, no memory",
    "train": "a stray training process started over SSH (session scope)",
    "ignore-term": "a holder started over SSH that ignores SIGTERM",
    "orphan": "a holder that forked a child after 'CUDA init'; the parent is SIGKILLed",
    "vllm-v1": "vllm-v1.service (Restart=always): main process without GPU, VLLM::EngineCore child on GPU 0",
    "stubborn-unit": "stubborn.service (Restart=always, TimeoutStopSec=90s): ignores SIGTERM, 4 GiB on GPU 0",
    "at-job": "a job started with `at now` (runs inside atd.service)",
    "cron-job": "a cron job (@reboot in /etc/cron.d, cron restarted; runs inside cron.service)",
    "slurm-job": "a batch job of the host's own one-node Slurm cluster (sbatch; runs inside slurmd.service)",
    "hub-kernel": "a kernel spawned by notebook-hub.service (a child of the hub, inside its unit)",
    "monitor": "`nvidia-smi dmon` started over SSH: an NVML client (every device file open, no GPU memory)",
}

# Each host is a one-node Slurm cluster of its own. Debian 12's slurmd (22.05) refuses the
# cgroup/v2 plugin where /proc/self/cgroup also lists v1 hierarchies (this machine: "Hybrid mode
# is not supported"); with cgroup/v1, proctrack/linuxproc and task/none it runs, and a job's
# tasks stay in slurmd.service's cgroup under a slurmstepd reparented to PID 1 (measured): the
# shape docs/docsite/rst/guide_design.rst, "Known field behaviour elsewhere" describes for Slurm
# with cgroup v1.
SLURM_CONF = """# Written by tests/fleet/fleet.py: a one-node cluster on this host only.
ClusterName={name}
SlurmctldHost={name}(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SlurmdParameters=config_overrides
ReturnToService=2
SlurmUser=slurm
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
NodeName={name} NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
SLURM_CGROUP_CONF = "CgroupPlugin=cgroup/v1\n"


# ---------------------------------------------------------------------------- cgroups

def cgroup_roots() -> list[Path]:
    """The hierarchies a host's processes are placed in: unified (+ name=systemd on hybrid)."""
    fs = Path("/sys/fs/cgroup")
    if (fs / "unified" / "cgroup.procs").exists():
        return [fs / "unified", fs / "systemd"]
    if (fs / "cgroup.controllers").exists():
        return [fs]
    raise FleetError("no cgroup2 hierarchy found under /sys/fs/cgroup")


def cgroup_pids(cg: Path) -> list[int]:
    pids: list[int] = []
    if not cg.is_dir():
        return pids
    for dirpath, _dirs, files in os.walk(cg):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids += [int(x) for x in Path(dirpath, "cgroup.procs").read_text().split()]
    return pids


def cgroup_populated(cg: Path) -> bool:
    ev = cg / "cgroup.events"
    if ev.exists():
        with contextlib.suppress(OSError):
            for line in ev.read_text().splitlines():
                if line.startswith("populated "):
                    return line.split()[1] == "1"
    return bool(cgroup_pids(cg))


def rmdir_tree(cg: Path) -> None:
    if not cg.is_dir():
        return
    for dirpath, _dirs, _files in sorted(os.walk(cg), key=lambda t: -len(t[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def proc_start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_in_cgroup(pid: int, cg_rel: str) -> bool:
    """True when PID's unified-hierarchy cgroup is cg_rel or below it."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        if line.startswith("0::"):
            path = line[3:]
            return path == cg_rel or path.startswith(cg_rel + "/")
    return False


def pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total


# ---------------------------------------------------------------------------- the fleet

class Fleet:
    """A fleet recorded in STATE_ROOT/<prefix>/state.json."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, state_root: Path | None = None):
        if not prefix.replace("-", "").isalnum() or len(prefix) > 8 or not prefix[0].isalpha():
            raise FleetError("prefix: up to 8 letters/digits/dashes, starting with a letter")
        self.prefix = prefix
        self.state_dir = (state_root or STATE_ROOT) / prefix
        self.state_file = self.state_dir / "state.json"
        self.key = self.state_dir / "id_ed25519"
        self.inventory = self.state_dir / "inventory.ini"
        self.ansible_cfg = self.state_dir / "ansible.cfg"
        self.cp_dir = self.state_dir / "cp"
        self.state: dict = {}
        if self.state_file.exists():
            self.state = json.loads(self.state_file.read_text())

    # -- state
    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.rename(self.state_file)

    @property
    def hosts(self) -> list[dict]:
        return self.state.get("hosts", [])

    def host(self, name: str) -> dict:
        for h in self.hosts:
            if name in (h["name"], h["addr"]):
                return h
        raise FleetError(f"no host {name!r} in fleet {self.prefix}")

    def _hostdir(self, h: dict) -> Path:
        return self.state_dir / "hosts" / h["name"]

    # -- SSH
    def ssh_argv(self, name: str, cmd: str, connect_timeout: int = 5) -> list[str]:
        h = self.host(name)
        return [
            "ssh", "-i", str(self.key), "-F", "/dev/null",
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
            "-o", f"ConnectTimeout={connect_timeout}", "-o", "ControlMaster=auto",
            "-o", f"ControlPath={self.cp_dir}/f-%C", "-o", "ControlPersist=60",
            "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
            f"root@{h['addr']}", cmd,
        ]

    def ssh(self, name: str, cmd: str, check: bool = False, timeout: float = 60,
            connect_timeout: int = 5) -> subprocess.CompletedProcess:
        argv = self.ssh_argv(name, cmd, connect_timeout)
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, check=False, capture_output=True, text=True, timeout=timeout)
        if r.returncode == 255 and "mux_client_" in r.stderr:
            # The client could not talk to its control master (it died under load: "mux_client_request_alive:
            # write packet: Broken pipe"), so the command never reached the host: once more, on a connection of its own.
            argv[argv.index("ControlMaster=auto")] = "ControlMaster=no"
            argv[argv.index(f"ControlPath={self.cp_dir}/f-%C")] = "ControlPath=none"
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, check=False, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise FleetError(f"{name}: {cmd!r} -> rc {r.returncode}: {r.stdout}{r.stderr}")
        return r

    def gpu_memory(self, name: str) -> dict[int, int]:
        """{index: MiB used} as host NAME's nvidia-smi reports it."""
        r = self.ssh(name, "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits", check=True)
        return {int(i): int(m) for i, m in (ln.split(",") for ln in r.stdout.splitlines() if ln.strip())}

    def _close_masters(self) -> None:
        if not self.cp_dir.is_dir():
            return
        procs = [subprocess.Popen(["ssh", "-F", "/dev/null", "-o", f"ControlPath={sock}", "-O", "exit", "fleet"],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for sock in self.cp_dir.iterdir()]
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close_host_masters(self, name: str) -> None:
        """Ends the SSH control masters (the rig's `f-` and Ansible's `a-`) of one host, so that
        no later session rides on a connection that outlived a change to the host's link."""
        if not self.cp_dir.is_dir():
            return
        addr = self.host(name)["addr"]
        for kind in ("f", "a"):
            subprocess.run(["ssh", "-F", "/dev/null", "-o", f"ControlPath={self.cp_dir}/{kind}-%C",
                            "-O", "exit", f"root@{addr}"], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)

    def set_link(self, name: str, up: bool) -> None:
        """Takes NAME's network link down (the host becomes unreachable, as a node whose NIC or
        switch port died) or up again. It is the host's end of its veth pair, inside the host's
        own network namespace, that goes down: the controller's end, its address and its route
        stay, so packets for the host still go to that veth and are lost there (SSH fails with
        "No route to host"), never to the machine's default route."""
        h = self.host(name)
        if "netns" not in h.get("owned", []):
            raise FleetError(f"{name}: its network namespace is not recorded as this fleet's")
        if not up:
            self.close_host_masters(name)
        run(["ip", "-n", h["netns"], "link", "set", "dev", "host0", "up" if up else "down"])
        if up:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection((h["addr"], 22), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise FleetError(f"{name}: sshd not reachable 30 s after its link came up") from None
                    time.sleep(0.05)
            self.close_host_masters(name)

    # -- up
    def _pick_slot(self) -> int:
        used = set()
        if STATE_ROOT.is_dir():
            for sf in STATE_ROOT.glob("*/state.json"):
                if sf.parent.name != self.prefix:
                    with contextlib.suppress(Exception):
                        used.add(json.loads(sf.read_text())["slot"])
        routes = run(["ip", "-4", "route", "show"], check=False).stdout
        for slot in range(256):
            if slot not in used and f"{SUBNET_PREFIX}.{slot}." not in routes:
                return slot
        raise FleetError("no free subnet slot")

    def up(self, n: int, profile: str = "mixed", ready_timeout: float = 120, suite: str = SUITE, device_bpf: bool = False) -> dict:
        if not 1 <= n <= MAX_HOSTS:
            raise FleetError(f"--hosts must be 1..{MAX_HOSTS}")
        profile_presets(profile, n)  # validate before anything is touched
        base_recipe(suite)
        timings: dict = {}
        if self.state:
            owner = self.state.get("owner_pid")
            if owner and owner != os.getpid() and proc_start_time(owner) == self.state.get("owner_start"):
                raise FleetError(f"fleet {self.prefix} is in use by live process {owner}; "
                                 "choose another --name (or run `down` first)")
            log(f"cleaning stale state of fleet {self.prefix}")
            self.down()
        t_all = time.monotonic()
        base = ensure_base(timings, suite)
        try:
            with open(CACHE_DIR / ".slots.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # two fleets coming up never pick one subnet slot
                self._create(n, profile, base, timings, suite, device_bpf)
            self._wait_ready(ready_timeout, timings)
        except BaseException:
            log("bring-up failed; tearing down what was created")
            with contextlib.suppress(Exception):
                self._save_logs_hint()
            self.down()
            raise
        timings["up_total_s"] = round(time.monotonic() - t_all, 2)
        self.state["timings"] = timings
        self._save()
        return timings

    def _save_logs_hint(self) -> None:
        for h in self.hosts:
            con = self._hostdir(h) / "console.log"
            if con.exists():
                tail = con.read_text(errors="replace").splitlines()[-15:]
                log(f"{h['name']} console tail:\n  " + "\n  ".join(tail))

    def _create(self, n: int, profile: str, base: Path, timings: dict, suite: str = SUITE, device_bpf: bool = False) -> None:
        t0 = time.monotonic()
        slot = self._pick_slot()
        roots = cgroup_roots()
        cg_rel = f"/zeromib-fleet/{self.prefix}"
        presets = profile_presets(profile, n)
        hosts = []
        for i in range(1, n + 1):
            name = f"{self.prefix}-{i:02d}"
            hosts.append({
                "name": name, "index": i, "preset": presets[i - 1],
                "netns": name, "veth": f"zf{slot}-{i:02d}",
                "host_addr": f"{SUBNET_PREFIX}.{slot}.{4 * (i - 1) + 1}",
                "addr": f"{SUBNET_PREFIX}.{slot}.{4 * (i - 1) + 2}",
                "cgroup_rel": f"{cg_rel}/{name}",
                "cgroups": [str(r) + f"{cg_rel}/{name}" for r in roots],
                "propagate": f"/run/systemd/nspawn/propagate/{name}",
                "supervisor_pid": None, "supervisor_start": None,
                # The real driver may number /dev/nvidia<minor> apart from the index; one host shows it.
                "minors": [1, 0, 3, 2] if profile == "mixed" and presets[i - 1] == "h100x4" else None,
            })
        # Recorded before anything exists, so that `down` can undo a half-done `up`.
        self.state = {"prefix": self.prefix, "slot": slot, "profile": profile, "base": str(base), "suite": suite,
                      "device_bpf": device_bpf,
                      "owner_pid": os.getpid(), "owner_start": proc_start_time(os.getpid()),
                      "cgroup_parents": [str(r) + cg_rel for r in roots], "hosts": hosts,
                      "sim_source": str(SIM_DIR)}
        self._save()
        self.cp_dir.mkdir(parents=True, exist_ok=True)
        self.cp_dir.chmod(0o700)

        if not self.key.exists():
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"zeromib-fleet-{self.prefix}",
                 "-f", str(self.key)])
        pub = self.key.with_suffix(".pub").read_text()

        # Each host takes ~7 inotify instances (TEST_RIGS §1); the default 128 fails above ~20.
        lim = Path("/proc/sys/fs/inotify/max_user_instances")
        with contextlib.suppress(OSError):
            if int(lim.read_text()) < 16 * n + 256:
                lim.write_text(str(max(1024, 16 * n + 256)))

        for h in hosts:
            self._prepare_upper(h, pub)
        timings["prepare_s"] = round(time.monotonic() - t0, 2)

        # Names are checked to be free before they are recorded as ours, and recorded before
        # they are created: `down` then removes exactly what this fleet made, even after a crash.
        t1 = time.monotonic()
        links = run(["ip", "-o", "link", "show"], check=False).stdout
        namespaces = set(run(["ip", "netns", "list"], check=False).stdout.split())
        for h in hosts:
            taken = [what for what, busy in (
                (f"netns {h['netns']}", h["netns"] in namespaces),
                (f"link {h['veth']}", f" {h['veth']}@" in links or f" {h['veth']}:" in links),
                (f"machine {h['name']}", os.path.lexists(h["propagate"])),
                *((f"cgroup {cg}", os.path.exists(cg)) for cg in h["cgroups"])) if busy]
            if taken:
                raise FleetError(f"{', '.join(taken)} already exist(s) and are not recorded by this fleet")
            h["owned"] = ["netns", "veth", "cgroups"]
        self._save()
        batch = []
        for h in hosts:
            run(["ip", "netns", "add", h["netns"]])
            batch += [f"link add {h['veth']} type veth peer name host0 netns {h['netns']}",
                      f"addr add {h['host_addr']}/30 dev {h['veth']}",
                      f"link set {h['veth']} up"]
        run(["ip", "-batch", "-"], input="\n".join(batch) + "\n", stdin=None)
        for h in hosts:
            run(["ip", "-n", h["netns"], "-batch", "-"], stdin=None, input=(
                f"addr add {h['addr']}/30 dev host0\nlink set host0 up\nlink set lo up\n"))
        timings["network_s"] = round(time.monotonic() - t1, 2)

        t2 = time.monotonic()
        for h in hosts:
            for cg in h["cgroups"]:
                Path(cg).mkdir(parents=True)
            h["owned"].append("machine")  # nspawn's /run/systemd/nspawn/propagate/NAME from now on
            self._start(h)
        self._save()
        timings["spawn_s"] = round(time.monotonic() - t2, 2)
        self._write_inventory()

    def _prepare_upper(self, h: dict, pub: str) -> None:
        hd = self._hostdir(h)
        if hd.exists():
            shutil.rmtree(hd)
        up = hd / "upper"
        (up / "root" / ".ssh").mkdir(parents=True, mode=0o700)
        (up / "root").chmod(0o700)
        (up / "root" / ".ssh").chmod(0o700)
        ak = up / "root" / ".ssh" / "authorized_keys"
        ak.write_text(pub)
        ak.chmod(0o600)

        src = SIM_DIR
        lib = up / "usr" / "local" / "lib" / "nvidia-sim"
        shutil.copytree(src, lib, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "test_*"))
        for f in lib.iterdir():
            if f.is_file() and os.access(src / f.name, os.X_OK):
                f.chmod(0o755)
        (up / "usr" / "bin").mkdir(parents=True, exist_ok=True)
        (up / "usr" / "local" / "bin").mkdir(parents=True, exist_ok=True)
        (up / "usr" / "local" / "sbin").mkdir(parents=True, exist_ok=True)
        os.symlink("/usr/local/lib/nvidia-sim/nvidia-smi", up / "usr" / "bin" / "nvidia-smi")
        os.symlink("/usr/local/lib/nvidia-sim/gpu_holder", up / "usr" / "local" / "bin" / "gpu_holder")
        # The simulator's scripts start with `#!/usr/bin/env python` (the shebang ansible-test
        # sanity allows); give the host the `python` that Debian's python-is-python3 gives.
        if not os.path.lexists(Path(self.state["base"]) / "usr" / "bin" / "python"):
            os.symlink("python3", up / "usr" / "bin" / "python")

        cfg = make_config(h["preset"], h["name"], h.get("minors"))
        gpus = config_gpus(cfg)
        h["gpu_count"] = len(gpus)
        h["gpus"] = gpus
        h["idle_mib"] = max([int(g.get("baseline_mib", 0)) for g in cfg.get("gpus", [])] or [0])
        etc = up / "etc" / "nvidia-sim"
        etc.mkdir(parents=True)
        (etc / "config.json").write_text(json.dumps(cfg, indent=1))
        all_gpus = ",".join(str(g["index"]) for g in gpus)
        (etc / "workloads.env").write_text(f"ALL_GPUS={all_gpus}\nGPU_COUNT={len(gpus)}\n")

        # VLLM_ARGV0_WORKAROUND: a process whose argv[0] has no slash gets sys.executable from a
        # PATH search; gpu_holder's --name re-exec sets argv[0] to the name, so without this the
        # EngineCore parent has sys.executable == "" and its worker exec fails.
        argv0 = up / "usr" / "local" / "lib" / "nvidia-sim-argv0"
        argv0.mkdir(parents=True)
        os.symlink("/usr/bin/python3", argv0 / "VLLM::EngineCore")
        os.symlink("/usr/bin/python3", argv0 / "vllm")
        hub = up / "usr" / "local" / "bin" / "jupyterhub"
        shutil.copyfile(FLEET_DIR / "notebook_hub.py", hub)
        hub.chmod(0o755)
        slurm = up / "etc" / "slurm"
        slurm.mkdir(parents=True)
        (slurm / "slurm.conf").write_text(SLURM_CONF.format(name=h["name"]))
        (slurm / "cgroup.conf").write_text(SLURM_CGROUP_CONF)
        script = up / "usr" / "local" / "sbin" / "nvidia-sim-devices"
        script.write_text(DEVICES_SCRIPT)
        script.chmod(0o755)
        sysd = up / "etc" / "systemd" / "system"
        (sysd / "sysinit.target.wants").mkdir(parents=True)
        (sysd / "nvidia-sim-devices.service").write_text(DEVICES_UNIT)
        os.symlink("../nvidia-sim-devices.service", sysd / "sysinit.target.wants" / "nvidia-sim-devices.service")
        for unit, text in WORKLOAD_UNITS.items():
            (sysd / unit).write_text(text)
        # Masked per host rather than in the base, so the list can change without a rebuild.
        # user@.service: a per-login systemd --user costs ~5 MiB and CPU at every first SSH
        # login; sessions and their scopes do not need it.
        for unit in HOST_MASKED_UNITS:
            os.symlink("/dev/null", sysd / unit)
        # Real nodes wait 90 s for a unit that ignores SIGTERM at shutdown; a test host need not.
        (up / "etc" / "systemd" / "system.conf.d").mkdir(parents=True)
        (up / "etc" / "systemd" / "system.conf.d" / "zeromib-fleet.conf").write_text(
            "[Manager]\nDefaultTimeoutStopSec=5s\n")
        (up / "etc" / "tmpfiles.d").mkdir(parents=True)
        (up / "etc" / "tmpfiles.d" / "nvidia-sim.conf").write_text(
            "d /run/nvidia-sim 0755 root root -\nd /run/nvidia-sim/ready 0755 root root -\n")

    def _boot_script(self, h: dict) -> Path:
        hd = self._hostdir(h)
        nspawn = [
            "systemd-nspawn", "--quiet", "--boot", f"--directory={self.state['base']}",
            f"--overlay={self.state['base']}:{hd / 'upper'}:/", f"--machine={h['name']}",
            "--register=no", "--keep-unit", f"--network-namespace-path=/run/netns/{h['netns']}",
            "--link-journal=no", "--resolv-conf=off", "--timezone=off", "--console=read-only",
            "--capability=CAP_MKNOD",
        ]
        if self.state.get("device_bpf"):
            nspawn += DEVICE_BPF_ARGS
        lines = ["#!/bin/sh", "# Supervises one fleet host: re-launches nspawn when the host reboots."]
        for cg in h["cgroups"]:
            lines.append(f"echo $$ > {cg}/cgroup.procs || exit 97")
        lines += [
            "export SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1",
            f"cd {shlex.quote(str(hd))}",
            "while :; do",
            f"  {shlex.join(nspawn)} </dev/null >>console.log 2>&1 &",
            "  echo $! > nspawn.pid",
            "  wait $!",
            "  rc=$?",
            '  echo "== nspawn exited rc=$rc $(date +%T.%N)" >> console.log',
            "  [ -e stop ] && exit 0",
            f'  [ "$rc" = {NSPAWN_REBOOT_RC} ] || exit "$rc"',
            "done",
        ]
        p = hd / "boot.sh"
        p.write_text("\n".join(lines) + "\n")
        p.chmod(0o755)
        return p

    def _start(self, h: dict) -> None:
        hd = self._hostdir(h)
        for f in ("stop", "nspawn.pid"):
            with contextlib.suppress(FileNotFoundError):
                (hd / f).unlink()
        # The supervisor has its own copy of the log's descriptor: ours closes once it started.
        with open(hd / "supervisor.log", "a") as log:
            p = subprocess.Popen(["/bin/sh", str(self._boot_script(h))], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=log, start_new_session=True, close_fds=True)
        h["supervisor_pid"] = p.pid
        h["supervisor_start"] = proc_start_time(p.pid)

    def _wait_ready(self, timeout: float, timings: dict) -> None:
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.hosts)) as ex:
            results = list(ex.map(lambda h: self.wait_host(h["name"], timeout), self.hosts))
        timings["boot_s"] = round(time.monotonic() - t0, 2)
        for h, (state, failed) in zip(self.hosts, results):
            h["system_state"] = state
            h["failed_units"] = failed
            if state == "degraded":
                log(f"{h['name']}: degraded, failed units: {failed}")
        bad = [h["name"] for h in self.hosts if h["system_state"] not in ("running", "degraded")]
        if bad:
            raise FleetError(f"hosts not ready after {timeout} s: {bad}")

    def wait_host(self, name: str, timeout: float = 120) -> tuple[str, list[str]]:
        """Waits for sshd, then for `systemctl is-system-running --wait`; returns (state, failed units)."""
        deadline = time.monotonic() + timeout
        state = "unreachable"
        addr = self.host(name)["addr"]
        while time.monotonic() < deadline:
            if not self._supervisor_alive(self.host(name)):
                return "dead", []
            try:  # a bare connect is far cheaper than an ssh client per try
                socket.create_connection((addr, 22), timeout=1).close()
            except OSError:
                time.sleep(0.05)
                continue
            try:
                r = self.ssh(name, "systemctl is-system-running --wait", timeout=max(1, deadline - time.monotonic()),
                             connect_timeout=2)
            except subprocess.TimeoutExpired:
                break
            state = r.stdout.strip() or "unreachable"
            if r.returncode == 255:  # ssh itself: not up yet
                time.sleep(0.1)
                continue
            if state in ("running", "degraded", "maintenance", "stopping"):
                break
            time.sleep(0.1)
        failed: list[str] = []
        if state == "degraded":
            r = self.ssh(name, "systemctl list-units --failed --plain --no-legend")
            failed = [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]
        return state, failed

    def _supervisor_alive(self, h: dict) -> bool:
        pid = h.get("supervisor_pid")
        return bool(pid) and proc_start_time(pid) == h.get("supervisor_start")

    def nspawn_pid(self, h: dict) -> int | None:
        """The host's current nspawn PID, checked to be a systemd-nspawn inside our cgroup."""
        try:
            pid = int((self._hostdir(h) / "nspawn.pid").read_text())
        except (OSError, ValueError):
            return None
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None
        return pid if comm == "systemd-nspawn" and pid_in_cgroup(pid, h["cgroup_rel"]) else None

    def baselines(self) -> dict[str, int]:
        """{inventory group: max_used_mib} for the presets whose GPUs idle above 0 MiB (the MIG
        host: 55 MiB -> 64), as an operator sets them (README.md, "Real use")."""
        groups: dict[str, int] = {}
        for h in self.hosts:
            idle = int(h.get("idle_mib", 0))
            if idle > 0:
                group = h["preset"].replace("-", "_")
                groups[group] = max(groups.get(group, 0), 64 if idle <= 64 else idle + 8)
        return groups

    def write_baselines(self) -> dict[str, int]:
        """group_vars/<group>.yml next to the inventory with free_gpus_max_used_mib and
        gpu_audit_max_used_mib for each group of baselines(): what `up` and the demo leave."""
        d = self.inventory.parent / "group_vars"
        d.mkdir(exist_ok=True)
        groups = self.baselines()
        for group, mib in groups.items():
            (d / f"{group}.yml").write_text(json.dumps({"free_gpus_max_used_mib": mib, "gpu_audit_max_used_mib": mib}) + "\n")
        return groups

    def _write_inventory(self) -> None:
        lines = ["# Written by tests/fleet/fleet.py; removed by `fleet.py down`.", "[gpu_nodes]"]
        for h in self.hosts:
            lines.append(
                f"{h['name']} ansible_host={h['addr']} fleet_preset={h['preset']} "
                f"fleet_gpu_count={h.get('gpu_count', 0)} fleet_idle_mib={h.get('idle_mib', 0)}")
        presets = sorted({h["preset"] for h in self.hosts})
        for p in presets:
            lines += ["", f"[{p.replace('-', '_')}]"] + [h["name"] for h in self.hosts if h["preset"] == p]
        lines += ["", "[gpu_nodes:vars]", "ansible_user=root",
                  f"ansible_ssh_private_key_file={self.key}",
                  "ansible_python_interpreter=/usr/bin/python3",
                  "ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'"]
        self.inventory.write_text("\n".join(lines) + "\n")
        self.ansible_cfg.write_text("\n".join([
            "# Written by tests/fleet/fleet.py for this fleet.",
            "[defaults]",
            f"inventory = {self.inventory}",
            "host_key_checking = False",
            f"forks = {max(5, len(self.hosts))}",
            "interpreter_python = /usr/bin/python3",
            f"collections_path = {COLLECTIONS_PATH}",
            "retry_files_enabled = False",
            "gathering = explicit",
            "",
            "[ssh_connection]",
            "pipelining = True",
            "ssh_args = -o ControlMaster=auto -o ControlPersist=60s -o StrictHostKeyChecking=no "
            "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
            f"control_path_dir = {self.cp_dir}",
            "control_path = %(directory)s/a-%%C",
            "",
        ]))

    # -- operations on running hosts
    def reboot(self, name: str, timeout: float = 120) -> tuple[str, list[str]]:
        """`systemctl reboot` inside the host; its supervisor starts nspawn again (exit 133)."""
        h = self.host(name)
        old = self.nspawn_pid(h)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.ssh(name, "systemctl reboot", timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            new = self.nspawn_pid(h)
            if new and new != old:
                break
            if not self._supervisor_alive(h):
                raise FleetError(f"{name}: supervisor ended during reboot; see {self._hostdir(h)}/console.log")
            time.sleep(0.1)
        else:
            raise FleetError(f"{name}: did not come back from reboot in {timeout} s")
        return self.wait_host(name, max(1, deadline - time.monotonic()))

    def workload(self, name: str, workload: str, gpus: str | None = None, mib: int | None = None,
                 timeout: float = 30) -> dict:
        """Starts a workload (see WORKLOADS) on host NAME and returns once it holds its GPUs.

        Returns {host, workload, pid, children, workers} from gpu_holder's ready file; for
        units also `unit`; for `orphan` the SIGKILLed `parent_pid` and the orphaned `child_pid`.
        """
        h = self.host(name)
        gpus = gpus or ",".join(str(g["index"]) for g in h.get("gpus", [])) or "0"
        mib_opt = f"--mib {mib if mib is not None else 40960}"
        wait = ('for i in $(seq 400); do [ -e "$f" ] && break; sleep 0.025; done; '
                '[ -e "$f" ] || { echo "not ready: $f" >&2; exit 1; }; cat "$f"')
        units = {"vllm": "vllm.service", "sglang": "sglang.service",
                 "persistenced": "nvidia-persistenced.service", "vllm-v1": "vllm-v1.service",
                 "stubborn-unit": "stubborn.service"}
        holder = (f"/usr/local/bin/gpu_holder --gpus {gpus} {mib_opt} --name {{name}} "
                  f"--ready-file $f")
        launched = {
            # Double quotes: $f is the ready file, expanded now (at and sbatch run the job later).
            "at-job": (f"echo \"exec {holder.format(name='at_train')}\" | at now 2>/dev/null; ", 30),
            "cron-job": ("c=/etc/cron.d/zeromib-gpu-job-$$; "
                         f"echo \"@reboot root exec {holder.format(name='cron_train')}\" > $c; "
                         "rm -f /run/crond.reboot; systemctl restart cron; ", 30),
            "slurm-job": ("systemctl start munge slurmctld slurmd || exit 1; "
                          f"sbatch --quiet -o /dev/null -J gpu_train --wrap \"exec {holder.format(name='slurm_train')}\"; ",
                          60),
            "hub-kernel": ("systemctl start notebook-hub.service || exit 1; mkdir -p /run/nvidia-sim/hub/spawn; "
                           "printf '{\"gpus\": \"%s\", \"mib\": %s, \"ready\": \"%s\"}' "
                           f"{gpus} {mib if mib is not None else 40960} $f > /run/nvidia-sim/hub/spawn/.k$$; "
                           "mv /run/nvidia-sim/hub/spawn/.k$$ /run/nvidia-sim/hub/spawn/k$$.json; ", 30),
        }
        session = {"train": "train.py", "ignore-term": "stubborn_train.py --ignore-term",
                   "orphan": "orphan_parent.py --fork-child", "monitor": "nvidia-smi --monitor dmon"}
        if workload in units:
            unit = units[workload]
            verb = "enable --now" if workload == "sglang" else "start"  # sglang comes back at boot
            cmd = (f"f=/run/nvidia-sim/ready/{unit[:-len('.service')]}; systemctl {verb} {unit} 2>/dev/null || exit 1; "
                   + wait)
        elif workload in launched:
            start, patience = launched[workload]
            wait_long = wait.replace("seq 400", f"seq {patience * 40}")
            cmd = (f"mkdir -p /run/nvidia-sim/ready; f=/run/nvidia-sim/ready/{workload}-$$; rm -f $f; "
                   + start + wait_long + ("; rm -f $c" if workload == "cron-job" else ""))
        elif workload in session:
            nm, _sep, extra = session[workload].partition(" ")
            cmd = (f"mkdir -p /run/nvidia-sim/ready; f=/run/nvidia-sim/ready/{workload}-$$; rm -f $f; "
                   f"setsid nohup /usr/local/bin/gpu_holder --gpus {gpus} {mib_opt} --name {nm} {extra} "
                   f"--ready-file $f </dev/null >/dev/null 2>&1 & " + wait)
        else:
            raise FleetError(f"unknown workload {workload!r}; choose from {sorted(WORKLOADS)}")
        r = self.ssh(name, cmd, timeout=timeout)
        if r.returncode != 0:
            raise FleetError(f"{name}: workload {workload} failed (rc {r.returncode}): {r.stdout}{r.stderr}")
        out = {"host": name, "workload": workload, **json.loads(r.stdout.strip().splitlines()[-1])}
        if workload in units:
            out["unit"] = units[workload]
        if workload in launched:
            out["unit"] = {"at-job": "atd.service", "cron-job": "cron.service", "slurm-job": "slurmd.service",
                           "hub-kernel": "notebook-hub.service"}[workload]
        if workload == "orphan":
            parent, child = out["pid"], out["children"][0]
            self.ssh(name, f"kill -9 {parent}; while [ -e /proc/{parent} ]; do sleep 0.01; done", check=True)
            out.update(parent_pid=parent, child_pid=child)
        return out

    def status(self) -> dict:
        out = {"prefix": self.prefix, "state_dir": str(self.state_dir), "up": bool(self.state),
               "inventory": str(self.inventory) if self.inventory.exists() else None, "hosts": []}
        for h in self.hosts:
            pids = cgroup_pids(Path(h["cgroups"][0]))
            out["hosts"].append({
                "name": h["name"], "addr": h["addr"], "preset": h["preset"],
                "supervisor_alive": self._supervisor_alive(h), "nspawn_pid": self.nspawn_pid(h),
                "processes": len(pids), "pss_mib": round(pss_kib(pids) / 1024, 1),
            })
        return out

    # -- down
    def down(self, stop_timeout: float = 3) -> dict:
        """Tears down everything the state dir records; safe on half-done or crashed fleets."""
        t0 = time.monotonic()
        if not self.state:
            if self.state_dir.exists() and not any(self.state_dir.glob("hosts/*/upper")):
                shutil.rmtree(self.state_dir, ignore_errors=True)
            return {"down_s": 0.0, "hosts": 0}
        hosts = self.hosts
        self._close_masters()
        graceful = []
        for h in hosts:
            hd = self._hostdir(h)
            if hd.is_dir():
                (hd / "stop").touch()
            pid = self.nspawn_pid(h)
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)  # nspawn powers the container off cleanly
                graceful.append(Path(h["cgroups"][0]))
        # A host whose nspawn is gone (SIGKILLed, crashed) keeps running: only its cgroup ends it.
        unified = [Path(h["cgroups"][0]) for h in hosts if "cgroups" in h.get("owned", [])]
        deadline = time.monotonic() + stop_timeout
        while time.monotonic() < deadline and any(cgroup_populated(c) for c in graceful):
            time.sleep(0.05)
        for cg in unified:
            if cgroup_populated(cg):
                kill = cg / "cgroup.kill"
                if kill.exists():
                    kill.write_text("1")
                else:  # kernels before 5.14
                    for pid in cgroup_pids(cg):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(cgroup_populated(c) for c in unified):
            time.sleep(0.05)
        leftover = [str(c) for c in unified if cgroup_populated(c)]
        links = run(["ip", "-o", "link", "show"], check=False).stdout
        netns = run(["ip", "netns", "list"], check=False).stdout.split()
        batch = []
        for h in hosts:
            owned = h.get("owned", [])
            if "veth" in owned and f" {h['veth']}@" in links:
                batch.append(f"link del {h['veth']}")
            if "netns" in owned and h["netns"] in netns:
                batch.append(f"netns del {h['netns']}")
        if batch:
            run(["ip", "-force", "-batch", "-"], check=False, stdin=None, input="\n".join(batch) + "\n")
        for h in hosts:
            owned = h.get("owned", [])
            if "cgroups" in owned:
                for cg in h["cgroups"]:
                    rmdir_tree(Path(cg))
            prop = Path(h["propagate"])
            if "machine" in owned and prop.is_dir():
                shutil.rmtree(prop, ignore_errors=True)
        for parent in self.state.get("cgroup_parents", []):
            with contextlib.suppress(OSError):
                os.rmdir(parent)
            with contextlib.suppress(OSError):
                os.rmdir(Path(parent).parent)
        if leftover:
            raise FleetError(f"processes survived cgroup.kill in {leftover}; state kept in {self.state_dir}")
        shutil.rmtree(self.state_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            STATE_ROOT.rmdir()
        self.state = {}
        return {"down_s": round(time.monotonic() - t0, 2), "hosts": len(hosts)}

    def leftovers(self) -> list[str]:
        """What of this fleet is still on the machine (for tests of `down`)."""
        found = []
        names = {h["name"] for h in self.hosts} if self.hosts else set()
        prefix = f"{self.prefix}-"
        for ns in run(["ip", "netns", "list"], check=False).stdout.split():
            if ns.startswith(prefix) or ns in names:
                found.append(f"netns {ns}")
        for pid in run(["pgrep", "-x", "systemd-nspawn"], check=False).stdout.split():
            with contextlib.suppress(OSError):
                if f"--machine={prefix}" in Path(f"/proc/{pid}/cmdline").read_text():
                    found.append(f"nspawn pid {pid}")
        for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup"):
            p = Path(root) / "zeromib-fleet" / self.prefix
            if p.exists():
                found.append(f"cgroup {p}")
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            if f"/netns/{prefix}" in line or str(self.state_dir) in line:
                found.append(f"mount {line.split()[4]}")
        for p in Path("/run/systemd/nspawn/propagate").glob(f"{prefix}*"):
            found.append(f"propagate {p}")
        if self.state_dir.exists():
            found.append(f"state dir {self.state_dir}")
        return found


# ---------------------------------------------------------------------------- clean

def dir_size_mib(path: Path) -> float:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return round(total / 2**20, 1)


def clean(repo: Path = REPO) -> dict:
    """`make clean`: tears down every fleet of this checkout (the tests', the demo's, the
    benchmarks', also one left over from a killed run), then removes the base rootfs cache,
    unless a fleet of another checkout is still up on it (it is that fleet's read-only lower
    layer)."""
    downed, others = [], []
    if STATE_ROOT.is_dir():
        for sf in sorted(STATE_ROOT.glob("*/state.json")):
            source = None
            with contextlib.suppress(OSError, ValueError):
                source = Path(json.loads(sf.read_text()).get("sim_source", ""))
            if source == repo / "tests" / "sim":
                Fleet(sf.parent.name).down()
                downed.append(sf.parent.name)
            else:
                others.append(sf.parent.name)
    out = {"fleets_down": downed, "cache": str(CACHE_DIR)}
    if not CACHE_DIR.exists():
        out["cache_removed_mib"] = 0.0
        return out
    with open(CACHE_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # no `up` of another checkout restores the base meanwhile
        others += [sf.parent.name for sf in STATE_ROOT.glob("*/state.json")
                   if sf.parent.name not in downed + others] if STATE_ROOT.is_dir() else []
        if others:
            out["cache_kept_for"] = others
            return out
        size = dir_size_mib(CACHE_DIR)
        for entry in CACHE_DIR.iterdir():
            if entry.name != ".lock":
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    with contextlib.suppress(OSError):
        (CACHE_DIR / ".lock").unlink()
        CACHE_DIR.rmdir()
    out["cache_removed_mib"] = size
    return out


# ---------------------------------------------------------------------------- guests and `try`

def guest_host(fleet: Fleet) -> dict:
    """Where a guest goes: the last host with 8 GPUs that idle at 0 MiB (the first one, zmf-01,
    keeps its own vLLM in `try`), else the last host."""
    eight = [h for h in fleet.hosts if h.get("gpu_count", 0) >= 8 and not h.get("idle_mib", 0)]
    return (eight or fleet.hosts)[-1]


def boot_guest(fleet: Fleet, host: str, kind: str = "lxc", name: str = "101", gpu: int | None = None) -> dict:
    """A system container of KIND in HOST (tests/fleet/guests.py): a real systemd in its own
    namespaces below the cgroup its kind gives it (Proxmox's /lxc/<VMID>/ns for lxc), whose enabled
    vllm.service (Restart=always) holds one GPU, the host's last unless GPU is given. It lives inside
    the host: `down` ends it with the host."""
    if str(FLEET_DIR) not in sys.path:
        sys.path.insert(0, str(FLEET_DIR))
    import guests  # beside this file; the tests import it by this name too
    h = fleet.host(host)
    gpu = h.get("gpu_count", 1) - 1 if gpu is None else gpu
    try:
        guest = guests.boot(fleet, h["name"], kind, name, gpu)
    except AssertionError as e:
        raise FleetError(f"{h['name']}: guest {kind}:{name} did not come up: {e}") from None
    return {"host": h["name"], "kind": kind, "guest": name, "gpu": gpu, "init_pid": guest.init_pid,
            "cgroup": guest.boundary, "services_entry": guest.entry()}


def try_lines(fleet: Fleet, vllm_host: str, guest: dict) -> list[str]:
    """What `make fleet-up` prints: the fleet, its inventory, commands to try, how to take it down."""
    inv = fleet.inventory
    kinds = ", ".join(f"{h['name']} {h.get('gpu_count', 0)}x {h['preset']}" for h in fleet.hosts)
    services = json.dumps({"free_gpus_services": ["vllm*.service", guest["services_entry"]]})
    return [
        f"fleet {fleet.prefix} is up: {kinds}",
        f"  busy: {vllm_host} runs vllm.service on every GPU; {guest['host']} holds a Proxmox-LXC-shaped guest "
        f"{guest['guest']} ({guest['cgroup']}) whose own systemd runs vllm.service on GPU {guest['gpu']}",
        f"inventory: {inv}   (group gpu_nodes; group_vars/ beside it: the MIG group's baseline)",
        "try, from the checkout after `. .venv/bin/activate`:",
        f"  ansible-playbook playbooks/free_gpus.yml -i {inv} -l gpu_nodes -e '{services}'",
        f"  ansible-playbook playbooks/restore_gpus.yml -i {inv} -l gpu_nodes",
        f"  ansible-playbook playbooks/audit_gpus.yml -i {inv}",
        f"  ansible-playbook your_play.yml -i {inv}            # your own play, the role in its pre_tasks",
        f"  python3 tests/fleet/fleet.py workload {vllm_host} vllm --name {fleet.prefix}   # busy again (fleet.py -h: more)",
        "take it down: make fleet-down",
    ]


# ---------------------------------------------------------------------------- CLI

# Joins a mount namespace and attaches a read-only copy of a tree of this machine there: the new
# mount API (open_tree, mount_setattr, move_mount), as `machinectl bind` does; nspawn's propagation
# directory is not shared on these machines. Run as a child: setns needs a single-threaded process.
_BIND_INTO = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def ok(rc, what):
    if rc < 0:
        raise OSError(ctypes.get_errno(), what)
    return rc
class Attr(ctypes.Structure):
    _fields_ = [("set", ctypes.c_uint64), ("clr", ctypes.c_uint64), ("prop", ctypes.c_uint64), ("userns", ctypes.c_uint64)]
fd = ok(libc.syscall(428, -100, sys.argv[2].encode(), 1 | 0o2000000 | 0x8000), "open_tree")
attr = Attr(1, 0, 0, 0)
ok(libc.syscall(442, fd, b"", 0x1000 | 0x8000, ctypes.byref(attr), ctypes.sizeof(attr)), "mount_setattr")
ok(libc.setns(os.open(f"/proc/{int(sys.argv[1])}/ns/mnt", os.O_RDONLY), 0x00020000), "setns")
os.chdir("/")
os.makedirs(sys.argv[3], exist_ok=True)
ok(libc.syscall(429, fd, b"", -100, sys.argv[3].encode(), 4), "move_mount")
"""


def host_init_pid(fleet: Fleet, name: str) -> int:
    """The PID (on this machine) of a host's own systemd: the child of its nspawn."""
    pid = fleet.nspawn_pid(fleet.host(name))
    if pid is None:
        raise FleetError(f"{name}: no nspawn")
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if not children:
        raise FleetError(f"{name}: nspawn has no child")
    return int(children[0])


def bind_ro_into(fleet: Fleet, name: str, source: Path, target: str) -> None:
    """SOURCE of this machine, read-only at TARGET inside host NAME (until it reboots or
    `umount TARGET` there). Only that host's mount namespace changes."""
    run([sys.executable, "-c", _BIND_INTO, str(host_init_pid(fleet, name)), str(source), target])


@contextlib.contextmanager
def linked_hosts(fleet: Fleet, names: list[str], subnet: str = "172.31.77"):
    """The hosts NAMES on one layer-2 segment: a bridge in a network namespace made here, a veth
    from it into each host's own namespace (`ray0`, SUBNET.<1..n>/24 in list order). Yields
    {name: address}. This machine's own namespace, routes and forwarding are never touched;
    deleting the bridge's namespace removes every link it made."""
    bridge = f"{fleet.prefix}-l2"
    addrs = {name: f"{subnet}.{i}" for i, name in enumerate(names, 1)}
    run(["ip", "netns", "add", bridge])
    try:
        run(["ip", "-n", bridge, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", bridge, "link", "set", "br0", "up"])
        for i, name in enumerate(names, 1):
            netns = fleet.host(name)["netns"]
            run(["ip", "-n", bridge, "link", "add", f"l2p{i}", "type", "veth", "peer", "name", "ray0", "netns", netns])
            run(["ip", "-n", bridge, "link", "set", f"l2p{i}", "master", "br0", "up"])
            run(["ip", "-n", netns, "addr", "add", f"{addrs[name]}/24", "dev", "ray0"])
            run(["ip", "-n", netns, "link", "set", "ray0", "up"])
        yield addrs
    finally:
        run(["ip", "netns", "del", bridge], check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="bring up N hosts (tears down a stale fleet of the same name first)")
    p_up.add_argument("--hosts", type=int, default=8)
    p_up.add_argument("--profile", choices=PROFILES, default="mixed")
    p_up.add_argument("--suite", choices=SUITES, default=SUITE, help="the hosts' Debian release (default %(default)s)")
    p_up.add_argument("--device-bpf", action="store_true",
                      help="let the hosts' systemd attach device programs (CAP_BPF, bpf()): DevicePolicy= as on a real node")
    p_down = sub.add_parser("down", help="tear down everything the state dir records")
    p_st = sub.add_parser("status", help="hosts, their processes and memory (PSS)")
    p_wl = sub.add_parser("workload", help="start a workload on a host: " + ", ".join(sorted(WORKLOADS)))
    p_wl.add_argument("host")
    p_wl.add_argument("workload", choices=sorted(WORKLOADS))
    p_wl.add_argument("--gpus", help="comma-separated GPU indexes (session workloads)")
    p_wl.add_argument("--mib", type=int)
    p_rb = sub.add_parser("reboot", help="systemctl reboot inside a host and wait until it is up")
    p_rb.add_argument("host")
    p_ssh = sub.add_parser("ssh", help="run a command on a host over SSH")
    p_ssh.add_argument("host")
    p_ssh.add_argument("command", nargs=argparse.REMAINDER)
    p_guest = sub.add_parser("guest", help="boot a system container whose systemd runs vllm.service on one GPU, in HOST")
    p_guest.add_argument("host")
    p_guest.add_argument("--kind", choices=("lxc", "lxd", "nspawn"), default="lxc", help="its cgroup shape (default Proxmox's lxc)")
    p_guest.add_argument("--guest", default="101", help="its name (a VMID for lxc; default %(default)s)")
    p_guest.add_argument("--gpu", type=int, help="the GPU its vllm.service holds (default: the host's last)")
    p_try = sub.add_parser("try", help="`make fleet-up`: N hosts kept up, vLLM on the first, an LXC guest running "
                                       "vLLM on another; prints the inventory and commands to try")
    p_try.add_argument("--hosts", type=int, default=4)
    p_base = sub.add_parser("base", help="build/restore the cached base rootfs only")
    p_base.add_argument("--suite", choices=SUITES, default=SUITE)
    sub.add_parser("clean", help="down every fleet of this checkout; remove the base rootfs cache "
                                 "unless another checkout's fleet uses it")
    for p in (p_up, p_down, p_st, p_wl, p_rb, p_ssh, p_guest, p_try):
        p.add_argument("--name", default=DEFAULT_PREFIX, help="fleet prefix (hosts PREFIX-01..)")
    a = ap.parse_args(argv)

    if a.cmd == "base":
        t: dict = {}
        print(json.dumps({"base": str(ensure_base(t, a.suite)), **t}))
        return 0
    if a.cmd == "clean":
        print(json.dumps(clean()))
        return 0
    fleet = Fleet(a.name)
    if a.cmd == "up":
        if os.geteuid() != 0:
            raise SystemExit("fleet.py up needs root (netns, cgroups, nspawn)")
        timings = fleet.up(a.hosts, a.profile, suite=a.suite, device_bpf=a.device_bpf)
        baselines = fleet.write_baselines()
        st = fleet.status()
        print(json.dumps({"inventory": str(fleet.inventory), "ansible_cfg": str(fleet.ansible_cfg),
                          "group_vars": {g: {"free_gpus_max_used_mib": m} for g, m in baselines.items()},
                          "key": str(fleet.key), "timings": timings,
                          "hosts": [{k: h[k] for k in ("name", "addr", "preset")} | {
                              "state": h.get("system_state"), "failed_units": h.get("failed_units")}
                              for h in fleet.hosts],
                          "pss_mib_per_host": [x["pss_mib"] for x in st["hosts"]]}, indent=1))
    elif a.cmd == "try":
        if os.geteuid() != 0:
            raise SystemExit("fleet.py try needs root (netns, cgroups, nspawn)")
        try:
            fleet.up(a.hosts, "mixed")
            fleet.write_baselines()
            vllm_host = fleet.hosts[0]["name"]
            guest = boot_guest(fleet, guest_host(fleet)["name"])
            fleet.workload(vllm_host, "vllm")
        except BaseException:
            fleet.down()  # half a fleet is no fleet to try things on
            raise
        print("\n".join(try_lines(fleet, vllm_host, guest)))
    elif a.cmd == "guest":
        print(json.dumps(boot_guest(fleet, a.host, a.kind, a.guest, a.gpu)))
    elif a.cmd == "down":
        print(json.dumps(fleet.down()))
    elif a.cmd == "status":
        print(json.dumps(fleet.status(), indent=1))
    elif a.cmd == "workload":
        print(json.dumps(fleet.workload(a.host, a.workload, a.gpus, a.mib)))
    elif a.cmd == "reboot":
        t0 = time.monotonic()
        state, failed = fleet.reboot(a.host)
        print(json.dumps({"host": a.host, "state": state, "failed_units": failed,
                          "reboot_s": round(time.monotonic() - t0, 2)}))
    elif a.cmd == "ssh":
        r = fleet.ssh(a.host, shlex.join(a.command) if len(a.command) > 1 else " ".join(a.command))
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
        return r.returncode
    return 0


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")  # so that a killed `up` still tears down


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    try:
        sys.exit(main())
    except FleetError as e:
        print(f"fleet: {e}", file=sys.stderr)
        sys.exit(1)
