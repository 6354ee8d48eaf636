#!/usr/bin/env bash
# One-machine provisioned system (provisioning/project_localhost.yml): provision, install the
# runtime as a site would, start, stop.
#
#   provisioning/local_system.sh provision WORKSPACE [PROJECT_YML]   # default project_localhost.yml
#   provisioning/local_system.sh install-runtime VENV   # a fresh venv holding only what a site installs:
#                                                       # the hashed lock (pip --require-hashes) + the wheel
#   provisioning/local_system.sh install-tools VENV     # a fresh tools venv (the model user's commands):
#                                                       # the tools lock + the runtime and tools wheels
#   provisioning/local_system.sh start WORKSPACE [VENV] # server + every site of the newest prod_NN, run by
#                                                       # VENV's python and fedpartial-site (default: the
#                                                       # checkout's venv); waits (WAIT_SITES s, default 120)
#                                                       # until the server lists every site
#   provisioning/local_system.sh stop WORKSPACE         # admin shutdown, then each kit's fedpartial-site stop;
#                                                       # returns once no process of WORKSPACE is left
#
# The operator's tools (provisioning, the admin API that waits for the sites and shuts them down)
# run with PYTHON (default: python3 on PATH, i.e. the activated checkout venv); the kits run with
# VENV, which may hold the runtime wheel alone. The server's job store goes to WORKSPACE/storage.
# Admin commands afterwards, e.g.:
#   nvflare job submit -j JOB --startup-kit WORKSPACE/fedpartial_local/prod_00/lead@hospital-a.org
set -euo pipefail
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$DIR")"
USAGE="usage: provisioning/local_system.sh provision|install-runtime|install-tools|start|stop WORKSPACE|VENV [...]"
ACTION="${1:?$USAGE}"
WS="${2:?$USAGE}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')"
export PATH="$(dirname "$PYTHON"):$PATH"
"$PYTHON" -c "import fedpartial_tools" 2>/dev/null \
  || { echo "error: '$PYTHON' has no fedpartial_tools (the operator's tools); activate the checkout's venv or set PYTHON" >&2; exit 2; }
prod_dir() { ls -d "$WS"/*/prod_* 2>/dev/null | sort | tail -n 1; }
# the project admin's kit (role from its certificate)
admin_kit() { "$PYTHON" -m fedpartial_tools.deploy admin-kit "$(prod_dir)" --role project_admin; }
kits() { for f in "$(prod_dir)"/*/startup/fed_server.json "$(prod_dir)"/*/startup/fed_client.json; do
           [[ -f "$f" ]] && dirname "$(dirname "$f")"; done; }
case "$ACTION" in
  provision)
    mkdir -p "$WS"; WS="$(cd "$WS" && pwd)"
    "$DIR/provision.sh" "${3:-$DIR/project_localhost.yml}" "$WS";;
  install-runtime)
    VENV="$WS"
    [[ ! -e "$VENV" ]] || { echo "error: '$VENV' exists; install-runtime makes a fresh venv" >&2; exit 2; }
    WHEELS="$(mktemp -d)"
    WHEEL="$("$PYTHON" -m fedpartial_tools.deploy build-runtime --out "$WHEELS")"
    "$PYTHON" -m venv "$VENV"   # the same Python as the tools (the lock is for it), without their packages
    "$VENV/bin/pip" install -q --require-hashes -r "$WHEELS/requirements-site.lock"
    "$VENV/bin/pip" install -q --no-deps "$WHEEL"
    rm -rf "$WHEELS"
    "$VENV/bin/python" -c "import fedpartial_tools" 2>/dev/null \
      && { echo "error: '$VENV' sees the checkout's tooling: not a wheel-only venv" >&2; exit 1; }
    echo "runtime installed in $VENV: $("$VENV/bin/python" -c 'from fedpartial.flare.common import runtime_identity as r; print(r())')";;
  install-tools)
    VENV="$WS"
    [[ ! -e "$VENV" ]] || { echo "error: '$VENV' exists; install-tools makes a fresh venv" >&2; exit 2; }
    WHEELS="$(mktemp -d)"
    WHEEL="$("$PYTHON" -m fedpartial_tools.deploy build-runtime --out "$WHEELS")"
    TOOLS="$("$PYTHON" -m fedpartial_tools.deploy build-tools --out "$WHEELS")"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --require-hashes -r "$WHEELS/requirements-tools.lock"
    "$VENV/bin/pip" install -q --no-deps "$WHEEL" "$TOOLS"
    rm -rf "$WHEELS"
    echo "tools installed in $VENV: $(cd / && env -u PYTHONPATH "$VENV/bin/python" -m fedpartial --help | head -n 1)";;
  start)
    WS="$(cd "$WS" && pwd)"
    PROD="$(prod_dir)"; [[ -n "$PROD" ]] || { echo "error: nothing provisioned in $WS" >&2; exit 2; }
    VENV="${3:-$(dirname "$(dirname "$PYTHON")")}"
    SITE_CMD="$(cd "$VENV" && pwd)/bin/fedpartial-site"
    [[ -x "$SITE_CMD" ]] || { echo "error: '$SITE_CMD' missing: install the runtime wheel into $VENV" >&2; exit 2; }
    echo "$VENV" > "$WS/.kits_venv"
    for kit in $(kits); do
      if [[ -f "$kit/startup/fed_server.json" ]]; then
        env -u PYTHONPATH "$SITE_CMD" start "$kit" --storage "$WS/storage"
      else
        env -u PYTHONPATH "$SITE_CMD" start "$kit"
      fi
    done
    # started is not connected: wait until the server lists every site (the operator's admin API)
    if ! "$PYTHON" -m fedpartial_tools.deploy wait-sites "$PROD" --timeout "${WAIT_SITES:-120}"; then
      echo "error: not every site connected; see each kit's log.txt under $PROD; stopping" >&2
      "$0" stop "$WS" >&2 || true
      exit 1
    fi
    echo "admin kit: $(admin_kit)  (its user name is the folder name)";;
  stop)
    WS="$(cd "$WS" && pwd)"
    KIT="$(admin_kit)"
    if [[ -n "$KIT" ]]; then
      timeout 90 "$PYTHON" -m nvflare.cli system shutdown all --force --startup-kit "$KIT" >/dev/null 2>&1 \
        || echo "note: shutdown through the admin API failed (system not running?); stopping each kit" >&2
    fi
    VENV="$(cat "$WS/.kits_venv" 2>/dev/null || dirname "$(dirname "$PYTHON")")"
    SITE_CMD="$VENV/bin/fedpartial-site"; [[ -x "$SITE_CMD" ]] || SITE_CMD="$PYTHON -m fedpartial.site.command"
    for kit in $(kits); do $SITE_CMD stop "$kit" --wait 30 >/dev/null; done
    "$PYTHON" -m fedpartial_tools.deploy stop-leftovers "$WS" --wait 15;;
  *) echo "error: unknown action '$ACTION'; $USAGE" >&2; exit 2;;
esac
