# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the plugins of
# zeromib.gpu may use it.

"""The one table of gpu_facts' and gpu_release's options (OPTIONS), and the one range check of
every option.

Ansible's argument spec types a value (`float` accepts "nan" and "inf") but checks no range:
a NaN timeout compares false with everything, so `now >= deadline` never holds and a wait
never ends; a huge one overflows the OS's timers. Every numeric option of the modules, and of
the role's gate, goes through `check` before anything runs: at least RANGES' low end, and for
a time at most its TIME_LIMITS."""

from __future__ import annotations

import collections
import math
import typing as t

FACTS = "gpu_facts"
RELEASE = "gpu_release"
BOTH = (FACTS, RELEASE)
ONE_DAY_S = 86400
# A bound of a time (seconds; xid_window_hours in hours) and how a message says it.
DAY = (ONE_DAY_S, "one day")


# A collections.namedtuple, not a typing.NamedTuple: with postponed annotations, the latter compiles
# each field's annotation (typing.ForwardRef) on every gate's import.
class Option(collections.namedtuple("Option", ["name", "type", "default", "doc", "elements", "choices", "low", "most", "modules", "role", "slurm",
                                               "options"],
                                    defaults=(None, "", None, None, None, None, BOTH, True, True, None))):
    """One option of gpu_facts and gpu_release, as every entry point reads it: the modules' argument
    spec (argument_spec), the Slurm runner's defaults and type checks (_slurm/_jobcheck), the free_gpus
    role's variable types (plugin_utils/_role_spec, role_types) and the range check (check).

    name, type (the modules' argument spec type: path, float, int, bool, str, list), default, doc (a
    short one), elements and choices as the argument spec has them; low: the smallest value it accepts
    and whether that bound itself is allowed (RANGES); most: the most it accepts in its own unit and
    the words that say it (TIME_LIMITS); modules: which take it; role: the free_gpus role passes it as
    free_gpus_<name> (else the role has no such variable, or one of another name: health is
    free_gpus_require_healthy); slurm: a site may set it in the Slurm hooks' config
    (_slurm/_jobcheck.RELEASE_OPTIONS)."""

    __slots__ = ()

    def spec(self) -> dict[str, t.Any]:
        """The option's AnsibleModule argument spec entry."""
        entry: dict[str, t.Any] = {"type": self.type}
        if self.elements:
            entry["elements"] = self.elements
        if self.default is not None:
            entry["default"] = list(self.default) if isinstance(self.default, tuple) else self.default
        if self.choices:
            entry["choices"] = list(self.choices)
        if self.options:
            entry["options"] = {name: {key: list(value) if isinstance(value, list) else value for key, value in sub} for name, sub in self.options}
        return entry


# The one table of gpu_facts' and gpu_release's options. Adding an option: a row here, its
# DOCUMENTATION (the module's, or doc_fragments for both), the role's defaults, argument_specs and
# guide entry (a role variable), nothing else: tests/unit/plugins/module_utils/test_option_table.py
# holds DOCUMENTATION, the role's argument specs and this table to one another.
OPTIONS = (
    Option("nvidia_smi", "path", doc="path of nvidia-smi (searched when not set)"),
    Option("timeout", "float", 10, "seconds for each nvidia-smi call and the /proc scan", low=(0, False), most=DAY),
    Option("max_used_mib", "int", 0, "the most MiB a GPU may read and still be free", low=(0, True)),
    # _unified_memory.DEFAULT_MIN_HOST_AVAILABLE_MIB, with its reason.
    Option("min_host_available_mib", "int", 1024, "the least host MemAvailable (MiB) with which a GPU sharing the host's memory is free",
           low=(0, True)),
    Option("cross_gpu_footprint_mib", "int", 4, "MiB a context on another GPU leaves on a free one", low=(0, True)),
    Option("protect", "list", (), "process names or PIDs never signalled", elements="str"),
    Option("health", "bool", True, "read the GPUs' health (Xids, PCIe, persistence, /dev/shm)", role=False),
    Option("min_pcie_gen", "int", 0, "the lowest PCIe generation a GPU may run at", low=(0, True)),
    Option("min_pcie_width", "int", 0, "the narrowest PCIe link a GPU may run at", low=(0, True)),
    Option("require_persistence", "bool", True, "a GPU without persistence mode is unhealthy"),
    Option("expected_mig_mode", "str", None, "the MIG mode every GPU must be in", choices=("enabled", "disabled")),
    Option("xid_window_hours", "float", 24, "how far back the kernel log's Xids count", low=(0, True), most=(8760, "one year")),
    Option("dcgm_diag", "int", 0, "the dcgmi diag level to run (0: none)", choices=(0, 1, 2, 3, 4), slurm=False),
    Option("xid_ignore", "list", (), "Xids that never make a GPU unhealthy", elements="int"),
    Option("xid_fatal", "list", (), "Xids that always make a GPU unhealthy", elements="int"),
    Option("smoke_test", "bool", False, "run the CUDA smoke test on the free GPUs"),
    Option("smoke_test_mib", "int", 1024, "MiB the smoke test allocates on each GPU", low=(0, True)),
    # _shm.DEFAULT_MIN_FREE_MIB_PER_GPU, with its reason.
    Option("shm_min_free_mib_per_gpu", "int", 128, "the least free /dev/shm per GPU (MiB)", low=(0, True)),
    # The training-ready profile (_look/_readiness.py): not given, the default one. No default: {}
    # would be one dict object that Ansible fills in place, shared by every caller.
    Option("ready_profile", "dict", None, "the GPU settings a training job expects (compute mode, clocks, power limit)",
           options=(("compute_mode", (("type", "str"), ("default", "default"), ("choices", ["default", "exclusive_process", "prohibited", "any"]))),
                    ("clocks", (("type", "str"), ("default", "default"), ("choices", ["default", "any"]))),
                    ("power_limit", (("type", "str"), ("default", "default"))))),
    Option("processes", "bool", True, "list the processes that hold each GPU", modules=(FACTS,), role=False, slurm=False),
    Option("fail_on_error", "bool", True, "fail when nvidia-smi cannot be read", modules=(FACTS,), role=False, slurm=False),
    Option("gpus", "list", (), "the GPUs to free (indexes or UUIDs; none: all)", elements="str", modules=(RELEASE,), slurm=False),
    Option("services", "list", (), "units, containers, programs and guests' units to stop", elements="str", modules=(RELEASE,), slurm=False),
    Option("service_state", "str", "stopped", "what the named services are left", choices=("stopped", "disabled", "masked"),
           modules=(RELEASE,), slurm=False),
    Option("stop_owning_units", "bool", True, "stop the unit that runs a holder", modules=(RELEASE,)),
    Option("kill", "bool", True, "signal the holders left", modules=(RELEASE,), slurm=False),
    Option("kill_spanning", "bool", False, "also end what uses GPUs outside the selection", modules=(RELEASE,)),
    Option("kill_checkpointed", "bool", False, "also end CUDA-checkpointed holders (their saved state is lost)", modules=(RELEASE,)),
    Option("launchers", "list", (), "units of the site that start other people's jobs", elements="str", modules=(RELEASE,), slurm=False),
    Option("match", "list", (), "regular expressions a holder's command line must match", elements="str", modules=(RELEASE,), slurm=False),
    Option("kill_timeout", "float", 10, "seconds from SIGTERM to SIGKILL (and for each stop)", low=(0, True), most=DAY, modules=(RELEASE,)),
    Option("wait_timeout", "float", 60, "seconds to wait for the GPUs to read free", low=(0, True), most=DAY, modules=(RELEASE,)),
    Option("poll_interval", "float", 0.1, "seconds between readings while waiting", low=(0, False), most=DAY, modules=(RELEASE,), slurm=False),
    Option("settle_timeout", "float", 5, "seconds to watch that nothing starts a killed holder again", low=(0, True), most=DAY,
           modules=(RELEASE,)),
    Option("clean_shm", "bool", False, "remove what the killed jobs left in /dev/shm", modules=(RELEASE,)),
    # The Slurm epilog puts the profile back where the site opted in, as gpu_release does; the prolog only looks.
    Option("ready_fix", "bool", False, "set GPUs off the ready profile back to it, recorded for gpu_restore", modules=(RELEASE,)),
)
BY_NAME = {option.name: option for option in OPTIONS}


# What a key left out of a partial mapping means (Records.from_params): None (off, or "not set") for
# every option but these, which the engine always read as on when absent (the unit tests' and the
# Slurm runner's partial dicts rely on it). A full module.params never leaves a key out.
WHEN_MISSING = {"kill": True, "require_persistence": True, "processes": True}


def record_fields(modules: t.Iterable[str]) -> tuple[str, ...]:
    """The names of the table's options that any of `modules` takes, in the table's order."""
    wanted = set(modules)
    return tuple(option.name for option in OPTIONS if wanted & set(option.modules))


class Record:
    """A frozen record of named values (_fields), read by attribute: a plain class with __slots__,
    not a collections.namedtuple, whose making (an eval of its __new__) cost ~110 us a class on
    every gate's import. A subclass names its _fields (and __slots__ = _fields) and the value of
    a field not given (_defaults, else None). Runs on every Python the nodes run (3.8 included)."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()
    _defaults: t.Mapping[str, t.Any] = {}

    def __init__(self, **values: t.Any) -> None:
        unknown = set(values) - set(self._fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {', '.join(sorted(unknown))}")
        for name in self._fields:
            object.__setattr__(self, name, values[name] if name in values else self._defaults.get(name))

    def __setattr__(self, name: str, value: t.Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: {name} cannot be set")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: {name} cannot be deleted")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._asdict() == other._asdict()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(tuple(self._fields))

    def __repr__(self) -> str:
        return "{}({})".format(type(self).__name__, ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields))

    def _asdict(self) -> dict[str, t.Any]:
        return {name: getattr(self, name) for name in self._fields}

    def _replace(self, **values: t.Any) -> t.Any:
        return type(self)(**dict(self._asdict(), **values))

    if t.TYPE_CHECKING:
        # Fields are made from the table at import: any name reads as Any for mypy.
        def __getattr__(self, name: str) -> t.Any: ...


class Records(Record):
    """A record of options (ReleaseOptions, LookOptions) whose fields are the table's rows: a row
    added to OPTIONS is a field at once. A field left out reads WHEN_MISSING's value, else None."""

    __slots__ = ()
    _defaults = WHEN_MISSING

    @classmethod
    def from_params(cls, params: t.Mapping[str, t.Any]) -> t.Any:
        """A mapping of option values (module.params, checked; or a partial one) -> the record: a
        key it leaves out reads WHEN_MISSING's value, else None; keys that are no field are left."""
        return cls(**{name: params[name] for name in cls._fields if name in params})

    @classmethod
    def of(cls, given: t.Any) -> t.Any:
        """A record of this kind from a mapping or from another record (a ReleaseOptions gives the
        look its LookOptions): the one conversion at a boundary."""
        if isinstance(given, cls):
            return given
        return cls.from_params(given if isinstance(given, t.Mapping) else given._asdict())


# gpu_release's options as one frozen record, built once at the module's entry (Release.options),
# plus match_regexes: `match` compiled (gpu_release's checked_params), never recompiled. Read an option
# as `options.kill_timeout`, never by key: tests/quality/test_option_records.py holds it so.
class ReleaseOptions(Records):
    """gpu_release's options (every row of OPTIONS that gpu_release takes), and match_regexes."""

    _fields = record_fields((RELEASE,)) + ("match_regexes",)
    __slots__ = _fields

    @classmethod
    def from_params(cls, params: t.Mapping[str, t.Any]) -> t.Any:
        """As Records', with checked_params' compiled `_match_regexes` as match_regexes."""
        if "_match_regexes" in params:
            params = dict(params, match_regexes=params["_match_regexes"])
        return super().from_params(params)


# The look's options (every row gpu_facts takes: the look both modules share, _look/_facts and
# _health.Checks read it).
class LookOptions(Records):
    """The options of one look at the GPUs (every row of OPTIONS that gpu_facts takes)."""

    _fields = record_fields((FACTS,))
    __slots__ = _fields


# gpu_restore's own options (plugins/modules/gpu_restore.py ARGUMENT_SPEC; none is a row of OPTIONS: it
# reads no GPU the way the look does), as one frozen record built at _act/_restore.Restore's entry.
# A key left out of a partial mapping (the unit tests') reads None, as `params.get` read it.
class RestoreOptions(Record):
    """gpu_restore's options."""

    _fields = ("step_timeout", "wait_for_gpus", "forget", "nvidia_smi", "reload_despite_gpu_containers", "recreate_mig_layout")
    __slots__ = _fields

    @classmethod
    def of(cls, given: t.Any) -> t.Any:
        """gpu_restore's module.params (or a partial mapping, or a record) -> the record; keys that are no field are left."""
        if isinstance(given, cls):
            return given
        return cls(**{name: given[name] for name in cls._fields if name in given})


def argument_spec(module: str) -> dict[str, dict[str, t.Any]]:
    """The argument spec of gpu_facts or gpu_release (their options of the table)."""
    return {option.name: option.spec() for option in OPTIONS if module in option.modules}


def defaults(module: str) -> dict[str, t.Any]:
    """{option: default} of a module's options (lists as new lists)."""
    return {name: entry.get("default") for name, entry in argument_spec(module).items()}


def role_types(prefix: str = "free_gpus_") -> dict[str, dict[str, t.Any]]:
    """The free_gpus role's variable types of the table's options (plugin_utils/_role_spec.TYPES):
    a path is a string there, and "" (the role's default) stands for an unset choice."""
    types = {}
    for option in OPTIONS:
        if not option.role:
            continue
        entry: dict[str, t.Any] = {"type": "str" if option.type == "path" else option.type}
        if option.elements:
            entry["elements"] = option.elements
        if option.choices:
            entry["choices"] = list(option.choices) if option.default is not None else [""] + list(option.choices)
        types[prefix + option.name] = entry
    return types


# Options both modules take, with the same meaning and default.
SHARED_SPEC = {option.name: option.spec() for option in OPTIONS if option.modules == BOTH}

# option -> the smallest value it accepts, and whether that bound itself is allowed: the table's,
# and those of gpu_restore and the role's own. 0 is a meaningful kill_timeout (SIGKILL at once) and
# wait_timeout (one reading); a 0 timeout or poll_interval would never let nvidia-smi answer or
# would spin.
RANGES = dict(
    {option.name: option.low for option in OPTIONS if option.low is not None},
    expected_count=(0, True),
    # gpu_restore: every step (a systemctl call, a container start) must be given some time.
    step_timeout=(0, False),
    wait_for_gpus=(0, True),
)

# option -> the most it accepts, in its own unit, and how the message says it. Every option that is
# a time has its bound here: past it, deadlines overflow what the OS takes (`timeout: 1e10` ended in
# an OverflowError from a subprocess wait), and no GPU needs a longer wait than a day. A window
# over the kernel log is not a wait: a year of it is more than any node's uptime between reboots.
TIME_LIMITS = dict(
    {option.name: option.most for option in OPTIONS if option.most is not None},
    step_timeout=DAY,
    wait_for_gpus=DAY,
)

# systemd refuses unit names longer than 255 characters (UNIT_NAME_MAX); the count keeps every
# systemctl command line far below the kernel's limit on arguments (no "Argument list too long").
MAX_SERVICES = 1000
MAX_SERVICE_LEN = 255


def range_problem(name: str, value: t.Any) -> str | None:
    """A sentence saying what is wrong with one numeric option, or None."""
    if value is None or name not in RANGES or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return f"{name} must be a number, got {value!r}"
    except OverflowError:  # an integer past any float (10**400): no option takes it
        return f"{name} must be a number that fits a float, got an integer of {len(str(abs(int(value)))):d} digits"
    # An infinite time is told its bound (below); any other NaN or infinity is no number to check.
    if math.isnan(number) or (math.isinf(number) and name not in TIME_LIMITS):
        return f"{name} must be a finite number, got {value}"
    low, inclusive = RANGES[name]
    if number < low or (number == low and not inclusive):
        return "{} must be {} {}, got {}".format(name, "at least" if inclusive else "greater than", low, value)
    if name in TIME_LIMITS and number > TIME_LIMITS[name][0]:
        most, words = TIME_LIMITS[name]
        unit = "hours" if name.endswith("_hours") else "seconds"
        return f"{name} must be at most {most:d} {unit} ({words}), got {value}"
    return None


def services_problem(services: t.Sequence[str] | None) -> str | None:
    """A sentence when `services` is more than systemctl can be given, or None."""
    services = services or []
    if len(services) > MAX_SERVICES:
        return f"services: {len(services):d} entries, more than the {MAX_SERVICES:d} gpu_release accepts: use globs (vllm*.service)"
    for entry in services:
        if len(entry) > MAX_SERVICE_LEN + len("container:"):
            return f"services: an entry of {len(entry):d} characters ({entry[:40]}...) is longer than any unit or container name ({MAX_SERVICE_LEN:d})"
    return None


# nvidia-smi's compute modes a ready_profile may ask for (lower case; _look/_readiness.py).
READY_COMPUTE_MODES = ("default", "exclusive_process", "prohibited")


def ready_profile_problems(given: t.Any, name: str = "ready_profile") -> list[str]:
    """One sentence per mistake in a ready_profile value (the module's spec checks its own; the
    Slurm prolog's JSON config comes here unchecked). The profile itself: _look/_readiness.py."""
    if given is None:
        return []
    if not isinstance(given, dict):
        return [f"{name} must be a mapping (compute_mode, clocks, power_limit), got {given!r}"]
    known = {"compute_mode", "clocks", "power_limit"}
    problems = [f"{name}: unknown key {key!r} (known: compute_mode, clocks, power_limit)" for key in sorted(set(given) - known)]
    mode = given.get("compute_mode")
    if mode is not None and str(mode).lower() not in READY_COMPUTE_MODES + ("any",):
        problems.append(f"{name}.compute_mode must be one of default, exclusive_process, prohibited, any; got {mode!r}")
    clocks = given.get("clocks")
    if clocks is not None and str(clocks).lower() not in ("default", "any"):
        problems.append(f"{name}.clocks must be default or any, got {clocks!r}")
    power = given.get("power_limit")
    if power is not None and not isinstance(power, bool) and str(power).strip().lower() not in ("default", "any"):
        try:
            watts = float(str(power))
        except ValueError:
            watts = float("nan")
        if math.isnan(watts) or math.isinf(watts) or watts <= 0:
            problems.append(f"{name}.power_limit must be default, any or the least watts a GPU may be limited to (e.g. 300), got {power!r}")
    elif isinstance(power, bool):
        problems.append(f"{name}.power_limit must be default, any or a number of watts, got {power!r}")
    return problems


def check(params: t.Mapping[str, t.Any], prefix: str = "") -> list[str]:
    """Every problem of the numeric options and of `services` in `params` -> a list of sentences
    (empty: fine). `prefix` names the options as the user wrote them (the role's free_gpus_)."""
    problems = []
    for name in sorted(params):
        problem = range_problem(name, params[name])
        if problem:
            problems.append(prefix + problem)
    if "ready_profile" in params:
        problems.extend(prefix + problem for problem in ready_profile_problems(params["ready_profile"]))
    if "services" in params:
        problem = services_problem(params["services"])
        if problem:
            problems.append(prefix + problem)
    return problems


def baseline_with_margin(mib: int) -> int:
    """The max_used_mib to set for a GPU whose idle baseline reads MIB: the next multiple of 16 with
    at least 4 MiB to spare (55 -> 64: MIG GPUs read 50-59 MiB idle). The exact reading would fail
    the host again the day its GPU reads 1 MiB more. gpu_release, the free_gpus role and the audit
    all advise this value."""
    return -(-(int(mib) + 4) // 16) * 16
