"""The device nodes a restore needs (pure parts, and the check against a real directory): which
nodes, which are missing (a regular file in a node's place counts as missing), and nvidia-modprobe's
arguments that create them."""
import os

from ansible_collections.zeromib.gpu.plugins.module_utils._act import _device_nodes as nodes


def test_the_control_uvm_and_each_gpus_node_are_needed():
    assert nodes.needed([1, 0, 1], "/dev") == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia0", "/dev/nvidia1"]


def test_a_file_in_a_nodes_place_is_missing(tmp_path):
    (tmp_path / "nvidia-uvm").write_text("")
    os.symlink("/dev/null", str(tmp_path / "nvidiactl"))
    assert nodes.missing([str(tmp_path / "nvidia-uvm"), str(tmp_path / "nvidiactl"), "/dev/null"]) == [
        str(tmp_path / "nvidia-uvm"), str(tmp_path / "nvidiactl")]


def test_modprobe_arguments_create_uvm_and_each_gpu():
    assert nodes.modprobe_args(["/dev/nvidia-uvm-tools"]) == [["-u", "-c=0"]]
    assert nodes.modprobe_args(["/dev/nvidia-uvm", "/dev/nvidia3", "/dev/nvidia1"]) == [["-u", "-c=1"], ["-c=3"]]
    assert nodes.modprobe_args(["/dev/nvidiactl"]) == [["-c=0"]]


def test_without_the_helper_the_error_names_the_nodes(tmp_path):
    report = nodes.ensure([0], check_mode=False, dev=str(tmp_path), search_path=str(tmp_path / "empty"))
    assert report["missing"] == [str(tmp_path / n) for n in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0")]
    assert report["error"].startswith("NVIDIA device node(s) {} missing and nvidia-modprobe is not installed".format(", ".join(report["missing"])))


def test_a_helper_that_creates_nothing_is_said_with_its_output(tmp_path):
    helper = tmp_path / "bin" / "nvidia-modprobe"
    helper.parent.mkdir()
    helper.write_text("#!/bin/sh\necho 'modprobe: FATAL: Module nvidia-uvm not found'\nexit 1\n")
    helper.chmod(0o755)
    calls = []

    def run(argv):
        calls.append(argv)
        return 1, "modprobe: FATAL: Module nvidia-uvm not found"

    report = nodes.ensure([], check_mode=False, dev=str(tmp_path), search_path=str(helper.parent), run=run)
    assert calls == [[str(helper), "-u", "-c=0"]]
    assert "missing after nvidia-modprobe: " in report["error"] and "Module nvidia-uvm not found" in report["error"], report["error"]
    assert report["created"] == []
