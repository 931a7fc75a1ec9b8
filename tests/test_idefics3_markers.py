"""Idefics3 / SmolVLM forecasts are exact whatever the tokenizer makes of the crop markers.

The processor writes ``<fake_token_around_image><row_r_col_c>`` before each crop's ``<image>`` tokens. The
released tokenizers hold the 36 ``<row_r_col_c>`` markers as added tokens (one token each); a tokenizer that
lacks them splits every marker into several sub-tokens. The forecast counts the markers through the
tokenizer, so a :class:`PackedMapDataset` epoch keeps every sample either way. The oracle is transformers:
the released chat template rendered by ``ProcessorMixin.apply_chat_template`` through the released processor
class, built offline around a locally trained tokenizer.
"""

from __future__ import annotations

import io
from pathlib import Path

import datasets
import pytest
from PIL import Image
from transformers import ProcessorMixin

from vlm_pack import Preprocessor, offline
from vlm_pack.config import PackingConfig
from vlm_pack.data.map_style import PackedMapDataset, plan_info

TEMPLATES = Path(__file__).parent / "templates"
# Aspect ratios that give different crop grids (every side is first resized to the longest edge):
# 1x1 + global, 2x2, 3x2, 4x1 and a single crop (do_image_splitting keeps a tiny image one crop only when
# it is no larger than one crop after the resize, which never happens with do_resize; 1x4 and 4x3 cover more).
SIZES = [(64, 64), (300, 200), (90, 160), (400, 100), (100, 400), (220, 170)]


def _tokenizer(family: str, markers: bool):
    """The offline tokenizer of ``family``; without ``markers`` the ``<row_r_col_c>`` added tokens are left
    out (as a tokenizer trained or extended without them), so each marker is several BPE sub-tokens."""
    if markers:
        return offline.build_tokenizer(family)
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from vlm_pack.offline.tokenizers import _SPECIAL_TOKENS, _tokenizer_json, family_tokens

    layout = family_tokens(family)
    extra = [t for t in layout["extra"] if not t.startswith("<row_")]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(1024)))
    tok.add_special_tokens({"additional_special_tokens": [*_SPECIAL_TOKENS, *extra]})
    tok.add_special_tokens(dict(layout["core"]))
    tok._set_model_specific_special_tokens(special_tokens=dict(layout["roles"]))
    tok.vlm_pack_family = family
    return tok


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _conversation(i: int, images: int) -> list[dict]:
    user = [{"type": "image"}] * images + [{"type": "text", "text": "what is shown " * (1 + i % 3)}]
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": "a dog " * (1 + i % 4)}]},
    ]


def _oracle(proc, conversation: list[dict], images: list) -> int:
    """transformers' length: the checkpoint template rendered by transformers, through its processor."""
    text = ProcessorMixin.apply_chat_template(proc, conversation)
    bos = proc.tokenizer.bos_token
    enc = proc(text=[text], images=[images], add_special_tokens=not (bos and text.startswith(bos)))
    return len(enc["input_ids"][0])


@pytest.mark.parametrize("markers", [True, False], ids=["markers", "no-markers"])
@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
@pytest.mark.slow
def test_an_epoch_keeps_every_image_sample_whatever_the_markers_tokenize_to(family, markers):
    tok = _tokenizer(family, markers)
    marker_ids = tok("<row_1_col_1>", add_special_tokens=False)["input_ids"]
    assert (len(marker_ids) == 1) == markers  # the premise: without the added tokens a marker is split
    template = (TEMPLATES / f"{family}.jinja").read_text()
    proc = offline.processor(family, tok, chat_template=template)
    # one image per sample (every grid shape), then two images in one sample
    images = [[_png(s, i)] for i, s in enumerate(SIZES)] + [[_png(SIZES[1], 7), _png(SIZES[3], 8)]]
    messages = [_conversation(i, len(im)) for i, im in enumerate(images)]
    ds = datasets.Dataset.from_dict({"images": images, "messages": messages})
    ds = ds.cast_column("images", datasets.List(datasets.Image()))

    config = PackingConfig(capacity=8192, on_error="raise")  # a forecast mismatch raises instead of a warning
    packed = PackedMapDataset(ds, Preprocessor(processor=proc), config, cache=False)
    assert packed.skipped == [] and packed.num_samples == len(images)
    seen: dict[int, int] = {}
    for i in range(len(packed)):
        info = plan_info(packed[i])
        seen.update(zip(info["rows"], info["lengths"]))
    assert sorted(seen) == list(range(len(images)))  # every sample loaded into its pack

    pre = Preprocessor(processor=proc)
    for row, (blobs, conversation) in enumerate(zip(images, messages)):
        pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in blobs]
        expected = _oracle(proc, conversation, pil)
        assert seen[row] == expected, row
        assert pre.forecast(conversation, [im.size for im in pil])[0] == expected, row
