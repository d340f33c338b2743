"""CUDA MPS on simulated hosts (tests/sim/nvidia-cuda-mps-control) through real ansible-playbook:
the clients are freed like any holder and the server is stopped through its control daemon's
quit when every GPU it serves is selected; when it also serves an unselected GPU, the run fails
before acting, naming it (the spanning rule), and with kill_spanning it is quit anyway. The readings the simulator reproduces are in tests/sim/README.md."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import run_module  # noqa: E402
from supervisor_rig import Supervisord  # noqa: E402
from test_gpu_release import killed_pids, used  # noqa: E402
from test_respawn import wait_used  # noqa: E402


def start_mps(host, daemon_env=None):
    """Control daemon (with its server on every GPU it sees) and the environment its clients use."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(host.dir, "mps")}
    assert host.run(["nvidia-cuda-mps-control", "-d"], env=dict(env, **(daemon_env or {}))).returncode == 0
    assert wait_used(host, 0, 66)
    procs = host.run(["ps", "-eo", "pid=,args="]).stdout.splitlines()
    pids = {}
    for line in procs:
        pid, args = line.strip().split(" ", 1)
        for name in ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
            if args.startswith(name + " "):
                pids[name] = int(pid)
    return env, pids["nvidia-cuda-mps-control"], pids["nvidia-cuda-mps-server"]


def test_every_gpu_selected_frees_the_clients_and_quits_the_server(nshost):
    host = nshost("h200x1")
    env, control, server = start_mps(host)
    client = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8802"], env=env)
    assert used(host, 0) == 8802 + 66 + 15  # H200: two apps read their sum + 15 MiB
    facts = run_module(host, "gpu_facts")["ansible_facts"]["gpu"]
    placed = {h["pid"]: (h["gpu_indexes"], h["attribution"]) for h in facts["holders"]}
    # As gpu_facts placed them on a real H200 (tests/gpu/results/README.md, MPS run of 2026-12-01).
    assert placed == {control: ([], "undecided"), server: ([0], "listed"), client.pid: ([0], "listed")}
    run = run_module(host, "gpu_release")
    assert not run.failed and run["released"] is True, run.msg
    assert list(killed_pids(run)) == [client.pid]
    [stopped] = run["stopped_mps_servers"]
    assert stopped["pid"] == server and stopped["pipe_directory"] == env["CUDA_MPS_PIPE_DIRECTORY"]
    assert stopped["how"] == "echo quit | /usr/bin/nvidia-cuda-mps-control" and stopped["gpu_indexes"] == [0]
    assert host.wait_gone(server, 2) and host.wait_gone(control, 2) and used(host, 0) == 0
    # The control daemon maps the GPU node without a context (undecided, as on the H200): never signalled.
    assert control not in killed_pids(run)


def test_server_that_also_serves_an_unselected_gpu_is_refused_before_acting(nshost):
    host = nshost("h200x2")
    env, control, server = start_mps(host)
    client0 = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8802"], env=env)
    client1 = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "4096"], env=env)
    for check in (True, False):
        run = run_module(host, "gpu_release", {"gpus": ["0"]}, check=check)
        # The generic spanning refusal: the server is listed on both GPUs.
        assert run.failed and "refusing to free GPU 0" in run.msg, run.msg
        assert f"pid {server} nvidia-cuda-mps [nvidia-cuda-mps-server " in run.msg and "GPU 1 is outside the selection" in run.msg, run.msg
        assert "Nothing was stopped or signalled" in run.msg and run["killed"] == [] and run["stopped_mps_servers"] == []
    assert all(host.alive(pid) for pid in (control, server, client0.pid, client1.pid))
    assert used(host, 0) >= 8802 and used(host, 1) >= 4096
    run = run_module(host, "gpu_release", {"gpus": ["0", "1"]})
    assert not run.failed and run["released"] is True, run.msg
    assert sorted(killed_pids(run)) == sorted([client0.pid, client1.pid]) and [s["pid"] for s in run["stopped_mps_servers"]] == [server]
    assert sorted(run["stopped_mps_servers"][0]["gpu_indexes"]) == [0, 1]
    time.sleep(0.2)
    assert used(host, 0) == 0 and used(host, 1) == 0 and not host.alive(control)


def test_kill_spanning_quits_a_server_that_serves_an_unselected_gpu(nshost):
    host = nshost("h200x2")
    env, control, server = start_mps(host)
    client0 = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8802"], env=env)
    client1 = host.spawn(["gpu_holder", "--gpus", "1", "--mib", "4096"], env=env)
    run = run_module(host, "gpu_release", {"gpus": ["0"], "kill_spanning": True})
    assert [s["pid"] for s in run["stopped_mps_servers"]] == [server] and client0.pid in killed_pids(run), run.msg
    # GPU 1's client keeps running (its own context); only the server serving both is gone.
    assert host.alive(client1.pid) and host.wait_gone(server, 2) and host.wait_gone(control, 2)


# --- issue 31: MPS by identity only (a name decides nothing; docs/docsite/rst/guide_security.rst)

USER = 4242


def test_users_job_posing_as_a_server_with_roots_pipe_directory_does_not_quit_roots_daemon(nshost):
    """uid 4242 runs a GPU-1 job named nvidia-cuda-mps-server with CUDA_MPS_PIPE_DIRECTORY set to
    root's pipe directory (every MPS client knows it); root's daemon serves GPU 0 only. Freeing
    GPU 1 signals the impostor and leaves root's MPS alone."""
    host = nshost("h200x2")
    env, control, server = start_mps(host, {"CUDA_VISIBLE_DEVICES": "0"})
    client = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8802"], env=env)
    posed = host.spawn_as(USER, ["gpu_holder", "--gpus", "1", "--mib", "2048", "--name", "nvidia-cuda-mps-server"], env=env)
    assert used(host, 1) >= 2048 and "CUDA_MPS_PIPE_DIRECTORY=" + env["CUDA_MPS_PIPE_DIRECTORY"] in host.read(f"/proc/{posed.pid}/environ").replace("\0", " ")
    run = run_module(host, "gpu_release", {"gpus": [1]})
    assert not run.failed and run["released"] is True, run.msg
    assert run["stopped_mps_servers"] == [] and list(killed_pids(run)) == [posed.pid]
    assert not host.alive(posed.pid) and used(host, 1) < 16  # what is left is GPU 0's footprint (clean)
    # Root's daemon, its server and its client on GPU 0 are untouched.
    time.sleep(0.3)
    assert all(host.alive(pid) for pid in (control, server, client.pid)) and used(host, 0) == 8802 + 66 + 15
    log = host.read(os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control.log"))
    assert "quit" not in log, log


def test_users_job_named_like_the_control_daemon_is_signalled_and_freed(nshost):
    host = nshost("h200x1")
    posed = host.spawn_as(USER, ["gpu_holder", "--gpus", "0", "--mib", "2048", "--name", "nvidia-cuda-mps-control"])
    assert used(host, 0) >= 2048
    run = run_module(host, "gpu_release", {"wait_timeout": 5})
    assert not run.failed and run["released"] is True, run.msg
    assert list(killed_pids(run)) == [posed.pid] and run["stopped_mps_servers"] == []
    assert not host.alive(posed.pid) and used(host, 0) == 0


def test_control_daemon_is_not_signalled_when_the_same_run_stops_a_supervisord_program(nshost):
    """The re-plan after stops (a unit, a container or a supervisord program: one code path,
    _release.act) keeps root's control daemon out of the targets: quit ends it, no SIGTERM."""
    host = nshost("h200x1")
    env, control, server = start_mps(host)
    sup = Supervisord(host, {"trainer": "/usr/bin/gpu_holder --gpus 0 --mib 4096 --name trainer"})
    assert wait_used(host, 0, 4096 + 66)
    client = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"], env=env)
    run = run_module(host, "gpu_release", {"services": ["supervisor:trainer"]})
    assert not run.failed and run["released"] is True, run.msg
    assert [p["name"] for p in run["stopped_programs"]] == ["trainer"]
    assert control not in killed_pids(run) and server not in killed_pids(run) and client.pid in killed_pids(run), run["killed"]
    [stopped] = run["stopped_mps_servers"]
    assert stopped["pid"] == server and stopped["how"] == "echo quit | /usr/bin/nvidia-cuda-mps-control", run["warnings"]
    assert host.wait_gone(control, 2) and sup.state("trainer") == "STOPPED" and used(host, 0) == 0


# --- issue 57: terminate_client through the vouched control daemon before any signal


def control_log(host, env):
    return host.read(os.path.join(env["CUDA_MPS_PIPE_DIRECTORY"], "control.log"))


def test_a_client_gets_terminate_client_before_any_signal_and_the_server_is_quit_after(nshost):
    host = nshost("h200x1")
    env, control, server = start_mps(host)
    client = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8802"], env=env)
    # The daemon's own answer says who its clients are (no client's environment is read by the module).
    assert host.run(["nvidia-cuda-mps-control"], env=env, input=f"get_client_list {server}\n").stdout.split() == [str(client.pid)]
    dry = run_module(host, "gpu_release", check=True)
    assert [(c["pid"], c["server_pid"], c["how"]) for c in dry["terminated_mps_clients"]] == [(client.pid, server, None)], dry.msg
    assert "terminate_client" not in control_log(host, env) and host.alive(client.pid)
    run = run_module(host, "gpu_release")
    assert not run.failed and run["released"] is True, run.msg
    [terminated] = run["terminated_mps_clients"]
    assert terminated == {"pid": client.pid, "name": "python3", "server_pid": server, "pipe_directory": env["CUDA_MPS_PIPE_DIRECTORY"],
                          "gpu_indexes": [0], "how": f"echo terminate_client {server} {client.pid} | /usr/bin/nvidia-cuda-mps-control"}
    # The order: the daemon found the client alive when told to terminate it, then this run's SIGTERM
    # ended the process (terminate_client ends its GPU work, not the process), then quit.
    log = control_log(host, env).splitlines()
    told = log.index(f"command: terminate_client {server} {client.pid} (client alive, terminated)")
    assert told < log.index("command: quit"), log
    assert killed_pids(run)[client.pid]["signal"] == "SIGTERM" and host.exit_status(client.pid) == -15
    assert [s["pid"] for s in run["stopped_mps_servers"]] == [server] and host.wait_gone(server, 2) and used(host, 0) == 0


def test_only_the_selected_gpus_client_is_terminated_the_other_daemon_server_and_client_are_left_alone(nshost):
    """One control daemon per GPU (CUDA_VISIBLE_DEVICES and a pipe directory each, as NVIDIA's
    multi-daemon setup does): freeing GPU 0 tells daemon 0 to terminate its client and quits its
    server; daemon 1 is told nothing, and its server and client run on."""
    host = nshost("h200x2")
    env0 = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(host.dir, "mps0")}
    env1 = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(host.dir, "mps1")}
    for env, gpu in ((env0, "0"), (env1, "1")):
        assert host.run(["nvidia-cuda-mps-control", "-d"], env=dict(env, CUDA_VISIBLE_DEVICES=gpu)).returncode == 0
        assert wait_used(host, int(gpu), 66)
    servers = {int(line.split()[0]): line for line in host.run(["ps", "-eo", "pid=,args="]).stdout.splitlines()
               if line.split()[1:2] == ["nvidia-cuda-mps-server"]}
    server0, server1 = (int(host.run(["nvidia-cuda-mps-control"], env=env, input="get_server_list\n").stdout) for env in (env0, env1))
    assert sorted(servers) == sorted([server0, server1])
    client0 = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "8802"], env=dict(env0, CUDA_VISIBLE_DEVICES="0"))
    client1 = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "4096"], env=dict(env1, CUDA_VISIBLE_DEVICES="1"))
    run = run_module(host, "gpu_release", {"gpus": [0]})
    assert not run.failed and run["released"] is True, run.msg
    assert [(c["pid"], c["server_pid"]) for c in run["terminated_mps_clients"]] == [(client0.pid, server0)]
    assert list(killed_pids(run)) == [client0.pid] and [s["pid"] for s in run["stopped_mps_servers"]] == [server0]
    assert "terminate_client" in control_log(host, env0)
    assert "terminate_client" not in control_log(host, env1) and "quit" not in control_log(host, env1)
    time.sleep(0.3)
    assert host.alive(server1) and host.alive(client1.pid) and used(host, 1) == 4096 + 66 + 15
    # Daemon 1 still counts its client as its own.
    assert host.run(["nvidia-cuda-mps-control"], env=env1, input=f"get_client_list {server1}\n").stdout.split() == [str(client1.pid)]


def test_a_client_left_out_by_match_is_not_terminated_and_the_server_is_not_quit(nshost):
    host = nshost("h200x1")
    env, control, server = start_mps(host)
    chosen = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048", "--name", "chosen-job"], env=env)
    other = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "1024", "--name", "other-job"], env=env)
    run = run_module(host, "gpu_release", {"match": ["chosen-job"], "wait_timeout": 1})
    # The GPU stays held by the other client and the server, which this run leaves running.
    assert run.failed and run.msg.startswith("GPUs still in use after"), run.msg
    assert [(c["pid"], c["server_pid"]) for c in run["terminated_mps_clients"]] == [(chosen.pid, server)]
    assert list(killed_pids(run)) == [chosen.pid] and run["stopped_mps_servers"] == []
    log = control_log(host, env)
    assert f"terminate_client {server} {other.pid}" not in log and "quit" not in log, log
    assert all(host.alive(pid) for pid in (control, server, other.pid))
    assert host.run(["nvidia-cuda-mps-control"], env=env, input=f"get_client_list {server}\n").stdout.split() == [str(other.pid)]
