#!/usr/bin/env bash
# The transformers compatibility matrix: for each version, a copy of .venv (installed from the lock
# constraints/ci.txt by scripts/setup_env.sh) with only transformers swapped (`pip install transformers==X`,
# which moves only what that release requires: tokenizers / huggingface-hub; the lock's `kernels`, which 5.25
# requires and with which 5.6's hub_kernels fails to import, is removed where the release does not import with
# it), then the test suite; then the torchvision / video tests (marker `torchvision`) on the same release,
# in an overlay venv over .venv-tv (scripts/test_torchvision.sh) that holds only the swapped packages.
#
#   bash scripts/compat_matrix.sh                    # the versions below
#   bash scripts/compat_matrix.sh 5.6.2 newest       # chosen ones; "newest" = the newest release pyproject allows
#   MATRIX_TESTS="tests/test_families.py" bash scripts/compat_matrix.sh 5.6.2    # a part of the suite
#
# The default list: the lower bound of pyproject.toml's range (5.6.0, also LLaMA-Factory 0.9.5's newest:
# `<=5.6.0`; 5.6.2 left out to keep CI within its limit with the torchvision stage), NeMo Automodel 0.7's pin (5.18.0), the newest release ms-swift 4.6 allows (<5.20: 5.19.0), the
# release before the lock's (5.24.0: 5.25 changed Qwen3-VL's video prompts) and the newest release the range
# allows. An entry whose version is the lock's own is skipped: `make test` ran the suite on exactly that.
# MATRIX_TORCHVISION=0 skips the torchvision stage. Exit status 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
DEFAULT_VERSIONS=(5.6.0 5.18.0 5.19.0 5.24.0 newest)
if [ $# -gt 0 ]; then versions=("$@"); else versions=("${DEFAULT_VERSIONS[@]}"); fi
tests=${MATRIX_TESTS:-tests}

VENV=${VENV:-.venv}  # the development venv, from the lock
VENV=$VENV bash scripts/setup_env.sh
base=$(cd "$VENV" && pwd)
torchvision=${MATRIX_TORCHVISION:-1}
if [ "$torchvision" = 1 ]; then
    bash scripts/test_torchvision.sh --co -q tests/test_video_forecast.py >/dev/null  # create/refresh .venv-tv
    tv_site=$(cd "${VENV_TV:-.venv-tv}" && bin/python -c "import site; print(site.getsitepackages()[0])")
fi
locked=$("$base/bin/python" -c "import transformers; print(transformers.__version__)")
range=$("$base/bin/python" -c "from vlm_pack._compat import TRANSFORMERS_REQUIREMENT as r; print(r)")
work=$(mktemp -d "${TMPDIR:-/tmp}/vlm-pack-matrix.XXXXXX")
trap 'rm -rf "$work"' EXIT
summary=()
failed=0

# The lock's `kernels` (0.19, which 5.25 requires) breaks an older release's import (5.6's
# integrations/hub_kernels.py); a release that does not require it then runs without it, as its users' would.
without_kernels() {
    if ! "$1" -c "import transformers.integrations.hub_kernels" 2>/dev/null; then
        "$1" -m pip uninstall -q -y kernels || true
    fi
    # an overlay cannot uninstall its base's copy: it shadows it with the release 5.6 imports with
    if ! "$1" -c "import transformers.integrations.hub_kernels" 2>/dev/null; then
        "$1" -m pip install -q "kernels==0.10.5"
    fi
}

for want in "${versions[@]}"; do
    start=$SECONDS
    if [ "$want" = newest ]; then spec="transformers$range"; else spec="transformers==$want"; fi
    venv=$work/venv
    rm -rf "$venv"
    cp -a "$base" "$venv"
    # console scripts (pytest, energon, vlm-pack) name their interpreter by absolute path: repoint them
    for f in "$venv"/bin/*; do
        if [ -f "$f" ] && [ ! -L "$f" ]; then sed -i "1s|^#!$base/|#!$venv/|" "$f"; fi
    done
    "$venv/bin/python" -m pip install -q --upgrade "$spec"
    without_kernels "$venv/bin/python"
    got=$("$venv/bin/python" -c "import transformers; print(transformers.__version__)")
    if [ "$got" = "$locked" ] && [ "$want" = newest ]; then
        summary+=("transformers $got (newest): the lock's own version, tested by make test; skipped")
        continue
    fi
    echo "== transformers $got: pytest $tests"
    log=$work/pytest-$got.log
    set +e
    "$venv/bin/python" -m pytest -q -p no:cacheprovider $tests 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    set -e
    result=$(tail -n 1 "$log" | sed 's/^=* *//; s/ *=*$//')
    summary+=("transformers $got: $result ($((SECONDS - start)) s with the install)")
    if [ "$status" -ne 0 ]; then failed=1; fi
    if [ "$torchvision" = 1 ]; then
        start=$SECONDS
        tv=$work/tv
        rm -rf "$tv"
        "$base/bin/python" -m venv --without-pip "$tv"
        site=$("$tv/bin/python" -c "import site; print(site.getsitepackages()[0])")
        echo "import site; site.addsitedir('$tv_site')" >"$site/vlm_pack_tv_base.pth"
        "$tv/bin/python" -m pip install -q "$spec"  # only what differs lands in the overlay
        without_kernels "$tv/bin/python"
        echo "== transformers $got: pytest -m torchvision $tests"
        set +e
        "$tv/bin/python" -m pytest -q -p no:cacheprovider -m torchvision $tests 2>&1 | tee "$log"
        status=${PIPESTATUS[0]}
        set -e
        result=$(tail -n 1 "$log" | sed 's/^=* *//; s/ *=*$//')
        summary+=("transformers $got, torchvision tests: $result ($((SECONDS - start)) s with the install)")
        if [ "$status" -ne 0 ]; then failed=1; fi
        rm -rf "$tv"
    fi
done
rm -rf "$work/venv"

echo "== compatibility matrix (lock: transformers $locked; supported: transformers$range)"
printf '%s\n' "${summary[@]}"
exit "$failed"
