"""Shards that end wrong: an empty tar is reported, and a half-written tar keeps every sample it holds whole and
names the one it cuts. Real WebDataset shards written here (``write_shards``), real images (Pillow), cut with
the byte offsets the tar itself gives; read through a ``PackedDataLoader`` epoch and the CLI's forecast.
"""

from __future__ import annotations

import io
import tarfile
import warnings
from pathlib import Path

import pytest
from PIL import Image

from vlm_pack import Preprocessor, forecast_sources
from vlm_pack.data import PackedDataLoader, PackedWebDataset, write_shards
from vlm_pack.data.stats import BadSampleWarning
from vlm_pack.offline import build_tokenizer, image_processor


def _png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((56, 56), 30 + i).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    return Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl"))


@pytest.fixture
def shards(tmp_path) -> list[str]:
    """Two shards of 4 samples each (``a0``..``a3``, ``b0``..``b3``)."""
    out = []
    for name in "ab":
        records = [{"key": f"{name}{i}", "images": [_png(i)], "caption": f"picture {name}{i}"} for i in range(4)]
        out += write_shards(records, tmp_path / name, maxcount=100)
    return out


def _epoch(urls: list[str], pre: Preprocessor) -> tuple[PackedWebDataset, list[str], list[str]]:
    ds = PackedWebDataset(urls, pre, capacity=512)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BadSampleWarning)
        keys = sorted(k for batch in PackedDataLoader(ds, num_workers=0) for k in batch.metadata["__key__"])
    return ds, keys, [str(w.message) for w in caught if issubclass(w.category, BadSampleWarning)]


def test_an_empty_shard_is_reported(tmp_path, shards, pre):
    empty = tmp_path / "empty.tar"
    tarfile.open(empty, "w").close()  # a valid tar with no member: what an interrupted writer leaves
    ds, keys, warned = _epoch([shards[0], str(empty), shards[1]], pre)
    assert keys == [f"{n}{i}" for n in "ab" for i in range(4)]
    assert ds.stats.reasons == {"empty_shard": 1} and ds.stats.samples_bad == 0
    assert [b.shard for b in ds.stats.bad] == [str(empty)]
    assert any("empty_shard" in w and str(empty) in w for w in warned)
    # the forecast (vlm-pack analyze / pack) lists it with the records left out
    table = forecast_sources([shards[0], str(empty)], preprocessor=pre, progress=False)
    assert len(table) == 4 and [(where, reason) for _, where, reason in table.invalid] == [
        (str(empty), f"{empty}: the shard holds no sample.")
    ]


def _cut_inside(url: str, member: str, out: Path) -> Path:
    """``url``'s bytes up to the middle of ``member``'s data: a tar whose writer stopped there."""
    with tarfile.open(url) as tar:
        info = tar.getmember(member)
    out.write_bytes(Path(url).read_bytes()[: info.offset_data + info.size // 2])
    return out


@pytest.mark.parametrize("member", ["a2.png", "a2.txt"])
def test_a_half_written_tar_keeps_every_whole_sample_and_names_the_one_it_cuts(tmp_path, shards, pre, member):
    cut = _cut_inside(shards[0], member, tmp_path / "half.tar")
    ds, keys, warned = _epoch([str(cut), shards[1]], pre)
    # a0 and a1, whole before the cut, are packed (a1 was lost unnamed before); a2 is named; a3 was never written
    assert keys == ["a0", "a1", "b0", "b1", "b2", "b3"]
    (bad,) = ds.stats.bad
    assert (bad.shard, bad.key, bad.reason) == (str(cut), "a2", "unreadable_shard")
    assert "sample 'a2' is cut short and left out" in bad.detail
    assert any("'a2'" in w for w in warned)
