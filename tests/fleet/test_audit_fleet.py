"""playbooks/audit_gpus.yml over a mixed fleet: clean hosts, a dirty host, an unreachable host,
a host whose nvidia-smi hangs and one without nvidia-smi. The audit is read-only, lists every
host with the right status, and fails the run only when asked to."""
from __future__ import annotations

import json

import pytest

from scenarios import AUDIT, Cast, alive, memory

pytestmark = pytest.mark.usefixtures("fleet_baselines")

HIDE_SMI = "mv /usr/bin/nvidia-smi /usr/bin/nvidia-smi.away"
RESTORE_SMI = "if [ -e /usr/bin/nvidia-smi.away ]; then mv -f /usr/bin/nvidia-smi.away /usr/bin/nvidia-smi; fi"


@pytest.fixture(scope="module")
def audit(fleet, fleet_baselines, tmp_path_factory):
    fleet.reset()
    names = fleet.names
    assert len(names) >= 6, "the audit scenario needs 6 hosts or more"
    cast = Cast(fleet)
    dirty, down, hung, nosmi = names[1], names[2], names[3], names[4]
    holder = fleet.workload(dirty, "train", gpus="1", mib=700)
    fleet.workload(dirty, "persistenced")  # protected: never blocking, never the reason
    fleet.set_fault(hung, hang=True)
    fleet.ssh(nosmi, HIDE_SMI, check=True)
    report_dir = tmp_path_factory.mktemp("gpu_audit") / "report"
    try:
        before = memory(fleet, [h for h in names if h not in (down, hung, nosmi)])
        with fleet.unreachable(down):
            run = fleet.ansible_playbook(AUDIT, extra_vars={"gpu_audit_timeout": 2, "gpu_audit_report_dir": str(report_dir)})
        fleet.clear_faults(hung)
        after = memory(fleet, [h for h in names if h not in (down, hung, nosmi)])
        report = json.loads((report_dir / "report.json").read_text()) if (report_dir / "report.json").exists() else None
        yield {"run": run, "report": report, "dir": report_dir, "dirty": dirty, "down": down, "hung": hung,
               "nosmi": nosmi, "holder": holder, "before": before, "after": after, "cast": cast,
               "clean": [h for h in names if h not in (dirty, down, hung, nosmi)]}
    finally:
        fleet.ssh(nosmi, RESTORE_SMI)
        fleet.reset()


def _hosts(report):
    return {h["host"]: h for h in report["hosts"]}


def test_audit_of_a_mixed_fleet_passes_without_fail_on_dirty_and_writes_every_report(audit):
    run = audit["run"]
    assert run.rc == 0, run
    for name in ("report.json", "report.md", "report.html", "gpu_audit.prom"):
        assert (audit["dir"] / name).stat().st_size > 0, name
    assert f"Report: {audit['dir'].resolve()}/report.html" in run.stdout


def test_report_lists_each_host_with_its_status_and_reason(audit, fleet):
    hosts = _hosts(audit["report"])
    assert sorted(hosts) == sorted(fleet.names)
    for host in audit["clean"]:
        assert hosts[host]["status"] == "clean" and hosts[host]["reason"] is None, hosts[host]
    assert hosts[audit["dirty"]]["status"] == "dirty"
    assert hosts[audit["dirty"]]["dirty_gpus"] == [1]
    assert "GPU 1" in hosts[audit["dirty"]]["reason"] and str(audit["holder"]["pid"]) in hosts[audit["dirty"]]["reason"]
    assert hosts[audit["down"]]["status"] == "unreachable" and hosts[audit["down"]]["gpu_count"] is None
    assert hosts[audit["hung"]]["status"] == "error"
    assert "timed out" in hosts[audit["hung"]]["reason"], hosts[audit["hung"]]
    assert hosts[audit["nosmi"]]["status"] == "error"
    assert "nvidia-smi" in hosts[audit["nosmi"]]["reason"] and "not found" in hosts[audit["nosmi"]]["reason"]
    s = audit["report"]["summary"]
    assert (s["hosts_total"], s["hosts_clean"], s["hosts_dirty"], s["hosts_error"], s["hosts_unreachable"]) == (
        len(fleet.names), len(audit["clean"]), 1, 2, 1)
    assert s["gpus_dirty"] == 1
    attention = {a["host"]: a["status"] for a in audit["report"]["findings"]["attention"]}
    assert attention == {audit["dirty"]: "dirty", audit["down"]: "unreachable", audit["hung"]: "error", audit["nosmi"]: "error"}


def test_mig_host_idle_at_55_mib_is_clean_with_its_group_threshold(audit):
    mig = audit["cast"].mig
    if not mig:
        pytest.skip("no MIG host in this fleet profile")
    h = _hosts(audit["report"])[mig]
    assert h["status"] == "clean" and h["memory_used_mib"] == 55 * h["gpu_count"], h


def test_blocking_holder_is_listed_and_protected_persistenced_is_not(audit):
    holders = audit["report"]["findings"]["holders"]
    assert [(x["host"], x["pid"]) for x in holders] == [(audit["dirty"], audit["holder"]["pid"])], holders
    dirty_gpus = audit["report"]["findings"]["dirty_gpus"]
    assert [(g["host"], g["index"]) for g in dirty_gpus] == [(audit["dirty"], 1)]


def test_audit_is_read_only(audit, fleet):
    assert audit["after"] == audit["before"]
    assert alive(fleet, audit["dirty"], [audit["holder"]["pid"]])[audit["holder"]["pid"]]


def test_html_and_prometheus_reports_name_every_host(audit, fleet):
    html = (audit["dir"] / "report.html").read_text()
    prom = (audit["dir"] / "gpu_audit.prom").read_text()
    for host in fleet.names:
        assert host in html, host
        assert f'host="{host}"' in prom, host


def test_fail_on_dirty_fails_the_run_after_writing_the_report_and_passes_a_clean_subset(audit, fleet, tmp_path):
    dirty, clean = audit["dirty"], audit["clean"][0]
    run = fleet.ansible_playbook(AUDIT, limit=[dirty, clean], extra_vars={
        "gpu_audit_fail_on_dirty": True, "gpu_audit_report_dir": str(tmp_path / "dirty")})
    assert run.rc != 0, run
    report = json.loads((tmp_path / "dirty" / "report.json").read_text())
    assert {h["host"]: h["status"] for h in report["hosts"]} == {dirty: "dirty", clean: "clean"}
    failed = [t for t in run.results() if t["status"] == "failed"]
    msg = failed[-1]["result"]["msg"] if failed else ""
    assert f"{dirty} (dirty" in msg and f"{clean} (" not in msg, msg

    control = fleet.ansible_playbook(AUDIT, limit=[clean], extra_vars={
        "gpu_audit_fail_on_dirty": True, "gpu_audit_report_dir": str(tmp_path / "clean")})
    assert control.rc == 0, control
