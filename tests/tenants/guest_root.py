"""A system container whose root is hostile, built inside a fleet host (tests/fleet/guests.py's
guests): what the host must never execute with its own privileges, nor read without a bound.

The guest's root owns everything inside the guest: its programs (its `systemctl` at every path
the host could run), its /proc (a tmpfs with FIFOs where the kernel's files were), and what its
system manager answers (`MainPID=4321`, a PID whose /proc files are those FIFOs). Two tenants:

- `record_systemctl(fleet, host, guest)`: in a guest booted with a real systemd (guests.boot),
  the guest's root puts its own systemctl first in every PATH. It writes down, each time it runs,
  what confines it (/proc/$$/status and cgroup, beside its init's, both as the guest sees them)
  and then does the real systemctl's job, so the legitimate run still works. `records(...)` reads
  them back.
- `fifo_proc(fleet, host, name, gpu)`: a guest whose init is a shell named as systemd is (a copy
  at .../systemd), with a bounding set smaller than the host's, a tmpfs over its
  /proc with FIFOs at /proc/4321/*, a `vllm.service` process holding GPU `gpu`, and a systemctl
  that records itself, says `MainPID=4321` for any unit, and stops the server when asked.

Both act only inside the fleet host's guest (its own mount and PID namespaces); `teardown` (or
guests.teardown) ends every process through the guest's cgroups and removes its files.
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fleet"))
import guests as rig  # noqa: E402  (tests/fleet/guests.py: the guests these tenants live in)

# Where the guest's root keeps its records (inside the guest: read through its init's root).
RECORDS = "/var/lib/zeromib-tenant"
# The real systemctl, copied aside by the guest's root before it puts its own in its place.
REAL = "/usr/local/lib/zeromib-tenant/systemctl.real"
# Every directory a PATH may name before the real systemctl's.
PATHS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# The capabilities a guest manager drops from its guests' bounding set (LXC's defaults, in part).
DROPPED = "-sys_module,-sys_rawio,-mac_admin,-mac_override,-sys_time,-sys_boot"
# The PID its systemd names as every unit's main process; its /proc files are FIFOs.
FIFO_PID = 4321
FIFO_FILES = ("stat", "status", "cmdline", "comm", "environ", "cgroup", "maps", "exe", "wchan", "io")

# What the guest's systemctl records, each run: itself, then its init, as the guest sees them.
# (A guest whose /proc is a tmpfs of FIFOs keeps the kernel's view of its own PID namespace aside.)
RECORD = f"""n=$(date +%s%N)-$$
P=/proc; [ -d {RECORDS}/kernel-proc/1 ] && P={RECORDS}/kernel-proc
mkdir -p {RECORDS}
{{ echo "== self"; cat $P/$$/status; echo "== self_cgroup"; cat $P/$$/cgroup
   echo "== init"; cat $P/1/status; echo "== init_cgroup"; cat $P/1/cgroup
   echo "== argv"; echo "$*"; }} > {RECORDS}/run-$n.rec 2>&1
"""


def _sh(fleet, host: str, script: str, timeout: float = 60) -> str:
    r = fleet.ssh(host, script, timeout=timeout)
    assert r.returncode == 0, f"{host}: {script[:300]}...\nrc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def record_systemctl(fleet, host: str, guest: rig.Guest) -> None:
    """The guest's root puts its own systemctl at every PATH directory of the guest (the real one
    copied aside first): each run records what confines it, then execs the real one."""
    script = "#!/bin/sh\n" + RECORD + f'exec {REAL} "$@"\n'
    inside = (f"mkdir -p /usr/local/lib/zeromib-tenant {RECORDS} && cp /usr/bin/systemctl {REAL} && "
              + " && ".join(f"mkdir -p {d} && rm -f {d}/systemctl && printf %s {shlex.quote(script)} > {d}/systemctl && chmod 755 {d}/systemctl"
                            for d in PATHS if d not in ("/bin", "/sbin")))
    # The test acts as the guest's root: in all its namespaces (the rig's own way in, not the module's).
    _sh(fleet, host, f"nsenter -t {guest.init_pid} -a sh -c {shlex.quote(inside)}")


def unit_state(fleet, host: str, guest: rig.Guest, unit: str = "vllm.service") -> str:
    """ActiveState of a guest's unit, asked by the test (as the guest's root) with the real
    systemctl, so that the records hold only what the module ran."""
    out = fleet.ssh(host, f"nsenter -t {guest.init_pid} -a {REAL} show -p ActiveState --value {unit}").stdout
    return out.strip()


def records(fleet, host: str, guest: rig.Guest) -> list[dict[str, dict[str, str] | str]]:
    """What the guest's systemctl recorded, oldest first: [{self, init: status fields, self_cgroup,
    init_cgroup, argv}]."""
    out = _sh(fleet, host, f"cd /proc/{guest.init_pid}/root{RECORDS} 2>/dev/null && for f in $(ls run-*.rec 2>/dev/null | sort -t- -k2 -n); do "
                           "cat $f; echo '== end'; done; true")
    found: list[dict] = []
    current: dict = {}
    section = ""
    for line in out.split("\n"):
        if line.startswith("== "):
            section = line[3:]
            if section == "end":
                found.append(current)
                current = {}
            else:
                current[section] = {} if section in ("self", "init") else ""
        elif section in ("self", "init") and ":" in line:
            key, _sep, value = line.partition(":")
            current[section][key] = value.strip()
        elif section and section != "end" and line:
            current[section] += line + "\n"
    return found


def clear_records(fleet, host: str, guest: rig.Guest) -> None:
    fleet.ssh(host, f"rm -f /proc/{guest.init_pid}/root{RECORDS}/run-*.rec")


# ---------------------------------------------------------------- a guest whose /proc is FIFOs


FIFO_SYSTEMCTL = "#!/bin/sh\n" + RECORD + f"""state=$(cat {RECORDS}/state 2>/dev/null || echo active)
verb=""; units=""
for a in "$@"; do case "$a" in -*) ;; *) if [ -z "$verb" ]; then verb=$a; else units="$units $a"; fi;; esac; done
case "$verb" in
  list-units) echo "vllm.service loaded $state running vLLM of the guest";;
  list-unit-files) echo "vllm.service enabled enabled";;
  show) for u in $units; do
          [ "$state" = active ] && sub=running || sub=dead
          printf 'Id=%s\\nLoadState=loaded\\nActiveState=%s\\nSubState=%s\\nUnitFileState=enabled\\nMainPID={FIFO_PID}\\n' "$u" "$state" "$sub"
          printf 'TriggeredBy=\\nFragmentPath=/etc/systemd/system/%s\\nExecStart={{ path=/usr/bin/vllm ; argv[]=/usr/bin/vllm serve ; }}\\n\\n' "$u"
        done;;
  is-active) echo "$state"; [ "$state" = active ];;
  stop|kill) kill -KILL $(cat {RECORDS}/server.pid) 2>/dev/null; echo inactive > {RECORDS}/state;;
  start) echo active > {RECORDS}/state;;
  *) ;;
esac
exit 0
"""
# The guest's init, in the guest's PID namespace (PID 1): starts its server while it still shares the
# host's mount namespace (the simulated driver reads the host's /proc), then makes a mount namespace
# of its own with a tmpfs over /proc, FIFOs in it and its systemctl over the real one, and stays.
FIFO_INIT = """set -e
/usr/local/bin/gpu_holder --gpus {gpu} --mib {mib} </dev/null >/dev/null 2>&1 &
echo $! > {cg}/system.slice/vllm.service/cgroup.procs
echo $! > {dir}/server.pid
exec unshare --mount --propagation private sh -c {inner}
"""
FIFO_INNER = """set -e
mount -t tmpfs -o mode=0755 tenant {records}
cp {dir}/server.pid {records}/server.pid
printf %s {systemctl} > {records}/systemctl && chmod 755 {records}/systemctl
for d in {paths}; do [ -e $d/systemctl ] && mount --bind {records}/systemctl $d/systemctl || true; done
mkdir -p {records}/kernel-proc && mount -t proc proc {records}/kernel-proc
mount -t tmpfs -o mode=0755 tenant /proc
mkdir -p /proc/{pid}
for f in {files}; do mkfifo /proc/{pid}/$f; done
exec {dir}/systemd -c 'while :; do sleep 1; done'
"""


def fifo_proc(fleet, host: str, name: str, gpu: int, mib: int = 40960, timeout: float = 30) -> rig.Guest:
    """The hostile guest of the module's doc, of LXD's shape (/lxc.payload.NAME), its server in
    /lxc.payload.NAME/system.slice/vllm.service holding GPU `gpu`. Torn down on failure."""
    boundary, monitor = (path.format(name=name) for path in rig.SHAPES["lxd"])
    guest = rig.Guest("lxd", name, boundary, monitor, f"/var/lib/zeromib-guests/tenant-{name}", gpu)
    d, cg = guest.dir, rig.CG
    inner = FIFO_INNER.format(records=RECORDS, dir=d, systemctl=shlex.quote(FIFO_SYSTEMCTL), paths=" ".join(PATHS), pid=FIFO_PID,
                              files=" ".join(FIFO_FILES))
    init = FIFO_INIT.format(gpu=gpu, mib=mib, dir=d, cg=cg + boundary, inner=shlex.quote(inner))
    launch = (f"#!/bin/sh\nset -e\necho $$ > {cg}{boundary}/init.scope/cgroup.procs\n"
              f"(sleep 0.5; echo $$ > {cg}{monitor}/cgroup.procs) &\n"
              f"exec setpriv --bounding-set={DROPPED} -- unshare --pid --cgroup --uts --fork sh {d}/init.sh </dev/null >{d}/console.log 2>&1\n")
    setup = (f"mkdir -p {d} {RECORDS} && cp /bin/sh {d}/systemd && printf %s {shlex.quote(init)} > {d}/init.sh && "
             f"printf %s {shlex.quote(launch)} > {d}/launch.sh && chmod +x {d}/launch.sh && "
             f"mkdir -p {cg}{boundary}/init.scope {cg}{boundary}/system.slice/vllm.service {cg}{monitor} && "
             f"(setsid {d}/launch.sh </dev/null >/dev/null 2>&1 &)")
    try:
        _sh(fleet, host, setup)
        guest.init_pid = rig._wait_init(fleet, host, guest, timeout)  # pylint: disable=protected-access
        deadline = time.monotonic() + timeout
        rig.wait_gpu(fleet, host, gpu, lambda used: used >= 1000, timeout)
        # Ready when its /proc is the FIFOs' (the init has exec'd into its own mount namespace).
        while fleet.ssh(host, f"test -p /proc/{guest.init_pid}/root/proc/{FIFO_PID}/status").returncode != 0:
            assert time.monotonic() < deadline, f"tenant guest {name}: no FIFOs after {timeout} s"
            time.sleep(0.2)
    except BaseException:
        teardown(fleet, host, guest)
        raise
    return guest


def teardown(fleet, host: str, guest: rig.Guest) -> None:
    """Every process of the guest ended through its cgroups, its cgroups and files removed (the
    FIFOs and mounts go with its mount namespace)."""
    rig.teardown(fleet, host, [guest])
    fleet.ssh(host, f"rm -rf {shlex.quote(guest.dir)}; rmdir {RECORDS} 2>/dev/null; true")
