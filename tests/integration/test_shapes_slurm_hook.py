"""The node shapes of issue 70 through the real Slurm hook (the packed slurm_gpu_checks runner as
slurmd calls it, on a namespace host with the simulated driver): each says the right verdict, its
sentence first, and no reset advice where a reset is not the node's to do.

Shapes already run through the hook elsewhere: unified memory (test_unified_memory.py), checkpointed
holders (test_checkpointed_holders.py), IMEX importers and WSL2 (test_node_shapes.py). Here: a holder
in a frozen cgroup (root's, and a user's delegated one), a node with GPUs given to VMs by PCI
passthrough, a vGPU host whose GPU holds its VMs' framebuffer, a paused docker container (refused
naming `docker unpause`, before anything is done), and work that escaped its job (an Apptainer
instance, a detached process) on the job's GPU and another: refused, the first sentence naming where
it came from and what ends it.
"""
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from test_gpu_release import used  # noqa: E402
from test_slurm_epilog_smoke import epilog  # noqa: E402
from test_slurm_epilog_smoke import runner  # noqa: E402,F401  # pylint: disable=unused-import  # a pytest fixture, used by name
from test_vfio_passthrough import vfio_node  # noqa: E402,F401  # pylint: disable=unused-import  # a pytest fixture, used by name
from tenants.frozen_cgroup import frozen_holder  # noqa: E402  # pylint: disable=wrong-import-position
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "sim"))
import make_config  # noqa: E402
from apptainer_starter import INSTALLED  # noqa: E402
from test_apptainer_instances import install_starter, share, start_instance  # noqa: E402,F401  # pylint: disable=unused-import  # a fixture, used by name
from test_container_engines import docker, rig  # noqa: E402,F401  # pylint: disable=unused-import  # fixtures, used by name

USER = 4242
FAST = {"kill_timeout": 0.5, "wait_timeout": 1, "settle_timeout": 0}
RESET_WORDS = ("--gpu-reset", "a reboot is needed", "fallen off the bus", "leaked")


def no_reset_words(text):
    return [word for word in RESET_WORDS if word in text]


def test_the_epilog_names_a_leftover_root_froze_as_frozen_with_the_thaw_command_first(nshost, runner, tmp_path):  # noqa: F811
    host = nshost("h200x1", seed="shapefrozen")
    with frozen_holder(host, "suspended-job", mib=2048) as held:
        rc, stderr, entry = epilog(host, runner, tmp_path, "951", gpus="0", **FAST)
        assert rc != 0 and not entry["ok"], (stderr, entry)
        cause = " ".join(entry["causes"])
        assert entry["causes"][0].startswith("frozen (freezer.state FROZEN in "), entry
        assert f"pid {held.pid} " in cause and f"`echo THAWED > {held.directory}/freezer.state`" in cause, entry
        assert "unkillable (outlived SIGKILL" not in cause and not no_reset_words(stderr + cause), entry
        assert held.state() == "FROZEN"  # the hook thaws nothing itself


def test_the_epilog_never_thaws_a_cgroup_a_user_froze_in_her_subtree(nshost, runner, tmp_path):  # noqa: F811
    host = nshost("h200x1", seed="shapefrozenuser")
    with frozen_holder(host, "alice-lab", mib=1024, uid=USER, delegated=True) as held:
        rc, stderr, entry = epilog(host, runner, tmp_path, "952", gpus="0", **FAST)
        assert rc != 0 and not entry["ok"], (stderr, entry)
        cause = " ".join(entry["causes"])
        assert entry["causes"][0].startswith("frozen (freezer.state FROZEN in "), entry
        assert f"the cgroup is in uid {USER}'s delegated subtree, frozen by that user" in cause, entry
        assert "THAWED" not in cause and not no_reset_words(stderr + cause), entry
        assert held.state() == "FROZEN" and used(host, 0) >= 1024


def test_the_epilog_on_a_node_with_gpus_given_to_vms_passes_its_own_gpu_and_leaves_the_vms_alone(vfio_node, runner, tmp_path):  # noqa: F811
    host, qemu = vfio_node
    rc, stderr, entry = epilog(host, runner, tmp_path, "953", gpus="0", **FAST)
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), (stderr, entry)
    assert entry.get("killed", []) == [] and host.alive(qemu), entry  # the VM's QEMU is never the job's leftover
    assert not no_reset_words(stderr + str(entry)), entry


# Seen 2026-12-07: the hook says "GPU 0: 20489 MiB, no process holds it" (killed [], nothing refused), where
# gpu_release names the paused container and `docker unpause`; the hook says gpu_release's refusal first.
def test_the_epilog_refuses_a_paused_container_naming_docker_unpause_first(docker, runner, tmp_path):  # noqa: F811
    docker.run_holder("suspended", [0])
    docker.docker("pause", "suspended")
    rc, stderr, entry = epilog(docker.host, runner, tmp_path, "954", gpus="0", **FAST)
    assert rc != 0 and not entry["ok"], (stderr, entry)
    assert entry["causes"][0].startswith("GPUs are held by paused containers: suspended (docker "), entry
    assert "`docker unpause suspended` thaws it" in entry["causes"][0], entry
    assert not no_reset_words(stderr + str(entry)) and "reset" not in str(entry["causes"]).lower(), entry
    assert docker.inspect("suspended")["State"]["Paused"] is True  # refused before anything was done


def test_the_epilog_names_an_apptainer_instance_left_on_the_jobs_gpu_with_its_stop_command_first(nshost, runner, tmp_path, share):  # noqa: F811
    """An instance its user started outside any job holds the job's GPU 0 and GPU 1 (no job's): the
    epilog does not end it (that would end its work on GPU 1) and says first which instance it is."""
    host = nshost("h200x2", seed="shapeinstance")
    install_starter(host)
    pid, _starter = start_instance(host, share, INSTALLED, "train", gpus="0,1")
    rc, stderr, entry = epilog(host, runner, tmp_path, "955", gpus="0", **FAST)
    assert rc != 0 and not entry["ok"], (stderr, entry)
    assert re.match(rf"GPU 0: \d+ MiB, held by pid {pid} python3 \(Apptainer instance train of uid {USER}: "
                    r"`apptainer instance stop train`\)$", entry["causes"][0]), entry
    assert host.alive(pid) and not no_reset_words(stderr + str(entry)), entry


def test_the_epilog_names_a_detached_leftover_outside_any_job_first(nshost, runner, tmp_path):  # noqa: F811
    host = nshost("h200x2", seed="shapedetached")
    left = host.spawn_as(USER, ["gpu_holder", "--gpus", "0,1", "--mib", "1024"])
    rc, stderr, entry = epilog(host, runner, tmp_path, "956", gpus="0", **FAST)
    assert rc != 0 and not entry["ok"], (stderr, entry)
    assert re.match(rf"GPU 0: \d+ MiB, held by pid {left.pid} python3 \(a process of uid {USER} started outside any job\)$", entry["causes"][0]), entry
    assert host.alive(left.pid) and not no_reset_words(stderr + str(entry)), entry


MDEV = "aa1e7a8c-0c7c-4c1e-9d6c-1f0e1f0e1f01"


def test_the_epilog_on_a_vgpu_host_says_its_gpus_memory_is_given_to_vms_with_no_reset(nshost, runner, tmp_path):  # noqa: F811
    """A vGPU hypervisor (nvidia-smi -q: Host VGPU) whose GPU 1 has a vGPU (sysfs: a mediated device, in
    the host's own mount namespace), its framebuffer reserved with no process of the host: the
    epilog fails on it, says so first, and advises no reset (no systemd here names the VM)."""
    host = nshost(config=make_config.make_config("h200x2", seed="shapevgpu", virtualization_mode="Host VGPU"), seed="shapevgpu")
    bus = host.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "1"], check=True).stdout.strip().lower()[-12:]
    d = "/sys/bus/pci/devices"
    host.run(["sh", "-c", f"mount -t tmpfs -o mode=755,size=1m zm-vgpu-sim /sys/bus && mkdir -p {d}/{bus}/{MDEV} /sys/bus/mdev/devices && "
                          f"echo 0x10de > {d}/{bus}/vendor && ln -s ../../../../kernel/iommu_groups/101 {d}/{bus}/{MDEV}/iommu_group && "
                          f"ln -s ../../pci/devices/{bus}/{MDEV} /sys/bus/mdev/devices/{MDEV} && mkdir -p /dev/vfio && "
                          "mknod -m 600 /dev/vfio/101 c 1 5"], check=True)
    host.set_fault({"leak": {"1": {"mib": 24576, "listed": False}}})
    rc, stderr, entry = epilog(host, runner, tmp_path, "957", gpus="1", **FAST)
    assert rc != 0 and not entry["ok"], (stderr, entry)
    assert entry["causes"][0].startswith("GPU 1: "), entry
    assert entry["causes"][0].endswith(" MiB, no process holds it here: vGPUs given to VMs, no reset"), entry
    assert not no_reset_words(stderr + " ".join(entry["causes"])), entry


def test_the_epilog_quotes_a_sleeping_vllm_servers_own_word_for_a_leftover_outside_any_job(nshost, runner, tmp_path):  # noqa: F811
    """A server of uid 4242 left outside any job on the job's GPU 0 and GPU 1, whose own port answers
    vLLM's `GET /is_sleeping` with true: the epilog refuses it as any such leftover (its word decides
    nothing) and its first cause quotes what the server says of itself."""
    host = nshost("h200x2", seed="shapesleep")
    host.run(["ip", "link", "set", "lo", "up"], check=False)
    left = host.spawn_as(USER, ["gpu_holder", "--gpus", "0,1", "--mib", "1024", "--http-port", "18000", "--http-answer", "asleep"])
    listening = host.run(["sh", "-c", "for i in $(seq 200); do grep -q ':4650 00000000:0000 0A' /proc/net/tcp && exit 0; sleep 0.05; done; "
                                      "cat /proc/net/tcp; exit 1"], check=False)
    assert listening.returncode == 0, listening.stdout
    rc, stderr, entry = epilog(host, runner, tmp_path, "958", gpus="0", **FAST)
    assert rc != 0 and not entry["ok"], (stderr, entry)
    assert re.match(rf"GPU 0: \d+ MiB, held by pid {left.pid} python3 \(a process of uid {USER} started outside any job; its server says it is "
                    r"asleep: vLLM's sleep mode keeps its CUDA context\)$", entry["causes"][0]), entry
    assert host.alive(left.pid) and not no_reset_words(stderr + str(entry)), entry
