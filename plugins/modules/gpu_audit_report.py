#!/usr/bin/python
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Documentation only: the report is the action plugin plugins/action/gpu_audit_report.py.

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_audit_report
short_description: Internal (the report step of audit_gpus.yml) - write the fleet GPU audit report on the controller
version_added: 0.1.0
description:
  - B(Internal to the collection) - the report step of C(playbooks/audit_gpus.yml) and C(playbooks/audit_merge.yml);
    its options and return values may change without notice. Use the role or playbook that runs it, not this plugin in a
    play of your own.
  - The report step of C(playbooks/audit_gpus.yml) (its task file C(playbooks/tasks/audit_report.yml)); runs on the controller
    only and touches no managed node.
  - Reads the hosts' data once - the registered M(zeromib.gpu.gpu_facts) result of every host of the play (O(result_var)), or
    saved records (O(hosts_data), O(hosts_data_var)), or the part files of a sliced audit (O(parts)) - and builds the report
    model (P(zeromib.gpu.gpu_audit_model#filter)).
  - Runs the report's JMESPath queries (hosts that need attention, dirty and busy GPUs, holders, NVML clients, memory of gone
    PIDs) and O(queries) with the C(jmespath) library, renders C(report.md) and C(report.html) with Jinja, and writes
    C(report.json), C(report.md), C(report.html) and C(gpu_audit.prom) into O(report_dir), each through a temporary file and
    a rename.
  - A host needs attention when it is not clean (dirty, error, unreachable), when a GPU of it is unhealthy or its health
    was not fully checked, or when it has a pending restore (what M(zeromib.gpu.gpu_release) stopped and
    M(zeromib.gpu.gpu_restore) has not put back; C(report.md) and C(report.html) list those in a section of their own).
    The HTML page groups those hosts by reason and draws its heat map one page of hosts at a time, so that a 4,000-host page
    stays under 5 MB.
  - It never fails on what it finds; it returns a verdict (RV(verdict)) for the task file's C(assert).
author:
  - zeromib.gpu contributors (@zeromib)
attributes:
  check_mode:
    details: The report is built and the verdict returned, but nothing is written, neither report nor part.
options:
  hosts_data:
    description:
      - Host records C({host, status, error, gpu}) as P(zeromib.gpu.gpu_audit_model#filter) takes them. Wins over every other
        source.
    type: list
    elements: dict
  hosts_data_var:
    description:
      - The name of a variable that holds such records, read as it is, never templated (saved host data is not a template,
        and a command line may contain braces). Used when the variable is defined; C(playbooks/tasks/audit_report.yml) passes
        V(gpu_audit_hosts_data).
    type: str
  result_var:
    description:
      - When no records and no parts are given, the registered M(zeromib.gpu.gpu_facts) result of this name is read, once and
        raw, for every host of the play (C(ansible_play_hosts_all)), unreachable and failed hosts included.
    type: str
    default: __gpu_audit_facts
  expected_hosts:
    description:
      - Every host the audit targeted; one without a record is reported as V(error). Defaults to the play's hosts when the
        results are read from the play, to the parts' hosts with O(parts), else none.
    type: list
    elements: str
  parts:
    description:
      - Part files written by the slices of a sliced audit (O(write_part)), directories of them (every C(*.json)), or globs.
        Their hosts are merged into one report; a host in two parts fails the task, naming it.
    type: list
    elements: path
    default: []
  write_part:
    description:
      - Write this run's host records as one part here. A path ending in C(/) (or an existing directory) gets a file named
        after the hosts (C(gpu-audit-part-<hash>.json)), so that a slice run again replaces its own part.
    type: path
  report:
    description: Write the four report files. V(false) for a slice that only writes its part.
    type: bool
    default: true
  report_dir:
    description:
      - Where the report goes. A relative path is relative to the controller's working directory; C(~) is expanded. Created
        if missing.
    type: path
    default: gpu_audit_report
  title:
    description: Heading of the Markdown and HTML reports.
    type: str
    default: GPU fleet audit
  max_used_mib:
    description: The threshold the report states (C(settings.max_used_mib)); each host's own gpu_facts verdict decides.
    type: int
    default: 0
  busy_pct:
    description: A GPU at or above this share of memory used is listed in C(findings.busy_gpus).
    type: float
    default: 50
  queries:
    description: "Your own JMESPath queries over the model, C({name: expression}); results land in C(report.json) under C(queries)."
    type: dict
    default: {}
  fail_on_dirty:
    description: The verdict fails when some host is dirty, in error or unreachable.
    type: bool
    default: false
  fail_on_unhealthy:
    description: The verdict fails when some GPU is unhealthy or its health was not fully checked.
    type: bool
    default: false
  generated_at:
    description: When the audit ran, seconds since the epoch. Defaults to the earliest part's time with O(parts), else now.
    type: float
# The attributes every action plugin shares, in one fragment (plugins/doc_fragments/controller_action.py).
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
  - ansible.builtin.action_common_attributes.flow
  - zeromib.gpu.controller_action
notes:
  - C(report.json) holds one host per line inside an indented document (the diff of two audits shows the hosts that changed).
  - Needs the C(jmespath) and C(jinja2) Python libraries on the controller (ansible-core requires Jinja already).
seealso:
  - module: zeromib.gpu.gpu_facts
  - plugin: zeromib.gpu.gpu_audit_model
    plugin_type: filter
"""

EXAMPLES = r"""
- name: Audit (what playbooks/audit_gpus.yml does)
  hosts: gpu_nodes
  gather_facts: false
  ignore_unreachable: true
  tasks:
    - name: Read GPU memory, processes, holders and health
      zeromib.gpu.gpu_facts:
        fail_on_error: false
      register: __gpu_audit_facts
      ignore_errors: true

    - name: Write the fleet report on the controller
      zeromib.gpu.gpu_audit_report:
        report_dir: /srv/reports/gpu
        fail_on_dirty: true
      register: report
      run_once: true
      delegate_to: localhost

    - name: Fail when some host is not clean
      ansible.builtin.assert:
        that: not report.verdict.failed
        fail_msg: "{{ report.verdict.msg }}"
      run_once: true

- name: Merge the parts of a sliced audit
  hosts: localhost
  gather_facts: false
  tasks:
    - name: One report from every slice's part
      zeromib.gpu.gpu_audit_report:
        parts: [/shared/gpu-audit/run-42/]
        report_dir: /srv/reports/gpu
"""

RETURN = r"""
report_dir:
  description: The report directory, absolute.
  type: str
  returned: always
files:
  description: The four report files (written unless in check mode).
  type: list
  elements: str
  returned: when O(report=true)
part:
  description: The part file written (or, in check mode, that would be).
  type: str
  returned: when O(write_part) is set
summary:
  description: The model's C(summary) (hosts, GPUs, MiB, holders, unhealthy and not fully checked GPUs).
  type: dict
  returned: always
attention:
  description: The hosts that need attention, C({host, status, reason, health, pending_restore}) (C(pending_restore) counts the entries).
  type: list
  elements: dict
  returned: always
summary_msg:
  description: The one-line fleet summary, ending with the path of C(report.html).
  type: str
  returned: always
verdict:
  description:
    - C(failed) - whether O(fail_on_dirty) / O(fail_on_unhealthy) fail the run; C(msg) - the message naming each failing host
      with its reason; C(hosts) - their names.
  type: dict
  returned: always
elapsed_s:
  description: Seconds the step took.
  type: float
  returned: always
"""
