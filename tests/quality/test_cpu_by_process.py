"""tests/tools/cpu_by_process.py: the record decoding and the process tree (pure logic, on records
built here), and one real run with the kernel's process accounting, in a PID namespace of its own
(accounting is one per namespace: a run of its own must not take it from a profile of the suite)."""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tests" / "tools" / "cpu_by_process.py"
_spec = importlib.util.spec_from_file_location("cpu_by_process", TOOL)
cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu)


def record(pid, ppid, comm, ticks, fork_only=False, version=3):
    """One acct_v3 record as the kernel writes it (times in 1/100 s, comp_t-encoded)."""
    return cpu.RECORD.pack(0x01 if fork_only else 0, version, 0, 0, 0, 0, pid, ppid, 0, 0.0,
                           encode_comp_t(ticks), 0, 0, 0, 0, 0, 0, 0, comm.encode())


def encode_comp_t(value):
    exponent = 0
    while value > 0x1FFF:
        value >>= 3
        exponent += 1
    return (exponent << 13) | value


def test_comp_t_decodes_mantissa_and_base_8_exponent():
    assert cpu.comp_t(0x1FFF) == 8191
    assert cpu.comp_t((1 << 13) | 1000) == 8000
    assert cpu.comp_t((2 << 13) | 3) == 192


def test_records_give_name_parent_cpu_and_fork_only():
    data = record(10, 1, "ansible-playboo", 137) + record(11, 10, "ansible-playboo", 4, fork_only=True)
    recs = cpu.records(data)
    assert recs == [{"pid": 10, "ppid": 1, "comm": "ansible-playboo", "cpu_s": 1.37, "fork_only": False},
                    {"pid": 11, "ppid": 10, "comm": "ansible-playboo", "cpu_s": 0.04, "fork_only": True}]


def test_a_record_of_another_version_is_refused_not_misread():
    with pytest.raises(ValueError, match="not a v3 accounting record"):
        cpu.records(record(10, 1, "sh", 1, version=2))


def test_descendants_follow_reused_pids_to_the_right_parent():
    # 200 (the root's child) starts 300, which exits; later PID 300 is reused by a process of
    # someone else whose child 301 must not be counted.
    recs = cpu.records(record(300, 200, "nvidia-smi", 5) + record(200, 100, "make", 1)
                       + record(301, 300, "stranger", 50) + record(300, 1, "stranger", 50)
                       + record(100, 99, "python3", 0))
    found = cpu.descendants(recs, 100)
    assert sorted(r["comm"] for r in found) == ["make", "nvidia-smi"]


def test_a_record_of_the_live_root_does_not_take_its_children():
    recs = cpu.records(record(200, 100, "sh", 1) + record(100, 99, "python3", 0) + record(201, 100, "ls", 1))
    assert sorted(r["comm"] for r in cpu.descendants(recs, 100)) == ["ls", "sh"]


def test_rows_by_program_most_cpu_first_with_exec_median_and_forks_apart():
    recs = cpu.records(record(2, 1, "python", 4) + record(3, 1, "python", 6) + record(4, 1, "python", 50)
                       + record(5, 1, "ansible-playboo", 140) + record(6, 5, "ansible-playboo", 5, fork_only=True))
    rows = cpu.by_program(recs)
    assert [r["program"] for r in rows] == ["ansible-playboo", "python"]
    assert rows[0] == {"program": "ansible-playboo", "processes": 2, "cpu_s": 1.45, "share": round(1.45 / 2.05, 4),
                       "execd": 1, "execd_median_ms": 1400, "fork_only": 1, "fork_only_cpu_s": 0.05}
    assert rows[1]["execd_median_ms"] == 60 and rows[1]["processes"] == 3
    text = cpu.table(rows, top=1)
    assert "| `ansible-playboo` | 2 | 1.4 s | 70.7 % | 1400 ms | 1 (0.1 s) |" in text
    assert "| 1 others | 3 | 0.6 s | 29.3 % | | |" in text


needs_acct = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or
                                "CONFIG_BSD_PROCESS_ACCT=y" not in (subprocess.run(
                                    ["sh", "-c", "zcat /proc/config.gz 2>/dev/null || cat /boot/config-$(uname -r) 2>/dev/null"],
                                    capture_output=True, text=True, check=False).stdout),
                                reason="needs root, unshare and a kernel with process accounting")


@needs_acct
def test_a_real_run_counts_short_lived_children_orphans_and_the_exit_status(tmp_path):
    out = tmp_path / "rows.json"
    # A burner, a short-lived child, and an orphan whose parent exits first (adopted by the tool).
    # The orphan burns a span of its own CPU time, not a count of steps: accounting samples CPU in
    # clock ticks, and CI's machine ran 3 * 10**6 steps with none counted (0.0 s). The shell then
    # waits until the orphan is a zombie (its record is written on exit, before that), where a
    # fixed sleep can be outrun by a loaded machine.
    script = ("import os, sys, time\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    start = time.process_time()\n"
              "    while time.process_time() - start < 0.2: pass\n"
              "    os._exit(0)\n"
              "open(sys.argv[1], 'w').write(str(pid))\n")
    command = ["sh", "-c", f"{sys.executable} -c 'sum(range(5 * 10**6))'; /bin/true; "
                           f"{sys.executable} -c \"$0\" \"$1\"; pid=$(cat \"$1\"); "
                           "until [ ! -e /proc/$pid ] || grep -q ') Z ' /proc/$pid/stat; do sleep 0.02; done; exit 7",
               script, str(tmp_path / "orphan.pid")]
    # Not the namespace's PID 1 (a shell is, and keeps running: `; exit $?`), so that the orphan is
    # the tool's only by its being the subreaper, as when it runs on a machine.
    tool = shlex.join([sys.executable, str(TOOL), "--json", str(out), "--", *command])
    # --mount-proc: /proc/$pid above must be the namespace's PID.
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", f"{tool}; exit $?"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 7, proc.stdout + proc.stderr
    rows = {r["program"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["true"]["processes"] == 1
    python = [r for name, r in rows.items() if name.startswith("python")]
    assert sum(r["execd"] for r in python) >= 2, rows
    assert sum(r["fork_only"] for r in python) == 1, rows          # the orphan, counted
    assert sum(r["fork_only_cpu_s"] for r in python) > 0, rows
    assert "COMMAND and its descendants:" in proc.stdout and "COMMAND's rc 7" in proc.stdout


def test_no_command_is_a_usage_error_naming_it():
    proc = subprocess.run([sys.executable, str(TOOL), "--"], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "no COMMAND given" in proc.stderr


@needs_acct
def test_a_command_that_cannot_run_is_named_not_a_traceback():
    proc = subprocess.run(["unshare", "--pid", "--fork", sys.executable, str(TOOL), "--", "/nonexistent/tool"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 127 and "cannot run /nonexistent/tool" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
