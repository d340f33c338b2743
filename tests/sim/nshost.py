"""A simulated GPU host in private Linux namespaces (no GPU, no container engine).

    with NsHost(preset="h200x8") as host:
        host.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv"])
        p = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "40960"])
        host.kill(p.pid)

`unshare --mount --uts --pid --fork --mount-proc --kill-child` starts this file's
`_init` (PID 1 of the new PID namespace, which reaps orphans). Inside the namespace only
(the machine's own files are never touched):

* /dev is an overlay (upper dir in the host's temp dir) with /dev/nvidia<minor>,
  /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools, /dev/nvidia-caps/nvidia-cap1,2
  as character devices 1:5 (/dev/zero semantics: openable, and a read-only MAP_SHARED
  mapping keeps the /dev/nvidiaN path in /proc/PID/maps). Their major is NOT 195.
* /proc/driver is a tmpfs holding nvidia/version and nvidia/gpus/<bus>/information in
  the real driver's format (Device Minor: is where the minor number comes from).
* /etc, /run and /usr/bin are overlays: /etc/nvidia-sim/config.json is the sim config,
  /run/nvidia-sim is a bind of the host-visible state dir, /usr/bin/nvidia-smi and
  /usr/bin/gpu_holder and /usr/bin/nvidia-cuda-mps-control (simulated MPS) are symlinks to tests/sim (and /usr/bin/journalctl and /usr/bin/dmesg to
  tests/sim/kernel-log, the simulated kernel log), and /usr/bin/python -> python3 is added
  when the machine has no /usr/bin/python (the two scripts use `#!/usr/bin/env python`).
* IPC namespace of its own (`own_ipc=False`: the machine's, as docker --ipc=host shares the node's).
* /dev/shm is a tmpfs of the host's own (`shm_from`: a directory outside bound there instead, as an
  LXC guest given the host's; `shm_source="shm"`: mounted as a container runtime mounts a pod's,
  "nsshm" by default; mode 1777, `shm_size_mib`, 4096 by default: a limit,
  not memory taken), as every node and container has one: what a test leaves there, and what
  the modules find there, is never the machine's.
* /sys/module is a tmpfs of the host's own with nvidia/ (the driver loaded; `driver_module=False`:
  without it, a sysfs that hides the kernel's modules), and with `nvidia_drm` (its use count; None:
  not loaded) nvidia_drm/refcnt (the count lsmod shows; a machine without loadable modules has
  neither it nor /proc/modules), and a fake `modprobe` (tests/sim/modprobe) unloads and loads it there.
* config `nvswitches: N`: /dev/nvidia-nvswitchctl and /dev/nvidia-nvswitch0..N-1 (an NVSwitch
  baseboard's nodes).
* the host name (UTS namespace) is the seed.

Processes started with spawn() are children of the namespace's init (ppid 1, own
session), like daemons. run() uses `nsenter -t INIT -m -u -p [-i]` (the command's parent is
outside the namespace: ppid 0 inside). Teardown SIGKILLs the init, which makes the
kernel kill everything in the PID namespace; the mount namespace dies with it. An
atexit hook and PR_SET_PDEATHSIG (on unshare, tied to the creating thread) make sure
nothing outlives the test process. Nothing outside the namespace is ever signalled.

Stdlib only. Needs root, util-linux unshare/nsenter, overlayfs.
"""
import argparse
import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIM = os.path.join(HERE, "nvidia-smi")
HOLDER = os.path.join(HERE, "gpu_holder")
# journalctl and dmesg inside: the Xids a test injects, never the machine's own kernel log
KERNEL_LOG = os.path.join(HERE, "kernel-log")
# nv-fabricmanager and systemctl inside, for a config with "fabric_manager" (a fabric node)
FABRIC_MANAGER = os.path.join(HERE, "fabricmanager")
# modprobe inside, for a host given `nvidia_drm`
MODPROBE = os.path.join(HERE, "modprobe")
sys.path.insert(0, HERE)
import make_config  # noqa: E402

STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Where gpu_release keeps its restore record on a node: a private, empty tmpfs in every host.
RECORD_DIR = "/var/lib/zeromib-gpu"
PR_SET_PDEATHSIG = 1
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2

_LIVE = set()
_LIVE_LOCK = threading.Lock()


# ====================================================================== host side
class NsError(RuntimeError):
    pass


class HostProc:
    """A process started inside the namespace by NsHost.spawn()."""

    def __init__(self, host, pid, argv, log, info=None):
        self.host, self.pid, self.argv, self.log = host, pid, argv, log
        self.info = info or {}
        self.children = self.info.get("children", [])  # --fork-child pids (ns view)
        self.workers = self.info.get("workers", [])    # --workers pids (ns view)
        self._host_pid = None

    @property
    def host_pid(self):
        if self._host_pid is None:
            self._host_pid = self.host.host_pid(self.pid)
        return self._host_pid

    def alive(self):
        return self.host.alive(self.pid)

    def kill(self, sig=signal.SIGKILL):
        return self.host.kill(self.pid, sig)

    def wait_gone(self, timeout=10.0):
        return self.host.wait_gone(self.pid, timeout)

    @property
    def returncode(self):
        return self.host.exit_status(self.pid)

    def output(self):
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def __repr__(self):
        return f"<HostProc pid={self.pid} {self.argv[:3]!r}>"


class NsHost:
    """A simulated GPU host. See the module docstring."""

    def __init__(self, preset="h200x8", minors=None, seed=None, config=None, count=None,
                 release_delay_s=None, tmp_root=None, start_timeout=30.0, libcuda=None, gpu_nodes=None, shm_size_mib=4096,
                 nvidia_drm=None, driver_module=True, shm_from=None, own_ipc=True, shm_source="nsshm"):
        # /dev/shm's size (a tmpfs of the host's own) and nvidia_drm's use count (None: not loaded).
        self.shm_size_mib = int(shm_size_mib)
        self.nvidia_drm = nvidia_drm
        self.driver_module = driver_module
        # /dev/shm bound from a directory outside (a host's, shared: LXC's lxc.mount.entry) instead
        # of a tmpfs of its own; own_ipc False: the machine's IPC namespace (docker --ipc=host).
        self.shm_from = shm_from
        self.own_ipc = own_ipc
        # The source /dev/shm's tmpfs is mounted with: "shm" as a container runtime mounts the
        # one of a container's or a pod's IPC namespace (Docker, Podman, containerd, CRI-O).
        self.shm_source = shm_source
        # A container given some of the host's GPUs (issue 37): the minors whose /dev/nvidia<minor>
        # it has; None: every GPU's. Its /proc/driver/nvidia still lists every GPU.
        self.gpu_nodes = None if gpu_nodes is None else [int(m) for m in gpu_nodes]
        # A libcuda.so.1 to put where the loader finds it inside (tests/sim/fake_libcuda.py builds
        # the fake one); None: the host has no libcuda, as before.
        self.libcuda = libcuda
        self.seed = seed or f"simhost-{os.getpid()}-{id(self) % 100000}"
        if config is None:
            over = {}
            if release_delay_s is not None:
                over["release_delay_s"] = release_delay_s
            config = make_config.make_config(preset, seed=self.seed, minors=minors, count=count,
                                             **over)
        self.config = config
        self.tmp_root = tmp_root
        self.start_timeout = start_timeout
        self.dir = None
        self.init_pid = None     # host pid of the namespace's PID 1
        self._unshare = None
        self._init_start = None
        self._pidns = None
        self._n = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------ paths
    @property
    def root(self):
        d = self.dir
        return argparse.Namespace(
            dir=d,                                             # host temp dir
            state=os.path.join(d, "state"),                     # = /run/nvidia-sim inside
            config=os.path.join(d, "config.json"),              # = /etc/nvidia-sim/config.json
            faults=os.path.join(d, "state", "faults.json"),
            log=os.path.join(d, "init.log"),
            inside=f"/proc/{self.init_pid}/root" if self.init_pid else None,  # its / from here
        )

    # ------------------------------------------------------------ lifecycle
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def start(self):
        if self.dir:
            raise NsError("already started")
        _remove_stale(self.tmp_root or tempfile.gettempdir())
        self.dir = tempfile.mkdtemp(prefix="nshost-", dir=self.tmp_root)
        os.chmod(self.dir, 0o755)
        with open(os.path.join(self.dir, "owner"), "w") as f:
            f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self):
        for sub in ("state", "ready", "logs", "state/contexts"):
            os.mkdir(os.path.join(self.dir, sub))
        # An unprivileged user's holder (spawn_as) registers its context and its ready file
        # here, as a CUDA process's context lives in the driver whoever runs it.
        for sub in ("state", "ready", "state/contexts"):
            os.chmod(os.path.join(self.dir, sub), 0o1777)
        with open(self.root.config, "w") as f:
            json.dump(self.config, f, indent=2)
        spec = {"dir": self.dir, "config": self.root.config, "hostname": self.seed,
                "state": self.root.state, "sim": SIM, "holder": HOLDER, "kernel_log": KERNEL_LOG,
                "fabric_manager": FABRIC_MANAGER,
                "libcuda": self.libcuda, "gpu_nodes": self.gpu_nodes, "shm_size_mib": self.shm_size_mib}
        spec["driver_module"] = bool(self.driver_module)
        spec["shm_from"] = self.shm_from
        spec["shm_source"] = self.shm_source
        if self.nvidia_drm is not None:
            spec["nvidia_drm"] = int(self.nvidia_drm)
            spec["modprobe"] = MODPROBE
        spec_path = os.path.join(self.dir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        t0 = time.monotonic()
        with open(self.root.log, "wb") as log:
            self._unshare = subprocess.Popen(
                ["unshare", "--mount", "--uts", "--pid", *(["--ipc"] if self.own_ipc else []), "--fork", "--mount-proc", "--kill-child",
                 sys.executable, "-I", os.path.abspath(__file__), "_init", spec_path],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=_pdeathsig, close_fds=True)
        ready = os.path.join(self.dir, "init.ready")
        while not os.path.exists(ready):
            if self._unshare.poll() is not None:
                raise NsError(f"namespace init failed (rc {self._unshare.returncode}): {self._read_log()}")
            if time.monotonic() - t0 > self.start_timeout:
                raise NsError(f"namespace init not ready after {self.start_timeout:.0f} s: {self._read_log()}")
            time.sleep(0.005)
        with open(ready) as f:
            status = f.read()
        if status.strip() != "ok":
            raise NsError(f"namespace init failed: {status}")
        self.init_pid = self._find_init()
        self._init_start = _start_time(self.init_pid)
        self._pidns = os.readlink(f"/proc/{self.init_pid}/ns/pid")
        self.start_s = time.monotonic() - t0

    def _find_init(self):
        upid = self._unshare.pid
        for _try in range(400):
            for pid in _pids():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        data = f.read()
                    if int(data[data.rindex(")") + 2:].split()[1]) == upid:
                        return pid
                except (OSError, ValueError):
                    continue
            time.sleep(0.005)
        raise NsError("cannot find the namespace's init")

    def _read_log(self):
        try:
            with open(self.root.log, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self):
        """Kill everything in the namespace and remove the temp dir. Idempotent."""
        t0 = time.monotonic()
        if self.init_pid and self._init_start is not None:
            try:
                if _start_time(self.init_pid) == self._init_start:
                    os.kill(self.init_pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        if self._unshare is not None:
            if self.init_pid is None and self._unshare.poll() is None:
                # init never came up: unshare --kill-child takes it down with it
                self._unshare.kill()
            try:
                self._unshare.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._unshare.kill()
                self._unshare.wait(timeout=15)
        self._remove_cgroups()
        if self.dir:
            for _try in range(50):
                try:
                    shutil.rmtree(self.dir)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        with _LIVE_LOCK:
            _LIVE.discard(self)
        self.stop_s = time.monotonic() - t0
        self.init_pid = None
        self._init_start = None
        self._unshare = None
        self.dir = None

    # ------------------------------------------------------------ commands
    def _env(self, env):
        """The caller's environment minus NVIDIA_SIM_*, with a plain PATH (as on a
        fresh host; the caller's may hold slow shims such as pyenv's), plus env."""
        base = dict((k, v) for k, v in os.environ.items()
                    if not k.startswith(("NVIDIA_SIM_", "PYENV_", "VIRTUAL_ENV")))
        base["PATH"] = STD_PATH
        if env:
            base.update(env)
        return base

    def run(self, argv, env=None, timeout=30, input=None, cwd=None, check=False):  # noqa: A002 (subprocess.run's keyword)
        """Run argv inside the namespace; returns subprocess.CompletedProcess (text).

        On timeout the command (inside) and nsenter are SIGKILLed and
        subprocess.TimeoutExpired is raised."""
        self._need()
        cmd = ["nsenter", "-t", str(self.init_pid), "-m", "-u", "-p", *(["-i"] if self.own_ipc else []), "--"] + list(argv)
        p = subprocess.Popen(cmd, env=self._env(env), cwd=cwd, stdin=subprocess.PIPE if input
                             is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, universal_newlines=True)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            for child in _children(p.pid):
                if self._in_ns(child):
                    _kill_tree_in_ns(self, child)
            p.kill()
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        cp = subprocess.CompletedProcess(list(argv), p.returncode, out, err)
        if check:
            cp.check_returncode()
        return cp

    def smi(self, *args, **kw):
        """Shortcut: run nvidia-smi with args inside the namespace."""
        return self.run(["nvidia-smi"] + list(args), **kw)

    def spawn(self, argv, env=None, cwd="/", ready=None, timeout=15.0):
        """Start argv as a child of the namespace's init and return a HostProc.

        For gpu_holder (ready=None means: when argv[0] is gpu_holder) a --ready-file is
        added and spawn waits until the holder has done its "CUDA init"."""
        self._need()
        argv = list(argv)
        with self._lock:
            self._n += 1
            n = self._n
        if ready is None:
            ready = os.path.basename(argv[0]) == "gpu_holder" and "--ready-file" not in argv
        ready_file = None
        if ready:
            ready_file = os.path.join(self.dir, "ready", f"{n}.json")
            argv += ["--ready-file", ready_file]
        log = os.path.join(self.dir, "logs", f"{n}.log")
        full_env = {"PATH": STD_PATH, "HOME": "/root", "LANG": "C.UTF-8"}
        full_env.update(env or {})
        reply = self._ctl({"op": "spawn", "argv": argv, "env": full_env, "cwd": cwd, "log": log})
        if "error" in reply:
            raise NsError("spawn {!r}: {}".format(argv, reply["error"]))
        pid = reply["pid"]
        info = None
        if ready_file:
            t0 = time.monotonic()
            while not os.path.exists(ready_file):
                st = self.exit_status(pid)
                if st is not None:
                    raise NsError(f"{argv!r} exited with {st} before ready: {_read(log)}")
                if time.monotonic() - t0 > timeout:
                    raise NsError(f"{argv!r} not ready after {timeout:.0f} s: {_read(log)}")
                time.sleep(0.005)
            with open(ready_file) as f:
                info = json.load(f)
        return HostProc(self, pid, argv, log, info)

    def spawn_as(self, uid, argv, **kw):
        """spawn() as an unprivileged user: `setpriv --reuid UID --regid UID --clear-groups`
        (no passwd entry needed; the real uid is UID, as for any user's job). A gpu_holder
        argv waits for its CUDA init, as spawn() does."""
        argv = list(argv)
        if kw.get("ready") is None:
            kw["ready"] = any(os.path.basename(a) == "gpu_holder" for a in argv[:3]) and "--ready-file" not in argv
        return self.spawn(["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--"] + argv, **kw)

    # ------------------------------------------------------------ cgroups a user may name
    def user_cgroup(self, relative, owner):
        """Create the cgroup `relative` (e.g. user.slice/user-4242.slice/user@4242.service/app.slice/
        docker-<id>.scope) below a cgroup of this host's own on the machine's cgroup2 hierarchy,
        each directory from the first one named in `relative` down chowned to `owner`, as systemd
        delegates a user's subtree (with `owner` None, root keeps them). Returns the path as
        /proc/PID/cgroup shows it. Removed by stop() (depth first, once the namespace's processes
        are gone)."""
        self._need()
        mount = _cgroup2_mount()
        if mount is None:
            raise NsError("no cgroup2 hierarchy mounted")
        top = f"zeromib-nshost-{os.getpid()}-{id(self) % 100000}"
        made = getattr(self, "_cgroups", None)
        if made is None:
            made = self._cgroups = []
        path = os.path.join(mount, top)
        if not os.path.isdir(path):
            os.mkdir(path)
            made.append(path)
        for part in relative.strip("/").split("/"):
            path = os.path.join(path, part)
            if not os.path.isdir(path):
                os.mkdir(path)
                made.append(path)
            if owner is not None:
                os.chown(path, owner, owner)
                for name in ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
                    try:
                        os.chown(os.path.join(path, name), owner, owner)
                    except OSError:
                        pass
        return "/" + os.path.relpath(path, mount)

    def move_to_cgroup(self, pid, cgroup):
        """Move namespace pid `pid` into `cgroup` (a path user_cgroup returned): what its user can
        do for their own processes inside their delegated subtree."""
        with open(os.path.join(_cgroup2_mount(), cgroup.lstrip("/"), "cgroup.procs"), "w") as handle:
            handle.write(str(self.host_pid(pid)))

    def _remove_cgroups(self):
        for path in reversed(getattr(self, "_cgroups", None) or []):
            for _try in range(100):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        self._cgroups = []

    def exit_status(self, pid):
        """Exit status of a process spawn() started: returncode style, None if running."""
        reply = self._ctl({"op": "status", "pid": pid})
        return reply.get("status")

    # ------------------------------------------------------------ processes
    def _state(self, pid):
        try:
            with open(f"/proc/{self.init_pid}/root/proc/{pid}/stat") as f:
                data = f.read()
            return data[data.rindex(")") + 2:].split()[0]
        except (OSError, ValueError):
            return None

    def alive(self, pid):
        """True while pid (as seen inside the namespace) exists and is not a zombie."""
        self._need()
        st = self._state(int(pid))
        return st is not None and st not in ("Z", "X")

    def wait_gone(self, pid, timeout=10.0):
        t0 = time.monotonic()
        while self.alive(pid):
            if time.monotonic() - t0 > timeout:
                return False
            time.sleep(0.005)
        return True

    def host_pid(self, pid):
        """The host pid of namespace pid `pid` (None when gone)."""
        self._need()
        pid = int(pid)
        if pid == 1:
            return self.init_pid
        for hp in _pids():
            try:
                with open(f"/proc/{hp}/status") as f:
                    for line in f:
                        if line.startswith("NSpid:"):
                            ids = line.split()[1:]
                            break
                    else:
                        continue
                if len(ids) >= 2 and int(ids[-1]) == pid and self._in_ns(hp):
                    return hp
            except (OSError, ValueError):
                continue
        return None

    def _in_ns(self, host_pid):
        try:
            return os.readlink(f"/proc/{host_pid}/ns/pid") == self._pidns
        except OSError:
            return False

    def kill(self, pid, sig=signal.SIGKILL):
        """Signal a process of this namespace (pid as seen inside). False if gone."""
        hp = self.host_pid(pid)
        if hp is None or hp == self.init_pid:
            return False
        try:
            os.kill(hp, sig)
            return True
        except ProcessLookupError:
            return False

    # ------------------------------------------------------------ faults and files
    def set_fault(self, faults=None, **kw):
        """Merge faults into $NVIDIA_SIM_STATE/faults.json (see nvidia-smi's README)."""
        self._need()
        cur = self.faults()
        cur.update(faults or {})
        cur.update(kw)
        _atomic_write(self.root.faults, json.dumps(cur))
        self.forget_kernel_log_read()

    # What gpu_facts/gpu_release keep of the kernel log they read (_kernel_log_state), inside.
    KERNEL_LOG_STATE = "/var/lib/zeromib-gpu/kernel-log.json"

    def forget_kernel_log_read(self):
        """A new set of faults rewrites the simulated kernel log, which a real log never does: what
        the modules kept of the old one (a journal cursor, its Xid lines) goes with it."""
        self.run(["rm", "-f", self.KERNEL_LOG_STATE], check=True)

    def clear_faults(self):
        self._need()
        try:
            os.unlink(self.root.faults)
        except FileNotFoundError:
            pass
        self.forget_kernel_log_read()

    def faults(self):
        try:
            with open(self.root.faults) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def read(self, path):
        """Read a file as the namespace sees it (e.g. /proc/driver/nvidia/version)."""
        self._need()
        with open(f"/proc/{self.init_pid}/root{path}", errors="replace") as f:
            return f.read()

    def contexts(self):
        """Registered contexts (parsed JSON of $NVIDIA_SIM_STATE/contexts/*.json)."""
        out = []
        d = os.path.join(self.root.state, "contexts")
        for fn in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            if fn.endswith(".json"):
                try:
                    with open(os.path.join(d, fn)) as f:
                        out.append(json.load(f))
                except (OSError, ValueError):
                    pass
        return out

    # ------------------------------------------------------------ internals
    def _need(self):
        if not self.init_pid:
            raise NsError("host not started")

    def _ctl(self, req):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(30)
            s.connect(os.path.join(self.dir, "ctl.sock"))
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
            return json.loads(buf.decode())
        finally:
            s.close()


def _remove_stale(tmp):
    """Remove nshost-* dirs whose creating process is gone (it was SIGKILLed before it
    could clean up; its namespace died with it through PR_SET_PDEATHSIG)."""
    try:
        names = [n for n in os.listdir(tmp) if n.startswith("nshost-")]
    except OSError:
        return
    for n in names:
        d = os.path.join(tmp, n)
        try:
            with open(os.path.join(d, "owner")) as f:
                pid, start = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
        try:
            if _start_time(pid) == start:
                continue  # owner alive
        except (OSError, ValueError):
            pass
        if _ns_alive(d):
            continue
        shutil.rmtree(d, ignore_errors=True)


def _ns_alive(d):
    """True while the namespace init of dir d runs (its cmdline names d/spec.json)."""
    needle = (d + "/spec.json").encode()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    return True
        except OSError:
            continue
    return False


def _cgroup2_mount():
    """Where the machine's cgroup2 hierarchy is mounted (/sys/fs/cgroup, or
    /sys/fs/cgroup/unified on a hybrid machine), or None."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _sep, right = line.partition(" - ")
                if right.split()[:1] == ["cgroup2"]:
                    return left.split()[4]
    except OSError:
        pass
    return None


def _pdeathsig():
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _pids():
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit():
            out.append(int(n))
    return out


def _start_time(pid):
    with open(f"/proc/{pid}/stat") as f:
        data = f.read()
    return int(data[data.rindex(")") + 2:].split()[19])


def _children(ppid):
    out = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                data = f.read()
            if int(data[data.rindex(")") + 2:].split()[1]) == ppid:
                out.append(pid)
        except (OSError, ValueError):
            continue
    return out


def _kill_tree_in_ns(host, hp):
    for c in _children(hp):
        if host._in_ns(c):
            _kill_tree_in_ns(host, c)
    try:
        if host._in_ns(hp):
            os.kill(hp, signal.SIGKILL)
    except OSError:
        pass


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-2000:]
    except OSError:
        return ""


def _atomic_write(path, text):
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


@atexit.register
def _cleanup_all():
    with _LIVE_LOCK:
        hosts = list(_LIVE)
    for h in hosts:
        try:
            h.stop()
        except Exception:
            pass


# ====================================================================== namespace side
_libc = None


def _mount(src, target, fstype=None, flags=0, data=None):
    if _libc.mount(src.encode() if src else None, target.encode(),
                   fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} on {target} ({fstype}, {data}): {os.strerror(e)}")


def _umount(target):
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def _submounts(path):
    """Top-level mount points strictly below path (from /proc/self/mountinfo)."""
    pts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp.startswith(path.rstrip("/") + "/"):
                pts.append(mp)
    pts = sorted(set(pts))
    top = [p for p in pts if not any(p != q and p.startswith(q + "/") for q in pts)]
    return top


def _overlay(path, base):
    """Put a writable overlay on path; keep what was mounted below it."""
    name = path.strip("/").replace("/", "_")
    upper, work, keep = (os.path.join(base, f"{name}-{s}") for s in ("upper", "work", "keep"))
    for d in (upper, work, keep):
        os.makedirs(d)
    subs = _submounts(path)
    if subs:
        _mount(path, keep, None, MS_BIND | MS_REC)
    _mount("overlay", path, "overlay", 0,
           f"lowerdir={path},upperdir={upper},workdir={work}")
    for s in subs:
        _mount(os.path.join(keep, os.path.relpath(s, path)), s, None, MS_BIND | MS_REC)
    if subs:
        _umount(keep)


def _mknod(path, minor=5):
    os.mknod(path, 0o666 | 0o020000, os.makedev(1, minor))
    os.chmod(path, 0o666)


def _information(cfg, g):
    bus = g["pci_bus_id"].lower()
    dom, rest = bus.split(":", 1)
    loc = f"{dom[-4:]}:{rest}"
    vb = str(g.get("vbios_version", "??.??.??.??.??")).lower()
    return loc, ("Model: \t\t {}\n".format(g["name"]) +
                 "IRQ:   \t\t {}\n".format(150 + g["index"]) +
                 "GPU UUID: \t {}\n".format(g["uuid"]) +
                 f"Video BIOS: \t {vb}\n" +
                 "Bus Type: \t PCIe\n" +
                 "DMA Size: \t 52 bits\n" +
                 "DMA Mask: \t 0xfffffffffffff\n" +
                 f"Bus Location: \t {loc}\n" +
                 "Device Minor: \t {}\n".format(g["minor"]) +
                 "GPU Firmware: \t {}\n".format(cfg.get("driver_version", "")) +
                 "GPU Excluded:\t No\n")


def _setup(spec):
    with open(spec["config"]) as f:
        cfg = json.load(f)
    base = os.path.join(spec["dir"], "ns")
    os.makedirs(base)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    try:
        _libc.sethostname(spec["hostname"].encode(), len(spec["hostname"]))
    except Exception:
        pass
    # /dev
    _overlay("/dev", base)
    wsl = cfg.get("wsl")
    if wsl:
        _wsl_setup(wsl, spec["dir"])
    for g in [] if wsl else cfg["gpus"]:
        if spec.get("gpu_nodes") is None or g["minor"] in spec["gpu_nodes"]:
            _mknod("/dev/nvidia{}".format(g["minor"]))
    for n in () if wsl else ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        _mknod("/dev/" + n)
    if cfg.get("imex"):
        # IMEX channels as the administrator creates them (NVIDIA's IMEX guide): root's, in /dev.
        os.makedirs("/dev/nvidia-caps-imex-channels", exist_ok=True)
        for n in range(int(cfg["imex"].get("channels", 1))):
            _mknod(f"/dev/nvidia-caps-imex-channels/channel{n:d}")
    for n in range(int(cfg.get("nvswitches") or 0)):
        _mknod(f"/dev/nvidia-nvswitch{n:d}")
    if cfg.get("nvswitches"):
        _mknod("/dev/nvidia-nvswitchctl")
    # A /dev/shm of its own (the overlay above shows the machine's through): nothing a test
    # leaves there, and nothing the modules read there, is the machine's.
    if spec.get("shm_from"):
        _mount(spec["shm_from"], "/dev/shm", None, MS_BIND)
    else:
        _mount(spec.get("shm_source") or "nsshm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV,
               "mode=1777,size={:d}m".format(spec.get("shm_size_mib", 4096)))
    # The kernel's modules as a node with the driver loaded shows them, in a container too (sysfs'
    # modules are the kernel's): nvidia/ always (the reset advice believes /sys/module only then),
    # nvidia_drm/ when given. `driver_module: False`: a sysfs that hides them (not mounted, masked).
    _mount("nssysmodule", "/sys/module", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    if spec.get("driver_module", True) and not wsl:
        os.makedirs("/sys/module/nvidia/holders")
        with open("/sys/module/nvidia/refcnt", "w") as f:
            f.write("0\n")
    if spec.get("nvidia_drm") is not None:
        os.makedirs("/sys/module/nvidia_drm/holders")
        with open("/sys/module/nvidia_drm/refcnt", "w") as f:
            f.write("{:d}\n".format(spec["nvidia_drm"]))
    # every host, MIG or not: the real (non-MIG) 2-GPU H200 has them, and CUDA processes
    # and NVML clients open both (tests/fixtures/h200x2-proc)
    for n in () if wsl else ("nvidia-cap1", "nvidia-cap2"):
        os.makedirs("/dev/nvidia-caps", exist_ok=True)
        _mknod("/dev/nvidia-caps/" + n)
    # /proc/driver/nvidia
    _mount("nvidia-sim", "/proc/driver", "tmpfs", 0, "mode=755,size=1m")
    # WSL2: no NVIDIA kernel driver, an empty /proc/driver (never the machine's).
    if not wsl:
        _proc_driver_nvidia(spec, cfg)
    _mount(None, "/proc/driver", None, MS_REMOUNT | MS_RDONLY)
    _setup_rest(spec, cfg, base)


def _proc_driver_nvidia(spec, cfg):
    os.makedirs("/proc/driver/nvidia/gpus")
    dv = cfg.get("driver_version", "")
    with open("/proc/driver/nvidia/version", "w") as f:
        f.write(f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {dv}  Release Build  "
                "(dvs-builder@U22-I3-AF03-09-1)  Tue Jul  8 17:52:20 UTC 2025\n"
                "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n")
    # A container given some GPUs sees the host's own files, bind-mounted (LXC's
    # `lxc.mount.entry: /proc/driver/nvidia proc/driver/nvidia none bind,ro`): a copy here.
    gpus_dir = "/proc/driver/nvidia/gpus"
    if spec.get("gpu_nodes") is not None:
        gpus_dir = os.path.join(spec["dir"], "host-proc-driver-nvidia-gpus")
        os.mkdir(gpus_dir)
    for g in cfg["gpus"]:
        loc, text = _information(cfg, g)
        os.mkdir(os.path.join(gpus_dir, loc))
        with open(os.path.join(gpus_dir, loc, "information"), "w") as f:
            f.write(text)
    if spec.get("gpu_nodes") is not None:
        _mount(gpus_dir, "/proc/driver/nvidia/gpus", None, MS_BIND)
        _mount(None, "/proc/driver/nvidia/gpus", None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def _wsl_setup(wsl, directory):
    """WSL2's kernel as Linux sees it: Microsoft's /dev/dxg (a 1:5 stand-in, as the sim's other
    nodes) and the kernel release WSL's kernel reports, bound over procfs' osrelease (the running
    kernel's, which no namespace changes: only this mount namespace sees the stand-in)."""
    _mknod("/dev/dxg")
    release = os.path.join(directory, "osrelease")
    with open(release, "w") as f:
        f.write(wsl.get("osrelease", "5.15.79.1-microsoft-standard-WSL2") + "\n")
    _mount(release, "/proc/sys/kernel/osrelease", None, MS_BIND)
    _mount(None, "/proc/sys/kernel/osrelease", None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def _setup_rest(spec, cfg, base):
    # /etc/nvidia-sim, /run/nvidia-sim, /usr/bin/{nvidia-smi,gpu_holder}
    _overlay("/etc", base)
    os.makedirs("/etc/nvidia-sim", exist_ok=True)
    shutil.copyfile(spec["config"], "/etc/nvidia-sim/config.json")
    if (cfg.get("imex") or {}).get("nodes") is not None:
        # nvidia-imex's list of the domain's nodes, root's (0644) as its package installs it.
        os.makedirs("/etc/nvidia-imex", exist_ok=True)
        with open("/etc/nvidia-imex/nodes_config.cfg", "w") as f:
            f.write("".join(node + "\n" for node in cfg["imex"]["nodes"]))
        os.chmod("/etc/nvidia-imex/nodes_config.cfg", 0o644)
    _overlay("/run", base)
    os.makedirs("/run/nvidia-sim", exist_ok=True)
    _mount(spec["state"], "/run/nvidia-sim", None, MS_BIND)
    _overlay("/usr/bin", base)
    # gpu_release writes its restore record to /var/lib/zeromib-gpu: each host has its own. The
    # overlay keeps writes private but shows the machine's own /var/lib beneath: a record there
    # (from a gpu_release run on the machine itself) would read as every host's. A fresh tmpfs
    # (root's, 0700, as _record makes it) starts each host with none (issue 33).
    _overlay("/var/lib", base)
    # The Slurm runner logs to /var/log/zeromib-gpu by default: each host's own, never the machine's.
    _overlay("/var/log", base)
    os.makedirs(RECORD_DIR, exist_ok=True)
    _mount("zeromib-record", RECORD_DIR, "tmpfs", 0, "mode=0700,size=1m")
    links = [("nvidia-smi", spec["sim"]), ("gpu_holder", spec["holder"])]
    links += [(name, spec["kernel_log"]) for name in ("journalctl", "dmesg") if spec.get("kernel_log")]
    # The simulated MPS control daemon (and client) beside gpu_holder.
    links.append(("nvidia-cuda-mps-control", os.path.join(os.path.dirname(spec["holder"]), "nvidia-cuda-mps-control")))
    if spec.get("modprobe"):
        # The machine's own modprobe (kmod) sits before /usr/bin on PATH: the fake goes over it,
        # in this mount namespace only.
        if os.path.isfile("/usr/sbin/modprobe"):
            _mount(spec["modprobe"], "/usr/sbin/modprobe", None, MS_BIND)
        else:
            links.append(("modprobe", spec["modprobe"]))
    fm = cfg.get("fabric_manager") if spec.get("fabric_manager") else None
    if fm:
        # unit null: no systemd (the machine's own systemctl answers as without systemd as PID 1);
        # binary "driver_root": only in the GPU Operator's driver root, none on the host's PATH.
        if fm.get("unit", "active") is not None:
            links.append(("systemctl", spec["fabric_manager"]))
        if fm.get("binary", "host") == "host":
            links.append(("nv-fabricmanager", spec["fabric_manager"]))
        elif fm.get("binary") == "driver_root":
            os.makedirs("/run/nvidia/driver/usr/bin", exist_ok=True)
            os.symlink(spec["fabric_manager"], "/run/nvidia/driver/usr/bin/nv-fabricmanager")
    for name, target in links:
        if os.path.lexists("/usr/bin/" + name):
            os.unlink("/usr/bin/" + name)
        os.symlink(target, "/usr/bin/" + name)
    # nvidia-smi and gpu_holder start with `#!/usr/bin/env python` (the shebang ansible-test
    # allows): give the host a `python` as Debian's python-is-python3 does, when it has none.
    if not os.path.lexists("/usr/bin/python"):
        os.symlink("python3", "/usr/bin/python")
    if spec.get("libcuda"):
        _install_libcuda(spec["libcuda"], base)


def _install_libcuda(library, base):
    """libcuda.so.1 where the NVIDIA driver's packages put it (Debian/Ubuntu: the multiarch
    directory, which the dynamic loader searches without ld.so.cache), in an overlay."""
    import sysconfig
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    libdir = "/usr/lib/" + multiarch if multiarch and os.path.isdir("/usr/lib/" + multiarch) else "/usr/lib"
    _overlay(libdir, base)
    target = os.path.join(libdir, "libcuda.so.1")
    if os.path.lexists(target):
        os.unlink(target)
    os.symlink(library, target)


def _init(spec_path):
    global _libc
    _libc = ctypes.CDLL(None, use_errno=True)
    with open(spec_path) as f:
        spec = json.load(f)
    ready = os.path.join(spec["dir"], "init.ready")
    statuses = {}
    try:
        _setup(spec)
        sock_path = os.path.join(spec["dir"], "ctl.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(sock_path)
        srv.listen(64)
    except Exception as e:  # report and die; the host side raises
        _atomic_write(ready, f"setup failed: {e!r}")
        sys.exit(1)

    def reap(*_):
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            statuses[pid] = -os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st)
            if len(statuses) > 10000:
                statuses.pop(next(iter(statuses)))

    signal.signal(signal.SIGCHLD, reap)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    _atomic_write(ready, "ok")
    while True:
        try:
            conn, _addr = srv.accept()
        except OSError:
            continue
        try:
            conn.settimeout(10)
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                buf += chunk
            req = json.loads(buf.decode())
            reap()
            if req["op"] == "spawn":
                # A reused PID (tests make the namespace reuse one) must not read the status of
                # the process that had it before.
                reply = _spawn(req, statuses)
            elif req["op"] == "status":
                pid = int(req["pid"])
                reply = {"status": statuses.get(pid)}
            else:
                reply = {"error": "unknown op"}
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except Exception as e:
            try:
                conn.sendall(json.dumps({"error": repr(e)}).encode() + b"\n")
            except Exception:
                pass
        finally:
            conn.close()


def _spawn(req, statuses=None):
    r, w = os.pipe()
    pid = os.fork()
    if statuses is not None and pid > 0:
        statuses.pop(pid, None)
    if pid == 0:
        try:
            os.close(r)
            os.setsid()
            for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                      signal.SIGPIPE):
                signal.signal(s, signal.SIG_DFL)
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            nul = os.open("/dev/null", os.O_RDONLY)
            os.dup2(nul, 0)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(req.get("cwd") or "/")
            os.set_inheritable(w, False)
            os.execvpe(req["argv"][0], req["argv"], req["env"])
        except BaseException as e:
            try:
                os.write(w, repr(e).encode())
            finally:
                os._exit(127)
    os.close(w)
    err = b""
    while True:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        err += chunk
    os.close(r)
    if err:
        return {"error": err.decode(errors="replace"), "pid": pid}
    return {"pid": pid}


# ====================================================================== CLI
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_init"]:
        _init(argv[1])
        return 0
    ap = argparse.ArgumentParser(description="simulated GPU host in namespaces")
    sub = ap.add_subparsers(dest="cmd")
    for name in ("up", "run"):
        p = sub.add_parser(name)
        p.add_argument("--preset", default="h200x8", choices=sorted(make_config.PRESETS))
        p.add_argument("--minors", help="comma list, minor of each index")
        p.add_argument("--seed")
        if name == "run":
            p.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.cmd is None:
        ap.print_help()
        return 2
    minors = [int(x) for x in a.minors.split(",")] if a.minors else None
    with NsHost(preset=a.preset, minors=minors, seed=a.seed) as host:
        if a.cmd == "run":
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            cp = host.run(cmd or ["nvidia-smi"], timeout=None)
            sys.stdout.write(cp.stdout)
            sys.stderr.write(cp.stderr)
            return cp.returncode
        print(f"host {host.seed} up in {host.start_s:.2f} s: init pid {host.init_pid}, dir {host.dir}")
        print(f"enter: nsenter -t {host.init_pid} -m -u -p -- bash      (Ctrl-C here tears it down)")
        sys.stdout.flush()
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
