# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""supervisor:<glob> services: the pure parts (supervisorctl's output, supervisord's command line
and configuration files). The real supervisord is in tests/integration/test_supervisor_release.py."""

from __future__ import annotations

import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _release as release
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _restore as restore
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _supervisor
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed

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


class Fake(_supervisor.Supervisor):
    """A supervisord whose status and configuration files are given: [(path, text, root only)]."""

    def __init__(self, status=STATUS, files=(), pid=23):
        super().__init__(pid, "/etc/supervisor/supervisord.conf", "/usr/bin/supervisorctl")
        self.listing, self.files = status, list(files)

    def status(self, timeout=10.0):
        return _supervisor.parse_status(self.listing)

    def configuration(self):
        return self.files


CONF = [("/etc/supervisor/conf.d/vllm.conf", "[program:vllm]\ncommand=vllm serve\n", True),
        ("/etc/supervisor/conf.d/serve.conf", "[group:serve]\nprograms=tokenizer\n[program:tokenizer]\ncommand=tok\n", True)]


def test_plan_stops_running_programs_and_disables_named_ones():
    steps = _supervisor.plan(["vllm", "serve:*", "nothing*"], "disabled", [Fake(files=CONF)])
    assert [e["name"] for e in steps["stop"]] == ["vllm"]
    assert [e["name"] for e in steps["disable"]] == ["vllm", "serve:tokenizer"]
    assert steps["not_found"] == ["supervisor:nothing*"]
    assert _supervisor.public(steps["stop"][0]) == {"name": "vllm", "supervisor_pid": 23, "config": "/etc/supervisor/supervisord.conf",
                                                    "state_before": "RUNNING", "pid": 59}  # its process now: the record keeps the GPUs its family held


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


# ------------------------------------------------------------------ numprocs copies (issue 54, class 3)

# supervisorctl 4.2.5 status of a [program:trainer] with numprocs=2 and
# process_name=%(program_name)s_%(process_num)d, beside an exporter.
NUMPROCS_STATUS = """exporter                         RUNNING   pid 70, uptime 0:00:09
trainer:trainer_0                RUNNING   pid 71, uptime 0:00:09
trainer:trainer_1                RUNNING   pid 72, uptime 0:00:09
"""
TRAINER = ("[program:trainer]\ncommand=/usr/bin/gpu_holder --gpus %(process_num)d ; one GPU a copy\nnumprocs = 2\n"
           "process_name=%(program_name)s_%(process_num)d\nautostart=true\nautorestart=true\n")
NUMPROCS_CONF = [("/etc/supervisor/conf.d/trainer.conf", TRAINER, True),
                 ("/etc/supervisor/conf.d/exporter.conf", "[program:exporter]\ncommand=/bin/sleep 100000\n", True)]


def numprocs_plan(patterns, state, files=None, status=NUMPROCS_STATUS):
    return _supervisor.plan(patterns, state, [Fake(status, NUMPROCS_CONF if files is None else files)], node="gpu-node-7")


def test_the_names_of_numprocs_copies_come_from_their_section_as_supervisord_makes_them():
    sections, where = _supervisor.read_sections([(path, text) for path, text, _root in NUMPROCS_CONF])
    assert sections["program:trainer"]["numprocs"] == "2" and sections["program:trainer"]["command"] == "/usr/bin/gpu_holder --gpus %(process_num)d"
    assert _supervisor.names_by_section(sections, where, "gpu-node-7") == {
        "trainer:trainer_0": "program:trainer", "trainer:trainer_1": "program:trainer", "exporter": "program:exporter"}


def test_copies_in_a_group_with_numprocs_start_a_padded_number_and_the_node_name():
    text = ("[group:pool]\nprograms = worker, web\n[program:worker]\nnumprocs=3\nnumprocs_start=1\n"
            "process_name=%(host_node_name)s-%(group_name)s-%(process_num)02d\n[program:web]\ncommand=web\n")
    sections, where = _supervisor.read_sections([("/etc/supervisor/supervisord.conf", text)])
    assert _supervisor.names_by_section(sections, where, "n7") == {
        "pool:n7-pool-01": "program:worker", "pool:n7-pool-02": "program:worker", "pool:n7-pool-03": "program:worker", "pool:web": "program:web"}


@pytest.mark.parametrize("options", [
    {"numprocs": "%(ENV_COPIES)s", "process_name": "w_%(process_num)d"},  # supervisord's environment: not known here
    {"numprocs": "2", "process_name": "%(ENV_PREFIX)s_%(process_num)d"},
    {"numprocs": "0"}, {"numprocs": "1000000", "process_name": "w_%(process_num)d"},
], ids=["env-numprocs", "env-name", "zero", "absurd"])
def test_names_that_cannot_be_worked_out_are_left_unknown(options):
    assert _supervisor.copy_names("w", "w", options, "/etc", "n7") == []


def test_copies_are_also_known_from_supervisords_own_listing():
    # process_name from supervisord's environment (not expandable here), or numprocs edited since supervisord read it:
    # the names it runs in group trainer still come from [program:trainer].
    found = _supervisor.sections_of(["trainer:trainer_0", "trainer:trainer_1", "exporter"], {"program:trainer", "program:exporter"}, {})
    assert found == {"trainer:trainer_0": "program:trainer", "trainer:trainer_1": "program:trainer", "exporter": "program:exporter"}
    assert _supervisor.copies_of("trainer:trainer_1", found) == ["trainer:trainer_0", "trainer:trainer_1"]
    assert _supervisor.copies_of("exporter", found) == ["exporter"]


def test_disabling_one_copy_is_refused_before_anything_with_the_reason_and_the_alternative():
    with pytest.raises(StepFailed) as refused:
        numprocs_plan(["trainer:trainer_0"], "disabled")
    assert refused.value.msg == (
        "not disabling: supervisor:trainer:trainer_0 is one of the 2 copies of [program:trainer] (numprocs), whose autostart and autorestart "
        "hold for every copy: disabling it would also keep trainer:trainer_1, not named, stopped from supervisord's next start. Name the "
        "program to stop and disable every copy (services: [supervisor:trainer:*]; refused when a copy holds a GPU outside the selection), "
        "or set service_state: stopped to stop it only. Nothing was stopped or changed")


@pytest.mark.parametrize("patterns, state", [(["*_0"], "disabled"), (["trainer_1", "exporter"], "masked")])
def test_a_glob_that_selects_some_copies_is_refused_too(patterns, state):
    with pytest.raises(StepFailed, match=r"is one of the 2 copies of \[program:trainer\]"):
        numprocs_plan(patterns, state)


@pytest.mark.parametrize("patterns", [["trainer"], ["trainer:*"], ["trainer_*"], ["trainer:trainer_0", "trainer:trainer_1"]])
def test_naming_every_copy_disables_them_all(patterns):
    steps = numprocs_plan(patterns, "disabled")
    assert [e["name"] for e in steps["stop"]] == [e["name"] for e in steps["disable"]] == ["trainer:trainer_0", "trainer:trainer_1"]
    assert {e["_section"] for e in steps["disable"]} == {"program:trainer"}


def test_stopping_one_copy_stops_that_copy_only():
    steps = numprocs_plan(["trainer:trainer_0"], "stopped")
    assert [e["name"] for e in steps["stop"]] == ["trainer:trainer_0"] and steps["disable"] == []


def test_a_copy_of_a_group_shared_with_another_program_is_named_by_its_copies():
    status = "pool:worker_0  RUNNING   pid 81, uptime 0:00:02\npool:worker_1  RUNNING   pid 82, uptime 0:00:02\npool:web  RUNNING   pid 83, uptime 0:00:02\n"
    files = [("/etc/supervisor/conf.d/pool.conf", "[group:pool]\nprograms=worker,web\n[program:worker]\nnumprocs=2\n"
              "process_name=worker_%(process_num)d\n[program:web]\ncommand=web\n", True)]
    with pytest.raises(StepFailed, match=r"services: \[supervisor:pool:worker_0, supervisor:pool:worker_1\]"):
        numprocs_plan(["pool:worker_1"], "disabled", files, status)
    # The web program of the same group is no copy of the worker: disabling it alone is fine.
    assert [e["name"] for e in numprocs_plan(["web"], "disabled", files, status)["disable"]] == ["pool:web"]


def test_a_section_only_a_user_can_have_written_decides_nothing():
    # The same text in a file a user may write: its numprocs and names are not believed, and the program is not disabled.
    untrusted = [(path, text, False) for path, text, _root in NUMPROCS_CONF]
    with pytest.raises(StepFailed) as refused:
        numprocs_plan(["trainer"], "disabled", untrusted)
    assert ("supervisor:trainer:trainer_0: its [program:trainer] is in /etc/supervisor/conf.d/trainer.conf, not a file only root can write: "
            "not editing it") in refused.value.msg
    with pytest.raises(StepFailed, match="no file of supervisord's configuration could be read"):
        numprocs_plan(["exporter"], "disabled", [])


def holder(pid, gpus):
    return {"pid": pid, "gpu_indexes": gpus}


# The copies' processes: trainer_0 (pid 71) runs python (pid 171) on GPU 0, trainer_1 (pid 72) holds GPU 1 itself.
HOLDERS = [holder(171, [0]), holder(72, [1]), holder(300, [0])]
PARENTS = {171: [171, 71, 1], 72: [72, 1], 300: [300, 1]}


@pytest.mark.parametrize("selected, spanning", [
    ([0], [{"program": "trainer:trainer_1", "section": "program:trainer", "pids": [72], "gpu_indexes": [1], "outside_gpus": [1]}]),
    ([1], [{"program": "trainer:trainer_0", "section": "program:trainer", "pids": [171], "gpu_indexes": [0], "outside_gpus": [0]}]),
    ([0, 1], []),
    ([2], []),  # named, and none of them holds a selected GPU: nothing of the selection's work to protect
])
def test_a_program_named_whole_spans_when_its_copies_work_inside_and_outside_the_selection(selected, spanning):
    steps = numprocs_plan(["trainer"], "disabled")
    assert _supervisor.spanning_copies(steps, HOLDERS, selected, PARENTS.__getitem__) == spanning


def test_one_copy_named_to_stop_is_no_spanning_program():
    steps = numprocs_plan(["trainer:trainer_0"], "stopped")
    assert _supervisor.spanning_copies(steps, HOLDERS, [0], PARENTS.__getitem__) == []


def test_the_spanning_message_names_the_copy_and_its_gpu():
    copy = {"program": "trainer:trainer_1", "section": "program:trainer", "pids": [72], "gpu_indexes": [1], "outside_gpus": [1]}
    message = release.spanning_message([], [], [], [0], [copy])
    assert message.startswith(
        "refusing to free GPU 0: ending these would also end their work on GPUs outside the selection: supervisor:trainer:trainer_1 (pids 72), "
        "a copy of [program:trainer] that naming the program stops too, holds GPU 1, outside the selection")
    assert "Nothing was stopped or signalled" in message and "kill_spanning: true" in message
    [record] = release.spanning_record([], [], [], [copy])
    assert record == {"pid": None, "name": "trainer:trainer_1", "cmdline": None, "unit": None, "container": None, "program": "trainer:trainer_1",
                      "pids": [72], "gpu_indexes": [1], "outside_gpus": [1]}


@pytest.mark.skipif(os.geteuid() != 0, reason="disable() edits only a file root owns")
def test_disabling_every_copy_edits_their_section_once_and_restore_puts_it_back_once(tmp_path):
    conf = tmp_path / "trainer.conf"
    conf.write_text(TRAINER)
    calls = []

    def run(argv, timeout):
        calls.append(argv[3:])
        return 0, "trainer:trainer_0: stopped\ntrainer:trainer_1: stopped\n"

    supervisor = Fake(files=[(str(conf), TRAINER, True)], status=NUMPROCS_STATUS)
    supervisor.run, supervisor.config, supervisor.config_files = run, str(conf), lambda: [str(conf)]
    steps = _supervisor.plan(["trainer"], "disabled", [supervisor], node="n7")
    done = _supervisor.act(steps, 10.0)
    assert calls == [["stop", "trainer:trainer_0", "trainer:trainer_1"]]
    assert [(d["name"], d["section"], d["autostart_before"], d["autorestart_before"]) for d in done["disabled_programs"]] == [
        ("trainer:trainer_0", "program:trainer", "true", "true"), ("trainer:trainer_1", "program:trainer", "true", "true")]
    text = conf.read_text()
    assert text.count("autostart=false") == 1 and text.count("autorestart=false") == 1
    # What gpu_restore writes back for either copy's entry: the file as it was.
    entry = dict(done["disabled_programs"][1], kind="supervisor", actions=["stopped", "disabled"])
    assert restore.program_edit(entry, _supervisor) == TRAINER
