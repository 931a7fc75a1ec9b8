"""The supported transformers range: declared once (pyproject.toml = vlm_pack._compat), enforced at import."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_pack import _compat

ROOT = Path(__file__).resolve().parents[1]


def _requirement(name: str) -> str:
    """``name``'s version specifier in pyproject.toml's dependencies (no tomllib: Python 3.10 has none)."""
    (spec,) = re.findall(rf'^\s*"{re.escape(name)}([<>=!~][^"]*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    return spec


def test_pyproject_declares_the_range_the_import_check_enforces():
    assert _requirement("transformers") == _compat.TRANSFORMERS_REQUIREMENT
    lower = _compat.TRANSFORMERS_REQUIREMENT.split(",")[0].removeprefix(">=")
    assert _compat.release(lower) == _compat.TRANSFORMERS_MINIMUM


def _fake_transformers(root: Path, version: str) -> Path:
    """An installed-looking transformers of ``version`` (package + dist-info), to put first on the path."""
    (root / "transformers").mkdir()
    (root / "transformers" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    info = root / f"transformers-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    return root


def _import_vlm_pack(path: Path) -> subprocess.CompletedProcess:
    code = "import sys; sys.path.insert(0, sys.argv[1]); import vlm_pack; print('imported')"
    return subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)


def test_import_below_the_range_names_the_range(tmp_path):
    proc = _import_vlm_pack(_fake_transformers(tmp_path, "4.57.6"))
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "transformers 4.57.6 is installed" in proc.stderr
    assert f"transformers{_compat.TRANSFORMERS_REQUIREMENT}" in proc.stderr


@pytest.mark.parametrize("version", ["5.99.0", "5.25.0.dev0"])
def test_import_inside_the_range_passes(tmp_path, version):
    proc = _import_vlm_pack(_fake_transformers(tmp_path, version))
    assert proc.returncode == 0 and proc.stdout.strip() == "imported", proc.stderr


def test_the_installed_transformers_is_read_without_importing_it():
    import transformers

    assert _compat.installed_transformers_version() == transformers.__version__
