#!/usr/bin/env bash
# Build the fedpartial server / site image (docker/Dockerfile) from this checkout.
#
#   docker/build.sh [--cuda cu128] [--tag NAME:TAG]
#
# Writes the build context docker/dist/ (the runtime wheel of fedpartial.__version__ and
# requirements.txt), then runs docker build there. Default tag fedpartial:<version>[-<cuda>].
set -euo pipefail
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$DIR")"
CUDA=""; TAG=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda) CUDA="$2"; shift 2;;
    --tag) TAG="$2"; shift 2;;
    *) echo "error: unknown argument '$1'" >&2; exit 2;;
  esac
done
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$REPO/custom${PYTHONPATH:+:$PYTHONPATH}"
VERSION="$("$PYTHON" -c 'import fedpartial; print(fedpartial.__version__)')"
rm -rf "$DIR/dist"
"$PYTHON" -m fedpartial_tools.deploy build-runtime --out "$DIR/dist"
cp "$REPO/requirements.txt" "$DIR/dist/requirements.txt"
INDEX="https://download.pytorch.org/whl/${CUDA:-cpu}"
TAG="${TAG:-fedpartial:${VERSION}${CUDA:+-$CUDA}}"
docker build -f "$DIR/Dockerfile" --build-arg RUNTIME_VERSION="$VERSION" --build-arg TORCH_INDEX="$INDEX" \
  -t "$TAG" "$DIR"
echo "built $TAG (fedpartial runtime $VERSION, torch from $INDEX)"
