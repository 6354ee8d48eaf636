#!/usr/bin/env bash
# Prepare a one-machine POC system: startup kits for a server, N sites and three admins
# (admin@hospital-a.org = project_admin, lead@hospital-a.org = lead, orgadmin@hospital-b.org = org_admin).
#
#   poc/prepare.sh STATE_DIR [--sites N | --site-names a,b,c] [--port P]
#
# Everything goes under STATE_DIR (see poc/common.sh). --port 0 / absent = a free port, so
# several POC systems (or a POC system and the tests) can run side by side.
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$DIR/common.sh"
poc_init "${1:-}"; shift || true
SITES=2; NAMES=""; PORT=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sites) SITES="$2"; shift 2;;
    --site-names) NAMES="$2"; shift 2;;
    --port) PORT="$2"; shift 2;;
    *) poc_die "unknown argument '$1' (see the header of $0)";;
  esac
done
if ls "$NVFLARE_POC_WORKSPACE"/*/prod_*/server/pid.fl >/dev/null 2>&1; then
  poc_die "a POC system of $STATE seems to be running; run poc/stop.sh $STATE first"
fi
"$PYTHON" -m fedpartial_tools.deploy poc-project --sites "$SITES" --site-names "$NAMES" --port "$PORT" \
  --out "$STATE/project.yml" >/dev/null
nvf poc prepare -i "$STATE/project.yml" --force
echo "kits: $(poc_prod_dir)"
