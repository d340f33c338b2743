"""Run a zeromib.gpu module through real ansible-playbook inside a simulated host (NsHost).

The playbook runs with `connection: local` inside the host's namespaces, so the module sees
the host's /proc, /dev/nvidia* and simulated nvidia-smi, exactly as on a node. The result comes
from the test-only callback tests/fleet/callback_plugins/fleet_json.py (every task's result, as
Ansible hands it to callbacks), not from a task that writes it: that task was a second module
run (copy: stat and copy) costing ~0.6 s of CPU per call, a third of the suite's Ansible time.
"""
import json
import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.join(REPO, ".venv", "bin")
COLLECTIONS = os.path.join(REPO, ".build", "collections")

PLAY = """---
- hosts: localhost
  gather_facts: false
  tasks:
    - name: module under test
      {module}: {args}
      ignore_errors: true
"""
CALLBACKS = os.path.join(REPO, "tests", "fleet", "callback_plugins")
# One AnsiballZ cache for the session's runs (tests/fleet/callback_plugins/shared_payloads.py).
SHARED_PAYLOADS = os.path.join(REPO, ".build", "ansiballz-cache")


def playbook_env(**extra):
    """ansible-playbook's environment inside a simulated host: this checkout's collection, and
    the session's one AnsiballZ cache (a payload built once, not once per run)."""
    env = {"ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "HOME": "/root", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "False", "ANSIBLE_DEPRECATION_WARNINGS": "False",
           "ANSIBLE_CALLBACK_PLUGINS": CALLBACKS, "ANSIBLE_CALLBACKS_ENABLED": "shared_payloads",
           "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1", "ZEROMIB_SHARED_ANSIBALLZ": SHARED_PAYLOADS,
           # The runs here use `-i localhost,` or an ini file: Ansible's four other inventory
           # plugins (each one's documentation parsed at every start) cost ~60 ms of CPU a run.
           "ANSIBLE_INVENTORY_ENABLED": "host_list,ini"}
    env.update(extra)
    return env


def results_env(out):
    """ansible-playbook's environment for a run whose task results the callback writes to OUT."""
    return playbook_env(ANSIBLE_CALLBACKS_ENABLED="fleet_json,shared_payloads", ZEROMIB_FLEET_JSON_OUT=out)


def task_result(out, task, proc):
    """The last result of the task named TASK in the callback's file OUT, as `register` would
    keep it: without Ansible's internal `_ansible_*` keys, with `failed` (which callbacks are
    given as the result's status, not as a key)."""
    try:
        with open(out) as handle:
            record = [t for t in json.load(handle)["tasks"] if t["task"] == task][-1]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise AssertionError(f"ansible-playbook gave no result of {task!r} (rc {proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}") from exc
    result = {k: v for k, v in record["result"].items() if not k.startswith("_ansible")}
    result["failed"] = record["status"] in ("failed", "ignored")
    return result


class ModuleRun:
    def __init__(self, result, wall_s, stdout, stderr, rc):
        self.result = result
        self.wall_s = wall_s
        self.stdout = stdout
        self.stderr = stderr
        self.rc = rc

    @property
    def failed(self):
        return bool(self.result.get("failed"))

    @property
    def msg(self):
        return self.result.get("msg", "")

    def __getitem__(self, key):
        return self.result[key]

    def get(self, key, default=None):
        return self.result.get(key, default)


def run_module(host, module, args=None, check=False, diff=False, timeout=180, extra_env=None, argv_prefix=()):
    """Run zeromib.gpu.<module> with args on `host` (plus `extra_env` for ansible-playbook; `argv_prefix`
    runs ansible-playbook through a wrapper, e.g. one that enters a cgroup first); returns a ModuleRun."""
    host._seq = getattr(host, "_seq", 0) + 1
    out = os.path.join(host.dir, f"result-{host._seq}.json")
    play = os.path.join(host.dir, f"play-{host._seq}.yml")
    with open(play, "w") as handle:
        handle.write(PLAY.format(module="zeromib.gpu." + module, args=json.dumps(args or {})))
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", play,
           "-e", "ansible_python_interpreter=/usr/bin/python3"]
    if check:
        cmd.append("--check")
    if diff:
        cmd.append("--diff")
    env = results_env(out)
    env.update(extra_env or {})
    started = time.monotonic()
    proc = host.run(list(argv_prefix) + cmd, env=env, timeout=timeout)
    wall = time.monotonic() - started
    result = task_result(out, "module under test", proc)
    assert "Traceback" not in result.get("module_stderr", "") + result.get("msg", ""), result
    record_timing(module, result, wall)
    return ModuleRun(result, wall, proc.stdout, proc.stderr, proc.returncode)


def record_timing(module, result, wall):
    """Append the module's own elapsed_s to tests/output/module_timings.jsonl (one line per call),
    so that each scenario's time on the simulated host can be reported."""
    out_dir = os.path.join(REPO, "tests", "output")
    os.makedirs(out_dir, exist_ok=True)
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0], "module": module,
            "elapsed_s": result.get("elapsed_s"), "timings": result.get("timings"), "failed": bool(result.get("failed")),
            "ansible_wall_s": round(wall, 3)}
    with open(os.path.join(out_dir, "module_timings.jsonl"), "a") as handle:
        handle.write(json.dumps(line) + "\n")
