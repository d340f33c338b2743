"""A real Docker Engine on a simulated GPU host, for tests/integration/test_container_engines.py.

The rig (found to work on this machine kind; TEST_RIGS.md "Docker Engine"):

* An NsHost (tests/sim/nshost.py) is the GPU node: its /dev holds the simulated /dev/nvidia*
  nodes, its /run the simulator's state, and the simulated nvidia-smi and gpu_release run in it.
* Debian's `dockerd` (docker.io) runs INSIDE that host's namespaces, started by its init like
  a system daemon: its own --data-root and --exec-root under the host's temp dir, its socket at
  /run/docker.sock of the host (an overlay private to the namespace, so gpu_release finds it
  where it would on a node), --iptables=false --ip-masq=false --bridge=none, containers on
  --network none. The machine's own Docker (if any), firewall and networks are never touched.
  It is stopped by its PID (SIGTERM, then SIGKILL), and the namespace's end kills the rest.
* The image is built locally with `docker import` from a root filesystem of a few empty dirs and
  the usr-merge links; the host's /usr (its python3) and tests/sim are bind-mounted read-only, so
  the container's process is the simulator's gpu_holder, unchanged.
* The container gets the simulated nodes by bind mount (-v /dev/nvidia0:/dev/nvidia0), as
  libnvidia-container (docker --gpus) mounts them: the simulated nodes are all char 1:5 and are
  known by their inode (the real driver's by their device number 195:N, which a --device node
  mknod'ed by runc keeps; a 1:5 node of its own would be /dev/zero to gpu_release and to the
  simulator alike). The simulator's config and state come with -v; the container shares the
  host's PID namespace (--pid=host): gpu_holder registers its context under its own PID, and
  the simulated nvidia-smi, running on the host like the real one, must see the same PID the
  driver would report (a container's PIDs as the host sees them).
* With the cgroupfs driver (no systemd here) a container's processes sit in /docker/<id>, the
  layout of Docker on cgroup v1 nodes; --cgroup-parent=/kubepods/burstable/pod<uid> gives the
  layout of the kubelet with dockershim. Those cgroups live in the machine's cgroup tree (the
  namespace has no cgroup namespace): teardown removes the ones the rig's containers had, by id.
* Podman (Debian's podman 4.3, rootful, no daemon) runs the same way in its own NsHost
  (PodmanHost): its storage on a tmpfs mounted over /var/lib inside the namespace, its
  containers.conf (cgroupfs, file events: there is no systemd in the namespace) in the
  namespace's /etc, so the podman CLI that gpu_release runs finds them at their default paths.
  Its containers sit in /libpod_parent/libpod-<id>.
"""
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SIM_DIR = os.path.join(os.path.dirname(HERE), "sim")
DOCKERD = "/usr/sbin/dockerd"
DOCKER = "/usr/bin/docker"
PODMAN = "/usr/bin/podman"
SOCKET = "/run/docker.sock"
IMAGE = "zeromib/holder:test"
CGROUP_ROOT = "/sys/fs/cgroup"


def missing(paths=(DOCKERD, DOCKER)):
    """Why the rig cannot run here, or None."""
    for path in paths:
        if not os.access(path, os.X_OK):
            return "{} not found: install Debian's {} (tests/tools/apt-deps.sh does)".format(path, "podman" if path == PODMAN else "docker.io")
    return None


class DockerError(RuntimeError):
    pass


class DockerHost:
    """dockerd inside an NsHost. `host` is the NsHost; `docker(*args)` runs the CLI inside it."""

    # The cgroup of a container: <parent>/<prefix><id> (cgroupfs driver).
    CGROUP_PARENT, CGROUP_PREFIX = "docker", ""
    CGROUP_CHILDREN = ()  # cgroups the engine makes under its parent besides its containers'

    def __init__(self, host):
        self.host = host
        self.base = os.path.join(host.dir, self.CGROUP_PARENT)
        self.pid = None
        self.created = []  # container ids, for teardown of their cgroups
        self.cgroups = []  # extra cgroup dirs made by a test (kubepods), removed at teardown
        self._had_parent_cgroup = {h: os.path.isdir(os.path.join(CGROUP_ROOT, h, self.CGROUP_PARENT)) for h in _hierarchies()}

    # ------------------------------------------------------------ daemon
    def contain(self):
        """A tmpfs over /var/lib inside the namespace: what a container engine (or gpu_release's
        podman CLI) writes at its default paths stays there (the namespace's /etc and /run are
        overlays already)."""
        if getattr(self, "_contained", False):
            return
        result = self.host.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "zeromib-rig", "/var/lib"])
        if result.returncode != 0:
            raise DockerError(f"mount tmpfs on /var/lib: {result.stderr}")
        self._contained = True

    def start(self, timeout=60):
        self.contain()
        for sub in ("data", "exec", "logs"):
            os.makedirs(os.path.join(self.base, sub), exist_ok=True)
        log = os.path.join(self.base, "logs", f"dockerd-{int(time.time() * 1000)}.log")
        argv = [DOCKERD, "--data-root", os.path.join(self.base, "data"), "--exec-root", os.path.join(self.base, "exec"),
                "-H", "unix://" + SOCKET, "--pidfile", os.path.join(self.base, "dockerd.pid"),
                "--iptables=false", "--ip-masq=false", "--bridge=none", "--shutdown-timeout=2"]
        proc = self.host.spawn(["sh", "-c", f'exec "$@" >>{log} 2>&1', "dockerd"] + argv, ready=False)
        self.pid = proc.pid
        started = time.monotonic()
        while True:
            if self.docker("version", "--format", "{{.Server.Version}}", check=False).returncode == 0:
                break
            if not self.host.alive(self.pid) or time.monotonic() - started > timeout:
                raise DockerError(f"dockerd did not come up: {_tail(log)}")
            time.sleep(0.1)
        self.start_s = time.monotonic() - started
        return self

    def stop(self, timeout=20):
        """Stop our dockerd by its PID: SIGTERM (it stops its containers), SIGKILL if it lingers."""
        if self.pid is None:
            return
        self.host.kill(self.pid, signal.SIGTERM)
        if not self.host.wait_gone(self.pid, timeout):
            self.host.kill(self.pid, signal.SIGKILL)
            self.host.wait_gone(self.pid, 5)
        self.pid = None

    def restart(self):
        self.stop()
        return self.start()

    def teardown(self):
        """Everything this rig made outside the namespace: the cgroups of its containers (the
        namespace's end takes the processes, mounts and files)."""
        try:
            if self.pid is not None and self.host.init_pid:
                for cid in self.ids():
                    if cid not in self.created:
                        self.created.append(cid)
                self.stop()
        except Exception:  # noqa: BLE001 - teardown goes on; the namespace's end kills what is left
            pass

    def remove_cgroups(self):
        """After the namespace is gone: rmdir the (now empty) cgroups of our containers and the
        test's kubepods paths, deepest first, and /docker where the rig created it. rmdir only
        ever removes an empty cgroup: nothing of anyone else's can go."""
        for hierarchy in _hierarchies():
            root = os.path.join(CGROUP_ROOT, hierarchy)
            paths = []
            for cid in self.created:
                paths.append(os.path.join(root, self.CGROUP_PARENT, self.CGROUP_PREFIX + cid))
                paths += [os.path.join(root, p.strip("/"), cid) for p in self.cgroups]
            for extra in self.cgroups:
                parts = extra.strip("/").split("/")
                paths += [os.path.join(root, *parts[:n]) for n in range(len(parts), 0, -1)]
            if not self._had_parent_cgroup.get(hierarchy):
                # Podman's conmon cgroup under its parent (made at its first container), then the parent.
                paths += [os.path.join(root, self.CGROUP_PARENT, child) for child in self.CGROUP_CHILDREN]
                paths.append(os.path.join(root, self.CGROUP_PARENT))
            for path in paths:
                _rmdir(path)

    # ------------------------------------------------------------ CLI
    def cli(self):
        return [DOCKER, "-H", "unix://" + SOCKET]

    def docker(self, *args, check=True, timeout=60):
        result = self.host.run(self.cli() + list(args), timeout=timeout)
        if check and result.returncode != 0:
            raise DockerError("docker {}: rc {}: {}".format(" ".join(args), result.returncode, result.stderr.strip()))
        return result

    def ids(self):
        return self.docker("ps", "-a", "-q", "--no-trunc").stdout.split()

    def inspect(self, name):
        return json.loads(self.docker("inspect", "--type", "container", name).stdout)[0]

    def build_image(self):
        root = tempfile.mkdtemp(prefix="rootfs-", dir=self.base)
        for sub in ("usr", "etc", "run", "proc", "sys", "dev", "tmp", "root"):
            os.makedirs(os.path.join(root, sub))
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
            os.symlink(target, os.path.join(root, link))
        result = self.host.run(["sh", "-c", "tar -C {} -c . | {} import - {}".format(root, " ".join(self.cli()), IMAGE)], timeout=120)
        shutil.rmtree(root, ignore_errors=True)
        if result.returncode != 0:
            raise DockerError(f"docker import: {result.stderr}")

    def run_holder(self, name, gpus, mib=20480, restart="always", holder_args=(), run_args=(), ready=True, timeout=30):
        """`docker run -d` a gpu_holder on `gpus` (indexes); waits for its CUDA init. Returns
        the container's inspect record."""
        config = self.host.config
        nodes = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
        for index in gpus:
            minor = [g for g in config["gpus"] if g["index"] == int(index)][0]["minor"]
            nodes.append(f"/dev/nvidia{minor}")
        devices = []
        for node in nodes:
            devices += ["-v", f"{node}:{node}"]
        ready_file = f"/run/nvidia-sim/ready-{name}.json"
        argv = ["run", "-d", "--name", name, f"--restart={restart}", "--pid=host", "--network=none"] + devices + [
            "-v", "/usr:/usr:ro", "-v", f"{SIM_DIR}:{SIM_DIR}:ro", "-v", "/etc/nvidia-sim:/etc/nvidia-sim:ro",
            "-v", "/run/nvidia-sim:/run/nvidia-sim"] + list(run_args) + [
            IMAGE, "python3", os.path.join(SIM_DIR, "gpu_holder"), "--gpus", ",".join(str(g) for g in gpus), "--mib", str(mib),
            "--ready-file", ready_file] + list(holder_args)
        cid = self.docker(*argv).stdout.strip().splitlines()[-1]
        self.created.append(cid)
        if ready:
            self.wait_ready(name, timeout)
        return self.inspect(cid)

    def ready_info(self, name):
        try:
            with open(os.path.join(self.host.root.state, f"ready-{name}.json")) as handle:
                return json.load(handle)
        except (OSError, ValueError):
            return None

    def wait_ready(self, name, timeout=30, not_pid=None):
        """Wait until the holder of container `name` has done its CUDA init (again, when
        `not_pid` is the PID of the previous run). Returns its PID."""
        started = time.monotonic()
        while True:
            info = self.ready_info(name)
            if info and info["pid"] != not_pid and self.host.alive(info["pid"]):
                return info["pid"]
            if time.monotonic() - started > timeout:
                raise DockerError("container {}: holder not ready after {} s: {}".format(
                    name, timeout, self.docker("logs", name, check=False).stderr[-2000:]))
            time.sleep(0.02)

    def remove_all(self):
        """Remove every container of this daemon (all of them are the rig's)."""
        ids = self.ids()
        if ids:
            self.docker("rm", "-f", *ids, check=False)

    def make_cgroup(self, path, host_pid):
        """Put a process (host PID) into cgroup `path` of the name=systemd hierarchy (the one
        gpu_facts reads on this cgroup v1 machine) and of the unified one where it is mounted."""
        self.cgroups.append(path)
        placed = False
        for hierarchy in _hierarchies():
            if hierarchy not in ("systemd", "unified"):
                continue
            directory = os.path.join(CGROUP_ROOT, hierarchy, path.strip("/"))
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "cgroup.procs"), "w") as handle:
                handle.write(f"{host_pid}\n")
            placed = True
        if not placed:
            raise DockerError(f"no name=systemd or unified cgroup hierarchy under {CGROUP_ROOT}")


class PodmanHost(DockerHost):
    """Podman inside an NsHost, at its default paths there (no daemon: start() configures it)."""

    CGROUP_PARENT, CGROUP_PREFIX = "libpod_parent", "libpod-"
    CGROUP_CHILDREN = ("conmon",)
    CONF = "[engine]\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\nruntime = \"runc\"\n"

    def start(self, timeout=60):
        if self.pid is None:
            self.contain()
            os.makedirs(self.base, exist_ok=True)
            result = self.host.run(["sh", "-c", "mkdir -p /etc/containers && cat > /etc/containers/containers.conf"], input=self.CONF)
            if result.returncode != 0:
                raise DockerError(f"podman setup: {result.stderr}")
            self.pid = 0
        return self

    def stop(self, timeout=20):
        pass

    def cli(self):
        return [PODMAN]

    def teardown(self):
        try:
            if self.host.init_pid:
                self.created += [cid for cid in self.ids() if cid not in self.created]
                self.docker("rm", "-f", "-t", "0", "--all", check=False)
        except Exception:  # noqa: BLE001 - the namespace's end kills what is left
            pass


def _hierarchies():
    try:
        return sorted(n for n in os.listdir(CGROUP_ROOT) if os.path.isdir(os.path.join(CGROUP_ROOT, n)) and not os.path.islink(os.path.join(CGROUP_ROOT, n)))
    except OSError:
        return []


def _rmdir(path):
    for _try in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # busy: a process just killed is still being reaped
            time.sleep(0.02)


def _tail(path):
    try:
        with open(path, errors="replace") as handle:
            return handle.read()[-3000:]
    except OSError:
        return ""


def used(host, index):
    out = host.smi("-i", str(index), "--query-gpu=memory.used", "--format=csv,noheader,nounits").stdout
    return int(out.strip())


def rig_missing():
    """Why a Docker test cannot run here (root, util-linux, dockerd and docker), or None."""
    if os.geteuid() != 0:
        return "simulated hosts and dockerd need root"
    if not (shutil.which("unshare") and shutil.which("nsenter")):
        return "util-linux unshare/nsenter not found"
    return missing()


@contextlib.contextmanager
def docker_node(preset, seed):
    """The Docker tests' one rig: a simulated namespace host (tests/sim/nshost, PRESET's GPUs) running
    a real dockerd with the holder image built; dockerd, the host and then its cgroups are torn down
    whatever happens. Skips the test where the rig cannot run here."""
    reason = rig_missing()
    if reason:
        pytest.skip(reason)
    from nshost import NsHost  # tests/sim, on sys.path beside this file's importers
    host = NsHost(preset=preset, seed=seed)
    dockerd = None
    try:
        host.start()
        dockerd = DockerHost(host)
        dockerd.start()
        dockerd.build_image()
        yield dockerd
    finally:
        if dockerd is not None:
            dockerd.teardown()
        host.stop()
        if dockerd is not None:
            dockerd.remove_cgroups()
