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
  - Frees the selected GPUs of a node and returns as soon as they are proven free, in four steps.
  - B(Look) - one snapshot of the GPUs, their compute apps and every process holding C(/dev/nvidia*).
  - B(Plan) - the units and containers to stop and the holders to signal, never a protected process, the module's own session, an
    NVML client or a process that uses only unselected GPUs. A refusal (a Kubernetes pod, a spanning process) fails here, before
    anything is done.
  - B(Act) - stop containers and units (bounded by O(kill_timeout)), then SIGTERM the holders left and SIGKILL those still alive
    after O(kill_timeout); a holder that SIGTERM cannot reach gets SIGKILL at once.
  - B(Verify) - poll C(memory.used) until every selected GPU reads at most O(max_used_mib), or fail after O(wait_timeout) naming each
    dirty GPU, its MiB and what holds it.
  - A host that is already clean is not touched (C(changed=false)). Every step and rule in detail -
    R(gpu_release in detail, ansible_collections.zeromib.gpu.docsite.guide_gpu_release).
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
      - Reports the plan (RV(stopped_units), and RV(killed) with C(signal=null) and the C(sigkill_at_once) each would get); a dirty
        host the real run would free passes. It fails where the real run certainly fails, with the same message.
  diff_mode:
    support: full
    details:
      - Per-GPU memory and holders, and the units, containers, processes and C(/dev/shm) files acted on, before and after (in check
        mode, the plan).
  platform:
    platforms: posix
options:
  gpus:
    description:
      - Indexes or UUIDs of the GPUs to free; empty selects every GPU nvidia-smi shows. Processes that use only other GPUs are left
        alone. A GPU this namespace cannot reach (RV(not_visible)) cannot be selected.
    type: list
    elements: str
    default: []
  services:
    description:
      - systemd units to stop even if they hold nothing now (globs allowed, V(vllm*.service); no suffix means C(.service)). Units
        missing on a host are listed in RV(services_not_found), so one list fits a mixed fleet.
      - V(container:<glob>) names Docker or Podman containers, V(supervisor:<glob>) supervisord programs, and
        V(lxc:<id>:<unit>), V(lxd:<name>:<unit>) or V(machine:<name>:<unit>) a system container's own units.
      - V(swarm:<service glob>) scales Docker Swarm services to 0 replicas through the Docker Engine API of this node (a Swarm
        manager; gpu_restore scales them back), and V(ray:) lets the run end the Ray workers on the selected GPUs - an actor Ray
        would start again (C(max_restarts)) through Ray itself, C(ray.kill(actor, no_restart=True)) with the node's own Ray
        installation, before any signal (RV(ray_actors)). Without them, holders that Swarm or a Ray node runs fail the run before
        anything is done, naming the command, for Ray each actor's own (RV(orchestrated)).
        R(Cluster runtimes, ansible_collections.zeromib.gpu.docsite.guide_orchestrators).
      - A glob never selects what keeps the node reachable and its data safe (network, storage, identity, remote access, time) nor a
        launcher; they are kept (RV(kept_units)). Every rule -
        R(services in detail, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.services).
    type: list
    elements: str
    default: []
  service_state:
    description:
      - What to leave the entries of O(services) in - V(stopped), V(disabled) (also not started at boot; for a container, restart
        policy C(no); for a supervisord program, C(autostart) and C(autorestart) off) or V(masked).
      - Units found through O(stop_owning_units) are only stopped.
        R(More in the gpu_release guide on service_state, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.service-state).
    type: str
    choices: [stopped, disabled, masked]
    default: stopped
  stop_owning_units:
    description:
      - Stop a holder inside a systemd C(.service) through its unit, so that C(Restart=) cannot start it again, when that unit is the
        GPU workload (its main process or their descendants hold the GPUs).
      - A launcher that merely started a holder (a scheduler, cron, Ray, Jupyter, a container engine, O(launchers), ...) is never
        stopped; its holders are signalled and it is listed in RV(launchers).
      - The unit is the one systemd says the holder runs in (a sub-cgroup a user names below her C(Delegate=yes) unit is her
        unit's). A unit without a main process (a oneshot with C(RemainAfterExit=yes)) is stopped for its holders only when
        O(services) names it; an essential unit never, and one that keeps the node reachable and its data safe only when named
        exactly - their holders are signalled and the unit is listed in RV(launchers).
        R(More in the gpu_release guide on stop_owning_units, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.stop-owning-units).
    type: bool
    default: true
  kill_spanning:
    description:
      - A process, unit or container that uses a selected GPU and GPUs outside O(gpus) (B(spanning)) fails the run before anything is
        done, naming it (RV(spanning)); V(true) ends it anyway.
        R(More in the gpu_release guide on kill_spanning, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.kill-spanning).
    type: bool
    default: false
  kill_checkpointed:
    description:
      - Where root's own C(cuda-checkpoint) exists, a holder that NVIDIA's cuda-checkpoint has checkpointed (its GPU memory moved
        to host memory, about 0 MiB on the GPU, taken back when it is restored) fails the run before anything is done, naming it;
        V(true) ends it anyway, and its saved state is lost. A running holder is locked and checkpointed before it is signalled.
        R(More in the node shapes guide, ansible_collections.zeromib.gpu.docsite.guide_node_shapes.cuda-checkpointed-processes).
    type: bool
    default: false
  launchers:
    description:
      - A site's own launchers, added to the built-in ones (see O(stop_owning_units)) - unit globs (V(mysched*.service)) or process
        name globs (V(my-agent*)).
    type: list
    elements: str
    default: []
  kill:
    description:
      - Signal the holders left after the units are stopped, and stop the containers found holding selected GPUs. With V(false) a GPU
        still held by a process left running fails the task at once, naming it.
    type: bool
    default: true
  match:
    description:
      - Python regular expressions searched in each holder's command line; when set, only matching holders (and their units) are
        acted on. O(services) are always acted on. An NVML client is signalled only when O(match) names it.
    type: list
    elements: str
    default: []
  kill_timeout:
    description:
      - Seconds between SIGTERM and SIGKILL; also how long a unit may take to stop before systemd kills it (RV(killed_units)), and a
        container's stop grace. A holder that SIGTERM cannot reach gets SIGKILL at once (C(sigkill_at_once) in RV(killed)).
    type: float
    default: 10
  wait_timeout:
    description:
      - Seconds to wait, after acting, for every selected GPU to read at most O(max_used_mib). The wait ends early, with a failure, when
        waiting cannot help (protected holders, no holder, O(kill=false)).
        R(More in the gpu_release guide on wait_timeout, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.wait-timeout).
    type: float
    default: 60
  poll_interval:
    description:
      - Seconds between memory reads while waiting. The driver frees memory 20-130 ms after a process exits.
    type: float
    default: 0.1
  clean_shm:
    description:
      - Once every selected GPU reads free, remove the files the jobs this run ended left in C(/dev/shm) (NCCL, torch, multiprocessing
        segments) that no process holds, so that the next job does not fail for want of space. Needs root; nothing is removed when the
        run fails.
      - A file goes only when it ties to a process this run ended - its name names that PID, or its owner had processes ended and runs
        none left that could open it. Another user's live block (a service's shared memory, held by no process) and a file of a job that
        ended before the run stay, named in RV(shm_kept) with why. Nothing is removed in a container whose C(/dev/shm) or IPC namespace
        may be shared with processes it cannot see (a Kubernetes pod's).
        R(Which files and how, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.clean-shm).
    type: bool
    default: false
  ready_fix:
    description:
      - Once every selected GPU reads free, set each one whose compute mode, power limit, application clocks or clock lock is off
        O(ready_profile) back to it with nvidia-smi's own setters (C(-c), C(-pl) to the default power limit, C(-rac), C(-rgc -rmc)), and
        record what each read before in the restore record, so that M(zeromib.gpu.gpu_restore) sets the inference side's settings
        back before it starts its units. The GPUs are then read again (RV(health_issues) says what they read now). Needs root. A
        pending ECC mode change needs a reset and is only reported; a clock lock's range cannot be read, so gpu_restore does not
        lock it again (it says so). Nothing is changed in check mode or when the run fails.
        R(More in the health guide, ansible_collections.zeromib.gpu.docsite.guide_health.training-ready-profile).
    type: bool
    default: false
  settle_timeout:
    description:
      - Seconds to keep watching, once the GPUs read clean, for a signalled holder that something starts again (a shell loop,
        supervisord, torchrun's agent, a container's restart policy). Only spent when such a restarter survived the signals.
    type: float
    default: 5
notes:
  - Needs root (O(ignore:become=true)) to see and signal other users' processes and to manage systemd units.
  - Every number is checked before anything runs (no V(nan), V(inf) or negatives; times at most one day).
  - The module never resets a GPU; leaked memory is said with the reset sequence that works on this node, or a reboot.
  - A failure after acting still returns what was done (RV(stopped_units), RV(killed), RV(killed_units), RV(stopped_containers)); what
    was stopped is recorded for M(zeromib.gpu.gpu_restore).
  - Containers, Kubernetes pods, restarters, MPS and the bytecode cache -
    R(rules for every run, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.notes).
seealso:
  - module: zeromib.gpu.gpu_facts
  - module: zeromib.gpu.gpu_restore
  - name: The gpu_release guide
    link: https://github.com/zeromib/gpu/blob/main/docs/docsite/rst/guide_gpu_release.rst
    description: Each step, option and rule of gpu_release in detail.
  - name: The troubleshooting guide
    link: https://github.com/zeromib/gpu/blob/main/docs/docsite/rst/guide_troubleshooting.rst
    description: What each failure message means and what to do.
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
given_to_vms:
  description:
    - NVIDIA GPUs bound to C(vfio-pci), given to VMs by PCI passthrough, and vGPUs of NVIDIA GPUs, as C(ansible_facts.gpu.given_to_vms)
      of M(zeromib.gpu.gpu_facts) reports them (C(bus), C(iommu_group), C(vm), C(pid), C(mdev)) - never selected, never acted on. The
      free_gpus role names the passthrough GPUs where C(free_gpus_expected_count) is short, and a vGPU host's failure the VMs holding
      the GPU's vGPUs, without reset advice.
  type: list
  elements: dict
  returned: always
  sample:
    - {bus: "0000:61:00.0", iommu_group: "42", vm: "train-vm (libvirt)", pid: 4812, mdev: null}
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
    - C(unpaused) is V(true) for a paused container named in O(services), unpaused through its runtime right before its stop (a paused
      container that O(services) does not name is refused, naming C(docker unpause NAME)).
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
failed_units:
  description:
    - Units of RV(killed_units) that systemd left V(failed) (C(Result=signal)); a warning names them. M(zeromib.gpu.gpu_restore) resets
      them (C(systemctl reset-failed)) before starting them again.
  type: list
  elements: str
  returned: always
  sample: [stubborn.service]
launchers:
  description:
    - Units that started holders of the selected GPUs but are not the workload (see O(stop_owning_units)), and units that own holders
      but are not stopped for them (essential, keeping the node reachable, or without a main process and not named in O(services)),
      with the holders signalled instead of stopping them and the C(reason). One entry per unit and Slurm job; C(slurm_job_id) comes
      from the holder's cgroup (C(job_<id>)) or its C(SLURM_JOB_ID); holders in a Slurm job outside any service (a
      C(slurmstepd.scope)) are listed too.
    - In check mode, the same plan.
  type: list
  elements: dict
  returned: always
  sample:
    - {unit: atd.service, reason: atd.service starts other jobs (scheduler, cron, hub, CI runner, container engine or supervisor),
       pids: [4242], slurm_job_id: null}
    - {unit: slurmd.service, reason: slurmd.service starts other jobs (scheduler, cron, hub, CI runner, container engine or supervisor),
       pids: [5120], slurm_job_id: "1734"}
orchestrated:
  description:
    - Holders of the selected GPUs that a cluster runtime starts again when they are killed, one entry per Ray node or Docker Swarm
      service - C(kind) (V(ray), V(swarm)), C(name), C(pids), C(gpu_indexes), C(command) (what stops it through the runtime) and
      C(entry) (the O(services) entry that lets gpu_release do so). A Ray node counts only when the identity rule vouches for it
      (a system unit's main process, or root running it from a system directory); a Swarm task by the labels Docker reports.
  type: list
  elements: dict
  returned: success
  sample:
    - {kind: swarm, name: vllm, pids: [4242], gpu_indexes: [0], command: docker service scale vllm=0, entry: "swarm:vllm"}
ray_actors:
  description:
    - With O(services) V(ray:), the Ray actors on the selected GPUs that Ray's GCS would start again (C(max_restarts) -1 or
      restarts left), ended through Ray (C(ray.kill(actor, no_restart=True))) before any signal - C(id), C(name), C(namespace),
      C(pid) (the actor's process, as the GCS reports it and the kernel confirms), C(class_name), C(max_restarts), C(holders) (the
      GPU holders it runs), C(command) (Ray's own command for it) and C(ended) (false in check mode, or where Ray no longer knew the
      actor by its name).
    - Empty or absent without V(ray:), or where no such actor holds a selected GPU.
  type: list
  elements: dict
  returned: success
  sample:
    - {id: 5f1c2e0a9b, name: trainer0, namespace: zm, pid: 4242, class_name: Trainer, max_restarts: -1, holders: [4260],
       command: "ray.kill(ray.get_actor('trainer0', namespace='zm'), no_restart=True)", ended: true}
scaled_services:
  description: Docker Swarm services this run scaled to 0 replicas (O(services) V(swarm:<glob>)); recorded for gpu_restore.
  type: list
  elements: str
  returned: success
  sample: [vllm]
multi_node:
  description:
    - Holders signalled that are ranks of a multi-node job, with C(pid) and C(launcher), the job - a Slurm job that Slurm (C(scontrol show job)) says
      spans more than one node, the job named by the kernel (the slurmstepd cgroup the process runs in, never its environment), as
      V(Slurm job 77 on 2 nodes) and its node list; else a torchrun with C(--nnodes) above 1 whose agent or rank the kernel shows
      connected to another host (its command line, PID and that peer). Their ranks on other nodes keep their GPUs until NCCL's
      timeout. A note, named in the host's first sentence, never a decision.
  type: list
  elements: dict
  returned: success
  sample: [{pid: 4242, launcher: "torchrun --nnodes 2 --nproc-per-node 8 train.py (PID 4100)"}]
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
checkpointed_holders:
  description:
    - Holders that root's own C(cuda-checkpoint) locked and checkpointed just before their signal (C(pid), C(name),
      C(state_before) V(running) or V(locked), C(checkpoint_s)); see O(kill_checkpointed).
  type: list
  elements: dict
  returned: when a root-owned cuda-checkpoint exists and the run signalled holders
  sample:
    - {pid: 812, name: python3, state_before: running, checkpoint_s: 0.41}
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
    - C(sigkill_at_once) says why a process got SIGKILL at once, without SIGTERM - V(ignores SIGTERM),
      V(init of its PID namespace, no SIGTERM handler), V(stopped (state T)), V(stopped by its tracer (state t)) or
      V(in a frozen cgroup (cgroup.freeze)); V(null) for a process that SIGTERM can reach.
      R(Why in the gpu_release guide on kill_timeout, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.kill-timeout).
    - In check mode, the processes that would be signalled, with C(signal=null) and the C(sigkill_at_once) they would get.
    - C(sleep_answer) is what the process's own vLLM server answered to C(GET /is_sleeping) (C(port), C(asleep)), as
      M(zeromib.gpu.gpu_facts) reports it for its holders; V(null) where nothing was asked or answered. Its server's word, quoted, that decides
      nothing.
  type: list
  elements: dict
  returned: always
  sample:
    - {pid: 495, name: python3, cmdline: python3 train.py, unit: null, container: null, gpu_indexes: [0], signal: SIGTERM, sigkill_at_once: null,
       sleep_answer: null, exited_after_s: 0.02}
    - {pid: 512, name: python3, cmdline: python3 serve.py, unit: null, container: null, gpu_indexes: [0], signal: SIGKILL,
       sigkill_at_once: "init of its PID namespace, no SIGTERM handler", sleep_answer: null, exited_after_s: 0.15}
    - {pid: 812, name: vllm, cmdline: vllm serve Qwen/Qwen3-8B, unit: null, container: null, gpu_indexes: [0], signal: SIGTERM,
       sigkill_at_once: null, sleep_answer: {port: 8000, asleep: true}, exited_after_s: 0.4}
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
ready_fixed:
  description:
    - With O(ready_fix), each GPU set back to the training-ready profile - C(index), C(uuid), C(changes) (plain words) and
      C(commands) (the nvidia-smi command lines run). V([]) when none was off it or O(ready_fix) is off.
  type: list
  elements: dict
  returned: always
  sample: [{index: 1, uuid: GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5, changes: ["compute mode Exclusive_Process -> Default"],
            commands: ["nvidia-smi -i GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5 -c 0"]}]
ghost_busy:
  description:
    - Each GPU this run killed a process on that still read busy (utilization at least 50 %) with no process and no memory - a
      ghost-busy GPU - said with what was seen and done - a CUDA context opened and closed on it from a fresh process (the smoke
      test's path), and what it reads now. One still busy after that is also a health issue, with the reset advice naming the
      processes that hold its device node (NVML handles block a reset). V([]) when there was none.
  type: list
  elements: str
  returned: always
ready_fix_errors:
  description: "With O(ready_fix), each setter that failed, as C(GPU <index> (<bus id>): nvidia-smi <args> failed: <why>)."
  type: list
  elements: str
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
    - The files O(clean_shm) removed from C(/dev/shm) (in check mode, would remove) - C(path), C(size_mib), C(age_s), C(pattern), C(user);
      at most 50, the largest (RV(truncated) counts them all).
  type: list
  elements: dict
  returned: always
  sample: [{path: /dev/shm/nccl-Xb3kLq, size_mib: 36.0, age_s: 12, pattern: nccl-*, user: alice}]
shm_kept:
  description:
    - The files of job patterns in C(/dev/shm) that O(clean_shm) kept because nothing ties them to a process this run ended, each with
      C(why) - C(path), C(size_mib), C(age_s), C(pattern), C(user), C(why). Empty without O(clean_shm) or when the run failed.
  type: list
  elements: dict
  returned: always
  sample: [{path: /dev/shm/psm_1a2b3c4d, size_mib: 1.0, age_s: 600, pattern: psm_*, user: bob, why: "this run ended no process of its owner (uid 4343)"}]
shm_removed_mib:
  description:
    - The MiB of all the files O(clean_shm) removed (in check mode, would remove), also those RV(shm_removed) does not list.
  type: float
  returned: always
  sample: 36.0
truncated:
  description:
    - The lists this result cut, each to its 50 most relevant entries (RV(holders) - those that keep a GPU from being free first;
      RV(killed), RV(shm_removed), RV(shm).unheld and every other list), as {list - how many entries it had}; V({}) when none was cut.
      No user sets the size of the result by starting processes or making files.
  type: dict
  returned: always
  sample: {holders: 3012}
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
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _caps
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log_state
from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi, NvidiaSmiError
from ansible_collections.zeromib.gpu.plugins.module_utils._act._release import Release, ReleaseError
from ansible_collections.zeromib.gpu.plugins.module_utils._act._system import System

# Built from the one option table (_options.OPTIONS); DOCUMENTATION above says the same (a test holds them equal).
ARGUMENT_SPEC = _options.argument_spec(_options.RELEASE)


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
    every = list(warnings)
    for warning in every[:_caps.LIMIT]:
        module.warn(f"{host}: {warning}")
    if len(every) > _caps.LIMIT:
        module.warn(f"{host}: and {len(every) - _caps.LIMIT:d} more warnings")


def ready_fixed(smi: NvidiaSmi, params: t.Mapping[str, t.Any], result: dict[str, t.Any], release: Release, check_mode: bool) -> dict[str, t.Any]:
    """The result with the GPUs put back to the training-ready profile (ready_fix; _ready_settings,
    as the Slurm epilog does it). _ready_settings is loaded only when asked for."""
    if not params["ready_fix"] or check_mode or not result.get("released") or release.health is None:
        return dict(result, ready_fixed=[], ready_fix_errors=[])
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ready_settings
    return _ready_settings.after_release(smi, result, release)


def ghosts_cleared(smi: NvidiaSmi, params: t.Mapping[str, t.Any], result: dict[str, t.Any], check_mode: bool) -> dict[str, t.Any]:
    """The result with `ghost_busy`: a GPU this run killed a process on that still reads busy with
    no process and no memory gets a CUDA context opened and closed from a fresh process, and is
    read again (_ghost_busy). Loaded only after kills: a clean gate does not pay for it."""
    result = dict(result, ghost_busy=[])
    if check_mode or not result.get("released") or not result.get("killed"):
        return result
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ghost_busy
    return _ghost_busy.after_release(smi, result, params["timeout"])


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
        smi.min_host_available_mib = params["min_host_available_mib"]
        system = System(module.get_bin_path("systemctl"), record_path=_record.PATH,
                        # Check mode writes nothing, not even the kernel log's cursor: a whole read.
                        kernel_log_state=None if module.check_mode else _kernel_log_state.PATH)
        # The options as one frozen record, made once here: the engine reads nothing else (_options.ReleaseOptions).
        release = Release(smi, system, _options.ReleaseOptions.from_params(params), check_mode=module.check_mode)
        # A plain dict from here: the module adds the host's health keys and the smoke test's.
        result: dict[str, t.Any] = dict(release.run())
        # The training-ready profile's settings (opt-in), before the diagnostic and the smoke test run work on the GPUs.
        result = ready_fixed(smi, params, result, release, module.check_mode)
        result = ghosts_cleared(smi, params, result, module.check_mode)
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
        module.fail_json(msg=exc.msg, **(_caps.cap_result(exc.result) if exc.result else {}))
    warn_all(module, result.pop("warnings", []))
    module.exit_json(**_caps.cap_result(result))


if __name__ == "__main__":
    main()
