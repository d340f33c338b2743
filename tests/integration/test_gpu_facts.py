"""gpu_facts through real ansible-playbook on simulated GPU hosts (private namespaces, real
processes holding real device nodes, the simulated driver)."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def start_daemon(host, name="nvidia-persistenced"):
    """A process posing as a GPU daemon that holds every /dev/nvidia* node, no memory."""
    ready = os.path.join(host.dir, f"daemon-{name}-{time.monotonic():f}")
    host.spawn(["/usr/bin/python3", os.path.join(HERE, "fake_daemon.py"), name, ready], ready=False)
    deadline = time.monotonic() + 15
    while not os.path.exists(ready):
        assert time.monotonic() < deadline, "fake daemon did not start"
        time.sleep(0.01)
    return int(open(ready).read())


def by_pid(records, pid):
    [record] = [r for r in records if r["pid"] == pid]
    return record


def facts(run):
    assert not run.failed, run.msg
    return run["ansible_facts"]["gpu"]


def test_idle_8_gpu_node_reads_clean_and_maps_minor_numbers(nshost):
    host = nshost("h200x8", minors=[1, 0, 2, 3, 4, 5, 6, 7])
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["count"] == 8 and gpu["clean"] is True and gpu["memory_used_mib"] == 0
    assert gpu["driver_version"] == "580.159.04" and gpu["error"] is None
    assert [g["minor_number"] for g in gpu["gpus"]] == [1, 0, 2, 3, 4, 5, 6, 7]
    # /dev/nvidia0 is GPU 1: Slurm's File=/dev/nvidia[0-7] numbers the GPUs otherwise than nvidia-smi (issue 69).
    assert gpu["minor_order_differs"] is True
    first = gpu["gpus"][0]
    assert first["memory_total_mib"] == 143771 and first["memory_reserved_mib"] == 616 and first["name"] == "NVIDIA H200"
    assert isinstance(first["power_draw_w"], float) and first["mig_mode"] == "Disabled"
    assert gpu["holders"] == [] and gpu["processes"] == []
    assert not any(g["cross_gpu_footprint"] for g in gpu["gpus"])


def test_holder_on_gpu0_is_found_through_its_minor_node(nshost):
    # GPU index 0 is /dev/nvidia1 on this host: a tool that assumed minor == index would
    # blame GPU 1.
    host = nshost("h200x8", minors=[1, 0, 2, 3, 4, 5, 6, 7])
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960"])
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["clean"] is False
    assert gpu["gpus"][0]["memory_used_mib"] == 40960 + 9 and gpu["gpus"][0]["clean"] is False
    # the other seven read the cross-GPU footprint of the context on GPU 0: clean, and said so
    assert all(g["clean"] and g["cross_gpu_footprint"] and g["memory_used_mib"] == 4 for g in gpu["gpus"][1:])
    [record] = [h for h in gpu["holders"] if h["pid"] == holder.pid]
    # it has every GPU's node open (a real CUDA process does), but nvidia-smi lists it on GPU 0 only
    assert record["gpu_indexes"] == [0] and record["attribution"] == "listed"
    assert "/dev/nvidia1" in record["devices"] and "/dev/nvidia0" in record["devices"] and "/dev/nvidiactl" in record["devices"]
    assert record["protected"] is False and record["state"] in ("S", "R") and record["start_time"] > 0
    assert record["user"] == "root" and "gpu_holder" in record["cmdline"]
    [app] = [a for a in gpu["processes"] if a["pid"] == holder.pid]
    assert app["gpu_index"] == 0 and app["used_memory_mib"] == 40960 and app["alive"] is True


def test_orphaned_fork_child_keeps_memory_behind_a_not_found_owner(nshost):
    host = nshost("h200x1")
    parent = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960", "--fork-child"])
    [child] = parent.children
    host.kill(parent.pid)
    assert host.wait_gone(parent.pid)
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["clean"] is False and gpu["memory_used_mib"] >= 40960
    [app] = gpu["processes"]
    assert app["pid"] == parent.pid and app["name"] in ("[Not Found]", "[No data]") and app["alive"] is False
    [orphan] = [h for h in gpu["holders"] if h["pid"] == child]
    assert orphan["gpu_indexes"] == [0] and orphan["ppid"] == 1 and orphan["attribution"] == "mapped"


def test_persistenced_holding_every_node_does_not_make_the_host_dirty(nshost):
    host = nshost("h200x8")
    daemon = start_daemon(host, "nvidia-persistenced")
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["minor_order_differs"] is False  # minor numbers in nvidia-smi's order
    [record] = [h for h in gpu["holders"] if h["pid"] == daemon]
    # The kernel truncates comm to 15 characters; argv[0] still carries the full name.
    assert record["name"] == "nvidia-persiste" and record["protected"] is True
    # It has every GPU's node open but maps none: an NVML client, which uses no GPU.
    assert sum(1 for d in record["devices"] if d[len("/dev/nvidia"):].isdigit()) == 8
    assert record["gpu_indexes"] == [] and record["attribution"] == "nvml_client"
    assert gpu["clean"] is True


def test_user_protected_name_keeps_a_holder_out_of_the_verdict(nshost):
    # An agent with a (tiny) context of its own uses the GPU: dirty until `protect` names it.
    # (A process with device files and no mapping is an NVML client and never dirty anyway.)
    host = nshost("h200x1")
    agent = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "0", "--name", "my-gpu-agent"])
    gpu = facts(run_module(host, "gpu_facts", {"max_used_mib": 16}))
    record = by_pid(gpu["holders"], agent.pid)
    assert record["attribution"] == "listed" and record["gpu_indexes"] == [0] and record["protected"] is False
    assert gpu["gpus"][0]["clean"] is True and gpu["clean"] is False
    gpu = facts(run_module(host, "gpu_facts", {"max_used_mib": 16, "protect": ["my-gpu-agent"]}))
    assert by_pid(gpu["holders"], agent.pid)["protected"] is True and gpu["clean"] is True


def test_fake_daemon_with_device_files_only_is_an_nvml_client_never_dirty(nshost):
    host = nshost("h200x1")
    daemon = start_daemon(host, "my-gpu-agent")
    gpu = facts(run_module(host, "gpu_facts"))
    record = by_pid(gpu["holders"], daemon)
    assert record["attribution"] == "nvml_client" and record["protected"] is False and gpu["clean"] is True


def test_control_node_only_client_is_listed_but_not_dirty(nshost):
    host = nshost("h200x1")
    client = host.spawn(["gpu_holder", "--control-only"])
    gpu = facts(run_module(host, "gpu_facts"))
    [record] = [h for h in gpu["holders"] if h["pid"] == client.pid]
    assert record["gpu_indexes"] == [] and record["attribution"] == "nvml_client" and gpu["clean"] is True


def test_map_only_holder_is_found_through_proc_maps(nshost):
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024", "--map-only"])
    gpu = facts(run_module(host, "gpu_facts"))
    assert [(h["gpu_indexes"], h["attribution"]) for h in gpu["holders"] if h["pid"] == holder.pid] == [([0], "listed")]


def test_mig_node_idles_at_55_mib_and_needs_a_baseline(nshost):
    host = nshost("a100-mig")
    assert facts(run_module(host, "gpu_facts"))["clean"] is False
    gpu = facts(run_module(host, "gpu_facts", {"max_used_mib": 64}))
    assert gpu["clean"] is True and all(g["memory_used_mib"] == 55 and g["mig_mode"] == "Enabled" for g in gpu["gpus"])


def test_processes_false_decides_by_memory_alone(nshost):
    host = nshost("h200x1")
    host.spawn(["gpu_holder", "--control-only"])
    gpu = facts(run_module(host, "gpu_facts", {"processes": False}))
    assert gpu["clean"] is True and gpu["holders"] == [] and gpu["processes"] == []


def test_leaked_memory_without_holder_is_dirty(nshost):
    host = nshost("h200x8")
    host.set_fault(leak={"3": 2048})
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["clean"] is False and gpu["gpus"][3]["memory_used_mib"] == 2048 and gpu["holders"] == []


def test_memory_not_available_is_never_clean(nshost):
    # WDDM rows and broken drivers print [N/A] / [Unknown Error] where memory should be.
    host = nshost("h200x1")
    host.set_fault(field_values={"memory.used": "[Unknown Error]"})
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["gpus"][0]["memory_used_mib"] is None and gpu["gpus"][0]["clean"] is False
    assert gpu["memory_used_mib"] is None and gpu["clean"] is False


def test_check_mode_reads_the_same(nshost):
    host = nshost("h200x1")
    run = run_module(host, "gpu_facts", check=True)
    assert facts(run)["count"] == 1 and run["changed"] is False


def test_hung_nvidia_smi_fails_within_timeout(nshost):
    host = nshost("h200x1")
    host.set_fault(hang=True)
    started = time.monotonic()
    run = run_module(host, "gpu_facts", {"timeout": 2})
    assert run.failed and "timed out after 2 s" in run.msg
    # The module returns within its timeout plus the kill; the rest is Ansible's start-up.
    assert time.monotonic() - started < 2 + 20
    report = facts(run_module(host, "gpu_facts", {"timeout": 1, "fail_on_error": False}))
    assert report["clean"] is False and report["count"] == 0 and "timed out" in report["error"]
    assert report["memory_used_mib"] is None and report["gpus"] == []


@pytest.mark.parametrize(
    "fault, words",
    [
        ({"no_devices": True}, "found no GPU (rc 6)"),
        ({"driver_not_loaded": True}, "driver is not loaded (nvidia-smi rc 9)"),
        ({"gpu_lost": [0]}, "fallen off the bus (nvidia-smi rc 15)"),
        ({"garbage": True}, "nvidia-smi printed"),
    ],
    ids=["rc6-no-devices", "rc9-driver-not-loaded", "rc15-gpu-lost", "unparseable-output"],
)
def test_broken_driver_is_a_clear_failure_never_clean(nshost, fault, words):
    host = nshost("h200x1")
    host.set_fault(fault)
    run = run_module(host, "gpu_facts")
    assert run.failed and words in run.msg, run.msg
    report = facts(run_module(host, "gpu_facts", {"fail_on_error": False}))
    assert report["clean"] is False and words in report["error"]


def test_a_driver_upgraded_under_its_loaded_module_is_said_as_such_by_facts_and_release(nshost):
    """Driver/library version mismatch: its own first sentence (what happened, running jobs go on,
    new ones fail until a reboot or a reload), with both versions, from gpu_facts and gpu_release."""
    host = nshost("h200x1")
    loaded = host.config["driver_version"]
    host.set_fault({"library_mismatch": "580.178"})
    first = (f"the NVIDIA driver was upgraded under its loaded kernel module (Driver/library version mismatch: kernel module {loaded}, "
             "library 580.178): jobs already running are unaffected, but new CUDA jobs and nvidia-smi fail until the node is rebooted")
    run = run_module(host, "gpu_facts")
    assert run.failed and run.msg.startswith(first), run.msg
    report = facts(run_module(host, "gpu_facts", {"fail_on_error": False}))
    assert report["clean"] is False and report["error"].startswith(first)
    # The module's own version file answers although nvidia-smi does not; no library on this disk.
    assert report["driver"] == {"loaded": loaded, "library": None, "library_path": None, "mismatch": False}
    release = run_module(host, "gpu_release")
    assert release.failed and release.msg.startswith(first), release.msg
    # The role says it first, once, in its host's line.
    from test_gpu_health_gate import run_role
    outcome = run_role(host, {})
    assert outcome["failed"] and outcome["msg"].startswith("localhost: " + first) and outcome["msg"].count("Driver/library") == 1, outcome["msg"]
    # The audit: a host in error, its reason the same first sentence.
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _audit_report as gpu_audit_report
    [entry] = gpu_audit_report.build_report([{"host": "node01", "status": "ok", "error": None, "gpu": report}], generated_at=0.0)["hosts"]
    assert entry["status"] == "error" and entry["reason"].startswith(first), entry


def test_a_driver_package_upgraded_on_disk_is_drift_for_facts_and_the_audit_before_nvidia_smi_breaks(nshost):
    """The library on disk (the GPU Operator's driver root, here under the host's own /run) is newer
    than the loaded module: nvidia-smi still answers, the audit already says it."""
    host = nshost("h200x1")
    loaded = host.config["driver_version"]
    lib = "/run/nvidia/driver/usr/lib64"
    done = host.run(["sh", "-c", f"mkdir -p {lib} && : > {lib}/libnvidia-ml.so.580.178.04 && ln -s libnvidia-ml.so.580.178.04 {lib}/libnvidia-ml.so.1"])
    assert done.returncode == 0, done.stderr
    report = facts(run_module(host, "gpu_facts"))
    assert report["clean"] is True and report["error"] is None
    assert report["driver"] == {"loaded": loaded, "library": "580.178.04", "library_path": f"{lib}/libnvidia-ml.so.580.178.04", "mismatch": True}
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _audit_report as gpu_audit_report
    built = gpu_audit_report.build_report([{"host": "node01", "status": "ok", "error": None, "gpu": report}], generated_at=0.0)
    [entry] = built["hosts"]
    assert entry["status"] == "clean" and entry["driver_drift"].startswith(
        f"driver upgraded under the loaded module (kernel module {loaded}, library 580.178.04): new CUDA jobs fail"), entry["driver_drift"]
    assert built["summary"]["hosts_driver_drift"] == 1


def test_missing_nvidia_smi_is_named(nshost):
    host = nshost("h200x1")
    run = run_module(host, "gpu_facts", {"nvidia_smi": "/opt/nowhere/nvidia-smi"})
    assert run.failed and "not found or not executable at /opt/nowhere/nvidia-smi" in run.msg
