"""A user's crash in a file named like an NVIDIA driver message (issue 54), through real Ansible and
the Slurm epilog on a simulated host: a forged Xid never makes a healthy GPU fatal, a forged
driver load never hides a real Xid.

The crashes are real: uid 4242, inside the simulated host, copies a small C program (it writes to
address 0) to a file of its own named like a driver message and runs it; the kernel's segfault
report quotes the name (and, as the comm, its first 15 bytes). The report is read back from this
machine's /dev/kmsg and given, exactly as the kernel wrote it, to the simulated kernel log
(tests/sim/kernel-log `kernel_messages`), which prints it as journalctl and dmesg print a record
(tests/fixtures/kernel-log/segfault-linux-6.18). Where /dev/kmsg cannot be read or the kernel
logs no report (debug.exception-trace off), the report is written in the kernel's documented
format instead (arch/x86/mm/fault.c show_signal_msg, print_vma_addr) and the test says so in
`CRASHES.source`.
"""
import errno
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from ansible_in_ns import run_module
from test_gpu_health_gate import run_role

USER = 4242
GPU1_BUS = "0000:00:07"  # the h200x2 preset's GPU 1 (00000000:00:07.0), as an Xid line names it
CRASH_C = "int main(void) { *(volatile int *)0 = 0; return 0; }\n"
# The kernel's record of a crash: "COMM[PID]: segfault at ADDR ip IP sp SP error N in NAME[OFF,START+SIZE] ..."
SEGFAULT = re.compile(r"\[(?P<pid>\d+)\]: segfault at ")


def forged_names(host, token):
    """{kind: file name} of the crashes: a forged Xid of GPU 1 and a forged driver load, each in the
    comm and after a line feed (a whole line of its own in the record), and a forged journal line
    after U+2028 (where str.splitlines() would start a line)."""
    xid = f"NVRM: Xid (PCI:{GPU1_BUS}): 79, GPU has fallen off the bus. {token}"
    load = f"NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build {token}"
    return {
        "xid-as-comm": xid,
        "xid-after-line-feed": "x\n" + xid,
        "load-as-comm": load,
        "load-after-line-feed": "x\n" + load,
        "journal-line-after-u2028": f"x\u20282026-12-05T11:23:04+0000 {host.seed} kernel: {xid}",
    }


def compile_crash(directory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: install gcc and libc6-dev (tests/tools/apt-deps.sh test)")
    source, program = os.path.join(directory, "crash.c"), os.path.join(directory, "crash")
    with open(source, "w") as handle:
        handle.write(CRASH_C)
    subprocess.run([cc, "-O0", "-o", program, source], check=True, capture_output=True)
    os.chmod(program, 0o755)
    return program


def kmsg_records():
    """This machine's kernel records (/dev/kmsg, read as root), text unescaped: [(seq, text)]; None
    when /dev/kmsg cannot be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    records = []
    try:
        while True:
            try:
                data = os.read(fd, 16384)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten while read: go on with the next
                    continue
                raise
            head, _sep, rest = data.partition(b";")
            text = rest.split(b"\n", 1)[0]
            # The kernel escapes each byte below space, above tilde and the backslash as \xNN.
            text = re.sub(rb"\\x([0-9a-f]{2})", lambda m: bytes([int(m.group(1), 16)]), text)
            records.append((int(head.split(b",")[1]), text.decode("utf-8", "surrogateescape")))
    finally:
        os.close(fd)
    return records


def documented_report(name, pid):
    """The report in show_signal_msg's and print_vma_addr's format, for a machine whose kernel
    records cannot be read: the comm is the name's first 15 bytes."""
    comm = name.encode("utf-8")[:15].decode("utf-8", "ignore")
    return (f"{comm}[{pid}]: segfault at 0 ip 0000555555555132 sp 00007ffc10c54ed0 error 6 in {name}[1132,555555555000+1000] "
            f"likely on CPU 0 (core 0, socket 0)")


def crash(host, program, directory, name):
    """uid 4242 copies PROGRAM to NAME in its own DIRECTORY and runs it: it dies of SIGSEGV."""
    proc = host.run(["setpriv", "--reuid", str(USER), "--regid", str(USER), "--clear-groups", "--", "sh", "-c",
                     'cp "$1" "$2" && exec "$2"', "sh", program, os.path.join(directory, name)], timeout=30)
    assert proc.returncode in (-11, 139), (proc.returncode, proc.stderr)


def capture(host, names):
    """(source, {kind: the kernel's record of the crash}): "kernel" when read from /dev/kmsg."""
    base = tempfile.mkdtemp(prefix="zeromib-crash-")
    try:
        os.chmod(base, 0o755)
        program = compile_crash(base)
        home = os.path.join(base, "u")
        os.mkdir(home, 0o700)
        os.chown(home, USER, USER)
        traced = _read("/proc/sys/debug/exception-trace").strip() == "1"
        found = {}
        for _attempt in range(3):
            for kind, name in names.items():
                if kind not in found:
                    crash(host, program, home, name)
            records = kmsg_records() if traced else None
            if records is None:
                return "documented format", dict((kind, documented_report(name, 4242)) for kind, name in names.items())
            for kind, name in names.items():
                mine = [text for _seq, text in records if SEGFAULT.search(text) and " in " + name + "[" in text]
                if mine:
                    found[kind] = mine[-1]
            if len(found) == len(names):
                return "kernel", found
            time.sleep(5.5)  # printk_ratelimit: 10 reports in 5 s for the whole machine
        pytest.fail(f"the kernel logged no segfault report of {sorted(set(names) - set(found))} (printk rate limit?)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _read(path):
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def host(module_nshost):
    return module_nshost("h200x2", seed="xidforge")


@pytest.fixture(scope="module")
def crashes(host):
    token = "%06x" % (int(time.time() * 1000) & 0xFFFFFF)
    source, records = capture(host, forged_names(host, token))
    print(f"segfault reports ({source}):", json.dumps(records, indent=1))
    return source, records


def crash_faults(records, kinds=None, **extra):
    """The simulated kernel log holding the records of the crashes `kinds` (all), 30 s ago and on."""
    texts = [text for kind, text in records.items() if kinds is None or kind in kinds]
    return dict({"kernel_messages": [{"text": text, "age_s": 30 - i} for i, text in enumerate(texts)]}, **extra)


# The forged driver loads alone: a real Xid before them must still count (with forged Xids among
# them, a reader that took the loads would still fail the gate, for the wrong Xid).
FORGED_LOADS = ("load-as-comm", "load-after-line-feed")


READERS = {"journalctl": {}, "dmesg": {"no_journal": True}, "dmesg-syslog": {"no_journal": True, "dmesg_syslog": True}}


def test_the_reports_quote_the_forged_text(crashes):
    _source, records = crashes
    # What the search anywhere in a line believed: every record holds the driver's text.
    assert all(("NVRM: Xid (PCI:" in text or "NVRM: loading NVIDIA UNIX" in text) for text in records.values())
    assert "\nNVRM: Xid (PCI:0000:00:07): 79, GPU has fallen off the bus." in records["xid-after-line-feed"]
    assert records["xid-as-comm"].startswith("NVRM: Xid (PCI:[")  # the comm: the name's first 15 bytes


@pytest.mark.parametrize("reader", list(READERS))
def test_crashes_named_like_driver_messages_leave_a_healthy_gpu_healthy(host, crashes, reader):
    host.set_fault(crash_faults(crashes[1], **READERS[reader]))
    try:
        facts = run_module(host, "gpu_facts", {})
    finally:
        host.clear_faults()
    gpu = facts["ansible_facts"]["gpu"]
    log = gpu["health"]["kernel_log"]
    assert gpu["healthy"] is True and [g["health"]["xids"] for g in gpu["gpus"]] == [[], []], gpu["gpus"]
    assert (log["source"], log["error"], log["driver_loaded"]) == (reader.split("-")[0], None, None), log


def test_the_gate_passes_and_gpu_release_reads_healthy_beside_the_crashes(host, crashes):
    host.set_fault(crash_faults(crashes[1]))
    try:
        outcome = run_role(host, {"free_gpus_expected_count": 2})
        release = run_module(host, "gpu_release", {"kill_timeout": 1, "wait_timeout": 5})
    finally:
        host.clear_faults()
    assert not outcome["failed"], outcome["msg"]
    assert outcome["result"]["healthy"] is True and outcome["result"]["health_issues"] == []
    assert not release.failed and release["healthy"] is True and release["health_issues"] == [], release.result


@pytest.mark.parametrize("reader", list(READERS))
def test_a_real_xid_before_a_forged_driver_load_still_fails_the_gate(host, crashes, reader):
    host.set_fault(crash_faults(crashes[1], FORGED_LOADS, xid=[{"gpu": 1, "xid": 79, "age_s": 90}], **READERS[reader]))
    try:
        outcome = run_role(host, {})
        facts = run_module(host, "gpu_facts", {}) if reader == "journalctl" else None
    finally:
        host.clear_faults()
    assert outcome["failed"] and "GPU 1 (00000000:00:07.0)" in outcome["msg"], outcome["msg"]
    assert "Xid 79 (GPU has fallen off the bus)" in outcome["msg"], outcome["msg"]
    if facts is not None:
        gpu = facts["ansible_facts"]["gpu"]
        assert gpu["health"]["kernel_log"]["driver_loaded"] is None
        assert [x["xid"] for x in gpu["gpus"][1]["health"]["xids"]] == [79] and gpu["gpus"][1]["health"]["xids_before_driver_load"] == []


def test_the_real_drivers_load_still_moves_an_earlier_xid_to_history(host, crashes):
    host.set_fault(crash_faults(crashes[1], xid=[{"gpu": 1, "xid": 79, "age_s": 600}], driver_loaded_age_s=300))
    try:
        facts = run_module(host, "gpu_facts", {})
    finally:
        host.clear_faults()
    gpu = facts["ansible_facts"]["gpu"]
    assert gpu["healthy"] is True and "580.159.04  Release Build  (dvs-builder" in gpu["health"]["kernel_log"]["driver_loaded"]
    assert [x["xid"] for x in gpu["gpus"][1]["health"]["xids_before_driver_load"]] == [79]


# --- the Slurm epilog, as slurmd runs the hook (tests/integration/test_slurm_epilog_smoke.py)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    out = tmp_path_factory.mktemp("runner") / "slurm_gpu_checks.pyz"
    subprocess.run(["/usr/bin/python3", os.path.join(REPO, "roles", "slurm_gpu_checks", "files", "pack_runner.py"),
                    os.path.join(REPO, "plugins", "module_utils"), str(out)], check=True, capture_output=True)
    return str(out)


def epilog(host, runner, tmp_path, job):
    config, log = tmp_path / f"config-{job}.json", tmp_path / f"log-{job}.jsonl"
    config.write_text(json.dumps({"drain": False, "log": str(log)}))
    config.chmod(0o600)
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": "1", "SLURM_SCRIPT_CONTEXT": "epilog_slurmd",
           "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = host.run(["/usr/bin/python3", runner, "epilog", f"--config={config}"], env=env, timeout=120)
    return proc.returncode, proc.stderr, json.loads(log.read_text().splitlines()[-1])


def test_the_epilog_passes_beside_the_crashes_and_fails_on_the_real_xid(host, crashes, runner, tmp_path):
    host.set_fault(crash_faults(crashes[1]))
    try:
        rc, stderr, entry = epilog(host, runner, tmp_path, "5401")
        host.set_fault(xid=[{"gpu": 1, "xid": 79, "age_s": 90}])
        real_rc, _real_stderr, real = epilog(host, runner, tmp_path, "5402")
    finally:
        host.clear_faults()
    assert (rc, entry["ok"], entry["causes"]) == (0, True, []), stderr
    assert (real_rc, real["ok"]) == (1, False)
    assert any("Xid 79 (GPU has fallen off the bus)" in cause for cause in real["causes"]), real["causes"]
