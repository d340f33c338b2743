"""Holders a cluster runtime starts again (_look/_orchestrators, issue 72), on a fake /proc written as
the kernel writes it. The attacker: a user who names a process of theirs `raylet` (or copies Ray's
binary into their home) to make root refuse to free a GPU, and a user's command line that claims a
multi-node torchrun (a note only, never a decision)."""
from __future__ import annotations

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _orchestrators as orch
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils.fakeproc import write_process

RAYLET = "/usr/lib/python3/dist-packages/ray/core/src/ray/raylet/raylet"


def _read(proc):
    return lambda pid: _holders.read_process(pid, str(proc))


def _holder(pid, gpus=(0,), **kw):
    return dict({"pid": pid, "gpu_indexes": list(gpus), "candidate_gpu_indexes": [], "protected": False, "container": None}, **kw)


@pytest.fixture
def proc(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return root


def test_a_worker_under_a_vouched_raylet_is_rays(proc):
    write_process(proc, 100, comm="raylet", argv=(RAYLET, "--node_ip_address=10.0.0.1"), exe=RAYLET, uid=0)
    write_process(proc, 200, comm="ray::Trainer", ppid=100, argv=("ray::Trainer.train",), uid=1000)
    [found] = orch.group([_holder(200)], [0], str(proc), _read(proc), lambda h: None)
    assert found["kind"] == "ray" and found["pids"] == [200] and found["gpu_indexes"] == [0]
    assert found["entry"] == "ray:" and found["command"].startswith("ray stop")
    said = orch.refusal([found])
    assert "Ray node raylet (PID 100) (PID 200 on GPU 0): run `ray stop" in said and "name it in services as ray:" in said


def test_a_users_own_raylet_is_no_ray_node_root_refuses_for(proc):
    # Her copy of the binary, her uid: her process tree, an ordinary holder (the user cannot make root refuse).
    write_process(proc, 100, comm="raylet", argv=("/home/alice/raylet",), exe="/home/alice/raylet", exe_owner=1000, uid=1000)
    write_process(proc, 200, comm="ray::Trainer", ppid=100, argv=("ray::Trainer",), uid=1000)
    assert orch.group([_holder(200)], [0], str(proc), _read(proc), lambda h: None) == []
    # Named `raylet` with root's python: still her uid.
    write_process(proc, 100, comm="raylet", argv=("python3", "raylet"), exe="/usr/bin/python3.11", uid=1000)
    assert orch.group([_holder(200)], [0], str(proc), _read(proc), lambda h: None) == []


def test_a_swarm_task_is_known_by_the_labels_docker_reports(proc):
    write_process(proc, 300, argv=("python3", "serve.py"))
    records = {"c1": {"labels": {"com.docker.swarm.service.name": "vllm", "com.docker.swarm.task.name": "vllm.1.x"}}, "c2": {"labels": {}}}
    found = orch.group([_holder(300, container="c1"), _holder(301, container="c2")], [0], str(proc), _read(proc),
                       lambda h: records.get(h["container"]))
    assert [(f["kind"], f["name"], f["pids"], f["command"], f["entry"]) for f in found] == [
        ("swarm", "vllm", [300], "docker service scale vllm=0", "swarm:vllm")]


def test_only_holders_of_selected_gpus_and_unprotected_ones_count(proc):
    write_process(proc, 100, comm="raylet", argv=(RAYLET,), exe=RAYLET, uid=0)
    write_process(proc, 200, ppid=100, argv=("ray::A",), uid=1000)
    assert orch.group([_holder(200, gpus=(1,))], [0], str(proc), _read(proc), lambda h: None) == []
    assert orch.group([_holder(200, protected=True)], [0], str(proc), _read(proc), lambda h: None) == []


def test_a_multi_node_torchrun_is_named_and_a_single_node_one_is_not(proc):
    write_process(proc, 50, argv=("/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes=1:4", "train.py"), uid=1000)
    write_process(proc, 60, ppid=50, argv=("python3", "train.py"), uid=1000)
    _connect(proc, 60, 779)  # the rank's NCCL socket to its peer on another host
    assert orch.multi_node_launcher(60, str(proc), _read(proc)).startswith("/usr/bin/python3 -m torch.distributed.run --nnodes=1:4")
    write_process(proc, 50, argv=("torchrun", "--nnodes", "1", "train.py"), uid=1000)
    assert orch.multi_node_launcher(60, str(proc), _read(proc)) is None


def test_a_ray_start_unit_vouches_through_systemds_main_pid(proc):
    # `ray start --block` as a unit's ExecStart=: /usr/local/bin/ray is a script of root's python.
    unit = "0::/system.slice/ray.service\n"
    write_process(proc, 90, argv=("/usr/bin/python3", "/usr/local/bin/ray", "start", "--block"), uid=0, cgroup=unit, exe="/usr/bin/python3.11")
    write_process(proc, 100, comm="raylet", ppid=90, argv=("/home/x/raylet",), exe="/home/x/raylet", exe_owner=1000, uid=1000)
    write_process(proc, 200, ppid=100, argv=("ray::A",), uid=1000)
    [found] = orch.group([_holder(200)], [0], str(proc), _read(proc), lambda h: None, main_pid_of=lambda unit: 90)
    assert found["name"].endswith("(PID 90)")


STEP = "0::/system.slice/slurmstepd.scope/job_77/step_0/user/task_0\n"
SHOW_77 = ("JobId=77 JobName=train UserId=alice(4242) JobState=RUNNING NumNodes=2 NumCPUs=16 NumTasks=16 "
           "NodeList=gpu[01-02] BatchHost=gpu01\n")


def _slurm(answers):
    """Slurm's answer to `scontrol show job -o JOB` (None: no answer), and the jobs asked."""
    asked = []

    def show_job(job):
        asked.append(job)
        return answers.get(job)
    return show_job, asked


def test_a_rank_of_a_slurm_job_on_two_nodes_is_named_from_its_cgroup_and_slurms_answer(proc):
    write_process(proc, 70, argv=("python3", "train.py"), uid=4242, cgroup=STEP)
    show_job, asked = _slurm({"77": SHOW_77})
    assert orch.multi_node_job(70, str(proc), _read(proc), show_job) == "Slurm job 77 on 2 nodes (gpu[01-02])"
    assert asked == ["77"]


def test_a_one_node_slurm_job_or_no_answer_from_slurm_names_nothing(proc):
    write_process(proc, 70, argv=("python3", "train.py"), uid=4242, cgroup=STEP)
    show_job, _asked = _slurm({"77": SHOW_77.replace("NumNodes=2", "NumNodes=1").replace("gpu[01-02]", "gpu01")})
    assert orch.multi_node_job(70, str(proc), _read(proc), show_job) is None
    show_job, _asked = _slurm({})
    assert orch.multi_node_job(70, str(proc), _read(proc), show_job) is None


def test_what_a_tenant_writes_never_makes_a_multi_node_job(proc):
    # Attackers: the job's user sets SLURM_JOB_NUM_NODES and torchrun's --nnodes at will, and names
    # cgroups below the subtree systemd delegates to her (user@4242.service/.../job_77). Only a job
    # the kernel places the process in (slurmstepd's cgroup), counted by Slurm itself, is named.
    write_process(proc, 50, argv=("torchrun", "--nnodes", "4", "train.py"), uid=4242,
                  cgroup="0::/user.slice/user-4242.slice/user@4242.service/app.slice/job_77/step_0\n")
    write_process(proc, 60, ppid=50, argv=("python3", "train.py"), uid=4242,
                  cgroup="0::/user.slice/user-4242.slice/user@4242.service/app.slice/job_77/step_0\n")
    show_job, asked = _slurm({"77": SHOW_77})
    assert orch.multi_node_job(60, str(proc), _read(proc), show_job) is None
    assert asked == [], "Slurm is asked only about a job the kernel names"


def _connect(proc, pid, inode, remote="0B00000A:6E14", state="01"):
    """PID holds a TCP socket (inode) that the kernel's table shows connected to REMOTE (hex
    address:port as /proc/net/tcp writes it; 0B00000A:6E14 is 10.0.0.11:28180)."""
    import os
    os.symlink(f"socket:[{inode}]", os.path.join(str(proc), str(pid), "fd", "90"))
    net = os.path.join(str(proc), str(pid), "net")
    os.makedirs(net, exist_ok=True)
    with open(os.path.join(net, "tcp"), "w") as table:
        table.write("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
                    f"   0: 0500000A:9C40 {remote} {state} 00000000:00000000 00:00000000 00000000  4242        0 {inode} 1 0\n")


def test_a_torchrun_says_nnodes_but_only_a_connection_to_another_host_makes_it_multi_node(proc):
    # Attacker: the command line is its user's (`torchrun --nnodes 4` on one node, or a script
    # named torchrun). The kernel's word that the job has peers elsewhere: its agent's or rank's
    # TCP connection (the rendezvous store, NCCL's sockets) to a host that is not this one.
    write_process(proc, 50, argv=("torchrun", "--nnodes", "4", "train.py"), uid=4242)
    write_process(proc, 60, ppid=50, argv=("python3", "train.py"), uid=4242)
    assert orch.multi_node_launcher(60, str(proc), _read(proc)) is None
    _connect(proc, 50, 777, remote="0100007F:6E14")  # 127.0.0.1: a store on this node
    assert orch.multi_node_launcher(60, str(proc), _read(proc)) is None
    write_process(proc, 50, argv=("torchrun", "--nnodes", "4", "train.py"), uid=4242)
    _connect(proc, 50, 778)
    assert orch.multi_node_launcher(60, str(proc), _read(proc)) == "torchrun --nnodes 4 train.py (PID 50, connected to 10.0.0.11:28180)"


def test_once_ray_was_asked_the_refusal_names_each_actors_own_command(proc):
    write_process(proc, 100, comm="raylet", argv=(RAYLET, "--node_ip_address=10.0.0.1"), exe=RAYLET, uid=0)
    write_process(proc, 200, comm="ray::Trainer", ppid=100, argv=("ray::Trainer.train",), uid=1000)
    [found] = orch.group([_holder(200)], [0], str(proc), _read(proc), lambda h: None)
    found["actors"] = [{"command": "ray.kill(ray.get_actor('trainer0', namespace='zm'), no_restart=True)",
                        "label": "actor trainer0 (Trainer, PID 200, max_restarts -1)"}]
    said = orch.refusal([found])
    assert ("run `ray.kill(ray.get_actor('trainer0', namespace='zm'), no_restart=True)` (actor trainer0 (Trainer, PID 200, max_restarts -1)), "
            "`ray stop` on this node, or name it in services as ray:") in said
