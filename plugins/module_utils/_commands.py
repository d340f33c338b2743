# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""How the collection finds and runs the node's own tools: one search order, one environment.

Every tool's output is parsed, so each runs in the C locale (a German node's systemctl says
"aktiv"); systemctl also without a pager or colours (it pages into less when it thinks a
terminal is there, and colours its output when asked by the environment).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import typing as t

# Where root's tools live when PATH (a cron job's, a minimal container's) does not name them;
# the last one is where the NVIDIA GPU Operator's driver container shows its tools on the host.
SYSTEM_DIRS = ("/usr/bin", "/bin", "/usr/sbin", "/sbin", "/usr/local/bin", "/usr/local/sbin")
NVIDIA_DIRS = ("/usr/local/nvidia/bin", "/run/nvidia/driver/usr/bin")


def c_locale_env(**extra: str) -> dict[str, str]:
    """This process's environment in the C locale, with `extra` on top."""
    return dict(os.environ, LC_ALL="C", LANG="C", **extra)


def systemd_env() -> dict[str, str]:
    """The environment for systemctl, journalctl and loginctl: C locale, no pager, no colours."""
    return c_locale_env(SYSTEMD_PAGER="", SYSTEMD_COLORS="0")


def which(name: str, dirs: t.Iterable[str] = SYSTEM_DIRS + NVIDIA_DIRS, search_path: str | None = None) -> str | None:
    """The executable file `name` in PATH (or `search_path`), then in `dirs` in their order; None
    when none is there."""
    path = search_path if search_path is not None else os.environ.get("PATH", "")
    seen: set[str] = set()
    for directory in [d for d in path.split(os.pathsep) if d] + list(dirs):
        if directory in seen:
            continue
        seen.add(directory)
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def systemctl(path: str | None, args: t.Sequence[str], timeout: float | None = None) -> tuple[int, str, str]:
    """(rc, stdout, stderr) of `systemctl ARGS` at `path`, in systemd_env(). No systemctl reads
    rc 127; a call that outlasts `timeout` is ended and reads rc 124 (systemd goes on with its
    job: the caller decides what that means)."""
    if not path:
        return 127, "", "systemctl not found"
    try:
        process = subprocess.run(
            [path] + list(args), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False, env=systemd_env(),
        )
    except subprocess.TimeoutExpired:
        return 124, "", f"no answer within {timeout:.0f} s"
    return process.returncode, process.stdout.decode("utf-8", "replace"), process.stderr.decode("utf-8", "replace")


def replace_file(path: str, data: bytes, durable: bool) -> None:
    """Put `data` at `path` atomically: a root-only temporary beside it (O_EXCL, never through a
    link), then a rename. `durable`: the file and its directory are fsynced (the restore record,
    which must survive a crash); without, a crash may lose the new content (a state that only
    saves time). The caller vouches for the directory."""
    tmp = f"{path}.{os.getpid():d}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path))


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
