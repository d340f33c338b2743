"""A host whose become does not start over the local connection is said in the role's words (issue 67).

Over `ansible_connection: local` (a play run on the GPU node itself, or through a wrapper such as
`nsenter`), ansible-core 2.19 and later wait for become's success marker themselves and, when sudo
ends first, fail the task with their own words ("Premature end of stream waiting for become
success"); over SSH the same shell's words reach the module's result and the role says them. This
machine has no sudo: a play with `become: true` over the local connection meets exactly that. The
play runs on this machine against one simulated host (its interpreter enters the host's
namespaces, as tests/integration/test_wedged_node_play.py does), becoming another user than the
controller's root (become to root is skipped for root); nothing starts there, since become fails
before the module does. Through the README's play (the role in pre_tasks) and through
free_gpus.yml, on the oldest and the newest supported ansible-core."""
import json
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansible_in_ns import results_env  # noqa: E402
from test_wedged_node_play import interpreter  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "compat"))
import matrix  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORES = [entry for entry in matrix.CONTROLLER if entry[0].startswith(("2.17.", "2.21."))]
VERDICT = "zeromib.gpu.free_gpus : Assert that every selected GPU is free"
SAID = "the module could not start on this host: /bin/sh: 1: sudo: not found"
README_PLAY = os.path.join(REPO, "playbooks", "example_training.yml")
FREE_GPUS = os.path.join(REPO, "playbooks", "free_gpus.yml")

pytestmark = pytest.mark.skipif(shutil.which("sudo") is not None, reason="needs a controller without sudo (become cannot start)")


@pytest.mark.parametrize(("core", "python"), CORES, ids=[f"ansible-core-{c}" for c, _p in CORES])
@pytest.mark.parametrize("playbook", [README_PLAY, FREE_GPUS], ids=["readme-play", "free_gpus.yml"])
@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_no_sudo_over_the_local_connection_is_said_in_the_roles_words(nshost, tmp_path, core, python, playbook, check):
    host = nshost("h200x1", seed="nosudo")
    # The controller runs as root, for whom Ansible skips become to root: become to another user takes sudo, which is not here.
    inventory = {"gpu_nodes": {"hosts": {"node-a": {"ansible_connection": "local", "ansible_become_user": "nobody",
                                                    "ansible_python_interpreter": interpreter(host, str(tmp_path / "python3"))}}}}
    (tmp_path / "inventory.json").write_text(json.dumps(inventory))
    out = str(tmp_path / "results.json")
    bin_dir = matrix.controller_bin(core, python)
    env = dict(os.environ, **results_env(out))
    env.update(ANSIBLE_INVENTORY_ENABLED="yaml", PATH=f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin")
    argv = [str(bin_dir / "ansible-playbook"), "-i", str(tmp_path / "inventory.json"), playbook] + (["--check"] if check else [])
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-3000:]
    assert "Premature end of stream" not in said and "become success" not in said, said[-3000:]
    assert said.count(SAID) == 1, said[-3000:]
    with open(out) as handle:
        tasks = json.load(handle)["tasks"]
    if playbook == README_PLAY:
        [verdict] = [t for t in tasks if t["task"] == VERDICT]
        assert verdict["status"] == "failed" and verdict["result"]["msg"].startswith(f"node-a: {SAID}"), verdict
        assert "sudo is not installed on this host" in verdict["result"]["msg"]
    else:
        assert f"node-a: {SAID}" in said and "sudo is not installed on this host" in said, said[-3000:]
