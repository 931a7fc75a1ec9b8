"""A Ray forecast worker starts without torch (issue 34): it is shipped the forecast's parts only.

No Ray cluster: a fresh Python process does what a Ray actor does at its start (import
``vlm_pack.integrations.ray``, unpickle the ``_ChunkForecast`` constructor's forecaster) and forecasts one
chunk. Real parts: parquet with PNG bytes made by Pillow, the offline Qwen2-VL tokenizer, image processor and
full HF processor (with the released Qwen2-VL chat template), and Idefics3's processor. Oracle: the chunk
forecast in this process with the whole Preprocessor (``forecast_chunk`` as the local process pool runs it).
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from vlm_pack.data.forecast import forecast_chunk, make_forecaster
from vlm_pack.integrations.ray import _shippable, forecast_parts, ray_chunks
from vlm_pack.offline import build_tokenizer, image_processor, processor
from vlm_pack.preprocessor import Preprocessor

ROOT = Path(__file__).parents[1]
TEMPLATE = (Path(__file__).parent / "templates" / "qwen2_vl.jinja").read_text()

_WORKER = r"""
import pickle, sys, time
t = time.perf_counter()
from vlm_pack.integrations.ray import _ChunkForecast
forecaster, chunk = pickle.loads(open(sys.argv[1], "rb").read())
actor = _ChunkForecast(forecaster)
out = actor({"seq": [0], "chunk": [pickle.dumps(chunk)]})
open(sys.argv[2], "wb").write(pickle.dumps({
    "result": out["result"][0], "torch": "torch" in sys.modules, "seconds": time.perf_counter() - t,
}))
"""


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def parquet(tmp_path_factory) -> str:
    rows = 30
    images = [[_png((30 + 23 * (i % 7), 30 + 31 * (i % 5)), i)] * (1 + (i % 4 == 0)) * (i % 5 != 3) for i in range(rows)]
    messages = [
        [{"role": "user", "content": [{"type": "image", "text": None}] * len(im) + [{"type": "text", "text": "what " * (1 + i % 6)}]},
         {"role": "assistant", "content": [{"type": "text", "text": "this " * (2 + (3 * i) % 11)}]}]
        for i, im in enumerate(images)
    ]  # fmt: skip
    ds = datasets.Dataset.from_dict({"images": images, "messages": messages})
    path = tmp_path_factory.mktemp("worker") / "train.parquet"
    ds.cast_column("images", datasets.List(datasets.Image())).to_parquet(str(path))
    return str(path)


def _in_a_fresh_worker(pre: Preprocessor, parquet: str, tmp_path: Path) -> tuple[dict, object]:
    """``(what the fresh worker reported, the chunk forecast here with the whole Preprocessor)``."""
    forecaster = make_forecaster(parquet, preprocessor=pre)
    (chunk,) = ray_chunks(forecaster.sources)
    shipped = replace(forecaster, sources=[_shippable(s) for s in forecaster.sources],
                      pre=forecast_parts(forecaster.pre), on_error="skip")  # fmt: skip
    blob, out = tmp_path / "args.pkl", tmp_path / "out.pkl"
    blob.write_bytes(pickle.dumps((shipped, chunk)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", _WORKER, str(blob), str(out)], check=True, env=env, cwd=tmp_path)
    return pickle.loads(out.read_bytes()), forecast_chunk(replace(forecaster, on_error="skip"), chunk)


@functools.cache
def _tokenizers_import_torch() -> bool:
    """Whether this transformers' own tokenizer classes import torch, in a fresh process."""
    code = "import sys; from transformers import PreTrainedTokenizerFast; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


def _same(a, b) -> None:
    for name in ("ordinals", "text", "patches", "num_images", "counts", "starts"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert list(a.keys) == list(b.keys) and a.invalid == b.invalid


@pytest.mark.slow
@pytest.mark.parametrize("parts", ["tokenizer_and_image_processor", "processor"])
def test_a_forecast_worker_forecasts_exactly_without_importing_torch(parts, parquet, tmp_path):
    tok = build_tokenizer("qwen2_vl")
    if parts == "processor":
        pre = Preprocessor(processor=processor("qwen2_vl", tok, chat_template=TEMPLATE))
    else:
        pre = Preprocessor(tok, image_processor("qwen2_vl"))
    report, expected = _in_a_fresh_worker(pre, parquet, tmp_path)
    # vlm-pack imports no torch; a transformers release whose tokenizer module imports it (5.6) still does
    assert report["torch"] is _tokenizers_import_torch()
    _same(pickle.loads(report["result"]), expected)
    assert len(expected.text) == 30 and sum(expected.num_images) > 20


def test_the_parts_shipped_are_the_forecasts_own():
    tok = build_tokenizer("qwen2_vl")
    full = Preprocessor(processor=processor("qwen2_vl", tok, chat_template=TEMPLATE))
    lean = forecast_parts(full)
    assert lean.processor is None and lean.image_processor is None and lean.tokenizer is tok
    assert lean.template == TEMPLATE and lean.spec == full.spec and lean._placeholder == full._placeholder
    rows = [([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], [(320, 240)], "k")]
    assert [(f.length, f.counts) for f in lean.forecast_rows(rows)] == [(f.length, f.counts) for f in full.forecast_rows(rows)]
    # tile markers named on the processor (Idefics3): the processor travels too
    markers = Preprocessor(processor=processor("idefics3"))
    assert forecast_parts(markers).processor is markers.processor
    # nothing to strip: the same object
    bare = Preprocessor(tok, spec=full.spec)
    assert forecast_parts(bare) is bare
