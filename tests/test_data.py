"""WebDataset shards -> packed batches: writer, streaming pipeline, workers, bad data and resume."""

from __future__ import annotations

import io
import tarfile
import warnings
from pathlib import Path

import pytest
import webdataset as wds
from PIL import Image

from vlm_pack.data.shards import image_fields, parse_text, write_shards, write_shards_from_folder


def _encoded(size: tuple[int, int], fmt: str, seed: int = 0) -> bytes:
    image = Image.effect_noise(size, 40 + seed).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_write_shards_layout_and_round_trip(tmp_path):
    jpg, png, webp = _encoded((40, 30), "JPEG"), _encoded((17, 23), "PNG"), _encoded((64, 48), "WEBP")
    conversation = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "compare"}],
        },
        {"role": "assistant", "content": "the same"},
    ]
    records = [
        {"key": "one", "images": jpg, "caption": "noise"},
        {"images": [png, webp], "conversation": conversation, "meta": {"source": "test"}},
        ((jpg[:64], "jpg"), "truncated on purpose"),  # corrupt bytes are stored as given
    ]
    paths = write_shards(records, tmp_path / "out", maxcount=2)
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["shard-000000.tar", "shard-000001.tar"]
    with tarfile.open(paths[0]) as tar:
        names = tar.getnames()
    assert names == [
        "one.jpg",
        "one.txt",
        "000000001.0.png",
        "000000001.1.webp",
        "000000001.json",
    ]
    # identical input -> byte-identical shards (fixed mtime)
    again = write_shards(records, str(tmp_path / "again" / "s-%03d.tar"), maxcount=2)
    assert [Path(a).read_bytes() for a in again] == [Path(p).read_bytes() for p in paths]

    samples = list(wds.WebDataset(paths, shardshuffle=False))
    assert [s["__key__"] for s in samples] == ["one", "000000001", "000000002"]
    assert image_fields(samples[1]) == ["0.png", "1.webp"]
    assert samples[1]["0.png"] == png and samples[1]["1.webp"] == webp
    assert parse_text(samples[0]) == "noise"
    assert parse_text(samples[1]) == conversation
    assert samples[2]["jpg"] == jpg[:64]


def test_write_shards_rejects_bad_records(tmp_path):
    with pytest.raises(ValueError, match="record 1: duplicate key 'a'"):
        write_shards([{"key": "a", "caption": "x"}, {"key": "a", "caption": "y"}], tmp_path / "d")
    with pytest.raises(ValueError, match=r"key 'a.b'.*without '.'"):
        write_shards([{"key": "a.b", "caption": "x"}], tmp_path / "e")
    with pytest.raises(ValueError, match="record 0, image 0: cannot tell the format"):
        write_shards([{"images": b"not an image", "caption": "x"}], tmp_path / "f")
    with pytest.raises(ValueError, match="no records"):
        write_shards([], tmp_path / "g")


def test_write_shards_from_folder(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "dog.jpg").write_bytes(_encoded((30, 20), "JPEG"))
    (src / "dog.txt").write_text("a dog")
    (src / "sub" / "a.png").write_bytes(_encoded((10, 12), "PNG"))
    (src / "sub" / "b.webp").write_bytes(_encoded((14, 9), "WEBP"))
    (src / "sub" / "pair.json").write_text(
        '{"images": ["a.png", "b.webp"], "conversations": [{"from": "human", "value": "<image>\\n<image>\\nSame?"},'
        ' {"from": "gpt", "value": "No."}]}'
    )
    (src / "lonely.png").write_bytes(_encoded((8, 8), "PNG"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = write_shards_from_folder(src, tmp_path / "out")
    assert any("lonely.png" in str(w.message) for w in caught)
    samples = {s["__key__"]: s for s in wds.WebDataset(paths, shardshuffle=False)}
    assert sorted(samples) == ["dog", "sub/pair"]
    assert parse_text(samples["dog"]) == "a dog"
    assert image_fields(samples["sub/pair"]) == ["0.png", "1.webp"]
    assert parse_text(samples["sub/pair"]) == [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "No."}]},
    ]
