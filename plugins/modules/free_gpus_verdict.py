#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Documentation only: the verdict is the action plugin plugins/action/free_gpus_verdict.py.

from __future__ import annotations

DOCUMENTATION = r"""
module: free_gpus_verdict
short_description: Internal (the free_gpus role's last task) - fail each host whose GPUs are not free, with its reason, once
version_added: 0.1.0
description:
  - B(Internal to the collection) - the last task of the role P(zeromib.gpu.free_gpus#role);
    its options and return values may change without notice. Use the role or playbook that runs it, not this plugin in a
    play of your own.
  - The last task of the role P(zeromib.gpu.free_gpus#role), after M(zeromib.gpu.free_gpus_gate); use the role, not this plugin.
  - Runs on the controller only; reads the C(free_gpus_result) fact that the gate set on every host of the batch.
  - A host that is not free fails here with the message of its C(free_gpus_result) as C(msg), and nothing else is printed for it
    (no C(no_log), so callback plugins such as AWX/AAP job events, ansible-runner, ARA and the json callback receive the reason too).
    A rescue around the role reads that message in C(ansible_failed_result.msg). A settings mistake that an earlier host of the
    batch has word for word is said there only; this host's C(msg) names the variables and that host.
  - A free host says its message (C(free_gpus_result.message)) in one line without C(-v), above its C(ok); under
    C(playbooks/free_gpus.yml) the fleet summary says it instead.
  - With C(free_gpus_on_failure=drain) such a host's Slurm node is drained first (M(zeromib.gpu.slurm_node)), unless the failure is
    a settings mistake (nothing was done, nothing is wrong with the node).
  - Under C(any_errors_fatal), a host whose GPUs are free while another host's are not says which hosts stop the play, and how to put
    back what its own run stopped; C(free_gpus_result) then has C(status=stopped) and C(stopped_by).
author:
  - zeromib.gpu contributors (@zeromib)
attributes:
  check_mode:
    details: Reads what the gate's dry run recorded; nothing is drained in check mode.
options:
  msg:
    description:
      - Fail the host with this message instead, whatever its C(free_gpus_result) says (the task's C(when) decides which hosts).
        C(playbooks/free_gpus.yml) uses it after its fleet summary, which has said each host's reason, and
        C(playbooks/restore_gpus.yml) likewise for a host whose restore failed.
    type: str
# The attributes every action plugin shares, in one fragment (plugins/doc_fragments/controller_action.py).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.flow
  - zeromib.gpu.controller_action
notes:
  - It reads the role's variables and the facts the gate set. It fails a host that has no C(free_gpus_result).
seealso:
  - module: zeromib.gpu.free_gpus_gate
"""

EXAMPLES = r"""
- name: Free the GPUs and prove it (the gate, then this verdict)
  ansible.builtin.include_role:
    name: zeromib.gpu.free_gpus
  vars:
    free_gpus_services: [vllm*.service]
"""

RETURN = r"""
msg:
  description: The message of C(free_gpus_result) - why the host is not free, what was done, or which hosts stop the play.
  type: str
  returned: always
"""
