"""GPUs that share the host's memory (issue 70, unified memory: GB10 / DGX Spark, Jetson-class), through
the real modules (ansible-playbook on a namespace host) and the packed Slurm hook as slurmd runs it.

The simulated GB10 (preset `gb10`, tests/sim/README.md "Node shapes") answers `[N/A]` for memory.total,
memory.used and memory.free, as the public reports show the hardware, while --query-compute-apps lists each
process's used_memory. The proof there is "no compute process on the GPU and at least
min_host_available_mib of the host's MemAvailable": the host's real /proc/meminfo (a namespace host shares
this machine's), so the tests choose a least that this machine always has (64 MiB) or never has (1 PiB).
"""
import pytest

from ansible_in_ns import run_module
from test_slurm_epilog_smoke import epilog
# runner: the packed hook, a fixture of that module.
from test_slurm_epilog_smoke import runner  # noqa: F401  # pylint: disable=unused-import

USER = 4242
ALWAYS = 64  # MiB of MemAvailable any machine running the suite has
NEVER = 1 << 30  # MiB (1 PiB): no machine has it


@pytest.fixture(scope="module")
def gb10(module_nshost):
    return module_nshost("gb10", seed="sparknode")


def no_reset_advice(text):
    return "--gpu-reset" not in text and "reboot" not in text and "reset or a reboot is needed" not in text and "leak" not in text


def test_the_gb10_rig_reads_na_memory_and_lists_per_process_used_memory(gb10):
    """The rig itself, as the public reports show the hardware."""
    assert gb10.smi("--query-gpu=memory.total,memory.used,memory.free", "--format=csv,noheader").stdout.strip() == "[N/A], [N/A], [N/A]"
    holder = gb10.spawn_as(USER, ["gpu_holder", "--gpus", "0", "--mib", "2048"])
    try:
        rows = gb10.smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits").stdout
        assert f"{holder.pid}, 2048" in rows, rows
    finally:
        holder.kill()


def test_an_idle_gb10_is_free_by_the_unified_memory_proof_and_says_so(gb10):
    facts = run_module(gb10, "gpu_facts", {"min_host_available_mib": ALWAYS})["ansible_facts"]["gpu"]
    gpu = facts["gpus"][0]
    assert facts["clean"] is True and gpu["clean"] is True, facts
    assert gpu["memory_proof"] == "unified memory" and gpu["memory_used_mib"] == 0, gpu
    assert isinstance(gpu["host_memory_available_mib"], int) and gpu["host_memory_available_mib"] >= ALWAYS, gpu
    assert gpu["memory_total_mib"] is None and gpu["memory_free_mib"] is None  # never invented


def test_too_little_host_memory_available_is_never_free_and_gets_no_reset_advice(gb10):
    facts = run_module(gb10, "gpu_facts", {"min_host_available_mib": NEVER})["ansible_facts"]["gpu"]
    assert facts["clean"] is False and facts["gpus"][0]["clean"] is False, facts
    run = run_module(gb10, "gpu_release", {"min_host_available_mib": NEVER, "wait_timeout": 3})
    msg = run["msg"]
    assert run.get("failed") and "and no compute process is on it: the GPU shares the host's memory (unified memory" in msg, msg
    assert f"so it is free when the host has at least {NEVER} MiB of MemAvailable (min_host_available_mib), and it has " in msg, msg
    assert no_reset_advice(msg.replace("a GPU reset frees no host memory", "")), msg
    assert not run.get("changed")


def test_gpu_release_ends_a_users_compute_process_then_proves_the_gb10_free(gb10):
    holder = gb10.spawn_as(USER, ["gpu_holder", "--gpus", "0", "--mib", "4096"])
    try:
        before = run_module(gb10, "gpu_facts", {"min_host_available_mib": ALWAYS})["ansible_facts"]["gpu"]
        assert before["clean"] is False and before["gpus"][0]["memory_used_mib"] == 4096, before  # the process's used_memory
        run = run_module(gb10, "gpu_release", {"min_host_available_mib": ALWAYS})
        assert not run.get("failed") and run["released"] is True and {k["pid"] for k in run["killed"]} == {holder.pid}, run.result
        after = [g for g in run["gpus"] if g["index"] == 0][0]
        assert after["memory_proof"] == "unified memory" and after["memory_used_mib"] == 0, after
    finally:
        holder.kill()


def test_the_slurm_epilog_names_the_unified_memory_proof_that_failed(gb10, runner, tmp_path):  # noqa: F811
    rc, stderr, entry = epilog(gb10, runner, tmp_path, "901", gpus="0", min_host_available_mib=NEVER)
    assert rc != 0 and not entry["ok"], (stderr, entry)
    assert len(entry["causes"]) == 1 and entry["causes"][0].startswith(
        "GPU 0: unified memory, no compute process, "), entry
    assert entry["causes"][0].endswith("MiB of host memory available: below min_host_available_mib (no reset frees host memory)"), entry
    assert no_reset_advice(stderr + str(entry).replace("no reset frees host memory", "")), entry


def test_the_slurm_epilog_passes_an_idle_gb10(gb10, runner, tmp_path):  # noqa: F811
    rc, stderr, entry = epilog(gb10, runner, tmp_path, "902", gpus="0", min_host_available_mib=ALWAYS)
    assert rc == 0 and entry["ok"], (stderr, entry)


def test_a_plain_node_keeps_the_memory_used_proof(nshost):
    host = nshost("h200x1", seed="plainnode")
    gpu = run_module(host, "gpu_facts", {})["ansible_facts"]["gpu"]["gpus"][0]
    assert gpu["memory_proof"] == "memory.used" and gpu["host_memory_available_mib"] is None, gpu
