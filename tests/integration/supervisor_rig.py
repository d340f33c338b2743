"""Debian's `supervisor` package (supervisord 4.2.5) running inside a namespace host.

The .deb is fetched once with `apt-get download supervisor` into .build/supervisor/ and unpacked
there with `dpkg -x` (nothing is installed on this machine). Inside the host, /usr/bin/supervisord
and /usr/bin/supervisorctl are two-line wrappers (in the host's /usr/bin overlay) that run the
package's own scripts with its Python package on PYTHONPATH; its configuration lives in the host's
/etc overlay and its socket and logs in the host's /run, so the machine's own files are untouched.
supervisord runs in the foreground (`-n`), started by the namespace's init, as root: as
supervisor.service runs it on Debian."""
import fcntl
import glob
import os
import shutil
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(REPO, ".build", "supervisor")

MAIN_CONF = """[unix_http_server]
file=/run/supervisor.sock
chmod=0700

[supervisord]
logfile=/run/supervisor-log/supervisord.log
pidfile=/run/supervisord.pid
childlogdir=/run/supervisor-log

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix:///run/supervisor.sock

[include]
files = /etc/supervisor/conf.d/*.conf
"""

PROGRAM = """[program:{name}]
command={command}
autostart=true
autorestart=true
startsecs=0
stopwaitsecs=5
"""


def program_section(name, program):
    """A program's section: `program` is its command, or {command, option: value} for more
    (numprocs, process_name: copies of one program, as `[program:trainer]` with numprocs=2)."""
    if isinstance(program, str):
        return PROGRAM.format(name=name, command=program)
    options = dict(program)
    text = PROGRAM.format(name=name, command=options.pop("command"))
    return text + "".join(f"{key}={value}\n" for key, value in options.items())


def unpacked():
    """The unpacked package root, fetching and unpacking it the first time."""
    root = os.path.join(CACHE, "root")
    if os.path.exists(os.path.join(root, "usr", "bin", "supervisord")):
        return root
    os.makedirs(CACHE, exist_ok=True)
    # Parallel test workers (pytest-xdist) may all get here first on a fresh checkout: one fetches
    # and unpacks, the others wait for it and find the root.
    with open(os.path.join(CACHE, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(root, "usr", "bin", "supervisord")):
            return root
        debs = glob.glob(os.path.join(CACHE, "supervisor_*.deb"))
        if not debs:
            got = subprocess.run(["apt-get", "download", "supervisor"], cwd=CACHE, capture_output=True, text=True,
                                 check=False)
            debs = glob.glob(os.path.join(CACHE, "supervisor_*.deb"))
            if not debs:
                raise AssertionError("cannot fetch Debian's supervisor package (apt-get download supervisor): "
                                     f"{got.stderr[-500:]}")
        shutil.rmtree(root + ".tmp", ignore_errors=True)  # left by a run killed while unpacking
        subprocess.run(["dpkg", "-x", debs[0], root + ".tmp"], check=True)
        os.rename(root + ".tmp", root)
    return root


LOG = "/run/supervisor-log/supervisord.log"


class Supervisord:
    """supervisord in a host, with programs (each in its file, see program_section) and `groups` ({group: [program]},
    in a file of their own); `ctl(...)` runs supervisorctl there. A program of a group is
    `group:program` to supervisorctl."""

    def __init__(self, host, programs, groups=None):
        self.host = host
        self.root = unpacked()
        site = os.path.join(self.root, "usr", "lib", "python3", "dist-packages")
        script = f"#!/bin/sh\nPYTHONPATH={site} exec /usr/bin/python3 {self.root}/usr/bin/{{tool}} \"$@\"\n"
        files = {"/usr/bin/supervisord": script.format(tool="supervisord"),
                 "/usr/bin/supervisorctl": script.format(tool="supervisorctl"),
                 "/etc/supervisor/supervisord.conf": MAIN_CONF}
        for name, program in programs.items():
            files[f"/etc/supervisor/conf.d/{name}.conf"] = program_section(name, program)
        if groups:
            files["/etc/supervisor/conf.d/groups.conf"] = "".join(
                f"[group:{group}]\nprograms={','.join(members)}\n\n" for group, members in groups.items())
        for path, text in files.items():
            self.write(path, text, mode="0755" if path.startswith("/usr/bin/") else "0644")
        host.run(["mkdir", "-p", "/run/supervisor-log"], check=True)
        self.start()

    def write(self, path, text, mode="0644"):
        self.host.run(["sh", "-c", f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode} "$1"', "sh", path], input=text, check=True)

    def read(self, path):
        return self.host.run(["cat", path], check=True).stdout

    def start(self):
        self.proc = self.host.spawn(["/usr/bin/supervisord", "-n", "-c", "/etc/supervisor/supervisord.conf"])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.ctl("pid").stdout.strip().isdigit():
                return
            time.sleep(0.1)
        raise AssertionError(f"supervisord did not answer: {self.proc.output()}")

    def stop(self):
        """Ends supervisord as its unit would (SIGTERM: it stops its programs first)."""
        self.host.kill(self.proc.pid, 15)
        assert self.host.wait_gone(self.proc.pid, 15)

    def ctl(self, *args):
        return self.host.run(["/usr/bin/supervisorctl", "-c", "/etc/supervisor/supervisord.conf"] + list(args))

    def state(self, name):
        for line in self.ctl("status", name).stdout.splitlines():
            if line.split() and line.split()[0] == name:
                return line.split()[1]
        return None

    def log(self):
        """supervisord's own log (every spawn and stop of a program), all runs of it appended."""
        return self.read(LOG)

    def pid_of(self, name):
        out = self.ctl("pid", name).stdout.strip()
        return int(out) if out.isdigit() and out != "0" else None
