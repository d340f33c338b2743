# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The CUDA smoke test on the controller: the gate's verdict, the outcome message and the audit
model (controller code: ansible-test runs these apart from the module_utils tests)."""

from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cuda_smoke as smoke
from ansible_collections.zeromib.gpu.plugins.plugin_utils._gate import gate_failures
from ansible_collections.zeromib.gpu.plugins.filter.free_gpus import free_gpus_outcome


def records(*oks):
    return [{"index": i, "pci_bus_id": f"b{i}", "smoke_test": smoke.result(ok, "CUDA_ERROR_X (1) at cuInit" if ok is False else None,
                                                                           0.2 if ok else None, 1024 if ok else None,
                                                                           skipped="MIG" if ok is None else None)}
            for i, ok in enumerate(oks)]


# --- the role's gate


def released_with(*oks):
    gpus = [dict(g, clean=True, memory_used_mib=0) for g in records(*oks)]
    result = {"changed": False, "released": True, "selected_gpus": [g["index"] for g in gpus], "gpus_before": gpus, "gpus": gpus,
              "healthy": True, "elapsed_s": 0.1}
    result.update(smoke.summary(gpus, {g["index"]: g["smoke_test"] for g in gpus}, seconds=0.4))
    return result


def test_a_failed_smoke_test_fails_the_gate_naming_gpu_and_error():
    result = released_with(True, False)
    assert gate_failures(result, {}, False) == ["free_gpus_smoke_test"]
    outcome = free_gpus_outcome(result, "node01", require_healthy=True)
    assert outcome["status"] == "unhealthy" and outcome["ok"] is False
    assert outcome["message"] == "node01: smoke test failed: GPU 1 (b1): CUDA_ERROR_X (1) at cuInit"


def test_a_passed_smoke_test_is_said_and_a_skipped_gpu_named():
    result = released_with(True, None)
    assert gate_failures(result, {}, False) == []
    outcome = free_gpus_outcome(result, "node01", require_healthy=True)
    assert outcome["ok"] and "smoke test passed on 1 GPU (1024 MiB, 0.2 s)" in outcome["message"]
    assert "smoke test skipped on GPU 1: MIG" in outcome["message"]


# --- the audit


def test_the_audit_model_carries_each_gpus_last_smoke_test():
    from ansible_collections.zeromib.gpu.plugins.filter.gpu_audit_model import gpu_audit_model

    gpus = [dict(g, memory_used_mib=0, memory_total_mib=143771, clean=True) for g in records(True, False, None)]
    gpus.append({"index": 3, "pci_bus_id": "b3", "memory_used_mib": 0, "memory_total_mib": 143771, "clean": True})
    facts = {"count": 4, "clean": True, "memory_used_mib": 0, "error": None, "gpus": gpus, "processes": [], "holders": []}
    model = gpu_audit_model([{"host": "node01", "status": "ok", "gpu": facts}], 0.0)
    assert [(g["smoke_test"] or {}).get("result") for g in model["hosts"][0]["gpus"]] == ["passed", "FAILED", "skipped", None]
