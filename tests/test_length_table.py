"""The forecast table at scale: keys and sources front-coded (``Strings``), read like lists.

A 100 M-sample forecast holds two strings a sample; as Python objects in lists they cost more than the rest of
the table together (~175 bytes a sample). These tests hold the table to bytes per sample, and check that the
compact columns behave like the lists every consumer indexed before: indexing, slicing, iteration, equality,
pickling (a forecast's chunks travel between processes and Ray workers), and the parquet round trip.
"""

from __future__ import annotations

import pickle
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlm_pack.data.forecast import LengthTable
from vlm_pack.data.lengths import read_lengths, write_lengths
from vlm_pack.data.strings import Strings


def _table(keys: list[str], sources: list[str]) -> LengthTable:
    n = len(keys)
    ones = np.ones(n, np.int64)
    return LengthTable(keys, sources, 10 * ones, 4 * ones, 16 * ones, np.arange(n + 1, dtype=np.int64),
                       4 * ones, 2 * ones, index=np.arange(n, dtype=np.int64))


KEYS = ["s0", "", "Straße-7", "猫-12", "emoji-\U0001f600", "k" * 300]


def test_keys_and_sources_read_like_the_lists_they_replace():
    table = _table(KEYS, [f"train.parquet:{i}" for i in range(len(KEYS))])
    keys = table.keys
    assert keys == KEYS and list(keys) == KEYS and len(keys) == len(KEYS)
    assert keys[3] == "猫-12" and keys[-1] == "k" * 300 and keys[np.int64(2)] == "Straße-7"
    assert keys[1:4] == KEYS[1:4] and keys[::2] == KEYS[::2] and keys.index("猫-12") == 3 and "s0" in keys
    assert table.sources[5] == "train.parquet:5"
    assert pickle.loads(pickle.dumps(table.keys)) == KEYS
    assert Strings.concat([keys[:2], KEYS[2:]]) == keys
    with pytest.raises(IndexError):
        keys[len(KEYS)]
    with pytest.raises(TypeError, match="str only"):
        Strings(["a", 3])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(alphabet=st.sampled_from(["a", "b", "1", "\x00", "é", "猫", "\ud800"]), max_size=6), max_size=70),
    st.booleans(),
    st.data(),
)
def test_strings_equal_the_list_they_were_built_from(items, ordered, data):
    """Front coding (each item stored as the bytes after what it shares with the one before) loses nothing:
    any item, slice, concatenation or pickle gives back the list's strings, NULs, surrogates and all."""
    items = sorted(items) if ordered else items
    strings = Strings(items)
    assert list(strings) == items and [strings[i] for i in range(len(items))] == items
    a = data.draw(st.integers(0, len(items)))
    b = data.draw(st.integers(a, len(items)))
    assert strings[a:b] == items[a:b] and strings[::3] == items[::3]
    joined = Strings.concat([Strings(items[:a]), items[a:b], Strings(items[b:])])
    assert joined == items and [joined[i] for i in range(len(items))] == items
    assert pickle.loads(pickle.dumps(strings)) == items


def test_a_lengths_file_round_trips_the_strings_exactly(tmp_path):
    table = _table(KEYS, [f"shard-{i}.tar" for i in range(len(KEYS))])
    back = read_lengths(write_lengths(table, tmp_path / "lengths.parquet"))
    assert back.keys == table.keys and back.sources == table.sources
    np.testing.assert_array_equal(back.lengths, table.lengths)


def test_a_forecast_table_costs_bytes_per_sample_not_objects(tmp_path):
    """What a forecast leaves behind is the table: int64 arrays and one buffer per string column. Before,
    its keys and sources were lists of str (and every chunk's result lists of Python ints until the end)."""
    import json

    from vlm_pack.data.forecast import forecast_sources
    from vlm_pack.offline import build_tokenizer, image_processor
    from vlm_pack.vision import vision_spec_from_processor

    n = 8_000
    path = tmp_path / "captions.jsonl"
    words = ["a", "dog", "on", "the", "street", "cat", "sign"]
    path.write_text("".join(json.dumps({"key": f"train-00042-{i:06d}", "caption": " ".join(words[: 2 + i % 5])}) + "\n"
                            for i in range(n)))
    tok = build_tokenizer("qwen2_vl")
    spec = vision_spec_from_processor(image_processor("qwen2_vl"))
    warm = tmp_path / "warm.jsonl"  # the tokenizer's word cache and the imports, before measuring
    warm.write_text("".join(path.read_text().splitlines(keepends=True)[:50]))
    forecast_sources(warm, tokenizer=tok, spec=spec, progress=False)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = forecast_sources(path, tokenizer=tok, spec=spec, progress=False, chunk_rows=1024)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(table) == n and table.keys[7] == "train-00042-000007" and table.sources[7].endswith(":8")
    # 7 int64 arrays [N] (a text-only table has no images: 56 B), two front-coded string columns (~15 B
    # here): ~72 B a sample; as lists of str and ints it was 257 B
    assert held <= 100 * n, held / n  # measured: 72
    assert table.nbytes <= held
