"""One forecast (issue 32): every planner, the Energon encoder and ``forecast_length`` forecast through
``vlm_pack.processing.length.forecast_rows``, and the collator and the Energon encoder take a processed
sample's expanded length from ``vlm_pack.processing.length.expanded_length``.

Each test changes the one implementation (a monkeypatch that adds a few tokens) and sees every caller change
with it: a caller with an arithmetic of its own would keep the old number. Before the change, every caller
agrees with the length the processor's own output has.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
from PIL import Image

from vlm_pack import Preprocessor
from vlm_pack.data import forecast_sources, stream_tar_samples, write_shards
from vlm_pack.demo import demo_records
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.processing import forecast_length
from vlm_pack.processing import length as one_forecast

SHIFT = 7


@pytest.fixture(scope="module")
def parts():
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 50176})
    return tok, ip


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """The demo records in one shard, and the first one with two or more images (its key, record, crude sample)."""
    records = demo_records(24)
    path = tmp_path_factory.mktemp("one_forecast") / "part-%05d.tar"
    write_shards(records, str(path), maxcount=100)
    url = str(path).replace("%05d", "00000")
    record = next(r for r in records if len(r["images"]) >= 2)
    crude = next(s for s in stream_tar_samples(url) if s["__key__"] == record["key"])
    return url, record, crude


def _shifted(original):
    def spy(rows, **options):
        out = original(rows, **options)
        return [r if isinstance(r, Exception) else dataclasses.replace(r, length=r.length + SHIFT) for r in out]

    return spy


def _forecasts(pre, url, record):
    """The record's forecast by each planner's way of asking for one."""
    sizes = _sizes(record)
    conversation, key = record["conversation"], record["key"]
    table = forecast_sources(url, preprocessor=pre, progress=False)
    by_length = forecast_length(
        conversation, sizes, tokenizer=pre.tokenizer, image_processor=pre.image_processor, family=pre.family
    )
    return {
        "Preprocessor.forecast": pre.forecast(conversation, sizes, key)[0],
        "Preprocessor.forecast_prompt": pre.forecast_prompt(conversation, sizes, key)[0],
        "forecast_length": by_length[0],
        "forecast_sources": int(table.lengths[table.keys.index(key)]),
    }


@pytest.mark.parametrize("layout", ["expanded", "collapsed"])
def test_every_planner_forecasts_through_the_one_forecast(parts, shard, monkeypatch, layout):
    url, record, _ = shard
    pre = Preprocessor(*parts, family="qwen2_vl", layout=layout)
    before = _forecasts(pre, url, record)
    processed = pre.process([data for data, _ in record["images"]], record["conversation"], record["key"])
    expanded = one_forecast.expanded_length(len(processed["input_ids"]), processed["tokens_per_image"], layout)
    assert set(before.values()) == {expanded}, before
    if layout == "collapsed":  # the sample's own ids are shorter: the expansion is counted, not read off
        assert len(processed["input_ids"]) < expanded
    monkeypatch.setattr(one_forecast, "forecast_rows", _shifted(one_forecast.forecast_rows))
    after = _forecasts(pre, url, record)
    assert after == {name: n + SHIFT for name, n in before.items()}


@pytest.mark.parametrize("layout", ["expanded", "collapsed"])
def test_the_collator_reads_the_one_expanded_length(parts, shard, monkeypatch, layout):
    _, record, _ = shard
    pre = Preprocessor(*parts, family="qwen2_vl", layout=layout)
    processed = pre.process([data for data, _ in record["images"]], record["conversation"], record["key"])
    collator = pre.collator(8192)
    before = collator._normalise(0, processed).expanded_len
    assert before == pre.forecast(record["conversation"], _sizes(record), record["key"])[0]
    original = one_forecast.expanded_length
    monkeypatch.setattr(one_forecast, "expanded_length", lambda *a: original(*a) + SHIFT)
    assert collator._normalise(0, processed).expanded_len == before + SHIFT


def _sizes(record):
    return [Image.open(io.BytesIO(data)).size for data, _ in record["images"]]


@pytest.mark.parametrize("layout", ["expanded", "collapsed"])
def test_the_energon_encoder_forecasts_and_checks_through_the_one_forecast(parts, shard, monkeypatch, layout):
    pytest.importorskip("megatron.energon", reason="needs the [energon] extra")
    from vlm_pack.integrations.energon import VLMPackingTaskEncoder

    _, record, crude = shard
    pre = Preprocessor(*parts, family="qwen2_vl", layout=layout)
    encoder = VLMPackingTaskEncoder(pre, 8192)
    cooked = encoder.cook_sample(crude)
    assert cooked.failure is None and cooked.length == pre.forecast(record["conversation"], _sizes(record))[0]
    assert isinstance(encoder._process(cooked), dict)  # its processed length is its forecast
    with monkeypatch.context() as patch:
        patch.setattr(one_forecast, "forecast_rows", _shifted(one_forecast.forecast_rows))
        assert encoder.cook_sample(crude).length == cooked.length + SHIFT
    original = one_forecast.expanded_length
    monkeypatch.setattr(one_forecast, "expanded_length", lambda *a: original(*a) + SHIFT)
    checked = encoder._process(cooked)  # the processed length, read through the one expanded_length
    assert isinstance(checked, str) and checked.startswith("forecast_mismatch"), checked
    assert f"processed length {cooked.length + SHIFT}" in checked  # failures.forecast_mismatch
