# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""gpu_audit_report's pure parts: the record of a registered result, parts, health in "needs
attention", the verdict, grouping, escaping, the heat map data and report.json's layout."""

from __future__ import annotations

import copy
import json

import pytest
from ansible.errors import AnsibleActionFail

from ansible_collections.zeromib.gpu.plugins.action.gpu_audit_report import ActionModule
from ansible_collections.zeromib.gpu.plugins.plugin_utils import _audit_report as plugin
from ansible_collections.zeromib.gpu.tests.unit.plugins.filter import audit_hosts as ah

EPOCH = 1748779200.0


def unhealthy(host="xid-h200"):
    record = ah.clean_h200x8(host)
    gpu = record["gpu"]["gpus"][5]
    gpu.update(healthy=False, health_checked=True,
               health_issues=["Xid 79 (GPU has fallen off the bus) in the kernel log at 7200 s ago"],
               health={"ecc_uncorrected_volatile": 0, "xids": [{"xid": 79, "time": "7200 s ago", "message": "NVRM: Xid"}], "unchecked": []})
    record["gpu"]["healthy"] = False
    record["gpu"]["health_checked"] = True
    record["gpu"]["health_issues"] = ["GPU 5 (00000000:1D:00.0): Xid 79 (GPU has fallen off the bus) in the kernel log at 7200 s ago"]
    return record


def unchecked(host="old-driver"):
    """An R440-like driver: no mig.mode.current, so MIG mode could not be checked."""
    record = ah.clean_h200x8(host)
    for gpu in record["gpu"]["gpus"]:
        gpu.update(healthy=True, health_checked=False, health_issues=[],
                   health={"unchecked": ["the driver does not know mig.mode.current: not checked"]})
    record["gpu"]["healthy"] = True
    record["gpu"]["health_checked"] = False
    return record


def report(*records, **kw):
    return plugin.build_report(list(records), generated_at=EPOCH, **kw)


# --------------------------------------------------------------------------- reading results


@pytest.mark.parametrize("result, status, error", [
    pytest.param({"changed": False, "ansible_facts": {"gpu": {"count": 0}}}, "ok", None, id="answered"),
    pytest.param({"unreachable": True, "msg": "Failed to connect to the host via ssh: timed out."}, "unreachable",
                 "Failed to connect to the host via ssh: timed out", id="unreachable"),
    pytest.param({"failed": True, "msg": "MODULE FAILURE.", "module_stderr": "Traceback...\nOSError: boom\n"}, "error",
                 "MODULE FAILURE: OSError: boom", id="module-crash-keeps-the-last-stderr-line"),
    pytest.param({"failed": True}, "error", "zeromib.gpu.gpu_facts failed", id="no-message"),
])
def test_a_registered_result_becomes_the_record_audit_gpus_used_to_set(result, status, error):
    record = plugin.host_record("node01", result)
    assert (record["host"], record["status"], record["error"]) == ("node01", status, error)
    assert (record["gpu"] is None) == (status != "ok")


class _Cache:
    def __init__(self, facts):
        self._nonpersistent_fact_cache = facts


class _HostVars:
    def __init__(self, facts, others):
        self._variable_manager = _Cache(facts)
        self.others = others
        self.raw_reads = []

    def raw_get(self, host):
        self.raw_reads.append(host)
        return self.others.get(host, {})


def test_play_results_are_read_once_from_the_cache_and_hosts_without_one_are_left_to_expected_hosts():
    answered = {"ansible_facts": {"gpu": ah.clean_h200x8()["gpu"]}}
    hostvars = _HostVars({"a": {"__gpu_audit_facts": answered}}, {"b": {"__gpu_audit_facts": {"unreachable": True, "msg": "x"}}})
    records = plugin.play_results({"hostvars": hostvars}, ["a", "b", "c"], "__gpu_audit_facts")
    assert [(r["host"], r["status"]) for r in records] == [("a", "ok"), ("b", "unreachable")]
    assert hostvars.raw_reads == ["b", "c"], "only hosts missing from the cache go through raw_get"


# --------------------------------------------------------------------------- parts


def test_parts_merge_into_the_report_of_the_whole_fleet(tmp_path):
    fleet = ah.fleet()
    whole = report(*copy.deepcopy(fleet))
    halves = [fleet[0::2], fleet[1::2]]
    for n, half in enumerate(halves):
        names = [r["host"] for r in half]
        (tmp_path / plugin.part_name(names)).write_text(json.dumps(plugin.part_document(half, names, EPOCH + n)))
    records, expected, epoch = plugin.read_parts([str(tmp_path)])
    merged = plugin.build_report(records, expected, epoch)
    assert epoch == EPOCH, "the earliest part says when the audit ran"
    assert merged == whole


def test_a_part_name_depends_on_its_hosts_only():
    assert plugin.part_name(["b", "a"]) == plugin.part_name(["a", "b"]) != plugin.part_name(["a"])


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read the part"),
    (json.dumps({"hosts": []}), "is not an audit part"),
    (json.dumps({"format": plugin.PART_FORMAT, "version": 9, "hosts_data": []}), "of version 9"),
])
def test_a_bad_part_fails_naming_the_file(tmp_path, content, message):
    path = tmp_path / "part.json"
    path.write_text(content)
    with pytest.raises(AnsibleActionFail, match=message):
        plugin.read_parts([str(path)])


def test_no_part_found_fails_naming_the_place(tmp_path):
    with pytest.raises(AnsibleActionFail, match="no part in"):
        plugin.read_parts([str(tmp_path / "*.json")])


def test_a_host_in_two_parts_fails_naming_it():
    with pytest.raises(AnsibleActionFail, match="host clean-h200 appears twice"):
        report(ah.clean_h200x8(), ah.clean_h200x8())


# --------------------------------------------------------------------------- health


def test_an_unhealthy_gpu_on_a_clean_host_needs_attention_and_its_xid_age_reads_in_hours():
    r = report(ah.clean_h200x8(), unhealthy())
    (entry,) = r["findings"]["attention"]
    assert entry == {"host": "xid-h200", "status": "clean", "reason": None,
                     "health": "GPU 5 (00000000:1D:00.0): Xid 79 (GPU has fallen off the bus) in the kernel log 2 h ago", "pending_restore": 0, "driver": None,
                     "shm": None, "ghost_busy": None}
    assert "7200 s" not in json.dumps(r["hosts"][1]["health_issues"])


def test_a_gpu_whose_health_was_not_fully_checked_needs_attention_saying_what():
    r = report(unchecked())
    (entry,) = r["findings"]["attention"]
    assert entry["health"] == "health not checked on GPU 0, 1, 2, 3, 4, 5, 6, 7: the driver does not know mig.mode.current: not checked"
    assert r["summary"]["gpus_health_unchecked"] == 8 and r["summary"]["hosts_health_unchecked"] == 1


def test_check_names_from_gpu_facts_are_preferred_to_its_notes():
    record = unchecked()
    for gpu in record["gpu"]["gpus"]:
        gpu["health_unchecked"] = ["mig_mode"]
    assert report(record)["hosts"][0]["health_reason"] == "health not checked on GPU 0, 1, 2, 3, 4, 5, 6, 7: mig_mode"


@pytest.mark.parametrize("dirty, unhealthy_, failing", [
    (True, False, ["dirty-h200"]),
    (False, True, ["xid-h200", "old-driver"]),
    (True, True, ["dirty-h200", "xid-h200", "old-driver"]),
    (False, False, []),
])
def test_the_verdict_fails_on_what_it_was_asked_to(dirty, unhealthy_, failing):
    r = report(ah.dirty_with_holders(), unhealthy(), unchecked(), ah.clean_h200x8())
    found = plugin.not_ready(r, dirty, unhealthy_)
    assert sorted(e["host"] for e in found) == sorted(failing)
    failed, msg = plugin.verdict(r, found, dirty, unhealthy_, "/r/report.html")
    assert failed == bool(failing)
    if failing:
        assert msg.startswith(f"{len(failing)} of 4 hosts") and msg.endswith("Report: /r/report.html")


def test_an_all_clean_fleet_says_so():
    r = report(ah.clean_h200x8("a"), ah.clean_h200x8("b"))
    assert plugin.verdict(r, [], True, True, "x") == (False, "All 2 hosts are clean and healthy")


# --------------------------------------------------------------------------- the page


def test_attention_is_grouped_by_kind_of_reason_largest_first():
    records = [ah.dirty_with_holders(f"dirty{n:02d}") for n in range(7)] + [ah.unreachable(f"gone{n}") for n in range(3)]
    records[-1]["error"] = records[-1]["error"].replace("10.0.3.29", "10.0.9.1")
    records += [unhealthy(f"xid{n}") for n in range(2)]
    groups = plugin.attention_groups(report(*records))
    assert [(g["status"], g["title"], g["count"]) for g in groups] == [
        ("dirty", "held by vllm.service", 7),
        ("unreachable", "Failed to connect to the host via ssh: ssh: connect to host <address> port <n>: No route to host", 3),
        ("unhealthy", "Xid 79 (GPU has fallen off the bus)", 2),
    ]
    assert groups[0]["first"] == ["dirty00", "dirty01", "dirty02", "dirty03", "dirty04"]


def test_files_killed_jobs_left_in_dev_shm_put_a_clean_host_under_needs_attention_with_its_line_and_gauges():
    left = ah.clean_h200x8("left")
    left["gpu"]["shm"] = {"path": "/dev/shm", "size_mib": 1024.0, "free_mib": 576.0, "files": 14, "unheld_mib": 448.0, "complete": True,
                          "error": None, "unheld": [{"path": f"/dev/shm/torch_4242_{i:d}_0", "size_mib": 32.0, "age_s": 40, "pattern": "torch_*",
                                                     "user": "alice"} for i in range(14)]}
    r = report(left, ah.clean_h200x8("tidy"))
    (entry,) = r["findings"]["attention"]
    line = "14 file(s) of killed jobs in /dev/shm that no process holds, 448 MiB (torch_* 14); 576 MiB free of 1024 MiB"
    assert (entry["host"], entry["status"], entry["shm"]) == ("left", "clean", line)
    assert [(g["status"], g["title"], g["count"]) for g in plugin.attention_groups(r)] == [("shm leftovers", "files of killed jobs left in /dev/shm", 1)]
    files = plugin.render(r)
    assert "14 file(s) of killed jobs in /dev/shm that no process holds, 448 MiB" in files["report.md"] and line in files["report.html"]
    assert 'zeromib_gpu_shm_unheld_files{host="left"} 14' in files["gpu_audit.prom"]
    assert 'zeromib_gpu_shm_free_mib{host="left"} 576.0' in files["gpu_audit.prom"]


@pytest.mark.parametrize("raw, escaped", [
    ("node_01", "node_01"),
    ("_private_ and __x", "\\_private\\_ and \\_\\_x"),
    ("a|b", "a\\|b"),
    ("*x* `y` [z](u) <b> &amp;", "\\*x\\* \\`y\\` \\[z\\](u) &lt;b&gt; &amp;amp;"),
    ("two\nlines", "two lines"),
    (None, "-"),
    (12, "12"),
])
def test_a_name_from_the_fleet_is_literal_text_in_markdown(raw, escaped):
    assert plugin.markdown_text(raw) == escaped


def test_a_command_line_in_a_code_span_cannot_end_the_span_or_the_cell():
    assert plugin.markdown_code("python -c 'a|b' `x`") == "python -c 'a\\|b' 'x'"


def test_data_for_the_page_script_cannot_end_the_script_element():
    text = plugin.json_for_script({"cmd": "</script><script>alert(1)</script> & <!--"})
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == {"cmd": "</script><script>alert(1)</script> & <!--"}


def test_heat_map_data_keeps_each_holder_line_once_per_host():
    r = report(ah.dirty_with_holders())
    data = plugin.heat_data(r)
    (row,) = data["h"]
    assert row[0] == "dirty-h200" and row[1] == "dirty" and row[8] == 1
    lines = row[9]
    assert len(lines) == len(set(lines))
    gpu0 = row[12][0]
    assert [lines[i] for i in gpu0[13]][0].startswith("pid 495 python3")
    assert data["s"][gpu0[8]] == "NVIDIA H200" and gpu0[4] & 1 == 0, "GPU 0 is dirty"


def test_report_json_is_the_model_with_a_line_per_host():
    r = report(*ah.fleet())
    text = plugin.report_json(r)
    assert json.loads(text) == json.loads(json.dumps(r))
    host_lines = [line for line in text.splitlines() if line.startswith('    {"') and '"host": ' in line]
    assert len(host_lines) == len(r["hosts"])


def test_every_file_renders_for_an_empty_fleet():
    files = plugin.render(report())
    assert set(files) == set(plugin.FILES)
    assert "None: every host is clean" in files["report.md"]


def test_files_are_written_atomically_and_unchanged_content_is_not_rewritten(tmp_path):
    path = tmp_path / "report.json"
    assert plugin.write_atomically(str(path), "one\n") is True
    mtime = path.stat().st_mtime_ns
    assert plugin.write_atomically(str(path), "one\n") is False and path.stat().st_mtime_ns == mtime
    assert plugin.write_atomically(str(path), "two\n") is True and path.read_text() == "two\n"
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"], "no temporary file left behind"


def test_a_list_is_required():
    with pytest.raises(AnsibleActionFail, match="must be a list of host records"):
        plugin.build_report({"host": "a"})


# --------------------------------------------------------------------------- the task: ActionModule.run


def _task(args, task_vars=None, check_mode=False):
    from ansible_collections.zeromib.gpu.tests.unit.plugins.action.action_harness import action

    return action(ActionModule, task_vars or {}, args=args, check_mode=check_mode, name="zeromib.gpu.gpu_audit_report")


@pytest.mark.parametrize("args, message", [
    pytest.param({"max_used_mib": "lots"}, "zeromib.gpu.gpu_audit_report: argument 'max_used_mib' is of type str", id="wrong-type"),
    pytest.param({"hosts_dat": []}, "Invalid options for zeromib.gpu.gpu_audit_report: hosts_dat", id="unknown-option"),
    pytest.param({"hosts_data_var": "saved"}, "zeromib.gpu.gpu_audit_report: saved must be a list of host records, got str",
                 id="variable-not-a-list"),
    pytest.param({"hosts_data": [{"host": "a", "status": "ok", "gpu": None}], "generated_at": float("nan"), "report": False},
                 "zeromib.gpu.gpu_audit_report: Invalid value NaN", id="a-time-that-is-not-a-number"),
])
def test_bad_arguments_fail_with_the_tasks_name_and_no_traceback(args, message):
    task = _task(args, {"saved": "not a list"})
    with pytest.raises(AnsibleActionFail) as caught:
        task.run(task_vars={"saved": "not a list"})
    assert str(caught.value.message).startswith(message)
    assert task.module.calls == [], "the report runs nothing on a node"


def test_the_task_writes_the_four_files_and_reports_its_verdict(tmp_path):
    records = [ah.dirty_with_holders(), ah.clean_h200x8()]
    args = {"hosts_data": records, "report_dir": str(tmp_path / "r"), "fail_on_dirty": True, "generated_at": EPOCH}
    result = _task(args).run(task_vars={})
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted(plugin.FILES)
    assert result["changed"] is True and result["files"] == [str(tmp_path / "r" / name) for name in plugin.FILES]
    assert result["verdict"]["failed"] is True and result["verdict"]["hosts"] == ["dirty-h200"]
    assert result["verdict"]["msg"].startswith("1 of 2 hosts is not clean: dirty-h200 (dirty")
    assert result["msg"] == result["summary_msg"] and result["msg"].startswith("2 hosts: 1 clean, 1 dirty, 0 error, 0 unreachable")
    assert _task(args).run(task_vars={})["changed"] is False, "the same report again changes nothing"


def test_check_mode_writes_nothing_and_says_what_it_would_write(tmp_path):
    args = {"hosts_data": [ah.clean_h200x8()], "report_dir": str(tmp_path / "r"), "write_part": str(tmp_path / "parts") + "/"}
    result = _task(args, check_mode=True).run(task_vars={})
    assert list(tmp_path.iterdir()) == [] and result["changed"] is True
    assert result["part"] == str(tmp_path / "parts" / plugin.part_name(["clean-h200"]))
    assert result["verdict"] == {"failed": False, "msg": "The host is clean", "hosts": []}


def test_the_plays_registered_results_are_read_when_no_data_is_given(tmp_path):
    task_vars = {"ansible_play_hosts_all": ["a", "b"],
                 "hostvars": _HostVars({"a": {"__gpu_audit_facts": {"ansible_facts": {"gpu": ah.clean_h200x8()["gpu"]}}}}, {})}
    result = _task({"report": False}, task_vars).run(task_vars=task_vars)
    assert result["summary"]["hosts_total"] == 2 and result["summary"]["hosts_clean"] == 1
    assert result["attention"][0]["host"] == "b", "a host of the play without a result needs attention"


# --------------------------------------------------------------------------- GPUs not visible on their host (issue 37)


def container_given_one_gpu(host="lxc101"):
    """An LXC container given GPU 3 of an 8-GPU machine: gpu_facts saw one GPU and names the seven
    the driver lists that the container cannot reach."""
    record = ah.clean_h200x8(host)
    record["gpu"]["gpus"] = record["gpu"]["gpus"][:1]
    record["gpu"]["count"] = 1
    record["gpu"]["not_visible"] = ["0000:18:00.0", "0000:2a:00.0"]
    return record


def test_gpus_not_visible_on_a_host_are_a_line_of_the_report_never_dirty_nor_clean_gpus():
    r = report(ah.clean_h200x8(), container_given_one_gpu())
    record = [h for h in r["hosts"] if h["host"] == "lxc101"][0]
    assert record["status"] == "clean" and record["gpu_count"] == 1 and record["not_visible"] == ["0000:18:00.0", "0000:2a:00.0"]
    assert r["findings"]["not_visible"] == [{"host": "lxc101", "gpu_count": 1, "not_visible": ["0000:18:00.0", "0000:2a:00.0"]}]
    assert r["summary"]["gpus_total"] == 9 and r["findings"]["attention"] == []  # counted: the host's own GPUs only
    files = plugin.render(r)
    assert "| lxc101 | 1 | 0000:18:00.0, 0000:2a:00.0 |" in files["report.md"]
    row = '<tr data-host="lxc101"><td class="mono">lxc101</td><td class="num">1</td><td class="mono">0000:18:00.0, 0000:2a:00.0</td></tr>'
    assert row in files["report.html"]
    assert "cannot see" not in plugin.render(report(ah.clean_h200x8()))["report.md"]  # no section where every host sees its GPUs


# --------------------------------------------------------------------------- device files not in nvidia-smi's order (issue 69)


def minors_permuted(host="gpu-amd01"):
    """A host whose /dev/nvidia0 is nvidia-smi's GPU 6 (PrincetonUniversity/jobstats #34), as gpu_facts reports it."""
    record = ah.clean_h200x8(host)
    minors = [1, 2, 3, 4, 5, 6, 0, 7]
    for gpu in record["gpu"]["gpus"]:
        gpu["minor_number"] = minors[gpu["index"]]
    record["gpu"]["minor_order_differs"] = True
    return record


def test_a_host_whose_device_files_are_not_in_nvidia_smis_order_is_flagged_with_each_gpus_file():
    r = report(ah.clean_h200x8(), minors_permuted())
    record = [h for h in r["hosts"] if h["host"] == "gpu-amd01"][0]
    assert record["status"] == "clean" and record["minor_order_differs"] is True
    [finding] = r["findings"]["minor_order"]
    assert finding["host"] == "gpu-amd01" and finding["gpus"][6] == {"index": 6, "minor_number": 0}
    files = plugin.render(r)
    assert "## Hosts whose device files are not in nvidia-smi's order" in files["report.md"]
    row = "| gpu-amd01 | " + ", ".join(f"{i}: /dev/nvidia{m}" for i, m in enumerate([1, 2, 3, 4, 5, 6, 0, 7])) + " |"
    assert row in files["report.md"]
    assert '<tr data-host="gpu-amd01"><td class="mono">gpu-amd01</td><td class="mono">0: /dev/nvidia1, ' in files["report.html"]
    assert 'zeromib_gpu_minor_order_differs{host="gpu-amd01"} 1' in files["gpu_audit.prom"]
    plain = plugin.render(report(ah.clean_h200x8()))
    assert "zeromib_gpu_minor_order_differs{" not in plain["gpu_audit.prom"]  # a host whose minor numbers are unknown has no sample
    assert "not in nvidia-smi's order" not in plain["report.md"] and 'id="minor-order"' not in plain["report.html"]


def test_a_host_whose_minor_numbers_are_unknown_is_not_flagged():
    record = minors_permuted()
    record["gpu"]["minor_order_differs"] = None
    r = report(record)
    assert r["hosts"][0]["minor_order_differs"] is None and r["findings"]["minor_order"] == []


def test_the_heat_maps_note_says_a_unified_memory_gpus_proof_and_a_plain_gpu_has_none():
    unified = {"processes": [], "memory_proof": "unified memory", "host_memory_available_mib": 612}
    assert plugin._heat_notes(unified) == [
        "unified memory: free with no compute process and min_host_available_mib of host memory; 612 MiB available"]
    assert plugin._heat_notes({"processes": [], "memory_proof": "memory.used"}) == []
