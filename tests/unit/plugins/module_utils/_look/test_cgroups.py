# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""What a cgroup path names (_cgroups): container and pod ids by runtime and driver, none in a user's own subtree;
the cgroup mounts whose owners tell a delegated subtree."""

from __future__ import annotations

import json
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _cgroups

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, os.pardir, "fixtures", "docker")
ID64 = "4f3c2b1a" * 8
UID = "1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901"


def fixture(name):
    with open(os.path.join(FIXTURES, name)) as handle:
        return handle.read()


def inspect_fixture(name):
    data = json.loads(fixture(name))
    return data[0] if isinstance(data, list) else data


# ------------------------------------------------------------------ cgroup paths


@pytest.mark.parametrize(
    "path, expected",
    [
        (f"/docker/{ID64}", (ID64, "docker", False, None)),
        (f"/system.slice/docker-{ID64}.scope", (ID64, "docker", False, None)),
        (f"/machine.slice/libpod-{ID64}.scope/container", (ID64, "podman", False, None)),
        # A user's own subtree: whatever they name there is theirs (rootless Podman too): no container.
        (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{ID64}.scope/container", None),
        (f"/user.slice/user-4242.slice/user@4242.service/app.slice/docker-{ID64}.scope", None),
        ("/user.slice/user-4242.slice/user@4242.service/kubepods.slice/kubepods-besteffort-pod{}.slice".format(UID.replace("-", "_")), None),
        (f"/libpod_parent/libpod-{ID64}", (ID64, "podman", False, None)),
        (f"/machine.slice/libpod-conmon-{ID64}.scope", None),
        ("/system.slice/containerd.service", None),
        (f"/system.slice/nerdctl-{ID64}.scope", (ID64, "containerd", False, None)),
        (
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{}.scope".format(UID.replace("-", "_"), ID64),
            (ID64, "containerd", True, UID),
        ),
        ("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/crio-{}.scope".format(UID.replace("-", "_"), ID64),
         (ID64, "cri-o", True, UID)),
        (f"/kubepods/burstable/pod{UID}/{ID64}", (ID64, None, True, UID)),
        (f"/kubepods/pod{UID}/{ID64}", (ID64, None, True, UID)),
        (f"/kubepods/burstable/pod{UID}", (None, None, True, UID)),
        (
            "/system.slice/containerd.service/kubepods-burstable-pod{}.slice:cri-containerd:{}".format(UID.replace("-", "_"), ID64),
            (ID64, "containerd", True, UID),
        ),
        (f"/kubepods/burstable/pod0123456789abcdef0123456789abcdef/{ID64}", (ID64, None, True, "0123456789abcdef0123456789abcdef")),
        ("/system.slice/vllm.service", None),
        ("/", None),
        ("", None),
        (None, None),
    ],
    ids=[
        "docker-cgroupfs",
        "docker-systemd",
        "podman-systemd",
        "podman-rootless-is-the-users-own",
        "docker-id-named-in-a-user-subtree",
        "kubepods-in-a-user-subtree",
        "podman-cgroupfs",
        "podman-conmon-is-not-the-container",
        "containerd-daemon-itself",
        "nerdctl",
        "k8s-containerd-systemd",
        "k8s-crio-systemd",
        "k8s-cgroupfs-burstable",
        "k8s-cgroupfs-guaranteed",
        "k8s-pod-level",
        "k8s-containerd-under-its-service",
        "k8s-static-pod-hash-uid",
        "system-service",
        "root",
        "empty",
        "none",
    ],
)
def test_container_ref_of_a_cgroup_path(path, expected):
    ref = _cgroups.container_ref(path)
    assert (None if ref is None else (ref["id"], ref["runtime"], ref["kubernetes"], ref["pod_uid"])) == expected
    assert _cgroups.container_of(path) == (expected[0] if expected else None)


def test_real_proc_cgroup_of_a_docker_and_a_dockershim_pod_container():
    from ansible_collections.zeromib.gpu.plugins.module_utils._look import _holders

    vllm = _cgroups.container_ref(_holders.parse_cgroup(fixture("proc-cgroup-vllm.txt")))
    assert vllm["runtime"] == "docker" and vllm["id"] == inspect_fixture("api-inspect-vllm.json")["Id"] and not vllm["kubernetes"]
    pod = _cgroups.container_ref(_holders.parse_cgroup(fixture("proc-cgroup-k8s.txt")))
    assert pod["kubernetes"] and pod["pod_uid"] == UID and pod["id"] == inspect_fixture("api-inspect-k8s.json")["Id"]


def test_cgroup_mounts_are_cgroup2_and_v1_name_systemd(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "25 21 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n"
        "26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        "27 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid - cgroup cgroup rw,xattr,name=systemd\n"
        "30 25 0:27 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
    )
    assert _cgroups.cgroup_mounts(str(mountinfo)) == ["/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"]
