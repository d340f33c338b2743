"""The NVIDIA container runtime's device hook, played from the machine's side of a fleet host's
cgroup (TEST_RIGS §8): an allow-all BPF_PROG_TYPE_CGROUP_DEVICE program attached beside
systemd's own (BPF_F_ALLOW_MULTI), systemd's detached. Processes in that cgroup may then open
any device node, as a GPU container may open /dev/nvidia* although its unit's DeviceAllow=
does not name them; a daemon-reload makes systemd attach its program again and the access is
gone ("Failed to initialize NVML: Unknown Error").

The bpf() syscall through ctypes (no bpftool on this machine); x86_64 and aarch64. The programs
go with the cgroup: removing the unit (or the host) removes them.

    python3 tests/fleet/device_hook.py grant CGROUP_DIR   # attach the hook, detach the others
    python3 tests/fleet/device_hook.py list CGROUP_DIR    # program ids attached (JSON)
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import struct
import sys

SYS_BPF = {"x86_64": 321, "aarch64": 280}[platform.machine()]
BPF_PROG_LOAD, BPF_PROG_ATTACH, BPF_PROG_DETACH = 5, 8, 9
BPF_PROG_GET_FD_BY_ID, BPF_OBJ_GET_INFO_BY_FD, BPF_PROG_QUERY = 13, 15, 16
BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2
HOOK_NAME = b"zeromib_hook"
# r0 = 1 (allow); exit
ALLOW_ALL = struct.pack("<BBhi", 0xB7, 0, 0, 1) + struct.pack("<BBhi", 0x95, 0, 0, 0)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(cmd: int, attr: ctypes.Array) -> int:
    rc = _libc.syscall(SYS_BPF, cmd, ctypes.byref(attr), ctypes.sizeof(attr))
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf({cmd}): {os.strerror(err)}")
    return rc


def _attr(*fields: tuple[int, str, int]) -> ctypes.Array:
    buf = ctypes.create_string_buffer(128)
    for offset, fmt, value in fields:
        struct.pack_into(fmt, buf, offset, value)
    return buf


def load_allow_all() -> int:
    insns = ctypes.create_string_buffer(ALLOW_ALL, len(ALLOW_ALL))
    license_ = ctypes.create_string_buffer(b"GPL")
    attr = _attr((0, "<I", BPF_PROG_TYPE_CGROUP_DEVICE), (4, "<I", len(ALLOW_ALL) // 8),
                 (8, "<Q", ctypes.addressof(insns)), (16, "<Q", ctypes.addressof(license_)))
    ctypes.memmove(ctypes.addressof(attr) + 48, HOOK_NAME, len(HOOK_NAME))
    return _bpf(BPF_PROG_LOAD, attr)


def attached(cgroup_fd: int) -> list[int]:
    ids = (ctypes.c_uint32 * 64)()
    attr = _attr((0, "<I", cgroup_fd), (4, "<I", BPF_CGROUP_DEVICE), (16, "<Q", ctypes.addressof(ids)), (24, "<I", 64))
    _bpf(BPF_PROG_QUERY, attr)
    return list(ids[:struct.unpack_from("<I", attr, 24)[0]])


def prog_name(prog_fd: int) -> str:
    info = ctypes.create_string_buffer(256)
    attr = _attr((0, "<I", prog_fd), (4, "<I", len(info)), (8, "<Q", ctypes.addressof(info)))
    _bpf(BPF_OBJ_GET_INFO_BY_FD, attr)
    return info.raw[64:80].split(b"\0", 1)[0].decode()


def prog_fd(prog_id: int) -> int:
    return _bpf(BPF_PROG_GET_FD_BY_ID, _attr((0, "<I", prog_id)))


def programs(cgroup: str) -> list[dict]:
    """[{id, name}] of the device programs attached to CGROUP (a cgroup2 directory)."""
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        found = []
        for pid in attached(fd):
            pfd = prog_fd(pid)
            try:
                found.append({"id": pid, "name": prog_name(pfd)})
            finally:
                os.close(pfd)
        return found
    finally:
        os.close(fd)


def grant(cgroup: str) -> list[dict]:
    """Attach the allow-all hook to CGROUP and detach every other device program there ->
    the programs attached after."""
    fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        hook = load_allow_all()
        try:
            _bpf(BPF_PROG_ATTACH, _attr((0, "<I", fd), (4, "<I", hook), (8, "<I", BPF_CGROUP_DEVICE), (12, "<I", BPF_F_ALLOW_MULTI)))
        finally:
            os.close(hook)
        for pid in attached(fd):
            pfd = prog_fd(pid)
            try:
                if prog_name(pfd) != HOOK_NAME.decode():
                    _bpf(BPF_PROG_DETACH, _attr((0, "<I", fd), (4, "<I", pfd), (8, "<I", BPF_CGROUP_DEVICE)))
            finally:
                os.close(pfd)
    finally:
        os.close(fd)
    return programs(cgroup)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("grant", "list"):
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(grant(argv[1]) if argv[0] == "grant" else programs(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
