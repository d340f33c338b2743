# Test-only callback: records every task result as JSON in $ZEROMIB_FLEET_JSON_OUT, next to
# the normal human-readable stdout, so tests can assert on module returns: the fleet's
# (tests/fleet/conftest.py), the namespace hosts' (tests/integration/ansible_in_ns.py), the
# managed-Python matrix and the benchmarks, without a task that writes the result (a module run).
from __future__ import annotations

import json
import os

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: fleet_json
type: aggregate
short_description: write all task results to the file named by ZEROMIB_FLEET_JSON_OUT
description: Used by tests/fleet/conftest.py; not part of the collection.
requirements: [enable in callbacks_enabled]
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "fleet_json"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.out = {"plays": [], "tasks": [], "stats": {}}

    def v2_playbook_on_play_start(self, play):
        self.out["plays"].append(play.get_name())

    def _record(self, result, status):
        task = result._task
        self.out["tasks"].append({
            "play": self.out["plays"][-1] if self.out["plays"] else None,
            "task": task.get_name(),
            "action": task.action,
            "host": result._host.get_name(),
            "status": status,
            "result": self._clean(result._result),
        })

    @staticmethod
    def _clean(res):
        try:
            return json.loads(json.dumps(res, default=str))
        except (TypeError, ValueError):
            return {"repr": repr(res)}

    def v2_runner_on_ok(self, result):
        self._record(result, "changed" if result._result.get("changed") else "ok")

    def v2_runner_on_failed(self, result, ignore_errors=False):
        self._record(result, "ignored" if ignore_errors else "failed")

    def v2_runner_on_unreachable(self, result):
        self._record(result, "unreachable")

    def v2_runner_on_skipped(self, result):
        self._record(result, "skipped")

    def v2_playbook_on_stats(self, stats):
        self.out["stats"] = {h: stats.summarize(h) for h in sorted(stats.processed)}
        self._write()

    def _write(self):
        path = os.environ.get("ZEROMIB_FLEET_JSON_OUT")
        if path:
            with open(path, "w") as f:
                json.dump(self.out, f, indent=1)
