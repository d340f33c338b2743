# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A kernel line proves only what the kernel wrote (issue 54): a user's crash in a file named like
an NVIDIA driver message writes that name into the kernel's segfault report. Read from the real
capture of such crashes (tests/fixtures/kernel-log/segfault-linux-6.18: a forged Xid and a forged
driver load, each in the comm and in the file name, with a line feed, U+2028 and U+0085), as
journalctl, dmesg and dmesg through syslog(2) printed them: no Xid, no driver load; the driver's
own lines, as real drivers print them, still read."""

from __future__ import annotations

import os
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health as health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _kernel_log_state as log_state

CAPTURE = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "kernel-log", "segfault-linux-6.18")
# How each file of the capture was read (its README): the forms the modules read.
FORMS = {"journalctl": "journalctl-short-iso.txt", "dmesg": "dmesg.txt", "dmesg-syslog": "dmesg-syslog.txt"}
# The capture's journal lines all read the time journald imported them.
CAPTURE_STAMP = "2026-12-05T11:23:43+0000"
# The driver's own Xid 79 (its wording on R5xx drivers, public reports), logged before the crashes.
REAL_XID = {
    "journalctl": "2026-12-05T11:20:00+0000 vm kernel: NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, "
                  "GPU has fallen off the bus.",
    "dmesg": "[ 7000.000000] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
}
REAL_XID["dmesg-syslog"] = REAL_XID["dmesg"]


def captured(form):
    """The capture's lines as the module splits the reader's output."""
    with open(os.path.join(CAPTURE, FORMS[form]), encoding="utf-8", newline="") as handle:
        return log_state.log_lines(handle.read())


def gpu_on(bus_id):
    return {"index": 0, "pci_bus_id": bus_id, "persistence_mode": "Enabled", "recovery_action": "None"}


def test_the_capture_holds_the_forged_text_the_old_search_believed():
    # The search anywhere in a line (the code before issue 54) found both forgeries in every form.
    for form in FORMS:
        lines = captured(form)
        assert any(_kernel_log._XID.search(line) and _kernel_log._XID.search(line).group("xid") == "79" for line in lines), form
        assert any(_kernel_log._DRIVER_LOAD.search(line) for line in lines), form


@pytest.mark.parametrize("form", list(FORMS))
def test_a_users_crash_is_neither_an_xid_nor_a_driver_load(form):
    lines = captured(form)
    assert _kernel_log.parse_xids(lines) == {}
    assert _kernel_log.split_at_driver_load(lines) == ([], [], None)
    assert _kernel_log.driver_events(lines) == []


@pytest.mark.parametrize("form", list(FORMS))
def test_a_forged_xid_beside_a_healthy_gpu_leaves_it_healthy(form):
    found = _kernel_log.parse_xids(captured(form))
    gpu = health.Health(health.Checks(), found).annotate([gpu_on("00000000:18:00.0")])[0]
    assert (gpu["healthy"], gpu["health_issues"], gpu["health"]["xids"]) == (True, [], [])


@pytest.mark.parametrize("form", list(FORMS))
def test_a_forged_driver_load_after_a_real_xid_hides_nothing(form):
    lines = [REAL_XID[form]] + captured(form)
    after, before, loaded = _kernel_log.split_at_driver_load(lines)
    assert (after, before, loaded) == ([REAL_XID[form]], [], None)
    found = _kernel_log.parse_xids(after)
    gpu = health.Health(health.Checks(), found).annotate([gpu_on("00000000:18:00.0")])[0]
    assert gpu["healthy"] is False and [x["xid"] for x in gpu["health"]["xids"]] == [79]
    assert gpu["health_issues"][0].startswith("Xid 79 (GPU has fallen off the bus) in the kernel log"), gpu["health_issues"]


# The driver's lines as real drivers printed them: (id, lines, {bus: [Xids]} since the load, the load's version or None)
REAL_LINES = [
    ("journal-xid-79-systemd-252",
     ["2026-11-29T09:08:01+0000 node01 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."],
     {"0000:18:00": [79]}, None),
    ("journal-zone-with-colon-newer-systemd",
     ["2026-11-29T09:08:01+00:00 node01 kernel: NVRM: Xid (PCI:0000:18:00): 48, pid=1234, name=python3, An uncorrectable double bit error"],
     {"0000:18:00": [48]}, None),
    ("journal-older-driver-bus-without-pci",
     ["2026-11-29T09:09:01+0000 node01 kernel: NVRM: Xid (0000:2A:00): 94, pid=1234, name=python3, Contained: SM (0x1). RST: No, D-RST: No"],
     {"0000:2a:00": [94]}, None),
    # Public dmesg reports: an Xid 79 after the driver's GPU-at and serial-number lines; a six-digit uptime.
    ("dmesg-xid-79-after-the-drivers-gpu-lines",
     ["[ 4254.197816] NVRM: GPU at PCI:0000:5d:00: GPU-f1906b9b-557a-e961-045c-9fe4be3ce012",
      "[ 4254.197854] NVRM: GPU Board Serial Number: 1653923026510",
      "[ 4254.197860] NVRM: Xid (PCI:0000:5d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
      "[ 4254.197871] NVRM: GPU 0000:5d:00.0: GPU has fallen off the bus.",
      "[ 4254.197913] NVRM: A GPU crash dump has been created. If possible, please run",
      "               NVRM: nvidia-bug-report.sh as root to collect this data before"],
     {"0000:5d:00": [79]}, None),
    ("dmesg-six-digit-uptime",
     ["[349507.500659] NVRM: Xid (PCI:0000:07:00): 119, pid=2357, name=nv-hostengine, Timeout waiting for RPC from GPU0 GSP! Expected "
      "function 76 (GSP_RM_CONTROL) (0x90cc0301 0xc)."],
     {"0000:07:00": [119]}, None),
    # The same report read in one microsecond (a syslog(2) read prints no finer time): the driver's lines in a row all count.
    ("dmesg-driver-lines-in-one-microsecond",
     ["[  113.669214] NVRM: GPU at PCI:0000:00:06: GPU-fcdeaa4c-664a-4de8-2e32-23e14628ce8c",
      "[  113.669214] NVRM: GPU Board Serial Number: 1651522000466",
      "[  113.669214] NVRM: Xid (PCI:0000:00:06): 119, pid='<unknown>', name=<unknown>, Timeout waiting for RPC from GSP!",
      "[  113.669214] NVRM: Xid (PCI:0000:00:06): 119, pid='<unknown>', name=<unknown>, Timeout waiting for RPC from GSP!"],
     {"0000:00:06": [119, 119]}, None),
    # The real H200's load line (docs/real-gpu/run-2026-12-01-2320-probe), then an Xid after it.
    ("dmesg-open-module-load-on-the-real-h200",
     ["[    0.464501] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)",
      "[  300.000000] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python3, Graphics Exception"],
     {"0000:18:00": [13]}, "580.159.04"),
    ("journal-proprietary-module-load",
     ["2026-11-29T09:00:00+0000 node01 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
      "2026-11-29T09:05:00+0000 node01 kernel: NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.105.08  Thu Oct 19 18:56:32 UTC 2025"],
     {}, "580.105.08"),
]


@pytest.mark.parametrize("lines,xids,version", [row[1:] for row in REAL_LINES], ids=[row[0] for row in REAL_LINES])
def test_the_drivers_own_lines_still_read(lines, xids, version):
    after, _before, loaded = _kernel_log.split_at_driver_load(lines)
    found = _kernel_log.parse_xids(after)
    assert dict((bus, [x["xid"] for x in seen]) for bus, seen in found.items()) == xids
    assert (version in loaded) if version else loaded is None, loaded


# (id, line, (source, stamp, message) or None: the line starts no message of the kernel)
KERNEL_MESSAGES = [
    ("journal", "2026-12-01T02:20:22+0000 node01 kernel: NVRM: Xid (PCI:0000:18:00): 79, x",
     ("journalctl", "2026-12-01T02:20:22+0000", "NVRM: Xid (PCI:0000:18:00): 79, x")),
    ("journal-zone-with-colon", "2026-12-01T02:20:22+00:00 n kernel: m", ("journalctl", "2026-12-01T02:20:22+00:00", "m")),
    ("journal-utc-z", "2026-12-01T02:20:22Z n kernel: m", ("journalctl", "2026-12-01T02:20:22Z", "m")),
    ("journal-entry-without-a-host-name", "2026-12-01T02:20:22+0000 kernel: m", ("journalctl", "2026-12-01T02:20:22+0000", "m")),
    ("dmesg-padded", "[    5.000000] NVRM: loading", ("dmesg", "5.000000", "NVRM: loading")),
    ("dmesg-six-digits", "[349507.500659] m", ("dmesg", "349507.500659", "m")),
    ("journal-further-line-indented", "                                    NVRM: Xid (PCI:0000:18:00): 79, x", None),
    ("dmesg-further-line-indented", "               NVRM: Xid (PCI:0000:18:00): 79, x", None),
    ("journal-line-of-another-identifier", "2026-12-01T02:20:22+0000 node01 systemd[1]: NVRM: Xid (PCI:0000:18:00): 79, x", None),
    ("journalctl-cursor-note", "-- cursor: s=a;i=1", None),
    ("no-prefix", "NVRM: Xid (PCI:0000:18:00): 79, x", None),
    ("dmesg-human-time-not-asked-for", "[Sun Mar 29 19:20:37 2026] NVRM: Xid (PCI:0000:5f:00): 79, x", None),
    ("prefix-not-at-the-line-start", "x 2026-12-01T02:20:22+0000 node01 kernel: NVRM: Xid (PCI:0000:18:00): 79, x", None),
]


@pytest.mark.parametrize("line,expected", [row[1:] for row in KERNEL_MESSAGES], ids=[row[0] for row in KERNEL_MESSAGES])
def test_where_the_kernels_message_starts(line, expected):
    parsed = log_state.kernel_message(line)
    assert (tuple(parsed) if parsed else None) == expected


# (id, lines) a user can make the kernel print, none the driver's
NOT_THE_DRIVERS = [
    # The capture's comm: the message starts with "NVRM: " but reports a task.
    ("comm-named-like-the-driver", ["[ 7113.185133] NVRM: Xid (PCI:[12327]: segfault at 0 ip 000055e405e81132 sp 00007ffc10c54ed0 error 6"]),
    ("comm-with-bytes-outside-ascii-as-dmesg-escapes-them",
     ["[ 7113.185133] NVRM: \\xe2\\x80\\xa8\\xe2\\x80\\xa8\\xe2\\x80\\xa8[12327]: segfault at 0 ip 000055e405e81132 sp 00007ffc10c54ed0",
      "[ 7113.185133] NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.[1132,55e405e81000+1000]"]),
    # A comm named like the driver, then a line feed in the file name, read through syslog(2).
    ("syslog-form-after-a-task-report-with-the-drivers-prefix",
     ["[ 7113.185133] NVRM: Xid (PCI:[12327]: segfault at 0 ip 000055e405e81132 sp 00007ffc10c54ed0 error 6 in x",
      "[ 7113.185133] NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.[1132,55e405e81000+1000]"]),
    # Any message with a file name (fs/exec.c quotes the executable's path): its further lines in syslog(2)'s form.
    ("syslog-form-after-another-subsystems-line",
     ["[  812.000001] process '/home/u/x",
      "[  812.000001] NVRM: GPU at PCI:0000:18:00: GPU-0",
      "[  812.000001] NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.' started with executable stack"]),
]


@pytest.mark.parametrize("lines", [row[1] for row in NOT_THE_DRIVERS], ids=[row[0] for row in NOT_THE_DRIVERS])
def test_what_a_user_can_make_the_kernel_print_is_not_the_drivers(lines):
    assert log_state.driver_messages(lines) == [] and _kernel_log.parse_xids(lines) == {}


def test_the_log_is_split_at_line_feeds_only():
    text = "\n".join(captured("journalctl")) + "\n"
    forged = [line for line in text.splitlines() if log_state.kernel_message(line) and _kernel_log._XID.match(log_state.kernel_message(line).message)]
    # str.splitlines() breaks the U+2028 crash's line where the user wrote a whole journal line.
    assert forged and forged[0].startswith("2026-12-05T11:23:04+0000 vm kernel: NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus.")
    assert log_state.log_lines(text) == captured("journalctl") and _kernel_log.parse_xids(log_state.log_lines(text)) == {}
    assert log_state.log_lines("a\u2028b\x85c\rd\n\ne\n") == ["a\u2028b\x85c\rd", "", "e"]


# --- KernelLog reading the capture as the commands print it


def _reader(tmp_path, name, text):
    (tmp_path / (name + ".txt")).write_text(text, encoding="utf-8")
    (tmp_path / name).write_text("#!/bin/sh\ncat '{}'\n".format(tmp_path / (name + ".txt")))
    os.chmod(str(tmp_path / name), 0o755)


def _read(tmp_path, state_path=None):
    log = _kernel_log.KernelLog(24.0, search_path=str(tmp_path), state_path=state_path)
    log._which = lambda name: str(tmp_path / name) if (tmp_path / name).exists() else None
    log.start()
    return log, log.xids()


def _now_journal(lines):
    """The capture's journal lines at a time inside the window."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(time.time() - 60))
    return [line.replace(CAPTURE_STAMP, now) for line in lines]


def test_journalctl_printing_the_crashes_reads_no_xid_and_keeps_none(tmp_path):
    real = _now_journal([REAL_XID["journalctl"].replace("2026-12-05T11:20:00+0000", CAPTURE_STAMP)])[0]
    _reader(tmp_path, "journalctl", "\n".join([real] + _now_journal(captured("journalctl"))) + "\n-- cursor: s=a;i=9\n")
    state_path = str(tmp_path / "state" / "kernel-log.json")
    log, (found, history) = _read(tmp_path, state_path)
    assert (log.source, log.error, log.driver_loaded) == ("journalctl", None, None)
    assert [x["xid"] for x in found["0000:18:00"]] == [79] and history == {}
    assert log_state.read(state_path)["lines"] == [real]


def test_dmesg_printing_the_crashes_reads_no_xid(tmp_path):
    _reader(tmp_path, "journalctl", "")
    (tmp_path / "journalctl").write_text("#!/bin/sh\necho 'No journal files were found.' >&2\n")
    for form in ("dmesg", "dmesg-syslog"):
        _reader(tmp_path, "dmesg", "\n".join(captured(form)) + "\n")
        log, (found, history) = _read(tmp_path)
        assert (log.source, log.error, found, history, log.driver_loaded) == ("dmesg", None, {}, {}, None), form


def test_a_forged_line_an_earlier_version_kept_is_judged_again(tmp_path):
    kept = _now_journal(captured("journalctl")[:1])  # the comm-named crash, kept once for its "Xid"
    state = log_state.new_state(log_state.boot_id(), 24.0, "s=a;i=1", kept, time.time() - 30)
    state_path = str(tmp_path / "state" / "kernel-log.json")
    log_state.write(state, state_path)
    _reader(tmp_path, "journalctl", "-- cursor: s=a;i=1\n")
    log, (found, _history) = _read(tmp_path, state_path)
    assert (log.incremental, found) == (True, {})
    assert log_state.read(state_path)["lines"] == []


def test_a_large_kernel_log_is_read_as_it_streams_keeping_only_what_the_driver_checks_need():
    """Issue 66: a 100 MB kernel log was read whole and cost root 300 MiB. Now only the driver's
    lines (each with the dmesg lines before it) and the cursor are kept, the newest within the bound."""
    noise = b"".join(b"[ 12.%06d] usb 1-1: device descriptor read/64, error -71\n" % n for n in range(20000))
    xid = b"[ 13.000000] NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
    lines = _kernel_log.DriverLines(max_bytes=1 << 20)
    for _round in range(50):
        for start in range(0, len(noise), 65536):
            lines.feed(noise[start:start + 65536])
    lines.feed(xid[:40])
    lines.feed(xid[40:] + noise[:100])
    text = lines.text()
    assert lines.any_line and len(text) < 4096, len(text)
    assert text.splitlines()[-1] == xid.decode().strip() and text.splitlines()[-2].startswith("[ 12.019999] usb")
    small = _kernel_log.DriverLines(max_bytes=300)
    for _n in range(10):
        small.feed(xid)
    assert small.text().count("NVRM") == 2
    assert not _kernel_log.DriverLines(100).any_line
