#!/usr/bin/env bash
# Register (or update) every deployment in deploy/prefect.yaml on the server PREFECT_API_URL
# names. Run from anywhere; the flows are found in this repository. Nothing is armed: the
# `watch` schedule is deployed paused, and `convert/80b` is an example needing S3 and Dask.
set -euo pipefail
cd "$(dirname "$0")/.."
export ZEROSAFE_REPO="$PWD"
PREFECT=${PREFECT:-prefect}
"$PREFECT" --no-prompt deploy --all --prefect-file deploy/prefect.yaml
cat <<MSG

zerosafe: deployments registered. Workers import the flows from $ZEROSAFE_REPO:
  every worker machine needs this repository installed at that same path.
Ready to use:
  convert/default  prefect deployment run convert/default \\
                       --param source=CKPT_DIR --param destination=OUT_DIR --watch
  pt2st/default    prefect deployment run pt2st/default --param source=F.pt --param destination=F.safetensors
  lazify/default   prefect deployment run lazify/default --param checkpoint=CKPT_DIR --watch
Examples, not armed:
  convert/80b      needs S3 (credentials block secret/zerosafe-s3) and the Dask scheduler
                   named in conf/80b.yaml; edit conf/80b.yaml or pass --param to override.
  watch/watch      schedule (every 15 min) deployed PAUSED; its parameters name an example
                   bucket. Set root/destination_root/storage_options in deploy/prefect.yaml,
                   run this script again, then turn it on:
                     prefect deployment schedule ls watch/watch
                     prefect deployment schedule resume watch/watch SCHEDULE_ID
MSG
