# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""supervisor:<glob> services: the pure parts (supervisorctl's output, supervisord's command line
and configuration files). The real supervisord is in tests/integration/test_supervisor_release.py."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor

# supervisorctl 4.2.5 status, as printed for a standalone program, a numprocs group and a
# heterogeneous group.
STATUS = """vllm                             RUNNING   pid 59, uptime 0:00:05
workers:workers_00               RUNNING   pid 61, uptime 0:00:05
workers:workers_01               BACKOFF   Exited too quickly (process log may have details)
serve:tokenizer                  STOPPED   Dec 01 10:01 AM
"""


def test_status_lines_become_programs():
    assert _supervisor.parse_status(STATUS + "error: <class 'xmlrpc.client.Fault'>\n") == [
        {"name": "vllm", "state": "RUNNING", "pid": 59},
        {"name": "workers:workers_00", "state": "RUNNING", "pid": 61},
        {"name": "workers:workers_01", "state": "BACKOFF", "pid": None},
        {"name": "serve:tokenizer", "state": "STOPPED", "pid": None},
    ]


@pytest.mark.parametrize("name, pattern, hit", [
    ("vllm", "vll*", True), ("workers:workers_00", "workers", True), ("workers:workers_00", "workers_0?", True),
    ("serve:tokenizer", "tokenizer", True), ("vllm", "sglang*", False),
])
def test_program_globs_match_the_name_group_or_process(name, pattern, hit):
    assert _supervisor.program_matches(name, pattern) is hit


@pytest.mark.parametrize("args, config", [
    (["-n", "-c", "/etc/supervisor/supervisord.conf"], "/etc/supervisor/supervisord.conf"),
    (["--configuration=/srv/s.conf"], "/srv/s.conf"),
    (["--configuration", "/srv/s.conf", "-n"], "/srv/s.conf"),
    (["-c/srv/s.conf"], "/srv/s.conf"),
    (["-n"], None),
])
def test_configuration_comes_from_supervisords_command_line(args, config):
    assert _supervisor.config_of(args) == config


def test_includes_are_resolved_against_the_main_files_directory():
    text = "[supervisord]\nlogfile=x\n[include]\nfiles = conf.d/*.conf /opt/more/*.ini ; comment\n"
    assert _supervisor.include_globs(text, "/etc/supervisor") == ["/etc/supervisor/conf.d/*.conf", "/opt/more/*.ini"]


def test_disabling_rewrites_the_options_of_that_section_only():
    text = ("[program:vllm]\ncommand=vllm serve\nautostart = true\nautorestart=unexpected ; why\n\n"
            "[program:sglang]\ncommand=sglang\nautorestart=true\n")
    new, before = _supervisor.with_options_off(text, "program:vllm")
    assert before == {"autostart": "true", "autorestart": "unexpected"}
    vllm, sglang = new.split("[program:sglang]")
    assert "autostart=false" in vllm and "autorestart=false" in vllm and "= true" not in vllm and "unexpected" not in vllm
    assert sglang == "\ncommand=sglang\nautorestart=true\n"


def test_disabling_adds_missing_options_after_the_header():
    new, before = _supervisor.with_options_off("[program:vllm]\ncommand=vllm serve", "program:vllm")
    assert before == {"autostart": None, "autorestart": None}
    assert new.splitlines()[:3] == ["[program:vllm]", "autostart=false " + _supervisor.MARK, "autorestart=false " + _supervisor.MARK]
    assert _supervisor.with_options_off("[program:other]\n", "program:vllm") is None


def test_section_names_for_group_and_numprocs_names():
    assert _supervisor.section_names("vllm") == ["program:vllm"]
    assert _supervisor.section_names("workers:workers_00") == ["program:workers_00", "program:workers"]


def test_plan_stops_running_programs_and_disables_named_ones():
    class Fake(_supervisor.Supervisor):
        def status(self, timeout=10.0):
            return _supervisor.parse_status(STATUS)

    steps = _supervisor.plan(["vllm", "serve:*", "nothing*"], "disabled", [Fake(23, "/etc/s.conf", "/usr/bin/supervisorctl")])
    assert [e["name"] for e in steps["stop"]] == ["vllm"]
    assert [e["name"] for e in steps["disable"]] == ["vllm", "serve:tokenizer"]
    assert steps["not_found"] == ["supervisor:nothing*"]
    assert _supervisor.public(steps["stop"][0]) == {"name": "vllm", "supervisor_pid": 23, "config": "/etc/s.conf", "state_before": "RUNNING",
                                                    "pid": 59}  # its process now: the record keeps the GPUs its family held


@pytest.mark.skipif(os.geteuid() != 0, reason="disable() edits only a file root owns")
def test_disabling_a_program_of_a_group_calls_supervisorctl_stop_for_it_and_nothing_else(tmp_path):
    # `update workers` (before issue 31) stopped and re-added every program of the group.
    conf = tmp_path / "trainer.conf"
    conf.write_text("[program:trainer]\ncommand=python3 train.py\nautostart=true\nautorestart=true\n")
    calls = []

    def run(argv, timeout):
        calls.append(argv[3:])
        return 0, "workers:trainer: stopped\n"

    supervisor = _supervisor.Supervisor(23, str(conf), "/usr/bin/supervisorctl", run)
    supervisor.config_files = lambda: [str(conf)]
    entry = {"name": "workers:trainer", "supervisor_pid": 23, "config": str(conf), "state_before": "RUNNING", "_supervisor": supervisor}
    done = _supervisor.act({"stop": [entry], "disable": [dict(entry)], "not_found": [], "warnings": []}, 10.0)
    assert calls == [["stop", "workers:trainer"]]
    assert done["disabled_programs"][0]["group_updated"] is False and done["warnings"] == []
    assert "autostart=false" in conf.read_text() and "autorestart=false" in conf.read_text()
