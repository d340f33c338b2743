"""Helpers shared by the fleet tests: which host plays which part, task names, reading the
fleet summary, checking processes and units on hosts. Stdlib only."""
from __future__ import annotations

import concurrent.futures
import json
import re
import time

PLAYBOOK = "playbooks/free_gpus.yml"
AUDIT = "playbooks/audit_gpus.yml"
TRAINING = "playbooks/example_training.yml"
ROLE = "zeromib.gpu.free_gpus"
# The role's one task per host (the free_gpus_gate action: gpu_release's result, the verdict).
RELEASE_TASK = "zeromib.gpu.free_gpus : Free the GPUs and verify that they read at most the baseline"
GATE_TASK = RELEASE_TASK
# The role's rescue: a host that failed the gate fails again here, with the gate's message.
ASSERT_TASK = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
SUMMARY_TASK = "Fleet summary (unreachable, failed and dirty hosts first)"
# The MIG host idles at 55 MiB per GPU; inventory group_vars give it this threshold.
MIG_MAX_USED_MIB = 64


def wait_for(pred, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    return pred()


def parallel(fn, items):
    items = list(items)
    if not items:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(items)) as ex:
        return list(ex.map(fn, items))


class Cast:
    """Which host of the fleet plays which part; works for any fleet of 3 or more hosts and
    uses the H100 host (minors != indexes) and the MIG host (55 MiB idle) when there are."""

    def __init__(self, fleet):
        self.fleet = fleet
        names = fleet.names
        assert len(names) >= 3, "the fleet scenarios need at least 3 hosts"
        by_preset = {}
        for h in fleet.hosts:
            by_preset.setdefault(h.preset, []).append(h.name)
        h200 = by_preset.get("h200x8", [])
        self.mig = (by_preset.get("a100-mig") or [None])[0]
        self.h100 = (by_preset.get("h100x4") or [None])[0]
        plain = h200 + [n for n in names if n not in h200]
        self.vllm = plain[0]
        self.sglang = plain[1 % len(plain)]
        self.train = plain[2 % len(plain)]
        self.stubborn = plain[3 % len(plain)]
        self.orphan = self.h100 or plain[4 % len(plain)]
        self.names = names

    def idle(self, host: str) -> int:
        return self.fleet.host(host).idle_mib


def alive(fleet, host: str, pids) -> dict[int, bool]:
    """{pid: alive} on HOST (zombies count as gone)."""
    pids = [int(p) for p in pids]
    if not pids:
        return {}
    r = fleet.ssh(host, "for p in {}; do s=$(awk '{{print $3}}' /proc/$p/stat 2>/dev/null); "
                        "[ -n \"$s\" ] && [ \"$s\" != Z ] && echo $p; done; true".format(" ".join(map(str, pids))), check=True)
    live = {int(x) for x in r.stdout.split()}
    return {p: p in live for p in pids}


def unit_states(fleet, host: str, *units: str) -> dict[str, tuple[str, str]]:
    """{unit: (is-active, is-enabled)} on HOST."""
    r = fleet.ssh(host, "for u in {}; do echo \"$u $(systemctl is-active $u) $(systemctl is-enabled $u 2>/dev/null || true)\"; done".format(" ".join(units)))
    out = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if parts:
            out[parts[0]] = (parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else "")
    return out


def main_pid(fleet, host: str, unit: str) -> int:
    return int(fleet.ssh(host, f"systemctl show -p MainPID --value {unit}", check=True).stdout.strip() or 0)


def memory(fleet, hosts=None) -> dict[str, dict[int, int]]:
    hosts = hosts or fleet.names
    return dict(zip(hosts, parallel(fleet.gpu_memory, hosts)))


def baseline(fleet, host: str) -> dict[int, int]:
    h = fleet.host(host)
    return {g["index"]: h.idle_mib for g in h.gpus}


def summary_lines(result) -> list[str] | None:
    """The fleet summary of free_gpus.yml: its lines from the JSON record, or None if it did not print."""
    found = result.results(task=SUMMARY_TASK)
    if not found or found[-1]["status"] != "ok":
        return None
    msg = found[-1]["result"].get("msg")
    return msg if isinstance(msg, list) else str(msg).splitlines()


def summary_row(lines: list[str], host: str) -> str | None:
    for line in lines:
        cells = line.split()
        if len(cells) > 1 and host in cells[:3]:
            return line
    return None


def summary_status(lines: list[str], host: str) -> str | None:
    row = summary_row(lines, host)
    if row is None:
        return None
    m = re.match(r"^(would free|\S+)\s+" + re.escape(host) + r"\b", row)
    return m.group(1) if m else None


def host_message(result, host: str) -> str:
    """What free_gpus.yml's fleet summary says of HOST, after `HOST: ` (its row must be there)."""
    row = summary_row(summary_lines(result) or [], host)
    assert row and f"{host}: " in row, result.stdout[-3000:]
    uncensored(result, host)
    return row.split(f"{host}: ", 1)[1]


def fatal_line(result, host: str) -> str:
    """The one `fatal: [HOST]` line a play printed (the role in a user's own play: said once)."""
    [line] = [line for line in result.stdout.splitlines() if line.startswith(f"fatal: [{host}]")]
    uncensored(result, host)
    return line


def uncensored(result, host: str):
    """Nothing of HOST's hidden from the user or the recording callback (a no_log result prints
    and records `censored` in place of the reason)."""
    assert "censored" not in result.stdout, result.stdout[-3000:]
    records = json.dumps(result.results(host=host))
    assert "censored" not in records, records[-3000:]


FAIL_TASK = "Fail the hosts whose GPUs are not free"


def failure_messages(result, host: str) -> list[str]:
    """Distinct failure messages of a host, in order. The role's gate fails with the reason; the
    role's rescue and free_gpus.yml (after the fleet summary) fail the host again pointing to it."""
    messages = []
    for t in result.results(host=host):
        if t["status"] == "failed" and not t["result"].get("ignore_errors"):
            msg = str(t["result"].get("msg", ""))
            if msg not in messages:
                messages.append(msg)
    return messages
