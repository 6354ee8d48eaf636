# Sourced by the poc/*.sh scripts: one state folder holds everything of a one-machine system.
#
#   STATE/home      HOME of every nvflare command and site (~/.nvflare/config.conf lives here)
#   STATE/tmp       TMPDIR (torch / nvflare temporary files)
#   STATE/poc       NVFLARE_POC_WORKSPACE: kits, logs, job store, snapshots
#   STATE/jobs      packaged (submit-ready) jobs
#   STATE/results   downloaded job results
#
# STATE comes from the first argument or, failing that, $FEDPARTIAL_POC_STATE.
# PYTHON (default: python3 on PATH) must import nvflare and fedpartial; its folder goes first on
# PATH because the kits' startup/sub_start.sh start "python3" from PATH.

set -euo pipefail

poc_die() { echo "error: $*" >&2; exit 2; }

poc_init() {
  local state="${1:-${FEDPARTIAL_POC_STATE:-}}"
  [[ -n "$state" ]] || poc_die "give the state folder as first argument (or set FEDPARTIAL_POC_STATE)"
  mkdir -p "$state"
  STATE="$(cd "$state" && pwd)"
  case "$STATE" in
    /|/tmp|/tmp/nvflare|"$HOME"|"$HOME/.nvflare") poc_die "refusing to use '$STATE' as state folder";;
  esac
  # the project's .venv (made by scripts/setup.sh) unless PYTHON says otherwise
  local repo_venv; repo_venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python"
  if [[ -z "${PYTHON:-}" && -x "$repo_venv" ]]; then PYTHON="$repo_venv"; fi
  PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
  "$PYTHON" -c "import nvflare, fedpartial" 2>/dev/null \
    || poc_die "'$PYTHON' cannot import nvflare and fedpartial; activate the venv (or set PYTHON=/path/to/venv/bin/python)"
  PYTHON="$("$PYTHON" -c 'import sys; print(sys.executable)')"
  export PATH="$(dirname "$PYTHON"):$PATH"
  export HOME="$STATE/home" TMPDIR="$STATE/tmp" NVFLARE_POC_WORKSPACE="$STATE/poc"
  unset NVFLARE_STARTUP_KIT_DIR
  mkdir -p "$HOME" "$TMPDIR" "$STATE/jobs" "$STATE/results"
  # torch: one thread per site process keeps N sites from fighting over the cores of one machine
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" FEDPARTIAL_THREADS="${FEDPARTIAL_THREADS:-1}"
}

nvf() { "$PYTHON" -m nvflare.cli "$@"; }

# The newest prod_NN folder of the POC project (kits of server, sites and admins).
poc_prod_dir() {
  local d
  d="$(ls -d "$NVFLARE_POC_WORKSPACE"/*/prod_* 2>/dev/null | sort | tail -n 1)"
  [[ -n "$d" ]] || poc_die "no POC kits under $NVFLARE_POC_WORKSPACE: run poc/prepare.sh $STATE first"
  echo "$d"
}

# Admin kit of the project admin (role project_admin); POC_ADMIN overrides (e.g. lead@hospital-a.org).
poc_admin_kit() {
  local prod; prod="$(poc_prod_dir)"
  local name="${POC_ADMIN:-admin@hospital-a.org}"
  [[ -d "$prod/$name" ]] || poc_die "no admin kit '$name' in $prod"
  echo "$prod/$name"
}
