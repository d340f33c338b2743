"""The node shapes of issue 70 through the real Slurm hook (the packed slurm_gpu_checks runner as
slurmd calls it, on a namespace host with the simulated driver): each says the right verdict, its
sentence first, and no reset advice where a reset is not the node's to do.

Shapes already run through the hook elsewhere: unified memory (test_unified_memory.py), checkpointed
holders (test_checkpointed_holders.py), IMEX importers and WSL2 (test_node_shapes.py). Here: a holder
in a frozen cgroup (root's, and a user's delegated one), a node with GPUs given to VMs by PCI
passthrough, and a paused docker container (refused naming `docker unpause`, before anything is done).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from test_gpu_release import used  # noqa: E402
from test_slurm_epilog_smoke import epilog  # noqa: E402
from test_slurm_epilog_smoke import runner  # noqa: E402,F401  # pylint: disable=unused-import  # a pytest fixture, used by name
from test_vfio_passthrough import vfio_node  # noqa: E402,F401  # pylint: disable=unused-import  # a pytest fixture, used by name
from tenants.frozen_cgroup import frozen_holder  # noqa: E402  # pylint: disable=wrong-import-position
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "sim"))
from test_container_engines import docker, rig  # noqa: E402,F401  # pylint: disable=unused-import  # fixtures, used by name

USER = 4242
FAST = {"kill_timeout": 0.5, "wait_timeout": 1, "settle_timeout": 0}
RESET_WORDS = ("--gpu-reset", "a reboot is needed", "fallen off the bus", "leaked")


def no_reset_words(text):
    return [word for word in RESET_WORDS if word in text]


def test_the_epilog_names_a_leftover_root_froze_as_frozen_with_the_thaw_command_first(nshost, runner, tmp_path):  # noqa: F811
    host = nshost("h200x1", seed="shapefrozen")
    with frozen_holder(host, "suspended-job", mib=2048) as held:
        rc, stderr, entry = epilog(host, runner, tmp_path, "951", gpus="0", **FAST)
        assert rc != 0 and not entry["ok"], (stderr, entry)
        cause = " ".join(entry["causes"])
        assert entry["causes"][0].startswith("frozen (freezer.state FROZEN in "), entry
        assert f"pid {held.pid} " in cause and f"`echo THAWED > {held.directory}/freezer.state`" in cause, entry
        assert "unkillable (outlived SIGKILL" not in cause and not no_reset_words(stderr + cause), entry
        assert held.state() == "FROZEN"  # the hook thaws nothing itself


def test_the_epilog_never_thaws_a_cgroup_a_user_froze_in_her_subtree(nshost, runner, tmp_path):  # noqa: F811
    host = nshost("h200x1", seed="shapefrozenuser")
    with frozen_holder(host, "alice-lab", mib=1024, uid=USER, delegated=True) as held:
        rc, stderr, entry = epilog(host, runner, tmp_path, "952", gpus="0", **FAST)
        assert rc != 0 and not entry["ok"], (stderr, entry)
        cause = " ".join(entry["causes"])
        assert entry["causes"][0].startswith("frozen (freezer.state FROZEN in "), entry
        assert f"the cgroup is in uid {USER}'s delegated subtree, frozen by that user" in cause, entry
        assert "THAWED" not in cause and not no_reset_words(stderr + cause), entry
        assert held.state() == "FROZEN" and used(host, 0) >= 1024


def test_the_epilog_on_a_node_with_gpus_given_to_vms_passes_its_own_gpu_and_leaves_the_vms_alone(vfio_node, runner, tmp_path):  # noqa: F811
    host, qemu = vfio_node
    rc, stderr, entry = epilog(host, runner, tmp_path, "953", gpus="0", **FAST)
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), (stderr, entry)
    assert entry.get("killed", []) == [] and host.alive(qemu), entry  # the VM's QEMU is never the job's leftover
    assert not no_reset_words(stderr + str(entry)), entry


# Seen 2026-12-07: the hook says "GPU 0: 20489 MiB, no process holds it" (killed [], nothing refused), where
# gpu_release names the paused container and `docker unpause`; the hook says gpu_release's refusal first.
def test_the_epilog_refuses_a_paused_container_naming_docker_unpause_first(docker, runner, tmp_path):  # noqa: F811
    docker.run_holder("suspended", [0])
    docker.docker("pause", "suspended")
    rc, stderr, entry = epilog(docker.host, runner, tmp_path, "954", gpus="0", **FAST)
    assert rc != 0 and not entry["ok"], (stderr, entry)
    assert entry["causes"][0].startswith("GPUs are held by paused containers: suspended (docker "), entry
    assert "`docker unpause suspended` thaws it" in entry["causes"][0], entry
    assert not no_reset_words(stderr + str(entry)) and "reset" not in str(entry["causes"]).lower(), entry
    assert docker.inspect("suspended")["State"]["Paused"] is True  # refused before anything was done
