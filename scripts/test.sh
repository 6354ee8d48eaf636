#!/usr/bin/env bash
# README command 2: the whole test suite (unit, simulator, POC and provisioned end-to-end tests).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TMPDIR=${TMPDIR:-/tmp}
python -m pytest -q -p no:cacheprovider "$@"
