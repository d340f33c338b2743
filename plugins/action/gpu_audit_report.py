# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The fleet audit's report in one controller step (documented in plugins/modules/gpu_audit_report.py).

hosts' data (the play's registered gpu_facts results, a variable of saved records, or part files
written by slices) -> the model (gpu_audit_model) -> JMESPath findings (the jmespath library) ->
report.json, report.md, report.html, gpu_audit.prom, each written through a temporary file and a
rename.

Why an action and not set_fact/copy/template tasks: at 4,000 hosts those templated the whole model
three times through Ansible's templar and sent every file through module arguments - 210 s where
the collection's own Python needs about 2 s (benchmarks/HISTORY.md, "The audit report at fleet scale (issue 26)"). Here the data is read
once, raw (saved host data is never a template: a command line may contain braces), and rendered
with Jinja directly. The report itself is plugin_utils/_audit_report.py's.
"""

from __future__ import annotations

import json
import os
import time
import typing as t

from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.plugins.action import ActionBase

from ansible_collections.zeromib.gpu.plugins.plugin_utils._audit_report import (
    ARGUMENT_SPEC, FILES, build_report, not_ready, part_document, part_name, play_results, read_parts, render, report_dir_of, summary_line,
    verdict, write_atomically,
)
from ansible_collections.zeromib.gpu.plugins.plugin_utils._plain import plain


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(ARGUMENT_SPEC)
    _supports_check_mode = True
    _supports_async = False

    def _params(self) -> dict[str, t.Any]:
        validator = ArgumentSpecValidator(ARGUMENT_SPEC)
        checked = validator.validate(dict(self._task.args))
        if checked.error_messages:
            raise AnsibleActionFail("zeromib.gpu.gpu_audit_report: {}".format("; ".join(checked.error_messages)))
        return checked.validated_parameters

    def _hosts_data(self, params: dict[str, t.Any], task_vars: dict[str, t.Any]) -> tuple[list[t.Any], list[str] | None, float | None]:
        """(records, expected hosts, generated_at) from the one source the task names."""
        expected = params["expected_hosts"]
        if params["hosts_data"] is not None:
            return plain(params["hosts_data"]), expected, None
        if params["hosts_data_var"] and params["hosts_data_var"] in task_vars:
            records = task_vars[params["hosts_data_var"]]
            if not isinstance(records, list):
                raise AnsibleActionFail("zeromib.gpu.gpu_audit_report: {} must be a list of host records, got {}".format(
                    params["hosts_data_var"], type(records).__name__))
            return plain(records), expected, None
        if params["parts"]:
            records, from_parts, epoch = read_parts(params["parts"])
            return records, sorted(set(from_parts) | set(expected or [])), epoch
        hosts = [str(h) for h in task_vars.get("ansible_play_hosts_all") or []]
        return play_results(task_vars, hosts, params["result_var"]), (expected if expected is not None else hosts), None

    def run(self, tmp: str | None = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        started = time.monotonic()
        params = self._params()
        check_mode = bool(self._task.check_mode)
        try:
            records, expected, parts_epoch = self._hosts_data(params, task_vars)
            epoch = params["generated_at"] if params["generated_at"] is not None else (parts_epoch or time.time())
            report_dir = report_dir_of(params["report_dir"])
            written = {}
            if params["write_part"]:
                part_path = os.path.expanduser(params["write_part"])
                hosts = [str(r.get("host")) for r in records if isinstance(r, dict)]
                if os.path.isdir(part_path) or part_path.endswith(os.sep):
                    part_path = os.path.join(part_path, part_name(sorted(set(hosts) | set(expected or []))))
                part_path = os.path.realpath(part_path)
                result["part"] = part_path
                if not check_mode:
                    os.makedirs(os.path.dirname(part_path), exist_ok=True)
                    written[part_path] = write_atomically(part_path, json.dumps(part_document(records, expected or [], epoch)) + "\n")
            report = build_report(records, expected, epoch, params["max_used_mib"], params["busy_pct"], params["title"], params["queries"])
        except AnsibleError:
            raise
        except (TypeError, ValueError, OSError) as exc:
            raise AnsibleActionFail(f"zeromib.gpu.gpu_audit_report: {exc}") from exc
        report_html = os.path.join(report_dir, "report.html")
        if params["report"]:
            files = render(report)
            if not check_mode:
                os.makedirs(report_dir, mode=0o755, exist_ok=True)
                for name in FILES:
                    written[os.path.join(report_dir, name)] = write_atomically(os.path.join(report_dir, name), files[name])
            result["files"] = [os.path.join(report_dir, name) for name in FILES]
        failing = not_ready(report, params["fail_on_dirty"], params["fail_on_unhealthy"])
        failed, message = verdict(report, failing, params["fail_on_dirty"], params["fail_on_unhealthy"], report_html)
        result.update({
            "changed": check_mode or any(written.values()),
            "report_dir": report_dir,
            "summary": report["summary"],
            "attention": report["findings"]["attention"],
            "summary_msg": summary_line(report, report_html),
            "verdict": {"failed": failed, "msg": message, "hosts": [e["host"] for e in failing]},
            "elapsed_s": round(time.monotonic() - started, 3),
            "msg": summary_line(report, report_html),
        })
        return result
