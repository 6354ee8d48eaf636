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
# its own session: the site daemons do not belong to the caller's terminal / process group
setsid "$PYTHON" -m nvflare.cli poc start --timeout "$TIMEOUT" "${ONLY[@]}" </dev/null
