#!/usr/bin/env bash
# Register (or update) every deployment in deploy/prefect.yaml on the server PREFECT_API_URL
# names. Run from anywhere; the flows are found in this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
export ZEROSAFE_REPO="$PWD"
PREFECT=${PREFECT:-prefect}
"$PREFECT" --no-prompt deploy --all --prefect-file deploy/prefect.yaml
