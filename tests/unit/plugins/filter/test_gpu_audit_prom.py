# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_audit_prom: the audit model as a node_exporter textfile."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_model import gpu_audit_model
from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_prom import FilterModule, escape_label_value, gpu_audit_prom
from ansible_collections.zeromib.gpu.tests.unit.plugins.filter import audit_hosts as ah

EPOCH = 1748779200.0
FAMILIES = [
    "zeromib_gpu_audit_timestamp_seconds", "zeromib_gpu_audit_hosts", "zeromib_gpu_host_up", "zeromib_gpu_host_clean",
    "zeromib_gpu_host_info", "zeromib_gpu_devices", "zeromib_gpu_holders", "zeromib_gpu_nvml_clients", "zeromib_gpu_pending_restore",
    "zeromib_gpu_driver_drift", "zeromib_gpu_minor_order_differs", "zeromib_gpu_shm_free_mib", "zeromib_gpu_shm_unheld_mib", "zeromib_gpu_shm_unheld_files",
    "zeromib_gpu_memory_used_mib",
    "zeromib_gpu_memory_total_mib", "zeromib_gpu_clean", "zeromib_gpu_healthy", "zeromib_gpu_health_checked", "zeromib_gpu_ecc_uncorrected",
    "zeromib_gpu_xid_recent", "zeromib_gpu_ghost_busy",
]
# A sample line: name, optional {labels}, value. Label values may hold escaped quotes and backslashes.
SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*)\})? (?P<value>\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def _unescape(value):
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def parse(text):
    """Samples as {(name, frozenset(labels)): value}; fails on any line the format does not allow."""
    assert text.endswith("\n") and "\n\n" not in text
    samples, typed = {}, []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            dummy, dummy, name, kind = line.split(" ")
            assert kind == "gauge"
            typed.append(name)
            continue
        match = SAMPLE.match(line)
        assert match, f"not a valid sample line: {line!r}"
        labels = frozenset((k, _unescape(v)) for k, v in LABEL.findall(match.group("labels") or ""))
        key = (match.group("name"), labels)
        assert key not in samples, f"duplicate sample {key!r}"
        assert match.group("name") == typed[-1], f"sample outside its family: {line!r}"
        samples[key] = float(match.group("value"))
    assert typed == FAMILIES
    return samples


def _value(samples, metric, **labels):
    matches = [v for (n, ls), v in samples.items() if n == metric and all((k, str(val)) in ls for k, val in labels.items())]
    assert len(matches) == 1, (metric, labels, matches)
    return matches[0]


@pytest.mark.parametrize("raw, escaped", [
    pytest.param("node01", "node01", id="plain"),
    pytest.param('we"ird', 'we\\"ird', id="quote"),
    pytest.param("back\\slash", "back\\\\slash", id="backslash"),
    pytest.param("two\nlines", "two\\nlines", id="newline"),
    pytest.param('\\"\n', '\\\\\\"\\n', id="all-three-in-order"),
    pytest.param("NVIDIA GeForce RTX 4080 SUPER", "NVIDIA GeForce RTX 4080 SUPER", id="spaces-untouched"),
    pytest.param("ünï{cødé}=,", "ünï{cødé}=,", id="utf8-and-braces-untouched"),
    pytest.param(None, "", id="none-is-empty"),
    pytest.param(3, "3", id="number"),
])
def test_label_values_are_escaped_per_the_exposition_format(raw, escaped):
    assert escape_label_value(raw) == escaped


def test_fleet_metrics():
    samples = parse(gpu_audit_prom(gpu_audit_model(ah.fleet(), EPOCH)))
    assert _value(samples, "zeromib_gpu_audit_timestamp_seconds") == EPOCH
    assert [_value(samples, "zeromib_gpu_audit_hosts", status=s) for s in ("clean", "dirty", "error", "unreachable")] == [2, 1, 1, 1]
    assert {h: _value(samples, "zeromib_gpu_host_up", host=h) for h in ("clean-h200", "dirty-h200", "mig-h200", "hung-driver", "gone")} == {
        "clean-h200": 1, "dirty-h200": 1, "mig-h200": 1, "hung-driver": 0, "gone": 0}
    assert {h: _value(samples, "zeromib_gpu_host_clean", host=h) for h in ("clean-h200", "dirty-h200", "mig-h200", "hung-driver", "gone")} == {
        "clean-h200": 1, "dirty-h200": 0, "mig-h200": 1, "hung-driver": 0, "gone": 0}
    assert _value(samples, "zeromib_gpu_host_info", host="dirty-h200", status="dirty", driver_version="580.159.04", cuda_version="13.0") == 1
    assert _value(samples, "zeromib_gpu_host_info", host="gone", status="unreachable") == 1
    # issue 55: what is not known is no label (was cuda_version="")
    [gone] = [labels for (metric, labels) in samples if metric == "zeromib_gpu_host_info" and ("host", "gone") in labels]
    assert {k for k, _v in gone} == {"host", "status"}
    assert _value(samples, "zeromib_gpu_holders", host="dirty-h200") == 1, "protected holders and NVML clients do not count"
    assert _value(samples, "zeromib_gpu_nvml_clients", host="dirty-h200") == 2
    assert _value(samples, "zeromib_gpu_nvml_clients", host="clean-h200") == 0
    uuid = "GPU-ab0cf4f6-818d-be7e-f16b-963690000000"
    assert _value(samples, "zeromib_gpu_memory_used_mib", host="dirty-h200", gpu=0, uuid=uuid, name="NVIDIA H200") == 10267
    assert _value(samples, "zeromib_gpu_memory_used_mib", host="mig-h200", gpu=7) == 55
    assert _value(samples, "zeromib_gpu_memory_total_mib", host="clean-h200", gpu=3) == 143771
    assert _value(samples, "zeromib_gpu_clean", host="dirty-h200", gpu=0) == 0
    assert _value(samples, "zeromib_gpu_clean", host="mig-h200", gpu=0) == 1
    assert _value(samples, "zeromib_gpu_devices", host="clean-h200") == 8
    for down in ("gone", "hung-driver"):
        assert not [k for k in samples if k[0] in ("zeromib_gpu_devices", "zeromib_gpu_holders", "zeromib_gpu_memory_used_mib") and ("host", down) in k[1]]
    assert len([k for k in samples if k[0] == "zeromib_gpu_memory_used_mib"]) == 24


def test_awkward_label_values_round_trip():
    odd = ah.dirty_with_holders('rack"7\\node\n01')
    odd["gpu"]["gpus"][0]["name"] = 'NVIDIA "H200" \\ SXM'
    samples = parse(gpu_audit_prom(gpu_audit_model([odd], EPOCH)))
    assert _value(samples, "zeromib_gpu_host_up", host='rack"7\\node\n01') == 1
    assert _value(samples, "zeromib_gpu_memory_used_mib", host='rack"7\\node\n01', gpu=0, name='NVIDIA "H200" \\ SXM') == 10267


def test_unknown_memory_is_left_out_not_zero():
    record = ah.clean_h200x8("wddm")
    record["gpu"]["gpus"][0]["memory_used_mib"] = None
    text = gpu_audit_prom(gpu_audit_model([record], EPOCH))
    assert 'zeromib_gpu_memory_used_mib{host="wddm",gpu="0",' not in text
    assert 'zeromib_gpu_memory_total_mib{host="wddm",gpu="0",' in text


def test_an_empty_fleet_still_has_every_family():
    samples = parse(gpu_audit_prom(gpu_audit_model([], EPOCH)))
    assert _value(samples, "zeromib_gpu_audit_hosts", status="clean") == 0


def test_promtool_accepts_the_file(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool missing: tests/tools/apt-deps.sh installs the prometheus package")
    odd = ah.dirty_with_holders('rack"7\\node\n01')
    text = gpu_audit_prom(gpu_audit_model(ah.fleet() + [odd], EPOCH))
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("model", [None, [], {"summary": {}}, {"hosts": "x"}], ids=["none", "list", "no-hosts", "hosts-not-list"])
def test_anything_but_a_model_fails_clearly(model):
    with pytest.raises(AnsibleFilterError, match="expects the report model"):
        gpu_audit_prom(model)


def test_filter_is_registered():
    assert FilterModule().filters() == {"gpu_audit_prom": gpu_audit_prom}


def test_health_metrics_from_gpu_facts_health():
    from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_model import gpu_audit_model
    from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_prom import gpu_audit_prom

    gpu = {"index": 0, "uuid": "GPU-1", "name": "NVIDIA H200", "memory_used_mib": 0, "memory_total_mib": 143771, "clean": True,
           "healthy": False, "health_issues": ["Xid 79 (GPU has fallen off the bus) in the kernel log recently"],
           "health": {"ecc_uncorrected_volatile": 2, "xids": [{"xid": 79, "time": None, "message": "NVRM: Xid ..."}]}}
    model = gpu_audit_model([{"host": "node01", "gpu": {"count": 1, "clean": True, "healthy": False, "gpus": [gpu]}}], generated_at=0)
    assert model["hosts"][0]["unhealthy_gpus"] == [0] and model["summary"]["gpus_unhealthy"] == 1
    text = gpu_audit_prom(model)
    assert 'zeromib_gpu_healthy{host="node01",gpu="0",uuid="GPU-1"} 0' in text
    assert 'zeromib_gpu_ecc_uncorrected{host="node01",gpu="0",uuid="GPU-1"} 2' in text
    assert 'zeromib_gpu_xid_recent{host="node01",gpu="0",uuid="GPU-1"} 1' in text


def test_health_checked_metric_says_when_checks_could_not_run():
    from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_model import gpu_audit_model
    from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_prom import gpu_audit_prom

    # The GPU whose remap fields the driver rejected: healthy as far as was read, and said not checked.
    base = {"uuid": "GPU-1", "name": "NVIDIA H200", "memory_used_mib": 0, "memory_total_mib": 143771, "clean": True, "healthy": True,
            "health_issues": [], "health": {"ecc_uncorrected_volatile": 0, "xids": []}}
    gpus = [dict(base, index=0, health_checked=False, health_unchecked=["row_remap", "mig"]),
            dict(base, index=1, uuid="GPU-2", health_checked=True, health_unchecked=[])]
    model = gpu_audit_model([{"host": "node01", "gpu": {"count": 2, "clean": True, "healthy": True, "gpus": gpus}}], generated_at=0)
    assert model["hosts"][0]["gpus"][0]["health_unchecked"] == ["row_remap", "mig"]
    text = gpu_audit_prom(model)
    assert 'zeromib_gpu_healthy{host="node01",gpu="0",uuid="GPU-1"} 1' in text
    assert 'zeromib_gpu_health_checked{host="node01",gpu="0",uuid="GPU-1"} 0' in text
    assert 'zeromib_gpu_health_checked{host="node01",gpu="1",uuid="GPU-2"} 1' in text


def test_a_ghost_busy_gpu_reads_1_and_an_idle_one_0():
    """Issue 71: busy with no process and no memory, per GPU, for an alert on the next job's node."""
    gpus = [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA B200", "memory_used_mib": 0, "memory_total_mib": 183359, "clean": True,
             "utilization_gpu_pct": pct, "power_draw_w": 101.5} for i, pct in ((0, 0), (1, 100))]
    model = gpu_audit_model([{"host": "node01", "gpu": {"count": 2, "clean": True, "gpus": gpus, "holders": [], "processes": []}}], generated_at=0)
    text = gpu_audit_prom(model)
    assert 'zeromib_gpu_ghost_busy{host="node01",gpu="0",uuid="GPU-0"} 0' in text
    assert 'zeromib_gpu_ghost_busy{host="node01",gpu="1",uuid="GPU-1"} 1' in text
