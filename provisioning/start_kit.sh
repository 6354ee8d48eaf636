#!/usr/bin/env bash
# Start one provisioned server or site kit on this machine, in the background, with the
# kit's own restart loop (startup/start.sh -> sub_start.sh).
#
#   provisioning/start_kit.sh KIT_DIR [--storage DIR] [--no-check]
#
#   --storage DIR   server only: keep the job store and snapshots in DIR instead of the
#                   default /tmp/nvflare (lost on reboot); writes KIT_DIR/local/resources.json
#   --no-check      skip the import check of PYTHON (a caller starting several kits checks once)
#
# The kit runs "python3" from PATH: PYTHON (default: python3 on PATH, i.e. the active venv) must
# import nvflare, torch and monai; its folder is put first on PATH. The installed runtime
# (pip install --no-deps fedpartial_runtime-X-py3-none-any.whl into that venv) runs jobs packaged
# with --installed-runtime; the script prints its version, or says that only jobs carrying their
# code (app/custom, byoc) can run. Output goes to KIT_DIR/console.log, FLARE's log to
# KIT_DIR/log.txt. Stop everything with
#   nvflare system shutdown all --force --startup-kit ADMIN_KIT
set -euo pipefail
KIT="${1:?usage: provisioning/start_kit.sh KIT_DIR [--storage DIR]}"; shift
KIT="$(cd "$KIT" && pwd)"
STORAGE=""; CHECK=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --storage) STORAGE="$2"; shift 2;;
    --no-check) CHECK=0; shift;;
    *) echo "error: unknown argument '$1'" >&2; exit 2;;
  esac
done
[[ -f "$KIT/startup/sub_start.sh" ]] || { echo "error: '$KIT' is not a server/site kit (no startup/sub_start.sh)" >&2; exit 2; }
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
[[ "$CHECK" == 0 ]] || "$PYTHON" -c "import nvflare, torch, monai" \
  || { echo "error: '$PYTHON' cannot import nvflare, torch and monai; activate the venv or set PYTHON" >&2; exit 2; }
PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')"
export PATH="$(dirname "$PYTHON"):$PATH"
"$PYTHON" -c "import fedpartial, os; from fedpartial.flare.common import runtime_identity as r; print(f'fedpartial runtime '
              f'{r()} installed ({os.path.dirname(fedpartial.__file__)})')" 2>/dev/null \
  || echo "warning: '$PYTHON' has no fedpartial runtime installed: only jobs that carry their code (byoc) can run" >&2
if [[ -n "$STORAGE" ]]; then
  [[ -f "$KIT/startup/fed_server.json" ]] || { echo "error: --storage is for the server kit" >&2; exit 2; }
  mkdir -p "$STORAGE"
  "$PYTHON" -c "import sys; from fedpartial.site.kit import keep_server_storage_in as k; print(k(sys.argv[1], sys.argv[2]))" \
    "$KIT" "$(cd "$STORAGE" && pwd)" 2>/dev/null \
  || { SRC="$KIT/local/resources.json"; [[ -f "$SRC" ]] || SRC="$SRC.default"
       sed "s#/tmp/nvflare#$(cd "$STORAGE" && pwd)#g" "$SRC" > "$KIT/local/resources.json.tmp"
       mv "$KIT/local/resources.json.tmp" "$KIT/local/resources.json"; }
fi
if [[ -f "$KIT/daemon_pid.fl" ]] && kill -0 "$(cat "$KIT/daemon_pid.fl")" 2>/dev/null; then
  echo "error: $KIT is already running (daemon pid $(cat "$KIT/daemon_pid.fl"))" >&2; exit 1
fi
rm -f "$KIT/shutdown.fl"
cd "$KIT"
setsid nohup bash startup/sub_start.sh >> "$KIT/console.log" 2>&1 < /dev/null &
echo "started $(basename "$KIT") (python: $PYTHON); logs: $KIT/log.txt, $KIT/console.log"
