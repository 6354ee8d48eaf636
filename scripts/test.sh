#!/usr/bin/env bash
# README command 2: the whole test suite (unit, simulator, POC and provisioned end-to-end tests).
# Two xdist workers: the end-to-end tests spend much of their time waiting on FLARE (start-up,
# polling), so two at a time finish sooner on 2 cores; POC / provisioned systems stay on one
# worker (xdist_group "deployment"). FEDPARTIAL_TEST_WORKERS=0 runs everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TMPDIR=${TMPDIR:-/tmp}
WORKERS=${FEDPARTIAL_TEST_WORKERS:-2}
if [[ "$WORKERS" == 0 ]]; then
  python -m pytest -q -p no:cacheprovider "$@"
else
  python -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadgroup "$@"
fi
