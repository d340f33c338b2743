# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module_utils is PRIVATE: it may change without notice. Only the plugins and roles of
# zeromib.gpu may use it.

"""A job given a MIG slice: which GPU its hooks look at.

What slurmd writes into the prolog's and epilog's environment for a MIG slice (Slurm 22.05's
sources: gres_common_epilog_set_env in src/plugins/gres/common/gres_common.c, _handle_mig in
src/plugins/gpu/nvml/gpu_nvml.c): with `AutoDetect=nvml` each slice is one gres device whose
`MultipleFiles` are the parent GPU's /dev/nvidia<minor> and the slice's two
/dev/nvidia-caps/nvidia-cap<N>, and whose unique id is the slice's MIG UUID (`MIG-<uuid>`, driver
470.42.01 and later; before, `MIG-GPU-<parent uuid>/<gi>/<ci>`). The hooks then get:
- `CUDA_VISIBLE_DEVICES` = that unique id (the slice, unambiguous);
- `SLURM_JOB_GPUS` = the slice's position in slurmd's list of gres devices (every slice counts
  one): NOT an nvidia-smi index. On a node of 2 GPUs split in 7 slices each, the second GPU's
  first slice is 7.
Without AutoDetect (MultipleFiles written by hand) there is no unique id, and both variables carry
that position: no GPU can be told from it, and the hooks refuse it on a MIG GPU.

nvidia-smi lists a MIG UUID under its parent (`nvidia-smi -L`, two spaces in):
    GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-...)
      MIG 1g.5gb     Device  0: (UUID: MIG-...)
and compute apps on a slice report the parent GPU's UUID. The hooks therefore look at the parent
GPU, as shared (its other slices may be other jobs'): what other jobs hold there is theirs
(_shared), and the rest must read within the MIG baseline (an idle MIG GPU reads 50-59 MiB,
measured on H100 and H200)."""

from __future__ import annotations

import re
import typing as t

_OLD_FORM = re.compile(r"^MIG-(GPU-[0-9A-Fa-f-]+)/\d+/\d+$")
_GPU_LINE = re.compile(r"^GPU \d+: .*\(UUID: (GPU-[0-9A-Fa-f-]+)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG .*Device\s+\d+: \(UUID: (MIG-[0-9A-Fa-f-]+)\)\s*$")
TOKEN = r"MIG-(?:GPU-[0-9A-Fa-f-]+/\d+/\d+|[0-9A-Fa-f-]+)"


class MigError(Exception):
    pass


def is_mig(token: str) -> bool:
    return token[:4].upper() == "MIG-"


def parse_list(text: str) -> dict[str, str]:
    """`nvidia-smi -L` -> {MIG UUID (lower case): its parent GPU's UUID}."""
    parents: dict[str, str] = {}
    parent = None
    for line in text.splitlines():
        gpu = _GPU_LINE.match(line)
        if gpu:
            parent = gpu.group(1)
            continue
        mig = _MIG_LINE.match(line)
        if mig and parent:
            parents[mig.group(1).lower()] = parent
    return parents


def parents_of(tokens: t.Sequence[str], list_gpus: t.Callable[[], str]) -> list[str]:
    """The job's GPU tokens with each MIG slice replaced by its parent GPU's UUID (once each, in
    order). `list_gpus()` (nvidia-smi -L) is called only for a slice of the current UUID form."""
    out: list[str] = []
    listed: dict[str, str] | None = None
    for token in tokens:
        if not is_mig(token):
            parent = token
        elif _OLD_FORM.match(token):
            parent = t.cast("t.Match[str]", _OLD_FORM.match(token)).group(1)
        else:
            if listed is None:
                listed = parse_list(list_gpus())
            if token.lower() not in listed:
                raise MigError(f"MIG device {token} is not on this node (nvidia-smi -L lists {', '.join(sorted(listed)) or 'no MIG device'})")
            parent = listed[token.lower()]
        if parent not in out:
            out.append(parent)
    return out
