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


@pytest.mark.slow
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


@pytest.mark.slow
def test_prose_token_counts_are_the_hf_processors():
    """The prose's Qwen2-VL counts are what the HF image processor makes of real images of those sizes."""
    import re

    import transformers
    from PIL import Image

    # Qwen/Qwen2-VL-7B-Instruct preprocessor_config.json
    hf = transformers.Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 3136, "longest_edge": 12845056}
    )

    def tokens(width: int, height: int) -> int:
        grid = hf(images=[Image.new("RGB", (width, height), (120, 90, 60))], return_tensors="pt")["image_grid_thw"]
        return int(grid.prod()) // 4  # merge_size**2 patches per token

    text = " ".join("".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "markdown").split())
    quoted = re.search(r"a 1024x768 photo is ([\d,]+) Qwen2-VL tokens, an A4 page at 150 dpi about ([\d,]+), a "
                       r"full-resolution phone photo ([\d,]+)", text)  # fmt: skip
    assert quoted, "the notebook's token-count sentence moved"
    photo, a4, phone = (int(g.replace(",", "")) for g in quoted.groups())
    assert photo == tokens(1024, 768)
    assert a4 == round(tokens(1240, 1754), -2)  # "about": rounded to hundreds
    assert phone == tokens(4032, 3024)
