"""positions.py: mRoPE ids equal to the tiny real HF models' own get_rope_index, sample by sample."""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from PIL import Image

from vlm_pack.collate.positions import (
    mrope_position_ids,
    packed_mrope_position_ids,
    packed_position_ids,
    text_position_ids,
)
from vlm_pack.offline import build_tokenizer, image_processor, tiny_model
from vlm_pack.processing import process_sample

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def models():
    tok = build_tokenizer("qwen2_vl")
    return {fam: tiny_model(fam, tok) for fam in QWEN}, tok


def random_sample(rng: random.Random, cfg, family: str, n_vision: int):
    """Token ids of a Qwen chat with images and videos in random places, and the grids."""
    image_id, video_id = cfg.image_token_id, cfg.video_token_id
    vs, ve = cfg.vision_start_token_id, cfg.vision_end_token_id

    def text(n: int) -> list[int]:
        return [rng.randrange(20, 400) for _ in range(n)]

    ids, grids, vgrids = text(rng.randrange(0, 6)), [], []
    for _ in range(n_vision):
        h, w = 2 * rng.randrange(1, 7), 2 * rng.randrange(1, 7)
        if rng.random() < 0.7:
            ids += [vs] + [image_id] * (h * w // 4) + [ve]
            grids.append((1, h, w))
        else:
            t = rng.randrange(1, 5)
            if family == "qwen3_vl":  # timestamps between frames
                for _ in range(t):
                    ids += text(2) + [vs] + [video_id] * (h * w // 4) + [ve]
            else:
                ids += [vs] + [video_id] * (t * h * w // 4) + [ve]
            vgrids.append((t, h, w))
        ids += text(rng.randrange(0, 5))
    ids = torch.tensor(ids or text(3))
    img = torch.tensor(grids, dtype=torch.long).reshape(-1, 3) if grids else None
    vid = torch.tensor(vgrids, dtype=torch.long).reshape(-1, 3) if vgrids else None
    types = (ids == image_id).long() + 2 * (ids == video_id).long()
    return ids, img, vid, types


def hf_rope(model, ids, img, vid, types, **kw):
    pos, _ = model.model.get_rope_index(
        ids[None],
        mm_token_type_ids=types[None],
        image_grid_thw=img,
        video_grid_thw=None if vid is None else vid.clone(),
        **kw,
    )
    return pos[:, 0]


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.slow
def test_matches_get_rope_index_on_random_samples(models, family):
    model = models[0][family]
    cfg = model.config
    rng = random.Random(family)
    tps = getattr(cfg.vision_config, "tokens_per_second", None)
    # transformers < 5.18 truncates each video's seconds per grid to an integer (0.5 -> 0: no time between
    # frames); the released Qwen2.5-VL code and later transformers do not. vlm-pack keeps the released rule.
    truncates = "int(next(second_per_grid_ts))" in inspect.getsource(type(model.model).get_rope_index)
    for trial in range(25):
        ids, img, vid, types = random_sample(rng, cfg, family, n_vision=rng.randrange(0, 5))
        kw = {}
        if family == "qwen2_5_vl" and vid is not None:
            spg = [rng.choice([0.5, 1 / 3, 2.0, 0.25, 1.7]) for _ in range(vid.shape[0])]
            kw["second_per_grid_ts"] = torch.tensor(spg) if trial % 2 else spg
            if truncates:  # the reference gets the integers it would have used
                kw["second_per_grid_ts"] = [float(int(s)) for s in spg]
        ref = hf_rope(model, ids, img, vid, types, **kw)
        mine = mrope_position_ids(
            ids,
            img,
            video_grid_thw=vid,
            image_token_id=cfg.image_token_id,
            video_token_id=cfg.video_token_id,
            vision_start_token_id=cfg.vision_start_token_id,
            spatial_merge_size=cfg.vision_config.spatial_merge_size,
            tokens_per_second=tps,
            family=family,
            **kw,
        )
        assert torch.equal(mine, ref), (family, trial)
        # The model reads mm_token_type_ids; giving them instead of the ids is the same.
        by_types = mrope_position_ids(
            ids, img, video_grid_thw=vid, mm_token_type_ids=types, tokens_per_second=tps, family=family, **kw
        )
        assert torch.equal(by_types, ref)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_matches_get_rope_index_with_real_image_processor(models, family):
    mods, tok = models
    model = mods[family]
    ip = image_processor(family, size={"shortest_edge": 3136, "longest_edge": 128 * 128})
    images = [Image.new("RGB", (97, 61), (200, 30, 30)), Image.new("RGB", (40, 130), (20, 30, 230))]
    conv = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "two pictures"},
    ]
    s = process_sample(images, conv, tokenizer=tok, image_processor=ip, family=family)
    ref = hf_rope(model, s["input_ids"], s["image_grid_thw"], None, s["mm_token_type_ids"])
    mine = mrope_position_ids(
        s["input_ids"], s["image_grid_thw"], image_token_id=tok.image_token_id, family=family
    )
    assert torch.equal(mine, ref)
    assert int(mine.max()) < s["input_ids"].numel()  # mRoPE compresses the image span


def test_packed_samples_each_numbered_alone_and_padding_continues(models):
    model = models[0]["qwen2_vl"]
    cfg = model.config
    rng = random.Random(3)
    samples = [random_sample(rng, cfg, "qwen2_vl", n) for n in (2, 0, 1, 3)]
    pads = [3, 0, 5, 1]
    ids, types, cu, grids, vgrids = [], [], [0], [], []
    for (s_ids, img, vid, s_types), pad in zip(samples, pads):
        ids.append(torch.cat([s_ids, torch.zeros(pad, dtype=torch.long)]))
        types.append(torch.cat([s_types, torch.zeros(pad, dtype=torch.long)]))
        cu.append(cu[-1] + s_ids.numel() + pad)
        grids += [] if img is None else [img]
        vgrids += [] if vid is None else [vid]
    flat, flat_types = torch.cat(ids), torch.cat(types)
    img_all = torch.cat(grids)
    vid_all = torch.cat(vgrids) if vgrids else None
    cu_t = torch.tensor(cu, dtype=torch.int32)
    got = packed_mrope_position_ids(flat, cu_t, img_all, video_grid_thw=vid_all, mm_token_type_ids=flat_types)
    for i, (s_ids, img, vid, s_types) in enumerate(samples):
        part = got[:, cu[i] : cu[i + 1]]
        # The real part is the sample's own get_rope_index, the padding what get_rope_index gives it.
        assert torch.equal(part[:, : s_ids.numel()], hf_rope(model, s_ids, img, vid, s_types))
        padded_ref = hf_rope(model, ids[i], img, vid, types[i])
        assert torch.equal(part, padded_ref)
    four = packed_position_ids(
        flat[None],
        cu_t,
        family="qwen2_vl",
        image_grid_thw=img_all,
        video_grid_thw=vid_all,
        mm_token_type_ids=flat_types,
    )
    assert four.shape == (4, 1, flat.numel())
    assert torch.equal(four[0, 0], text_position_ids(cu_t, flat.numel()))
    assert torch.equal(four[1:, 0], got)


def test_text_position_ids():
    cu = torch.tensor([0, 3, 5, 5, 9])
    assert text_position_ids(cu, 9).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    # Past the last offset: continue the last sample.
    assert text_position_ids(torch.tensor([0, 2]), 4).tolist() == [0, 1, 2, 3]
    flat = packed_position_ids(torch.zeros(2, 4, dtype=torch.long), torch.tensor([0, 3, 8]))
    assert flat.tolist() == [[0, 1, 2, 0], [1, 2, 3, 4]]


def test_errors_name_the_sample():
    image_id, vs = 5, 3
    ids = torch.tensor([9, vs, image_id, image_id, 4, 9, vs, image_id, image_id, image_id, 4])
    cu = torch.tensor([0, 5, 11])
    grids = torch.tensor([[1, 2, 4], [1, 2, 4]])  # 2 tokens each: sample 1 has 3
    with pytest.raises(ValueError, match=r"sample 1: an image block of 3 tokens has grid \(1, 2, 4\)"):
        packed_mrope_position_ids(ids, cu, grids, image_token_id=image_id)
    with pytest.raises(ValueError, match="2 image run\\(s\\) but 1 image grid"):
        packed_mrope_position_ids(ids, cu, grids[:1], image_token_id=image_id)
    bad = torch.tensor([9, 9, image_id, image_id, 4])
    with pytest.raises(ValueError, match="does not follow <\\|vision_start\\|>"):
        packed_mrope_position_ids(bad, None, grids[:1], image_token_id=image_id, vision_start_token_id=vs)
    with pytest.raises(ValueError, match="tokens_per_second"):
        mrope_position_ids(
            torch.tensor([6, 6]),
            video_grid_thw=torch.tensor([[1, 2, 2]]),
            image_token_id=5,
            video_token_id=6,
            family="qwen2_5_vl",
        )
    with pytest.raises(ValueError, match="no multimodal RoPE"):
        mrope_position_ids(torch.tensor([1]), family="llava")
    with pytest.raises(ValueError, match="no multimodal RoPE"):
        packed_position_ids(torch.tensor([1]), torch.tensor([0, 1]), family="llava", image_grid_thw=grids)
