# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: gpu_audit_model
short_description: Build the fleet GPU audit report from per-host results
version_added: 0.1.0
author: zeromib.gpu developers
description:
  - Turns one record per audited host into the report model that C(playbooks/audit_gpus.yml)
    writes as C(report.json) and renders as Markdown, HTML and Prometheus text.
  - Decides each host's status, V(clean), V(dirty), V(error) or V(unreachable), with a one-line
    reason for every host that is not clean, and counts hosts, GPUs, MiB and holders.
  - Hosts are sorted by name, with digits compared as numbers (V(node2) before V(node10)).
  - Pure data in, pure data out; it touches no host and no file.
positional: generated_at
options:
  _input:
    description:
      - One dictionary per host.
      - C(host) (str, required) is the inventory name.
      - C(status) is V(ok) when C(zeromib.gpu.gpu_facts) answered (the default),
        V(error) (or V(failed)) when the module failed, V(unreachable) when Ansible could not
        connect.
      - C(error) is the message for V(error) and V(unreachable).
      - C(gpu) is the host's C(ansible_facts.gpu) as C(zeromib.gpu.gpu_facts) returns it. Facts
        whose own C(error) is set (O(zeromib.gpu.gpu_facts#module:fail_on_error=false)) make the
        host V(error).
    type: list
    elements: dict
    required: true
  generated_at:
    description:
      - When the audit ran, as seconds since the epoch. Defaults to now.
    type: float
  expected_hosts:
    description:
      - Every host the audit targeted. One without a record in the input is reported as V(error)
        (the audit stopped on it before recording a result) instead of silently missing.
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Build the report from per-host records
  ansible.builtin.set_fact:
    gpu_report: "{{ hosts_data | zeromib.gpu.gpu_audit_model }}"
  vars:
    hosts_data:
      - host: node01
        status: ok
        error: null
        gpu: "{{ hostvars['node01'].ansible_facts.gpu }}"
      - host: node02
        status: unreachable
        error: "Failed to connect to the host via ssh: Connection timed out"
        gpu: null

- name: Say how the fleet looks
  ansible.builtin.debug:
    msg: "{{ gpu_report.summary.hosts_clean }} of {{ gpu_report.summary.hosts_total }} hosts are clean"
"""

RETURN = r"""
_value:
  description: The report model.
  type: dict
  contains:
    schema_version:
      description: Version of this structure; bumped on incompatible changes.
      type: int
      sample: 1
    generated_at:
      description: When the audit ran, ISO 8601 in UTC.
      type: str
      sample: "2025-06-01T12:00:00Z"
    generated_epoch:
      description: When the audit ran, seconds since the epoch.
      type: float
    max_gpu_count:
      description: The largest GPU count of any host (at least 1); the width of the heat map.
      type: int
    summary:
      description: Fleet totals.
      type: dict
      contains:
        hosts_total: {description: Hosts audited., type: int}
        hosts_clean: {description: Hosts whose GPUs are all clean and held by no unprotected process., type: int}
        hosts_dirty: {description: Hosts that answered and are not clean., type: int}
        hosts_error: {description: Hosts where the module or nvidia-smi failed., type: int}
        hosts_unreachable: {description: Hosts Ansible could not reach., type: int}
        gpus_total: {description: GPUs reported by the hosts that answered., type: int}
        gpus_clean: {description: GPUs at or below the host's C(max_used_mib)., type: int}
        gpus_unhealthy: {description: GPUs with a health issue (C(healthy=false))., type: int}
        hosts_unhealthy: {description: Hosts that answered with at least one unhealthy GPU., type: int}
        gpus_health_unchecked: {description: GPUs whose health was not fully checked (C(health_checked=false))., type: int}
        hosts_health_unchecked: {description: Hosts that answered with at least one such GPU., type: int}
        hosts_pending_restore: {description: Hosts with a pending restore (a non-empty C(pending_restore))., type: int}
        gpus_dirty: {description: GPUs above it., type: int}
        memory_used_mib: {description: MiB used over all GPUs., type: int}
        memory_total_mib: {description: MiB installed over all GPUs., type: int}
        holders: {description: Unprotected processes using GPU memory (C(attribution) other than V(nvml_client))., type: int}
        nvml_clients:
          description:
            - NVML clients on the hosts that answered (C(attribution=nvml_client)), protected ones included,
              such as C(nvidia-smi dmon), exporters or C(nvidia-persistenced). They open the device files but use no
              GPU memory and never make a host dirty.
          type: int
        holders_not_listed:
          description:
            - Processes holding device files that the hosts' C(holders) do not list (each host lists its 10 most relevant, those
              that keep a GPU from being free first, and gpu_facts' own cap counts in its C(truncated)).
          type: int
    hosts:
      description: One entry per host, sorted by name.
      type: list
      elements: dict
      contains:
        host: {description: Inventory name., type: str}
        status: {description: "V(clean), V(dirty), V(error) or V(unreachable).", type: str}
        up: {description: Whether the host answered with GPU facts (V(clean) or V(dirty))., type: bool}
        reason: {description: Why the host is not clean; V(null) when it is., type: str}
        pending_restore:
          description:
            - What zeromib stopped on the host and C(zeromib.gpu.gpu_restore) has not put back yet, one line per unit or container
              (V(vllm.service stopped, disabled by zeromib at 2026-12-01T10:00:00Z)); empty when nothing is pending.
          type: list
          elements: str
        pending_restore_entries:
          description:
            - The same record, one dict per entry, for the report's "Pending restores" - C(what) (V(vllm.service),
              V(container vllm), V(supervisor program vllm)), C(kind), C(actions) (V(stopped, disabled)), C(since) (when the release
              that first changed it ran) and C(by) (the login user of that run, V(null) when unknown). An unreadable record is one
              entry with C(kind=null) and the reason in C(actions).
          type: list
          elements: dict
        not_visible:
          description:
            - Bus ids of the GPUs the host's driver lists that its namespace cannot reach (gpu_facts' C(not_visible)), such as the other
              GPUs of the physical host in a container given some of them; empty when it reaches them all. Not counted, neither clean
              nor dirty.
          type: list
          elements: str
        minor_order_differs:
          description:
            - V(true) when the host's GPU device nodes C(/dev/nvidia<minor>), in the order of their minor numbers, are not in nvidia-smi's
              index order (gpu_facts' C(minor_order_differs); each GPU's C(minor_number) says which is which) - every tool that counts
              device files, Slurm's C(File=/dev/nvidia[0-7]) among them, names other GPUs there than nvidia-smi. V(null) when unknown.
          type: bool
        inside_container:
          description:
            - V(true) when the host's gpu_facts ran in a container (an LXC/LXD/nspawn guest, a pod; gpu_facts' C(inside_container));
              memory no process there holds may be held by the host or another guest sharing the GPU, so the reason of a dirty host
              says to look on the host rather than pointing at a gone PID.
          type: bool
        driver_version: {description: NVIDIA driver version., type: str}
        cuda_version: {description: CUDA version the driver supports., type: str}
        gpu_count: {description: GPUs found; V(null) when the host did not answer., type: int}
        memory_used_mib: {description: MiB used over the host's GPUs., type: int}
        memory_total_mib: {description: MiB installed over the host's GPUs., type: int}
        used_pct: {description: "Used share of the host's GPU memory in percent, one decimal.", type: float}
        dirty_gpus: {description: Indexes of the GPUs that are not clean., type: list, elements: int}
        footprint_gpus:
          description:
            - Indexes of the GPUs that are clean although they read more than C(max_used_mib), because what they
              read is only the cross-GPU footprint of contexts on other GPUs (C(cross_gpu_footprint)).
          type: list
          elements: int
        holders_not_listed:
          description:
            - How many more processes hold the host's device files than its C(holders) lists (at most 10, those that keep a GPU
              from being free first); a user who starts thousands of them sets no size of the report.
          type: int
        nvml_clients:
          description: The host's holders whose C(attribution) is V(nvml_client) (also in C(holders)).
          type: list
          elements: dict
        healthy: {description: "gpu_facts' host verdict on GPU health; V(null) when it read none.", type: bool}
        health_issues:
          description:
            - "Every GPU's health issues, C(GPU <index> (<bus id>): <issue>)."
            - Ages in seconds read as people say them (V(Xid 79 ... 2 h ago), not V(at 7200 s ago)).
          type: list
          elements: str
        unhealthy_gpus: {description: Indexes of the GPUs with a health issue., type: list, elements: int}
        health_checked:
          description: "gpu_facts' C(health_checked) - V(false) when some health check could not be made on some GPU; V(null) when it read no health."
          type: bool
        unchecked_gpus: {description: Indexes of the GPUs whose health was not fully checked (C(health_checked=false))., type: list, elements: int}
        health_reason:
          description:
            - Why the host's GPUs are not ready for work, or not known to be - its health issues, then what could not be checked on
              which GPU; V(null) when every GPU is healthy and fully checked (or the host did not answer).
            - A host with a health reason is listed under "Hosts that need attention" even when its memory is clean.
          type: str
        gpus:
          description:
            - The host's GPUs as C(gpu_facts) returns them, plus C(host), C(used_pct) (one
              decimal, V(null) when unknown), C(holders) (the holders of this GPU, protected ones
              included) and C(processes) (nvidia-smi's compute apps on it).
            - C(smoke_test) is the GPU's last CUDA smoke test when the facts carry one (C(gpu_audit_smoke_test)),
              with C(result) V(passed), V(FAILED) or V(skipped); V(null) otherwise.
          type: list
          elements: dict
        holders:
          description:
            - The host's holders as C(gpu_facts) returns them, plus C(host), C(used_memory_mib)
              (what nvidia-smi attributes to the PID, V(null) if nothing), C(nvml_client) (its C(attribution)
              is V(nvml_client), so it uses no GPU), C(blocking) (unprotected and using a GPU, or V(undecided),
              so it makes the host dirty), C(spanning) (it uses more than one GPU - JAX, DataParallel, an MPS server - so
              freeing only some of them fails unless C(kill_spanning) is set; the reason says V(uses GPUs 0,1)) and
              C(container_label) (the container as the report shows it next to the PID, V(vllm (vllm/vllm-openai:v0.11.0))
              with the name and image its runtime gave, else the short id; prefixed with the Kubernetes pod; V(null) outside containers)
              and C(guest_label) (the system container it runs in, seen from the host, with the guest's own unit,
              such as V(LXC guest 101) followed by the unit; V(null) outside guests).
          type: list
          elements: dict
        stale_processes:
          description:
            - Compute apps whose PID is gone (C(alive=false)) while nvidia-smi still counts their
              memory; usually a forked child still holds it, else only a reboot or GPU reset frees it. On a host
              whose C(inside_container) is V(true) (gpu_facts ran in a container), such a PID is usually a process of the
              host or of another guest sharing the GPU, which the container cannot see; the reason says to look on the host.
          type: list
          elements: dict
"""

import typing as t
from collections.abc import Mapping, Sequence

from ansible.errors import AnsibleFilterError

from ansible_collections.zeromib.gpu.plugins.plugin_utils._audit_model import age_text, human_ages, model_of
from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain

# The model is plugin_utils/_audit_model.py's (the report action uses it too); its age formatters are named here.
__all__ = ["FilterModule", "age_text", "gpu_audit_model", "human_ages", "model_of"]


def gpu_audit_model(hosts: t.Any, generated_at: t.Any = None, expected_hosts: t.Any = None) -> dict[str, t.Any]:
    if isinstance(hosts, Mapping) or not isinstance(hosts, Sequence) or isinstance(hosts, str):
        raise AnsibleFilterError(f"zeromib.gpu.gpu_audit_model expects a list of host records, got {type(hosts).__name__}")
    return model_of([plain(entry) for entry in hosts], generated_at, plain(expected_hosts))


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"gpu_audit_model": gpu_audit_model}
