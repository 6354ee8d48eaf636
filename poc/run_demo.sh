#!/usr/bin/env bash
# The whole one-machine demo in one command: data (HAM10000 from ../shared/data for single-label
# jobs when present, else built-in synthetic) -> site files -> POC system ->
# job -> downloaded global model -> everything stopped -> test-set metrics and the model card.
#
#   poc/run_demo.sh STATE_DIR [JOB] [--sites N] [--rounds R] [--set key=value]...
#
#   STATE_DIR  every file of the run goes here (data, kits, logs, results, HOME, TMPDIR)
#   JOB        a job of jobs/ (default fedavg); its task and method pick the data and scenario
#   --sites    number of hospital sites (default 3)
#   --rounds   FL rounds (default 3)
#   --set      further job settings (e.g. --set rule_args.lr=0.01)
#
# The POC system is stopped on exit, also after an error or Ctrl-C; no process is left behind.
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$DIR/common.sh"
poc_init "${1:-}"; shift || true
JOB=fedavg
if [[ $# -gt 0 && "$1" != --* ]]; then JOB="$1"; shift; fi
SITES=3; ROUNDS=3; SETS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sites) SITES="$2"; shift 2;;
    --rounds) ROUNDS="$2"; shift 2;;
    --set) SETS+=(--set "$2"); shift 2;;
    *) poc_die "unknown argument '$1' (see the header of $0)";;
  esac
done
JOB_DIR="$JOB"; [[ -d "$JOB_DIR" ]] || JOB_DIR="$DIR/../jobs/$JOB"
[[ -f "$JOB_DIR/meta.json" ]] || poc_die "no job '$JOB' (looked for $JOB_DIR/meta.json)"
T0=$SECONDS
step() { echo; echo "== [$((SECONDS - T0)) s] $*"; }

step "1/6 site files for $SITES sites in $STATE/data"
rm -rf "$STATE/data"; mkdir -p "$STATE/data"
SOURCE="$("$PYTHON" -m fedpartial_tools.deploy demo-data "$JOB_DIR" --out "$STATE/data" --sites "$SITES")"
echo "source: $SOURCE"; cat "$STATE/data/sites/split_summary.md"
mapfile -t DATA_SETS < <("$PYTHON" -m fedpartial_tools.deploy data-overrides "$STATE/data/sites")

step "2/6 POC kits for $SITES sites"
"$DIR/stop.sh" "$STATE" >/dev/null 2>&1 || true   # a previous run's system, if any
"$DIR/prepare.sh" "$STATE" --sites "$SITES" >/dev/null

STOPPED=0
stop_system() { STOPPED=1; "$DIR/stop.sh" "$STATE"; }
cleanup() {
  local rc=$?
  if [[ "$STOPPED" == 0 ]]; then
    step "stopping the POC system"
    stop_system || rc=1
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step "3/6 starting server and sites"
"$DIR/start.sh" "$STATE" | tail -n 4

step "4/6 running $(basename "$JOB_DIR") ($ROUNDS rounds)"
ARGS=(--data-root "$STATE/data/sites" --set "num_rounds=$ROUNDS")
for s in "${DATA_SETS[@]}"; do ARGS+=(--set "$s"); done
"$DIR/run_job.sh" "$STATE" "$JOB_DIR" "${ARGS[@]}" "${SETS[@]}" | tee "$STATE/run_job.out"
RESULT="$(sed -n 's/^job .*: .*; result in //p' "$STATE/run_job.out" | tail -n 1)"
# the job's result: best_global_model.pt for segmentation, global_model.pt for classification
MODEL="$("$PYTHON" -m fedpartial_tools.deploy results "$RESULT" | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["result_model"] or "")')"
[[ -n "$MODEL" ]] || poc_die "no global_model.pt in $RESULT"

step "5/6 stopping the POC system"
stop_system

step "6/6 metrics of the job's result model on the test split of $SOURCE"
"$PYTHON" -m fedpartial evaluate --model "$MODEL" --data "$SOURCE" --split test --json > "$STATE/final_metrics.json"
echo "result model: $MODEL"
echo "per-round server metrics: $(dirname "$MODEL")/metrics.json"
echo "all test metrics (JSON): $STATE/final_metrics.json"
echo "TensorBoard (every site's curves): tensorboard --logdir $NVFLARE_POC_WORKSPACE"
echo
# the table of that one evaluation (evaluating again would record it twice in the model card)
"$PYTHON" - "$STATE/final_metrics.json" "$MODEL" <<'PY'
import json, sys
from fedpartial.models.io import read_model_file
from fedpartial_tools.cli import format_evaluation
print(format_evaluation(json.load(open(sys.argv[1])), read_model_file(sys.argv[2])["meta"]))
PY
CARD="$(dirname "$MODEL")/model_card.md"
echo
if [[ -f "$CARD" ]]; then echo "model card: $CARD"; else echo "model card: none beside $MODEL"; fi
# the result as a MONAI bundle (python -m monai.bundle run --config_file $STATE/bundle/configs/inference.json ...)
"$PYTHON" -m fedpartial export --model "$MODEL" --format monai-bundle --out "$STATE/bundle" > /dev/null
echo "MONAI bundle: $STATE/bundle"
