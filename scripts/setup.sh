#!/usr/bin/env bash
# Creates .venv (CPU torch first, then the pinned stack with torch as a constraint) and installs
# the fedpartial package in editable mode. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first: an unpinned torch pulled in by another package would fetch a multi-GB CUDA build.
quiet() { grep -v "^WARNING: Location" || true; }  # the machine's extra index lists absent packages
python -m pip install -q "$(grep '^torch==' requirements.txt)" 2>&1 | quiet
python -m pip install -q -r requirements.txt -c <(grep '^torch==' requirements.txt) 2>&1 | quiet
python -m pip install -q --no-deps -e .
python -c "import torch, nvflare, monai, fedpartial; print('setup ok: torch', torch.__version__, '| nvflare', nvflare.__version__, '| monai', monai.__version__)"
