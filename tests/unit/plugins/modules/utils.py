# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Run a module's main() in the test process, the usual way of Ansible's unit tests: the
arguments as AnsibleModule reads them, exit_json/fail_json raising what they were given."""

from __future__ import annotations

import contextlib
import json
import typing as t

import pytest

from ansible.module_utils import basic
from ansible.module_utils.common.text.converters import to_bytes


class AnsibleExitJson(Exception):
    """The module called exit_json; `.result` is what it returned."""

    def __init__(self, result: dict[str, t.Any]) -> None:
        super().__init__(result)
        self.result = result


class AnsibleFailJson(Exception):
    """The module called fail_json; `.result` is what it returned (msg included)."""

    def __init__(self, result: dict[str, t.Any]) -> None:
        super().__init__(result)
        self.result = result


def _exit_json(self: basic.AnsibleModule, **kwargs: t.Any) -> t.NoReturn:
    raise AnsibleExitJson(kwargs)


def _fail_json(self: basic.AnsibleModule, msg: str = "", **kwargs: t.Any) -> t.NoReturn:
    kwargs["failed"] = True
    kwargs["msg"] = msg
    raise AnsibleFailJson(kwargs)


@contextlib.contextmanager
def module_args(args: dict[str, t.Any]) -> t.Iterator[None]:
    """The module arguments AnsibleModule will read (ansible-core's own helper where it has one)."""
    try:
        from ansible.module_utils.testing import patch_module_args  # ansible-core 2.19+
    except ImportError:
        patch_module_args = None
    if patch_module_args is not None:
        with patch_module_args(args):
            yield
        return
    saved = basic._ANSIBLE_ARGS
    basic._ANSIBLE_ARGS = to_bytes(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    try:
        yield
    finally:
        basic._ANSIBLE_ARGS = saved


def fail_of(main: t.Callable[[], None], args: dict[str, t.Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, t.Any]:
    """Run `main` with `args`; the result of its fail_json (the test fails if it exits instead)."""
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)
    with module_args(args), pytest.raises(AnsibleFailJson) as info:
        main()
    return info.value.result
