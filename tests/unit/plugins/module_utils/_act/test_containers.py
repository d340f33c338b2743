# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Containers of GPU holders (_containers): what a holder's cgroup claims, confirmed by its runtime or
not (a fake runtime), and the plan gpu_release makes for containers and what it does. The cgroup
paths are in test_cgroups, the runtime clients in test_engines."""

from __future__ import annotations

import os
import time

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _containers as containers
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _container_of as container_of
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _engines as engines
from ansible_collections.zeromib.gpu.plugins.module_utils._act._errors import StepFailed

UID = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"


# ------------------------------------------------------------------ annotate, plan, act


class FakeRuntimes:
    """Runtimes with containers in memory: {id: record}, per runtime."""

    def __init__(self, records=None, runtime="docker", reachable=True, pods=None, stop_delay=0.0, fail_stop=()):
        self.records = {(runtime, r["id"]): dict(r) for r in records or []}
        self.reachable = reachable
        self.pods = pods or {}
        self.log = []
        self.stop_delay = stop_delay
        self.fail_stop = set(fail_stop)

    def client(self, runtime):
        return self if self.reachable else None

    def error(self, runtime):
        return f"no {runtime} here"

    # State.Pid of each container: set by annotate() below from the holders in its cgroup.
    members = {}

    def inspect(self, runtime, cid):
        if not self.reachable:
            raise engines.RuntimeUnavailable(f"no {runtime} here")
        record = self.records.get((runtime, cid))
        if not record:
            return None
        return dict(record, pid=record.get("pid", self.members.get(cid)))

    def find(self, glob):
        import fnmatch

        return [(runtime, dict(r)) for (runtime, _cid), r in sorted(self.records.items()) if fnmatch.fnmatchcase(r["name"], glob)]

    def stop(self, runtime, cid, grace):
        self.log.append(("stop", cid, grace))
        time.sleep(self.stop_delay)
        if cid in self.fail_stop:
            raise engines.RuntimeUnavailable("daemon said no")
        self.records[(runtime, cid)]["running"] = False

    def set_restart_no(self, runtime, cid):
        self.log.append(("update", cid))
        self.records[(runtime, cid)]["restart_policy"] = "no"

    def pod_of(self, cid):
        return self.pods.get(cid)


def record(cid, name, restart="always", running=True, pod=None, pod_uid=None, image="vllm/vllm-openai:v0.11.0"):
    return {"id": cid, "name": name, "image": image, "restart_policy": restart, "running": running, "status": "running" if running else "exited",
            "pod": pod, "pod_uid": pod_uid}


def holder(pid, cgroup, gpus=(0,), protected=False, name="python3"):
    return {"pid": pid, "name": name, "cmdline": "python3 -m vllm.entrypoints.openai.api_server", "cgroup": cgroup, "gpu_indexes": list(gpus),
            "protected": protected, "container": _cgroups.container_of(cgroup), "unit": None, "user": "root"}


A, B, C = "a" * 64, "b" * 64, "c" * 64


def annotate(holders, runtimes, mounts=()):
    """containers.annotate on holders whose /proc/PID/cgroup are their `cgroup`; each container's
    State.Pid is its first holder (as Docker reports its init), unless its record says otherwise."""
    cgroups = {h["pid"]: h["cgroup"] for h in holders}
    members = {}
    for h in sorted(holders, key=lambda h: h["pid"]):
        ref = _cgroups.container_ref(h["cgroup"])
        if ref and ref["id"]:
            members.setdefault(ref["id"], h["pid"])
    runtimes.members = members
    return container_of.annotate(holders, runtimes, mounts=list(mounts), cgroup_of=cgroups.get)


def test_annotate_names_container_image_and_pod():
    runtimes = FakeRuntimes([record(A, "vllm"), record(B, "k8s_vllm_vllm-0", pod="inference/vllm-0", pod_uid=UID)], pods={C: "ml/trainer-7"})
    holders = annotate(
        [
            holder(1, f"/docker/{A}"),
            holder(2, f"/kubepods/burstable/pod{UID}/{B}"),
            holder(3, "/kubepods.slice/kubepods-pod{}.slice/cri-containerd-{}.scope".format(UID.replace("-", "_"), C)),
            holder(4, "/user.slice/user-0.slice/session-1.scope"),
        ],
        runtimes,
    )
    assert [(h["container_runtime"], h["container_name"], h["container_image"], h["pod"], h["pod_uid"]) for h in holders] == [
        ("docker", "vllm", "vllm/vllm-openai:v0.11.0", None, None),
        ("docker", "k8s_vllm_vllm-0", "vllm/vllm-openai:v0.11.0", "inference/vllm-0", UID),
        ("containerd", None, None, "ml/trainer-7", UID),
        (None, None, None, None, None),
    ]


def test_annotate_without_a_runtime_keeps_what_the_cgroup_says():
    [h] = annotate([holder(1, f"/system.slice/docker-{A}.scope")], FakeRuntimes(reachable=False))
    assert (h["container"], h["container_runtime"], h["container_name"]) == (A, "docker", None)


def plan(runtimes, holders, named=(), state="stopped", own=(), stop_found=True):
    holders = annotate(holders, runtimes)
    targets = [h for h in holders if not h["protected"]]
    return containers.plan(runtimes, holders, targets, list(named), state, set(own), stop_found=stop_found)


def test_found_container_is_stopped_not_signalled_and_bare_process_is_signalled():
    runtimes = FakeRuntimes([record(A, "vllm")])
    steps = plan(runtimes, [holder(1, f"/docker/{A}", gpus=(0, 1)), holder(2, f"/docker/{A}", gpus=(2,)), holder(3, "/user.slice/x.scope")])
    assert [(e["name"], e["gpu_indexes"], e["restart_policy"]) for e in steps.stop] == [("vllm", [0, 1, 2], "always")]
    assert [h["pid"] for h in steps.signal] == [3] and steps.disable == [] and steps.outside == [] and steps.warnings == []


def test_container_the_runtime_cannot_be_asked_for_is_signalled_from_outside_with_a_warning():
    steps = plan(FakeRuntimes(reachable=False), [holder(1, f"/docker/{A}")])
    assert steps.stop == [] and [h["pid"] for h in steps.signal] == [1]
    assert [reason for _h, reason in steps.outside] == ["no docker here"]
    assert f"container {A[:12]} (docker) could not be stopped through its runtime (no docker here)" in steps.warnings[0]


def test_containers_of_runtimes_it_cannot_stop_are_signalled_from_outside():
    steps = plan(FakeRuntimes(), [holder(1, f"/system.slice/nerdctl-{A}.scope")])
    assert [h["pid"] for h in steps.signal] == [1] and [reason for _h, reason in steps.outside] == ["gpu_release cannot stop containerd containers"]


def test_container_that_also_runs_a_protected_process_is_not_stopped():
    steps = plan(FakeRuntimes([record(A, "gpu-tools")]), [holder(1, f"/docker/{A}"), holder(2, f"/docker/{A}", protected=True, name="nv-hostengine")])
    assert steps.stop == [] and [reason for _h, reason in steps.outside] == ["it also runs a protected process"]


def test_kill_false_stops_no_found_container():
    steps = plan(FakeRuntimes([record(A, "vllm")]), [holder(1, f"/docker/{A}")], stop_found=False)
    assert steps.stop == [] and steps.warnings == []


def test_named_containers_get_service_state_and_found_ones_are_only_stopped():
    runtimes = FakeRuntimes([record(A, "vllm-a"), record(B, "vllm-b", restart="no", running=False), record(C, "other")])
    steps = plan(runtimes, [holder(1, f"/docker/{C}")], named=["vllm*", "sglang*"], state="disabled")
    assert [e["name"] for e in steps.disable] == ["vllm-a"]
    assert [e["name"] for e in steps.stop] == ["vllm-a", "other"] and steps.not_found == ["container:sglang*"]


def test_masked_leaves_named_containers_as_disabled_does():
    steps = plan(FakeRuntimes([record(A, "vllm-a", restart="unless-stopped")]), [], named=["vllm-a"], state="masked")
    assert [e["name"] for e in steps.disable] == ["vllm-a"]


def test_a_pod_is_refused_before_anything_is_done():
    runtimes = FakeRuntimes([record(B, "k8s_vllm", pod="inference/vllm-0", pod_uid=UID)])
    with pytest.raises(StepFailed) as info:
        plan(runtimes, [holder(1, f"/docker/{A}"), holder(2, f"/kubepods/burstable/pod{UID}/{B}", gpus=(3,)),
                        holder(3, "/kubepods/besteffort/pod{}/{}".format("9" * 32, C))])
    message = info.value.msg
    assert "pod inference/vllm-0 (pid 2 python3 on GPU 3, container bbbbbbbbbbbb)" in message
    assert "pod UID %s (pid 3" % ("9" * 32) in message and "kubectl cordon" in message and "kubectl drain" in message
    assert runtimes.log == []


def test_a_named_pod_container_or_own_container_is_refused():
    runtimes = FakeRuntimes([record(B, "vllm-pod", pod="inference/vllm-0", pod_uid=UID), record(A, "ansible-runner")])
    with pytest.raises(StepFailed, match="belongs to Kubernetes pod inference/vllm-0"):
        plan(runtimes, [], named=["vllm*"])
    with pytest.raises(StepFailed, match="refusing to stop container ansible-runner .* runs this Ansible session"):
        plan(runtimes, [], named=["ansible*"], own=[A])


def test_act_disables_first_then_stops_every_container_at_once():
    runtimes = FakeRuntimes([record(A, "vllm-a"), record(B, "vllm-b")], stop_delay=0.3)
    steps = plan(runtimes, [], named=["vllm*"], state="disabled")
    started = time.monotonic()
    done = containers.act(runtimes, steps, 7.5)
    assert done["failed"] == {}
    assert time.monotonic() - started < 0.55, "both stops ran side by side"
    assert [entry[0] for entry in runtimes.log[:2]] == ["update", "update"] and sorted(runtimes.log[2:]) == [("stop", A, 7.5), ("stop", B, 7.5)]
    assert [(e["name"], e["restart_policy"], e["restart_policy_before"]) for e in done["disabled"]] == [
        ("vllm-a", "no", "always"),
        ("vllm-b", "no", "always"),
    ]
    assert [e["name"] for e in done["stopped"]] == ["vllm-a", "vllm-b"]
    assert all(e["stopped_after_s"] >= 0.3 for e in done["stopped"])


def test_act_reports_a_container_it_could_not_stop():
    runtimes = FakeRuntimes([record(A, "vllm-a")], fail_stop=[A])
    steps = plan(runtimes, [holder(1, f"/docker/{A}")])
    done = containers.act(runtimes, steps, 1)
    assert done["failed"] == {A: "daemon said no"}
    assert done["stopped"] == [] and "could not stop container vllm-a" in done["warnings"][0]


# ------------------------------------------------------------------ what a user may name (docs/docsite/rst/guide_security.rst)


def test_cgroup_in_a_directory_a_user_owns_is_no_container(tmp_path):
    """The kernel's word: systemd chowns a delegated subtree to its user, who may then create and
    name cgroups in it (docker-<victim id>.scope, kubepods.slice) without any user@ in the path."""
    mount = tmp_path / "cgroup"
    leaf = mount / "system.slice" / "delegated.service" / (f"docker-{A}.scope")
    leaf.mkdir(parents=True)
    os.chown(str(mount / "system.slice" / "delegated.service"), 4242, 4242)
    path = f"/system.slice/delegated.service/docker-{A}.scope"
    assert _cgroups.delegated_to(path, [str(mount)]) == 4242
    assert _cgroups.delegated_to("/system.slice", [str(mount)]) is None
    runtimes = FakeRuntimes([record(A, "victim-db")])
    [h] = annotate([holder(7, path)], runtimes, mounts=[str(mount)])
    assert h["container"] is None and h["_container_ref"] is None and "owned by uid 4242" in h["container_note"]
    steps = containers.plan(runtimes, [h], [h], [], "stopped", set())
    assert steps.stop == [] and [t["pid"] for t in steps.signal] == [7] and runtimes.log == []


def test_kubepods_cgroup_a_user_made_is_no_pod_and_blocks_nothing(tmp_path):
    mount = tmp_path / "cgroup"
    path = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{}.scope".format(UID.replace("-", "_"), C)
    (mount / path.lstrip("/")).mkdir(parents=True)
    os.chown(str(mount / "kubepods.slice"), 4242, 4242)
    [h] = annotate([holder(8, path)], FakeRuntimes(), mounts=[str(mount)])
    assert containers.pod_holders([h]) == [] and h["pod_uid"] is None
    steps = containers.plan(FakeRuntimes(), [h], [h], [], "stopped", set())
    assert [t["pid"] for t in steps.signal] == [8]


def test_container_its_runtime_does_not_run_the_holder_in_is_never_stopped():
    """A cgroup path naming the victim's container (outside any delegated subtree, e.g. a runtime's
    cgroupfs layout copied) is believed only when Docker's State.Pid, or its cgroup, holds the process."""
    runtimes = FakeRuntimes([dict(record(A, "victim-db"), pid=300)])
    attacker = holder(9, f"/docker/{A}/evil")
    cgroups = {9: attacker["cgroup"], 300: f"/docker/{B}"}
    [h] = container_of.annotate([attacker], runtimes, mounts=[], cgroup_of=cgroups.get)
    assert h["container"] is None and "does not run this process in it" in h["container_note"]
    steps = containers.plan(runtimes, [h], [h], [], "stopped", set())
    assert steps.stop == [] and runtimes.log == []


@pytest.mark.parametrize(
    "holder_pid, holder_cgroup, init_cgroup, expected",
    [
        (300, "/docker/" + A, "/docker/" + A, True),  # the container's init itself
        (301, "/docker/" + A, "/docker/" + A, True),  # a process beside it
        (302, f"/system.slice/docker-{A}.scope/sub", f"/system.slice/docker-{A}.scope", True),  # below it
        (303, f"/docker/{A}x", "/docker/" + A, False),  # a sibling whose name starts alike
        (304, "/docker/" + A, None, False),  # State.Pid gone
        (305, "/", "/", False),
    ],
    ids=["init", "beside-init", "below-init", "prefix-sibling", "init-gone", "root-cgroup"],
)
def test_confirmed_by_state_pid_or_its_cgroup(holder_pid, holder_cgroup, init_cgroup, expected):
    cgroups = {300: init_cgroup}
    assert container_of.confirmed({"pid": holder_pid, "cgroup": holder_cgroup}, {"pid": 300}, cgroups.get) is expected
    assert container_of.confirmed({"pid": holder_pid, "cgroup": holder_cgroup}, {"pid": None}, cgroups.get) is False


def test_container_named_in_a_user_managers_subtree_is_an_ordinary_holder_with_a_note():
    path = f"/user.slice/user-4242.slice/user@4242.service/app.slice/docker-{A}.scope"
    runtimes = FakeRuntimes([record(A, "victim-db")])
    [h] = annotate([holder(7, path), ], runtimes)
    assert h["container"] is None and "user@4242.service" in h["container_note"] and "no container or pod" in h["container_note"]
    [plain] = annotate([holder(8, "/user.slice/user-4242.slice/user@4242.service/app.slice/foo.service")], runtimes)
    assert plain["container_note"] is None


def test_own_containers_reads_every_hierarchy_line_of_a_cgroup_v1_node(tmp_path):
    # cgroup v1 with the container named on the controller lines only (the name=systemd line is
    # the session's scope): the session's own container must still be found, or it would be stopped.
    own = "a" * 64
    (tmp_path / "40").mkdir()
    (tmp_path / "40" / "cgroup").write_text(
        f"12:memory:/docker/{own}\n11:cpu,cpuacct:/docker/{own}\n1:name=systemd:/user.slice/session-3.scope\n")
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "cgroup").write_text("0::/system.slice/sshd.service\n")
    assert containers.own_containers([40, 41, 42], proc=str(tmp_path)) == {own}
