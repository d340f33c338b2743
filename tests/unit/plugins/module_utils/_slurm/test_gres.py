"""_gres: Slurm's GRES indexes mapped to GPUs by the list slurmd builds (Slurm 22.05 to 25.11 sources,
read in the module's docstring); pure, on gres.conf texts of the forms sites write."""
import os

import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._slurm import _gres
from ansible_collections.zeromib.gpu.plugins.module_utils._slurm._gres import NodeGpu, Unmapped

# A node whose /dev/nvidia0 is nvidia-smi's GPU 6 (PrincetonUniversity/jobstats #34's shape).
MINORS = [1, 2, 3, 4, 5, 6, 0, 7]
GPUS = [NodeGpu(f"GPU-{index:08d}", minor, f"0000:{index:02x}:00.0") for index, minor in enumerate(MINORS)]
BY_MINOR = {gpu.minor: gpu for gpu in GPUS}


def minor_of(path):
    """The rig's device nodes: /dev/nvidiaN is minor N; anything else is no GPU's."""
    name = os.path.basename(path)
    return int(name[len("nvidia"):]) if name.startswith("nvidia") and name[len("nvidia"):].isdigit() else None


def mapped(text, indexes, node="gpu01"):
    return [(i, path, gpu.uuid) for i, path, gpu in _gres.map_indexes(indexes, _gres.parse(text, node), minor_of, GPUS, lambda: GPUS)]


@pytest.mark.parametrize("hostlist, names", [
    ("/dev/nvidia[0-3]", ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"]),
    ("/dev/nvidia[3,1-2]", ["/dev/nvidia3", "/dev/nvidia1", "/dev/nvidia2"]),
    ("/dev/nvidia0,/dev/nvidia[5-6]", ["/dev/nvidia0", "/dev/nvidia5", "/dev/nvidia6"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("gpu[1-2]-ib[0-1]", ["gpu1-ib0", "gpu1-ib1", "gpu2-ib0", "gpu2-ib1"]),
    ("/dev/nvidia7", ["/dev/nvidia7"]),
])
def test_slurms_hostlist_form_expands_in_its_written_order(hostlist, names):
    assert _gres.expand(hostlist) == names


@pytest.mark.parametrize("hostlist", ["/dev/nvidia[0-3", "/dev/nvidia[a-b]", "/dev/nvidia[3-1]"])
def test_a_hostlist_slurm_would_not_expand_is_an_error(hostlist):
    with pytest.raises(ValueError):
        _gres.expand(hostlist)


def test_gres_index_0_is_the_first_device_file_and_its_gpu_is_the_one_behind_its_minor_number():
    assert mapped("Name=gpu File=/dev/nvidia[0-7]\n", [0, 1]) == [(0, "/dev/nvidia0", "GPU-00000006"), (1, "/dev/nvidia1", "GPU-00000000")]


def test_the_files_keep_the_order_written_not_their_numbers_order():
    text = "Name=gpu Type=h100 File=/dev/nvidia6\nName=gpu Type=h100 File=/dev/nvidia[0-5,7]\n"
    assert mapped(text, [0, 1]) == [(0, "/dev/nvidia6", "GPU-00000005"), (1, "/dev/nvidia0", "GPU-00000006")]


def test_name_lines_come_before_nodename_lines_as_slurmd_reads_them_and_other_nodes_lines_count_not():
    """slurmd appends the Name= array, then the NodeName= array (gres.c _parse_gres_conf_locked)."""
    text = ("# the node's own GPUs first in the file, yet read second\n"
            "NodeName=gpu[01-04] Name=gpu File=/dev/nvidia[1-3]\n"
            "NodeName=gpu09 Name=gpu File=/dev/nvidia7\n"
            "Name=gpu File=/dev/nvidia0   # every node\n")
    assert [path for _i, path, _u in mapped(text, [0, 1, 2, 3])] == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3"]
    with pytest.raises(Unmapped, match="GRES index 4 is beyond the 4 device files of gres.conf"):
        mapped(text, [4])


def test_continued_lines_and_other_gres_are_read_as_slurm_reads_them():
    text = "Name=mps Count=400 File=/dev/nvidia[0-7]\nName=gpu \\\n  File=/dev/nvidia[2-3]\n"
    assert mapped(text, [1]) == [(1, "/dev/nvidia3", "GPU-00000002")]


def test_autodetect_nvml_is_nvmls_order_whatever_the_minor_numbers():
    assert mapped("AutoDetect=nvml\n", [0, 6]) == [(0, "/dev/nvidia1", "GPU-00000000"), (6, "/dev/nvidia0", "GPU-00000006")]
    assert mapped("NodeName=gpu01 AutoDetect=nvml Name=gpu Count=8\n", [6]) == [(6, "/dev/nvidia0", "GPU-00000006")]


def test_autodetect_nvml_with_files_chooses_among_nvmls_gpus_only_where_both_orders_agree():
    """Where slurmd's gpu/nvml plugin cannot load it falls back to the files' order."""
    assert mapped("AutoDetect=nvml\nName=gpu File=/dev/nvidia[1-3]\n", [0, 2]) == [(0, "/dev/nvidia1", "GPU-00000000"), (2, "/dev/nvidia3", "GPU-00000002")]
    with pytest.raises(Unmapped, match="AutoDetect=nvml with File= lines whose order is not NVML's"):
        mapped("AutoDetect=nvml\nName=gpu File=/dev/nvidia[0-7]\n", [0])


def test_a_nodes_own_autodetect_off_overrides_the_global_one():
    text = "AutoDetect=nvml\nNodeName=gpu01 AutoDetect=off Name=gpu File=/dev/nvidia[0-7]\n"
    assert mapped(text, [0]) == [(0, "/dev/nvidia0", "GPU-00000006")]
    assert mapped(text, [0], node="gpu02") == [(0, "/dev/nvidia1", "GPU-00000000")]


@pytest.mark.parametrize("text, why", [
    ("", "gres.conf names no device file"),
    ("Name=gpu Count=8\n", "gres.conf names no device file"),
    ("Name=gpu Type=a100 File=/dev/nvidia[0-3]\nName=gpu Type=v100 File=/dev/nvidia[4-7]\n", "several Types (a100, v100)"),
    ("Name=gpu MultipleFiles=/dev/nvidia0,/dev/nvidia-caps/nvidia-cap21\n", "MultipleFiles="),
    ("Include /etc/slurm/gres.d/node.conf\n", "includes another file"),
    ("AutoDetect=rsmi\n", "AutoDetect=rsmi"),
    ("Name=gpu File=/dev/nvidia[0-7\n", "unclosed"),
    ("Name=gpu File=/dev/null\n", "/dev/null (GRES index 0) is no NVIDIA GPU device node"),
    ("Name=gpu File=/dev/nvidia9\n", "/dev/nvidia9 (GRES index 0) has minor number 9, which no GPU of the driver has"),
    ("Name gpu\n", "is not a Key=value"),
])
def test_what_is_not_read_here_is_said_and_nothing_is_assumed(text, why):
    with pytest.raises(Unmapped, match=None) as caught:
        mapped(text, [0])
    assert why in str(caught.value), caught.value


def test_nvidia_smis_order_is_read_against_the_drivers_gpus():
    text = "0, GPU-00000000\n1, GPU-00000001\n"
    assert _gres.parse_smi_order(text, GPUS) == GPUS[:2]
    with pytest.raises(Unmapped, match="nvidia-smi's GPU 0 \\(GPU-ffffffff\\) is not in the driver's list"):
        _gres.parse_smi_order("0, GPU-ffffffff\n", GPUS)


def test_gres_conf_sits_beside_the_slurm_conf_slurmd_reads_its_configless_copy_included():
    assert _gres.conf_path({"SLURM_CONF": "/var/lib/slurm/slurmd/conf-cache/slurm.conf"}) == "/var/lib/slurm/slurmd/conf-cache/gres.conf"
    assert _gres.conf_path({}) == "/etc/slurm/gres.conf"


def test_only_a_gres_conf_of_roots_alone_is_read(tmp_path):
    path = tmp_path / "gres.conf"
    path.write_text("Name=gpu File=/dev/nvidia[0-7]\n")
    path.chmod(0o644)
    uid = os.getuid()
    assert _gres.read_conf(str(path), owner=uid).startswith("Name=gpu")
    path.chmod(0o664)
    with pytest.raises(Unmapped, match="not trusted"):
        _gres.read_conf(str(path), owner=uid)
    path.chmod(0o644)
    with pytest.raises(Unmapped, match="not trusted"):
        _gres.read_conf(str(path), owner=uid + 1)
    with pytest.raises(Unmapped, match="cannot read"):
        _gres.read_conf(str(tmp_path / "none"))


def test_the_log_names_each_index_its_gpu_and_its_file():
    rows = _gres.map_indexes([0], _gres.parse("Name=gpu File=/dev/nvidia[0-7]", "n"), minor_of, GPUS, lambda: GPUS)
    assert _gres.describe(rows) == {"0": "GPU-00000006 (/dev/nvidia0)"}
