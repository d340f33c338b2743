"""What a user of a shared GPU node can write decides nothing root does (issue 19, docs/docsite/rst/guide_design.rst, "What
can be trusted on a shared node", docs/docsite/rst/guide_security.rst).

Each test is one attack of the issue, done as an unprivileged user would do it, inside a simulated
host: a real uid of its own (4242, `setpriv --reuid 4242 --regid 4242 --clear-groups`), its own
user+mount namespace (`unshare -Ur`), `exec -a`, argv[0] with a comma and a line feed (the simulated
nvidia-smi prints names verbatim, like the real one), its own delegated cgroup subtree (a test-owned
cgroup on the machine's cgroup2 hierarchy, chowned as systemd delegates it, removed after), and the
reuse of a dead owner's PID. Each test first shows the attack is real (what the old code would have
read), then runs the modules through real ansible-playbook inside the host: the victim survives,
the attacker's holder is freed, nothing is stopped on a path or a name alone."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402

USER = 4242
POD_UID = "1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901"
CONTAINER_ID = "c0ffee" * 10 + "c0ff"


def used(host, index):
    return int(host.smi("-i", str(index), "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout.strip())


def apps_with_names(host):
    """The compute apps as the module asked for them before issue 19 (with process_name)."""
    out = host.smi("--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits").stdout
    return out.splitlines()


def uuid(host, index):
    return [g["uuid"] for g in host.config["gpus"] if g["index"] == index][0]


def killed(run):
    return sorted(k["pid"] for k in run["killed"])


def fd_targets(host, pid):
    fd_dir = f"{host.root.inside}/proc/{pid}/fd"
    out = set()
    for entry in os.listdir(fd_dir):
        try:
            out.add(os.readlink(os.path.join(fd_dir, entry)))
        except OSError:
            pass
    return out


def user_holder(host, gpus, mib=2048, extra=()):
    return host.spawn_as(USER, ["gpu_holder", "--gpus", gpus, "--mib", str(mib)] + list(extra))


def trainer(host, gpus, mib=4096):
    """Root's training job: the victim of each attack."""
    return host.spawn(["gpu_holder", "--gpus", gpus, "--mib", str(mib)])


def test_holder_opening_gpu0_through_a_bind_mount_in_its_own_namespace_is_found_and_freed(nshost):
    """Hiding a holder: /dev bind-mounted at /mnt/d in the user's own user+mount namespace."""
    host = nshost("h200x2")
    script = "mount -t tmpfs none /mnt && mkdir /mnt/d && mount --rbind /dev /mnt/d && exec gpu_holder --dev-dir /mnt/d \"$@\""
    hidden = host.spawn_as(USER, ["unshare", "-Ur", "--mount", "sh", "-c", script, "sh", "--gpus", "0", "--mib", "3072"], ready=True)
    targets = fd_targets(host, hidden.pid)
    assert "/mnt/d/nvidia0" in targets and not any(t.startswith("/dev/nvidia") for t in targets), targets  # no path says /dev/nvidia0
    assert used(host, 0) >= 3072  # the driver knows the file, not the path

    facts = run_module(host, "gpu_facts")
    assert not facts.failed, facts.msg
    [holder] = [h for h in facts["ansible_facts"]["gpu"]["holders"] if h["pid"] == hidden.pid]
    assert "/dev/nvidia0" in holder["devices"] and holder["gpu_indexes"] == [0] and holder["user"] == str(USER)

    run = run_module(host, "gpu_release", {"gpus": [0]})
    assert not run.failed, run.msg
    assert hidden.pid in killed(run) and run["released"] is True and not host.alive(hidden.pid) and used(host, 0) == 0


def test_name_with_comma_and_line_feed_cannot_list_roots_trainer_on_the_attackers_gpu(nshost):
    """Forging compute-apps rows: argv[0] `x, 0, GPU-<gpu1>\\n<victim pid>, y` read with process_name
    lists root's GPU-0 trainer on GPU 1; freeing GPU 1 must leave the trainer alone."""
    host = nshost("h200x2")
    victim = trainer(host, "0")
    name = f"x, 0, {uuid(host, 1)}\n{victim.pid}, y"
    attacker = user_holder(host, "1", extra=["--name", name])
    rows = apps_with_names(host)
    assert f"{victim.pid}, y, 2048, {uuid(host, 1)}" in rows, rows  # the forged row, as nvidia-smi prints it

    run = run_module(host, "gpu_release", {"gpus": [1]})
    assert not run.failed, run.msg
    assert killed(run) == [attacker.pid] and run["released"] is True
    assert host.alive(victim.pid) and used(host, 0) >= 4096 and not host.alive(attacker.pid)
    facts = run_module(host, "gpu_facts")
    assert [(p["pid"], p["name"]) for p in facts["ansible_facts"]["gpu"]["processes"]] == [(victim.pid, "python3")]


@pytest.mark.parametrize("how", ["exec-a", "prctl"])
def test_users_job_named_like_a_protected_daemon_is_signalled_and_the_real_ones_survive(nshost, how):
    """Impersonating a protected daemon: uid 4242 runs python as `Xorg` (exec -a) or as
    `nvidia-persistenced` (argv[0] and comm set, as prctl(PR_SET_NAME) does)."""
    host = nshost("h200x2")
    persistenced = host.spawn(["gpu_holder", "--no-context", "--name", "nvidia-persistenced"])  # root's, every node open
    xorg = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "300", "--name", "Xorg"])  # root's compositor with a context
    if how == "exec-a":
        fake = host.spawn_as(USER, ["bash", "-c", 'exec -a Xorg python3 /usr/bin/gpu_holder --gpus 1 --mib 2048 "$@"', "bash"], ready=True)
        named = "Xorg"
    else:
        fake = user_holder(host, "1", extra=["--name", "nvidia-persistenced"])
        named = "nvidia-persistenced"

    run = run_module(host, "gpu_release", {"gpus": [1]})
    assert not run.failed, run.msg
    assert killed(run) == [fake.pid] and run["released"] is True and not host.alive(fake.pid)
    assert any(f"named like {named}" in w and f"uid {USER}" in w for w in run["warnings"]), run["warnings"]
    assert host.alive(persistenced.pid) and host.alive(xorg.pid)

    again = run_module(host, "gpu_release", {"gpus": [0], "wait_timeout": 2})
    assert again.failed and "protected" in again.msg and "Xorg" in again.msg
    assert host.alive(persistenced.pid) and host.alive(xorg.pid) and killed(again) == []


def test_kubepods_cgroup_in_a_users_own_subtree_neither_blocks_the_run_nor_hides_the_holder(nshost):
    """Blocking the gate: a user cgroup named kubepods.slice/... on a node without Kubernetes."""
    host = nshost("h200x2")
    victim = trainer(host, "0")
    cgroup = host.user_cgroup(
        f"user.slice/user-{USER}.slice/user@{USER}.service/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD_UID}.slice/"
        f"cri-containerd-{CONTAINER_ID}.scope", owner=USER)
    attacker = user_holder(host, "1")
    host.move_to_cgroup(attacker.pid, cgroup)
    assert cgroup in host.read(f"/proc/{attacker.pid}/cgroup")

    run = run_module(host, "gpu_release", {"gpus": [1]})
    assert not run.failed, run.msg
    assert killed(run) == [attacker.pid] and run["released"] is True and host.alive(victim.pid)


def test_new_trainer_reusing_a_dead_owners_pid_is_not_killed_for_the_old_owners_gpu(nshost):
    """PID reuse of a dead owner: nvidia-smi keeps listing the dead GPU-1 owner's PID while its
    orphaned child holds the context; root's new GPU-0 trainer gets that PID."""
    host = nshost("h200x2")
    # Started from the user's shell, as a job is: the owner leads no process group or session, so
    # its PID is free for reuse once it is reaped (a leader's PID stays taken while its orphan lives).
    shell = host.spawn_as(USER, ["sh", "-c", 'gpu_holder --gpus 1 --mib 2048 --fork-child "$@"; sleep 100000', "sh"], ready=True)
    owner, [orphan] = shell.info["pid"], shell.children
    host.kill(owner)
    assert host.wait_gone(owner, 5)
    deadline = time.monotonic() + 5
    while os.path.exists(f"{host.root.inside}/proc/{owner}") and time.monotonic() < deadline:
        time.sleep(0.01)  # reaped by the user's shell: the PID is free again
    assert "[Not Found]" in " ".join(apps_with_names(host))  # nvidia-smi keeps listing the dead owner
    victim = None
    for _try in range(20):
        # The next PID the namespace hands out is the dead owner's (the kernel's own counter).
        host.run(["sh", "-c", f"echo {owner - 1} > /proc/sys/kernel/ns_last_pid"], check=True)
        candidate = trainer(host, "0")
        if candidate.pid == owner:
            victim = candidate
            break
        host.kill(candidate.pid)
        candidate.wait_gone(5)
    assert victim is not None, f"could not make the namespace reuse pid {owner}"
    rows = host.smi("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader").stdout.splitlines()
    assert f"{victim.pid}, {uuid(host, 0)}" in rows and f"{victim.pid}, {uuid(host, 1)}" in rows, rows

    run = run_module(host, "gpu_release", {"gpus": [1]})
    assert not run.failed, run.msg
    assert killed(run) == [orphan] and run["released"] is True
    assert host.alive(victim.pid) and used(host, 0) >= 4096 and not host.alive(orphan) and host.alive(shell.pid)


def test_gpu_missing_from_nvidia_smi_is_an_error_never_clean(nshost):
    """A GPU the driver has (/proc/driver/nvidia/gpus) and nvidia-smi omits (rc 0, one row fewer)."""
    host = nshost("h200x2")
    holder = trainer(host, "1")
    bus = [g["pci_bus_id"] for g in host.config["gpus"] if g["index"] == 1][0]
    host.set_fault(omit_gpus=[1])
    assert len(host.smi("--query-gpu=index", "--format=csv,noheader").stdout.split()) == 1

    facts = run_module(host, "gpu_facts", {"fail_on_error": False})
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["clean"] is False and "0000:00:07.0" in gpu["error"], (bus, gpu["error"])
    assert run_module(host, "gpu_facts").failed

    run = run_module(host, "gpu_release", {"gpus": [0]})
    assert run.failed and run.get("released") is not True and "0000:00:07.0" in run.msg
    assert host.alive(holder.pid)


def test_user_cgroup_helpers_tear_down(nshost):
    """The rig itself: the test-owned cgroup tree is gone once the host stops."""
    host = nshost("h200x1")
    cgroup = host.user_cgroup(f"user.slice/user-{USER}.slice/user@{USER}.service/app.slice/x.scope", owner=USER)
    from nshost import _cgroup2_mount
    top = os.path.join(_cgroup2_mount(), cgroup.strip("/").split("/")[0])
    assert os.stat(os.path.join(_cgroup2_mount(), cgroup.lstrip("/"))).st_uid == USER
    holder = user_holder(host, "0")
    host.move_to_cgroup(holder.pid, cgroup)
    host.stop()
    deadline = time.monotonic() + 5
    while os.path.exists(top) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(top)
