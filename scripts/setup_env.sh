#!/usr/bin/env bash
# Create .venv (or $VENV) and install vlm-pack with its dev extras and the optional integrations (so tests
# cover them), at the exact versions of the committed lock constraints/ci.txt: a fresh machine next month
# gets what CI tested. pyproject.toml keeps ranges for users; scripts/update_lock.sh renews the lock.
# The lock pins torch==2.13.0: where pip's find-links hold a local CPU build of it (2.13.0+cpu), pip takes it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
LOCK=constraints/ci.txt
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
stamp=$VENV/.vlm-pack-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$LOCK" -nt "$stamp" ]; then
    "$VPY" -m pip install -q --upgrade pip
    "$VPY" -m pip install -q -c "$LOCK" -e ".[dev,hf,trl,energon,ray]"
    touch "$stamp"
fi
