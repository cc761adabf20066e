#!/usr/bin/env bash
# The 16-core scaling check of issue 28, unattended, into $OUT (default bench/results/device).
# bench/scaling.py at 1/4/8/16 tasks, units as threads and as worker processes, output into
# tmpfs (/dev/shm) and onto disk; each run also measures the overlapped I/O limit.
# Budget: 4 runs of at most 120 s each (the first also forges the 2B checkpoint): under 9 min.
# NOT yet covered: the GPU load path (load_pt(device="cuda"), lazy_torch_load under DeepSpeed).
# Untested on a device machine: written on the 2-core machine, where only `--tasks 1,2` ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  PY=python3  # a fresh machine: its own torch/numpy; the repo on the path
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, numpy, safetensors, xxhash" 2>&1 | tee "$OUT/env.txt" || {
  echo "missing packages: see $OUT/env.txt"; exit 2; }
WORK=/tmp/zs-scaling
for workers in threads processes; do
  for dest in /dev/shm/zs-out /tmp/zs-out; do
    name="scaling-$workers-$(basename "$(dirname "$dest")")"
    timeout 120 "$PY" bench/scaling.py --params 2B --tasks 1,4,8,16 --repeat 1 \
      --work-dir "$WORK" --out-dir "$dest" --workers "$workers" --json "$OUT/$name.json" \
      2>&1 | tee "$OUT/$name.log"
    rm -rf "$dest"
  done
done
