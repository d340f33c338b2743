# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmark of the audit report at fleet scale (issue 26): wall time and controller memory.

    .venv/bin/python benchmarks/audit_report.py                       # after: 100, 1000, 4000 hosts
    .venv/bin/python benchmarks/audit_report.py --before --hosts 100,1000
    .venv/bin/python benchmarks/audit_report.py --summary 1000        # free_gpus.yml's summary task

Each contender is what a user runs: `ansible-playbook` of a localhost play that imports
playbooks/tasks/audit_report.yml, fed with the saved results of N hosts (the 30-host mixed fleet of
tests/integration/test_audit_report.py, repeated under new names). "before" runs the task file of
BEFORE_REV from a `git archive` (set_fact of the model, JMESPath through the templar, copy/template
of every file); "after" runs this checkout's (the zeromib.gpu.gpu_audit_report action plugin). The
input goes in as `-e @hosts_data.json` for both: Ansible's own loading of it is part of the time.

Memory is the largest resident set of any process of the run (getrusage of the children: the
ansible-playbook parent and its forked worker, which runs the report). Not a timed test: a
benchmark, printed as a Markdown table (benchmarks/HISTORY.md, "The audit report at fleet scale
(issue 26)", quotes it).
"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
from test_audit_report import _holder, build_fleet  # noqa: E402  (the fleet the report tests use)

VENV = os.path.join(REPO, ".venv", "bin")
# Landed main before issue 26: the task-file report.
BEFORE_REV = "7476bfa"


def pathological(record):
    """A host record as gpu_facts answers on the pathological node (issue 66,
    benchmarks/pathological_node.py), capped as it is: 30 processes of another job that did not
    answer and 20 guests' NVML clients listed of 10,050 holders (`truncated`), /dev/shm with 300,000
    files of which 50 are listed of 10,000 unheld."""
    facts = record.get("gpu")
    if not facts:
        return record
    blocked = [dict(_holder(70000 + n, "python3", "", [], user="4242", state="D"), attribution="blocked", blocked=True, devices=[],
                    candidate_gpu_indexes=list(range(8)), waits_in="request_wait_answer", cgroup=f"/system.slice/slurmstepd.scope/job_902/step_{n}")
               for n in range(30)]
    clients = [_holder(80000 + n, "exporter", "exporter --listen :9400", []) for n in range(20)]
    facts = dict(facts, holders=list(facts.get("holders") or []) + blocked + clients, truncated={"holders": 10050, "shm.unheld": 10000})
    facts["shm"] = {"path": "/dev/shm", "size_mib": 4096.0, "free_mib": 4096.0, "files": 300000, "files_read": 10000, "unheld_count": 10000,
                    "unheld_mib": 0.0, "complete": False, "error": None,
                    "unheld": [{"path": f"/dev/shm/nccl-flood-{n}", "size_mib": 0.0, "age_s": 60, "pattern": "nccl-*", "user": "4242"}
                               for n in range(50)]}
    return dict(record, gpu=facts)


def fleet(count, worst=False):
    """`count` host records: the 30-host sample fleet repeated, every host renamed (rackNN-...);
    `worst`: each as the pathological node's gpu_facts answers (pathological)."""
    base = [pathological(record) for record in build_fleet()] if worst else build_fleet()
    hosts = []
    rack = 0
    while len(hosts) < count:
        for record in base:
            if len(hosts) == count:
                break
            copy = json.loads(json.dumps(record))
            copy["host"] = "rack{:03d}-{}".format(rack, record["host"])
            hosts.append(copy)
        rack += 1
    return hosts


def collection(rev, where):
    """A collections path whose zeromib.gpu is `rev` (None: this checkout)."""
    root = os.path.join(where, "collections")
    target = os.path.join(root, "ansible_collections", "zeromib", "gpu")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if rev is None:
        os.symlink(REPO, target)
    else:
        os.makedirs(target)
        archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)
    return root, target


PLAY = """\
- name: Write a GPU audit report from saved per-host results
  hosts: localhost
  gather_facts: false
  connection: local
  tasks:
    - name: Build, query and write the report
      ansible.builtin.import_tasks: %s
"""


NOOP = """\
- name: The same input, no report (what Ansible's loading of it costs)
  hosts: localhost
  gather_facts: false
  connection: local
  tasks:
    - name: Nothing
      ansible.builtin.debug:
        msg: loaded
"""


def run_report(rev, count, where, from_part=False, noop=False, worst=False):
    """from_part: the hosts' data in a part file (gpu_audit_parts, as audit_merge.yml reads the
    slices' parts) instead of an extra var that Ansible parses and tags first."""
    root, target = collection(rev, where)
    data = os.path.join(where, "hosts_data.json")
    with open(data, "w") as handle:
        if from_part:
            json.dump({"format": "zeromib.gpu audit part", "version": 1, "generated_epoch": time.time(), "expected_hosts": [],
                       "hosts_data": fleet(count, worst)}, handle)
        else:
            json.dump({"gpu_audit_hosts_data": fleet(count, worst)}, handle)
    play = os.path.join(where, "report.yml")
    with open(play, "w") as handle:
        handle.write(NOOP if noop else PLAY % os.path.join(target, "playbooks", "tasks", "audit_report.yml"))
    out = os.path.join(where, "out")
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=root, ANSIBLE_LOCALHOST_WARNING="false",
               ANSIBLE_INVENTORY_UNPARSED_WARNING="false", ANSIBLE_NOCOLOR="1",
               ANSIBLE_PYTHON_INTERPRETER=sys.executable)
    env.pop("ANSIBLE_CONFIG", None)
    given = ["-e", json.dumps({"gpu_audit_parts": [data]})] if from_part else ["-e", "@" + data]
    return _timed([os.path.join(VENV, "ansible-playbook"), play, *given, "-e", "gpu_audit_report_dir=" + out], env, where, out)


def _timed(argv, env, cwd, out=None):
    """(wall s, max RSS MiB of any process of the run, file sizes) of one run in a child."""
    code = textwrap.dedent("""\
        import json, resource, subprocess, sys, time
        argv, cwd = json.loads(sys.argv[1]), sys.argv[2]
        start = time.monotonic()
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
        wall = time.monotonic() - start
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(json.dumps({"rc": proc.returncode, "wall": wall, "rss": usage.ru_maxrss / 1024.0, "cpu": usage.ru_utime + usage.ru_stime,
                          "tail": (proc.stdout + proc.stderr)[-3000:]}))
        """)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argv), cwd], env=env, capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout)
    if result["rc"] != 0:
        raise SystemExit("run failed (rc {}):\n{}".format(result["rc"], result["tail"]))
    sizes = {"cpu": result["cpu"]}
    if out and os.path.isdir(out):
        for name in ("report.json", "report.html", "report.md", "gpu_audit.prom"):
            sizes[name] = os.path.getsize(os.path.join(out, name)) / 1e6
    return result["wall"], result["rss"], sizes


SUMMARY_PLAY = """\
- name: The fleet summary of free_gpus.yml over saved per-host results
  hosts: all
  gather_facts: false
  tasks:
    - name: Every host has its free_gpus_result (as the role leaves it)
      ansible.builtin.set_fact:
        free_gpus_result: "{{ saved_results[inventory_hostname] }}"
%s
"""


def run_summary(count, where):
    """free_gpus.yml's summary task (copied from the playbook) over `count` hosts' saved results."""
    import yaml

    root, dummy = collection(None, where)
    with open(os.path.join(REPO, "playbooks", "free_gpus.yml")) as handle:
        play = yaml.safe_load(handle)[0]
    summary = next(t for t in play["tasks"] if t.get("name", "").startswith("Fleet summary"))
    outcome = {"host": None, "status": "freed", "message": "8 GPUs free", "gpus": 8, "before_mib": 1028316, "after_mib": 0,
               "stopped_units": ["vllm.service"], "killed": [], "healthy": True, "health_issues": []}
    results = {f"node{n:04d}": dict(outcome, host=f"node{n:04d}") for n in range(count)}
    with open(os.path.join(where, "results.json"), "w") as handle:
        json.dump({"saved_results": results}, handle)
    with open(os.path.join(where, "inventory.json"), "w") as handle:
        json.dump({"all": {"hosts": {h: {"ansible_connection": "local"} for h in results}}}, handle)
    with open(os.path.join(where, "summary.yml"), "w") as handle:
        handle.write(SUMMARY_PLAY % textwrap.indent(yaml.safe_dump([summary], sort_keys=False), "    "))
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=root, ANSIBLE_NOCOLOR="1", ANSIBLE_PYTHON_INTERPRETER=sys.executable)
    env.pop("ANSIBLE_CONFIG", None)
    argv = [os.path.join(VENV, "ansible-playbook"), "-i", os.path.join(where, "inventory.json"), "-e",
            "@" + os.path.join(where, "results.json"), os.path.join(where, "summary.yml"), "-f", "8"]
    whole = _timed(argv, env, where)
    # The same play without the summary task: the difference is the summary's own cost.
    with open(os.path.join(where, "summary.yml"), "w") as handle:
        handle.write(SUMMARY_PLAY % "")
    bare = _timed(argv, env, where)
    return whole, bare


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def chromium(args, profile):
    import shutil

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    start = time.monotonic()
    proc = subprocess.run([binary, *CHROMIUM_FLAGS, "--user-data-dir=" + profile, *args], capture_output=True, text=True,
                          timeout=300, check=False)
    return time.monotonic() - start, proc


def run_page(count, where, shot=None):
    """The report page of `count` hosts in headless Chromium: the page's own mark (navigation to
    the first page of the heat map drawn, `data-drawn-ms`), the wall time of a screenshot, and
    the same for an empty page (Chromium's own start-up)."""
    import re

    sys.path.insert(0, os.path.join(REPO, ".build", "collections"))
    from ansible_collections.zeromib.gpu.plugins.plugin_utils import _audit_report as plugin

    report = plugin.build_report(fleet(count), title="GPU fleet audit ({} hosts, sample)".format(f"{count:,}"))
    page = os.path.join(where, "report.html")
    with open(page, "w") as handle:
        handle.write(plugin.render(report)["report.html"])
    empty = os.path.join(where, "empty.html")
    with open(empty, "w") as handle:
        handle.write("<!DOCTYPE html><title>empty</title><p>empty</p>")
    uri = "file://" + page
    dummy, dom = chromium(["--dump-dom", uri], os.path.join(where, "p1"))
    drawn = re.search(r'data-drawn-ms="(\d+)"', dom.stdout)
    rows = dom.stdout.count('<tr class="host ')
    png = shot or os.path.join(where, "shot.png")
    shot_s, dummy = chromium(["--screenshot=" + png, "--window-size=1400,1400", uri], os.path.join(where, "p2"))
    blank_s, dummy = chromium(["--screenshot=" + os.path.join(where, "blank.png"), "--window-size=1400,1400", "file://" + empty],
                              os.path.join(where, "p3"))
    return {"html_mb": os.path.getsize(page) / 1e6, "drawn_ms": int(drawn.group(1)) if drawn else None, "rows": rows,
            "screenshot_s": shot_s, "blank_s": blank_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="100,1000,4000")
    parser.add_argument("--before", action="store_true", help=f"run the task file of {BEFORE_REV} instead of this checkout's")
    parser.add_argument("--part", action="store_true", help="after: feed the hosts' data as a part file (gpu_audit_parts)")
    parser.add_argument("--noop", action="store_true", help="the same -e @hosts_data.json into a play that writes no report")
    parser.add_argument("--pathological", action="store_true", help="every host as gpu_facts answers on the pathological node (issue 66)")
    parser.add_argument("--summary", type=int, metavar="N", help="time free_gpus.yml's summary task at N hosts instead")
    parser.add_argument("--page", type=int, metavar="N", help="load the report page of N hosts in headless Chromium instead")
    parser.add_argument("--screenshot", help="with --page: keep the screenshot here (docs/images/audit-report-4000.png)")
    args = parser.parse_args()
    print("<!-- {}, {}, {} CPUs, {} -->".format(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), platform.node(),
                                                os.cpu_count(), " ".join(sys.argv)))
    if args.page:
        with tempfile.TemporaryDirectory(prefix="zeromib-bench-") as where:
            page = run_page(args.page, where, os.path.abspath(args.screenshot) if args.screenshot else None)
        print("| report.html, {} hosts | {:.2f} MB | heat map drawn {} ms after navigation ({} rows) | screenshot {:.2f} s, "
              "empty page {:.2f} s |".format(f"{args.page:,}", page["html_mb"], page["drawn_ms"], page["rows"],
                                             page["screenshot_s"], page["blank_s"]))
        return
    if args.summary:
        with tempfile.TemporaryDirectory(prefix="zeromib-bench-") as where:
            (wall, rss, dummy), (bare, bare_rss, dummy) = run_summary(args.summary, where)
        print(f"| free_gpus.yml summary, {args.summary} hosts | {wall:.1f} s (play without it: {bare:.1f} s) | {rss:.0f} MiB |")
        return
    print("| contender | hosts | wall | CPU (user+sys) | controller max RSS | report.json | report.html | report.md | gpu_audit.prom | load avg |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for count in [int(n) for n in args.hosts.split(",")]:
        with tempfile.TemporaryDirectory(prefix="zeromib-bench-") as where:
            wall, rss, sizes = run_report(BEFORE_REV if args.before else None, count, where, from_part=args.part and not args.before,
                                          noop=args.noop, worst=args.pathological)
        if args.noop:
            print("| no report, `-e @hosts_data.json` only | {} | {:.1f} s | {:.1f} s | {:.0f} MiB | | | | | {:.1f} |".format(
                f"{count:,}", wall, sizes["cpu"], rss, os.getloadavg()[0]), flush=True)
            continue
        if args.before:
            name = f"before ({BEFORE_REV}, task file), `-e @hosts_data.json`"
        else:
            given = "part file (`gpu_audit_parts`)" if args.part else "`-e @hosts_data.json`"
            name = f"after (gpu_audit_report), {given}" + (", pathological hosts" if args.pathological else "")
        print("| {} | {} | {:.1f} s | {:.1f} s | {:.0f} MiB | {:.1f} MB | {:.2f} MB | {:.2f} MB | {:.1f} MB | {:.1f} |".format(
            name, f"{count:,}", wall, sizes["cpu"], rss,
            sizes["report.json"], sizes["report.html"], sizes["report.md"], sizes["gpu_audit.prom"], os.getloadavg()[0]), flush=True)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE))
    main()
