"""Managed-node Pythons of the compatibility matrix (tests/compat/matrix.py): gpu_facts and
gpu_release run under each CPython 3.8-3.13 (ansible_python_interpreter) on a simulated GPU
host, driven by requirements.txt's ansible-core. A Python missing from this machine skips its entry
under `make test` (the run's last lines name it) and fails it under `make test-matrix`
(tests/conftest.py)."""
from __future__ import annotations

import pytest

import matrix
from ansible_in_ns import results_env, task_result

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
    env = dict(results_env(out), ANSIBLE_PIPELINING="False")
    proc = nshost.run([str(matrix.MAIN_VENV_BIN / "ansible-playbook"), "-vvv", "-i", inventory, play],
                      env=env, cwd=nshost.dir, timeout=180)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # Each module really ran under this interpreter (Ansible's own -vvv record of the command).
    for module in ("gpu_facts", "gpu_release"):
        assert f"{interpreter} " in "".join(
            line for line in proc.stdout.splitlines() if f"AnsiballZ_{module}.py" in line and "EXEC" in line), module
    result = task_result(out, "The results", proc)["msg"]
    facts = result["facts"]["ansible_facts"]["gpu"]
    assert facts["count"] == 8 and facts["gpus"][0]["memory_used_mib"] >= 4096 and not facts["clean"]
    release = result["release"]
    assert release["released"] and release["changed"], release
    assert [k["pid"] for k in release["killed"]] == [holder.pid], release["killed"]
    assert not holder.alive()
