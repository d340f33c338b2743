"""pytest fixtures for tests on a fleet of real systemd hosts with simulated GPUs.

`fleet` (session scope) brings up ZEROMIB_FLEET_HOSTS hosts (default 8, profile
ZEROMIB_FLEET_PROFILE, default mixed) with tests/fleet/fleet.py and always tears them down.
Under pytest-xdist every worker that runs a fleet test brings up a fleet of its own
(`fleet_prefix`), and the fleet's tests are grouped by file (tests/rig_scope.py), so that the
files run on several workers at once instead of one after the other on one (~19 min of the
suite's ~19 when they were one group).
`clean_fleet` (function scope) is the same fleet, reset to idle GPUs after the test.

The fleet needs root, systemd-nspawn and network namespaces. Where they are missing the tests
are skipped, unless CI or ZEROMIB_FLEET_REQUIRED=1 is set: then they fail, so that a CI run that
silently skips the fleet cannot pass.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet as _rig  # noqa: E402

REPO = _rig.REPO
VENV_BIN = REPO / ".venv" / "bin"
CALLBACKS = Path(__file__).resolve().parent / "callback_plugins"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rig_scope import per_worker  # noqa: E402


def fleet_prefix(worker: str | None = os.environ.get("PYTEST_XDIST_WORKER")) -> str:
    """This process's fleet: the checkout's (or ZEROMIB_FLEET_NAME), and under pytest-xdist one per
    worker (gw3 -> ...3), so that the fleet's test files run on several workers at once, each on
    a fleet of its own (a boot is ~3 s and ~4 s of CPU; idle hosts cost nothing)."""
    base = os.environ.get("ZEROMIB_FLEET_NAME") or _rig.checkout_prefix("t")
    return base + worker[2:] if worker and worker.startswith("gw") and worker[2:].isdigit() else base


TEST_PREFIX = fleet_prefix()


@dataclasses.dataclass(frozen=True)
class FleetHost:
    name: str
    addr: str
    preset: str
    gpu_count: int
    idle_mib: int
    gpus: tuple  # ({index, minor, pci_bus_id, uuid, name}, ...)


@dataclasses.dataclass
class AnsibleResult:
    rc: int
    stdout: str
    stderr: str
    json: dict  # {"plays": [...], "tasks": [{play, task, action, host, status, result}], "stats": {...}}
    elapsed_s: float
    cmd: list

    def results(self, task: str | None = None, host: str | None = None) -> list[dict]:
        """Task records, filtered by task name and/or host."""
        return [t for t in self.json.get("tasks", [])
                if (task is None or t["task"] == task) and (host is None or t["host"] == host)]

    def result(self, task: str, host: str) -> dict:
        """The module return of TASK on HOST (the last one, if the task ran more than once)."""
        found = self.results(task, host)
        if not found:
            raise KeyError(f"no result for task {task!r} on {host!r}; tasks: "
                           f"{sorted({t['task'] for t in self.json.get('tasks', [])})}")
        return found[-1]["result"]

    @property
    def stats(self) -> dict:
        return self.json.get("stats", {})

    def __str__(self) -> str:
        return f"rc={self.rc} in {self.elapsed_s} s\n{self.stdout}\n{self.stderr}"


class FleetHandle:
    """What tests get: hosts, SSH, Ansible runs against the fleet's inventory, workloads."""

    def __init__(self, rig: _rig.Fleet):
        self.rig = rig
        self.inventory: Path = rig.inventory
        self.ansible_cfg: Path = rig.ansible_cfg
        self.hosts = [FleetHost(h["name"], h["addr"], h["preset"], h.get("gpu_count", 0),
                                h.get("idle_mib", 0), tuple(h.get("gpus", []))) for h in rig.hosts]
        self.names = [h.name for h in self.hosts]
        self.timings = dict(rig.state.get("timings", {}))

    def host(self, name: str) -> FleetHost:
        return next(h for h in self.hosts if name in (h.name, h.addr))

    # -- SSH
    def ssh(self, host: str, cmd: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.rig.ssh(host, cmd, check=check, timeout=timeout)

    def ssh_all(self, cmd: str, hosts: list[str] | None = None, check: bool = False) -> dict:
        hosts = hosts or self.names
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(hosts)) as ex:
            return dict(zip(hosts, ex.map(lambda h: self.ssh(h, cmd, check=check), hosts)))

    def gpu_memory(self, host: str) -> dict[int, int]:
        """{index: MiB used} as the host's nvidia-smi reports it."""
        r = self.ssh(host, "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits", check=True)
        return {int(i): int(m) for i, m in (ln.split(",") for ln in r.stdout.splitlines() if ln.strip())}

    # -- workloads and host life cycle
    def workload(self, host: str, name: str, gpus: str | None = None, mib: int | None = None) -> dict:
        """Starts a workload from fleet.WORKLOADS (vllm, sglang, persistenced, train, ignore-term, orphan,
        vllm-v1, stubborn-unit, at-job, cron-job, slurm-job, hub-kernel)."""
        return self.rig.workload(host, name, gpus=gpus, mib=mib)

    def reboot(self, host: str, timeout: float = 120) -> str:
        """`systemctl reboot` inside HOST; returns the system state once it is back."""
        state, failed = self.rig.reboot(host, timeout=timeout)
        assert state in ("running", "degraded"), f"{host} after reboot: {state} {failed}"
        return state

    # Stops every workload; then waits for the sim to read idle memory (it keeps a dead
    # context's memory for release_delay_s after the first nvidia-smi call that sees it dead).
    RESET = ("rm -f /run/nvidia-sim/faults.json /var/lib/zeromib-gpu/released.json; "
             "if ! fuser -s /dev/nvidia* && [ -z \"$(ls -A /run/nvidia-sim/contexts 2>/dev/null)\" ] "
             "&& ! systemctl -q is-active vllm sglang nvidia-persistenced vllm-v1 stubborn "
             "&& ! systemctl -q is-enabled sglang 2>/dev/null; then exit 0; fi; "
             # stubborn.service ignores SIGTERM with a 90 s stop timeout: killed, not waited for
             "systemctl stop --no-block stubborn.service; systemctl kill --signal=SIGKILL stubborn.service 2>/dev/null; "
             "systemctl disable --now vllm.service sglang.service nvidia-persistenced.service vllm-v1.service stubborn.service "
             ">/dev/null 2>&1; systemctl reset-failed; fuser -s -k -KILL /dev/nvidia* ; "
             "rm -f /run/nvidia-sim/ready/*; for i in $(seq 100); do "
             "if ! fuser -s /dev/nvidia* && ! nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits "
             "| awk '$1 > {idle} {{bad=1}} END {{exit !bad}}'; then exit 0; fi; sleep 0.05; done; "
             "echo still held or dirty: >&2; fuser -v /dev/nvidia* >&2; nvidia-smi >&2; exit 1")

    def reset(self, hosts: list[str] | None = None) -> None:
        """Stops every workload on HOSTS (default all) and waits until their GPUs read idle."""
        hosts = hosts or self.names
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(hosts)) as ex:
            res = dict(zip(hosts, ex.map(
                lambda h: self.ssh(h, self.RESET.format(idle=self.host(h).idle_mib)), hosts)))
        bad = {h: r.stderr for h, r in res.items() if r.returncode != 0}
        assert not bad, f"reset failed: {bad}"

    # -- network faults
    @contextlib.contextmanager
    def unreachable(self, host: str):
        """HOST's link is down inside the block (SSH to it fails at once, as to a dead node);
        it is up again, and sshd answers, when the block ends, whatever happened inside."""
        self.rig.set_link(host, up=False)
        try:
            yield host
        finally:
            self.rig.set_link(host, up=True)

    # -- inventory variables (files next to the fleet's inventory; Ansible reads them on every run)
    def write_group_vars(self, group: str, variables: dict) -> Path:
        """Writes group_vars/GROUP.yml next to the inventory (JSON is YAML); returns its path."""
        d = self.inventory.parent / "group_vars"
        d.mkdir(exist_ok=True)
        path = d / f"{group}.yml"
        path.write_text(json.dumps(variables, indent=1) + "\n")
        return path

    def remove_group_vars(self, group: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.inventory.parent / "group_vars" / f"{group}.yml").unlink()

    # -- simulator faults (tests/sim/README.md: hang, latency_s, gpu_lost, leak, ...)
    FAULTS = "/run/nvidia-sim/faults.json"

    def set_fault(self, host: str, faults: dict | None = None, **kw: Any) -> dict:
        """Merges faults into HOST's /run/nvidia-sim/faults.json; returns the new set."""
        cur = self.ssh(host, f"cat {self.FAULTS} 2>/dev/null").stdout.strip()
        merged = {**(json.loads(cur) if cur else {}), **(faults or {}), **kw}
        text = shlex.quote(json.dumps(merged))
        self.ssh(host, f"printf %s {text} > {self.FAULTS}.tmp && mv {self.FAULTS}.tmp {self.FAULTS}", check=True)
        return merged

    def clear_faults(self, host: str) -> None:
        self.ssh(host, f"rm -f {self.FAULTS}", check=True)

    # -- Ansible
    def _env(self, json_out: str) -> dict:
        env = _rig.ansible_env(self.ansible_cfg)
        env.update({
            "ANSIBLE_CALLBACK_PLUGINS": str(CALLBACKS),
            "ANSIBLE_CALLBACKS_ENABLED": "fleet_json,shared_payloads",
            "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1",
            # One AnsiballZ cache for the session's runs (callback_plugins/shared_payloads.py).
            "ZEROMIB_SHARED_ANSIBALLZ": str(REPO / ".build" / "ansiballz-cache"),
            # The fleet's inventory is inventory.ini (and host lists): the other inventory
            # plugins' documentation, parsed at each start, cost ~60 ms of CPU a run.
            "ANSIBLE_INVENTORY_ENABLED": "ini,host_list",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "ZEROMIB_FLEET_JSON_OUT": json_out,
        })
        return env

    def _run(self, argv: list[str], extra_vars: dict | None, check: bool, diff: bool,
             timeout: float, cwd: Path | str | None, env: dict | None = None) -> AnsibleResult:
        with tempfile.TemporaryDirectory(prefix="fleet-ansible-") as tmp:
            out = os.path.join(tmp, "result.json")
            if extra_vars:
                ev = os.path.join(tmp, "extra_vars.json")
                Path(ev).write_text(json.dumps(extra_vars))
                argv += ["-e", f"@{ev}"]
            if check:
                argv.append("--check")
            if diff:
                argv.append("--diff")
            t0 = time.monotonic()
            r = subprocess.run(argv, cwd=cwd or REPO, env={**self._env(out), **(env or {})},
                               stdin=subprocess.DEVNULL, check=False,
                               capture_output=True, text=True, timeout=timeout)
            elapsed = round(time.monotonic() - t0, 2)
            data = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
        return AnsibleResult(r.returncode, r.stdout, r.stderr, data, elapsed, argv)

    def ansible_playbook(self, playbook: str | Path | list | dict, limit: str | list | None = None,
                         extra_vars: dict | None = None, check: bool = False, diff: bool = False,
                         args: list[str] | None = None, timeout: float = 600,
                         cwd: Path | str | None = None, bin_dir: Path | None = None,
                         env: dict | None = None) -> AnsibleResult:
        """Runs ansible-playbook against the fleet. PLAYBOOK is a path (relative to the repo),
        a collection playbook (zeromib.gpu.free_gpus), or plays as Python data. BIN_DIR: the
        ansible-playbook of another venv (the ansible-core matrix); ENV: added variables."""
        with tempfile.NamedTemporaryFile("w", suffix=".yml", prefix="fleet-play-", delete=False) as f:
            inline = f.name
        try:
            if isinstance(playbook, (list, dict)):
                Path(inline).write_text(json.dumps(playbook if isinstance(playbook, list) else [playbook]))
                playbook = inline
            argv = [str((bin_dir or VENV_BIN) / "ansible-playbook"), "-i", str(self.inventory), str(playbook)]
            if limit:
                argv += ["--limit", ",".join(limit) if isinstance(limit, list) else limit]
            argv += list(args or [])
            return self._run(argv, extra_vars, check, diff, timeout, cwd, env)
        finally:
            os.unlink(inline)

    def ansible(self, pattern: str, module: str, module_args: str | dict = "", check: bool = False,
                diff: bool = False, extra_vars: dict | None = None, timeout: float = 300) -> AnsibleResult:
        """An ad-hoc `ansible PATTERN -m MODULE -a ARGS` against the fleet."""
        if isinstance(module_args, dict):
            module_args = json.dumps(module_args)
        argv = [str(VENV_BIN / "ansible"), "-i", str(self.inventory), pattern, "-m", module]
        if module_args:
            argv += ["-a", module_args]
        return self._run(argv, extra_vars, check, diff, timeout, None)


def _prerequisites_missing() -> str | None:
    if not sys.platform.startswith("linux"):
        return "fleet tests need Linux"
    if os.geteuid() != 0:
        return "fleet tests need root (network namespaces, cgroups, systemd-nspawn)"
    if not (shutil.which("systemd-nspawn") and shutil.which("mmdebstrap")):
        subprocess.run([str(REPO / "tests" / "tools" / "apt-deps.sh")], check=False)
        if not (shutil.which("systemd-nspawn") and shutil.which("mmdebstrap")):
            return "systemd-nspawn/mmdebstrap missing (tests/tools/apt-deps.sh could not install them)"
    if subprocess.run(["unshare", "--net", "true"], capture_output=True, check=False).returncode != 0:
        return "cannot create network namespaces here"
    if not any(Path(p).exists() for p in ("/sys/fs/cgroup/unified/cgroup.procs", "/sys/fs/cgroup/cgroup.controllers")):
        return "no cgroup2 hierarchy"
    return None


def _must_run() -> bool:
    return os.environ.get("ZEROMIB_FLEET_REQUIRED") == "1" or bool(os.environ.get("CI"))


def pytest_configure(config):
    config.addinivalue_line("markers", "fleet: needs the nspawn fleet (root, systemd-nspawn)")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.fleet)


@pytest.fixture(scope="session")
@per_worker
def fleet():
    why = _prerequisites_missing()
    if why:
        if _must_run():
            pytest.fail(f"fleet required (CI / ZEROMIB_FLEET_REQUIRED=1) but: {why}")
        pytest.skip(why)
    n = int(os.environ.get("ZEROMIB_FLEET_HOSTS", "8"))
    profile = os.environ.get("ZEROMIB_FLEET_PROFILE", "mixed")
    rig = _rig.Fleet(TEST_PREFIX)

    def _down(*_a):
        try:
            rig.down()
        except Exception as e:  # report, but never hide the test's own failure
            print(f"fleet teardown: {e}", file=sys.stderr)

    atexit.register(_down)
    prev = None
    if threading_main():
        prev = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        rig.up(n, profile)
        yield FleetHandle(rig)
    finally:
        _down()
        atexit.unregister(_down)
        if prev is not None:
            signal.signal(signal.SIGTERM, prev)


@pytest.fixture(scope="module")
def suite_fleet():
    """`suite_fleet(suite)`: a one-host fleet (8x H200) booted from another Debian release's base
    (fleet.SUITES: "trixie" is Debian 13, Slurm 24.11), brought up the first time a test of the
    module asks for it (the base is built then, once, and cached), reset to idle GPUs by the
    caller, torn down at the module's end, on failure too. The session fleet stays bookworm's."""
    why = _prerequisites_missing()
    if why:
        if _must_run():
            pytest.fail(f"fleet required (CI / ZEROMIB_FLEET_REQUIRED=1) but: {why}")
        pytest.skip(why)
    up: dict[str, _rig.Fleet] = {}

    def get(suite: str) -> FleetHandle:
        if suite not in up:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "")
            rig = _rig.Fleet(_rig.checkout_prefix("d" if suite == "trixie" else "s")
                             + (worker[2:] if worker.startswith("gw") and worker[2:].isdigit() else ""))
            up[suite] = rig
            rig.up(1, "h200", suite=suite)
        return FleetHandle(up[suite])

    try:
        yield get
    finally:
        for rig in up.values():
            try:
                rig.down()
            except Exception as e:  # report, but never hide the test's own failure
                print(f"fleet teardown ({rig.prefix}): {e}", file=sys.stderr)


@pytest.fixture(scope="module")
def device_bpf_fleet():
    """`device_bpf_fleet(suite)`: a one-host fleet (8x H200) of that Debian release whose systemd
    manages device access (fleet.py up --device-bpf: DevicePolicy= enforced with BPF device
    programs, as on a real node), brought up the first time a test of the module asks for it
    and kept for the module's other tests; torn down at the module's end, on failure too."""
    why = _prerequisites_missing()
    if why:
        if _must_run():
            pytest.fail(f"fleet required (CI / ZEROMIB_FLEET_REQUIRED=1) but: {why}")
        pytest.skip(why)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    suffix = worker[2:] if worker.startswith("gw") and worker[2:].isdigit() else ""
    up: dict[str, _rig.Fleet] = {}

    def down(rig: _rig.Fleet) -> None:
        try:
            rig.down()
        except Exception as e:  # report, but never hide the test's own failure
            print(f"fleet teardown ({rig.prefix}): {e}", file=sys.stderr)

    def get(suite: str = _rig.SUITE) -> FleetHandle:
        if suite not in up:
            rig = _rig.Fleet(_rig.checkout_prefix("b" if suite == _rig.SUITE else "c") + suffix)
            up[suite] = rig
            rig.up(1, "h200", suite=suite, device_bpf=True)
        return FleetHandle(up[suite])

    try:
        yield get
    finally:
        for rig in up.values():
            down(rig)


@pytest.fixture
def clean_fleet(fleet):
    """The session fleet; every host is reset to idle GPUs after the test."""
    yield fleet
    fleet.reset()


@pytest.fixture(scope="session")
@per_worker
def fleet_baselines(fleet):
    """Inventory group_vars for hosts whose GPUs idle above 0 MiB (the MIG host: 55 MiB):
    `free_gpus_max_used_mib` and `gpu_audit_max_used_mib` of 64 for that group only, as an
    operator would set them. Written next to the fleet's inventory; removed at the end."""
    groups = fleet.rig.write_baselines()  # what `fleet.py up` writes
    yield fleet
    for group in groups:
        fleet.remove_group_vars(group)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def threading_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


@pytest.fixture
def molecule(molecule_scenario, fleet, tmp_path, monkeypatch):
    """A Molecule scenario of this repository, ready to run against two H200 hosts of the fleet:
    `molecule.test()` runs `molecule test -s NAME` in the scenario's role and returns the
    CompletedProcess (its output goes to pytest's capture).

    The only place that touches pytest-ansible's Molecule support (`molecule_scenario`: it finds
    every scenario git tracks and parametrizes over them). pytest-ansible announces its end of
    life for December 2026: then `subprocess.run([sys.executable, "-m", "molecule", "test", "-s",
    name], cwd=role_dir)` over `git ls-files '**/molecule/*/molecule.yml'` replaces it here."""
    hosts = [h for h in fleet.hosts if h.preset == "h200x8"][:2]
    assert len(hosts) == 2, "the Molecule scenario needs two H200 hosts in the fleet"
    key = fleet.inventory.parent / "id_ed25519"
    lines = ["all:", "  hosts:"]
    for i, h in enumerate(hosts, 1):
        lines.append(f"    gpu-node-{i}: {{ansible_host: {h.addr}, fleet_gpu_count: {h.gpu_count}}}")
    lines += ["  vars:", "    ansible_user: root", f"    ansible_ssh_private_key_file: {key}",
              "    ansible_python_interpreter: /usr/bin/python3",
              "    ansible_ssh_common_args: '-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'"]
    inventory = tmp_path / "molecule-inventory.yml"
    inventory.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("ZEROMIB_MOLECULE_INVENTORY", str(inventory))
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", str(REPO / ".build" / "collections"))
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")  # molecule runs ansible-*
    monkeypatch.setenv("ANSIBLE_NOCOLOR", "1")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("ANSIBLE_CONFIG", raising=False)
    yield molecule_scenario
    fleet.reset([h.name for h in hosts])
