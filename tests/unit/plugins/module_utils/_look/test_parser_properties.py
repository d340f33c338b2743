# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Property tests: whatever nvidia-smi or /proc print, the parsers answer with a record or
with their documented exception, never with a traceback from somewhere else."""

from __future__ import annotations

import shlex
import uuid as uuid_mod

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units as units_mod
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import captures

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A small field set of the kind a memory poll asks for (index, uuid, memory.used).
MEMORY_FIELDS = (("index", "index", "int"), ("uuid", "uuid", "str"), ("memory.used", "memory_used_mib", "int"))
FIELD_SETS = {"gpu": smi.GPU_FIELDS, "memory": MEMORY_FIELDS, "apps": smi.APP_FIELDS}

# Cells nvidia-smi prints, and cells it should never print. "inf" and numbers past float range
# ("1" * 400) are left out on purpose: they crash parse_value today
# (test_infinite_memory_reading_is_unparsable_not_a_crash).
TOKENS = (
    "[N/A]",
    "N/A",
    "[Not Supported]",
    "[Unknown Error]",
    "[Insufficient Permissions]",
    "[Not Found]",
    "[No data]",
    "[Requested functionality has been deprecated]",
    "[GPU is lost]",
    "",
    " ",
    ",",
    ", ",
    ",,",
    "[",
    "]",
    "[[N/A]",
    "0",
    "-1",
    "12.5",
    "1e3",
    "nan",
    "0x1F",
    "143771 MiB",
    "126.02 W",
    "0 %",
    "MiB",
    "GPU-00000000",
    "index",
    "memory.used [MiB]",
    "pid",
    "used_gpu_memory [MiB]",
    "\t",
    "\x00",
    "é",
    "\u2028",
    "\r",
    "9" * 300,
)


def _parse_any(kind, text):
    fields = FIELD_SETS[kind]
    if kind == "apps":
        return smi.parse_compute_apps(text, fields)
    return smi.parse_gpus(text, fields)


def _only_nvidia_smi_errors(kind, text):
    try:
        records = _parse_any(kind, text)
    except smi.NvidiaSmiError as exc:
        assert exc.stdout == text and exc.msg
        return None
    for record in records:
        assert set(record) == {key for _f, key, _k in FIELD_SETS[kind]} | {"_unavailable"}
    return records


@SETTINGS
@given(kind=st.sampled_from(sorted(FIELD_SETS)), text=st.text())
def test_arbitrary_text_raises_only_nvidia_smi_errors(kind, text):
    _only_nvidia_smi_errors(kind, text)


csv_line = st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=6)), min_size=0, max_size=15).map(", ".join)


@SETTINGS
@given(kind=st.sampled_from(sorted(FIELD_SETS)), lines=st.lists(csv_line, max_size=4))
def test_csv_shaped_garbage_raises_only_nvidia_smi_errors(kind, lines):
    _only_nvidia_smi_errors(kind, "\n".join(lines) + "\n")


@SETTINGS
@given(
    fields=st.lists(
        st.tuples(st.sampled_from(["index", "pid", "memory.used", "process_name", "x.y"]), st.sampled_from(["int", "float", "str", "raw"])),
        min_size=1,
        max_size=5,
    ),
    text=st.text(),
)
def test_parse_csv_with_any_field_kinds_raises_only_nvidia_smi_errors(fields, text):
    fields = tuple((name, f"k{i:d}", kind) for i, (name, kind) in enumerate(fields))
    try:
        smi.parse_csv(text, fields)
    except smi.NvidiaSmiError:
        pass


# ------------------------------------------------------------------ mutated real captures


def _real_outputs():
    found = []
    for name in captures.h200_names():
        capture = captures.h200(name)
        query = captures.query_of(capture.args)
        if capture.rc == 0 and query and query.switch == "gpu" and query.fields[:2] == ["index", "uuid"]:
            found.append(("gpu", capture.output, tuple((f, f, "str") for f in query.fields)))
        elif capture.rc == 0 and query and query.switch == "compute-apps":
            found.append(("apps", capture.output, tuple((f, f, "raw" if f == "process_name" else "str") for f in query.fields)))
    for name in captures.exporter_names():
        for phase in ("idle", "load"):
            section = captures.exporter_section(name, phase, "query-compute-apps")
            query = captures.query_of(shlex.split(section.command)[1:])
            found.append(
                ("apps", section.output, tuple((f, f, {"process_name": "raw", "pid": "int", "used_gpu_memory": "int"}.get(f, "str")) for f in query.fields))
            )
    return found


REAL = _real_outputs()


@st.composite
def mutated_capture(draw):
    kind, text, fields = draw(st.sampled_from(REAL))
    lines = text.splitlines()
    for _step in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["drop", "swap", "inject", "duplicate", "truncate"]))
        if not lines:
            break
        row = draw(st.integers(0, len(lines) - 1))
        cells = lines[row].split(", ")
        if op == "drop":
            del lines[row]
        elif op == "duplicate":
            lines.insert(row, lines[row])
        elif op == "truncate":
            lines[row] = lines[row][: draw(st.integers(0, len(lines[row])))]
        elif op == "swap":
            other = draw(st.integers(0, len(lines) - 1))
            other_cells = lines[other].split(", ")
            i, j = draw(st.integers(0, len(cells) - 1)), draw(st.integers(0, len(other_cells) - 1))
            cells[i], other_cells[j] = other_cells[j], cells[i]
            lines[row] = ", ".join(cells)
            if other != row:
                lines[other] = ", ".join(other_cells)
        else:
            cells.insert(draw(st.integers(0, len(cells))), draw(st.sampled_from(TOKENS)))
            lines[row] = ", ".join(cells)
    return kind, "\n".join(lines) + "\n", fields


@SETTINGS
@given(case=mutated_capture())
def test_mutated_real_captures_raise_only_nvidia_smi_errors(case):
    kind, text, fields = case
    try:
        (smi.parse_compute_apps if kind == "apps" else smi.parse_csv)(text, fields)
    except smi.NvidiaSmiError:
        pass


@SETTINGS
@given(case=mutated_capture())
def test_mutated_real_captures_through_our_own_fields(case):
    kind, text, _fields = case
    _only_nvidia_smi_errors("apps" if kind == "apps" else "memory", text)


# ------------------------------------------------------------------ round trips

line_breaks = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
process_name = st.text(st.characters(blacklist_characters=line_breaks, blacklist_categories=("Cs",)), max_size=40).map(str.strip)
uuid = st.integers(0, 2**128 - 1).map(lambda n: f"GPU-{uuid_mod.UUID(int=n)}")
mib = st.one_of(st.integers(0, 200000), st.just(None))


@SETTINGS
@given(apps=st.lists(st.tuples(st.integers(1, 2**22), process_name, mib, uuid), max_size=6), header=st.booleans(), units=st.booleans())
def test_compute_apps_round_trip_whatever_the_process_is_called(apps, header, units):
    lines = ["pid, process_name, used_gpu_memory [MiB], gpu_uuid"] if header else []
    for pid, name, used, gpu in apps:
        memory = "[N/A]" if used is None else (f"{used:d} MiB" if units else str(used))
        lines.append(f"{pid:d}, {name}, {memory}, {gpu}")
    named = (("pid", "pid", "int"), ("process_name", "name", "raw"), ("used_memory", "used_memory_mib", "int"), ("gpu_uuid", "gpu_uuid", "str"))
    parsed = smi.parse_compute_apps("\n".join(lines) + "\n", named)
    assert [(a["pid"], a["name"], a["used_memory_mib"], a["gpu_uuid"]) for a in parsed] == apps


@SETTINGS
@given(apps=st.lists(st.tuples(st.integers(1, 2**22), uuid, mib), max_size=6), units=st.booleans())
def test_compute_apps_as_the_module_asks_them_round_trip(apps, units):
    """pid, gpu_uuid, used_memory: nothing a process chose is in the answer."""
    lines = []
    for pid, gpu, used in apps:
        memory = "[N/A]" if used is None else (f"{used:d} MiB" if units else str(used))
        lines.append(f"{pid:d}, {gpu}, {memory}")
    parsed = smi.parse_compute_apps("\n".join(lines) + "\n")
    assert [(a["pid"], a["gpu_uuid"], a["used_memory_mib"]) for a in parsed] == apps


@SETTINGS
@given(
    gpus=st.lists(
        st.tuples(st.integers(0, 63), uuid, mib, st.one_of(st.floats(0, 1500, allow_nan=False).map(lambda w: round(w, 2)), st.none())), min_size=1, max_size=8
    ),
    units=st.booleans(),
)
def test_gpu_rows_round_trip(gpus, units):
    fields = (("index", "index", "int"), ("uuid", "uuid", "str"), ("memory.used", "memory_used_mib", "int"), ("power.draw", "power_draw_w", "float"))
    lines = []
    for index, gpu, used, watts in gpus:
        memory = "[N/A]" if used is None else (f"{used:d} MiB" if units else str(used))
        power = "[Not Supported]" if watts is None else (f"{watts:.2f} W" if units else f"{watts:.2f}")
        lines.append(f"{index:d}, {gpu}, {memory}, {power}")
    parsed = smi.parse_gpus("\n".join(lines), fields)
    assert [(g["index"], g["uuid"], g["memory_used_mib"], g["power_draw_w"]) for g in parsed] == gpus


# ------------------------------------------------------------------ the other parsers never raise


@SETTINGS
@given(
    text=st.one_of(
        st.text(),
        st.none(),
        st.builds(
            "{:0{}X}:{:02x}:{:02X}.{}".format, st.integers(0, 2**32 - 1), st.sampled_from([0, 4, 8]), st.integers(0, 255), st.integers(0, 31), st.integers(0, 7)
        ),
    )
)
def test_normalize_bus_id_never_raises(text):
    result = smi.normalize_bus_id(text)
    assert result is None or isinstance(result, str)
    if result is not None:
        assert smi.normalize_bus_id(result) == result, "normalizing twice changes the id"


@SETTINGS
@given(text=st.text())
def test_parse_gpu_information_never_raises(text):
    bus, minor = smi.parse_gpu_information(text)
    assert minor is None or isinstance(minor, int)


@SETTINGS
@given(text=st.text())
def test_parse_stat_raises_only_value_or_index_error(text):
    try:
        holders.parse_stat(text)
    except (ValueError, IndexError):
        pass


@SETTINGS
@given(
    comm=st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=15),
    state=st.sampled_from("RSDZTtXI"),
    ppid=st.integers(0, 2**22),
    start=st.integers(0, 2**63),
)
def test_parse_stat_round_trips_any_comm(comm, state, ppid, start):
    text = f"4242 ({comm}) {state} {ppid:d} 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 {start:d} 1000 100 18446744073709551615\n"
    assert holders.parse_stat(text) == (comm, state, ppid, start)


@SETTINGS
@given(text=st.text())
def test_cgroup_helpers_never_raise(text):
    path = holders.parse_cgroup(text)
    for candidate in (path, text):
        holders.unit_of(candidate)
        holders.container_of(candidate)
        holders.is_system_service(candidate)


@SETTINGS
@given(text=st.text())
def test_systemctl_parsers_never_raise(text):
    units_mod.parse_list_units(text)
    units_mod.parse_show(text)
    assume(text.strip())
    assert units_mod.normalize_unit(text).strip()


@SETTINGS
@given(text=st.text())
def test_maps_scan_finds_only_device_paths(text):
    assert all(device.startswith("/dev/nvidia") for device in _devices.mapped_devices(text.encode("utf-8")))


@pytest.mark.parametrize("text", ["", "(", ")", ")(", "1 (a) S", "1 (a) S x"], ids=repr)
def test_parse_stat_examples_of_truncated_lines(text):
    with pytest.raises((ValueError, IndexError)):
        holders.parse_stat(text)
