#!/usr/bin/env bash
# A site joins a provisioned project keeping its own private key (NVFlare distributed provisioning:
# nvflare cert request / cert approve / package). The key never leaves the site; the project admin
# signs the site's certificate request with the project's root CA.
#
#   1. site:           provisioning/join_site.sh request SITE ORG PROJECT OUT_DIR
#                        -> OUT_DIR/SITE.request.zip (send it to the project admin; OUT_DIR keeps SITE.key)
#   2. project admin:  provisioning/join_site.sh approve REQUEST_ZIP WORKSPACE PROJECT_YML [SIGNED_ZIP]
#                        -> SIGNED_ZIP (default SITE.signed.zip) and the root CA fingerprint; send both back
#                           (the fingerprint over another channel, e.g. read out on the phone)
#   3. site:           provisioning/join_site.sh package SIGNED_ZIP OUT_DIR KIT_WORKSPACE FINGERPRINT
#                        -> KIT_WORKSPACE/PROJECT/prod_00/SITE (start it with provisioning/start_kit.sh)
#
# WORKSPACE / PROJECT_YML: the provisioning workspace and project.yml of the running system (its root CA,
# state/cert.json, signs). Do not also add SITE to project.yml: provisioning would then make a second
# key for it. ORG: letters, digits and "_".
set -euo pipefail
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
nvflare() { "$PYTHON" -m nvflare.cli "$@"; }
ACTION="${1:?usage: provisioning/join_site.sh request|approve|package ...}"; shift
case "$ACTION" in
  request)
    SITE="${1:?usage: join_site.sh request SITE ORG PROJECT OUT_DIR}"; ORG="${2:?ORG}"; PROJECT="${3:?PROJECT}"
    OUT="${4:?OUT_DIR}"
    mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
    printf 'name: %s\nparticipants:\n  - name: %s\n    type: client\n    org: %s\n' "$PROJECT" "$SITE" "$ORG" \
      > "$OUT/$SITE.participant.yml"
    nvflare cert request -p "$OUT/$SITE.participant.yml" --out "$OUT" --force >/dev/null
    echo "request: $OUT/$SITE.request.zip  (send it to the project admin; $OUT/$SITE.key stays here)";;
  approve)
    REQ="${1:?usage: join_site.sh approve REQUEST_ZIP WORKSPACE PROJECT_YML [SIGNED_ZIP]}"
    WS="${2:?WORKSPACE}"; PROJ="${3:?PROJECT_YML}"
    SITE="$(basename "$REQ" .request.zip)"
    SIGNED="${4:-$(pwd)/$SITE.signed.zip}"
    CA_JSON="$("$PYTHON" -m fedpartial_tools.deploy join-ca "$WS" "$PROJ")"
    field() { "$PYTHON" -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$CA_JSON" "$1"; }
    # 360 days like the provisioned kits (nvflare cert approve alone gives 1095), never beyond the root CA
    nvflare cert approve "$REQ" -c "$(field ca_dir)" --profile "$(field profile)" --out "$SIGNED" --force \
      --valid-days "${VALID_DAYS:-360}" >/dev/null
    echo "signed: $SIGNED"
    echo "root CA fingerprint: $(field fingerprint)";;
  package)
    SIGNED="${1:?usage: join_site.sh package SIGNED_ZIP OUT_DIR KIT_WORKSPACE FINGERPRINT}"; REQ_DIR="${2:?OUT_DIR}"
    KWS="${3:?KIT_WORKSPACE}"; FP="${4:?FINGERPRINT}"
    nvflare package "$SIGNED" -w "$KWS" --request-dir "$REQ_DIR" --fingerprint "$FP" | grep -E '^(output_dir|endpoint):';;
  *) echo "error: unknown action '$ACTION' (request | approve | package)" >&2; exit 2;;
esac
