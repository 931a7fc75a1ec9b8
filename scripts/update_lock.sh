#!/usr/bin/env bash
# Renew constraints/ci.txt on purpose: a fresh venv resolves pyproject.toml's ranges (newest releases), and
# its `pip freeze` (minus vlm-pack itself; torch as the plain release the lock pins) becomes the lock.
# Then run `make test` and `bash scripts/compat_matrix.sh`, and commit the lock with what they showed.
#   bash scripts/update_lock.sh [TORCH_VERSION]    (default: the torch the current lock pins)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOCK=constraints/ci.txt
torch_version=${1:-$(sed -n 's/^torch==//p' "$LOCK")}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: unpinned, pip could pick a multi-GB CUDA build where a CPU one is meant
"$tmp/venv/bin/python" -m pip install -q "torch==$torch_version"
"$tmp/venv/bin/python" -m pip install -q -e ".[dev,hf,trl,energon,ray]"
{
    grep '^#' "$LOCK"
    "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^vlm-pack' \
        | sed -E 's/^torch( @ .*|==[^+]*\+.*)$/torch=='"$torch_version"'/'
} > "$tmp/ci.txt"
mv "$tmp/ci.txt" "$LOCK"
git --no-pager diff --stat -- "$LOCK" || true
