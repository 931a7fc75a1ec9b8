"""notebooks/explore_packing.ipynb executes top to bottom (so it never rots) and is saved with its outputs.

``VLM_PACK_SAVE_NOTEBOOK=1 pytest tests/test_notebook.py`` writes the freshly executed notebook back.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "explore_packing.ipynb"


def _outputs(nb, kind: str) -> list:
    return [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == kind
    ]


def test_saved_notebook_has_its_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), "save the notebook executed"
    images = [o for o in _outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # lengths, efficiency, packs, attention mask, collapsed vs expanded
    assert not _outputs(nb, "error")


def test_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel inherits it: keep the inline backend
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # kernel "python3" with argv[0] "python": jupyter_client runs it with this interpreter (sys.executable).
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    assert not _outputs(nb, "error")
    text = "".join(o.get("text", "") for o in _outputs(nb, "stream"))
    # The analysis table, a real pack, and the collapsed -> expanded remap all printed.
    assert "padding waste, random order" in text
    assert "cu_seqlens_padded" in text and "-> expanded (remapped)" in text
    images = [o for o in _outputs(nb, "display_data") if "image/png" in o.get("data", {})]
    assert len(images) >= 5
    if os.environ.get("VLM_PACK_SAVE_NOTEBOOK"):
        nbformat.write(nb, NOTEBOOK)


def test_prose_token_counts_are_the_real_ones():
    from vlm_pack.vision import vision_spec

    spec = vision_spec("qwen2_vl")
    text = "".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "markdown")
    assert f"a 1024x768 photo is {spec.num_tokens(1024, 768):,} Qwen2-VL tokens" in text
    assert f"about {round(spec.num_tokens(1240, 1754), -2):,}" in text  # A4 at 150 dpi
    assert f"full-resolution phone photo {spec.num_tokens(4032, 3024):,}" in text
