#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Documentation only: the check is the action plugin plugins/action/role_variables_check.py.

from __future__ import annotations

DOCUMENTATION = r"""
module: role_variables_check
short_description: Internal (the first task of the restore_gpus and slurm_gpu_checks roles) - check their variables before anything is done
version_added: 0.1.0
description:
  - B(Internal to the collection) - the first task of the roles P(zeromib.gpu.restore_gpus#role) and P(zeromib.gpu.slurm_gpu_checks#role);
    its options and return values may change without notice. Use the role or playbook that runs it, not this plugin in a
    play of your own.
  - The first task of P(zeromib.gpu.restore_gpus#role) and P(zeromib.gpu.slurm_gpu_checks#role); use the roles, not this plugin.
  - Runs on the controller only, and checks the role's variables before anything is done (see the notes).
  - The roles' C(meta/argument_specs.yml) type their variables V(raw), so that Ansible's own role argument validation, which runs first,
    passes them on to this check (with the real types there, it failed first, naming a Python class and dumping the specification).
  - The reason is the host's one failure line, in C(msg); nothing is hidden with C(no_log), so callback plugins receive it too.
author:
  - zeromib.gpu contributors (@zeromib)
options:
  prefix:
    description: The prefix of the role's variables.
    type: str
    choices: [restore_gpus_, slurm_gpu_checks_]
    required: true
  not_options:
    description: Names with the prefix that are no variable of the role and no typo (a fact the role sets).
    type: list
    elements: str
    default: []
seealso:
  - module: zeromib.gpu.free_gpus_gate
    description: The free_gpus role's gate checks that role's variables the same way.
# The attributes every action plugin shares, in one fragment (plugins/doc_fragments/controller_action.py).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.flow
  - zeromib.gpu.controller_action
  # How the role's variables are checked (plugins/doc_fragments/role_variables.py), as the free_gpus role's gate says it.
  - zeromib.gpu.role_variables
"""

EXAMPLES = r"""
- name: Check the role's variables
  zeromib.gpu.role_variables_check:
    prefix: restore_gpus_
    not_options: [restore_gpus_result]
"""

RETURN = r"""
msg:
  description: What is wrong, after C(settings mistake, nothing was done:), or that the variables are fine.
  type: str
  returned: always
"""
