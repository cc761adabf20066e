# Sourced by the device checks (bench/device_check.sh, bench/device_command.sh), from the repo's
# root with START, DEADLINE and OUT set: `device_setup NAME` makes /tmp/zs-device-NAME (RAW, every
# log) and $OUT/NAME-summary.txt (SUMMARY), installs carried wheels (bench/device_wheels.sh) and
# picks the Python (PY): the checkout's .venv, else a fresh machine's python3 with the repo on the
# path. A device call brings back at most 8 files, so `pack` puts RAW into $OUT/NAME.tar.gz (after
# each step: a kill keeps what finished). `left` is the seconds before DEADLINE; `note` prints a
# line and keeps it in SUMMARY; `forge_ckpt DIR PARAMS [TIMEOUT]` forges (or reuses) a ZeRO-3 ws8 checkpoint.
device_setup() {
  NAME=$1
  RAW=/tmp/zs-device-$NAME
  rm -rf "$RAW" && mkdir -p "$RAW" "$OUT"
  SUMMARY="$OUT/$NAME-summary.txt"
  : >"$SUMMARY"
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  PY=.venv/bin/python
  if [ ! -x "$PY" ]; then
    PY=python3
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONUNBUFFERED=1
}
pack() { tar -czf "$OUT/$NAME.tar.gz" -C "$RAW" . 2>/dev/null; }
left() { echo $((DEADLINE - (SECONDS - START))); }
note() { echo "$*" | tee -a "$SUMMARY"; }
forge_ckpt() {  # forge_ckpt DIR PARAMS [TIMEOUT_SECONDS]
  timeout "${3:-3600}" "$PY" -c "
import sys, time; sys.path.insert(0, '.')
from bench.run import forge
t = time.perf_counter(); info = forge(sys.argv[1], sys.argv[2], world_size=8, stage=3, seed=0)
print(f'forged {info[\"num_params\"] / 1e9:.2f}B params in {time.perf_counter() - t:.1f} s')
" "$1" "$2"
}
