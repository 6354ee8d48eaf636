#!/usr/bin/env bash
# Stop the POC system in STATE_DIR (aborts running jobs) and make sure no process of it is left:
# processes whose command line names STATE_DIR get 15 s to exit, then are killed.
# Exit 1 if a process survives.   poc/stop.sh STATE_DIR
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$DIR/common.sh"
poc_init "${1:-}"
server_running() {
  local f
  for f in "$NVFLARE_POC_WORKSPACE"/*/prod_*/server/daemon_pid.fl "$NVFLARE_POC_WORKSPACE"/*/prod_*/server/pid.fl; do
    [[ -f "$f" ]] && kill -0 "$(cat "$f")" 2>/dev/null && return 0
  done
  return 1
}
if server_running; then
  timeout 90 "$PYTHON" -m nvflare.cli poc stop </dev/null || echo "warning: 'nvflare poc stop' failed; killing the processes" >&2
fi
# the kits' sub_start.sh loops notice shutdown.fl within 5 s
"$PYTHON" -m fedpartial_tools.deploy stop-leftovers "$STATE" --wait 15
