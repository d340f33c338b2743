# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""No name decides alone (issue 31, docs/docsite/rst/guide_security.rst): every list of process names in module_utils
is a _protect.ProcessNames, whose only question (`of`) asks the identity rule first.

The test enumerates module_utils itself, so a list added later fails it until it is classified:
- a module-level tuple, list, set or frozenset of strings is either a ProcessNames or listed in
  NOT_PROCESS_NAMES below with what it lists instead (directories, unit globs, result keys);
- each ProcessNames, name by name, answers None for a user's process of that name (uid 4242, even
  from a root-owned /usr/bin/python3) and the name for root's;
- the raw matchers (the names a process gives itself, matched without the rule) are called only
  where listed in RAW_NAME_READERS, each with why that is no decision by name."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil

import pytest

from ansible_collections.zeromib.gpu.plugins import module_utils
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _protect

NOT_PROCESS_NAMES = {
    "_vfio.VM_SLICES": "cgroup directories at the top of root's cgroup tree where systemd puts VM scopes, never a process's name",
    "_apptainer.STARTERS": "basenames of the executable the kernel resolved (/proc/PID/exe), root-owned in a system directory: the identity rule's own test",
    "_apptainer.STARTER_DIRS": "directories",
    "_origin.SSH_SERVICES": "PAM service names in logind's root-owned session record (sshd's), never a process's name",
    "_origin._RANK_KEYS": "environment variable names of a torchrun rank, quoted in words only",
    "_checkpoint.STATES": "the states cuda-checkpoint --get-state prints",
    "_checkpoint.TOOL_DIRS": "directories",
    "_mig_restore.UNIT_DIRS": "directories systemd reads system units from",
    "_mig_restore.GUEST_PROPS": "systemd properties a guest's systemd is asked about one of its units",
    "_services.ORCHESTRATOR_PREFIXES": "services entry prefixes (swarm:, ray:)",
    "_orchestrators.PREFIXES": "services entry prefixes (swarm:, ray:)",
    "_orchestrators.SLURM_DIRS": "directories Slurm's clients live in (scontrol)",
    "_caps.WHOLE": "result keys (lists the hardware sizes)",
    "_commands.SYSTEM_DIRS": "directories",
    "_device_nodes.CONTROL": "device node paths (/dev/nvidiactl, the UVM nodes)",
    "_ready_settings.ACTIONS": "restore record actions (GPU settings)",
    "_options.READY_COMPUTE_MODES": "nvidia-smi compute mode values (ready_profile)",
    "_mounts.ANSWERING_FS": "file system types (mountinfo)",
    "_jobcheck.MODES": "the Slurm hook modes (prolog, epilog)",
    "_jobcheck.NUMBERS": "config option names (numbers)",
    "_jobcheck.BOOLEANS": "config option names (true or false)",
    "_options.BOTH": "module names (gpu_facts, gpu_release)",
    "_jobcheck.PATHS": "config option names (paths)",
    "_drain.ADMIN_STATES": "Slurm node states",
    "_jobcheck.RELEASE_OPTIONS": "gpu_release option names the hooks' config may set",
    "_commands.NVIDIA_DIRS": "directories",
    "_supervisor.PROCESS_SECTIONS": "supervisord config section kinds",
    "_nvidia_smi.LIBRARY_DIRS": "directories",
    "_containers.MANAGED": "result keys",
    "_container_of.MANAGED": "result keys",
    "_container_of.HOLDER_KEYS": "result keys",
    "_cuda_smoke.STEPS": "step names",
    "_words._HOLDER_TEXTS": "phrases of the failure message (GPUs said together by holder)",
    "_reload_risk.MEMORY_FS": "file system types (a container's /dev read only on these)",
    "_engines.MANAGED": "result keys",
    "_engines.BIN_DIRS": "directories",
    "_facts.GPU_KEYS": "result keys",
    "_facts.HOLDER_KEYS": "result keys",
    "_health.NOT_GPU_FAULTS": "health check names",
    "_check_names.CHECKS": "health check names",
    "_health.CHECKS": "health check names (_check_names', as callers know them)",
    "_health._CHECKED_KEYS": "result keys",
    "_health.FAULT_TOKENS": "words of nvidia-smi's output",
    "_kernel_log.TOOL_DIRS": "directories",
    "_health.HEALTH_KEYS": "result keys",
    "_health.FABRIC_REGISTRATION_KEYS": "result keys (issue 30, on main)",
    "_devices.DRIVER_ROOT_PREFIXES": "directories",
    "_devices._FRONTEND_NAMES": "driver names in /proc/devices (the kernel's)",
    "_devices.DEV_DIRS": "directories",
    "_protect.SYSTEM_DIRS": "directories",
    "_mps.BIN_DIRS": "directories",
    "_nvidia_smi.OPTIONAL_FIELDS": "nvidia-smi query fields",
    "_record.KINDS": "record kinds",
    "_reload_risk.CLOSED_DEFAULTS": "device node paths (what DevicePolicy=closed allows)",
    "_record.ACTIONS": "record actions",
    "_settle.TORCHRUN_MODULES": "Python modules in a command line: a label for the message (supervisor_kind); the walk stops by stops_the_walk",
    "_signals.PRIVATE_KEYS": "result keys",
    "_supervisor.BIN_DIRS": "directories",
    "_supervisor.DEFAULT_CONFIGS": "file paths",
    "_supervisor.RUNNING_STATES": "supervisorctl states",
    "_units.ACTIVE_STATES": "systemd states",
    "_units.ENABLED_STATES": "systemd states",
    "_units.MASKED_STATES": "systemd states",
    "_units.STOPPED_STATES": "systemd states",
    "_unit_kinds.UNIT_SUFFIXES": "unit name suffixes",
    "_units.UNIT_SUFFIXES": "unit name suffixes (_unit_kinds', as callers know them)",
    "_units.LAUNCHER_UNITS": "unit globs, matched against systemd's unit names (no process's)",
    "_units.ESSENTIAL_UNITS": "unit globs of the `*` essentials, matched against systemd's unit names (no process's)",
    "_unit_kinds.LAUNCHER_UNITS": "unit globs, matched against systemd's unit names (no process's)",
    "_unit_kinds.ESSENTIAL_UNITS": "unit globs of the `*` essentials, matched against systemd's unit names (no process's)",
    "_cgroups.GUEST_KINDS": "kinds of system containers (lxc, lxd, nspawn)",
    # The host cannot vouch for a guest's executable (the guest's file, owned by the guest's mapped root): see RAW_NAME_READERS.
    "_guests.SYSTEM_MANAGERS": "names of a guest's init (PID 1 of the guest's PID namespace, the kernel's word), read by _guests.manager_of",
}

# Where the names a process gives itself are read without the identity rule, and why that decides
# nothing by a name: {(module, function): why}.
RAW_NAME_READERS = {
    ("_protect", "name_matches"): "the raw matcher itself",
    ("_protect", "ProcessNames.of"): "after `identified`",
    ("_protect", "ProcessNames.posed_by"): "only when `identified` fails: the impostor warning",
    ("_protect", "ProcessNames.candidates"): "called by of / posed_by",
    ("_protect", "ProcessNames.among"): "names its caller holds for vouched; its only caller is _units.launcher_name (checked here)",
    ("_units", "main_names"): "after `identified` (systemd's MainPID), and ExecStart= (systemd's)",
    ("_units", "exec_start_names"): "names in systemd's ExecStart=, no process's",
    ("_units", "launcher_name"): "ProcessNames.among over main_names",
    ("_settle", "_names"): "for supervisor_kind, a label; the walk's stop is stops_the_walk (identified first)",
    ("_settle", "stops_the_walk"): "after `identified` (its first operand): the walk's stop",
    ("_settle", "supervisor_kind"): "a label for the message (what stops the restarter); deciding, it is asked after `identified`",
    ("_guests", "manager_of"): ("the guest's word about its own init (the process the kernel numbers 1 in the guest's PID namespace): it "
                                "decides only whether gpu_release refuses (stops less) or signals the guest's process as any other, "
                                "never that anything is stopped"),
}
RAW_MATCHERS = {"name_matches", "own_names", "process_names", "_first_match", "among", "_names", "candidates"}


def modules():
    """(file name without .py, module) of every module_util, in every wing (_look, _act, _slurm)."""
    for info in pkgutil.walk_packages(module_utils.__path__, module_utils.__name__ + "."):
        if not info.ispkg:
            yield info.name.rsplit(".", 1)[1], importlib.import_module(info.name)


def string_lists():
    for name, module in modules():
        for attr, value in vars(module).items():
            if isinstance(value, (tuple, list, set, frozenset)) and value and all(isinstance(item, str) for item in value):
                yield f"{name}.{attr}", value


def name_lists():
    for name, module in modules():
        for attr, value in vars(module).items():
            if isinstance(value, _protect.ProcessNames):
                yield f"{name}.{attr}", value


def test_every_list_of_strings_is_classified():
    unclassified = [qualified for qualified, _value in string_lists() if qualified not in NOT_PROCESS_NAMES]
    assert not unclassified, (
        f"{unclassified}: a list of process names must be a _protect.ProcessNames (the identity rule decides, not the name); "
        "any other list of strings goes into NOT_PROCESS_NAMES with what it lists")


def test_the_known_name_lists_are_process_names():
    found = dict(name_lists())
    for qualified in ("_protect.BUILTIN_PROTECTED_NAMES", "_units.LAUNCHER_NAMES", "_mps.CONTROL_NAMES", "_mps.SERVER_NAMES",
                      "_supervisor.SUPERVISORD"):
        assert qualified in found, qualified


def posed(name, uid, exe_path="/usr/bin/python3"):
    """A process that goes by `name` (argv[0], comm, script), run by `uid` from a root-owned
    executable of a system directory: root's when uid is 0, a user's `exec -a` otherwise."""
    return {"pid": 4321, "ppid": 1, "name": name[:15], "argv0": name, "exe": os.path.basename(exe_path), "exe_path": exe_path,
            "exe_owner": 0, "exe_verified": True, "uid": uid, "cmdline": name, "unit": "user@4242.service", "system_service": False}


@pytest.mark.parametrize("qualified,names", sorted(name_lists(), key=lambda item: item[0]), ids=lambda v: v if isinstance(v, str) else "")
def test_each_name_of_each_list_counts_only_through_the_identity_rule(qualified, names):
    assert len(names) > 0
    for name in names.names:
        assert names.of(posed(name, 4242)) is None, f"{qualified}: {name} decided for uid 4242"
        assert names.of(posed(name, 4242), main_pid_of=lambda _unit: 4321) is None, f"{qualified}: {name} (not a system unit's main)"
        assert names.of(posed(name, 0, exe_path="/home/u/bin/tool")) is None, f"{qualified}: {name} from a user's directory"
        assert names.of(posed(name, 0)) in names.names, f"{qualified}: {name} not recognised for root"
        assert names.posed_by(posed(name, 4242)) in names.names


def _calls_outside_the_rule():
    found = []
    for name, module in modules():
        with open(module.__file__) as handle:
            tree = ast.parse(handle.read())
        for scope, node in _walk(tree, ""):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
                if called in RAW_MATCHERS and not _allowed(name, scope):
                    found.append(f"{name}.{scope or '<module>'} calls {called}")
            if isinstance(node, ast.Attribute) and node.attr == "_names" and name != "_protect":
                found.append(f"{name}.{scope or '<module>'} reads ProcessNames._names")
    return found


def _walk(node, scope):
    """(dotted scope, node) for every node: `Class.method`, `function.inner`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _walk(child, f"{scope}.{child.name}" if scope else child.name)
        else:
            yield scope, child
            yield from _walk(child, scope)


def _allowed(module, scope):
    parts = scope.split(".")
    return any((module, ".".join(parts[:n])) in RAW_NAME_READERS for n in range(1, len(parts) + 1))


def test_names_a_process_gives_itself_are_read_only_where_the_rule_comes_first():
    assert _calls_outside_the_rule() == []
