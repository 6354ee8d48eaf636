#!/usr/bin/env bash
# Provision (or re-provision) a project and list the startup kits to hand out.
#
#   provisioning/provision.sh PROJECT_YML WORKSPACE [--zip] [--renew NAME[,NAME...]|all]
#
# Writes WORKSPACE/<project>/prod_NN/<participant>/ (one startup kit per server, site and admin)
# and keeps the root CA in WORKSPACE/<project>/state/. Re-running it on the same WORKSPACE after
# adding a participant to PROJECT_YML reuses that root CA and prints which kits are new, so only
# those need to be sent (already-running kits keep working). --zip also writes
# WORKSPACE/<project>/prod_NN/zips/<participant>.zip for transfer. --renew gives the named participants
# (or all) new keys and certificates, signed by the same root CA (re-provisioning alone reuses each
# participant's stored certificate and its expiry); those kits are marked RENEWED.
# Send each kit over a trusted channel: it holds that participant's private key.
set -euo pipefail
USAGE="usage: provisioning/provision.sh PROJECT_YML WORKSPACE [--zip] [--renew NAMES|all]"
PROJECT="${1:?$USAGE}"
WS="${2:?$USAGE}"
shift 2
ZIP=""; RENEW=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --zip) ZIP=--zip; shift;;
    --renew) RENEW="${2:?--renew needs NAMES or all}"; shift 2;;
    *) echo "error: unknown argument '$1'; $USAGE" >&2; exit 2;;
  esac
done
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
# project.yml names fedpartial_tools.deploy.builders.SitePolicyBuilder: nvflare imports it from here
export PYTHONPATH="$(cd "$(dirname "${BASH_SOURCE[0]}")/../custom" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import nvflare" 2>/dev/null || { echo "error: '$PYTHON' cannot import nvflare; activate the venv" >&2; exit 2; }
mkdir -p "$WS"
WS="$(cd "$WS" && pwd)"
NAME="$("$PYTHON" -c "import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))['name'])" "$PROJECT")"
PREV="$(ls -d "$WS/$NAME"/prod_* 2>/dev/null | sort | tail -n 1 || true)"
if [[ -n "$RENEW" ]]; then
  "$PYTHON" -m fedpartial_tools.deploy renew-certs "$WS" "$PROJECT" ${RENEW//,/ }
fi
# from the project file's folder: its relative paths (SitePolicyBuilder's privacy_file) are read from there
PROJECT="$(cd "$(dirname "$PROJECT")" && pwd)/$(basename "$PROJECT")"
(cd "$(dirname "$PROJECT")" && "$PYTHON" -m nvflare.cli provision -p "$PROJECT" -w "$WS" --force >/dev/null)
PROD="$(ls -d "$WS/$NAME"/prod_* | sort | tail -n 1)"
echo "kits in $PROD (root CA: $WS/$NAME/state/cert.json — keep private):"
for kit in "$PROD"/*/; do
  kit="${kit%/}"; p="$(basename "$kit")"
  [[ -d "$kit/startup" ]] || continue
  if [[ -f "$kit/startup/fed_server.json" ]]; then kind=server
  elif [[ -f "$kit/startup/fed_client.json" ]]; then kind=site
  else kind=admin; fi
  new=""
  if [[ -n "$PREV" && ! -d "$PREV/$p" ]]; then new="  <- NEW: send this kit"
  elif [[ -n "$PREV" ]] && ! cmp -s "$PREV/$p/startup/$(ls "$kit/startup" | grep -m1 -E '^(server|client)\.crt$')" \
       "$kit/startup/$(ls "$kit/startup" | grep -m1 -E '^(server|client)\.crt$')"; then
    new="  <- RENEWED: send this kit, restart it"
  fi
  printf '  %-6s %s%s\n' "$kind" "$kit" "$new"
  if [[ "$ZIP" == "--zip" ]]; then
    mkdir -p "$PROD/zips"
    (cd "$PROD" && "$PYTHON" -m zipfile -c "zips/$p.zip" "$p")
  fi
done
if [[ -n "$PREV" ]]; then
  OLD_CA="$(ls "$PREV"/*/startup/rootCA.pem | head -n 1)"; NEW_CA="$(ls "$PROD"/*/startup/rootCA.pem | head -n 1)"
  if cmp -s "$OLD_CA" "$NEW_CA"; then
    echo "root CA unchanged since $(basename "$PREV"): running kits keep working; only NEW / RENEWED kits must be sent"
  else
    echo "warning: the root CA differs from $(basename "$PREV"): every kit must be replaced" >&2
  fi
fi
