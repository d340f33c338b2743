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
    that own holders (O(stop_owning_units)); and the holders left to signal, never a protected process, never PID 1, never the module's
    own Ansible session, never a process that uses only unselected GPUs, never an NVML client (unless O(match) names it).
  - Which GPU a process uses is not which device files it has open (every CUDA process opens every GPU's); it is the GPU where
    nvidia-smi lists it as a compute app or, for a process nvidia-smi does not list (the orphaned child of a dead owner), the GPU whose
    device file it maps with a context-sized mapping. A process that cannot be placed so is reported in RV(undecided) and signalled
    only when every GPU it may use is selected. See M(zeromib.gpu.gpu_facts).
  - B(Act) - C(systemctl stop) the units (then C(disable) or C(mask) the named ones), SIGTERM the remaining holders, SIGKILL those
    still alive after O(kill_timeout). Before every signal the PID's start time is checked again, so a reused PID is never signalled.
  - B(Verify) - poll C(memory.used) every O(poll_interval) until every selected GPU reads at most O(max_used_mib), or fail after
    O(wait_timeout) with one message naming each dirty GPU, its MiB and what still holds it.
  - A host that is already clean is not touched and reports C(changed=false).
author:
  - zeromib.gpu contributors (@zeromib)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - zeromib.gpu.nvidia_smi
  - zeromib.gpu.health
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
      - Indexes or UUIDs of the GPUs to free. Processes that use only other GPUs are left alone, so one GPU can be freed while the
        others train; the GPUs freed then read the cross-GPU footprint of those contexts (see O(cross_gpu_footprint_mib)).
      - Empty selects every GPU.
    type: list
    elements: str
    default: []
  services:
    description:
      - systemd units to stop even if they hold nothing now, for example a vLLM server that is restarting.
      - Globs are allowed (V(vllm*.service)); a name without a suffix gets C(.service).
      - Units that do not exist on the host are listed in RV(services_not_found), not an error, so one list fits a mixed fleet.
    type: list
    elements: str
    default: []
  service_state:
    description:
      - What to leave the units of O(services) in.
      - V(stopped) stops them; V(disabled) also disables them, so they do not start at the next boot; V(masked) masks them.
      - Units found through O(stop_owning_units) are only stopped, never disabled.
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
      - Signal the holders that remain after the units are stopped. With V(false) only units are acted on.
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
  - A holder inside a container is signalled like any process; the result warns that its runtime may restart it.
  - The role P(zeromib.gpu.free_gpus#role) runs this module and asserts the result, for C(pre_tasks) of a training play.
seealso:
  - module: zeromib.gpu.gpu_facts
requirements:
  - nvidia-smi from the NVIDIA driver on the managed node
  - systemd, when O(services) or O(stop_owning_units) are used
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
  description: Units of O(services) that systemd does not know on this host.
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
warnings:
  description: Things the operator should know, such as holders inside containers.
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
healthy:
  description:
    - V(true) when no GPU has a health issue at the end, and C(dcgmi diag), when asked for and installed, passed.
      Health does not change RV(released); the P(zeromib.gpu.free_gpus#role) role asserts both.
    - The checks are those of M(zeromib.gpu.gpu_facts) (ECC, row remaps, PCIe link, slowdown, persistence and MIG mode, Xids).
  type: bool
  returned: always
health_checked:
  description: V(false) when some health check could not be made (see C(health.unchecked) of each GPU).
  type: bool
  returned: always
health_issues:
  description: "Every GPU's health issues as C(GPU <index> (<bus id>): <issue>), then a failed DCGM diagnostic."
  type: list
  elements: str
  returned: always
  sample: ["GPU 0 (00000000:18:00.0): Xid 79 (GPU has fallen off the bus) in the kernel log at 2026-11-29T09:08:01+0000"]
health:
  description: The kernel log read (C(kernel_log)) and the DCGM diagnostic (C(dcgm_diag), V(null) unless O(dcgm_diag) is set).
  type: dict
  returned: always
elapsed_s:
  description: Seconds spent in the module.
  type: float
  returned: always
  sample: 0.41
timings:
  description: Seconds spent stopping units, signalling processes, and waiting for memory to read free.
  type: dict
  returned: always
  sample: {stop_s: 0.0, kill_s: 0.15, wait_s: 0.12}
"""

import re

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.zeromib.gpu.plugins.module_utils import _facts
from ansible_collections.zeromib.gpu.plugins.module_utils import _health
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
    cross_gpu_footprint_mib=dict(type="int", default=4),
    nvidia_smi=dict(type="path"),
    timeout=dict(type="float", default=10),
    health=dict(type="bool", default=True),
    min_pcie_gen=dict(type="int", default=0),
    min_pcie_width=dict(type="int", default=0),
    require_persistence=dict(type="bool", default=True),
    expected_mig_mode=dict(type="str", choices=["enabled", "disabled"]),
    xid_window_hours=dict(type="float", default=24),
    dcgm_diag=dict(type="int", default=0, choices=[0, 1, 2, 3, 4]),
)


def checked_params(params):
    """Option values that the argument spec cannot check -> a clear message, or compiled regexes."""
    for name in ("kill_timeout", "wait_timeout", "timeout"):
        if params[name] < 0 or (name == "timeout" and params[name] == 0):
            raise ValueError("%s must be greater than 0, got %s" % (name, params[name]))
    if params["poll_interval"] <= 0:
        raise ValueError("poll_interval must be greater than 0, got %s" % params["poll_interval"])
    for name in ("max_used_mib", "cross_gpu_footprint_mib", "min_pcie_gen", "min_pcie_width", "xid_window_hours"):
        if params[name] < 0:
            raise ValueError("%s must be 0 or more, got %s" % (name, params[name]))
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
        if params["dcgm_diag"] and result.get("released") and not module.check_mode:
            # The diagnostic runs work on the GPUs: only once they are free.
            dcgm = _health.dcgm_diag(params["dcgm_diag"], lambda name: module.get_bin_path(name))
            result.update(_facts.health_summary(result["gpus"], release.health, dcgm))
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
