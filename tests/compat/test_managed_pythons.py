"""Managed-node Pythons of the compatibility matrix (tests/compat/matrix.py): gpu_facts and
gpu_release run under each CPython 3.8-3.13 (ansible_python_interpreter) on a simulated GPU
host, driven by requirements.txt's ansible-core. A Python missing from this machine fails the
test; it is never skipped."""
from __future__ import annotations

import json

import pytest

import matrix

PLAY = """---
- name: Read and free the GPUs under {python}
  hosts: node
  gather_facts: false
  tasks:
    - name: Read the GPUs
      zeromib.gpu.gpu_facts:
      register: facts
    - name: Free GPU 0
      zeromib.gpu.gpu_release:
        gpus: ["0"]
        kill_timeout: 2
      register: release
    - name: The results
      ansible.builtin.debug:
        msg: "{{{{ {{'facts': facts, 'release': release}} }}}}"
"""


@pytest.mark.parametrize("python", matrix.MANAGED_PYTHONS, ids=[f"py{p}" for p in matrix.MANAGED_PYTHONS])
def test_modules_run_under_managed_python(nshost, python):
    interpreter = matrix.find_python(python)
    holder = nshost.spawn(["gpu_holder", "--gpus", "0", "--mib", "4096"])
    out = f"{nshost.dir}/result.json"
    play = f"{nshost.dir}/play.yml"
    inventory = f"{nshost.dir}/inventory.ini"
    with open(play, "w") as f:
        f.write(PLAY.format(python=python))
    with open(inventory, "w") as f:
        f.write(f"node ansible_connection=local ansible_python_interpreter={interpreter}\n")
    env = {"ANSIBLE_COLLECTIONS_PATH": str(matrix.REPO / ".build" / "collections"), "HOME": "/root",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCALHOST_WARNING": "False", "ANSIBLE_PIPELINING": "False",
           # The results through the test-only callback, not a copy task (a module run of its own).
           "ANSIBLE_CALLBACK_PLUGINS": str(matrix.REPO / "tests" / "fleet" / "callback_plugins"),
           "ANSIBLE_CALLBACKS_ENABLED": "fleet_json", "ZEROMIB_FLEET_JSON_OUT": out}
    proc = nshost.run([str(matrix.MAIN_VENV_BIN / "ansible-playbook"), "-vvv", "-i", inventory, play],
                      env=env, cwd=nshost.dir, timeout=180)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # Each module really ran under this interpreter (Ansible's own -vvv record of the command).
    for module in ("gpu_facts", "gpu_release"):
        assert f"{interpreter} " in "".join(
            line for line in proc.stdout.splitlines() if f"AnsiballZ_{module}.py" in line and "EXEC" in line), module
    with open(out) as f:
        result = next(t["result"]["msg"] for t in json.load(f)["tasks"] if t["task"] == "The results")
    facts = result["facts"]["ansible_facts"]["gpu"]
    assert facts["count"] == 8 and facts["gpus"][0]["memory_used_mib"] >= 4096 and not facts["clean"]
    release = result["release"]
    assert release["released"] and release["changed"], release
    assert [k["pid"] for k in release["killed"]] == [holder.pid], release["killed"]
    assert not holder.alive()
