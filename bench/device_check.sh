#!/usr/bin/env bash
# The device checks of issue 28, unattended, within DEADLINE seconds (default 500), into $OUT
# (default bench/results/device), most valuable first; a step that would not fit is skipped
# and says so:
# STEPS picks and orders them (default: 1, 2, 3, 4 below).
# 1. bench/scaling.py at 1/8/16 tasks (the issue's targets), units as worker processes,
#    output into tmpfs (/dev/shm), the copy as `auto` picks it (fused at 8 and 16 tasks; the
#    last round's merges in streams); each run also measures the overlapped I/O limit.
# 2. The same with the threaded pipeline copy (ZEROSAFE_COPY=pipeline): whether 8 tasks should
#    fuse (the pipeline was ahead at 8 in two calls of three on 2026-11-27).
# 3. The same as 1 with the output on disk (/tmp).
# 4. bench/gpu_resume.sh: a real DeepSpeed ZeRO-2 and ZeRO-3 resume on every GPU, plain
#    torch.load against zerosafe.lazy_torch_load: peak host RSS, seconds, identical losses
#    (measured on 2026-11-26; last, as it changed least since).
# The checkpoint is forged once, first, outside the timed runs. Every log and JSON goes into
# $OUT/check.tar.gz and the tables into $OUT/check-summary.txt (bench/_device.sh).
# Before the call, run bench/device_wheels.sh here and carry `.whl` (DeepSpeed, zlib-ng and
# what of DeepSpeed's dependencies the image lacks).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
DEADLINE=${DEADLINE:-500}
PARAMS=${PARAMS:-2B}
TASKS=${TASKS:-1,8,16}
REPEAT=${REPEAT:-2}  # the best of 2 per N: a first run pays one-off costs
# the steps, in order: scaling-WORKERS-shm|tmp (bench/scaling.py into tmpfs or onto disk), gpu;
# a scaling step may end in :VAR=VALUE,... to run with those variables (its files are named so),
# e.g. scaling-processes-shm:ZEROSAFE_COPY=pipeline; `probe`: the cores' topology and pure-CPU
# scaling (bench/_cpu_probe.py); `profile` (py-spy over a run at the most tasks, every process,
# waits included) takes the same suffix.
STEPS=${STEPS:-scaling-processes-shm scaling-processes-shm:ZEROSAFE_COPY=pipeline scaling-processes-tmp gpu}
OUT=${OUT:-bench/results/device}
source bench/_device.sh
device_setup check
{
  "$PY" -c "import torch, numpy, safetensors, xxhash, psutil, zlib_ng; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
  nproc; free -g; df -h /tmp /dev/shm; nvidia-smi -L 2>&1; uname -r
} 2>&1 | tee "$RAW/env.txt" | tee -a "$SUMMARY"
WORK=/tmp/zs-scaling
note "== forge $PARAMS ZeRO-3 ws8 ($(left) s left)"
forge_ckpt "$WORK/ckpt-$PARAMS-z3-ws8" "$PARAMS" $(( $(left) - 60 )) 2>&1 | tee "$RAW/forge.log" | tee -a "$SUMMARY"
scaling() {  # scaling WORKERS DEST NEED_SECONDS [VAR=VALUE,...]
  local workers=$1 dest=$2 need=$3 vars=${4:-} name
  name="scaling-$workers-$(basename "$(dirname "$dest")")${vars:+-${vars//[=,]/-}}"
  if [ "$(left)" -lt "$need" ]; then note "== $name skipped: $(left) s left, needs $need"; return; fi
  note "== $name ($(left) s left)"
  env ${vars//,/ } timeout "$need" "$PY" bench/scaling.py --params "$PARAMS" --tasks "$TASKS" --repeat "$REPEAT" \
    --work-dir "$WORK" --out-dir "$dest" --workers "$workers" --json "$RAW/$name.json" \
    >"$RAW/$name.log" 2>&1
  note "exit $?"
  grep -E "params, fp32|memory copy|^tasks|^---|^[0-9]+ \|" "$RAW/$name.log" | tee -a "$SUMMARY"
  tail -3 "$RAW/$name.log" | grep -iE "error|Traceback" | tee -a "$SUMMARY"
  rm -rf "$dest"
  pack
}
probe() {  # the cores themselves: topology and pure-CPU scaling (bench/_cpu_probe.py)
  note "== probe ($(left) s left)"
  "$PY" bench/_cpu_probe.py 2>&1 | tee -a "$SUMMARY"
}
profile() {  # py-spy over a run at the most tasks, every process, waits included
  if [ ! -x /tmp/site/bin/py-spy ]; then note "== profile skipped: no py-spy (carry .whl)"; return; fi
  if [ "$(left)" -lt 90 ]; then note "== profile skipped: $(left) s left"; return; fi
  note "== profile ($(left) s left)"
  env ${1//,/ } timeout 80 /tmp/site/bin/py-spy record --idle --threads --subprocesses -r 100 -f raw \
    -o "$RAW/profile.txt" -- "$PY" bench/scaling.py --params "$PARAMS" --tasks "${TASKS##*,}" \
    --repeat 2 --work-dir "$WORK" --out-dir /dev/shm/zs-out --workers processes \
    >"$RAW/profile.log" 2>&1
  "$PY" bench/_profile.py "$RAW/profile.txt" --rate 100 --top 40 >"$RAW/profile-summary.txt" 2>&1
  sed -n '/^leaves/,$p' "$RAW/profile-summary.txt" | head -42 | tee -a "$SUMMARY"
  rm -rf /dev/shm/zs-out
  pack
}
gpu_resume() {
  if [ "$(left)" -ge 150 ]; then
    note "== gpu resume ($(left) s left)"
    mkdir -p "$RAW/gpu"
    PY="$PY" OUT="$RAW/gpu" timeout $(( $(left) > 220 ? 200 : $(left) - 20 )) bash bench/gpu_resume.sh \
      2>&1 | tee "$RAW/gpu-resume.log" | tee -a "$SUMMARY"
    cp "$RAW"/gpu/gpu-resume-z*.json "$OUT/" 2>/dev/null
    pack
  else
    note "== gpu resume skipped: $(left) s left"
  fi
}
for entry in $STEPS; do
  step=${entry%%:*} vars=
  [ "$step" != "$entry" ] && vars=${entry#*:}
  case $step in
    scaling-*-shm) w=${step#scaling-}; scaling "${w%-shm}" /dev/shm/zs-out 100 "$vars" ;;
    scaling-*-tmp) w=${step#scaling-}; scaling "${w%-tmp}" /tmp/zs-out 80 "$vars" ;;
    gpu) gpu_resume ;;
    probe) probe ;;
    profile) profile "$vars" ;;
    *) note "unknown step $step" ;;
  esac
done
note "== done in $((SECONDS - START)) s"
pack
