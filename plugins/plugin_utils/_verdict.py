# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""The free_gpus role's verdict on one host: the one place that decides whether a host passes.

Used by the role's gate (plugins/action/free_gpus_gate.py: `failed_checks`, whether the task
fails) and by the free_gpus_outcome filter (the `problems` and `status` of free_gpus_result).
A new condition (a health threshold, say) is one more step in `verdict`, with its check name
added to CHECKS (the gate's documented `failed_checks`) and, where it has one, its sentence.
Pure functions of gpu_release's result: no Ansible import.
"""

from __future__ import annotations

import re
import typing as t

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Gpu

# The gate's check names (its `failed_checks`), in the order of the assert the gate replaced.
CHECKS = ("gpu_release failed", "released", "every selected GPU clean", "free_gpus_expected_count", "free_gpus_require_healthy",
          "free_gpus_smoke_test")


class Verdict(t.NamedTuple):
    """`failed_checks`: what fails the gate (empty: the host passes). `problems`: the sentences of
    free_gpus_result's message (empty: the outcome is ok). `status`: the outcome's status when it
    has problems (failed, dirty, unhealthy)."""

    failed_checks: list[str]
    problems: list[str]
    status: str


def selected_gpus(result: t.Mapping[str, t.Any], key: str = "gpus") -> list[Gpu]:
    """The GPUs of `result[key]` that gpu_release was asked to free (all of them without a selection)."""
    selected = result.get("selected_gpus") or []
    return [g for g in result.get(key) or [] if not selected or g.get("index") in selected]


def health_problems(result: t.Mapping[str, t.Any]) -> list[str]:
    """The gpu_release result's health issues, or a sentence when it has no health verdict."""
    if result.get("healthy") is True:
        return []
    return list(result.get("health_issues") or []) or ["GPU health unknown (gpu_release read no health)"]


# Ansible's words for a module that printed no JSON: the cause is in its stderr/stdout.
_NO_RESULT = ("Module result deserialization failed", "MODULE FAILURE", "The module failed to execute correctly")


def _first_line(text: object) -> str:
    """The first line that says something (SSH's "Shared connection to HOST closed." says nothing
    of the cause); of a traceback, its last line (the exception)."""
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip() and not line.startswith("Shared connection to ")]
    if lines and lines[0].startswith("Traceback (most recent call last)"):
        return lines[-1]
    return lines[0] if lines else ""


def start_failure(result: t.Mapping[str, t.Any]) -> str | None:
    """gpu_release never started (no sudo, a Python that is not there, a crash of the
    interpreter) -> the cause in the user's words, from what the shell printed; None otherwise.

    Ansible's own message ("Module result deserialization failed: No start of json char found")
    names the symptom; the first line of module_stderr (or module_stdout) names the cause."""
    msg = str(result.get("msg") or "")
    if not msg.startswith(_NO_RESULT) and "module_stderr" not in result:
        return None
    said = _first_line(result.get("module_stderr")) or _first_line(result.get("module_stdout"))
    if not said:
        return None
    rc = result.get("rc")
    cause = "{}{}".format(said, f" (rc {rc})" if rc not in (None, "") else "")
    lowered = said.lower()
    # sudo itself missing ("/bin/sh: 1: sudo: not found"), not sudo saying what it could not run
    # ("sudo: /usr/bin/python3: command not found", a Python that is not there).
    if re.search(r"\bsudo: (command )?not found|\bsudo: no such file", lowered):
        fix = ("sudo is not installed on this host: install it, connect as root (ansible_user: root) with become: false, "
               "or set another ansible_become_method")
    elif "sudo" in lowered and "password" in lowered:
        fix = "sudo asks for a password: run with --ask-become-pass (-K) or allow this user NOPASSWD for sudo"
    elif re.search(r"python|interpreter|pyenv", lowered):
        fix = "no working Python at the path Ansible uses: set ansible_python_interpreter to a Python 3 on this host (e.g. /usr/bin/python3)"
    elif "become success" in lowered or "sudo" in lowered:
        fix = ("become (sudo) did not start for this user: allow it NOPASSWD for sudo, run with --ask-become-pass (-K), "
               "or connect as root (ansible_user: root) with become: false")
    elif "not found" in lowered or rc == 127:
        fix = "a command that Ansible runs to start the module is missing on this host (become method, shell or Python)"
    else:
        fix = "gpu_release did not start; run with -vvv for Ansible's whole output"
    return f"the module could not start on this host: {cause}; {fix}"


def _release_failures(result: t.Mapping[str, t.Any], check_mode: bool) -> tuple[list[str], list[str], str]:
    """Whether gpu_release looked, acted and left the selected GPUs clean -> (checks, problems, status)."""
    checks: list[str] = []
    problems: list[str] = []
    status = "dirty"
    # gpu_release fails with a verdict (GPUs read dirty) or before one (nvidia-smi broken, bad
    # option, plan refused): that fails a dry run as it fails the real one. A result without
    # `released` is a failure even when failed_when cleared its flag.
    looked = not (result.get("failed") or "released" not in result)
    if not looked:
        checks.append("gpu_release failed")
        problems.append(start_failure(result) or result.get("msg") or "gpu_release failed")
        if not result.get("gpus"):
            status = "failed"
    if check_mode:
        return checks, problems, status
    if not result.get("released", False):
        checks.append("released")
        if looked and result.get("released") is False:
            dirty = [dirty_reading(g) for g in selected_gpus(result) if not g.get("clean")]
            problems.append("not released: " + ", ".join(dirty))
    selected = result.get("selected_gpus") or []
    if any(not gpu.get("clean") for gpu in result.get("gpus") or [] if gpu.get("index") in selected):
        checks.append("every selected GPU clean")
    return checks, problems, status


def dirty_reading(gpu: t.Mapping[str, t.Any]) -> str:
    """`GPU 3 reads 4096 MiB`; for a GPU sharing the host's memory, whose proof is its compute
    processes and the host's MemAvailable (memory_proof: unified memory), those instead."""
    if gpu.get("memory_proof") == "unified memory":
        return "GPU {} (unified memory) has {} MiB in compute processes and {} MiB of host memory available".format(
            gpu.get("index"), gpu.get("memory_used_mib"), gpu.get("host_memory_available_mib"))
    return "GPU {} reads {} MiB".format(gpu.get("index"), gpu.get("memory_used_mib"))


def count_problem(expected: int, count: int, given_to_vms: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    """The words for an expected GPU count nvidia-smi does not show; GPUs bound to vfio-pci
    (gpu_release's `given_to_vms`, less its vGPUs: their GPU is listed) are a VM's, said as such,
    with no reset advice; pure."""
    head = f"expected {expected} GPUs, nvidia-smi shows {count}"
    given_to_vms = [entry for entry in given_to_vms if not entry.get("mdev")]
    if not given_to_vms:
        return head + ": a GPU may have fallen off the bus"
    shown = [f"{g.get('bus')} to VM {g['vm']}" if g.get("vm") else
             f"{g.get('bus')} (IOMMU group {g.get('iommu_group')}; no VM systemd names holds it)" for g in given_to_vms[:5]]
    more = f" and {len(given_to_vms) - 5:d} more" if len(given_to_vms) > 5 else ""
    text = "{}: {:d} given to VMs by PCI passthrough (vfio-pci): {}{}; a VM's GPU is freed in the VM, and no reset is this host's to do".format(
        head, len(given_to_vms), ", ".join(shown), more)
    other = expected - count - len(given_to_vms)
    return text + (f"; {other:d} more may have fallen off the bus" if other > 0 else "")


def verdict(result: t.Mapping[str, t.Any], expected_count: int | None = 0, check_mode: bool = False,
            require_healthy: bool = False) -> Verdict:
    """gpu_release's result on one host, and the role's settings -> the Verdict."""
    checks, problems, status = _release_failures(result, check_mode)
    expected = int(expected_count or 0)
    count = len(result.get("gpus") or [])
    if expected and count != expected:
        checks.append("free_gpus_expected_count")
        problems.append(count_problem(expected, count, result.get("given_to_vms") or []))
        status = "failed"
    # Health is read, never changed: a dry run fails on an unhealthy GPU as the real run does.
    if require_healthy and result.get("gpus") and result.get("healthy") is not True:
        checks.append("free_gpus_require_healthy")
        problems.append("unhealthy: " + "; ".join(health_problems(result)))
        status = "unhealthy" if status == "dirty" and len(problems) == 1 else status
    # A GPU that failed the CUDA smoke test (free_gpus_smoke_test) is not ready, however free it reads.
    if result.get("smoke_test_passed") is False:
        checks.append("free_gpus_smoke_test")
        problems.append("smoke test failed: " + "; ".join(result.get("smoke_test_issues") or ["(no detail)"]))
        status = "unhealthy" if status == "dirty" and len(problems) == 1 else status
    return Verdict(checks, problems, status)
