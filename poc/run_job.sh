#!/usr/bin/env bash
# Package a job of jobs/ (code carried in app/custom), submit it to the running POC system in
# STATE_DIR, wait for it, download the result and print where the outputs are.
#
#   poc/run_job.sh STATE_DIR JOB [--profile NAME] [--data-root DIR] [--set key=value]...
#                  [--matched-to METHOD_JOB] [--timeout SECONDS] [--gpus N [--gpu-mem GIB]] [--admin USER]
#
#   JOB          a folder of jobs/ (e.g. jobs/fedavg) or its name (fedavg)
#   --profile    a named profile of the job's recipe (e.g. fedmlp --profile ctich, fedia --profile
#                lesions; python -m fedpartial_tools jobs --list); the job is named JOB_NAME
#   --data-root  folder where every site finds <site>.npz (absolute path on the sites' machine)
#   --fit-data   set the job's model block (class names, task, channels, image size) from the site
#                files in --data-root, as 'python -m fedpartial simulate --fit-data' does
#   --set        job setting overrides, as for 'python -m fedpartial simulate'
#   --matched-to a baseline run with a method job's model, local recipe and rounds (e.g. fedavg
#                --matched-to fedlsm), as for 'python -m fedpartial simulate'
#   --timeout    abort the job after this many seconds (default 1800)
#   --gpus       resource_spec: GPUs each site must have (default none: CPU-only sites accept the job)
#   --admin      admin kit to use (default admin@hospital-a.org; lead@hospital-a.org works too)
#
# Submits through FLARE's admin API (fedpartial_tools.deploy run-job); prints the job id and the result folder
# STATE_DIR/results/<job name>/<job id> (STATE_DIR/results/<job name>/latest links to the newest);
# prints round k/N, the key metric and time left while the job runs.  Exit 1 if the job did not
# complete, 2 if it timed out (it is aborted then).
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
    --profile) PKG_ARGS+=(--profile "$2"); NAME="${NAME}_$2"; shift 2;;
    --data-root) DATA_ROOT="$(cd "$2" && pwd)"; PKG_ARGS+=(--data-root "$DATA_ROOT"); shift 2;;
    --fit-data) FIT=1; shift;;
    --set) USER_SETS+=(--set "$2"); shift 2;;
    --matched-to) PKG_ARGS+=(--matched-to "$2"); shift 2;;
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
"$PYTHON" -m fedpartial package-job "$JOB" --out "$STATE/jobs/$NAME" --name "$NAME" --set "server.min_clients=$NSITES" \
  "${PKG_ARGS[@]}" >/dev/null
"$PYTHON" -m fedpartial_tools.deploy resource-spec "$STATE/jobs/$NAME" --gpus "$GPUS" --gpu-mem "$GPU_MEM" \
  --site-names "$SITES" >/dev/null

# submit, wait (printing round k/N, the key metric and time left), abort on timeout, download:
# the same Python the tests use (fedpartial_tools.deploy.admin.run_job)
"$PYTHON" -m fedpartial_tools.deploy run-job --admin-kit "$KIT" --job "$STATE/jobs/$NAME" --out "$STATE/results/$NAME" \
  --timeout "$TIMEOUT" --server-dir "$PROD/server" --latest-link
