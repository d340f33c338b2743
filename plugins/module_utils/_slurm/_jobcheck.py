# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the plugins and roles of
# zeromib.gpu may use it.

"""The Slurm job boundary: the prolog and epilog that the role zeromib.gpu.slurm_gpu_checks
installs, run by slurmd as `python3 slurm_gpu_checks.pyz prolog|epilog` with no Ansible on the
node. The zip holds this collection's module_utils (roles/slurm_gpu_checks/files/pack_runner.py)
and calls main(); the work is gpu_release's own
(Release): the epilog frees the ending job's GPUs, the prolog looks at them in check mode.

Whose process is it (_look/_jobs.owning_job): a holder in another job's cgroup (`job_<id>` on any
hierarchy line of /proc/PID/cgroup, written by slurmstepd as root, never in a user's delegated
subtree) or below another job's slurmstepd (a vouched one: a root-owned /usr/sbin/slurmstepd,
whose title names the job) is that job's and is never signalled; and a new process of another
job that runs a killed holder's command line (the next task of an array job) is no restart of
it. Nothing a job's user can set (its environment, its process names, the cgroups it names)
decides whom root signals or what root concludes."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils import _options
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _caps
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _jobs
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _bounded
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _drain
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _gres
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _mig
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _shared
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import ReleaseError, StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi, NvidiaSmiError
from ansible_collections.zeromib.gpu.plugins.module_utils._act._plan import is_mig
from ansible_collections.zeromib.gpu.plugins.module_utils._act._release import Release
from ansible_collections.zeromib.gpu.plugins.module_utils._act._system import System

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._types import Holder

CONFIG_PATH = "/etc/zeromib-gpu/slurm_gpu_checks.json"
# slurmd runs the epilog also after a failed prolog (measured on 22.05): the job never ran, so
# what holds its GPUs is someone else's and the prolog only reported it. The failed prolog leaves
# a mark here (root-only: no user can make the epilog spare or end anything) for that epilog.
PROLOG_FAILED_DIR = "/run/zeromib-gpu/prolog-failed"
MODES = ("prolog", "epilog")
# One scontrol call at most (slurmctld answers in milliseconds; a busy one in seconds).
SCONTROL_S = 10.0
# slurmd runs the hooks with a nearly empty environment: no PATH of the site's.
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/slurm/bin"

# gpu_release's option defaults (the one option table, _options.OPTIONS) except where a job
# boundary needs less patience: slurmd waits for the epilog (PrologEpilogTimeout) while the next
# job waits for the node.
RELEASE_DEFAULTS: dict[str, t.Any] = _options.defaults(_options.RELEASE)
JOB_DEFAULTS = {"kill_timeout": 3.0, "wait_timeout": 15.0, "settle_timeout": 1.0}
# The options a site sets in the config file: the release's own that the table marks `slurm` (the
# CUDA smoke test included: the epilog runs it as gpu_release does, after the GPUs are proven
# free), and the runner's.
RELEASE_OPTIONS = tuple(option.name for option in _options.OPTIONS if option.slurm)
RUNNER_DEFAULTS: dict[str, t.Any] = {
    "drain": "scontrol",           # scontrol: set a zeromib: drain reason before failing; exit_status: only fail (slurmd drains)
    "scontrol": None,              # path; searched on SAFE_PATH when not set
    "without_gres": "skip",        # a job Slurm gave no GPUs: skip (nothing to check) or all (every GPU of the node)
    "log": "/var/log/zeromib-gpu/slurm_gpu_checks.log",  # one JSON line a run; null: none
    "deadline": 60.0,              # seconds: the whole run, below Slurm's PrologEpilogTimeout
    "shared_gpus": False,          # GPUs several jobs use at once (gres/shard, gres/mps): other jobs' memory is theirs
    "mig_baseline_mib": 60,        # what an idle MIG GPU reads (50-59 MiB measured on H100/H200): a slice's parent may read it
}
CHOICES = {"without_gres": ("skip", "all"), "drain": ("scontrol", "exit_status")}
# `drain: true/false`, the option's first spelling.
DRAIN_BOOLEANS = {True: "scontrol", False: "exit_status"}
# Kept back from the deadline for what follows the work: the drain's scontrol calls (each bounded
# by what is left), or only the log line.
RESERVE_S = {"scontrol": 5.0, "exit_status": 1.0}

# Kept between the ghost-busy readings' end and the work's: the verdict and its last reading.
GHOST_MARGIN_S = 1.0

_GPU_TOKEN = re.compile(r"^(?:\d+|GPU-[0-9A-Fa-f-]+|" + _mig.TOKEN + ")$")


class JobCheckError(Exception):
    """A problem with the runner's input (config, environment): the hook fails and says it."""


# ---------------------------------------------------------------- pure: Slurm's environment


def job_id(environ: t.Mapping[str, str]) -> str:
    value = (environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "").strip()
    if not value.isdigit() or not value.isascii():
        raise JobCheckError(f"SLURM_JOB_ID is not set to a job id ({value!r}): run by slurmd as Prolog= or Epilog=, or set it")
    return value


def job_gpus(environ: t.Mapping[str, str]) -> list[str] | None:
    """The job's GPUs as slurmd gives them to the prolog and epilog: the UUIDs of
    CUDA_VISIBLE_DEVICES where slurmd gives UUIDs, else SLURM_JOB_GPUS (slurmd's GRES indexes,
    never nvidia-smi's: _gres maps them), else CUDA_VISIBLE_DEVICES, else GPU_DEVICE_ORDINAL (set
    alike by slurmd, measured on 22.05). None: the job was given no GPU. slurmd writes this
    environment, not the job's user."""
    # A UUID names its GPU: a MIG slice's (SLURM_JOB_GPUS is then its place in slurmd's list of
    # slices, _mig), every GPU's with AutoDetect=nvml from Slurm 25.11 and with AutoDetect=nvidia.
    names: tuple[str, ...] = ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
    if any(_mig.is_mig(token.strip()) or token.strip()[:4].upper() == "GPU-" for token in (environ.get("CUDA_VISIBLE_DEVICES") or "").split(",")):
        names = ("CUDA_VISIBLE_DEVICES",)
    for name in names:
        raw = environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        tokens = [token.strip() for token in raw.split(",")]
        if tokens in (["NoDevFiles"], ["-1"]):
            return None  # what Slurm puts in CUDA_VISIBLE_DEVICES of a job without GPUs
        bad = [token for token in tokens if not _GPU_TOKEN.match(token) or not token.isascii()]
        if bad:
            raise JobCheckError("{}={!r}: {} is not a GPU index or UUID".format(name, raw, ", ".join(repr(b) for b in bad)))
        return tokens
    return None


def mode_of(argv: t.Sequence[str], environ: t.Mapping[str, str]) -> str:
    """`prolog` or `epilog`: the first argument, else slurmd's SLURM_SCRIPT_CONTEXT
    (prolog_slurmd, epilog_slurmd)."""
    if argv:
        if argv[0] not in MODES:
            raise JobCheckError(f"unknown mode {argv[0]!r}: prolog or epilog")
        return argv[0]
    context = environ.get("SLURM_SCRIPT_CONTEXT", "")
    for mode in MODES:
        if context.startswith(mode):
            return mode
    raise JobCheckError(f"no mode given and SLURM_SCRIPT_CONTEXT={context!r} names none: call it with prolog or epilog")


# ---------------------------------------------------------------- whose process (_jobs.owning_job)


def spare_other_jobs(holders: list[Holder], ending: str, proc: str = "/proc", spared: dict[int, str] | None = None) -> list[Holder]:
    """Holders of other jobs marked protected (reason `Slurm job N`), and an MPS server whose GPUs
    another job's process uses (`MPS server for Slurm job N`: quitting it would end that job's
    clients); new records. `spared` gets {pid: owner} of each (the result's public holders do not
    carry the reason): the job's number, or the server's reason."""
    marked = []
    for holder in holders:
        owner = None if holder.get("protected") else _jobs.owning_job(holder["pid"], proc)
        if _jobs.other_job(owner, ending):
            holder = t.cast("Holder", dict(holder, protected=True, protected_reason=f"Slurm job {owner}"))
            if spared is not None:
                spared[holder["pid"]] = t.cast(str, owner)
        marked.append(holder)
    return spare_shared_servers(marked, spared)


def spare_shared_servers(holders: list[Holder], spared: dict[int, str] | None = None) -> list[Holder]:
    """An MPS server (vouched: _act/_mps) on a GPU that a process of another job also holds is
    kept: its clients may be that job's, and a quit ends every client of the server."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._act import _mps  # pylint: disable=import-outside-toplevel

    jobs_on: dict[int, set[str]] = {}
    for holder in holders:
        reason = str(holder.get("protected_reason") or "")
        if reason.startswith("Slurm job "):
            for index in holder.get("gpu_indexes") or []:
                jobs_on.setdefault(index, set()).add(reason[len("Slurm job "):])
    marked = []
    for holder in holders:
        jobs = sorted({job for index in holder.get("gpu_indexes") or [] for job in jobs_on.get(index, ())}, key=lambda j: (len(j), j))
        if jobs and not holder.get("protected") and _mps.is_server(holder):
            reason = "MPS server for Slurm job {}".format(", ".join(jobs))
            holder = t.cast("Holder", dict(holder, protected=True, protected_reason=reason))
            if spared is not None:
                spared[holder["pid"]] = reason
        marked.append(holder)
    return marked


class JobRelease(Release):
    """gpu_release's run for one ending job: every look and rescan spares the other jobs'
    processes, and the respawn watch passes over their new ones (the only additions: Release's
    planning, signals and verdict are unchanged)."""

    def __init__(self, *args: t.Any, ending_job: str, note: t.Callable[[str], None] = lambda _stage: None, numbered: t.Sequence[str] = (),
                 **kwargs: t.Any) -> None:
        super().__init__(*args, **kwargs)
        self.ending_job = ending_job
        self.note = note
        # The job's GPUs came as numbers (these): on a MIG GPU those are slurmd's count of slices (_mig).
        self.numbered = list(numbered)
        # Why the run was refused before anything was done: the cause, whatever the GPUs read.
        self.refusal: str | None = None
        # {pid: job} of the holders spared as another job's, for the drain reason.
        self.spared: dict[int, str] = {}

    def plan(self, snapshot: t.Any) -> t.Any:
        # The GPUs the job's numbers were mapped to (_gres), or every GPU where they could not be.
        wanted = [str(token) for token in self.options.gpus or []]
        mig = [g for g in snapshot.gpus if (not wanted or given(g, wanted)) and is_mig(g)] if self.numbered else []
        if mig:
            self.refusal = ("GPU {} is in MIG mode and Slurm named the job's GPUs by number ({}): on a MIG GPU slurmd's numbers count its "
                            "slices, not GPUs. Let slurmd give the slices' MIG UUIDs (gres.conf AutoDetect=nvml sets "
                            "CUDA_VISIBLE_DEVICES=MIG-...)".format(mig[0]["index"], ",".join(self.numbered)))
            raise StepFailed(self.refusal)
        self.note("signalling what the job left and waiting for its GPUs to read free" if not self.check_mode else "judging the look")
        return super().plan(snapshot)

    def look(self) -> t.Any:
        snapshot = super().look()
        snapshot.holders = spare_other_jobs(snapshot.holders, self.ending_job, self.system.proc, self.spared)
        return snapshot

    def scan(self, gpus: t.Any) -> t.Any:
        holders, apps = super().scan(gpus)
        return spare_other_jobs(holders, self.ending_job, self.system.proc, self.spared), apps

    def others(self, pid: int) -> str | None:
        """Whose a process is when it is not the ending job's to free: `Slurm job N` for another
        job's, the reason of an MPS server kept for one; None for the ending job's or no job's."""
        if pid in self.spared and not self.spared[pid].isdigit():
            return self.spared[pid]
        owner = _jobs.owning_job(pid, self.system.proc)
        return f"Slurm job {owner}" if _jobs.other_job(owner, self.ending_job) else None

    def foreign(self, targets: list[Holder]) -> t.Callable[[int, int], bool]:
        """For the respawn watch: (new pid, killed pid) -> whether the new process runs in another
        job than the ending one. Only a process of the ending job or of no job can be what this
        epilog killed, started again: the other jobs' are spared, never signalled."""
        proc = self.system.proc
        return lambda pid, _killed: _jobs.other_job(_jobs.owning_job(pid, proc), self.ending_job)


# ---------------------------------------------------------------- config


def check_config(raw: t.Any) -> dict[str, t.Any]:
    """The config file's object -> every option with its value, or JobCheckError naming each problem."""
    if not isinstance(raw, dict):
        raise JobCheckError(f"the config must be a JSON object, got {type(raw).__name__}")
    known = set(RELEASE_OPTIONS) | set(RUNNER_DEFAULTS)
    problems = [f"unknown option {k!r}" for k in sorted(set(raw) - known)]
    config = dict(RUNNER_DEFAULTS)
    config.update({k: RELEASE_DEFAULTS[k] for k in RELEASE_OPTIONS})
    config.update(JOB_DEFAULTS)
    config.update({k: v for k, v in raw.items() if k in known})
    if isinstance(config["drain"], bool):
        config["drain"] = DRAIN_BOOLEANS[config["drain"]]
    for name, choices in CHOICES.items():
        if config[name] not in choices:
            problems.append("{} must be one of {}, got {!r}".format(name, ", ".join(choices), config[name]))
    for name in BOOLEANS:
        if not isinstance(config[name], bool):
            problems.append(f"{name} must be true or false, got {config[name]!r}")
    problems += type_problems(config)
    problems += _options.check({k: config[k] for k in RELEASE_OPTIONS})
    if not problems and config["mig_baseline_mib"] < 0:
        problems.append(f"mig_baseline_mib must be 0 or more, got {config['mig_baseline_mib']!r}")
    if not problems:
        problems += time_problems(config)
    if problems:
        raise JobCheckError("config: " + "; ".join(problems))
    return config


def work_budget(config: t.Mapping[str, t.Any]) -> float:
    """Seconds the work (look, signals, waits, smoke test) may take: the deadline less what the
    drain and the log need after it."""
    return float(config["deadline"]) - RESERVE_S.get(config["drain"], RESERVE_S["scontrol"])


def time_problems(config: t.Mapping[str, t.Any]) -> list[str]:
    """The bounded steps must fit the deadline: a config whose own waits outlast it would end in
    the hook killed by its deadline on every dirty GPU, said as a hang rather than as the GPU."""
    deadline, budget = float(config["deadline"]), work_budget(config)
    if not 0 < deadline <= _options.ONE_DAY_S:
        return [f"deadline must be a number of seconds above 0 and at most one day, got {config['deadline']!r}"]
    reserve = deadline - budget
    waits = ("kill_timeout", "wait_timeout", "settle_timeout")
    total = sum(float(config[name]) for name in waits)
    problems = []
    if budget <= 0:
        problems.append(f"deadline {deadline:g} s leaves nothing for the work after the {reserve:g} s kept for drain {config['drain']}")
    elif total > budget:
        problems.append(f"deadline {deadline:g} s leaves {budget:g} s for the work after the {reserve:g} s kept for drain {config['drain']}, "
                        f"and kill_timeout + wait_timeout + settle_timeout are {total:g} s: lower them or raise deadline "
                        "(it must stay below Slurm's PrologEpilogTimeout)")
    elif float(config["timeout"]) > budget:
        problems.append(f"timeout (nvidia-smi's) {float(config['timeout']):g} s is longer than the {budget:g} s the deadline leaves for the work")
    return problems


# JSON has no Ansible to convert a quoted "3" into a number: the runner takes only what it uses,
# typed as the option table types the release's options, and its own.
NUMBERS = tuple(name for name in RELEASE_OPTIONS if _options.BY_NAME[name].type in ("int", "float")) + ("deadline", "mig_baseline_mib")
BOOLEANS = tuple(name for name in RELEASE_OPTIONS if _options.BY_NAME[name].type == "bool") + ("shared_gpus",)
PATHS = tuple(name for name in RELEASE_OPTIONS if _options.BY_NAME[name].type == "path") + ("scontrol", "log")  # a string, or null
# The lists: of what (the words of the message).
LISTS = {name: ((str, int), "names or PIDs") if _options.BY_NAME[name].elements == "str" else (int, "Xid numbers")
         for name in RELEASE_OPTIONS if _options.BY_NAME[name].type == "list"}


def type_problems(config: t.Mapping[str, t.Any]) -> list[str]:
    """What JSON may carry and the runner cannot use, named (check_config's types)."""
    problems = []
    for name in NUMBERS:
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{name} must be a number, got {value!r}")
    for name in PATHS:
        if config[name] is not None and (not isinstance(config[name], str) or not config[name]):
            problems.append(f"{name} must be a path or null, got {config[name]!r}")
    for name, (element, words) in LISTS.items():
        value = config[name]
        if not isinstance(value, list):
            problems.append(f"{name} must be a list, got {value!r}")
        elif any(isinstance(v, bool) or not isinstance(v, element) for v in value):
            problems.append(f"{name} must be a list of {words}, got {value!r}")
    for name in RELEASE_OPTIONS:
        choices = _options.BY_NAME[name].choices
        if choices and config[name] not in (None,) + choices:
            problems.append("{} must be {} or null, got {!r}".format(name, ", ".join(str(c) for c in choices), config[name]))
    return problems


def read_config(path: str, owner: int = 0, required: bool = False) -> dict[str, t.Any]:
    """The root-owned config: a file anyone else could write would decide whom root signals.
    Missing: the defaults, unless `required` (a path the hook was given must be there). Opened
    without following a link and without blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            data = handle.read() if stat.S_ISREG(st.st_mode) else b""
    except FileNotFoundError:
        if required:
            raise JobCheckError(f"the config {path} does not exist") from None
        return check_config({})
    except OSError as exc:
        raise JobCheckError(f"cannot read the config {path}: {exc.strerror}") from None
    if st.st_uid != owner or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or not stat.S_ISREG(st.st_mode):
        raise JobCheckError(f"the config {path} must be a regular file owned by uid {owner:d} that only its owner can write: refused")
    try:
        return check_config(json.loads(data.decode("utf-8")))
    except (ValueError, UnicodeDecodeError) as exc:
        raise JobCheckError(f"the config {path} is not valid JSON: {exc}") from None


def release_params(config: t.Mapping[str, t.Any], gpus: list[str] | None) -> dict[str, t.Any]:
    params = dict(RELEASE_DEFAULTS, **{k: config[k] for k in RELEASE_OPTIONS})
    params["gpus"] = list(gpus or [])
    params["_match_regexes"] = []
    params["protect"] = [str(p) for p in params["protect"]]
    return params


# ---------------------------------------------------------------- the verdict


def given(gpu: t.Mapping[str, t.Any], tokens: list[str] | None) -> bool:
    """Whether Slurm gave the job this GPU (by nvidia-smi index or UUID, as job_gpus reads them)."""
    return any(token == str(gpu.get("index")) or token.lower() == str(gpu.get("uuid") or "").lower() for token in tokens or [])


def dirty_causes(result: t.Mapping[str, t.Any], spared: t.Mapping[int, str] | None = None) -> list[str]:
    """Short causes, one per GPU of the job that is not free or not healthy: `GPU 0: 4096 MiB,
    held by pid 345 python3` / `GPU 1: 4096 MiB, no process holds it` / `GPU 2: <health issue>`;
    on a shared GPU the MiB are those beyond what other jobs hold there (`result["shared"]`)."""
    selected = set(result.get("selected_gpus") or [])
    holders = result.get("holders") or []
    shared = result.get("shared") or {}
    causes = []
    nobody = None  # "no process holds it", and on a node with IMEX channels where else it may be held (_look/_node_shapes)
    for gpu in result.get("gpus") or result.get("gpus_before") or []:
        if gpu.get("index") not in selected:
            continue
        if not gpu.get("clean"):
            on = [h for h in holders if gpu["index"] in (h.get("gpu_indexes") or [])
                  or (h.get("blocked") and gpu["index"] in (h.get("candidate_gpu_indexes") or []))]
            share = shared.get(str(gpu["index"]))
            if share is None and not on and gpu.get("memory_proof") == "unified memory":
                from ansible_collections.zeromib.gpu.plugins.module_utils._look import _unified_memory  # pylint: disable=import-outside-toplevel
                causes.append(_unified_memory.short_cause(gpu))
                continue
            if share is None:
                vgpus = given_as_vgpus(result, gpu) if not on else None
                if not on and vgpus is None and nobody is None:
                    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _node_shapes  # pylint: disable=import-outside-toplevel
                    nobody = "no process holds it" + _node_shapes.short_note(_node_shapes.imex_domain())
                who = "held by " + _caps.named([short_holder(h, spared or {}) for h in on], 3, ", ") if on else str(vgpus or nobody)
                causes.append("GPU {}: {} MiB, {}".format(gpu["index"], gpu.get("memory_used_mib"), who))
                continue
            # What the other jobs hold is deducted: only the rest's holders are the cause.
            rest = [h for h in on if owner_of(h, spared or {}) not in share.get("owners", ())]
            who = "held by " + _caps.named([short_holder(h, spared or {}) for h in rest], 3, ", ") if rest else "no process holds the rest"
            causes.append("GPU {}: {} MiB{}, {}".format(gpu["index"], gpu.get("memory_used_mib"), _shared.describe(share), who))
    for issue in result.get("health_issues") or []:
        causes.append(str(issue))
    return causes


def given_as_vgpus(result: t.Mapping[str, t.Any], gpu: t.Mapping[str, t.Any]) -> str | None:
    """`no process holds it here: vGPUs given to VMs (...)` for a GPU whose vGPUs the kernel lists
    (gpu_release's `given_to_vms`: the framebuffer VMs hold, no reset), else None."""
    given = [entry for entry in result.get("given_to_vms") or [] if entry.get("mdev")]
    if not given:
        return None
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _node_shapes  # pylint: disable=import-outside-toplevel
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _vfio  # pylint: disable=import-outside-toplevel
    vms = _vfio.vms_of_gpu(given, gpu.get("pci_bus_id"))
    return "no process holds it" + _node_shapes.short_vgpu(vms) if vms[0] or vms[1] else None


def short_holder(holder: t.Mapping[str, t.Any], spared: t.Mapping[int, str]) -> str:
    owner = owner_of(holder, spared) or origin_words(holder.get("origin"))
    # Its own vLLM server's word (_look/_sleep_mode), quoted short: it decides nothing.
    notes = [owner] if owner else []
    if (holder.get("sleep_answer") or {}).get("asleep"):
        # Loaded only for a holder whose server answered, as gpu_release loads it.
        from ansible_collections.zeromib.gpu.plugins.module_utils._look import _sleep_mode  # pylint: disable=import-outside-toplevel
        notes.append(_sleep_mode.note(holder["sleep_answer"], short=True))
    text = "pid {} {}".format(holder.get("pid"), holder.get("name")) + (" ({})".format("; ".join(notes)) if notes else "")
    return text + (" (did not answer: a stalled file system?)" if holder.get("blocked") else "")


def origin_words(origin: t.Mapping[str, t.Any] | None) -> str | None:
    """Where a holder outside every job came from, short (_look/_origin): `SSH session 5 of user
    alice from 10.0.0.9: `loginctl terminate-session 5``; None where nothing says."""
    if not origin:
        return None
    text = str(origin.get("text") or "")
    # A session's words run to their first comma; an instance's and a detached process's to their note.
    cut = text.find(", " if str(origin.get("kind")).endswith("_session") else " (")
    cut = len(text) if cut < 0 else cut
    return text[:cut] + (f": `{origin['stop']}`" if origin.get("stop") and origin.get("kind") != "detached" else "")


def owner_of(holder: t.Mapping[str, t.Any], spared: t.Mapping[int, str]) -> str | None:
    if holder.get("protected_reason"):
        return str(holder["protected_reason"])
    job = spared.get(holder.get("pid"))  # type: ignore[arg-type]
    if not job:
        return None
    return f"Slurm job {job}" if job.isdigit() else job


# The release's own words for a SIGKILLed holder a frozen cgroup keeps (_look/_frozen.advice).
FROZEN = re.compile(r"frozen \((?:freezer\.state|cgroup\.events) [^)]*\): .*?no reboot is needed\)?")


def verdict(mode: str, result: t.Mapping[str, t.Any], failure: str | None, spared: t.Mapping[int, str] | None = None) -> tuple[bool, list[str]]:
    """(ok, causes) of one run: the epilog's GPUs released, the prolog's already free; healthy."""
    causes = dirty_causes(result, spared)
    free = bool(result.get("released")) and failure is None
    healthy = result.get("healthy") is not False
    if free and healthy:
        return True, []
    if not causes:
        causes = [failure or ("GPUs not free" if not free else "GPUs not healthy")]
    # A holder its frozen cgroup keeps is said first, with who thaws it: never "held by" alone.
    return False, FROZEN.findall(failure or "") + causes


def drain_reason(mode: str, job: str, causes: list[str]) -> str:
    return _drain.short_reason("{} job {}: {}".format(mode, job, "; ".join(causes)))


# ---------------------------------------------------------------- side effects


def run_command(argv: list[str], deadline: float | None = None) -> tuple[int, str, str]:
    """argv -> (rc, stdout, stderr), bounded by SCONTROL_S and by `deadline` (monotonic): the
    hook's own deadline is never crossed waiting for slurmctld."""
    timeout = SCONTROL_S if deadline is None else min(SCONTROL_S, deadline - time.monotonic())
    if timeout <= 0:
        return 124, "", "not run: the hook's deadline has come"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                              env=dict(os.environ, LANG="C", LC_ALL="C", SLURM_TIME_FORMAT="standard"))
    except subprocess.TimeoutExpired:
        return 124, "", f"{os.path.basename(argv[0])} did not answer within {timeout:.1f} s"
    except OSError as exc:
        return 127, "", str(exc)
    return done.returncode, done.stdout, done.stderr


def find_scontrol(configured: str | None) -> str | None:
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    for directory in SAFE_PATH.split(":"):
        path = os.path.join(directory, "scontrol")
        if os.access(path, os.X_OK):
            return path
    return None


def drain(config: t.Mapping[str, t.Any], environ: t.Mapping[str, str], reason: str,
          run: t.Callable[[list[str]], tuple[int, str, str]] = run_command) -> str:
    """Drain this node with `reason` unless someone else drained it (slurm_node's rule) -> what
    was done. With `drain: exit_status` nothing is called: slurmd drains the node for the failed
    hook itself (reason "Epilog error" / "Prolog error"), and the cause is in the log."""
    if config.get("drain") == "exit_status":
        return "not drained through scontrol (drain: exit_status): slurmd drains the node for the failed hook"
    scontrol = find_scontrol(config.get("scontrol"))
    if not scontrol:
        return "not drained: scontrol not found (Slurm drains the node for the failed hook itself)"
    slurm = _drain.Slurm(run, scontrol)
    try:
        name, node = slurm.node_name((environ.get("SLURMD_NODENAME") or "").strip() or None)
        act, why = _drain.drain_decision(node, reason)
        if act:
            slurm.update(name, "state=drain", "reason=" + reason)
            return f"drained {name}: {reason}"
        return f"not drained ({why})"
    except _drain.SlurmError as exc:
        return f"not drained: {exc}"


def mark_prolog_failed(job: str, directory: str = PROLOG_FAILED_DIR) -> None:
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with open(os.path.join(directory, job), "w", encoding="utf-8"):
            pass
    except OSError as exc:
        sys.stderr.write(f"zeromib: cannot mark the failed prolog of job {job} in {directory}: {exc.strerror}" + "\n")


def take_prolog_failed(job: str, directory: str = PROLOG_FAILED_DIR) -> bool:
    """Whether the prolog of `job` failed (the mark is removed)."""
    try:
        os.unlink(os.path.join(directory, job))
        return True
    except OSError:
        return False


def log(path: str | None, entry: t.Mapping[str, t.Any]) -> None:
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")
    except OSError as exc:
        sys.stderr.write(f"zeromib: cannot write the log {path}: {exc.strerror}" + "\n")


def map_gres(numbers: list[str], environ: t.Mapping[str, str], smi: NvidiaSmi) -> tuple[list[str] | None, dict[str, t.Any]]:
    """Slurm's GPU numbers (GRES indexes) -> (the GPUs' UUIDs, what the log says of it); (None, why)
    where slurmd's list cannot be read: then every GPU of the node is checked, never the GPU that
    nvidia-smi happens to number so (_gres)."""
    try:
        mapped = _gres.job_gpus([int(n) for n in numbers], environ, smi.run)
    except _gres.Unmapped as exc:
        return None, {"unmapped": f"{exc}; every GPU of the node was checked, other jobs' memory deducted"}
    return [gpu.uuid for _index, _path, gpu in mapped], {"mapped": _gres.describe(mapped)}


def check_job(mode: str, job: str, gpus: list[str] | None, config: t.Mapping[str, t.Any],
              note: t.Callable[[str], None] = lambda _stage: None, environ: t.Mapping[str, str] | None = None
              ) -> tuple[bool, list[str], dict[str, t.Any]]:
    """gpu_release for the job's GPUs (the prolog in check mode: it looks, it never signals).
    `note(stage)` says where the run is, for the cause when the deadline comes first. `environ`:
    slurmd's (where gres.conf is, the node's name), for mapping Slurm's GPU numbers."""
    params = release_params(config, gpus)
    numbers = list(gpus) if gpus and all(token.isdigit() for token in gpus) else []
    gres: dict[str, t.Any] = {}
    try:
        smi = NvidiaSmi(NvidiaSmi.find(params["nvidia_smi"]), params["timeout"])
        smi.min_host_available_mib = params["min_host_available_mib"]
        slices = [token for token in gpus or [] if _mig.is_mig(token)]
        if slices:
            # The slices' parent GPUs, shared with the jobs of their other slices, at the MIG baseline.
            gpus = params["gpus"] = _mig.parents_of(gpus or [], lambda: smi.run(["-L"]))
            params["max_used_mib"] = max(params["max_used_mib"], config["mig_baseline_mib"])
        if numbers:
            note("mapping Slurm's GPU numbers to GPUs (gres.conf, the driver's minor numbers)")
            gpus, gres = map_gres(numbers, os.environ if environ is None else environ, smi)
            params["gpus"] = list(gpus or [])
        release = JobRelease(smi, System(find_systemctl()), params, check_mode=(mode == "prolog"), ending_job=job, note=note, numbered=numbers)
    except NvidiaSmiError as exc:
        return False, [f"nvidia-smi: {exc.msg}"], {}
    except _mig.MigError as exc:
        return False, [str(exc)], {}
    ok, causes, result = judge_job(mode, release, smi, params, config, gpus, bool(slices) or bool(gres.get("unmapped")), note)
    if gres:
        result["gres"] = gres
    if not ok and gres.get("unmapped"):
        causes.append("Slurm's GPU numbers {} not mapped: {}".format(",".join(numbers), gres["unmapped"]))
    return ok, causes, result


def judge_job(mode: str, release: JobRelease, smi: NvidiaSmi, params: dict[str, t.Any], config: t.Mapping[str, t.Any],
              gpus: list[str] | None, shared: bool, note: t.Callable[[str], None]) -> tuple[bool, list[str], dict[str, t.Any]]:
    """The release run, its verdict and the epilog's smoke test. `shared`: other jobs' memory on
    the job's GPUs is theirs (MIG slices, every GPU checked for want of a mapping)."""
    readings = None
    if config.get("shared_gpus") or shared:
        # Other jobs' memory on the job's GPUs is theirs (_shared): the release judges the rest.
        readings = release.smi = _shared.SharedReadings(smi, lambda gpu: gpus is None or given(gpu, gpus), release.others, params["max_used_mib"])
    note("the look (nvidia-smi, the /proc scan, the health readings)")
    try:
        result: dict[str, t.Any] = dict(release.run())
        failure = None
    except NvidiaSmiError as exc:
        # A node shape no run can free (_look/_node_shapes) says so itself, first.
        return False, [exc.msg if getattr(exc, "node_shape", False) else f"nvidia-smi: {exc.msg}"], {}
    except ReleaseError as exc:
        if release.refusal:
            return False, [release.refusal], {}
        result, failure = dict(exc.result), exc.msg
    except StepFailed as exc:
        return False, [exc.msg], {}
    if readings is not None and readings.last:
        result["shared"] = _shared.record(readings.last)
    if mode == "epilog" and failure is None and not result.get("shared"):
        note("the training-ready profile and the GPUs left busy with no process")
        result = ready_for_the_next_job(smi, release, params, result, config.get("work_until"))
    ok, causes = verdict(mode, result, failure, release.spared)
    if not ok:
        # A setter that failed is said after the setting it left (the profile's issue names the command).
        causes += [str(error) for error in result.get("ready_fix_errors") or []]
    if ok and mode == "epilog" and params["smoke_test"] and result.get("shared"):
        # Its readings would count what the other jobs on the GPU allocate meanwhile.
        result["smoke_test_skipped"] = "other jobs use the GPU"
    elif ok and mode == "epilog" and params["smoke_test"]:
        note("the CUDA smoke test")
        try:
            ok, causes, result = smoke_test(smi, params, result)
        except NvidiaSmiError as exc:
            return False, [f"nvidia-smi, before the CUDA smoke test: {exc.msg}"], result
    return ok, causes, result


def ready_for_the_next_job(smi: NvidiaSmi, release: JobRelease, params: t.Mapping[str, t.Any], result: dict[str, t.Any],
                           until: float | None = None) -> dict[str, t.Any]:
    """The epilog's GPUs, proven free, as gpu_release leaves them: put back to the training-ready
    profile where the site opted in (ready_fix, recorded for gpu_restore: _act/_ready_settings), and
    a GPU the job's kills left busy with no process cleared by a context opened and closed from a
    fresh process (_act/_ghost_busy). Never on a GPU other jobs use: the caller skips shared GPUs,
    whose settings and utilization are theirs too. `until` (monotonic): when the hook stops the
    work; the ghost's readings end GHOST_MARGIN_S before it, so the drain reason names the GPU."""
    if params.get("ready_fix") and result.get("released"):
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ready_settings  # pylint: disable=import-outside-toplevel
        result = _ready_settings.after_release(smi, result, release)
    if result.get("released") and result.get("killed"):
        from ansible_collections.zeromib.gpu.plugins.module_utils._act import _ghost_busy  # pylint: disable=import-outside-toplevel
        settle_s = _ghost_busy.SETTLE_S if until is None else min(_ghost_busy.SETTLE_S, max(0.0, until - GHOST_MARGIN_S - time.monotonic()))
        result = _ghost_busy.after_release(smi, result, params["timeout"], short=True, settle_s=settle_s)
    return result


def smoke_test(smi: NvidiaSmi, params: t.Mapping[str, t.Any], result: dict[str, t.Any]) -> tuple[bool, list[str], dict[str, t.Any]]:
    """The epilog's GPUs, proven free, each run CUDA once (_cuda_smoke, as gpu_release runs it):
    a GPU that cannot is no GPU for the next job (its issue is the drain reason)."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cuda_smoke  # pylint: disable=import-outside-toplevel
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _facts  # pylint: disable=import-outside-toplevel

    tested = _cuda_smoke.after_release(smi, params, result, False, lambda: _facts.look(
        smi, params["protect"], max_used_mib=params["max_used_mib"], footprint_mib=params["cross_gpu_footprint_mib"]))
    if tested.get("smoke_test_passed") is False:
        return False, [str(issue) for issue in tested.get("smoke_test_issues") or []] or ["CUDA smoke test failed"], tested
    return True, [], tested


def find_systemctl() -> str | None:
    for directory in SAFE_PATH.split(":"):
        path = os.path.join(directory, "systemctl")
        if os.access(path, os.X_OK):
            return path
    return None


def main(argv: t.Sequence[str], environ: t.Mapping[str, str], config_path: str = CONFIG_PATH, marks: str = PROLOG_FAILED_DIR) -> int:
    """The hook: 0 when the job's GPUs are free and healthy; else drain (zeromib: reason) and 1,
    so that slurmd drains the node (epilog) or requeues the job (prolog)."""
    started = time.monotonic()
    # --config=PATH (the benchmark's, a site's second config): given by whoever runs the hook, root.
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    config_path = given or config_path
    argv = [a for a in argv if not a.startswith("--config=")]
    if list(argv[:1]) == ["check-config"]:
        # The role's check right after it writes the config: a bad one fails the play, not the next job.
        try:
            sys.stdout.write(json.dumps(read_config(config_path, required=given is not None), sort_keys=True) + "\n")
            return 0
        except JobCheckError as exc:
            sys.stderr.write(f"zeromib: {exc}" + "\n")
            return 2
    os.environ["PATH"] = os.environ.get("PATH") or SAFE_PATH
    config: dict[str, t.Any] = dict(RUNNER_DEFAULTS)
    mode, job, gpus = "hook", "?", None
    try:
        # The config first: its log is where even a bad call is said.
        config = read_config(config_path, required=given is not None)
        mode = mode_of(argv, environ)
        job = job_id(environ)
        gpus = job_gpus(environ)
        if gpus is None and config["without_gres"] == "skip":
            log(config["log"], {"mode": mode, "job": job, "ok": True, "skipped": "no GPU given to the job", "elapsed_s": round(time.monotonic() - started, 3)})
            return 0
        if mode == "epilog" and take_prolog_failed(job, marks):
            log(config["log"], {"mode": mode, "job": job, "gpus": gpus, "ok": True, "elapsed_s": round(time.monotonic() - started, 3),
                                "skipped": "the prolog failed: the job never ran, nothing on its GPUs is its own (the prolog drained the node)"})
            return 0
        ok, causes, result = bounded_check(mode, job, gpus, config, started, environ)
    except JobCheckError as exc:
        ok, causes, result = False, [str(exc)], {}
    except Exception as exc:  # pylint: disable=broad-exception-caught
        # A hook must drain with a reason, never die with a traceback slurmd only logs.
        ok, causes, result = False, [f"internal error, {type(exc).__name__}: {exc}"], {}
    # The prolog runs in check mode: its `killed` is the plan, the holders it found (never signalled).
    acted, count = _caps.cap_list([{"pid": k.get("pid"), "name": k.get("name"), "signal": k.get("signal")} for k in result.get("killed") or []])
    entry: dict[str, t.Any] = {"mode": mode, "job": job, "gpus": gpus, "ok": ok, "causes": causes,
                               ("holders" if mode == "prolog" else "killed"): acted}
    if count is not None:
        entry["truncated"] = {("holders" if mode == "prolog" else "killed"): count}
    if result.get("smoke_test_passed") is not None:
        entry["smoke_test_passed"] = result["smoke_test_passed"]
    for key in ("shared", "smoke_test_skipped", "gres", "ghost_busy", "ready_fixed", "ready_fix_errors"):
        if result.get(key):
            entry[key] = result[key]
    if not ok:
        reason = drain_reason(mode, job, causes)
        sys.stderr.write(reason + "\n")
        hook_deadline = started + float(config.get("deadline") or RUNNER_DEFAULTS["deadline"]) - RESERVE_S["exit_status"]
        entry["drain"] = drain(config, environ, reason, lambda argv: run_command(argv, hook_deadline))
        if mode == "prolog" and job != "?":
            mark_prolog_failed(job, marks)
    elif mode == "prolog" and job != "?":
        # A requeued job keeps its id: a mark left by an earlier failed prolog of it (its epilog
        # never ran, slurmd restarted) must not make this run's epilog skip its leftovers.
        take_prolog_failed(job, marks)
    entry["elapsed_s"] = round(time.monotonic() - started, 3)
    log(config.get("log"), entry)
    return 0 if ok else 1


def bounded_check(mode: str, job: str, gpus: list[str] | None, config: t.Mapping[str, t.Any], started: float,
                  environ: t.Mapping[str, str] | None = None) -> tuple[bool, list[str], dict[str, t.Any]]:
    """check_job in a child the hook stops waiting for when the work budget (the deadline less
    the drain's reserve) is spent: the cause then says where the run was."""
    budget = work_budget(config) - (time.monotonic() - started)
    # The child's own steps that may wait (the ghost-busy readings) end before the hook stops it.
    config = dict(config, work_until=time.monotonic() + budget)
    outcome = _bounded.run_bounded(lambda note: list(check_job(mode, job, gpus, config, note, environ=environ)), budget)
    if not outcome.finished:
        where = f" (still at: {outcome.stage})" if outcome.stage else ""
        return False, [f"the {mode} did not finish within its deadline of {float(config['deadline']):g} s{where}; the run was stopped"], {}
    if outcome.error is not None:
        return False, [f"internal error, {outcome.error}"], {}
    ok, causes, result = outcome.value
    return bool(ok), list(causes), dict(result or {})
