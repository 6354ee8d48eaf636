#!/usr/bin/env bash
# The prepared GPU run: on one H100 / H200 it runs as many trainings in parallel as fit in the
# minutes given and writes their rows to $OUT (then, here: python -m fedpartial_tools.bench.rows
# merge OUT/rows.csv --into docs/results/rows, and commit). What it runs: FedIA on six MS
# patients (fedpartial_tools.bench.ms6_protocol: the recipe chosen on the sites' own val masks,
# then the leave-one-patient-out fold table, then the second rater).
#
#   OUT=DIR [MINUTES=7] [PARALLEL=0] [PROTOCOL_ARGS="--chosen cosine"] bash scripts/device_bench.sh
#
# The committed rows (docs/results/rows/ms6-*.csv) are copied into OUT/rows.csv first, so a training
# done before is skipped; PROTOCOL_ARGS="--chosen cosine" goes straight to the fold table with the
# recipe the committed rows chose.
#
# Needs: python3 with torch (CUDA); nvflare and MONAI from the environment, else from wheels in
# .whl/ (the device machine has no package index); the two MS source files in $DATA (default
# .devdata, else ../shared/data). FEDPARTIAL_COMMIT names the commit in the rows where there is no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder for the rows}
MINUTES=${MINUTES:-7}
PARALLEL=${PARALLEL:-0}
DATA=${DATA:-.devdata}; [[ -d "$DATA" ]] || DATA=../shared/data
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
T0=$SECONDS
if ! python3 -c "import nvflare, monai" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/custom${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TMPDIR=/tmp/fpbench
mkdir -p "$TMPDIR"
python3 - <<'PY'
import os, torch, nvflare, monai
print(f"torch {torch.__version__} cuda {torch.cuda.is_available()} "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}; nvflare {nvflare.__version__}; "
      f"monai {monai.__version__}; {os.cpu_count()} cores")
PY
echo "[$((SECONDS - T0)) s] set up"
# GPU use beside the run, one sample every 15 s
( while sleep 15; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null \
    | sed "s/^/[gpu $((SECONDS - T0)) s] /" >> "$OUT/gpu.txt"; done ) &
SAMPLER=$!
# the committed MS rows first: a training done before is not run again, the recipe chosen before is checked
python3 - "$OUT/rows.csv" <<'PY'
import glob, sys
from fedpartial_tools.bench.rows import append_row, read_committed
for path in sorted(glob.glob("docs/results/rows/ms6-*.csv")):
    for row in read_committed(path):
        append_row(sys.argv[1], row)
PY
python3 -m fedpartial_tools.bench.ms6_protocol --out /tmp/fpbench/ms6 --rows "$OUT/rows.csv" --data-dir "$DATA" \
  --minutes "$MINUTES" --parallel "$PARALLEL" --report "$OUT/report.json" ${PROTOCOL_ARGS:-}
RC=$?
kill $SAMPLER 2>/dev/null
# FLARE's share of a GPU round, from the servers' per-round records
python3 - "$OUT/rounds.json" <<'PY'
import glob, json, sys
import numpy as np
from fedpartial_tools.bench.throughput import flare_overhead
out = {}
for m in glob.glob("/tmp/fpbench/ms6/*/ms6-*/seed*/*/metrics.json"):
    rounds = json.load(open(m))["rounds"]
    stamps = [r["aggregated_at"] for r in rounds]
    local = [max(s.get("train_seconds", 0.0) for s in r["sites"].values()) for r in rounds]
    out[m.split("/ms6/", 1)[1]] = {"round_s": float(np.median(np.diff(stamps))) if len(stamps) > 1 else None,
                                   "local_s": float(np.median(local)), **flare_overhead(m.rsplit("/", 1)[0])}
json.dump(out, open(sys.argv[1], "w"), indent=1)
r = [v["round_s"] for v in out.values() if v["round_s"]]
l = [v["local_s"] for v in out.values()]
if r:
    print(f"{len(r)} trainings: median round {np.median(r):.2f} s, of which the slowest site's validation + "
          f"training {np.median(l):.2f} s")
PY
echo "[$((SECONDS - T0)) s] done (rc $RC)"
exit $RC
