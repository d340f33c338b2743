#!/usr/bin/env bash
# Raw readings of the health fields on a real NVIDIA host, framed as the other captures
# (### <exact command> ... ### rc=N), for tests/fixtures/nvidia-smi/<model>-<driver>/health_*.txt.
# Read-only: it starts no GPU work, changes no setting. Also times the --query-gpu call with and
# without the health fields, and the kernel log read, as gpu_facts makes them.
# Usage: tests/gpu/health_capture.sh [OUT_DIR]   (default: $OUT or /tmp/health-capture)
set -u
out=${1:-${OUT:-/tmp/health-capture}}; mkdir -p "$out"
base=index,uuid,name,pci.bus_id,driver_version,memory.total,memory.reserved,memory.used,memory.free,utilization.gpu,temperature.gpu,power.draw,persistence_mode,mig.mode.current
health=ecc.errors.uncorrected.volatile.total,remapped_rows.pending,remapped_rows.failure,retired_pages.pending,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,pstate,clocks_event_reasons.hw_slowdown,clocks_event_reasons.hw_thermal_slowdown,clocks_event_reasons.hw_power_brake_slowdown,clocks_event_reasons.sw_thermal_slowdown
framed() {  # framed FILE CMD...: one capture file
    local file=$1; shift
    { echo "### $*"; "$@" 2>&1; echo "### rc=$?"; } > "$out/$file"
}
framed_sh() {  # framed_sh FILE 'shell pipeline'
    local file=$1; shift
    { echo "### $1"; bash -c "$1" 2>&1; echo "### rc=$?"; } > "$out/$file"
}
framed health_q_gpu_csv.txt nvidia-smi --query-gpu=index,pci.bus_id,$health,persistence_mode,mig.mode.current --format=csv
framed health_q_gpu_nounits.txt nvidia-smi --query-gpu=$base,$health --format=csv,noheader,nounits
framed health_q_gpu_gen_variants.txt nvidia-smi --query-gpu=index,pcie.link.gen.current,pcie.link.gen.gpucurrent,pcie.link.gen.max,pcie.link.gen.gpumax,pcie.link.gen.hostmax,pcie.link.width.current,pcie.link.width.max,pstate,clocks_event_reasons.active --format=csv
framed health_q_gpu_throttle_alias.txt nvidia-smi --query-gpu=index,clocks_throttle_reasons.hw_slowdown,clocks_throttle_reasons.hw_thermal_slowdown,clocks_throttle_reasons.hw_power_brake_slowdown,clocks_throttle_reasons.sw_thermal_slowdown --format=csv
framed health_smi_q_health.txt nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER,PERFORMANCE
framed_sh health_smi_q_pcie.txt "nvidia-smi -q | grep -A12 'GPU Link Info'"
framed_sh health_kernel_xid.txt 'journalctl -k -q --no-pager | grep -i xid | tail -n 20'
framed_sh health_dmesg_xid.txt 'dmesg 2>&1 | grep -i xid | tail -n 20'
framed_sh health_dcgmi.txt 'command -v dcgmi || echo "dcgmi not installed"'
# Cost: 20 runs each, the median in ms.
timeit() {  # timeit LABEL CMD...
    local t0 t1 times=()
    for _ in $(seq 20); do
        t0=$(date +%s%N); "$@" > /dev/null 2>&1; t1=$(date +%s%N); times+=($(( (t1 - t0) / 1000 )))
    done
    printf '%s median_us=%s min_us=%s\n' "$1" \
        "$(printf '%s\n' "${times[@]}" | sort -n | sed -n 10p)" "$(printf '%s\n' "${times[@]}" | sort -n | head -1)"
}
{
    echo "### timings (20 runs each; microseconds)"
    timeit query-gpu-base nvidia-smi --query-gpu=$base --format=csv,noheader,nounits
    timeit query-gpu-with-health nvidia-smi --query-gpu=$base,$health --format=csv,noheader,nounits
    timeit journalctl-k-24h journalctl -k --since -1440min -o short-iso -q --no-pager
    timeit dmesg dmesg
    echo "### rc=0"
} > "$out/health_timings.txt" 2>&1
cat "$out"/health_*.txt
