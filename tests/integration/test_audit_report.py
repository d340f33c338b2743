# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The fleet audit's report, written by the real ansible-playbook.

* The report tasks (playbooks/tasks/audit_report.yml) run on saved per-host results of a
  30-host fleet: every file is checked, the .prom with promtool, the HTML in headless chromium
  (DOM and screenshot).
* playbooks/audit_gpus.yml runs end to end (as ``zeromib.gpu.audit_gpus``) against local hosts
  answered by a stand-in gpu_facts, an unreachable host and a host whose Python is missing, and
  once with the real module where it exists.

``ZEROMIB_UPDATE_SCREENSHOT=1 pytest tests/integration/test_audit_report.py`` refreshes
docs/images/audit-report.png.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
H200_TOTAL = 143771
FOOTPRINT = 4
L40S_TOTAL = 46068


# --------------------------------------------------------------------------- fleet data


def _gpu(index, used=0, total=H200_TOTAL, name="NVIDIA H200", max_used=0, mig="Disabled", host_no=0, footprint=False):
    """footprint: the GPU runs nothing and reads the 4 MiB cross-GPU footprint of contexts on the
    host's other GPUs (as gpu_facts reports it: clean, cross_gpu_footprint true)."""
    used = FOOTPRINT if footprint else used
    return {
        "index": index,
        "uuid": f"GPU-{0xAB0C0000 + host_no:08x}-{index:04x}-{0xBE7E:04x}-{0xF16B:04x}-{0x963690D7C5C5 + index:012x}",
        "name": name,
        "pci_bus_id": "00000000:%02X:00.0" % (0x18 + 0x10 * index),
        "minor_number": index,
        "memory_total_mib": total,
        "memory_used_mib": used,
        "memory_reserved_mib": 616,
        "memory_free_mib": None if used is None else total - used - 616,
        # As real GPUs read: [N/A] in MIG mode, 0 % on a GPU that runs nothing (a context elsewhere leaves
        # it its footprint only), busy where a process works.
        "utilization_gpu_pct": None if mig == "Enabled" else 0 if not used or footprint else min(99, 35 + index * 7),
        "temperature_c": 31 + (used or 0) * 30 // total + index % 3,
        "power_draw_w": round(118.0 + (used or 0) / 400.0, 2),
        "persistence_mode": "Enabled",
        "mig_mode": mig,
        "cross_gpu_footprint": footprint,
        "clean": footprint or (used is not None and used <= max_used),
        "healthy": True,
        "health_issues": [],
        "health": {"ecc_uncorrected_volatile": 0, "xids": []},
    }


def _holder(pid, name, cmdline, gpus, unit=None, container=None, user="root", protected=False, state="S", attribution=None):
    """Every process, CUDA program or NVML client, has every GPU's node open (as measured on a
    real 2-GPU H200): `attribution` and `gpu_indexes` say which GPUs it really uses."""
    return {
        "pid": pid, "ppid": 1, "name": name, "cmdline": cmdline, "user": user, "state": state,
        "start_time": 1234567 + pid,
        "devices": [f"/dev/nvidia{i}" for i in range(8)] + ["/dev/nvidiactl", "/dev/nvidia-uvm"],
        "gpu_indexes": list(gpus), "unit": unit, "container": container, "protected": protected,
        "attribution": attribution or ("listed" if gpus else "nvml_client"), "candidate_gpu_indexes": [],
    }


def _proc(pid, gpu, name="python3", alive=True):
    return {"pid": pid, "name": name, "used_memory_mib": gpu["memory_used_mib"], "gpu_uuid": gpu["uuid"], "gpu_index": gpu["index"], "alive": alive}


def _facts(gpus, holders=(), processes=(), error=None):
    gpus = list(gpus)
    holders = list(holders)
    blocking = any(h["gpu_indexes"] and not h["protected"] for h in holders)
    return {
        "driver_version": "580.159.04", "cuda_version": "13.0", "count": len(gpus),
        "clean": error is None and all(g["clean"] for g in gpus) and not blocking,
        "memory_used_mib": None if error else sum(g["memory_used_mib"] or 0 for g in gpus),
        "error": error, "gpus": gpus, "processes": list(processes), "holders": holders,
    }


def build_fleet():
    """30 hosts as audit_gpus.yml's first play records them: most clean, a few of every kind of trouble."""
    hosts = []
    for n in range(1, 31):
        name = f"gpu-node{n:02d}"
        gpus = [_gpu(i, host_no=n) for i in range(8)]
        holders, procs, status, error, facts = [], [], "ok", None, None
        if n == 3:  # vLLM TP=8 started by a unit at boot
            gpus = [_gpu(i, used=128410 + 37 * i, host_no=n) for i in range(8)]
            holders = [_holder(2211 + i, f"VLLM::Worker_TP{i}" if i else "python3",
                               "/opt/vllm/bin/python3 -m vllm.entrypoints.openai.api_server --model /models/llama-3.1-70b --tensor-parallel-size 8",
                               [i], unit="vllm.service") for i in range(8)]
            procs = [_proc(2211 + i, gpus[i]) for i in range(8)]
        elif n == 7:  # an interactive training run left on two GPUs
            gpus = [_gpu(i, used=[40960, 38912][i] if i < 2 else 0, host_no=n, footprint=i >= 2) for i in range(8)]
            holders = [_holder(48211, "python3", "python3 train.py --config configs/llama-8b.yaml --gpus 0,1", [0, 1], user="alice")]
            procs = [{"pid": 48211, "name": "python3", "used_memory_mib": 40960, "gpu_uuid": gpus[0]["uuid"], "gpu_index": 0, "alive": True},
                     {"pid": 48211, "name": "python3", "used_memory_mib": 38912, "gpu_uuid": gpus[1]["uuid"], "gpu_index": 1, "alive": True}]
        elif n == 11:  # orphaned fork child keeps the dead parent's memory
            gpus = [_gpu(i, used=6662 if i == 3 else 0, host_no=n, footprint=i != 3) for i in range(8)]
            holders = [_holder(9127, "python3", 'python3 -c "import torch; torch.zeros(1).cuda(); os.fork()"', [3], user="bob",
                               attribution="mapped")]
            procs = [{"pid": 9120, "name": "[Not Found]", "used_memory_mib": 6662, "gpu_uuid": gpus[3]["uuid"], "gpu_index": 3, "alive": False}]
        elif n == 14:  # sglang in a container on GPUs 4-7
            gpus = [_gpu(i, used=70144 + 512 * i if i >= 4 else 0, host_no=n, footprint=i < 4) for i in range(8)]
            holders = [_holder(77001, "sglang::scheduler", "python3 -m sglang.launch_server --model-path /models/qwen2.5-72b --tp 4 --port 30000", [4, 5, 6, 7],
                               container="3f9c2d1ab4e8a7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2", user="svc-infer")]
            holders[0].update(container_runtime="docker", container_name="sglang", container_image="lmsysorg/sglang:v0.4.9-cu124")
            procs = [_proc(77001, g) for g in gpus[4:]]
        elif n == 5:  # only monitors: NVML clients, no GPU memory, clean
            holders = [_holder(3301, "nvidia-smi", "nvidia-smi dmon -s mu", []),
                       _holder(3302, "dcgm-exporter", "/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/default-counters.csv", [],
                               unit="dcgm-exporter.service", user="dcgm")]
        elif n == 9:  # free but not ready: GPU 5 logged an Xid 79 and an uncorrectable ECC error
            gpus[5].update(healthy=False, health_issues=["1 uncorrectable ECC error since the driver loaded",
                                                         "Xid 79 (GPU has fallen off the bus) in the kernel log at 2026-11-29T09:08:01+0000"],
                           health={"ecc_uncorrected_volatile": 1, "xids": [{"xid": 79, "time": "2026-11-29T09:08:01+0000", "message": "NVRM: Xid"}]})
        elif n == 18:  # MIG host idles at 55 MiB, audited with max_used_mib 60
            gpus = [_gpu(i, used=55, max_used=60, mig="Enabled", host_no=n) for i in range(8)]
        elif n == 21:  # a small leftover: a notebook kernel with <1 % of GPU 6, plus a protected NVML client
            gpus = [_gpu(i, used=1210 if i == 6 else 0, host_no=n, footprint=i != 6) for i in range(8)]
            kernel = "/usr/bin/python3 -m ipykernel_launcher -f /root/.local/share/jupyter/runtime/kernel-<'\"&>.json"
            holders = [_holder(5120, "python3", kernel, [6], user="carol"),
                       _holder(812, "nvidia-persistenced", "/usr/bin/nvidia-persistenced --user nvidia-persistenced", [], protected=True)]
            procs = [{"pid": 5120, "name": "python3", "used_memory_mib": 1210, "gpu_uuid": gpus[6]["uuid"], "gpu_index": 6, "alive": True}]
        elif n == 24:  # nvidia-smi hangs: a GPU fell off the bus
            status, error = "ok", None
            facts = {"driver_version": None, "cuda_version": None, "count": 0, "clean": False, "memory_used_mib": None,
                     "error": "nvidia-smi timed out after 10 s", "gpus": [], "processes": [], "holders": []}
        elif n == 26:  # the module could not run at all
            status, error = "error", "MODULE FAILURE: /usr/bin/python3: No such file or directory"
        elif n == 29:
            status, error = "unreachable", "Failed to connect to the host via ssh: ssh: connect to host 10.0.3.29 port 22: No route to host"
        elif n == 30:  # an L40S box with 4 GPUs
            gpus = [_gpu(i, total=L40S_TOTAL, name="NVIDIA L40S", host_no=n) for i in range(4)]
        if status == "ok" and facts is None:
            facts = _facts(gpus, holders, procs)
            facts["healthy"] = all(g["healthy"] for g in gpus)
        hosts.append({"host": name, "status": status, "error": error, "gpu": facts if status == "ok" else None})
    return hosts


def clean_fleet(count=3):
    return [{"host": f"clean{n:02d}", "status": "ok", "error": None, "gpu": _facts([_gpu(i, host_no=n) for i in range(8)])} for n in range(count)]


# --------------------------------------------------------------------------- running Ansible


def _env(collections_path):
    env = dict(os.environ)
    env.update({
        "ANSIBLE_COLLECTIONS_PATH": str(collections_path),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_LOCALHOST_WARNING": "false",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "false",
        "ANSIBLE_HOST_KEY_CHECKING": "false",
        "ANSIBLE_RETRY_FILES_ENABLED": "false",
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
        "ANSIBLE_TIMEOUT": "5",
        "ANSIBLE_SSH_ARGS": "-o ControlMaster=no -o BatchMode=yes",
        "PATH": "{}:{}".format(BIN, env.get("PATH", "")),
    })
    env.pop("ANSIBLE_CONFIG", None)
    return env


def run_playbook(args, cwd, collections_path, timeout=300, host=None):
    """ansible-playbook ARGS from CWD; inside the simulated HOST when the play runs a real module
    with a local connection (gpu_facts writes its bytecode cache under /var/lib/zeromib-gpu: the
    host's own, never this machine's)."""
    argv = [str(BIN / "ansible-playbook"), *args]
    if host is None:
        proc = subprocess.run(argv, cwd=str(cwd), env=_env(collections_path),
                              capture_output=True, text=True, timeout=timeout, check=False)
    else:
        # nsenter leaves a process that enters the host's mount namespace in its root: `env -C`
        # puts the run in CWD, where the report's default directory is.
        proc = host.run(["env", "-C", str(cwd), *argv], env=_env(collections_path), timeout=timeout)
    proc.output = proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="session")
def collections_path():
    root = REPO / ".build" / "collections"
    link = root / "ansible_collections" / "zeromib" / "gpu"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(REPO, link.parent))
    return root


def report_only(tmp_path, collections_path, hosts_data, extra=()):
    """Run the report tasks from a bare localhost play, as a test or a re-render would."""
    (tmp_path / "hosts_data.json").write_text(json.dumps({"gpu_audit_hosts_data": hosts_data}))
    (tmp_path / "report_only.yml").write_text(textwrap.dedent("""\
        - name: Write a GPU audit report from saved per-host results
          hosts: localhost
          gather_facts: false
          connection: local
          tasks:
            - name: Build, query and write the report
              ansible.builtin.import_tasks: %s
        """ % (REPO / "playbooks" / "tasks" / "audit_report.yml")))
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    given = [] if hosts_data is None else ["-e", "@%s" % (tmp_path / "hosts_data.json")]
    return run_playbook([str(tmp_path / "report_only.yml"), *given, *extra], cwd, collections_path), cwd


@pytest.fixture(scope="module")
def fleet_report(tmp_path_factory, collections_path):
    tmp = tmp_path_factory.mktemp("fleet")
    proc, cwd = report_only(tmp, collections_path, build_fleet(),
                            ["-e", "gpu_audit_title='H200 fleet audit (sample)'",
                             "-e", '{"gpu_audit_queries": {"busiest_gpu": "max_by(hosts[?up].gpus[], &memory_used_mib).[host, index]"}}'])
    assert proc.returncode == 0, proc.output
    return cwd / "gpu_audit_report", proc


# --------------------------------------------------------------------------- report files


def test_relative_report_dir_lands_in_the_controllers_working_directory(fleet_report):
    out, dummy = fleet_report
    assert sorted(p.name for p in out.iterdir()) == ["gpu_audit.prom", "report.html", "report.json", "report.md"]
    assert not (REPO / "playbooks" / "gpu_audit_report").exists()
    assert not (REPO / "playbooks" / "tasks" / "gpu_audit_report").exists()


def test_report_json_counts_every_kind_of_host(fleet_report):
    report = json.loads((fleet_report[0] / "report.json").read_text())
    assert report["summary"] == {
        "hosts_total": 30, "hosts_clean": 22, "hosts_dirty": 5, "hosts_error": 2, "hosts_unreachable": 1,
        "gpus_total": 8 * 26 + 4, "gpus_clean": 8 * 26 + 4 - 16, "gpus_dirty": 16,
        "memory_used_mib": report["summary"]["memory_used_mib"], "memory_total_mib": 26 * 8 * H200_TOTAL + 4 * L40S_TOTAL,
        "holders": 8 + 1 + 1 + 1 + 1, "nvml_clients": 2 + 1, "holders_not_listed": 0,
        "hosts_unhealthy": 1, "gpus_unhealthy": 1, "hosts_health_unchecked": 0, "gpus_health_unchecked": 0, "hosts_pending_restore": 0, "hosts_driver_drift": 0,
        "hosts_shm_leftovers": 0, "hosts_ghost_busy": 0, "gpus_ghost_busy": 0,
    }
    status = {h["host"]: h["status"] for h in report["hosts"]}
    node09 = next(h for h in report["hosts"] if h["host"] == "gpu-node09")
    assert node09["healthy"] is False and node09["unhealthy_gpus"] == [5] and node09["gpus"][5]["xid_recent"] == 1
    assert [h for h, s in status.items() if s != "clean"] == [
        "gpu-node03", "gpu-node07", "gpu-node11", "gpu-node14", "gpu-node21", "gpu-node24", "gpu-node26", "gpu-node29"]
    assert status["gpu-node18"] == "clean", "the MIG host's 55 MiB baseline is under its max_used_mib"
    findings = report["findings"]
    # Hosts that need attention: every host that is not clean, and the unhealthy one whose memory is clean.
    assert [a["host"] for a in findings["attention"]] == sorted([h for h, s in status.items() if s != "clean"] + ["gpu-node09"])
    node09_attention = next(a for a in findings["attention"] if a["host"] == "gpu-node09")
    assert node09_attention["status"] == "clean" and node09_attention["health"].startswith("GPU 5 (00000000:68:00.0): 1 uncorrectable")
    assert {(g["host"], g["index"]) for g in findings["dirty_gpus"]} >= {("gpu-node07", 0), ("gpu-node07", 1), ("gpu-node11", 3), ("gpu-node21", 6)}
    assert [p["pid"] for p in findings["stale_processes"]] == [9120]
    assert report["queries"] == {"busiest_gpu": ["gpu-node03", 7]}
    assert next(a for a in findings["attention"] if a["host"] == "gpu-node24")["reason"] == "nvidia-smi timed out after 10 s"
    hosts = {h["host"]: h for h in report["hosts"]}
    assert [(c["host"], c["pid"]) for c in findings["nvml_clients"]] == [("gpu-node05", 3301), ("gpu-node05", 3302), ("gpu-node21", 812)]
    assert all(c["pid"] not in {h["pid"] for h in findings["holders"]} for c in findings["nvml_clients"])
    assert hosts["gpu-node07"]["footprint_gpus"] == [2, 3, 4, 5, 6, 7] and hosts["gpu-node03"]["footprint_gpus"] == []
    assert hosts["gpu-node05"]["status"] == "clean" and len(hosts["gpu-node05"]["nvml_clients"]) == 2


def test_prom_file_passes_promtool(fleet_report):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool missing: tests/tools/apt-deps.sh installs the prometheus package")
    prom = fleet_report[0] / "gpu_audit.prom"
    proc = subprocess.run([promtool, "check", "metrics"], input=prom.read_text(), capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = prom.read_text()
    assert 'zeromib_gpu_host_up{host="gpu-node29"} 0' in text
    assert 'zeromib_gpu_host_clean{host="gpu-node18"} 1' in text
    assert 'zeromib_gpu_memory_used_mib{host="gpu-node07",gpu="0",' in text
    assert 'zeromib_gpu_holders{host="gpu-node03"} 8' in text
    assert 'zeromib_gpu_nvml_clients{host="gpu-node05"} 2' in text and 'zeromib_gpu_holders{host="gpu-node05"} 0' in text
    assert 'zeromib_gpu_clean{host="gpu-node07",gpu="2",' in text
    assert 'zeromib_gpu_healthy{host="gpu-node09",gpu="5",' in text and 'zeromib_gpu_healthy{host="gpu-node09",gpu="4",' in text
    prefixes = tuple(f'zeromib_gpu_{name}{{host="gpu-node09",gpu="5"' for name in ("healthy", "ecc_uncorrected", "xid_recent"))
    node09 = [line for line in text.splitlines() if line.startswith(prefixes)]
    assert [line.rsplit(" ", 1)[1] for line in node09] == ["0", "1", "1"], node09


def test_markdown_lists_every_problem_host(fleet_report):
    md = (fleet_report[0] / "report.md").read_text()
    assert md.startswith("# H200 fleet audit (sample)\n")
    for host in ("gpu-node03", "gpu-node24", "gpu-node26", "gpu-node29"):
        assert f"| {host} | **" in md
    assert "| gpu-node21 | 5120 | python3 | carol |" in md
    # A holder in a container shows the container's name and image next to its PID.
    assert "| gpu-node14 | 77001 | sglang::scheduler | svc-infer | - | sglang (lmsysorg/sglang:v0.4.9-cu124) |" in md
    # NVML clients are listed apart from the holders (GPU users), and counted
    holders, clients = md.split("\n## Holders\n")[1].split("\n## NVML clients\n")
    assert "| gpu-node05 |" not in holders and "| gpu-node05 | 3301 | nvidia-smi | root | - | no | `nvidia-smi dmon -s mu` |" in clients
    assert "| gpu-node21 | 812 | nvidia-persistenced | root | - | yes |" in clients
    assert "| holders | NVML clients |" in md and "| 12 | 3 |" in md
    # a GPU clean at the cross-GPU footprint says so
    node07 = next(line for line in md.splitlines() if line.startswith("| gpu-node07 | dirty |"))
    assert "0:40960! 1:38912! 2:4 (footprint) 3:4 (footprint)" in node07
    assert "`(footprint)`: the GPU runs nothing of its own" in md
    assert "## Unhealthy GPUs" in md and "| gpu-node09 | 5 | 00000000:68:00.0 | 1 | 1 | 1 uncorrectable ECC error" in md


class _Dom(HTMLParser):
    def __init__(self):
        super().__init__()
        self.cells, self.rows, self.scripts, self.links = [], [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "td" and "cell" in (a.get("class") or "").split():
            self.cells.append(a)
        if tag == "tr" and "host" in (a.get("class") or "").split():
            self.rows.append(a)
        if tag == "script" and a.get("src"):
            self.scripts.append(a["src"])
        if tag == "link" or (tag == "img" and not (a.get("src") or "").startswith("data:")):
            self.links.append(a)


def _chromium(*args, timeout=120):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("chromium missing: tests/tools/apt-deps.sh installs it")
    profile = tempfile.mkdtemp(prefix="zeromib-chromium-")
    try:
        return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                               "--disable-background-networking", "--disable-component-update", "--disable-sync",
                               "--hide-scrollbars", f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def test_html_is_self_contained(fleet_report):
    html = (fleet_report[0] / "report.html").read_text()
    dom = _Dom()
    dom.feed(html)
    assert dom.scripts == [] and dom.links == []
    for needle in ("http://", "https://", "@import", "url("):
        assert needle not in html
    assert "<'" not in html and "kernel-&lt;&#39;&#34;&amp;&gt;.json" in html, "command lines are escaped"
    assert ">sglang (lmsysorg/sglang:v0.4.9-cu124)</span>" in html


def test_heat_map_renders_in_chromium(fleet_report):
    page = (fleet_report[0] / "report.html").as_uri()
    proc = _chromium("--dump-dom", page)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = _Dom()
    dom.feed(proc.stdout)
    gpu_cells = [c for c in dom.cells if c.get("data-state") in ("clean", "dirty")]
    assert len(gpu_cells) == 8 * 26 + 4
    dirty = {(c["data-host"], int(c["data-gpu"])) for c in gpu_cells if c["data-state"] == "dirty"}
    assert dirty == ({("gpu-node03", i) for i in range(8)} | {("gpu-node07", 0), ("gpu-node07", 1), ("gpu-node11", 3)}
                     | {("gpu-node14", i) for i in range(4, 8)} | {("gpu-node21", 6)})
    assert all("dirty" in c["class"].split() for c in gpu_cells if c["data-state"] == "dirty")
    node07 = next(c for c in gpu_cells if c["data-host"] == "gpu-node07" and c["data-gpu"] == "0")
    assert node07["data-used-mib"] == "40960" and "pid 48211 python3" in node07["title"] and "user alice" in node07["title"]
    assert "unit vllm.service" in next(c for c in gpu_cells if c["data-host"] == "gpu-node03")["title"]
    footprint = {(c["data-host"], int(c["data-gpu"])) for c in gpu_cells if c.get("data-footprint") == "true"}
    assert ("gpu-node07", 2) in footprint and ("gpu-node14", 0) in footprint and not any(h == "gpu-node03" for h, _gpu in footprint)
    node07_2 = next(c for c in gpu_cells if c["data-host"] == "gpu-node07" and c["data-gpu"] == "2")
    assert node07_2["data-state"] == "clean" and "4 MiB footprint of contexts on other GPUs" in node07_2["title"]
    assert "NVML clients" in proc.stdout and 'id="nvml-clients"' in proc.stdout
    assert sum(1 for c in dom.cells if c.get("data-state") == "absent") == 4, "the 4-GPU host pads its row"
    rows = {r["data-host"]: r["data-status"] for r in dom.rows}
    assert len(rows) == 30 and rows["gpu-node29"] == "unreachable" and rows["gpu-node24"] == "error" and rows["gpu-node18"] == "clean"
    assert "No route to host" in proc.stdout
    unhealthy = [c for c in gpu_cells if "unhealthy" in c["class"].split()]
    assert [(c["data-host"], c["data-gpu"]) for c in unhealthy] == [("gpu-node09", "5")]
    assert "UNHEALTHY: 1 uncorrectable ECC error" in unhealthy[0]["title"] and "Xid 79" in unhealthy[0]["title"]
    assert unhealthy[0]["data-state"] == "clean", "free but not ready: clean memory, marked unhealthy"


def _png_summary(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, pos = b"", 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    pixels = zlib.decompress(idat)
    return width, height, len(set(pixels[i:i + 3] for i in range(0, len(pixels) - 3, 997)))


def test_screenshot_is_not_blank(fleet_report, tmp_path):
    shot = tmp_path / "audit-report.png"
    proc = _chromium(f"--screenshot={shot}", "--window-size=1280,2300", (fleet_report[0] / "report.html").as_uri())
    assert shot.exists(), proc.stderr[-2000:]
    width, height, colours = _png_summary(shot)
    assert (width, height) == (1280, 2300)
    assert colours > 40, "the screenshot looks blank"
    if os.environ.get("ZEROMIB_UPDATE_SCREENSHOT"):
        (REPO / "docs" / "images").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, REPO / "docs" / "images" / "audit-report.png")


# --------------------------------------------------------------------------- verdicts


def test_fail_on_dirty_fails_after_writing_the_report_and_names_the_hosts(tmp_path, collections_path):
    hosts = clean_fleet(2) + [h for h in build_fleet() if h["host"] in ("gpu-node07", "gpu-node29")]
    proc, cwd = report_only(tmp_path, collections_path, hosts, ["-e", "gpu_audit_fail_on_dirty=true", "-e", "gpu_audit_report_dir=out/nested"])
    assert proc.returncode == 2, proc.output
    assert "2 of 4 hosts are not clean" in proc.output
    assert "gpu-node07 (dirty: GPU 0 40960 MiB" in proc.output and "gpu-node29 (unreachable: Failed to connect" in proc.output
    assert json.loads((cwd / "out" / "nested" / "report.json").read_text())["summary"]["hosts_dirty"] == 1


def test_clean_fleet_passes_fail_on_dirty(tmp_path, collections_path):
    proc, dummy = report_only(tmp_path, collections_path, clean_fleet(3),
                              ["-e", "gpu_audit_fail_on_dirty=true", "-e", "gpu_audit_report_dir=%s" % (tmp_path / "abs")])
    assert proc.returncode == 0, proc.output
    assert "All 3 hosts are clean" in proc.output or "ok=" in proc.output
    html = (tmp_path / "abs" / "report.html").read_text()
    assert "All hosts clean" in html and 'data-state="dirty"' not in html


# --------------------------------------------------------------------------- the whole playbook

STAND_IN = '''\
#!/usr/bin/python
# Test stand-in for zeromib.gpu.gpu_facts: answers with the facts in the JSON file given as
# nvidia_smi, or fails with its "fail" message. Only the playbook's wiring is under test here.
from __future__ import annotations
import json
from ansible.module_utils.basic import AnsibleModule

def main():
    module = AnsibleModule(argument_spec=dict(
        nvidia_smi=dict(type="path"), timeout=dict(type="float", default=10), max_used_mib=dict(type="int", default=0),
        processes=dict(type="bool", default=True), fail_on_error=dict(type="bool", default=True),
        protect=dict(type="list", elements="str", default=[]), smoke_test=dict(type="bool", default=False)), supports_check_mode=True)
    with open(module.params["nvidia_smi"]) as handle:
        answer = json.load(handle)
    if "fail" in answer:
        module.fail_json(msg=answer["fail"])
    module.exit_json(changed=False, ansible_facts={"gpu": answer["facts"]})

if __name__ == "__main__":
    main()
'''


def _stand_in_collection(tmp_path):
    root = tmp_path / "collections"
    coll = root / "ansible_collections" / "zeromib" / "gpu"
    (coll / "plugins" / "modules").mkdir(parents=True)
    for name in ("galaxy.yml", "meta", "playbooks"):
        (coll / name).symlink_to(REPO / name)
    (coll / "plugins" / "filter").symlink_to(REPO / "plugins" / "filter")
    (coll / "plugins" / "plugin_utils").symlink_to(REPO / "plugins" / "plugin_utils")
    (coll / "plugins" / "action").symlink_to(REPO / "plugins" / "action")
    (coll / "plugins" / "module_utils").symlink_to(REPO / "plugins" / "module_utils")  # plugin_utils import a few of its names
    (coll / "plugins" / "modules" / "gpu_facts.py").write_text(STAND_IN)
    return root


def test_audit_playbook_end_to_end_with_a_stand_in_module(tmp_path):
    fleet = {h["host"]: h for h in build_fleet()}
    answers = tmp_path / "answers"
    answers.mkdir()
    inventory = {"all": {"hosts": {}, "vars": {"ansible_python_interpreter": sys.executable}}}
    for name in ("gpu-node03", "gpu-node18", "gpu-node24", "gpu-node30"):
        (answers / name).write_text(json.dumps({"facts": fleet[name]["gpu"]}))
        inventory["all"]["hosts"][name] = {"ansible_connection": "local", "gpu_audit_nvidia_smi": str(answers / name)}
    inventory["all"]["hosts"]["gpu-node18"]["gpu_audit_max_used_mib"] = 60
    (answers / "broken").write_text(json.dumps({"fail": "nvidia-smi not found in PATH, /usr/bin, /usr/local/nvidia/bin, /usr/local/bin"}))
    inventory["all"]["hosts"]["no-driver"] = {"ansible_connection": "local", "gpu_audit_nvidia_smi": str(answers / "broken")}
    inventory["all"]["hosts"]["no-python"] = {"ansible_connection": "local", "ansible_python_interpreter": "/nonexistent/python3"}
    inventory["all"]["hosts"]["crashing"] = {"ansible_connection": "local"}  # the stand-in raises without its file
    inventory["all"]["hosts"]["gone"] = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_user": "nobody"}
    inventory["all"]["hosts"]["not-audited"] = {"ansible_connection": "local"}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_playbook(["zeromib.gpu.audit_gpus", "-i", str(tmp_path / "inventory.json"), "-l", "!not-audited"], cwd, _stand_in_collection(tmp_path))
    assert proc.returncode == 0, proc.output
    report = json.loads((cwd / "gpu_audit_report" / "report.json").read_text())
    status = {h["host"]: (h["status"], h["reason"]) for h in report["hosts"]}
    assert set(status) == {"gpu-node03", "gpu-node18", "gpu-node24", "gpu-node30", "no-driver", "no-python", "crashing", "gone"}
    assert status["gpu-node03"][0] == "dirty" and status["gpu-node18"] == ("clean", None) and status["gpu-node30"] == ("clean", None)
    assert status["gpu-node24"] == ("error", "nvidia-smi timed out after 10 s")
    assert status["no-driver"] == ("error", "nvidia-smi not found in PATH, /usr/bin, /usr/local/nvidia/bin, /usr/local/bin")
    assert status["no-python"][0] == "error" and "/nonexistent/python3" in status["no-python"][1]
    assert status["crashing"] == ("error", "Module failed: expected str, bytes or os.PathLike object, not NoneType")
    assert status["gone"][0] == "unreachable" and "port 1" in status["gone"][1]

    proc = run_playbook(["zeromib.gpu.audit_gpus", "-i", str(tmp_path / "inventory.json"), "-l", "!not-audited", "-e", "gpu_audit_fail_on_dirty=true"],
                        cwd, _stand_in_collection(tmp_path / "again"))
    assert proc.returncode == 2, proc.output
    assert "6 of 8 hosts are not clean" in proc.output


def test_audit_playbook_with_the_real_module_reports_a_host_without_nvidia_smi(tmp_path, collections_path, nshost):
    inventory = {"all": {"hosts": {
        "no-driver": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                      "gpu_audit_nvidia_smi": str(tmp_path / "missing" / "nvidia-smi")},
        "gone": {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_user": "nobody"},
    }}}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    host = nshost("h200x1")
    proc = run_playbook([str(REPO / "playbooks" / "audit_gpus.yml"), "-i", str(tmp_path / "inventory.json")], tmp_path,
                        collections_path, host=host)
    assert proc.returncode == 0, proc.output
    report = json.loads((tmp_path / "gpu_audit_report" / "report.json").read_text())
    assert [(h["host"], h["status"]) for h in report["hosts"]] == [("gone", "unreachable"), ("no-driver", "error")]
    assert report["hosts"][1]["reason"]
    # The module ran on the simulated host, and kept its bytecode there (not on this machine).
    assert host.run(["ls", "/var/lib/zeromib-gpu/bytecode"], check=True).stdout.split()


# --------------------------------------------------------------------------- health, check mode, scale


def _unhealthy_fleet():
    """A clean host with an Xid 79 read from dmesg 2 hours ago, an R440-like host whose driver has
    no mig.mode.current (MIG mode unchecked on every GPU), and a clean healthy host."""
    hosts = clean_fleet(1)
    xid = clean_fleet(2)[1]
    xid["host"] = "xid_node|01"
    g = xid["gpu"]["gpus"][2]
    g.update(healthy=False, health_issues=["Xid 79 (GPU has fallen off the bus) in the kernel log at 7200 s ago"],
             health={"ecc_uncorrected_volatile": 0, "xids": [{"xid": 79, "time": "7200 s ago", "message": "NVRM: Xid (PCI:0000:38:00): 79"}],
                     "unchecked": []}, health_checked=True)
    xid["gpu"].update(healthy=False, health_checked=True,
                      health_issues=["GPU 2 (00000000:38:00.0): Xid 79 (GPU has fallen off the bus) in the kernel log at 7200 s ago"])
    old = clean_fleet(3)[2]
    old["host"] = "r440-node"
    for g in old["gpu"]["gpus"]:
        g.update(health_checked=False, health={"unchecked": ["the driver does not know mig.mode.current: not checked"]}, mig_mode=None)
    old["gpu"].update(healthy=True, health_checked=False)
    return hosts + [xid, old]


def test_unhealthy_and_unchecked_gpus_need_attention_and_fail_on_unhealthy_fails_on_them(tmp_path, collections_path):
    proc, cwd = report_only(tmp_path, collections_path, _unhealthy_fleet(), ["-e", "gpu_audit_fail_on_unhealthy=true"])
    assert proc.returncode == 2, proc.output
    assert "2 of 3 hosts are not known healthy" in proc.output
    assert "xid_node|01 (clean; GPU 2 (00000000:38:00.0): Xid 79 (GPU has fallen off the bus) in the kernel log 2 h ago)" in proc.output
    assert "r440-node (clean; health not checked on GPU 0, 1, 2, 3, 4, 5, 6, 7: the driver does not know mig.mode.current" in proc.output
    out = cwd / "gpu_audit_report"
    report = json.loads((out / "report.json").read_text())
    assert [a["host"] for a in report["findings"]["attention"]] == ["r440-node", "xid_node|01"]
    md = (out / "report.md").read_text()
    # A user-chosen name is escaped in Markdown (the pipe would split the cell).
    assert "| xid_node\\|01 | **clean** | - | GPU 2 (00000000:38:00.0): Xid 79 (GPU has fallen off the bus) in the kernel log 2 h ago |" in md
    assert "7200 s" not in md and "7200 s" not in (out / "report.html").read_text()
    assert "- **unhealthy**, Xid 79 (GPU has fallen off the bus): 1 host (xid_node\\|01)" in md
    assert "- **unchecked**, health not fully checked: 1 host (r440-node)" in md

    proc, dummy = report_only(tmp_path, collections_path, _unhealthy_fleet(), ["-e", "gpu_audit_fail_on_dirty=true"])
    assert proc.returncode == 0, "fail_on_dirty is about memory: clean but unhealthy hosts pass it\n" + proc.output


def test_check_mode_writes_nothing(tmp_path, collections_path):
    proc, cwd = report_only(tmp_path, collections_path, build_fleet(), ["--check", "-e", "gpu_audit_fail_on_dirty=true"])
    assert proc.returncode == 2, proc.output
    assert "8 of 30 hosts are not clean" in proc.output
    assert not (cwd / "gpu_audit_report").exists()


def test_a_4000_host_page_groups_what_needs_attention_and_draws_one_page_of_the_heat_map(tmp_path, collections_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from audit_report import fleet

    hosts = fleet(4000)
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"format": "zeromib.gpu audit part", "version": 1, "generated_epoch": 1748779200.0,
                                "expected_hosts": [], "hosts_data": hosts}))
    proc, cwd = report_only(tmp_path, collections_path, None, ["-e", json.dumps({"gpu_audit_parts": [str(part)]})])
    assert proc.returncode == 0, proc.output
    page = cwd / "gpu_audit_report" / "report.html"
    assert page.stat().st_size <= 5_000_000, page.stat().st_size
    proc = _chromium("--dump-dom", page.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = _Dom()
    dom.feed(proc.stdout)
    assert len(dom.rows) == 100, "one page of 100 hosts"
    assert "hosts 1-100 of 4,000, page 1 of 40" in proc.stdout
    groups = proc.stdout.count('<details class="group"')
    assert 6 <= groups <= 12, groups
    assert "held by vllm.service</b> <span class=\"count\">134 hosts</span>" in proc.stdout
    assert "and 129 more" in proc.stdout


def test_saved_host_data_is_never_templated(tmp_path, collections_path):
    """A command line is the host's text, not a template of the controller: a saved one with braces
    reads as it was."""
    hosts = [h for h in build_fleet() if h["host"] == "gpu-node07"]
    hosts[0]["gpu"]["holders"][0]["cmdline"] = "python3 {{ 7 * 6 }} {{ lookup('env', 'HOME') }}"
    proc, cwd = report_only(tmp_path, collections_path, hosts)
    assert proc.returncode == 0, proc.output
    report = json.loads((cwd / "gpu_audit_report" / "report.json").read_text())
    assert report["hosts"][0]["holders"][0]["cmdline"] == "python3 {{ 7 * 6 }} {{ lookup('env', 'HOME') }}"
    assert "`python3 {{ 7 * 6 }} {{ lookup('env', 'HOME') }}`" in (cwd / "gpu_audit_report" / "report.md").read_text()


HOSTILE = {
    "name": "<svg onload=alert(1)>|*x*_y_`z`[a](b)\nrow",
    "cmdline": "python3 -c 'x' | `rm` <img src=x onerror=alert(2)>\n| forged | row |",
    "unit": "evil|<b>unit</b>_*.service",
    "container": "[click](http://x)`c`",
}


def test_markdown_escapes_every_user_chosen_name_html_and_markdown_control_characters(tmp_path, collections_path):
    """report.md goes into tickets and chats: process, unit and container names and command lines
    (chosen by any user of the node) must not become HTML, table cells, emphasis, links or rows."""
    gpus = [_gpu(0, used=1024, host_no=1)]
    holder = _holder(4242, HOSTILE["name"], HOSTILE["cmdline"], [0], unit=HOSTILE["unit"], container="4f3c2b1a4f3c")
    holder.update({"container_name": HOSTILE["container"], "container_runtime": "docker", "container_image": "img<x>|y"})
    proc_row = _proc(4243, gpus[0], name=HOSTILE["name"], alive=False)
    hosts = [{"host": "node01", "status": "ok", "error": None, "gpu": _facts(gpus, [holder], [proc_row])}]
    proc, cwd = report_only(tmp_path, collections_path, hosts)
    assert proc.returncode == 0, proc.output
    md = (cwd / "gpu_audit_report" / "report.md").read_text()
    for raw in ("<svg", "<b>", "[click](", "*x*", "_y_", "\nrow", "\n| forged"):
        assert raw not in md, (raw, md)
    assert "&lt;svg onload=alert(1)&gt;\\|\\*x\\*\\_y\\_\\`z\\`\\[a\\](b) row" in md, md
    assert "evil\\|&lt;b&gt;unit&lt;/b&gt;\\_\\*.service" in md
    assert "\\[click\\](http://x)\\`c\\`" in md
    # a command line is a code span: literal text, its backtick made a quote, its pipes escaped, one line
    assert "`python3 -c 'x' \\| 'rm' <img src=x onerror=alert(2)> \\| forged \\| row \\|`" in md
    # every table row still has its own number of cells
    holders = md.split("\n## Holders\n")[1].split("\n## ")[0]
    rows = [line for line in holders.splitlines() if line.startswith("| node01 |")]
    assert len(rows) == 1 and rows[0].replace("\\|", "").count("|") == 10, rows


# --------------------------------------------------------------------------- pending restores (issue 33)


def _pending_fleet():
    """Three clean hosts; on node-b gpu_release stopped and disabled vllm.service and stopped a
    container two days ago and nobody ran restore_gpus: gpu_facts reports its record."""
    hosts = clean_fleet(3)
    for n, entry in enumerate(hosts):
        entry["host"] = "node-" + "abc"[n]
    at = "2026-11-29T08:00:00Z"
    entries = [{"kind": "unit", "name": "vllm.service", "actions": ["stopped", "disabled"], "active": True, "unit_file_state": "enabled",
                "gpu_indexes": [0, 1], "released_at": at, "released_by": "alice"},
               {"kind": "container", "name": "tgi", "id": "4f3c" * 16, "runtime": "docker", "actions": ["stopped"], "running": True,
                "restart_policy": "always", "released_at": at}]
    hosts[1]["gpu"]["pending_restore"] = {
        "path": "/var/lib/zeromib-gpu/released.json", "updated_at": at, "entries": entries, "error": None,
        "summary": [f"vllm.service stopped, disabled by zeromib at {at}", f"container tgi stopped by zeromib at {at}"]}
    return hosts


def test_a_pending_restore_shows_in_every_report_file(tmp_path, collections_path):
    proc, cwd = report_only(tmp_path, collections_path, _pending_fleet())
    assert proc.returncode == 0, proc.output
    out = cwd / "gpu_audit_report"
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["hosts_pending_restore"] == 1 and report["summary"]["hosts_clean"] == 3
    assert [(a["host"], a["status"], a["pending_restore"]) for a in report["findings"]["attention"]] == [("node-b", "clean", 2)]

    md = (out / "report.md").read_text()
    section = md.split("\n## Pending restores\n")[1].split("\n## ")[0]
    assert "| host | what | done by the release | stopped since | by which run |" in section
    assert "| node-b | vllm.service | stopped, disabled | 2026-11-29T08:00:00Z | gpu_release of 2026-11-29T08:00:00Z by alice |" in section
    assert "| node-b | container tgi | stopped | 2026-11-29T08:00:00Z | gpu_release of 2026-11-29T08:00:00Z |" in section
    assert "node-a" not in section and "node-c" not in section
    # "Hosts that need attention": grouped like the other reasons, and the row says why a clean host is there.
    assert ("- **pending restore**, stopped by zeromib, not restored: container tgi, vllm.service: 1 host (node-b)" in md), md
    assert "| node-b | **clean** | pending restore: 2 entries stopped by zeromib | - |" in md

    html = (out / "report.html").read_text()
    assert '<table class="list" id="pending-restores">' in html
    assert ('<tr data-host="node-b" data-pending-restore="vllm.service"><td class="mono">node-b</td><td class="mono">vllm.service</td>'
            "<td>stopped, disabled</td><td class=\"nw\">2026-11-29T08:00:00Z</td><td>gpu_release of 2026-11-29T08:00:00Z by alice</td></tr>") in html
    assert '<span class="pill pending-restore">pending restore</span>' in html
    assert '<input type="checkbox" id="only-pending"> only hosts with a pending restore' in html
    assert 'data-k="hosts_pending_restore">1 <small>host</small>' in html
    heat = json.loads(html.split('<script type="application/json" id="heat-data">')[1].split("</script>")[0])
    assert {row[0]: row[14] for row in heat["h"]} == {"node-a": 0, "node-b": 2, "node-c": 0}

    prom = (out / "gpu_audit.prom").read_text()
    assert 'zeromib_gpu_pending_restore{host="node-b"} 2' in prom and 'zeromib_gpu_pending_restore{host="node-a"} 0' in prom
    promtool = shutil.which("promtool") or (str(REPO / ".build" / "tools" / "bin" / "promtool")
                                            if (REPO / ".build" / "tools" / "bin" / "promtool").exists() else None)
    if promtool:
        check = subprocess.run([promtool, "check", "metrics"], input=prom, capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_heat_map_marks_the_host_row_of_a_pending_restore_and_filters_on_it_in_chromium(tmp_path, collections_path):
    proc, cwd = report_only(tmp_path, collections_path, _pending_fleet())
    assert proc.returncode == 0, proc.output
    page = (cwd / "gpu_audit_report" / "report.html").as_uri()
    drawn = _chromium("--dump-dom", page)
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    dom = _Dom()
    dom.feed(drawn.stdout)
    assert [(r["data-host"], r.get("data-pending-restore")) for r in dom.rows] == [("node-a", None), ("node-b", "2"), ("node-c", None)]
    assert '<td class="hn">node-b<span class="pr">\u21ba 2</span></td>' in drawn.stdout
    assert "2 pending restores: stopped by zeromib, not put back (restore_gpus)" in next(r["title"] for r in dom.rows if r["data-host"] == "node-b")
    # The filter: only the hosts with a pending restore (report.html?pending-restore sets it at load).
    filtered = _chromium("--dump-dom", page + "?pending-restore")
    assert filtered.returncode == 0, filtered.stderr[-2000:]
    dom = _Dom()
    dom.feed(filtered.stdout)
    assert [r["data-host"] for r in dom.rows] == ["node-b"]
    assert "hosts 1-1 of 1 (of 3), page 1 of 1" in filtered.stdout
