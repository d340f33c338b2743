# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The fake node Release.run is tested against (test support, not collected by pytest): a /proc
tree in a temporary directory that changes as signals arrive and units stop, an nvidia-smi that
reads its memory from that tree, systemctl that records what it is asked, and a clock that only
moves when Release sleeps. Nothing is killed and no time is waited for real."""

from __future__ import annotations

import os
import re
import signal

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils import fakeproc

SESSION_SCOPE = "0::/user.slice/user-0.slice/session-7.scope\n"
SSH_SERVICE = "0::/system.slice/ssh.service\n"
# Measured on an H200: memory.used drops ~20-130 ms after the holder exits, and the
# compute-apps list empties first.
RELEASE_DELAY_S = 0.05
RESPAWN_S = 2.0
# Measured on the H200 pair: a GPU with no context of its own reads 4 MiB while a process that
# can see it (it maps the GPU's node small) has its context on another GPU.
FOOTPRINT_MIB = 4


def uuid(index):
    return "GPU-%08x-818d-be7e-f16b-963690d7c5c5" % (0xAB0CF4F6 + index)


# The gpu_release module's own PID in every fake node's /proc.
MY_PID = 4199


class Proc:
    def __init__(self, pid, mem, unit, on_term, on_kill, smi_pid, smi_name, spec):
        self.pid, self.mem, self.unit, self.on_term, self.on_kill = pid, mem, unit, on_term, on_kill
        self.smi_pid, self.smi_name, self.spec = smi_pid, smi_name, spec


class World:
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
        # {GPU: MiB} read with no process and no compute app: a MIG GPU's idle baseline.
        self.baseline = {}
        self.mig = False
        self.systemctl_log = []
        self.signals = []
        self.unreadable = set()
        self.next_start = 20000
        # The module's own process, as this /proc numbers it (its `self` link: holders.own_pid), a
        # number no test gives a process (the runner's real PID could be one, after PID wrap).
        self.mypid = MY_PID
        os.symlink(str(MY_PID), os.path.join(str(root), "self"))
        fakeproc.write_process(root, 1, comm="systemd", ppid=0, argv=("/sbin/init",), cgroup="0::/init.scope\n", exe="/usr/lib/systemd/systemd")
        fakeproc.write_process(
            root, 4000, comm="sshd", argv=("sshd: /usr/sbin/sshd -D [listener] 0 of 10-100 startups",), cgroup=SSH_SERVICE, exe="/usr/sbin/sshd"
        )
        fakeproc.write_process(root, 4100, comm="sshd", ppid=4000, argv=("sshd: root@notty",), cgroup=session_cgroup, exe="/usr/sbin/sshd")
        fakeproc.write_process(root, self.mypid, comm="python3", ppid=4100, argv=("/usr/bin/python3", "AnsiballZ_gpu_release.py"), cgroup=session_cgroup)

    # --- processes

    def unit(self, name, active="active", sub="running", file_state="enabled", restart=False, fragment=None, triggered_by="",
             timeout_stop=90.0):
        """A systemd unit. Its first process is its main process; `timeout_stop` is its
        TimeoutStopSec (90 s by default), after which systemd itself sends SIGKILL."""
        self.units[name] = {
            "props": {"Id": name, "LoadState": "loaded", "ActiveState": active, "SubState": sub, "UnitFileState": file_state,
                      "FragmentPath": fragment or f"/usr/lib/systemd/system/{name}", "TriggeredBy": triggered_by},
            "restart": restart,
            "pids": set(),
            "main": None,
            "timeout_stop": timeout_stop,
        }

    def control_group(self, name):
        """systemd's ControlGroup= of a unit. A unit of the test's (World.unit): its directory in
        system.slice while it runs or has processes left, else empty. Any other (init.scope, a
        session's scope, a user's manager, a container's scope): the directory of that name that a
        process of the tree sits in or below, where only slices lie above it, as systemd places
        units (a directory of that name below another unit is no unit of systemd's)."""
        unit = self.units.get(name)
        if unit is not None:
            if unit["props"]["ActiveState"] in ("inactive", "failed") and not unit["pids"]:
                return ""
            return unit.get("cgroup") or f"/system.slice/{name}"
        for entry in os.listdir(str(self.root)):
            try:
                with open(os.path.join(str(self.root), entry, "cgroup")) as handle:
                    lines = handle.read().splitlines()
            except OSError:
                continue
            for line in lines:
                parts = line.split("::", 1)[1].split("/") if line.startswith("0::") else []
                if name in parts and all(part.endswith(".slice") for part in parts[1:parts.index(name)]):
                    return "/".join(parts[: parts.index(name) + 1])
        return ""

    def settle(self, name):
        """A stopping unit is inactive once its last process is gone (failed if SIGKILLed)."""
        unit = self.units[name]
        if unit["props"]["ActiveState"] == "deactivating" and not unit["pids"]:
            unit["props"].update(ActiveState="failed", SubState="failed") if unit.get("killed") else unit["props"].update(
                ActiveState="inactive", SubState="dead")

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
        maps=None,
        cuda_visible=None,
        ppid=1,
        environ=None,
        sig_ign=0,
        sig_cgt=0,
        nspid=None,
    ):
        """A process. With `mem` ({GPU: MiB}) and no `devices`, a CUDA process as measured on a
        real multi-GPU node: every GPU's node open, its own GPUs' mapped context-sized, the
        others small (not at all for GPUs that `cuda_visible`, CUDA_VISIBLE_DEVICES, hides).
        `visible=False`: nvidia-smi does not list it."""
        assert pid != self.mypid and pid not in self.procs
        mem = dict(mem or {})
        if cgroup is None:
            cgroup = f"0::/system.slice/{unit}\n" if unit else "0::/user.slice/user-1000.slice/session-3.scope\n"
        if devices is None and mem:
            devices, default_maps = fakeproc.cuda_process(set(mem), range(self.gpus), cuda_visible)
            maps = default_maps if maps is None else maps
        elif devices is None:
            devices = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
        spec = dict(comm=comm, argv=argv, cgroup=cgroup, fds=tuple(devices), maps=tuple(maps or ()), exe=exe, ppid=ppid,
                    sig_ign=sig_ign, sig_cgt=sig_cgt, nspid=nspid)
        self.next_start += 1
        fakeproc.write_process(self.root, pid, start_time=self.next_start, **spec)
        if environ:
            with open(os.path.join(str(self.root), str(pid), "environ"), "wb") as handle:
                handle.write(b"".join(("{}={}".format(*item)).encode() + b"\0" for item in sorted(environ.items())))
        self.procs[pid] = Proc(pid, mem, unit, on_term, on_kill, smi_pid if smi_pid else pid, smi_name if smi_name else comm, spec)
        if not visible:
            self.procs[pid].smi_pid = None
        if unit:
            self.units[unit]["pids"].add(pid)
            if self.units[unit]["main"] not in self.procs:
                self.units[unit]["main"] = pid
        return self.procs[pid]

    def exit(self, pid, by_stop=False):
        proc = self.procs.pop(pid)
        fakeproc.remove_process(self.root, pid)
        for index, mib in proc.mem.items():
            self.freeing.append((self.t + RELEASE_DELAY_S, index, mib))
        if proc.unit:
            unit = self.units[proc.unit]
            unit["pids"].discard(pid)
            by_stop = by_stop or unit["props"]["ActiveState"] in ("deactivating", "inactive", "failed")
            self.settle(proc.unit)
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
        status = os.path.join(str(self.root), str(pid), "status")
        with open(status) as handle:
            text = handle.read()
        with open(status, "w") as handle:
            handle.write(text.replace("State:\tS (sleeping)", "State:\tD (disk sleep)"))
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
        used = live + freeing + sum(mib for i, _pid, _name, mib in self.leaked if i == index) + self.baseline.get(index, 0)
        node = f"/dev/nvidia{index}"
        if not used and any(p.mem and node in [m[0] for m in p.spec["maps"] if not isinstance(m, str)] for p in self.procs.values()):
            used = FOOTPRINT_MIB
        return used

    def gpu_text(self):
        def mib(i, value):
            # WDDM rows and GPUs in an error state read [N/A] (docs/docsite/rst/guide_design.rst, "Known field behaviour elsewhere").
            return "[N/A]" if i in self.unreadable else str(value)

        return "".join(
            "{}, {}, NVIDIA H200, 00000000:{:02X}:00.0, 580.159.04, 143771, 616, {}, {}, 0, 37, 126.02, Enabled, {}\n".format(
                i, uuid(i), 0x18 + i, mib(i, self.memory_used(i)), mib(i, 143771 - 616 - self.memory_used(i)),
                "Enabled" if self.mig else "Disabled")
            for i in range(self.gpus)
        )

    def apps_text(self):
        rows = []
        for proc in self.procs.values():
            for index, mib in sorted(proc.mem.items()):
                if proc.smi_pid is not None:
                    rows.append(f"{proc.smi_pid}, {uuid(index)}, {mib}")
        # pid, gpu_uuid, used_memory: the module never asks nvidia-smi for names (docs/docsite/rst/guide_security.rst).
        rows += [f"{pid}, {uuid(i)}, {mib}" for i, pid, _name, mib in self.leaked]
        return "".join(row + "\n" for row in rows)


class FakeSmi:
    """query_all / query_gpus / run / app_args, answering from the World through the real parsers."""

    def __init__(self, world):
        self.world = world
        self.calls = 0

    def query_all(self, fields=smi.GPU_FIELDS, with_apps=True, meanwhile=None):
        return self.query_gpus(fields, meanwhile=meanwhile), (self.run(self.app_args()) and smi.parse_compute_apps(self.world.apps_text()) if with_apps else [])

    def query_gpus(self, fields=smi.GPU_FIELDS, gpus=None, meanwhile=None):
        assert fields == smi.GPU_FIELDS
        self.calls += 1
        if meanwhile is not None:
            meanwhile()  # while the call is out, as NvidiaSmi.query_gpus runs it
        return smi.parse_gpus(self.world.gpu_text())

    def abandon(self, started):
        self.abandoned = getattr(self, "abandoned", 0) + 1

    def run(self, args):
        if list(args) == ["-q"]:
            # A failure's reset advice asks for the GPUs' virtualization mode (_node_shapes): bare metal.
            return getattr(self.world, "q_text", "")
        assert args == self.app_args()
        self.calls += 1
        return self.world.apps_text() or "\n"

    # A call started now and read later (the look overlaps it with the /proc scan).
    def start(self, args):
        return args

    def finish(self, started):
        return self.run(started)

    @staticmethod
    def app_args():
        return smi.NvidiaSmi.app_args()


class FakeSystem(release.System):
    """systemctl, signals and the clock of the World; /proc reads go to the World's tree."""

    def __init__(self, world):
        # No Docker or Podman on this node unless a test gives it one.
        runtimes = getattr(world, "runtimes", None) or _engines.Runtimes(which=lambda name: None, sockets={})
        super().__init__(systemctl_path="/usr/bin/systemctl", proc=str(world.root), runtimes=runtimes)
        self.world = world

    def systemctl(self, args):
        world = self.world
        world.systemctl_log.append(list(args))
        verb, names = args[0], [a for a in args[1:] if not a.startswith("-")]
        if verb == "list-units":
            rows = ("{0} loaded {1} {2} {0}\n".format(n, u["props"]["ActiveState"], u["props"]["SubState"]) for n, u in sorted(world.units.items()))
            return 0, "".join(rows), ""
        if verb == "list-unit-files":
            return 0, "".join("{} {} enabled\n".format(n, u["props"]["UnitFileState"]) for n, u in sorted(world.units.items())), ""
        if verb == "show":
            wanted = [a.split("=", 1)[1].split(",") for a in args if a.startswith("--property=")][0]
            blocks = []
            for name in names:
                if name in world.units:
                    unit = world.units[name]
                    props = dict(unit["props"], MainPID=str(unit["main"] if unit["main"] in world.procs else 0),
                                 ControlGroup=world.control_group(name))
                else:
                    props = {"Id": name, "LoadState": "not-found", "ActiveState": "inactive", "SubState": "dead", "UnitFileState": "",
                             "MainPID": "0", "TriggeredBy": "", "FragmentPath": "", "ControlGroup": world.control_group(name)}
                    if props["ControlGroup"]:  # a unit the test did not declare, running all the same (a session's scope, user@)
                        props.update(LoadState="loaded", ActiveState="active", SubState="running")
                blocks.append("".join(f"{key}={props[key]}\n" for key in wanted if key in props))
            return 0, "\n".join(blocks), ""
        for name in names:
            unit = world.units[name]
            if verb == "stop":
                assert "--no-block" in args, f"an unbounded systemctl stop: {args}"
                if unit["props"]["ActiveState"] in ("inactive", "failed"):
                    continue
                unit["props"].update(ActiveState="deactivating", SubState="stop-sigterm")
                for pid in sorted(unit["pids"]):
                    self.deliver(pid, signal.SIGTERM)

                def timeout_stop(name=name, unit=unit):
                    if unit["props"]["ActiveState"] == "deactivating":
                        world.systemctl_log.append(["(systemd: TimeoutStopSec)", name])
                        unit["killed"] = True
                        for pid in sorted(unit["pids"]):
                            self.deliver(pid, signal.SIGKILL)

                world.at(world.t + unit["timeout_stop"], timeout_stop)
                world.settle(name)
            elif verb == "kill":
                assert "--signal=SIGKILL" in args
                unit["killed"] = True
                for pid in sorted(unit["pids"]):
                    self.deliver(pid, signal.SIGKILL)
                world.settle(name)
            elif verb == "disable":
                unit["props"]["UnitFileState"] = "disabled"
            elif verb == "mask":
                unit["props"]["UnitFileState"] = "masked"
        return 0, "", ""

    def signal(self, pid, signum):
        self.world.signals.append((round(self.world.t, 3), pid, signal.Signals(signum).name))
        if self.world.procs.get(pid) is None:
            raise ProcessLookupError(pid)
        self.deliver(pid, signum)

    def deliver(self, pid, signum):
        """A signal arrives (from gpu_release, or from systemd stopping the unit)."""
        world = self.world
        proc = world.procs[pid]
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


def run(world, check_mode=False, release_class=release.Release, **options):
    worker = release_class(FakeSmi(world), FakeSystem(world), params(**options), check_mode=check_mode, driver_root=str(world.root.parent / "no-driver"))
    return worker.run()


def fail(world, **options):
    with pytest.raises(release.ReleaseError) as info:
        run(world, **options)
    return info.value


def stops(world):
    return [args for args in world.systemctl_log if args[0] in ("stop", "disable", "mask")]
