# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# PRIVATE to zeromib.gpu's controller-side plugins; may change without notice.

"""What the free_gpus role's two action plugins share (plugins/action/free_gpus_gate.py and
free_gpus_verdict.py): the role's variables checked and turned into gpu_release's options, one
gpu_release run on a host under the gate's bound, and its outcome recorded in `free_gpus_result`.
The verdict runs the same release for a host the fleet check of free_gpus_services held back, so
both subclass GateAction here, and no action plugin imports another.

Why an action and not four tasks (validation, module, set_fact, assert): every task costs
Ansible a worker process per host on the controller (~0.05-0.1 s of CPU each on 2 cores,
benchmarks/HISTORY.md, "What issue 14 changed (2026-12-01)"); the three that ran
no SSH were most of the gate's cost over a one-task play.
"""

from __future__ import annotations

import contextlib
import gc
import math
import multiprocessing
import os
import signal
import threading
import time
import typing as t
from collections.abc import Mapping

import yaml
from ansible import constants as C
from ansible.errors import AnsibleActionFail, AnsibleConnectionFailure, AnsibleError
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _play_settings, _role_spec, _services_check
from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_vars import role_options
from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import failed, in_role_words, outcome_of
from ansible_collections.zeromib.gpu.plugins.plugin_utils._verdict import Verdict, verdict

ROLE_PREFIX = "free_gpus_"
# Role variables that are not gpu_release options: the gate itself uses them.
GATE_ONLY = frozenset(["free_gpus_expected_count", "free_gpus_require_healthy", "free_gpus_strict"])
# Role variables of the role's rescue (tasks/drain.yml), not of gpu_release.
GATE_ONLY = GATE_ONLY | frozenset(["free_gpus_on_failure", "free_gpus_slurm_node_name"])
# Options dropped when empty, so that gpu_release's own default applies (search PATH for nvidia-smi).
OMIT_WHEN_EMPTY = frozenset(["nvidia_smi", "expected_mig_mode"])
# free_gpus_* names that are not role variables and are no typo: the fact the role sets, and
# free_gpus.yml's host pattern.
NOT_OPTIONS = frozenset(["free_gpus_result", "free_gpus_hosts"])
# What a gate's result leaves out without -v: the GPU and holder records (a screen each on an
# 8-GPU node; free_gpus_result keeps their figures).
RECORD_KEYS = ("gpus", "gpus_before", "holders")


def warning_text(warning: t.Any) -> t.Any:
    """A module's warning as text (ansible-core 2.19 hands the action a WarningSummary, whose text
    is its event's msg); anything else unchanged."""
    if isinstance(warning, str):
        return warning
    msg = getattr(getattr(warning, "event", None), "msg", None)
    return msg if isinstance(msg, str) else warning


def without_records(result: dict[str, t.Any], verbosity: int) -> dict[str, t.Any]:
    """A gate's result as the task returns it without -v: no GPU or holder records. Nothing shows
    them at that verbosity, and the controller's main process walks every key of every host's
    result for its callbacks (~12 ms of CPU a clean 8-GPU host on the 2-core benchmark machine,
    benchmarks/HISTORY.md, "The clean gate's cost, third round (issue 36, 2026-12-02 evening)"). -v returns them all."""
    if verbosity > 0:
        return result
    return {key: value for key, value in result.items() if key not in RECORD_KEYS}


def gate_failures(release: t.Mapping[str, t.Any], params: t.Mapping[str, t.Any], check_mode: bool) -> list[str]:
    """The role's verdict on one host -> the names of the checks that fail (empty: the host passes)."""
    return role_verdict(release, params, check_mode).failed_checks


def role_verdict(release: t.Mapping[str, t.Any], params: t.Mapping[str, t.Any], check_mode: bool) -> Verdict:
    """The one verdict (plugin_utils/_verdict.py) with the role's settings."""
    return verdict(release, params.get("free_gpus_expected_count"), check_mode, params.get("free_gpus_require_healthy", True))


def module_args(params: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """Validated role variables -> gpu_release's options (free_gpus_X -> X)."""
    args = {}
    for name, value in params.items():
        if not name.startswith(ROLE_PREFIX) or name in GATE_ONLY:
            continue
        option = name[len(ROLE_PREFIX):]
        if option in OMIT_WHEN_EMPTY and not value:
            continue
        args[option] = value
    return args


try:
    role_options(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "roles", "free_gpus"))
except (OSError, yaml.YAMLError):
    pass


# The gate's bound on one gpu_release run (issue 57): every step of the module has a bound of its
# own, so a node where it outlives their sum is wedged (a file system or driver that does not
# answer even the module's bounded reads, a Python that cannot start). Without this the play's
# gate would wait for that one node for good, and with it the fleet step and the training start.
# The sum, from the role's own variables:
#   6 x free_gpus_timeout: nvidia-smi calls and /proc passes, each bounded by it (the look's query
#     and its compute apps, the scan, the rescan after acting, the verify loop's last reading,
#     /dev/shm's pass);
#   2 x free_gpus_kill_timeout: the stop of units and containers, then the signals (SIGTERM, then
#     SIGKILL after kill_timeout);
#   free_gpus_wait_timeout: the verify loop; free_gpus_settle_timeout: the respawn watch;
#   with free_gpus_smoke_test, free_gpus_timeout for cuInit and for each GPU (free_gpus_expected_count,
#     8 when not set);
#   GATE_MARGIN_S: Ansible's connection, the payload's transfer and Python's start on a loaded
#     node (a clean gate takes 2-6 s on the 2-core test machine).
# With the defaults (10, 10, 60, 5): 60 + 20 + 60 + 5 + 40 = 185 s. Not Ansible's task `timeout:`
# keyword: that fails the host with Ansible's own words and no free_gpus_result, so the fleet
# summary would call the host unreachable; here the host gets its outcome, said once by the verdict.
GATE_MARGIN_S = 40.0


def gate_bound_s(params: t.Mapping[str, t.Any]) -> float:
    """Seconds the gate waits for gpu_release on one node (the sum above), from validated role variables."""
    def seconds(name: str) -> float:
        value = params.get(name)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 0.0
    timeout = seconds("free_gpus_timeout")
    smoke = (int(params.get("free_gpus_expected_count") or 8) + 1) * timeout if params.get("free_gpus_smoke_test") else 0.0
    return (6 * timeout + 2 * seconds("free_gpus_kill_timeout") + seconds("free_gpus_wait_timeout") + seconds("free_gpus_settle_timeout")
            + smoke + GATE_MARGIN_S)


def no_answer_message(bound: float) -> str:
    return (f"gpu_release did not answer within {bound:.0f} s, the bound of this host's free_gpus_* timeouts (6 x free_gpus_timeout + "
            "2 x free_gpus_kill_timeout + free_gpus_wait_timeout + free_gpus_settle_timeout + 40 s): the node is wedged (a file system "
            "or the driver does not answer, or Python cannot start there); what its GPUs hold is unknown, and the run may still be "
            "waiting there. See the troubleshooting guide, \"A node that does not answer\"")


# What Ansible's local connection raises when become ends before it starts (no sudo, a sudo that
# asks for a password): an error of the task, in Ansible's words, where over SSH the same shell's
# words reach the module's result (module_stderr) and the role says them.
BECOME_FAILED = "waiting for become success"


def become_failure(error: AnsibleError) -> dict[str, t.Any] | None:
    """A become that did not start -> the result of a module that could not start, whose
    module_stderr is what the shell or sudo said (plugin_utils/_verdict.start_failure words it);
    None for any other error."""
    text = str(getattr(error, "message", None) or error)
    if BECOME_FAILED not in text:
        return None
    said = ""
    for stream in (">>> Standard Error", ">>> Standard Output"):
        if stream in text:
            said = text.split(stream, 1)[1].split(">>> ", 1)[0].strip()
            break
    return {"failed": True, "msg": "MODULE FAILURE", "module_stderr": said or text.splitlines()[0]}


def become_failed_or(run: t.Callable[[], dict[str, t.Any]], said: t.Callable[[dict[str, t.Any]], dict[str, t.Any]]) -> dict[str, t.Any]:
    """RUN's result; where become did not start, SAID of its failure (become_failure) instead. A
    connection failure, and any other error, stays the task's."""
    try:
        return run()
    except AnsibleConnectionFailure:
        raise
    except AnsibleError as exc:
        failure = become_failure(exc)
        if failure is None:
            raise
        return said(failure)


class NoAnswer(BaseException):
    """The gate's bound passed while gpu_release ran. A BaseException, as Ansible's own task
    timeout is: nothing between the alarm and the gate takes it for an error of its own."""


@contextlib.contextmanager
def bounded(seconds: float) -> t.Iterator[None]:
    """Raise NoAnswer in the block once `seconds` have passed (SIGALRM: the worker's main thread
    waits in the connection's read of the module's answer). Where Ansible's own task timeout
    comes first, or off the main thread (a test calling the plugin), the block is not bounded here."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return
    outer, _interval = signal.getitimer(signal.ITIMER_REAL)
    if outer and outer <= seconds:
        yield
        return

    def expired(_signum: int, _frame: t.Any) -> None:
        raise NoAnswer()

    previous = signal.signal(signal.SIGALRM, expired)
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, outer - (time.monotonic() - started)))


class Invalid(Exception):
    """The role's variables fail their checks: `result` is the task's failed result."""

    def __init__(self, result: dict[str, t.Any]) -> None:
        super().__init__(result["msg"])
        self.result = result


def pause_collector_in_worker() -> None:
    """In Ansible's worker (a fork of the controller that ends with this one task), no cyclic
    garbage collection: Ansible builds gpu_release's payload here (the `ast` of every module_util
    it packs, ~0.9 MB of source), and each collection walked the whole inherited heap; the process
    exits before its garbage matters. Measured on one host (benchmarks/gate_profile.py): the build
    took 297 ms, 188 ms with the inherited objects frozen, ~130 ms with collection off. Anywhere
    else (a test calling the plugin in its own process) nothing changes."""
    if multiprocessing.parent_process() is not None:
        gc.freeze()
        gc.disable()


# The verdict's words (plugins/action/free_gpus_verdict.py).

def is_free(outcome: t.Any) -> bool:
    return isinstance(outcome, Mapping) and bool(outcome.get("ok"))


def drain_reason(outcome: t.Mapping[str, t.Any], host: str) -> str:
    """The outcome's message without the host's name (Slurm's node is the host)."""
    message = str(outcome.get("message") or "GPUs could not be freed")
    return message[len(host) + 2:] if message.startswith(f"{host}: ") else message


def should_drain(outcome: t.Mapping[str, t.Any], on_failure: t.Any, check_mode: bool) -> bool:
    """free_gpus_on_failure=drain drains a host whose GPUs could not be freed or are unhealthy; a
    settings mistake (nothing was done, nothing is wrong with the node) drains nothing."""
    return str(on_failure) == "drain" and not check_mode and outcome.get("status") != "invalid"


def say_success(message: str) -> None:
    """A free host's one line, in the default output: `h1: 8 GPUs free (327752 -> 0 MiB), stopped
    vllm.service in 0.436 s` above its `ok: [h1]`. An ok result's msg is printed with -v only (with
    the whole result, ~20 KB a host), and `_ansible_verbose_always` would print it as a JSON block;
    Ansible's worker hands this line to the controller's display, which the result callbacks of
    AWX/AAP and ansible-runner record as the task's output too. With -v the result says it itself.
    Under free_gpus.yml its fleet summary says it instead."""
    display = Display()
    if display.verbosity == 0:
        # C's colors are set from the configuration at run time.
        display.display(message, color=getattr(C, "COLOR_OK", "green"))


class GateAction(ActionBase):
    """The gate's steps, each a method: the gate's run() and the verdict's fleet check call them."""

    def _recorded(self, result: dict[str, t.Any]) -> dict[str, t.Any]:
        """The gate's result on a host that is not free: recorded, not failed. The role's next task
        (zeromib.gpu.free_gpus_verdict) fails the host with this message, once, where every host's
        outcome is known; free_gpus.yml's fleet summary says it instead."""
        verbosity = Display().verbosity
        if verbosity < 3:
            # -vvv keeps the module's traceback.
            result.pop("exception", None)
        # An ok result is printed with -v only. "failed" stays, False: Ansible fails a result
        # without it whose rc is not 0 (no sudo).
        result["failed"] = False
        return without_records(result, verbosity)

    def _dry_run(self, args: dict[str, t.Any], task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        """gpu_release in check mode (it changes nothing): which container: and supervisor: entries
        match nothing, before anything is done."""
        was = self._task.check_mode
        self._task.check_mode = True
        try:
            with bounded(gate_bound_s({ROLE_PREFIX + name: value for name, value in args.items()})):
                return self._release_module(dict(args), task_vars)
        finally:
            self._task.check_mode = was

    def _release_module(self, args: dict[str, t.Any], task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        """gpu_release on this host; a become that did not start is its result, not the task's error."""
        return become_failed_or(lambda: self._execute_module(module_name="zeromib.gpu.gpu_release", module_args=args, task_vars=task_vars),
                                lambda failure: failure)

    def _command(self, command: str) -> dict[str, t.Any]:
        """A shell command on this host (a become that did not start: its rc 1 and what it said)."""
        return become_failed_or(lambda: self._low_level_execute_command(command),
                                lambda failure: {"rc": 1, "stdout": "", "stderr": failure["module_stderr"]})

    def _services_look(self, params: t.Mapping[str, t.Any], task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        """Which free_gpus_services entries match something on this host, before anything is done:
        {matched, unmatched, close (entry -> the nearest units here), error}. Unit names and globs
        from one listing of systemd's units; container: and supervisor: entries from a dry run (only
        when there are such entries, and not in check mode, where the run itself says it)."""
        entries = [str(entry) for entry in params.get("free_gpus_services") or []]
        unmatched: list[str] = []
        units: list[str] = []
        if _services_check.unit_entries(entries):
            listed = self._command(_services_check.list_command(entries))
            if listed.get("rc") != 0:
                said = " ".join(str(listed.get("stderr") or listed.get("stdout") or "").split())[:200]
                return {"matched": [], "unmatched": [], "close": {}, "error": f"systemctl could not list the units (rc {listed.get('rc')}): {said}"}
            units = _services_check.listed_units(str(listed.get("stdout") or ""))
            unmatched = _services_check.unmatched(entries, units)
        others = _services_check.other_entries(entries)
        if others and not self._task.check_mode:
            dry = self._dry_run(module_args(params), task_vars)
            unmatched += _services_check.from_release(others, dry.get("services_not_found") or [], [])
        close: dict[str, list[str]] = {}
        if unmatched:
            # Only now every service of the host, for "did you mean".
            every = self._command(_services_check.LIST_SERVICES)
            close = _services_check.candidates(unmatched, units + _services_check.listed_units(str(every.get("stdout") or "")))
        return {"matched": [e for e in entries if e not in unmatched], "unmatched": unmatched, "close": close, "error": None}

    def _invalid(self, result: dict[str, t.Any], host: str, problems: list[str], marker: str = "") -> dict[str, t.Any]:
        """A settings mistake found before anything was done, recorded for the verdict."""
        msg = f"settings mistake, nothing was done{marker}: " + "; ".join(problems)
        result.update({"msg": msg, "argument_errors": problems, "ansible_facts": {"free_gpus_result": failed(host, msg, "invalid")}})
        return self._recorded(result)

    def _mistakes_elsewhere(self, task_vars: dict[str, t.Any], host: str) -> dict[str, list[str]]:
        """{host: its settings mistakes} for the other hosts of the play that have one, checked once
        per play for every gate (plugin_utils/_play_settings.py)."""
        hosts = [str(name) for name in task_vars.get("ansible_play_hosts_all") or []]
        if len(hosts) < 2:
            return {}
        spec = self._argument_spec(task_vars)
        found = _play_settings.once(str(getattr(C, "DEFAULT_LOCAL_TMP", "")), _play_settings.cache_key(self._task, hosts), lambda: _play_settings.play_mistakes(
            _play_settings.raw_settings(task_vars, self._task, hosts), spec, NOT_OPTIONS))
        return {name: problems for name, problems in found.items() if name != host}

    def _stopped_by(self, result: dict[str, t.Any], host: str, elsewhere: t.Mapping[str, list[str]]) -> dict[str, t.Any]:
        """A host without a mistake of its own, held still by another host's: recorded as a settings
        mistake that names the offending hosts and variables; their own lines say the whole mistake."""
        outcome = failed(host, _play_settings.elsewhere_message(elsewhere), "invalid")
        outcome["mistake_on"] = list(elsewhere)
        result.update({"msg": outcome["message"], "changed": False, "ansible_facts": {"free_gpus_result": outcome}})
        return self._recorded(result)

    def _no_answer(self, result: dict[str, t.Any], host: str, bound: float) -> dict[str, t.Any]:
        """gpu_release outlived the gate's bound on this host: it fails alone, the rest of the play goes on."""
        msg = no_answer_message(bound)
        result.update({"msg": msg, "changed": False, "ansible_facts": {"free_gpus_result": failed(host, msg, "failed")}})
        return self._recorded(result)

    def _deferred(self, result: dict[str, t.Any], host: str, look: t.Mapping[str, t.Any], warnings: list[str]) -> dict[str, t.Any]:
        """Some services entry matches nothing on this host: nothing is done yet. The role's verdict
        runs this host's release once every host has looked, unless no host of the play matches
        that entry (a typo: then every host that has it fails, and none has acted)."""
        outcome = failed(host, "waiting for the fleet check of free_gpus_services: {} {} nothing on this host".format(
            ", ".join(look["unmatched"]), "matches" if len(look["unmatched"]) == 1 else "match"), "deferred")
        outcome.update({"services_matched": look["matched"], "services_unmatched": look["unmatched"], "services_close": look["close"]})
        result.update({"msg": outcome["message"], "changed": False, "warnings": warnings, "ansible_facts": {"free_gpus_result": outcome}})
        return self._recorded(result)

    def _argument_spec(self, task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        role_path = task_vars.get("role_path")
        if not role_path:
            raise AnsibleActionFail("zeromib.gpu.free_gpus_gate runs inside the zeromib.gpu.free_gpus role only")
        spec = role_options(role_path)
        if spec is None:
            raise AnsibleActionFail(f"no meta/argument_specs.yml in {role_path}")
        return spec

    def _validated(self, task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        """The role's variables, checked and typed with Ansible's own validator against their types
        (plugin_utils/_role_spec.py: the role's file says `raw`, so that Ansible's automatic
        validation lets this check speak), each mistake said in the user's words, then their
        ranges as gpu_release checks them."""
        spec, validator = _play_settings.checker(self._argument_spec(task_vars))
        try:
            provided = _play_settings.untemplated({name: task_vars[name] for name in spec if name in task_vars}, self._templar.template)
        except AnsibleError as exc:
            raise Invalid({"failed": True, "msg": "settings mistake, nothing was done: a free_gpus_* variable cannot be templated: {}".format(
                " ".join(str(getattr(exc, "message", exc)).split()))}) from exc
        checked = validator.validate(provided, validate_role_argument_spec=True)
        if checked.error_messages:
            errors = _role_spec.plain_errors(checked.error_messages, provided)
            raise Invalid({
                "failed": True,
                "msg": "settings mistake, nothing was done: {}".format("; ".join(errors)),
                "argument_errors": errors,
            })
        problems = _play_settings.range_problems(checked.validated_parameters)
        if problems:
            raise Invalid({"failed": True, "msg": "settings mistake, nothing was done: " + "; ".join(problems), "argument_errors": problems})
        return checked.validated_parameters

    def release(self, result: dict[str, t.Any], params: dict[str, t.Any], task_vars: dict[str, t.Any], host: str,
                look: t.Mapping[str, t.Any] | None) -> dict[str, t.Any]:
        """gpu_release on this host, its verdict in free_gpus_result (the role's verdict runs this
        for a host the fleet check held back)."""
        bound = gate_bound_s(params)
        try:
            with bounded(bound):
                release = self._release_module(module_args(params), task_vars)
        except NoAnswer:
            return self._no_answer(result, host, bound)
        entries = [str(entry) for entry in params.get("free_gpus_services") or []]
        # What matches nothing on this host is the fleet check's to say, once (an entry that matches
        # on some hosts only is no mistake in a mixed fleet); gpu_release's line per host goes.
        release_warnings = [text for w in release.get("warnings") or []
                            if not _services_check.no_match_warning(text := warning_text(w), entries)]
        check_mode = bool(self._task.check_mode)
        found = role_verdict(release, params, check_mode)
        outcome = outcome_of(release, host, found, check_mode)
        # Said as the role's user sets them: free_gpus_max_used_mib, not the module's max_used_mib.
        outcome["message"] = in_role_words(outcome["message"])
        if look is not None:
            # In check mode the run itself says which container: and supervisor: entries match nothing.
            unmatched = list(look["unmatched"]) + [e for e in _services_check.from_release(
                _services_check.other_entries(entries), release.get("services_not_found") or [], []) if e not in look["unmatched"]]
            if unmatched and params.get("free_gpus_strict"):
                return self._invalid(result, host, [f"free_gpus_services: {entry} matches no unit, container or supervisord program on this host"
                                                    for entry in unmatched], " (free_gpus_strict)")
            outcome.update({"services_matched": [e for e in entries if e not in unmatched] if not look["error"] else [],
                            "services_unmatched": unmatched, "services_close": look["close"]})
        result.update(release)
        result["warnings"] = [in_role_words(text) if isinstance(text, str) else text for text in release_warnings]
        # Set on every host, free or not: this task never fails (Ansible drops a failed task's facts).
        result["ansible_facts"] = {"free_gpus_result": outcome}
        result["msg"] = outcome["message"]
        if found.failed_checks:
            result["failed_checks"] = found.failed_checks
            return self._recorded(result)
        result.pop("failed", None)
        return without_records(result, Display().verbosity)
