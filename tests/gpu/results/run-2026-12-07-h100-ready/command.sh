#!/bin/bash
# One device call: the training-ready profile read (issue 71) and the clean gate against its floor (issue 68).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{ date -u; nproc; cat /proc/loadavg; nvidia-smi --query-gpu=name,driver_version,memory.used,compute_mode,power.limit,power.default_limit --format=csv; python3 --version; ansible --version | head -1; } > $OUT/machine.txt 2>&1
mkdir -p $OUT/ready
PYTHONPATH= timeout 60 python3 tests/gpu/ready_profile.py $OUT/ready > $OUT/ready_profile.json 2> $OUT/ready_profile.err; echo "ready rc=$?"
timeout 330 python3 tests/gpu/gate_floor.py --out $OUT/floor --runs 7 \
  --collections before68=.gatebase/1e1c6ba --collections before71=.gatebase/245e17d --collections main=.gatebase/b393c13 > $OUT/floor.txt 2>&1; echo "floor rc=$?"
cat $OUT/floor.txt
timeout 150 python3 benchmarks/gate_breakdown.py --reps 7 --collections .gatebase/b393c13 --out $OUT/breakdown.json > $OUT/breakdown.txt 2>&1; echo "breakdown rc=$?"
tail -30 $OUT/breakdown.txt
cat /proc/loadavg >> $OUT/machine.txt
nvidia-smi --query-gpu=memory.used --format=csv,noheader >> $OUT/machine.txt
