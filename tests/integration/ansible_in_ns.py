"""Run a zeromib.gpu module through real ansible-playbook inside a simulated host (NsHost).

The playbook runs with `connection: local` inside the host's namespaces, so the module sees
the host's /proc, /dev/nvidia* and simulated nvidia-smi, exactly as on a node.
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
      register: __result
      ignore_errors: true
    - name: write the result
      ansible.builtin.copy:
        content: "{{{{ __result | to_json }}}}"
        dest: {out}
        mode: "0600"
      check_mode: false
      diff: false
"""


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
        handle.write(PLAY.format(module="zeromib.gpu." + module, args=json.dumps(args or {}), out=json.dumps(out)))
    cmd = [os.path.join(VENV_BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", play,
           "-e", "ansible_python_interpreter=/usr/bin/python3"]
    if check:
        cmd.append("--check")
    if diff:
        cmd.append("--diff")
    env = {"ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "HOME": "/root", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "False", "ANSIBLE_DEPRECATION_WARNINGS": "False"}
    env.update(extra_env or {})
    started = time.monotonic()
    proc = host.run(list(argv_prefix) + cmd, env=env, timeout=timeout)
    wall = time.monotonic() - started
    try:
        with open(out) as handle:
            result = json.load(handle)
    except (OSError, ValueError) as exc:
        raise AssertionError(f"ansible-playbook wrote no result (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}") from exc
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
