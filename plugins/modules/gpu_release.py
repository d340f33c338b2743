#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_release
short_description: Free NVIDIA GPUs safely and prove that they read 0 MiB
version_added: 0.1.0
description:
  - Frees the selected GPUs of a node in four steps, and returns as soon as they are proven free.
  - B(Look) - one snapshot of the GPUs (C(nvidia-smi)), their compute apps, and every process holding C(/dev/nvidia*) (a C(/proc) scan).
  - B(Plan) - the units named in O(services) that are active (or, per O(service_state), enabled or not masked), with the sockets and
    timers that trigger them; the systemd services that are the GPU workload (O(stop_owning_units)), never a launcher of other jobs;
    the Docker and Podman containers named in O(services) or holding a selected GPU; and the holders left to signal, never a protected
    process, never PID 1, never the module's own Ansible session, never a process that uses only unselected GPUs, never an NVML client
    (unless O(match) names it). A holder in a Kubernetes pod fails the run here, before anything is done.
  - Which GPU a process uses is not which device files it has open (every CUDA process opens every GPU's); it is the GPU where
    nvidia-smi lists it as a compute app or, for a process nvidia-smi does not list (the orphaned child of a dead owner), the GPU whose
    device file it maps with a context-sized mapping. A process that cannot be placed so is reported in RV(undecided) and signalled
    only when every GPU it may use is selected. See M(zeromib.gpu.gpu_facts).
  - B(Act) - stop the containers through their runtime (after setting the restart policy of named ones to C(no) with
    O(service_state=disabled)); C(systemctl stop --no-block) the units, all at once, and wait for them at most O(kill_timeout) before
    C(systemctl kill --signal=SIGKILL) (never C(TimeoutStopSec), 90 s by default); then C(disable) or C(mask) the named ones. SIGTERM the
    remaining holders, SIGKILL those still alive after O(kill_timeout); a holder that SIGTERM cannot reach (it ignores SIGTERM -
    C(SigIgn) in C(/proc/PID/status) - or it is the init of its own PID namespace without a SIGTERM handler, as under
    C(unshare --pid --fork); or, read right before its first signal, it is stopped - state C(T), as after Ctrl-Z, SIGSTOP or a job
    suspension -, stopped by its tracer - state C(t), as under a debugger - or in a frozen cgroup v2 - C(cgroup.freeze)) gets SIGKILL at once, and its
    RV(killed) entry says why (C(sigkill_at_once)). A PID is signalled only
    while it is the process that was planned - through a pidfd where the node has them (Linux 5.3+, Python 3.9+), else after a check
    of its start time right before every signal.
  - B(Verify) - poll C(memory.used) every O(poll_interval) until every selected GPU reads at most O(max_used_mib), or fail after
    O(wait_timeout) with one message naming each dirty GPU, its MiB and what still holds it. When something was signalled that a
    restart policy outside this run's control may start again, watch a short settle window before answering (see the notes).
  - B(/dev/shm) - with O(clean_shm), once the GPUs are proven free, remove what killed jobs left in C(/dev/shm) (see O(clean_shm)).
  - A host that is already clean is not touched and reports C(changed=false).
author:
  - zeromib.gpu contributors (@zeromib)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - zeromib.gpu.nvidia_smi
  - zeromib.gpu.health
  - zeromib.gpu.smoke_test
attributes:
  check_mode:
    support: full
    details:
      - Reports the plan (RV(stopped_units), and RV(killed) with C(signal=null)) and does not fail on a dirty host that the real run
        would free.
      - It fails, with the message the real run would give, where the real run certainly fails - a dirty GPU that no process holds
        (leaked memory, or an idle baseline above O(max_used_mib), after the same short grace), a GPU held only by protected processes,
        and O(kill=false) with holders it would leave running - and where the plan is refused (a Kubernetes pod).
  diff_mode:
    support: full
    details:
      - Per-GPU memory and the holders, then the units, containers and processes acted on - before, and after (what is stopped,
        disabled, masked, signalled) - and the files of C(/dev/shm) that O(clean_shm) removes. In check mode, C(after) is the plan.
  platform:
    platforms: posix
options:
  gpus:
    description:
      - Indexes or UUIDs of the GPUs to free. Processes that use only other GPUs are left alone, so one GPU can be freed while the
        others train; the GPUs freed then read the cross-GPU footprint of those contexts (see O(cross_gpu_footprint_mib)).
      - Empty selects every GPU nvidia-smi shows. Indexes are nvidia-smi's on this node; in a container or job given some of the
        host's GPUs they count from 0 there. A GPU this namespace cannot reach (RV(not_visible)) cannot be selected; naming it is an
        error that says so.
    type: list
    elements: str
    default: []
  services:
    description:
      - systemd units to stop even if they hold nothing now, for example a vLLM server that is restarting.
      - Globs are allowed (V(vllm*.service)); a name without a suffix gets C(.service). A glob that matches no unit is a warning.
      - Units that do not exist on the host are listed in RV(services_not_found), not an error, so one list fits a mixed fleet.
      - The C(.socket) and C(.timer) units that trigger a named unit (C(TriggeredBy=)) are stopped with it and get the same O(service_state),
        so that they cannot start it again.
      - Globs match the units systemd has loaded and the installed unit files (C(systemctl list-unit-files)), so an enabled but
        inactive V(vllm.service) is matched too (and disabled with O(service_state=disabled)). Templates (C(getty@.service)) are not
        matched; their instances are.
      - Never stopped, named or not - the unit of the module's own session, a unit whose main process is protected (see O(protect)),
        systemd's own units, D-Bus, login, SSH, consoles and networking. Named, such a unit fails the task before anything is done;
        matched by a glob, it is kept (RV(kept_units)).
      - Never selected by a glob, stopped only when named exactly - what keeps the node reachable and its data safe. Network
        (networking, C(ifup@*), NetworkManager, systemd-networkd, C(wg-quick@*), tailscaled, nftables, iptables, firewalld, ufw, ...),
        storage (iscsid, multipathd, C(nfs*), rpcbind, autofs, C(lvm*), C(zfs*), Lustre, BeeGFS, GPFS, Ceph, ...), identity (sssd, nslcd,
        winbind, nscd), remote access (sshd, ssh, dropbear) and time (chrony, chronyd, ntp, ntpsec, systemd-timesyncd); and launchers
        (cron, atd, Slurm, Ray, jupyterhub, container engines, O(launchers), ...). They are listed in RV(kept_units) with the reason, and
        one warning names them. So V(*) cannot take the node down.
      - V(container:<name glob>) names Docker or Podman containers instead (V(container:vllm*)), in any state; a glob that matches no
        container (or a host without Docker and Podman) is listed in RV(services_not_found).
      - V(supervisor:<program glob>) names programs of supervisord (V(supervisor:vllm*)), matched against the names
        C(supervisorctl status) prints (V(name), V(group:name)); they are stopped through C(supervisorctl stop), at most O(kill_timeout)
        (+ 5 s) per call. Only a supervisord running as root is asked, through its own configuration (C(-c) of its command line).
        A glob that matches no program (or a host without supervisord) is listed in RV(services_not_found).
      - V(lxc:<id glob>:<unit glob>) (Proxmox and LXC), V(lxd:<name glob>:<unit glob>) (LXD, Incus) and V(machine:<name glob>:<unit glob>)
        (systemd-nspawn) name a system container's own units, when the play runs on the host (V(lxc:101:vllm*.service)). They are
        stopped (and get O(service_state)) by the guest's own systemd, entered with C(nsenter -t <guest init> -a systemctl ...), with the
        same rules as the host's units; gpu_restore starts them again. A guest that is not running, or a unit it does not have, is
        listed in RV(services_not_found); a guest whose init is no systemd fails the task before anything is done.
      - A bare unit name is the host's unit, never a guest's of the same name, and the GPU selection holds for it - a named unit whose
        processes hold only GPUs outside O(gpus) is kept (RV(kept_units), kind V(other_gpus)) - freeing GPU 4 never stops the
        V(vllm.service) serving on GPUs 0 and 1. A named unit that holds nothing is stopped.
      - A process of a guest's service whose guest runs a system manager is never signalled from the host (the guest's manager would
        start it again) - without such an entry the task fails before anything is done, naming the guest, the command to run there and
        the entry to add. See the collection's C(docs/docsite/rst/guide_system_containers.rst).
    type: list
    elements: str
    default: []
  service_state:
    description:
      - What to leave the units of O(services) in.
      - V(stopped) stops them; V(disabled) also disables them, so they do not start at the next boot; V(masked) masks them.
      - Units found through O(stop_owning_units) are only stopped, never disabled.
      - C(systemctl mask) cannot mask a unit whose own file is in C(/etc/systemd/system) (where it would put its link to C(/dev/null)).
        V(masked) then fails before anything is stopped or signalled, saying to move the unit file to C(/usr/local/lib/systemd/system)
        or to use V(disabled).
      - For containers named in O(services), V(disabled) sets the restart policy to C(no) (C(docker update --restart=no)) before stopping
        them, so that neither a restart of the Docker daemon nor a reboot starts them again. A container cannot be masked; V(masked)
        leaves named containers as V(disabled) does, and they are reported in RV(disabled_containers).
      - Containers found holding a selected GPU are only stopped; with restart policy V(always) Docker starts them again when its
        daemon restarts. Name them in O(services) to disable them.
      - For supervisord programs named in O(services), V(disabled) (and V(masked), since supervisord has no mask) sets C(autostart=false) and
        C(autorestart=false) in the program's section of its configuration file (a file only root can write); the file is what supervisord
        reads again at its restart and at boot, so the program stays stopped across both. The running supervisord is not made to re-read
        it (C(supervisorctl update GROUP) would stop and re-add every other program of the group) - it never restarts a program it
        stopped. Stopping or disabling one program never stops, starts or re-adds another. The values before are returned in
        RV(disabled_programs).
      - The copies of a supervisord program with C(numprocs) > 1 (V(trainer:trainer_0), V(trainer:trainer_1)) share its section, so one
        copy cannot be disabled alone - V(disabled) for some copies but not all fails before anything is done, naming the copies it would
        disable too. Name the program (V(supervisor:trainer:*)) to stop and disable every copy, or use V(stopped), which stops the
        named copy only.
      - A system container's units named in O(services) (V(lxc:101:vllm.service)) are disabled or masked by the guest's systemd.
    type: str
    choices: [stopped, disabled, masked]
    default: stopped
  stop_owning_units:
    description:
      - Stop a holder that runs inside a systemd C(.service) through its unit, so that C(Restart=) cannot start it again, when that unit
        B(is) the GPU workload (C(vllm.service)), that is when its main process or the main process's descendants hold the GPUs (also
        vLLM V1, whose API server holds no GPU and whose C(VLLM::EngineCore) child does).
      - A B(launcher) that merely started a holder is never stopped - job schedulers (slurmd, slurmstepd, PBS, LSF, HTCondor's
        condor_master, condor_startd, condor_starter), cron, anacron, atd, cluster runtimes (a Ray node - C(ray start), raylet,
        gcs_server; Dask workers - dask-worker, C(dask worker), C(dask cuda worker), distributed.cli; Nomad - C(nomad agent)), notebook
        hubs, servers and kernel gateways (jupyterhub, jupyter-lab, jupyter-notebook, jupyter-server, jupyter-kernelgateway), CI
        runners (gitlab-runner, GitHub and Buildkite agents), container engines (dockerd, containerd, kubelet, crio, podman),
        supervisord, login and SSH, C(user@.service), systemd's own units, and those of O(launchers). It is known by the unit's name,
        by the names of its main process (C(MainPID) from systemd) or of its C(ExecStart=) command (a renamed unit file is still
        recognised), or because the holders are not its main process or its descendants. Their holders are signalled instead, and the
        launcher is listed in RV(launchers), with the Slurm job id where the holder runs in a Slurm job.
      - Running processes without a GPU is no sign of a launcher - an inference server's unit has those too (vLLM's API server,
        Python's multiprocessing resource tracker, tokenizer workers) and is stopped as the workload. Nor are C(ray::) worker names - vLLM's
        Ray executor starts raylet and C(ray::) workers under its own API server, and that unit is the workload.
      - A workload unit that also holds GPUs outside O(gpus) is not stopped for a partial selection - see O(kill_spanning).
      - Holders in a C(.scope) (a login session, a container) are signalled as processes; the module never stops the unit
        or scope its own session runs in, nor one that runs a protected process.
    type: bool
    default: true
  kill_spanning:
    description:
      - What to do with a B(spanning) process, one that uses a selected GPU and also GPUs outside O(gpus) (nvidia-smi lists it on
        both, or it maps both context-sized) - JAX preallocates on every visible GPU, a DataParallel trainer, an MPS server.
        Ending it would end its work on the GPUs the selection kept out.
      - V(false) - the run fails before anything is stopped or signalled (check mode fails the same way), naming each such process
        (pid, name, command line) and the unselected GPUs it uses, listed in RV(spanning). The same holds for a workload unit
        (C(stop_owning_units)) or a container found holding a selected GPU whose processes also hold GPUs outside the selection, and
        for a supervisord program named in O(services) whose C(numprocs) copies hold a selected GPU and GPUs outside the selection.
      - V(true) - end them anyway - signal the process, stop the unit or the container.
      - With every GPU selected (the default) nothing spans.
    type: bool
    default: false
  launchers:
    description:
      - A site's own launchers, added to the built-in ones (see O(stop_owning_units)) - a launcher's unit is never stopped to free
        GPUs; its GPU holders are signalled and it is named in RV(launchers). A glob in O(services) never selects one either.
      - An entry that ends in a unit suffix is a unit glob (V(mysched*.service)); any other is a process name glob (V(mysched),
        V(my-agent*)), matched against the executable, C(argv[0]), the script an interpreter runs and C(comm) of the unit's main
        process (C(MainPID) from systemd) and the command of its C(ExecStart=).
    type: list
    elements: str
    default: []
  kill:
    description:
      - Signal the holders that remain after the units are stopped, and stop the containers found holding selected GPUs. With V(false)
        only the units and containers named in O(services), and the units found through O(stop_owning_units), are acted on, and a GPU
        still held by a process it leaves running fails the task at once (waiting would not free it), naming the process.
    type: bool
    default: true
  match:
    description:
      - Python regular expressions searched in each holder's command line. When set, only matching holders (and their units)
        are acted on; O(services) are always acted on.
      - An NVML client (a process that maps no per-GPU device file and that nvidia-smi does not list, such as C(nvidia-smi dmon)
        or a metrics exporter) is signalled only when O(match) names it.
    type: list
    elements: str
    default: []
  kill_timeout:
    description:
      - Seconds between SIGTERM and SIGKILL, and how long a process may outlive SIGKILL before it is reported as unkillable.
      - A process that SIGTERM cannot reach (it ignores SIGTERM, it is the init of its own PID namespace without a handler for it, it is
        stopped or stopped by its tracer, or its cgroup is frozen) gets SIGKILL at once, without this wait (C(sigkill_at_once) in RV(killed)).
      - Also how long a unit may take to stop before it is killed through systemd (RV(killed_units)).
      - Also the grace a container gets from its runtime (C(docker stop -t), rounded up to whole seconds) before the runtime SIGKILLs it.
    type: float
    default: 10
  wait_timeout:
    description:
      - Seconds to wait, after acting, for every selected GPU to read at most O(max_used_mib).
      - The wait ends early, with a failure, when it cannot help - the GPUs are held only by protected processes, a GPU's memory reads
        V([N/A]) (it can never be proven free), O(kill=false) leaves a holder running, or no process holds a dirty GPU and nothing was
        done for it (after a 1 s grace of readings that do not drop, since a process that just exited frees its memory within ~1 s on
        H200). A small steady reading with no holder (MIG GPUs idle at 50-59 MiB) is called the GPU's idle baseline, with the
        O(max_used_mib) to set; a larger one leaked memory, which needs a GPU reset or a reboot.
      - A GPU still being freed when it runs out - its memory fell over the last second of readings, or a process the kernel is ending
        (C(PF_EXITING), e.g. one unpinning a large host-memory pool after the stop) still holds it - fails saying so, and that a longer
        O(wait_timeout) (role variable C(free_gpus_wait_timeout)) may free it; no reset is advised for it.
    type: float
    default: 60
  poll_interval:
    description:
      - Seconds between memory reads while waiting. The driver frees memory 20-130 ms after a process exits.
    type: float
    default: 0.1
  clean_shm:
    description:
      - Once every selected GPU reads free, remove from C(/dev/shm) the files that killed jobs left there, so that the next job's NCCL
        init does not fail for want of space while every GPU reads 0 MiB. In check mode (and diff mode) RV(shm_removed) lists what
        would go.
      - A file goes only when it is a regular file directly in C(/dev/shm) (never through a link, never in a subdirectory), named like a
        job framework's segment (V(nccl-*), V(torch_*), V(cuda.shm.*), V(psm_*), V(psm_shm.*), V(psm2_shm.*), V(sem.mp-*), V(pym-*);
        other POSIX semaphores, V(sem.*), are only listed), it was there when the run started (the same inode - a file made since belongs
        to a job that may not have opened it yet), and no live process has it open or mapped, by the kernel's identity of the file.
        Whoever owns it.
      - Needs root (O(ignore:become=true)), and every process readable (a process this module cannot read may hold a file); otherwise
        nothing is removed and a warning says why. C(/dev/shm) must be a root-owned directory with the sticky bit (as every tmpfs there
        is) - a file is unlinked through the directory's descriptor after a last check that it is the same inode, so a name swapped
        meanwhile by a user swaps only a file of theirs, and a link is removed, never followed.
      - In a container (a PID namespace of its own), nothing is removed - in check mode either - where C(/dev/shm) may be shared with
        the host or another container, whose processes this module cannot see (a file one of them holds looks unheld from inside) - the
        container shares the node's IPC namespace (C(docker --ipc=host)), C(/dev/shm) is a directory of another file system bound there,
        or its mount is a slave of a mount outside (a bind of the host's with LXC's or nspawn's default propagation). RV(shm) still lists
        the files and a warning says why; clean them on the host. A bind of an outside tmpfs made private, in a container with an IPC
        namespace of its own (C(-v /dev/shm:/dev/shm) without C(--ipc=host)), looks like a C(/dev/shm) of its own from inside, so do not
        set O(clean_shm) there.
      - Nothing is removed when the run fails. See RV(shm) for what stays.
    type: bool
    default: false
  settle_timeout:
    description:
      - Seconds to keep watching, once the selected GPUs read clean, for a signalled holder that something starts again (the respawn
        watch, see the notes). Only spent when such a restarter survived the signals; a window over parents ends as soon as the last
        of them exits.
      - The default covers a shell loop without C(sleep), supervisord, pm2, runsv, s6-supervise, torchrun's elastic agent, systemd's
        C(RestartSec) and Docker's first restart. Raise it for a restarter that waits longer (a loop with C(sleep 30)).
    type: float
    default: 5
notes:
  - Needs root (O(ignore:become=true)) to see and signal other users' processes and to manage systemd units.
  - Every number is checked before anything runs - V(nan) and V(inf) are refused, as are negative values; O(timeout) and
    O(poll_interval) must be greater than 0. Every time has an upper bound - O(timeout), O(kill_timeout), O(wait_timeout),
    O(poll_interval) and O(settle_timeout) at most 86400 seconds (one day), O(xid_window_hours) at most 8760 (one year) - and a
    larger value fails naming the option and its bound. O(gpus) and O(protect) take indexes and PIDs in ASCII digits only. O(services) takes at
    most 1000 entries (use globs), none longer than a unit name can be.
  - The module never resets a GPU. Memory that nvidia-smi attributes to a process that no longer exists, with no live holder left,
    is a context the driver has not freed; the failure message says that a GPU reset or a reboot is needed, what on this node would
    refuse a bare C(nvidia-smi --gpu-reset) (persistence mode, the processes that hold the GPU's device node with the unit, container
    or pod they run in, a loaded C(nvidia_drm)), and the exact sequence as root - persistence off for that GPU, stop what holds it,
    C(nvidia-smi --gpu-reset -i N), start it again, persistence on, the reading that must show 0 MiB. It says to reboot where no reset
    can succeed (C(nvidia_drm) in use by a console or display server; an NVSwitch GPU whose reset must take GPUs still in use because
    Fabric Manager is not running). See the collection's C(docs/troubleshooting.md).
  - A failure after acting (nvidia-smi reports a GPU lost, a signal is not permitted, the GPUs stay dirty) still returns what was done
    - RV(stopped_units), RV(killed), RV(killed_units), RV(stopped_containers).
  - B(Containers.) A holder in a Docker or Podman container (found from its cgroup path) is never signalled from outside; the container
    is stopped through its runtime (the Engine API on C(/run/docker.sock) or C($DOCKER_HOST), Podman's on C(/run/podman/podman.sock)
    or C($CONTAINER_HOST), else the C(docker)/C(podman) command), with O(kill_timeout) as its grace. Only when the runtime cannot be
    asked (or is containerd or CRI-O outside Kubernetes) are the container's processes signalled, with a warning, and watched as below.
  - B(Kubernetes.) A holder of a selected GPU in a Kubernetes pod (a C(kubepods) cgroup) is never signalled or stopped; the kubelet
    would restart it and the pod's owner would lose its work without the scheduler knowing. The module fails before acting, naming the
    pod (namespace/name where the runtime says it, else its UID), and says to cordon and drain the node.
  - B(No false released.) When this run signalled, from outside, a process whose restart is outside its control (in a container it
    could not stop through the runtime, or in a C(.service) of a user's systemd manager whose C(Restart=) is not C(no)), it watches for
    O(settle_timeout) seconds after the GPUs read clean (Docker restarts a killed container within ~0.3-0.5 s, measured; systemd's
    C(RestartSec) defaults to 100 ms). A new process in that container's or unit's cgroup, or a selected GPU that reads dirty again,
    fails the run naming it; RV(released) is V(true) only when the window passed quietly.
  - B(Respawn watch.) Likewise for a signalled holder whose parent is still alive (walking up from its parent to its session leader
    or a launcher; never PID 1, a protected daemon or the Ansible session) - a C(while true; do python train.py; done) loop, supervisord,
    pm2, runsv, s6-supervise, circusd, monit, torchrun's elastic agent. A new process under that parent that runs the killed command
    line again, or that maps a selected GPU's device file (a new holder), fails the run naming the parent (PID, name, command line)
    and what stops it (C(supervisorctl stop NAME), C(pm2 stop NAME), C(sv down DIR), C(s6-svc -d DIR); torchrun's agent goes first).
    Without such a parent there is no window (C(settle_s) of RV(timings) is 0); a parent that exits with its holder ends the window at
    once.
  - B(MPS.) C(nvidia-cuda-mps-control) (the control daemon) and C(nvidia-cuda-mps-server) are recognised by executable, C(argv[0])
    or script name. Clients are freed like any holder, after C(echo terminate_client <server PID> <client PID> | nvidia-cuda-mps-control)
    through their server's control daemon (NVIDIA's documented early termination, which keeps the server and its other clients sound;
    the daemon's own C(get_client_list) says which processes are its clients), then signalled as before if still alive (see
    RV(terminated_mps_clients)); the control daemon is never signalled. The server is stopped through its control
    daemon when every GPU it serves (where nvidia-smi lists it) is selected - C(echo quit | nvidia-cuda-mps-control) with the daemon's
    C(CUDA_MPS_PIPE_DIRECTORY) (default C(/tmp/nvidia-mps)), or C(quit) written into that directory's C(control) FIFO without the
    program - after its clients are signalled; a server still alive after O(kill_timeout) is signalled. A server that also serves a GPU
    outside the selection fails the run before anything is done (check mode too), naming it and those GPUs, since stopping it would end the
    MPS clients of the other GPUs. See RV(stopped_mps_servers).
  - B(Restore.) What the run stopped, disabled or masked (units, containers, supervisord programs), with its state before, is added to a
    root-only record, C(/var/lib/zeromib-gpu/released.json); M(zeromib.gpu.gpu_restore) puts it back after training. Nothing is written
    in check mode or when the run changed nothing. See RV(restore_record).
  - B(Compiled code.) AnsiballZ sends a module's source, never its bytecode, so the code a run compiled is kept in root's bytecode cache on
    the node, C(/var/lib/zeromib-gpu/bytecode) (the directory 0700, a file 0600 per module), and the next run of a module of this
    collection loads it instead of compiling (~45 ms of CPU a clean gate on the benchmark's simulated hosts). An entry is used only
    for the same source (its SHA-256) and the same Python, from a regular file of root's in directories no one else may write (each
    one up to C(/)); anything else is compiled as without the cache, and a cache that cannot be written costs only the next run's compile.
    Nothing is written in check mode.
  - The role P(zeromib.gpu.free_gpus#role) runs this module and asserts the result, for C(pre_tasks) of a training play.
seealso:
  - module: zeromib.gpu.gpu_facts
  - module: zeromib.gpu.gpu_restore
requirements:
  - nvidia-smi from the NVIDIA driver on the managed node
  - systemd, when O(services) or O(stop_owning_units) are used
  - for containers, Docker or Podman on the node (no Python package; the module speaks their API over the unix socket, or runs their CLI)
"""

EXAMPLES = r"""
- name: Free every GPU of the node
  zeromib.gpu.gpu_release:
  become: true

- name: Stop and disable the inference servers, then free the GPUs
  zeromib.gpu.gpu_release:
    services:
      - vllm*.service
      - sglang.service
    service_state: disabled
  become: true

- name: Stop the vLLM containers for good (restart policy no), then free the GPUs
  zeromib.gpu.gpu_release:
    services:
      - container:vllm*
    service_state: disabled
    kill_timeout: 30
  become: true

- name: Free GPUs 2 and 3 only, killing only training processes, on a MIG node
  zeromib.gpu.gpu_release:
    gpus: [2, 3]
    match: ['train\.py']
    max_used_mib: 64
    kill_timeout: 5
  become: true

- name: What would be stopped and killed?
  zeromib.gpu.gpu_release:
  check_mode: true
  become: true
  register: __plan
"""

RETURN = r"""
released:
  description: Every selected GPU reads at most O(max_used_mib) at the end. In check mode, whether the host is already clean.
  type: bool
  returned: always
selected_gpus:
  description: Indexes of the GPUs acted on.
  type: list
  elements: int
  returned: always
  sample: [0, 1, 2, 3, 4, 5, 6, 7]
not_visible:
  description:
    - Bus ids (the driver's spelling) of the GPUs the driver lists in C(/proc/driver/nvidia/gpus) that this namespace cannot reach
      (a container, a Slurm step or C(docker --device) given only some of the host's GPUs) - not this node's, never selected, never
      acted on. V([]) when it reaches them all.
    - Naming one in O(gpus) fails the run before anything is done. A GPU the driver lists, whose device node this namespace can
      open and that nvidia-smi leaves out, fails the run (it can never be proven free).
  type: list
  elements: str
  returned: always
  sample: ["0000:2a:00.0", "0000:3a:00.0"]
stopped_units:
  description: Units stopped (in check mode, to be stopped).
  type: list
  elements: str
  returned: always
  sample: [vllm.service]
stopped_containers:
  description:
    - Containers stopped through their runtime (in check mode, to be stopped), named in O(services) or found holding a selected GPU.
    - C(restart_policy) is the policy before the run; C(stopped_after_s) the seconds the runtime took (not in check mode).
  type: list
  elements: dict
  returned: always
  sample:
    - {name: vllm, id: 4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a, image: "vllm/vllm-openai:v0.11.0", runtime: docker,
       restart_policy: always, gpu_indexes: [0, 1, 2, 3, 4, 5, 6, 7], stopped_after_s: 0.42}
disabled_containers:
  description:
    - Containers named in O(services) whose restart policy was set to C(no), with O(service_state=disabled) or O(service_state=masked).
  type: list
  elements: dict
  returned: always
  sample:
    - {name: vllm, id: 4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a, image: "vllm/vllm-openai:v0.11.0", runtime: docker,
       restart_policy: "no", restart_policy_before: always, gpu_indexes: []}
stopped_programs:
  description:
    - supervisord programs named in O(services) (V(supervisor:<glob>)) that were running and were stopped through C(supervisorctl stop)
      (in check mode, to be stopped); C(pid) is the program's process before the stop, as its supervisord reported it.
  type: list
  elements: dict
  returned: always
  sample:
    - {name: vllm, supervisor_pid: 812, config: /etc/supervisor/supervisord.conf, state_before: RUNNING, pid: 815}
disabled_programs:
  description:
    - supervisord programs named in O(services) whose C(autostart) and C(autorestart) were set to C(false), with O(service_state=disabled)
      or O(service_state=masked); C(file) is the configuration file changed, C(autostart_before)/C(autorestart_before) the values it had
      (null when the option was not set), C(section) the section edited (one for every copy of a C(numprocs) program, each copy listed).
      C(group_updated) is V(false) - the running supervisord was not made to re-read the file, so no
      other program of its group was stopped or started; the file counts from supervisord's next start.
  type: list
  elements: dict
  returned: always
  sample:
    - {name: vllm, supervisor_pid: 812, config: /etc/supervisor/supervisord.conf, state_before: RUNNING, pid: 815,
       file: /etc/supervisor/conf.d/vllm.conf, section: "program:vllm", autostart_before: "true", autorestart_before: "true",
       group_updated: false}
stopped_guest_units:
  description:
    - A system container's own units named in O(services), stopped through the guest's systemd (in check mode, to be stopped), each
      named as its entry - V(lxc:101:vllm.service), V(lxd:web:vllm.service), V(machine:build:vllm.service).
  type: list
  elements: str
  returned: always
  sample: [lxc:101:vllm.service]
disabled_guest_units:
  description: The same, disabled in the guest with O(service_state=disabled).
  type: list
  elements: str
  returned: always
masked_guest_units:
  description: The same, masked in the guest with O(service_state=masked).
  type: list
  elements: str
  returned: always
killed_guest_units:
  description: A guest's units whose stop outlasted O(kill_timeout), killed through the guest's systemd and stopped again.
  type: list
  elements: str
  returned: always
stopped_mps_servers:
  description:
    - MPS servers stopped through their control daemon (in check mode, to be stopped, with C(how=null)). C(how) is the command used,
      null when C(quit) could not be sent and the server was signalled instead (see RV(killed)).
  type: list
  elements: dict
  returned: always
  sample:
    - {pid: 475, name: nvidia-cuda-mps, pipe_directory: /tmp/nvidia-mps, gpu_indexes: [0, 1],
       how: "echo quit | /usr/local/nvidia/bin/nvidia-cuda-mps-control"}
terminated_mps_clients:
  description:
    - MPS clients told C(terminate_client <server PID> <client PID>) through their server's control daemon before any signal (in check
      mode, to be told, with C(how=null)); those still alive are then signalled as before (see RV(killed)). C(how) is the command used,
      null when it failed (a warning says why).
  type: list
  elements: dict
  returned: always
  sample:
    - {pid: 812, name: python3, server_pid: 475, pipe_directory: /tmp/nvidia-mps, gpu_indexes: [0],
       how: "echo terminate_client 475 812 | /usr/bin/nvidia-cuda-mps-control"}
disabled_units:
  description: Units disabled, with O(service_state=disabled).
  type: list
  elements: str
  returned: when O(service_state=disabled)
masked_units:
  description: Units masked, with O(service_state=masked).
  type: list
  elements: str
  returned: when O(service_state=masked)
killed_units:
  description: Units whose stop outlasted O(kill_timeout), killed through systemd (C(systemctl kill --signal=SIGKILL)) and stopped again.
  type: list
  elements: str
  returned: always
  sample: [stubborn.service]
launchers:
  description:
    - Units that started holders of the selected GPUs but are not the workload (see O(stop_owning_units)), with the holders signalled
      instead of stopping them. One entry per unit and Slurm job; C(slurm_job_id) comes from the holder's cgroup (C(job_<id>)) or its
      C(SLURM_JOB_ID); holders in a Slurm job outside any service (a C(slurmstepd.scope)) are listed too.
    - In check mode, the same plan.
  type: list
  elements: dict
  returned: always
  sample:
    - {unit: atd.service, reason: atd.service starts other jobs (scheduler, cron, hub, CI runner, container engine or supervisor),
       pids: [4242], slurm_job_id: null}
    - {unit: slurmd.service, reason: slurmd.service starts other jobs (scheduler, cron, hub, CI runner, container engine or supervisor),
       pids: [5120], slurm_job_id: "1734"}
spanning:
  description:
    - Processes (C(pid), C(name), C(cmdline), C(unit), C(container)), workload units (C(unit), C(pid=null)) and containers
      (C(container)) that use a selected GPU and also GPUs outside the selection, with C(gpu_indexes) (all the GPUs they use),
      C(outside_gpus) (the unselected ones) and C(pids); and the copies of a supervisord program named in O(services) that hold GPUs
      outside the selection while other copies hold selected ones (C(program), the copy's C(group:name)).
    - Without O(kill_spanning) the run fails before acting when this list is not empty; with it, they were ended.
  type: list
  elements: dict
  returned: always
  sample:
    - {pid: 733, name: python3, cmdline: python3 jax_train.py, unit: null, container: null, pids: [733], gpu_indexes: [0, 1],
       outside_gpus: [0]}
kept_units:
  description:
    - Units that a glob in O(services) matched but that a glob never selects, with the reason - essential to the node, network,
      storage, identity, remote access or time, a launcher, or a protected main process. Name one exactly to stop it, where allowed.
    - Named units whose processes hold only GPUs outside O(gpus) (kind V(other_gpus)); select their GPUs to stop them.
  type: list
  elements: dict
  returned: always
  sample:
    - {unit: tailscaled.service, reason: "network: the node needs it to stay reachable and its data safe; name it exactly to stop it"}
services_not_found:
  description:
    - Units of O(services) that systemd does not know on this host, V(container:<glob>) entries that match no container, and guest entries
      (V(lxc:101:vllm.service)) that name no running guest or no unit of it.
  type: list
  elements: str
  returned: always
killed:
  description:
    - Processes signalled, with the last signal sent (V(SIGTERM) or V(SIGKILL)) and the seconds from the first signal to their exit.
    - C(sigkill_at_once) says why a process got SIGKILL at once, without SIGTERM and without waiting O(kill_timeout) - V(ignores SIGTERM)
      (bit 15 of C(SigIgn) in C(/proc/PID/status)) or V(init of its PID namespace, no SIGTERM handler) (a process such as one started by
      C(unshare --pid --fork), which the kernel shields from a SIGTERM it has no handler for, bit 15 of C(SigCgt) clear), both as the
      look read them; V(stopped (state T)) (SIGSTOP, Ctrl-Z, a suspended job), V(stopped by its tracer (state t)) (a debugger) or
      V(in a frozen cgroup (cgroup.freeze)) (cgroup v2's freezer, as C(scontrol suspend) uses it), read right before the signal, since
      a SIGTERM would stay pending until the process runs again and SIGKILL ends it without resuming it; V(null) for a process that
      SIGTERM can reach.
    - In check mode, the processes that would be signalled, with C(signal=null) and the C(sigkill_at_once) they would get.
  type: list
  elements: dict
  returned: always
  sample:
    - {pid: 495, name: python3, cmdline: python3 train.py, unit: null, container: null, gpu_indexes: [0], signal: SIGTERM, sigkill_at_once: null,
       exited_after_s: 0.02}
    - {pid: 512, name: python3, cmdline: python3 serve.py, unit: null, container: null, gpu_indexes: [0], signal: SIGKILL,
       sigkill_at_once: "init of its PID namespace, no SIGTERM handler", exited_after_s: 0.15}
protected:
  description: Protected processes that hold a selected GPU (or that O(match) named). Never signalled.
  type: list
  elements: dict
  returned: always
  sample: [{pid: 812, name: nvidia-persiste, unit: nvidia-persistenced.service, gpu_indexes: [0, 1]}]
reused_pids:
  description: Planned targets not signalled because their PID now belongs to another process.
  type: list
  elements: dict
  returned: always
undecided:
  description:
    - Processes that may use a selected GPU but also others, and that were therefore not signalled. They map per-GPU device
      files but none with a context-sized mapping, so which GPU they use cannot be decided (see M(zeromib.gpu.gpu_facts)).
      Select all of C(candidate_gpu_indexes), or name them in O(match), to free them.
  type: list
  elements: dict
  returned: always
  sample: [{pid: 733, name: python3, cmdline: python3 worker.py, candidate_gpu_indexes: [0, 1]}]
unkillable:
  description: Processes that outlived SIGKILL for O(kill_timeout) seconds (usually D state in the driver).
  type: list
  elements: dict
  returned: always
restore_record:
  description:
    - Where this run recorded what it stopped, disabled or masked, with the state before, for M(zeromib.gpu.gpu_restore)
      (C(/var/lib/zeromib-gpu/released.json), root-only), and how many entries the record holds now.
    - V(null) when the run changed nothing, and in check mode; then nothing is written.
  type: dict
  returned: always
  sample: {path: /var/lib/zeromib-gpu/released.json, entries: 2}
warnings:
  description:
    - Things the operator should know, such as a container that could not be stopped through its runtime.
    - Each starts with the node's host name (C(platform.node()); the module does not know the inventory name), so that a warning
      of a fleet-wide run says which host it is about.
  type: list
  elements: str
  returned: always
gpus_before:
  description: Per-GPU state at the start, shaped like the C(gpus) of M(zeromib.gpu.gpu_facts).
  type: list
  elements: dict
  returned: always
gpus:
  description:
    - Per-GPU state at the end, shaped like the C(gpus) of M(zeromib.gpu.gpu_facts).
    - With O(smoke_test), each selected GPU also has C(smoke_test) - C(ok) (V(null) when not tested), C(error) (the CUDA error by name
      and number and the call, or why the GPU failed), C(seconds) (context creation to destruction), C(mib) (allocated and written),
      C(skipped) (why not tested - check mode, MIG mode, not released) and C(memory_used_mib_after) (read by C(nvidia-smi) after it).
  type: list
  elements: dict
  returned: always
smoke_test_passed:
  description:
    - V(true) when O(smoke_test) ran and every selected GPU passed; V(false) when one failed (a CUDA error, a hung call, memory
      not freed after it, or a GPU found in use right before it); V(null) when not asked, in check mode, or when a GPU was skipped
      (MIG mode). Does not change RV(released); the P(zeromib.gpu.free_gpus#role) role fails on V(false).
  type: bool
  returned: always
smoke_test_issues:
  description: "Each failed GPU as C(GPU <index> (<bus id>): <error>)."
  type: list
  elements: str
  returned: always
  sample: ["GPU 3 (00000000:5D:00.0): CUDA_ERROR_SYSTEM_NOT_READY (802) at cuCtxCreate: system not yet initialized"]
holders:
  description: Holders left at the end, protected ones included, shaped like the C(holders) of M(zeromib.gpu.gpu_facts).
  type: list
  elements: dict
  returned: always
healthy:
  description:
    - V(true) when no GPU has a health issue at the end, and C(dcgmi diag), when asked for and installed, passed, and C(/dev/shm) has the
      free space of O(shm_min_free_mib_per_gpu).
      Health does not change RV(released); the P(zeromib.gpu.free_gpus#role) role asserts both.
    - The checks are those of M(zeromib.gpu.gpu_facts) (ECC, row remaps, PCIe link, slowdown, persistence and MIG mode, recovery
      action, NVSwitch fabric (Fabric Manager as context), Xids judged by NVIDIA's Xid catalog).
  type: bool
  returned: always
health_checked:
  description:
    - V(false) when some health check could not be made; each GPU's C(health_unchecked) names the checks (C(health.unchecked)
      says why). Memory is freed and verified all the same.
  type: bool
  returned: always
health_issues:
  description: "Every GPU's health issues as C(GPU <index> (<bus id>): <issue>), then a failed DCGM diagnostic."
  type: list
  elements: str
  returned: always
  sample: ["GPU 0 (00000000:18:00.0): Xid 79 (GPU has fallen off the bus) in the kernel log at 2026-11-29T09:08:01+0000"]
health:
  description:
    - The kernel log read (C(kernel_log)), what the host has of Fabric Manager where a GPU has a fabric (C(fabric_manager)) and the DCGM diagnostic
      (C(dcgm_diag), V(null) unless O(dcgm_diag) is set), as in M(zeromib.gpu.gpu_facts).
  type: dict
  returned: always
elapsed_s:
  description: Seconds spent in the module.
  type: float
  returned: always
  sample: 0.41
shm:
  description:
    - C(/dev/shm) at the end, shaped like RV(zeromib.gpu.gpu_facts#module:ansible_facts.gpu.shm) (C(path), C(size_mib), C(free_mib),
      C(files)); C(unheld) (what no live process holds, after O(clean_shm)) only with O(clean_shm), else V(null).
    - V(null) when not read - without O(health) and O(clean_shm). Its free space below O(shm_min_free_mib_per_gpu) for each GPU makes
      RV(healthy) V(false).
  type: dict
  returned: always
  sample: {path: /dev/shm, size_mib: 64304.2, free_mib: 64304.2, files: 0, unheld: [], unheld_mib: 0, complete: true, error: null}
shm_removed:
  description:
    - The files O(clean_shm) removed from C(/dev/shm) (in check mode, would remove) - C(path), C(size_mib), C(age_s), C(pattern), C(user).
  type: list
  elements: dict
  returned: always
  sample: [{path: /dev/shm/nccl-Xb3kLq, size_mib: 36.0, age_s: 12, pattern: nccl-*, user: alice}]
timings:
  description:
    - Seconds spent stopping units and containers (C(stop_s)), signalling processes (C(kill_s)), waiting for memory to read free
      (C(wait_s)), and watching for a respawn (C(settle_s), 0 when nothing could respawn).
    - C(smoke_test_s) - the CUDA smoke test (a fresh look, the test process, the memory read after it), only when it ran.
  type: dict
  returned: always
  sample: {look_s: 0.05, plan_s: 0.0, stop_s: 0.0, kill_s: 0.15, wait_s: 0.12, settle_s: 0.0}
"""

import atexit
import platform
import re
import typing as t

from ansible.module_utils.basic import AnsibleModule

# First of the collection's imports: the module_utils below are then compiled once, not twice (_compile_once).
from ansible_collections.zeromib.gpu.plugins.module_utils import _compile_once
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log_state
from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi, NvidiaSmiError
from ansible_collections.zeromib.gpu.plugins.module_utils._act._release import Release, ReleaseError, System

ARGUMENT_SPEC = dict(
    _options.SHARED_SPEC,
    gpus=dict(type="list", elements="str", default=[]),
    services=dict(type="list", elements="str", default=[]),
    service_state=dict(type="str", default="stopped", choices=["stopped", "disabled", "masked"]),
    stop_owning_units=dict(type="bool", default=True),
    kill=dict(type="bool", default=True),
    kill_spanning=dict(type="bool", default=False),
    launchers=dict(type="list", elements="str", default=[]),
    match=dict(type="list", elements="str", default=[]),
    kill_timeout=dict(type="float", default=10),
    wait_timeout=dict(type="float", default=60),
    poll_interval=dict(type="float", default=0.1),
    settle_timeout=dict(type="float", default=5),
    clean_shm=dict(type="bool", default=False),
)


def checked_params(params: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """Option values that the argument spec cannot check -> a clear message, or compiled regexes."""
    problems = _options.check(params)
    if problems:
        raise ValueError("; ".join(problems))
    regexes = []
    for pattern in params["match"]:
        try:
            regexes.append(re.compile(pattern))
        except re.error as exc:
            raise ValueError(f"match: {pattern!r} is not a valid regular expression: {exc}") from None
    return dict(params, _match_regexes=regexes)


def warn_all(module: AnsibleModule, warnings: t.Iterable[str]) -> None:
    """Ansible prints a module's warnings without the host: name it (the node's host name)."""
    host = platform.node() or "this host"
    for warning in warnings:
        module.warn(f"{host}: {warning}")


def smoke_tested(smi: NvidiaSmi, params: t.Mapping[str, t.Any], result: dict[str, t.Any], check_mode: bool) -> dict[str, t.Any]:
    """The result with the smoke test's keys. _cuda_smoke is loaded only when the test is asked
    for: a gate without it does not pay for its import (65 ms of a clean gate's node time when it
    was imported at the top, benchmarks/HISTORY.md, "The clean gate's cost (issue 36, 2026-12-01)")."""
    if not params["smoke_test"]:
        return dict(result, smoke_test_passed=None, smoke_test_issues=[])
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cuda_smoke
    return _cuda_smoke.after_release(smi, params, result, check_mode, lambda: _facts.look(
        smi, params["protect"], max_used_mib=params["max_used_mib"], footprint_mib=params["cross_gpu_footprint_mib"]))


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    if not module.check_mode:
        # The code this run compiled, kept on the node for the next run (_compile_once), whichever
        # way the module exits; check mode writes nothing.
        atexit.register(_compile_once.keep)
    try:
        params = checked_params(module.params)
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    try:
        smi = NvidiaSmi(NvidiaSmi.find(params["nvidia_smi"]), params["timeout"])
        system = System(module.get_bin_path("systemctl"), record_path=_record.PATH,
                        # Check mode writes nothing, not even the kernel log's cursor: a whole read.
                        kernel_log_state=None if module.check_mode else _kernel_log_state.PATH)
        release = Release(smi, system, params, check_mode=module.check_mode)
        # A plain dict from here: the module adds the host's health keys and the smoke test's.
        result: dict[str, t.Any] = dict(release.run())
        if params["dcgm_diag"] and result.get("released") and not module.check_mode:
            # The diagnostic runs work on the GPUs: only once they are free.
            dcgm = _health.dcgm_diag(params["dcgm_diag"], module.get_bin_path)
            result.update(release.with_shm_floor(_facts.health_summary(result["gpus"], release.health, dcgm)))
        # Last: CUDA work on GPUs proven free, after a fresh look at who holds them.
        result = smoke_tested(smi, params, result, module.check_mode)
    except NvidiaSmiError as exc:
        module.fail_json(**exc.details())
    except ReleaseError as exc:
        warn_all(module, exc.result.pop("warnings", []))
        module.fail_json(msg=exc.msg, **exc.result)
    warn_all(module, result.pop("warnings", []))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
