#!/usr/bin/env bash
# The GPU load path of issue 28: a real DeepSpeed resume (`engine.load_checkpoint`) on every GPU
# of the machine, ZeRO-2 and ZeRO-3, once with plain `torch.load` and once inside
# `zerosafe.lazy_torch_load()` reading the siblings `lazify_checkpoint` wrote. For each stage it
# writes $OUT/gpu-resume-z<stage>.json: per rank, the load's seconds and peak host RSS (and
# anonymous RSS) above the baseline, for both ways, and whether the next steps' losses and the
# trained weights after them are bit-identical between the two.
#
#   OUT=/tmp/out bash bench/gpu_resume.sh                          # a GPU machine (nccl)
#   NPROC=2 RESUME_BACKEND=gloo DS_ACCELERATOR=cpu bash bench/gpu_resume.sh   # its logic on CPU
#
# Needs deepspeed and psutil importable (bench/device_check.sh installs carried wheels first).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/device}
mkdir -p "$OUT"
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} RESUME_BACKEND=${RESUME_BACKEND:-nccl}
NPROC=${NPROC:-$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
DIMS=${DIMS:-[32768, 2048, 4096]}  # ~0.15B params: embedding and head carry most of the bytes
WORK=$(mktemp -d /tmp/zs-gpu-resume-XXXX)
status=0
run() {  # torchrun of tests/lazy/resume_zero.py on NPROC ranks, its log kept under $OUT
  local log=$1; shift
  local port
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "$PY" -m torch.distributed.run --nnodes 1 --nproc_per_node "$NPROC" \
    --master_addr 127.0.0.1 --master_port "$port" \
    tests/lazy/resume_zero.py "$@" >"$OUT/$log" 2>&1 || { echo "failed: see $OUT/$log"; return 1; }
}
for stage in 2 3; do
  dir="$WORK/z$stage"; mkdir -p "$dir/pt" "$dir/lazy"
  echo "{\"stage\": $stage, \"dims\": $DIMS, \"steps_before\": 2, \"steps_after\": 3}" >"$dir/spec.json"
  echo "ZeRO-$stage on $NPROC rank(s), $DS_ACCELERATOR/$RESUME_BACKEND: save"
  run "gpu-z$stage-save.log" save "$dir/spec.json" "$dir/ckpt" || { status=1; continue; }
  "$PY" -c "import sys, json, zerosafe; print(json.dumps({k: v for k, v in
zerosafe.lazify_checkpoint(sys.argv[1], memory=2 << 30).items() if k != 'files'}))" "$dir/ckpt" \
    >"$OUT/gpu-z$stage-lazify.json" 2>"$OUT/gpu-z$stage-lazify.log" || { echo "lazify failed"; status=1; continue; }
  for via in pt lazy; do
    echo "ZeRO-$stage: resume ($via)"
    run "gpu-z$stage-resume-$via.log" resume "$dir/spec.json" "$dir/ckpt" "$via" "$dir/$via" || status=1
  done
  "$PY" - "$dir" "$stage" "$OUT/gpu-resume-z$stage.json" <<'EOF' || status=1
import json, sys
from pathlib import Path
from safetensors.torch import load_file
import torch

d, stage, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ranks = {via: [json.loads(p.read_text()) for p in sorted((d / via).glob("rank*.json"))]
         for via in ("pt", "lazy")}
a, b = (load_file(d / via / "weights.safetensors") for via in ("pt", "lazy"))
result = {
    "stage": stage,
    "ranks": len(ranks["pt"]),
    "losses_equal": [r["losses"] for r in ranks["pt"]] == [r["losses"] for r in ranks["lazy"]],
    "weights_equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
    "siblings_loaded": [len(r["loaded"]) for r in ranks["lazy"]],
    "fell_back": [r["fell_back"] for r in ranks["lazy"]],
    "load": {via: [{k: r[k] for k in ("load_seconds", "load_peak_rss_bytes",
                                      "load_peak_anon_bytes", "baseline_rss_bytes")}
                   for r in rows] for via, rows in ranks.items()},
}
Path(out).write_text(json.dumps(result, indent=1))
peak = {via: max(r["load_peak_anon_bytes"] for r in rows) / 2**20 for via, rows in ranks.items()}
print(f"ZeRO-{stage}: losses equal {result['losses_equal']}, weights equal "
      f"{result['weights_equal']}; load peak anonymous RSS above baseline, worst rank: "
      f"torch.load {peak['pt']:.0f} MiB, lazy {peak['lazy']:.0f} MiB")
sys.exit(0 if result["losses_equal"] and result["weights_equal"] else 1)
EOF
done
rm -rf "$WORK"
exit $status
