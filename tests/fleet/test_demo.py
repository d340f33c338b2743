"""`make demo`, one of README.md's two commands, as make runs it (tests/fleet/demo.py), under a
fleet prefix of its own: it frees a busy fleet, puts back what it stopped, and only then audits, so
that its audit lists nothing pending restore after "every GPU freed" (issue 67); no ansible command
of it warns; its fleet is down at the end."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

import fleet as rig

PREFIX = rig.checkout_prefix("m")  # not "d": test_fleet_rig.py crashes a fleet of that prefix at the same time


@pytest.fixture
def demo_prefix():
    if os.geteuid() != 0 or not shutil.which("systemd-nspawn"):
        if os.environ.get("ZEROMIB_FLEET_REQUIRED") == "1" or os.environ.get("CI"):
            pytest.fail("the demo must run here but needs root and systemd-nspawn")
        pytest.skip("the demo needs root and systemd-nspawn")
    try:
        yield PREFIX
    finally:
        rig.Fleet(PREFIX).down()


def test_demo_frees_puts_back_then_audits_with_nothing_pending_and_downs_its_fleet(demo_prefix, tmp_path):
    r = subprocess.run([str(rig.REPO / ".venv" / "bin" / "python"), str(rig.FLEET_DIR / "demo.py"), "--name", demo_prefix],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
                       env={k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PYTEST_"))})
    out = r.stdout
    assert r.returncode == 0, out[-6000:] + r.stderr[-3000:]
    steps = [line.split(":")[0] for line in out.splitlines() if line.startswith("==> ")]
    order = ["==> Freeing every GPU", "==> GPU memory after", "==> Putting back what was stopped (as when training ends)",
             "==> Auditing the fleet as it runs now (read-only; the servers put back hold their GPUs again) into "
             f"{tmp_path}/gpu_audit_report/", "==> Done"]
    assert [s for s in steps if s in order] == order, steps
    assert out.rstrip().endswith("every GPU of every node was freed and verified, and what was stopped was put back"), out[-2000:]
    assert "4 hosts: 2 put back, 2 nothing" in out, out[-6000:]
    report = json.loads((tmp_path / "gpu_audit_report" / "report.json").read_text())
    assert report["summary"]["hosts_pending_restore"] == 0 and report["summary"]["hosts_total"] == 4, report["summary"]
    assert not [line for line in (r.stderr + out).splitlines() if "WARNING" in line.upper()], r.stderr[-3000:]
    assert rig.Fleet(demo_prefix).leftovers() == [], rig.Fleet(demo_prefix).leftovers()
