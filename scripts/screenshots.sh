#!/usr/bin/env bash
# Take docs/deployment.md's screenshots of the Prefect UI: a real server (UI on), the `zerosafe`
# process pool, the deployments of deploy/prefect.yaml, one worker, one conversion of the
# sample checkpoint; then headless Chromium photographs the `convert-job` run page and the
# job's summary artifact into docs/. Needs `chromium` (Debian: apt-get install chromium).
#
#   bash scripts/screenshots.sh            # writes docs/run-page.png, docs/summary-artifact.png
#
# Everything it starts is stopped on exit; it leaves only the two PNG files.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$CHROMIUM" ]; then
    echo "screenshots: no chromium found (apt-get install chromium); nothing taken" >&2
    exit 1
fi
BIN=${BIN:-$REPO/.venv/bin}
TMP=$(mktemp -d)
PORT=${PORT:-4299}
export PREFECT_HOME=$TMP/home PREFECT_API_URL=http://127.0.0.1:$PORT/api
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_WORKER_QUERY_SECONDS=2
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -INT -- "-$pid" 2>/dev/null || true; done
    sleep 1
    for pid in "${pids[@]}"; do kill -INT -- "-$pid" 2>/dev/null || true; done
    sleep 2
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
    rm -rf "$TMP"
}
trap cleanup EXIT
setsid "$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" > "$TMP/server.log" 2>&1 &
pids+=($!)
until curl -fs "$PREFECT_API_URL/health" > /dev/null; do sleep 1; done
"$BIN/prefect" work-pool create zerosafe --type process > /dev/null
PREFECT="$BIN/prefect" bash deploy/deploy.sh > /dev/null
setsid "$BIN/prefect" worker start --pool zerosafe > "$TMP/worker.log" 2>&1 &
pids+=($!)
OUT=$TMP/out/step2
"$BIN/prefect" deployment run convert/default --param "source=$REPO/examples/zero3-bf16-ws3" \
    --param "destination=$OUT" --param max_shard_size=20KB --watch > "$TMP/run.log"
read -r CHILD SUMMARY < <("$BIN/python" - "$OUT" <<'PY'
import sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName
from zerosafe_app.flows.convert import job_slug

with get_client(sync_client=True) as client:
    (child,) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["convert-job"])))
    (summary,) = [a for a in client.read_artifacts() if a.key == f"zerosafe-{job_slug(sys.argv[1])}"]
print(child.id, summary.id)
PY
)
sleep 5  # task states and logs reach the server through events
mkdir -p docs
shoot() {
    "$CHROMIUM" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
        --virtual-time-budget=20000 --screenshot="$2" "$1" 2> /dev/null
}
shoot "http://127.0.0.1:$PORT/runs/flow-run/$CHILD" docs/run-page.png
shoot "http://127.0.0.1:$PORT/artifacts/artifact/$SUMMARY" docs/summary-artifact.png
ls -l docs/run-page.png docs/summary-artifact.png
