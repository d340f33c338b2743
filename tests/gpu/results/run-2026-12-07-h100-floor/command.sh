#!/bin/bash
# The clean gate at three commits in the same minutes (issue 68): 158b99a (1.036x in the issue), 1e1c6ba, main.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{ date -u; cat /proc/loadavg; nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader; } > $OUT/machine.txt 2>&1
timeout 400 python3 tests/gpu/gate_floor.py --out $OUT/floor --runs 7 \
  --collections c158b99a=.gatebase/158b99a --collections c1e1c6ba=.gatebase/1e1c6ba --collections main=.gatebase/c090444 > $OUT/floor.txt 2>&1; echo "floor rc=$?"
cat $OUT/floor.txt
for c in 158b99a c090444; do timeout 90 python3 benchmarks/gate_breakdown.py --reps 5 --collections .gatebase/$c --out $OUT/breakdown-$c.json > $OUT/breakdown-$c.txt 2>&1; echo "breakdown $c rc=$?"; tail -4 $OUT/breakdown-$c.txt; done
{ date -u; cat /proc/loadavg; nvidia-smi --query-gpu=memory.used --format=csv,noheader; } >> $OUT/machine.txt
