"""Plans and rows agree under padding: with ``pad_to_multiple_of`` every planner (the streaming packer of
``PackedWebDataset``, the plan of ``PackedMapDataset``) plans on the spans the collator pads samples to, and a
planned bin becomes exactly one row, or the collator raises naming its samples.

The samples are text-only conversations of chosen lengths at the capacity edge: 30 + 33 + 36 = 99 tokens fit a
row of 100, but padded to multiples of 4 (``pad_multiple_for(cp=2)``) they take 32 + 36 + 36 = 104.
"""

from __future__ import annotations

import warnings
from collections import Counter

import datasets
import pytest

from vlm_pack import (
    PackedDataLoader,
    PackedWebDataset,
    PackingCollator,
    PackingConfig,
    Preprocessor,
    pad_multiple_for,
)
from vlm_pack.data import write_shards
from vlm_pack.data.map_style import PackedMapDataset, plan_info
from vlm_pack.data.stats import BadSampleWarning
from vlm_pack.offline import build_tokenizer, image_processor

CAPACITY = 100
MULTIPLE = pad_multiple_for(cp=2)
LENGTHS = [30, 33, 36, 97, 29, 34, 31, 66, 35, 30, 33, 36, 61, 37, 98, 32, 33, 35, 36, 30]


@pytest.fixture(scope="module")
def parts():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


def _conversation(pre: Preprocessor, tokens: int) -> list[dict]:
    """A text-only conversation that is exactly ``tokens`` tokens long once rendered (searched, not assumed)."""
    for n in range(tokens):
        answer = " ".join(["a"] * n)
        conv = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]}]
        if pre.forecast(conv, [])[0] == tokens:
            return conv
    raise AssertionError(f"no text of {tokens} tokens")


@pytest.fixture(scope="module")
def conversations(parts):
    pre = Preprocessor(*parts, family="qwen2_vl")
    return [_conversation(pre, n) for n in LENGTHS]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, conversations):
    root = tmp_path_factory.mktemp("edge")
    records = [{"key": f"edge-{i:03d}", "images": [], "conversation": c} for i, c in enumerate(conversations)]
    return write_shards(records, str(root / "part-%05d.tar"), maxcount=7)


def _check_rows(batches, lengths_of) -> Counter:
    """Each batch is one row of ``CAPACITY`` with spans of multiples of ``MULTIPLE``; the samples it holds."""
    seen: Counter = Counter()
    for batch in batches:
        assert batch.num_rows == 1 and batch.row_length == CAPACITY
        assert (batch.cu_seqlens_padded.diff() % MULTIPLE == 0).all()
        assert batch.seq_lens.tolist() == [lengths_of(k) for k in batch.metadata["__key__"]]
        seen.update(batch.metadata["__key__"])
    return seen


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_stream_epoch_with_padding_gives_every_sample_once_one_row_per_bin(parts, shards, workers):
    tok, ip = parts
    ds = PackedWebDataset(shards, Preprocessor(tok, ip, family="qwen2_vl"), capacity=CAPACITY, pad_to_multiple_of=MULTIPLE, buffer_size=8, min_fill_ratio=1.0)
    batches = list(PackedDataLoader(ds, num_workers=workers))
    seen = _check_rows(batches, lambda key: LENGTHS[int(key.split("-")[1])])
    assert seen == Counter(f"edge-{i:03d}" for i in range(len(LENGTHS)))


def test_stream_bin_that_the_collator_would_split_raises_naming_its_samples(parts, shards):
    """A collator set to hold fewer samples per row than the packer plans refuses the bin (it used to split it
    into two rows silently)."""
    tok, ip = parts
    collator = PackingCollator(CAPACITY, tokenizer=tok, family="qwen2_vl", pad_to_multiple_of=MULTIPLE,
                               max_samples_per_bin=1, max_rows=1)
    ds = PackedWebDataset(shards, Preprocessor(tok, ip, family="qwen2_vl"), capacity=CAPACITY, pad_to_multiple_of=MULTIPLE, collator=collator)
    with pytest.raises(ValueError, match=r"\(key 'edge-\d+'\).* need \d rows of capacity 100 and at most 1 samples"):
        list(PackedDataLoader(ds))


@pytest.fixture(scope="module")
def table(conversations):
    return datasets.Dataset.from_list([{"messages": c} for c in conversations])


def test_map_style_epoch_with_padding_gives_every_row_once_one_row_per_pack(parts, table):
    tok, ip = parts
    config = PackingConfig(capacity=CAPACITY, pad_to_multiple_of=MULTIPLE)
    packed = PackedMapDataset(table, Preprocessor(tok, ip, family="qwen2_vl"), config, world_size=2, cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BadSampleWarning)  # nothing left out of a pack at load time
        batches = [packed[i] for i in range(len(packed))]
    rows = _check_rows(batches, lambda key: LENGTHS[int(key)])
    assert rows == Counter(str(i) for i in range(len(LENGTHS))) and packed.skipped == []
    assert sorted(r for b in batches for r in plan_info(b)["rows"]) == list(range(len(LENGTHS)))


def test_map_style_collator_cannot_disagree_with_the_plan_on_a_packing_setting(parts, table):
    """A packing setting given to the collator only (where the plan would not see it) is refused, naming the
    dataset keyword that gives it to both."""
    tok, ip = parts
    config = PackingConfig(capacity=CAPACITY, pad_to_multiple_of=MULTIPLE)
    for name in ("max_samples_per_bin", "pad_to_multiple_of"):
        with pytest.raises(TypeError, match=rf"pass {name}= to PackedMapDataset"):
            PackedMapDataset(table, Preprocessor(tok, ip, family="qwen2_vl"), config, cache=False, collator_kwargs={name: 1})
