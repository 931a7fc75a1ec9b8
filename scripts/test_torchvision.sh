#!/usr/bin/env bash
# The tests that need torchvision or PyAV (marker `torchvision`): every video test (the `video` extra: PyAV
# reads and decodes, transformers' video processors are torchvision classes), LFM2-VL's image processor (a
# torchvision class only), Gemma 3n's vision tower (timm's MobileNetV5; timm needs torchvision). torchvision
# does not load beside the lock's CPU torch 2.13.0, so these run in a venv of their own, $VENV_TV (default
# .venv-tv): torch, torchvision, timm and av at constraints/torchvision.txt's versions (torch 2.14.1 and
# torchvision 0.29.1 load together, on a CPU too), everything else at the lock's (constraints/ci.txt).
# `make test` runs this after the main suite, so the README's test command runs the video tests too.
#
#   bash scripts/test_torchvision.sh                 # create/refresh .venv-tv, then pytest -m torchvision
#   bash scripts/test_torchvision.sh tests/test_x.py # a part
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV_TV:-.venv-tv}
stamp=$VENV/.vlm-pack-installed
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints/ci.txt -nt "$stamp" ] \
    || [ constraints/torchvision.txt -nt "$stamp" ] || [ scripts/test_torchvision.sh -nt "$stamp" ]; then
    lock=$(mktemp)
    trap 'rm -f "$lock"' EXIT
    # the lock without its torch pin, then this stage's torch, torchvision, timm and av
    grep -v -E '^(torch|torchvision|timm|av)==' constraints/ci.txt >"$lock"
    cat constraints/torchvision.txt >>"$lock"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -c "$lock" torch timm -e ".[dev,hf,trl,energon,video]"
    touch "$stamp"
fi
if [ $# -eq 0 ]; then set -- tests; fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m torchvision "$@"
