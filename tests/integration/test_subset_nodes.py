"""Nodes that see a subset of the GPUs (issue 37): a container given GPU 3 of 8 is not "missing" seven.

The driver's /proc/driver/nvidia/gpus is not namespaced: in an LXC container, a Slurm step with a
device cgroup or `docker --device /dev/nvidia3` it lists every GPU of the machine, while nvidia-smi
lists only those whose device node the namespace can open (real H200, driver 580.159.04: without
/dev/nvidia0, "No devices were found" rc 6 while the driver's list still has 0000:00:06.0; the
simulator reproduces it, tests/sim/README.md). Here the container is an NsHost with
`gpu_nodes=[3]`: the machine's eight GPUs in a bind-mounted copy of the driver's list, one device
node. Everything runs through real ansible-playbook inside it: gpu_facts, gpu_release, the
free_gpus playbook and the audit. A GPU whose node the namespace reaches and that nvidia-smi leaves
out stays an error; a node that is no device, or that a device cgroup denies, is not visible.
"""
import json
import os
import time

from ansible_in_ns import REPO, VENV_BIN, playbook_env, run_module

# h200x8's buses (tests/sim/make_config.py HGX_BUSES), in the driver's spelling, by minor.
BUSES = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]
OTHERS = [bus for minor, bus in enumerate(BUSES) if minor != 3]
ENV = playbook_env()


def container(nshost, nodes=(3,), seed="lxc101"):
    return nshost("h200x8", gpu_nodes=list(nodes), seed=seed)


def uuid_of(host, minor):
    return [g["uuid"] for g in host.config["gpus"] if g["minor"] == minor][0]


def smi_rows(host):
    return host.smi("--query-gpu=index,pci.bus_id,memory.used", "--format=csv,noheader,nounits").stdout.splitlines()


def driver_list(host):
    return sorted(os.listdir(f"{host.root.inside}/proc/driver/nvidia/gpus"))


def holder(host, minor, mib=4096):
    # By UUID: the simulator's gpu_holder numbers GPUs as the config does (tests/sim/README.md).
    return host.spawn(["gpu_holder", "--gpus", uuid_of(host, minor), "--mib", str(mib)])


def playbook(host, name, extra, timeout=240):
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", os.path.join(REPO, "playbooks", name),
           "-e", "ansible_python_interpreter=/usr/bin/python3", "-e", "free_gpus_hosts=localhost", "-e", json.dumps(extra)]
    return host.run(cmd, env=ENV, timeout=timeout)


def test_container_given_one_of_eight_gpus_sees_it_and_lists_the_other_seven_as_not_visible(nshost):
    host = container(nshost)
    job = holder(host, 3)
    assert driver_list(host) == BUSES  # the machine's driver list, bind-mounted
    assert os.path.exists(f"{host.root.inside}/dev/nvidia3") and not os.path.exists(f"{host.root.inside}/dev/nvidia0")
    assert [row.split(", ")[:2] for row in smi_rows(host)] == [["0", "00000000:5D:00.0"]]  # NVML: the one GPU, as index 0

    facts = run_module(host, "gpu_facts")
    assert not facts.failed, facts.msg
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["error"] is None and gpu["count"] == 1 and gpu["not_visible"] == OTHERS
    [only] = gpu["gpus"]
    assert (only["index"], only["minor_number"], only["pci_bus_id"]) == (0, 3, "00000000:5D:00.0")
    [found] = [h for h in gpu["holders"] if h["pid"] == job.pid]
    assert found["gpu_indexes"] == [0] and "/dev/nvidia3" in found["devices"]
    assert gpu["clean"] is False and only["memory_used_mib"] >= 4096  # the one GPU is judged; the seven are not this node's

    job.kill()
    assert job.wait_gone(5)
    deadline = time.monotonic() + 5
    while smi_rows(host) != ["0, 00000000:5D:00.0, 0"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the driver frees a dead context's memory a little after the exit
    again = run_module(host, "gpu_facts")["ansible_facts"]["gpu"]
    assert again["clean"] is True and again["not_visible"] == OTHERS  # clean: its one GPU; never "clean" for the seven


def test_gpu_release_frees_and_proves_the_one_gpu_and_lists_the_seven(nshost):
    host = container(nshost)
    job = holder(host, 3)
    run = run_module(host, "gpu_release", {"wait_timeout": 10, "kill_timeout": 2})
    assert not run.failed, run.msg
    assert run["released"] is True and run["selected_gpus"] == [0] and run["not_visible"] == OTHERS
    assert [k["pid"] for k in run["killed"]] == [job.pid] and not host.alive(job.pid)
    assert [(g["index"], g["minor_number"], g["memory_used_mib"]) for g in run["gpus"]] == [(0, 3, 0)]
    assert smi_rows(host) == ["0, 00000000:5D:00.0, 0"]


def test_gpus_naming_a_gpu_not_visible_here_is_a_clear_error_and_nothing_is_done(nshost):
    host = container(nshost)
    job = holder(host, 3)
    for given, words in (("3", ["GPU 3 is not visible on this node:", "indexes 0", "numbered from 0", BUSES[0]]),
                         (uuid_of(host, 1), [f"GPU {uuid_of(host, 1)} is not visible on this node:", BUSES[1], "/dev/nvidia1"]),
                         (BUSES[5], [f"GPU {BUSES[5]} is not visible on this node:", "/dev/nvidia5", uuid_of(host, 5)])):
        run = run_module(host, "gpu_release", {"gpus": [given]})
        assert run.failed and run.msg.startswith(words[0]), run.msg
        assert all(word in run.msg for word in words), (words, run.msg)
        assert run.get("killed", []) == [] and host.alive(job.pid)
    # Its own GPU, as nvidia-smi numbers it there, is freed.
    run = run_module(host, "gpu_release", {"gpus": ["0"]})
    assert not run.failed and run["released"] is True and not host.alive(job.pid)


def test_free_gpus_playbook_frees_the_container_and_passes_its_gate(nshost):
    host = container(nshost)
    job = holder(host, 3)
    proc = playbook(host, "free_gpus.yml", {"ansible_become": False, "free_gpus_expected_count": 1, "free_gpus_wait_timeout": 10,
                                            "free_gpus_kill_timeout": 2})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert not host.alive(job.pid) and smi_rows(host) == ["0, 00000000:5D:00.0, 0"]
    assert "failed=0" in proc.stdout


def test_the_audit_lists_the_gpus_not_visible_on_the_container(nshost):
    host = container(nshost)
    out = os.path.join(host.dir, "audit")
    proc = playbook(host, "audit_gpus.yml", {"gpu_audit_report_dir": out})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    with open(os.path.join(out, "report.json")) as handle:
        report = json.load(handle)
    [record] = report["hosts"]
    assert record["status"] == "clean" and record["gpu_count"] == 1 and record["not_visible"] == OTHERS
    assert report["findings"]["not_visible"] == [{"host": "localhost", "gpu_count": 1, "not_visible": OTHERS}]
    with open(os.path.join(out, "report.md")) as handle:
        markdown = handle.read()
    assert "## GPUs a host's driver lists but it cannot see" in markdown
    assert "| localhost | 1 | {} |".format(", ".join(OTHERS)) in markdown
    with open(os.path.join(out, "report.html")) as handle:
        assert 'id="not-visible"' in handle.read()


def test_a_reachable_gpu_nvidia_smi_leaves_out_stays_an_error_beside_the_not_visible_ones(nshost):
    """A container given GPUs 2 and 3: nvidia-smi omits its second GPU (rc 0, one row fewer) while the
    namespace can open /dev/nvidia3. That GPU is never not_visible, never clean: the look fails."""
    host = container(nshost, nodes=(2, 3), seed="lxc102")
    job = holder(host, 3)
    host.set_fault(omit_gpus=[1])
    assert [row.split(", ")[1] for row in smi_rows(host)] == ["00000000:3A:00.0"]

    facts = run_module(host, "gpu_facts", {"fail_on_error": False})
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["clean"] is False and BUSES[3] in gpu["error"] and "6 of them not visible" in gpu["error"], gpu["error"]
    assert run_module(host, "gpu_facts").failed
    run = run_module(host, "gpu_release", {"gpus": ["0"]})
    assert run.failed and run.get("released") is not True and BUSES[3] in run.msg
    assert host.alive(job.pid)


def test_every_node_present_and_one_gpu_left_out_by_nvidia_smi_is_an_error(nshost):
    host = nshost("h200x8", seed="node37")
    host.set_fault(omit_gpus=[5])
    facts = run_module(host, "gpu_facts", {"fail_on_error": False})
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["clean"] is False and BUSES[5] in gpu["error"] and "not visible" not in gpu["error"], gpu["error"]
    run = run_module(host, "gpu_release")
    assert run.failed and BUSES[5] in run.msg and run.get("released") is not True


def test_a_node_that_is_no_device_is_not_visible(nshost):
    """/dev/nvidia5 is a bind mount of a regular file: no driver device, NVML cannot use it."""
    host = nshost("h200x8", seed="node38")
    host.run(["sh", "-c", "echo not-a-gpu > /run/not-a-gpu && mount --bind /run/not-a-gpu /dev/nvidia5"], check=True)
    assert len(smi_rows(host)) == 7

    facts = run_module(host, "gpu_facts")
    assert not facts.failed, facts.msg
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["not_visible"] == [BUSES[5]] and gpu["count"] == 7 and gpu["clean"] is True
    assert sorted(g["minor_number"] for g in gpu["gpus"]) == [0, 1, 2, 3, 4, 6, 7]


def test_a_node_the_device_cgroup_denies_is_not_visible(nshost):
    """A Slurm step or a container's device cgroup: /dev/nvidia5 (here char 1:7, a node of its own)
    may not be opened by the module's process tree (cgroup v1 devices.deny, as a v2 eBPF program
    would answer it: EPERM at open). Outside that cgroup the same node is a GPU like the others."""
    host = nshost("h200x8", seed="node39")
    host.run(["sh", "-c", "rm /dev/nvidia5 && mknod -m 666 /dev/nvidia5 c 1 7"], check=True)
    # Restricted to GPU 3, the job opens the other nodes without mapping them (/dev/full maps nothing).
    job = host.spawn(["gpu_holder", "--gpus", uuid_of(host, 3), "--mib", "4096"], env={"CUDA_VISIBLE_DEVICES": uuid_of(host, 3)})
    free = run_module(host, "gpu_facts")["ansible_facts"]["gpu"]
    assert free["count"] == 8 and free["not_visible"] == [] and free["error"] is None

    cgroup = f"/sys/fs/cgroup/devices/zeromib-issue37-{os.getpid()}-{host.init_pid}"
    os.mkdir(cgroup)
    try:
        with open(os.path.join(cgroup, "devices.deny"), "w") as handle:
            handle.write("c 1:7 rwm\n")
        enter = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]
        denied = host.run(enter + ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]).stdout.split()
        assert len(denied) == 7
        facts = run_module(host, "gpu_facts", argv_prefix=enter)
        assert not facts.failed, facts.msg
        gpu = facts["ansible_facts"]["gpu"]
        assert gpu["not_visible"] == [BUSES[5]] and gpu["count"] == 7 and gpu["error"] is None
        run = run_module(host, "gpu_release", argv_prefix=enter)
        assert not run.failed, run.msg
        assert run["released"] is True and run["not_visible"] == [BUSES[5]] and not host.alive(job.pid)
    finally:
        os.rmdir(cgroup)
