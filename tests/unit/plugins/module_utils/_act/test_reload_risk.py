"""No daemon-reload behind a running container's back (issue 69): unit files change with
--no-reload, a mask systemd does not see yet is said, and _reload_risk's reading of what a
reload would take away. The real reproduction (systemd's device programs, a container's lost
access) is tests/fleet/test_reload_fleet.py."""
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _reload_risk as risk
from ansible_collections.zeromib.gpu.plugins.module_utils._act import _units as units

NVIDIA0, CTL, NULL, ZERO = os.makedev(195, 0), os.makedev(195, 255), os.makedev(1, 3), os.makedev(1, 5)
NODES = {"nvidia0": NVIDIA0, "nvidiactl": CTL}
DEV = {"/dev/null": NULL, "/dev/zero": ZERO, "/dev/nvidia0": NVIDIA0, "/dev/nvidiactl": CTL, "/dev/char/195:0": NVIDIA0}


def resolve(path):
    return DEV.get(path)


@pytest.mark.parametrize("policy, allow, lost", [
    # a Docker container on the systemd driver, GPUs granted by the NVIDIA hook
    ("strict", ["/dev/null rwm", "/dev/zero rwm"], ["nvidia0", "nvidiactl"]),
    # the GPUs passed as devices, as runc passes them: /dev/char/M:m, and the node has that link
    ("strict", ["/dev/char/195:0 rw", "/dev/char/195:255 rw"], ["nvidiactl"]),
    # by path, or by the driver's major
    ("strict", ["/dev/nvidia0 rw", "/dev/nvidiactl rw"], []),
    ("closed", ["char-nvidia-frontend rw"], []),
    # no device program: a reload takes nothing away
    ("auto", [], None),
])
def test_what_a_reload_leaves_a_unit_is_what_its_device_allow_resolves_to(policy, allow, lost):
    grant = risk.allowed(policy, allow, {"nvidia-frontend": 195, "pts": 136}, resolve)
    assert (None if grant is None else risk.uncovered(NODES, grant)) == lost


def test_show_of_many_units_keeps_every_device_allow_line():
    text = ("Id=docker-4f2a.scope\nControlGroup=/system.slice/docker-4f2a.scope\nDevicePolicy=strict\nDeviceAllow=/dev/null rwm\n"
            "DeviceAllow=/dev/char/195:0 rw\n\nId=ssh.service\nControlGroup=/system.slice/ssh.service\nDevicePolicy=auto\nDeviceAllow=\n")
    assert risk.parse_units(text) == [
        {"Id": "docker-4f2a.scope", "ControlGroup": "/system.slice/docker-4f2a.scope", "DevicePolicy": "strict",
         "DeviceAllow": ["/dev/null rwm", "/dev/char/195:0 rw"]},
        {"Id": "ssh.service", "ControlGroup": "/system.slice/ssh.service", "DevicePolicy": "auto", "DeviceAllow": []}]


def test_on_cgroup_v1_or_without_nvidia_devices_nothing_is_at_risk_and_systemd_is_not_asked(tmp_path):
    asked = []
    assert risk.at_risk(lambda args: asked.append(args) or (0, "", ""), cgroup_root=str(tmp_path)) == []
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "dev").mkdir()
    assert risk.at_risk(lambda args: asked.append(args) or (0, "", ""), cgroup_root=str(tmp_path), root=str(tmp_path)) == []
    assert asked == []


class MaskNode:
    """systemctl mask --no-reload as systemd 252/257 does it: a unit another unit wants stays loaded."""

    def __init__(self, wanted):
        self.wanted = set(wanted)
        self.calls = []

    def systemctl(self, args):
        self.calls.append(list(args))
        if args[0] == "show":
            names = [a for a in args[1:] if not a.startswith("-")]
            return 0, "\n".join("Id={}\nLoadState={}\n".format(u, "loaded" if u in self.wanted else "masked") for u in names), ""
        return 0, "", ""


def test_mask_and_disable_never_reload_systemd_and_a_mask_systemd_does_not_see_yet_is_said():
    node = MaskNode(wanted=["vllm.service"])
    done = units.act(node, {"stop": [], "disable": ["old.service"], "mask": ["vllm.service", "sglang.service"], "warnings": [],
                            "kept_units": []}, 5.0)
    assert node.calls[:2] == [["disable", "--no-reload", "--no-ask-password", "old.service"],
                              ["mask", "--no-reload", "--no-ask-password", "vllm.service", "sglang.service"]]
    assert not any(c[0] == "daemon-reload" for c in node.calls)
    assert done["masked_units"] == ["vllm.service", "sglang.service"]
    assert len(done["warnings"]) == 1 and done["warnings"][0].startswith("vllm.service is stopped and masked on disk")
    assert "sglang" not in done["warnings"][0] and "create-dev-char-symlinks" in done["warnings"][0]


def mountinfo(dev_fstype):
    return ("22 1 0:21 / / rw - overlay overlay rw\n"
            f"23 22 0:22 / /dev rw,nosuid - {dev_fstype} {dev_fstype} rw\n").encode()


def test_a_containers_dev_on_a_file_system_that_may_not_answer_is_not_read_and_counts_as_at_risk(tmp_path, monkeypatch):
    """Its root owns its mounts: a /dev on FUSE whose daemon stops answering would hold an lstat."""
    (tmp_path / "812").mkdir()
    (tmp_path / "812" / "mountinfo").write_bytes(mountinfo("fuse.hostile"))
    looked = []
    monkeypatch.setattr(risk.os, "lstat", lambda path: looked.append(path) or os.stat("/"))
    assert risk.container_nodes(str(tmp_path), 812, ["nvidia0"]) == "its /dev is on fuse.hostile, not read"
    assert looked == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_a_containers_nvidia_nodes_are_looked_up_by_the_nodes_names_only(tmp_path):
    (tmp_path / "812" / "root" / "dev").mkdir(parents=True)
    (tmp_path / "812" / "mountinfo").write_bytes(mountinfo("tmpfs"))
    dev = tmp_path / "812" / "root" / "dev"
    os.mknod(dev / "nvidia0", 0o600 | 0o020000, NVIDIA0)
    os.mknod(dev / "nvidia9", 0o600 | 0o020000, os.makedev(195, 9))  # not one of the node's: never looked at
    (dev / "nvidiactl").symlink_to("/dev/null")  # not a device node: not counted
    assert risk.container_nodes(str(tmp_path), 812, ["nvidia0", "nvidiactl"]) == {"nvidia0": NVIDIA0}
