"""A tenant never chooses which host unit root stops (issue 65, item 1), through the real modules on
real systemd (Debian 12's systemd 252 in a fleet host).

The attacker is a real unprivileged user, uid 4242, whose unit has `Delegate=yes` and `User=4242`
(tests/tenants/delegated_user.py): below her unit's cgroup she names sub-cgroups `networking.service`
and `openibd.service` and moves her two GPU holders there. The host has units of those names
(harmless stand-ins: oneshot, RemainAfterExit=yes, an ExecStop= that leaves a mark). A plain
`gpu_release gpus: [0, 1]` must leave them running, their ExecStop= never run, and free her GPUs
through her own unit, the unit systemd says her processes run in. The same for a container's root
below a unit of its own (`systemd-nspawn --keep-unit`: `payload/system.slice/networking.service`,
root-owned). A unit without a main process is stopped for its holders only when named; an owned
essential unit is refused as a named one is; a user's job in her delegated unit is still freed.

Runs on any fleet: `ZEROMIB_FLEET_HOSTS=1 pytest tests/fleet/test_delegated_units_fleet.py`."""
from __future__ import annotations

import contextlib
import json

import pytest

from scenarios import alive, baseline, main_pid, unit_states, wait_for
from tenants.delegated_user import delegated_unit, keep_unit_container

pytestmark = pytest.mark.usefixtures("fleet_baselines")

KILL_TIMEOUT = 2
# What a stand-in's ExecStop= appends its name to: proof that systemd ran it (a stop job).
STOPPED = "/run/zeromib-standin-stopped"
HOLDER = "/usr/local/bin/gpu_holder"


def gpu_host(fleet) -> str:
    """A host with two or more GPUs that idle at 0 MiB."""
    return next(h.name for h in fleet.hosts if h.gpu_count >= 2 and h.idle_mib == 0)


def oneshot(name: str, start: str = "/bin/true") -> str:
    return (f"[Unit]\nDescription=zeromib test stand-in for {name}\n[Service]\nType=oneshot\nRemainAfterExit=yes\n"
            f"ExecStart={start}\nExecStop=/bin/sh -c 'echo {name} >> {STOPPED}'\n")


@contextlib.contextmanager
def host_units(fleet, host: str, units: dict[str, str]):
    """Units of the host ({name: unit file}) in /run/systemd/system, started; stopped and removed
    after, also on failure."""
    try:
        for name, text in units.items():
            fleet.ssh(host, f"cat > /run/systemd/system/{name} <<'EOF'\n{text}EOF", check=True)
        fleet.ssh(host, f"rm -f {STOPPED}; mkdir -p /run/nvidia-sim/ready; systemctl daemon-reload && systemctl start {' '.join(units)}",
                  check=True)
        yield
    finally:
        names = " ".join(units)
        fleet.ssh(host, f"systemctl stop {names}; systemctl reset-failed {names}; "
                        f"rm -f {' '.join('/run/systemd/system/' + n for n in units)} {STOPPED}; systemctl daemon-reload; true")
        fleet.reset([host])


def stop_marks(fleet, host: str) -> list[str]:
    return fleet.ssh(host, f"cat {STOPPED} 2>/dev/null; true").stdout.split()


def entered(fleet, host: str, *units: str) -> dict[str, str]:
    """{unit: ActiveEnterTimestampMonotonic}: changes when a unit is stopped and started again."""
    out = fleet.ssh(host, "for u in {}; do echo $u $(systemctl show -p ActiveEnterTimestampMonotonic --value $u); done".format(
        " ".join(units)), check=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def module(fleet, host: str, name: str, args: dict | None = None) -> dict:
    run = fleet.ansible(host, f"zeromib.gpu.{name}", args or "")
    [task] = [t for t in run.json["tasks"] if t["host"] == host]
    return task["result"]


def release(fleet, host: str, **args) -> dict:
    return module(fleet, host, "gpu_release", dict({"kill_timeout": KILL_TIMEOUT}, **args))


def facts_units(fleet, host: str) -> dict[int, str | None]:
    """{pid: unit} of gpu_facts' holders."""
    holders = module(fleet, host, "gpu_facts")["ansible_facts"]["gpu"]["holders"]
    return {h["pid"]: h.get("unit") for h in holders}


def ready_pid(fleet, host: str, path: str) -> int:
    def written() -> str:
        return fleet.ssh(host, f"cat {path} 2>/dev/null").stdout.strip()

    found = wait_for(written, timeout=30)
    assert found, f"{host}: {path} never written"
    return int(json.loads(found)["pid"])


# --------------------------------------------------------------------------- the attacker


def test_her_sub_cgroups_named_like_host_units_stop_neither_and_her_gpus_are_freed(clean_fleet):
    fleet = clean_fleet
    host = gpu_host(fleet)
    with host_units(fleet, host, {"networking.service": oneshot("networking.service"), "openibd.service": oneshot("openibd.service")}):
        before = entered(fleet, host, "networking.service", "openibd.service")
        jobs = {"networking.service": "--gpus 0 --mib 1000", "openibd.service": "--gpus 1 --mib 1000"}
        with delegated_unit(fleet, host, jobs) as alice:
            assert alice.cgroups["networking.service"] == "/system.slice/lab-alice.service/networking.service"
            # What gpu_facts reports, and what the reset advice would name: systemd's unit of her processes.
            units = facts_units(fleet, host)
            assert {units.get(pid) for pid in alice.pids.values()} == {"lab-alice.service"}, units
            result = release(fleet, host, gpus=[0, 1])
            assert result.get("released") is True, result.get("msg")
            assert not {"networking.service", "openibd.service"} & set(result["stopped_units"]), result["stopped_units"]
            assert not any(alive(fleet, host, alice.pids.values()).values())
            assert {g: m for g, m in fleet.gpu_memory(host).items() if g in (0, 1)} == {0: 0, 1: 0}
        assert stop_marks(fleet, host) == [], "systemd ran a host unit's ExecStop="
        assert {u: s[0] for u, s in unit_states(fleet, host, "networking.service", "openibd.service").items()} == {
            "networking.service": "active", "openibd.service": "active"}
        assert entered(fleet, host, "networking.service", "openibd.service") == before


def test_a_containers_root_below_a_unit_of_its_own_names_payload_system_slice_networking_in_vain(clean_fleet):
    """systemd-nspawn --keep-unit: the container's systemd (root, no user namespace) makes
    `payload/system.slice/networking.service` below the unit nspawn runs in; root owns every
    directory, and the name is still the container's."""
    fleet = clean_fleet
    host = gpu_host(fleet)
    with host_units(fleet, host, {"networking.service": oneshot("networking.service")}):
        with keep_unit_container(fleet, host, {"payload/system.slice/networking.service": "--gpus 0 --mib 1000"}) as box:
            owner = fleet.ssh(host, f"stat -c %u /sys/fs/cgroup{box.cgroups['payload/system.slice/networking.service']}", check=True)
            assert owner.stdout.strip() == "0"
            result = release(fleet, host, gpus=[0])
            assert result.get("released") is True, result.get("msg")
            assert "networking.service" not in result["stopped_units"], result["stopped_units"]
            assert not any(alive(fleet, host, box.pids.values()).values())
        assert stop_marks(fleet, host) == []
        assert unit_states(fleet, host, "networking.service")["networking.service"][0] == "active"


# --------------------------------------------------------------------------- units the run would stop


def test_a_oneshot_unit_that_remains_is_stopped_for_its_holder_only_when_named(clean_fleet):
    fleet = clean_fleet
    host = gpu_host(fleet)
    ready = "/run/nvidia-sim/ready/gpu-prep"
    # Its ExecStart= leaves a GPU holder behind in its cgroup and ends: active (exited), MainPID=0.
    start = f"/bin/sh -c 'rm -f {ready}; {HOLDER} --gpus 0 --mib 1000 --ready-file {ready} >/dev/null 2>&1 &'"
    with host_units(fleet, host, {"gpu-prep.service": oneshot("gpu-prep.service", start)}):
        holder = ready_pid(fleet, host, ready)
        assert main_pid(fleet, host, "gpu-prep.service") == 0
        result = release(fleet, host, gpus=[0])
        assert result.get("released") is True, result.get("msg")
        assert result["stopped_units"] == [] and stop_marks(fleet, host) == []
        assert unit_states(fleet, host, "gpu-prep.service")["gpu-prep.service"][0] == "active"
        assert not alive(fleet, host, [holder])[holder]
        [entry] = [e for e in result["launchers"] if e["unit"] == "gpu-prep.service"]
        assert entry["pids"] == [holder] and "no main process" in entry["reason"]
        # Named, it is stopped as asked (its ExecStop= runs).
        fleet.ssh(host, f"systemctl restart gpu-prep.service && rm -f {STOPPED}", check=True)
        holder = ready_pid(fleet, host, ready)
        named = release(fleet, host, gpus=[0], services=["gpu-prep.service"])
        assert named.get("released") is True, named.get("msg")
        assert named["stopped_units"] == ["gpu-prep.service"] and stop_marks(fleet, host) == ["gpu-prep.service"]
        assert not alive(fleet, host, [holder])[holder]


def test_an_owned_essential_unit_is_refused_and_only_its_gpu_holder_is_signalled(clean_fleet):
    """A unit matching the essential list (systemd-*) whose main process is no GPU holder and whose
    child is: never stopped, named or owned; the holder is signalled and the unit keeps running."""
    fleet = clean_fleet
    host = gpu_host(fleet)
    ready = "/run/nvidia-sim/ready/systemd-gpu-probe"
    unit = "systemd-gpu-probe.service"
    text = (f"[Service]\nExecStart=/bin/sh -c 'rm -f {ready}; {HOLDER} --gpus 0 --mib 1000 --ready-file {ready} >/dev/null 2>&1 & "
            "exec sleep infinity'\n")
    with host_units(fleet, host, {unit: text}):
        holder = ready_pid(fleet, host, ready)
        main = main_pid(fleet, host, unit)
        assert main and main != holder
        result = release(fleet, host, gpus=[0])
        assert result.get("released") is True, result.get("msg")
        assert unit not in result["stopped_units"]
        assert unit_states(fleet, host, unit)[unit][0] == "active" and main_pid(fleet, host, unit) == main
        assert not alive(fleet, host, [holder])[holder]
        [entry] = [e for e in result["launchers"] if e["unit"] == unit]
        assert entry["pids"] == [holder] and "essential" in entry["reason"]
        refused = fleet.ansible(host, "zeromib.gpu.gpu_release", {"gpus": [0], "services": [unit]})
        assert "refusing to stop systemd-gpu-probe.service" in refused.stdout + refused.stderr


# --------------------------------------------------------------------------- the legitimate case


def test_her_own_job_in_her_delegated_unit_is_still_freed_through_her_unit(clean_fleet):
    fleet = clean_fleet
    host = gpu_host(fleet)
    with delegated_unit(fleet, host, {"trainer": "--gpus 0 --mib 2000", "trainer/eval.service": "--gpus 1 --mib 1000"}) as alice:
        units = facts_units(fleet, host)
        assert {units.get(pid) for pid in alice.pids.values()} == {"lab-alice.service"}, units
        result = release(fleet, host, gpus=[0, 1])
        assert result.get("released") is True, result.get("msg")
        assert result["stopped_units"] == ["lab-alice.service"], result["stopped_units"]
        assert not any(alive(fleet, host, alice.pids.values()).values())
        assert fleet.gpu_memory(host) == baseline(fleet, host)
        assert unit_states(fleet, host, "lab-alice.service")["lab-alice.service"][0] in ("inactive", "failed", "unknown")
