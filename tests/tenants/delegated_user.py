"""A user whose unit has `Delegate=yes` and `User=`: she names the cgroups below it.

systemd hands such a unit's cgroup directory to its user (`chown`), and she may create and name
cgroups below it at will: `.../lab-alice.service/networking.service` is a directory of hers, not a
unit of the host's. The same holds for a container's root below a unit with `Delegate=yes` and no
`User=` (what `systemd-nspawn --keep-unit` runs in): its systemd creates `payload/system.slice/
networking.service` there, a directory root owns and the container's root named.

On a fleet host (real systemd, tests/fleet):

    with delegated_unit(fleet, host, {"networking.service": "--gpus 0 --mib 1000"}) as alice:
        alice.pids      # {"networking.service": PID of the GPU holder she moved there}
        alice.unit      # "lab-alice.service", systemd's unit of every process in the subtree

`delegated_unit` makes a real unprivileged user (uid 4242, `alice`, unless she exists), starts
`systemd-run --unit lab-alice -p Delegate=yes -p User=4242 /bin/sh -c SCRIPT`, whose script runs
as her: it creates the sub-cgroups she names below her unit's own cgroup (read from
/proc/self/cgroup, as she would), starts one GPU holder (tests/sim's gpu_holder) for each, moves
it there (its own `echo $$ > cgroup.procs`, with her rights only) and waits for them. With
`user=None` the unit has no `User=` (a container's root under a unit of its own: the directories
are root's). Torn down on leaving, also on failure: the unit stopped (systemd ends every process of
its cgroup, sub-cgroups included), its failed state reset, her files and, when this kit made her,
the user removed. Everything happens inside the fleet host, never on this machine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import shlex
import time
import typing as t

UID = 4242
NAME = "alice"
UNIT = "lab-alice"
HOLDER = "/usr/local/bin/gpu_holder"
# Ready files of her holders: a directory of hers (she writes them as uid 4242).
READY_ROOT = "/run/zeromib-tenants"


@dataclasses.dataclass
class DelegatedUnit:
    """What `delegated_unit` made: the unit (systemd's name), its main process, the holders by the
    sub-cgroup each sits in, and the cgroup of each as /proc/PID/cgroup shows it."""

    host: str
    unit: str
    uid: int | None
    main_pid: int
    pids: dict[str, int]
    cgroups: dict[str, str]


def _ssh(fleet: t.Any, host: str, cmd: str, check: bool = True, timeout: float = 60) -> t.Any:
    done = fleet.ssh(host, cmd, check=False, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{host}: {cmd!r} failed (rc {done.returncode}): {done.stdout}{done.stderr}")
    return done


def script(jobs: t.Mapping[str, str], ready: str) -> str:
    """The shell script her unit's main process runs: for each sub-cgroup (a path below her unit's
    cgroup, `networking.service` or `payload/system.slice/networking.service`) make it, start a
    holder with the given gpu_holder arguments that moves itself there first, then wait for them
    all. Only what its user may do: her own directories, her own processes."""
    lines = ["set -e", "cg=/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)"]
    for number, (sub, args) in enumerate(jobs.items()):
        target = shlex.quote(sub)
        lines += [
            f'mkdir -p "$cg"/{target}',
            # The child moves itself, then becomes the holder: its PID is the holder's.
            f'sh -c \'echo $$ > "$1/cgroup.procs" && shift && exec "$@"\' mover "$cg"/{target} '
            f"{HOLDER} {args} --ready-file {ready}/{number:d} &",
        ]
    lines.append("wait")
    return "\n".join(lines)


def _ready_pids(fleet: t.Any, host: str, ready: str, count: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        done = _ssh(fleet, host, f"for i in $(seq 0 {count - 1}); do cat {ready}/$i 2>/dev/null || echo; echo; done", check=False)
        found = [json.loads(line) for line in done.stdout.splitlines() if line.strip().startswith("{")]
        if len(found) == count:
            return [int(entry["pid"]) for entry in found]
        if time.monotonic() > deadline:
            raise AssertionError(f"{host}: her holders did not get ready in {timeout:.0f} s: {done.stdout}{done.stderr}")
        time.sleep(0.1)


def _cgroup_of(fleet: t.Any, host: str, pid: int) -> str:
    return _ssh(fleet, host, f"sed -n 's/^0:://p' /proc/{pid:d}/cgroup").stdout.strip()


@contextlib.contextmanager
def delegated_unit(fleet: t.Any, host: str, jobs: t.Mapping[str, str], unit: str = UNIT, uid: int | None = UID, name: str = NAME,
                   timeout: float = 30) -> t.Iterator[DelegatedUnit]:
    """A unit with Delegate=yes (and User=uid, unless uid is None) on HOST whose main process puts
    one GPU holder in each sub-cgroup of `jobs` ({sub-cgroup: gpu_holder arguments}); yields a
    DelegatedUnit once every holder is ready and sits where its job said. Torn down on leaving."""
    made_user = False
    ready = f"{READY_ROOT}/{unit}"
    try:
        if uid is not None:
            exists = _ssh(fleet, host, f"getent passwd {uid:d}", check=False).returncode == 0
            if not exists:
                _ssh(fleet, host, f"useradd -u {uid:d} -M -d /nonexistent -s /usr/sbin/nologin {shlex.quote(name)}")
                made_user = True
        owner = f"-o {uid:d}" if uid is not None else ""
        # The simulator's context registry is open to every user, as the real driver serves every user's contexts.
        _ssh(fleet, host, f"mkdir -p /run/nvidia-sim/contexts && chmod 1777 /run/nvidia-sim/contexts; rm -rf {ready} {ready}.sh; "
                          f"install -d -m 755 {READY_ROOT}; install -d -m 700 {owner} {ready}")
        # The script goes in a file: systemd expands `$NAME` in a command line it is given (before 254, also systemd-run's).
        _ssh(fleet, host, f"cat > {ready}.sh <<'EOF'\n{script(jobs, ready)}\nEOF")
        user = ["-p", f"User={uid:d}"] if uid is not None else []
        argv = ["systemd-run", "--quiet", "--unit", unit, "-p", "Delegate=yes"] + user + ["/bin/sh", f"{ready}.sh"]
        _ssh(fleet, host, " ".join(shlex.quote(a) for a in argv))
        pids = _ready_pids(fleet, host, ready, len(jobs), timeout)
        by_sub = dict(zip(jobs, pids))
        main = int(_ssh(fleet, host, f"systemctl show -p MainPID --value {unit}.service").stdout.strip() or 0)
        cgroups = {sub: _cgroup_of(fleet, host, pid) for sub, pid in by_sub.items()}
        for sub, path in cgroups.items():
            assert path.endswith("/" + sub), f"her holder in {sub} sits in {path}"
        yield DelegatedUnit(host, f"{unit}.service", uid, main, by_sub, cgroups)
    finally:
        _ssh(fleet, host, f"systemctl stop {unit}.service; systemctl reset-failed {unit}.service; rm -rf {ready} {ready}.sh; true", check=False)
        if made_user:
            _ssh(fleet, host, f"userdel {shlex.quote(name)} || true", check=False)


@contextlib.contextmanager
def keep_unit_container(fleet: t.Any, host: str, jobs: t.Mapping[str, str], unit: str = "lab-box", timeout: float = 30
                        ) -> t.Iterator[DelegatedUnit]:
    """What `systemd-run --unit lab-box -p Delegate=yes systemd-nspawn --keep-unit ...` leaves on the
    host: a unit of the host with Delegate=yes and no User=, below which the container's root (its
    own systemd, root without a user namespace) names the cgroups, root-owned: `payload/system.slice/
    networking.service`. Stands in for nspawn (not installed in the fleet's hosts): the same unit and
    the same directories, made by the unit's own process as the container's systemd makes them.
    `jobs` keys are relative to the unit's cgroup, as in delegated_unit."""
    with delegated_unit(fleet, host, jobs, unit=unit, uid=None, timeout=timeout) as box:
        yield box
