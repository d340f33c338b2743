"""The fleet rig itself: real systemd hosts with simulated GPUs, as the collection's fleet tests
need them. If these fail, every other fleet test would fail for the wrong reason."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet as rig  # noqa: E402
from scenarios import wait_for  # noqa: E402


def main_pid(fleet, host: str, unit: str) -> int:
    return int(fleet.ssh(host, f"systemctl show -p MainPID --value {unit}", check=True).stdout)


def test_every_host_boots_to_running_with_its_own_hostname(fleet):
    res = fleet.ssh_all("systemctl is-system-running; hostname; systemctl list-units --failed --plain --no-legend")
    for host, r in res.items():
        state, hostname, *failed = r.stdout.split("\n")
        assert (state, hostname) == ("running", host), f"{host}: {r.stdout}{r.stderr}"


def test_nvidia_smi_lists_each_hosts_simulated_gpus_idle(fleet):
    for h in fleet.hosts:
        r = fleet.ssh(h.name, "nvidia-smi -L", check=True)
        assert len(r.stdout.splitlines()) == h.gpu_count, r.stdout
        assert fleet.gpu_memory(h.name) == {i: h.idle_mib for i in range(h.gpu_count)}
    if len(fleet.hosts) >= 3:  # mixed profile: one H100 host, one MIG host at 55 MiB
        assert {h.preset for h in fleet.hosts} >= {"h200x8", "h100x4", "a100-mig"}
        assert [h.idle_mib for h in fleet.hosts if h.preset == "a100-mig"] == [55]


def test_device_nodes_and_proc_driver_give_minor_numbers_apart_from_indexes(fleet):
    for h in fleet.hosts:
        r = fleet.ssh(h.name, "stat -c '%n %F %t:%T' /dev/nvidia[0-9]* /dev/nvidiactl /dev/nvidia-uvm; "
                              "grep -H 'Device Minor' /proc/driver/nvidia/gpus/*/information", check=True)
        for g in h.gpus:
            assert f"/dev/nvidia{g['minor']} character special file 1:5" in r.stdout
            bus = g["pci_bus_id"].lower()[4:]
            assert re.search(rf"gpus/{re.escape(bus)}/information:Device Minor: \t {g['minor']}\n", r.stdout), r.stdout
    mixed_h100 = [h for h in fleet.hosts if h.preset == "h100x4"]
    if mixed_h100:
        assert [g["minor"] for g in mixed_h100[0].gpus] != [g["index"] for g in mixed_h100[0].gpus]


def test_ansible_reaches_every_host_through_the_fixture(fleet):
    res = fleet.ansible("gpu_nodes", "ansible.builtin.command", "nvidia-smi --query-gpu=index --format=csv,noheader")
    assert res.rc == 0, res
    counts = {t["host"]: len(t["result"]["stdout_lines"]) for t in res.results()}
    assert counts == {h.name: h.gpu_count for h in fleet.hosts}

    play = {"hosts": "gpu_nodes", "gather_facts": False,
            "tasks": [{"name": "read hostname", "ansible.builtin.command": "hostname", "changed_when": False}]}
    res = fleet.ansible_playbook(play, limit=fleet.names[0], extra_vars={"unused": [1, 2]})
    assert res.rc == 0, res
    assert res.result("read hostname", fleet.names[0])["stdout"] == fleet.names[0]
    assert res.stats[fleet.names[0]]["failures"] == 0


def test_restart_always_vllm_respawns_after_kill_9(clean_fleet):
    fleet, host = clean_fleet, clean_fleet.names[0]
    started = fleet.workload(host, "vllm")
    assert len(started["workers"]) == fleet.host(host).gpu_count
    assert all(mib >= 40960 for mib in fleet.gpu_memory(host).values())
    first = main_pid(fleet, host, "vllm.service")
    assert first == started["pid"]
    fleet.ssh(host, f"kill -9 {first}", check=True)
    again = wait_for(lambda: main_pid(fleet, host, "vllm.service") not in (0, first), timeout=10)
    assert again, "vllm.service was not restarted within 10 s"
    r = fleet.ssh(host, "cat /proc/$(systemctl show -p MainPID --value vllm.service)/cgroup")
    assert "0::/system.slice/vllm.service" in r.stdout


def test_stray_processes_sit_in_the_login_session_scope(clean_fleet):
    fleet, host = clean_fleet, clean_fleet.names[-1]
    train = fleet.workload(host, "train", gpus="0", mib=1024)
    stubborn = fleet.workload(host, "ignore-term", gpus="0", mib=512)
    orphan = fleet.workload(host, "orphan", gpus="0", mib=256)
    for pid in (train["pid"], stubborn["pid"], orphan["child_pid"]):
        r = fleet.ssh(host, f"grep ^0:: /proc/{pid}/cgroup; ps -o ppid= -p {pid}", check=True)
        assert re.search(r"^0::/user\.slice/user-0\.slice/session-\d+\.scope$", r.stdout, re.M), r.stdout
    assert fleet.ssh(host, f"ps -o ppid= -p {orphan['child_pid']}").stdout.strip() == "1"
    assert fleet.ssh(host, f"test -e /proc/{orphan['parent_pid']}").returncode != 0
    # SIGTERM really is ignored
    fleet.ssh(host, f"kill -TERM {stubborn['pid']}; sleep 0.3", check=True)
    assert fleet.ssh(host, f"test -e /proc/{stubborn['pid']}").returncode == 0
    apps = fleet.ssh(host, "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader",
                     check=True).stdout
    assert f"{train['pid']}, train.py, 1024 MiB" in apps
    assert f"{orphan['parent_pid']}, [Not Found], 256 MiB" in apps or f"{orphan['parent_pid']}, [No data]" in apps


def test_persistenced_holds_every_device_without_memory(clean_fleet):
    fleet, host = clean_fleet, clean_fleet.names[0]
    p = fleet.workload(host, "persistenced")["pid"]
    r = fleet.ssh(host, f"ls -l /proc/{p}/fd | grep -o '/dev/nvidia[^ ]*' | sort; cat /proc/{p}/comm", check=True)
    assert "/dev/nvidiactl" in r.stdout and r.stdout.rstrip().endswith("nvidia-persiste")
    assert set(fleet.gpu_memory(host).values()) == {fleet.host(host).idle_mib}


def test_reboot_brings_back_enabled_units_only(clean_fleet):
    fleet, host = clean_fleet, clean_fleet.names[0]
    fleet.workload(host, "sglang")  # enabled: comes back at boot
    fleet.workload(host, "train", gpus="1", mib=100)  # gone with the reboot
    boot_id = fleet.ssh(host, "cat /proc/sys/kernel/random/boot_id; systemctl show -p ActiveEnterTimestampMonotonic --value init.scope").stdout
    t0 = time.monotonic()
    assert fleet.reboot(host) == "running"
    took = time.monotonic() - t0
    after = fleet.ssh(host, "cat /proc/sys/kernel/random/boot_id; systemctl show -p ActiveEnterTimestampMonotonic --value init.scope").stdout
    assert after != boot_id
    r = fleet.ssh(host, "systemctl is-active sglang.service vllm.service; ls /proc/driver/nvidia/gpus | wc -l")
    assert r.stdout.split() == ["active", "inactive", str(fleet.host(host).gpu_count)], r.stdout
    assert wait_for(lambda: all(m >= 30720 for m in fleet.gpu_memory(host).values()), timeout=10)
    assert fleet.ssh(host, "pgrep -x train.py").returncode == 1
    assert took < 30, f"reboot took {took:.1f} s"


def test_down_leaves_nothing_even_after_a_crashed_nspawn():
    """A second, small fleet: crash it (SIGKILL nspawn), bring it up again over the wreck, tear down."""
    prefix = rig.checkout_prefix("d")
    f = rig.Fleet(prefix)
    try:
        f.up(2, "h200")
        victim = f.hosts[0]
        pid = f.nspawn_pid(victim)
        subprocess.run(["kill", "-9", str(pid)], check=True)
        # nspawn is gone but the host keeps running inside its cgroup
        time.sleep(0.5)
        assert f.nspawn_pid(victim) is None
        assert rig.cgroup_populated(Path(victim["cgroups"][0]))

        f = rig.Fleet(prefix)  # as a new process would see it
        f.up(1, "h200")  # cleans the stale fleet first
        assert f.ssh(f.hosts[0]["name"], "systemctl is-system-running").stdout.strip() == "running"
    finally:
        rig.Fleet(prefix).down()
    assert rig.Fleet(prefix).leftovers() == []
    assert rig.Fleet(prefix).down() == {"down_s": 0.0, "hosts": 0}  # idempotent
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert f"{prefix}-" not in netns
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f"/run/netns/{prefix}-" not in mounts and f"zeromib-fleet/{prefix}" not in mounts


@pytest.mark.parametrize("n", [0, 33])
def test_fleet_size_is_checked_before_anything_is_created(n):
    with pytest.raises(rig.FleetError):
        rig.Fleet(rig.checkout_prefix("x")).up(n)
    assert rig.Fleet(rig.checkout_prefix("x")).leftovers() == []


def test_a_suite_is_checked_before_anything_is_built_and_bookworms_base_keeps_its_recipe():
    """A second suite changes nothing of the default base: its recipe (hence its hash, and the
    cached base every fleet boots from) is BASE_RECIPE's, and trixie's differs only by the suite."""
    with pytest.raises(rig.FleetError, match="unknown suite 'sid'"):
        rig.Fleet(rig.checkout_prefix("x")).up(1, suite="sid")
    assert rig.Fleet(rig.checkout_prefix("x")).leftovers() == []
    assert rig.base_recipe() == rig.BASE_RECIPE and rig.base_paths()[0].name.startswith("base-bookworm-")
    assert {k: v for k, v in rig.base_recipe("trixie").items() if rig.BASE_RECIPE[k] != v} == {"suite": "trixie"}
    assert rig.recipe_hash("trixie") != rig.recipe_hash()


def test_simulator_faults_are_set_per_host_and_cleared_by_reset(clean_fleet):
    fleet, host = clean_fleet, clean_fleet.names[-1]
    fleet.set_fault(host, gpu_lost=[0])
    r = fleet.ssh(host, "nvidia-smi --query-gpu=index,memory.used --format=csv")
    assert r.returncode == 15 and "GPU is lost" in r.stdout
    assert fleet.ssh(fleet.names[0], "nvidia-smi -L").returncode == 0  # other hosts unaffected
    fleet.reset([host])
    assert fleet.ssh(host, "nvidia-smi -L").returncode == 0
