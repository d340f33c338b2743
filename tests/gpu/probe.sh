#!/usr/bin/env bash
# First look at a real NVIDIA host: what /proc, the driver files and nvidia-smi show for a real
# CUDA holder and an orphaned child. Kills only the processes it started.
set -u
out=${OUT:-/tmp/probe}; mkdir -p "$out"; cd "$(dirname "$0")" || exit 1
started=()
cleanup() { for p in "${started[@]}"; do kill -9 "$p" 2>/dev/null; done; }
trap cleanup EXIT
{
uname -a; cat /proc/version; id
ls -la /dev/nvidia* ; ls -la /proc/driver/nvidia/gpus/ 2>&1; cat /proc/driver/nvidia/gpus/*/information 2>&1
nvidia-smi --version; nvidia-smi -L; nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv
python3 -c "
import ctypes,time
t=time.monotonic(); l=ctypes.CDLL('libcuda.so.1'); v=ctypes.c_int(); r=l.cuDriverGetVersion(ctypes.byref(v)); print('cuDriverGetVersion', r, v.value, round(time.monotonic()-t,4),'s')"
rm -f /tmp/r1 /tmp/r1.child
python3 cuda_holder.py --gpu 0 --mib 4096 --fork-child --ready /tmp/r1 & p=$!; started+=("$p")
for _ in $(seq 200); do [ -f /tmp/r1 ] && [ -f /tmp/r1.child ] && break; sleep 0.1; done
c=$(cat /tmp/r1.child); started+=("$c")
echo "parent $p child $c"
find "/proc/$p/fd" -mindepth 1 -lname '*nvidia*' -printf '%p -> %l\n'; grep nvidia "/proc/$p/maps" | head -5; cat "/proc/$p/cgroup"; head -c 300 "/proc/$p/stat"; echo
find "/proc/$c/fd" -mindepth 1 -lname '*nvidia*' -printf '%p -> %l\n' | head
nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv
nvidia-smi --query-gpu=index,memory.used,memory.reserved --format=csv
kill -9 "$p"; sleep 0.05
nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv
sleep 0.5; nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv
nvidia-smi --query-gpu=index,memory.used --format=csv
kill -9 "$c"; for _ in $(seq 100); do u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0); [ "$u" = 0 ] && break; sleep 0.02; done
echo "after child kill: $u MiB"
time nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,driver_version,memory.total,memory.reserved,memory.used,memory.free,utilization.gpu,temperature.gpu,power.draw,persistence_mode,mig.mode.current --format=csv,noheader,nounits
ps -eo pid,ppid,comm,args | head -30
} > "$out/probe.txt" 2>&1
cat "$out/probe.txt"
