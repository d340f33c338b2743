"""GPUs given to VMs by PCI passthrough (issue 70): bound to vfio-pci, absent from the host's
nvidia-smi, through the real gpu_facts and the free_gpus role (ansible-playbook) on a simulated host.

The kernel's answers are simulated inside the host's own mount namespace, never on this machine's
/sys: a tmpfs over /sys/bus/pci/devices with the devices' `vendor`, `class`, `driver` and
`iommu_group` as sysfs has them, /dev/vfio/<group> nodes in the host's /dev, a stand-in for QEMU
holding /dev/vfio/42 open in the scope systemd-machined makes for a libvirt VM
(`machine.slice/machine-qemu\\x2d1\\x2dtrain\\x2dvm.scope`, root's, in the name=systemd hierarchy).

The attacker: a user who may open a group node (libvirt chowns it to the VM's user) holds
/dev/vfio/43 from a cgroup of her delegated subtree named like a VM scope; the VM is never named
from her cgroup.

A VM is named only where systemd confirms its scope as a unit: this host has no systemd (its PID 1
is no system manager), so even the root-made libvirt-shaped scope names none here. The VM named from
a real machine scope, through both paths, runs on the fleet's systemd hosts (tests/fleet/test_vms_fleet.py).
"""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]
from ansible_in_ns import run_module  # noqa: E402
from test_paused_containers import ENDS, OWN_PLAY, REPO, SUMMARY_TASK, VERDICT, controller_play  # noqa: E402

SYSTEMD = "/sys/fs/cgroup/systemd"
SCOPE = SYSTEMD + "/machine.slice/machine-qemu\\x2d1\\x2dtrain\\x2dvm.scope"
USER = 4242
HER_TOP = SYSTEMD + "/zm-vfio-alice"
HER_SCOPE = HER_TOP + "/machine.slice/machine-qemu\\x2d9\\x2dfake\\x2dvm.scope"
HOLD = "import sys, time; f = open(sys.argv[1], 'rb'); open(sys.argv[2], 'w').close(); time.sleep(600)"
# sysfs of the simulated node: (address, vendor, class, driver, IOMMU group)
DEVICES = (
    ("0000:61:00.0", "0x10de", "0x030200", "vfio-pci", "42"),  # an H200 given to the libvirt VM
    ("0000:62:00.0", "0x10de", "0x030200", "vfio-pci", "43"),  # an H200 bound to vfio-pci, held by the tenant only
    ("0000:63:00.0", "0x8086", "0x020000", "vfio-pci", "44"),  # a NIC given to a VM: not a GPU
    ("0000:64:00.1", "0x10de", "0x040300", "vfio-pci", "42"),  # the GPU's audio function: not a display device
)


def sysfs(host):
    """The devices' sysfs, in the host's mount namespace only (its root mount is private)."""
    host.run(["mount", "-t", "tmpfs", "-o", "mode=755,size=1m", "zeromib-vfio-sim", "/sys/bus/pci/devices"], check=True)
    for bus, vendor, klass, driver, group in DEVICES:
        path = f"/sys/bus/pci/devices/{bus}"
        host.run(["sh", "-c", 'mkdir "$1" && echo "$2" > "$1/vendor" && echo "$3" > "$1/class" && '
                              'ln -s "../../../bus/pci/drivers/$4" "$1/driver" && ln -s "../../../kernel/iommu_groups/$5" "$1/iommu_group"',
                  "sh", path, vendor, klass, driver, group], check=True)
    host.run(["sh", "-c", "mkdir -p /dev/vfio && mknod -m 600 /dev/vfio/vfio c 1 5 && for g in 42 43 44; do mknod -m 600 /dev/vfio/$g c 1 5; done "
                          f"&& chown {USER:d} /dev/vfio/43"], check=True)


def hold(host, group, cgroup, uid=None):
    """A process holding /dev/vfio/GROUP open, moved into CGROUP (name=systemd) -> its PID."""
    ready = f"/tmp/zeromib-vfio-ready-{group}"
    argv = ["python3", "-c", HOLD, f"/dev/vfio/{group}", ready]
    proc = host.spawn_as(uid, argv, ready=False) if uid is not None else host.spawn(argv, ready=False)
    host.run(["sh", "-c", f'for i in $(seq 200); do [ -e {ready} ] && exit 0; sleep 0.05; done; exit 1'], check=True)
    host.run(["sh", "-c", 'echo "$1" > "$2/cgroup.procs"', "sh", str(proc.pid), cgroup], check=True)
    return proc


@pytest.fixture
def vfio_node(nshost):
    host = nshost("h200x1", seed="vfionode")
    made = [d for d in (SYSTEMD + "/machine.slice", HER_TOP) if not os.path.isdir(d)]
    procs = []
    try:
        sysfs(host)
        host.run(["mkdir", "-p", SCOPE, HER_SCOPE], check=True)
        host.run(["chown", "-R", f"{USER:d}:{USER:d}", HER_TOP], check=True)  # her delegated subtree
        procs.append(hold(host, "42", SCOPE))
        procs.append(hold(host, "43", HER_SCOPE, uid=USER))
        yield host, procs[0].pid
    finally:
        for proc in procs:
            proc.kill()
            proc.wait_gone()
        for path in (SCOPE, HER_SCOPE, os.path.dirname(HER_SCOPE)) + tuple(made):
            host.run(["rmdir", path])


def test_gpu_facts_names_the_vm_each_passthrough_gpu_is_given_to_from_the_kernel_and_systemd(vfio_node):
    host, qemu = vfio_node
    run = run_module(host, "gpu_facts")
    assert not run.failed, run.msg
    gpu = run["ansible_facts"]["gpu"]
    assert gpu["count"] == 1 and gpu["clean"] is True
    assert gpu["given_to_vms"] == [
        # a root-made directory shaped like libvirt's scope, which no systemd confirms: no VM is named from it
        {"bus": "0000:61:00.0", "iommu_group": "42", "vm": None, "pid": None, "mdev": None},
        # held from her own cgroup named like a VM scope: no VM is named from it
        {"bus": "0000:62:00.0", "iommu_group": "43", "vm": None, "pid": None, "mdev": None},
    ]
    assert "fake" not in str(gpu) and "train-vm" not in str(gpu) and host.alive(qemu)


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_an_expected_count_short_by_passthrough_gpus_says_they_are_given_to_vms_with_no_reset_on_both_paths(vfio_node, tmp_path, core, python):
    host, _qemu = vfio_node
    said = ("expected 3 GPUs, nvidia-smi shows 1: 2 given to VMs by PCI passthrough (vfio-pci): 0000:61:00.0 (IOMMU group 42; no VM systemd "
            "names holds it), 0000:62:00.0 (IOMMU group 43; no VM systemd names holds it); a VM's GPU is freed in the VM, and no reset is this "
            "host's to do")
    rc, output, tasks = controller_play(tmp_path, host, core, python, os.path.join(REPO, "playbooks", "free_gpus.yml"),
                                        node_vars={"free_gpus_expected_count": 3})
    assert rc == 2, output[-3000:]
    [summary] = [t for t in tasks if t["task"] == SUMMARY_TASK]
    [row] = [line for line in summary["result"]["msg"] if "node: " in line]
    assert row.split("node: ", 1)[1].startswith(said), row
    for word in ("missing", "leaked", "fallen off the bus", "--gpu-reset", "reboot", "fake"):
        assert word not in output, (word, output[-3000:])

    # the role in a user's own play: the verdict says the same, and training never starts
    (tmp_path / "train.yml").write_text(json.dumps(OWN_PLAY))
    rc, output, tasks = controller_play(tmp_path, host, core, python, str(tmp_path / "train.yml"), node_vars={"free_gpus_expected_count": 3})
    assert rc == 2, output[-3000:]
    [verdict] = [t for t in tasks if t["task"] == VERDICT]
    assert verdict["status"] == "failed" and verdict["result"]["msg"].startswith(f"node: {said}"), verdict["result"]
    assert not [t for t in tasks if t["task"] == "Train"] and output.count(said) == 1, output[-3000:]

    rc, output, tasks = controller_play(tmp_path, host, core, python, os.path.join(REPO, "playbooks", "free_gpus.yml"),
                                        node_vars={"free_gpus_expected_count": 4})
    four = said.replace("expected 3 GPUs", "expected 4 GPUs", 1) + "; 1 more may have fallen off the bus"
    assert rc == 2 and four in output, output[-3000:]
