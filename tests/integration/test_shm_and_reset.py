"""What the kills leave in /dev/shm, and reset advice that works, through real ansible-playbook on
simulated GPU hosts (issue 58).

Each NsHost has a /dev/shm of its own (a tmpfs). The segments are made by real processes
(tests/integration/shm_job.py): a killed job's, one a live unprivileged user's process keeps open,
one it keeps mapped with its descriptor closed. The reset advice is followed to the letter in the
host, against the simulated nvidia-smi, which refuses `--gpu-reset` as the real one does while
persistence mode is on, a process holds the GPU's node or nvidia_drm is loaded (tests/sim/README.md).
"""
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import COLLECTIONS, run_module  # noqa: E402
from test_gpu_health_gate import run_role  # noqa: E402

if COLLECTIONS not in sys.path:
    sys.path.append(COLLECTIONS)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "shm_job.py")
USER = 4242
# The user whose job gpu_release ends in these tests.
KILLED = 4244
NOTHING_OF_ROOT = "this run ended no process of its owner (uid 0)"
REFUSED = "GPU 00000000:00:06.0: In use by another client"


def job(host, *segments, user=None, then=None):
    """shm_job.py in the host: `segments` like "open:nccl-Xb3kLq:8"; `then`: argv it execs into."""
    argv = ["/usr/bin/python3", JOB, *segments] + (["exec", *then] if then else [])
    if user is None:
        return host.spawn(argv, ready=True)
    return host.spawn_as(user, argv, ready=True)


def facts(run):
    assert not run.failed, run.msg
    return run["ansible_facts"]["gpu"]


def names(records):
    return [os.path.basename(r["path"]) for r in records]


def shm_files(host):
    return sorted(host.run(["ls", "-A", "/dev/shm"]).stdout.split())


# --------------------------------------------------------------------------- /dev/shm in the look


def test_a_killed_jobs_segments_are_listed_largest_first_and_a_live_users_open_or_mapped_ones_are_not(nshost):
    host = nshost("h200x2")
    killed = job(host, "open:nccl-Xb3kLq:8", "map:torch_4711_1298412897_0:24", "map:sem.mp-k2j4h5g6:0")
    live = job(host, "open:nccl-Q7mZp2:4", "map:torch_5150_77_0:4", user=USER)
    host.kill(killed.pid)
    assert host.wait_gone(killed.pid)
    gpu = facts(run_module(host, "gpu_facts"))
    shm = gpu["shm"]
    assert (shm["path"], shm["files"], shm["complete"], shm["error"]) == ("/dev/shm", 5, True, None)
    assert names(shm["unheld"]) == ["torch_4711_1298412897_0", "nccl-Xb3kLq", "sem.mp-k2j4h5g6"]
    expected = [("torch_*", 24.0, "root"), ("nccl-*", 8.0, "root"), ("sem.mp-*", 0.0, "root")]
    assert [(r["pattern"], r["size_mib"], r["user"]) for r in shm["unheld"]] == expected
    assert shm["unheld_mib"] == 32.0 and 0 < shm["free_mib"] < shm["size_mib"] == 4096.0
    # Still held by the user's live process (one open, one only mapped): never listed.
    assert host.alive(live.pid) and gpu["healthy"] is True
    # The audit's page names them, on a host whose GPUs are clean.
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _audit_report as gpu_audit_report
    report = gpu_audit_report.build_report([{"host": "node01", "status": "ok", "gpu": gpu}], generated_at=0.0)
    [entry] = report["findings"]["attention"]
    assert (entry["status"], entry["shm"]) == ("clean", "3 file(s) of killed jobs in /dev/shm that no process holds, 32 MiB (nccl-* 1, sem.mp-* 1, "
                                                        "torch_* 1); {:g} MiB free of 4096 MiB".format(shm["free_mib"]))
    assert 'zeromib_gpu_shm_unheld_files{host="node01"} 3' in gpu_audit_report.render(report)["gpu_audit.prom"]


def test_dev_shm_below_the_floor_for_the_nodes_gpus_makes_it_unhealthy_naming_what_fills_it(nshost):
    host = nshost("h200x2", shm_size_mib=256)
    killed = job(host, "open:torch_99_1_0:200")
    host.kill(killed.pid)
    assert host.wait_gone(killed.pid)
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["healthy"] is False and gpu["clean"] is True
    [issue] = gpu["health_issues"]
    assert re.fullmatch(r"/dev/shm has 5[56] MiB free of 256 MiB, below the 256 MiB that 2 GPU\(s\) need at 128 MiB each "
                        r"\(shm_min_free_mib_per_gpu\): NCCL init and DataLoader workers fail with \"No space left on device\" "
                        r"\(1 file\(s\) no live process holds take 200 MiB\); clean_shm \(role: free_gpus_clean_shm\) removes "
                        r"such files of the jobs its run ends \(1 here match job patterns\)", issue), issue
    # The audit: the host unhealthy for it, grouped by the kind of issue.
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _audit_report as gpu_audit_report
    report = gpu_audit_report.build_report([{"host": "node01", "status": "ok", "error": None, "gpu": gpu}], generated_at=0.0)
    [entry] = report["hosts"]
    assert entry["health_issues"] == [issue] and report["summary"]["hosts_unhealthy"] == 1, entry
    groups = {(g["status"], g["title"]): [h["host"] for h in g["hosts"]] for g in gpu_audit_report.attention_groups(report)}
    assert [(status, hosts) for (status, _title), hosts in groups.items()] == [("unhealthy", ["node01"]), ("shm leftovers", ["node01"])], groups
    assert facts(run_module(host, "gpu_facts", {"shm_min_free_mib_per_gpu": 16}))["healthy"] is True
    # clean_shm on a run that ends nothing removes nothing: no process of this run ties to the file
    # (a job that died before it, a service's block alike); it says what it kept and why.
    run = run_module(host, "gpu_release", {"clean_shm": True})
    assert run["released"] is True and run["healthy"] is False and run["shm_removed"] == []
    assert [(os.path.basename(k["path"]), k["why"]) for k in run["shm_kept"]] == [("torch_99_1_0", "this run ended no process of its owner (uid 0)")]
    assert shm_files(host) == ["torch_99_1_0"]


def test_the_role_fails_a_host_whose_dev_shm_is_full_and_passes_it_once_clean_shm_empties_it(nshost):
    host = nshost("h200x2", shm_size_mib=256)
    # A user's CUDA job on GPU 0 that keeps its NCCL segment open: the role ends it.
    job(host, "open:nccl-Full01:200", user=USER, then=["/usr/bin/gpu_holder", "--gpus", "0", "--mib", "1024"])
    outcome = run_role(host, {})
    assert outcome["failed"] and outcome["msg"].startswith("localhost: ") and "unhealthy: " in outcome["msg"], outcome["msg"]
    # Said in the role's words: its variables, not the module's options.
    assert "at 128 MiB each (free_gpus_shm_min_free_mib_per_gpu)" in outcome["msg"]
    assert outcome["msg"].endswith("(1 file(s) no live process holds take 200 MiB); free_gpus_clean_shm removes such files of the jobs its run "
                                   "ends (1 here match job patterns)"), outcome["msg"]
    # A later run ended nothing of its owner's: the file stays, and the role's fact says why.
    outcome = run_role(host, {"free_gpus_clean_shm": True})
    assert outcome["failed"] and outcome["result"]["shm_removed"] == [] and shm_files(host) == ["nccl-Full01"], outcome["result"]
    assert outcome["result"]["shm_kept"] == [{"path": "/dev/shm/nccl-Full01", "size_mib": 200.0, "why": f"this run ended no process of its owner (uid {USER})"}]
    host.run(["rm", "/dev/shm/nccl-Full01"], check=True)  # the operator, by hand
    # With clean_shm on the run that ends the job, what the job left goes with it.
    job(host, "open:nccl-Full02:200", user=USER, then=["/usr/bin/gpu_holder", "--gpus", "0", "--mib", "1024"])
    outcome = run_role(host, {"free_gpus_clean_shm": True})
    assert not outcome["failed"], outcome["msg"]
    assert outcome["result"]["healthy"] is True and shm_files(host) == []
    # The role's fact and its line say what went, as gpu_release's result does.
    assert outcome["result"]["shm_removed"] == ["/dev/shm/nccl-Full02"] and outcome["result"]["shm_removed_mib"] == 200.0, outcome["result"]
    assert outcome["result"]["shm_kept"] == [] and "removed 1 file of /dev/shm (200.0 MiB)" in outcome["result"]["message"], outcome["result"]


# --------------------------------------------------------------------------- gpu_release clean_shm


def test_clean_shm_frees_the_job_then_removes_only_its_unheld_segments_and_check_and_diff_mode_say_so_first(nshost):
    host = nshost("h200x2")
    # A user's CUDA job on GPU 0 that keeps its NCCL segment open and left a PyTorch segment named
    # with its PID (unmapped at its exec): gpu_release ends it, then both go.
    cuda = job(host, "open:nccl-Job0AA:16", "map:torch_{pid}_5_0:8", user=KILLED, then=["/usr/bin/gpu_holder", "--gpus", "0", "--mib", "2048"])
    torch = f"torch_{cuda.pid}_5_0"
    # Root's job that died before this run: its files tie to no process the run ends.
    left = job(host, "open:torch_4711_5_0:8", "map:sem.mp-abcdef12:0", "open:sem.app_lock:0", "open:app-state.db:1")
    host.kill(left.pid)
    assert host.wait_gone(left.pid)
    live = job(host, "open:nccl-Live01:4", "map:torch_5150_1_0:4", user=USER)
    before = shm_files(host)
    root_kept = [("torch_4711_5_0", NOTHING_OF_ROOT), ("sem.mp-abcdef12", NOTHING_OF_ROOT)]

    plan = run_module(host, "gpu_release", {"clean_shm": True}, check=True, diff=True)
    assert not plan.failed, plan.msg
    assert plan["changed"] is True and [k["pid"] for k in plan["killed"]] == [cuda.pid]
    # Check mode lists what is unheld now: the segment the running job still holds is not yet among them.
    assert names(plan["shm_removed"]) == [torch] and kept(plan) == root_kept
    assert f"shm /dev/shm/{torch} (8 MiB, torch_*): to be removed (clean_shm)" in plan["diff"]["after"]
    assert shm_files(host) == before and host.alive(cuda.pid)

    run = run_module(host, "gpu_release", {"clean_shm": True}, diff=True)
    assert not run.failed, run.msg
    assert run["released"] is True and run["changed"] is True and not host.alive(cuda.pid)
    assert names(run["shm_removed"]) == ["nccl-Job0AA", torch] and kept(run) == root_kept
    assert [r["pattern"] for r in run["shm_removed"]] == ["nccl-*", "torch_*"]
    assert "shm /dev/shm/nccl-Job0AA (16 MiB, nccl-*): removed" in run["diff"]["after"]
    # Left: what a live process holds, what no process of this run ties to, a POSIX semaphore and a file of no job pattern.
    assert shm_files(host) == ["app-state.db", "nccl-Live01", "sem.app_lock", "sem.mp-abcdef12", "torch_4711_5_0", "torch_5150_1_0"]
    assert sorted(names(run["shm"]["unheld"])) == ["app-state.db", "sem.app_lock", "sem.mp-abcdef12", "torch_4711_5_0"] and host.alive(live.pid)

    again = run_module(host, "gpu_release", {"clean_shm": True})
    # A run that ends nothing removes nothing, and says why each file of a job pattern stays.
    assert again["changed"] is False and again["shm_removed"] == [] and kept(again) == root_kept
    # A tmpfs of the host's own, in an IPC namespace of its own: cleaned, and no refusal said.
    assert shm_warnings(run) == shm_warnings(plan) == []


def kept(run):
    return [(os.path.basename(k["path"]), k["why"]) for k in run["shm_kept"]]


def test_clean_shm_removes_nothing_made_after_the_run_started_nor_through_a_link(nshost):
    host = nshost("h200x1")
    # A link a user planted under a job's name: neither it nor the file it points to is taken.
    precious = os.path.join(host.dir, "precious")
    with open(precious, "w") as handle:
        handle.write("precious\n")
    host.run(["ln", "-s", precious, "/dev/shm/nccl-Planted"], check=True)
    # A launcher whose job gpu_release ends, and which makes a segment right after: made after the
    # run's look, it is left (it may belong to a job starting now that has not opened it yet).
    launcher = job(host, "later:nccl-Late01:1", "child", "/usr/bin/gpu_holder", "--gpus", "0", "--mib", "1024")
    run = run_module(host, "gpu_release", {"clean_shm": True, "settle_timeout": 1})
    assert not run.failed, run.msg
    assert run["released"] is True and run["shm_removed"] == [] and host.alive(launcher.pid)
    with open(precious) as handle:
        assert handle.read() == "precious\n"
    assert shm_files(host) == ["nccl-Late01", "nccl-Planted"]
    assert names(run["shm"]["unheld"]) == ["nccl-Late01"]


def shm_warnings(run):
    """gpu_release's clean_shm warnings, without the host name each warning starts with."""
    return [w.split(": ", 1)[1] for w in run.get("warnings") or [] if ": clean_shm" in w]


def refusal(run):
    [said] = shm_warnings(run)
    return said


def test_clean_shm_refuses_a_dev_shm_bound_from_outside_where_a_process_it_cannot_see_holds_a_segment(nshost, tmp_path):
    """An LXC guest given the host's /dev/shm: a segment the host's own job keeps open looks unheld
    from inside (the guest cannot see that process). Nothing is removed, in check mode either; what
    is there is listed, and the reason names the bind."""
    outside = tmp_path / "host-shm"
    outside.mkdir()
    os.chmod(outside, 0o1777)
    with open(outside / "nccl-HostJob", "wb") as held:  # this test's process: outside the host's PID namespace
        held.write(b"\0" * 4096)
        held.flush()
        host = nshost("h200x1", shm_from=str(outside))
        # The job this run ends, and the segment it left with its PID in the name.
        killed = job(host, "map:torch_{pid}_1_0:4", user=KILLED, then=["/usr/bin/gpu_holder", "--gpus", "0", "--mib", "1024"])
        torch = f"torch_{killed.pid}_1_0"
        for check in (True, False):
            run = run_module(host, "gpu_release", {"clean_shm": True}, check=check, diff=True)
            assert not run.failed, run.msg
            assert run["shm_removed"] == [] and names(run["shm"]["unheld"]) == [torch, "nccl-HostJob"], run["shm"]
            assert re.fullmatch(r"clean_shm: nothing was removed: /dev/shm is the directory /\S*host-shm of a file system \(\w+\) mounted from "
                                r"outside this container on /dev/shm, so a process there may hold a file that no process here holds \(clean it "
                                r"on the host\)", refusal(run)), refusal(run)
            assert "to be removed" not in run["diff"]["after"]
        assert sorted(os.listdir(outside)) == ["nccl-HostJob", torch]


def test_clean_shm_refuses_a_container_that_shares_the_nodes_ipc_namespace(nshost):
    """docker --ipc=host: the container's /dev/shm is the node's, whatever its mount looks like."""
    host = nshost("h200x1", own_ipc=False)
    killed = job(host, "map:torch_{pid}_1_0:4", user=KILLED, then=["/usr/bin/gpu_holder", "--gpus", "0", "--mib", "1024"])
    run = run_module(host, "gpu_release", {"clean_shm": True})
    assert run["released"] is True and run["shm_removed"] == [] and shm_files(host) == [f"torch_{killed.pid}_1_0"]
    assert refusal(run).startswith("clean_shm: nothing was removed: this container shares the node's IPC namespace (as docker --ipc=host does), "
                                   "and with it the node's /dev/shm, so a process there may hold a file"), refusal(run)


# --------------------------------------------------------------------------- reset advice


# A namespace host is itself a container (a PID namespace of its own): memory no process of it
# holds may be held outside it, said first (issue 56); the advice is then what the host's operator
# runs if nothing there holds it either, read from the kernel's modules and NVML, which are the host's.
HELD_OUTSIDE = ("this run is inside a container (a PID namespace of its own), which cannot see the "
                "host's processes or other guests', so GPU {gpu} may be held outside it, by the host or another guest sharing it. Look on the host: "
                "zeromib.gpu.gpu_facts there names the holder and the guest it runs in (gpu_release there frees it); if nothing on the host holds it "
                "either, ")


def advised_steps(message):
    """The commands of the advice, in order, and the reading that must show 0 MiB."""
    sequence = message.split("To reset, as root on the host, in this order: ", 1)[1]
    steps, verify = sequence.split("; then `", 1)
    return re.findall(r"`([^`]+)`", steps), verify.split("`", 1)[0]


def said_from_inside(run, gpu):
    """The failure's first sentence and the GPU's part are the from-inside ones; the host's advice follows."""
    assert run.failed and run.msg.startswith("GPUs read above max_used_mib with no process of this container holding them"), run.msg
    assert f"GPU {gpu} " in run.msg and "MiB, and no process of this container holds it" in run.msg and HELD_OUTSIDE.format(gpu=gpu) in run.msg, run.msg
    return run.msg.split(HELD_OUTSIDE.format(gpu=gpu), 1)[1]


def test_a_leak_on_a_node_with_persistence_on_and_nvidia_drm_loaded_gets_the_sequence_that_works(nshost):
    host = nshost("h200x1", nvidia_drm=0)
    host.spawn(["gpu_holder", "--persistence-daemon", "--name", "nvidia-persistenced"])
    host.set_fault({"leak": {"0": 4096}})
    # What the advice of 0.x said, tried as it stood: refused, with NVIDIA's wording.
    bare = host.smi("--gpu-reset", "-i", "0")
    assert bare.returncode == 255 and REFUSED in bare.stdout
    run = run_module(host, "gpu_release")
    advice = said_from_inside(run, 0)
    assert advice.startswith("a GPU reset or a reboot of the host is needed; a bare `nvidia-smi --gpu-reset -i 0` is refused on this node "
                             "(\"In use by another client\"): persistence mode is on, nvidia_drm is loaded. To reset, as root on the host"), advice
    steps, verify = advised_steps(run.msg)
    assert steps == ["nvidia-smi -i 0 -pm 0", "modprobe -r nvidia_drm", "nvidia-smi --gpu-reset -i 0", "modprobe nvidia_drm", "nvidia-smi -i 0 -pm 1"]
    for step in steps:
        done = host.run(["sh", "-c", step])
        assert done.returncode == 0, (step, done.stdout, done.stderr)
    assert host.run(["sh", "-c", verify]).stdout == "0, 0 MiB\n"
    assert host.smi("--query-gpu=persistence_mode", "--format=csv,noheader").stdout == "Enabled\n"
    assert run_module(host, "gpu_release")["released"] is True


def test_a_protected_daemon_holding_the_gpus_node_is_named_and_stopped_in_the_sequence(nshost):
    host = nshost("h200x1")
    hostengine = host.spawn(["gpu_holder", "--monitor", "pynvml", "--name", "nv-hostengine"])
    host.set_fault({"leak": {"0": 4096}})
    run = run_module(host, "gpu_release")
    advice = said_from_inside(run, 0)
    assert f"persistence mode is on, pid {hostengine.pid} nv-hostengine holds its device node" in advice
    # The daemon is this container's: its PID is not the host's, so its steps are marked to run here.
    assert (f"`nvidia-smi -i 0 -pm 0`; `kill {hostengine.pid}` (in this container); `nvidia-smi --gpu-reset -i 0`; "
            "`start nv-hostengine again as it was started` (in this container); `nvidia-smi -i 0 -pm 1`") in advice
    assert advice.endswith("A process of the host or of another guest with the GPU's device node open (DCGM's nv-hostengine, dcgm-exporter) "
                           "refuses the reset as well and is not seen from here: zeromib.gpu.gpu_facts on the host names it"), advice
    steps, verify = advised_steps(run.msg)
    assert steps == ["nvidia-smi -i 0 -pm 0", f"kill {hostengine.pid}", "nvidia-smi --gpu-reset -i 0", "start nv-hostengine again as it was started",
                     "nvidia-smi -i 0 -pm 1"]
    for step in steps[:3]:
        assert host.run(["sh", "-c", step]).returncode == 0, step
    assert host.run(["sh", "-c", verify]).stdout == "0, 0 MiB\n"


def test_nvidia_drm_in_use_by_a_console_means_reboot(nshost):
    host = nshost("h200x1", nvidia_drm=1)
    host.set_fault({"leak": {"0": 4096}})
    run = run_module(host, "gpu_release")
    assert said_from_inside(run, 0) == ("only a reboot of the host frees it: nvidia_drm is loaded and in use (1 user(s): a console or display "
                                        "server on an NVIDIA GPU), and no GPU can be reset while it is")
    assert "in this order" not in run.msg
    assert host.run(["modprobe", "-r", "nvidia_drm"]).stderr == "modprobe: FATAL: Module nvidia_drm is in use.\n"


def test_an_nvswitch_gpu_resets_alone_with_fabric_manager_and_with_its_baseboard_without(nshost):
    host = nshost("hgx-h100x8")
    host.set_fault({"leak": {"3": 4096}})
    run = run_module(host, "gpu_release", {"gpus": ["3"]})
    assert said_from_inside(run, 3).startswith("a GPU reset or a reboot of the host is needed; a bare `nvidia-smi --gpu-reset -i 3` is refused")
    steps, _verify = advised_steps(run.msg)
    assert steps == ["nvidia-smi -i 3 -pm 0", "nvidia-smi --gpu-reset -i 3", "nvidia-smi -i 3 -pm 1"]

    host.set_fault({"leak": {"3": 4096}, "fabricmanager_state": "failed"})
    busy = host.spawn(["gpu_holder", "--gpus", "5", "--mib", "1024"])
    run = run_module(host, "gpu_release", {"gpus": ["3"]})
    assert said_from_inside(run, 3) == ("only a reboot of the host frees it: Fabric Manager is not running, and without it an NVSwitch GPU is "
                                        f"reset only together with its NVLink peers: GPU(s) 0,1,2,4,5,6,7 are in use (pid {busy.pid} python3); once "
                                        "they are free, the reset sequence can take them all")
    # A bare reset of GPU 3 alone is refused by the driver's rule (nvidia-smi(1)).
    assert host.smi("--gpu-reset", "-i", "3").returncode == 255

    host.kill(busy.pid)
    assert host.wait_gone(busy.pid)
    # Until the driver has freed GPU 5 (release_delay_s), its memory may be another guest's: no reset takes it.
    deadline = time.monotonic() + 10
    while host.smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "5").stdout.strip() != "0":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    run = run_module(host, "gpu_release", {"gpus": ["3"]})
    said_from_inside(run, 3)
    steps, verify = advised_steps(run.msg)
    every = "0,1,2,3,4,5,6,7"
    assert steps == [f"nvidia-smi -i {every} -pm 0", f"nvidia-smi --gpu-reset -i {every}", f"nvidia-smi -i {every} -pm 1"]
    assert "the reset must take GPUs 0,1,2,3,4,5,6,7 together: Fabric Manager is not running" in run.msg
    for step in steps:
        assert host.run(["sh", "-c", step]).returncode == 0, step
    assert host.run(["sh", "-c", verify]).stdout == "".join(f"{i:d}, 0 MiB\n" for i in range(8))


def test_the_simulated_reset_replays_nvidias_wording(nshost):
    host = nshost("h200x1")
    refused = host.smi("-r", "-i", "0")
    assert (refused.returncode, refused.stdout) == (255, (
        "The following GPUs could not be reset:\n  GPU 00000000:00:06.0: In use by another client\n\n1 device is currently being used by one or "
        "more other processes (e.g., Fabric Manager, CUDA application, graphics application such as an X server, or a monitoring application "
        "such as another instance of nvidia-smi). Please first kill all processes using this device and all compute applications running in "
        "the system.\n"))
    assert host.smi("-i", "0", "-pm", "0").stdout == "Disabled persistence mode for GPU 00000000:00:06.0.\nAll done.\n"
    done = host.smi("--gpu-reset", "-i", "0")
    assert (done.returncode, done.stdout) == (0, "GPU 00000000:00:06.0 was successfully reset.\nAll done.\n")
    with open(os.path.join(host.root.state, "persistence.json")) as handle:
        assert json.load(handle) == {host.config["gpus"][0]["uuid"]: "Disabled"}  # the mode it set, kept by UUID


def test_the_role_says_the_sequence_once_and_the_audit_says_where_to_look(nshost):
    """The same leak through free_gpus (its host's line, said once) and through the audit, which
    gives no advice of its own: dirty, no holder in this container, look on the host."""
    host = nshost("h200x1", nvidia_drm=0)
    host.set_fault({"leak": {"0": 4096}})
    outcome = run_role(host, {})
    assert outcome["failed"] and outcome["msg"].startswith("localhost: GPUs read above free_gpus_max_used_mib with no process of this "
                                                           "container holding them"), outcome["msg"]
    steps, _verify = advised_steps(outcome["msg"])
    assert steps == ["nvidia-smi -i 0 -pm 0", "modprobe -r nvidia_drm", "nvidia-smi --gpu-reset -i 0", "modprobe nvidia_drm", "nvidia-smi -i 0 -pm 1"]
    assert outcome["msg"].count("To reset, as root on the host") == 1 and outcome["msg"].count("may be held outside it") == 1
    gpu = facts(run_module(host, "gpu_facts"))
    assert gpu["clean"] is False and gpu["inside_container"] is True
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _audit_report as gpu_audit_report
    report = gpu_audit_report.build_report([{"host": "node01", "status": "ok", "error": None, "gpu": gpu}], generated_at=0.0)
    [entry] = report["hosts"]
    assert (entry["status"], entry["reason"]) == ("dirty", "GPU 0 4096 MiB; memory counted for PID 3000000, not in this container: held outside "
                                                           "it (the host or another guest)? look on the host"), entry


def test_a_container_that_cannot_read_the_kernels_modules_is_given_no_sequence(nshost):
    """Without /sys/module/nvidia, whether nvidia_drm is loaded on the host is unknown: a sequence
    read from here could be the wrong one, so the host's own run is named instead."""
    host = nshost("h200x1", driver_module=False)
    host.set_fault({"leak": {"0": 4096}})
    run = run_module(host, "gpu_release")
    assert said_from_inside(run, 0) == "gpu_release there says what frees it (this container cannot read the kernel's modules, /sys/module)"
    assert "reset" not in run.msg and "reboot" not in run.msg and "`" not in run.msg
