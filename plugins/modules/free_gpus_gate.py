#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Documentation only: the gate is the action plugin plugins/action/free_gpus_gate.py.

from __future__ import annotations

DOCUMENTATION = r"""
module: free_gpus_gate
short_description: Internal (the free_gpus role's gate) - free the GPUs and record whether they read free, in one task
version_added: 0.1.0
description:
  - B(Internal to the collection) - the first task of the role P(zeromib.gpu.free_gpus#role);
    its options and return values may change without notice. Use the role or playbook that runs it, not this plugin in a
    play of your own.
  - The first task of the role P(zeromib.gpu.free_gpus#role); use the role, not this plugin.
  - On the controller, checks the role's variables (C(free_gpus_*)) against the role's C(meta/argument_specs.yml), as Ansible's
    automatic role argument validation does, with the same message.
  - Runs M(zeromib.gpu.gpu_release) once on the node with those variables, and returns its result.
  - Sets the fact C(free_gpus_result) (see the filter P(zeromib.gpu.free_gpus_outcome#filter)).
  - Records in C(free_gpus_result) whether every selected GPU reads at most C(free_gpus_max_used_mib) and the node has
    C(free_gpus_expected_count) GPUs, with the message saying why not; it never fails the host itself. The role's next task,
    M(zeromib.gpu.free_gpus_verdict), fails each host that is not free with that message, once. In check mode a dirty node passes
    (it would be freed); a node whose GPUs cannot be read, or whose plan is refused, does not.
  - Waits for M(zeromib.gpu.gpu_release) at most the bound of the host's own timeouts - 6 x C(free_gpus_timeout) + 2 x
    C(free_gpus_kill_timeout) + C(free_gpus_wait_timeout) + C(free_gpus_settle_timeout) (+ C(free_gpus_timeout) for cuInit and each GPU
    with C(free_gpus_smoke_test)) + 40 s, 185 s with the defaults. A node where it outlives that is wedged (a file system or the
    driver does not answer, or Python cannot start there); its C(free_gpus_result) says C(gpu_release did not answer within N s) and
    the host fails alone, while the rest of the play goes on.
  - One task per host, where a validation task, the module, a C(set_fact) and an C(assert) cost four.
author:
  - zeromib.gpu contributors (@zeromib)
attributes:
  check_mode:
    details: Runs M(zeromib.gpu.gpu_release) in check mode; a dirty node passes, a node that cannot be read fails.
  diff_mode:
    support: full
    details: M(zeromib.gpu.gpu_release)'s diff.
options: {}
notes:
  - Takes no options; it reads the role's variables. It fails outside the role.
  - When the role is run with C(rolespec_validate=false) (as C(playbooks/free_gpus.yml) does), this task is the only validation, and
    the play saves Ansible's automatic validation task on every host.
  - The task never fails (Ansible keeps no facts from a failed task), so C(free_gpus_result) is set on every host.
  - C(free_gpus_result) is returned as a fact (also C(ansible_facts.free_gpus_result)); with fact caching it is cached like any fact,
    so a summary should read it only for the hosts of the current play (C(ansible_play_hosts)), as C(playbooks/free_gpus.yml) does.
# The attributes every action plugin shares, in one fragment (plugins/doc_fragments/controller_action.py).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.flow
  - zeromib.gpu.controller_action
  # How the role's variables are checked (plugins/doc_fragments/role_variables.py), as role_variables_check says it.
  - zeromib.gpu.role_variables
seealso:
  - module: zeromib.gpu.gpu_release
  - module: zeromib.gpu.free_gpus_verdict
"""

EXAMPLES = r"""
- name: Free the GPUs and prove it (what the role does)
  ansible.builtin.import_role:
    name: zeromib.gpu.free_gpus
    rolespec_validate: false
  vars:
    free_gpus_services: [vllm*.service]
"""

RETURN = r"""
msg:
  description: The message of C(free_gpus_result) - host, GPUs, MiB before and after, what was done, or why the node is not free.
  type: str
  returned: always
failed_checks:
  description:
    - The checks that failed (the host is not free), in this order - V(gpu_release failed), V(released), V(every selected GPU clean),
      V(free_gpus_expected_count), V(free_gpus_require_healthy), V(free_gpus_smoke_test).
  type: list
  elements: str
  returned: when the host is not free
released:
  description:
    - Every other key of M(zeromib.gpu.gpu_release)'s result is returned as it returns it, except its GPU and holder
      records (RV(zeromib.gpu.gpu_release#module:gpus), RV(zeromib.gpu.gpu_release#module:gpus_before),
      RV(zeromib.gpu.gpu_release#module:holders)), which only C(-v) returns; C(free_gpus_result) keeps their figures.
  type: bool
  returned: when gpu_release ran
"""
