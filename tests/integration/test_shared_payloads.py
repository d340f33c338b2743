"""The test session's shared AnsiballZ cache (tests/fleet/callback_plugins/shared_payloads.py):
keyed by what payloads are made from, used only when private, and really shared between runs."""
import os
import subprocess
import sys

from ansible_in_ns import CALLBACKS, REPO, VENV_BIN, playbook_env

sys.path.insert(0, CALLBACKS)
import shared_payloads  # noqa: E402

PLAY = "---\n- hosts: localhost\n  gather_facts: false\n  tasks:\n    - ansible.builtin.ping:\n"


def test_the_key_changes_with_any_source_file_and_not_with_bytecode(tmp_path):
    plugins = tmp_path / "plugins"
    (plugins / "module_utils" / "__pycache__").mkdir(parents=True)
    source = plugins / "module_utils" / "_x.py"
    source.write_text("A = 1\n")
    key = shared_payloads.content_key([str(plugins)])
    (plugins / "module_utils" / "__pycache__" / "_x.cpython-311.pyc").write_bytes(b"\0")
    assert shared_payloads.content_key([str(plugins)]) == key
    source.write_text("A = 22\n")
    assert shared_payloads.content_key([str(plugins)]) != key


def run_ping(tmp_path, shared):
    play = tmp_path / "ping.yml"
    play.write_text(PLAY)
    env = dict(os.environ, **playbook_env(ZEROMIB_SHARED_ANSIBALLZ=str(shared)))
    return subprocess.run([os.path.join(VENV_BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", str(play),
                           "-e", f"ansible_python_interpreter={sys.executable}"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)


def test_two_runs_share_one_payload_and_a_directory_others_may_write_is_not_used(tmp_path):
    shared = tmp_path / "cache"
    first = run_ping(tmp_path, shared)
    assert first.returncode == 0, first.stdout + first.stderr
    [key_dir] = list(shared.iterdir())
    [payload] = [p for p in key_dir.iterdir() if p.name.startswith("ansible.modules.ping-") and not p.name.endswith(".lock")]
    built = payload.stat().st_mtime_ns
    second = run_ping(tmp_path, shared)
    assert second.returncode == 0, second.stdout + second.stderr
    assert payload.stat().st_mtime_ns == built  # read, not built again
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    third = run_ping(tmp_path, open_dir)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "not a directory of this user's only; not shared" in third.stdout + third.stderr
    assert list(open_dir.iterdir()) == []
