"""Slurm's GPU numbers are not nvidia-smi's (issue 69): the hooks map SLURM_JOB_GPUS (slurmd's GRES
indexes) through the list slurmd built, on a simulated node whose device minor numbers are permuted
against nvidia-smi's PCI bus order (tests/sim: `NsHost(minors=...)`, consistent in
/proc/driver/nvidia/gpus/*/information and `nvidia-smi -q`), as PrincetonUniversity/jobstats #34
reports for some AMD hosts: /dev/nvidia0 is nvidia-smi's GPU 6.

Each scene: job 901 ended and left a process on the GPU behind /dev/nvidia0 (its GRES index 0 with
`File=/dev/nvidia[0-7]`); job 902 still runs on nvidia-smi's GPU 0. The epilog of job 901, given
SLURM_JOB_GPUS=0 as slurmd gives it, must free the GPU behind /dev/nvidia0 and leave job 902 alone.
Before issue 69 it looked at nvidia-smi's GPU 0: job 902's memory failed it (the node drained) and
the leftover stayed on GPU 6, unseen.
"""
import json

import pytest

from test_gpu_release import used
# runner: the packed hook, a fixture of that module.
from test_slurm_epilog_smoke import gres_conf, runner, task_cgroup, wait_used  # noqa: F401  # pylint: disable=unused-import

# nvidia-smi's GPU 6 has minor number 0 (/dev/nvidia0), GPU 0 minor number 1.
MINORS = [1, 2, 3, 4, 5, 6, 0, 7]
BEHIND_NVIDIA0 = MINORS.index(0)
FILES = "Name=gpu File=/dev/nvidia[0-7]\n"
USER = 4242


def hook(host, runner, tmp_path, mode, job, env):  # noqa: F811 (the fixture's value)
    """The hook as slurmd calls it (slurmd's SLURM_CONF, SLURMD_NODENAME) -> (rc, stderr, log entry)."""
    config, log = tmp_path / f"config-{job}.json", tmp_path / f"log-{job}.jsonl"
    config.write_text(json.dumps({"drain": "exit_status", "log": str(log)}))
    config.chmod(0o600)
    env = dict({"SLURM_JOB_ID": job, "SLURM_SCRIPT_CONTEXT": f"{mode}_slurmd", "SLURM_CONF": "/etc/slurm/slurm.conf",
                "SLURMD_NODENAME": host.seed, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, **env)
    proc = host.run(["/usr/bin/python3", runner, mode, f"--config={config}"], env=env, timeout=120)
    return proc.returncode, proc.stderr, json.loads(log.read_text().splitlines()[-1])


def scene(host, leftover_on=BEHIND_NVIDIA0, other_on=0):
    """Job 901's leftover (root's, in its task cgroup) on nvidia-smi's GPU `leftover_on`; job 902's
    running process on GPU `other_on`."""
    left = host.spawn(["gpu_holder", "--gpus", str(leftover_on), "--mib", "4096"])
    host.move_to_cgroup(left.pid, task_cgroup(host, 901))
    other = host.spawn_as(USER, ["gpu_holder", "--gpus", str(other_on), "--mib", "2048"])
    host.move_to_cgroup(other.pid, task_cgroup(host, 902))
    wait_used(host, leftover_on, 4096)
    wait_used(host, other_on, 2048)
    return left, other


def uuid(host, index):
    return host.config["gpus"][index]["uuid"]


def assert_freed_behind_nvidia0(host, entry, left, other, rc, stderr):
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), (stderr, entry)
    assert [k["pid"] for k in entry["killed"]] == [left.pid] and not host.alive(left.pid)
    assert host.alive(other.pid) and used(host, 0) >= 2048 and used(host, BEHIND_NVIDIA0) < 64  # other contexts' footprint only


def test_the_minor_numbers_of_the_rig_are_not_nvidia_smis_order(nshost):
    """The rig itself: the driver's information file and `nvidia-smi -q` agree that /dev/nvidia0 is GPU 6."""
    host = nshost("h200x8", minors=MINORS, seed="gresrig")
    q = [line.split(":")[1].strip() for line in host.smi("-q", "-i", str(BEHIND_NVIDIA0)).stdout.splitlines() if "Minor Number" in line]
    bus = host.config["gpus"][BEHIND_NVIDIA0]["pci_bus_id"].lower()[-12:]
    info = host.read(f"/proc/driver/nvidia/gpus/{bus}/information")
    assert q == ["0"] and "Device Minor: \t 0\n" in info


def test_the_epilog_of_gres_index_0_frees_the_gpu_behind_dev_nvidia0_and_leaves_nvidia_smis_gpu_0_to_its_job(nshost, runner, tmp_path):  # noqa: F811
    host = nshost("h200x8", minors=MINORS, seed="gresfiles")
    gres_conf(host, FILES)
    left, other = scene(host)
    rc, stderr, entry = hook(host, runner, tmp_path, "epilog", "901", {"SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"})
    assert_freed_behind_nvidia0(host, entry, left, other, rc, stderr)
    assert entry["gres"] == {"mapped": {"0": f"{uuid(host, BEHIND_NVIDIA0)} (/dev/nvidia0)"}}


def test_the_prolog_of_gres_index_0_reports_what_holds_the_gpu_behind_dev_nvidia0(nshost, runner, tmp_path):  # noqa: F811
    """The prolog looks at the same GPU: a leftover there fails it (and is only reported), job 902's GPU 0 is not its business."""
    host = nshost("h200x8", minors=MINORS, seed="gresprolog")
    gres_conf(host, FILES)
    left, other = scene(host)
    rc, stderr, entry = hook(host, runner, tmp_path, "prolog", "903", {"SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"})
    assert (rc, entry["ok"]) == (1, False), (stderr, entry)
    [cause] = entry["causes"]
    assert cause.startswith(f"GPU {BEHIND_NVIDIA0}: ") and f"held by pid {left.pid} " in cause and "(Slurm job 901)" in cause, cause
    assert host.alive(left.pid) and host.alive(other.pid)


def test_uuids_in_cuda_visible_devices_name_the_gpu_whatever_slurm_job_gpus_says(nshost, runner, tmp_path):  # noqa: F811
    """Slurm 25.11 (AutoDetect=nvml) gives the hooks the GPUs' UUIDs in CUDA_VISIBLE_DEVICES beside
    its GRES indexes in SLURM_JOB_GPUS (SlinkyProject slurm-operator #112): the UUID decides, and no
    gres.conf is needed to read it."""
    host = nshost("h200x8", minors=MINORS, seed="gresuuid")
    left, other = scene(host)
    rc, stderr, entry = hook(host, runner, tmp_path, "epilog", "901",
                             {"SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": uuid(host, BEHIND_NVIDIA0)})
    assert_freed_behind_nvidia0(host, entry, left, other, rc, stderr)
    assert "gres" not in entry and entry["gpus"] == [uuid(host, BEHIND_NVIDIA0)]


def test_with_autodetect_nvml_gres_index_0_is_nvmls_first_gpu(nshost, runner, tmp_path):  # noqa: F811
    """AutoDetect=nvml: slurmd sorts its GPUs in NVML's order (gres_gpu.c _sort_gpu_by_links_order),
    nvidia-smi's: GRES index 0 is nvidia-smi's GPU 0 here, whatever its minor number."""
    host = nshost("h200x8", minors=MINORS, seed="gresnvml")
    gres_conf(host, "AutoDetect=nvml\n")
    left, other = scene(host, leftover_on=0, other_on=BEHIND_NVIDIA0)
    rc, stderr, entry = hook(host, runner, tmp_path, "epilog", "901", {"SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"})
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), (stderr, entry)
    assert [k["pid"] for k in entry["killed"]] == [left.pid] and host.alive(other.pid) and used(host, 0) < 64
    assert entry["gres"] == {"mapped": {"0": f"{uuid(host, 0)} (/dev/nvidia{MINORS[0]})"}}


@pytest.mark.parametrize("owner, mode", [(USER, 0o644), (0, 0o664), (0, 0o646)], ids=["a user's", "group-writable", "world-writable"])
def test_a_gres_conf_someone_else_could_write_is_not_trusted_and_every_gpu_is_checked(nshost, runner, tmp_path, owner, mode):  # noqa: F811
    """The attacker: uid 4242 writes gres.conf so that GRES index 0 reads as /dev/nvidia3, a quiet
    GPU, while their job's leftover keeps GPU 6. Not root's alone, it is not read: every GPU is
    checked, other jobs' memory deducted, and the log says why."""
    host = nshost("h200x8", minors=MINORS, seed="gresevil")
    gres_conf(host, "Name=gpu File=/dev/nvidia[3-4]\n", owner=owner, mode=mode)
    left, other = scene(host)
    rc, stderr, entry = hook(host, runner, tmp_path, "epilog", "901", {"SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"})
    assert_freed_behind_nvidia0(host, entry, left, other, rc, stderr)
    said = entry["gres"]["unmapped"]
    assert "/etc/slurm/gres.conf is not a regular file of uid 0 that only its owner can write: not trusted" in said, said
    assert said.endswith("every GPU of the node was checked, other jobs' memory deducted")


def test_without_a_readable_mapping_every_gpu_is_checked_and_the_log_says_why(nshost, runner, tmp_path):  # noqa: F811
    """No gres.conf beside SLURM_CONF: nothing is assumed. The leftover is found on whichever GPU it
    is, job 902's process and memory are its own, and the log says why every GPU was looked at."""
    host = nshost("h200x8", minors=MINORS, seed="gresnone")
    left, other = scene(host)
    rc, stderr, entry = hook(host, runner, tmp_path, "epilog", "901", {"SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"})
    assert_freed_behind_nvidia0(host, entry, left, other, rc, stderr)
    assert entry["gres"]["unmapped"].startswith("cannot read /etc/slurm/gres.conf: No such file or directory; every GPU of the node was checked")
