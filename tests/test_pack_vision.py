"""A pack's images processed in one image-processor call: the same batches as sample by sample, one copy less."""

from __future__ import annotations

import io
import random
import warnings

import pytest
import torch
from PIL import Image

from vlm_pack.collate.collator import PackingCollator
from vlm_pack.collate.vision_inputs import join_vision
from vlm_pack.data.pipeline import BadSampleWarning, PackedWebDataset
from vlm_pack.data.reader import stream_tar_samples
from vlm_pack.data.shards import image_fields, parse_text, write_shards
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor
from vlm_pack.processing import process_pack, process_sample

COMPARED = (
    "input_ids",
    "labels",
    "position_ids",
    "cu_seqlens",
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
)


def _jpeg(width: int, height: int, seed: int) -> bytes:
    image = Image.effect_noise((width, height), 30 + seed).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _records(n: int) -> list[dict]:
    """Captions and chats with 0-2 images of assorted sizes, and a JPEG whose pixels are cut after the header."""
    rng = random.Random(7)
    records = []
    for i in range(n):
        images = [
            _jpeg(rng.randint(28, 300), rng.randint(28, 300), i * 3 + j) for j in range(rng.choice([0, 1, 2]))
        ]
        words = " ".join(rng.choice(["red", "dog", "sky", "a", "car"]) for _ in range(rng.randint(3, 30)))
        if i % 2:
            record = {"caption": words}
        else:
            marks = [{"type": "image"}] * len(images)
            user = [*marks, {"type": "text", "text": "what is it?"}]
            record = {
                "conversation": [{"role": "user", "content": user}, {"role": "assistant", "content": words}]
            }
        records.append({"key": f"s{i:02d}", "images": images, **record})
    jpg = _jpeg(90, 70, 99)
    records.insert(
        3, {"key": "cut", "images": (jpg[: len(jpg) // 2], "jpg"), "caption": "header fine, pixels cut"}
    )
    return records


@pytest.mark.parametrize(
    ("family", "capacity", "one_call"),
    # LLaVA-NeXT pads tiles to the call's most: processed sample by sample (up to ~2900 tokens an image)
    [("qwen2_vl", 512, True), ("llava_next", 8192, False)],
)
@pytest.mark.slow
def test_pipeline_batches_equal_the_per_sample_path_bit_for_bit(tmp_path, family, capacity, one_call):
    tok, ip = build_tokenizer(family), image_processor(family)
    urls = write_shards(_records(14), tmp_path / "shards", maxcount=5)
    ds = PackedWebDataset(urls, Preprocessor(tok, ip), capacity=capacity, shuffle_seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        batches = list(ds)
    assert ds.stats.reasons == {"decode_error": 1}
    assert [bad.key for bad in ds.stats.bad] == ["cut"]
    raw = {sample["__key__"]: sample for url in urls for sample in stream_tar_samples(url)}
    keys = [key for batch in batches for key in batch.metadata["__key__"]]
    assert sorted(keys) == sorted(set(raw) - {"cut"})  # the cut sample's pack-mates are all packed
    collator = PackingCollator(capacity, tokenizer=tok, family=family, spatial_merge_size=2)
    with_images = 0
    for batch in batches:
        alone = [
            process_sample(
                [raw[key][name] for name in image_fields(raw[key])],
                parse_text(raw[key]),
                tokenizer=tok,
                image_processor=ip,
                key=key,
            )
            for key in batch.metadata["__key__"]
        ]
        expected = collator(alone)
        for name in COMPARED:
            got, want = getattr(batch, name), getattr(expected, name)
            assert (got is None) == (want is None), name
            if want is not None:
                assert got.dtype == want.dtype and torch.equal(got, want), name
        with_images += batch.pixel_values is not None
    assert with_images >= 2
    assert one_call == (batches[0].pixel_values is not None and batches[0].pixel_values.dim() == 2)


def test_process_pack_equals_process_sample_and_join_vision_returns_the_one_call_without_copying():
    tok, ip = build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")
    chat = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "both?"}]}
    ]
    chat.append({"role": "assistant", "content": "yes"})
    samples = [
        ([_jpeg(120, 80, 1)], "a caption"),
        ([], "no image"),
        ([b"not an image at all"], "bad bytes"),
        ([_jpeg(64, 200, 2), _jpeg(333, 41, 3)], chat),
        ([_jpeg(56, 56, 4)], chat),  # two placeholders for one image
        ([_jpeg(250, 250, 5)], "last"),
    ]
    outs = process_pack(samples, keys=[f"k{i}" for i in range(6)], tokenizer=tok, image_processor=ip)
    assert isinstance(outs[2], Exception) and isinstance(outs[4], ValueError) and "k4" in str(outs[4])
    good = [0, 1, 3, 5]
    for index in good:
        alone = process_sample(*samples[index], tokenizer=tok, image_processor=ip)
        assert outs[index].keys() == alone.keys()
        for name, value in alone.items():
            assert outs[index][name].dtype == value.dtype and torch.equal(outs[index][name], value), name
    with_images = [outs[i] for i in good if "pixel_values" in outs[i]]
    joined = join_vision(with_images)
    expected = ip(
        images=[im for i in good for im in (Image.open(io.BytesIO(b)).convert("RGB") for b in samples[i][0])]
    )
    assert torch.equal(joined["pixel_values"], torch.as_tensor(expected["pixel_values"]))
    assert torch.equal(joined["image_grid_thw"], torch.as_tensor(expected["image_grid_thw"]))
    # the pack's one tensor, not a copy; a reordered pack is copied in its own order
    assert joined["pixel_values"].data_ptr() == with_images[0]["pixel_values"].data_ptr()
    reordered = [with_images[0], with_images[2], with_images[1]]
    swapped = join_vision(reordered)["pixel_values"]
    assert swapped.data_ptr() != joined["pixel_values"].data_ptr()
    assert torch.equal(swapped, torch.cat([s["pixel_values"] for s in reordered]))
    # a part of the pack is copied too: a view would keep the whole pack's memory alive
    assert join_vision(with_images[:2])["pixel_values"].data_ptr() != joined["pixel_values"].data_ptr()


def test_an_image_the_one_call_refuses_fails_only_its_own_sample():
    tok, ip = build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")
    buf = io.BytesIO()
    Image.new("RGB", (402, 2), "white").save(buf, format="PNG")  # aspect ratio > 200: Qwen2-VL refuses it
    samples = [([_jpeg(90, 90, 1)], "first"), ([buf.getvalue()], "a line"), ([_jpeg(60, 120, 2)], "third")]
    outs = process_pack(samples, keys=["a", "line", "c"], tokenizer=tok, image_processor=ip)
    assert isinstance(outs[1], ValueError) and "aspect ratio" in str(outs[1])
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['image_procesor'\]"):
        process_pack(samples, tokenizer=tok, image_procesor=ip)
    for index in (0, 2):
        alone = process_sample(*samples[index], tokenizer=tok, image_processor=ip)
        assert torch.equal(outs[index]["pixel_values"], alone["pixel_values"])
        assert torch.equal(outs[index]["input_ids"], alone["input_ids"])


@pytest.mark.parametrize(
    "dtypes", [(torch.float32,) * 3, (torch.bfloat16,) * 3, (torch.float32, torch.float64, torch.float32)]
)
def test_large_joins_equal_torch_cat(dtypes):
    """Joins over 4 MiB go to numpy-allocated (huge-page-advised) memory: still torch.cat's values and dtype."""
    generator = torch.Generator().manual_seed(0)
    parts = [
        torch.randn(rows, 1176, generator=generator).to(dtype)
        for rows, dtype in zip((900, 1300, 700), dtypes)
    ]
    joined = join_vision([{"pixel_values": part} for part in parts])["pixel_values"]
    expected = torch.cat(parts)
    assert joined.dtype == expected.dtype and torch.equal(joined, expected)
    assert joined.data_ptr() not in {part.data_ptr() for part in parts}
