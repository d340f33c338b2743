#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_restore
short_description: Put back the inference services that gpu_release stopped, exactly as they were
version_added: 0.1.0
description:
  - Reads the record that M(zeromib.gpu.gpu_release) keeps on the node (C(/var/lib/zeromib-gpu/released.json), root-only) of every
    unit and container it stopped, disabled or masked, with its state before, and puts each back, newest release first.
  - B(Units) - C(systemctl unmask) what the release masked, C(systemctl enable) what was enabled before and is not now,
    C(systemctl start) what was active before and is not now. A unit that was already stopped or disabled before the release stays so.
  - B(Supervisord programs) - their C(autostart)/C(autorestart) as they were, then C(supervisorctl start) when they were running.
  - B(Containers) (Docker, Podman) - the restart policy they had before (C(docker update --restart=always)), then a start when they
    were running.
  - In check mode (C(--check)) the same plan is made and reported under the same keys as the real run (V(started_units),
    V(started_containers), ...), one line per entry in RV(plan); nothing is changed.
  - Only what is still undone is done, so a second run changes nothing. An entry put back leaves the record (the file is removed when
    it is empty); an entry that cannot be put back stays, and the module fails naming it and why.
  - Every step is bounded by O(step_timeout). With O(wait_for_gpus) it also waits until the services it started hold their GPUs again,
    so that a play knows the inference servers are back.
author:
  - zeromib.gpu contributors (@zeromib)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details:
      - The same plan as the real run, under the same keys (RV(started_units), RV(enabled_units), RV(unmasked_units),
        RV(restored_policies), RV(started_containers), RV(started_programs), RV(restored), RV(plan), ...); changes neither the node nor
        the record. C(changed) is true only when the plan is not empty.
  diff_mode:
    support: full
    details: >-
      One line per entry of the record, how it reads before and after (V(vllm.service: disabled, stopped) becomes
      V(vllm.service: enabled, running)); an entry that could not be restored keeps its line, with the reason.
  platform:
    platforms: posix
options:
  step_timeout:
    description:
      - Seconds each step may take - one C(systemctl) call (a C(start) waits for the unit's start job, so a C(Type=notify) server that
        takes longer is reported, not waited on), one container start. At most 86400 (one day).
    type: float
    default: 30
  wait_for_gpus:
    description:
      - V(false) does not wait. V(true) waits up to 60 s, a number (at most 86400, one day) up to that many seconds, until every unit,
        container and supervisord program that held GPUs at the release and was started again holds a GPU again (a C(/proc) scan and one
        C(nvidia-smi) call every 0.5 s; a program's processes are its process as its supervisord reports it and that process's descendants).
      - When the time runs out the module fails, naming the services without GPU; what was restored has left the record.
    type: raw
    default: false
  forget:
    description:
      - Names (globs allowed) of units or containers, or container id prefixes, to drop from the record without restoring them, for
        example a container removed since the release.
    type: list
    elements: str
    default: []
  nvidia_smi:
    description: Path of C(nvidia-smi), used by O(wait_for_gpus) and to set back GPU settings a release's ready_fix changed; searched like
      M(zeromib.gpu.gpu_facts) does when not set.
    type: path
  reload_despite_gpu_containers:
    description:
      - Unit files are changed without a C(systemctl daemon-reload) (C(--no-reload)), because a reload cuts running GPU containers off their GPUs
        on a cgroup v2 node whose container engine uses the systemd cgroup driver.
      - One case needs a reload - a unit to start again that systemd still holds masked (masked when systemd loaded it, and wanted by
        another unit, as an enabled unit is by its target); C(unmask) alone does not let it start. The run then reloads systemd only
        when no running container has NVIDIA devices that the reload would take away (granted outside its unit's C(DeviceAllow=)); if
        one has, that unit is not started and the task fails naming the containers and NVIDIA's fix
        (C(nvidia-ctk system create-dev-char-symlinks --create-all)). A guest's systemd is never reloaded in that case.
      - V(true) reloads all the same. R(More in the containers guide on daemon-reload, ansible_collections.zeromib.gpu.docsite.guide_containers.daemon-reload).
    type: bool
    default: false
  recreate_mig_layout:
    description:
      - The record keeps the MIG layout (GPU and compute instances, MIG UUIDs) of every GPU in MIG mode that a release selected; a reboot
        loses it (only MIG mode persists). Before anything is restored, each layout is compared with the GPU now. The same slicing - nothing
        to do. Other instances - never touched; the task fails, nothing restored.
      - No instance now - with V(false) the task fails, nothing restored, naming the units and containers to restore whose configuration
        (a root-owned unit file, drop-in or C(EnvironmentFile=); a container's device request) names a MIG UUID that no longer exists.
        With V(true) the layout is re-created (C(nvidia-smi mig -i N -cgi PROFILES -C)) and read back; the new instances have new MIG
        UUIDs, so an entry whose configuration still names a lost one is not restored, and its reason names the UUID at its place now.
      - A MIG change is refused while a process holds the GPU's device files (C(In use by another client)); the task names them (DCGM's
        C(nv-hostengine), any NVML client).
    type: bool
    default: false
notes:
  - Needs root (O(ignore:become=true)); the record is readable by root only.
  - The record, its format and how several releases before one restore merge, are described in C(docs/docsite/rst/guide_restore.rst).
  - The role P(zeromib.gpu.restore_gpus#role) runs this module, for the C(always) of a C(block) around training.
  - B(Supervisord programs) (C(supervisor:) in O(zeromib.gpu.gpu_release#module:services)) - the C(autostart)/C(autorestart) lines that
    M(zeromib.gpu.gpu_release) wrote (marked with its comment) are put back as they were, and a program that was running is started
    (C(supervisorctl start)); no other program is stopped, started or re-added. C(supervisorctl reread) and C(update GROUP) run only for
    a program alone in its group (C(update) re-adds the whole group). A supervisord restarted since the release read C(autorestart=false)
    for a program beside others; it gets it back at supervisord's next start, and the task warns so. O(wait_for_gpus) waits for them
    too, when their process (or its children) held GPUs at the release.
  - B(Docker Swarm services) (C(swarm:) in O(zeromib.gpu.gpu_release#module:services)) - scaled back to the replicas they had, through the
    Docker Engine API of the node (a Swarm manager); restored as C(kind=swarm_service).
seealso:
  - module: zeromib.gpu.gpu_release
  - module: zeromib.gpu.gpu_facts
requirements:
  - systemd, for units; Docker or Podman on the node, for containers (no Python package)
"""

EXAMPLES = r"""
- name: Put back the inference servers stopped before training
  zeromib.gpu.gpu_restore:
  become: true

- name: Put them back and wait until they hold their GPUs again
  zeromib.gpu.gpu_restore:
    wait_for_gpus: 120
  become: true

- name: What would be put back?
  zeromib.gpu.gpu_restore:
  check_mode: true
  become: true
  register: __restore_plan

- name: Show the plan, one line per entry (vllm.service - enable, start)
  ansible.builtin.debug:
    var: __restore_plan.plan

- name: Drop a container removed since the release from the record, restore the rest
  zeromib.gpu.gpu_restore:
    forget: [old-vllm]
  become: true
"""

RETURN = r"""
record_path:
  description: The record read.
  type: str
  returned: always
  sample: /var/lib/zeromib-gpu/released.json
plan:
  description:
    - What was put back (in check mode, what would be), one line per entry, newest release first; entries found already as before the
      release and entries forgotten have a line too (they leave the record). Empty when there is nothing to do (C(changed) false).
  type: list
  elements: str
  returned: always
  sample: ["container vllm: restart policy always, start", "sglang.service: start", "vllm.service: enable, start"]
already_restored:
  description: Entries found already as before the release (put back by hand); they leave the record without a step.
  type: list
  elements: str
  returned: always
  sample: ["tgi.service stopped by zeromib at 2026-12-01T10:00:00Z"]
restored:
  description: What was put back (in check mode, what would be), newest release first, with the steps taken.
  type: list
  elements: dict
  returned: always
  sample: [{kind: unit, name: vllm.service, steps: [enable, start]}]
unmasked_units:
  description: Units unmasked (in check mode, to be unmasked; the same for the keys below).
  type: list
  elements: str
  returned: always
enabled_units:
  description: Units enabled again.
  type: list
  elements: str
  returned: always
  sample: [vllm.service]
started_units:
  description: Units started again.
  type: list
  elements: str
  returned: always
  sample: [vllm.service]
reset_failed_units:
  description:
    - Units that read V(failed) (killed through systemd by M(zeromib.gpu.gpu_release), RV(zeromib.gpu.gpu_release#module:failed_units)),
      reset with C(systemctl reset-failed) right before their start.
  type: list
  elements: str
  returned: always
  sample: [stubborn.service]
restored_policies:
  description: Containers whose restart policy was put back.
  type: list
  elements: dict
  returned: always
  sample: [{name: vllm, id: 4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a4f3c2b1a, restart_policy: always}]
started_containers:
  description: Containers started again.
  type: list
  elements: str
  returned: always
  sample: [vllm]
device_nodes:
  description:
    - The NVIDIA device nodes checked before anything was restored - C(needed) (C(/dev/nvidiactl), C(/dev/nvidia-uvm),
      C(/dev/nvidia-uvm-tools) and each GPU's C(/dev/nvidia<minor>) the driver lists), C(missing) (absent or not a character device),
      C(created) (by C(nvidia-modprobe), or that it would create in check mode), C(helper) and C(error). A node still missing fails
      the restore before anything starts, naming it. V(null) when nothing was to restore or the NVIDIA driver is not loaded.
  type: dict
  returned: always
recreated_mig_layouts:
  description:
    - "MIG layouts re-created with O(recreate_mig_layout) (in check mode, to be re-created), each as C(GPU <index> (<uuid>): nvidia-smi <arguments>)."
  type: list
  elements: str
  returned: always
  sample: ["GPU 0 (GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5): nvidia-smi mig -i 0 -cgi 9,9 -C"]
restored_gpu_settings:
  description:
    - GPU settings that M(zeromib.gpu.gpu_release)'s O(zeromib.gpu.gpu_release#module:ready_fix) changed, set back with nvidia-smi
      before the units start.
    - "Each as C(GPU <index> (<uuid>): <settings>). A clock lock is not locked again (its range cannot be read); a warning says so."
  type: list
  elements: str
  returned: always
  sample: ["GPU 1 (GPU-ab0cf4f6-818d-be7e-f16b-963690d7c5c5): compute mode Exclusive_Process, power limit 350 W"]
started_programs:
  description: Supervisord programs started again.
  type: list
  elements: str
  returned: always
started_guest_units:
  description:
    - A system container's own units (stopped by gpu_release through a V(lxc:), V(lxd:) or V(machine:) entry of its C(services)) started
      again through the guest's systemd, named as that entry (V(lxc:101:vllm.service)). A guest that is not running keeps its entry.
  type: list
  elements: str
  returned: always
  sample: [lxc:101:vllm.service]
reset_failed_guest_units:
  description: As RV(reset_failed_units), for a system container's own units, named as their entry.
  type: list
  elements: str
  returned: always
  sample: [lxc:101:vllm.service]
enabled_guest_units:
  description: The same, enabled again in the guest.
  type: list
  elements: str
  returned: always
unmasked_guest_units:
  description: The same, unmasked in the guest.
  type: list
  elements: str
  returned: always
forgotten:
  description: Entries dropped from the record through O(forget).
  type: list
  elements: str
  returned: always
not_restored:
  description: Entries that could not be put back, with the steps left to do and why; they stay in the record.
  type: list
  elements: dict
  returned: always
  sample: [{kind: unit, name: broken.service, id: null, steps: [start], reason: "systemctl start broken.service failed (rc 1): ..."}]
pending:
  description: The entries left in the record after this run (those of RV(not_restored)).
  type: list
  elements: str
  returned: always
  sample: ["broken.service stopped by zeromib at 2026-12-01T10:00:00Z"]
gpus_held:
  description: With O(wait_for_gpus), the GPU indexes each started unit, container or supervisord program holds at the end.
  type: dict
  returned: always
  sample: {vllm.service: [0, 1, 2, 3, 4, 5, 6, 7]}
elapsed_s:
  description: Seconds spent in the module.
  type: float
  returned: success
timings:
  description: Seconds spent restoring (C(restore_s)) and waiting for the GPUs (C(wait_s)).
  type: dict
  returned: always
"""

import typing as t

from ansible.module_utils.basic import AnsibleModule

# First of the collection's imports: the module_utils below are then compiled once, not twice (_compile_once).
from ansible_collections.zeromib.gpu.plugins.module_utils import _compile_once  # noqa: F401 pylint: disable=unused-import
from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _restore
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi, NvidiaSmiError

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

ARGUMENT_SPEC = dict(
    step_timeout=dict(type="float", default=30),
    wait_for_gpus=dict(type="raw", default=False),
    forget=dict(type="list", elements="str", default=[]),
    nvidia_smi=dict(type="path"),
    reload_despite_gpu_containers=dict(type="bool", default=False),
    recreate_mig_layout=dict(type="bool", default=False),
)


def checked_params(params: t.Mapping[str, t.Any]) -> float:
    """The seconds to wait for the GPUs (0: no wait); ValueError naming the option that is wrong."""
    wait = _restore.parse_wait(params["wait_for_gpus"])
    problems = _options.check({"step_timeout": params["step_timeout"]})
    if problems:
        raise ValueError("; ".join(problems))
    return wait


def warn_all(module: AnsibleModule, warnings: t.Iterable[str]) -> None:
    for warning in warnings:
        module.warn(warning)


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    params = module.params
    try:
        wait = checked_params(params)
    except ValueError as exc:
        module.fail_json(msg=str(exc))

    def look() -> list[Holder]:
        return _restore.holders_now(NvidiaSmi(NvidiaSmi.find(params["nvidia_smi"]), 10))

    restore = _restore.Restore(_restore.System(module.get_bin_path("systemctl")), params, module.check_mode, look if wait else None)
    try:
        result = restore.run()
    except _restore.RestoreError as exc:
        warn_all(module, exc.result.pop("warnings", []))
        module.fail_json(msg=exc.msg, **exc.result)
    except NvidiaSmiError as exc:
        warn_all(module, restore.result.pop("warnings", []))
        module.fail_json(**dict(restore.result, **exc.details()))
    warn_all(module, result.pop("warnings", []))
    module.exit_json(**result)


if __name__ == "__main__":
    main()
