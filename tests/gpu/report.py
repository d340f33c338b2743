# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Render the results.json of tests/gpu/acceptance.py as the tables of tests/gpu/results/README.md.

    python3 tests/gpu/report.py tests/gpu/results/run-2026-11-29-1020/results.json
"""
import json
import statistics
import sys


def fmt(value, unit=" s"):
    return "-" if value is None else f"{value}{unit}"


def release_rows(scenarios):
    rows = ["| scenario | module `elapsed_s` | floor (signal to 0 MiB) | over floor | hand procedure | left by hand | signals |",
            "|---|---|---|---|---|---|---|"]
    for s in scenarios:
        if "floor_s" not in s:
            continue
        left = "{} MiB".format(s.get("hand_procedure_mib_after"))
        if s.get("pkill_only_mib_after") is not None:
            left += " (`pkill` alone: {} MiB)".format(s["pkill_only_mib_after"])
        signals = ", ".join(f"{sig} after {after} s" for _pid, sig, after in s.get("signals", []))
        rows.append("| {} {} | {} | {} | {} | {} | {} | {} |".format(
            "PASS" if s["ok"] else "FAIL", s["name"], fmt(s.get("elapsed_s")), fmt(s.get("floor_s")), fmt(s.get("over_floor_s")),
            fmt(s.get("hand_procedure_s")), left, signals))
    return rows


def medians(scenarios):
    groups = {}
    for s in scenarios:
        if "floor_s" in s and s.get("elapsed_s") is not None:
            key = s["name"].rsplit(", run", 1)[0]
            groups.setdefault(key, []).append(s)
    rows = ["| scenario | runs | median `elapsed_s` | median floor | median over floor |", "|---|---|---|---|---|"]
    for key, runs in groups.items():
        over = [r["over_floor_s"] for r in runs if r.get("over_floor_s") is not None]
        floors = [r["floor_s"] for r in runs if r.get("floor_s") is not None]
        rows.append("| {} | {} | {:.3f} s | {} | {} |".format(
            key, len(runs), statistics.median(r["elapsed_s"] for r in runs),
            f"{statistics.median(floors):.3f} s" if floors else "-", f"{statistics.median(over):.3f} s" if over else "-"))
    return rows


def other_rows(scenarios):
    rows = ["| scenario | result | details |", "|---|---|---|"]
    for s in scenarios:
        if "floor_s" in s:
            continue
        details = {k: v for k, v in s.items() if k in ("clean", "count", "memory_used_mib", "reserved", "cuda_version", "mismatches",
                                                       "elapsed_s", "changed", "still_alive", "comm", "killed", "rc", "summary")}
        rows.append("| {} | {} | `{}` |".format(s["name"], "PASS" if s["ok"] else "FAIL", json.dumps(details).replace("|", "\\|")))
    return rows


def main(path):
    with open(path) as handle:
        data = json.load(handle)
    out = ["Driver: {}. GPU: {}. Run {} to {}, `{}`.".format(
        " / ".join(l.strip() for l in data["nvidia_smi_version"].splitlines() if l.strip()), data["gpu"], data["started"], data["finished"],
        data["command"])]
    out += ["", "### Release times"] + medians(data["scenarios"]) + ["", "Every run:", ""] + release_rows(data["scenarios"])
    out += ["", "### Other scenarios"] + other_rows(data["scenarios"])
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1])
