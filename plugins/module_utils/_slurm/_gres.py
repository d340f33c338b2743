# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the plugins and roles of
# zeromib.gpu may use it.

"""Slurm's GPU numbers mapped to GPUs: SLURM_JOB_GPUS holds slurmd's GRES indexes, never
nvidia-smi's indexes.

What slurmd gives the prolog and epilog (Slurm 22.05 to 25.11: gres_common_prep_set_env, in 22.05
gres_common_epilog_set_env, in src/plugins/gres/common/gres_common.c): SLURM_JOB_GPUS is
each device's place in slurmd's list of gres/gpu devices, and CUDA_VISIBLE_DEVICES the device's
unique id where it has one (a MIG slice's UUID; every GPU's UUID with AutoDetect=nvml from 25.11
and with AutoDetect=nvidia), else that same place. slurmd's list (gres_node_config_load in
src/interfaces/gres.c; src/plugins/gres/gpu/gres_gpu.c):
- without AutoDetect: the files of gres.conf's `File=` records of this node, in the order slurmd
  reads them (every `Name=` line, then every `NodeName=` line, each in the file's order; a
  range such as /dev/nvidia[0-7] expanded in its own order); records of several `Type=`s are
  put in slurm.conf's order, and a `MultipleFiles=` record is one device: neither is read here.
  A file's GPU is the GPU behind its device node: its minor number, which the driver's
  /proc/driver/nvidia/gpus/*/information ties to a bus and a UUID. nvidia-smi numbers GPUs in PCI
  bus order, the kernel's minor numbers need not follow it (PrincetonUniversity/jobstats #34:
  /dev/nvidia0 is nvidia-smi's GPU 6 on some AMD hosts);
- with AutoDetect=nvml: the GPUs NVML finds, put in NVML's order (_sort_gpu_by_links_order: each
  GPU's Links string marks its NVML index, PCI bus order, nvidia-smi's); `File=` lines then only
  choose among them. Where slurmd's gpu/nvml plugin cannot load it falls back to the files'
  order: where the two orders differ for the job, nothing is mapped.

Where the list cannot be read (no gres.conf, one not root's, a layout above that is not read here)
nothing is assumed: the hooks check every GPU of the node and say why (_jobcheck). Pure, but for
the readers at the end."""

from __future__ import annotations

import os
import re
import socket
import stat
import typing as t

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _devices
from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import read_driver_gpus

GRES_CONF = "gres.conf"
DEFAULT_CONF_DIR = "/etc/slurm"


class Unmapped(Exception):
    """Why the job's GRES indexes could not be mapped to GPUs (a sentence for the log)."""


class Record(t.NamedTuple):
    """One gres/gpu record of gres.conf that applies to this node."""

    files: tuple[str, ...]     # File= expanded, () for none
    type_name: str | None
    multiple_files: bool


class GresConf(t.NamedTuple):
    records: tuple[Record, ...]   # in slurmd's order
    autodetect: str | None        # what applies to this node ("nvml", "nvidia", "off"...), None when unset


# ---------------------------------------------------------------- pure: Slurm's hostlist and gres.conf


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand(hostlist: str) -> list[str]:
    """Slurm's hostlist form, as gres.conf's File= and NodeName= take it: `/dev/nvidia[0-3,6]`,
    `node[01-04]`, several comma-separated entries; ranges kept in their written order, zero
    padding kept. ValueError for a form Slurm would not expand."""
    names: list[str] = []
    for entry in _top_level_split(hostlist):
        parts: list[list[str]] = [[""]]
        rest = entry
        while "[" in rest:
            head, _sep, tail = rest.partition("[")
            inner, closed, rest = tail.partition("]")
            if not closed:
                raise ValueError(f"unclosed [ in {hostlist!r}")
            parts.append([head])
            parts.append(_expand_ranges(inner, hostlist))
        parts.append([rest])
        combined = [""]
        for choices in parts:
            combined = [left + right for left in combined for right in choices]
        names.extend(combined)
    return names


def _top_level_split(text: str) -> list[str]:
    entries, depth, current = [], 0, ""
    for char in text.strip():
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += char
    entries.append(current)
    return [entry.strip() for entry in entries if entry.strip()]


def _expand_ranges(inner: str, whole: str) -> list[str]:
    out: list[str] = []
    for piece in inner.split(","):
        match = _RANGE.match(piece.strip())
        if not match:
            raise ValueError(f"{piece!r} is no number range in {whole!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        width = len(low) if low.startswith("0") and len(low) > 1 else 0
        if int(high) < int(low) or int(high) - int(low) > 65535:
            raise ValueError(f"{piece!r} is no range Slurm expands in {whole!r}")
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def logical_lines(text: str) -> list[str]:
    """gres.conf's lines as Slurm's parser reads them: `#` starts a comment (`\\#` is a #), a
    trailing backslash continues the line."""
    lines, pending = [], ""
    for raw in text.split("\n"):
        line = re.sub(r"(?<!\\)#.*$", "", raw).replace("\\#", "#").rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        if line:
            lines.append(line)
    if pending.strip():
        lines.append(pending.strip())
    return lines


def parse(text: str, node_name: str) -> GresConf:
    """gres.conf -> this node's gres/gpu records in slurmd's order, and the AutoDetect that applies
    here. Unmapped for what slurmd reads and this does not (Include)."""
    named: list[Record] = []
    by_node: list[Record] = []
    autodetect: str | None = None
    line_autodetect: str | None = None
    for line in logical_lines(text):
        if line.split()[0].lower().startswith("include"):
            raise Unmapped(f"gres.conf includes another file ({line!r}), which is not read here")
        pairs = [_pair(word, line) for word in line.split()]
        first = pairs[0][0]
        values = dict(pairs)
        if first == "autodetect" and len(pairs) == 1:
            autodetect = values["autodetect"].lower()
            continue
        if first not in ("name", "nodename"):
            raise Unmapped(f"gres.conf line {line!r} is neither a Name= nor a NodeName= line")
        if "nodename" in values:
            try:
                if node_name not in expand(values["nodename"]):
                    continue
            except ValueError as exc:
                raise Unmapped(f"gres.conf NodeName={values['nodename']}: {exc}") from None
        if values.get("autodetect"):
            line_autodetect = values["autodetect"].lower()
        if (values.get("name") or "").lower() != "gpu":
            continue
        files = values.get("file") or values.get("files") or values.get("multiplefiles")
        try:
            expanded = tuple(expand(files)) if files else ()
        except ValueError as exc:
            raise Unmapped(f"gres.conf File={files}: {exc}") from None
        record = Record(expanded, values.get("type"), "multiplefiles" in values)
        (named if first == "name" else by_node).append(record)
    # A node's own AutoDetect (on one of its lines) overrides the global one.
    return GresConf(tuple(named + by_node), line_autodetect or autodetect)


def _pair(word: str, line: str) -> tuple[str, str]:
    key, sep, value = word.partition("=")
    if not sep:
        raise Unmapped(f"gres.conf line {line!r}: {word!r} is not a Key=value")
    return key.lower(), value.strip('"')


def device_files(conf: GresConf) -> list[str]:
    """slurmd's device list without AutoDetect: the files in its order. Unmapped where slurmd
    orders them by what is not read here."""
    records = [r for r in conf.records if r.files]
    multiple = [r for r in records if r.multiple_files]
    if multiple:
        raise Unmapped("gres.conf gives a GPU several files (MultipleFiles={}): which number is which GPU depends on slurmd's "
                       "merge of them".format(",".join(multiple[0].files)))
    types = sorted({r.type_name or "" for r in records})
    if len(types) > 1:
        raise Unmapped("gres.conf gives this node's GPUs several Types ({}): slurmd orders them by slurm.conf's Gres= line, "
                       "which is not read here".format(", ".join(t_ or "(none)" for t_ in types)))
    return [name for record in records for name in record.files]


class NodeGpu(t.NamedTuple):
    """A GPU as the driver lists it (/proc/driver/nvidia/gpus/*/information)."""

    uuid: str
    minor: int
    bus: str


def by_files(indexes: t.Sequence[int], files: t.Sequence[str], minor_of: t.Callable[[str], int | None],
             gpus_by_minor: t.Mapping[int, NodeGpu]) -> list[tuple[int, str, NodeGpu]]:
    """GRES index -> (index, its device file, the GPU behind it), in the job's order. Unmapped
    for an index beyond the list, a file that is no GPU's device node, a minor no GPU has."""
    mapped = []
    for index in indexes:
        if index >= len(files):
            raise Unmapped(f"GRES index {index} is beyond the {len(files)} device files of gres.conf")
        path = files[index]
        minor = minor_of(path)
        if minor is None:
            raise Unmapped(f"{path} (GRES index {index}) is no NVIDIA GPU device node on this node")
        if minor not in gpus_by_minor:
            raise Unmapped(f"{path} (GRES index {index}) has minor number {minor}, which no GPU of the driver has")
        mapped.append((index, path, gpus_by_minor[minor]))
    return mapped


def by_nvml(indexes: t.Sequence[int], nvml_order: t.Sequence[NodeGpu], files: t.Sequence[str],
            minor_of: t.Callable[[str], int | None]) -> list[tuple[int, str, NodeGpu]]:
    """AutoDetect=nvml: the GPUs in NVML's order (nvidia-smi's), only those File= names where it
    names any. Where File= is given and slurmd's gpu/nvml plugin could not load, slurmd uses the
    files' order instead: both must give the same GPU, else Unmapped."""
    chosen = list(nvml_order)
    if files:
        minors = [minor_of(path) for path in files]
        if None in minors:
            raise Unmapped(f"{files[minors.index(None)]} of gres.conf is no NVIDIA GPU device node on this node")
        chosen = [gpu for gpu in nvml_order if gpu.minor in minors]
        by_minor = {gpu.minor: gpu for gpu in nvml_order}
        by_file = by_files(indexes, files, minor_of, by_minor)
        if any(index >= len(chosen) or chosen[index] != gpu for index, _path, gpu in by_file):
            raise Unmapped("AutoDetect=nvml with File= lines whose order is not NVML's (PCI bus order): slurmd orders the GPUs "
                           "by NVML where its gpu/nvml plugin loads, by the files where it does not")
    mapped = []
    for index in indexes:
        if index >= len(chosen):
            raise Unmapped(f"GRES index {index} is beyond the {len(chosen)} GPUs AutoDetect=nvml finds here")
        gpu = chosen[index]
        mapped.append((index, f"/dev/nvidia{gpu.minor:d}", gpu))
    return mapped


def map_indexes(indexes: t.Sequence[int], conf: GresConf, minor_of: t.Callable[[str], int | None],
                driver_gpus: t.Sequence[NodeGpu], nvml_order: t.Callable[[], t.Sequence[NodeGpu]]) -> list[tuple[int, str, NodeGpu]]:
    """The job's GRES indexes -> [(index, device file, GPU)] by slurmd's list (module docstring).
    `nvml_order()` (nvidia-smi's GPUs in index order) is asked only with AutoDetect=nvml."""
    autodetect = conf.autodetect or "off"
    if autodetect == "nvml":
        return by_nvml(indexes, nvml_order(), [f for r in conf.records for f in r.files], minor_of)
    if autodetect != "off":
        raise Unmapped(f"gres.conf sets AutoDetect={autodetect}, whose order is not read here (slurmd gives such GPUs' UUIDs where it has them)")
    files = device_files(conf)
    if not files:
        raise Unmapped("gres.conf names no device file (File=) of a GPU for this node")
    return by_files(indexes, files, minor_of, {gpu.minor: gpu for gpu in driver_gpus})


def describe(mapped: t.Sequence[tuple[int, str, NodeGpu]]) -> dict[str, str]:
    """For the hook's log: {"0": "GPU-... (/dev/nvidia6)"}."""
    return {str(index): f"{gpu.uuid} ({path})" for index, path, gpu in mapped}


# ---------------------------------------------------------------- reading the node


def conf_path(environ: t.Mapping[str, str]) -> str:
    """gres.conf beside the slurm.conf slurmd reads (Slurm's get_extra_conf_path): SLURM_CONF,
    which slurmd sets for the hooks, is a configless node's cached copy (its conf-cache)."""
    slurm_conf = (environ.get("SLURM_CONF") or "").strip()
    return os.path.join(os.path.dirname(slurm_conf) if slurm_conf else DEFAULT_CONF_DIR, GRES_CONF)


def read_conf(path: str, owner: int = 0) -> str:
    """gres.conf's text, only from a regular file of root's that no one else may write: a file a
    user could write would choose which GPU root frees and proves. Unmapped otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as handle:
            st = os.fstat(handle.fileno())
            data = handle.read(1 << 20) if stat.S_ISREG(st.st_mode) else b""
    except OSError as exc:
        raise Unmapped(f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Unmapped(f"{path} is not a regular file of uid {owner:d} that only its owner can write: not trusted")
    return data.decode("utf-8", "replace")


def node_gpus(driver: t.Mapping[t.Any, t.Mapping[str, t.Any]]) -> list[NodeGpu]:
    """_nvidia_smi.read_driver_gpus' records -> NodeGpu, those with a UUID and a minor number."""
    return [NodeGpu(str(g["uuid"]), int(g["minor"]), str(g["bus"])) for g in driver.values() if g.get("uuid") and g.get("minor") is not None]


def parse_smi_order(text: str, driver_gpus: t.Sequence[NodeGpu]) -> list[NodeGpu]:
    """`nvidia-smi --query-gpu=index,uuid --format=csv,noheader` -> the driver's GPUs in nvidia-smi's
    index order (NVML's). Unmapped where a GPU of one is not the other's."""
    by_uuid = {gpu.uuid.lower(): gpu for gpu in driver_gpus}
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 2 or not cells[0].isdigit():
            continue
        if cells[1].lower() not in by_uuid:
            raise Unmapped(f"nvidia-smi's GPU {cells[0]} ({cells[1]}) is not in the driver's list")
        rows.append((int(cells[0]), by_uuid[cells[1].lower()]))
    return [gpu for _index, gpu in sorted(rows)]


def node_name(environ: t.Mapping[str, str]) -> str:
    """The name slurmd matches gres.conf's NodeName= against: SLURMD_NODENAME, else the short host name."""
    return (environ.get("SLURMD_NODENAME") or "").strip() or socket.gethostname().split(".")[0]


def minor_reader(table: _devices.DeviceTable | None = None) -> t.Callable[[str], int | None]:
    """path -> the minor number of the GPU device node it is (following links), by the identity
    rules of the /proc scan (_devices.DeviceTable: 195:minor, or the very inode of a root-owned
    /dev/nvidia<minor>); None for anything else."""
    known = table or _devices.DeviceTable.read()

    def minor_of(path: str) -> int | None:
        try:
            name = known.name_of(os.stat(path))
        except OSError:
            return None
        return _devices.gpu_minor(name) if name else None

    return minor_of


def job_gpus(indexes: t.Sequence[int], environ: t.Mapping[str, str], run_smi: t.Callable[[list[str]], str],
             driver_root: str = "/proc/driver/nvidia/gpus") -> list[tuple[int, str, NodeGpu]]:
    """The job's GRES indexes mapped through this node's gres.conf and driver; Unmapped says why not."""
    path = conf_path(environ)
    conf = parse(read_conf(path), node_name(environ))
    driver = node_gpus(read_driver_gpus(driver_root))
    if not driver:
        raise Unmapped(f"the driver lists no GPU with its minor number and UUID ({driver_root})")
    return map_indexes(indexes, conf, minor_reader(), driver, lambda: parse_smi_order(run_smi(["--query-gpu=index,uuid", "--format=csv,noheader"]), driver))
