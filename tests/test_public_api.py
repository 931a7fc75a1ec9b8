"""The public API: one name per concept, every name importable, and ``import vlm_pack`` loads nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys
import vlm_pack
before = sorted(sys.modules)
names = {n: type(getattr(vlm_pack, n)).__name__ for n in vlm_pack.__all__}
print(json.dumps({"before": before, "names": names, "dir": dir(vlm_pack)}))
"""


def _probe() -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_import_is_lazy_and_every_public_name_resolves():
    probe = _probe()
    loaded = set(probe["before"])
    heavy = ("vlm_pack.testing", "vlm_pack.offline", "vlm_pack.attention", "vlm_pack.parallel", "vlm_pack.data",
             "megatron", "matplotlib", "webdataset", "torch", "transformers")  # fmt: skip
    assert not loaded & set(heavy), sorted(loaded & set(heavy))
    # Every advertised name resolves (to a class, function or module), and dir() lists them all.
    import vlm_pack

    assert set(probe["names"]) == set(vlm_pack.__all__)
    assert probe["names"]["testing"] == probe["names"]["offline"] == "module"
    assert set(vlm_pack.__all__) <= set(probe["dir"])


def test_one_name_per_concept():
    import vlm_pack as vp
    from vlm_pack.config import PackingConfig

    assert vp.PackingConfig is PackingConfig
    for alias in ("build_packed_pipeline", "select_backend"):
        assert alias not in vp.__all__ and not hasattr(vp, alias)
    # A typo is an AttributeError that names it, not a silent None.
    try:
        vp.PackingConfg  # noqa: B018
    except AttributeError as e:
        assert "PackingConfg" in str(e)
    else:
        raise AssertionError("vp.PackingConfg resolved")
