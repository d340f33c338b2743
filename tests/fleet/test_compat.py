"""The ansible-core compatibility matrix on the controller (tests/compat/matrix.py): each
ansible-core release that meta/runtime.yml admits frees a busy fleet host with free_gpus.yml (the
role, gpu_release, the summary filter) and audits it with audit_gpus.yml (gpu_facts, the JMESPath
fleet query, the report templates), over SSH, from its own venv. A Python missing from this machine skips its entry under `make test`
(the run's last lines name it) and fails it under `make test-matrix` (tests/conftest.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios import PLAYBOOK, summary_lines

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import matrix  # noqa: E402

AUDIT = "playbooks/audit_gpus.yml"


@pytest.fixture
def h200_host(fleet):
    host = [h.name for h in fleet.hosts if h.preset == "h200x8"][0]
    yield host
    fleet.reset([host])


@pytest.mark.parametrize(("core", "python"), matrix.CONTROLLER, ids=[f"ansible-core-{c}-py{p}" for c, p in matrix.CONTROLLER])
def test_controller_runs_role_modules_and_audit(fleet, h200_host, tmp_path, core, python):
    bin_dir = matrix.controller_bin(core, python)
    version = subprocess.run([str(bin_dir / "ansible-playbook"), "--version"], capture_output=True, text=True, check=True).stdout
    assert f"[core {core}]" in version and f"python version = {python}." in version, version
    env = {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"}

    fleet.workload(h200_host, "vllm")
    run = fleet.ansible_playbook(PLAYBOOK, limit=h200_host, bin_dir=bin_dir, env=env,
                                 extra_vars={"free_gpus_services": ["vllm*.service"], "free_gpus_kill_timeout": 2})
    assert run.rc == 0, run
    lines = summary_lines(run)
    assert lines and lines[-1] == "1 host: 1 freed", run
    assert set(fleet.gpu_memory(h200_host).values()) == {0}

    report_dir = tmp_path / "report"
    run = fleet.ansible_playbook(AUDIT, limit=h200_host, bin_dir=bin_dir, env=env,
                                 extra_vars={"gpu_audit_report_dir": str(report_dir), "gpu_audit_fail_on_dirty": True})
    assert run.rc == 0, run
    report = json.loads((report_dir / "report.json").read_text())
    assert [(h["host"], h["status"]) for h in report["hosts"]] == [(h200_host, "clean")], report["hosts"]
    assert (report_dir / "report.html").stat().st_size > 0 and (report_dir / "gpu_audit.prom").stat().st_size > 0
