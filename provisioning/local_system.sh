#!/usr/bin/env bash
# One-machine provisioned system (provisioning/project_localhost.yml): provision, start, stop.
#
#   provisioning/local_system.sh provision WORKSPACE [PROJECT_YML]   # default project_localhost.yml
#   provisioning/local_system.sh start WORKSPACE     # server + every site of the newest prod_NN; waits
#                                                    # (WAIT_SITES s, default 120) until the server lists them
#   provisioning/local_system.sh stop WORKSPACE      # shutdown via the admin API, then no leftovers
#
# The server's job store goes to WORKSPACE/storage. Admin commands afterwards, e.g.:
#   nvflare job submit -j JOB --startup-kit WORKSPACE/fedpartial_local/prod_00/admin@hospital-a.org
set -euo pipefail
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ACTION="${1:?usage: provisioning/local_system.sh provision|start|stop WORKSPACE}"
WS="${2:?usage: provisioning/local_system.sh provision|start|stop WORKSPACE}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')"
export PYTHON PATH="$(dirname "$PYTHON"):$PATH"
mkdir -p "$WS"; WS="$(cd "$WS" && pwd)"
prod_dir() { ls -d "$WS"/*/prod_* 2>/dev/null | sort | tail -n 1; }
# the project admin's kit (role from its certificate)
admin_kit() { "$PYTHON" -m fedpartial_tools.deploy admin-kit "$(prod_dir)" --role project_admin; }
case "$ACTION" in
  provision)
    "$DIR/provision.sh" "${3:-$DIR/project_localhost.yml}" "$WS";;
  start)
    PROD="$(prod_dir)"; [[ -n "$PROD" ]] || { echo "error: nothing provisioned in $WS" >&2; exit 2; }
    SERVER="$(dirname "$(dirname "$(ls "$PROD"/*/startup/fed_server.json)")")"
    "$PYTHON" -c "import nvflare, torch, monai" \
      || { echo "error: '$PYTHON' cannot import nvflare, torch and monai; activate the venv or set PYTHON" >&2; exit 2; }
    "$DIR/start_kit.sh" "$SERVER" --storage "$WS/storage" --no-check
    for f in "$PROD"/*/startup/fed_client.json; do "$DIR/start_kit.sh" "$(dirname "$(dirname "$f")")" --no-check; done
    # started is not connected: wait until the server lists every site (admin API)
    "$PYTHON" -m fedpartial_tools.deploy wait-sites "$PROD" --timeout "${WAIT_SITES:-120}" \
      || { echo "error: not every site connected; see each kit's log.txt under $PROD" >&2; exit 1; }
    echo "admin kit: $(admin_kit)  (its user name is the folder name)";;
  stop)
    KIT="$(admin_kit)"
    if [[ -n "$KIT" ]]; then
      timeout 90 "$PYTHON" -m nvflare.cli system shutdown all --force --startup-kit "$KIT" \
        || echo "warning: shutdown through the admin API failed; killing the processes" >&2
    fi
    "$PYTHON" -m fedpartial_tools.deploy stop-leftovers "$WS" --wait 15;;
  *) echo "error: unknown action '$ACTION'" >&2; exit 2;;
esac
