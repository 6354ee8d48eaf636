#!/usr/bin/env bash
# Package a job of jobs/ (code carried in app/custom), submit it to the running POC system in
# STATE_DIR, wait for it, download the result and print where the outputs are.
#
#   poc/run_job.sh STATE_DIR JOB [--data-root DIR] [--set key=value]... [--timeout SECONDS]
#                  [--gpus N [--gpu-mem GIB]] [--admin USER]
#
#   JOB          a folder of jobs/ (e.g. jobs/fedavg) or its name (fedavg)
#   --data-root  folder where every site finds <site>.npz (absolute path on the sites' machine)
#   --fit-data   set the job's model block (class names, task, channels, image size) from the site
#                files in --data-root, as 'python -m fedpartial simulate --fit-data' does
#   --set        job setting overrides, as for 'python -m fedpartial simulate'
#   --timeout    abort the job after this many seconds (default 1800)
#   --gpus       resource_spec: GPUs each site must have (default none: CPU-only sites accept the job)
#   --admin      admin kit to use (default admin@hospital-a.org; lead@hospital-a.org works too)
#
# Uses the 'nvflare job' CLI with --startup-kit; prints the job id and the result folder
# STATE_DIR/results/<job name>/<job id> (STATE_DIR/results/<job name>/latest links to the newest);
# prints round k/N, the key metric and time left while the job runs.  Exit 1 if the job did not complete.
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$DIR/.." && pwd)"
source "$DIR/common.sh"
poc_init "${1:-}"; shift || true
JOB="${1:-}"; shift || true
[[ -n "$JOB" ]] || poc_die "usage: poc/run_job.sh STATE_DIR JOB [--data-root DIR] [--set k=v]..."
[[ -d "$JOB" ]] || JOB="$REPO/jobs/$JOB"
[[ -f "$JOB/meta.json" ]] || poc_die "'$JOB' is not a job folder (no meta.json)"
JOB="$(cd "$JOB" && pwd)"
NAME="$(basename "$JOB")"
TIMEOUT=1800; GPUS=0; GPU_MEM=0; PKG_ARGS=(); FIT=0; DATA_ROOT=""; USER_SETS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --data-root) DATA_ROOT="$(cd "$2" && pwd)"; PKG_ARGS+=(--data-root "$DATA_ROOT"); shift 2;;
    --fit-data) FIT=1; shift;;
    --set) USER_SETS+=(--set "$2"); shift 2;;
    --timeout) TIMEOUT="$2"; shift 2;;
    --gpus) GPUS="$2"; shift 2;;
    --gpu-mem) GPU_MEM="$2"; shift 2;;
    --admin) export POC_ADMIN="$2"; shift 2;;
    *) poc_die "unknown argument '$1'";;
  esac
done
if [[ "$FIT" == 1 ]]; then
  [[ -n "$DATA_ROOT" ]] || poc_die "--fit-data needs --data-root"
  mapfile -t FITTED < <("$PYTHON" -m fedpartial_tools.deploy data-overrides "$DATA_ROOT")
  for s in "${FITTED[@]}"; do PKG_ARGS+=(--set "$s"); done
fi
PKG_ARGS+=("${USER_SETS[@]}")   # after the fitted ones, so a --set wins
KIT="$(poc_admin_kit)"
PROD="$(poc_prod_dir)"
SITES="$(ls -d "$PROD"/*/startup/fed_client.json 2>/dev/null | awk -F/ '{print $(NF-2)}' | sort -V | paste -sd, -)"
NSITES="$(echo "$SITES" | tr ',' '\n' | grep -c .)"

# min_clients = number of sites (results of late sites would be dropped otherwise); a --set wins
"$PYTHON" -m fedpartial package-job "$JOB" --out "$STATE/jobs/$NAME" --set "server.min_clients=$NSITES" \
  "${PKG_ARGS[@]}" >/dev/null
"$PYTHON" -m fedpartial_tools.deploy resource-spec "$STATE/jobs/$NAME" --gpus "$GPUS" --gpu-mem "$GPU_MEM" \
  --site-names "$SITES" >/dev/null

json_field() { "$PYTHON" -c "import json,sys; d=json.load(sys.stdin); print(d.get('data', d).get('$1', ''))"; }

SUBMIT="$(nvf --format json job submit -j "$STATE/jobs/$NAME" --startup-kit "$KIT")" \
  || poc_die "submit failed: $SUBMIT"
JOB_ID="$(echo "$SUBMIT" | json_field job_id)"
[[ -n "$JOB_ID" ]] || poc_die "no job id in the submit reply: $SUBMIT"
echo "submitted $NAME as job $JOB_ID (sites: $SITES); waiting (timeout ${TIMEOUT}s)..."
# wait in the background and print round k/N, the key metric and time left meanwhile
WAIT_OUT="$STATE/jobs/$NAME.wait.json"
nvf --format json job wait "$JOB_ID" --timeout "$TIMEOUT" --startup-kit "$KIT" >"$WAIT_OUT" &
WAIT_PID=$!
"$PYTHON" -m fedpartial_tools.deploy progress --job "$STATE/jobs/$NAME" --metrics "$PROD/server/$JOB_ID/metrics.json" \
  --while-pid "$WAIT_PID" || true
wait "$WAIT_PID" || true
STATUS_JSON="$(cat "$WAIT_OUT")"
STATUS="$(echo "$STATUS_JSON" | json_field status 2>/dev/null || true)"
if [[ "$STATUS" != FINISHED* ]]; then
  echo "job $JOB_ID not finished after ${TIMEOUT}s (status '${STATUS:-?}'); aborting it" >&2
  nvf job abort "$JOB_ID" --force --startup-kit "$KIT" || true
fi
OUT="$STATE/results/$NAME"
mkdir -p "$OUT"
nvf job download "$JOB_ID" -o "$OUT" --force --startup-kit "$KIT" >/dev/null
ln -sfn "$JOB_ID" "$OUT/latest"   # results/<job>/latest = the newest run of this job
echo "job $JOB_ID: $STATUS; result in $OUT/$JOB_ID"
"$PYTHON" -m fedpartial_tools.deploy results "$OUT/$JOB_ID"
[[ "$STATUS" == *COMPLETED ]] || { echo "error: job $JOB_ID ended $STATUS; see $OUT/$JOB_ID/workspace/log.txt" >&2; exit 1; }
