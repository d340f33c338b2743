# Copyright (c) zeromib.gpu developers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: gpu_audit_prom
short_description: Render a GPU audit report as Prometheus text (textfile collector)
version_added: 0.1.0
author: zeromib.gpu developers
description:
  - Renders the model built by P(zeromib.gpu.gpu_audit_model#filter) in the Prometheus text
    exposition format, one C(# HELP) and C(# TYPE) line per metric family, every metric a gauge,
    no sample timestamps (node_exporter's textfile collector rejects them).
  - Label values are escaped as the format requires (backslash, double quote, line feed).
  - Per-GPU and per-host samples whose value is unknown are left out rather than written as 0.
  - "Metrics: C(zeromib_gpu_audit_timestamp_seconds), C(zeromib_gpu_audit_hosts{status}),
    C(zeromib_gpu_host_up{host}), C(zeromib_gpu_host_clean{host}),
    C(zeromib_gpu_host_info{host,status,driver_version,cuda_version}), C(zeromib_gpu_devices{host}),
    C(zeromib_gpu_holders{host}), C(zeromib_gpu_nvml_clients{host}), C(zeromib_gpu_pending_restore{host}),
    C(zeromib_gpu_memory_used_mib{host,gpu,uuid,name}),
    C(zeromib_gpu_memory_total_mib{host,gpu,uuid,name}), C(zeromib_gpu_clean{host,gpu,uuid}), C(zeromib_gpu_healthy{host,gpu,uuid}),
    C(zeromib_gpu_health_checked{host,gpu,uuid}), C(zeromib_gpu_ecc_uncorrected{host,gpu,uuid}), C(zeromib_gpu_xid_recent{host,gpu,uuid})
    (the last four only where gpu_facts read health)."
options:
  _input:
    description: The report model from P(zeromib.gpu.gpu_audit_model#filter).
    type: dict
    required: true
seealso:
  - plugin: zeromib.gpu.gpu_audit_model
    plugin_type: filter
"""

EXAMPLES = r"""
- name: Write the audit for node_exporter's textfile collector
  ansible.builtin.copy:
    content: "{{ hosts_data | zeromib.gpu.gpu_audit_model | zeromib.gpu.gpu_audit_prom }}"
    dest: /var/lib/node_exporter/textfile/gpu_audit.prom
    mode: "0644"
"""

RETURN = r"""
_value:
  description: The metrics, ending with a line feed.
  type: str
  sample: |
    # HELP zeromib_gpu_host_up 1 when the host answered with GPU facts, 0 when unreachable or in error.
    # TYPE zeromib_gpu_host_up gauge
    zeromib_gpu_host_up{host="node01"} 1
"""

import typing as t

from ansible_collections.zeromib.gpu.plugins.plugin_utils._audit_prom import escape_label_value, gpu_audit_prom

# The rendering is plugin_utils/_audit_prom.py's (the report action uses it too).
__all__ = ["FilterModule", "escape_label_value", "gpu_audit_prom"]


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"gpu_audit_prom": gpu_audit_prom}
