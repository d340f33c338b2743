"""gpu_release through real ansible-playbook on simulated GPU hosts: real processes holding real
device nodes are signalled for real, inside the host's PID namespace only."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402
from test_gpu_facts import start_daemon  # noqa: E402


def used(host, index):
    out = host.smi("-i", str(index), "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout
    return int(out.strip())


def killed_pids(run):
    return {k["pid"]: k for k in run["killed"]}


def test_clean_host_is_left_untouched(nshost):
    host = nshost("h200x8")
    run = run_module(host, "gpu_release")
    assert not run.failed, run.msg
    assert run["changed"] is False and run["released"] is True and run["killed"] == [] and run["stopped_units"] == []
    assert run["gpus_before"] == run["gpus"] and len(run["gpus"]) == 8


def test_check_mode_kills_nothing_and_reports_the_plan(nshost):
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960"])
    run = run_module(host, "gpu_release", check=True)
    assert not run.failed, run.msg
    assert run["changed"] is True and run["released"] is False
    assert [(k["pid"], k["signal"]) for k in run["killed"]] == [(holder.pid, None)]
    assert host.alive(holder.pid) and used(host, 0) >= 40960


def test_cooperative_holder_is_freed_by_sigterm_and_verified(nshost):
    host = nshost("h200x8")
    holder = host.spawn(["gpu_holder", "--gpus", "0,1", "--mib", "40960"])
    run = run_module(host, "gpu_release", diff=True)
    assert not run.failed, run.msg
    assert run["changed"] is True and run["released"] is True
    entry = killed_pids(run)[holder.pid]
    assert entry["signal"] == "SIGTERM" and entry["sigkill_at_once"] is None and entry["exited_after_s"] < 2
    assert not host.alive(holder.pid) and used(host, 0) == 0 and used(host, 1) == 0
    assert run["gpus_before"][0]["memory_used_mib"] >= 40960 and run["gpus"][0]["memory_used_mib"] == 0
    assert "40969 MiB" in run["diff"]["before"]  # H200: one app reads its MiB + 9 and "gpu_holder" in run["diff"]["before"]
    assert run["timings"]["wait_s"] < 5 and run["elapsed_s"] < 10
    again = run_module(host, "gpu_release")
    assert again["changed"] is False and again["released"] is True


def test_its_own_nvidia_smi_holding_the_device_nodes_is_no_holder(nshost):
    """The look's /proc pass runs while nvidia-smi answers; a slow nvidia-smi holds
    /dev/nvidiactl and every GPU node meanwhile (as NVML does): gpu_facts and gpu_release see
    exactly the real holder and free only it. Whether the pass meets the open nodes depends on
    when the simulated nvidia-smi (a Python program) opens them; the rule itself is proven by
    test_facts.py::test_the_modules_own_nvidia_smi_holding_the_nodes_is_no_holder."""
    host = nshost("h200x2")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "4096"])
    host.set_fault(latency_s=0.5)
    facts = run_module(host, "gpu_facts")
    assert not facts.failed, facts.msg
    assert [(h["pid"], h["gpu_indexes"]) for h in facts["ansible_facts"]["gpu"]["holders"]] == [(holder.pid, [0])]
    run = run_module(host, "gpu_release")
    assert not run.failed, run.msg
    assert run["released"] is True and list(killed_pids(run)) == [holder.pid]
    assert [h["pid"] for h in run["holders"]] == [] and not host.alive(holder.pid)


def test_holder_whose_sigterm_handler_stays_gets_sigkill_after_kill_timeout(nshost):
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960", "--term-handler-stays"])
    run = run_module(host, "gpu_release", {"kill_timeout": 1})
    assert not run.failed, run.msg
    entry = killed_pids(run)[holder.pid]
    assert entry["signal"] == "SIGKILL" and entry["sigkill_at_once"] is None and entry["exited_after_s"] >= 1.0
    assert run["timings"]["kill_s"] < 1.0 + 3 and run["released"] is True and used(host, 0) == 0


def namespace_child(host, proc):
    """The one child of `proc` (the `unshare --fork` that started it), as this host's PIDs read."""
    with open(f"/proc/{host.init_pid}/root/proc/{proc.pid}/task/{proc.pid}/children") as handle:
        [child] = handle.read().split()
    return int(child)


@pytest.mark.parametrize("uid", [0, 4242], ids=["root", "user-4242"])
def test_holder_ignoring_sigterm_gets_sigkill_at_once(nshost, uid):
    # SIG_IGN (bit 15 of SigIgn): a SIGTERM would change nothing; kill_timeout 30 is not waited.
    host = nshost("h200x1")
    argv = ["gpu_holder", "--gpus", "0", "--mib", "40960", "--ignore-term"]
    holder = host.spawn_as(uid, argv) if uid else host.spawn(argv)
    run = run_module(host, "gpu_release", {"kill_timeout": 30})
    assert not run.failed, run.msg
    entry = killed_pids(run)[holder.pid]
    assert (entry["signal"], entry["sigkill_at_once"]) == ("SIGKILL", "ignores SIGTERM")
    assert entry["exited_after_s"] < 5 and run["timings"]["kill_s"] < 5
    assert run["released"] is True and not host.alive(holder.pid) and used(host, 0) == 0


def member_of_namespace(host, init_pid, argv):
    """Start argv inside the PID namespace whose init is INIT_PID (nsenter forks it there);
    returns (the nsenter, the member's PID as this host reads it)."""
    nsenter = host.spawn(["nsenter", "--target", str(init_pid), "--pid", "--"] + argv, ready=False)
    deadline = time.monotonic() + 10
    while True:
        try:
            return nsenter, namespace_child(host, nsenter)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def namespace_init_holder(host):
    """Root's `unshare --pid --fork gpu_holder`: the GPU's holder is the init of its namespace."""
    unshare = host.spawn(["unshare", "--pid", "--fork", "gpu_holder", "--gpus", "0", "--mib", "40960"], ready=True)
    return unshare, namespace_child(host, unshare)


def test_a_namespace_init_whose_end_would_end_another_users_process_is_not_signalled(nshost):
    # Ending the init of a PID namespace makes the kernel SIGKILL every other process in it: here
    # uid 4243's, which this run was not asked to free. The holder is spared and named; nothing dies.
    host = nshost("h200x1")
    _unshare, holder = namespace_init_holder(host)
    _nsenter, member = member_of_namespace(host, holder, ["setpriv", "--reuid", "4243", "--regid", "4243", "--clear-groups", "--",
                                                          "sleep", "600"])
    # The dry run says what the real run will do: nothing signalled, the same failure.
    dry = run_module(host, "gpu_release", {"kill_timeout": 2}, check=True)
    assert dry.failed and dry.msg.startswith("GPUs are held only by protected processes"), dry.msg
    assert holder not in killed_pids(dry)
    run = run_module(host, "gpu_release", {"kill_timeout": 2})
    assert run.failed and run.msg.startswith("GPUs are held only by protected processes"), run.msg
    assert run["timings"]["wait_s"] < 10  # decided at the first look after acting, not after wait_timeout
    assert holder not in killed_pids(run)
    said = [w for w in run.get("warnings") or [] if f"not signalled: pid {holder} " in w]
    assert said and f"pid {member} sleep (uid 4243, not the holder's uid 0)" in said[0], run.get("warnings")
    assert holder in [p["pid"] for p in run["protected"]]
    assert host.alive(holder) and host.alive(member) and used(host, 0) > 0


def test_a_process_that_entered_a_nested_namespace_from_outside_counts_as_a_member(nshost):
    # Root's own nested namespace inside the holder's (its `unshare` a member by descent), then uid
    # 4243 enters that nested namespace by setns from outside: no parent of it is a member, only
    # the kernel's namespace tree (NS_GET_PARENT) says that the init's end would end it.
    host = nshost("h200x1")
    _unshare, holder = namespace_init_holder(host)
    _outer, nested_unshare = member_of_namespace(host, holder, ["unshare", "--pid", "--fork", "sleep", "600"])
    deadline = time.monotonic() + 10
    while True:
        try:
            with open(f"/proc/{host.init_pid}/root/proc/{nested_unshare}/task/{nested_unshare}/children") as handle:
                [nested_init] = [int(pid) for pid in handle.read().split()]
            break
        except ValueError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    _inner, entered = member_of_namespace(host, nested_init, ["setpriv", "--reuid", "4243", "--regid", "4243", "--clear-groups", "--",
                                                              "sleep", "600"])
    run = run_module(host, "gpu_release", {"kill_timeout": 2})
    assert run.failed and run.msg.startswith("GPUs are held only by protected processes"), run.msg
    said = [w for w in run.get("warnings") or [] if f"not signalled: pid {holder} " in w]
    assert said and f"pid {entered} sleep (uid 4243, not the holder's uid 0)" in said[0], run.get("warnings")
    assert host.alive(holder) and host.alive(entered) and host.alive(nested_init) and used(host, 0) > 0


def test_a_namespace_init_whose_namespace_holds_only_its_own_users_processes_is_ended_with_them(nshost):
    # The same namespace with a process of the holder's own uid (its job's): the holder is ended,
    # and the kernel ends that process with it.
    host = nshost("h200x1")
    _unshare, holder = namespace_init_holder(host)
    _nsenter, member = member_of_namespace(host, holder, ["sleep", "600"])
    run = run_module(host, "gpu_release", {"kill_timeout": 2})
    assert not run.failed, run.msg
    assert killed_pids(run)[holder]["signal"] == "SIGKILL"
    assert not any("not signalled" in w for w in run.get("warnings") or [])
    deadline = time.monotonic() + 5
    while host.alive(member) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not host.alive(holder) and not host.alive(member) and used(host, 0) == 0


@pytest.mark.parametrize("uid", [0, 4242], ids=["root", "user-4242"])
def test_pid_namespace_init_without_a_handler_gets_sigkill_at_once(nshost, uid):
    # `unshare --pid --fork`: the holder is PID 1 of its own namespace and has no SIGTERM handler,
    # so the kernel drops a SIGTERM from outside (real H200: the release waited the whole kill_timeout).
    # A user makes one with `unshare --user --map-root-user --pid --fork`.
    host = nshost("h200x1")
    argv = ["unshare", "--pid", "--fork", "gpu_holder", "--gpus", "0", "--mib", "40960"]
    if uid:
        userns = ["unshare", "--user", "--map-root-user"]
        if host.run(["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--"] + userns + ["true"]).returncode != 0:
            pytest.skip("this kernel gives users no user namespaces (unprivileged_userns_clone)")
        unshare = host.spawn_as(uid, userns + argv[1:], ready=True)
    else:
        unshare = host.spawn(argv, ready=True)
    holder = namespace_child(host, unshare)
    run = run_module(host, "gpu_release", {"kill_timeout": 30})
    assert not run.failed, run.msg
    entry = killed_pids(run)[holder]
    assert (entry["signal"], entry["sigkill_at_once"]) == ("SIGKILL", "init of its PID namespace, no SIGTERM handler")
    assert entry["exited_after_s"] < 5 and run["timings"]["kill_s"] < 5
    assert run["released"] is True and not host.alive(holder) and used(host, 0) == 0
    assert unshare.wait_gone(5)  # the unshare that waited for it ends with it, never signalled
    assert unshare.pid not in killed_pids(run)


def test_check_mode_shows_the_sigkill_at_once(nshost):
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024", "--ignore-term"])
    run = run_module(host, "gpu_release", {"kill_timeout": 30}, check=True)
    assert not run.failed, run.msg
    assert [(k["pid"], k["signal"], k["sigkill_at_once"]) for k in run["killed"]] == [(holder.pid, None, "ignores SIGTERM")]
    assert host.alive(holder.pid)


def test_orphaned_fork_child_is_found_and_freed(nshost):
    # The hand procedure's `pkill` of the parent leaves the child holding all of the memory,
    # and nvidia-smi shows only the dead parent as [Not Found].
    host = nshost("h200x1")
    parent = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960", "--fork-child"])
    [child] = parent.children
    host.kill(parent.pid)
    assert host.wait_gone(parent.pid) and used(host, 0) >= 40960
    run = run_module(host, "gpu_release")
    assert not run.failed, run.msg
    assert list(killed_pids(run)) == [child] and not host.alive(child) and used(host, 0) == 0


def test_vllm_engine_and_tp_workers_are_all_freed(nshost):
    host = nshost("h200x8")
    server = host.spawn(["gpu_holder", "--gpus", "0,1,2,3", "--mib", "20480", "--workers", "4", "--worker-name",
                         "VLLM::Worker_TP{i}", "--name", "vllm"])
    run = run_module(host, "gpu_release")
    assert not run.failed, run.msg
    assert set(server.workers) <= set(killed_pids(run)) and run["released"] is True
    assert all(used(host, i) == 0 for i in range(4))


def test_persistenced_survives_while_the_holder_beside_it_is_freed(nshost):
    host = nshost("h200x8")
    daemon = start_daemon(host, "nvidia-persistenced")
    holder = host.spawn(["gpu_holder", "--gpus", "2", "--mib", "8192"])
    run = run_module(host, "gpu_release")
    assert not run.failed, run.msg
    assert list(killed_pids(run)) == [holder.pid] and host.alive(daemon)
    # an NVML client uses no GPU: not a protected holder of GPU 2 either, only listed
    assert run["protected"] == [] and run["released"] is True
    assert [(h["pid"], h["attribution"], h["gpu_indexes"]) for h in run["holders"]] == [(daemon, "nvml_client", [])]


def test_protected_holder_with_memory_fails_at_once_naming_it(nshost):
    host = nshost("h200x1")
    guard = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "512", "--name", "nv-hostengine"])
    started = time.monotonic()
    run = run_module(host, "gpu_release", {"wait_timeout": 60})
    assert run.failed and "held only by protected processes" in run.msg and "nv-hostengine" in run.msg
    assert run["timings"]["wait_s"] < 5 and time.monotonic() - started < 40
    assert host.alive(guard.pid)


def test_gpus_option_frees_only_the_selected_gpu(nshost):
    host = nshost("h200x8", minors=[1, 0, 2, 3, 4, 5, 6, 7])
    keep = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "4096"])
    free = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "4096"])
    uuid = host.config["gpus"][1]["uuid"]
    run = run_module(host, "gpu_release", {"gpus": [uuid]})
    assert not run.failed, run.msg
    assert run["selected_gpus"] == [1] and list(killed_pids(run)) == [free.pid]
    # GPU 1 reads the 4 MiB footprint of the context left on GPU 0: clean, and said so
    assert host.alive(keep.pid) and used(host, 0) == 4096 + 9 and used(host, 1) == 4
    gpu1 = [g for g in run["gpus"] if g["index"] == 1][0]
    assert gpu1["clean"] is True and gpu1["cross_gpu_footprint"] is True and run["released"] is True


def test_a_huge_time_fails_naming_the_option_and_its_bound_and_touches_nothing(nshost):
    # Before issue 31: `timeout: 1e10` ended in an uncaught OverflowError from the nvidia-smi wait.
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024"])
    for module, args, msg in [
        ("gpu_release", {"timeout": 1e10}, "timeout must be at most 86400 seconds (one day), got 10000000000.0"),
        ("gpu_release", {"kill_timeout": "inf"}, "kill_timeout must be at most 86400 seconds (one day), got inf"),
        ("gpu_facts", {"timeout": 1e308}, "timeout must be at most 86400 seconds (one day), got 1e+308"),
        ("gpu_restore", {"step_timeout": 1e10}, "step_timeout must be at most 86400 seconds (one day), got 10000000000.0"),
    ]:
        run = run_module(host, module, args)
        assert run.failed and run.msg == msg, (module, run.msg)
        assert "module_stderr" not in run.result and "Traceback" not in run.stdout + run.stderr
    assert host.alive(holder.pid) and used(host, 0) >= 1024


def test_holder_of_a_selected_and_an_unselected_gpu_is_freed_only_with_kill_spanning(nshost):
    # docs/docsite/rst/guide_design.rst, "What comes back, and what spans GPUs": ending it would end its work on GPU 0, which the selection keeps out.
    host = nshost("h200x8")
    both = host.spawn(["gpu_holder", "--gpus", "0,1", "--mib", "1024"])
    run = run_module(host, "gpu_release", {"gpus": ["1"]})
    assert run.failed and list(killed_pids(run)) == [] and host.alive(both.pid) and "GPU 0 is outside the selection" in run.msg
    run = run_module(host, "gpu_release", {"gpus": ["1"], "kill_spanning": True})
    assert list(killed_pids(run)) == [both.pid] and run["released"] is True


def test_match_signals_only_matching_processes(nshost):
    host = nshost("h200x1")
    train = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024", "--name", "train.py"])
    other = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024", "--name", "notebook"])
    run = run_module(host, "gpu_release", {"match": ["^train\\.py"], "wait_timeout": 1})
    assert list(killed_pids(run)) == [train.pid] and host.alive(other.pid)
    # What matching left behind keeps the GPU dirty: the verdict says so, naming it.
    assert run.failed and "notebook" in run.msg and "GPU 0" in run.msg


def test_kill_false_signals_nothing(nshost):
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024"])
    run = run_module(host, "gpu_release", {"kill": False, "wait_timeout": 0.5})
    assert run.failed and run["killed"] == [] and host.alive(holder.pid)


def test_memory_no_process_here_holds_is_said_to_be_held_outside_this_container_first(nshost):
    """An NsHost is a PID namespace of its own, as an LXC/LXD/nspawn guest is: nvidia-smi lists a
    PID that does not exist there (the leak fault's 3000005: what a guest sees of the host's or
    another guest's process on a shared GPU). That is said first; a reset is advised only as what
    the host's operator runs if nothing on the host holds it either (tests/integration/test_shm_and_reset.py)."""
    host = nshost("h200x8")
    host.set_fault(leak={"5": 3072})
    run = run_module(host, "gpu_release", {"wait_timeout": 1})
    assert run.failed and run["released"] is False
    assert "GPU 5" in run.msg and "3072 MiB" in run.msg and "nvidia-smi charges it to pid 3000005, which does not exist here" in run.msg
    assert "may be held outside it, by the host or another guest sharing it" in run.msg
    before, _sep, after = run.msg.partition("; if nothing on the host holds it either, a GPU reset or a reboot of the host is needed")
    assert after and "reset" not in before and "reboot" not in before, run.msg
    assert 1.0 <= run["timings"]["wait_s"] < 4
    facts = run_module(host, "gpu_facts", {})
    assert facts["ansible_facts"]["gpu"]["inside_container"] is True


def test_unknown_gpu_and_bad_regex_are_named(nshost):
    host = nshost("h200x1")
    run = run_module(host, "gpu_release", {"gpus": ["7"]})
    assert run.failed and "GPU '7' is not on this host" in run.msg and "indexes 0" in run.msg
    run = run_module(host, "gpu_release", {"match": ["(unclosed"]})
    assert run.failed and "not a valid regular expression" in run.msg


def test_hung_driver_fails_release_within_timeout(nshost):
    host = nshost("h200x1")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024"])
    host.set_fault(hang=True)
    run = run_module(host, "gpu_release", {"timeout": 1})
    assert run.failed and "timed out after 1 s" in run.msg and host.alive(holder.pid)
