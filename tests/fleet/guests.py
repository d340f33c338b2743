"""System containers inside a fleet host (issue 56): real guests of the three kinds the field runs,
seen from their host as Proxmox, LXD and systemd-nspawn show them.

A guest is a real systemd booted as PID 1 in new PID, mount, UTS, IPC, cgroup and network
namespaces, on an overlay of the host's root (a tmpfs upper), below a boundary cgroup of its
kind's shape (`_cgroups._GUEST_BOUNDARIES`):
- lxc:    /lxc/<id>/ns                 (Proxmox VE; the launcher, as lxc-start's monitor, in /lxc.monitor/<id>)
- lxd:    /lxc.payload.<name>          (LXD, Incus; the launcher in /lxc.monitor.<name>)
- nspawn: /machine.slice/systemd-nspawn@<name>.service/payload  (a transient unit of the host's systemd
          with Delegate=yes, as `machinectl start` makes it; the launcher in supervisor/)
Its own `vllm.service` (Restart=always, as the field's guests auto-start vLLM) holds one GPU, and its
systemd is reached as the host reaches a guest's: `nsenter -t <guest init> -a systemctl ...`.

What stands in for the real thing: the launcher is `unshare` (not lxc-start or systemd-nspawn, which
the fleet image does not have), the guest's root is the host's own tree under an overlay (not a
distribution of its own), and /dev is the host's (bind-mounted, with the simulated GPU nodes, as
`lxc.mount.entry` or `--bind` pass them). The guest's gpu_holder registers under its host PID
(NVIDIA_SIM_DRIVER_PROC, the host's procfs at /run/host-proc), as the driver knows a guest's
processes on the host.

`stand_in(...)`: a guest without a system manager, as TEST_RIGS.md describes it: a shell loop as the
init of `unshare --pid --cgroup --uts --fork`, restarting its server as Restart=always would.
"""
from __future__ import annotations

import dataclasses
import shlex
import time

# The guest's init: boots systemd in new namespaces below BOUNDARY (run by BOOT below).
INNER = r"""set -e
G={dir}
mount --make-rprivate /
mount -t overlay overlay -o lowerdir=/,upperdir=$G/upper,workdir=$G/work $G/root
mount --rbind /dev $G/root/dev
mount -t proc proc $G/root/proc
mount -t sysfs -o ro sysfs $G/root/sys
mount -t cgroup2 cgroup2 $G/root/sys/fs/cgroup
mount -t tmpfs tmpfs $G/root/run
mount -t tmpfs tmpfs $G/root/tmp
mkdir -p $G/root/run/host-proc $G/root/run/nvidia-sim
mount --bind /run/nvidia-sim $G/root/run/nvidia-sim
cd $G/root
mkdir -p .oldroot
pivot_root . .oldroot
mount --rbind /.oldroot/proc /run/host-proc
umount -l /.oldroot
exec env -i container=lxc PATH=/usr/sbin:/usr/bin:/sbin:/bin /lib/systemd/systemd --system
"""
# Units the guest does not need (or that would act on the host's devices and network).
MASKED = ("getty@tty1.service", "console-getty.service", "ssh.service", "sshd.service", "systemd-networkd.service",
          "nvidia-sim-devices.service", "cron.service", "atd.service", "systemd-logind.service", "systemd-resolved.service",
          "systemd-timesyncd.service", "sglang.service", "vllm-v1.service", "stubborn.service", "notebook-hub.service",
          "nvidia-persistenced.service", "e2scrub_reap.service", "munge.service", "slurmd.service", "slurmctld.service")
GUEST_UNIT = """[Unit]
Description=vLLM of guest {name} (simulated)
[Service]
Environment=NVIDIA_SIM_DRIVER_PROC=/run/host-proc
ExecStart=/usr/local/bin/gpu_holder --gpus {gpu} --mib {mib}
Restart=always
RestartSec=0.5
[Install]
WantedBy=multi-user.target
"""
SHAPES = {
    "lxc": ("/lxc/{name}/ns", "/lxc.monitor/{name}"),
    "lxd": ("/lxc.payload.{name}", "/lxc.monitor.{name}"),
    "nspawn": ("/machine.slice/systemd-nspawn@{name}.service/payload", "/machine.slice/systemd-nspawn@{name}.service/supervisor"),
}
CG = "/sys/fs/cgroup"


@dataclasses.dataclass
class Guest:
    kind: str
    name: str
    boundary: str  # its cgroup, as the host's /proc/PID/cgroup shows it
    monitor: str
    dir: str
    gpu: int
    init_pid: int = 0

    def entry(self, unit: str = "vllm.service") -> str:
        """Its unit as gpu_release's services names it."""
        return "{}:{}:{}".format({"nspawn": "machine"}.get(self.kind, self.kind), self.name, unit)


def _sh(fleet, host, script: str, timeout: float = 60) -> str:
    r = fleet.ssh(host, script, timeout=timeout)
    assert r.returncode == 0, f"{host}: {script[:200]}...\nrc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def boot(fleet, host: str, kind: str, name: str, gpu: int, mib: int = 40960, timeout: float = 60, bounding: str = "",
         props: tuple[str, ...] = ()) -> Guest:
    """A guest of KIND with a real systemd whose enabled vllm.service holds GPU `gpu`; returns
    once its systemd is running and the GPU reads its memory on the host. `bounding`: capabilities
    its init's bounding set lacks, as a guest manager drops them (setpriv's `-sys_module,...`);
    `props`: properties of the nspawn shape's launcher unit (`SystemCallFilter=~kexec_load`: a
    seccomp filter of the guest's own, as systemd-nspawn adds)."""
    boundary, monitor = (path.format(name=name) for path in SHAPES[kind])
    guest = Guest(kind, name, boundary, monitor, f"/var/lib/zeromib-guests/{kind}-{name}", gpu)
    d = guest.dir
    upper = f"{d}/upper/etc/systemd/system"
    setup = [
        f"mkdir -p {d} && (mountpoint -q {d} || mount -t tmpfs -o mode=0700 tmpfs {d})",
        f"mkdir -p {d}/upper {d}/work {d}/root {upper}/multi-user.target.wants",
        *[f"ln -sf /dev/null {upper}/{unit}" for unit in MASKED],
        f"printf %s {shlex.quote(GUEST_UNIT.format(name=name, gpu=gpu, mib=mib))} > {upper}/vllm.service",
        f"ln -sf ../vllm.service {upper}/multi-user.target.wants/vllm.service",
        f"echo {shlex.quote(name)} > {d}/upper/etc/hostname && : > {d}/upper/etc/machine-id",
        f"printf %s {shlex.quote(INNER.format(dir=d))} > {d}/inner.sh",
        # The launcher joins the boundary before it makes the cgroup namespace (rooted there), then
        # `unshare` (its PID) is moved out to the monitor's cgroup, as lxc-start's monitor lives outside.
        f"printf %s {shlex.quote(launcher(guest, bounding))} > {d}/launch.sh && chmod +x {d}/launch.sh",
    ]
    if kind == "nspawn":
        setup.append(f"systemd-run --quiet --unit systemd-nspawn@{name}.service --slice machine.slice -p Delegate=yes "
                     + "".join(f"-p {shlex.quote(p)} " for p in props) + f"{d}/launch.sh")
    else:
        setup.append(f"mkdir -p {CG}{boundary} {CG}{monitor} && (setsid {d}/launch.sh </dev/null >/dev/null 2>&1 &)")
    try:
        _sh(fleet, host, " && ".join(setup))
        guest.init_pid = _wait_init(fleet, host, guest, timeout)
        # Until the guest's systemd answers on its bus (a loaded machine: several seconds), systemctl
        # prints nothing to stdout; ask again until it says running (or degraded) or the time is up.
        deadline, state = time.monotonic() + timeout, ""
        while state not in ("running", "degraded") and time.monotonic() < deadline:
            state = _sh(fleet, host, f"nsenter -t {guest.init_pid} -a systemctl is-system-running --wait || true", timeout=timeout).strip()
            if state not in ("running", "degraded"):
                time.sleep(0.5)
        assert state in ("running", "degraded"), f"guest {kind} {name}: {state!r}"
        wait_gpu(fleet, host, gpu, lambda mib: mib >= 1000, timeout)
    except BaseException:
        # Half booted: the test's list does not hold it yet, so nothing else would end it (its server
        # would hold a GPU of the fleet's host for the tests that come after).
        teardown(fleet, host, [guest])
        raise
    return guest


def launcher(guest: Guest, bounding: str = "") -> str:
    """The guest's launcher script: into the boundary, the monitor out, then the init (with the
    bounding set less `bounding`)."""
    drop = f"setpriv --bounding-set={bounding} -- " if bounding else ""
    return (f"#!/bin/sh\nset -e\nmkdir -p {CG}{guest.boundary} {CG}{guest.monitor}\n"
            f"echo $$ > {CG}{guest.boundary}/cgroup.procs\n"
            f"(sleep 0.5; echo $$ > {CG}{guest.monitor}/cgroup.procs) &\n"
            f"exec {drop}unshare --pid --mount --uts --ipc --cgroup --net --fork --propagation private sh {guest.dir}/inner.sh "
            f"</dev/null >{guest.dir}/console.log 2>&1\n")


def stand_in(fleet, host: str, name: str, gpu: int, mib: int = 40960, timeout: float = 30) -> Guest:
    """A guest whose init is a shell loop (no system manager) restarting its server on GPU `gpu`:
    `unshare --pid --cgroup --uts --fork` below /lxc/<name>/ns, sharing the host's /proc."""
    boundary, monitor = (path.format(name=name) for path in SHAPES["lxc"])
    guest = Guest("lxc", name, boundary, monitor, "", gpu)
    loop = f"while :; do /usr/local/bin/gpu_holder --gpus {gpu} --mib {mib}; sleep 0.3; done"
    path = f"/run/zeromib-guest-{name}.sh"
    body = (f"#!/bin/sh\necho $$ > {CG}{boundary}/cgroup.procs\n(sleep 0.5; echo $$ > {CG}{monitor}/cgroup.procs) &\n"
            f"exec unshare --pid --cgroup --uts --fork sh -c {shlex.quote(loop)}\n")
    script = (f"mkdir -p {CG}{boundary} {CG}{monitor} && printf %s {shlex.quote(body)} > {path} && chmod +x {path} && "
              f"(setsid {path} </dev/null >/dev/null 2>&1 &)")
    try:
        _sh(fleet, host, script)
        guest.init_pid = _wait_init(fleet, host, guest, timeout)
        wait_gpu(fleet, host, gpu, lambda used: used >= 1000, timeout)
    except BaseException:
        teardown(fleet, host, [guest])
        raise
    return guest


def _wait_init(fleet, host: str, guest: Guest, timeout: float) -> int:
    """The host PID of the guest's PID 1, once it is in its cgroup and the launcher is out of it."""
    find = (f"for p in $(cat $(find {CG}{guest.boundary} -name cgroup.procs) 2>/dev/null); do "
            "grep -q \"^NSpid:.*[[:space:]]1$\" /proc/$p/status 2>/dev/null && echo $p; done; "
            f"cat {CG}{guest.monitor}/cgroup.procs 2>/dev/null | head -1 | sed 's/^/monitor /'")
    deadline = time.monotonic() + timeout
    while True:
        lines = _sh(fleet, host, find).splitlines()
        pids = [int(line) for line in lines if line.strip().isdigit()]
        if pids and any(line.startswith("monitor ") for line in lines):
            return pids[0]
        assert time.monotonic() < deadline, f"guest {guest.kind} {guest.name} has no init after {timeout} s: {lines}"
        time.sleep(0.2)


def wait_gpu(fleet, host: str, gpu: int, ok, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while True:
        used = fleet.gpu_memory(host)[gpu]
        if ok(used):
            return used
        assert time.monotonic() < deadline, f"GPU {gpu} of {host} reads {used} MiB after {timeout} s"
        time.sleep(0.2)


def systemctl(fleet, host: str, guest: Guest, args: str) -> str:
    """The guest's own systemctl, as the host reaches it."""
    return fleet.ssh(host, f"nsenter -t {guest.init_pid} -a systemctl {args}").stdout.strip()


def unit_state(fleet, host: str, guest: Guest, unit: str = "vllm.service") -> tuple[str, str, int]:
    """(ActiveState, unit file state, MainPID as the guest numbers it) of the guest's unit; the file
    state as the files say (`is-enabled`: `show` keeps the one systemd last read until a reload)."""
    out = systemctl(fleet, host, guest, f"show -p ActiveState,MainPID --no-pager {unit}")
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return props.get("ActiveState", ""), systemctl(fleet, host, guest, f"is-enabled {unit}"), int(props.get("MainPID") or 0)


def host_pids(fleet, host: str, guest: Guest, unit: str = "vllm.service") -> list[int]:
    """The host PIDs of a guest unit's processes (its cgroup, read on the host)."""
    out = fleet.ssh(host, f"cat {CG}{guest.boundary}/system.slice/{unit}/cgroup.procs 2>/dev/null").stdout
    return sorted(int(word) for word in out.split())


def teardown(fleet, host: str, guests: list[Guest]) -> None:
    """Every process of the guests ended through their cgroups (also the launcher's), then their
    cgroups and file systems removed. Safe to call twice, and for a guest half booted."""
    script = []
    for guest in guests:
        if guest.kind == "nspawn":
            script.append(f"systemctl kill --signal=SIGKILL systemd-nspawn@{guest.name}.service 2>/dev/null; "
                          f"systemctl stop systemd-nspawn@{guest.name}.service 2>/dev/null; "
                          f"systemctl reset-failed systemd-nspawn@{guest.name}.service 2>/dev/null")
        else:
            for cg in (guest.boundary, guest.monitor):
                script.append(f"[ -d {CG}{cg} ] && echo 1 > {CG}{cg}/cgroup.kill; "
                              f"for i in $(seq 100); do grep -q 'populated 0' {CG}{cg}/cgroup.events 2>/dev/null && break; sleep 0.05; done; "
                              f"[ -d {CG}{cg} ] && find {CG}{cg} -depth -type d -exec rmdir {{}} \\; ")
                parts = cg.strip("/").split("/")
                # The directories above it too (/lxc/101 of /lxc/101/ns, /lxc): the ones other guests use stay.
                script += [f"rmdir {CG}/{'/'.join(parts[:n])} 2>/dev/null" for n in range(len(parts) - 1, 0, -1)]
        if guest.dir:
            script.append(f"(mountpoint -q {guest.dir} && umount -l {guest.dir}); rmdir {guest.dir} {guest.dir.rsplit('/', 1)[0]} 2>/dev/null")
    script.append("true")
    fleet.ssh(host, "; ".join(script), timeout=60)
