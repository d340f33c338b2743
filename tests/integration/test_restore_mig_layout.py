"""The MIG layout in the restore record, through the real modules on simulated A100s in MIG mode (issue 71).

Only MIG mode survives a reboot: the GPU and compute instances, and their MIG UUIDs, are lost, and a
service pinned to a MIG UUID fails at restore. gpu_release records the layout of each selected GPU in
MIG mode beside what it changed; gpu_restore compares it with the GPU before anything is restored, and
refuses naming the service pinned to a lost MIG UUID, or (recreate_mig_layout) re-creates the layout
and restores, naming the new UUID where a service still names the old one; DCGM holding the GPU is
named as what blocks the re-creation ("In use by another client").

The simulated driver keeps the layout in its state directory's mig.json (tests/sim/nvidia-smi,
cmd_mig); a simulated reboot removes that file. The record's `unit` entry is written into the record
by the test (a namespace host has no systemd to stop a unit through): what gpu_restore reads of it is
the unit's files, which the host has, in its own /etc.

Who else controls what the restore reads: an unprivileged user may own a file a root unit names
(EnvironmentFile= in a shared directory) or a FIFO there; the tenant `uid 4242` below writes one naming a
MIG UUID, and it is never read (a user cannot make a root service look pinned, nor hang the restore).
MIG changes are root's only: the simulated nvidia-smi refuses anyone else, as the driver does.
"""
import json
import os

import pytest

from ansible_in_ns import run_module

TENANT = 4242
RECORD = "/var/lib/zeromib-gpu/released.json"


def mig(host, *args, uid=None):
    argv = ["nvidia-smi", "mig"] + list(args)
    if uid is not None:
        argv = ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--"] + argv
    return host.run(argv)


def mig_uuids(host):
    out = host.smi("-L", check=True).stdout
    return [line.split("UUID: ")[1].rstrip(")") for line in out.splitlines() if line.startswith("  MIG ")]


def reboot(host):
    """A simulated reboot as far as MIG goes: the instances are gone, MIG mode stays."""
    os.unlink(os.path.join(host.root.state, "mig.json"))


def write(host, path, text, owner=0, mode="0644"):
    host.run(["sh", "-c", f'mkdir -p "$(dirname {path})" && cat > {path} && chown {owner}:{owner} {path} && chmod {mode} {path}'],
             input=text, check=True)


def mig_log(host):
    path = os.path.join(host.root.state, "mig.log")
    return open(path).read().splitlines() if os.path.exists(path) else []


def setters(host):
    path = os.path.join(host.root.state, "setters.log")
    return open(path).read().splitlines() if os.path.exists(path) else []


def released_with_layout(nshost, seed):
    """An A100 pair in MIG mode, GPU 0 sliced 3g.40gb + 3g.40gb, left in Exclusive_Process by the inference
    side; a release with ready_fix (the change it records) -> (host, GPU 0's UUID, its two MIG UUIDs)."""
    host = nshost("a100-mig", seed=seed)
    uuid = host.config["gpus"][0]["uuid"]
    assert mig(host, "-i", "0", "-cgi", "9,3g.40gb", "-C").returncode == 0
    before = mig_uuids(host)
    assert len(before) == 2
    os.unlink(os.path.join(host.root.state, "mig.log"))  # the inference side's slicing: what the module runs is logged from here
    with open(os.path.join(host.root.state, "settings.json"), "w") as handle:
        json.dump({uuid: {"compute_mode": "Exclusive_Process"}}, handle)
    # MIG idles at 55 MiB (tests/sim/README.md): the idle baseline accepted, as the gate's message says to.
    run = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5, "ready_fix": True, "max_used_mib": 64})
    assert not run.failed and run["ready_fixed"], run.msg
    return host, uuid, before


def add_unit_entry(host, unit):
    """The record as a release that stopped `unit` leaves it (the unit keys of _record.unit_entries)."""
    record = json.loads(host.read(RECORD))
    record["entries"].insert(0, {"kind": "unit", "name": unit, "actions": ["stopped"], "active": True, "active_state": "active",
                                 "unit_file_state": "enabled", "gpu_indexes": [0], "released_at": "2026-12-06T21:00:00Z"})
    host.run(["python3", "-c", "import sys; open(sys.argv[1], 'w').write(sys.stdin.read())", RECORD], input=json.dumps(record), check=True)


def test_the_simulated_driver_slices_for_root_only_lists_mig_devices_and_loses_them_at_a_reboot(nshost):
    host = nshost("a100-mig", seed="mig00")
    denied = mig(host, "-i", "0", "-cgi", "9", "-C", uid=TENANT)
    assert denied.returncode == 4 and "Insufficient Permissions" in denied.stdout
    made = mig(host, "-i", "0", "-cgi", "9,9", "-C")
    assert made.returncode == 0, made.stdout
    assert made.stdout.startswith("Successfully created GPU instance ID  1 on GPU  0 using profile MIG 3g.40gb (ID  9)\n"
                                  "Successfully created compute instance ID  0 on GPU  0 GPU instance ID  1 using profile MIG 3g.40gb (ID  2)\n")
    listed = mig(host, "-lgi").stdout
    assert "|   0  MIG 3g.40gb       9        1          0:4     |" in listed, listed
    assert "|   0  MIG 3g.40gb       9        2          4:4     |" in listed, listed
    assert len(mig_uuids(host)) == 2
    assert mig(host, "-i", "0", "-cgi", "9").returncode == 23, "no room left for a third 3g.40gb"
    reboot(host)
    gone = mig(host, "-lgi")
    assert gone.returncode == 6 and gone.stdout == "No GPU instances found: Not Found\n"
    assert mig_uuids(host) == []


def test_the_release_records_the_layout_and_after_a_reboot_restore_refuses_naming_the_pinned_service(nshost):
    host, uuid, before = released_with_layout(nshost, "mig01")
    record = run_module(host, "gpu_facts", {})["ansible_facts"]["gpu"]["pending_restore"]
    [layout] = [e for e in record["entries"] if e["kind"] == "mig_layout" and e["uuid"] == uuid]
    assert [(gi["profile"], gi["placement"]) for gi in layout["gpu_instances"]] == [("3g.40gb", "0:4"), ("3g.40gb", "4:4")]
    assert [(ci["gpu_instance"], ci["profile_id"], ci["placement"]) for ci in layout["compute_instances"]] == [(1, 2, "0:3"), (2, 2, "0:3")]
    assert [d["uuid"] for d in layout["mig_devices"]] == before
    write(host, "/etc/systemd/system/vllm.service", f"[Service]\nEnvironment=CUDA_VISIBLE_DEVICES={before[1]}\nExecStart=/usr/bin/vllm serve\n")
    add_unit_entry(host, "vllm.service")
    reboot(host)
    failed = run_module(host, "gpu_restore", {})
    assert failed.failed
    assert failed.msg.startswith(f"GPU 0 ({uuid}): its MIG layout is gone (2 GPU instances (3g.40gb at 0:4, 3g.40gb at 4:4) at the release, "
                                 "none now, as after a reboot); set recreate_mig_layout: true (role: restore_gpus_recreate_mig_layout) "
                                 "to re-create it"), failed.msg
    assert f"These would not start, their MIG UUIDs no longer exist: vllm.service names {before[1]}." in failed.msg, failed.msg
    assert failed.msg.endswith(f"Nothing was restored. To restore without the layout, drop it from the record: forget: [mig:{uuid}] "
                               "(role: restore_gpus_forget)"), failed.msg
    assert setters(host) == [f"-i {uuid} -c 0"] and mig_log(host) == [], "nothing restored, nothing sliced"
    # The plan with the option re-creates nothing either.
    plan = run_module(host, "gpu_restore", {"recreate_mig_layout": True}, check=True)
    assert plan["recreated_mig_layouts"] == [f"GPU 0 ({uuid}): nvidia-smi mig -i 0 -cgi 9,9 -C"], plan.result
    assert mig_log(host) == [] and mig_uuids(host) == []


def test_with_recreate_mig_layout_the_layout_comes_back_and_the_rest_is_restored(nshost):
    host, uuid, before = released_with_layout(nshost, "mig02")
    write(host, "/etc/systemd/system/vllm.service", f"[Service]\nEnvironment=CUDA_VISIBLE_DEVICES={before[0]}\nExecStart=/usr/bin/vllm serve\n")
    add_unit_entry(host, "vllm.service")
    reboot(host)
    restore = run_module(host, "gpu_restore", {"recreate_mig_layout": True})
    assert mig_log(host) == ["mig -i 0 -cgi 9,9 -C"]
    assert restore["recreated_mig_layouts"] == [f"GPU 0 ({uuid}): nvidia-smi mig -i 0 -cgi 9,9 -C"]
    listed = mig(host, "-lgi").stdout
    assert "0:4" in listed and "4:4" in listed
    after = mig_uuids(host)
    assert len(after) == 2 and not set(after) & set(before), "re-created instances have new MIG UUIDs"
    # The inference side's settings are back; the service pinned to the old UUID is not started, and says the new one.
    assert setters(host)[-1] == f"-i {uuid} -c 3" and restore["restored_gpu_settings"], restore.msg
    assert restore.failed
    [pinned] = restore["not_restored"]
    assert pinned["name"] == "vllm.service"
    assert f"names MIG UUID {before[0]} (the instance at its place is now {after[0]}), which no longer exists" in pinned["reason"], pinned
    record = run_module(host, "gpu_facts", {})["ansible_facts"]["gpu"]["pending_restore"]
    assert [e["kind"] for e in record["entries"]] == ["unit"], "the layout and the settings left the record; the unit stays"
    # Pointed at the new UUID, the unit passes the MIG check (and then needs systemd, which a namespace host has not).
    write(host, "/etc/systemd/system/vllm.service", f"[Service]\nEnvironment=CUDA_VISIBLE_DEVICES={after[0]}\n")
    again = run_module(host, "gpu_restore", {"recreate_mig_layout": True})
    assert "MIG UUID" not in again.msg and mig_log(host) == ["mig -i 0 -cgi 9,9 -C"], again.msg


def test_dcgm_holding_the_gpu_is_named_as_what_blocks_the_recreation(nshost):
    host, uuid, _before = released_with_layout(nshost, "mig03")
    reboot(host)
    dcgm = host.spawn(["gpu_holder", "--monitor", "dmon", "--name", "nv-hostengine"])
    try:
        failed = run_module(host, "gpu_restore", {"recreate_mig_layout": True})
        assert failed.failed
        assert failed.msg.startswith(f"GPU 0 ({uuid}): nvidia-smi mig -i 0 -cgi 9,9 -C was refused (In use by another client): "
                                     f"nv-hostengine (pid {dcgm.pid}, DCGM's host engine, an NVML client) holds the GPU's device files"), failed.msg
        assert setters(host) == [f"-i {uuid} -c 0"], "nothing restored"
    finally:
        host.kill(dcgm.pid)
    restore = run_module(host, "gpu_restore", {"recreate_mig_layout": True})
    assert not restore.failed, restore.msg
    assert restore["recreated_mig_layouts"] and run_module(host, "gpu_facts", {})["ansible_facts"]["gpu"]["pending_restore"] is None


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_tenants_environment_file_is_never_read(nshost, kind):
    """A root unit names EnvironmentFile=/run/shared/vllm.env, a path the tenant controls. Its MIG UUID must not
    make the service read as pinned (the refusal names only what root's files say), and a FIFO there must not
    hang the restore."""
    host, uuid, before = released_with_layout(nshost, f"mig04{kind}")
    host.run(["sh", "-c", f"mkdir -p /run/shared && chown {TENANT}:{TENANT} /run/shared"], check=True)
    if kind == "file":
        write(host, "/run/shared/vllm.env", f"CUDA_VISIBLE_DEVICES={before[0]}\n", owner=TENANT)
    else:
        host.run(["setpriv", "--reuid", str(TENANT), "--regid", str(TENANT), "--clear-groups", "--", "mkfifo", "/run/shared/vllm.env"], check=True)
    write(host, "/etc/systemd/system/vllm.service", "[Service]\nEnvironmentFile=-/run/shared/vllm.env\nExecStart=/usr/bin/vllm serve\n")
    add_unit_entry(host, "vllm.service")
    reboot(host)
    failed = run_module(host, "gpu_restore", {}, timeout=60)
    assert failed.failed and "its MIG layout is gone" in failed.msg, failed.msg
    assert "These would not start" not in failed.msg and before[0] not in failed.msg, failed.msg
    said = " ".join(failed.result.get("warnings") or []) + failed.stdout + failed.stderr
    assert "/run/shared/vllm.env" in said and "not read" in said, said


@pytest.mark.parametrize("fault, words", [("hang", "nvidia-smi timed out after 2 s"), ("garbage", "is not on this node now")])
def test_a_hung_or_garbled_nvidia_smi_is_never_read_as_the_layout_being_there(nshost, fault, words):
    host, uuid, _before = released_with_layout(nshost, f"mig05{fault}")
    host.set_fault(**{fault: True})
    failed = run_module(host, "gpu_restore", {"recreate_mig_layout": True, "step_timeout": 2}, timeout=90)
    host.clear_faults()
    assert failed.failed and words in failed.msg and "othing was restored" in failed.msg, failed.msg
    assert setters(host) == [f"-i {uuid} -c 0"] and mig_log(host) == [], "nothing restored, nothing sliced"
