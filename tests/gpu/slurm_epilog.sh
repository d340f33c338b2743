#!/usr/bin/env bash
# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
#
# Issue 35 on the real H200: the Slurm epilog's time end to end (python start included), run as
# slurmd runs it (SLURM_JOB_ID, SLURM_JOB_GPUS, SLURM_SCRIPT_CONTEXT=epilog_slurmd), no Slurm needed:
#   1. clean node: the epilog on every GPU, 10 runs;
#   2. a job-like process tree left behind: a real CUDA holder (tests/gpu/cuda_holder.py, PyTorch,
#      4 GiB on GPU 0) and its forked child, setsid'd out of the "job", freed by the epilog, 5 runs;
#   3. beside it, DeepOps' 50-exclusive-gpu procedure (kill -9 every listed PID, sleep 5, check).
# The runner is built from this checkout exactly as the role builds it (pack_runner.py).
# Usage (repository root, root on the GPU machine): bash tests/gpu/slurm_epilog.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-/tmp/zeromib-slurm-epilog}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
python3 roles/slurm_gpu_checks/files/pack_runner.py plugins/module_utils "$OUT/runner.pyz"
CONF="$OUT/config.json"
printf '{"drain": false, "log": "%s/epilog.log", "kill_timeout": 3}\n' "$OUT" > "$CONF"
chmod 600 "$CONF"
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
nproc > "$OUT/nproc.txt"; nvidia-smi -L > "$OUT/gpus.txt"; python3 --version > "$OUT/python.txt" 2>&1
echo "== clean node, GPUs $GPUS"
python3 benchmarks/epilog_time.py --runner "$OUT/runner.pyz" --config "$CONF" --gpus "$GPUS" --runs 10 --python "$(command -v python3)" \
  | tee "$OUT/clean.json"
echo "== a CUDA holder and its forked child left behind on GPU 0"
HOLDER="$PY $(pwd)/tests/gpu/cuda_holder.py --gpu 0 --mib 4096 --fork-child --name left_behind --ready $OUT/ready"
python3 benchmarks/epilog_time.py --runner "$OUT/runner.pyz" --config "$CONF" --gpus 0 --runs 5 --python "$(command -v python3)" \
  --leave-behind "$HOLDER" --ready "$OUT/ready" --deepops | tee "$OUT/left_behind.json"
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tee "$OUT/after.txt"
