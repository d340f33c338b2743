"""The training-ready profile over real SSH on the fleet's systemd hosts (issue 71), on the oldest and
the newest ansible-core the collection supports: a GPU the inference side left in EXCLUSIVE_PROCESS
(multi-process training then fails with "all CUDA-capable devices are busy or unavailable") is said
in the FIRST sentence of its host's line, through the role in a user's own play
(playbooks/example_training.yml: training does not start) and through free_gpus.yml (its summary);
the role's free_gpus_ready_profile accepts it where the site wants it, and a mistake in one of its
suboptions stops the play before anything is done, said once; free_gpus_ready_fix puts the GPU back
to the profile and restore_gpus.yml puts the inference side's setting back.

The setting is the simulated driver's (tests/sim/README.md "GPU settings the driver keeps"):
/run/nvidia-sim/settings.json on the host, by GPU UUID, read by nvidia-smi --query-gpu and changed
by `nvidia-smi -c` as root only. What each test reads back comes from the host's nvidia-smi.
Works on a fleet of 3 hosts (ZEROMIB_FLEET_HOSTS=3)."""
from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from scenarios import PLAYBOOK, TRAINING, summary_lines, summary_row, summary_status
from test_failure_paths import counts, fatal_lines, host_vars, recap
from test_failure_paths import trio  # noqa: F401  # pylint: disable=unused-import  # a pytest fixture, used by name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

VERDICT = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
MARKER = "/run/zeromib-training-started"
SETTINGS = "/run/nvidia-sim/settings.json"
SETTERS = "/run/nvidia-sim/setters.log"
# The oldest ansible-core the collection supports and the newest.
ENDS = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
LEFT = "compute mode is Exclusive_Process, expected Default"


def first_sentence(message: str) -> str:
    """What a user reads first: up to the first `; ` (the gate joins its issues with it)."""
    return message.split("; ", 1)[0]


def compute_modes(fleet, host: str) -> list[str]:
    out = fleet.ssh(host, "nvidia-smi --query-gpu=compute_mode --format=csv,noheader", check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def trained(fleet, host: str) -> bool:
    return fleet.ssh(host, f"test -e {MARKER}").returncode == 0


@pytest.fixture
def left(trio):
    """(fleet, good, bad, bin_dirs): GPU 1 of `bad` left in Exclusive_Process by the inference side."""
    fleet, (good, bad), _mig = trio
    uuid = fleet.host(bad).gpus[1]["uuid"]
    text = shlex.quote(json.dumps({uuid: {"compute_mode": "Exclusive_Process"}}))
    fleet.ssh(bad, f"printf %s {text} > {SETTINGS}; rm -f {SETTERS}", check=True)
    assert compute_modes(fleet, bad)[1] == "Exclusive_Process"
    try:
        yield fleet, good, bad
    finally:
        fleet.ssh_all(f"rm -f {SETTINGS} {SETTERS} {MARKER}")


def controller(core: str, python: str) -> tuple[str, dict]:
    bin_dir = matrix.controller_bin(core, python)
    return bin_dir, {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_a_gpu_left_in_exclusive_process_is_said_first_on_both_paths_and_training_does_not_start(left, core, python):
    fleet, good, bad = left
    bin_dir, env = controller(core, python)
    gpu = fleet.host(bad).gpus[1]
    where = "GPU 1 ({})".format(gpu["pci_bus_id"])

    own = fleet.ansible_playbook(TRAINING, limit=[good, bad], bin_dir=bin_dir, env=env, extra_vars={"training_command": f"touch {MARKER}"})
    assert own.rc == 2, own
    assert recap(own, bad) == counts(ok=2, failed=1), own.stdout
    said = own.result(VERDICT, bad)["msg"]
    assert said.startswith(f"{bad}: "), said
    first = first_sentence(said)
    assert f"{where}: {LEFT}" in first, said
    assert "nvidia-smi -i 1 -c DEFAULT" in said and "all CUDA-capable devices are busy or unavailable" in said, said
    [fatal] = fatal_lines(own, bad)
    assert LEFT in fatal, fatal
    out = own.stdout + own.stderr
    assert out.count(LEFT) == 1, out[-4000:]
    assert "censored" not in out and "Traceback" not in out and "Origin:" not in out, out[-4000:]
    assert not trained(fleet, good) and not trained(fleet, bad), "training started beside a GPU not ready for it"
    assert compute_modes(fleet, bad)[1] == "Exclusive_Process", "the gate changed a setting it was not asked to"

    run = fleet.ansible_playbook(PLAYBOOK, limit=[good, bad], bin_dir=bin_dir, env=env)
    assert run.rc == 2, run
    lines = summary_lines(run)
    assert summary_status(lines, bad) == "unhealthy", lines
    row = summary_row(lines, bad)
    message = row.split(f"{bad}: ", 1)[1]
    assert f"{where}: {LEFT}" in first_sentence(message), row
    assert summary_status(lines, good) == "clean", lines
    assert (run.stdout + run.stderr).count(LEFT) == 1, run.stdout[-4000:]


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_the_roles_ready_profile_accepts_it_and_a_suboptions_mistake_stops_the_play_said_once(left, core, python):
    fleet, good, bad = left
    bin_dir, env = controller(core, python)
    # A site whose training runs one process per GPU: any compute mode will do on this host.
    host_vars(fleet, bad, {"free_gpus_ready_profile": {"compute_mode": "any"}})
    own = fleet.ansible_playbook(TRAINING, limit=[good, bad], bin_dir=bin_dir, env=env, extra_vars={"training_command": f"touch {MARKER}"})
    assert own.rc == 0, own
    assert trained(fleet, good) and trained(fleet, bad)
    fleet.ssh_all(f"rm -f {MARKER}")
    run = fleet.ansible_playbook(PLAYBOOK, limit=[good, bad], bin_dir=bin_dir, env=env)
    assert run.rc == 0, run

    # A mistake in a suboption: every host stops before any acts, the mistake said whole once.
    host_vars(fleet, bad, {"free_gpus_ready_profile": {"compute_mode": "exclusive"}})
    fleet.workload(good, "vllm")
    own = fleet.ansible_playbook(TRAINING, limit=[good, bad], bin_dir=bin_dir, env=env, extra_vars={"training_command": f"touch {MARKER}"})
    assert own.rc == 2, own
    mine = own.result(VERDICT, bad)["msg"]
    assert re.match(rf"{bad}: settings mistake, nothing was done: free_gpus_ready_profile\.compute_mode must be ", mine), mine
    assert own.result(VERDICT, good)["msg"].startswith(f"{good}: settings mistake on {bad} (free_gpus_ready_profile)"), \
        own.result(VERDICT, good)["msg"]
    out = own.stdout + own.stderr
    assert out.count("free_gpus_ready_profile.compute_mode must be") == 1, out[-4000:]
    assert "Traceback" not in out and "censored" not in out, out[-4000:]
    assert fleet.ssh(good, "systemctl is-active vllm.service").stdout.strip() == "active", "a host acted before the mistake stopped the play"
    assert not trained(fleet, good) and not trained(fleet, bad)

    run = fleet.ansible_playbook(PLAYBOOK, limit=[good, bad], bin_dir=bin_dir, env=env)
    assert run.rc == 2, run
    lines = summary_lines(run)
    assert summary_status(lines, bad) == "invalid", lines
    assert "settings mistake, nothing was done: free_gpus_ready_profile.compute_mode must be" in summary_row(lines, bad), lines
    assert (run.stdout + run.stderr).count("free_gpus_ready_profile.compute_mode must be") == 1, run.stdout[-4000:]
    assert fleet.ssh(good, "systemctl is-active vllm.service").stdout.strip() == "active"


def test_ready_fix_puts_the_gpu_back_to_the_profile_and_restore_gpus_puts_the_inference_sides_setting_back(left):
    fleet, good, bad = left
    host_vars(fleet, bad, {"free_gpus_ready_fix": True})
    run = fleet.ansible_playbook(PLAYBOOK, limit=[good, bad])
    assert run.rc == 0, run
    assert compute_modes(fleet, bad)[1] == "Default"
    # set by the GPU's UUID (never an index that another GPU may have by the time it runs), once
    uuid = fleet.host(bad).gpus[1]["uuid"]
    assert fleet.ssh(bad, f"cat {SETTERS}").stdout.splitlines() == [f"-i {uuid} -c 0"]
    back = fleet.ansible_playbook("playbooks/restore_gpus.yml", limit=[bad])
    assert back.rc == 0, back
    assert compute_modes(fleet, bad)[1] == "Exclusive_Process", "restore_gpus.yml did not put the inference side's compute mode back"
    again = fleet.ansible_playbook("playbooks/restore_gpus.yml", limit=[bad])
    assert again.rc == 0 and compute_modes(fleet, bad)[1] == "Exclusive_Process", again


# --- a guest's unit pinned to a MIG UUID (the MIG host of the trio): the guest's own systemd says what it names

def test_a_guests_unit_pinned_to_a_lost_mig_uuid_is_named_from_its_own_systemd_and_kept_stopped(trio):
    """An LXC guest's vllm.service, pinned by a drop-in of the guest's own (its root's file, never
    read from the host) to a MIG UUID of GPU 0, is stopped through the guest's systemd and the layout
    recorded; after a reboot (only MIG mode stays) gpu_restore refuses naming the guest's unit and the
    UUID, the unit stays stopped; with recreate_mig_layout the layout comes back and the unit is kept,
    its reason naming the UUID of the instance at its place now."""
    import guests as rig  # pylint: disable=import-outside-toplevel

    from test_guests_fleet import module  # pylint: disable=import-outside-toplevel

    fleet, _plain, host = trio
    uuid = fleet.host(host).gpus[0]["uuid"]
    fleet.ssh(host, "nvidia-smi mig -i 0 -cgi 9,9 -C", check=True)
    listed = fleet.ssh(host, "nvidia-smi -L", check=True).stdout
    before = re.findall(r"MIG-[0-9a-f-]{36}", listed)
    assert len(before) == 2, listed
    guest = rig.boot(fleet, host, "lxc", "101", 0, mib=10240)
    try:
        drop_in = f"{guest.dir}/upper/etc/systemd/system/vllm.service.d"
        fleet.ssh(host, f"mkdir -p {drop_in} && printf '[Service]\\nEnvironment=CUDA_VISIBLE_DEVICES={before[1]}\\n' > {drop_in}/mig.conf",
                  check=True)
        rig.systemctl(fleet, host, guest, "daemon-reload")
        args = {"services": [guest.entry("vllm*.service")], "gpus": ["0"], "kill_timeout": 2, "max_used_mib": 64}
        freed = module(fleet, host, "gpu_release", args)
        assert not freed.get("failed"), freed.get("msg")
        assert freed["stopped_guest_units"] == [guest.entry()]
        fleet.ssh(host, "rm -f /run/nvidia-sim/mig.json", check=True)  # a reboot, as far as MIG goes

        refused = module(fleet, host, "gpu_restore", {})
        assert refused["failed"]
        assert refused["msg"].startswith(f"GPU 0 ({uuid}): its MIG layout is gone"), refused["msg"]
        assert f"These would not start, their MIG UUIDs no longer exist: guest unit {guest.entry()} names {before[1]}." in refused["msg"], \
            refused["msg"]
        assert rig.unit_state(fleet, host, guest)[0] == "inactive"

        restored = module(fleet, host, "gpu_restore", {"recreate_mig_layout": True})
        after = re.findall(r"MIG-[0-9a-f-]{36}", fleet.ssh(host, "nvidia-smi -L", check=True).stdout)
        assert len(after) == 2 and not set(after) & set(before)
        [kept] = restored["not_restored"]
        assert kept["kind"] == "guest_unit", kept
        assert f"names MIG UUID {before[1]} (the instance at its place is now {after[1]}), which no longer exists" in kept["reason"], kept
        assert rig.unit_state(fleet, host, guest)[0] == "inactive", "a guest unit pinned to a lost MIG UUID was started"
    finally:
        rig.teardown(fleet, host, [guest])
        fleet.ssh(host, "rm -f /run/nvidia-sim/mig.json /run/nvidia-sim/mig.log /var/lib/zeromib-gpu/released.json")


RESTORE = "playbooks/restore_gpus.yml"
RESTORE_TASK = "zeromib.gpu.restore_gpus : Put back the units and containers gpu_release stopped, disabled or masked"
RESTORE_SUMMARY = "Fleet restore summary (unreachable and failed hosts first)"


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_a_mig_layout_lost_at_a_reboot_is_said_first_by_restore_gpus_and_recreated_on_request(trio, core, python):
    """The MIG host's GPU 0, sliced 3g.40gb + 3g.40gb and left in Exclusive_Process: free_gpus.yml
    with free_gpus_ready_fix records the setting and the layout; after a reboot (only MIG mode
    stays) restore_gpus.yml says first that the layout is gone and restores nothing; with
    restore_gpus_recreate_mig_layout the layout comes back, then the inference side's setting."""
    fleet, (plain, _other), host = trio
    bin_dir, env = controller(core, python)
    uuid = fleet.host(host).gpus[0]["uuid"]
    fleet.ssh(host, "nvidia-smi mig -i 0 -cgi 9,9 -C", check=True)
    text = shlex.quote(json.dumps({uuid: {"compute_mode": "Exclusive_Process"}}))
    fleet.ssh(host, f"printf %s {text} > {SETTINGS}; rm -f {SETTERS}", check=True)
    try:
        host_vars(fleet, host, {"free_gpus_ready_fix": True, "free_gpus_max_used_mib": 64})
        freed = fleet.ansible_playbook(PLAYBOOK, limit=[host], bin_dir=bin_dir, env=env)
        assert freed.rc == 0, freed
        assert compute_modes(fleet, host)[0] == "Default"
        fleet.ssh(host, "rm -f /run/nvidia-sim/mig.json", check=True)  # a reboot, as far as MIG goes

        back = fleet.ansible_playbook(RESTORE, limit=[plain, host], bin_dir=bin_dir, env=env)
        assert back.rc == 2, back
        said = back.result(RESTORE_TASK, host)["msg"]
        assert first_sentence(said).startswith(f"GPU 0 ({uuid}): its MIG layout is gone"), said
        assert "set recreate_mig_layout: true (role: restore_gpus_recreate_mig_layout) to re-create it" in said, said
        assert said.endswith(f"forget: [mig:{uuid}] (role: restore_gpus_forget)"), said
        lines = back.result(RESTORE_SUMMARY, plain)["msg"]
        row = next(line for line in lines if f" {host} " in line)
        assert row.split()[0] == "failed" and row.split(f"{host}  ", 1)[1].startswith(f"restore failed: GPU 0 ({uuid}): its MIG layout is gone"), lines
        assert lines[-1] == "2 hosts: 1 failed, 1 nothing", lines
        out = back.stdout + back.stderr
        assert "Traceback" not in out and "censored" not in out, out[-4000:]
        assert compute_modes(fleet, host)[0] == "Default", "a refused restore put a setting back"

        again = fleet.ansible_playbook(RESTORE, limit=[host], bin_dir=bin_dir, env=env, extra_vars={"restore_gpus_recreate_mig_layout": True})
        assert again.rc == 0, again
        assert len(re.findall(r"MIG-[0-9a-f-]{36}", fleet.ssh(host, "nvidia-smi -L", check=True).stdout)) == 2
        assert compute_modes(fleet, host)[0] == "Exclusive_Process"
    finally:
        fleet.ssh(host, f"rm -f /run/nvidia-sim/mig.json /run/nvidia-sim/mig.log {SETTINGS} {SETTERS} /var/lib/zeromib-gpu/released.json")


@pytest.mark.parametrize(("core", "python"), ENDS, ids=[f"ansible-core-{c}" for c, _p in ENDS])
def test_a_device_node_missing_after_a_driver_reload_is_said_first_by_restore_gpus_until_the_drivers_helper_creates_it(left, core, python):
    """After a driver reload /dev/nvidia-uvm-tools is missing until something runs nvidia-modprobe
    (restored GPU containers and guests then fail to start): restore_gpus.yml says so first and
    restores nothing; with the driver's helper installed it creates the node and restores."""
    fleet, good, bad = left
    bin_dir, env = controller(core, python)
    host_vars(fleet, bad, {"free_gpus_ready_fix": True})
    sim = fleet.ssh(bad, "dirname \"$(readlink -f /usr/local/bin/gpu_holder)\"", check=True).stdout.strip()
    try:
        freed = fleet.ansible_playbook(PLAYBOOK, limit=[good, bad], bin_dir=bin_dir, env=env)
        assert freed.rc == 0 and compute_modes(fleet, bad)[1] == "Default", freed
        fleet.ssh(bad, "rm -f /dev/nvidia-uvm-tools", check=True)

        back = fleet.ansible_playbook(RESTORE, limit=[good, bad], bin_dir=bin_dir, env=env)
        assert back.rc == 2, back
        said = back.result(RESTORE_TASK, bad)["msg"]
        assert first_sentence(said).startswith("NVIDIA device node(s) /dev/nvidia-uvm-tools missing and nvidia-modprobe is not installed"), said
        assert said.endswith("; nothing was restored"), said
        row = next(line for line in back.result(RESTORE_SUMMARY, good)["msg"] if f" {bad} " in line)
        assert row.split(f"{bad}  ", 1)[1].startswith("restore failed: NVIDIA device node(s) /dev/nvidia-uvm-tools missing"), row
        assert compute_modes(fleet, bad)[1] == "Default", "a refused restore put a setting back"

        fleet.ssh(bad, f"ln -sf {sim}/nvidia-modprobe /usr/bin/nvidia-modprobe", check=True)
        again = fleet.ansible_playbook(RESTORE, limit=[bad], bin_dir=bin_dir, env=env)
        assert again.rc == 0, again
        assert again.result(RESTORE_TASK, bad)["device_nodes"]["created"] == ["/dev/nvidia-uvm-tools"]
        assert fleet.ssh(bad, "test -c /dev/nvidia-uvm-tools").returncode == 0
        assert compute_modes(fleet, bad)[1] == "Exclusive_Process"
    finally:
        fleet.ssh(bad, "rm -f /usr/bin/nvidia-modprobe /var/lib/zeromib-gpu/released.json; "
                       "[ -c /dev/nvidia-uvm-tools ] || mknod -m 666 /dev/nvidia-uvm-tools c 1 5")
