"""Launchers beyond the fixed list, `services: ["*"]` and globs over unit files, on real systemd
hosts (issue 20.5, 20.6, 21.5).

- A Ray-like unit (its main process is `ray start --block`, which starts job A's GPU worker and
  job B's CPU worker as its own children, as raylet does) next to a vLLM-V1-shaped unit (an API
  server without a GPU whose children are Python's multiprocessing resource tracker and the
  EngineCore, whose children, the TP workers, hold the GPUs). Freeing the GPUs keeps
  ray-like.service active with job B's worker alive, ends job A's GPU worker and names the
  launcher; the vLLM-shaped unit, processes without a GPU and all, is stopped as the workload.
- A site's own launcher (`free_gpus_launchers: [mysched*.service]`).
- `services: ["*"]` with units named like the network, storage, identity, remote-access and time
  services of a real node installed (dummies): they stay active, the GPU workload is stopped; an
  exact name still stops one.
- A glob matches an installed unit that systemd has not loaded (disabled, inactive): no false
  "matches no unit" warning, and `disabled` disables an enabled unit that is not loaded; every
  warning names the host.

Runs on any fleet size: `ZEROMIB_FLEET_HOSTS=1 pytest tests/fleet/test_cluster_launchers_fleet.py`."""
from __future__ import annotations

import json
import time

import pytest

from scenarios import (PLAYBOOK, RELEASE_TASK, alive, baseline, main_pid, summary_lines, summary_row, summary_status,
                       unit_states, wait_for)

pytestmark = pytest.mark.usefixtures("fleet_baselines")

KILL_TIMEOUT = 2
UNIT_DIR = "/etc/systemd/system"
ARGV0_PATH = "/usr/local/lib/nvidia-sim-argv0:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# `ray start --block` in miniature: the node process of a Ray cluster runs every job's workers as
# its children (raylet's workers are named ray::<task>). Job A's worker holds a GPU, job B's is a
# CPU task. Installed as /usr/local/bin/ray so that its process reads `python3 /usr/local/bin/ray
# start ...` (comm "ray"), as the real one does.
RAY = r'''#!/usr/bin/python3
import json, os, signal, subprocess, sys, time
gpu, ready = sys.argv[sys.argv.index("--gpu") + 1], sys.argv[sys.argv.index("--ready-file") + 1]
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # a worker that ends is reaped; the node lives on
for f in (ready, ready + ".a"):
    if os.path.exists(f):
        os.unlink(f)
a = subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", gpu, "--mib", "3000", "--name", "ray::job_a", "--ready-file", ready + ".a"])
b = subprocess.Popen(["/bin/bash", "-c", "exec -a ray::job_b sleep infinity"])
while not os.path.exists(ready + ".a"):
    time.sleep(0.02)
tmp = ready + ".tmp"
with open(tmp, "w") as out:
    out.write(json.dumps({"pid": os.getpid(), "gpu_worker": a.pid, "cpu_worker": b.pid}) + "\n")
os.rename(tmp, ready)
while True:
    time.sleep(3600)
'''

# vLLM V1's shape: the API server (main process) holds no GPU; its children are the resource
# tracker of Python's multiprocessing (no GPU) and the EngineCore (an NVML client), whose
# children, the TP workers, hold the GPUs (docs/docsite/rst/guide_design.rst,
# field behaviour).
VLLM = r'''#!/usr/bin/python3
import json, os, subprocess, sys, time
gpus, ready = sys.argv[sys.argv.index("--gpus") + 1], sys.argv[sys.argv.index("--ready-file") + 1]
for f in (ready, ready + ".core"):
    if os.path.exists(f):
        os.unlink(f)
tracker = subprocess.Popen([sys.executable, "-c", "from multiprocessing.resource_tracker import main;main(0)"], stdin=subprocess.PIPE)
core = subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", gpus, "--mib", "5000", "--workers", str(len(gpus.split(","))),
                         "--name", "VLLM::EngineCore", "--worker-name", "VLLM::Worker_TP{i}", "--ready-file", ready + ".core"])
while not os.path.exists(ready + ".core"):
    time.sleep(0.02)
with open(ready + ".core") as f:
    info = json.load(f)
tmp = ready + ".tmp"
with open(tmp, "w") as out:
    out.write(json.dumps({"pid": os.getpid(), "tracker": tracker.pid, "engine_core": info["pid"], "workers": info["workers"]}) + "\n")
os.rename(tmp, ready)
while True:
    time.sleep(3600)
'''

# A site's own scheduler agent: a plain Python program that starts a GPU job as its child. By
# the built-in rules its unit is the GPU workload; free_gpus_launchers says otherwise.
MYSCHED = r'''#!/usr/bin/python3
import os, signal, subprocess, sys
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
ready = sys.argv[sys.argv.index("--ready-file") + 1]
subprocess.Popen(["/usr/local/bin/gpu_holder", "--gpus", sys.argv[sys.argv.index("--gpu") + 1], "--mib", "1500", "--name", "site_job",
                  "--ready-file", ready])
signal.pause()
'''


def unit_file(description, exec_start, extra="", restart="always", install="WantedBy=multi-user.target"):
    return (f"[Unit]\nDescription={description}\nAfter=nvidia-sim-devices.service\n\n[Service]\nEnvironment=PATH={ARGV0_PATH}\n"
            f"ExecStart={exec_start}\n{extra}Restart={restart}\nRestartSec=1\n\n[Install]\n{install}\n")


UNITS = {
    "ray-like.service": unit_file("A Ray node (simulated): every job's workers are its children",
                                  "/usr/local/bin/ray start --block --gpu 2 --ready-file /run/nvidia-sim/ready/ray-like"),
    "vllm-tp.service": unit_file("vLLM V1, TP=2 (simulated): API server, resource tracker, EngineCore, workers",
                                 "/usr/local/bin/vllm serve model --gpus 0,1 --ready-file /run/nvidia-sim/ready/vllm-tp"),
    "mysched-agent.service": unit_file("A site scheduler's node agent (simulated)",
                                       "/usr/local/bin/mysched-agent --gpu 3 --ready-file /run/nvidia-sim/ready/mysched"),
}
SCRIPTS = {"/usr/local/bin/ray": RAY, "/usr/local/bin/vllm": VLLM, "/usr/local/bin/mysched-agent": MYSCHED}


def gpu_host(fleet, count=4) -> str:
    return next(h.name for h in fleet.hosts if h.gpu_count >= count and h.idle_mib == 0)


def install(fleet, host, files: dict, mode: str = "0644") -> None:
    script = "".join(f"cat > {path} <<'ZEROMIB_EOF'\n{text}ZEROMIB_EOF\nchmod {mode} {path}\n" for path, text in files.items())
    fleet.ssh(host, script + "systemctl daemon-reload", check=True)


def start_and_read(fleet, host, unit, ready, timeout=30) -> dict:
    fleet.ssh(host, f"mkdir -p /run/nvidia-sim/ready; systemctl start {unit}", check=True)
    assert wait_for(lambda: fleet.ssh(host, f"test -s {ready}").returncode == 0, timeout=timeout), f"{unit} never got ready"
    return json.loads(fleet.ssh(host, f"cat {ready}", check=True).stdout)


@pytest.fixture(scope="module")
def cluster(fleet, fleet_baselines):
    """On one host: ray-like.service (job A's worker on GPU 2, job B's CPU worker) and
    vllm-tp.service (workers on GPUs 0 and 1), then free_gpus.yml --check and the real run."""
    fleet.reset()
    host = gpu_host(fleet)
    install(fleet, host, SCRIPTS, "0755")
    install(fleet, host, {f"{UNIT_DIR}/{u}": text for u, text in UNITS.items()})
    try:
        ray = start_and_read(fleet, host, "ray-like.service", "/run/nvidia-sim/ready/ray-like")
        v1 = start_and_read(fleet, host, "vllm-tp.service", "/run/nvidia-sim/ready/vllm-tp")
        before = fleet.gpu_memory(host)
        # Issue 72: a vouched Ray node's workers are ended only when services names `ray:` (else the run refuses with `ray stop`).
        ray_named = {"free_gpus_kill_timeout": KILL_TIMEOUT, "free_gpus_services": ["ray:"]}
        check = fleet.ansible_playbook(PLAYBOOK, limit=host, check=True, extra_vars=ray_named)
        after_check = fleet.gpu_memory(host)
        run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars=ray_named)
        yield {"host": host, "ray": ray, "v1": v1, "before": before, "after_check": after_check, "check": check, "run": run,
               "ray_main_after": main_pid(fleet, host, "ray-like.service"), "t_run": time.monotonic(), "after": fleet.gpu_memory(host)}
    finally:
        fleet.ssh(host, "systemctl stop ray-like.service vllm-tp.service mysched-agent.service; "
                        f"rm -f {' '.join(f'{UNIT_DIR}/{u}' for u in UNITS)} {' '.join(SCRIPTS)}; systemctl daemon-reload; "
                        "systemctl reset-failed")
        fleet.reset()


def test_ray_like_launcher_stays_active_with_its_cpu_job_and_only_the_gpu_worker_is_ended(cluster, fleet):
    host, run, ray = cluster["host"], cluster["run"], cluster["ray"]
    assert run.rc == 0, run
    assert cluster["before"][2] >= 3000 and cluster["after"] == baseline(fleet, host)
    assert unit_states(fleet, host, "ray-like.service")["ray-like.service"][0] == "active"
    assert cluster["ray_main_after"] == ray["pid"]  # never restarted: the same `ray start` process
    assert alive(fleet, host, [ray["pid"], ray["cpu_worker"], ray["gpu_worker"]]) == {
        ray["pid"]: True, ray["cpu_worker"]: True, ray["gpu_worker"]: False}
    res = run.result(RELEASE_TASK, host)
    assert "ray-like.service" not in res["stopped_units"]
    [entry] = [e for e in res["launchers"] if e["unit"] == "ray-like.service"]
    assert entry["pids"] == [ray["gpu_worker"]] and "ray start" in entry["reason"], entry
    assert ray["gpu_worker"] in {k["pid"] for k in res["killed"]}


def test_vllm_v1_shaped_unit_with_processes_without_a_gpu_is_stopped_as_the_workload(cluster, fleet):
    host, run, v1 = cluster["host"], cluster["run"], cluster["v1"]
    res = run.result(RELEASE_TASK, host)
    assert res["stopped_units"] == ["vllm-tp.service"], res["stopped_units"]
    assert not {k["pid"] for k in res["killed"]} & {v1["pid"], v1["engine_core"], *v1["workers"]}  # stopped, not signalled
    time.sleep(max(0.0, 3.0 - (time.monotonic() - cluster["t_run"])))  # Restart=always, RestartSec=1
    assert unit_states(fleet, host, "vllm-tp.service")["vllm-tp.service"][0] == "inactive"
    assert not any(alive(fleet, host, [v1["pid"], v1["tracker"], v1["engine_core"], *v1["workers"]]).values())


def test_check_mode_plans_the_same_and_acts_on_nothing(cluster):
    host = cluster["host"]
    assert cluster["check"].rc == 0, cluster["check"]
    assert cluster["after_check"] == cluster["before"]
    planned, done = cluster["check"].result(RELEASE_TASK, host), cluster["run"].result(RELEASE_TASK, host)
    assert planned["stopped_units"] == done["stopped_units"] == ["vllm-tp.service"]
    assert [(e["unit"], e["pids"]) for e in planned["launchers"]] == [(e["unit"], e["pids"]) for e in done["launchers"]]


def test_a_site_launcher_named_in_free_gpus_launchers_is_kept_and_its_gpu_job_ended(cluster, fleet):
    host = cluster["host"]
    job_pid = start_and_read(fleet, host, "mysched-agent.service", "/run/nvidia-sim/ready/mysched")["pid"]
    agent = main_pid(fleet, host, "mysched-agent.service")
    # by the built-in rules the agent's unit is the workload: the plan stops it
    plain = fleet.ansible_playbook(PLAYBOOK, limit=host, check=True)
    assert plain.result(RELEASE_TASK, host)["stopped_units"] == ["mysched-agent.service"]
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_launchers": ["mysched*.service"],
                                                                   "free_gpus_kill_timeout": KILL_TIMEOUT})
    assert run.rc == 0, run
    res = run.result(RELEASE_TASK, host)
    assert res["stopped_units"] == [] and [(e["unit"], e["pids"]) for e in res["launchers"]] == [("mysched-agent.service", [job_pid])]
    assert unit_states(fleet, host, "mysched-agent.service")["mysched-agent.service"][0] == "active"
    assert main_pid(fleet, host, "mysched-agent.service") == agent
    assert alive(fleet, host, [agent, job_pid]) == {agent: True, job_pid: False}
    assert fleet.gpu_memory(host) == baseline(fleet, host)


# --------------------------------------------------------------------------- services: ["*"]

SLEEPER = "/bin/sleep infinity"
ONESHOT = "[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/true\nExecStop=/bin/true\n"
# Dummies named like what keeps a real node reachable and its data safe. A template and its
# instance for ifup@ and wg-quick@, as Debian ships them.
NODE_UNITS = {
    "tailscaled.service": f"[Service]\nExecStart={SLEEPER}\n",
    "ifup@.service": f"[Unit]\nDescription=ifup for %i (simulated)\n[Service]\nExecStart={SLEEPER}\n",
    "wg-quick@.service": ONESHOT,
    "nftables.service": ONESHOT,
    "iscsid.service": f"[Service]\nExecStart={SLEEPER}\n",
    "multipathd.service": f"[Service]\nExecStart={SLEEPER}\n",
    "nfs-server.service": ONESHOT,
    "sssd.service": f"[Service]\nExecStart={SLEEPER}\n",
    "dropbear.service": f"[Service]\nExecStart={SLEEPER}\n",
    "chrony.service": f"[Service]\nExecStart={SLEEPER}\n",
}
NODE_INSTANCES = ["tailscaled.service", "ifup@eth9.service", "wg-quick@wg0.service", "nftables.service", "iscsid.service",
                  "multipathd.service", "nfs-server.service", "sssd.service", "dropbear.service", "chrony.service"]


@pytest.fixture
def node_units(clean_fleet):
    fleet = clean_fleet
    host = gpu_host(fleet)
    install(fleet, host, {f"{UNIT_DIR}/{u}": text for u, text in NODE_UNITS.items()})
    fleet.ssh(host, "systemctl start " + " ".join(NODE_INSTANCES), check=True)
    active_before = set(fleet.ssh(host, "systemctl list-units --type=service --state=active --plain --no-legend | awk '{print $1}'",
                                  check=True).stdout.split())
    yield fleet, host, active_before
    fleet.ssh(host, "systemctl stop " + " ".join(NODE_INSTANCES) + "; rm -f " + " ".join(f"{UNIT_DIR}/{u}" for u in NODE_UNITS)
              + "; systemctl daemon-reload; systemctl reset-failed")


def test_star_keeps_network_storage_identity_remote_access_and_time_units_and_stops_the_gpu_workload(node_units):
    fleet, host, active_before = node_units
    v1 = fleet.workload(host, "vllm-v1")
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_services": ["*"], "free_gpus_kill_timeout": KILL_TIMEOUT})
    res = run.result(RELEASE_TASK, host)
    try:
        assert run.rc == 0, run
        assert "vllm-v1.service" in res["stopped_units"] and not alive(fleet, host, [v1["pid"]])[v1["pid"]]
        states = unit_states(fleet, host, *NODE_INSTANCES)
        assert {u: s[0] for u, s in states.items()} == {u: "active" for u in NODE_INSTANCES}, states
        kept = {k["unit"]: k["reason"] for k in res["kept_units"]}
        for unit, kind in [("tailscaled.service", "network"), ("ifup@eth9.service", "network"), ("wg-quick@wg0.service", "network"),
                           ("nftables.service", "network"), ("iscsid.service", "storage"), ("multipathd.service", "storage"),
                           ("nfs-server.service", "storage"), ("sssd.service", "identity"), ("dropbear.service", "remote access"),
                           ("chrony.service", "time")]:
            assert kept.get(unit, "").startswith(kind + ":"), (unit, kept.get(unit))
        assert not set(res["stopped_units"]) & set(NODE_INSTANCES)
        # the warning names them, and the host
        assert any(line.startswith(f"[WARNING]: {host}: free_gpus_services: kept ") for line in (run.stdout + run.stderr).splitlines()), \
            run.stdout + run.stderr
        assert fleet.gpu_memory(host) == baseline(fleet, host)
    finally:
        # put back what `*` stopped besides the workload (the rig's own oneshots), for the next tests
        others = [u for u in res.get("stopped_units", []) if u != "vllm-v1.service" and u in active_before]
        if others:
            fleet.ssh(host, "systemctl start " + " ".join(others))


@pytest.mark.parametrize("unit", ["tailscaled.service", "ifup@eth9.service", "nftables.service"])
def test_an_exact_name_still_stops_a_node_keeping_unit(node_units, unit):
    fleet, host, _before = node_units
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_services": [unit]})
    assert run.rc == 0, run
    assert run.result(RELEASE_TASK, host)["stopped_units"] == [unit]
    assert unit_states(fleet, host, unit)[unit][0] == "inactive"


# --------------------------------------------------------------------------- globs over unit files

INSTALLED = unit_file("An LLM server installed and disabled (simulated)",
                      "/usr/local/bin/gpu_holder --gpus 0 --mib 1000 --name llm_serve", restart="no")


@pytest.fixture
def installed_units(clean_fleet):
    """llmfile-off.service: installed, disabled, inactive (systemd has not loaded it);
    llmfile-on.service: enabled for a target that is not started (so not loaded either)."""
    fleet = clean_fleet
    host = gpu_host(fleet)
    install(fleet, host, {f"{UNIT_DIR}/llmfile-off.service": INSTALLED,
                          f"{UNIT_DIR}/llmfile-on.service": INSTALLED.replace("WantedBy=multi-user.target", "WantedBy=zeromib-later.target"),
                          f"{UNIT_DIR}/zeromib-later.target": "[Unit]\nDescription=A target nothing starts\n"})
    fleet.ssh(host, "systemctl enable llmfile-on.service && systemctl daemon-reload", check=True)
    yield fleet, host
    fleet.ssh(host, f"systemctl disable llmfile-on.service; rm -f {UNIT_DIR}/llmfile-*.service {UNIT_DIR}/zeromib-later.target; "
                    "systemctl daemon-reload")


def test_glob_matches_installed_units_systemd_has_not_loaded(installed_units):
    fleet, host = installed_units
    loaded = fleet.ssh(host, "systemctl list-units --all --plain --no-legend 'llmfile*'", check=True).stdout
    assert "llmfile-off" not in loaded and "llmfile-on" not in loaded, loaded  # what the glob used to see: nothing
    # stopped: nothing to do, and no false "matches no unit" warning
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_services": ["llmfile*.service"]})
    assert run.rc == 0, run
    assert "matches no unit" not in run.stdout + run.stderr, run.stdout + run.stderr
    assert run.result(RELEASE_TASK, host)["stopped_units"] == []
    # disabled: the enabled one is disabled, the disabled one left alone
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_services": ["llmfile*.service"],
                                                                   "free_gpus_service_state": "disabled"})
    assert run.rc == 0, run
    res = run.result(RELEASE_TASK, host)
    assert res["disabled_units"] == ["llmfile-on.service"], res
    assert unit_states(fleet, host, "llmfile-on.service", "llmfile-off.service") == {
        "llmfile-on.service": ("inactive", "disabled"), "llmfile-off.service": ("inactive", "disabled")}


def test_a_glob_that_matches_nothing_on_any_host_is_a_settings_mistake_and_nothing_is_done(clean_fleet):
    # issue 55: typos stop the play (was a warning naming the host, rc 0)
    fleet = clean_fleet
    host = gpu_host(fleet)
    fleet.workload(host, "vllm")
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_services": ["tgi-none*.service"]})
    assert run.rc == 2, run
    lines = summary_lines(run)
    assert summary_status(lines, host) == "invalid", lines
    assert summary_row(lines, host).endswith(f"{host}: settings mistake, nothing was done: free_gpus_services: tgi-none*.service matches no "
                                             "unit, container or supervisord program on any host of the play"), lines
    assert "on this host" not in run.stdout + run.stderr
    assert unit_states(fleet, host, "vllm.service")["vllm.service"][0] == "active", "nothing was done"


# --------------------------------------------------------------------------- spanning units (issue 20.3)

def test_a_unit_whose_workers_span_gpus_fails_before_acting_for_a_partial_selection_and_kill_spanning_stops_it(clean_fleet):
    """vllm.service runs one TP worker per GPU: freeing GPU 1 alone would end the engine on every
    GPU. The host fails before anything is stopped or signalled (--check says the same), the
    summary names the unit and its GPUs; with free_gpus_kill_spanning the unit is stopped."""
    fleet = clean_fleet
    host = gpu_host(fleet)
    vllm = fleet.workload(host, "vllm")
    before = fleet.gpu_memory(host)
    for check in (True, False):
        run = fleet.ansible_playbook(PLAYBOOK, limit=host, check=check, extra_vars={"free_gpus_gpus": [1]})
        assert run.rc != 0 and run.stats[host]["failures"] >= 1, run
        res = run.result(RELEASE_TASK, host)
        assert res["stopped_units"] == [] and res["killed"] == [], res
        assert "refusing to free GPU 1" in res["msg"] and "unit vllm.service" in res["msg"] and "kill_spanning" in res["msg"], res["msg"]
        [entry] = res["spanning"]
        assert entry["unit"] == "vllm.service" and 1 not in entry["outside_gpus"] and 0 in entry["outside_gpus"]
        # said once, in the summary (issue 32)
        assert "refusing to free GPU 1" in summary_row(summary_lines(run), host), summary_lines(run)
        row = summary_row(summary_lines(run) or [], host)
        assert row and row.startswith("failed") and "unit vllm.service" in row and "GPU 0,2,3,4,5,6,7 are outside the selection" in row, row
        assert unit_states(fleet, host, "vllm.service")["vllm.service"][0] == "active"
        assert alive(fleet, host, [vllm["pid"], *vllm["workers"]]) == {p: True for p in [vllm["pid"], *vllm["workers"]]}
        assert fleet.gpu_memory(host) == before
    run = fleet.ansible_playbook(PLAYBOOK, limit=host, extra_vars={"free_gpus_gpus": [1], "free_gpus_kill_spanning": True,
                                                                   "free_gpus_kill_timeout": KILL_TIMEOUT})
    assert run.rc == 0, run
    res = run.result(RELEASE_TASK, host)
    assert res["stopped_units"] == ["vllm.service"] and res["spanning"][0]["unit"] == "vllm.service"
    assert summary_status(summary_lines(run), host) == "freed"
    assert "spanning: vllm.service uses GPUs" in summary_row(summary_lines(run), host)
    assert fleet.gpu_memory(host) == baseline(fleet, host)
