"""Where a command's CPU goes, by program (issue 34): every process it starts, however short-lived.

    sudo python3 tests/tools/cpu_by_process.py [--top N] [--all] [--json OUT.json] -- COMMAND [ARG...]

`/proc/stat` around a run says how much CPU it took, not who took it; a sampler of /proc misses
what lives less than its period, and the suite's cost is thousands of short processes
(ansible-playbook runs, modules on simulated hosts, simulated nvidia-smi calls). The kernel's
process accounting (acct(2), BSD v3 records) writes one record for every process that exits:
its name (comm, 15 characters), parent, user and system CPU time. This script turns accounting
on into a file of its own, runs COMMAND, turns it off again (also on failure), and prints CPU by
program name, for COMMAND's descendants only (--all: every process of the machine that exited
meanwhile).

Reading the table: a `#!` script is named after the script (`ansible-playboo`), `env python`
after the interpreter (`python`); a forked worker that never exec'd keeps its parent's name and
is counted under "fork only"; a process that exec'd several times is named by its last program.
A process still running when COMMAND ends (a daemon it left) has no record.

Accounting is one per PID namespace, and a later acct(2) call takes it over: run one at a time
(the suite's own test of this script runs it in a PID namespace of its own for that reason).
Needs root and a kernel with CONFIG_BSD_PROCESS_ACCT. Stdlib only.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime
# (float), utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t each), comm[16].
RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")
ACCT_VERSION = 3
AFORK = 0x01  # the process forked and never exec'd
AHZ = 100     # comp_t times are in units of 1/AHZ s


def comp_t(value: int) -> int:
    """The integer a comp_t holds: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 0x7))


def records(data: bytes) -> list[dict]:
    """The v3 records of an accounting file's DATA, in the order the kernel wrote them."""
    out = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        (flag, version, _tty, _exit, _uid, _gid, pid, ppid, _btime, _etime, utime, stime,
         *_rest, comm) = RECORD.unpack_from(data, offset)
        if version & 0x0F != ACCT_VERSION:
            raise ValueError(f"not a v3 accounting record at byte {offset} (version {version})")
        out.append({"pid": pid, "ppid": ppid, "comm": comm.split(b"\0", 1)[0].decode("ascii", "replace"),
                    "cpu_s": (comp_t(utime) + comp_t(stime)) / AHZ, "fork_only": bool(flag & AFORK)})
    return out


def descendants(recs: list[dict], root: int) -> list[dict]:
    """The records of ROOT's descendants (ROOT itself still running). The kernel writes a record
    when a process exits and names the parent it had then, so a process's children are the
    records naming its PID written since that PID last exited: PIDs are reused within a long run
    (pid_max is often 32768). An orphan is named after the process that adopted it (a subreaper,
    or PID 1 outside ROOT's tree, then it is left out)."""
    waiting = defaultdict(list)  # pid -> records of its children, until that pid's own record
    for rec in recs:
        # ROOT is alive throughout: a record of its PID (seen for the process that called acct(2)
        # itself, once it has started a child) is not a parent that took its children away.
        rec = dict(rec, children=[] if rec["pid"] == root else waiting.pop(rec["pid"], []))
        waiting[rec["ppid"]].append(rec)
    found, todo = [], list(waiting.get(root, ()))
    while todo:
        rec = todo.pop()
        todo.extend(rec.pop("children"))
        found.append(rec)
    return found


def by_program(recs: list[dict]) -> list[dict]:
    """Rows by program name, most CPU first: processes, CPU, the median of the exec'd ones."""
    groups = defaultdict(list)
    for rec in recs:
        groups[rec["comm"]].append(rec)
    total = sum(r["cpu_s"] for r in recs) or 1.0
    rows = []
    for comm, members in groups.items():
        execd = [r["cpu_s"] for r in members if not r["fork_only"]]
        forks = [r["cpu_s"] for r in members if r["fork_only"]]
        cpu = sum(execd) + sum(forks)
        rows.append({"program": comm, "processes": len(members), "cpu_s": round(cpu, 2),
                     "share": round(cpu / total, 4), "execd": len(execd),
                     "execd_median_ms": round(1000 * statistics.median(execd)) if execd else None,
                     "fork_only": len(forks), "fork_only_cpu_s": round(sum(forks), 2)})
    return sorted(rows, key=lambda row: (-row["cpu_s"], row["program"]))


def table(rows: list[dict], top: int) -> str:
    lines = ["| program | processes | CPU | share | median, exec'd | fork only (CPU) |", "|---|---|---|---|---|---|"]
    for row in rows[:top]:
        median = "-" if row["execd_median_ms"] is None else f"{row['execd_median_ms']} ms"
        lines.append(f"| `{row['program']}` | {row['processes']} | {row['cpu_s']:.1f} s | {100 * row['share']:.1f} % | "
                     f"{median} | {row['fork_only']} ({row['fork_only_cpu_s']:.1f} s) |")
    if len(rows) > top:
        rest = rows[top:]
        lines.append(f"| {len(rest)} others | {sum(r['processes'] for r in rest)} | {sum(r['cpu_s'] for r in rest):.1f} s "
                     f"| {100 * sum(r['share'] for r in rest):.1f} % | | |")
    return "\n".join(lines)


def set_accounting(path: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(path.encode() if path else None) != 0:
        err = ctypes.get_errno()
        what = "turn process accounting on" if path else "turn process accounting off"
        hint = " (needs root and CONFIG_BSD_PROCESS_ACCT)" if err in (1, 38) else ""
        raise OSError(err, f"cannot {what}: {os.strerror(err)}{hint}")


PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> None:
    """Become the subreaper of what COMMAND starts: a process whose parent exits first (a daemon's
    double fork, a worker outliving its pool) is then adopted here, so its record names this
    process and it counts as COMMAND's, instead of PID 1's."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_until(pid: int) -> int:
    """Wait for PID, reaping the orphans adopted meanwhile (zombies would hold their PIDs);
    return PID's exit status as subprocess gives it."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            raise RuntimeError(f"process {pid} was not a child of this one") from None
        if done == pid:
            break
    while True:  # the orphans already gone; those still running are left running
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--top", type=int, default=20, help="rows to print (default 20)")
    parser.add_argument("--all", action="store_true", help="every process that exited meanwhile, not only COMMAND's")
    parser.add_argument("--json", help="write every row to this file too")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND given (put it after --)")
    with tempfile.TemporaryDirectory(prefix="cpu-by-process-") as tmp:
        log = os.path.join(tmp, "acct")
        with open(log, "wb"):
            pass
        try:
            set_accounting(log)
        except OSError as exc:
            print(f"cpu_by_process: {exc.strerror}", file=sys.stderr)
            return 2
        adopt_orphans()
        started = time.monotonic()
        try:
            proc = subprocess.Popen(command)
            rc = reap_until(proc.pid)
        except OSError as exc:  # COMMAND not found or not executable
            print(f"cpu_by_process: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
            return 127
        finally:
            set_accounting(None)
        wall = time.monotonic() - started
        with open(log, "rb") as handle:
            recs = records(handle.read())
    chosen = recs if args.all else descendants(recs, os.getpid())
    rows = by_program(chosen)
    print(f"\n{'every process' if args.all else 'COMMAND and its descendants'}: {len(chosen)} processes, "
          f"{sum(r['cpu_s'] for r in chosen):.1f} s of CPU, {wall:.1f} s wall, COMMAND's rc {rc}")
    print(table(rows, args.top))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"wall_s": round(wall, 2), "rc": rc, "rows": rows}, handle, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
