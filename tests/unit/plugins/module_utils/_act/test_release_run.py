# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Release.run end to end against a fake node: a /proc tree in a temporary directory that
changes as signals arrive and units stop, an nvidia-smi that reads its memory from that tree,
systemctl that records what it is asked, and a clock that only moves when Release sleeps.
Nothing is killed and no time is waited for real."""

from __future__ import annotations

import os
import signal

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _words as words
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _settle
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc
# The fake node (tests/unit/plugins/module_utils/fake_node.py).
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fake_node import (  # noqa: F401
    FOOTPRINT_MIB, FakeSmi, FakeSystem, RELEASE_DELAY_S, RESPAWN_S, SSH_SERVICE, World, fail, params, run, stops, uuid,
)


@pytest.fixture
def world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return World(root)


# ------------------------------------------------------------------ signals


def test_cooperative_holder_exits_on_sigterm(world):
    world.spawn(495, {0: 40960}, argv=("python3", "hold.py", "--gib", "40"))
    result = run(world)
    assert world.signals == [(0.0, 495, "SIGTERM")]
    assert result["killed"] == [
        {
            "pid": 495,
            "name": "python3",
            "cmdline": "python3 hold.py --gib 40",
            "unit": "session-3.scope",
            "container": None,
            "gpu_indexes": [0],
            # its own vLLM server's word (_look/_sleep_mode): nothing listens here
            "sleep_answer": None,
            "signal": "SIGTERM",
            "sigkill_at_once": None,
            "exited_after_s": 0.0,
        }
    ]
    assert (result["changed"], result["released"], result["stopped_units"]) == (True, True, [])
    # GPU 1 read the footprint of GPU 0's context before, and counted free for it.
    assert [(g["memory_used_mib"], g["clean"], g["cross_gpu_footprint"]) for g in result["gpus_before"]] == [(40960, False, False), (4, True, True)]
    assert [g["memory_used_mib"] for g in result["gpus"]] == [0, 0]
    assert result["holders"] == [] and world.t < 1.0
    # nvidia-smi still read the memory for a moment after the exit: the verdict polled for it.
    assert result["timings"]["wait_s"] >= RELEASE_DELAY_S


SIGTERM_MASK = 1 << 14  # bit 15 - 1 of SigIgn/SigCgt


def test_holder_whose_sigterm_handler_does_not_exit_gets_sigkill_after_kill_timeout(world):
    world.spawn(495, {0: 40960}, on_term="ignore", sig_cgt=SIGTERM_MASK)
    result = run(world, kill_timeout=10.0)
    assert [(pid, name) for _t, pid, name in world.signals] == [(495, "SIGTERM"), (495, "SIGKILL")]
    assert world.signals[1][0] == pytest.approx(10.0, abs=0.02)
    assert world.t >= 10.0
    assert result["killed"][0]["signal"] == "SIGKILL"
    assert result["killed"][0]["exited_after_s"] == pytest.approx(10.0, abs=0.02)
    assert result["released"] is True and result["unkillable"] == []


@pytest.mark.parametrize("status, reason", [
    (dict(sig_ign=SIGTERM_MASK), "ignores SIGTERM"),
    (dict(nspid=(4321, 1)), "init of its PID namespace, no SIGTERM handler"),
], ids=["SigIgn", "pid-namespace-init"])
def test_holder_that_sigterm_cannot_reach_gets_sigkill_at_once(world, status, reason):
    world.spawn(495, {0: 40960}, on_term="ignore", **status)
    world.spawn(497, {0: 1000}, argv=("python3", "train.py"))
    result = run(world, kill_timeout=10.0)
    assert world.signals == [(0.0, 495, "SIGKILL"), (0.0, 497, "SIGTERM")]
    killed = {k["pid"]: k for k in result["killed"]}
    assert (killed[495]["signal"], killed[495]["sigkill_at_once"], killed[495]["exited_after_s"]) == ("SIGKILL", reason, 0.0)
    assert (killed[497]["signal"], killed[497]["sigkill_at_once"]) == ("SIGTERM", None)
    assert result["released"] is True and world.t < 1.0


def test_namespace_init_with_a_sigterm_handler_gets_sigterm(world):
    world.spawn(495, {0: 40960}, nspid=(4321, 1), sig_cgt=SIGTERM_MASK)
    result = run(world, kill_timeout=10.0)
    assert world.signals == [(0.0, 495, "SIGTERM")]
    assert result["killed"][0]["sigkill_at_once"] is None


def test_pid_1_of_our_own_namespace_is_no_namespace_init_below_ours(world):
    # NSpid with one entry: the process lives in the reader's own PID namespace.
    world.spawn(495, {0: 40960}, nspid=(495,))
    run(world, kill_timeout=10.0)
    assert world.signals == [(0.0, 495, "SIGTERM")]


def test_sigkilled_at_once_holder_that_does_not_die_is_unkillable(world):
    world.spawn(495, {0: 40960}, sig_ign=SIGTERM_MASK, on_kill="D")
    error = fail(world, kill_timeout=2.0, wait_timeout=5.0)
    assert [name for _t, _pid, name in world.signals] == ["SIGKILL"]
    assert error.result["unkillable"][0]["pid"] == 495 and error.result["unkillable"][0]["sigkill_at_once"] == "ignores SIGTERM"


def test_check_mode_shows_who_would_get_sigkill_at_once(world):
    world.spawn(495, {0: 40960}, sig_ign=SIGTERM_MASK)
    result = run(world, check_mode=True)
    assert world.signals == []
    assert [(k["pid"], k["signal"], k["sigkill_at_once"]) for k in result["killed"]] == [(495, None, "ignores SIGTERM")]


def test_slow_cooperative_holder_is_not_escalated(world):
    world.spawn(495, {0: 40960}, on_term=3.0)
    result = run(world, kill_timeout=10.0)
    assert [name for _t, _pid, name in world.signals] == ["SIGTERM"]
    assert result["killed"][0]["exited_after_s"] == pytest.approx(3.0, abs=0.02)


def test_pid_reused_between_scan_and_signal_is_not_signalled(world):
    world.spawn(495, {0: 40960})

    class ReusedAfterLook(release.Release):
        def look(self):
            snapshot = super().look()
            world.reuse_pid(495)
            return snapshot

    result = run(world, release_class=ReusedAfterLook)
    assert world.signals == []
    assert result["killed"] == []
    assert result["reused_pids"] == [{"pid": 495, "name": "python3", "reason": "PID reused by another process since the scan; not signalled"}]
    assert 495 in world.procs and result["released"] is True


def test_holder_gone_before_the_signal_is_not_reported_killed(world):
    world.spawn(495, {0: 40960})

    class ExitedAfterLook(release.Release):
        def look(self):
            snapshot = super().look()
            world.exit(495)
            return snapshot

    result = run(world, release_class=ExitedAfterLook)
    assert (world.signals, result["killed"], result["reused_pids"], result["released"]) == ([], [], [], True)


def test_orphaned_fork_child_keeps_memory_until_killed(world):
    # The parent was killed; its fork child (now under PID 1) keeps the context. nvidia-smi
    # shows the dead parent's PID as [Not Found] and never the child.
    world.spawn(496, {0: 6662}, argv=("python3", "worker.py"), smi_pid=495, smi_name="[Not Found]")
    result = run(world)
    assert [(pid, name) for _t, pid, name in world.signals] == [(496, "SIGTERM")]
    assert result["released"] is True and result["gpus"][0]["memory_used_mib"] == 0


def test_unkillable_holder_in_d_state_is_reported(world):
    world.spawn(495, {0: 40960}, on_term="ignore", on_kill="D")
    error = fail(world, kill_timeout=2.0, wait_timeout=5.0)
    assert [name for _t, _pid, name in world.signals] == ["SIGTERM", "SIGKILL"]
    assert error.result["unkillable"][0]["pid"] == 495 and error.result["unkillable"][0]["state"] == "D"
    assert ("unkillable (outlived SIGKILL: a thread of it stays in the kernel, D state, in the driver or a file system that does not answer): "
            "pid 495 python3 [python3 serve.py] (unit session-3.scope, state D); a reboot is needed") in error.msg
    assert f"GPU 0 ({uuid(0)}) reads 40960 MiB, held by pid 495 python3" in error.msg


def test_holder_of_an_unselected_gpu_is_left_alone(world):
    world.spawn(495, {0: 1000})
    world.spawn(497, {1: 2000})
    result = run(world, gpus=["1"])
    assert [pid for _t, pid, _name in world.signals] == [497]
    assert result["selected_gpus"] == [1] and result["released"] is True and 495 in world.procs


def test_freeing_one_gpu_next_to_training_leaves_the_trainer_and_accepts_its_footprint(world):
    """The incident on the H200 pair: gpus ["1"] killed the trainer on GPU 0, and GPU 1 could
    never read 0 MiB while GPU 0 trained."""
    world.spawn(495, {0: 40960}, argv=("python3", "train.py"))
    world.spawn(497, {1: 20480}, argv=("python3", "serve.py"))
    result = run(world, gpus=["1"])
    assert [pid for _t, pid, _name in world.signals] == [497] and 495 in world.procs
    after = result["gpus"][1]
    assert (after["memory_used_mib"], after["clean"], after["cross_gpu_footprint"]) == (FOOTPRINT_MIB, True, True)
    assert result["released"] is True and result["gpus"][0]["cross_gpu_footprint"] is False


def test_footprint_allowance_off_means_the_other_gpus_context_keeps_it_dirty(world):
    world.spawn(495, {0: 40960})
    world.spawn(497, {1: 20480})
    error = fail(world, gpus=["1"], cross_gpu_footprint_mib=0, wait_timeout=1.0)
    assert f"GPU 1 ({uuid(1)}) reads 4 MiB" in error.msg and 495 in world.procs


def test_footprint_is_no_excuse_for_memory_a_process_still_uses(world):
    world.spawn(495, {0: 40960})
    world.spawn(497, {1: 3}, on_term="ignore", on_kill="ignore")
    error = fail(world, gpus=["1"], kill_timeout=0.5, wait_timeout=2.0)
    assert f"GPU 1 ({uuid(1)}) reads 3 MiB, held by pid 497" in error.msg


def test_cuda_visible_devices_trainer_on_the_other_gpu_is_left_alone(world):
    world.spawn(495, {0: 40960}, cuda_visible=[0])
    world.spawn(497, {1: 20480})
    result = run(world, gpus=["1"])
    assert [pid for _t, pid, _name in world.signals] == [497] and 495 in world.procs
    assert result["gpus"][1]["memory_used_mib"] == 0 and result["gpus"][1]["cross_gpu_footprint"] is False


def test_orphan_on_gpu_1_is_freed_with_gpu_1_and_left_alone_for_gpu_0(world):
    world.spawn(495, {0: 40960})
    world.spawn(752, {1: 2566}, argv=("python3", "worker.py"), smi_pid=751, smi_name="[Not Found]")
    result = run(world, gpus=["0"])
    assert [pid for _t, pid, _name in world.signals] == [495] and 752 in world.procs
    assert result["gpus"][0]["memory_used_mib"] == FOOTPRINT_MIB and result["released"] is True
    result = run(world, gpus=["1"])
    assert [pid for _t, pid, _name in world.signals][-1] == 752 and result["released"] is True


def test_nvml_monitors_survive_freeing_every_gpu(world):
    dmon_fds, dmon_maps = fakeproc.nvml_client([0, 1], "dmon")
    world.spawn(600, comm="nvidia-smi", argv=("nvidia-smi", "dmon", "-d", "1"), devices=dmon_fds, maps=dmon_maps)
    nvml_fds, _maps = fakeproc.nvml_client([0, 1], "pynvml")
    world.spawn(601, argv=("python3", "exporter.py"), devices=nvml_fds)
    world.spawn(495, {0: 40960})
    result = run(world)
    assert [pid for _t, pid, _name in world.signals] == [495] and {600, 601} <= set(world.procs)
    assert result["released"] is True
    assert sorted((h["pid"], h["attribution"]) for h in result["holders"]) == [(600, "nvml_client"), (601, "nvml_client")]


def test_host_with_only_monitors_is_clean_and_untouched(world):
    dmon_fds, dmon_maps = fakeproc.nvml_client([0, 1], "dmon")
    world.spawn(600, comm="nvidia-smi", argv=("nvidia-smi", "dmon"), devices=dmon_fds, maps=dmon_maps)
    result = run(world)
    assert (result["changed"], result["released"], world.signals) == (False, True, [])


def test_undecided_process_is_reported_not_signalled_for_one_gpu(world):
    small = [("/dev/nvidia0", 64), ("/dev/nvidia0", 64), ("/dev/nvidia1", 64), ("/dev/nvidia1", 64)]
    world.spawn(733, {1: 500}, argv=("python3", "odd.py"), maps=small, visible=False)
    error = fail(world, gpus=["1"], wait_timeout=1.0)
    assert world.signals == [] and error.result["undecided"] == [
        {"pid": 733, "name": "python3", "cmdline": "python3 odd.py", "candidate_gpu_indexes": [0, 1]}
    ]
    assert "possibly held by pid 733 python3 [python3 odd.py]" in error.msg
    result = run(world)
    assert [pid for _t, pid, _name in world.signals] == [733] and result["released"] is True


def test_match_limits_who_is_signalled(world):
    world.spawn(495, {0: 1000}, argv=("python3", "-m", "vllm.entrypoints.openai.api_server"))
    world.spawn(496, {0: 2000}, argv=("python3", "train.py"))
    error = fail(world, match=["vllm"], wait_timeout=5.0)
    assert [pid for _t, pid, _name in world.signals] == [495]
    assert f"GPU 0 ({uuid(0)}) reads 2000 MiB, held by pid 496 python3" in error.msg


def test_kill_false_signals_nobody(world):
    world.spawn(495, {0: 1000})
    error = fail(world, kill=False, wait_timeout=1.0)
    assert world.signals == [] and error.result["killed"] == [] and error.result["changed"] is False


def test_holder_in_a_container_whose_runtime_cannot_be_asked_is_signalled_and_watched(world):
    container = "4f3c2b1a" * 8
    world.spawn(495, {0: 1000}, cgroup=f"0::/system.slice/docker-{container}.scope\n")
    result = run(world)
    assert [pid for _t, pid, _name in world.signals] == [495] and result["killed"][0]["container"] == container
    assert any("container 4f3c2b1a4f3c (docker) could not be stopped through its runtime" in warning for warning in result["warnings"])
    # Nothing came back within the settle window (see _settle): released, after watching for it.
    assert result["released"] is True and result["timings"]["settle_s"] == pytest.approx(_settle.SETTLE_S, abs=0.3)


# ------------------------------------------------------------------ units


def test_unit_owning_a_holder_is_stopped_and_the_holder_not_signalled(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 70000}, unit="vllm.service", argv=("python3", "-m", "vllm.entrypoints.openai.api_server"))
    result = run(world)
    assert ["stop", "--no-block", "--no-ask-password", "vllm.service"] in world.systemctl_log
    assert world.signals == [] and result["killed"] == []
    assert result["stopped_units"] == ["vllm.service"] and result["released"] is True and result["changed"] is True
    assert "disable" not in [args[0] for args in world.systemctl_log]


def test_restart_always_unit_is_stopped_not_fought(world):
    world.unit("vllm.service", restart=True)
    world.spawn(495, {0: 70000}, unit="vllm.service")
    result = run(world)
    world.advance(2 * RESPAWN_S)
    assert result["released"] is True and not world.procs


def test_service_state_disabled_disables_named_enabled_units_only(world):
    world.unit("vllm-a.service")  # active, enabled: stop + disable
    world.unit("vllm-b.service", active="inactive", sub="dead")  # enabled: disable
    world.unit("vllm-c.service", active="inactive", sub="dead", file_state="disabled")  # nothing to do
    world.unit("sglang.service")  # not named, owns a holder: stopped, never disabled
    world.spawn(495, {0: 1000}, unit="vllm-a.service")
    world.spawn(496, {1: 1000}, unit="sglang.service")
    result = run(world, services=["vllm*.service"], service_state="disabled")
    assert stops(world) == [
        ["stop", "--no-block", "--no-ask-password", "vllm-a.service", "sglang.service"],
        ["disable", "--no-reload", "--no-ask-password", "vllm-a.service", "vllm-b.service"],
    ]
    assert result["stopped_units"] == ["vllm-a.service", "sglang.service"]
    assert result["disabled_units"] == ["vllm-a.service", "vllm-b.service"]
    assert world.signals == [] and result["released"] is True


def test_service_state_masked(world):
    world.unit("vllm.service")
    result = run(world, services=["vllm"], service_state="masked")
    assert stops(world) == [["stop", "--no-block", "--no-ask-password", "vllm.service"], ["mask", "--no-reload", "--no-ask-password", "vllm.service"]]
    assert result["masked_units"] == ["vllm.service"] and "disabled_units" not in result


def test_second_run_with_disabled_services_changes_nothing(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 1000}, unit="vllm.service")
    first = run(world, services=["vllm.service"], service_state="disabled")
    world.systemctl_log[:] = []
    second = run(world, services=["vllm.service"], service_state="disabled")
    assert (first["changed"], second["changed"], second["released"]) == (True, False, True)
    assert stops(world) == [] and second["disabled_units"] == []


def test_named_service_that_does_not_exist_is_reported(world):
    result = run(world, services=["tgi.service"])
    assert result["services_not_found"] == ["tgi.service"] and stops(world) == [] and result["changed"] is False


def test_own_session_unit_is_never_stopped_even_when_a_holder_lives_in_it(tmp_path):
    # Without pam_systemd the Ansible session runs inside ssh.service, and so does anything
    # started from an interactive login: stopping the unit would cut the session.
    root = tmp_path / "proc"
    root.mkdir()
    world = World(root, session_cgroup=SSH_SERVICE)
    world.unit("ssh.service")
    world.spawn(600, {0: 5000}, cgroup=SSH_SERVICE, argv=("python3", "notebook.py"))
    result = run(world)
    assert stops(world) == [] and result["stopped_units"] == []
    assert [(pid, name) for _t, pid, name in world.signals] == [(600, "SIGTERM")]
    assert result["released"] is True and (root / "4000").is_dir() and (root / str(world.mypid)).is_dir()


def test_named_service_running_the_session_is_refused(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    world = World(root, session_cgroup=SSH_SERVICE)
    world.unit("ssh.service")
    error = fail(world, services=["ssh"])
    assert "refusing to stop ssh.service" in error.msg and stops(world) == []


def test_unit_of_a_protected_process_is_never_stopped(world):
    world.unit("nvidia-persistenced.service")
    world.spawn(
        812,
        {},
        unit="nvidia-persistenced.service",
        comm="nvidia-persiste",
        exe="/usr/bin/nvidia-persistenced",
        argv=("/usr/bin/nvidia-persistenced", "--user", "nvidia-persistenced"),
        devices=["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"],
    )
    error = fail(world, services=["nvidia-persistenced"])
    assert "refusing to stop nvidia-persistenced.service" in error.msg and stops(world) == []


# ------------------------------------------------------------------ check mode and clean hosts


def test_check_mode_sends_nothing_and_reports_the_plan(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 70000}, unit="vllm.service")
    world.spawn(497, {1: 1000}, argv=("python3", "train.py"))
    result = run(world, check_mode=True)
    assert world.signals == [] and stops(world) == []
    assert (result["changed"], result["released"], result["stopped_units"]) == (True, False, ["vllm.service"])
    assert [(k["pid"], k["signal"], k["exited_after_s"]) for k in result["killed"]] == [(497, None, None)]  # 495 ends with vllm.service
    assert [g["memory_used_mib"] for g in result["gpus"]] == [70000, 1000]
    assert set(world.procs) >= {495, 497}


def test_check_mode_on_a_clean_host_has_nothing_to_do(world):
    result = run(world, check_mode=True)
    assert (result["changed"], result["released"], result["killed"], result["stopped_units"]) == (False, True, [], [])


def test_clean_host_changes_nothing(world):
    smi_calls = []

    class Counting(release.Release):
        def run(self):
            try:
                return super().run()
            finally:
                smi_calls.append(self.smi.calls)

    result = run(world, release_class=Counting)
    assert (result["changed"], result["released"], result["killed"], result["stopped_units"]) == (False, True, [], [])
    assert world.systemctl_log == [] and world.signals == []
    assert [g["memory_used_mib"] for g in result["gpus"]] == [0, 0]


def test_persistenced_opening_every_gpu_is_an_nvml_client_left_alone(world):
    """nvidia-persistenced opens every GPU's node and maps none: it uses no GPU memory, so it is
    neither a holder to report nor one to signal, even when every GPU is freed."""
    world.spawn(
        812,
        {},
        comm="nvidia-persiste",
        exe="/usr/bin/nvidia-persistenced",
        argv=("/usr/bin/nvidia-persistenced",),
        devices=["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"],
    )
    world.spawn(495, {0: 40960})
    result = run(world)
    assert result["protected"] == [] and [k["pid"] for k in result["killed"]] == [495]
    assert [(h["pid"], h["attribution"], h["gpu_indexes"], h["protected"]) for h in result["holders"]] == [(812, "nvml_client", [], True)]


# ------------------------------------------------------------------ failures


def test_protected_only_memory_fails_at_once_naming_the_protected_process(world):
    world.spawn(812, {0: 500}, comm="nvidia-persiste", exe="/usr/bin/nvidia-persistenced", argv=("/usr/bin/nvidia-persistenced",))
    error = fail(world, wait_timeout=60.0)
    assert world.t < 2.0, f"waited {world.t:.1f} s for a GPU that only a protected process holds"
    assert error.msg.startswith("GPUs are held only by protected processes")
    assert "pid 812 nvidia-persiste [/usr/bin/nvidia-persistenced] (unit session-3.scope, state S, protected)" in error.msg
    assert world.signals == [] and error.result["released"] is False


def test_user_protected_process_is_never_signalled(world):
    world.spawn(900, {0: 500}, comm="jupyter-lab", argv=("/opt/conda/bin/python3", "/opt/conda/bin/jupyter-lab"))
    error = fail(world, protect=["jupyter-lab"])
    assert world.signals == [] and "pid 900 jupyter-lab" in error.msg and world.t < 2.0


def test_leaked_memory_with_no_holder_fails_after_a_short_grace_not_after_wait_timeout(world):
    world.leaked.append((0, 427, "[Not Found]", 3590))
    error = fail(world, wait_timeout=60.0)
    assert release.NO_HOLDER_GRACE_S <= world.t < 3.0 and world.signals == []
    assert error.msg.startswith(words.EARLY_HEADS["no_holder"])
    assert "attributed to exited process(es) 427 [Not Found]" in error.msg
    assert "a GPU reset or a reboot is needed" in error.msg and "`nvidia-smi --gpu-reset -i 0`" in error.msg
    assert error.result["gpus"][0]["memory_used_mib"] == 3590 and error.result["released"] is False


def test_leaked_memory_is_predicted_by_check_mode_with_the_real_runs_message(world):
    world.leaked.append((0, 427, "[Not Found]", 3590))
    real = fail(world, wait_timeout=60.0).msg
    world.t = 0.0
    predicted = fail(world, check_mode=True, wait_timeout=60.0)
    assert predicted.msg == real and world.t < 3.0 and world.signals == []
    assert predicted.result["released"] is False


def test_idle_mig_gpus_with_the_default_baseline_fail_fast_with_the_max_used_mib_to_set(world):
    world.mig, world.baseline = True, {0: 55, 1: 55}
    error = fail(world, wait_timeout=60.0)
    assert world.t < 3.0 and world.signals == []
    assert "idle baseline (MIG mode is enabled), not a leak; set max_used_mib: 64 (its 55 MiB reading with a margin" in error.msg, error.msg
    assert "reset" not in error.msg and "reboot" not in error.msg
    world.t = 0.0
    assert fail(world, check_mode=True, wait_timeout=60.0).msg == error.msg and world.t < 3.0
    assert run(world, max_used_mib=55)["released"] is True


def test_memory_freeing_right_after_the_look_is_not_called_a_leak(world):
    world.leaked.append((0, 427, "[Not Found]", 3590))

    class Freeing(release.Release):
        def _read_gpus(self):
            world.leaked[:] = []  # the context the look saw is freed by the first reading
            return super()._read_gpus()

    result = run(world, release_class=Freeing, check_mode=True)
    assert result["released"] is False and world.t < 3.0


def test_check_mode_predicts_gpus_held_only_by_protected_processes(world):
    world.spawn(900, {0: 500}, comm="jupyter-lab", argv=("/opt/conda/bin/python3", "/opt/conda/bin/jupyter-lab"))
    error = fail(world, check_mode=True, protect=["jupyter-lab"])
    assert error.msg.startswith(words.EARLY_HEADS["protected"]) and "pid 900 jupyter-lab" in error.msg
    assert world.signals == []


def test_check_mode_predicts_kill_false_with_holders(world):
    world.spawn(900, {1: 500})
    error = fail(world, check_mode=True, kill=False)
    assert error.msg.startswith(words.EARLY_HEADS["not_killed"]) and "GPU 1" in error.msg and "pid 900" in error.msg
    assert world.signals == [] and world.procs


def test_kill_timeout_0_does_not_call_a_process_that_died_on_sigkill_unkillable(world):
    # The kernel takes ~0.15 s to tear down a large CUDA process after SIGKILL (real H200).
    world.spawn(900, {0: 500}, on_term="ignore", on_kill=0.15)
    result = run(world, kill_timeout=0.0)
    assert result["released"] is True and result["unkillable"] == [], result["unkillable"]
    assert [k["signal"] for k in result["killed"]] == ["SIGKILL"]


def test_gpus_and_protect_accept_ascii_digits_only(world):
    world.spawn(900, {0: 500})
    error = fail(world, gpus=["\u00b2"])
    assert "GPU '\u00b2' is not on this host" in error.msg
    assert run(world, protect=["\u00b3"])["released"] is True


def test_failure_result_carries_a_diff(world):
    world.leaked.append((1, 427, "[No data]", 12))
    error = fail(world, wait_timeout=1.0)
    assert f"GPU 1 {uuid(1)}: 12 MiB" in error.result["diff"]["after"]


def test_unknown_gpu_in_the_request_is_refused_before_anything_happens(world):
    world.spawn(495, {0: 1000})
    error = fail(world, gpus=["7"])
    assert "it has indexes 0, 1" in error.msg and world.signals == []
    # The look asked systemd which unit the holder runs in (a read, _unit_owner), and nothing else.
    assert world.systemctl_log == [["show", "--property=Id,ControlGroup", "--no-pager", "--", "session-3.scope"]]


def test_a_refused_request_fails_with_its_message_alone_and_a_refused_plan_with_the_result_so_far(world):
    # The one ReleaseError of Release.run: before a GPU is selected the request itself is wrong (no
    # result); a plan refused later (spanning) carries the result of the look, without a diff.
    world.spawn(495, {0: 1000})
    assert fail(world, gpus=["7"]).result == {}
    world.spawn(496, {0: 1000, 1: 1000})
    error = fail(world, gpus=[0])
    assert error.msg.startswith("refusing to free GPU 0") and error.result["selected_gpus"] == [0]
    assert [s["pid"] for s in error.result["spanning"]] == [496] and "diff" not in error.result


# ------------------------------------------------------------------ regressions of bugs found in review


def test_gpu_pod_under_containerd_service_never_stops_containerd(world):
    world.unit("containerd.service")
    pod = "0::/system.slice/containerd.service/kubepods-burstable-pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901.slice:cri-containerd:%s\n" % ("4f3c2b1a" * 8)
    world.spawn(495, {0: 40960}, cgroup=pod)
    error = fail(world)
    assert ["stop", "--no-block", "--no-ask-password", "containerd.service"] not in world.systemctl_log
    # A pod is never signalled either (_containers): the run fails before acting, naming the pod.
    assert world.signals == [] and "pod UID 1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901" in error.msg and "drain" in error.msg


def test_check_mode_plan_matches_what_the_real_run_does(tmp_path):
    results = []
    for check_mode in (True, False):
        root = tmp_path / ("check" if check_mode else "real")
        root.mkdir()
        world = World(root)
        world.unit("vllm.service")
        world.spawn(495, {0: 70000}, unit="vllm.service")
        world.spawn(497, {1: 1000}, argv=("python3", "train.py"))
        results.append(run(world, check_mode=check_mode))
    planned, done = results
    assert planned["stopped_units"] == done["stopped_units"] == ["vllm.service"]
    assert [k["pid"] for k in planned["killed"]] == [k["pid"] for k in done["killed"]] == [497]


def test_desktop_gpu_held_by_the_compositor_is_not_blamed_on_the_driver(world):
    world.spawn(1500, {0: 300}, comm="Xorg", exe="/usr/lib/xorg/Xorg", argv=("/usr/lib/xorg/Xorg", "vt2"), visible=False)
    error = fail(world, wait_timeout=5.0)
    assert world.signals == []
    assert "pid 1500 Xorg" in error.msg and "set max_used_mib" in error.msg and "held only by protected" in error.msg


# ------------------------------------------------------------------ workloads and launchers (issue 12)

ATD = "0::/system.slice/atd.service\n"
SLURMD = "0::/system.slice/slurmd.service\n"


def test_job_started_by_atd_is_signalled_and_atd_keeps_running(world):
    world.unit("atd.service")
    world.spawn(200, {}, unit="atd.service", comm="atd", argv=("/usr/sbin/atd", "-f"), exe="/usr/sbin/atd", devices=[])
    world.spawn(201, {}, unit="atd.service", comm="atd", argv=("/usr/sbin/atd", "-f"), exe="/usr/sbin/atd", devices=[], ppid=200)
    world.spawn(202, {0: 4000}, unit="atd.service", comm="train", argv=("python3", "train.py"), ppid=201)
    result = run(world)
    assert stops(world) == [] and result["stopped_units"] == []
    assert [(pid, name) for _t, pid, name in world.signals] == [(202, "SIGTERM")]
    assert result["launchers"] == [{"unit": "atd.service", "reason": result["launchers"][0]["reason"], "pids": [202], "slurm_job_id": None}]
    assert {200, 201} <= set(world.procs) and result["released"] is True


def test_slurm_job_in_slurmds_cgroup_is_signalled_and_named_with_its_job_id(world):
    # cgroup v1 + proctrack/linuxproc (measured on the fleet, Debian 12's slurm 22.05): the job's
    # tasks sit in slurmd.service's cgroup, under a slurmstepd reparented to PID 1.
    world.unit("slurmd.service")
    world.spawn(300, {}, unit="slurmd.service", comm="slurmd", argv=("/usr/sbin/slurmd", "-D", "-s"), exe="/usr/sbin/slurmd", devices=[])
    world.spawn(301, {}, unit="slurmd.service", comm="slurmstepd", argv=("slurmstepd: [7.batch]",), exe="/usr/sbin/slurmstepd", devices=[])
    world.spawn(302, {1: 8000}, unit="slurmd.service", comm="train", ppid=301, environ={"SLURM_JOB_ID": "7", "HOME": "/root"})
    result = run(world)
    assert stops(world) == [] and [pid for _t, pid, _n in world.signals] == [302]
    assert [(e["unit"], e["pids"], e["slurm_job_id"]) for e in result["launchers"]] == [("slurmd.service", [302], "7")]
    assert {300, 301} <= set(world.procs)


def test_renamed_notebook_hub_is_recognised_by_its_main_process_and_only_the_kernel_goes(world):
    world.unit("notebook-hub.service")
    world.spawn(400, {}, unit="notebook-hub.service", comm="jupyterhub", argv=("/usr/bin/python3", "/usr/local/bin/jupyterhub"), devices=[])
    world.spawn(401, {0: 3000}, unit="notebook-hub.service", comm="python3", argv=("python3", "-m", "ipykernel_launcher"), ppid=400)
    world.spawn(402, {1: 3000}, unit="notebook-hub.service", comm="python3", argv=("python3", "-m", "ipykernel_launcher"), ppid=400)
    result = run(world, gpus=["0"])
    assert stops(world) == [] and [pid for _t, pid, _n in world.signals] == [401]
    assert result["launchers"][0]["unit"] == "notebook-hub.service" and "jupyterhub" in result["launchers"][0]["reason"]
    assert {400, 402} <= set(world.procs)


def test_vllm_v1_shape_main_without_gpu_is_stopped_through_its_unit_and_not_respawned(world):
    world.unit("vllm.service", restart=True)
    world.spawn(500, {}, unit="vllm.service", comm="vllm", argv=("/usr/bin/python3", "/usr/bin/vllm", "serve"), devices=[])
    world.spawn(501, {0: 70000, 1: 70000}, unit="vllm.service", comm="VLLM::EngineCor", argv=("VLLM::EngineCore",), ppid=500)
    result = run(world)
    world.advance(2 * RESPAWN_S)
    assert result["stopped_units"] == ["vllm.service"] and result["launchers"] == [] and world.signals == []
    assert not world.procs and result["released"] is True


def test_workload_unit_holding_other_gpus_is_refused_before_acting_and_stopped_with_kill_spanning(world):
    world.unit("vllm.service")
    world.spawn(600, {}, unit="vllm.service", comm="VLLM::EngineCor", argv=("VLLM::EngineCore",), devices=["/dev/nvidiactl"])
    world.spawn(601, {0: 1000}, unit="vllm.service", comm="VLLM::Worker_TP", ppid=600)
    world.spawn(602, {1: 1000}, unit="vllm.service", comm="VLLM::Worker_TP", ppid=600)
    for check_mode in (True, False):
        with pytest.raises(release.ReleaseError) as info:
            run(world, check_mode=check_mode, gpus=["1"])
        assert stops(world) == [] and world.signals == [] and {600, 601, 602} <= set(world.procs)
        assert "unit vllm.service (pids 602) holds GPUs 0,1; GPU 0 is outside the selection" in info.value.msg
        assert "Nothing was stopped or signalled" in info.value.msg and "kill_spanning" in info.value.msg
        [entry] = info.value.result["spanning"]
        assert (entry["unit"], entry["gpu_indexes"], entry["outside_gpus"]) == ("vllm.service", [0, 1], [0])
    result = run(world, gpus=["1"], kill_spanning=True)
    assert result["stopped_units"] == ["vllm.service"] and result["released"] is True and not world.procs
    assert result["spanning"][0]["unit"] == "vllm.service"


def test_spanning_process_is_not_signalled_for_a_partial_selection_and_the_failure_names_it(world):
    # JAX preallocates on every visible GPU: nvidia-smi lists the process on GPU 0 and GPU 1.
    world.spawn(700, {0: 60000, 1: 60000}, comm="python3", argv=("python3", "jax_train.py"))
    world.spawn(701, {1: 2000}, comm="python3", argv=("python3", "other.py"))
    for check_mode in (True, False):
        with pytest.raises(release.ReleaseError) as info:
            run(world, check_mode=check_mode, gpus=["1"])
        assert world.signals == [] and {700, 701} <= set(world.procs), "signalled before refusing"
        msg = info.value.msg
        assert msg.startswith("refusing to free GPU 1:") and "pid 700 python3 [python3 jax_train.py]" in msg
        assert "uses GPUs 0,1; GPU 0 is outside the selection" in msg and "701" not in msg
        assert info.value.result["killed"] == [] and info.value.result["stopped_units"] == []
        [entry] = info.value.result["spanning"]
        assert (entry["pid"], entry["cmdline"], entry["gpu_indexes"], entry["outside_gpus"]) == (700, "python3 jax_train.py", [0, 1], [0])


def test_kill_spanning_ends_the_spanning_process(world):
    world.spawn(700, {0: 60000, 1: 60000}, comm="python3", argv=("python3", "jax_train.py"))
    result = run(world, gpus=["1"], kill_spanning=True)
    assert [pid for _t, pid, _n in world.signals] == [700] and result["released"] is True
    assert [k["pid"] for k in result["killed"]] == [700] and result["spanning"][0]["outside_gpus"] == [0]


def test_nothing_spans_when_every_gpu_it_uses_is_selected(world):
    world.spawn(700, {0: 60000, 1: 60000}, comm="python3", argv=("python3", "jax_train.py"))
    result = run(world, gpus=["0", "1"])
    assert result["spanning"] == [] and [k["pid"] for k in result["killed"]] == [700] and result["released"] is True


def test_match_decides_what_would_be_signalled_and_so_what_spans(world):
    world.spawn(700, {0: 60000, 1: 60000}, comm="python3", argv=("python3", "jax_train.py"))
    world.spawn(701, {1: 2000}, comm="python3", argv=("python3", "other.py"))
    result = run(world, check_mode=True, gpus=["1"], match=["other"])
    assert result["spanning"] == [] and [k["pid"] for k in result["killed"]] == [701] and 700 in world.procs


def test_check_mode_lists_the_launcher_plan_a_real_run_carries_out(tmp_path):
    results = []
    for check_mode in (True, False):
        root = tmp_path / ("check" if check_mode else "real")
        root.mkdir()
        world = World(root)
        world.unit("atd.service")
        world.unit("vllm.service")
        world.spawn(200, {}, unit="atd.service", comm="atd", argv=("/usr/sbin/atd", "-f"), exe="/usr/sbin/atd", devices=[])
        world.spawn(202, {0: 4000}, unit="atd.service", comm="train", ppid=200)
        world.spawn(500, {1: 4000}, unit="vllm.service")
        results.append(run(world, check_mode=check_mode))
        if check_mode:
            assert world.signals == [] and stops(world) == []
    planned, done = results
    assert planned["stopped_units"] == done["stopped_units"] == ["vllm.service"]
    assert [k["pid"] for k in planned["killed"]] == [k["pid"] for k in done["killed"]] == [202]
    assert planned["launchers"] == done["launchers"] and planned["launchers"][0]["unit"] == "atd.service"


# ------------------------------------------------------------------ bounded systemd (issue 12)


def test_term_ignoring_unit_with_the_default_timeoutstopsec_is_freed_within_kill_timeout(world):
    world.unit("stubborn.service", restart=True, timeout_stop=90.0)
    world.spawn(700, {0: 4096}, unit="stubborn.service", on_term="ignore")
    result = run(world, kill_timeout=2.0)
    assert result["released"] is True and world.t < 2.0 + 1.0, f"waited {world.t:.1f} s (TimeoutStopSec is 90 s)"
    assert result["stopped_units"] == ["stubborn.service"] and result["killed_units"] == ["stubborn.service"]
    assert ["(systemd: TimeoutStopSec)", "stubborn.service"] not in world.systemctl_log
    assert ["kill", "--signal=SIGKILL", "--no-ask-password", "stubborn.service"] in world.systemctl_log
    world.advance(2 * RESPAWN_S)
    assert not world.procs and world.units["stubborn.service"]["props"]["ActiveState"] == "failed"


def test_several_units_are_stopped_in_one_call(world):
    for name in ("vllm-a.service", "vllm-b.service", "sglang.service"):
        world.unit(name)
    world.spawn(701, {0: 1000}, unit="vllm-a.service", on_term=0.5)
    world.spawn(702, {1: 1000}, unit="vllm-b.service", on_term=0.5)
    world.spawn(703, {1: 1000}, unit="sglang.service", on_term=0.5)
    result = run(world)
    assert stops(world) == [["stop", "--no-block", "--no-ask-password", "vllm-a.service", "vllm-b.service", "sglang.service"]]
    assert result["timings"]["stop_s"] < 1.0 and result["released"] is True


def test_masking_a_unit_in_etc_is_refused_before_it_is_stopped(world):
    world.unit("vllm.service", fragment="/etc/systemd/system/vllm.service")
    world.spawn(704, {0: 1000}, unit="vllm.service")
    error = fail(world, services=["vllm"], service_state="masked")
    assert "cannot mask vllm.service" in error.msg and stops(world) == [] and world.signals == [] and 704 in world.procs


def test_socket_that_triggers_a_named_service_is_stopped_and_disabled_with_it(world):
    world.unit("vllm.service", triggered_by="vllm.socket")
    world.unit("vllm.socket", sub="listening")
    result = run(world, services=["vllm"], service_state="disabled")
    assert result["stopped_units"] == ["vllm.service", "vllm.socket"] and result["disabled_units"] == ["vllm.service", "vllm.socket"]


def test_star_glob_stops_the_gpu_service_but_not_dbus_journald_or_ssh(world):
    for name in ("dbus.service", "systemd-journald.service", "ssh.service", "vllm.service"):
        world.unit(name)
    result = run(world, services=["*"])
    assert result["stopped_units"] == ["vllm.service"]
    assert sorted(k["unit"] for k in result["kept_units"]) == ["dbus.service", "ssh.service", "systemd-journald.service"]
    assert len([w for w in result["warnings"] if w.startswith("services: kept 3 units")]) == 1


def test_glob_matching_nothing_warns(world):
    result = run(world, services=["tgi*"])
    assert result["warnings"] == ["services: tgi*.service matches no unit on this host"] and result["changed"] is False


# ------------------------------------------------------------------ failures keep the record (issue 12)


def test_kill_false_fails_at_once_naming_the_holders_it_leaves(world):
    world.spawn(495, {0: 1000})
    error = fail(world, kill=False, wait_timeout=60.0)
    assert world.t < 2.0, f"waited {world.t:.1f} s for holders that kill=false never signals"
    assert error.msg.startswith("GPUs are held by processes that kill=false leaves running") and "pid 495 python3" in error.msg


def test_kill_false_after_stopping_a_unit_fails_fast_and_keeps_stopped_units(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 1000}, unit="vllm.service")
    world.spawn(496, {1: 1000})
    error = fail(world, kill=False, wait_timeout=60.0)
    assert world.t < 3.0 and error.result["stopped_units"] == ["vllm.service"] and "pid 496" in error.msg


def test_unreadable_memory_fails_at_once(world):
    world.spawn(495, {0: 1000})
    world.unreadable.add(0)
    error = fail(world, wait_timeout=60.0)
    assert world.t < 2.0 and error.msg.startswith("GPU memory cannot be read") and error.result["killed"][0]["pid"] == 495


def test_nvidia_smi_failing_after_the_signal_keeps_killed_and_stopped_units(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 1000}, unit="vllm.service")
    world.spawn(496, {1: 1000})

    class LostAfterActing(FakeSmi):
        def query_gpus(self, fields=smi.GPU_FIELDS, gpus=None, meanwhile=None):
            if world.signals:
                raise smi.NvidiaSmiError("Unable to determine the device handle for GPU0000:18:00.0: GPU is lost", cmd=["nvidia-smi"], rc=15)
            return super().query_gpus(fields, gpus, meanwhile)

    worker = release.Release(LostAfterActing(world), FakeSystem(world), params(), driver_root=str(world.root.parent / "none"))
    with pytest.raises(release.ReleaseError) as info:
        worker.run()
    assert "GPU is lost" in info.value.msg
    assert info.value.result["stopped_units"] == ["vllm.service"]
    assert [(k["pid"], k["signal"]) for k in info.value.result["killed"]] == [(496, "SIGTERM")] and info.value.result["rc"] == 15


def test_permission_error_on_the_second_signal_keeps_the_first_in_killed(world):
    world.spawn(495, {0: 1000}, on_term="ignore")
    world.spawn(496, {1: 1000})

    class NoKill(FakeSystem):
        def signal(self, pid, signum):
            if signum == signal.SIGKILL:
                raise PermissionError(1, "Operation not permitted")
            return super().signal(pid, signum)

    worker = release.Release(FakeSmi(world), NoKill(world), params(kill_timeout=1.0), driver_root=str(world.root.parent / "none"))
    with pytest.raises(release.ReleaseError) as info:
        worker.run()
    assert "not permitted to signal pid 495" in info.value.msg
    assert [(k["pid"], k["signal"]) for k in info.value.result["killed"]] == [(495, "SIGTERM"), (496, "SIGTERM")]
    assert all("start_time" not in k and "_first_signal" not in k for k in info.value.result["killed"])


# ------------------------------------------------------------------ pidfd signalling (issue 12)


class FakePidfd:
    """pidfd_open pins the process that has the PID now; a signal through it reaches that
    process or, if it has exited, nobody (ESRCH), never a newcomer with the same PID."""

    def __init__(self, world):
        self.world = world
        self.fds = {}
        self.opened = []

    def open(self, pid):
        proc = self.world.procs.get(pid)
        if proc is None:
            raise ProcessLookupError(pid)
        fd = 100 + len(self.opened)
        self.fds[fd] = proc
        self.opened.append(pid)
        return fd

    def send(self, fd, signum):
        proc = self.fds[fd]
        if self.world.procs.get(proc.pid) is not proc:
            raise ProcessLookupError(proc.pid)
        self.world.signals.append((round(self.world.t, 3), proc.pid, signal.Signals(signum).name))
        FakeSystem(self.world).deliver(proc.pid, signum)

    def close(self, fd):
        del self.fds[fd]


def pidfd_system(world, pidfd):
    system = FakeSystem(world)
    system.pidfd = pidfd

    def no_kill(pid, signum):
        raise AssertionError("kill() used although a pidfd is available")

    system.signal = no_kill
    return system


def test_pidfd_path_signals_through_the_pidfd_and_closes_it(world):
    world.spawn(495, {0: 1000}, on_term="ignore")
    pidfd = FakePidfd(world)
    result = release.Release(FakeSmi(world), pidfd_system(world, pidfd), params(kill_timeout=1.0), driver_root="/none").run()
    assert [(pid, name) for _t, pid, name in world.signals] == [(495, "SIGTERM"), (495, "SIGKILL")]
    assert pidfd.opened == [495, 495] and pidfd.fds == {} and result["released"] is True


def test_pidfd_path_pid_reused_after_the_open_is_never_signalled(world):
    world.spawn(495, {0: 1000})
    pidfd = FakePidfd(world)
    opened = pidfd.open

    def open_then_reuse(pid):
        fd = opened(pid)
        world.reuse_pid(pid)  # the holder exits and a newcomer gets its PID, after the open
        return fd

    pidfd.open = open_then_reuse
    result = release.Release(FakeSmi(world), pidfd_system(world, pidfd), params(), driver_root="/none").run()
    assert world.signals == [] and result["reused_pids"][0]["pid"] == 495 and 495 in world.procs


def test_pidfd_path_pid_reused_between_the_check_and_the_signal_reaches_nobody(world):
    world.spawn(495, {0: 1000})
    pidfd = FakePidfd(world)
    sent = pidfd.send

    def reuse_then_send(fd, signum):
        world.reuse_pid(495)  # the window the start-time check alone cannot close
        return sent(fd, signum)

    pidfd.send = reuse_then_send
    result = release.Release(FakeSmi(world), pidfd_system(world, pidfd), params(), driver_root="/none").run()
    assert world.signals == [] and world.procs[495].spec["comm"] == "bash" and result["killed"] == []


def test_without_pidfd_the_start_time_is_checked_again_before_sigkill(world):
    # Python 3.8 nodes: the holder ignores SIGTERM, exits, and its PID is reused before SIGKILL.
    world.spawn(495, {0: 1000}, on_term="ignore")
    system = FakeSystem(world)
    assert system.pidfd is None
    world.at(0.5, lambda: world.reuse_pid(495))
    result = release.Release(FakeSmi(world), system, params(kill_timeout=1.0), driver_root="/none").run()
    assert [(pid, name) for _t, pid, name in world.signals] == [(495, "SIGTERM")]
    assert world.procs[495].spec["comm"] == "bash" and result["killed"][0]["signal"] == "SIGTERM"


# ------------------------------------------------------------------ names as bytes, device spellings


def test_holder_whose_comm_ends_inside_a_multibyte_character_is_found_and_freed(world):
    """A 15-byte comm cut inside a CJK character: read as text, /proc raised, the holder was
    skipped and the run waited 60 s, then advised a GPU reset."""
    world.spawn(495, {0: 40960}, comm="x", argv=("训练脚本.py",))
    stat_path = os.path.join(str(world.root), "495", "stat")
    with open(stat_path, "rb") as handle:
        stat = handle.read()
    with open(stat_path, "wb") as handle:
        handle.write(stat.replace(b"(x)", b"(" + "训练脚本\u3042".encode("utf-8")[:14] + b")"))
    result = run(world, wait_timeout=60.0)
    assert [(pid, name) for _t, pid, name in world.signals] == [(495, "SIGTERM")]
    assert result["released"] is True and world.t < 1.0 and result["killed"][0]["name"] == "训练脚本\ufffd"


def test_gpu_operator_device_spellings_are_found_and_freed(world):
    """On GPU Operator nodes the driver's /dev shows through as /run/nvidia/driver/dev."""
    fds, maps = fakeproc.cuda_process(0, [0, 1])
    world.spawn(495, {0: 40960}, devices=["/run/nvidia/driver" + p for p in fds], maps=[("/run/nvidia/driver" + p, kib) for p, kib in maps])
    fds, maps = fakeproc.cuda_process(1, [0, 1])
    world.spawn(496, {1: 1024}, devices=[p + " (deleted)" for p in fds], maps=[(p + " (deleted)", kib) for p, kib in maps])
    result = run(world)
    assert sorted(pid for _t, pid, _name in world.signals) == [495, 496] and result["released"] is True


def test_failure_message_does_not_call_a_gpu_the_result_reports_clean_through_the_footprint_dirty(world):
    """GPU 0 keeps an unkillable holder; GPU 1 reads only that context's cross-GPU footprint and
    is clean in the result: the message names GPU 0 only, and no reset for GPU 1."""
    world.spawn(495, {0: 40960}, on_term="ignore", on_kill="D")
    world.spawn(497, {1: 20480})
    error = fail(world, kill_timeout=1.0, wait_timeout=2.0)
    gpu1 = error.result["gpus"][1]
    assert (gpu1["memory_used_mib"], gpu1["clean"], gpu1["cross_gpu_footprint"]) == (FOOTPRINT_MIB, True, True)
    assert "GPU 0 (" in error.msg and "GPU 1 (" not in error.msg, error.msg
    assert "reset" not in error.msg


def test_check_mode_diff_shows_the_plan_units_and_processes_as_before_and_after(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 70000}, unit="vllm.service")
    world.spawn(497, {1: 1000}, argv=("python3", "train.py"))
    diff = run(world, check_mode=True, services=["vllm.service"], service_state="disabled")["diff"]
    assert diff["before"] != diff["after"]
    assert "unit vllm.service: active" in diff["before"] and "unit vllm.service: stopped, disabled" in diff["after"]
    assert "process 497 python3: running" in diff["before"]
    assert "process 497 python3: SIGTERM, then SIGKILL after kill_timeout" in diff["after"]
    # the holders that the plan ends (with their unit, or signalled) are gone from `after`
    assert "holder pid 495" in diff["before"] and "holder pid 495" not in diff["after"]
    assert "holder pid 497" in diff["before"] and "holder pid 497" not in diff["after"]


def test_real_run_diff_shows_the_units_stopped_and_the_processes_ended(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 70000}, unit="vllm.service")
    world.spawn(497, {1: 1000}, argv=("python3", "train.py"))
    diff = run(world, services=["vllm.service"], service_state="disabled")["diff"]
    assert "unit vllm.service: active" in diff["before"] and "unit vllm.service: stopped, disabled" in diff["after"]
    assert "process 497 python3: ended by SIGTERM" in diff["after"]


def test_mps_control_daemon_is_not_signalled_in_the_replan_after_a_unit_stop(world):
    """issue 31: the re-plan after stopping a unit (or a container, or a supervisord program) kept
    root's MPS control daemon as a target and sent it SIGTERM. It holds every GPU's node without a
    context (undecided, as on a real H200): never signalled."""
    world.unit("vllm.service")
    world.spawn(495, {0: 70000}, unit="vllm.service", argv=("python3", "-m", "vllm.entrypoints.openai.api_server"))
    world.spawn(30, comm="nvidia-cuda-mps", argv=("nvidia-cuda-mps-control", "-d"), exe="/usr/bin/nvidia-cuda-mps-control",
                devices=["/dev/nvidiactl", "/dev/nvidia0", "/dev/nvidia1"], maps=[("/dev/nvidia0", 64), ("/dev/nvidia1", 64)], visible=False)
    result = run(world)
    assert result["stopped_units"] == ["vllm.service"] and result["released"] is True, result.get("msg")
    assert [pid for _t, pid, _sig in world.signals] == [] and result["killed"] == []
