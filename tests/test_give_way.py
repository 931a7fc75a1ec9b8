"""No single sample stops an epoch: a ``PackedMapDataset`` pack none of whose samples loads gives way to the
rank's next pack, reported, every rank keeping its steps and every sample accounted for once.

The issue's case, made here: a long sample alone in its pack whose JPEG is cut short after its header (a
header-only plan lets it through, as documented); two data-parallel ranks; a real ``datasets.Dataset`` of real
images (Pillow), the real offline tokenizer and image processor.
"""

from __future__ import annotations

import io
import warnings

import datasets
import pytest
import torch
from PIL import Image

from vlm_pack import PackingConfig, Preprocessor
from vlm_pack.data.map_style import PackedMapDataset, PackedSampler, plan_info
from vlm_pack.data.stats import BadSampleWarning
from vlm_pack.offline import build_tokenizer, image_processor

CAPACITY, WORLD = 400, 2  # the long sample (379 tokens) leaves room for no other (24)


def _jpeg(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="JPEG")
    return buf.getvalue()


def _messages(text: str, images: int) -> list[dict]:
    user = [{"type": "image", "text": None}] * images + [{"type": "text", "text": text}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]


@pytest.fixture(scope="module")
def data() -> tuple[datasets.Dataset, int]:
    """13 samples: 12 short ones with a good JPEG, and one long one whose JPEG is cut after its header."""
    images, texts = [], []
    for i in range(12):
        images.append([_jpeg(i)])
        texts.append(f"what is in picture {i}?")
    cut = _jpeg(99)
    images.insert(5, [cut[: len(cut) // 2]])
    texts.insert(5, "describe this long picture in words " * 30)  # ~300 tokens: alone in its pack
    columns = {"images": images, "messages": [_messages(t, 1) for t in texts]}
    ds = datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image(decode=False)))
    return ds, 5


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    return Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl"))


def _rank_epoch(ds: PackedMapDataset) -> list[dict]:
    sampler = PackedSampler(ds)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        return [plan_info(sampler.observe(batch)) for batch in loader]


@pytest.mark.parametrize("shuffle_seed", [None, 3])
def test_an_all_bad_pack_gives_way_on_two_ranks_each_sample_once(data, pre, shuffle_seed):
    ds, bad = data
    config = PackingConfig(capacity=CAPACITY, shuffle_seed=shuffle_seed)
    ranks = [
        PackedMapDataset(ds, pre, config, world_size=WORLD, rank=r, cache=None, max_samples_per_bin=4)
        for r in range(WORLD)
    ]
    alone = [b for b in range(ranks[0].plan.num_bins) if ranks[0].rows_of(b).tolist() == [bad]]
    assert alone, "the long sample is alone in its pack"
    infos = [_rank_epoch(r) for r in ranks]

    # every rank yields its steps, in lock-step; the epoch does not stop
    assert [len(i) for i in infos] == [ranks[0].steps] * WORLD
    stand_ins = [info for rank in infos for info in rank if info["stand_in_for"] is not None]
    assert [info["stand_in_for"] for info in stand_ins] == alone
    (stand_in,) = stand_ins
    assert stand_in["left_out"] == [[bad, "decode_error"]] and stand_in["rows"]
    # the pack standing in is the same rank's (the step's balance across ranks is kept) and another one
    rank_bins = ranks[0].plan.rank_bins[stand_in["rank"]].tolist()
    assert stand_in["bin"] in rank_bins and stand_in["bin"] != stand_in["stand_in_for"]

    # exactly once: the rows of the items that are no stand-in, plus every row left out, are each row once
    packed = [row for rank in infos for info in rank if info["stand_in_for"] is None for row in info["rows"]]
    left = [row for rank in infos for info in rank for row, _ in info["left_out"]]
    assert sorted(packed + left) == list(range(len(ds)))
    # ... and the one left out is reported in the rank's skipped
    rank = stand_in["rank"]
    assert [(key, reason) for key, _, reason in ranks[rank].skipped] == [(str(bad), "decode_error")]
    assert ranks[1 - rank].skipped == []


def test_a_rank_whose_every_pack_fails_still_raises(pre):
    cut = _jpeg(7)
    images = [[cut[: len(cut) // 2]] for _ in range(4)]
    columns = {"images": images, "messages": [_messages(f"q {i}", 1) for i in range(4)]}
    ds = datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image(decode=False)))
    packed = PackedMapDataset(ds, pre, capacity=CAPACITY, cache=None, max_samples_per_bin=1)
    from vlm_pack.failures import FailureBudgetError

    with pytest.raises(FailureBudgetError, match="every pack of the epoch"):
        _rank_epoch(packed)
