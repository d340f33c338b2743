# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Paused containers (_act/_paused, issue 70): the runtime's word that a container is paused (real
readings of Docker 20.10 and Podman 4.3, tests/fixtures/docker), the plan (named: unpaused then
stopped; not named: refused naming `docker unpause NAME`) and the act, on a fake runtime. Through the
real Docker: tests/integration/test_paused_containers.py."""

from __future__ import annotations

import json
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers as containers
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _paused as paused
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines as engines

from ansible_collections.zeromib.gpu.tests.unit.plugins.module_utils._act.test_containers import A, B, FakeRuntimes, holder, plan, record

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "docker")


def inspect_fixture(name):
    with open(os.path.join(FIXTURES, name)) as handle:
        data = json.load(handle)
    return data[0] if isinstance(data, list) else data


class PausingRuntimes(FakeRuntimes):
    """FakeRuntimes whose containers can be paused; `unpause` thaws, or fails (`fail_unpause`)."""

    def __init__(self, records, fail_unpause=(), thawed_meanwhile=()):
        super().__init__(records)
        self.fail_unpause = set(fail_unpause) | set(thawed_meanwhile)
        for key, rec in self.records.items():
            if key[1] in thawed_meanwhile:
                rec["_thaw_later"] = True

    def unpause(self, runtime, cid):
        self.log.append(("unpause", cid))
        rec = self.records[(runtime, cid)]
        if rec.pop("_thaw_later", False):
            rec.update(paused=False, status="running")  # its owner unpaused it since the look
        if cid in self.fail_unpause:
            raise engines.RuntimeUnavailable(f"Container {cid} is not paused" if not rec["paused"] else "daemon said no")
        rec.update(paused=False, status="running")


def paused_record(cid, name, **kw):
    return dict(record(cid, name, **kw), paused=True, status="paused")


@pytest.mark.parametrize("fixture", ["api-inspect-paused.json", "cli-inspect-paused.json", "podman-cli-inspect-paused.json"])
def test_a_paused_container_reads_paused_and_up_on_docker_and_podman(fixture):
    rec = engines.record_of(inspect_fixture(fixture))
    # Podman 4.3 says Running false while paused: still up (its stop refuses it: podman-cli-stop-paused.stderr.txt).
    assert (rec["name"], rec["paused"], rec["running"], rec["status"]) == ("parked", True, True, "paused")
    assert paused.is_paused(rec)


def test_a_running_or_stopped_container_is_not_paused():
    assert not engines.record_of(inspect_fixture("api-inspect-vllm.json"))["paused"]
    assert not engines.record_of(inspect_fixture("api-inspect-stopped.json"))["paused"]
    assert not paused.is_paused(None) and not paused.is_paused(record(A, "vllm"))


def test_a_paused_container_not_named_is_refused_naming_the_runtimes_unpause_before_anything_is_done():
    runtimes = PausingRuntimes([paused_record(A, "suspended"), record(B, "vllm")])
    with pytest.raises(StepFailed) as info:
        plan(runtimes, [holder(1, f"/docker/{A}", gpus=(0, 1)), holder(2, f"/docker/{A}", gpus=(2,)), holder(3, f"/docker/{B}", gpus=(3,))])
    assert info.value.msg.startswith(
        "GPUs are held by paused containers: suspended (docker aaaaaaaaaaaa, vllm/vllm-openai:v0.11.0) on GPU 0,1,2: its container is "
        "paused: `docker unpause suspended` thaws it. gpu_release does not thaw a container it was not told to stop"), info.value.msg
    assert "name it in services (container:suspended)" in info.value.msg and "reboot" not in info.value.msg
    assert runtimes.log == []


def test_a_podman_container_is_refused_with_podman_unpause():
    runtimes = PausingRuntimes([paused_record(A, "parked")])
    runtimes.records = {("podman", A): runtimes.records[("docker", A)]}
    h = holder(1, f"/machine.slice/libpod-{A}.scope")
    with pytest.raises(StepFailed, match="`podman unpause parked` thaws it"):
        plan(runtimes, [h])


def test_a_named_paused_container_is_planned_unpaused_and_its_holders_are_not_refused():
    runtimes = PausingRuntimes([paused_record(A, "parked-vllm"), paused_record(B, "parked-idle")])
    steps = plan(runtimes, [holder(1, f"/docker/{A}", gpus=(0,))], named=["parked-*"])
    assert [(e["name"], e.get("unpaused"), e["gpu_indexes"]) for e in steps.stop] == [("parked-vllm", True, [0]), ("parked-idle", True, [])]
    assert steps.signal == [] and runtimes.log == []


def test_kill_false_leaves_a_paused_container_alone_and_refuses_nothing():
    steps = plan(PausingRuntimes([paused_record(A, "suspended")]), [holder(1, f"/docker/{A}")], stop_found=False)
    assert steps.stop == [] and steps.warnings == []


def test_act_unpauses_through_the_runtime_then_stops():
    runtimes = PausingRuntimes([paused_record(A, "parked-vllm"), record(B, "vllm")])
    steps = plan(runtimes, [holder(2, f"/docker/{B}")], named=["parked-*"])
    done = containers.act(runtimes, steps, 5)
    assert done["failed"] == {} and [(e["name"], e.get("unpaused")) for e in done["stopped"]] == [("parked-vllm", True), ("vllm", None)]
    assert runtimes.log.index(("unpause", A)) < runtimes.log.index(("stop", A, 5)) and ("unpause", B) not in runtimes.log


def test_act_stops_a_container_its_owner_unpaused_since_the_look():
    runtimes = PausingRuntimes([paused_record(A, "parked-vllm")], thawed_meanwhile=[A])
    done = containers.act(runtimes, plan(runtimes, [], named=["parked-*"]), 5)
    assert done["failed"] == {} and [e["name"] for e in done["stopped"]] == ["parked-vllm"]


def test_act_does_not_stop_a_container_that_stays_paused_and_says_why():
    runtimes = PausingRuntimes([paused_record(A, "parked-vllm")], fail_unpause=[A])
    done = containers.act(runtimes, plan(runtimes, [], named=["parked-*"]), 5)
    assert done["failed"] == {A: "could not unpause it: daemon said no"} and done["stopped"] == []
    assert ("stop", A, 5) not in runtimes.log
    assert "could not stop container parked-vllm (docker aaaaaaaaaaaa, vllm/vllm-openai:v0.11.0) through docker: could not unpause it" in done["warnings"][0]
