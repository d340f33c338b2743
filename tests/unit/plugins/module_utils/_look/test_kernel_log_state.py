# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The kernel log read incrementally (issue 36): what a gate keeps of the journal it read, and
that a doubt about it always means a whole read. The same verdict as a whole read on the same
kernel logs is proved through real Ansible in tests/integration/test_gpu_health_gate.py."""

from __future__ import annotations

import json
import os
import stat
import time

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log_state as log_state

NOW = 1764556800.0  # 2025-12-01T02:40:00Z
BOOT = "5c5f1a4e-8f0e-4d5e-9d3c-1f0a2b3c4d5e"


def stamp(epoch):
    return time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(epoch))


def xid_line(epoch, xid=79, bus="0000:18:00"):
    return f"{stamp(epoch)} node01 kernel: NVRM: Xid (PCI:{bus}): {xid:d}, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def test_journal_stamps_of_old_and_new_systemd_read_the_same_time():
    assert log_state.line_time("2025-12-01T02:40:00+0000 node01 kernel: x") == NOW
    assert log_state.line_time("2025-12-01T03:40:00+01:00 node01 kernel: x") == NOW
    assert log_state.line_time("[  5.000000] NVRM: Xid (PCI:0000:18:00): 79") is None


def test_kept_lines_leave_with_the_window_and_a_line_without_a_time_never_does():
    old, recent = xid_line(NOW - 25 * 3600), xid_line(NOW - 3600)
    assert log_state.in_window([old, recent, "no stamp: NVRM: Xid (PCI:0000:18:00): 79"], 24.0, NOW) == [
        recent, "no stamp: NVRM: Xid (PCI:0000:18:00): 79"]
    # journalctl --since -1440min keeps a line stamped at the cut (its second truncated).
    assert log_state.in_window([xid_line(NOW - 24 * 3600)], 24.0, NOW) == [xid_line(NOW - 24 * 3600)]


def state(**changes):
    record = {"format": 1, "boot_id": BOOT, "window_hours": 24.0, "read_at": NOW - 60, "cursor": "s=1;i=2", "lines": [xid_line(NOW - 120)]}
    record.update(changes)
    return record


def test_a_state_stands_for_the_read_only_of_this_boot_this_window_and_within_it():
    assert log_state.usable(state(), BOOT, 24.0, NOW)
    assert not log_state.usable(state(), "another-boot", 24.0, NOW)  # a reboot: the whole window
    assert not log_state.usable(state(), None, 24.0, NOW)
    assert not log_state.usable(state(), BOOT, 48.0, NOW)  # xid_window_hours changed
    assert not log_state.usable(state(read_at=NOW - 25 * 3600), BOOT, 24.0, NOW)
    assert not log_state.usable(state(read_at=NOW + 60), BOOT, 24.0, NOW)  # the clock went back
    assert not log_state.usable(state(cursor=""), BOOT, 24.0, NOW)
    assert not log_state.usable(state(lines="Xid 79"), BOOT, 24.0, NOW)
    assert not log_state.usable(state(format=2), BOOT, 24.0, NOW)
    assert not log_state.usable(["not", "a", "state"], BOOT, 24.0, NOW)


def test_no_state_is_kept_for_a_line_whose_time_cannot_be_read():
    assert log_state.new_state(BOOT, 24.0, "c", [xid_line(NOW)], NOW)["lines"] == [xid_line(NOW)]
    assert log_state.new_state(BOOT, 24.0, "c", ["NVRM: Xid (PCI:0000:18:00): 79"], NOW) is None
    assert log_state.new_state(BOOT, 24.0, None, [], NOW) is None
    assert log_state.new_state(None, 24.0, "c", [], NOW) is None


def test_a_gate_that_read_nothing_new_writes_nothing_until_half_the_window_has_passed():
    kept = state()
    assert log_state.same_read(kept, dict(kept, read_at=NOW))
    assert not log_state.same_read(kept, dict(kept, read_at=kept["read_at"] + 12 * 3600))
    assert not log_state.same_read(kept, dict(kept, cursor="s=1;i=3"))
    assert not log_state.same_read(kept, dict(kept, lines=[]))
    assert not log_state.same_read(None, kept)


def test_state_is_written_root_only_and_read_back(tmp_path):
    path = str(tmp_path / "zeromib-gpu" / "kernel-log.json")
    log_state.write(state(), path)
    assert log_state.read(path) == state()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert os.listdir(os.path.dirname(path)) == ["kernel-log.json"]


def test_a_corrupt_or_untrusted_state_reads_as_none(tmp_path):
    path = tmp_path / "zeromib-gpu" / "kernel-log.json"
    log_state.write(state(), str(path))
    path.write_text("{not json")
    assert log_state.read(str(path)) is None
    path.write_text(json.dumps(state()))
    os.chmod(str(path), 0o666)
    assert log_state.read(str(path)) is None
    os.chmod(str(path), 0o600)
    os.chmod(str(path.parent), 0o777)
    assert log_state.read(str(path)) is None
    os.chmod(str(path.parent), 0o700)
    link = tmp_path / "zeromib-gpu" / "link.json"
    link.symlink_to(path)
    assert log_state.read(str(link)) is None
    assert log_state.read(str(tmp_path / "absent" / "kernel-log.json")) is None


# --- KernelLog with a state: a journalctl that prints what it was asked and a fixed journal


def _journalctl(tmp_path, whole, after, rc_after=0):
    """A journalctl that logs its argv and prints `whole` for --since, `after` for --after-cursor."""
    body = '#!/bin/sh\necho "$*" >> {log}\ncase "$*" in\n  *--after-cursor*) printf %s {after}; exit {rc};;\n  *) printf %s {whole};;\nesac\n'.format(
        log=tmp_path / "argv", after=_quote(after), whole=_quote(whole), rc=rc_after)
    (tmp_path / "journalctl").write_text(body)
    os.chmod(str(tmp_path / "journalctl"), 0o755)


def _quote(text):
    return "'" + text.replace("'", "'\"'\"'") + "'"


def _read(tmp_path, state_path):
    log = _kernel_log.KernelLog(24.0, search_path=str(tmp_path), state_path=state_path)
    log._which = lambda name: str(tmp_path / name) if (tmp_path / name).exists() else None
    log.start()
    found, history = log.xids()
    return log, found, history


def test_next_gate_reads_only_after_the_cursor_and_still_reports_the_earlier_xid(tmp_path):
    now = time.time()
    first, second = xid_line(now - 600), xid_line(now - 5, xid=48, bus="0000:2a:00")
    _journalctl(tmp_path, f"{first}\n-- cursor: s=a;i=1\n", f"{second}\n-- cursor: s=a;i=2\n")
    state_path = str(tmp_path / "state" / "kernel-log.json")
    log, found, _history = _read(tmp_path, state_path)
    assert (log.source, log.incremental) == ("journalctl", False) and [x["xid"] for x in found["0000:18:00"]] == [79]
    assert log_state.read(state_path)["cursor"] == "s=a;i=1"
    log, found, _history = _read(tmp_path, state_path)
    assert (log.source, log.incremental, log.error, log.fallback) == ("journalctl", True, None, None)
    assert ([x["xid"] for x in found["0000:18:00"]], [x["xid"] for x in found["0000:2a:00"]]) == ([79], [48])
    asked = (tmp_path / "argv").read_text().splitlines()
    assert "--since" in asked[0] and "--show-cursor" in asked[0] and "--after-cursor s=a;i=1" in asked[1]
    assert log_state.read(state_path)["lines"] == [first, second]


def test_nothing_new_is_no_reason_to_read_dmesg_and_keeps_the_cursor(tmp_path):
    now = time.time()
    _journalctl(tmp_path, f"{xid_line(now - 60)}\n-- cursor: s=a;i=1\n", "")
    (tmp_path / "dmesg").write_text("#!/bin/sh\necho dmesg >> {}\n".format(tmp_path / "argv"))
    os.chmod(str(tmp_path / "dmesg"), 0o755)
    state_path = str(tmp_path / "state" / "kernel-log.json")
    _read(tmp_path, state_path)
    log, found, _history = _read(tmp_path, state_path)
    assert (log.source, log.incremental) == ("journalctl", True) and [x["xid"] for x in found["0000:18:00"]] == [79]
    assert "dmesg" not in (tmp_path / "argv").read_text() and log_state.read(state_path)["cursor"] == "s=a;i=1"


def test_a_cursor_journalctl_refuses_means_a_whole_read(tmp_path):
    now = time.time()
    _journalctl(tmp_path, f"{xid_line(now - 60)}\n-- cursor: s=a;i=1\n", "Failed to seek to cursor: Invalid argument", rc_after=1)
    state_path = str(tmp_path / "state" / "kernel-log.json")
    _read(tmp_path, state_path)
    log, found, _history = _read(tmp_path, state_path)
    assert (log.source, log.incremental, log.error) == ("journalctl", False, None) and [x["xid"] for x in found["0000:18:00"]] == [79]


def test_a_state_of_another_boot_hides_no_xid(tmp_path):
    now = time.time()
    _journalctl(tmp_path, f"{xid_line(now - 60)}\n-- cursor: s=a;i=1\n", "-- cursor: s=a;i=1\n")
    state_path = str(tmp_path / "state" / "kernel-log.json")
    log_state.write(dict(state(lines=[]), boot_id="another-boot", read_at=now - 10), state_path)
    log, found, _history = _read(tmp_path, state_path)
    assert log.incremental is False and [x["xid"] for x in found["0000:18:00"]] == [79]
    assert log_state.read(state_path)["boot_id"] == log_state.boot_id()


def test_driver_reload_after_the_last_read_moves_earlier_xids_to_history(tmp_path):
    now = time.time()
    load = f"{stamp(now - 5)} node01 kernel: NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build"
    _journalctl(tmp_path, f"{xid_line(now - 600)}\n-- cursor: s=a;i=1\n", f"{load}\n-- cursor: s=a;i=2\n")
    state_path = str(tmp_path / "state" / "kernel-log.json")
    _read(tmp_path, state_path)
    log, found, history = _read(tmp_path, state_path)
    assert log.incremental and found == {} and [x["xid"] for x in history["0000:18:00"]] == [79]
    assert "580.159.04" in (log.driver_loaded or "")


def test_without_a_state_path_nothing_is_kept_and_no_cursor_is_asked(tmp_path):
    _journalctl(tmp_path, f"{xid_line(time.time() - 60)}\n", "")
    log, found, _history = _read(tmp_path, None)
    assert log.incremental is False and [x["xid"] for x in found["0000:18:00"]] == [79]
    assert "--show-cursor" not in (tmp_path / "argv").read_text()


def test_a_journal_with_no_kernel_line_is_an_empty_answer_though_show_cursor_exits_1(tmp_path):
    # systemd 252: `journalctl -k --show-cursor` with no matching entry prints nothing and exits 1
    # (measured on the fleet's Debian 12 hosts); that is no failure and leaves the Xid check done.
    (tmp_path / "journalctl").write_text('#!/bin/sh\necho "$*" >> {}\nexit 1\n'.format(tmp_path / "argv"))
    os.chmod(str(tmp_path / "journalctl"), 0o755)
    log, found, history = _read(tmp_path, str(tmp_path / "state" / "kernel-log.json"))
    assert (log.source, log.error, found, history) == ("journalctl", None, {}, {})
    assert "--show-cursor" in (tmp_path / "argv").read_text()


def test_a_fifo_or_a_too_deep_state_reads_as_none_without_blocking(tmp_path):
    """Review of issue 36: a FIFO at the state's path blocked the look forever; nested JSON past
    the recursion limit ended in a traceback."""
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    os.mkfifo(directory / "kernel-log.json", 0o600)
    assert log_state.read(str(directory / "kernel-log.json")) is None
    deep = directory / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    deep.chmod(0o600)
    assert log_state.read(str(deep)) is None
