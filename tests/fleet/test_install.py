"""The collection as its users install and run it, against the fleet (real SSH, real systemd):

* from a fresh checkout, README.md's set-up and then its headline command, as written;
* installed without any Galaxy server: from the git repository and from the built tarball, then
  run in the installed form (`ansible-playbook zeromib.gpu.free_gpus`);
* as an AWX / Ansible Automation Platform job: the project's collection requirements installed
  as AWX's project update does, then free_gpus.yml run through ansible-runner (the engine
  under AWX), one job per slice of the inventory, as job slicing does.

The "checkout" is a copy of this working tree (what git tracks or would track), committed
into a repository of its own, so uncommitted changes are tested too.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import fleet as rig

REPO = rig.REPO
VENV_BIN = REPO / ".venv" / "bin"

README = (REPO / "README.md").read_text()
# Galaxy must never be asked: any request to a Galaxy server goes to a closed local port.
NO_GALAXY = {"ANSIBLE_GALAXY_SERVER": "http://127.0.0.1:9/api/", "ANSIBLE_GALAXY_SERVER_LIST": ""}


def user_env(**extra: str) -> dict:
    """A user's shell: the venv's tools on PATH, no Ansible settings from this test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "ZEROMIB_", "PYTEST_"))}
    env.update({"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ANSIBLE_NOCOLOR": "1", "ANSIBLE_HOST_KEY_CHECKING": "False", **NO_GALAXY, **extra})
    return env


def sh(cmd: str | list, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd) if isinstance(cmd, str) else cmd
    r = subprocess.run(argv, cwd=cwd, env=env or user_env(), stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=timeout, check=False)
    assert r.returncode == 0, f"$ {shlex.join(argv)} (in {cwd}) -> rc {r.returncode}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    return r


def readme_block(heading: str) -> list[str]:
    """The commands of the first ```sh block after HEADING in README.md (comments dropped)."""
    after = README[README.index(heading):]
    block = re.search(r"```sh\n(.*?)```", after, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("clone") / "gpu"
    dest.mkdir()
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           check=True).stdout
    listed = b"\0".join(f for f in files.split(b"\0") if f and (REPO / f.decode()).exists())
    subprocess.run(["tar", "--null", "-T", "-", "-cf", str(dest.parent / "tree.tar")], cwd=REPO, input=listed, check=True)
    subprocess.run(["tar", "-xf", str(dest.parent / "tree.tar"), "-C", str(dest)], check=True)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "checkout under test"]):
        subprocess.run(git + args, cwd=dest, check=True)
    return dest


def write_inventory(fleet, where: Path) -> Path:
    """The fleet's inventory as an operator's inventory.ini, with the MIG group's baseline
    (its GPUs idle at 55 MiB) in group_vars next to it, as README.md advises."""
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(fleet.inventory, where / "inventory.ini")
    for h in fleet.hosts:
        if h.idle_mib > 0:
            (where / "group_vars").mkdir(exist_ok=True)
            (where / "group_vars" / f"{h.preset.replace('-', '_')}.yml").write_text(
                json.dumps({"free_gpus_max_used_mib": 64, "gpu_audit_max_used_mib": 64}) + "\n")
    return where / "inventory.ini"


def idle(fleet, host: str) -> bool:
    return max(fleet.gpu_memory(host).values()) <= fleet.host(host).idle_mib


def test_readme_set_up_then_headline_command_from_a_fresh_checkout(clean_fleet, checkout):
    """README.md's block, run as written by one shell in the checkout (only the clone itself is
    the fixture's): its own venv, the link, then the headline command and the audit."""
    fleet = clean_fleet
    steps = readme_block("## Run it from a checkout")
    headline = "ansible-playbook playbooks/free_gpus.yml -i inventory.ini -l gpu_nodes"
    assert headline in steps and steps.index("make install") < steps.index(headline), steps
    assert f"```sh\n{headline}\n```" in README, "the headline command at the top of README.md changed"
    write_inventory(fleet, checkout)
    busy = fleet.names[0]
    fleet.workload(busy, "vllm")
    script = [s for s in steps if not s.startswith(("git clone", "cd "))]
    marked = []
    for step in script:
        marked += [f"echo '>>> {step}'", step]
    # The user's own PATH (python3 to make the venv), without this test run's venv.
    env = user_env(PATH=os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                        if p and Path(p) != VENV_BIN))
    r = sh(["bash", "-euo", "pipefail", "-c", "\n".join(marked)], checkout, env, timeout=600)
    out = r.stdout.split(f">>> {headline}\n", 1)[1]
    assert f"{len(fleet.names)} hosts: 1 freed, {len(fleet.names) - 1} clean" in out, out
    assert idle(fleet, busy)
    # The collection that ran is the checkout's own, found through its ansible.cfg.
    listed = sh([str(checkout / ".venv" / "bin" / "ansible-galaxy"), "collection", "list", "zeromib.gpu"], checkout).stdout
    assert str(checkout / ".build" / "collections") in listed, listed
    assert (checkout / "gpu_audit_report" / "report.html").exists()


def test_install_from_git_and_from_tarball_without_galaxy_then_run_installed_form(clean_fleet, checkout, tmp_path):
    fleet = clean_fleet
    install = readme_block("## Install")
    assert any(s.startswith("ansible-galaxy collection install git+") for s in install), install
    assert any(s.startswith("ansible-galaxy collection build --force && ansible-galaxy collection install zeromib-gpu-") for s in install), install
    inventory = write_inventory(fleet, tmp_path / "ops")

    from_git = tmp_path / "from-git"
    sh(["ansible-galaxy", "collection", "install", f"git+file://{checkout}", "-p", str(from_git)], tmp_path)
    built = tmp_path / "built"
    sh(["ansible-galaxy", "collection", "build", "--output-path", str(built)], checkout)
    (tarball,) = built.glob("zeromib-gpu-*.tar.gz")
    from_tarball = tmp_path / "from-tarball"
    sh(["ansible-galaxy", "collection", "install", str(tarball), "-p", str(from_tarball)], tmp_path)

    for installed, host in ((from_git, fleet.names[0]), (from_tarball, fleet.names[1])):
        manifest = json.loads((installed / "ansible_collections" / "zeromib" / "gpu" / "MANIFEST.json").read_text())
        assert manifest["collection_info"]["name"] == "gpu"
        fleet.workload(host, "train", mib=2048)
        env = user_env(ANSIBLE_COLLECTIONS_PATH=str(installed))
        r = sh(["ansible-playbook", "zeromib.gpu.free_gpus", "-i", str(inventory), "-l", host], inventory.parent, env)
        assert "1 host: 1 freed" in r.stdout, r.stdout
        assert idle(fleet, host)


USER_PLAY = """---
- name: Free the GPUs, then train
  hosts: gpu_nodes
  gather_facts: false
  become: true
  pre_tasks:
    - name: Free the GPUs of every node and prove they read 0 MiB
      ansible.builtin.import_role:
        name: zeromib.gpu.free_gpus
  tasks:
    - name: Train
      ansible.builtin.command: "true"
      changed_when: true
"""


@pytest.mark.parametrize("form", ["git", "tarball"])
def test_readme_install_in_a_checkout_after_make_install_makes_the_role_found_from_a_fresh_folder(checkout, tmp_path, form):
    """README.md's install commands, as written, run inside the checkout after `make install` has
    linked it (its ansible.cfg then finds the checkout first: without --force, "Nothing to do"), with
    a home of the test's own; then a play of the user's in a fresh folder, with no ansible.cfg, finds
    the role and the installed playbook by name. Nothing runs on a host: --list-tasks reads the role,
    and the installed free_gpus.yml refuses an inventory that matches nothing."""
    sh("make collection", checkout)
    home = tmp_path / "home"
    home.mkdir()
    env = user_env(HOME=str(home))
    lines = readme_block("## Install")
    start = "ansible-galaxy collection install git+" if form == "git" else "ansible-galaxy collection build"
    line = next(s for s in lines if s.startswith(start))
    line = line.replace("git+https://github.com/zeromib/gpu.git,main", f"git+file://{checkout},main")
    sh(["bash", "-euo", "pipefail", "-c", line], checkout, env)
    installed = home / ".ansible" / "collections" / "ansible_collections" / "zeromib" / "gpu"
    assert (installed / "MANIFEST.json").exists() and not installed.is_symlink(), sorted(home.rglob("*"))[:20]

    mine = tmp_path / "my-playbooks"
    mine.mkdir()
    (mine / "inventory.ini").write_text("[gpu_nodes]\nnode1 ansible_host=192.0.2.1\n")
    (mine / "train.yml").write_text(USER_PLAY)
    r = sh(["ansible-playbook", "-i", "inventory.ini", "train.yml", "--list-tasks"], mine, env)
    assert "zeromib.gpu.free_gpus : " in r.stdout and "Train" in r.stdout, r.stdout
    r = subprocess.run(["ansible-playbook", "zeromib.gpu.free_gpus", "-i", "missing.ini", "-l", "gpu_nodes"], cwd=mine, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 4 and "free_gpus.yml: no host to free" in r.stdout + r.stderr, r.stdout + r.stderr


def test_free_gpus_job_through_ansible_runner_in_two_slices(clean_fleet, checkout, tmp_path):
    """What AWX does for a job template of playbooks/free_gpus.yml with job slicing 2: the
    project update installs the collection requirements, then each slice's job runs through
    ansible-runner with the project as its working directory."""
    import ansible_runner

    fleet = clean_fleet
    data = tmp_path / "job"
    (data / "inventory").mkdir(parents=True)
    write_inventory(fleet, data / "inventory")
    (data / "inventory" / "inventory.ini").rename(data / "inventory" / "hosts")
    tarball_dir = tmp_path / "built"
    sh(["ansible-galaxy", "collection", "build", "--output-path", str(tarball_dir)], checkout)
    (tarball,) = tarball_dir.glob("zeromib-gpu-*.tar.gz")
    requirements = tmp_path / "requirements.yml"
    requirements.write_text(f"---\ncollections:\n  - name: {tarball}\n    type: file\n")
    collections = data / "requirements_collections"
    sh(["ansible-galaxy", "collection", "install", "-r", str(requirements), "-p", str(collections)], tmp_path)

    fleet.workload(fleet.names[0], "vllm")
    fleet.workload(fleet.names[-1], "train", mib=1024)
    names = fleet.names
    slices = [names[i::2] for i in range(2)]
    env = user_env(ANSIBLE_COLLECTIONS_PATH=str(collections))
    seen = set()
    for n, hosts in enumerate(slices, 1):
        r = ansible_runner.run(private_data_dir=str(data), project_dir=str(checkout), playbook="playbooks/free_gpus.yml",
                               inventory=str(data / "inventory"), limit=",".join(hosts), envvars=env,
                               extravars={"free_gpus_services": ["vllm*.service"], "free_gpus_kill_timeout": 2},
                               ident=f"slice-{n}", quiet=True)
        assert (r.status, r.rc) == ("successful", 0), f"slice {n}: {r.status} rc {r.rc}\n{r.stdout.read()[-6000:]}"
        released = {e["event_data"]["host"] for e in r.events if e.get("event") == "runner_on_ok"
                    and e["event_data"].get("task_action", "").endswith("free_gpus_gate")}
        assert released == set(hosts), released
        seen |= released
        assert set(r.stats["ok"]) == set(hosts), r.stats
    assert seen == set(names), seen
    for host in (names[0], names[-1]):
        assert idle(fleet, host)
