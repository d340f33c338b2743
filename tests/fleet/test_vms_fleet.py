"""GPUs given to VMs (issue 70) on a real systemd host: which VM holds a passthrough GPU or a vGPU is
named only where the kernel and systemd say it, through free_gpus.yml and the role in a user's own
play, on the oldest and newest supported ansible-core (over SSH into the fleet's hosts).

The kernel's side is simulated in the host's own mount namespace: a tmpfs over /sys/bus with the
devices as sysfs lays them out (two H200s bound to vfio-pci; a vGPU, a mediated device, of the
host's GPU 1) and /dev/vfio/<group> nodes. The VMs are real systemd units: the process holding
/dev/vfio/42 runs in the scope libvirt's systemd-machined makes
(`systemd-run --scope --slice=machine.slice --unit=machine-qemu\\x2d1\\x2dtrain\\x2dvm`), the one
holding the vGPU's group in Proxmox's (`--slice=qemu.slice --unit=101`).

The attacker: a user whom the group node /dev/vfio/43 was given to (libvirt chowns it to the VM's
user) holds it from her SSH login, her process named `qemu-system-x86_64 ... -name guest=evil-vm` as
QEMU names itself: no VM is named from it. And a directory made outside systemd in machine.slice,
named like libvirt's scope (`machine-qemu\x2d9\x2dghost\x2dvm.scope`), with a process holding
/dev/vfio/44 in it: systemd has no such unit, so it names no VM. Works on a fleet of 1 host.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios import PLAYBOOK, TRAINING, host_message

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

ENDS = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
IDS = [f"ansible-core-{c}" for c, _p in ENDS]
USER = "zmvmuser"
LIBVIRT_UNIT = "machine-qemu\\x2d1\\x2dtrain\\x2dvm"
GHOST = "/sys/fs/cgroup/machine.slice/machine-qemu\\x2d9\\x2dghost\\x2dvm.scope"
PROXMOX_UNIT = "101"
MDEV = "aa1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f01"
HOLD = "import sys, time; f = open(sys.argv[1], 'rb'); open(sys.argv[2], 'w').close(); time.sleep(900)"
CONFIG = "/etc/nvidia-sim/config.json"
# What the user runs over her SSH login: a process named as QEMU names itself, holding /dev/vfio/43.
EVIL = ("r=$HOME/evil-ready; rm -f $r; setsid nohup bash -c 'exec -a qemu-system-x86_64 python3 \"$0\" /dev/vfio/43 \"$1\" -name "
        "guest=evil-vm,debug-threads=on' $HOME/hold.py $r </dev/null >/dev/null 2>&1 & "
        "for i in $(seq 200); do [ -e $r ] && break; sleep 0.05; done; pgrep -u $(id -u) -f guest=evil-vm")
# The simulator's GPUs as a vGPU hypervisor's nvidia-smi -q reads them (Virtualization Mode Host VGPU).
HOST_VGPU = "import json, sys; c = json.load(open(sys.argv[1])); c['virtualization_mode'] = 'Host VGPU'; json.dump(c, open(sys.argv[1], 'w'))"


def sysfs_script(vgpu_parent: str) -> str:
    """sysfs as the kernel lays it out for two passthrough H200s and one vGPU of the GPU at VGPU_PARENT,
    on a tmpfs over /sys/bus (the fleet host's mount namespace only), and the group nodes in /dev/vfio."""
    return ("set -e; mount -t tmpfs -o mode=755,size=1m zm-vfio-sim /sys/bus; mkdir -p /sys/bus/pci/devices /sys/bus/mdev/devices; "
            "d=/sys/bus/pci/devices; "
            "for dev in 0000:61:00.0:42 0000:62:00.0:43 0000:63:00.0:44; do bus=${dev%:*}; g=${dev##*:}; mkdir $d/$bus; echo 0x10de > $d/$bus/vendor; "
            "echo 0x030200 > $d/$bus/class; ln -s ../../../bus/pci/drivers/vfio-pci $d/$bus/driver; "
            "ln -s ../../../kernel/iommu_groups/$g $d/$bus/iommu_group; done; "
            f"mkdir -p $d/{vgpu_parent}/{MDEV}; echo 0x10de > $d/{vgpu_parent}/vendor; echo 0x030200 > $d/{vgpu_parent}/class; "
            f"ln -s ../../../../kernel/iommu_groups/101 $d/{vgpu_parent}/{MDEV}/iommu_group; "
            f"ln -s ../../pci/devices/{vgpu_parent}/{MDEV} /sys/bus/mdev/devices/{MDEV}; "
            "mkdir -p /dev/vfio; for g in 42 43 44 101; do rm -f /dev/vfio/$g; mknod -m 600 /dev/vfio/$g c 1 5; done; "
            f"chown {USER} /dev/vfio/43")


def hold_in_scope(fleet, host: str, slice_name: str, unit: str, group: str) -> int:
    """A process holding /dev/vfio/GROUP in the scope UNIT that systemd makes in SLICE -> its PID."""
    ready = f"/run/zm-vm-ready-{group}"
    fleet.ssh(host, f"rm -f {ready}; setsid systemd-run --quiet --scope --slice={slice_name} --unit={shlex.quote(unit)} -- "
                    f"python3 -c {shlex.quote(HOLD)} /dev/vfio/{group} {ready} </dev/null >/dev/null 2>&1 & "
                    f"for i in $(seq 200); do [ -e {ready} ] && break; sleep 0.05; done", check=True)
    out = fleet.ssh(host, f"cat /sys/fs/cgroup/{slice_name}/{shlex.quote(unit + '.scope')}/cgroup.procs", check=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def own_login(fleet, host: str, user: str, cmd: str) -> subprocess.CompletedProcess:
    """CMD over an SSH login of its own as USER (not the fleet's multiplexed connection)."""
    argv = ["ControlMaster=no" if arg == "ControlMaster=auto" else "ControlPath=none" if arg.startswith("ControlPath=") else arg
            for arg in fleet.rig.ssh_argv(host, cmd)]
    argv[-2] = argv[-2].replace("root@", f"{user}@", 1)
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=False)


def vgpu_parent(fleet, host: str) -> str:
    """GPU 1's PCI address as sysfs names it (nvidia-smi's, lower case, 4-digit domain)."""
    out = fleet.ssh(host, "nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader", check=True).stdout
    bus = dict(line.split(", ") for line in out.splitlines())["1"]
    return bus.lower()[-12:]


@pytest.fixture
def vm_node(clean_fleet):
    fleet = clean_fleet
    host = fleet.names[0]
    parent = vgpu_parent(fleet, host)
    key = "/root/.ssh/authorized_keys"
    fleet.ssh(host, f"id {USER} >/dev/null 2>&1 || useradd -m -s /bin/bash {USER}; install -d -m 700 -o {USER} ~{USER}/.ssh; "
                    f"install -m 600 -o {USER} {key} ~{USER}/.ssh/authorized_keys; cp {CONFIG} {CONFIG}.before-vms", check=True)
    pids = []
    try:
        fleet.ssh(host, sysfs_script(parent), check=True)
        train = hold_in_scope(fleet, host, "machine.slice", LIBVIRT_UNIT, "42")
        infer = hold_in_scope(fleet, host, "qemu.slice", PROXMOX_UNIT, "101")
        # A process root moved into a directory it made itself, shaped like libvirt's scope: no unit of systemd's.
        fleet.ssh(host, f"rm -f /run/zm-vm-ready-44; setsid python3 -c {shlex.quote(HOLD)} /dev/vfio/44 /run/zm-vm-ready-44 </dev/null >/dev/null "
                        "2>&1 & p=$!; for i in $(seq 200); do [ -e /run/zm-vm-ready-44 ] && break; sleep 0.05; done; "
                        f"mkdir {shlex.quote(GHOST)} && echo $p > {shlex.quote(GHOST)}/cgroup.procs", check=True)
        ghost = int(fleet.ssh(host, f"cat {shlex.quote(GHOST)}/cgroup.procs", check=True).stdout.split()[0])
        pids = [ghost]
        # Her own "QEMU", from her SSH login: argv[0] and -name as QEMU gives them.
        fleet.ssh(host, f"printf '%s\\n' {shlex.quote(HOLD)} > ~{USER}/hold.py && printf '%s\\n' {shlex.quote(EVIL)} > ~{USER}/evil.sh", check=True)
        started = own_login(fleet, host, USER, "bash $HOME/evil.sh")
        assert started.returncode == 0, (started.stdout, started.stderr)
        pids += [int(word) for word in started.stdout.split()]
        yield fleet, host, {"train": train, "infer": infer, "evil": pids[1], "ghost": ghost, "parent": parent}
    finally:
        fleet.ssh(host, f"systemctl stop {shlex.quote(LIBVIRT_UNIT + '.scope')} {PROXMOX_UNIT}.scope; "
                        + "".join(f"kill -9 {pid:d}; " for pid in pids)
                        + f"for i in $(seq 100); do rmdir {shlex.quote(GHOST)} 2>/dev/null && break; sleep 0.05; done; "
                        + f"umount /sys/bus; rm -f /dev/vfio/42 /dev/vfio/43 /dev/vfio/44 /dev/vfio/101; mv {CONFIG}.before-vms {CONFIG}")
        fleet.clear_faults(host)


def play(fleet, core: str, python: str, playbook: str, host: str, **extra):
    bin_dir = matrix.controller_bin(core, python)
    return fleet.ansible_playbook(playbook, limit=[host], bin_dir=bin_dir, env={"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
                                  extra_vars=extra)


@pytest.mark.parametrize(("core", "python"), ENDS, ids=IDS)
def test_passthrough_gpus_are_named_with_the_vm_systemd_runs_and_never_from_a_users_qemu_on_both_paths(vm_node, core, python):
    fleet, host, pids = vm_node
    count = len(fleet.gpu_memory(host))
    said = (f"expected {count + 3} GPUs, nvidia-smi shows {count}: 3 given to VMs by PCI passthrough (vfio-pci): 0000:61:00.0 to VM train-vm "
            "(libvirt), 0000:62:00.0 (IOMMU group 43; no VM systemd names holds it), 0000:63:00.0 (IOMMU group 44; no VM systemd names holds "
            "it); a VM's GPU is freed in the VM, and no reset is this host's to do")
    run = play(fleet, core, python, PLAYBOOK, host, free_gpus_expected_count=count + 3)
    assert run.rc == 2, run.stdout[-3000:]
    assert host_message(run, host).startswith(said), host_message(run, host)
    own = play(fleet, core, python, TRAINING, host, free_gpus_expected_count=count + 3, training_command="true")
    assert own.rc == 2, own.stdout[-3000:]
    [fatal] = [line for line in own.stdout.splitlines() if line.startswith(f"fatal: [{host}]")]
    assert f'"msg": "{host}: {said}' in fatal, fatal
    for text in (run.stdout, own.stdout):
        for word in ("evil", "ghost", "--gpu-reset", "reboot", "missing", "leaked"):
            assert word not in text, (word, text[-3000:])
    alive = fleet.ssh(host, " && ".join(f"test -e /proc/{pid:d}" for pid in (pids["train"], pids["infer"], pids["evil"], pids["ghost"])))
    assert alive.returncode == 0, "no VM process is this run's to signal"


def test_a_vgpu_hosts_memory_is_said_held_by_the_vm_that_holds_its_vgpu_with_no_reset(vm_node):
    """A vGPU host (nvidia-smi -q: Host VGPU): GPU 1's framebuffer reserved for a vGPU no process of
    the host holds; the failure names the VM systemd runs that holds the vGPU's group."""
    fleet, host, pids = vm_node
    fleet.ssh(host, f"python3 -c {shlex.quote(HOST_VGPU)} {CONFIG}", check=True)
    fleet.set_fault(host, {"leak": {"1": {"mib": 24576, "listed": False}}})
    core, python = ENDS[-1]
    run = play(fleet, core, python, PLAYBOOK, host)
    assert run.rc == 2, run.stdout[-3000:]
    said = host_message(run, host)
    assert re.search(r"GPU 1 \(GPU-[^)]*\) reads \d+ MiB, and no process of this host holds it: GPU 1 is shared as vGPUs with VMs \(nvidia-smi -q: "
                     r"Virtualization Mode Host VGPU\), and memory no process here holds is the framebuffer reserved for the vGPUs given to VMs "
                     r"\(its vGPUs are held by Proxmox VM 101\), not a leak", said), said
    assert "--gpu-reset" not in run.stdout and "leaked" not in run.stdout, said
    assert fleet.ssh(host, f"test -e /proc/{pids['infer']:d}").returncode == 0, "the VM is not this run's to signal"
