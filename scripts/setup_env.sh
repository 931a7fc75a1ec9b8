#!/usr/bin/env bash
# Create .venv and install vlm-pack with its dev extras and the optional integrations (so tests cover them).
# Where pip's configured find-links hold a local torch wheel (a CPU build, say), it is used;
# elsewhere torch resolves from the index as usual: nobody is pinned to the local build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if [ ! -f .venv/.vlm-pack-installed ] || [ pyproject.toml -nt .venv/.vlm-pack-installed ]; then
    "$VPY" -m pip install -q --upgrade pip
    tmp=$(mktemp -d)
    if ! "$VPY" -c "import torch" 2>/dev/null && \
       "$VPY" -m pip download -q --no-index --no-deps --dest "$tmp" torch 2>/dev/null; then
        echo "setup: using local torch wheel $(ls "$tmp")"
        "$VPY" -m pip install -q "$tmp"/torch-*.whl
    fi
    rm -rf "$tmp"
    "$VPY" -m pip install -q -e ".[dev,hf,trl,energon]"
    touch .venv/.vlm-pack-installed
fi
