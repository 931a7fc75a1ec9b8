"""The same image limits at plan time and at load time: ``max_image_pixels`` refuses an image from its header,
before any pixel is decoded, in ``build_plan`` / ``PackedMapDataset`` and the CLI, and ``--verify`` names the
real cause of an image it cannot decode.

The bomb is a real PNG whose header declares 20000x20000 pixels and whose data is a few bytes: refused from the
header it is ``image_too_large``; had anything tried to decode it, it would be a decode error.
"""

from __future__ import annotations

import io
import json
import struct
import warnings
import zlib
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image

from vlm_pack import PackingConfig, Preprocessor
from vlm_pack.cli.main import main
from vlm_pack.data.map_style import PackedMapDataset, PackedSampler, plan_info
from vlm_pack.data.plan import build_plan
from vlm_pack.data.stats import BadSampleWarning
from vlm_pack.offline import build_tokenizer, image_processor

CAPACITY = 2048
LIMIT = 50_000  # a 300x300 image (90,000 pixels) is over it, a 100x100 one is not


def _png(size: tuple[int, int], seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def bomb(width: int = 20_000, height: int = 20_000) -> bytes:
    """A PNG whose IHDR declares ``width`` x ``height`` (CRC correct) over a 1x1 image's data."""
    data = _png((1, 1))
    ihdr = data[16:29]  # the IHDR chunk's 13 data bytes, after the 8-byte signature and the chunk's length, type
    patched = struct.pack(">II", width, height) + ihdr[8:]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + patched) & 0xFFFFFFFF)
    return data[:16] + patched + crc + data[33:]


def _messages(text: str) -> list[dict]:
    user = [{"type": "image", "text": None}, {"type": "text", "text": text}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]


@pytest.fixture(scope="module")
def pre() -> Preprocessor:
    return Preprocessor(build_tokenizer("qwen2_vl"), image_processor("qwen2_vl"))


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    """Rows 0-3: 100x100 photos; row 4: a 300x300 scan; row 5: the 20000x20000 bomb."""
    return [_png((100, 100), i) for i in range(4)] + [_png((300, 300), 9), bomb()]


def _dataset(images: list[bytes]) -> datasets.Dataset:
    columns = {"images": [[im] for im in images], "messages": [_messages(f"q {i}") for i in range(len(images))]}
    return datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image(decode=False)))


def _reasons(skipped) -> dict[str, str]:
    return {key: message for key, _, message in skipped}


def test_build_plan_and_packed_map_dataset_refuse_from_the_header(pre, images):
    ds = _dataset(images)
    with pytest.warns(UserWarning, match="left out of the plan"):
        plan = build_plan(ds, pre, capacity=CAPACITY, max_image_pixels=LIMIT, progress=False)
    left = _reasons(plan.skipped)
    assert sorted(left) == ["4", "5"] and plan.num_samples == 4
    assert "300x300 = 90,000 pixels > max_image_pixels 50,000" in left["4"]
    assert "20000x20000" in left["5"] and "refused before decoding" in left["5"]
    # the default limit (Pillow's own) refuses the bomb, from its header: never planned, never decoded
    with pytest.warns(UserWarning, match="left out of the plan"):
        packed = PackedMapDataset(ds, pre, capacity=CAPACITY, cache=None)
    assert list(_reasons(packed.skipped)) == ["5"] and "max_image_pixels 89,478,485" in packed.skipped[0][2]


def test_packed_map_dataset_refuses_at_load_time_too(pre, images):
    """A plan made without a limit (given, or cached), loaded with one: the image is refused from its header
    when its pack loads, left out and reported, never decoded."""
    ds = _dataset(images[:5])
    plan = build_plan(ds, pre, capacity=CAPACITY, max_image_pixels=None, progress=False)
    assert plan.num_samples == 5
    packed = PackedMapDataset(ds, pre, PackingConfig(capacity=CAPACITY, max_image_pixels=LIMIT), plan=plan)
    sampler = PackedSampler(packed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        infos = [plan_info(sampler.observe(b)) for b in torch.utils.data.DataLoader(packed, None, sampler=sampler)]
    assert [x for info in infos for x in info["left_out"]] == [[4, "image_too_large"]]
    assert sorted(r for info in infos for r in info["rows"]) == [0, 1, 2, 3]
    assert [(key, reason) for key, _, reason in packed.skipped] == [("4", "image_too_large")]


def _jsonl(tmp_path: Path, images: list[bytes]) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    lines = []
    for i, data in enumerate(images):
        (folder / f"{i}.png").write_bytes(data)
        turns = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A picture."}]
        lines.append(json.dumps({"id": f"s{i}", "image": f"{i}.png", "conversations": turns}))
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_max_image_pixels_and_verify_name_the_real_cause(tmp_path, images, capsys):
    data = _jsonl(tmp_path, images)
    argv = ["pack", str(data), "--family", "qwen2_vl", "--capacity", str(CAPACITY), "--no-progress"]
    out = tmp_path / "plan.jsonl"
    assert main([*argv, "--out", str(out), "--max-image-pixels", str(LIMIT)]) == 0
    capsys.readouterr()
    skipped = {s["key"]: s["reason"] for s in json.loads(out.with_name("plan.meta.json").read_text())["skipped"]}
    assert sorted(skipped) == ["s4", "s5"] and all("max_image_pixels 50,000" in r for r in skipped.values())
    # the default: the bomb is refused from its header, the scan planned
    assert main([*argv, "--out", str(out)]) == 0
    capsys.readouterr()
    skipped = {s["key"]: s["reason"] for s in json.loads(out.with_name("plan.meta.json").read_text())["skipped"]}
    assert list(skipped) == ["s5"] and "20000x20000" in skipped["s5"] and "refused before decoding" in skipped["s5"]
    # no cap of vlm-pack's: --verify decodes, and Pillow's own limit refuses the bomb: said so, not "truncated"
    assert main([*argv, "--out", str(out), "--max-image-pixels", "none", "--verify"]) == 0
    capsys.readouterr()
    skipped = {s["key"]: s["reason"] for s in json.loads(out.with_name("plan.meta.json").read_text())["skipped"]}
    assert list(skipped) == ["s5"] and "decompression bomb" in skipped["s5"] and "truncated" not in skipped["s5"]
