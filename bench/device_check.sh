#!/usr/bin/env bash
# The device checks of issue 28, unattended, into $OUT (default bench/results/device):
# 1. bench/scaling.py at 1/4/8/16 tasks, units as threads and as worker processes, output into
#    tmpfs (/dev/shm) and onto disk; each run also measures the overlapped I/O limit.
# 2. bench/gpu_resume.sh: a real DeepSpeed ZeRO-2 and ZeRO-3 resume on every GPU, plain
#    torch.load against zerosafe.lazy_torch_load: peak host RSS, seconds, identical losses.
# Budget: 4 scaling runs of at most 90 s each (the first also forges the 2B checkpoint) and the
# resume at most 200 s: under 10 min. Before the call, run bench/device_wheels.sh here and
# carry `.whl` (DeepSpeed and what of its dependencies the image lacks).
# Untested on a device machine: written on the 2-core machine, where the scaling at
# `--tasks 1,2` and the resume script on CPU ranks (gloo) ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (bench/device_wheels.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
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
    timeout 90 "$PY" bench/scaling.py --params 2B --tasks 1,4,8,16 --repeat 1 \
      --work-dir "$WORK" --out-dir "$dest" --workers "$workers" --json "$OUT/$name.json" \
      2>&1 | tee "$OUT/$name.log"
    rm -rf "$dest"
  done
done
PY="$PY" OUT="$OUT" timeout 200 bash bench/gpu_resume.sh 2>&1 | tee "$OUT/gpu-resume.log"
