#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Documentation only: the summary is the action plugin plugins/action/free_gpus_summary.py.

from __future__ import annotations

DOCUMENTATION = r"""
module: free_gpus_summary
short_description: Internal (the summary step of free_gpus.yml) - the fleet summary, and which hosts are not free
version_added: 0.1.0
description:
  - B(Internal to the collection) - the summary step of C(playbooks/free_gpus.yml);
    its options and return values may change without notice. Use the role or playbook that runs it, not this plugin in a
    play of your own.
  - The summary step of C(playbooks/free_gpus.yml), run once (C(run_once)) after the role P(zeromib.gpu.free_gpus#role); runs on
    the controller only and touches no managed node.
  - Reads the C(free_gpus_result) fact of every host of the play, and C(_free_gpus_failure) (set by C(free_gpus.yml)'s rescue
    when the role itself broke), once and raw from the variable manager's caches (a host found in neither through
    C(hostvars)), and returns one line per host, worst first, in the words of the filter
    P(zeromib.gpu.free_gpus_summary#filter), and the hosts that are not free.
  - Only the hosts still in the play (C(ansible_play_hosts)) are read; a host of the play that has left it (unreachable, or
    failed before its gate ran) is listed as unreachable, never with a result cached by an earlier run.
author:
  - zeromib.gpu contributors (@zeromib)
attributes:
  check_mode:
    details: It only reads; a check run's summary says what would be freed.
options: {}
# The attributes every action plugin shares, in one fragment (plugins/doc_fragments/controller_action.py).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.flow
  - zeromib.gpu.controller_action
notes:
  - Takes no options. Run it once (C(run_once=true)) after the role on every host of the play; its result is registered for all.
  - The columns and statuses of the lines are those of the filter P(zeromib.gpu.free_gpus_summary#filter) (docs/free_gpus.md).
seealso:
  - module: zeromib.gpu.free_gpus_gate
"""

EXAMPLES = r"""
- name: Fleet summary
  zeromib.gpu.free_gpus_summary:
  run_once: true
  register: summary

- name: Fail the hosts whose GPUs are not free
  ansible.builtin.fail:
    msg: "{{ inventory_hostname }}: not free (its line in the fleet summary above says why)"
  when: inventory_hostname in summary.not_free
"""

RETURN = r"""
msg:
  description: The summary, one line per host of the play, worst first (unreachable, failed, dirty, then freed and clean), and a
    last line of totals.
  type: list
  elements: str
  returned: always
not_free:
  description: The hosts still in the play whose GPUs are not free (their outcome is not ok, or the role broke on them), in the
    play's order; empty when every host is free.
  type: list
  elements: str
  returned: always
  sample: [gpu-node-07]
unreachable_hosts:
  description: The hosts of the play that have left it (unreachable, or failed before the role's gate), which the summary lists as
    unreachable, quoting the SSH error where the gate's registered result holds it.
  type: list
  elements: str
  returned: always
  sample: [gpu-node-03]
"""
