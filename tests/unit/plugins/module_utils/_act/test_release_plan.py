# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_release, the pure planning steps: which GPUs, which units, which holders, what to say."""

from __future__ import annotations

import inspect
import re
import textwrap

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps, _settle, _signals, _supervisor
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _words as words
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units as units_mod

UUIDS = ["GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5", "GPU-f07bb63c-cd2e-fe8d-534a-d4b919fe9734", "GPU-11111111-2222-3333-4444-555555555555"]
GPUS = [{"index": i, "uuid": u, "memory_used_mib": 0} for i, u in enumerate(UUIDS)]


def holder(pid, gpu_indexes, protected=False, cmdline="python3 train.py", name="python3", unit=None, system_service=False, container=None, state="S"):
    return {
        "pid": pid,
        "name": name,
        "cmdline": cmdline,
        "gpu_indexes": gpu_indexes,
        # What _attribution decides for a process that uses GPUs / uses none.
        "attribution": "listed" if gpu_indexes else "nvml_client",
        "candidate_gpu_indexes": [],
        "protected": protected,
        "unit": unit,
        "system_service": system_service,
        "container": container,
        "state": state,
        "start_time": 1000 + pid,
    }


# ------------------------------------------------------------------ select_gpus


@pytest.mark.parametrize(
    "wanted, selected",
    [
        (None, [0, 1, 2]),
        ([], [0, 1, 2]),
        (["2", "0"], [0, 2]),
        ([1, "1", " 1 "], [1]),
        ([UUIDS[1].upper()], [1]),
        ([UUIDS[2], "0"], [0, 2]),
    ],
    ids=["default-all", "empty-all", "indexes-sorted", "int-and-padded-deduplicated", "uuid-case-insensitive", "uuid-and-index"],
)
def test_select_gpus(wanted, selected):
    assert release.select_gpus(GPUS, wanted) == selected


@pytest.mark.parametrize("wanted", [["7"], ["GPU-deadbeef"], ["-1"], ["0", "3"]], ids=["index-not-on-host", "unknown-uuid", "negative", "one-good-one-bad"])
def test_unknown_gpu_is_refused_naming_what_the_host_has(wanted):
    with pytest.raises(release.StepFailed) as info:
        release.select_gpus(GPUS, wanted)
    assert "is not on this host: it has indexes 0, 1, 2" in info.value.msg
    assert ", ".join(UUIDS) in info.value.msg


def test_wrong_gpu_message_keeps_each_uuid_as_nvidia_smi_prints_it():
    """Issue 55: 'GPU-ab0cf4f6-...' came back as 'gpu-ab0cf4f6-...', which matches nothing the user can grep for."""
    gpus = [{"index": 0, "uuid": "GPU-AB0CF4F6-818D-BE7E-F16B-963690D7C5C5", "memory_used_mib": 0}]
    with pytest.raises(release.StepFailed) as info:
        release.select_gpus(gpus, ["3"])
    assert info.value.msg == "GPU '3' is not on this host: it has indexes 0 and UUIDs GPU-AB0CF4F6-818D-BE7E-F16B-963690D7C5C5"
    assert release.select_gpus(gpus, ["gpu-ab0cf4f6-818d-be7e-f16b-963690d7c5c5"]) == [0]


# ------------------------------------------------------------------ units


@pytest.mark.parametrize(
    "name, unit",
    [
        ("vllm", "vllm.service"),
        ("vllm.service", "vllm.service"),
        (" vllm \n", "vllm.service"),
        ("vllm*", "vllm*.service"),
        ("vllm@1", "vllm@1.service"),
        ("vllm@.service", "vllm@.service"),
        ("sglang.socket", "sglang.socket"),
        ("model-refresh.timer", "model-refresh.timer"),
        ("llama.cpp", "llama.cpp.service"),
    ],
    ids=repr,
)
def test_normalize_unit(name, unit):
    assert units_mod.normalize_unit(name) == unit


KNOWN = {"vllm-a.service", "vllm-b.service", "vllm-embed.service", "ssh.service", "sglang.service", "nvidia-persistenced.service"}


@pytest.mark.parametrize(
    "patterns, units",
    [
        (["vllm*.service"], ["vllm-a.service", "vllm-b.service", "vllm-embed.service"]),
        (["vllm-?"], ["vllm-a.service", "vllm-b.service"]),
        (["vllm-[b-z]*"], ["vllm-b.service", "vllm-embed.service"]),
        (["sglang", "sglang.service", "vllm-a*"], ["sglang.service", "vllm-a.service"]),
        (["tgi.service"], ["tgi.service"]),
        (["tgi*"], []),
        (None, []),
    ],
    ids=["glob-over-known-units", "question-mark", "bracket", "plain-names-deduplicated", "unknown-plain-name-kept", "glob-without-match", "none"],
)
def test_expand_services(patterns, units):
    assert units_mod.expand_services(patterns, KNOWN) == units


def test_parse_list_units_plain_and_bulleted():
    text = textwrap.dedent("""\
        vllm-a.service        loaded    active   running Vllm A
        ● vllm-b.service      not-found inactive dead    vllm-b.service
        ssh.service           loaded    active   running OpenBSD Secure Shell server
        """)
    assert units_mod.parse_list_units(text) == ["vllm-a.service", "vllm-b.service", "ssh.service"]
    assert units_mod.parse_list_units("vllm-a.service enabled enabled\nsglang.service disabled enabled\n") == ["vllm-a.service", "sglang.service"]
    assert units_mod.parse_list_units("") == []


SHOW = textwrap.dedent("""\
    Id=vllm-a.service
    LoadState=loaded
    ActiveState=active
    SubState=running
    UnitFileState=enabled

    Id=missing.service
    LoadState=not-found
    ActiveState=inactive
    SubState=dead
    UnitFileState=

    Id=sglang.service
    LoadState=loaded
    ActiveState=activating
    SubState=auto-restart
    UnitFileState=enabled
    Description=SGLang with a=b in it
    """)


def test_parse_show_multi_unit():
    units = units_mod.parse_show(SHOW)
    assert sorted(units) == ["missing.service", "sglang.service", "vllm-a.service"]
    assert units["vllm-a.service"] == {
        "Id": "vllm-a.service",
        "LoadState": "loaded",
        "ActiveState": "active",
        "SubState": "running",
        "UnitFileState": "enabled",
    }
    assert units["missing.service"]["UnitFileState"] == "" and units["sglang.service"]["Description"] == "SGLang with a=b in it"
    assert units_mod.parse_show("LoadState=loaded\n") == {}


def props(active="active", sub="running", file_state="enabled", load="loaded"):
    return {"LoadState": load, "ActiveState": active, "SubState": sub, "UnitFileState": file_state}


@pytest.mark.parametrize(
    "unit, state, actions",
    [
        (props(), "stopped", (True, False, False)),
        (props(), "disabled", (True, True, False)),
        (props(active="inactive", sub="dead"), "disabled", (False, True, False)),
        (props(active="inactive", sub="dead", file_state="disabled"), "disabled", (False, False, False)),
        (props(active="activating", sub="auto-restart"), "stopped", (True, False, False)),
        (props(active="failed", sub="auto-restart"), "stopped", (True, False, False)),
        (props(active="failed", sub="failed"), "stopped", (False, False, False)),
        (props(active="deactivating", sub="stop-sigterm"), "stopped", (True, False, False)),
        (props(file_state="static"), "disabled", (True, False, False)),
        (props(file_state="enabled-runtime"), "disabled", (True, True, False)),
        (props(file_state="linked"), "disabled", (True, True, False)),
        (props(), "masked", (True, False, True)),
        (props(active="inactive", sub="dead", file_state="masked", load="masked"), "masked", (False, False, False)),
        (props(load="not-found", active="inactive", sub="dead", file_state=""), "disabled", (False, False, False)),
        ({}, "disabled", (False, False, False)),
    ],
    ids=[
        "active-stopped",
        "active-disabled",
        "inactive-but-enabled-is-disabled",
        "already-disabled",
        "auto-restart-counts-as-active",
        "failed-in-auto-restart",
        "failed-for-good",
        "deactivating",
        "static-cannot-be-disabled",
        "enabled-runtime",
        "linked",
        "masked",
        "already-masked",
        "not-found",
        "no-properties",
    ],
)
def test_unit_actions(unit, state, actions):
    assert units_mod.unit_actions(unit, state) == actions


# ------------------------------------------------------------------ targets


HOLDERS = [
    holder(10, [0], cmdline="python3 -m vllm.entrypoints.openai.api_server"),
    holder(11, [1], cmdline="python3 -m vllm.entrypoints.openai.api_server --port 8001"),
    holder(12, [0, 1], cmdline="torchrun train.py"),
    holder(13, [0, 1], protected=True, name="nvidia-persiste", cmdline="/usr/bin/nvidia-persistenced --user nvidia-persistenced"),
    holder(14, [], cmdline="/usr/bin/dcgm-exporter"),
    holder(15, [], cmdline="python3 nvml_probe.py"),
    holder(16, [2], protected=True, cmdline="python3 -m vllm.entrypoints.openai.api_server --port 8002"),
]


@pytest.mark.parametrize(
    "selected, match, targets, protected",
    [
        ([0], [], [10], [13]),
        ([0, 1, 2], [], [10, 11, 12], [13, 16]),
        ([1], [], [11], [13]),
        ([0], ["vllm"], [10], [13, 16]),
        ([0], ["nvml_probe"], [15], [13]),
        ([0, 1, 2], ["persistenced"], [], [13, 16]),
        ([2], [], [], [16]),
    ],
    ids=[
        "selected-gpu-holders-not-the-one-spanning-two",
        "all-gpus",
        "holder-of-unselected-gpu-only-is-left-alone",
        "match-narrows",
        "nvml-client-only-when-matched",
        "protected-never-targeted-even-when-matched",
        "protected-only",
    ],
)
def test_plan_targets(selected, match, targets, protected):
    found, kept = release.plan_targets(HOLDERS, selected, [re.compile(m) for m in match])
    assert ([h["pid"] for h in found], [h["pid"] for h in kept]) == (targets, protected)


@pytest.mark.parametrize("selected, targets", [([0], [10, 12]), ([1], [11, 12]), ([2], [])])
def test_kill_spanning_targets_the_holder_that_also_uses_unselected_gpus(selected, targets):
    found, kept = release.plan_targets(HOLDERS, selected, [], kill_spanning=True)
    assert [h["pid"] for h in found] == targets
    assert [(h["pid"], outside) for h, outside in release.spanning_targets(HOLDERS, selected, [])] == (
        [(12, [1 - selected[0]])] if selected != [2] else [])


def test_nvml_clients_are_not_targeted_without_match():
    found, _kept = release.plan_targets(HOLDERS, [0, 1, 2], [])
    assert not [h for h in found if not h["gpu_indexes"]]


# ------------------------------------------------------------------ only_protected


def app(pid, gpu_index, alive=True, name="python3", mib=500):
    return {"pid": pid, "name": name, "used_memory_mib": mib, "gpu_uuid": UUIDS[gpu_index % len(UUIDS)], "gpu_index": gpu_index, "alive": alive}


DIRTY0 = [{"index": 0, "uuid": UUIDS[0], "memory_used_mib": 500}]
PERSISTENCED = holder(812, [0], protected=True, name="nvidia-persiste", cmdline="/usr/bin/nvidia-persistenced --user nvidia-persistenced")


@pytest.mark.parametrize(
    "dirty, holders, apps, expected",
    [
        (DIRTY0, [PERSISTENCED], [app(812, 0)], True),
        (DIRTY0, [PERSISTENCED, holder(426, [0])], [app(812, 0)], False),
        (DIRTY0, [PERSISTENCED], [], False),
        (DIRTY0, [PERSISTENCED], [app(812, 0), app(427, 0, alive=False, name="[Not Found]")], False),
        (DIRTY0, [PERSISTENCED], [app(812, 0), app(900, 0)], False),
        (DIRTY0 + [{"index": 1, "uuid": UUIDS[1], "memory_used_mib": 9}], [PERSISTENCED, holder(426, [1])], [app(812, 0), app(426, 1)], False),
        ([], [], [], True),
    ],
    ids=[
        "memory-claimed-only-by-a-protected-holder",
        "an-unprotected-holder-may-still-exit",
        "no-claim-may-be-a-release-in-progress",
        "dead-claim-is-not-protected",
        "live-unprotected-claimant",
        "other-gpu-has-an-unprotected-holder",
        "nothing-dirty",
    ],
)
def test_only_protected(dirty, holders, apps, expected):
    assert release.only_protected(dirty, holders, apps) is expected


# ------------------------------------------------------------------ failure_message


def test_failure_message_names_gpu_uuid_mib_and_holders():
    message = release.failure_message(
        [{"index": 3, "uuid": UUIDS[0], "memory_used_mib": 6662}],
        [holder(426, [3], unit="vllm.service", system_service=True), holder(500, [3], container="f" * 64, state="D"), holder(501, [1])],
        [app(426, 3)],
        60.0,
        [],
    )
    assert message.startswith(f"GPUs still in use after 60.0 s: GPU 3 ({UUIDS[0]}) reads 6662 MiB, held by ")
    assert "pid 426 python3 [python3 train.py] (unit vllm.service, state S)" in message
    assert "pid 500 python3 [python3 train.py] (container ffffffffffff, state D)" in message and "f" * 13 not in message
    assert "pid 501" not in message


def test_gpus_one_process_holds_are_said_once_with_the_process():
    """8 GPUs of one training job: one sentence for the process and its GPUs, not 8 copies of it (issue 67)."""
    gpus = [{"index": i, "uuid": f"GPU-{i:08d}-0000-0000-0000-000000000000", "memory_used_mib": 40969} for i in range(8)]
    job = holder(700, list(range(8)), cmdline="torchrun --nproc-per-node 8 train.py --model llama-70b --data /scratch/tokens")
    message = release.failure_message(gpus, [job], [app(700, i) for i in range(8)], 60.0, [])
    assert message == ("GPUs still in use after 60.0 s: GPUs 0-7 read 40969 MiB each (327752 MiB in all), held by "
                       "pid 700 python3 [torchrun --nproc-per-node 8 train.py --model llama-70b --...] (state S)")
    assert message.count("pid 700") == 1 and "GPU-0000" not in message


def test_gpus_are_grouped_by_holder_and_a_gpu_with_words_of_its_own_keeps_them():
    gpus = [{"index": 0, "uuid": UUIDS[0], "memory_used_mib": 1000}, {"index": 1, "uuid": UUIDS[1], "memory_used_mib": 1002},
            {"index": 2, "uuid": UUIDS[2], "memory_used_mib": 2048}, {"index": 3, "uuid": "GPU-3", "memory_used_mib": 500}]
    message = release.failure_message(gpus, [holder(700, [0, 1]), holder(800, [3])], [app(700, 0), app(700, 1), app(800, 3)], 60.0, [])
    held = "pid 700 python3 [python3 train.py] (state S)"
    assert f"GPUs 0,1 read 1000-1002 MiB (2002 MiB in all), held by {held}" in message and message.count("pid 700") == 1
    # the leaked GPU keeps its UUID and its own advice; a GPU alone with its holder reads as before
    assert f"GPU 2 ({UUIDS[2]}) reads 2048 MiB, and no live process holds the GPU" in message
    assert "GPU 3 (GPU-3) reads 500 MiB, held by pid 800 python3" in message


@pytest.mark.parametrize(("indexes", "said"), [([0], "0"), ([0, 1], "0,1"), ([0, 1, 2, 3, 5, 7, 8], "0-3,5,7,8"), ([4, 5, 6], "4-6")])
def test_index_list(indexes, said):
    assert words.index_list(indexes) == said


def test_dead_not_found_owner_without_live_holder_says_reset_or_reboot():
    message = release.failure_message(
        [{"index": 0, "uuid": UUIDS[0], "memory_used_mib": 3590}], [], [app(427, 0, alive=False, name="[Not Found]", mib=3590)], 60.0, []
    )
    assert "attributed to exited process(es) 427 [Not Found]" in message
    assert "a GPU reset or a reboot is needed" in message and "`nvidia-smi --gpu-reset -i 0`" in message


def test_dead_owner_with_empty_name_reads_no_data():
    message = release.failure_message([{"index": 0, "uuid": UUIDS[0], "memory_used_mib": 3590}], [], [app(427, 0, alive=False, name="")], 1.0, [])
    assert "427 [No data]" in message


def test_live_listed_pid_the_scan_could_not_place_is_named_never_no_live_process():
    """A holder hidden from the scan (a node it knows no identity of) that nvidia-smi lists alive."""
    message = release.failure_message([{"index": 0, "uuid": UUIDS[0], "memory_used_mib": 3590}], [], [app(427, 0, mib=3590)], 60.0, [])
    assert "no live process" not in message
    assert "listed by nvidia-smi for live pid 427 python3, which the scan could not place on this GPU: it has no device file" in message


def test_live_listed_pid_holding_another_gpu_is_named_as_a_possibly_reused_pid():
    message = release.failure_message([{"index": 1, "uuid": UUIDS[1], "memory_used_mib": 3590}], [holder(427, [0])], [app(427, 1, mib=3590)],
                                      60.0, [])
    assert "no live process" not in message and "pid 427" in message and "holds GPU 0 context-sized" in message and "PID reused" in message


def test_unknown_memory_cannot_be_proven_free():
    message = release.failure_message([{"index": 0, "uuid": UUIDS[0], "memory_used_mib": None}], [], [], 60.0, [])
    assert f"GPU 0 ({UUIDS[0]}) reads unknown MiB: nvidia-smi cannot report its memory, so it cannot be proven free" in message


def test_leaked_memory_without_any_claim_says_reset_or_reboot():
    message = release.failure_message([{"index": 1, "uuid": UUIDS[1], "memory_used_mib": 2048}], [], [], 60.0, [])
    assert "no live process holds the GPU" in message and "a GPU reset or a reboot is needed" in message
    assert "if 2048 MiB is this GPU's idle baseline, set max_used_mib: 2048 instead" in message


def test_small_reading_without_any_claim_is_an_idle_baseline_not_a_reset():
    message = release.failure_message([{"index": 1, "uuid": UUIDS[1], "memory_used_mib": 12}], [], [], 0.0, [], early="no_holder")
    assert message.startswith(words.EARLY_HEADS["no_holder"])
    assert "this is its idle baseline, not a leak; set max_used_mib: 16 (its 12 MiB reading with a margin" in message and "reset" not in message


def test_mig_gpu_reading_55_mib_without_any_claim_is_its_idle_baseline():
    gpu = {"index": 0, "uuid": UUIDS[0], "memory_used_mib": 55, "mig_mode": "Enabled"}
    message = release.failure_message([gpu], [], [], 0.0, [], early="no_holder")
    assert "idle baseline (MIG mode is enabled), not a leak; set max_used_mib: 64 (its 55 MiB reading with a margin" in message and "reboot" not in message


def test_protected_only_failure_names_the_protected_process():
    message = release.failure_message(DIRTY0, [PERSISTENCED], [app(812, 0)], 0.0, [], protected_only=True)
    assert message.startswith("GPUs are held only by protected processes, which gpu_release never signals")
    assert "pid 812 nvidia-persiste [/usr/bin/nvidia-persistenced --user nvidia-persistenced] (state S, protected)" in message


def test_unkillable_holders_are_listed():
    stuck = holder(500, [0], state="D")
    message = release.failure_message(DIRTY0, [stuck], [], 70.0, [stuck])
    assert message.endswith("unkillable (outlived SIGKILL: a thread of it stays in the kernel, D state, in the driver or a file system that does "
                            "not answer): pid 500 python3 [python3 train.py] (state D); a reboot is needed (nothing else ends a process stuck "
                            "in the kernel)")


@pytest.mark.parametrize(
    "cmdline, shown",
    [
        ("python3 train.py", "pid 7 python3 [python3 train.py] (state S)"),
        ("python3", "pid 7 python3 (state S)"),
        ("", "pid 7 python3 (state S)"),
        ("x" * 60, "pid 7 python3 [%s] (state S)" % ("x" * 60)),
        ("x" * 61, "pid 7 python3 [%s...] (state S)" % ("x" * 57)),
    ],
    ids=["command-line", "same-as-name", "kernel-thread-without-one", "60-chars-kept", "61-chars-cut"],
)
def test_holder_names_carry_their_command_line(cmdline, shown):
    assert words.describe_holder(holder(7, [0], cmdline=cmdline)) == shown


def test_summarize_diff():
    text = release.summarize_diff(
        [{"index": 0, "uuid": UUIDS[0], "memory_used_mib": 6662}, {"index": 1, "uuid": UUIDS[1], "memory_used_mib": None}],
        [holder(426, [0, 1], unit="vllm.service"), holder(900, [], name="dcgm-exporter", cmdline="/usr/bin/dcgm-exporter")],
    )
    assert text == (
        f"GPU 0 {UUIDS[0]}: 6662 MiB\nGPU 1 {UUIDS[1]}: None MiB\n"
        "holder pid 426 python3 [python3 train.py] (unit vllm.service, state S): 0,1\n"
        "holder pid 900 dcgm-exporter [/usr/bin/dcgm-exporter] (state S): control nodes\n"
    )
    assert release.summarize_diff([], []) == "\n"


# ------------------------------------------------------------------ one writer of the result (issue 22)


@pytest.mark.parametrize("step", [units_mod.owners, units_mod.plan, units_mod.act, units_mod.stop_bounded, _signals.Signaller,
                                  _supervisor.plan, _supervisor.act, _mps.stop, _settle.watch_for],
                         ids=lambda f: f"{f.__module__.rsplit('.', 1)[-1]}.{f.__name__}")
def test_the_steps_release_calls_are_given_no_result_to_write(step):
    assert "result" not in inspect.signature(step).parameters


@pytest.mark.parametrize("module", [units_mod, _signals, _supervisor, _mps, _settle], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_only_release_raises_release_error(module):
    assert "ReleaseError" not in inspect.getsource(module)
    assert "ReleaseError(" in inspect.getsource(release) and inspect.getsource(release).count("raise ReleaseError") == 1


# ------------------------------------------------------------------ a GPU not visible in this namespace (issue 37)

NOT_VISIBLE = [{"bus": "0000:2a:00.0", "minor": 1, "uuid": "GPU-2a2a2a2a-0000-0000-0000-000000000001"},
               {"bus": "0000:ab:00.0", "minor": 5, "uuid": "GPU-abababab-0000-0000-0000-000000000005"}]


@pytest.mark.parametrize("given, words", [
    ("GPU-ABABABAB-0000-0000-0000-000000000005", ["GPU GPU-ABABABAB-0000-0000-0000-000000000005 is not visible on this node: the driver lists it "
                                                  "(bus 0000:ab:00.0", "/dev/nvidia5"]),
    ("0000:2a:00.0", ["GPU 0000:2a:00.0 is not visible on this node:", "/dev/nvidia1", NOT_VISIBLE[0]["uuid"]]),
    ("00000000:2A:00.0", ["GPU 00000000:2A:00.0 is not visible on this node:", "/dev/nvidia1"]),
    ("5", ["GPU 5 is not visible on this node:", "indexes 0, 1, 2", "numbered from 0", "other 2 GPUs (0000:2a:00.0, 0000:ab:00.0)"]),
], ids=["uuid", "bus-id", "nvidia-smi-bus-id", "index"])
def test_gpu_not_visible_here_is_refused_naming_it_as_given(given, words):
    with pytest.raises(release.StepFailed) as info:
        release.select_gpus(GPUS, ["0", given], NOT_VISIBLE)
    assert info.value.msg.startswith(words[0]), info.value.msg
    assert all(word in info.value.msg for word in words), (words, info.value.msg)
    assert UUIDS[0] in info.value.msg  # what can be selected here, as nvidia-smi prints it


def test_unknown_uuid_on_a_node_with_gpus_not_visible_is_not_on_this_host():
    with pytest.raises(release.StepFailed, match="GPU 'GPU-deadbeef' is not on this host"):
        release.select_gpus(GPUS, ["GPU-deadbeef"], NOT_VISIBLE)


def test_a_gpu_read_blind_beside_a_dead_listed_owner_advises_no_reset():
    """Review of issue 32: the orphaned child of a dead, listed owner may be a process this module
    could not read; "a GPU reset or a reboot is needed" would then be wrong advice."""
    gpu = {"index": 0, "uuid": "GPU-0", "memory_used_mib": 40969}
    dead = [{"pid": 4711, "name": "[No data]", "gpu_index": 0, "alive": False}]
    blind = words.gpu_failure(gpu, [], dead, blind=True)
    assert "its holder may be one it cannot read" in blind and "reset" not in blind
    seeing = words.gpu_failure(gpu, [], dead, blind=False)
    assert "attributed to exited process(es) 4711 [No data]" in seeing and "`nvidia-smi --gpu-reset -i 0`" in seeing
