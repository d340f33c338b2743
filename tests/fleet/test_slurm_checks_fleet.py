"""Every Slurm job boundary (issue 35), with real Slurm: slurmctld, slurmd and munge of the host's
own one-node cluster (Debian 12, Slurm 22.05), the node given its 8 simulated GPUs as gres
(GresTypes=gpu, gres.conf File=/dev/nvidia[0-7]), so that slurmd itself sets SLURM_JOB_GPUS for the
hooks; the hooks installed by the role zeromib.gpu.slurm_gpu_checks; jobs submitted with sbatch.

The rig runs Slurm with proctrack/linuxproc and task/none (cgroup v1, see fleet.py): a job's tasks
sit in slurmd.service's cgroup below their slurmstepd, no device cgroup keeps a job off another
job's GPU, and a process that leaves its job (setsid, reparented to PID 1) is not ended by Slurm -
what the epilog is for.

Runs on a fleet of 1 or more hosts: `ZEROMIB_FLEET_HOSTS=1 ZEROMIB_FLEET_PROFILE=h200 pytest tests/fleet/test_slurm_checks_fleet.py`."""
from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from scenarios import wait_for

RESTORE = "playbooks/restore_gpus.yml"
LOG = "/var/log/zeromib-gpu/slurm_gpu_checks.log"
RUNNER = "/usr/local/lib/zeromib-gpu/slurm_gpu_checks.pyz"
CONF = "/etc/slurm/slurm.conf"
SAVED = "/root/slurm.conf.before-slurm-checks"
ROLE = "zeromib.gpu.slurm_gpu_checks"
HOLDER = "/usr/local/bin/gpu_holder"


def install(fleet, host, state="present", check=False, **options):
    role = {"role": ROLE, "slurm_gpu_checks_state": state, "slurm_gpu_checks_options": dict({"kill_timeout": 2}, **options)}
    play = {"hosts": host, "gather_facts": False, "roles": [role]}
    return fleet.ansible_playbook([play], limit=host, check=check)


def node(fleet, host) -> dict:
    out = fleet.ssh(host, f"scontrol show node -o {host}", check=True).stdout
    fields = dict(part.split("=", 1) for part in out.split() if "=" in part)
    reason = out.split("Reason=", 1)[1].strip() if "Reason=" in out else ""
    fields["Reason"] = reason.split(" [", 1)[0]
    return fields


def drained(fields) -> bool:
    return "DRAIN" in fields["State"]


def submit(fleet, host, script, gpus=1) -> str:
    # --mem: the node's RealMemory is 100 MB and cons_tres counts memory (CR_CORE_MEMORY): a job
    # without it takes the whole node and the next one waits.
    r = fleet.ssh(host, f"sbatch --parsable -o /dev/null --mem=10M --gres=gpu:{gpus:d} --wrap {shlex.quote(script)}", check=True)
    return r.stdout.strip().split(";")[0]


def job(fleet, host, job_id) -> dict:
    out = fleet.ssh(host, f"scontrol show job -o {job_id}").stdout
    return dict(part.split("=", 1) for part in out.split() if "=" in part)


def hook_runs(fleet, host, job_id, mode) -> list[dict]:
    out = fleet.ssh(host, f"cat {LOG} 2>/dev/null").stdout
    runs = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [r for r in runs if r.get("job") == job_id and r.get("mode") == mode]


def alive(fleet, host, pid) -> bool:
    return fleet.ssh(host, f"test -d /proc/{pid:d}").returncode == 0


def leave_behind(name, mib, gpus="0"):
    """A job script that starts a holder which leaves the job (setsid: reparented to PID 1, which
    proctrack/linuxproc does not follow) and ends once it holds its memory. `gpus` are CUDA's
    device numbers: the simulator, as CUDA, counts them within CUDA_VISIBLE_DEVICES (the job's)."""
    ready = f"/run/nvidia-sim/ready/{name}"
    return (f"mkdir -p /run/nvidia-sim/ready; rm -f {ready}; setsid nohup {HOLDER} --gpus {gpus} --mib {mib:d} --name {name} "
            f"--ready-file {ready} </dev/null >/dev/null 2>&1 & for i in $(seq 400); do [ -e {ready} ] && break; sleep 0.025; done")


def ready_pid(fleet, host, name) -> int:
    assert wait_for(lambda: fleet.ssh(host, f"test -s /run/nvidia-sim/ready/{name}").returncode == 0, timeout=30), name
    return json.loads(fleet.ssh(host, f"cat /run/nvidia-sim/ready/{name}", check=True).stdout)["pid"]


def ended(fleet, host, job_id, mode="epilog"):
    assert wait_for(lambda: hook_runs(fleet, host, job_id, mode), timeout=60), (job_id, job(fleet, host, job_id))
    return hook_runs(fleet, host, job_id, mode)[-1]


HOOKS = ("Prolog=/usr/local/libexec/zeromib-gpu/prolog", "Epilog=/usr/local/libexec/zeromib-gpu/epilog")
# Left by a test that changed the node's Slurm setup: the next test that needs the node configures
# it again (the last one on a host, the Debian 13 one, spares that ~10 s restart and role run).
RECONFIGURE = "/run/zeromib-test-reconfigure"


def configure(fleet, host):
    """The host's Slurm node given its 8 GPUs as gres and 4 CPUs (two jobs side by side), from the
    slurm.conf saved before the first change, and the hooks installed by the role."""
    fleet.ssh(host, f"""set -e; [ -e {SAVED} ] || cp {CONF} {SAVED}; cp {SAVED} {CONF}; rm -rf /etc/slurm/epilog.d /run/site-epilog-* {RECONFIGURE}
sed -i 's/^NodeName=.*/NodeName={host} NodeAddr=127.0.0.1 CPUs=4 RealMemory=100 Gres=gpu:8 State=UNKNOWN/' {CONF}
echo GresTypes=gpu >> {CONF}
echo 'Name=gpu File=/dev/nvidia[0-7]' > /etc/slurm/gres.conf
rm -f {LOG}; systemctl restart munge; systemctl restart slurmctld slurmd""", check=True)
    assert wait_for(lambda: fleet.ssh(host, f"scontrol show node -o {host}").returncode == 0, timeout=30)
    first = install(fleet, host)
    assert first.rc == 0, str(first)


def as_configured(fleet, host) -> bool:
    """The hooks are the role's and only the role's (a test that failed half-way may have left a
    site's hook, or removed ours, or changed the plugins)."""
    conf = fleet.ssh(host, f"cat {CONF}; test -x {RUNNER} && test ! -e /etc/slurm/epilog.d && test ! -e {RECONFIGURE} && echo RUNNER-OK").stdout.splitlines()
    hooks = [line for line in conf if line.startswith(("Prolog=", "Epilog="))]
    return sorted(hooks) == sorted(HOOKS) and "RUNNER-OK" in conf


@pytest.fixture(scope="module")
def slurm_node(fleet):
    """One host's Slurm node for the tests of this file, configured and given the hooks once (a
    restart of munge, slurmctld and slurmd and a role run cost ~15 s of CPU: per test they were
    ~70 % of this file's); everything put back after the last test."""
    hosts = [h.name for h in fleet.hosts if h.gpu_count >= 8 and h.idle_mib == 0]
    assert hosts, "these tests need a host with 8 GPUs"
    host = hosts[0]
    try:
        configure(fleet, host)
        yield host
    finally:
        fleet.clear_faults(host)
        install(fleet, host, state="absent")
        fleet.ssh(host, f"scancel --quiet --full -u root 2>/dev/null; mv {SAVED} {CONF} 2>/dev/null; rm -rf /etc/slurm/gres.conf {LOG} "
                        f"/etc/slurm/epilog.d /run/site-epilog-* {RECONFIGURE}; systemctl restart slurmctld slurmd; sleep 1; "
                        f"scontrol update nodename={host} state=resume 2>/dev/null; systemctl stop slurmd slurmctld; true")


@pytest.fixture
def gres_host(slurm_node, clean_fleet):
    """The file's Slurm node for one test, as a fresh one would be: no job, not drained, no fault,
    an empty hook log, the role's hooks (configured again if a test left them otherwise)."""
    fleet, host = clean_fleet, slurm_node
    as_fresh(fleet, host)
    yield fleet, host
    fleet.clear_faults(host)


def as_fresh(fleet, host):
    fleet.clear_faults(host)
    fleet.ssh(host, f"scancel --quiet --full -u root 2>/dev/null; rm -f {LOG}; true")
    assert wait_for(lambda: fleet.ssh(host, "squeue -h").stdout.strip() == "", timeout=60), fleet.ssh(host, "squeue").stdout
    if not as_configured(fleet, host):
        configure(fleet, host)
    fleet.ssh(host, f"scontrol update nodename={host} state=resume 2>/dev/null; true")
    assert wait_for(lambda: not drained(node(fleet, host)) and "Gres=gpu:8" in fleet.ssh(host, f"scontrol show node -o {host}").stdout,
                    timeout=15), node(fleet, host)


# Debian 13's Slurm 24.11 beside Debian 12's 22.05: a trixie host of its own (suite_fleet, brought
# up only when a 24.11 case runs), configured as the session fleet's node is.
SLURM_VERSIONS = ("22.05", "24.11")


def slurm_version(fleet, host) -> str:
    return fleet.ssh(host, "slurmd -V", check=True).stdout.split()[-1]


@pytest.fixture(scope="module")
def slurm2411_node(suite_fleet):
    fleet = suite_fleet("trixie")
    host = fleet.names[0]
    configure(fleet, host)
    return fleet, host


@pytest.fixture
def gres2411_host(slurm2411_node):
    fleet, host = slurm2411_node
    as_fresh(fleet, host)
    yield fleet, host
    fleet.clear_faults(host)
    fleet.reset()


@pytest.fixture(params=SLURM_VERSIONS)
def any_gres_host(request, suite_fleet):
    """gres_host on Slurm 22.05 (the session fleet's bookworm host) or on 24.11 (a trixie host);
    the node's own slurmd says which it runs."""
    fleet, host = request.getfixturevalue("gres_host" if request.param == "22.05" else "gres2411_host")
    assert slurm_version(fleet, host).startswith(request.param + "."), slurm_version(fleet, host)
    return fleet, host


def test_on_debian_13_free_gpus_stops_a_unit_and_ends_a_stray_holder(slurm2411_node):
    """The collection's modules on trixie's Python 3.13 and systemd 257, as on bookworm's."""
    fleet, host = slurm2411_node
    try:
        assert fleet.ssh(host, "python3 -c 'import sys; print(sys.version_info[:2])'").stdout.strip() == "(3, 13)"
        assert fleet.ssh(host, "systemctl --version").stdout.split()[1] == "257"
        fleet.workload(host, "vllm")
        stray = fleet.workload(host, "train", gpus="3", mib=1000)
        freed = fleet.ansible_playbook("playbooks/free_gpus.yml", limit=host)
        assert freed.rc == 0, str(freed)
        assert set(fleet.gpu_memory(host).values()) == {0}, fleet.gpu_memory(host)
        assert not alive(fleet, host, stray["pid"]) and fleet.ssh(host, "systemctl is-active vllm").stdout.strip() != "active"
    finally:
        fleet.reset()


# --------------------------------------------------------------------------- the role


def test_the_role_installs_idempotently_checks_in_check_mode_and_removes_only_its_own(gres_host):
    fleet, host = gres_host
    conf = fleet.ssh(host, f"cat {CONF}", check=True).stdout
    assert "Prolog=/usr/local/libexec/zeromib-gpu/prolog" in conf and "Epilog=/usr/local/libexec/zeromib-gpu/epilog" in conf
    assert fleet.ssh(host, f"stat -c '%U %a' {RUNNER} /etc/zeromib-gpu/slurm_gpu_checks.json", check=True).stdout.split() == [
        "root", "755", "root", "600"]
    again = install(fleet, host)
    assert again.rc == 0 and again.stats[host]["changed"] == 0, str(again)
    dry = install(fleet, host, check=True, max_used_mib=8)
    assert dry.rc == 0 and dry.stats[host]["changed"] == 1, str(dry)  # the config would change
    assert '"max_used_mib": 8' not in fleet.ssh(host, "cat /etc/zeromib-gpu/slurm_gpu_checks.json").stdout

    # A misspelt option stops the play at the role's argument spec, before anything is installed; a
    # value JSON cannot carry as the runner needs it, at the runner's own check of the config.
    bad = install(fleet, host, kill_timout=3)
    said = "slurm_gpu_checks_options.kill_timout is not an option of slurm_gpu_checks_options; did you mean kill_timeout?"
    assert bad.rc != 0 and str(bad).count(said) == 1 and "Supported parameters" not in str(bad), str(bad)
    quoted = install(fleet, host, kill_timeout="3")
    assert quoted.rc != 0 and "kill_timeout must be a number, got '3'" in str(quoted), str(quoted)
    install(fleet, host)

    gone = install(fleet, host, state="absent")
    assert gone.rc == 0, str(gone)
    conf = fleet.ssh(host, f"cat {CONF}", check=True).stdout
    assert "zeromib-gpu" not in conf and "GresTypes=gpu" in conf
    assert fleet.ssh(host, f"test -e {RUNNER}").returncode != 0
    assert install(fleet, host).rc == 0


def test_a_site_hook_is_never_replaced_and_a_directory_glob_gets_the_hook_beside_the_sites(gres_host):
    fleet, host = gres_host
    assert install(fleet, host, state="absent").rc == 0
    fleet.ssh(host, f"echo Epilog=/usr/local/sbin/site-epilog >> {CONF}", check=True)
    refused = install(fleet, host)
    assert refused.rc != 0 and "never replaces a site's hook" in str(refused), str(refused)
    assert "Epilog=/usr/local/sbin/site-epilog" in fleet.ssh(host, f"cat {CONF}").stdout

    fleet.ssh(host, f"sed -i '/^Epilog=/d' {CONF}; mkdir -p /etc/slurm/epilog.d; "
                    f"printf '#!/bin/sh\\ntouch /run/site-epilog-$SLURM_JOB_ID\\n' > /etc/slurm/epilog.d/10-site; chmod 755 /etc/slurm/epilog.d/10-site; "
                    f"echo 'Epilog=/etc/slurm/epilog.d/*' >> {CONF}", check=True)
    placed = install(fleet, host)
    assert placed.rc == 0, str(placed)
    assert fleet.ssh(host, "test -x /etc/slurm/epilog.d/50-zeromib-gpu").returncode == 0
    assert "Epilog=/etc/slurm/epilog.d/*" in fleet.ssh(host, f"cat {CONF}").stdout
    job_id = submit(fleet, host, leave_behind("dir_left", 1500))
    run = ended(fleet, host, job_id)
    assert run["ok"] and [k["name"] for k in run["killed"]] == ["dir_left"], run
    assert fleet.ssh(host, f"test -e /run/site-epilog-{job_id}").returncode == 0  # the site's hook ran too
    gone = install(fleet, host, state="absent")
    assert gone.rc == 0 and fleet.ssh(host, "test -e /etc/slurm/epilog.d/50-zeromib-gpu").returncode != 0
    assert fleet.ssh(host, "test -e /etc/slurm/epilog.d/10-site").returncode == 0
    fleet.ssh(host, f"sed -i '/^Epilog=/d' {CONF}; rm -rf /etc/slurm/epilog.d /run/site-epilog-*")
    assert install(fleet, host).rc == 0


# --------------------------------------------------------------------------- the epilog


def test_a_job_that_leaves_an_orphaned_holder_is_freed_by_the_epilog_and_the_next_job_runs(any_gres_host):
    fleet, host = any_gres_host
    job_id = submit(fleet, host, leave_behind("left_behind", 3000))
    pid = ready_pid(fleet, host, "left_behind")
    run = ended(fleet, host, job_id)
    assert run["ok"] and run["gpus"] == ["0"] and [(k["pid"], k["name"]) for k in run["killed"]] == [(pid, "left_behind")], run
    assert not alive(fleet, host, pid)
    assert fleet.gpu_memory(host)[0] == 0
    assert not drained(node(fleet, host)), node(fleet, host)

    after = submit(fleet, host, "true")
    assert wait_for(lambda: job(fleet, host, after).get("JobState") == "COMPLETED", timeout=60), job(fleet, host, after)
    assert ended(fleet, host, after)["ok"] and ended(fleet, host, after, "prolog")["ok"]


# gres.conf listing /dev/nvidia6 first: slurmd's GRES index 0 is nvidia-smi's GPU 6, 1 is GPU 0, and
# so on (issue 69: the order PrincetonUniversity/jobstats #34 reports, where minor numbers do not
# follow the PCI bus; here the files are written out of the bus order, which slurmd reads alike).
GRES_FILES = [6, 0, 1, 2, 3, 4, 5, 7]


def on_the_gpu_slurm_gave(name, mib, detach):
    """A job script whose holder runs on the GPU behind the device file of its GRES index (what
    ConstrainDevices and CUDA make of a real job: the rig has no device cgroup, and the simulator
    counts CUDA_VISIBLE_DEVICES, slurmd's GRES indexes here, as nvidia-smi's)."""
    ready = f"/run/nvidia-sim/ready/{name}"
    pick = f"set -- {' '.join(map(str, GRES_FILES))}; shift $SLURM_JOB_GPUS; gpu=$1"
    run = f"env -u CUDA_VISIBLE_DEVICES {HOLDER} --gpus $gpu --mib {mib:d} --name {name} --ready-file {ready}"
    if detach:
        return (f"mkdir -p /run/nvidia-sim/ready; rm -f {ready}; {pick}; setsid nohup {run} </dev/null >/dev/null 2>&1 & "
                f"for i in $(seq 400); do [ -e {ready} ] && break; sleep 0.025; done")
    return f"mkdir -p /run/nvidia-sim/ready; rm -f {ready}; {pick}; exec {run}"


def test_slurms_gres_index_is_mapped_to_the_gpu_behind_its_device_file_not_read_as_an_nvidia_smi_index(any_gres_host):
    """slurmd itself numbers the GPUs by gres.conf's files. Job R runs on its GPU; job E leaves a
    holder on its own and ends. The epilog of E, given E's GRES index in SLURM_JOB_GPUS, frees the
    GPU behind that index's file and leaves R's GPU alone; before issue 69 it looked at the
    nvidia-smi GPU of that number, passed, and left the holder."""
    fleet, host = any_gres_host
    fleet.ssh(host, f"touch {RECONFIGURE}; printf 'Name=gpu File=/dev/nvidia6\\nName=gpu File=/dev/nvidia[0-5,7]\\n' > /etc/slurm/gres.conf; "
                    "systemctl restart slurmctld slurmd", check=True)
    assert wait_for(lambda: "Gres=gpu:8" in fleet.ssh(host, f"scontrol show node -o {host}").stdout and not drained(node(fleet, host)),
                    timeout=30), node(fleet, host)
    running = submit(fleet, host, on_the_gpu_slurm_gave("gres_running", 2000, detach=False))
    other_pid = ready_pid(fleet, host, "gres_running")
    ending = submit(fleet, host, on_the_gpu_slurm_gave("gres_left", 1000, detach=True))
    mine = ready_pid(fleet, host, "gres_left")
    run = ended(fleet, host, ending)
    [index] = run["gpus"]
    gpu = GRES_FILES[int(index)]
    assert gpu != int(index) and run["ok"] and [k["pid"] for k in run["killed"]] == [mine], run
    assert run["gres"]["mapped"][index].endswith(f" (/dev/nvidia{gpu})"), run
    assert not alive(fleet, host, mine) and alive(fleet, host, other_pid) and job(fleet, host, running)["JobState"] == "RUNNING"
    memory = fleet.gpu_memory(host)
    assert memory[gpu] < 64 and max(memory.values()) >= 2000, memory  # the running job's context leaves its footprint
    assert ended(fleet, host, ending, "prolog")["gres"]["mapped"][index] == run["gres"]["mapped"][index]
    assert not drained(node(fleet, host)), node(fleet, host)


def test_the_epilog_touches_only_its_own_processes_beside_another_running_job(gres_host):
    fleet, host = gres_host
    running = submit(fleet, host, f"exec {HOLDER} --gpus 0 --mib 2000 --name other_job --ready-file /run/nvidia-sim/ready/other_job")
    other_pid = ready_pid(fleet, host, "other_job")
    assert wait_for(lambda: job(fleet, host, running).get("JobState") == "RUNNING", timeout=30)
    ending = submit(fleet, host, leave_behind("mine", 1000))
    mine = ready_pid(fleet, host, "mine")
    run = ended(fleet, host, ending)
    assert run["ok"] and run["gpus"] == ["1"] and [k["pid"] for k in run["killed"]] == [mine], run
    assert alive(fleet, host, other_pid) and job(fleet, host, running)["JobState"] == "RUNNING"
    memory = fleet.gpu_memory(host)
    assert memory[0] >= 2000 and memory[1] == 0, memory  # a context adds a few MiB, as on a real GPU
    assert not drained(node(fleet, host)), node(fleet, host)


def test_another_jobs_process_on_the_ending_jobs_gpu_is_spared_and_the_node_drained_naming_it(gres_host):
    # No device cgroup in this rig: once the ending job runs (its prolog saw GPU 1 free), a process of
    # the running job ignores CUDA_VISIBLE_DEVICES and takes GPU 1 too.
    fleet, host = gres_host
    fleet.ssh(host, "rm -f /run/zeromib-test-go /run/nvidia-sim/ready/greedy")
    running = submit(fleet, host, f"{HOLDER} --gpus 0 --mib 1000 --name own_gpu --ready-file /run/nvidia-sim/ready/own_gpu & "
                                  "while [ ! -e /run/zeromib-test-go ]; do sleep 0.05; done; "
                                  f"exec env -u CUDA_VISIBLE_DEVICES {HOLDER} --gpus 1 --mib 2000 --name greedy --ready-file /run/nvidia-sim/ready/greedy")
    ready_pid(fleet, host, "own_gpu")
    wait_greedy = "for i in $(seq 400); do [ -e /run/nvidia-sim/ready/greedy ] && break; sleep 0.025; done"
    ending = submit(fleet, host, leave_behind("mine2", 1000) + "; touch /run/zeromib-test-go; " + wait_greedy)
    mine = ready_pid(fleet, host, "mine2")
    greedy = ready_pid(fleet, host, "greedy")
    run = ended(fleet, host, ending)
    assert not run["ok"] and [k["pid"] for k in run["killed"]] == [mine], run
    assert alive(fleet, host, greedy) and job(fleet, host, running)["JobState"] == "RUNNING"
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"].startswith(f"zeromib: epilog job {ending}: GPU 1"), fields
    assert f"Slurm job {running}" in fields["Reason"], fields


# issue 54: two jobs of one real user, the same argv (an array job's tasks: the task id is only in
# the environment), each on its own GPU (CUDA's device 0 of the job's CUDA_VISIBLE_DEVICES).
JOB_USER = "zjobs"
TWIN = f"{HOLDER} --gpus 0 --mib 1000"
TWIN_DIR = "/run/zeromib-twins"


def as_user(fleet, host):
    """The real unprivileged user whose jobs these are (no sudo), and the simulator's context
    registry open to every user, as the real driver serves everyone's contexts."""
    fleet.ssh(host, f"id {JOB_USER} >/dev/null 2>&1 || useradd -m {JOB_USER}; mkdir -p /run/nvidia-sim/contexts; "
                    f"chmod 1777 /run/nvidia-sim/contexts; rm -rf {TWIN_DIR}; install -d -m 700 -o {JOB_USER} {TWIN_DIR}", check=True)


def submit_as_user(fleet, host, script) -> str:
    r = fleet.ssh(host, f"runuser -u {JOB_USER} -- sbatch --parsable -D /tmp -o /dev/null --mem=10M --gres=gpu:1 --wrap {shlex.quote(script)}",
                  check=True)
    return r.stdout.strip().split(";")[0]


def twin_pid(fleet, host, name) -> int:
    path = f"{TWIN_DIR}/{name}"
    assert wait_for(lambda: fleet.ssh(host, f"test -s {path}").returncode == 0, timeout=30), name
    return int(fleet.ssh(host, f"cat {path}", check=True).stdout)


def uid_and_argv(fleet, host, pid) -> tuple[str, str]:
    """(the user a process runs as, its argv joined by spaces)."""
    out = fleet.ssh(host, f"stat -c %U /proc/{pid:d}; tr '\\0' ' ' < /proc/{pid:d}/cmdline", check=True).stdout.splitlines()
    return out[0], out[1].strip()


def leave_twin_until_told():
    """Job N: leaves TWIN behind (setsid: reparented to PID 1, no job's), then ends when told."""
    return (f"setsid nohup {TWIN} </dev/null >/dev/null 2>&1 & echo $! > {TWIN_DIR}/left; "
            f"while [ ! -e {TWIN_DIR}/go ]; do sleep 0.05; done")


def after_the_leftover(start):
    """Waits until job N's leftover is gone (its epilog killed it), then runs `start`."""
    return (f"while [ ! -s {TWIN_DIR}/left ]; do sleep 0.05; done; left=$(cat {TWIN_DIR}/left); "
            f"while kill -0 $left 2>/dev/null; do sleep 0.01; done; {start}")


def twin_scene(fleet, host, job_m_script=None, detached_restart=False):
    """Job N leaves TWIN on its GPU, and is told to end once the rest is in place: job M of the
    same user running `job_m_script`, and/or (`detached_restart`) a loop of job N's that
    leaves the job too and starts TWIN again, in no job, once the epilog killed the leftover."""
    as_user(fleet, host)
    # The killed holder's memory lingers a moment after it is gone, as the real driver's does:
    # what starts next runs the killed argv (its interpreter's) before the GPU reads clean.
    fleet.set_fault(host, release_delay_s=1.5)
    script = leave_twin_until_told()
    if detached_restart:
        restart = f"echo $$ > {TWIN_DIR}/loop; " + after_the_leftover(f"CUDA_VISIBLE_DEVICES=1 {TWIN} & echo $! > {TWIN_DIR}/again; wait")
        script = f"setsid nohup sh -c {shlex.quote(restart)} </dev/null >/dev/null 2>&1 & " + script
    ending = submit_as_user(fleet, host, script)
    left = twin_pid(fleet, host, "left")
    assert wait_for(lambda: fleet.gpu_memory(host)[0] >= 1000, timeout=30), fleet.gpu_memory(host)
    argv = uid_and_argv(fleet, host, left)
    running = None
    if job_m_script:
        running = submit_as_user(fleet, host, job_m_script)
        assert wait_for(lambda: job(fleet, host, running).get("JobState") == "RUNNING", timeout=30), job(fleet, host, running)
        assert ended(fleet, host, running, "prolog")["ok"]
    fleet.ssh(host, f"touch {TWIN_DIR}/go", check=True)
    return ending, (left, argv), running


def test_another_jobs_task_with_the_killed_argv_is_no_restart_the_epilog_passes_and_the_node_stays_up(gres_host):
    """The incident of issue 54 on real Slurm: the epilog of job N frees N's leftover on GPU 0;
    job M of the same user starts its next task, the same argv, on GPU 1, the moment the leftover
    is gone. Before, the epilog took it for "something this run killed was started again" and
    the node was drained. Here (proctrack/linuxproc) M's task is M's by its vouched slurmstepd."""
    fleet, host = gres_host
    try:
        ending, (left, argv), running = twin_scene(fleet, host, after_the_leftover(f"{TWIN} & echo $! > {TWIN_DIR}/next; wait"))
        assert argv[0] == JOB_USER
        run = ended(fleet, host, ending)
        assert run["ok"] and run["gpus"] == ["0"] and [k["pid"] for k in run["killed"]] == [left], run
        task = twin_pid(fleet, host, "next")
        assert uid_and_argv(fleet, host, task) == argv, (argv, run)
        assert job(fleet, host, running)["JobState"] == "RUNNING" and alive(fleet, host, task)
        assert wait_for(lambda: fleet.gpu_memory(host)[1] >= 1000, timeout=30)
        assert fleet.gpu_memory(host)[0] == 0
        assert not drained(node(fleet, host)), node(fleet, host)
    finally:
        end_twins(fleet, host)


def test_a_restart_of_the_killed_argv_outside_any_job_still_drains_the_node(gres_host):
    """The same argv started again by a loop that left job N too (no job's: reparented to PID 1)
    is a restart: the epilog fails and the node is drained with a zeromib reason."""
    fleet, host = gres_host
    try:
        ending, (left, argv), _running = twin_scene(fleet, host, detached_restart=True)
        run = ended(fleet, host, ending)
        again = twin_pid(fleet, host, "again")
        assert not run["ok"] and [k["pid"] for k in run["killed"]] == [left], run
        [cause] = run["causes"]
        assert f"pid {again} " in cause and f"runs the command line of killed pid {left} again" in cause, cause
        assert uid_and_argv(fleet, host, again) == argv
        fields = node(fleet, host)
        assert drained(fields) and fields["Reason"].startswith(
            f"zeromib: epilog job {ending}: the GPUs read clean, but something this run killed was started again"), fields
    finally:
        end_twins(fleet, host)


def end_twins(fleet, host):
    """The user's jobs cancelled and what they started ended, by the PIDs they wrote."""
    fleet.ssh(host, f"scancel --quiet --full -u {JOB_USER}; for f in {TWIN_DIR}/loop {TWIN_DIR}/left {TWIN_DIR}/next {TWIN_DIR}/again; do "
                    f"[ -s $f ] && kill -9 $(cat $f) 2>/dev/null; done; rm -rf {TWIN_DIR}; true")
    assert wait_for(lambda: fleet.ssh(host, f"squeue -h -u {JOB_USER}").stdout.strip() == "", timeout=60)


def test_an_unfreeable_gpu_drains_the_node_with_a_zeromib_reason_and_restore_gpus_resumes_it(gres_host):
    fleet, host = gres_host
    job_id = submit(fleet, host, "sleep 5")
    # slurmctld shows RUNNING before slurmd has run the prolog: wait for the prolog itself.
    assert ended(fleet, host, job_id, "prolog")["ok"]
    fleet.set_fault(host, leak={"0": 4096})  # during the job: memory no process holds, a reset or reboot is needed
    run = ended(fleet, host, job_id)
    assert not run["ok"] and run["causes"] == ["GPU 0: 4096 MiB, no process holds it"], run
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"] == f"zeromib: epilog job {job_id}: GPU 0: 4096 MiB, no process holds it", fields

    kept = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_resume_drained": True})
    assert kept.rc == 0 and drained(node(fleet, host)), str(kept)  # still dirty: kept drained
    fleet.clear_faults(host)
    resumed = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_resume_drained": True})
    assert resumed.rc == 0 and not drained(node(fleet, host)), (str(resumed), node(fleet, host))


def test_an_admins_drain_is_never_overwritten_by_a_failing_epilog_nor_resumed(gres_host):
    fleet, host = gres_host
    job_id = submit(fleet, host, "sleep 5")
    assert ended(fleet, host, job_id, "prolog")["ok"]
    fleet.ssh(host, f"scontrol update nodename={host} state=drain reason=maintenance", check=True)
    fleet.set_fault(host, leak={"0": 4096})
    run = ended(fleet, host, job_id)
    assert not run["ok"] and "someone else" in run["drain"], run
    assert wait_for(lambda: job(fleet, host, job_id).get("JobState") != "RUNNING", timeout=30)
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"] == "maintenance", fields
    fleet.clear_faults(host)
    restore = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_resume_drained": True})
    assert restore.rc == 0, str(restore)
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"] == "maintenance", fields


# --------------------------------------------------------------------------- time bounds and draining (issue 59)


def config_on_node(fleet, host) -> dict:
    return json.loads(fleet.ssh(host, "cat /etc/zeromib-gpu/slurm_gpu_checks.json", check=True).stdout)


def test_the_runner_is_bounded_below_prolog_epilog_timeout_and_a_hung_nvidia_smi_ends_in_a_drain_in_time(gres_host):
    """PrologEpilogTimeout=30 in slurm.conf: the role sets the runner's deadline below it (30 less
    its 5 s margin), refuses a deadline that Slurm's timeout would cut short, and an epilog whose
    nvidia-smi hangs answers within its bounds, drained with a zeromib reason, before slurmd's
    timeout would kill it with none."""
    fleet, host = gres_host
    try:
        fleet.ssh(host, f"echo PrologEpilogTimeout=30 >> {CONF}; scontrol reconfigure", check=True)
        assert install(fleet, host, timeout=3).rc == 0
        assert config_on_node(fleet, host)["deadline"] == 25
        refused = install(fleet, host, deadline=28)
        assert refused.rc != 0 and "must stay below Slurm's PrologEpilogTimeout (30 s) by at least 5 s" in str(refused), str(refused)

        assert install(fleet, host, timeout=3).rc == 0
        job_id = submit(fleet, host, "sleep 3")
        assert ended(fleet, host, job_id, "prolog")["ok"]
        fleet.set_fault(host, hang=True)
        run = ended(fleet, host, job_id)
        assert not run["ok"] and run["causes"] == ["nvidia-smi: nvidia-smi timed out after 3 s (a hung driver or a GPU that fell off the bus); "
                                                   "it was killed"], run
        assert run["elapsed_s"] < 25, run
        fields = node(fleet, host)
        assert drained(fields) and fields["Reason"].startswith(f"zeromib: epilog job {job_id}: nvidia-smi: nvidia-smi timed out"), fields
    finally:
        fleet.clear_faults(host)
        fleet.ssh(host, f"sed -i '/^PrologEpilogTimeout=/d' {CONF}; scontrol reconfigure")
        install(fleet, host)


def test_drain_exit_status_calls_no_slurm_command_and_slurmd_drains_the_node_for_the_failed_epilog(gres_host):
    """Where a site forbids Slurm commands in its hooks: the epilog only fails; slurmd drains the
    node with Slurm's own reason, and the cause is in the runner's log."""
    fleet, host = gres_host
    try:
        assert install(fleet, host, drain="exit_status").rc == 0
        job_id = submit(fleet, host, "sleep 3")
        assert ended(fleet, host, job_id, "prolog")["ok"]
        fleet.set_fault(host, leak={"0": 4096})
        run = ended(fleet, host, job_id)
        assert not run["ok"] and run["causes"] == ["GPU 0: 4096 MiB, no process holds it"], run
        assert run["drain"] == "not drained through scontrol (drain: exit_status): slurmd drains the node for the failed hook", run
        assert wait_for(lambda: drained(node(fleet, host)), timeout=30), node(fleet, host)
        assert node(fleet, host)["Reason"] == "Epilog error", node(fleet, host)
    finally:
        fleet.clear_faults(host)
        install(fleet, host)


# --------------------------------------------------------------------------- configless Slurm (issue 59)

CTLD = "/etc/slurm-ctld"  # the controller's own config, as on a head node: the compute node has none
CONFIGLESS_UNITS = {
    # Debian's units start only where /etc/slurm/slurm.conf exists; SchedMD's configless page asks
    # for no ConditionPathExists on slurmd's.
    "slurmctld": f'[Unit]\nConditionPathExists=\nConditionPathExists={CTLD}/slurm.conf\n[Service]\nEnvironment="SLURMCTLD_OPTIONS=-f {CTLD}/slurm.conf"\n',
    "slurmd": '[Unit]\nConditionPathExists=\n[Service]\nEnvironment="SLURMD_OPTIONS=--conf-server 127.0.0.1"\n',
}


def go_configless(fleet, host):
    """slurmctld with SlurmctldParameters=enable_configless reading its config from CTLD, slurmd
    started with --conf-server, and no slurm.conf, gres.conf or cgroup.conf left in /etc/slurm:
    slurmd keeps what slurmctld serves in its conf-cache (/run/slurm/conf), as a configless
    compute node does. The role's hooks are removed first: the cluster starts without them."""
    assert install(fleet, host, state="absent").rc == 0
    units = "; ".join(f"mkdir -p /etc/systemd/system/{u}.service.d; printf {shlex.quote(text)} > /etc/systemd/system/{u}.service.d/configless.conf"
                      for u, text in CONFIGLESS_UNITS.items())
    fleet.ssh(host, f"""set -e; systemctl stop slurmd slurmctld; mkdir -p {CTLD}
mv /etc/slurm/slurm.conf /etc/slurm/gres.conf /etc/slurm/cgroup.conf {CTLD}/; echo SlurmctldParameters=enable_configless >> {CTLD}/slurm.conf
{units}; systemctl daemon-reload; rm -f {LOG}; systemctl start slurmctld; systemctl start slurmd""", check=True)
    assert wait_for(lambda: fleet.ssh(host, f"test -s /run/slurm/conf/slurm.conf && scontrol show node -o {host} | grep -q Gres=gpu:8").returncode == 0,
                    timeout=30), fleet.ssh(host, "journalctl -u slurmd -n 20 --no-pager").stdout
    fleet.ssh(host, f"scontrol update nodename={host} state=resume 2>/dev/null; true")


def leave_configless(fleet, host):
    """The host as the other tests expect it: its own slurm.conf again, the units as Debian ships them."""
    fleet.ssh(host, f"scancel --quiet --full -u root 2>/dev/null; systemctl stop slurmd slurmctld; "
                    f"rm -rf /etc/systemd/system/slurmctld.service.d/configless.conf /etc/systemd/system/slurmd.service.d/configless.conf {CTLD}; "
                    f"cp /etc/slurm/cgroup.conf.fleet /etc/slurm/cgroup.conf 2>/dev/null; systemctl daemon-reload; true")
    configure(fleet, host)


@pytest.fixture
def configless_host(gres_host):
    fleet, host = gres_host
    fleet.ssh(host, "cp -n /etc/slurm/cgroup.conf /etc/slurm/cgroup.conf.fleet", check=True)
    try:
        go_configless(fleet, host)
        yield fleet, host
    finally:
        leave_configless(fleet, host)


def role_said(result, host) -> list[str]:
    return result.result(f"{ROLE} : Say which lines the controller's slurm.conf needs (this node's is not edited)", host)["msg"]


def test_a_configless_node_gets_the_hooks_with_no_slurm_conf_edited_and_they_run_from_the_lines_the_role_names(configless_host):
    """The role on a configless compute node: no slurm.conf of its own, the controller's cached by
    slurmd. It installs the runner, its config and the hooks, edits nothing, and says which lines
    the controller's slurm.conf needs; with them added there (and scontrol reconfigure), slurmd
    runs the hooks from those paths: a job's leftover is freed beside another job's process, the
    next job starts on clean GPUs, and a dirty GPU drains the node through scontrol, which finds
    the controller through the configless copy (slurmd's SLURM_CONF)."""
    fleet, host = configless_host
    cached = fleet.ssh(host, "md5sum /run/slurm/conf/slurm.conf", check=True).stdout
    first = install(fleet, host)
    assert first.rc == 0, str(first)
    said = role_said(first, host)
    assert said[0] == ("slurm.conf is not edited on this node (configless: slurmd reads the controller's slurm.conf, cached in /run/slurm/conf). "
                       "The controller's slurm.conf needs, then scontrol reconfigure:"), said
    assert said[1:3] == list(HOOKS) and said[3].startswith("PrologEpilogTimeout=75 (recommended"), said
    assert fleet.ssh(host, "test ! -e /etc/slurm/slurm.conf && test -x /usr/local/libexec/zeromib-gpu/epilog && test -x " + RUNNER).returncode == 0
    assert fleet.ssh(host, "md5sum /run/slurm/conf/slurm.conf", check=True).stdout == cached

    fleet.ssh(host, f"printf '%s\\n' {' '.join(shlex.quote(line) for line in HOOKS)} PrologEpilogTimeout=40 >> {CTLD}/slurm.conf; scontrol reconfigure",
              check=True)
    assert wait_for(lambda: fleet.ssh(host, "grep -c '^[PE][a-z]*log=/usr/local/libexec/zeromib-gpu/' /run/slurm/conf/slurm.conf").stdout.strip() == "2",
                    timeout=30)
    # The controller's PrologEpilogTimeout, read from slurmd's copy, bounds the runner now: its
    # config is the one change; a third run changes nothing.
    again = install(fleet, host)
    assert again.rc == 0 and again.stats[host]["changed"] == 1 and config_on_node(fleet, host)["deadline"] == 35, str(again)
    assert role_said(again, host)[1:] == [f"{line}: already there" for line in HOOKS], role_said(again, host)
    third = install(fleet, host)
    assert third.rc == 0 and third.stats[host]["changed"] == 0, str(third)

    running = submit(fleet, host, f"exec {HOLDER} --gpus 0 --mib 2000 --name cl_other --ready-file /run/nvidia-sim/ready/cl_other")
    other = ready_pid(fleet, host, "cl_other")
    ending = submit(fleet, host, leave_behind("cl_left", 1500))
    left = ready_pid(fleet, host, "cl_left")
    run = ended(fleet, host, ending)
    assert run["ok"] and run["gpus"] == ["1"] and [k["pid"] for k in run["killed"]] == [left], run
    # Slurm's number mapped through the gres.conf slurmd keeps beside its cached slurm.conf (SLURM_CONF, issue 69).
    assert run["gres"]["mapped"]["1"].endswith(" (/dev/nvidia1)"), run
    assert alive(fleet, host, other) and job(fleet, host, running)["JobState"] == "RUNNING" and not alive(fleet, host, left)
    assert fleet.gpu_memory(host)[1] == 0

    after = submit(fleet, host, "sleep 2")
    prolog = ended(fleet, host, after, "prolog")
    [gpu] = prolog["gpus"]
    assert prolog["ok"] and gpu != "0" and fleet.gpu_memory(host)[int(gpu)] == 0, prolog
    fleet.set_fault(host, leak={gpu: 4096})
    run = ended(fleet, host, after)
    assert not run["ok"] and run["drain"].startswith(f"drained {host}: zeromib: epilog job {after}: GPU {gpu}: 4096 MiB"), run
    assert drained(node(fleet, host)) and node(fleet, host)["Reason"].startswith(f"zeromib: epilog job {after}"), node(fleet, host)


# --------------------------------------------------------------------------- GPUs shared by shards (issue 59)

SHARDS_PER_GPU = 2


@pytest.fixture
def shard_host(gres_host):
    """The node's GPUs also as gres/shard (2 a GPU: two jobs on one GPU, no fence between them, as
    22.05 does it), the role run again: GresTypes names shard, so the runner's shared_gpus is on."""
    fleet, host = gres_host
    shards = "".join(f"Name=shard Count={SHARDS_PER_GPU} File=/dev/nvidia{i}\\n" for i in range(8))
    try:
        fleet.ssh(host, f"""set -e; sed -i 's/^GresTypes=.*/GresTypes=gpu,shard/; s/ Gres=gpu:8 / Gres=gpu:8,shard:{8 * SHARDS_PER_GPU} /' {CONF}
printf 'Name=gpu File=/dev/nvidia[0-7]\\n{shards}' > /etc/slurm/gres.conf; systemctl restart slurmctld slurmd""", check=True)
        assert wait_for(lambda: f"shard:{8 * SHARDS_PER_GPU}" in fleet.ssh(host, f"scontrol show node -o {host}").stdout, timeout=30)
        fleet.ssh(host, f"scontrol update nodename={host} state=resume 2>/dev/null; true")
        assert install(fleet, host).rc == 0 and config_on_node(fleet, host)["shared_gpus"] is True
        yield fleet, host
    finally:
        fleet.ssh(host, "scancel --quiet --full -u root 2>/dev/null; true")
        configure(fleet, host)


def submit_shard(fleet, host, script) -> str:
    r = fleet.ssh(host, f"sbatch --parsable -o /dev/null --mem=10M --gres=shard:1 --wrap {shlex.quote(script)}", check=True)
    return r.stdout.strip().split(";")[0]


def running_holder(fleet, host, name, mib, submit_with=submit_shard):
    """A job whose task holds `mib` on its GPU until cancelled -> (job id, the holder's pid)."""
    job_id = submit_with(fleet, host, f"exec {HOLDER} --gpus 0 --mib {mib:d} --name {name} --ready-file /run/nvidia-sim/ready/{name}")
    pid = ready_pid(fleet, host, name)
    assert wait_for(lambda: job(fleet, host, job_id).get("JobState") == "RUNNING", timeout=30)
    return job_id, pid


def test_jobs_sharing_a_gpu_by_shards_each_epilog_frees_only_its_own_leftover_and_passes_beside_the_other(shard_host):
    """Two jobs on GPU 0 by gres/shard: the ending one leaves a holder; its epilog ends that holder
    only, reads the GPU as what the other job holds there, and passes; the other job runs on; the
    next shard job's prolog and epilog pass on the busy GPU. Before, the epilog saw the other job's
    memory on the GPU and drained the node at every job end."""
    fleet, host = shard_host
    running, other = running_holder(fleet, host, "sh_other", 2000)
    ending = submit_shard(fleet, host, leave_behind("sh_left", 1500))
    left = ready_pid(fleet, host, "sh_left")
    run = ended(fleet, host, ending)
    assert run["ok"] and run["gpus"] == ["0"] and [k["pid"] for k in run["killed"]] == [left], run
    assert run["shared"]["0"]["owners"] == [f"Slurm job {running}"] and run["shared"]["0"]["held_mib"] >= 2000, run
    assert alive(fleet, host, other) and not alive(fleet, host, left) and job(fleet, host, running)["JobState"] == "RUNNING"
    assert fleet.gpu_memory(host)[0] >= 2000 and not drained(node(fleet, host)), node(fleet, host)

    after = submit_shard(fleet, host, "sleep 1")
    assert wait_for(lambda: job(fleet, host, after).get("JobState") == "COMPLETED", timeout=60), job(fleet, host, after)
    prolog, epilog = ended(fleet, host, after, "prolog"), ended(fleet, host, after)
    assert prolog["ok"] and prolog["gpus"] == ["0"] and prolog["holders"] == [] and epilog["ok"] and epilog["killed"] == [], (prolog, epilog)
    assert alive(fleet, host, other) and not drained(node(fleet, host))


def test_on_a_shared_gpu_the_epilog_drains_only_for_what_the_ending_job_left(shard_host):
    """Memory beyond what the other job holds, that no process holds (a leak of the ending job):
    drained, named against the other job's share; the other job's process is never signalled."""
    fleet, host = shard_host
    running, other = running_holder(fleet, host, "sh_other2", 2000)
    ending = submit_shard(fleet, host, "sleep 3")
    assert ended(fleet, host, ending, "prolog")["ok"]
    fleet.set_fault(host, leak={"0": 3000})
    run = ended(fleet, host, ending)
    [cause] = run["causes"]
    assert not run["ok"] and run["killed"] == [] and cause.startswith("GPU 0: "), run
    assert cause.endswith(f" MiB beyond the 2015 MiB that Slurm job {running} holds there, no process holds the rest"), cause
    assert alive(fleet, host, other) and job(fleet, host, running)["JobState"] == "RUNNING"
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"].startswith(f"zeromib: epilog job {ending}: GPU 0: "), fields


NHC_CONFIG = "/etc/zeromib-gpu/nhc.json"
NHC_CHECK = f"SLURM_JOB_ID=0 /usr/bin/python3 -I {RUNNER} prolog --config={NHC_CONFIG}"


def test_the_nhc_recipe_passes_a_busy_node_and_names_a_stray_holder_without_signalling_anything(shard_host):
    """the Slurm guide's check (docs/docsite/rst/guide_slurm.rst) for LBNL NHC, run as NHC runs it between jobs on a node whose jobs are
    running (one on GPU 0 by shard, one on GPU 1): every job's memory is its own, nothing is
    signalled; a process of no job on a GPU fails the check, naming it, and stays."""
    fleet, host = shard_host
    fleet.ssh(host, f"printf '%s\\n' '{{\"without_gres\": \"all\", \"shared_gpus\": true, \"drain\": \"exit_status\", "
                    f"\"log\": \"/var/log/zeromib-gpu/nhc.log\"}}' > {NHC_CONFIG}; chmod 600 {NHC_CONFIG}", check=True)
    try:
        _shard_job, on_gpu0 = running_holder(fleet, host, "nhc_a", 2000)
        _gpu_job, on_gpu1 = running_holder(fleet, host, "nhc_b", 1000, submit_with=lambda f, h, s: submit(f, h, s, gpus=1))
        busy = fleet.ssh(host, NHC_CHECK)
        assert busy.returncode == 0, (busy.stdout, busy.stderr)
        assert alive(fleet, host, on_gpu0) and alive(fleet, host, on_gpu1)
        stray = fleet.workload(host, "train", gpus="2", mib=1000)
        dirty = fleet.ssh(host, NHC_CHECK)
        assert dirty.returncode == 1 and dirty.stderr.startswith("zeromib: prolog job 0: GPU 2: "), dirty.stderr
        assert f"held by pid {stray['pid']} train.py" in dirty.stderr, dirty.stderr
        assert alive(fleet, host, stray["pid"]) and alive(fleet, host, on_gpu0) and alive(fleet, host, on_gpu1)
        assert not drained(node(fleet, host))  # NHC drains, with its own reason: the check only fails
    finally:
        fleet.ssh(host, f"rm -f {NHC_CONFIG} /var/log/zeromib-gpu/nhc.log /run/zeromib-gpu/prolog-failed/0")


# --------------------------------------------------------------------------- cgroup v2 job containment (issue 59)

SHIM = Path(__file__).resolve().parent / "slurm_v2only.c"
SHIM_ON_HOST = "/usr/local/lib/zeromib-test/slurm_v2only.so"
V2_CAPTURES = {"22.05": Path(__file__).resolve().parents[1] / "fixtures" / "slurm-22.05.8" / "cgroup-v2" / "job7.json",
               "24.11": Path(__file__).resolve().parents[1] / "fixtures" / "slurm-24.11.5" / "cgroup-v2" / "job1.json"}


def built_shim(tmp_path) -> bytes:
    """tests/fleet/slurm_v2only.c, built with this machine's cc (the hosts have none)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "the cgroup v2 stand-in needs a C compiler on this machine (apt-get install gcc)"
    out = tmp_path / "slurm_v2only.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(SHIM), "-ldl"], check=True, capture_output=True)
    return out.read_bytes()


@pytest.fixture
def cgroup_v2_host(any_gres_host, tmp_path):
    """The node (Slurm 22.05 or 24.11) with proctrack/cgroup, task/cgroup, PrologFlags=Contain and
    cgroup.conf CgroupPlugin=cgroup/v2, ConstrainDevices=yes. The hosts boot with the unified
    hierarchy, but this machine mounts the v1 controllers too and the kernel lists them in
    /proc/PID/cgroup, which slurmd 22.05.8 and 24.11.5 alike refuse ("fatal: Hybrid mode is not
    supported"): slurmd (and the slurmstepd it starts) run with slurm_v2only.c preloaded, which
    shows them the unified line alone. The cgroups slurmstepd makes and where it puts each process
    are the kernel's."""
    fleet, host = any_gres_host
    shim = base64.b64encode(built_shim(tmp_path)).decode()
    try:
        fleet.ssh(host, f"""set -e; cp -n /etc/slurm/cgroup.conf /etc/slurm/cgroup.conf.fleet; mkdir -p {os.path.dirname(SHIM_ON_HOST)}
echo {shim} | base64 -d > {SHIM_ON_HOST}; chmod 755 {SHIM_ON_HOST}
sed -i 's#^ProctrackType=.*#ProctrackType=proctrack/cgroup#; s#^TaskPlugin=.*#TaskPlugin=task/cgroup#' {CONF}; echo PrologFlags=Contain >> {CONF}
printf 'CgroupPlugin=cgroup/v2\\nConstrainDevices=yes\\n' > /etc/slurm/cgroup.conf
mkdir -p /etc/systemd/system/slurmd.service.d; printf '[Service]\\nEnvironment=LD_PRELOAD={SHIM_ON_HOST}\\n' > /etc/systemd/system/slurmd.service.d/v2only.conf
systemctl daemon-reload; systemctl restart slurmctld slurmd""", check=True)
        assert wait_for(lambda: fleet.ssh(host, f"test -d /sys/fs/cgroup/system.slice/{host}_slurmstepd.scope && "
                                                f"scontrol show node -o {host} | grep -q Gres=gpu:8").returncode == 0, timeout=30), \
            fleet.ssh(host, "journalctl -u slurmd -n 20 --no-pager").stdout
        fleet.ssh(host, f"scontrol update nodename={host} state=resume 2>/dev/null; true")
        assert install(fleet, host).rc == 0
        yield fleet, host
    finally:
        fleet.ssh(host, f"touch {RECONFIGURE}; scancel --quiet --full -u root 2>/dev/null; rm -f /etc/systemd/system/slurmd.service.d/v2only.conf; "
                        "cp /etc/slurm/cgroup.conf.fleet /etc/slurm/cgroup.conf; rmdir /sys/fs/cgroup/escaped.slice 2>/dev/null; "
                        "systemctl daemon-reload; true")


def cgroup_of(fleet, host, pid) -> str:
    return next(line for line in fleet.ssh(host, f"cat /proc/{pid:d}/cgroup", check=True).stdout.splitlines() if line.startswith("0::"))


def test_on_cgroup_v2_the_epilog_frees_what_escaped_the_job_and_spares_another_jobs_detached_process_by_its_cgroup(cgroup_v2_host):
    """Real slurmstepd on cgroup v2: job M detaches a holder (it leaves M's process tree but not
    M's cgroup, which alone names its job) and runs on; job N leaves a holder that moved itself
    out of N's cgroup (as a root job, or a daemon it restarted, can): Slurm's own kill of N's
    cgroup misses it, the epilog ends it, M's process lives on, and the next job starts on clean
    GPUs. The paths are those captured from the same Slurm into tests/fixtures/slurm-<version>/cgroup-v2/."""
    fleet, host = cgroup_v2_host
    captured = json.loads(V2_CAPTURES[slurm_version(fleet, host).rsplit(".", 1)[0]].read_text())
    # With ConstrainDevices, slurmd numbers the job's CUDA_VISIBLE_DEVICES within the devices it
    # fences (the job's first GPU is 0); the sim's nodes share one device number and are not fenced,
    # so its holders are pointed at the job's GPU by SLURM_JOB_GPUS, as the fence would have it.
    own_gpu = 'CUDA_VISIBLE_DEVICES="$SLURM_JOB_GPUS" '
    running = submit(fleet, host, f"({own_gpu}setsid nohup {HOLDER} --gpus 0 --mib 1000 --name v2_other --ready-file /run/nvidia-sim/ready/v2_other "
                                  "</dev/null >/dev/null 2>&1 &); exec sleep 300")
    other = ready_pid(fleet, host, "v2_other")
    assert cgroup_of(fleet, host, other) == f"0::/system.slice/{host}_slurmstepd.scope/job_{running}/step_batch/user/task_0"
    shape = {p["cmdline"]: p["cgroup"][-1].replace(captured["node"], host).replace(f"job_{captured['job']}/", f"job_{running}/")
             for p in captured["processes"]}
    assert cgroup_of(fleet, host, other) == shape["sleep 301"]

    ending = submit(fleet, host, f"mkdir -p /sys/fs/cgroup/escaped.slice; export {own_gpu}; " + leave_behind("v2_left", 1500).replace(
        " & for i", " & echo $! > /sys/fs/cgroup/escaped.slice/cgroup.procs; for i", 1))
    left = ready_pid(fleet, host, "v2_left")
    assert cgroup_of(fleet, host, left) == "0::/escaped.slice"
    run = ended(fleet, host, ending)
    assert run["ok"] and run["gpus"] == ["1"] and [k["pid"] for k in run["killed"]] == [left], run
    assert alive(fleet, host, other) and not alive(fleet, host, left) and job(fleet, host, running)["JobState"] == "RUNNING"
    assert fleet.gpu_memory(host)[1] == 0

    after = submit(fleet, host, "true")
    assert wait_for(lambda: job(fleet, host, after).get("JobState") == "COMPLETED", timeout=60), job(fleet, host, after)
    prolog, epilog = ended(fleet, host, after, "prolog"), ended(fleet, host, after)
    assert prolog["ok"] and epilog["ok"] and epilog["killed"] == [] and alive(fleet, host, other), (prolog, epilog)
    assert not drained(node(fleet, host)), node(fleet, host)


# --------------------------------------------------------------------------- the prolog


def test_a_prolog_on_a_dirty_gpu_never_signals_requeues_the_job_and_drains_the_node(gres_host):
    fleet, host = gres_host
    stray = fleet.workload(host, "train", gpus="0", mib=1000)  # someone's process started over SSH
    job_id = submit(fleet, host, "true")
    run = ended(fleet, host, job_id, "prolog")
    assert not run["ok"] and [h["pid"] for h in run["holders"]] == [stray["pid"]], run
    # slurmd runs the epilog after the failed prolog too: the job never ran, so it ends nothing either.
    after = ended(fleet, host, job_id, "epilog")
    assert after["ok"] and "the prolog failed" in after["skipped"], after
    assert alive(fleet, host, stray["pid"])
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"].startswith(f"zeromib: prolog job {job_id}: GPU 0: "), fields
    assert f"MiB, held by pid {stray['pid']} train.py" in fields["Reason"], fields
    assert wait_for(lambda: job(fleet, host, job_id).get("JobState") == "PENDING", timeout=30), job(fleet, host, job_id)
    assert job(fleet, host, job_id).get("Restarts") == "1" or "held" in job(fleet, host, job_id).get("Reason", "").lower(), job(fleet, host, job_id)

    fleet.ssh(host, f"kill {stray['pid']:d}", check=True)
    assert wait_for(lambda: fleet.gpu_memory(host)[0] == 0, timeout=20)
    resumed = fleet.ansible_playbook(RESTORE, limit=host, extra_vars={"restore_gpus_resume_drained": True})
    assert resumed.rc == 0 and not drained(node(fleet, host)), (str(resumed), node(fleet, host))


def test_a_prolog_on_an_unhealthy_gpu_drains_the_node(gres_host):
    fleet, host = gres_host
    fleet.set_fault(host, field_values={"0": {"ecc.errors.uncorrected.volatile.total": "2"}})
    job_id = submit(fleet, host, "true")
    run = ended(fleet, host, job_id, "prolog")
    assert not run["ok"] and run["holders"] == [], run
    fields = node(fleet, host)
    assert drained(fields) and fields["Reason"].startswith(f"zeromib: prolog job {job_id}: GPU 0"), fields
