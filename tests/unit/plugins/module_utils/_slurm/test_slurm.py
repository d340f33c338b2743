"""Slurm drains (_slurm): only reasons starting with `zeromib:` are ours, to overwrite or resume;
parsed from real `scontrol show node -o` lines of Debian 12's Slurm 22.05 (the fleet's)."""
import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _drain as slurm

IDLE = ("NodeName=gpu01 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUEfctv=1 CPUTot=1 CPULoad=0.05 AvailableFeatures=(null) "
        "ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 NodeHostName=gpu01 Version=22.05.8 OS=Linux 6.1.0 RealMemory=100 "
        "AllocMem=0 FreeMem=1000 Sockets=1 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
        "Partitions=debug BootTime=2026-12-01T09:00:00 SlurmdStartTime=2026-12-01T09:01:00 LastBusyTime=2026-12-01T09:01:00 "
        "CfgTRES=cpu=1,mem=100M,billing=1 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 "
        "ExtSensorsTemp=n/s")
ADMIN = IDLE.replace("State=IDLE", "State=IDLE+DRAIN") + " Reason=maintenance [root@2026-12-01T10:00:00]"
OURS = IDLE.replace("State=IDLE", "State=IDLE+DRAIN") + " Reason=zeromib: gpu01: GPU 0 reads 4096 MiB [root@2026-12-01T10:00:00]"


def test_parse_node_keeps_the_reason_with_its_spaces_and_values_with_equals_signs():
    node = slurm.parse_node(OURS)
    assert node["NodeName"] == "gpu01" and node["State"] == "IDLE+DRAIN" and node["CfgTRES"] == "cpu=1,mem=100M,billing=1"
    assert node["OS"] == "Linux 6.1.0"
    assert slurm.reason_text(node) == "zeromib: gpu01: GPU 0 reads 4096 MiB"


@pytest.mark.parametrize("line, act", [(IDLE, True), (ADMIN, False), (OURS, True)])
def test_drain_never_overwrites_another_reason(line, act):
    assert slurm.drain_decision(slurm.parse_node(line), "zeromib: new")[0] is act


DOWN = IDLE.replace("State=IDLE", "State=DOWN") + " Reason=bad dimm [root@2026-12-01T10:00:00]"
NOT_RESPONDING = IDLE.replace("State=IDLE", "State=DOWN*") + " Reason=Not responding [slurm@2026-12-01T10:00:00]"


@pytest.mark.parametrize("line", [DOWN, NOT_RESPONDING, DOWN.replace("State=DOWN", "State=ALLOCATED+FAIL")], ids=["down", "not-responding", "fail"])
def test_an_admins_down_or_fail_is_never_replaced_by_a_drain_nor_resumed(line):
    """Review of issue 35: only DRAIN was someone else's; an admin's DOWN or FAIL reason was
    overwritten by a zeromib: drain, which restore_gpus would then resume."""
    node = slurm.parse_node(line)
    act, why = slurm.drain_decision(node, "zeromib: epilog job 7: GPU 0: 4096 MiB")
    assert act is False and "someone else" in why and slurm.reason_text(node) in why
    assert slurm.resume_decision(node)[0] is False


def test_drain_with_the_same_reason_changes_nothing():
    assert slurm.drain_decision(slurm.parse_node(OURS), "zeromib: gpu01: GPU 0 reads 4096 MiB") == (
        False, "drained already by zeromib with the same reason")


@pytest.mark.parametrize("line, act", [
    (IDLE, False), (ADMIN, False), (OURS, True), (OURS.replace("IDLE+DRAIN", "DRAINED"), True), (ADMIN.replace("IDLE+DRAIN", "MIXED+DRAIN"), False),
])
def test_resume_only_our_drains(line, act):
    assert slurm.resume_decision(slurm.parse_node(line))[0] is act


def test_short_reason_is_prefixed_one_line_and_bounded():
    assert slurm.short_reason("GPU 0  reads\n4096 MiB") == "zeromib: GPU 0 reads 4096 MiB"
    assert slurm.short_reason("zeromib: already") == "zeromib: already"
    long = slurm.short_reason("x" * 500)
    assert len(long) == slurm.REASON_MAX and long.endswith("...")
    assert "=" not in slurm.short_reason("kill=false leaves it")


def test_node_name_from_slurmd_c_then_the_host_name():
    calls = []

    def run(argv):
        calls.append(argv)
        if argv[1] == "-C":
            return 0, "NodeName=gpu01 CPUs=1 Boards=1 SocketsPerBoard=1 RealMemory=1000\nUpTime=0-00:10:00\n", ""
        if argv[-1] == "gpu01":
            return 0, IDLE + "\n", ""
        return 1, "", "Node not found"

    name, node = slurm.Slurm(run, "scontrol", "slurmd", hostname="gpu01").node_name()
    assert name == "gpu01" and node["State"] == "IDLE"
    with pytest.raises(slurm.SlurmError, match="set it"):
        slurm.Slurm(lambda argv: (1, "", "no"), "scontrol", None, hostname="other").node_name()
