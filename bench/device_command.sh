#!/usr/bin/env bash
# The second device check of issue 28 (after bench/device_check.sh), within DEADLINE seconds:
# 1. The whole `zerosafe convert` command as a user runs it (a new process each time, output on
#    disk, 2B ZeRO-3 ws8 -> bf16, 250MB shards so that the job has the shard count of a larger
#    model), interleaved rounds of: the defaults (threads, --parallel from the cores),
#    ZEROSAFE_WORKERS=auto (worker processes, as many as the 1 GB budget holds), the same with
#    --memory 4GB, and threads at --parallel 2 (the defaults before 2026-11-26).
# 2. The GPU load path: a ~2 GB optimizer-like .pt loaded onto the GPU by torch.load
#    (map_location="cuda") and by zerosafe.load_pt(device="cuda") from its safetensors
#    conversion, each in its own process: seconds, peak host RSS above the baseline, digest.
# Everything goes into $OUT/command.tar.gz and $OUT/command-summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
DEADLINE=${DEADLINE:-300}
ROUNDS=${ROUNDS:-3}
PARAMS=${PARAMS:-2B}
OUT=${OUT:-bench/results/device}
source bench/_device.sh
device_setup command
note "$(nproc) CPUs; $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())')"
CKPT=/tmp/zs-cmd/ckpt
forge_ckpt "$CKPT" "$PARAMS" 2>&1 | tee -a "$SUMMARY"
cat "$CKPT"/*/*.pt >/dev/null 2>&1  # warm: the rounds compare the engine, not the disk
convert() {  # convert NAME [ENV=VALUE...] -- [ARGS...]
  local name=$1; shift
  local envs=() t0 t1 rc
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  rm -rf "/tmp/zs-cmd/out-$name"
  t0=$(date +%s.%N)
  env "${envs[@]}" "$PY" -m zerosafe_app.cli convert "$CKPT" "/tmp/zs-cmd/out-$name" \
    --dtype bf16 --max-shard-size 250MB "$@" >"$RAW/$name-$round.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  note "$name round $round: exit $rc, $(awk "BEGIN { printf \"%.2f\", $t1 - $t0 }") s; $(head -1 "$RAW/$name-$round.log" | grep -o 'peak memory [0-9.]* [MG]B')"
  [ $rc -eq 0 ] || tail -3 "$RAW/$name-$round.log" | tee -a "$SUMMARY"
}
for round in $(seq 1 "$ROUNDS"); do
  if [ "$(left)" -lt 150 ]; then note "round $round skipped: $(left) s left"; break; fi
  convert defaults ZEROSAFE_WORKERS= --
  convert auto ZEROSAFE_WORKERS=auto --
  convert auto-4GB ZEROSAFE_WORKERS=auto -- --memory 4GB
  convert threads-p2 ZEROSAFE_WORKERS=threads -- --parallel 2
  pack
done
grep -h "worker processes\|one at a time" "$RAW"/auto*-1.log | head -3 | tee -a "$SUMMARY"
rm -rf /tmp/zs-cmd/out-*
if [ "$(left)" -ge 60 ]; then
  note "== GPU load ($(left) s left)"
  PT=/tmp/zs-load/opt.pt
  mkdir -p /tmp/zs-load
  "$PY" bench/_cuda_load.py make "$PT" 2>&1 | tail -2 | tee -a "$SUMMARY"
  for via in pt zerosafe pt zerosafe; do
    "$PY" bench/_cuda_load.py load "$PT" "$via" 2>&1 | tail -1 | tee -a "$SUMMARY"
  done
else
  note "GPU load skipped: $(left) s left"
fi
note "== done in $((SECONDS - START)) s"
pack
