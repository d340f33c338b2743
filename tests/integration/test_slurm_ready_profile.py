"""The Slurm prolog checks the training-ready profile (issue 71), run as slurmd runs the hook: the
runner packed by the role's pack_runner.py, `python3 RUNNER prolog` with slurmd's environment, on a
simulated host whose driver keeps the inference side's settings (tests/sim/nvidia-smi settings.json).
A job's GPU off the profile fails the prolog, named in its first sentence; the site's ready_profile in
the hooks' config overrides or skips a setting; a wrong one is refused in one line. The real-Slurm
cases of the hooks are in tests/fleet/test_slurm_checks_fleet.py.
"""
import json
import os
import subprocess

import pytest

from test_slurm_epilog_smoke import BUS, gres_conf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """The hook as the slurm_gpu_checks role installs it (pack_runner.py)."""
    out = tmp_path_factory.mktemp("runner") / "slurm_gpu_checks.pyz"
    subprocess.run(["/usr/bin/python3", os.path.join(REPO, "roles", "slurm_gpu_checks", "files", "pack_runner.py"),
                    os.path.join(REPO, "plugins", "module_utils"), str(out)], check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="module")
def host(module_nshost):
    return module_nshost("h200x2", seed="readyslurm")


def settings(host, values):
    with open(f"{host.root.state}/settings.json", "w") as handle:
        json.dump(values, handle)


def prolog(host, runner, tmp_path, job, gpus="0,1", **options):
    config, log = tmp_path / f"config-{job}.json", tmp_path / f"log-{job}.jsonl"
    config.write_text(json.dumps(dict({"drain": "exit_status", "log": str(log)}, **options)))
    config.chmod(0o600)
    gres_conf(host)
    env = {"SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus, "CUDA_VISIBLE_DEVICES": gpus, "SLURM_SCRIPT_CONTEXT": "prolog_slurmd",
           "SLURM_CONF": "/etc/slurm/slurm.conf", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = host.run(["/usr/bin/python3", runner, "prolog", f"--config={config}"], env=env, timeout=120)
    text = log.read_text() if log.exists() else host.read("/var/log/zeromib-gpu/slurm_gpu_checks.log")
    return proc.returncode, proc.stderr, json.loads(text.splitlines()[-1])


def test_a_gpu_left_in_exclusive_process_fails_the_prolog_naming_it(host, runner, tmp_path):
    settings(host, {host.config["gpus"][1]["uuid"]: {"compute_mode": "Exclusive_Process"}})
    try:
        rc, stderr, entry = prolog(host, runner, tmp_path, "801")
    finally:
        settings(host, {})
    assert (rc, entry["ok"]) == (1, False), stderr
    assert stderr.startswith(f"zeromib: prolog job 801: GPU 1 ({BUS[1]}): compute mode is Exclusive_Process, expected Default"), stderr


def test_a_power_limit_below_the_default_fails_and_the_sites_profile_accepts_it(host, runner, tmp_path):
    settings(host, {host.config["gpus"][0]["uuid"]: {"power.limit": "400.00", "power.default_limit": "700.00"}})
    try:
        rc, stderr, entry = prolog(host, runner, tmp_path, "802", gpus="0")
        assert (rc, entry["ok"]) == (1, False) and "power limit is 400 W, below the default 700 W" in stderr, stderr
        rc, stderr, entry = prolog(host, runner, tmp_path, "803", gpus="0", ready_profile={"power_limit": "350"})
        assert (rc, entry["ok"]) == (0, True), stderr
    finally:
        settings(host, {})


def test_a_wrong_ready_profile_in_the_config_is_refused_in_one_line(host, runner, tmp_path):
    rc, stderr, entry = prolog(host, runner, tmp_path, "805", ready_profile={"compute_mode": "exclusive"})
    assert (rc, entry["ok"]) == (1, False)
    [cause] = entry["causes"]
    assert "ready_profile.compute_mode must be one of default, exclusive_process, prohibited, any; got 'exclusive'" in cause, cause
