"""Build a configuration for the simulated nvidia-smi (``tests/sim/nvidia-smi``).

Importable (``make_config(preset, seed=..., ...)``) and a CLI::

    python3 tests/sim/make_config.py h200x8 --seed node01 [--minors 1,0,2,3,4,5,6,7] [-o config.json]

Presets model what the real captures in ``tests/fixtures/nvidia-smi`` show (memory
totals/reservations, names, idle power/clock readings). Values marked *guess* in the
comments come from no capture. UUIDs and serials are derived deterministically from
``seed`` (use the host name) so a rig is reproducible. Stdlib only, Python 3.8+.
"""
import argparse
import copy
import hashlib
import json
import os
import sys

DEFAULTS = {
    "driver_version": "580.159.04",
    "cuda_version": "13.0",
    # seconds the memory of a context stays counted after nvidia-smi first saw it dead
    "release_delay_s": 0.05,
    # memory.used exceeds the sum of the compute apps while contexts exist (captures:
    # H100 3 apps +20, L40S 2 apps +16): active + per-context overhead, unless the GPU model
    # has its own measured "overhead_mib" list (see MODELS["h200"])
    "active_overhead_mib": 5,
    "context_overhead_mib": 5,
    # a GPU with no context of its own reads this much more while a live process with a
    # context on another GPU maps its node (2-GPU H200: "1, 4" beside a GPU-0 context,
    # also with two such processes; tests/fixtures/h200x2-proc)
    "cross_gpu_footprint_mib": 4,
    "dev_dir": "/dev",
}

# Fields an R440 driver (before MIG) does not know, for `unsupported_fields`: MIG mode needs R450+
# (NVIDIA's MIG user guide: "driver R450 or later"); row remapping came with the A100 (NVIDIA's A100
# memory error management guide) and its fields later; memory.reserved, gpu_recovery_action and
# fabric.* are newer still (not in R4xx nvidia-smi's field list: a reading of its documentation,
# not a capture). clocks_event_reasons.* exists there only under its old name
# clocks_throttle_reasons.* (R535 renamed it), which the simulator answers to.
R440_UNSUPPORTED_FIELDS = [
    "mig.mode.current", "mig.mode.pending", "memory.reserved", "remapped_rows.pending", "remapped_rows.failure",
    "gpu_recovery_action", "fabric.state", "fabric.status",
    "clocks_event_reasons.hw_slowdown", "clocks_event_reasons.hw_thermal_slowdown",
    "clocks_event_reasons.hw_power_brake_slowdown", "clocks_event_reasons.sw_thermal_slowdown",
]

# The exporter's capture of a single-GPU H200 VM on driver 590.48.01 (one GPU, no NVSwitch, no
# Fabric Manager): its GPU reads fabric.state Completed, fabric.status Success, cliqueId 0, a zero
# clusterUuid and fabric.health.* N/A.
H200_VM_590_CAPTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "fixtures", "nvidia-smi",
                                   "exporter-captures", "linux-x86_64__nvidia-h200__590.48.01.txt")


def captured_fields(path, prefix=""):
    """{field: value} of the first `--query-gpu=... --format=csv` answer of an exporter capture
    (its header line, then the first GPU's line), the fields starting with `prefix`."""
    with open(path) as handle:
        lines = handle.read().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# $ nvidia-smi --query-gpu=") and line.endswith("--format=csv"):
            fields = line.split("=", 1)[1].rsplit(" ", 1)[0].split(",")
            answer = [text for text in lines[i + 1:] if text and not text.startswith("#")]
            values = [v.strip() for v in answer[1].split(",")]  # answer[0]: the header
            if len(values) != len(fields):
                raise ValueError(f"{path}: {len(fields)} fields, {len(values)} values")
            return dict((f, v) for f, v in zip(fields, values) if f.startswith(prefix))
    raise ValueError(f"{path}: no --query-gpu --format=csv answer")


# HGX H100/H200 8-GPU baseboards enumerate at these bus numbers on common servers.
HGX_BUSES = ["18", "2A", "3A", "5D", "9A", "AB", "BA", "DB"]

# Per-model values. From captures unless marked guess.
MODELS = {
    "h200": {  # h200-580.159.04 idle capture (driver 580) + exporter H200 (590)
        "name": "NVIDIA H200", "memory_total_mib": 143771, "memory_reserved_mib": 616,
        "baseline_mib": 0, "mig_mode": "Disabled", "persistence_mode": "Enabled",
        "compute_mode": "Default", "pstate": "P0", "temperature_c": 37, "power_draw_w": 126.02,
        "power_limit_w": 700.0, "utilization_gpu_pct": 0, "clocks_sm_mhz": 1980,
        "clocks_max_sm_mhz": 1980, "vbios_version": "96.00.A5.00.03", "ecc": True,
        "display_active": "Disabled", "memory_free_adjust_mib": 1,
        # memory.used minus the apps' sum with 1, 2, 3 contexts (beyond: + context_overhead_mib
        # each): 1 app 41478 -> 41487 and 2566 -> 2575 (run_held_*, h200x2-proc), 2 apps
        # 10252 -> 10267 (held_*), 3 apps 32342 -> 32362 (exporter H200, driver 590)
        "overhead_mib": [9, 15, 20],
    },
    "h100": {  # exporter H100 80GB HBM3 (590)
        "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "memory_reserved_mib": 479,
        "baseline_mib": 0, "mig_mode": "Disabled", "persistence_mode": "Enabled",
        "compute_mode": "Default", "pstate": "P0", "temperature_c": 41, "power_draw_w": 69.85,
        "power_limit_w": 700.0, "utilization_gpu_pct": 0, "clocks_sm_mhz": 345,
        "clocks_max_sm_mhz": 1980, "vbios_version": "96.00.A5.00.01", "ecc": True,
        "display_active": "Disabled", "memory_free_adjust_mib": 1,
    },
    "a100": {  # guess: A100-SXM4-80GB with MIG enabled; idle MIG reads 50-59 MiB (public reports)
        "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920, "memory_reserved_mib": 512,
        "baseline_mib": 55, "mig_mode": "Enabled", "persistence_mode": "Enabled",
        "compute_mode": "Default", "pstate": "P0", "temperature_c": 33, "power_draw_w": 62.11,
        "power_limit_w": 400.0, "utilization_gpu_pct": "[N/A]", "clocks_sm_mhz": 1410,
        "clocks_max_sm_mhz": 1410, "vbios_version": "92.00.45.00.06", "ecc": True,
        "display_active": "Disabled", "memory_free_adjust_mib": 1,
    },
    "l40s": {  # exporter L40S (595.80)
        "name": "NVIDIA L40S", "memory_total_mib": 46068, "memory_reserved_mib": 609,
        "baseline_mib": 0, "mig_mode": "[N/A]", "persistence_mode": "Disabled",
        "compute_mode": "Default", "pstate": "P0", "temperature_c": 63, "power_draw_w": 144.97,
        "power_limit_w": 350.0, "utilization_gpu_pct": 0, "clocks_sm_mhz": 2520,
        "clocks_max_sm_mhz": 2520, "vbios_version": "95.02.66.00.02", "ecc": True,
        "display_active": "Disabled", "memory_free_adjust_mib": 1,
    },
    "rtx4080": {  # exporter RTX 4080 SUPER (595.71.05), a desktop with kwin_wayland
        "name": "NVIDIA GeForce RTX 4080 SUPER", "memory_total_mib": 16376,
        "memory_reserved_mib": 434, "baseline_mib": 571, "mig_mode": "[N/A]",
        "persistence_mode": "Disabled", "compute_mode": "Default", "pstate": "P8",
        "temperature_c": 43, "power_draw_w": 26.2, "power_limit_w": 320.0,
        "utilization_gpu_pct": 0, "clocks_sm_mhz": 210, "clocks_max_sm_mhz": 3105,
        "vbios_version": "95.03.44.00.B2", "ecc": False, "serial": "[N/A]",
        "display_active": "Enabled", "memory_free_adjust_mib": 2,
    },
    "rtx3070-wsl2": {  # WSL2 on a Windows desktop: XuehaiPan/nvitop#49 and microsoft/wslg#919 (nvidia-smi 525.60.02,
        # Windows driver 526.98: 2844-2880 MiB of 8192 held by Windows' desktop, bus 00000000:09:00.0, "On");
        # NVIDIA/nvidia-container-toolkit#271 (-a under WSL2: Persistence Mode Enabled, Driver Model WDDM)
        "name": "NVIDIA GeForce RTX 3070", "memory_total_mib": 8192, "memory_reserved_mib": 0,
        "baseline_mib": 2844, "mig_mode": "[N/A]", "persistence_mode": "Enabled",
        "compute_mode": "Default", "pstate": "P3", "temperature_c": 55, "power_draw_w": 30.0,
        "power_limit_w": 240.0, "utilization_gpu_pct": 49, "clocks_sm_mhz": 1905, "clocks_max_sm_mhz": 2100,
        "vbios_version": "94.04.25.00.A9", "ecc": False, "serial": "[N/A]",
        "display_active": "Enabled", "memory_free_adjust_mib": 0,
    },
    "gb10": {  # DGX Spark (GB10): the GPU shares the host's 128 GB (unified memory); nvidia-smi reads memory.total, memory.used
        # and memory.free [N/A] while per-process used_memory works (leptonai/gpud#1170, XuehaiPan/nvitop#208, wookayin/gpustat#179).
        # memory_total_mib only feeds the simulator's own arithmetic: every memory field is answered [N/A] (fields, below).
        "name": "NVIDIA GB10", "memory_total_mib": 122502, "memory_reserved_mib": 0,
        "baseline_mib": 0, "mig_mode": "[N/A]", "persistence_mode": "Enabled",
        "compute_mode": "Default", "pstate": "P0", "temperature_c": 45, "power_draw_w": 11.0,
        "power_limit_w": "[N/A]", "utilization_gpu_pct": 0, "clocks_sm_mhz": 208, "clocks_max_sm_mhz": 3003,
        "vbios_version": "[N/A]", "ecc": False, "serial": "[N/A]",
        "display_active": "Disabled", "memory_free_adjust_mib": 0,
    },
}

UNIFIED_MEMORY_FIELDS = {"memory.total": "[N/A]", "memory.used": "[N/A]", "memory.free": "[N/A]", "memory.reserved": "[N/A]"}

PRESETS = {
    "h200x8": {"model": "h200", "count": 8, "buses": HGX_BUSES},
    "h200x1": {"model": "h200", "count": 1, "buses": ["00:06"]},  # the H200 capture's VM
    # the 2-GPU H200 node of tests/fixtures/h200x2-proc (GPU 0 at 00:06.0, GPU 1 at 00:07.0)
    "h200x2": {"model": "h200", "count": 2, "buses": ["00:06", "00:07"],
               "driver_version": "580.159.04", "cuda_version": "13.0"},
    "h100x4": {"model": "h100", "count": 4, "buses": ["18", "2A", "3A", "5D"],
               "driver_version": "590.48.01", "cuda_version": "13.1"},
    "a100-mig": {"model": "a100", "count": 2, "buses": ["07", "0F"],
                 "driver_version": "580.159.04", "cuda_version": "13.0"},
    "l40s": {"model": "l40s", "count": 2, "buses": ["01", "81"],
             "driver_version": "595.80", "cuda_version": "13.2"},
    # An HGX H100 8-GPU NVSwitch baseboard (DGX H100 shape): 4 NVSwitches, Fabric Manager running, every
    # GPU registered with the fabric (fabric.state Completed, fabric.status Success, as a registered
    # GPU reads them; the exporter's H200 VM capture has the same two values). Which GPUs a reset
    # must take together follows nvidia-smi(1), --gpu-reset (tests/sim/nvidia-smi, cmd_reset).
    "hgx-h100x8": {"model": "h100", "count": 8, "buses": HGX_BUSES, "driver_version": "590.48.01", "cuda_version": "13.1",
                   "nvswitches": 4, "fields": {"fabric.state": "Completed", "fabric.status": "Success"}},
    "rtx4080-desktop": {"model": "rtx4080", "count": 1, "buses": ["01"],
                        "driver_version": "595.71.05", "cuda_version": "13.2",
                        # the capture's compositor: 25 MiB under /usr/bin/kwin_wayland;
                        # a rig spawns: gpu_holder --name /usr/bin/kwin_wayland --mib 25
                        "compositor": {"name": "/usr/bin/kwin_wayland", "mib": 25}},
    # WSL2 (tests/fixtures/nvidia-smi/wsl2/README.md): no NVIDIA kernel driver, no /dev/nvidia*, /dev/dxg,
    # nvidia-smi lists every GPU and no process; the kernel release as WSL's kernel spells it.
    "wsl2-rtx3070": {"model": "rtx3070-wsl2", "count": 1, "buses": ["09"], "driver_version": "526.98", "cuda_version": "12.0",
                     "wsl": {"osrelease": "5.15.79.1-microsoft-standard-WSL2"}},
    # Unified memory (issue 70): one GB10 whose memory fields read [N/A]; compute apps list used_memory as usual.
    "gb10": {"model": "gb10", "count": 1, "buses": ["01"], "driver_version": "580.95.05", "cuda_version": "13.0",
             "fields": UNIFIED_MEMORY_FIELDS},
}


def _hex(seed, what, n):
    return hashlib.sha256((f"{seed}:{what}").encode()).hexdigest()[:n]


def gpu_uuid(seed, index):
    h = _hex(seed, f"uuid{index}", 32)
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def bus_id(bus):
    """'18' -> '00000000:18:00.0'; '00:06' -> '00000000:00:06.0'."""
    if ":" in bus:
        b, d = bus.split(":")
    else:
        b, d = bus, "00"
    return f"00000000:{b.upper()}:{d.upper()}.0"


def make_config(preset="h200x8", seed="simhost", minors=None, count=None, gpu_overrides=None,
                **overrides):
    """Return a config dict.

    minors: list mapping index -> minor number (default: identity). The real driver can
    number /dev/nvidia<minor> differently from nvidia-smi's index.
    count: fewer/more GPUs than the preset (bus ids continue synthetically).
    gpu_overrides: {index: {key: value}} applied to single GPUs.
    overrides: top-level keys (driver_version, release_delay_s, ...).
    """
    if preset not in PRESETS:
        raise ValueError("unknown preset {!r} (have {})".format(preset, ", ".join(sorted(PRESETS))))
    p = PRESETS[preset]
    model = MODELS[p["model"]]
    n = p["count"] if count is None else int(count)
    buses = list(p["buses"])
    while len(buses) < n:
        buses.append("%02X" % (0x40 + len(buses)))
    if minors is None:
        minors = list(range(n))
    minors = [int(m) for m in minors]
    if len(minors) != n or len(set(minors)) != n:
        raise ValueError(f"minors must be {n} distinct numbers")
    cfg = dict(DEFAULTS)
    for k in ("driver_version", "cuda_version"):
        if k in p:
            cfg[k] = p[k]
    cfg["preset"] = preset
    if "wsl" in p:
        cfg["wsl"] = dict(p["wsl"])
    cfg["hostname"] = seed
    if "compositor" in p:
        cfg["compositor"] = dict(p["compositor"])
    if p.get("nvswitches"):
        cfg["nvswitches"] = p["nvswitches"]
        cfg["fabric_manager"] = {"unit": "active", "version": cfg.get("driver_version"), "binary": "host"}
    gpus = []
    for i in range(n):
        g = copy.deepcopy(model)
        g.update({
            "index": i,
            "uuid": gpu_uuid(seed, i),
            "pci_bus_id": bus_id(buses[i]),
            "minor": minors[i],
        })
        if "serial" not in g:
            g["serial"] = str(int(_hex(seed, f"serial{i}", 12), 16) % 10 ** 13).zfill(13)
        g["fields"] = dict(p.get("fields") or {})
        if gpu_overrides and i in gpu_overrides:
            g.update(gpu_overrides[i])
        gpus.append(g)
    cfg["gpus"] = gpus
    cfg.update(overrides)
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("--seed", default="simhost", help="host name; seeds UUIDs and serials")
    ap.add_argument("--minors", help="comma list: minor number of each index, e.g. 1,0")
    ap.add_argument("--count", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="top-level override, e.g. release_delay_s=0.1")
    ap.add_argument("-o", "--output", help="write here instead of stdout")
    a = ap.parse_args(argv)
    over = {}
    for kv in a.set:
        k, _sep, v = kv.partition("=")
        try:
            over[k] = json.loads(v)
        except ValueError:
            over[k] = v
    minors = [int(x) for x in a.minors.split(",")] if a.minors else None
    cfg = make_config(a.preset, seed=a.seed, minors=minors, count=a.count, **over)
    text = json.dumps(cfg, indent=2) + "\n"
    if a.output:
        with open(a.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
