"""Ghost-busy GPUs in the audit (issue 71): playbooks/audit_gpus.yml over real SSH on the fleet's
systemd hosts. A GPU that reads 100 % busy at ~100 W with no process and 0 MiB (what a process killed
mid-kernel leaves on Blackwell: tests/sim/README.md, settings.json `ghost_busy`) is shown on its host
(report.json's ghost_busy_gpus and its sentence, the host listed under "Hosts that need attention"
though its memory is clean) and in the fleet summary (the play's last line, report.md, report.html, gpu_audit.prom).
An NVML client on every GPU (`nvidia-smi dmon`) does not hide it; a GPU that is busy because a
process works on it is no ghost. The audit changes nothing: no CUDA context is opened, nothing is
signalled.

Works on a fleet of 2 hosts or more: `ZEROMIB_FLEET_HOSTS=2 ZEROMIB_FLEET_PROFILE=h200 pytest tests/fleet/test_ghost_audit_fleet.py`."""
from __future__ import annotations

import json
import shlex

from scenarios import AUDIT, alive

SETTINGS = "/run/nvidia-sim/settings.json"


def test_the_audit_shows_a_ghost_busy_gpu_on_its_host_and_in_the_fleet_summary(clean_fleet, tmp_path):
    fleet = clean_fleet
    hosts = [h.name for h in fleet.hosts if h.gpu_count >= 2 and h.idle_mib == 0][:2]
    assert len(hosts) == 2, "this test needs two hosts with 2 GPUs or more that idle at 0 MiB"
    ghostly, working = hosts
    gpus = {name: fleet.host(name).gpus for name in hosts}
    # ghostly: GPU 1 busy with nothing on it. working: GPU 0 reads busy too, but a process works there.
    fleet.ssh(ghostly, f"printf %s {shlex.quote(json.dumps({gpus[ghostly][1]['uuid']: {'ghost_busy': 'stuck'}}))} > {SETTINGS}", check=True)
    fleet.ssh(working, f"printf %s {shlex.quote(json.dumps({gpus[working][0]['uuid']: {'ghost_busy': 'stuck'}}))} > {SETTINGS}", check=True)
    monitor = fleet.workload(ghostly, "monitor")
    trainer = fleet.workload(working, "train", gpus="0", mib=700)
    report_dir = tmp_path / "report"
    try:
        run = fleet.ansible_playbook(AUDIT, limit=hosts, extra_vars={"gpu_audit_report_dir": str(report_dir)})
        assert run.rc == 0, run
        assert alive(fleet, ghostly, [monitor["pid"]]) == {monitor["pid"]: True}, "the audit signalled an NVML client"
        assert alive(fleet, working, [trainer["pid"]]) == {trainer["pid"]: True}, "the audit signalled a holder"
        assert fleet.ssh(ghostly, "test -e /run/nvidia-sim/libcuda.log").returncode != 0, "the audit opened a CUDA context"
        setting = json.loads(fleet.ssh(ghostly, f"cat {SETTINGS}", check=True).stdout)
        assert setting[gpus[ghostly][1]["uuid"]] == {"ghost_busy": "stuck"}
    finally:
        fleet.ssh_all(f"rm -f {SETTINGS}")

    report = json.loads((report_dir / "report.json").read_text())
    by_host = {h["host"]: h for h in report["hosts"]}
    ghost = by_host[ghostly]
    bus = gpus[ghostly][1]["pci_bus_id"]
    assert ghost["status"] == "clean" and ghost["ghost_busy_gpus"] == [1], ghost
    [said] = ghost["ghost_busy"]
    assert said.startswith(f"GPU 1 ({bus}): 100 % busy at 101.5 W with no process and no memory (ghost-busy"), said
    assert said.endswith("else reset it (nvidia-smi -r -i 1)"), said
    assert by_host[working]["ghost_busy_gpus"] == [] and by_host[working]["status"] == "dirty", by_host[working]
    assert (report["summary"]["gpus_ghost_busy"], report["summary"]["hosts_ghost_busy"]) == (1, 1), report["summary"]
    [listed] = [a for a in report["findings"]["attention"] if a["host"] == ghostly]
    assert listed["status"] == "clean" and listed["ghost_busy"] == said, listed

    summary = [line for line in run.stdout.splitlines() if "Report: " in line]
    assert summary and "1 GPU busy with no process (ghost-busy) on 1 host." in summary[-1], run.stdout[-3000:]
    markdown = (report_dir / "report.md").read_text()
    assert "1 GPU on 1 host busy with no process (ghost-busy)" in markdown and f"GPU 1 ({bus}): 100 % busy" in markdown
    assert "**ghost busy**, GPUs busy with no process" in markdown, markdown[:3000]
    html = (report_dir / "report.html").read_text()
    assert 'data-k="gpus_ghost_busy">1<' in html
    prom = (report_dir / "gpu_audit.prom").read_text()
    assert f'zeromib_gpu_ghost_busy{{host="{ghostly}",gpu="1",uuid="{gpus[ghostly][1]["uuid"]}"}} 1' in prom
    assert f'zeromib_gpu_ghost_busy{{host="{working}",gpu="0",uuid="{gpus[working][0]["uuid"]}"}} 0' in prom
