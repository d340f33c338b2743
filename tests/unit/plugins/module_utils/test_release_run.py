# -*- coding: utf-8 -*-
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Release.run end to end against a fake node: a /proc tree in a temporary directory that
changes as signals arrive and units stop, an nvidia-smi that reads its memory from that tree,
systemctl that records what it is asked, and a clock that only moves when Release sleeps.
Nothing is killed and no time is waited for real."""

from __future__ import annotations

import os
import re
import signal

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils import _containers
from ansible_collections.zeromib.gpu.plugins.module_utils import _nvidia_smi as smi
from ansible_collections.zeromib.gpu.plugins.module_utils import _release as release
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

SESSION_SCOPE = "0::/user.slice/user-0.slice/session-7.scope\n"
SSH_SERVICE = "0::/system.slice/ssh.service\n"
# Measured on an H200: memory.used drops ~20-130 ms after the holder exits, and the
# compute-apps list empties first.
RELEASE_DELAY_S = 0.05
RESPAWN_S = 2.0


def uuid(index):
    return "GPU-%08x-818d-be7e-f16b-963690d7c5c5" % (0xAB0CF4F6 + index)


class Proc(object):
    def __init__(self, pid, mem, unit, on_term, on_kill, smi_pid, smi_name, spec):
        self.pid, self.mem, self.unit, self.on_term, self.on_kill = pid, mem, unit, on_term, on_kill
        self.smi_pid, self.smi_name, self.spec = smi_pid, smi_name, spec


class World(object):
    """The node: processes, units, GPU memory, time."""

    def __init__(self, root, gpus=2, session_cgroup=SESSION_SCOPE):
        self.root = root
        self.gpus = gpus
        self.t = 0.0
        self.procs = {}
        self.units = {}
        self.events = []
        self.freeing = []
        self.leaked = []
        self.systemctl_log = []
        self.signals = []
        self.next_start = 20000
        # Looked up now, not at import: a test runner may import this file in another process.
        self.mypid = os.getpid()
        fakeproc.write_process(root, 1, comm="systemd", ppid=0, argv=("/sbin/init",), cgroup="0::/init.scope\n", exe="/usr/lib/systemd/systemd")
        fakeproc.write_process(
            root, 4000, comm="sshd", argv=("sshd: /usr/sbin/sshd -D [listener] 0 of 10-100 startups",), cgroup=SSH_SERVICE, exe="/usr/sbin/sshd"
        )
        fakeproc.write_process(root, 4100, comm="sshd", ppid=4000, argv=("sshd: root@notty",), cgroup=session_cgroup, exe="/usr/sbin/sshd")
        fakeproc.write_process(root, self.mypid, comm="python3", ppid=4100, argv=("/usr/bin/python3", "AnsiballZ_gpu_release.py"), cgroup=session_cgroup)

    # --- processes

    def unit(self, name, active="active", sub="running", file_state="enabled", restart=False):
        self.units[name] = {
            "props": {"Id": name, "LoadState": "loaded", "ActiveState": active, "SubState": sub, "UnitFileState": file_state},
            "restart": restart,
            "pids": set(),
        }

    def spawn(
        self,
        pid,
        mem=None,
        unit=None,
        cgroup=None,
        comm="python3",
        argv=("python3", "serve.py"),
        on_term="exit",
        on_kill="exit",
        devices=None,
        exe="/usr/bin/python3.12",
        smi_pid=None,
        smi_name=None,
        visible=True,
    ):
        assert pid != self.mypid and pid not in self.procs
        mem = dict(mem or {})
        if cgroup is None:
            cgroup = "0::/system.slice/%s\n" % unit if unit else "0::/user.slice/user-1000.slice/session-3.scope\n"
        if devices is None:
            devices = ["/dev/nvidia%d" % i for i in sorted(mem)] + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
        spec = dict(comm=comm, argv=argv, cgroup=cgroup, fds=tuple(devices), exe=exe)
        self.next_start += 1
        fakeproc.write_process(self.root, pid, start_time=self.next_start, **spec)
        self.procs[pid] = Proc(pid, mem, unit, on_term, on_kill, smi_pid if smi_pid else pid, smi_name if smi_name else comm, spec)
        if not visible:
            self.procs[pid].smi_pid = None
        if unit:
            self.units[unit]["pids"].add(pid)
        return self.procs[pid]

    def exit(self, pid, by_stop=False):
        proc = self.procs.pop(pid)
        fakeproc.remove_process(self.root, pid)
        for index, mib in proc.mem.items():
            self.freeing.append((self.t + RELEASE_DELAY_S, index, mib))
        if proc.unit:
            unit = self.units[proc.unit]
            unit["pids"].discard(pid)
            if unit["restart"] and not by_stop:
                # Restart=always: systemd starts it again, with a new PID, in ~1-3 s.
                def respawn(proc=proc, unit=unit):
                    if unit["props"]["ActiveState"] == "active":
                        self.spawn(max(list(self.procs) + [proc.pid]) + 1, proc.mem, proc.unit, comm=proc.spec["comm"], argv=proc.spec["argv"])

                self.at(self.t + RESPAWN_S, respawn)

    def enter_d_state(self, pid):
        proc = self.procs[pid]
        with open(os.path.join(str(self.root), str(pid), "stat")) as handle:
            text = handle.read()
        right = text.rindex(")")
        with open(os.path.join(str(self.root), str(pid), "stat"), "w") as handle:
            handle.write(text[: right + 2] + "D" + text[right + 3 :])
        proc.on_kill = "ignore"

    def reuse_pid(self, pid):
        """The holder exits and an unrelated process gets its PID."""
        self.exit(pid)
        self.spawn(pid, comm="bash", argv=("-bash",), devices=[])

    # --- time

    def at(self, when, action):
        self.events.append((when, action))

    def advance(self, seconds):
        self.t += max(0.0, seconds)
        due = sorted([e for e in self.events if e[0] <= self.t + 1e-9], key=lambda e: e[0])
        self.events = [e for e in self.events if e[0] > self.t + 1e-9]
        for _when, action in due:
            action()

    # --- what nvidia-smi sees

    def memory_used(self, index):
        live = sum(p.mem.get(index, 0) for p in self.procs.values())
        freeing = sum(mib for until, i, mib in self.freeing if i == index and until > self.t)
        return live + freeing + sum(mib for i, _pid, _name, mib in self.leaked if i == index)

    def gpu_text(self):
        return "".join(
            "%d, %s, NVIDIA H200, 00000000:%02X:00.0, 580.159.04, 143771, 616, %d, %d, 0, 37, 126.02, Enabled, Disabled\n"
            % (i, uuid(i), 0x18 + i, self.memory_used(i), 143771 - 616 - self.memory_used(i))
            for i in range(self.gpus)
        )

    def apps_text(self):
        rows = []
        for proc in self.procs.values():
            for index, mib in sorted(proc.mem.items()):
                if proc.smi_pid is not None:
                    rows.append("%d, %s, %d, %s" % (proc.smi_pid, proc.smi_name, mib, uuid(index)))
        rows += ["%d, %s, %d, %s" % (pid, name, mib, uuid(i)) for i, pid, name, mib in self.leaked]
        return "".join(row + "\n" for row in rows)


class FakeSmi(object):
    """query_all / query_gpus / run / app_args, answering from the World through the real parsers."""

    def __init__(self, world):
        self.world = world
        self.calls = 0

    def query_all(self, fields=smi.GPU_FIELDS, with_apps=True):
        return self.query_gpus(fields), (self.run(self.app_args()) and smi.parse_compute_apps(self.world.apps_text()) if with_apps else [])

    def query_gpus(self, fields=smi.GPU_FIELDS, gpus=None):
        assert fields == smi.GPU_FIELDS
        self.calls += 1
        return smi.parse_gpus(self.world.gpu_text())

    def run(self, args):
        assert args == self.app_args()
        self.calls += 1
        return self.world.apps_text() or "\n"

    @staticmethod
    def app_args():
        return smi.NvidiaSmi.app_args()


class FakeSystem(release.System):
    """systemctl, signals and the clock of the World; /proc reads go to the World's tree."""

    def __init__(self, world):
        # No Docker or Podman on this node unless a test gives it one.
        runtimes = getattr(world, "runtimes", None) or _containers.Runtimes(which=lambda name: None, sockets={})
        super(FakeSystem, self).__init__(systemctl_path="/usr/bin/systemctl", proc=str(world.root), runtimes=runtimes)
        self.world = world

    def systemctl(self, args):
        world = self.world
        world.systemctl_log.append(list(args))
        verb, names = args[0], [a for a in args[1:] if not a.startswith("-")]
        if verb == "list-units":
            return 0, "".join("%s loaded %s %s %s\n" % (n, u["props"]["ActiveState"], u["props"]["SubState"], n) for n, u in sorted(world.units.items())), ""
        if verb == "list-unit-files":
            return 0, "".join("%s %s enabled\n" % (n, u["props"]["UnitFileState"]) for n, u in sorted(world.units.items())), ""
        if verb == "show":
            blocks = []
            for name in names:
                props = (
                    world.units[name]["props"]
                    if name in world.units
                    else {"Id": name, "LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead", "UnitFileState": ""}
                )
                blocks.append("".join("%s=%s\n" % item for item in sorted(props.items())))
            return 0, "\n".join(blocks), ""
        for name in names:
            unit = world.units[name]
            if verb == "stop":
                unit["props"].update(ActiveState="inactive", SubState="dead")
                for pid in sorted(unit["pids"]):
                    world.exit(pid, by_stop=True)
            elif verb == "disable":
                unit["props"]["UnitFileState"] = "disabled"
            elif verb == "mask":
                unit["props"]["UnitFileState"] = "masked"
        return 0, "", ""

    def signal(self, pid, signum):
        world = self.world
        world.signals.append((round(world.t, 3), pid, signal.Signals(signum).name))
        proc = world.procs.get(pid)
        if proc is None:
            raise ProcessLookupError(pid)
        behaviour = proc.on_term if signum == signal.SIGTERM else proc.on_kill
        if behaviour == "exit":
            world.exit(pid)
        elif behaviour == "D":
            world.enter_d_state(pid)
        elif isinstance(behaviour, float):
            world.at(world.t + behaviour, lambda: world.exit(pid) if world.procs.get(pid) is proc else None)

    def now(self):
        return self.world.t

    def sleep(self, seconds):
        self.world.advance(seconds)


def params(**overrides):
    values = dict(
        gpus=None,
        services=[],
        service_state="stopped",
        stop_owning_units=True,
        kill=True,
        match=[],
        protect=[],
        kill_timeout=10.0,
        wait_timeout=60.0,
        poll_interval=0.1,
        max_used_mib=0,
        nvidia_smi=None,
        timeout=10.0,
    )
    values.update(overrides)
    values["_match_regexes"] = [re.compile(m) for m in values["match"]]
    return values


@pytest.fixture
def world(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    return World(root)


def run(world, check_mode=False, release_class=release.Release, **options):
    worker = release_class(FakeSmi(world), FakeSystem(world), params(**options), check_mode=check_mode, driver_root=str(world.root.parent / "no-driver"))
    return worker.run()


def fail(world, **options):
    with pytest.raises(release.ReleaseError) as info:
        run(world, **options)
    return info.value


def stops(world):
    return [args for args in world.systemctl_log if args[0] in ("stop", "disable", "mask")]


# ------------------------------------------------------------------ signals


def test_cooperative_holder_exits_on_sigterm(world):
    world.spawn(495, {0: 40960}, argv=("python3", "hold.py", "--gib", "40"))
    result = run(world)
    assert world.signals == [(0.0, 495, "SIGTERM")]
    assert result["killed"] == [
        {
            "pid": 495,
            "name": "python3",
            "cmdline": "python3 hold.py --gib 40",
            "unit": "session-3.scope",
            "container": None,
            "gpu_indexes": [0],
            "signal": "SIGTERM",
            "exited_after_s": 0.0,
        }
    ]
    assert (result["changed"], result["released"], result["stopped_units"]) == (True, True, [])
    assert [g["memory_used_mib"] for g in result["gpus_before"]] == [40960, 0]
    assert [g["memory_used_mib"] for g in result["gpus"]] == [0, 0]
    assert result["holders"] == [] and world.t < 1.0
    # nvidia-smi still read the memory for a moment after the exit: the verdict polled for it.
    assert result["timings"]["wait_s"] >= RELEASE_DELAY_S


def test_sigterm_ignoring_holder_gets_sigkill_after_kill_timeout(world):
    world.spawn(495, {0: 40960}, on_term="ignore")
    result = run(world, kill_timeout=10.0)
    assert [(pid, name) for _t, pid, name in world.signals] == [(495, "SIGTERM"), (495, "SIGKILL")]
    assert world.signals[1][0] == pytest.approx(10.0, abs=0.02)
    assert world.t >= 10.0
    assert result["killed"][0]["signal"] == "SIGKILL"
    assert result["killed"][0]["exited_after_s"] == pytest.approx(10.0, abs=0.02)
    assert result["released"] is True and result["unkillable"] == []


def test_slow_cooperative_holder_is_not_escalated(world):
    world.spawn(495, {0: 40960}, on_term=3.0)
    result = run(world, kill_timeout=10.0)
    assert [name for _t, _pid, name in world.signals] == ["SIGTERM"]
    assert result["killed"][0]["exited_after_s"] == pytest.approx(3.0, abs=0.02)


def test_pid_reused_between_scan_and_signal_is_not_signalled(world):
    world.spawn(495, {0: 40960})

    class ReusedAfterLook(release.Release):
        def look(self):
            snapshot = super(ReusedAfterLook, self).look()
            world.reuse_pid(495)
            return snapshot

    result = run(world, release_class=ReusedAfterLook)
    assert world.signals == []
    assert result["killed"] == []
    assert result["reused_pids"] == [{"pid": 495, "name": "python3", "reason": "PID reused by another process since the scan; not signalled"}]
    assert 495 in world.procs and result["released"] is True


def test_holder_gone_before_the_signal_is_not_reported_killed(world):
    world.spawn(495, {0: 40960})

    class ExitedAfterLook(release.Release):
        def look(self):
            snapshot = super(ExitedAfterLook, self).look()
            world.exit(495)
            return snapshot

    result = run(world, release_class=ExitedAfterLook)
    assert (world.signals, result["killed"], result["reused_pids"], result["released"]) == ([], [], [], True)


def test_orphaned_fork_child_keeps_memory_until_killed(world):
    # The parent was killed; its fork child (now under PID 1) keeps the context. nvidia-smi
    # shows the dead parent's PID as [Not Found] and never the child.
    world.spawn(496, {0: 6662}, argv=("python3", "worker.py"), smi_pid=495, smi_name="[Not Found]")
    result = run(world)
    assert [(pid, name) for _t, pid, name in world.signals] == [(496, "SIGTERM")]
    assert result["released"] is True and result["gpus"][0]["memory_used_mib"] == 0


def test_unkillable_holder_in_d_state_is_reported(world):
    world.spawn(495, {0: 40960}, on_term="ignore", on_kill="D")
    error = fail(world, kill_timeout=2.0, wait_timeout=5.0)
    assert [name for _t, _pid, name in world.signals] == ["SIGTERM", "SIGKILL"]
    assert error.result["unkillable"][0]["pid"] == 495 and error.result["unkillable"][0]["state"] == "D"
    assert "unkillable (outlived SIGKILL, likely D state in the driver): pid 495 python3 [python3 serve.py] (unit session-3.scope, state D)" in error.msg
    assert "GPU 0 (%s) reads 40960 MiB, held by pid 495 python3" % uuid(0) in error.msg


def test_holder_of_an_unselected_gpu_is_left_alone(world):
    world.spawn(495, {0: 1000})
    world.spawn(497, {1: 2000})
    result = run(world, gpus=["1"])
    assert [pid for _t, pid, _name in world.signals] == [497]
    assert result["selected_gpus"] == [1] and result["released"] is True and 495 in world.procs


def test_match_limits_who_is_signalled(world):
    world.spawn(495, {0: 1000}, argv=("python3", "-m", "vllm.entrypoints.openai.api_server"))
    world.spawn(496, {0: 2000}, argv=("python3", "train.py"))
    error = fail(world, match=["vllm"], wait_timeout=5.0)
    assert [pid for _t, pid, _name in world.signals] == [495]
    assert "GPU 0 (%s) reads 2000 MiB, held by pid 496 python3" % uuid(0) in error.msg


def test_kill_false_signals_nobody(world):
    world.spawn(495, {0: 1000})
    error = fail(world, kill=False, wait_timeout=1.0)
    assert world.signals == [] and error.result["killed"] == [] and error.result["changed"] is False


def test_holder_in_a_container_whose_runtime_cannot_be_asked_is_signalled_and_watched(world):
    container = "4f3c2b1a" * 8
    world.spawn(495, {0: 1000}, cgroup="0::/system.slice/docker-%s.scope\n" % container)
    result = run(world)
    assert [pid for _t, pid, _name in world.signals] == [495] and result["killed"][0]["container"] == container
    assert any("container 4f3c2b1a4f3c (docker) could not be stopped through its runtime" in warning for warning in result["warnings"])
    # Nothing came back within the settle window (see _settle): released, after watching for it.
    assert result["released"] is True and result["timings"]["settle_s"] == pytest.approx(3.0, abs=0.3)


# ------------------------------------------------------------------ units


def test_unit_owning_a_holder_is_stopped_and_the_holder_not_signalled(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 70000}, unit="vllm.service", argv=("python3", "-m", "vllm.entrypoints.openai.api_server"))
    result = run(world)
    assert ["stop", "--no-ask-password", "vllm.service"] in world.systemctl_log
    assert world.signals == [] and result["killed"] == []
    assert result["stopped_units"] == ["vllm.service"] and result["released"] is True and result["changed"] is True
    assert "disable" not in [args[0] for args in world.systemctl_log]


def test_restart_always_unit_is_stopped_not_fought(world):
    world.unit("vllm.service", restart=True)
    world.spawn(495, {0: 70000}, unit="vllm.service")
    result = run(world)
    world.advance(2 * RESPAWN_S)
    assert result["released"] is True and not world.procs


def test_service_state_disabled_disables_named_enabled_units_only(world):
    world.unit("vllm-a.service")  # active, enabled: stop + disable
    world.unit("vllm-b.service", active="inactive", sub="dead")  # enabled: disable
    world.unit("vllm-c.service", active="inactive", sub="dead", file_state="disabled")  # nothing to do
    world.unit("sglang.service")  # not named, owns a holder: stopped, never disabled
    world.spawn(495, {0: 1000}, unit="vllm-a.service")
    world.spawn(496, {1: 1000}, unit="sglang.service")
    result = run(world, services=["vllm*.service"], service_state="disabled")
    assert stops(world) == [
        ["stop", "--no-ask-password", "vllm-a.service", "sglang.service"],
        ["disable", "--no-ask-password", "vllm-a.service", "vllm-b.service"],
    ]
    assert result["stopped_units"] == ["vllm-a.service", "sglang.service"]
    assert result["disabled_units"] == ["vllm-a.service", "vllm-b.service"]
    assert world.signals == [] and result["released"] is True


def test_service_state_masked(world):
    world.unit("vllm.service")
    result = run(world, services=["vllm"], service_state="masked")
    assert stops(world) == [["stop", "--no-ask-password", "vllm.service"], ["mask", "--no-ask-password", "vllm.service"]]
    assert result["masked_units"] == ["vllm.service"] and "disabled_units" not in result


def test_second_run_with_disabled_services_changes_nothing(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 1000}, unit="vllm.service")
    first = run(world, services=["vllm.service"], service_state="disabled")
    world.systemctl_log[:] = []
    second = run(world, services=["vllm.service"], service_state="disabled")
    assert (first["changed"], second["changed"], second["released"]) == (True, False, True)
    assert stops(world) == [] and second["disabled_units"] == []


def test_named_service_that_does_not_exist_is_reported(world):
    result = run(world, services=["tgi.service"])
    assert result["services_not_found"] == ["tgi.service"] and stops(world) == [] and result["changed"] is False


def test_own_session_unit_is_never_stopped_even_when_a_holder_lives_in_it(tmp_path):
    # Without pam_systemd the Ansible session runs inside ssh.service, and so does anything
    # started from an interactive login: stopping the unit would cut the session.
    root = tmp_path / "proc"
    root.mkdir()
    world = World(root, session_cgroup=SSH_SERVICE)
    world.unit("ssh.service")
    world.spawn(600, {0: 5000}, cgroup=SSH_SERVICE, argv=("python3", "notebook.py"))
    result = run(world)
    assert stops(world) == [] and result["stopped_units"] == []
    assert [(pid, name) for _t, pid, name in world.signals] == [(600, "SIGTERM")]
    assert result["released"] is True and (root / "4000").is_dir() and (root / str(world.mypid)).is_dir()


def test_named_service_running_the_session_is_refused(tmp_path):
    root = tmp_path / "proc"
    root.mkdir()
    world = World(root, session_cgroup=SSH_SERVICE)
    world.unit("ssh.service")
    error = fail(world, services=["ssh"])
    assert "refusing to stop ssh.service" in error.msg and stops(world) == []


def test_unit_of_a_protected_process_is_never_stopped(world):
    world.unit("nvidia-persistenced.service")
    world.spawn(
        812,
        {},
        unit="nvidia-persistenced.service",
        comm="nvidia-persiste",
        exe="/usr/bin/nvidia-persistenced",
        argv=("/usr/bin/nvidia-persistenced", "--user", "nvidia-persistenced"),
        devices=["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"],
    )
    error = fail(world, services=["nvidia-persistenced"])
    assert "refusing to stop nvidia-persistenced.service" in error.msg and stops(world) == []


# ------------------------------------------------------------------ check mode and clean hosts


def test_check_mode_sends_nothing_and_reports_the_plan(world):
    world.unit("vllm.service")
    world.spawn(495, {0: 70000}, unit="vllm.service")
    world.spawn(497, {1: 1000}, argv=("python3", "train.py"))
    result = run(world, check_mode=True)
    assert world.signals == [] and stops(world) == []
    assert (result["changed"], result["released"], result["stopped_units"]) == (True, False, ["vllm.service"])
    assert [(k["pid"], k["signal"], k["exited_after_s"]) for k in result["killed"]] == [(497, None, None)]  # 495 ends with vllm.service
    assert [g["memory_used_mib"] for g in result["gpus"]] == [70000, 1000]
    assert set(world.procs) >= {495, 497}


def test_check_mode_on_a_clean_host_has_nothing_to_do(world):
    result = run(world, check_mode=True)
    assert (result["changed"], result["released"], result["killed"], result["stopped_units"]) == (False, True, [], [])


def test_clean_host_changes_nothing(world):
    smi_calls = []

    class Counting(release.Release):
        def run(self):
            try:
                return super(Counting, self).run()
            finally:
                smi_calls.append(self.smi.calls)

    result = run(world, release_class=Counting)
    assert (result["changed"], result["released"], result["killed"], result["stopped_units"]) == (False, True, [], [])
    assert world.systemctl_log == [] and world.signals == []
    assert [g["memory_used_mib"] for g in result["gpus"]] == [0, 0]


def test_protected_holder_on_a_clean_host_is_reported_not_touched(world):
    world.spawn(
        812,
        {},
        comm="nvidia-persiste",
        exe="/usr/bin/nvidia-persistenced",
        argv=("/usr/bin/nvidia-persistenced",),
        devices=["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl"],
    )
    result = run(world)
    assert result["protected"] == [{"pid": 812, "name": "nvidia-persiste", "unit": "session-3.scope", "gpu_indexes": [0, 1]}]
    assert (result["changed"], result["released"], world.signals) == (False, True, [])


# ------------------------------------------------------------------ failures


def test_protected_only_memory_fails_at_once_naming_the_protected_process(world):
    world.spawn(812, {0: 500}, comm="nvidia-persiste", exe="/usr/bin/nvidia-persistenced", argv=("/usr/bin/nvidia-persistenced",))
    error = fail(world, wait_timeout=60.0)
    assert world.t < 2.0, "waited %.1f s for a GPU that only a protected process holds" % world.t
    assert error.msg.startswith("GPUs are held only by protected processes")
    assert "pid 812 nvidia-persiste [/usr/bin/nvidia-persistenced] (unit session-3.scope, state S, protected)" in error.msg
    assert world.signals == [] and error.result["released"] is False


def test_user_protected_process_is_never_signalled(world):
    world.spawn(900, {0: 500}, comm="jupyter-lab", argv=("/opt/conda/bin/python3", "/opt/conda/bin/jupyter-lab"))
    error = fail(world, protect=["jupyter-lab"])
    assert world.signals == [] and "pid 900 jupyter-lab" in error.msg and world.t < 2.0


def test_leaked_memory_with_no_holder_fails_after_wait_timeout(world):
    world.leaked.append((0, 427, "[Not Found]", 3590))
    error = fail(world, wait_timeout=60.0)
    assert world.t >= 60.0 and world.signals == []
    assert error.msg.startswith("GPUs still in use after 60.0 s")
    assert "attributed to exited process(es) 427 [Not Found]" in error.msg
    assert "a GPU reset (nvidia-smi --gpu-reset -i 0) or a reboot is needed" in error.msg
    assert error.result["gpus"][0]["memory_used_mib"] == 3590 and error.result["released"] is False


def test_failure_result_carries_a_diff(world):
    world.leaked.append((1, 427, "[No data]", 12))
    error = fail(world, wait_timeout=1.0)
    assert "GPU 1 %s: 12 MiB" % uuid(1) in error.result["diff"]["after"]


def test_unknown_gpu_in_the_request_is_refused_before_anything_happens(world):
    world.spawn(495, {0: 1000})
    error = fail(world, gpus=["7"])
    assert "it has indexes 0, 1" in error.msg and world.signals == [] and world.systemctl_log == []


# ------------------------------------------------------------------ regressions of bugs found in review


def test_gpu_pod_under_containerd_service_never_stops_containerd(world):
    world.unit("containerd.service")
    pod = "0::/system.slice/containerd.service/kubepods-burstable-pod1b2c3d4e_5f60_7182_93a4_b5c6d7e8f901.slice:cri-containerd:%s\n" % ("4f3c2b1a" * 8)
    world.spawn(495, {0: 40960}, cgroup=pod)
    error = fail(world)
    assert ["stop", "--no-ask-password", "containerd.service"] not in world.systemctl_log
    # A pod is never signalled either (_containers): the run fails before acting, naming the pod.
    assert world.signals == [] and "pod UID 1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901" in error.msg and "drain" in error.msg


def test_check_mode_plan_matches_what_the_real_run_does(tmp_path):
    results = []
    for check_mode in (True, False):
        root = tmp_path / ("check" if check_mode else "real")
        root.mkdir()
        world = World(root)
        world.unit("vllm.service")
        world.spawn(495, {0: 70000}, unit="vllm.service")
        world.spawn(497, {1: 1000}, argv=("python3", "train.py"))
        results.append(run(world, check_mode=check_mode))
    planned, done = results
    assert planned["stopped_units"] == done["stopped_units"] == ["vllm.service"]
    assert [k["pid"] for k in planned["killed"]] == [k["pid"] for k in done["killed"]] == [497]


def test_desktop_gpu_held_by_the_compositor_is_not_blamed_on_the_driver(world):
    world.spawn(1500, {0: 300}, comm="Xorg", exe="/usr/lib/xorg/Xorg", argv=("/usr/lib/xorg/Xorg", "vt2"), visible=False)
    error = fail(world, wait_timeout=5.0)
    assert world.signals == []
    assert "pid 1500 Xorg" in error.msg and "set max_used_mib" in error.msg and "held only by protected" in error.msg
