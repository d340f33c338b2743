# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""Whose job a process is: the Slurm job it runs in, from the kernel's word (its cgroup paths,
else its nearest vouched slurmstepd ancestor). Read by the epilog's look and scan (_slurm/_jobcheck)
and by the respawn watch of both the epilog and gpu_release (a new process of another job is that
job's task, not a restart): one reader for both, in the look, so that the acting wing may use it."""

from __future__ import annotations

import re
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders as holders_mod
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect

_JOB_CGROUP = re.compile(r"/job_(\d+)(?:/|$)")
_STEPD_TITLE = re.compile(r"^slurmstepd: \[(\d+)(?:\.[A-Za-z0-9_]+)?\]")


def job_of_cgroups(paths: t.Iterable[str]) -> str | None:
    """The Slurm job a process runs in from its cgroup paths (every hierarchy line: cgroup v1's
    freezer/devices lines carry /slurm/uid_N/job_N, v2 /system.slice/slurmstepd.scope/job_N).
    A path in the subtree systemd delegates to a user (user@UID.service) names no job, whatever
    it contains: its user creates and names cgroups there at will."""
    for path in paths:
        if _cgroups.in_user_manager(path):
            continue
        match = _JOB_CGROUP.search(path)
        if match:
            return match.group(1)
    return None


def job_of_stepd_title(cmdline: str | None) -> str | None:
    """`slurmstepd: [123.batch]` / `[123.0]` / `[123.extern]` -> "123"."""
    match = _STEPD_TITLE.match(cmdline or "")
    return match.group(1) if match else None


def other_job(owner: str | None, job: str | None) -> bool:
    """Whether a process of `owner` (its job, None: none) is another job's than `job`'s: a process
    of no job is nobody else's."""
    return owner is not None and owner != job


def owning_job(pid: int, proc: str = "/proc", depth: int = 64) -> str | None:
    """The job of a process: its cgroup, else its nearest vouched slurmstepd ancestor (cgroup v1
    with proctrack/linuxproc: the tasks sit in slurmd's cgroup under their slurmstepd)."""
    job = job_of_cgroups(holders_mod.cgroup_paths(pid, proc) or [])
    if job is not None:
        return job
    current = pid
    for _step in range(depth):
        record = holders_mod.read_process(current, proc)
        if record is None or record["ppid"] in (0, current):
            return None
        if record["name"] == "slurmstepd" and _protect.vouched(record):
            return job_of_stepd_title(record.get("cmdline"))
        current = record["ppid"]
    return None
