#!/usr/bin/env bash
# Installable as a user installs it: `python -m build` makes a wheel and an sdist; a clean venv outside the
# repository installs the wheel (no extras, versions from the lock so that torch stays the pinned build),
# then `import vlm_pack` and `vlm-pack demo` run from an empty folder, with no repository on the path.
#   bash scripts/check_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
VENV=${VENV:-.venv}  # the development venv (from the lock), which has `build`
VENV=$VENV bash scripts/setup_env.sh
work=$(mktemp -d "${TMPDIR:-/tmp}/vlm-pack-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
start=$SECONDS
"$VENV/bin/python" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/vlm_pack-*.whl)
sdist=$(ls "$work"/dist/vlm_pack-*.tar.gz)
echo "built $(basename "$wheel") and $(basename "$sdist") in $((SECONDS - start)) s"
# The sdist carries the package and what the wheel is built from.
members=$(tar -tzf "$sdist")  # listed once: `tar | grep -q` dies of SIGPIPE under pipefail
for member in vlm_pack/__init__.py vlm_pack/py.typed pyproject.toml README.md LICENSE; do
    grep -q "^vlm_pack-[^/]*/$member$" <<<"$members" || { echo "sdist lacks $member"; exit 1; }
done

python3 -m venv "$work/user"
"$work/user/bin/python" -m pip install -q -c "$root/constraints/ci.txt" "$wheel"
mkdir "$work/empty"
cd "$work/empty"  # no repository here or on the path: only what the wheel installed
"$work/user/bin/python" - <<'EOF'
import pathlib, vlm_pack
where = pathlib.Path(vlm_pack.__file__).resolve()
assert "site-packages" in where.parts, f"vlm_pack imported from {where}, not from the installed wheel"
print(f"import vlm_pack {vlm_pack.__version__} from {where.parent}")
EOF
XDG_CACHE_HOME="$work/cache" "$work/user/bin/vlm-pack" demo
test -s vlm-pack-report/report.json
echo "wheel check passed in $((SECONDS - start)) s"
