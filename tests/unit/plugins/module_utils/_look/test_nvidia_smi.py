# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_nvidia_smi on real captured output (H200 driver 580.159.04 and five exporter captures),
on synthesised edge cases, and NvidiaSmi against small shell scripts posing as nvidia-smi."""

from __future__ import annotations

import os
import shlex
import stat
import textwrap
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import captures

# A sample field set: what a memory poll would ask (index, uuid, memory.used).
MEMORY_FIELDS = (("index", "index", "int"), ("uuid", "uuid", "str"), ("memory.used", "memory_used_mib", "int"))

# ------------------------------------------------------------------ fields from a command line

# Record key and kind of every field the captures ask for; the rest are parsed as "str".
_KNOWN = {field: (key, kind) for field, key, kind in smi.GPU_FIELDS + smi.APP_FIELDS}
_KNOWN.update(
    {
        # The captures asked for names; the module no longer does (docs/docsite/rst/guide_security.rst).
        "process_name": ("name", "raw"),
        "used_gpu_memory": ("used_memory_mib", "int"),
        "gpu_bus_id": ("gpu_bus_id", "str"),
        "gpu_name": ("gpu_name", "str"),
        "gpu_serial": ("gpu_serial", "str"),
        "compute_mode": ("compute_mode", "str"),
        "ecc.errors.uncorrected.volatile.total": ("ecc_uncorrected", "int"),
        "clocks.sm": ("clocks_sm_mhz", "int"),
        "clocks.current.sm": ("clocks_sm_mhz", "int"),
        "pstate": ("pstate", "str"),
    }
)


def fields_for(names, known=None):
    known = _KNOWN if known is None else known
    return tuple((name,) + known.get(name, (name, "str")) for name in names)


def query_fields(capture_or_section):
    args = shlex.split(capture_or_section.command)[1:]
    query = captures.query_of(args)
    assert query is not None, capture_or_section.command
    return query, fields_for(query.fields)


# ------------------------------------------------------------------ H200, driver 580.159.04

IDLE_H200 = {
    "index": 0,
    "uuid": "GPU-f07bb63c-cd2e-fe8d-534a-d4b919fe9734",
    "name": "NVIDIA H200",
    "pci_bus_id": "00000000:00:06.0",
    "driver_version": "580.159.04",
    "memory_total_mib": 143771,
    "memory_reserved_mib": 616,
    "memory_used_mib": 0,
    "memory_free_mib": 143156,
    "utilization_gpu_pct": 0,
    "temperature_c": 37,
    "power_draw_w": 126.02,
    "persistence_mode": "Enabled",
    "compute_mode": "Default",
    "mig_mode": "Disabled",
    "ecc_uncorrected": 0,
    "clocks_sm_mhz": 1980,
    "pstate": "P0",
}
HELD_UUID = "GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5"
HELD_APPS = [
    {"pid": 427, "name": "python3", "used_memory_mib": 3590, "gpu_uuid": HELD_UUID, "gpu_bus_id": "00000000:00:06.0", "gpu_name": "NVIDIA H200"},
    {"pid": 426, "name": "python3", "used_memory_mib": 6662, "gpu_uuid": HELD_UUID, "gpu_bus_id": "00000000:00:06.0", "gpu_name": "NVIDIA H200"},
]

RUN_UUID = "GPU-d41735bc-63c1-3926-ea14-00865c4fd3ff"
RUN_H200 = {
    "index": 0,
    "uuid": RUN_UUID,
    "name": "NVIDIA H200",
    "pci_bus_id": "00000000:00:06.0",
    "driver_version": "580.159.04",
    "memory_total_mib": 143771,
    "memory_reserved_mib": 616,
    "persistence_mode": "Enabled",
    "mig_mode": "Disabled",
}

H200_EXPECTED = {
    "idle_q_gpu_csv.txt": [IDLE_H200],
    "idle_q_gpu_noheader.txt": [IDLE_H200],
    "idle_q_gpu_nounits.txt": [IDLE_H200],
    "idle_q_seed.txt": [{"index": 0, "memory_used_mib": 0}],
    "held_q_gpu_nounits.txt": [
        {
            "index": 0,
            "uuid": HELD_UUID,
            "pci_bus_id": "00000000:00:06.0",
            "memory_total_mib": 143771,
            "memory_reserved_mib": 616,
            "memory_used_mib": 10267,
            "memory_free_mib": 132890,
        }
    ],
    "held_apps_live_csv.txt": HELD_APPS,
    "held_apps_live_nh.txt": HELD_APPS,
    "idle_q_apps_empty.txt": [],
    "idle_q_apps_empty_nh.txt": [],
    # This project's own captures from the real-GPU acceptance run (tests/gpu/results/README.md).
    "run_idle_q_gpu_nounits.txt": [dict(RUN_H200, memory_used_mib=0, memory_free_mib=143156, utilization_gpu_pct=0, temperature_c=35, power_draw_w=79.08)],
    "run_held_q_gpu_nounits.txt": [dict(RUN_H200, memory_used_mib=41487, memory_free_mib=101670, utilization_gpu_pct=3, temperature_c=36, power_draw_w=85.45)],
    "run_orphan_q_gpu_nounits.txt": [
        dict(RUN_H200, memory_used_mib=41487, memory_free_mib=101670, utilization_gpu_pct=0, temperature_c=37, power_draw_w=106.62)
    ],
    "run_idle_q_apps.txt": [],
    "run_held_apps_live_csv.txt": [{"pid": 506, "name": "/opt/torch/.venv/bin/python3", "used_memory_mib": 41478, "gpu_uuid": RUN_UUID}],
    # The dead parent of an orphaned child, 0.5 s after the kill: the child holds all of it.
    "run_orphan_apps_dead_owner_csv.txt": [{"pid": 2220, "name": "[No data]", "used_memory_mib": 41478, "gpu_uuid": RUN_UUID}],
}


def test_every_h200_query_capture_has_an_expectation():
    with_query = {n for n in captures.h200_names() if captures.query_of(captures.h200(n).args) and captures.h200(n).rc == 0}
    assert with_query == set(H200_EXPECTED)


def _public(records):
    return [{k: v for k, v in r.items() if k != "_unavailable"} for r in records]


@pytest.mark.parametrize("name", sorted(H200_EXPECTED), ids=lambda n: n[:-4])
def test_h200_capture_parses_with_the_fields_of_its_own_command_line(name):
    capture = captures.h200(name)
    query, fields = query_fields(capture)
    first = capture.output.splitlines()[0] if capture.output.strip() else ""
    # The fixture really exercises what its flags say.
    assert first.startswith(query.fields[0]) == (query.header and bool(first))
    if query.units and not query.header and capture.output.strip() and "memory.used" in query.fields:
        assert "MiB" in capture.output
    records = smi.parse_csv(capture.output, fields, cmd=capture.args)
    assert _public(records) == H200_EXPECTED[name]
    for record in records:
        for key, value in record.items():
            if key.endswith("_mib") or key in ("index", "pid", "temperature_c", "utilization_gpu_pct"):
                assert value.__class__ is int, (key, value)  # not bool, not float
            if key == "power_draw_w":
                assert value.__class__ is float


@pytest.mark.parametrize("name", ["idle_q_gpu_csv.txt", "idle_q_gpu_noheader.txt", "idle_q_gpu_nounits.txt"])
def test_h200_gpu_capture_through_parse_gpus_with_our_own_fields(name):
    capture = captures.h200(name)
    query, _fields = query_fields(capture)
    ours = tuple(f for f in smi.GPU_FIELDS)
    # Cut the capture down to our columns: parse_gpus sees what `gpu_args` would ask for.
    positions = [query.fields.index(field) for field, _k, _t in ours]
    lines = capture.output.splitlines()
    body = lines[1:] if query.header else lines
    cut = "\n".join(", ".join(line.split(", ")[p] for p in positions) for line in body)
    (record,) = smi.parse_gpus(cut)
    assert {k: record[k] for _f, k, _t in ours} == {k: IDLE_H200[k] for _f, k, _t in ours}


def test_held_gpu_reads_at_least_what_its_compute_apps_claim():
    apps = smi.parse_compute_apps(
        captures.h200("held_apps_live_nh.txt").output, fields_for(captures.query_of(captures.h200("held_apps_live_nh.txt").args).fields)
    )
    (gpu,) = smi.parse_csv(captures.h200("held_q_gpu_nounits.txt").output, query_fields(captures.h200("held_q_gpu_nounits.txt"))[1])
    # 3590 + 6662 = 10252 MiB claimed by the two apps; the GPU reads 10267 (per-context overhead).
    assert sum(a["used_memory_mib"] for a in apps) == 10252 < gpu["memory_used_mib"] == 10267


# ------------------------------------------------------------------ header aliases


@pytest.mark.parametrize(
    "asked, header",
    [
        ("used_memory", "used_gpu_memory [MiB]"),
        ("used_gpu_memory", "used_memory [MiB]"),
        ("process_name", "name"),
        ("uuid", "gpu_uuid"),
        ("pci.bus_id", "gpu_bus_id"),
        ("clocks.sm", "clocks.current.sm [MHz]"),
        ("memory.used", "memory.used [MiB]"),
    ],
    ids=lambda v: v,
)
def test_header_with_canonical_name_matches_the_alias_we_asked_for(asked, header):
    fields = (("pid", "pid", "int"), (asked, "value", "str"))
    assert _public(smi.parse_csv(f"pid, {header}\n7, x\n", fields)) == [{"pid": 7, "value": "x"}]


def test_used_memory_header_in_the_real_h200_capture_is_the_canonical_name():
    capture = captures.h200("held_apps_live_csv.txt")
    assert "used_memory" in capture.command and "used_gpu_memory [MiB]" in capture.output.splitlines()[0]
    assert [a["used_memory_mib"] for a in smi.parse_compute_apps(capture.output, query_fields(capture)[1])] == [3590, 6662]


def test_header_naming_other_columns_is_unparsable_not_silently_shifted():
    text = "index, memory.total [MiB]\n0, 143771 MiB\n"
    with pytest.raises(smi.UnparsableOutput, match="printed the columns index, memory.total"):
        smi.parse_csv(text, (("index", "index", "int"), ("memory.used", "memory_used_mib", "int")))


def test_header_of_a_different_width_is_unparsable():
    with pytest.raises(smi.UnparsableOutput):
        smi.parse_gpus("index, uuid, memory.used [MiB]\n0, GPU-1, 5 MiB\n", MEMORY_FIELDS[:2])


# ------------------------------------------------------------------ exporter captures (5 models)

EXPORTER = captures.exporter_names()
PHASES = ("idle", "load")
_GPU_KEYS = {field: (key, kind) for field, key, kind in smi.GPU_FIELDS}

# What our GPU_FIELDS columns read in each capture (nvidia_gpu_exporter, masked UUIDs).
EXPORTER_GPU = {
    ("linux-geforce-rtx-4080-super-595.71.05", "idle"): dict(
        memory_total_mib=16376,
        memory_reserved_mib=434,
        memory_used_mib=596,
        utilization_gpu_pct=0,
        temperature_c=43,
        power_draw_w=26.2,
        persistence_mode="Disabled",
        mig_mode=None,
    ),
    ("linux-geforce-rtx-4080-super-595.71.05", "load"): dict(
        memory_total_mib=16376,
        memory_reserved_mib=434,
        memory_used_mib=1474,
        utilization_gpu_pct=7,
        temperature_c=46,
        power_draw_w=84.24,
        persistence_mode="Disabled",
        mig_mode=None,
    ),
    ("linux-h100-80gb-hbm3-590.48.01", "idle"): dict(
        memory_total_mib=81559,
        memory_reserved_mib=479,
        memory_used_mib=0,
        utilization_gpu_pct=0,
        temperature_c=41,
        power_draw_w=69.85,
        persistence_mode="Enabled",
        mig_mode="Disabled",
    ),
    ("linux-h100-80gb-hbm3-590.48.01", "load"): dict(
        memory_total_mib=81559,
        memory_reserved_mib=479,
        memory_used_mib=19818,
        utilization_gpu_pct=100,
        temperature_c=59,
        power_draw_w=631.95,
        persistence_mode="Enabled",
        mig_mode="Disabled",
    ),
    ("linux-h200-590.48.01", "idle"): dict(
        memory_total_mib=143771,
        memory_reserved_mib=614,
        memory_used_mib=0,
        utilization_gpu_pct=0,
        temperature_c=28,
        power_draw_w=77.71,
        persistence_mode="Enabled",
        mig_mode="Disabled",
    ),
    ("linux-h200-590.48.01", "load"): dict(
        memory_total_mib=143771,
        memory_reserved_mib=614,
        memory_used_mib=32362,
        utilization_gpu_pct=100,
        temperature_c=52,
        power_draw_w=627.4,
        persistence_mode="Enabled",
        mig_mode="Disabled",
    ),
    ("linux-l40s-595.80", "idle"): dict(
        memory_total_mib=46068,
        memory_reserved_mib=609,
        memory_used_mib=0,
        utilization_gpu_pct=100,
        temperature_c=63,
        power_draw_w=144.97,
        persistence_mode="Disabled",
        mig_mode=None,
    ),
    ("linux-l40s-595.80", "load"): dict(
        memory_total_mib=46068,
        memory_reserved_mib=609,
        memory_used_mib=1235,
        utilization_gpu_pct=9,
        temperature_c=54,
        power_draw_w=110.23,
        persistence_mode="Disabled",
        mig_mode=None,
    ),
    ("windows-geforce-rtx-2080-super-591.86", "idle"): dict(
        memory_total_mib=8192,
        memory_reserved_mib=205,
        memory_used_mib=702,
        utilization_gpu_pct=0,
        temperature_c=40,
        power_draw_w=38.92,
        persistence_mode=None,
        mig_mode=None,
    ),
    ("windows-geforce-rtx-2080-super-591.86", "load"): dict(
        memory_total_mib=8192,
        memory_reserved_mib=205,
        memory_used_mib=1296,
        utilization_gpu_pct=7,
        temperature_c=45,
        power_draw_w=97.43,
        persistence_mode=None,
        mig_mode=None,
    ),
}

EXPORTER_APPS = {
    ("linux-geforce-rtx-4080-super-595.71.05", "idle"): [(2165, "/usr/bin/kwin_wayland", 25)],
    ("linux-geforce-rtx-4080-super-595.71.05", "load"): [(2165, "/usr/bin/kwin_wayland", 25), (5022, "ffmpeg", 503), (5021, "ffmpeg", 360)],
    ("linux-h100-80gb-hbm3-590.48.01", "idle"): [],
    ("linux-h100-80gb-hbm3-590.48.01", "load"): [(11327, "/root/tools/memhog", 2566), (11328, "/root/tools/memhog", 1542), (11345, "./gpu_burn", 15690)],
    ("linux-h200-590.48.01", "idle"): [],
    ("linux-h200-590.48.01", "load"): [(10291, "/root/tools/memhog", 2566), (10293, "/root/tools/memhog", 1542), (10309, "./gpu_burn", 28234)],
    ("linux-l40s-595.80", "idle"): [],
    ("linux-l40s-595.80", "load"): [(20037, "ffmpeg", 538), (20038, "ffmpeg", 681)],
}

EXPORTER_CASES = [pytest.param(name, phase, id=f"{captures.model_of(name)}-{phase}") for name in EXPORTER for phase in PHASES]


def _exporter_gpu_fields(names):
    return tuple((name,) + _GPU_KEYS.get(name, (name, "str")) for name in names)


@pytest.mark.parametrize("name, phase", EXPORTER_CASES)
def test_exporter_full_query_gpu_parses_every_column(name, phase):
    section = captures.exporter_section(name, phase, "query-gpu")
    query = captures.query_of(shlex.split(section.command)[1:])
    assert len(query.fields) > 200 and query.header
    (record,) = smi.parse_csv(section.output, _exporter_gpu_fields(query.fields))
    raw_cells = [cell.strip() for cell in section.output.splitlines()[1].split(",")]
    assert len(raw_cells) == len(query.fields)
    for (field, key, kind), cell in zip(_exporter_gpu_fields(query.fields), raw_cells):
        if cell.startswith("[") and cell.endswith("]"):
            assert record[key] is None and record["_unavailable"][key] == cell, field
        elif cell in ("N/A", ""):  # bare N/A (temperature.memory, fabric.*) is no value either
            assert record[key] is None and key not in record["_unavailable"], field
        elif kind == "str":
            assert record[key] == cell, field


@pytest.mark.parametrize("name, phase", EXPORTER_CASES)
def test_exporter_gpu_fields_subset_has_python_types_and_none_for_tokens(name, phase):
    section = captures.exporter_section(name, phase, "query-gpu")
    query = captures.query_of(shlex.split(section.command)[1:])
    (record,) = smi.parse_csv(section.output, _exporter_gpu_fields(query.fields))
    expected = EXPORTER_GPU[(captures.model_of(name), phase)]
    assert {k: record[k] for k in expected} == expected
    assert record["index"] == 0 and record["uuid"] == "GPU-00000000-0000-0000-0000-000000000000"
    for _field, key, kind in smi.GPU_FIELDS:
        value = record[key]
        assert value is None or value.__class__ is {"int": int, "float": float, "str": str}[kind], (key, value)
    # used + reserved + free == total on every model, to nvidia-smi's rounding.
    assert abs(record["memory_used_mib"] + record["memory_reserved_mib"] + record["memory_free_mib"] - record["memory_total_mib"]) <= 2


def test_exporter_captures_carry_the_tokens_seen_in_the_field():
    # [Not Supported] is only in their help text, never a value: the synthesised cases cover it.
    seen = set()
    for name in EXPORTER:
        for phase in PHASES:
            section = captures.exporter_section(name, phase, "query-gpu")
            query = captures.query_of(shlex.split(section.command)[1:])
            (record,) = smi.parse_csv(section.output, _exporter_gpu_fields(query.fields))
            seen.update(record["_unavailable"].values())
    assert seen == {"[N/A]", "[Requested functionality has been deprecated]"}


def _exporter_apps(name, phase):
    section = captures.exporter_section(name, phase, "query-compute-apps")
    query = captures.query_of(shlex.split(section.command)[1:])
    return smi.parse_compute_apps(section.output, fields_for(query.fields))


@pytest.mark.parametrize("name, phase", [c for c in EXPORTER_CASES if not c.values[0].startswith("windows")])
def test_exporter_compute_apps_on_linux(name, phase):
    apps = _exporter_apps(name, phase)
    assert [(a["pid"], a["name"], a["used_memory_mib"]) for a in apps] == EXPORTER_APPS[(captures.model_of(name), phase)]


@pytest.mark.parametrize("phase", PHASES)
def test_wddm_compute_apps_keep_windows_paths_with_spaces_and_read_na_memory(phase):
    (name,) = [n for n in EXPORTER if n.startswith("windows")]
    apps = _exporter_apps(name, phase)
    assert len(apps) == {"idle": 10, "load": 12}[phase]
    names = [a["name"] for a in apps]
    assert "C:\\Program Files\\NZXT CAM\\NZXT CAM.exe" in names
    assert "C:\\Program Files\\NVIDIA Corporation\\NVIDIA GeForce Experience\\NVIDIA Share.exe" in names
    assert all(a["used_memory_mib"] is None and a["_unavailable"]["used_memory_mib"] == "[N/A]" for a in apps)
    assert all(a["gpu_serial"] is None for a in apps)


def test_desktop_compositor_shows_up_as_a_compute_app():
    apps = _exporter_apps([n for n in EXPORTER if "4080" in n][0], "idle")
    assert [(a["name"], a["used_memory_mib"]) for a in apps] == [("/usr/bin/kwin_wayland", 25)]


# ------------------------------------------------------------------ synthesised edge cases

# The column set the captures (and the module before docs/docsite/rst/guide_security.rst) asked for: names included.
APPS = (("pid", "pid", "int"), ("process_name", "name", "raw"), ("used_memory", "used_memory_mib", "int"), ("gpu_uuid", "gpu_uuid", "str"))
U = "GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5"
V = "GPU-0d1e2f30-4152-6374-8596-a7b8c9d0e1f2"


def test_compute_apps_are_asked_without_names():
    assert [field for field, _key, _kind in smi.APP_FIELDS] == ["pid", "gpu_uuid", "used_memory"]


def test_compute_apps_rows_are_exactly_pid_uuid_memory():
    apps = smi.parse_compute_apps(f"427, {U}, 3590\n9, {V}, [N/A]\n")
    assert [(a["pid"], a["gpu_uuid"], a["used_memory_mib"], a["name"]) for a in apps] == [(427, U, 3590, None), (9, V, None, None)]


@pytest.mark.parametrize(
    "text",
    [
        f"427, {U}, 3590, python3\n",  # a name where none was asked: not the driver's answer
        "427, python3, 3590\n",  # a name where the UUID belongs
        "427, GPU-1, 3590\n",  # a UUID not of the driver's form
        f"427, {U}\n",
        f"0, {U}, 5\n",  # PID 0
        f"-4, {U}, 5\n",
        f"x, 0, G\n427, {U}, 5\n",  # what a forged name would add, were names asked
    ],
    ids=["extra-name-column", "name-for-uuid", "short-uuid", "missing-memory", "pid-zero", "negative-pid", "forged-row-fragment"],
)
def test_compute_apps_row_that_is_not_exactly_the_typed_columns_rejects_the_answer(text):
    with pytest.raises(smi.UnparsableOutput):
        smi.parse_compute_apps(text)


def test_a_name_with_commas_and_a_line_feed_forges_a_row_only_where_names_are_asked():
    """The attack (issue 19): argv[0] `x, 0, G<LF><victim pid>, y` printed verbatim adds a row that
    lists the victim on the attacker's GPU. Asked without names, nvidia-smi prints no user text."""
    forged = f"4242, x, 0, {V}\n777, y, 500, {V}\n"
    # The old column set: the forged row parses as the driver's, listing pid 777 on GPU V.
    assert [(a["pid"], a["gpu_uuid"]) for a in smi.parse_compute_apps(forged, APPS)] == [(4242, V), (777, V)]
    assert smi.parse_compute_apps(f"4242, {V}, 500\n") == [{"pid": 4242, "gpu_uuid": V, "used_memory_mib": 500, "name": None, "_unavailable": {}}]


@pytest.mark.parametrize(
    "line, name, memory, unavailable",
    [
        (f"427, [Not Found], 3590, {U}", "[Not Found]", 3590, {}),
        (f"427, [No data], 3590, {U}", "[No data]", 3590, {}),
        (
            f"427, [Insufficient Permissions], [Insufficient Permissions], {U}",
            "[Insufficient Permissions]",
            None,
            {"used_memory_mib": "[Insufficient Permissions]"},
        ),
        (f"427, python3, [Unknown Error], {U}", "python3", None, {"used_memory_mib": "[Unknown Error]"}),
        (f"427, [Unknown Error], [Unknown Error], {U}", "[Unknown Error]", None, {"used_memory_mib": "[Unknown Error]"}),
        (f"427, , 3590, {U}", "", 3590, {}),
        (f"427, my, app, 3590, {U}", "my, app", 3590, {}),
        (f"427, a,b, c, 3590, {U}", "a,b, c", 3590, {}),
        (f"427, VLLM::EngineCore, 70000, {U}", "VLLM::EngineCore", 70000, {}),
        (f"427, C:\\Program Files\\NZXT CAM\\NZXT CAM.exe, [N/A], {U}", "C:\\Program Files\\NZXT CAM\\NZXT CAM.exe", None, {"used_memory_mib": "[N/A]"}),
    ],
    ids=[
        "not-found-name",
        "no-data-name",
        "insufficient-permissions",
        "unknown-error-memory",
        "unknown-error-name",
        "empty-name",
        "name-with-comma-space",
        "name-with-two-commas",
        "vllm-engine-core",
        "wddm-na",
    ],
)
def test_compute_app_names_are_kept_raw_and_tokens_in_numbers_become_none(line, name, memory, unavailable):
    (app,) = smi.parse_compute_apps(line + "\n", APPS)
    assert (app["pid"], app["name"], app["used_memory_mib"], app["gpu_uuid"]) == (427, name, memory, U)
    assert app["_unavailable"] == unavailable


def test_process_name_with_comma_space_behind_a_header():
    text = f"pid, process_name, used_gpu_memory [MiB], gpu_uuid\n9, serve, v2, 12 MiB, {U}\n"
    assert smi.parse_compute_apps(text, APPS)[0]["name"] == "serve, v2"


def test_empty_compute_apps_output_is_an_idle_answer():
    assert smi.parse_compute_apps("", APPS) == []
    assert smi.parse_compute_apps("\n\n", APPS) == []
    assert (
        smi.parse_compute_apps(captures.h200("idle_q_apps_empty.txt").output, fields_for(captures.query_of(captures.h200("idle_q_apps_empty.txt").args).fields))
        == []
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n",
        "index, uuid, name, pci.bus_id, driver_version, memory.total [MiB], memory.reserved [MiB], memory.used [MiB], memory.free [MiB], "
        "utilization.gpu [%], temperature.gpu, power.draw [W], persistence_mode, mig.mode.current\n",
    ],
    ids=["empty", "blank-line", "header-only"],
)
def test_empty_gpu_output_is_never_an_idle_host(text):
    with pytest.raises(smi.UnparsableOutput, match="no GPU"):
        smi.parse_gpus(text)


@pytest.mark.parametrize(
    "text, fields, message",
    [
        ("0, GPU-1\n", MEMORY_FIELDS, "2 columns, expected 3"),
        ("0, GPU-1, 5, 6\n", MEMORY_FIELDS, "4 columns, expected 3"),
        ("0, GPU-1, lots\n", MEMORY_FIELDS, "'lots' for memory.used"),
        ("0, GPU-1, 12.5\n", MEMORY_FIELDS, "'12.5' for memory.used"),
        (f"427, python3, lots, {U}\n", APPS, "'lots' for used_memory"),
        (f"[N/A], python3, 5, {U}\n", APPS, "without PID"),
        ("[N/A], GPU-1, 5\n", MEMORY_FIELDS, "without index or UUID"),
        ("0, [Unknown Error], 5\n", MEMORY_FIELDS, "without index or UUID"),
    ],
    ids=[
        "too-few-columns",
        "too-many-columns",
        "non-numeric-memory",
        "fractional-mib",
        "non-numeric-app-memory",
        "app-without-pid",
        "gpu-without-index",
        "gpu-without-uuid",
    ],
)
def test_output_we_cannot_trust_is_unparsable(text, fields, message):
    parse = smi.parse_compute_apps if fields is APPS else smi.parse_gpus
    with pytest.raises(smi.UnparsableOutput, match=message.replace("[", r"\[").replace("(", r"\(")) as info:
        parse(text, fields, cmd=["nvidia-smi"])
    assert info.value.stdout == text and info.value.rc == 0 and info.value.cmd == ["nvidia-smi"]


@pytest.mark.parametrize(
    "cell, kind, value",
    [
        ("143771 MiB", "int", 143771),
        ("126.02 W", "float", 126.02),
        ("126.00 W", "int", 126),
        ("0 %", "int", 0),
        ("1980 MHz", "int", 1980),
        ("[N/A]", "int", None),
        ("N/A", "int", None),
        ("[Not Supported]", "float", None),
        ("[Requested functionality has been deprecated]", "str", None),
        ("[GPU requires reset]", "int", None),
        ("[Some Future Token]", "int", None),
        ("", "str", None),
        ("[N/A]", "raw", "[N/A]"),
        ("  Enabled ", "str", "Enabled"),
    ],
    ids=repr,
)
def test_parse_value(cell, kind, value):
    assert smi.parse_value(cell, kind) == value


@pytest.mark.parametrize("cell", ["inf", "-Infinity MiB", "1e999", "9" * 400], ids=["inf", "minus-infinity", "1e999", "400-digits"])
def test_infinite_memory_reading_is_unparsable_not_a_crash(cell):
    with pytest.raises(smi.UnparsableOutput):
        smi.parse_gpus(f"0, GPU-1, {cell}\n", MEMORY_FIELDS)


# ------------------------------------------------------------------ failures by return code


def test_bad_field_capture_rc2_names_the_field():
    capture = captures.h200("idle_q_bad_field.txt")
    assert capture.rc == 2
    error = smi.classify_failure(capture.args, capture.rc, capture.output, "")
    assert error.__class__ is smi.BadField and error.field == "not.a.field"
    assert 'Field "not.a.field" is not a valid field to query.' in error.msg and "rc 2" in error.msg
    assert error.details() == {"msg": error.msg, "cmd": capture.args, "rc": 2, "stdout": capture.output, "stderr": ""}


def test_bad_index_capture_rc6_is_no_devices_found():
    capture = captures.h200("idle_q_bad_index.txt")
    error = smi.classify_failure(capture.args, capture.rc, capture.output, "")
    assert error.__class__ is smi.NoDevicesFound and error.msg.endswith("No devices were found") and error.rc == 6


@pytest.mark.parametrize(
    "rc, stdout, stderr, cls, said",
    [
        (2, "", 'Field "memory.reserved" is not a valid field to query.\n', smi.BadField, "memory.reserved"),
        (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "", smi.DriverNotLoaded, "couldn't communicate"),
        (
            15,
            "Unable to determine the device handle for GPU0000:18:00.0: GPU is lost.  Reboot the system to recover this GPU\n",
            "",
            smi.GpuLost,
            "GPU is lost",
        ),
        (3, "", "", smi.NvidiaSmiError, "no output"),
        (255, "\n\n", "Segmentation fault\n", smi.NvidiaSmiError, "Segmentation fault"),
        (-9, "", "", smi.NvidiaSmiError, "rc -9"),
    ],
    ids=["rc2-stderr", "rc9-driver-not-loaded", "rc15-gpu-lost", "rc3-silent", "rc255-stderr-only", "killed-by-signal"],
)
def test_classify_failure(rc, stdout, stderr, cls, said):
    error = smi.classify_failure(["nvidia-smi"], rc, stdout, stderr)
    assert error.__class__ is cls and said in error.msg and error.stdout == stdout and error.stderr == stderr
    if cls is smi.BadField:
        assert error.field == "memory.reserved"


MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.178\n"


@pytest.mark.parametrize("rc, stdout, library", [
    pytest.param(18, MISMATCH, "580.178", id="rc18-both-lines"),
    pytest.param(255, "Failed to initialize NVML: Driver/library version mismatch\n", None, id="older-driver-one-line-other-rc"),
    pytest.param(18, "", None, id="rc18-silent"),
])
def test_a_driver_library_mismatch_says_what_happened_and_the_cure(monkeypatch, tmp_path, rc, stdout, library):
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.173.02  Tue Jun 23 08:38:17 UTC 2026\n")
    monkeypatch.setattr(smi, "MODULE_VERSION_FILE", str(version))
    monkeypatch.setattr(smi, "loaded_module_version", lambda path=str(version): smi._MODULE_VERSION.search(version.read_text()).group(1))
    error = smi.classify_failure(["nvidia-smi"], rc, stdout, "")
    assert error.__class__ is smi.DriverLibraryMismatch and error.rc == rc and error.stdout == stdout
    assert error.msg.startswith("the NVIDIA driver was upgraded under its loaded kernel module (Driver/library version mismatch: kernel module 580.173.02")
    assert ("library 580.178)" in error.msg) is (library is not None)
    assert "jobs already running are unaffected, but new CUDA jobs and nvidia-smi fail until the node is rebooted" in error.msg


@pytest.mark.parametrize("text, version", [
    pytest.param("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.173.02  Tue Jun 23 08:38:17 UTC 2026\nGCC version: x\n", "580.173.02",
                 id="proprietary"),
    pytest.param("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)\n", "580.159.04",
                 id="open"),
    pytest.param("GCC version:  gcc version 12.3.0\n", None, id="no-nvrm-line"),
])
def test_the_loaded_modules_version_from_its_proc_file(tmp_path, text, version):
    path = tmp_path / "version"
    path.write_text(text)
    assert smi.loaded_module_version(str(path)) == version
    assert smi.loaded_module_version(str(tmp_path / "missing")) is None


def _library(folder, version):
    """libnvidia-ml.so.1 -> libnvidia-ml.so.<version>, as the driver's packages install it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"libnvidia-ml.so.{version}").write_bytes(b"\x7fELF")
    (folder / "libnvidia-ml.so.1").symlink_to(f"libnvidia-ml.so.{version}")


def test_the_installed_library_is_the_first_directorys_and_a_drift_is_a_mismatch(tmp_path):
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build\n")
    first, second = tmp_path / "lib64", tmp_path / "lib"
    _library(second, "580.159.04")
    assert smi.driver_versions(str(version), [str(first), str(second)]) == {
        "loaded": "580.159.04", "library": "580.159.04", "library_path": str(second / "libnvidia-ml.so.580.159.04"), "mismatch": False}
    _library(first, "580.178.04")  # an upgrade that reached the disk, not the running module
    drift = smi.driver_versions(str(version), [str(first), str(second)])
    assert (drift["loaded"], drift["library"], drift["mismatch"]) == ("580.159.04", "580.178.04", True)
    # Nothing on disk, or no module loaded: unknown, never a mismatch.
    assert smi.driver_versions(str(version), [str(tmp_path / "none")])["mismatch"] is False
    assert smi.driver_versions(str(tmp_path / "no-module"), [str(first)]) == {
        "loaded": None, "library": "580.178.04", "library_path": str(first / "libnvidia-ml.so.580.178.04"), "mismatch": False}


# ------------------------------------------------------------------ bus ids, minors


@pytest.mark.parametrize(
    "bus_id, expected",
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        ("0000:18:00.0", "0000:18:00.0"),
        ("00000000:0C:00.0", "0000:0c:00.0"),
        ("18:00.0", "0000:18:00.0"),
        (" 00000001:AB:00.1\n", "0001:ab:00.1"),
        ("zz:yy:00.0", "zz:yy:00.0"),
        ("", None),
        (None, None),
    ],
    ids=repr,
)
def test_normalize_bus_id(bus_id, expected):
    assert smi.normalize_bus_id(bus_id) == expected


# The format of /proc/driver/nvidia/gpus/<bus>/information (tab-separated values).
INFORMATION = textwrap.dedent("""\
    Model: \t\t NVIDIA H200
    IRQ:   \t\t 89
    GPU UUID: \t GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5
    Video BIOS: \t 96.00.a5.00.01
    Bus Type: \t PCIe
    DMA Size: \t 52 bits
    DMA Mask: \t 0xfffffffffffff
    Bus Location: \t 0000:18:00.0
    Device Minor: \t 3
    GPU Firmware: \t 580.159.04
    GPU Excluded:\t No
    """)


@pytest.mark.parametrize(
    "text, expected",
    [
        (INFORMATION, ("0000:18:00.0", 3)),
        (INFORMATION.replace("\t 3\n", "\t ?\n"), ("0000:18:00.0", None)),
        ("Device Minor: 0\n", (None, 0)),
        ("", (None, None)),
    ],
    ids=["h200", "garbled-minor", "minor-only", "empty"],
)
def test_parse_gpu_information(text, expected):
    assert smi.parse_gpu_information(text) == expected


def test_read_minor_numbers_from_a_driver_proc_tree(tmp_path):
    root = tmp_path / "gpus"
    for entry, text in {
        "0000:18:00.0": INFORMATION.replace("\t 3\n", "\t 1\n"),
        "0000:2a:00.0": INFORMATION.replace("0000:18:00.0", "0000:2a:00.0").replace("\t 3\n", "\t 0\n"),
        "0000:ab:00.0": "Device Minor: \t 7\n",  # no Bus Location: the directory name says it
        "0000:cd:00.0": "Model: NVIDIA H200\n",  # no minor: skipped
    }.items():
        (root / entry).mkdir(parents=True)
        (root / entry / "information").write_text(text)
    (root / "0000:ef:00.0").mkdir()  # no information file: skipped
    minors = smi.read_minor_numbers(str(root))
    assert minors == {"0000:18:00.0": 1, "0000:2a:00.0": 0, "0000:ab:00.0": 7}
    assert minors[smi.normalize_bus_id("00000000:18:00.0")] == 1


def test_read_minor_numbers_without_the_driver_is_empty(tmp_path):
    assert smi.read_minor_numbers(str(tmp_path / "absent")) == {}


# ------------------------------------------------------------------ NvidiaSmi with fake binaries


def fake_binary(directory, body, name="nvidia-smi"):
    path = os.path.join(str(directory), name)
    with open(path, "w") as handle:
        handle.write("#!/bin/sh\n" + textwrap.dedent(body))
    os.chmod(path, 0o755)
    return path


def _gone(pid):
    try:
        with open(f"/proc/{pid:d}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_hung_nvidia_smi_is_killed_with_its_children_and_never_reads_clean(tmp_path):
    pidfile = tmp_path / "child.pid"
    path = fake_binary(tmp_path, f"sleep 30 &\necho $! > {pidfile}\nwait\n")
    runner = smi.NvidiaSmi(path, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(smi.NvidiaSmiTimeout, match="timed out after 0.5 s") as info:
        runner.query_gpus()
    assert time.monotonic() - started < 0.5 + 1.5
    assert info.value.rc is None and info.value.cmd[0] == path
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 2
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(child), "the hung nvidia-smi's child survived"


def test_rc6_attaches_what_nvidia_smi_printed(tmp_path):
    path = fake_binary(tmp_path, 'echo "No devices were found"\nexit 6\n')
    with pytest.raises(smi.NoDevicesFound) as info:
        smi.NvidiaSmi(path, timeout=5).run(["-i", "7", "--query-gpu=index", "--format=csv"])
    assert info.value.stdout == "No devices were found\n" and info.value.rc == 6
    assert info.value.cmd == [path, "-i", "7", "--query-gpu=index", "--format=csv"]


def test_nvidia_smi_runs_in_the_c_locale_without_stdin(tmp_path):
    path = fake_binary(tmp_path, 'cat\necho "$LC_ALL $LANG"\n')
    assert smi.NvidiaSmi(path, timeout=5).run([]) == "C C\n"


def test_binary_that_cannot_be_executed_is_not_found(tmp_path):
    path = tmp_path / "nvidia-smi"
    path.write_bytes(b"\x7fELF garbage")
    path.chmod(0o755)
    with pytest.raises(smi.NvidiaSmiNotFound, match="cannot run"):
        smi.NvidiaSmi(str(path), timeout=5).run([])


def test_find_explicit_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "bin" / "nvidia-smi")
    with pytest.raises(smi.NvidiaSmiNotFound, match=f"not found or not executable at {missing}"):
        smi.NvidiaSmi.find(missing)


def test_find_explicit_path_that_is_not_executable(tmp_path):
    path = fake_binary(tmp_path, "exit 0\n")
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    if os.access(path, os.X_OK):  # root with any x bit... none is set here, so never
        pytest.skip("root may execute a file without x bits on this system")
    with pytest.raises(smi.NvidiaSmiNotFound):
        smi.NvidiaSmi.find(path)


def test_find_explicit_path(tmp_path):
    path = fake_binary(tmp_path, "exit 0\n")
    assert smi.NvidiaSmi.find(path) == path


def test_find_searches_path_before_the_usual_places(tmp_path, monkeypatch):
    in_path, usual = tmp_path / "in-path", tmp_path / "usual"
    in_path.mkdir()
    usual.mkdir()
    fake_binary(in_path, "exit 0\n")
    fake_binary(usual, "exit 0\n")
    monkeypatch.setattr(smi.NvidiaSmi, "SEARCH_PATHS", (str(usual),))
    monkeypatch.setenv("PATH", os.pathsep.join(["", str(tmp_path / "empty"), str(in_path)]))
    assert smi.NvidiaSmi.find() == str(in_path / "nvidia-smi")
    assert smi.NvidiaSmi.find(search_path="") == str(usual / "nvidia-smi")


def test_find_names_the_places_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(smi.NvidiaSmi, "SEARCH_PATHS", (str(tmp_path / "usr-bin"),))
    with pytest.raises(smi.NvidiaSmiNotFound, match="usr-bin") as info:
        smi.NvidiaSmi.find(search_path=str(tmp_path))
    assert "Set nvidia_smi" in info.value.msg


# An R470-era driver: no memory.reserved (rc 2), everything else answers.
OLD_DRIVER = """\
echo "$*" >> "{log}"
case "$*" in
  *memory.reserved*) echo 'Field "memory.reserved" is not a valid field to query.'; echo; exit 2 ;;
  *--query-gpu=*) echo "0, GPU-1, NVIDIA A100-SXM4-40GB, 00000000:07:00.0, 470.57.02, 40536, 3, 40533, 0, 33, 55.12, Enabled, Disabled" ;;
  *--query-compute-apps=*) echo "495, GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5, 1200" ;;
esac
"""


def test_old_driver_without_memory_reserved_reads_it_as_none(tmp_path):
    log = tmp_path / "calls.log"
    runner = smi.NvidiaSmi(fake_binary(tmp_path, OLD_DRIVER.format(log=log)), timeout=5)
    (gpu,) = runner.query_gpus()
    assert gpu["memory_reserved_mib"] is None and gpu["memory_used_mib"] == 3 and gpu["driver_version"] == "470.57.02"
    assert runner.calls == 2
    assert "memory.reserved" not in log.read_text().splitlines()[1]


def test_old_driver_fallback_keeps_gpu_selection(tmp_path):
    log = tmp_path / "calls.log"
    runner = smi.NvidiaSmi(fake_binary(tmp_path, OLD_DRIVER.format(log=log)), timeout=5)
    runner.query_gpus(gpus=[0])
    assert all(line.startswith("-i 0 ") for line in log.read_text().splitlines())


def test_bad_field_other_than_memory_reserved_is_not_swallowed(tmp_path):
    path = fake_binary(tmp_path, "echo 'Field \"power.draw\" is not a valid field to query.'\nexit 2\n")
    runner = smi.NvidiaSmi(path, timeout=5)
    with pytest.raises(smi.BadField) as info:
        runner.query_gpus()
    assert info.value.field == "power.draw" and runner.calls == 1


MODERN_DRIVER = """\
case "$*" in
  *--query-gpu=*) echo "0, GPU-1, NVIDIA H200, 00000000:18:00.0, 580.159.04, 143771, 616, 1200, 141955, 0, 37, 126.02, Enabled, Disabled" ;;
  *--query-compute-apps=*) echo "495, GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5, 1200" ;;
esac
"""


def test_query_all_runs_the_gpu_and_the_apps_call(tmp_path):
    runner = smi.NvidiaSmi(fake_binary(tmp_path, MODERN_DRIVER), timeout=5)
    gpus, apps = runner.query_all()
    assert runner.calls == 2
    assert [(g["index"], g["memory_reserved_mib"], g["memory_used_mib"]) for g in gpus] == [(0, 616, 1200)]
    assert [(a["pid"], a["name"], a["used_memory_mib"], a["gpu_uuid"]) for a in apps] == [(495, None, 1200, "GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5")]


def test_query_all_on_an_old_driver_retries_the_gpu_call_only(tmp_path):
    runner = smi.NvidiaSmi(fake_binary(tmp_path, OLD_DRIVER.format(log=tmp_path / "log")), timeout=5)
    gpus, apps = runner.query_all()
    assert runner.calls == 3
    assert gpus[0]["memory_reserved_mib"] is None and [a["pid"] for a in apps] == [495]


def test_query_all_without_processes_is_one_call(tmp_path):
    runner = smi.NvidiaSmi(fake_binary(tmp_path, MODERN_DRIVER), timeout=5)
    gpus, apps = runner.query_all(with_apps=False)
    assert (runner.calls, apps, len(gpus)) == (1, [], 1)


def test_driver_not_loaded_does_not_wait_for_a_hung_apps_call(tmp_path):
    path = fake_binary(
        tmp_path,
        """\
        case "$*" in
          *--query-compute-apps=*) sleep 30 ;;
          *) echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9 ;;
        esac
        """,
    )
    started = time.monotonic()
    with pytest.raises(smi.DriverNotLoaded):
        smi.NvidiaSmi(path, timeout=20).query_all()
    assert time.monotonic() - started < 3


@pytest.mark.parametrize(
    "gpus, expected",
    [
        (None, ["--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"]),
        ([0, 3], ["-i", "0,3", "--query-gpu=index,uuid,memory.used", "--format=csv,noheader,nounits"]),
    ],
    ids=["all", "selected"],
)
def test_gpu_args(gpus, expected):
    assert smi.NvidiaSmi.gpu_args(MEMORY_FIELDS, gpus) == expected


def test_app_args_ask_for_the_app_fields():
    assert smi.NvidiaSmi.app_args() == ["--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]


def test_meanwhile_runs_while_the_query_is_out_and_its_pid_is_remembered(tmp_path):
    """query_gpus(meanwhile=...) runs it once after starting the real process and before reading
    it; the process's PID is in .pids (the look leaves its own calls out of the /proc pass)."""
    path = fake_binary(tmp_path, 'sleep 0.3\necho "0, GPU-1, 1024"\n')
    worker = smi.NvidiaSmi(path, timeout=5)
    seen = []

    def meanwhile():
        [pid] = worker.pids
        seen.append(os.path.exists(f"/proc/{pid:d}"))

    gpus = worker.query_gpus((("index", "index", "int"), ("uuid", "uuid", "str"), ("memory.used", "memory_used_mib", "int")), meanwhile=meanwhile)
    assert seen == [True] and [(g["index"], g["memory_used_mib"]) for g in gpus] == [(0, 1024)]


def test_meanwhile_failing_kills_the_query_it_ran_beside(tmp_path):
    path = fake_binary(tmp_path, "sleep 30\n")
    worker = smi.NvidiaSmi(path, timeout=60)

    seen = []

    def meanwhile():
        seen.extend(worker.pids)
        raise RuntimeError("the /proc pass failed")

    began = time.monotonic()
    with pytest.raises(RuntimeError, match="the /proc pass failed"):
        worker.query_gpus(meanwhile=meanwhile)
    [pid] = seen
    assert time.monotonic() - began < 5 and not os.path.exists(f"/proc/{pid:d}") and worker.pids == set()


def test_a_call_collected_after_its_timeout_that_had_answered_is_read_not_timed_out(tmp_path):
    """The early compute-apps call is read after the kernel log and Fabric Manager reads, which
    may take longer than `timeout`: an answer that came in time is no hung driver."""
    path = fake_binary(tmp_path, 'echo "answered"\n')
    worker = smi.NvidiaSmi(path, timeout=0.2)
    started = worker.start([])
    time.sleep(0.5)
    assert worker.finish(started) == "answered\n" and worker.pids == set()


def test_a_finished_call_leaves_the_pids_left_out_of_the_proc_pass(tmp_path):
    path = fake_binary(tmp_path, 'echo "0, GPU-1, 1024"\n')
    worker = smi.NvidiaSmi(path, timeout=5)
    worker.query_gpus((("index", "index", "int"), ("uuid", "uuid", "str"), ("memory.used", "memory_used_mib", "int")))
    assert worker.pids == set()  # a recycled PID is someone else's, never left out of a later look
