# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""A failed task result whose reason is printed once, and that every consumer receives whole.

ansible-core 2.19 turns a failed result that an action returns into an error of its own: the
default callback prints it as `[ERROR]: Task failed: Action failed: <msg>`, a 5-line `Origin:`
excerpt of the task's file, and then the `fatal: [host]: FAILED! => {...}` line, which holds
`msg` again: the reason three times on the screen. 2.17 and 2.18 print the `fatal:` line only.
Hiding the result with no_log is no way out: callback plugins (AWX/AAP job events,
ansible-runner, ARA, json) then receive `{"censored": ...}`, and on 2.17/2.18 the terminal shows
nothing else either (docs/docsite/rst/guide_troubleshooting.rst, "The role in your own play").

Where the error carries the result itself and says that no `exception` goes with it (2.19's
`ContributesToTaskResult.omit_exception_key`, which `AnsibleActionSkip` uses), Ansible builds the
task's result from it without an error: one `fatal:` line with the whole result, as on 2.17.
Older releases take the returned dict as it is.
"""

from __future__ import annotations

import typing as t

from ansible.errors import AnsibleAction
from ansible.utils.display import Display

_display = Display()

# 2.19 and later: an error may contribute the task's result and omit the `exception` key.
OMITS_EXCEPTION = isinstance(getattr(AnsibleAction, "omit_exception_key", None), property)


class SaidOnce(AnsibleAction):
    """A failed result, raised so that Ansible keeps it as it is (msg once, no error summary)."""

    @property
    def result_contribution(self) -> t.Mapping[str, object]:
        return dict(self._result, failed=True)

    @property
    def omit_exception_key(self) -> bool:
        return True


def fail_once(result: dict[str, t.Any]) -> dict[str, t.Any]:
    """Return RESULT as the task's failed result (2.17, 2.18), or raise it so (2.19 and later)."""
    result["failed"] = True
    result.pop("exception", None)
    if OMITS_EXCEPTION:
        # 2.19 keeps a task's warnings from what was displayed during it, not from a raised result
        # (TaskExecutor._execute replaces them): said through Display, they stay the result's warnings.
        for warning in result.pop("warnings", None) or []:
            _display.warning(str(getattr(getattr(warning, "event", None), "msg", None) or warning))
        raise SaidOnce(str(result.get("msg", "")), result=result)
    return result


def result_of(run: t.Callable[[], dict[str, t.Any]]) -> dict[str, t.Any]:
    """The result a task gets from RUN (an action's run), raised or returned: for tests."""
    try:
        return run()
    except SaidOnce as said:
        return dict(said.result_contribution)
