"""Per-token extras (loss weights, masks) are packed like ``input_ids`` and keep their dtype (issue 18 e)."""

from __future__ import annotations

import pytest
import torch

from vlm_pack.collate.collator import PackingCollator
from vlm_pack.offline import build_tokenizer
from vlm_pack.processing import process_sample


@pytest.fixture(scope="module")
def samples():
    tok = build_tokenizer("qwen2_vl")
    texts = ["a red dog on the beach", "two cars", "the sky is blue today and the tree is green"]
    out = []
    for i, text in enumerate(texts):
        sample = process_sample([], text, tokenizer=tok, family="qwen2_vl")
        n = sample["input_ids"].shape[-1]
        sample["loss_weight"] = torch.linspace(0.25, 1.0, n) * (i + 1)  # float32, e.g. a length-normalised loss
        sample["keep"] = torch.arange(n) % 3 != 0  # bool, e.g. a mask of the tokens to train on
        if i != 1:  # one sample without it: its tokens get 0
            sample["weight64"] = torch.full((n,), 0.5, dtype=torch.float64)
        out.append(sample)
    return tok, out


def test_float_and_bool_token_extras_are_packed_like_input_ids_with_their_dtype(samples):
    tok, given = samples
    batch = PackingCollator(64, tokenizer=tok, family="qwen2_vl", pad_to_multiple_of=4).collate(given)
    assert batch.extra["loss_weight"].dtype == torch.float32
    assert batch.extra["keep"].dtype == torch.bool
    assert batch.extra["weight64"].dtype == torch.float64
    assert batch.extra["keep"].shape == batch.input_ids.shape == batch.extra["loss_weight"].shape
    ids = batch.input_ids.flatten()
    flat = {k: v.flatten() for k, v in batch.extra.items()}
    covered = torch.zeros_like(ids, dtype=torch.bool)
    for packed, index in enumerate(batch.sample_index.tolist()):
        start, n = int(batch.cu_seqlens_padded[packed]), int(batch.seq_lens[packed])
        span = slice(start, start + n)
        assert torch.equal(ids[span], given[index]["input_ids"].flatten())  # the sample sits here
        assert torch.equal(flat["loss_weight"][span], given[index]["loss_weight"])  # values kept exactly
        assert torch.equal(flat["keep"][span], given[index]["keep"])
        expected = given[index].get("weight64", torch.zeros(n, dtype=torch.float64))
        assert torch.equal(flat["weight64"][span], expected)
        covered[span] = True
    # padding carries 0 / False: it is never weighted or trained on
    assert not flat["loss_weight"][~covered].any() and not flat["keep"][~covered].any()


def test_a_tensor_that_is_not_one_per_token_is_kept_whole(samples):
    tok, given = samples
    broken = [dict(given[0]), given[1]]
    broken[0]["loss_weight"] = torch.ones(3)  # not one per token: a per-sample tensor, kept whole
    batch = PackingCollator(64, tokenizer=tok, family="qwen2_vl").collate(broken)
    assert batch.extra["loss_weight"].shape == (3,)
