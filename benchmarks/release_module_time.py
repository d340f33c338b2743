"""gpu_release's own time (`elapsed_s` and its `timings`) on a simulated 8-GPU namespace host,
for the checkout this file is run from or any other (`--checkout DIR`: its tests/ rigs and its
collection are used), so that a refactor is measured against the commit before it on the same
machine in the same minutes. Scenarios: a clean host (the gate before a job), a cooperative
holder on GPUs 0 and 1 (SIGTERM), and check mode with that holder.

Usage: python benchmarks/release_module_time.py [--checkout DIR] [--reps N]"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(checkout, reps):
    sys.path[:0] = [os.path.join(checkout, "tests", "integration"), os.path.join(checkout, "tests", "sim")]
    from ansible_in_ns import run_module  # pylint: disable=import-outside-toplevel
    from nshost import NsHost  # pylint: disable=import-outside-toplevel
    times = {"clean": [], "holder (SIGTERM)": [], "check mode": []}
    looks = []
    host = NsHost(preset="h200x8")
    host.start()
    try:
        for _rep in range(reps):
            times["clean"].append(run_module(host, "gpu_release")["elapsed_s"])
            holder = host.spawn(["gpu_holder", "--gpus", "0,1", "--mib", "40960"])
            times["check mode"].append(run_module(host, "gpu_release", check=True)["elapsed_s"])
            run = run_module(host, "gpu_release")
            if run.failed or not host.wait_gone(holder.pid):
                raise SystemExit(f"the holder was not freed: {run.msg}")
            times["holder (SIGTERM)"].append(run["elapsed_s"])
            looks.append(run["timings"]["look_s"])
    finally:
        host.stop()
    return {name: statistics.median(values) for name, values in times.items()}, statistics.median(looks)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", default=os.path.dirname(HERE))
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    medians, look = measure(os.path.abspath(args.checkout), args.reps)
    print(json.dumps({"checkout": args.checkout, "reps": args.reps, "median_elapsed_s": medians, "median_look_s": look}))


if __name__ == "__main__":
    main()
