#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_facts
short_description: Read every NVIDIA GPU of a node, and who holds it
version_added: 0.1.0
description:
  - Reads each GPU's state and compute apps with C(nvidia-smi) (C locale, bounded by O(timeout)), and scans C(/proc) for the processes
    that hold C(/dev/nvidia*), as C(fuser -v) does - also what nvidia-smi cannot see, such as the orphaned child of a dead owner.
  - Says which GPUs each process really uses (C(attribution) - V(listed), V(mapped), V(undecided), or an V(nvml_client), which never
    makes a host dirty), believing nothing a user of the node can set.
  - Checks nvidia-smi's GPUs against the driver's own list (a GPU left out is an error; one this namespace cannot reach is
    C(not_visible)), reads C(/dev/shm), and says whether each GPU is ready for work (C(healthy), C(health_issues)).
  - Returns the fact C(ansible_facts.gpu) and changes nothing but its own root-only caches (in check mode, nothing). Every reading in
    detail - R(what gpu_facts reads, ansible_collections.zeromib.gpu.docsite.guide_gpu_release.gpu-facts).
author:
  - zeromib.gpu contributors (@zeromib)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.facts
  - zeromib.gpu.nvidia_smi
  - zeromib.gpu.health
  - zeromib.gpu.smoke_test
attributes:
  check_mode:
    support: full
  diff_mode:
    support: none
  facts:
    support: full
  platform:
    platforms: posix
options:
  processes:
    description:
      - Also list compute apps and the processes holding C(/dev/nvidia*).
      - When V(false), RV(ansible_facts.gpu.clean) is decided by memory alone.
    type: bool
    default: true
  fail_on_error:
    description:
      - When V(false), a failing C(nvidia-smi) (missing, hung, driver not loaded, GPU lost) is reported in
        RV(ansible_facts.gpu.error) with RV(ansible_facts.gpu.clean=false) instead of failing the task. Meant for audits.
    type: bool
    default: true
notes:
  - Reading other users' C(/proc/PID/fd) needs root; run with O(ignore:become=true) or holders of other users stay unseen.
  - Takes two C(nvidia-smi) calls and one kernel log read, run in parallel, and one pass over C(/proc).
  - Every number is checked before anything runs - V(nan), V(inf) and negative values are refused, and O(timeout) must be greater
    than 0 and at most 86400 seconds (one day), O(xid_window_hours) at most 8760 (one year); a value past its bound fails naming the
    option and the bound (the same check as M(zeromib.gpu.gpu_release)'s).
  - The attribution rule and the readings it is derived from -
    R(which process uses which GPU, ansible_collections.zeromib.gpu.docsite.guide_attribution).
  - Managed nodes need Python 3.8 or later and the NVIDIA driver's C(nvidia-smi); no Python package.
seealso:
  - module: zeromib.gpu.gpu_release
  - name: The gpu_release guide
    link: https://github.com/zeromib/gpu/blob/main/docs/docsite/rst/guide_gpu_release.rst
    description: What gpu_facts reads, and each option of gpu_release, in detail.
requirements:
  - nvidia-smi from the NVIDIA driver on the managed node
"""

EXAMPLES = r"""
- name: Read the GPUs
  zeromib.gpu.gpu_facts:

- name: Fail unless every GPU reads 0 MiB and nothing holds one
  ansible.builtin.assert:
    that: ansible_facts.gpu.clean
    fail_msg: "{{ ansible_facts.gpu.gpus | rejectattr('clean') | map(attribute='index') | list }} in use"

- name: Audit without failing on broken drivers; MIG GPUs idle at ~55 MiB
  zeromib.gpu.gpu_facts:
    fail_on_error: false
    max_used_mib: 64
    timeout: 5

- name: Ready for training - accept PCIe Gen4, require MIG off, look back 48 h for Xids
  zeromib.gpu.gpu_facts:
    min_pcie_gen: 4
    expected_mig_mode: disabled
    xid_window_hours: 48

- name: Fail unless every GPU is healthy
  ansible.builtin.assert:
    that: ansible_facts.gpu.healthy
    fail_msg: "{{ ansible_facts.gpu.health_issues }}"

- name: Memory only, no process scan
  zeromib.gpu.gpu_facts:
    processes: false
"""

RETURN = r"""
ansible_facts:
  description: Facts added to the host.
  returned: always
  type: dict
  contains:
    gpu:
      description: The node's GPUs and who holds them.
      returned: always
      type: dict
      contains:
        driver_version:
          description: NVIDIA driver version.
          type: str
          returned: always
          sample: 580.159.04
        driver:
          description:
            - The loaded kernel module's version (C(/proc/driver/nvidia/version)) and the installed driver library's
              (C(libnvidia-ml.so.1) on disk), also when nvidia-smi fails.
            - C(mismatch) is V(true) when both are known and differ, when the driver was upgraded under the loaded module;
              running jobs go on, new CUDA jobs fail until a reboot (or a reload of the modules).
          type: dict
          returned: always
          sample: {loaded: 580.159.04, library: 580.178.04, library_path: /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.178.04, mismatch: true}
        cuda_version:
          description: CUDA version the driver supports (from C(libcuda)), V(null) when unknown.
          type: str
          returned: always
          sample: "13.0"
        count:
          description: Number of GPUs nvidia-smi shows (not those in RV(ansible_facts.gpu.not_visible)).
          type: int
          returned: always
          sample: 8
        clean:
          description:
            - V(true) when every GPU is clean and no live, unprotected process uses a GPU (C(attribution) V(listed),
              V(mapped) or V(undecided)). NVML clients do not count.
            - Always V(false) when RV(ansible_facts.gpu.error) is set.
          type: bool
          returned: always
        memory_used_mib:
          description: Memory used over all GPUs, V(null) when a GPU's memory is unknown or nvidia-smi failed.
          type: int
          returned: always
          sample: 10267
        error:
          description: What went wrong with nvidia-smi when O(fail_on_error=false), else V(null).
          type: str
          returned: always
          sample: nvidia-smi timed out after 10 s (a hung driver or a GPU that fell off the bus); it was killed
        not_visible:
          description:
            - Bus ids (the driver's spelling) of the GPUs the driver lists in C(/proc/driver/nvidia/gpus) that this namespace cannot
              reach, V([]) when it reaches them all. A container, a Slurm step with a device cgroup or C(docker --device) given only
              some of the host's GPUs sees the driver's list of them all, but nvidia-smi there shows only those whose device node
              C(/dev/nvidia<minor>) is present and may be opened.
            - Such a GPU is not this node's - it is neither counted, nor clean, nor an error. A GPU the driver lists, whose node this
              namespace can open and that nvidia-smi leaves out is an error (RV(ansible_facts.gpu.error)).
          type: list
          elements: str
          returned: always
          sample: ["0000:2a:00.0", "0000:3a:00.0"]
        given_to_vms:
          description:
            - NVIDIA GPUs given to VMs by PCI passthrough - bound to C(vfio-pci), so absent from nvidia-smi and the driver's list - as
              the kernel says (C(/sys/bus/pci/devices/<bus>/driver), C(vendor) C(0x10de), C(class) C(0x03xxxx), C(iommu_group)), then
              the vGPUs of NVIDIA GPUs (C(/sys/bus/mdev/devices/<uuid>), each with its own C(iommu_group)). V([]) on a node whose
              C(/dev/vfio) has no group (read in one directory listing).
            - Each has C(bus) (the GPU's; for a vGPU on a virtual function, its physical GPU's), C(iommu_group), C(mdev) (the vGPU's
              UUID, V(null) for passthrough), and C(vm) with C(pid), the VM process that holds C(/dev/vfio/<group>) open, found only
              in the VM scopes systemd made and confirms as its units (libvirt's C(machine.slice/machine-qemu-N-NAME.scope), named
              C(NAME (libvirt)); Proxmox's C(qemu.slice/VMID.scope), named C(Proxmox VM VMID)), root's all the way; V(null) when none
              holds it, or systemd does not confirm the scope. A process's name or command line names no VM.
            - Such a GPU is neither counted, nor clean, nor an error, nor missing - it is the VM's, and no reset is the host's to do. A
              vGPU's GPU is listed by nvidia-smi; memory no process of the host holds there is the VMs' framebuffer.
          type: list
          elements: dict
          returned: always
          sample:
            - {bus: "0000:61:00.0", iommu_group: "42", vm: "train-vm (libvirt)", pid: 4812, mdev: null}
        minor_order_differs:
          description:
            - V(true) when the GPUs' device nodes C(/dev/nvidia<minor>), in the order of their minor numbers, are not in nvidia-smi's
              index order (PCI bus order) - each GPU's C(minor_number) beside its C(index) in RV(ansible_facts.gpu.gpus) says which
              is which. Every tool that counts device files then names other GPUs than nvidia-smi - Slurm's C(File=/dev/nvidia[0-7])
              numbers a job's GPUs so (the hooks of the role C(zeromib.gpu.slurm_gpu_checks) map them; the audit flags such a node).
            - V(false) when both orders agree, V(null) when the driver's C(/proc/driver/nvidia/gpus) could not be read (C(minor_number) is
              then the index, assumed) or nvidia-smi failed.
          type: bool
          returned: always
          sample: false
        inside_container:
          description:
            - V(true) when this look ran in a container (a PID namespace other than the kernel's first - an LXC or LXD guest, an
              nspawn container, a Docker container or a Kubernetes pod), where the processes of the host and of other guests that
              share its GPUs are invisible - memory that no process here holds may be held there. V(false) on the host, V(null) when
              nvidia-smi failed.
          type: bool
          returned: always
          sample: false
        pending_restore:
          description:
            - What M(zeromib.gpu.gpu_release) stopped, disabled or masked on this host and M(zeromib.gpu.gpu_restore) has not put back
              yet (its record, C(/var/lib/zeromib-gpu/released.json)), V(null) when nothing is pending.
            - C(summary) has one line per entry (V(vllm.service stopped, disabled by zeromib at 2026-12-01T10:00:00Z)), C(entries)
              the record's entries; C(error) says why the record could not be read (it is root-only; run with O(ignore:become=true)).
          type: dict
          returned: always
          sample:
            path: /var/lib/zeromib-gpu/released.json
            updated_at: "2026-12-01T10:00:00Z"
            summary: ["vllm.service stopped, disabled by zeromib at 2026-12-01T10:00:00Z"]
            entries: [{kind: unit, name: vllm.service, actions: [stopped, disabled], active: true, unit_file_state: enabled}]
            error: null
        shm:
          description:
            - C(/dev/shm) - C(path), C(size_mib) and C(free_mib) (the space an unprivileged job may still use), C(files) (regular files in it;
              past 10,000 files or 1 s of reading the rest are only counted, V(null) when even that outlasts 1 s), C(files_read) (the
              files read and looked for holders, those the listing and clean_shm consider - those that take space or that a job's pattern
              names; an empty file of no job is counted, never listed),
              C(unheld) (the files no live process has open or mapped, largest and oldest first, at most 50 - C(path), C(size_mib) (what it
              takes in memory), C(age_s) (since it was last written), C(pattern) (the job framework's name pattern, V(null) for none known -
              V(nccl-*) NCCL, V(torch_*) PyTorch, V(cuda.shm.*) CUDA IPC handles, V(psm_*) Python's multiprocessing.shared_memory (vLLM),
              V(psm_shm.*) Omni-Path PSM/PSM2, V(sem.mp-*) Python multiprocessing semaphores, V(pym-*) its heap arenas, V(sem.*) other
              POSIX semaphores) and C(user)), C(unheld_count) and C(unheld_mib) (how many and their total, all of them), C(complete)
              (V(false) when some process could not be read, not root - a file it holds may be listed) and C(error) (why C(/dev/shm) could
              not be read).
            - C(unheld) is V(null) with O(processes=false). A file open through a path outside C(/dev/shm) under its name (a bind mount
              of it elsewhere) counts as held.
            - M(zeromib.gpu.gpu_release) with O(zeromib.gpu.gpu_release#module:clean_shm) removes the unheld files of a job pattern.
          type: dict
          returned: always
          sample:
            path: /dev/shm
            size_mib: 64304.2
            free_mib: 63856.2
            files: 16
            files_read: 16
            unheld: [{path: /dev/shm/torch_4242_1298412897_0, size_mib: 32.0, age_s: 41, pattern: torch_*, user: alice}]
            unheld_count: 14
            unheld_mib: 448.0
            complete: true
            error: null
        truncated:
          description:
            - The lists this fact cut, each to its 50 most relevant entries (C(holders) - those that keep a GPU from being free first;
              C(processes); C(shm.unheld) - the largest), as {list - how many entries it had}; V({}) when none was cut. No user sets the
              size of the answer by starting processes or making files.
          type: dict
          returned: always
          sample: {holders: 3012}
        healthy:
          description:
            - V(true) when no GPU has a health issue (and C(dcgmi diag), when asked for, passed). See RV(ansible_facts.gpu.health_issues).
            - V(false) also when C(/dev/shm) has less free space than O(shm_min_free_mib_per_gpu) for each GPU.
            - V(false) when RV(ansible_facts.gpu.error) is set.
          type: bool
          returned: always
        health_checked:
          description:
            - V(false) when some check could not be made on some GPU - a driver that does not know a health field, a reading of
              V([N/A]), an unreadable kernel log; each GPU's C(health_unchecked) names the checks and C(health.unchecked) says why.
          type: bool
          returned: always
        health_issues:
          description: "Every GPU's health issues as C(GPU <index> (<bus id>): <issue>), then a failed DCGM diagnostic."
          type: list
          elements: str
          returned: always
          sample: ["GPU 3 (00000000:5D:00.0): 1 uncorrectable ECC error since the driver loaded"]
        health:
          description:
            - C(kernel_log) - where the Xids were read (C(source) V(journalctl) or V(dmesg)), C(error) when it could not be read,
              C(fallback) (why journalctl was passed over for dmesg, such as a journalctl that has no journal),
              C(driver_loaded) (the driver's load line in the window; V(null) when it loaded before the window), C(window_hours), C(elapsed_s),
              C(incremental) (V(true) when journalctl read only the lines after the last look's cursor, kept in
              C(/var/lib/zeromib-gpu/kernel-log.json); the lines kept from it are judged again with the new ones).
            - C(fabric_manager) - where a GPU has a fabric (C(fabric.state) not N/A), what the host has of Fabric Manager, as
              context for the GPU's own reading - C(unit) (C(load_state), C(active_state), C(sub_state) of C(systemctl show
              nvidia-fabricmanager); C(load_state) V(not-found) when there is no such unit; V(null) when systemd could not be
              asked, C(unit_error) says why), C(binary) (C(nv-fabricmanager) on PATH, else under the GPU Operator's
              C(/run/nvidia/driver)), C(version) (C(nv-fabricmanager --version) of a host binary), C(version_error), C(note)
              (a plain sentence when nothing was found, or only the GPU Operator's binary); else V(null).
            - C(dcgm_diag) - V(null) unless O(dcgm_diag) was set; else C(level), C(ran), C(passed), C(summary), C(elapsed_s).
          type: dict
          returned: always
          sample:
            kernel_log: {source: journalctl, error: null, fallback: null, driver_loaded: null, incremental: true, window_hours: 24, elapsed_s: 0.012}
            fabric_manager: null
            dcgm_diag: null
        smoke_test_passed:
          description:
            - With O(smoke_test), V(true) when every GPU passed the CUDA smoke test, V(false) when one failed, V(null) when some GPU
              was not tested (in use, MIG mode, check mode) - a skipped test is never reported as passed. V(null) when not asked.
          type: bool
          returned: always
        smoke_test_issues:
          description: "Each GPU that failed the smoke test as C(GPU <index> (<bus id>): <error>)."
          type: list
          elements: str
          returned: always
          sample: ["GPU 0 (00000000:18:00.0): CUDA_ERROR_SYSTEM_NOT_READY (802) at cuCtxCreate: system not yet initialized"]
        smoke_test_s:
          description: Seconds the smoke test took (a test process for all GPUs, the memory read after it); V(null) when none ran.
          type: float
          returned: when O(smoke_test=true)
        gpus:
          description:
            - One entry per GPU. V([N/A]) and other bracketed values read as V(null).
            - C(minor_number) is the GPU's device minor number (C(/dev/nvidia<minor_number>), the driver's C(Device Minor:)), which need not
              be its C(index) (see RV(ansible_facts.gpu.minor_order_differs)); the index where the driver's files cannot be read.
            - With O(smoke_test), C(smoke_test) - C(ok) (V(null) when not tested), C(error), C(seconds), C(mib), C(skipped) (why not
              tested - in use by a process, MIG mode, check mode) and C(memory_used_mib_after); V(null) without O(smoke_test).
            - C(healthy) is V(false) when C(health_issues) (plain sentences) is not empty; C(health_unchecked) lists the checks that
              could not run (V(ecc), V(row_remap), V(retired_pages), V(pcie), V(clocks), V(persistence), V(mig),
              V(recovery_action), V(fabric), V(xid), and the training-ready profile's V(compute_mode), V(clock_settings),
              V(power_limit), V(ecc_mode); C(health.unchecked) says why); C(health_checked) is V(true) only when it is empty.
            - C(health) holds the readings - C(ecc_uncorrected_volatile), C(remapped_rows_pending), C(remapped_rows_failure),
              C(retired_pages_pending), C(pcie_link_gen_current), C(pcie_link_gen_max), C(pcie_link_width_current),
              C(pcie_link_width_max), C(pstate), C(slowdown) (active hardware or thermal slowdown reasons), C(mig_mode_pending),
              C(recovery_action), C(fabric_state), C(fabric_status), C(fabric_health_summary), C(xids) (this GPU's Xid lines of the kernel log in the window
              since the driver loaded, each C(xid), C(time), C(message), C(action) (NVIDIA's catalog) and C(fault)),
              C(xids_before_driver_load) and C(unchecked).
            - C(health.ready) holds the training-ready profile's readings (O(ready_profile)) - C(compute_mode), C(power_limit_w),
              C(power_default_limit_w), C(app_clocks_graphics_mhz), C(app_clocks_graphics_default_mhz), C(app_clocks_memory_mhz),
              C(app_clocks_memory_default_mhz), C(clocks_user_limited) (the applications-clocks event reason is active),
              C(ecc_mode), C(ecc_mode_pending), C(utilization_gpu_pct), C(power_draw_w), and C(profile), the profile checked.
            - C(clean) is V(true) when C(memory_used_mib) is at most O(max_used_mib), or when C(cross_gpu_footprint) is V(true).
            - C(memory_proof) says how the GPU was proven free - V(memory.used) (its reading, at most O(max_used_mib)), or V(unified memory)
              for a GPU that shares the host's memory (GB10 / DGX Spark, Jetson; C(memory.total), C(memory.used) and C(memory.free) read
              V([N/A])), then C(memory_used_mib) is the sum of its compute processes' C(used_memory) and the GPU is clean when no compute
              process is on it and C(host_memory_available_mib) (the host's MemAvailable) is at least O(min_host_available_mib);
              C(host_memory_available_mib) is V(null) on other GPUs.
            - C(cross_gpu_footprint) is V(true) for a GPU that no process uses and whose memory above O(max_used_mib) is at most
              O(cross_gpu_footprint_mib), while contexts live on other GPUs.
          type: list
          elements: dict
          returned: always
          sample:
            - index: 0
              uuid: GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5
              name: NVIDIA H200
              pci_bus_id: "00000000:00:06.0"
              minor_number: 0
              memory_total_mib: 143771
              memory_used_mib: 10267
              memory_reserved_mib: 616
              memory_free_mib: 132890
              memory_proof: memory.used
              host_memory_available_mib: null
              utilization_gpu_pct: 0
              temperature_c: 43
              power_draw_w: 120.0
              persistence_mode: Enabled
              mig_mode: Disabled
              clean: false
              cross_gpu_footprint: false
              healthy: true
              health_checked: true
              health_unchecked: []
              health_issues: []
              health:
                ecc_uncorrected_volatile: 0
                remapped_rows_pending: false
                remapped_rows_failure: false
                retired_pages_pending: null
                pcie_link_gen_current: 5
                pcie_link_gen_max: 5
                pcie_link_width_current: 16
                pcie_link_width_max: 16
                pstate: P0
                slowdown: []
                mig_mode_pending: Disabled
                recovery_action: None
                fabric_state: null
                fabric_status: null
                fabric_health_summary: null
                xids: []
                xids_before_driver_load: []
                unchecked: []
                ready:
                  compute_mode: Default
                  power_limit_w: 700.0
                  power_default_limit_w: 700.0
                  app_clocks_graphics_mhz: null
                  app_clocks_graphics_default_mhz: null
                  app_clocks_memory_mhz: null
                  app_clocks_memory_default_mhz: null
                  clocks_user_limited: false
                  ecc_mode: Enabled
                  ecc_mode_pending: Enabled
                  utilization_gpu_pct: 0
                  power_draw_w: 120.0
                  profile: {compute_mode: default, clocks: default, power_limit: default}
        processes:
          description:
            - Compute apps from nvidia-smi (asked as C(pid,gpu_uuid,used_memory), never with process names), joined to GPUs by
              UUID. C(name) is the process's C(argv[0]) from C(/proc), for display only, V([Not Found]) for a dead owner.
          type: list
          elements: dict
          returned: always
          sample:
            - {pid: 426, name: python3, used_memory_mib: 6662, gpu_uuid: GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5, gpu_index: 0, alive: true}
        holders:
          description:
            - Processes with a C(/dev/nvidia*) node open or mapped, as C(fuser -v) shows them.
            - C(gpu_indexes) are the GPUs the process really uses, C(attribution) says why - V(listed) (nvidia-smi lists it on
              them), V(mapped) (its context-sized mapping of their device files), V(undecided) (it maps per-GPU device files but
              none context-sized; C(candidate_gpu_indexes) are the GPUs it may use) or V(nvml_client) (it maps no per-GPU
              device file and is not listed, such as C(nvidia-smi dmon), an exporter, C(nvidia-persistenced); it uses no
              GPU memory, C(gpu_indexes) is empty and it does not make a host dirty).
            - V(blocked) (C(blocked=true)) is a process whose C(/proc) entries did not answer within the scan's budget (a process in
              C(execve) closing a file of a FUSE or NFS mount that stopped answering, a process stuck in the kernel); it is told from
              C(/proc/PID/status) alone (C(cmdline) empty, C(start_time) null), C(wchan) is where it sleeps (null when that did not
              answer either) and C(waits_in) where the scan's read of it waited. It may use any GPU (C(candidate_gpu_indexes) lists
              them all), so the host is not clean beside it, and gpu_release never signals it. The scan waits on no process longer
              than a quarter of O(timeout) (at most 0.5 s) and ends within O(timeout) in all; processes it did not reach make the host
              not clean, with a warning.
            - A thread-group leader that exited while its other threads run on (state V(Z), C(ps) shows C(Zl <defunct>)) is read
              through a live thread and reported with state V(Z) like any holder.
            - C(container) is the container id from the process's cgroup path (Docker, Podman, containerd, CRI-O, Kubernetes),
              C(container_runtime) the runtime the path names (V(docker), V(podman), V(containerd), V(cri-o); V(null) for a Kubernetes
              pod on the cgroupfs driver unless Docker knows the container). C(container_name) and C(container_image) come from the
              runtime (Docker or Podman, through its API socket or its CLI) and are V(null) where it cannot be asked.
            - C(pod) is V(namespace/name) of the Kubernetes pod (from the container's C(io.kubernetes.pod.*) labels, or crictl), C(pod_uid)
              its UID (from the cgroup path); both V(null) outside Kubernetes, and for a container whose cgroup is not under C(kubepods)
              whatever its labels say.
            - C(unit) is the host's systemd unit the process runs in, as systemd says it - the first C(.service) or C(.scope) of its
              cgroup path, kept only where that unit's C(ControlGroup=) is that directory, else V(null). Below a unit that delegates its
              cgroup (C(Delegate=yes), C(user@UID.service)) the names are its user's, and the unit is the delegating one
              (C(lab-alice.service) for a process in its C(networking.service) sub-cgroup).
            - Device files are known by kernel identity (device number, or the inode of the node's own C(/dev/nvidiaN)), not by path.
              A name protects only a process whose identity backs it; C(protection_note) says why a process named like a protected
              daemon is not protected, C(container_note) why a cgroup path naming a container or pod was not believed (a user-delegated
              subtree, or the runtime does not run the process there), or why a container's C(io.kubernetes.pod.*) labels make no pod (its
              cgroup is not under C(kubepods), where a kubelet puts its pods). See the collection's C(docs/docsite/rst/guide_security.rst).
            - C(guest) is the system container the process runs in, seen from the host (Proxmox LXC C(/lxc/<id>/ns), LXD
              C(/lxc.payload.<name>), systemd-nspawn C(/machine.slice/systemd-nspawn@<name>.service/payload) or C(machine-<name>.scope)
              in its cgroup path), V(null) elsewhere - C(kind) (V(lxc), V(lxd), V(nspawn)), C(name) (the VMID or the guest's name),
              C(unit) (the guest's own unit of the process, V(null) where none), C(init_pid) (the host PID of the guest's init) and
              C(manager) (the system manager that init is, such as V(systemd); V(null) when it is none). Such a process's C(unit) is
              V(null) - its unit is the guest's, never the host's. See the collection's C(docs/docsite/rst/guide_system_containers.rst).
            - C(origin) is where a process outside every job, unit and container came from, V(null) elsewhere - C(kind)
              (V(ssh_session), V(login_session), V(apptainer_instance), V(detached)), C(session) (the login session's id, V(null)
              outside one), C(text) (the words a failure says) and C(stop) (what ends it, such as V(loginctl terminate-session 5) or
              V(apptainer instance stop train)); for V(apptainer_instance) also C(user), the user that command runs as (the starter's
              real uid, V(null) without a name). A login session is named from the kernel's cgroup path, systemd's unit and logind's
              root-owned record, an Apptainer instance from an ancestor running root's starter (its name quoted as its user's word),
              never from the process's name. See the collection's C(docs/docsite/rst/guide_node_shapes.rst).
            - C(sleep_answer) is what the process's own vLLM server answered to C(GET /is_sleeping) - C(port) and C(asleep) (V(true) when it
              says it is in vLLM's sleep mode, which keeps its CUDA context and memory) - and V(null) where nothing was asked or answered.
              Asked only of a holder, over loopback, on a port the kernel shows it (or its parent of the same user and cgroup, such as vLLM
              V1's API server) listening on with a socket of its own user; bounded in time and size. The server's word, quoted, that decides
              nothing. See the collection's C(docs/docsite/rst/guide_node_shapes.rst).
          type: list
          elements: dict
          returned: always
          sample:
            - pid: 495
              ppid: 1
              name: python3
              cmdline: python3 train.py
              user: root
              state: S
              start_time: 123456
              devices: [/dev/nvidia0, /dev/nvidia1, /dev/nvidiactl, /dev/nvidia-uvm]
              gpu_indexes: [0]
              attribution: listed
              candidate_gpu_indexes: []
              unit: null
              container: 4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a
              container_runtime: docker
              container_name: vllm
              container_image: vllm/vllm-openai:v0.11.0
              pod: null
              pod_uid: null
              guest: null
              origin: null
              sleep_answer: null
              protected: false
              protection_note: null
              container_note: null
            - pid: 4101
              ppid: 4100
              name: python3
              cmdline: python3 -m vllm.entrypoints.openai.api_server
              user: root
              state: S
              start_time: 654321
              devices: [/dev/nvidia4, /dev/nvidiactl, /dev/nvidia-uvm]
              gpu_indexes: [4]
              attribution: listed
              candidate_gpu_indexes: []
              unit: null
              container: null
              container_runtime: null
              container_name: null
              container_image: null
              pod: null
              pod_uid: null
              guest: {kind: lxc, name: "101", unit: vllm.service, init_pid: 4000, manager: systemd}
              sleep_answer: {port: 8000, asleep: true}
              protected: false
              protection_note: null
              container_note: null
              blocked: false
              wchan: null
              waits_in: null
"""

import atexit
import typing as t

from ansible.module_utils.basic import AnsibleModule

# First of the collection's imports: the module_utils below are then compiled once, not twice (_compile_once).
from ansible_collections.zeromib.gpu.plugins.module_utils import _compile_once
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _caps
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cuda_smoke
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log_state
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _shm
from ansible_collections.zeromib.gpu.plugins.module_utils import _record
from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi, NvidiaSmiError, driver_versions

# Built from the one option table (_options.OPTIONS); DOCUMENTATION above says the same (a test holds them equal).
ARGUMENT_SPEC = _options.argument_spec(_options.FACTS)


def checked_params(params: t.Mapping[str, t.Any]) -> str | None:
    """A clear message for an option value the argument spec cannot check (NaN, a negative), or None."""
    return "; ".join(_options.check(params)) or None


def gather(params: t.Mapping[str, t.Any], which: t.Callable[[str], str | None] | None = None,
           check_mode: bool = False) -> tuple[dict[str, t.Any], list[str]]:
    """Options -> (the ansible_facts.gpu dict, warnings). Raises NvidiaSmiError.
    `which(name)` finds dcgmi (None: not installed)."""
    smi = NvidiaSmi(NvidiaSmi.find(params["nvidia_smi"]), params["timeout"])
    smi.min_host_available_mib = params["min_host_available_mib"]
    # The look's options as one record, made once here (_options.LookOptions).
    options = _options.LookOptions.from_params(params)
    # Check mode writes nothing, not even the kernel log's cursor: a whole read.
    snapshot = _facts.look_at(smi, _facts.Request.from_options(options, kernel_log_state=None if check_mode else _kernel_log_state.PATH))
    dcgm = _health.dcgm_diag(params.get("dcgm_diag") or 0, which or (lambda name: None))
    facts = _facts.assemble(_facts.Findings.of_snapshot(snapshot, max_used_mib=params["max_used_mib"], with_processes=params["processes"],
                                                        cuda_version=_facts.cuda_driver_version(), dcgm=dcgm))
    facts["minor_order_differs"] = snapshot.minor_order_differs
    facts["given_to_vms"] = snapshot.given_to_vms
    _cuda_smoke.for_facts(smi, params, facts, snapshot, check_mode)
    facts["shm"] = _shm.look(processes=params["processes"], deadline_s=params["timeout"])
    if params["health"]:
        facts = _shm.with_floor(facts, _shm.floor_issue(facts["shm"], params["shm_min_free_mib_per_gpu"], facts["count"]))
    return facts, _facts.scan_warnings(snapshot)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    if not module.check_mode:
        # The code this run compiled, kept on the node for the next run (_compile_once), whichever
        # way the module exits; check mode writes nothing.
        atexit.register(_compile_once.keep)
    problem = checked_params(module.params)
    if problem:
        module.fail_json(msg=problem)
    try:
        facts, warnings = gather(module.params, module.get_bin_path, module.check_mode)
    except NvidiaSmiError as exc:
        if module.params["fail_on_error"]:
            module.fail_json(**exc.details())
        facts, warnings = _facts.failed_facts(exc.msg), []
        facts.update(_cuda_smoke.summary([], asked=False))
        facts["shm"] = _shm.look(processes=module.params["processes"], deadline_s=module.params["timeout"])
    for warning in warnings:
        module.warn(warning)
    # A host whose inference servers are still stopped by zeromib (gpu_restore not run yet).
    facts["pending_restore"] = _record.pending()
    # The loaded module against the library on disk: a drift fails new CUDA jobs, so the audit says it first.
    facts["driver"] = driver_versions()
    module.exit_json(changed=False, ansible_facts={"gpu": _caps.cap_result(facts)})


if __name__ == "__main__":
    main()
