# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The one reader of /proc/PID/status (_holders.read_status) reads the kernel's fields whatever a
user puts in her process's name (issue 65).

The kernel writes the comm on the Name: line escaping only "\\n" and "\\\\" (fs/proc/array.c,
proc_task_name: seq_escape_str(..., "\\n\\\\")); every other byte, \\r, \\x0b, \\x0c, \\x1c-\\x1e and
the UTF-8 of U+0085 and U+2028 among them, comes out as it is. Each status below is built as the
kernel writes it, for a zombie whose group has no thread left: a name that spells `Threads:\\t2`
after a line break of str.splitlines() made gpu_release wait on it as a live zombie leader."""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata

from hypothesis import given
from hypothesis import strategies as st

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _guests
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _mounts

# Every character Python's str.splitlines() breaks at, and the one bytes.splitlines() and a
# text-mode file add to "\n": the kernel prints all but "\n" raw in a comm.
LINE_BREAKS = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\r\n")
FORGED = ("Threads:\t2", "PPid:\t1", "Uid:\t0\t0\t0\t0", "NSpid:\t1", "State:\tR (running)", "SigIgn:\tffffffffffffffff", "Tgid:\t1")
# The kernel's fields of the zombie, in its order (fs/proc/array.c: task_state, task_sig...).
KERNEL = (("Umask", "0022"), ("State", "Z (zombie)"), ("Tgid", "4711"), ("Ngid", "0"), ("Pid", "4711"), ("PPid", "4700"),
          ("TracerPid", "0"), ("Uid", "4242\t4242\t4242\t4242"), ("Gid", "4242\t4242\t4242\t4242"), ("FDSize", "0"), ("Groups", ""),
          ("NStgid", "4711\t12"), ("NSpid", "4711\t12"), ("NSpgid", "4700\t1"), ("NSsid", "4700\t1"), ("Threads", "1"),
          ("SigQ", "0/63375"), ("SigPnd", "0000000000000000"), ("ShdPnd", "0000000000000000"), ("SigBlk", "0000000000000000"),
          ("SigIgn", "0000000000000000"), ("SigCgt", "0000000000004000"))


def kernel_escape(comm: bytes) -> bytes:
    """proc_task_name's escaping of the Name: line (Linux 5.16+; older kernels wrote octal)."""
    return comm.replace(b"\\", b"\\\\").replace(b"\n", b"\\n")


def status_of(comm: bytes) -> bytes:
    lines = [b"Name:\t" + kernel_escape(comm)] + [f"{k}:\t{v}".encode() for k, v in KERNEL]
    return b"\n".join(lines) + b"\n"


def kernel_fields() -> dict[str, str]:
    return dict(KERNEL)


def check(status: bytes | str, comm_shown: str) -> None:
    fields = holders.parse_status(status)
    assert fields == dict(kernel_fields(), Name=comm_shown)
    assert holders.status_field(status, "Threads") == 1 and holders.status_field(status, "PPid") == 4700
    assert holders._uid_from_status(status) == 4242 and holders.status_ints(status, "NSpid") == [4711, 12]
    assert holders.signal_facts(status) == ("caught", False)
    assert holders.status_state(fields) == "Z"
    assert holders.holds_threads({"state": "Z", "threads": holders.status_field(status, "Threads")}) is False


# Names built from the characters that break lines elsewhere, forged fields, and any other text.
pieces = st.one_of(st.sampled_from(LINE_BREAKS), st.sampled_from(FORGED), st.text(min_size=0, max_size=4))
names = st.lists(pieces, max_size=6).map(lambda parts: "".join(parts).replace("\0", ""))


@given(names)
def test_no_name_changes_the_fields_read(name):
    comm = name.encode("utf-8")
    shown = kernel_escape(comm).decode("utf-8", "replace")
    check(status_of(comm), shown)


@given(st.binary(min_size=0, max_size=15).filter(lambda b: b"\0" not in b))
def test_no_comm_of_bytes_changes_the_fields_read(comm):
    """A comm is 15 bytes at most, cut anywhere in a multi-byte character."""
    check(status_of(comm), kernel_escape(comm).decode("utf-8", "replace"))


def test_every_unicode_line_break_and_control_character_in_a_name():
    """All of them at once, before each forged field: the exhaustive case beside the random ones."""
    breaks = [chr(c) for c in range(0x110000) if len(("a" + chr(c) + "b").splitlines()) > 1]
    controls = [chr(c) for c in range(0x20) if chr(c) not in ("\0",)] + ["\x7f"] + [chr(c) for c in range(0x80, 0xA0)]
    assert set(breaks) == {"\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"}
    for char in sorted(set(breaks) | set(controls)):
        for forged in FORGED:
            comm = (char + forged).encode("utf-8")
            check(status_of(comm), kernel_escape(comm).decode("utf-8"))
            check(status_of(comm).decode("utf-8"), kernel_escape(comm).decode("utf-8"))
    assert unicodedata.category("\u2028") == "Zl"


def test_read_status_and_its_users_on_a_proc_tree(tmp_path):
    """The readers that take a PID (the holder scan, the zombie check, guests' NSpid, status_of)
    all read through read_status: a forged name changes none of them."""
    comm = b"x\x0bThreads:\t2\x1cNSpid:\t1"
    (tmp_path / "4711").mkdir()
    (tmp_path / "4711" / "status").write_bytes(status_of(comm))
    (tmp_path / "4711" / "stat").write_bytes(b"4711 (x) Z 4700 4700 4700 0 -1 4 0 0 0 0 0 0 0 0 20 0 1 0 12345 0 0")
    assert holders.read_status(4711, str(tmp_path))["Threads"] == "1"
    assert holders.status_of(4711, str(tmp_path)) == ("Z", 4700)
    assert holders._start_time(4711, str(tmp_path)) is None  # a zombie with no thread left: gone
    assert _guests.ns_pids(4711, str(tmp_path)) == [4711, 12]
    assert holders._nspid_depth(4711, str(tmp_path)) == 2


def test_a_real_process_named_with_line_breaks_reads_as_the_kernel_wrote_it():
    """This machine's kernel, a child of this test named with the characters (not a rig: only its
    own child, ended by PID)."""
    name = "a\x0bThreads:\t9"
    code = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, ctypes.c_char_p(sys.argv[1].encode()), 0, 0, 0); "
            "print(1, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"1\n"
        with open(f"/proc/{child.pid}/status", "rb") as handle:
            raw = handle.read()
        assert len(raw.decode().splitlines()) > len(raw.split(b"\n")) - 1  # the kernel wrote the \x0b raw
        fields = holders.read_status(child.pid)
        assert fields["Name"] == name and holders.status_field(fields, "Threads") == 1
        assert holders.status_field(fields, "PPid") == os.getpid()
    finally:
        child.kill()
        child.wait()


def test_a_mount_point_a_user_names_shifts_no_field_of_mountinfo(tmp_path):
    """A FUSE mount in a user's folder is in the node's mountinfo under the name she chose: the
    kernel escapes a space, tab, newline and backslash, not \\x0b, \\x1c or \\r, which str.split(),
    bytes.split() and splitlines() all take for separators. Each table reads her mount as hers."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups, _shm
    point = "/home/alice/a\x0bb\x1cc\rd\x85e"
    text = ("36 35 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw\n"
            f"40 35 0:50 / {point} rw,nosuid,nodev shared:77 - fuse.stall stall rw,user_id=4242\n")
    (tmp_path / "mountinfo").write_bytes(text.encode("utf-8"))
    assert _cgroups.cgroup_mounts(str(tmp_path / "mountinfo")) == ["/sys/fs/cgroup"]
    table = _mounts.MountTable(text.encode("utf-8"))
    assert sorted(table._points) == sorted([("/sys/fs/cgroup", "cgroup2"), (point, "fuse.stall")])
    mounts = _shm.parse_mountinfo(text)
    assert [(m.point, m.fstype) for m in mounts] == [("/sys/fs/cgroup", "cgroup2"), (point, "fuse.stall")]
