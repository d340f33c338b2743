# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""_unified_memory: a GPU that shares the host's memory (memory [N/A]) is told from nvidia-smi's own
tokens, proven by its compute processes and the host's MemAvailable, and a GPU whose memory is
[Unknown Error] or unknown is never taken for it."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _unified_memory as um

FIELDS = smi.GPU_FIELDS
GB10 = "0, GPU-11111111-2222-3333-4444-555555555555, NVIDIA GB10, 0000000F:01:00.0, 580.95.05, [N/A], [N/A], [N/A], [N/A], 0, 45, 11.0, Enabled, [N/A]"
UUID = "GPU-11111111-2222-3333-4444-555555555555"


def gb10(text=GB10):
    return smi.parse_gpus(text, FIELDS)


def test_all_three_memory_fields_na_is_the_shape():
    assert smi.shows_unified_memory(gb10()) and um.shows_unified(gb10()[0])


def test_unknown_error_memory_is_not_the_shape_and_stays_never_clean():
    records = gb10(GB10.replace("[N/A], [N/A], [N/A], [N/A]", "[Unknown Error], [N/A], [Unknown Error], [Unknown Error]"))
    assert not smi.shows_unified_memory(records) and not um.shows_unified(records[0])
    assert not _facts.gpu_is_clean(records[0], 0)


def test_no_compute_process_and_enough_host_memory_is_free():
    records = gb10()
    um.fill(records, [], 1024, 4096)
    gpu = records[0]
    assert gpu["memory_used_mib"] == 0 and gpu["memory_proof"] == um.UNIFIED and _facts.gpu_is_clean(gpu, 0)
    assert _facts.public_gpu(gpu, 0)["host_memory_available_mib"] == 4096


def test_a_compute_process_or_short_or_unread_host_memory_is_not_free():
    busy = gb10()
    um.fill(busy, [{"pid": 7, "gpu_uuid": UUID, "used_memory_mib": 0}], 1024, 4096)
    assert not _facts.gpu_is_clean(busy[0], 0) and busy[0]["_unified_not_free"] == um.BUSY  # a 0 MiB process is still one
    short = gb10()
    um.fill(short, [], 1024, 1023)
    assert not _facts.gpu_is_clean(short[0], 0) and "it has 1023 MiB available" in um.failure(short[0])
    unread = gb10()
    um.fill(unread, [], 1024, None)
    assert not _facts.gpu_is_clean(unread[0], 0) and "could not be read" in um.failure(unread[0])


def test_a_process_whose_used_memory_is_unknown_leaves_the_reading_unknown():
    records = gb10()
    um.fill(records, [{"pid": 7, "gpu_uuid": UUID, "used_memory_mib": None}], 1024, 4096)
    assert records[0]["memory_used_mib"] is None and not _facts.gpu_is_clean(records[0], 0)


def test_memavailable_is_read_in_mib_and_a_missing_line_is_none(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:    2097152 kB\n")
    assert um.host_available_mib(str(meminfo)) == 2048
    meminfo.write_text("MemTotal:       131072000 kB\n")
    assert um.host_available_mib(str(meminfo)) is None
    assert um.host_available_mib(str(tmp_path / "absent")) is None


def test_a_plain_gpu_keeps_the_memory_used_proof():
    plain = smi.parse_gpus(GB10.replace("[N/A], [N/A], [N/A], [N/A]", "143771, 616, 0, 143155"), FIELDS)
    assert not smi.shows_unified_memory(plain)
    assert _facts.public_gpu(plain[0], 0)["memory_proof"] == "memory.used"
