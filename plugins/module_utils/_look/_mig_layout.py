# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the modules of
# zeromib.gpu may use it.

"""The MIG layout of a GPU: its GPU instances, compute instances and MIG device UUIDs (issue 71).

Only MIG mode survives a reboot; the instances and their MIG UUIDs are lost, and a service pinned
to a MIG UUID then fails to start. gpu_release keeps the layout of every selected GPU in MIG mode
in the restore record (kind `mig_layout`), and gpu_restore compares it with the node now
(_act/_mig_restore.py). Read with `nvidia-smi mig -lgi`, `mig -lci` and `nvidia-smi -L`, and only
when a selected GPU reads MIG mode Enabled: a gate on a node without MIG makes no call more.

The tables' shapes are those of NVIDIA's MIG user guide ("Getting Started with MIG"); the simulated
driver prints them (tests/sim/nvidia-smi, cmd_mig). Who else controls what is read here: root only
creates or destroys instances (nvidia-smi refuses anyone else), and the text is the driver's; no
process name or user-written text is in these tables.

Pure parsers, and `read`/`record_entries`, which take the NvidiaSmi to ask."""

from __future__ import annotations

import re
import typing as t

if t.TYPE_CHECKING:
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmi

    # {gpu_instances: [...], compute_instances: [...], mig_devices: [...]} of one GPU.
    Layout = t.Dict[str, t.List[t.Dict[str, t.Any]]]

KIND = "mig_layout"
# The record's one action of this kind: the layout was recorded (nothing on the GPU was changed).
ACTION = "layout"

# `|   0  MIG 3g.40gb        9        2          0:4     |` (GPU, profile name, profile ID, instance ID, placement)
_GI_ROW = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s*\|\s*$")
# `|   0      2       MIG 3g.40gb          2         0          0:3     |` (GPU, GPU instance, name, CI profile, CI ID, placement)
_CI_ROW = re.compile(r"^\|\s*(\d+)\s+(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+):(\d+)\s*\|\s*$")
_GPU_LINE = re.compile(r"^GPU (\d+): .*\(UUID: (GPU-[0-9A-Fa-f-]+)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[0-9A-Fa-f-]+)\)\s*$")
# A MIG device UUID as a unit's or a container's configuration names it (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES).
MIG_UUID = re.compile(r"MIG-[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}")
# nvidia-smi's answer where a MIG GPU has no instance (rc 6, NVML's "Not Found"): an empty layout.
_NONE_FOUND = re.compile(r"No (GPU|compute) instances found")


def parse_gpu_instances(text: str) -> list[dict[str, t.Any]]:
    """`nvidia-smi mig -lgi` -> [{gpu, profile, profile_id, id, placement}] (placement `start:size`)."""
    rows = []
    for line in text.splitlines():
        match = _GI_ROW.match(line)
        if match:
            gpu, name, profile_id, gi, start, size = match.groups()
            rows.append({"gpu": int(gpu), "profile": name, "profile_id": int(profile_id), "id": int(gi), "placement": f"{start}:{size}"})
    return rows


def parse_compute_instances(text: str) -> list[dict[str, t.Any]]:
    """`nvidia-smi mig -lci` -> [{gpu, gpu_instance, profile, profile_id, id, placement}]."""
    rows = []
    for line in text.splitlines():
        match = _CI_ROW.match(line)
        if match:
            gpu, gi, name, profile_id, ci, start, size = match.groups()
            rows.append({"gpu": int(gpu), "gpu_instance": int(gi), "profile": name, "profile_id": int(profile_id), "id": int(ci),
                         "placement": f"{start}:{size}"})
    return rows


def parse_list(text: str) -> dict[str, dict[str, t.Any]]:
    """`nvidia-smi -L` -> {GPU UUID: {index, mig_devices: [{profile, device, uuid}]}}, in -L's order."""
    gpus: dict[str, dict[str, t.Any]] = {}
    current: dict[str, t.Any] | None = None
    for line in text.splitlines():
        gpu = _GPU_LINE.match(line)
        if gpu:
            current = gpus[gpu.group(2)] = {"index": int(gpu.group(1)), "mig_devices": []}
            continue
        device = _MIG_LINE.match(line)
        if device and current is not None:
            current["mig_devices"].append({"profile": device.group(1), "device": int(device.group(2)), "uuid": device.group(3)})
    return gpus


def entry_name(uuid: t.Any) -> str:
    """The record entry's name, `mig:GPU-...`: apart from the GPU's `gpu_settings` entry, so that gpu_restore's forget can name either."""
    return f"mig:{uuid}"


def in_mig_mode(gpu: t.Mapping[str, t.Any]) -> bool:
    return str(gpu.get("mig_mode") or "").strip().lower() == "enabled"


def _listed(smi: NvidiaSmi, args: list[str]) -> str:
    """One mig listing; "" where the GPUs have no instance (nvidia-smi's rc 6 "No ... instances found")."""
    from ansible_collections.zeromib.gpu.plugins.module_utils._look._nvidia_smi import NvidiaSmiError  # pylint: disable=import-outside-toplevel
    try:
        return smi.run(args)
    except NvidiaSmiError as exc:
        if exc.rc == 6 and _NONE_FOUND.search(exc.stdout + exc.stderr):
            return ""
        raise


def read(smi: NvidiaSmi, indexes: t.Sequence[int]) -> dict[str, Layout]:
    """{GPU UUID: layout} of the GPUs `indexes` (all three readings, one call each for every GPU).
    Raises NvidiaSmiError when nvidia-smi fails otherwise."""
    ids = ",".join(str(i) for i in indexes)
    gis = parse_gpu_instances(_listed(smi, ["mig", "-i", ids, "-lgi"]))
    cis = parse_compute_instances(_listed(smi, ["mig", "-i", ids, "-lci"]))
    listed = parse_list(smi.run(["-L"]))
    layouts: dict[str, Layout] = {}
    for uuid, gpu in listed.items():
        if gpu["index"] not in indexes:
            continue
        layouts[uuid] = {
            "gpu_instances": [dict((k, v) for k, v in row.items() if k != "gpu") for row in gis if row["gpu"] == gpu["index"]],
            "compute_instances": [dict((k, v) for k, v in row.items() if k != "gpu") for row in cis if row["gpu"] == gpu["index"]],
            "mig_devices": [{"profile": d["profile"], "uuid": d["uuid"]} for d in gpu["mig_devices"]],
        }
    return layouts


def shape(layout: t.Mapping[str, t.Any]) -> tuple[t.Any, ...]:
    """What two layouts must share to be the same slicing: each GPU instance's profile and place,
    with its compute instances' profiles and places (instance IDs and UUIDs may differ)."""
    by_gi: dict[t.Any, list[tuple[t.Any, t.Any]]] = {}
    for ci in layout.get("compute_instances") or []:
        by_gi.setdefault(ci.get("gpu_instance"), []).append((ci.get("profile_id"), ci.get("placement")))
    return tuple(sorted((gi.get("profile_id"), gi.get("placement"), tuple(sorted(by_gi.get(gi.get("id"), []))))
                        for gi in layout.get("gpu_instances") or []))


def said(layout: t.Mapping[str, t.Any]) -> str:
    """`2 GPU instances (3g.40gb at 0:4, 3g.40gb at 4:4)`; `no instance`."""
    gis = sorted(layout.get("gpu_instances") or [], key=lambda gi: str(gi.get("placement")))
    if not gis:
        return "no instance"
    return "{:d} GPU instance{} ({})".format(len(gis), "" if len(gis) == 1 else "s",
                                             ", ".join("{} at {}".format(gi.get("profile"), gi.get("placement")) for gi in gis))


def record_entries(smi: NvidiaSmi, gpus: t.Sequence[t.Mapping[str, t.Any]], selected: t.Iterable[int],
                   at: str | None) -> tuple[list[dict[str, t.Any]], list[str]]:
    """The restore record's entries for the selected GPUs in MIG mode (none, and no call, when no
    selected GPU is), and warnings where the layout could not be read (the release goes on)."""
    chosen = set(selected)
    mig = [g for g in gpus if g.get("index") in chosen and in_mig_mode(g)]
    if not mig:
        return [], []
    try:
        layouts = read(smi, [t.cast(int, g["index"]) for g in mig])
    except Exception as exc:  # pylint: disable=broad-exception-caught  # NvidiaSmiError, OSError: said, the release goes on
        return [], ["the MIG layout of GPU {} was not recorded ({}): gpu_restore cannot re-create it".format(
            ", ".join(str(g.get("index")) for g in mig), getattr(exc, "msg", str(exc)))]
    entries = []
    for gpu in mig:
        layout = layouts.get(str(gpu.get("uuid")))
        if layout is None:
            continue
        entries.append(dict(layout, kind=KIND, name=entry_name(gpu.get("uuid")), uuid=gpu.get("uuid"), index=gpu.get("index"),
                            pci_bus_id=gpu.get("pci_bus_id"),
                            actions=[ACTION], gpu_indexes=[gpu.get("index")], released_at=at))
    return entries, []
