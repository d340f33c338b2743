#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: slurm_node
short_description: Drain this host in Slurm when its GPUs cannot be freed, resume it only when zeromib drained it
version_added: 0.1.0
description:
  - O(state=drained) drains the Slurm node of this host (C(scontrol update nodename=NODE state=drain reason=...), the reason starting
    with C(zeromib:)), so that the scheduler sends it no more work. A node already drained with a reason that does not start with C(zeromib:) (an admin's
    C(maintenance)) is left exactly as it is.
  - O(state=resumed) resumes the node (C(state=resume)) only when its drain reason starts with C(zeromib:); a drain by anyone else
    is never resumed. The role P(zeromib.gpu.restore_gpus#role) calls it only after a fresh look reads the GPUs clean and healthy.
  - The node name is O(node_name), else the C(NodeName) of C(slurmd -C) or the host's short name when C(scontrol) knows it, else the
    node whose C(NodeHostName) is this host.
  - Used by the roles (C(free_gpus_on_failure=drain), C(restore_gpus_resume_drained=true)); it can be used alone.
author:
  - zeromib.gpu contributors (@zeromib)
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Says what it would do; runs only C(scontrol show) and C(slurmd -C).
  diff_mode:
    support: none
  platform:
    platforms: posix
options:
  state:
    description: V(drained) or V(resumed).
    type: str
    choices: [drained, resumed]
    required: true
  reason:
    description:
      - Why the node is drained, with O(state=drained). It is prefixed with C(zeromib:), put on one line and cut to 120 characters.
    type: str
    default: GPUs could not be freed
  node_name:
    description: The Slurm node name of this host; found as described above when not set.
    type: str
notes:
  - Needs C(scontrol) on the host and a reachable C(slurmctld), and a user Slurm lets update nodes (root or SlurmUser).
seealso:
  - module: zeromib.gpu.gpu_release
  - module: zeromib.gpu.gpu_restore
requirements:
  - Slurm's C(scontrol) (and C(slurmd), to find the node name)
"""

EXAMPLES = r"""
- name: Drain this node, its GPUs could not be freed
  zeromib.gpu.slurm_node:
    state: drained
    reason: GPU 3 holds 4096 MiB of a dead process
  become: true

- name: Resume it if zeromib drained it
  zeromib.gpu.slurm_node:
    state: resumed
  become: true
"""

RETURN = r"""
node_name:
  description: The Slurm node acted on.
  type: str
  returned: success
  sample: gpu-node-01
state_before:
  description: The node's C(State) before.
  type: str
  returned: success
  sample: IDLE+DRAIN
reason_before:
  description: The node's drain reason before, without Slurm's C([user@time]) suffix (empty when none).
  type: str
  returned: success
  sample: maintenance
reason:
  description: The reason set, with O(state=drained).
  type: str
  returned: when O(state=drained)
  sample: "zeromib: GPU 3 holds 4096 MiB of a dead process"
why:
  description: Why the module acted or did not.
  type: str
  returned: success
  sample: "drained by someone else (reason 'maintenance'): never resumed by zeromib"
"""

import os

from ansible.module_utils.basic import AnsibleModule

# First of the collection's imports: the module_utils below are then compiled once, not twice (_compile_once).
from ansible_collections.zeromib.gpu.plugins.module_utils import _compile_once  # noqa: F401 pylint: disable=unused-import
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _drain


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", required=True, choices=["drained", "resumed"]),
            reason=dict(type="str", default="GPUs could not be freed"),
            node_name=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    module.run_command_environ_update = {"LANG": "C", "LC_ALL": "C"}
    scontrol = module.get_bin_path("scontrol", opt_dirs=["/usr/local/bin", "/opt/slurm/bin"])
    if not scontrol:
        module.fail_json(msg="scontrol not found on this host: cannot {} it in Slurm".format("drain" if module.params["state"] == "drained" else "resume"))
    slurmd = module.get_bin_path("slurmd", opt_dirs=["/usr/sbin", "/usr/local/sbin", "/opt/slurm/sbin"])

    def run(argv: list[str]) -> tuple[int, str, str]:
        rc, out, err = module.run_command(argv, environ_update={"SLURM_TIME_FORMAT": "standard"})
        return rc, out, err

    slurm = _drain.Slurm(run, scontrol, slurmd, hostname=os.uname()[1].split(".")[0])
    try:
        name, node = slurm.node_name(module.params["node_name"])
        result = {"node_name": name, "state_before": node.get("State"), "reason_before": _drain.reason_text(node)}
        if module.params["state"] == "drained":
            reason = _drain.short_reason(module.params["reason"])
            act, why = _drain.drain_decision(node, reason)
            result["reason"] = reason
            if act and not module.check_mode:
                slurm.update(name, "state=drain", "reason=" + reason)
        else:
            act, why = _drain.resume_decision(node)
            if act and not module.check_mode:
                slurm.update(name, "state=resume")
    except _drain.SlurmError as exc:
        module.fail_json(msg=str(exc))
    module.exit_json(changed=act, why=why, **result)


if __name__ == "__main__":
    main()
