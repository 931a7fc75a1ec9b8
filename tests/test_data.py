"""WebDataset shards -> packed batches: writer, streaming pipeline, workers, bad data and resume."""

from __future__ import annotations

import io
import os
import pickle
import re
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
    assert parse_text(samples["sub/pair"]) == [  # LLaVA turns as role/content, the text as written
        {"role": "user", "content": "<image>\n<image>\nSame?"},
        {"role": "assistant", "content": "No."},
    ]


# -- reading shards back: one reader for the analysis (lazy) and the pipeline (streaming) ----------------


class _CountingFile(io.FileIO):
    """A real file that counts the bytes read through it."""

    n_read = 0

    def readinto(self, b):  # type: ignore[override]
        n = super().readinto(b)
        self.n_read += n or 0
        return n


def test_lazy_and_streaming_readers_agree_and_lazy_reads_only_headers(tmp_path, write_tar):
    from PIL import ImageOps

    from vlm_pack.data.reader import lazy_tar_samples, read_header, stream_tar_samples
    from vlm_pack.data.shards import SampleError

    big = _encoded((500, 400), "PNG")  # noise: ~600 KB that the lazy reader must not read
    conv = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "two"},
    ]
    rotated = _exif_rotated_jpeg((150, 60))
    shard = write_tar(
        tmp_path / "s.tar",
        [
            ("__index__/a.json", b"{}"),  # webdataset metadata folder: skipped by both readers
            ("a.jpg", rotated),
            ("a.TXT", b"a caption"),
            ("dir/b.1.webp", _encoded((64, 48), "WEBP")),
            ("dir/b.0.png", big),
            ("dir/b.json", json.dumps({"messages": conv}).encode()),
            ("c.png", big),  # no text
            ("d.json", b"{not json"),
            ("d.jpg", _encoded((8, 8), "JPEG")),
            ("e.png", b"\x89PNG\r\n\x1a\n-truncated"),
            ("e.txt", b"x"),
        ],
    )
    streamed = list(stream_tar_samples(str(shard)))
    with _CountingFile(shard) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        lazy = list(lazy_tar_samples(tar, str(shard)))
        assert (
            [s["__key__"] for s in lazy] == [s["__key__"] for s in streamed] == ["a", "dir/b", "c", "d", "e"]
        )
        assert [sorted(s) for s in lazy] == [sorted(s) for s in streamed]
        assert lazy[0]["txt"] == streamed[0]["txt"] == b"a caption"  # suffixes lower-cased by both
        assert not isinstance(lazy[1]["0.png"], bytes)  # an unread file object

        headers = [read_header(s) for s in (lazy[0], streamed[0], lazy[1], streamed[1])]
        assert headers[0] == headers[1] == ("a caption", ["jpg"], [(60, 150)], [], [])  # EXIF orientation applied
        assert headers[0].image_sizes[0] == ImageOps.exif_transpose(Image.open(io.BytesIO(rotated))).size
        assert headers[2] == headers[3] == (conv, ["0.png", "1.webp"], [(500, 400), (64, 48)], [], [])
        assert f.n_read < len(big) // 3  # headers only: neither big image was read
        assert lazy[1]["0.png"].read() == big  # the header read left the member at its start
        for i, (reason, text) in zip(
            (2, 3, 4),
            [
                ("missing_text", "missing text"),
                ("bad_text", "json field is not valid JSON"),
                ("corrupt_image", "image_size(e.png)"),
            ],
        ):
            for sample in (lazy[i], streamed[i]):
                with pytest.raises(SampleError, match=re.escape(text)) as exc:
                    read_header(sample)
                assert exc.value.reason == reason and isinstance(exc.value, ValueError)
        assert pickle.loads(pickle.dumps(exc.value)).reason == "corrupt_image"

    dup = write_tar(tmp_path / "dup.tar", [("k.txt", b"a"), ("k.txt", b"b")])
    with pytest.raises(ValueError, match="duplicate file name"):
        list(stream_tar_samples(str(dup)))
    with tarfile.open(dup) as tar, pytest.raises(ValueError, match="duplicate file name"):
        list(lazy_tar_samples(tar, str(dup)))


# -- streaming pipeline --------------------------------------------------------------------------------

import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402

import torch  # noqa: E402

from vlm_pack.data.pipeline import (  # noqa: E402
    BadSampleWarning,
    PackedDataLoader,
    PackedWebDataset,
    StreamEnd,
    stream_info,
)
from vlm_pack.failures import FailureBudgetError, SampleError  # noqa: E402
from vlm_pack.offline import build_tokenizer, image_processor  # noqa: E402
from vlm_pack.preprocessor import Preprocessor  # noqa: E402

CAPACITY = 256
BAD_REASONS = {
    "corrupt_image": "bad_header",
    "decode_error": "bad_pixels",
    "missing_text": "bad_notext",
    "placeholder_mismatch": "bad_placeholders",
    "bad_text": "bad_json",
    "too_long": "bad_long",
    "image_rejected": "bad_aspect",
}


def _exif_rotated_jpeg(size: tuple[int, int]) -> bytes:
    image = Image.effect_noise(size, 60).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: decoded as height x width
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif)
    return buf.getvalue()


def _good_records(n: int, prefix: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        n_images = rng.choice([0, 1, 1, 1, 2])
        images = [
            _encoded((rng.randint(20, 260), rng.randint(20, 260)), rng.choice(["JPEG", "PNG", "WEBP"]), i + j)
            for j in range(n_images)
        ]
        words = " ".join(
            rng.choice(["red", "dog", "sky", "the", "car", "two"]) for _ in range(rng.randint(3, 40))
        )
        if i % 2:
            record = {"caption": words}
        else:
            marks = [{"type": "image"}] * n_images
            record = {
                "conversation": [
                    {"role": "system", "content": "be brief"},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "look:"}, *marks, {"type": "text", "text": "?"}],
                    },
                    {"role": "assistant", "content": words},
                ]
            }
        records.append({"key": f"{prefix}{i:03d}", "images": images, **record})
    if n > 5:
        records[3]["images"] = [_exif_rotated_jpeg((150, 60))]  # decoded as 60 x 150: the forecast must know
        records[5]["images"] = [_encoded((12, 12), "PNG")]  # below min_pixels: upscaled
    return records


def _bad_records() -> list[dict]:
    jpg = _encoded((120, 90), "JPEG")
    conv = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "compare"}],
        },
        {"role": "assistant", "content": "same"},
    ]
    return [
        {"key": "bad_header", "images": (b"\xff\xd8\xff\xe0" + b"\x00" * 7, "jpg"), "caption": "x"},
        {"key": "bad_pixels", "images": (jpg[: len(jpg) // 2], "jpg"), "caption": "header fine, pixels cut"},
        {"key": "bad_notext", "images": jpg},
        {"key": "bad_placeholders", "images": jpg, "conversation": conv},
        {"key": "bad_json", "images": jpg, "meta": {"note": "no text"}},
        {"key": "bad_long", "caption": "dog " * 2000},
        {"key": "bad_aspect", "images": _encoded((402, 2), "PNG"), "caption": "a line"},
    ]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    good = _good_records(30, "s", seed=0)
    records = list(good)
    for j, bad in enumerate(_bad_records()):
        records.insert(4 * j + 2, bad)
    urls = write_shards(records, root / "main", maxcount=5)
    # An unreadable shard, and a shard truncated inside its 4th sample's second member.
    (root / "garbage.tar").write_bytes(b"this is not a tar file" * 50)
    cut = write_shards(_good_records(4, "cut", seed=1), root / "cut")[0]
    with tarfile.open(cut) as tar:
        member = tar.getmember("cut003.txt")
    Path(cut).write_bytes(Path(cut).read_bytes()[: member.offset_data + 1])
    urls = [*urls[:2], str(root / "garbage.tar"), *urls[2:], cut]
    good_keys = sorted([r["key"] for r in good] + ["cut000", "cut001", "cut002"])
    return {"urls": urls, "good": good_keys, "n_read": len(good_keys) + len(BAD_REASONS)}


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


def _pipeline(corpus, qwen, **overrides) -> PackedWebDataset:
    tok, ip = qwen
    kwargs = dict(
        capacity=CAPACITY,
        oversized="skip",  # the corpus's too-long sample is counted as too_long
        shuffle_seed=3,
        shuffle_buffer=4,
        buffer_size=4,
        min_fill_ratio=0.9,  # keeps bins open longer: checkpoints catch samples in the packer
    )
    kwargs.update(overrides)
    return PackedWebDataset(corpus["urls"], Preprocessor(tok, ip), **kwargs)


def _summary(batch) -> tuple:
    """What identifies a pack: its stream, its samples in packed order and its tokens."""
    return (
        stream_info(batch)["snapshot"].stream,
        tuple(batch.metadata["__key__"]),
        tuple(batch.seq_lens.tolist()),
        batch.input_ids.sum().item(),
    )


def _run(loader, stop: int | None = None) -> list:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        for batch in loader:
            out.append(batch)
            if stop is not None and len(out) == stop:
                break
    return out


@pytest.fixture(scope="module")
def reference(corpus, qwen):
    """One uninterrupted epoch through 2 DataLoader workers."""
    ds = _pipeline(corpus, qwen)
    batches = _run(PackedDataLoader(ds, num_workers=2))
    return ds, batches


def test_two_workers_every_good_sample_in_exactly_one_pack(corpus, reference):
    ds, batches = reference
    keys = [k for b in batches for k in b.metadata["__key__"]]
    assert sorted(keys) == corpus["good"]  # each good sample once, no bad one
    assert {stream_info(b)["snapshot"].stream for b in batches} == {0, 1}  # both workers produced packs
    for b in batches:
        assert b.num_rows == 1 and b.input_ids.shape == (1, CAPACITY)
        assert int(b.seq_lens.sum()) <= CAPACITY
        assert b.cu_seqlens[-1].item() == int(b.seq_lens.sum())
        # The header-only forecast of each sample equals its length after real preprocessing.
        meta = stream_info(b)
        forecast = dict(zip((k for _, k in meta["samples"]), meta["forecast"]))
        assert [forecast[k] for k in b.metadata["__key__"]] == b.seq_lens.tolist()
        assert meta["lengths"] == meta["forecast"]
        n_image_tokens = int((b.input_ids == ds.preprocessor.tokenizer.image_token_id).sum())
        if b.image_grid_thw is None:  # a pack of text-only samples
            assert n_image_tokens == 0 and b.pixel_values is None
        else:
            assert (
                n_image_tokens == int(b.tokens_per_image.sum()) == int(b.image_grid_thw.prod(-1).sum()) // 4
            )
    assert ds.observe(batches[-1].to("cpu")) is not None  # the metadata survives .to(device)
    stats = ds.stats
    assert stats.reasons == {**dict.fromkeys(BAD_REASONS, 1), "unreadable_shard": 2}
    assert {(b.reason, b.key) for b in stats.bad} >= set(BAD_REASONS.items())
    assert stats.samples_bad == len(BAD_REASONS) and stats.forecast_mismatches == 0
    assert stats.samples_read == corpus["n_read"]
    assert stats.samples_packed == len(corpus["good"]) and stats.bins == len(batches)
    assert stats.tokens == sum(int(b.seq_lens.sum()) for b in batches)
    assert 0.5 < stats.fill_ratio <= 1.0


def test_bad_data_is_warned_with_shard_and_key_or_raised(corpus, qwen):
    ds = _pipeline(corpus, qwen, shuffle_seed=None)
    with pytest.warns(BadSampleWarning) as caught:
        keys = sorted(k for b in ds for k in b.metadata["__key__"])
    assert keys == corpus["good"]  # single process: same samples
    messages = [str(w.message) for w in caught if issubclass(w.category, BadSampleWarning)]
    for reason, key in BAD_REASONS.items():
        hit = [m for m in messages if f"key {key!r}" in m]
        assert len(hit) == 1 and reason in hit[0] and "main/shard-" in hit[0], (reason, hit)
    assert any("garbage.tar" in m and "unreadable_shard" in m for m in messages)
    assert any("cut/shard-000000.tar" in m and "unreadable_shard" in m and "cut002" in m for m in messages)

    strict = _pipeline(corpus, qwen, shuffle_seed=None, on_error="raise")
    with pytest.raises(
        ValueError, match=r"bad_text: key 'bad_header' in .*main/shard-000000.tar|corrupt_image"
    ):
        list(strict)


@pytest.mark.slow
def test_resume_after_interruption_gives_the_same_remaining_packs(corpus, qwen, reference):
    ref = [_summary(b) for b in reference[1]]
    # The state after k batches, as a checkpoint taken at that point would hold it (plain JSON data).
    ds = _pipeline(corpus, qwen)
    loader = PackedDataLoader(ds, num_workers=2)
    states = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        for _ in loader:
            states.append(json.loads(json.dumps(loader.state_dict())))
    assert len(states) == len(ref) >= 8
    held = {"shuffle": 0, "open": 0, "ready": 0}
    for k in range(1, len(ref), 2):
        for snap in states[k - 1]["progress"]["streams"]:
            held["shuffle"] += len(snap["shuffle"])
            held["open"] += sum(len(b["keys"]) for b in snap["packer"]["open"])
            held["ready"] += sum(len(keys) for keys in snap["ready"])
        resumed = _pipeline(corpus, qwen)
        resumed.load_state_dict(states[k - 1])
        tail = [_summary(b) for b in _run(PackedDataLoader(resumed, num_workers=2))]
        assert ref[:k] + tail == ref, k
        # stats continue from the checkpoint: the epoch's totals equal the uninterrupted run's
        assert resumed.stats.reasons == reference[0].stats.reasons
        assert resumed.stats.samples_read == corpus["n_read"]
    # the cuts caught samples in every kind of buffer, which resuming must read again
    assert min(held.values()) > 0, held

    # A real interruption: break out of the loop, checkpoint, resume in a new pipeline.
    first = _pipeline(corpus, qwen)
    loader = PackedDataLoader(first, num_workers=2)
    head = [_summary(b) for b in _run(loader, stop=2)]
    resumed = _pipeline(corpus, qwen)
    resumed.load_state_dict(loader.state_dict())
    assert head + [_summary(b) for b in _run(PackedDataLoader(resumed, num_workers=2))] == ref


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 3])
@pytest.mark.slow
def test_resume_with_another_worker_count_loses_and_repeats_nothing(corpus, qwen, workers):
    first = _pipeline(corpus, qwen)
    loader = PackedDataLoader(first, num_workers=2)
    head = _run(loader, stop=3)
    resumed = _pipeline(corpus, qwen)
    resumed.load_state_dict(loader.state_dict())
    tail = _run(PackedDataLoader(resumed, num_workers=workers))
    keys = [k for b in head + tail for k in b.metadata["__key__"]]
    assert sorted(keys) == corpus["good"]
    stats = resumed.stats
    assert stats.samples_read == corpus["n_read"] and stats.samples_packed == len(corpus["good"])
    assert stats.reasons == {**dict.fromkeys(BAD_REASONS, 1), "unreadable_shard": 2}


@pytest.mark.slow
def test_epochs_follow_each_other_and_reshuffle(corpus, qwen, reference):
    ds = _pipeline(corpus, qwen)
    loader = PackedDataLoader(ds, num_workers=2)
    epoch0 = [_summary(b) for b in _run(loader)]
    assert epoch0 == [_summary(b) for b in reference[1]]
    state = loader.state_dict()
    epoch1 = _run(loader)  # the next iteration is the next epoch, shuffled again
    assert {stream_info(b)["epoch"] for b in epoch1} == {1}
    assert sorted(k for b in epoch1 for k in b.metadata["__key__"]) == corpus["good"]
    assert [_summary(b) for b in epoch1] != epoch0
    # a checkpoint taken at the end of epoch 0 resumes into epoch 1
    again = _pipeline(corpus, qwen)
    again.load_state_dict(state)
    assert [_summary(b) for b in _run(PackedDataLoader(again, num_workers=2))] == [
        _summary(b) for b in epoch1
    ]
    assert again.stats.samples_read == 2 * corpus["n_read"]  # both epochs
    # set_epoch restarts a given epoch
    again.set_epoch(0)
    assert [_summary(b) for b in _run(PackedDataLoader(again, num_workers=2))] == epoch0


def _keys_of(batches) -> list[str]:
    return [k for b in batches for k in b.metadata["__key__"]]


def _forecast_matches(batch) -> bool:
    meta = stream_info(batch)
    forecast = dict(zip((k for _, k in meta["samples"]), meta["forecast"]))
    return [forecast[k] for k in batch.metadata["__key__"]] == batch.seq_lens.tolist()


@pytest.mark.slow
def test_split_by_node_and_worker_then_resume_on_fewer_ranks(corpus, qwen, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    kwargs = dict(pad_to_multiple_of=8, vision_capacity=2, vision_cost="images")
    per_rank, states, heads = [], [], []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ds = _pipeline(corpus, qwen, **kwargs)
        loader = PackedDataLoader(ds, num_workers=2)
        batches = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BadSampleWarning)
            for batch in loader:
                batches.append(batch)
                if len(batches) == 2:  # each rank checkpoints after its 2nd batch
                    states.append(loader.state_dict())
                    heads.append(list(batches))
        assert {stream_info(b)["snapshot"].stream % 2 for b in batches} == {rank}
        for b in batches:
            spans = b.cu_seqlens_padded.diff()
            assert bool((spans % 8 == 0).all()) and int(spans.sum()) == CAPACITY
            assert _forecast_matches(b)
            assert (0 if b.image_grid_thw is None else len(b.image_grid_thw)) <= 2
        per_rank.append(_keys_of(batches))
    assert sorted(per_rank[0] + per_rank[1]) == corpus["good"]
    assert not set(per_rank[0]) & set(per_rank[1])

    # Resume both ranks' checkpoints on a single rank with one worker: the rest, exactly once.
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    ds = _pipeline(corpus, qwen, **kwargs)
    ds.load_state_dict(json.loads(json.dumps(states)))
    tail = _run(PackedDataLoader(ds, num_workers=1))
    assert sorted(_keys_of(heads[0] + heads[1] + tail)) == corpus["good"]
    assert ds.stats.samples_read == corpus["n_read"]
    assert ds.stats.reasons == {**dict.fromkeys(BAD_REASONS, 1), "unreadable_shard": 2}


@pytest.mark.slow
def test_llava_next_forecast_equals_processed_length(tmp_path):
    tok, ip = build_tokenizer("llava_next"), image_processor("llava_next")
    rng = random.Random(5)
    records = [
        {
            "key": f"n{i}",
            "images": _encoded((rng.randint(60, 700), rng.randint(60, 500)), "JPEG", i),
            "caption": "x",
        }
        for i in range(5)
    ]
    urls = write_shards(records, tmp_path / "ln", maxcount=3)
    ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=4096)
    batches = list(ds)
    assert sorted(_keys_of(batches)) == [f"n{i}" for i in range(5)]
    assert all(_forecast_matches(b) for b in batches) and ds.stats.forecast_mismatches == 0
    # LLaVA-NeXT: anyres crops -> 5-D pixel_values, one image_sizes row per image
    assert all(
        b.pixel_values.dim() == 5 and len(b.image_sizes) == len(b.metadata["__key__"]) for b in batches
    )


def test_progress_log(corpus, qwen, caplog):
    ds = _pipeline(corpus, qwen, progress="log", log_every=0.0)
    with caplog.at_level(logging.INFO, logger="vlm_pack.data"):
        batches = _run(ds)
    lines = [r.getMessage() for r in caplog.records if r.name == "vlm_pack.data"]
    assert len(lines) == len(batches)
    assert all("samples/s" in m and "packs/s" in m and "fill" in m for m in lines)
    assert torch.is_tensor(batches[0].input_ids)


# -- review: record fields, URL forms, forecast mismatches, resume in a new process ---------------------


def test_write_shards_takes_llava_conversations_and_rejects_unknown_fields(tmp_path):
    """LLaVA-style records ('conversations' of from/value turns) are stored; unknown fields never vanish."""
    jpg = _encoded((60, 50), "JPEG")
    turns = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "noise"}]
    paths = write_shards([{"key": "llava", "image": jpg, "conversations": turns}], tmp_path / "ok")
    (sample,) = wds.WebDataset(paths, shardshuffle=False)
    assert parse_text(sample) == [  # role/content turns, the newline after <image> kept as written
        {"role": "user", "content": "<image>\nWhat is it?"},
        {"role": "assistant", "content": "noise"},
    ]
    assert image_fields(sample) == ["jpg"]
    with pytest.raises(
        ValueError, match=r"record 0 \(key 'x'\): unknown field\(s\) \['captoin', 'id'\].*'meta'"
    ):
        write_shards([{"key": "x", "images": jpg, "captoin": "typo", "id": 7}], tmp_path / "bad")
    with pytest.raises(ValueError, match=r"record 1: give one text field, not \['conversation', 'caption'\]"):
        write_shards([{"caption": "a"}, {"caption": "b", "conversation": []}], tmp_path / "two")
    with pytest.raises(ValueError, match="'images' or 'image', not both"):
        write_shards([{"image": jpg, "images": [jpg], "caption": "c"}], tmp_path / "both")


def _small_shards(root: Path) -> list[str]:
    convs = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "red dog"}]
    records = [
        {"key": "llava", "images": _encoded((60, 50), "PNG"), "conversations": convs},
        {  # an image but no placeholder: the image goes first in the first user turn
            "key": "noph",
            "images": _encoded((60, 50), "JPEG", 1),
            "conversation": [
                {"role": "user", "content": "describe"},
                {"role": "assistant", "content": "dog"},
            ],
        },
        {"key": "cap", "images": _encoded((40, 40), "WEBP", 2), "caption": "a caption"},
        {"key": "txt", "caption": "just text"},
    ]
    return write_shards(records, root, maxcount=2)


@pytest.mark.slow
def test_url_forms_and_more_workers_than_shards(tmp_path, qwen):
    tok, ip = qwen
    urls = _small_shards(tmp_path / "s")
    pattern = str(tmp_path / "s" / "shard-{000000..000001}.tar")
    for given in (pattern, urls, [Path(u) for u in urls], f"{urls[0]}::{urls[1]}"):
        assert PackedWebDataset(given, Preprocessor(tok, ip), capacity=256).urls == urls
    assert PackedWebDataset(Path(urls[0]), Preprocessor(tok, ip), capacity=256).urls == urls[:1]
    with pytest.raises(ValueError, match="no shard URLs"):
        PackedWebDataset([], Preprocessor(tok, ip), capacity=256)

    # 3 workers for 2 shards: the idle worker yields nothing, the epoch still completes and resumes.
    ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256, min_fill_ratio=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DataLoader: 3 workers on 2 cores
        batches = list(PackedDataLoader(ds, num_workers=3))
    assert sorted(_keys_of(batches)) == ["cap", "llava", "noph", "txt"]
    assert {stream_info(b)["snapshot"].stream for b in batches} == {0, 1}
    assert ds.stats.samples_read == ds.stats.samples_packed == 4 and ds.stats.samples_bad == 0
    assert all(_forecast_matches(b) for b in batches)
    texts = {}
    for b in batches:
        cu = b.cu_seqlens.tolist()
        for key, start, end in zip(b.metadata["__key__"], cu, cu[1:]):
            texts[key] = tok.decode(b.input_ids.flatten()[start:end])
    assert "<|vision_start|><|image_pad|>" in texts["llava"] and "What?" in texts["llava"]
    assert "\n<|vision_start|>" not in texts["llava"].split("What?")[0][-1:]  # placeholder newline dropped
    assert texts["noph"].index("<|vision_start|>") < texts["noph"].index("describe")
    next_epoch = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256, min_fill_ratio=1.0)
    next_epoch.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert next_epoch.epoch == 0 and next_epoch.state_dict()["progress"]["complete"]


def test_forecast_mismatch_is_bad_data_left_out_counted_and_never_packed(tmp_path, qwen):
    """A processor changed after the pipeline read its vision spec: processed lengths differ from the forecast.
    One policy (``vlm_pack.failures.forecast_mismatch``): the sample cannot be packed as planned, so it is
    left out under its own reason, warned about and counted, shorter or longer; raised under on_error="raise"."""
    import copy

    tok, ip = qwen
    records = [
        {"key": f"m{i}", "images": _encoded((56 * (i + 1), 56), "PNG", i), "caption": "x"} for i in range(3)
    ]
    urls = write_shards(records, tmp_path / "m")
    shorter = copy.deepcopy(ip)
    ds = PackedWebDataset(urls, Preprocessor(tok, shorter), capacity=64, min_fill_ratio=1.0)
    shorter.size["longest_edge"] = 56 * 56  # m1 and m2 now process to 4 image tokens (m0 already did)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(ds)
    mismatches = [str(w.message) for w in caught if "FORECAST MISMATCH" in str(w.message)]
    assert len(mismatches) == 2 and all("shard-000000.tar" in m for m in mismatches), mismatches
    assert any("key 'm1'" in m and re.search(r"forecast \d+ != processed length \d+", m) for m in mismatches)
    assert sorted(_keys_of(batches)) == ["m0"]  # shorter than forecast: still never packed as planned
    st = ds.stats
    assert st.forecast_mismatches == 2 and st.samples_bad == 2 and st.reasons == {"forecast_mismatch": 2}
    assert all(stream_info(b)["lengths"] == stream_info(b)["forecast"] for b in batches)
    # every sample longer than forecast (a spec that does not match the processor): systematic, the run stops
    larger = copy.deepcopy(ip)
    ds = PackedWebDataset(urls, Preprocessor(tok, larger), capacity=64, min_fill_ratio=1.0)
    larger.size["shortest_edge"] = 56 * 56 * 8
    with (
        pytest.raises(FailureBudgetError, match=r"no sample was good.*forecast_mismatch \(3 of 3\)"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", BadSampleWarning)
        list(ds)
    changed = copy.deepcopy(ip)
    strict = PackedWebDataset(urls, Preprocessor(tok, changed), capacity=64, on_error="raise")
    changed.size["shortest_edge"] = 56 * 56 * 8
    with (
        pytest.raises(SampleError, match=r"forecast \d+ != processed length \d+ for key 'm\d' in .*shard-000000.tar"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", BadSampleWarning)
        list(strict)


_RESUME_SCRIPT = """
import json, sys, warnings
from vlm_pack.data.pipeline import PackedDataLoader, PackedWebDataset
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor
urls, state_path = json.loads(sys.argv[1]), sys.argv[2]
ds = PackedWebDataset(urls, Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")),
                      capacity=256, oversized="skip", shuffle_seed=3, shuffle_buffer=4, buffer_size=4,
                      min_fill_ratio=0.9)
with open(state_path) as f:
    ds.load_state_dict(json.load(f))
warnings.simplefilter("ignore")
out = [[list(b.metadata["__key__"]), b.seq_lens.tolist()] for b in PackedDataLoader(ds, num_workers=2)]
print(json.dumps({"batches": out, "read": ds.stats.samples_read}))
"""


@pytest.mark.slow
def test_resume_in_a_new_process_from_a_json_file(corpus, qwen, reference, tmp_path):
    """The checkpoint is a JSON file; a fresh interpreter (other hash seed) continues with the same packs."""
    import os
    import subprocess
    import sys

    ref = [[list(b.metadata["__key__"]), b.seq_lens.tolist()] for b in reference[1]]
    first = _pipeline(corpus, qwen)
    loader = PackedDataLoader(first, num_workers=2)
    head = _run(loader, stop=3)
    (tmp_path / "state.json").write_text(json.dumps(loader.state_dict()))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    proc = subprocess.run(
        [sys.executable, "-c", _RESUME_SCRIPT, json.dumps(corpus["urls"]), str(tmp_path / "state.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [[list(b.metadata["__key__"]), b.seq_lens.tolist()] for b in head] + result["batches"] == ref
    assert result["read"] == corpus["n_read"]


# -- typed, versioned resume state; PackingConfig -----------------------------------------------------

from vlm_pack.config import PackingConfig  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"


def _solid_png(width: int, height: int, shade: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 255 - shade, 40)).save(buf, format="PNG")
    return buf.getvalue()


def _legacy_shards(root: Path) -> list[str]:
    """The shards the version-1 fixture was saved on, as relative URLs (the state digests the URL list)."""
    words = "red dog sky the car two".split()
    records = []
    for i in range(10):
        text = " ".join(words[(i + j) % 6] for j in range(5 + 7 * (i % 4)))
        images = [_solid_png(28 * (1 + i % 3), 28 * (1 + (i + 1) % 4), 20 * i)] if i % 3 else []
        records.append({"key": f"L{i:02d}", "images": images, "caption": text})
    records.insert(4, {"key": "Lbad", "images": _solid_png(30, 30, 1)})  # no text: missing_text
    urls = [os.path.relpath(u, root) for u in write_shards(records, root, maxcount=4)]
    (root / "garbage.tar").write_bytes(b"not a tar" * 100)
    return [urls[0], "garbage.tar", *urls[1:]]


def _legacy_pipeline(urls, qwen, **knobs) -> PackedWebDataset:
    tok, ip = qwen
    config = PackingConfig(capacity=48, shuffle_seed=3, shuffle_buffer=3, buffer_size=3, min_fill_ratio=0.9)
    return PackedWebDataset(urls, Preprocessor(tok, ip), config, oversized="skip", **knobs)


@pytest.mark.filterwarnings("ignore::vlm_pack.data.BadSampleWarning")
@pytest.mark.slow
def test_a_state_saved_by_the_untyped_version_1_still_resumes(tmp_path, qwen, monkeypatch):
    monkeypatch.chdir(tmp_path)
    urls = _legacy_shards(tmp_path)
    saved = json.loads((FIXTURES / "pipeline_state_v1.json").read_text())
    assert saved["state"]["version"] == 1 and saved["state"]["progress"]["plan"][0] == [3, 0, []]
    epoch = saved["epoch"]  # the packs the version-1 code made in one uninterrupted epoch
    assert [list(b.metadata["__key__"]) for b in _legacy_pipeline(urls, qwen)] == epoch  # behaviour unchanged

    resumed = _legacy_pipeline(urls, qwen)
    resumed.load_state_dict(saved["state"])
    assert [list(b.metadata["__key__"]) for b in resumed] == epoch[2:]
    assert resumed.stats.reasons == {"missing_text": 1, "unreadable_shard": 1}
    assert resumed.stats.samples_read == 11 and resumed.stats.samples_packed == 10

    # the state is now written as version 2, named fields instead of positional lists, and reads back
    again = _legacy_pipeline(urls, qwen)
    again.load_state_dict(saved["state"])
    state = again.state_dict()
    assert state["version"] == 2 and state["progress"]["plan"][0] == {"shard": 3, "start": 0, "pending": []}
    assert state["progress"]["streams"][0]["cursor"] == {"item": 3, "sample": 1}
    assert json.loads(json.dumps(state)) == state
    from vlm_pack.data.state import PipelineState

    assert PipelineState.from_json(json.loads(json.dumps(state))).to_json() == state
    third = _legacy_pipeline(urls, qwen)
    third.load_state_dict(json.loads(json.dumps(state)))
    assert [list(b.metadata["__key__"]) for b in third] == epoch[2:]


def test_a_state_of_an_unknown_version_is_refused_naming_both_versions(tmp_path, qwen, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ds = _legacy_pipeline(_legacy_shards(tmp_path), qwen)
    state = ds.state_dict()
    for bad in (3, None):
        with pytest.raises(ValueError, match=rf"state version {bad}: this vlm-pack reads versions 1, 2"):
            ds.load_state_dict({**state, "version": bad})
    with pytest.raises(ValueError, match="another shard list"):
        _legacy_pipeline(["garbage.tar"], qwen).load_state_dict(state)
    with pytest.raises(ValueError, match=r"another configuration .*'shuffle_seed': \(3, 4\)"):
        _legacy_pipeline(_legacy_shards(tmp_path), qwen, shuffle_seed=4).load_state_dict(state)


def test_packing_config_or_keyword_knobs(tmp_path, qwen):
    tok, ip = qwen
    urls = _small_shards(tmp_path / "s")
    by_keywords = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256, buffer_size=8)
    config = PackingConfig(capacity=256, buffer_size=8)
    assert by_keywords.config == config and config.oversized == "raise"  # the same defaults either way
    by_config = PackedWebDataset(urls, Preprocessor(tok, ip), config)
    assert [list(b.metadata["__key__"]) for b in by_config] == [list(b.metadata["__key__"]) for b in by_keywords]
    # keywords over a config; validation is PackingConfig's
    assert PackedWebDataset(urls, Preprocessor(tok, ip), config, capacity=512).capacity == 512
    with pytest.raises(ValueError, match="min_fill_ratio must be a float in"):
        PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256, min_fill_ratio=2)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['capcity'\]; packing settings: \["):
        PackedWebDataset(urls, Preprocessor(tok, ip), capcity=256)
    with pytest.raises(TypeError, match="needs capacity="):
        PackedWebDataset(urls, Preprocessor(tok, ip))
    with pytest.raises(ValueError, match="PackedWebDataset cannot do oversized='truncate'"):
        PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256, oversized="truncate")


# -- issue 18: streams that yield nothing, lost counts, unreadable shard lists, huge headers ------------


def _good_and_garbage(root: Path) -> list[str]:
    """Two shards: one good (4 samples), one unreadable. With 2 workers, stream 1 gets only the bad one."""
    good = _small_shards(root / "good")
    (root / "garbage.tar").write_bytes(b"this is not a tar file" * 50)
    return [*good[:1], str(root / "garbage.tar")]


@pytest.mark.filterwarnings("ignore::vlm_pack.data.BadSampleWarning")
@pytest.mark.slow
def test_a_stream_that_yields_no_batch_still_completes_the_epoch_with_a_plain_dataloader(tmp_path, qwen):
    tok, ip = qwen
    urls = _good_and_garbage(tmp_path)
    ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256, min_fill_ratio=1.0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    passes = []
    for _ in range(2):
        observed = [ds.observe(item) for item in loader]  # what the docs ask of a plain DataLoader user
        passes.append([b for b in observed if b is not None])
        assert ds.state_dict()["progress"]["complete"]
    assert [{stream_info(b)["epoch"] for b in batches} for batches in passes] == [{0}, {1}]
    assert [sorted(_keys_of(batches)) for batches in passes] == [["llava", "noph"]] * 2
    assert ds.stats.reasons == {"unreadable_shard": 2}  # once per epoch


@pytest.mark.filterwarnings("ignore::vlm_pack.data.BadSampleWarning")
def test_an_unreadable_shard_is_counted_with_any_worker_count(tmp_path, qwen):
    tok, ip = qwen
    urls = _good_and_garbage(tmp_path)
    reasons = {}
    for workers in (0, 2):
        ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256)
        batches = list(PackedDataLoader(ds, num_workers=workers))
        assert sorted(_keys_of(batches)) == ["llava", "noph"]
        reasons[workers] = ds.stats.reasons
        assert ds.stats.samples_read == 2 and [b.shard for b in ds.stats.bad] == [urls[1]]
    assert reasons == {0: {"unreadable_shard": 1}, 2: {"unreadable_shard": 1}}


@pytest.mark.filterwarnings("ignore::vlm_pack.data.BadSampleWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_all_shards_unreadable_is_an_error_naming_them(tmp_path, qwen, workers):
    tok, ip = qwen
    pattern = str(tmp_path / "shrad-{000000..000001}.tar")  # a typo: no such files
    ds = PackedWebDataset(pattern, Preprocessor(tok, ip), capacity=256)
    with pytest.raises(ValueError, match=r"none of the 2 shard\(s\) this epoch could be read") as exc:
        list(PackedDataLoader(ds, num_workers=workers))
    assert "shrad-000000.tar" in str(exc.value) and "Check the paths" in str(exc.value)


def _png_declaring(width: int, height: int) -> bytes:
    """A real small PNG whose IHDR is rewritten to declare ``width`` x ``height`` (valid CRC)."""
    import struct
    import zlib

    data = bytearray(_solid_png(8, 8, 3))
    ihdr = data[12:29]  # chunk type "IHDR" + its 13 data bytes (width, height first), what the CRC covers
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


def test_an_image_header_over_max_image_pixels_is_refused_before_decoding(tmp_path, qwen, monkeypatch):
    from vlm_pack.vision import image_size

    tok, ip = qwen
    bomb = _png_declaring(30000, 30000)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # as many training scripts do
    assert image_size(bomb) == (30000, 30000) == Image.open(io.BytesIO(bomb)).size
    records = [
        {"key": "bomb", "images": (bomb, "png"), "caption": "huge"},
        {"key": "photo", "images": _encoded((120, 90), "JPEG"), "caption": "fine"},
        {"key": "small", "images": _encoded((60, 50), "PNG"), "caption": "fine"},
    ]
    urls = write_shards(records, tmp_path / "s")
    ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=4096)
    with pytest.warns(BadSampleWarning) as caught:
        keys = sorted(_keys_of(list(ds)))
    assert keys == ["photo", "small"] and ds.stats.reasons == {"image_too_large": 1}
    (message,) = [str(w.message) for w in caught]
    assert "key 'bomb'" in message and "30000x30000 = 900,000,000 pixels > max_image_pixels 89,478,485" in message
    assert "PackingConfig.max_image_pixels" in message

    # the limit is a knob: 100x100 pixels refuses the 120x90 photo and keeps the 60x50 one
    ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=4096, max_image_pixels=100 * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        assert sorted(_keys_of(list(ds))) == ["small"]
    assert ds.stats.reasons == {"image_too_large": 2}


@pytest.mark.filterwarnings("ignore::vlm_pack.data.BadSampleWarning")
@pytest.mark.slow
def test_a_plain_dataloader_gets_only_batches_and_counts_bad_samples_after_each_streams_last_batch(tmp_path, qwen):
    tok, ip = qwen
    good = _small_shards(tmp_path / "good")  # two shards of two good samples
    (tmp_path / "garbage.tar").write_bytes(b"this is not a tar file" * 50)
    bad = write_shards(
        [
            {"key": "notext", "images": _encoded((20, 20), "PNG")},
            {"key": "badheader", "images": (b"\x89PNG\r\n\x1a\n-cut", "png"), "caption": "x"},
        ],
        tmp_path / "bad",
    )
    # 2 workers deal the shards round robin: stream 0 reads good[0] then garbage.tar, stream 1 good[1]
    # then the all-bad shard. A tiny min_fill_ratio emits each sample's pack as soon as it is read, so
    # both streams count their bad shard after their last pack was made.
    urls = [good[0], good[1], str(tmp_path / "garbage.tar"), bad[0]]
    ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256, min_fill_ratio=0.01)
    items = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert not any(isinstance(item, StreamEnd) for item in items)
    assert sorted(_keys_of(items)) == ["cap", "llava", "noph", "txt"] and len(items) == 4
    last = {}
    for item in items:
        assert ds.observe(item) is item
        last[stream_info(item)["snapshot"].stream] = stream_info(item)["snapshot"]
    assert sorted(last) == [0, 1] and all(snapshot.done for snapshot in last.values())
    assert last[0].stats.reasons == {"unreadable_shard": 1}
    assert last[1].stats.reasons == {"missing_text": 1, "corrupt_image": 1}
    assert ds.state_dict()["progress"]["complete"]
    assert ds.stats.reasons == {"unreadable_shard": 1, "missing_text": 1, "corrupt_image": 1}
    assert ds.stats.samples_read == 6 and ds.stats.samples_packed == 4 and ds.stats.samples_bad == 2


def test_each_conversation_is_tokenized_once_and_packs_what_process_sample_gives(tmp_path, qwen, monkeypatch):
    from vlm_pack.data.reader import stream_tar_samples
    from vlm_pack.processing import process_sample

    tok, ip = qwen
    urls = _small_shards(tmp_path / "s")
    texts = []
    tokenize = type(tok).__call__

    def counting(self, text, *args, **kwargs):
        texts.append(text)
        return tokenize(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tok), "__call__", counting)
    ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=256, min_fill_ratio=1.0)
    batches = list(ds)  # the forecast tokenizes; processing the packed samples reuses its ids
    assert len(texts) == len(set(texts)) == 4 == ds.stats.samples_packed
    raw = {sample["__key__"]: sample for url in urls for sample in stream_tar_samples(url)}
    for batch in batches:
        cu = batch.cu_seqlens.tolist()
        for key, start, end in zip(batch.metadata["__key__"], cu, cu[1:]):
            sample = raw[key]
            alone = process_sample(
                [sample[name] for name in image_fields(sample)], parse_text(sample), tokenizer=tok, image_processor=ip
            )
            assert torch.equal(batch.input_ids.flatten()[start:end], alone["input_ids"])
            # the collator masks each sample's first label (the shift must not cross samples)
            assert torch.equal(batch.labels.flatten()[start + 1 : end], alone["labels"][1:])
