#!/usr/bin/env bash
# README command 2: the whole test suite (unit, simulator, POC and provisioned end-to-end tests).
# Two xdist workers, each taking whole test files (--dist loadfile): the end-to-end tests spend much
# of their time waiting on FLARE, so two at a time finish sooner on 2 cores, and a file's one
# provisioned or POC system (a module fixture) is set up once rather than on each worker.
# (xdist_group marks do nothing here: pytest-xdist 3.8 names a group through Item._nodeid, which
# pytest 9 no longer reads.) FEDPARTIAL_TEST_WORKERS=0 runs everything in one process.
# --durations: the slowest tests are printed at the end, to keep CI's time in view.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export TMPDIR=${TMPDIR:-/tmp}
WORKERS=${FEDPARTIAL_TEST_WORKERS:-2}
if [[ "$WORKERS" == 0 ]]; then
  python -m pytest -q -p no:cacheprovider --durations=25 "$@"
else
  python -m pytest -q -p no:cacheprovider --durations=25 -n "$WORKERS" --dist loadfile "$@"
fi
