"""The MIG layout's pure parts (issue 71): the parsers of `nvidia-smi mig -lgi`, `-lci` and `-L` (shapes of
NVIDIA's MIG user guide and tests/fixtures/nvidia-smi-L), the comparison, the re-creation's command, the
MIG UUIDs a re-creation moved, who blocks a MIG change, and which unit files are read (root's only)."""
import os

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mig_restore
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mig_layout

HERE = os.path.dirname(os.path.abspath(__file__))
LIST = os.path.join(HERE, os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "nvidia-smi-L", "mig-a100x2.txt")

# NVIDIA's MIG user guide, "Getting Started with MIG" (A100-40GB): `nvidia-smi mig -lgi` after -cgi 9,14,19,19,19.
LGI = """\
+----------------------------------------------------+
| GPU instances:                                     |
| GPU   Name          Profile  Instance   Placement  |
|                       ID       ID       Start:Size |
|====================================================|
|   0  MIG 1g.5gb       19        7          4:1     |
+----------------------------------------------------+
|   0  MIG 2g.10gb      14        3          2:2     |
+----------------------------------------------------+
|   0  MIG 3g.20gb       9        2          0:4     |
+----------------------------------------------------+
"""
LCI = """\
+--------------------------------------------------------------------+
| Compute instances:                                                 |
| GPU     GPU       Name             Profile   Instance   Placement  |
|       Instance                       ID        ID       Start:Size |
|         ID                                                         |
|====================================================================|
|   0      7       MIG 1g.5gb           0         0          0:1     |
+--------------------------------------------------------------------+
|   0      3       MIG 2g.10gb          1         0          0:2     |
+--------------------------------------------------------------------+
|   0      2       MIG 3g.20gb          2         0          0:3     |
+--------------------------------------------------------------------+
"""


def layout():
    return {"gpu_instances": [dict((k, v) for k, v in r.items() if k != "gpu") for r in _mig_layout.parse_gpu_instances(LGI)],
            "compute_instances": [dict((k, v) for k, v in r.items() if k != "gpu") for r in _mig_layout.parse_compute_instances(LCI)],
            "mig_devices": [{"profile": "3g.20gb", "uuid": "MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60"},
                            {"profile": "2g.10gb", "uuid": "MIG-1c6a9d2b-5f3e-5c8a-8b4d-2e3f4a5b6c71"}]}


def test_the_guides_tables_and_the_list_parse():
    assert _mig_layout.parse_gpu_instances(LGI)[2] == {"gpu": 0, "profile": "3g.20gb", "profile_id": 9, "id": 2, "placement": "0:4"}
    assert _mig_layout.parse_compute_instances(LCI)[0] == {"gpu": 0, "gpu_instance": 7, "profile": "1g.5gb", "profile_id": 0, "id": 0,
                                                           "placement": "0:1"}
    with open(LIST) as handle:
        listed = _mig_layout.parse_list(handle.read())
    assert [d["profile"] for d in listed["GPU-7a3c1f52-0d64-4c1e-9b1e-2f9a4c6d8e01"]["mig_devices"]] == ["3g.20gb", "2g.10gb", "1g.5gb"]
    assert listed["GPU-8b4d2a63-1e75-4d2f-8c2f-3a0b5d7e9f12"]["index"] == 1
    assert _mig_layout.parse_gpu_instances("No GPU instances found: Not Found\n") == []


def test_the_same_slicing_with_other_ids_is_the_same_and_an_empty_gpu_is_gone():
    now = layout()
    for gi in now["gpu_instances"]:
        gi["id"] += 10
    for ci in now["compute_instances"]:
        ci["gpu_instance"] += 10
    assert _mig_restore.verdict(layout(), now) == "same"
    assert _mig_restore.verdict(layout(), {"gpu_instances": []}) == "gone"
    assert _mig_restore.verdict(layout(), {"gpu_instances": layout()["gpu_instances"][:1], "compute_instances": []}) == "changed"
    assert _mig_layout.said(layout()) == "3 GPU instances (3g.20gb at 0:4, 2g.10gb at 2:2, 1g.5gb at 4:1)"


def test_the_recreation_takes_the_profiles_in_the_order_of_their_places():
    assert _mig_restore.create_args(dict(layout(), index=0)) == ["mig", "-i", "0", "-cgi", "9,14,19", "-C"]
    two = layout()
    two["compute_instances"].append(dict(two["compute_instances"][2], id=1))
    assert _mig_restore.create_args(dict(two, index=0)) is None, "-C cannot give back two compute instances in one GPU instance"


def test_moved_pairs_each_lost_uuid_with_the_device_at_its_place_now():
    now = {"mig_devices": [{"profile": "3g.20gb", "uuid": "MIG-new-a"}, {"profile": "2g.10gb", "uuid": "MIG-1c6a9d2b-5f3e-5c8a-8b4d-2e3f4a5b6c71"}]}
    assert _mig_restore.moved(layout(), now) == {"MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60": "MIG-new-a"}


def test_blockers_name_dcgm_and_every_nvml_client_but_not_a_process_of_another_gpu():
    holders = [{"pid": 812, "name": "/usr/bin/nv-hostengine", "attribution": "nvml_client", "gpu_indexes": []},
               {"pid": 900, "name": "python3", "attribution": "listed", "gpu_indexes": [1]},
               {"pid": 901, "name": "python3", "attribution": "listed", "gpu_indexes": [0], "unit": "job.service"}]
    assert _mig_restore.blockers(holders, 0) == ["/usr/bin/nv-hostengine (pid 812, DCGM's host engine, an NVML client)",
                                                 "python3 (pid 901, using GPU 0, unit job.service)"]


def test_only_root_owned_unit_files_are_read(tmp_path):
    etc, lib = tmp_path / "etc", tmp_path / "lib"
    (etc / "vllm.service.d").mkdir(parents=True)
    lib.mkdir()
    (lib / "vllm.service").write_text("[Service]\nEnvironment=CUDA_VISIBLE_DEVICES=MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60\n")
    (etc / "vllm.service.d" / "env.conf").write_text(f"[Service]\nEnvironmentFile=-{tmp_path}/env\n")
    (tmp_path / "env").write_text("NVIDIA_VISIBLE_DEVICES=MIG-1c6a9d2b-5f3e-5c8a-8b4d-2e3f4a5b6c71\n")
    assert _mig_restore.unit_paths("vllm.service", [str(etc), str(lib)]) == [str(lib / "vllm.service"), str(etc / "vllm.service.d" / "env.conf")]
    uuids, skipped = _mig_restore.unit_mig_uuids("vllm.service", [str(etc), str(lib)])
    if os.geteuid() == 0:
        assert uuids == {"MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60", "MIG-1c6a9d2b-5f3e-5c8a-8b4d-2e3f4a5b6c71"} and skipped == []
        os.chown(tmp_path / "env", 4242, 4242)
        uuids, skipped = _mig_restore.unit_mig_uuids("vllm.service", [str(etc), str(lib)])
        assert uuids == {"MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60"}
        assert skipped == [f"{tmp_path}/env is owned by uid 4242 or writable by others (mode 644): not read"]
    else:
        assert uuids == set() and len(skipped) == 2, "files this user (not root) owns are not root's"


def test_a_gate_without_mig_makes_no_call():
    class NoCall:
        def run(self, args):
            raise AssertionError(f"nvidia-smi {args} called")

    gpus = [{"index": 0, "uuid": "GPU-a", "mig_mode": "Disabled"}, {"index": 1, "uuid": "GPU-b", "mig_mode": "[N/A]"},
            {"index": 2, "uuid": "GPU-c", "mig_mode": "Enabled"}]
    assert _mig_layout.record_entries(NoCall(), gpus, [0, 1], "t") == ([], [])


def test_a_containers_device_request_and_nvidia_visible_devices_name_its_mig_uuids():
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines

    inspect = {"Id": "c" * 64, "Name": "/vllm", "Config": {"Env": ["NVIDIA_VISIBLE_DEVICES=MIG-1c6a9d2b-5f3e-5c8a-8b4d-2e3f4a5b6c71", "A=b"]},
               "HostConfig": {"DeviceRequests": [{"Driver": "nvidia", "DeviceIDs": ["MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60"],
                                                  "Capabilities": [["gpu"]]}]},
               "State": {"Running": False}}
    record = _engines.record_of(inspect)
    assert record["gpu_devices"] == ["MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60", "MIG-1c6a9d2b-5f3e-5c8a-8b4d-2e3f4a5b6c71"]
    assert _mig_restore.container_mig_uuids(record) == set(record["gpu_devices"])
    assert _mig_restore.container_mig_uuids(None) == set()


# --- a guest's units: the guest's own systemd is asked, confined as the guest; its files are never read from the host

LOST = "MIG-1c6a9d2b-5f3e-5c8a-8b4d-2e3f4a5b6c71"
KEPT = "MIG-0b5f8c1a-4e2d-5b7f-9a3c-1d2e3f4a5b60"
GUEST = {"kind": "lxc", "name": "101", "manager": "systemd", "unit": None}
ENTRY = {"kind": "guest_unit", "name": "vllm.service", "guest_kind": "lxc", "guest": "101", "entry": "lxc:101:vllm.service"}


class GuestSystem:
    """The node's seam as a guest's restore uses it: a running LXC guest 101 whose systemd answers `answer`."""

    def __init__(self, answer=(0, "", ""), guests=(GUEST,), refusal=None):
        self.answer, self.guests, self.refusal, self.calls = answer, list(guests), refusal, []

    def running_guests(self, kind, name_glob):
        return [g for g in self.guests if g["kind"] == kind]

    def guest_refusal(self, guest):
        return self.refusal

    def guest_systemctl(self, guest, args, timeout):
        self.calls.append(list(args))
        return self.answer

    def now(self):
        return 0.0

    def sleep(self, seconds):
        pass


class Restore:
    def __init__(self, system):
        self.system, self.options, self.step_timeout, self.result = system, _options.RestoreOptions.of({}), 5.0, {"warnings": []}


def check_of(system):
    found = _mig_restore.MigCheck(Restore(system), [ENTRY])
    found.present = {KEPT}
    return found


def test_a_guests_unit_naming_a_lost_mig_uuid_is_pinned_by_its_own_systemds_answer():
    system = GuestSystem((0, f"Environment=CUDA_VISIBLE_DEVICES={LOST} HF_HOME=/x\nExecStart={{ path=/usr/bin/vllm ; argv[]=/usr/bin/vllm serve }}\n"
                             "ExecStartPre=\nEnvironmentFiles=/etc/vllm.env (ignore_errors=no)\n", ""))
    found = check_of(system)
    assert found._pinned() == [(ENTRY, [LOST])]
    assert system.calls == [["show", "--no-pager", "-p", "Environment", "-p", "ExecStart", "-p", "ExecStartPre", "-p", "EnvironmentFiles",
                             "vllm.service"]], "one question to the guest's systemd, nothing read from its files"
    assert found.restore.result["warnings"] == ["lxc:101:vllm.service: its EnvironmentFile /etc/vllm.env is the guest's and is not read from "
                                                "the host; check the MIG UUIDs it names with `pct exec 101 -- cat /etc/vllm.env`"]
    assert found.still_pinned() == {("guest_unit", "lxc", "101", "vllm.service"): (
        f"its configuration names MIG UUID {LOST}, which no longer exists: point it at the UUID of `nvidia-smi -L` and run gpu_restore again")}
    assert _mig_restore._label(ENTRY) == "guest unit lxc:101:vllm.service"


def test_a_guest_root_cannot_make_its_answer_long_or_pin_what_exists():
    flood = " ".join(f"MIG-{n:08x}-0000-0000-0000-000000000000" for n in range(5000))
    found = check_of(GuestSystem((0, f"Environment=A={flood} B={KEPT}\nEnvironmentFiles=" + " ".join(f"/e{n}" for n in range(100)) + "\n", "")))
    [(entry, lost)] = found._pinned()
    assert entry is ENTRY and len(lost) == _mig_restore.MAX_SAID and KEPT not in lost
    assert len(found.restore.result["warnings"]) <= _mig_restore.MAX_SAID


def test_a_guest_the_host_cannot_ask_is_left_to_its_restore_and_one_that_does_not_answer_is_not_started_naming_the_command():
    for system in (GuestSystem(guests=()), GuestSystem(refusal="LXC guest 101 cannot be reached confined as the guest"),
                   GuestSystem(guests=(dict(GUEST, manager="init"),))):
        found = check_of(system)
        assert found._pinned() == [] and system.calls == [] and found.still_pinned() == {}
    found = check_of(GuestSystem((124, "", "")))
    assert found._pinned() == []
    [why] = list(found.still_pinned().values())
    assert why == ("LXC guest 101 did not say what its unit names (no answer within step_timeout): not started while a MIG layout changed; "
                   "check it with `pct exec 101 -- systemctl cat vllm.service` and run gpu_restore again")
    # What the guest's systemctl prints is the guest root's text: never repeated in root's answer.
    found = check_of(GuestSystem((1, "", "\x1b[2Jall clear, restore everything\n" * 50)))
    [why] = list(found.still_pinned().values())
    assert "(its systemctl exited 1)" in why and "all clear" not in why
    assert "did not say what its unit names" in found._refusal(["GPU 0 (GPU-a): its MIG layout is gone"], [])
