#!/usr/bin/python
# -*- coding: utf-8 -*-
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
  - B(Plan) - the units named in O(services) that are active (or, per O(service_state), enabled or not masked); the systemd services
    that own holders (O(stop_owning_units)); the Docker and Podman containers named in O(services) or holding a selected GPU; and the
    holders left to signal, never a protected process, never PID 1, never the module's own Ansible session, never a process that holds
    only unselected GPUs. A holder in a Kubernetes pod fails the run here, before anything is done.
  - B(Act) - stop the containers through their runtime (after setting the restart policy of named ones to C(no) with
    O(service_state=disabled)), C(systemctl stop) the units (then C(disable) or C(mask) the named ones), SIGTERM the remaining holders,
    SIGKILL those still alive after O(kill_timeout). Before every signal the PID's start time is checked again, so a reused PID is never
    signalled.
  - B(Verify) - poll C(memory.used) every O(poll_interval) until every selected GPU reads at most O(max_used_mib), or fail after
    O(wait_timeout) with one message naming each dirty GPU, its MiB and what still holds it. When something was signalled that a
    restart policy outside this run's control may start again, watch a short settle window before answering (see the notes).
  - A host that is already clean is not touched and reports C(changed=false).
author:
  - zeromib.gpu contributors (@zeromib)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - zeromib.gpu.nvidia_smi
attributes:
  check_mode:
    support: full
    details: Reports the plan (RV(stopped_units), and RV(killed) with C(signal=null)) and never fails on a dirty host.
  diff_mode:
    support: full
    details: Per-GPU memory and the holders, before and after.
  platform:
    platforms: posix
options:
  gpus:
    description:
      - Indexes or UUIDs of the GPUs to free. Holders of other GPUs only are left alone.
      - Empty selects every GPU.
    type: list
    elements: str
    default: []
  services:
    description:
      - systemd units to stop even if they hold nothing now, for example a vLLM server that is restarting.
      - Globs are allowed (V(vllm*.service)); a name without a suffix gets C(.service).
      - Units that do not exist on the host are listed in RV(services_not_found), not an error, so one list fits a mixed fleet.
      - V(container:<name glob>) names Docker or Podman containers instead (V(container:vllm*)), in any state; a glob that matches no
        container (or a host without Docker and Podman) is listed in RV(services_not_found).
    type: list
    elements: str
    default: []
  service_state:
    description:
      - What to leave the units of O(services) in.
      - V(stopped) stops them; V(disabled) also disables them, so they do not start at the next boot; V(masked) masks them.
      - Units found through O(stop_owning_units) are only stopped, never disabled.
      - For containers named in O(services), V(disabled) sets the restart policy to C(no) (C(docker update --restart=no)) before stopping
        them, so that neither a restart of the Docker daemon nor a reboot starts them again. A container cannot be masked; V(masked)
        leaves named containers as V(disabled) does, and they are reported in RV(disabled_containers).
      - Containers found holding a selected GPU are only stopped; with restart policy V(always) Docker starts them again when its
        daemon restarts. Name them in O(services) to disable them.
    type: str
    choices: [stopped, disabled, masked]
    default: stopped
  stop_owning_units:
    description:
      - Stop a holder that runs inside a systemd C(.service) through its unit, so that C(Restart=) cannot start it again.
      - Holders in a C(.scope) (a login session, a container) are signalled as processes; the module never stops the unit
        or scope its own session runs in, nor one that runs a protected process.
    type: bool
    default: true
  kill:
    description:
      - Signal the holders that remain after the units are stopped, and stop the containers found holding selected GPUs. With V(false)
        only the units and containers named in O(services), and the units found through O(stop_owning_units), are acted on.
    type: bool
    default: true
  match:
    description:
      - Python regular expressions searched in each holder's command line. When set, only matching holders (and their units)
        are acted on; O(services) are always acted on.
      - A process that holds only control nodes (C(/dev/nvidiactl), C(/dev/nvidia-uvm)) is signalled only when O(match) names it.
    type: list
    elements: str
    default: []
  kill_timeout:
    description:
      - Seconds between SIGTERM and SIGKILL, and how long a process may outlive SIGKILL before it is reported as unkillable.
      - Also the grace a container gets from its runtime (C(docker stop -t), rounded up to whole seconds) before the runtime SIGKILLs it.
    type: float
    default: 10
  wait_timeout:
    description:
      - Seconds to wait, after acting, for every selected GPU to read at most O(max_used_mib).
    type: float
    default: 60
  poll_interval:
    description:
      - Seconds between memory reads while waiting. The driver frees memory 20-130 ms after a process exits.
    type: float
    default: 0.1
notes:
  - Needs root (O(ignore:become=true)) to see and signal other users' processes and to manage systemd units.
  - The module never resets a GPU. Memory that nvidia-smi attributes to a process that no longer exists, with no live holder left,
    is a context the driver has not freed; the failure message says that a GPU reset or a reboot is needed.
  - B(Containers.) A holder in a Docker or Podman container (found from its cgroup path) is never signalled from outside; the container
    is stopped through its runtime (the Engine API on C(/run/docker.sock) or C($DOCKER_HOST), Podman's on C(/run/podman/podman.sock)
    or C($CONTAINER_HOST), else the C(docker)/C(podman) command), with O(kill_timeout) as its grace. Only when the runtime cannot be
    asked (or is containerd or CRI-O outside Kubernetes) are the container's processes signalled, with a warning, and watched as below.
  - B(Kubernetes.) A holder of a selected GPU in a Kubernetes pod (a C(kubepods) cgroup) is never signalled or stopped; the kubelet
    would restart it and the pod's owner would lose its work without the scheduler knowing. The module fails before acting, naming the
    pod (namespace/name where the runtime says it, else its UID), and says to cordon and drain the node.
  - B(No false released.) When this run signalled, from outside, a process whose restart is outside its control (in a container it
    could not stop through the runtime, or in a C(.service) of a user's systemd manager whose C(Restart=) is not C(no)), it watches for
    3 s after the GPUs read clean (Docker restarts a killed container within ~0.3-0.5 s, measured; systemd's C(RestartSec) defaults to
    100 ms). A new process in that container's or unit's cgroup, or a selected GPU that reads dirty again, fails the run naming it;
    RV(released) is V(true) only when the window passed quietly. Without such a process there is no window (C(settle_s) of RV(timings) is 0).
  - The role P(zeromib.gpu.free_gpus#role) runs this module and asserts the result, for C(pre_tasks) of a training play.
seealso:
  - module: zeromib.gpu.gpu_facts
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
services_not_found:
  description: Units of O(services) that systemd does not know on this host, and V(container:<glob>) entries that match no container.
  type: list
  elements: str
  returned: always
killed:
  description:
    - Processes signalled, with the last signal sent (V(SIGTERM) or V(SIGKILL)) and the seconds from the first signal to their exit.
    - In check mode, the processes that would be signalled, with C(signal=null).
  type: list
  elements: dict
  returned: always
  sample:
    - {pid: 495, name: python3, cmdline: python3 train.py, unit: null, container: null, gpu_indexes: [0], signal: SIGKILL, exited_after_s: 0.02}
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
unkillable:
  description: Processes that outlived SIGKILL for O(kill_timeout) seconds (usually D state in the driver).
  type: list
  elements: dict
  returned: always
warnings:
  description: Things the operator should know, such as a container that could not be stopped through its runtime.
  type: list
  elements: str
  returned: always
gpus_before:
  description: Per-GPU state at the start, shaped like the C(gpus) of M(zeromib.gpu.gpu_facts).
  type: list
  elements: dict
  returned: always
gpus:
  description: Per-GPU state at the end, shaped like the C(gpus) of M(zeromib.gpu.gpu_facts).
  type: list
  elements: dict
  returned: always
holders:
  description: Holders left at the end, protected ones included, shaped like the C(holders) of M(zeromib.gpu.gpu_facts).
  type: list
  elements: dict
  returned: always
elapsed_s:
  description: Seconds spent in the module.
  type: float
  returned: always
  sample: 0.41
timings:
  description:
    - Seconds spent stopping units and containers (C(stop_s)), signalling processes (C(kill_s)), waiting for memory to read free
      (C(wait_s)), and watching for a respawn (C(settle_s), 0 when nothing could respawn).
  type: dict
  returned: always
  sample: {look_s: 0.05, plan_s: 0.0, stop_s: 0.0, kill_s: 0.15, wait_s: 0.12, settle_s: 0.0}
"""

import re

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.zeromib.gpu.plugins.module_utils._nvidia_smi import NvidiaSmi, NvidiaSmiError
from ansible_collections.zeromib.gpu.plugins.module_utils._release import Release, ReleaseError, System

ARGUMENT_SPEC = dict(
    gpus=dict(type="list", elements="str", default=[]),
    services=dict(type="list", elements="str", default=[]),
    service_state=dict(type="str", default="stopped", choices=["stopped", "disabled", "masked"]),
    stop_owning_units=dict(type="bool", default=True),
    kill=dict(type="bool", default=True),
    match=dict(type="list", elements="str", default=[]),
    protect=dict(type="list", elements="str", default=[]),
    kill_timeout=dict(type="float", default=10),
    wait_timeout=dict(type="float", default=60),
    poll_interval=dict(type="float", default=0.1),
    max_used_mib=dict(type="int", default=0),
    nvidia_smi=dict(type="path"),
    timeout=dict(type="float", default=10),
)


def checked_params(params):
    """Option values that the argument spec cannot check -> a clear message, or compiled regexes."""
    for name in ("kill_timeout", "wait_timeout", "timeout"):
        if params[name] < 0 or (name == "timeout" and params[name] == 0):
            raise ValueError("%s must be greater than 0, got %s" % (name, params[name]))
    if params["poll_interval"] <= 0:
        raise ValueError("poll_interval must be greater than 0, got %s" % params["poll_interval"])
    if params["max_used_mib"] < 0:
        raise ValueError("max_used_mib must be 0 or more, got %s" % params["max_used_mib"])
    regexes = []
    for pattern in params["match"]:
        try:
            regexes.append(re.compile(pattern))
        except re.error as exc:
            raise ValueError("match: %r is not a valid regular expression: %s" % (pattern, exc))
    return dict(params, _match_regexes=regexes)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        params = checked_params(module.params)
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    try:
        smi = NvidiaSmi(NvidiaSmi.find(params["nvidia_smi"]), params["timeout"])
        release = Release(smi, System(module.get_bin_path("systemctl")), params, check_mode=module.check_mode)
        result = release.run()
    except NvidiaSmiError as exc:
        module.fail_json(**exc.details())
    except ReleaseError as exc:
        for warning in exc.result.pop("warnings", []):
            module.warn(warning)
        module.fail_json(msg=exc.msg, **exc.result)
    for warning in result.pop("warnings", []):
        module.warn(warning)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
