#!/usr/bin/env bash
# Start the server and every site of the POC system in STATE_DIR and wait until all sites are
# connected (about 10-15 s).   poc/start.sh STATE_DIR [--timeout SECONDS] [-p NAME]...
# -p NAME starts only that participant (repeatable), e.g. -p server to restart a crashed server.
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$DIR/common.sh"
poc_init "${1:-}"; shift || true
TIMEOUT=90; ONLY=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --timeout) TIMEOUT="$2"; shift 2;;
    -p) ONLY+=(-p "$2"); shift 2;;
    *) poc_die "unknown argument '$1'";;
  esac
done
poc_prod_dir >/dev/null
# Its own session: the site daemons do not belong to the caller's terminal / process group.
# FLARE's `poc start` can hang for ever after the sites are up: its readiness check closes an admin
# session whose first connection attempt never returns (AdminAPI.close waits on it). So it gets a
# bound (--foreground: only that process is stopped, the daemons share its process group), and a
# start that overran is judged by asking the server ourselves.
BOUND=$((TIMEOUT + 30)); rc=0
setsid timeout --foreground -k 5 "$BOUND" "$PYTHON" -m nvflare.cli poc start --timeout "$TIMEOUT" "${ONLY[@]}" \
  </dev/null || rc=$?
if [[ $rc -eq 124 || $rc -eq 137 ]]; then
  echo "nvflare poc start did not return within $BOUND s; asking the server whether every site is connected" >&2
  [[ ${#ONLY[@]} -eq 0 ]] || poc_die "cannot tell whether the participants ${ONLY[*]} started; see the server log under $NVFLARE_POC_WORKSPACE"
  timeout -k 5 "$TIMEOUT" "$PYTHON" -m fedpartial_tools.deploy wait-sites "$(poc_prod_dir)" --timeout "$((TIMEOUT - 5))" \
    || poc_die "the POC system is not ready (nvflare poc start hung, and not every site is connected)"
  rc=0
fi
exit $rc
