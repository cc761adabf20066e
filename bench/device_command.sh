#!/usr/bin/env bash
# The second device check of issue 28 (after bench/device_check.sh), within DEADLINE seconds:
# 1. The whole `zerosafe convert` command as a user runs it (a new process each time, output on
#    disk, 2B ZeRO-3 ws8 -> bf16, 250MB shards so that the job has the shard count of a larger
#    model), interleaved rounds of CONFIGS (default: all of them):
#      defaults   threads, --parallel from the cores (4 on 16), merges N at once in-process
#      threads-p8 threads, --parallel 8
#      auto       ZEROSAFE_WORKERS=auto: worker processes, as many as the 1 GB budget holds
#      auto-4GB   the same with --memory 4GB --parallel 8
#      threads-p2 threads at --parallel 2 (the defaults before 2026-11-26)
#    and each of them as base-NAME: the same command run from BASELINE, an earlier tree of this
#    repository (`git worktree add .base COMMIT`, then carry `.base`), for before/after figures
#    from the same run.
# 2. With PROFILE=1 and py-spy carried (bench/device_wheels.sh): one more run of each of
#    PROFILES (default: defaults auto-4GB) under `py-spy record --idle --threads --subprocesses -f raw`, for where the
#    wall-clock goes beyond the units.
# 3. With GPU_LOAD=1 (default): a ~2 GB optimizer-like .pt loaded onto the GPU by torch.load
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
CONFIGS=${CONFIGS:-defaults threads-p8 auto auto-4GB threads-p2}
PROFILE=${PROFILE:-0}
GPU_LOAD=${GPU_LOAD:-1}
PROFILES=${PROFILES:-defaults auto-4GB}
BASELINE=${BASELINE:-.base}
source bench/_device.sh
device_setup command
note "$(nproc) CPUs; $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())')"
for i in 1 2 3; do  # what a command that imports torch waits for (the page cache is warm now)
  note "import torch: $("$PY" -c 'import time; t = time.perf_counter(); import torch; print(f"{time.perf_counter() - t:.2f} s")'); import numpy, ml_dtypes: $("$PY" -c 'import time; t = time.perf_counter(); import numpy, ml_dtypes; print(f"{time.perf_counter() - t:.2f} s")')"
done
PY=$(command -v "$PY" 2>/dev/null || echo "$PWD/$PY")
case $PY in /*) ;; *) PY=$PWD/$PY ;; esac
CKPT=/tmp/zs-cmd/ckpt
forge_ckpt "$CKPT" "$PARAMS" 2>&1 | tee -a "$SUMMARY"
cat "$CKPT"/*/*.pt >/dev/null 2>&1  # warm: the rounds compare the engine, not the disk
convert() {  # convert NAME [ENV=VALUE...] -- [ARGS...]; RUNNER (e.g. py-spy) wraps it if set
  local name=$1; shift
  local envs=() t0 t1 rc
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  rm -rf "/tmp/zs-cmd/out-$name"
  t0=$(date +%s.%N)
  (cd "${RUN_DIR:-.}" && env "${envs[@]}" ${RUNNER:-} "$PY" -m zerosafe_app.cli convert "$CKPT" \
    "/tmp/zs-cmd/out-$name" --dtype bf16 --max-shard-size 250MB "$@") >"$RAW/$name-$round.log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  note "$name round $round: exit $rc, $(awk "BEGIN { printf \"%.2f\", $t1 - $t0 }") s; $(grep -m1 -o 'peak memory [0-9.]* [MG]B' "$RAW/$name-$round.log")"
  [ $rc -eq 0 ] || tail -3 "$RAW/$name-$round.log" | tee -a "$SUMMARY"
}
run_config() {  # run_config [base-]NAME
  local p="" RUN_DIR=.
  case $1 in base-*)
    p=base-; RUN_DIR=$BASELINE
    [ -d "$RUN_DIR/zerosafe" ] || { note "$1: no baseline tree at $BASELINE"; return; } ;;
  esac
  case ${1#base-} in
    defaults) convert ${p}defaults ZEROSAFE_WORKERS= -- ;;
    threads-p8) convert ${p}threads-p8 ZEROSAFE_WORKERS=threads -- --parallel 8 ;;
    auto) convert ${p}auto ZEROSAFE_WORKERS=auto -- ;;
    auto-4GB) convert ${p}auto-4GB ZEROSAFE_WORKERS=auto -- --memory 4GB --parallel 8 ;;
    threads-p2) convert ${p}threads-p2 ZEROSAFE_WORKERS=threads -- --parallel 2 ;;
    *) note "unknown config $1" ;;
  esac
}
for round in $(seq 1 "$ROUNDS"); do
  if [ "$(left)" -lt 150 ]; then note "round $round skipped: $(left) s left"; break; fi
  for config in $CONFIGS; do run_config "$config"; done
  pack
done
if [ "$PROFILE" = 1 ] && [ -x /tmp/site/bin/py-spy ]; then
  for config in $PROFILES; do
    if [ "$(left)" -lt 90 ]; then note "profile $config skipped: $(left) s left"; continue; fi
    round=profile
    RUNNER="/tmp/site/bin/py-spy record --idle --threads --subprocesses -r 250 -f raw -o $RAW/profile-$config.txt --" \
      run_config "$config"
    pack
  done
elif [ "$PROFILE" = 1 ]; then
  note "profiles skipped: no /tmp/site/bin/py-spy (carry .whl from bench/device_wheels.sh)"
fi
grep -h "worker processes\|one at a time" "$RAW"/auto*-1.log | head -3 | tee -a "$SUMMARY"
rm -rf /tmp/zs-cmd/out-*
if [ "$GPU_LOAD" = 1 ] && [ "$(left)" -ge 60 ]; then
  note "== GPU load ($(left) s left)"
  PT=/tmp/zs-load/opt.pt
  mkdir -p /tmp/zs-load
  "$PY" bench/_cuda_load.py make "$PT" 2>&1 | tail -2 | tee -a "$SUMMARY"
  for via in pt zerosafe pt zerosafe; do
    "$PY" bench/_cuda_load.py load "$PT" "$via" 2>&1 | tail -1 | tee -a "$SUMMARY"
  done
else
  note "GPU load skipped (GPU_LOAD=$GPU_LOAD, $(left) s left)"
fi
note "== done in $((SECONDS - START)) s"
pack
