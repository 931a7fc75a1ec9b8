"""Videos in the collapsed layout (Megatron style): one placeholder per video, or per temporal group where the
processor writes text between groups (Qwen3-VL's ``<t seconds>``, kept as text), expanded by the model.

Oracle: the same sample processed in the expanded layout, i.e. the family's HF processor's own expansion
(tests/test_video_process.py holds that layout to ``processor(text=..., videos=[whole clip])``). Each
collapsed sample must expand, placeholder by placeholder, to exactly those ``input_ids`` / ``labels`` /
``mm_token_type_ids``; the collator's collapsed batch, remapped to the expanded space, must give the
expanded-layout batch's boundaries and mRoPE positions, with padding (``pad_to_multiple_of``, context
parallel) counted on expanded spans. Needs torchvision (transformers' video processors) and PyAV.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("av")
pytestmark = pytest.mark.torchvision

from PIL import Image  # noqa: E402

from vlm_pack import PackingCollator, offline, pad_multiple_for  # noqa: E402
from vlm_pack.collate.remap import remap_cu_seqlens, remap_cu_seqlens_padded  # noqa: E402
from vlm_pack.failures import InternalCheckError  # noqa: E402
from vlm_pack.processing import process_sample  # noqa: E402
from vlm_pack.testing import encode_clip, processor_with_video, token_mult_prob_error  # noqa: E402

_TEMPLATES = Path(__file__).parent / "templates"
# Qwen2/2.5-VL keep every frame; Qwen3-VL samples at its default 2 fps, so a 12-frame 6 fps clip gives 4 frames,
# 2 temporal groups, each opened by its own "<t seconds>" text.
_VIDEO = {
    "qwen2_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, cap_pixels_per_frame=False),
    "qwen2_5_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, cap_pixels_per_frame=False),
    "qwen3_vl": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32}, cap_pixels_per_frame=False),
}
_IMAGE = {
    "qwen2_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
    "qwen2_5_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
    "qwen3_vl": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}),
}
FAMILIES = tuple(_VIDEO)


def _turns(parts: list[dict], question: str, answer: str) -> list[dict]:
    return [
        {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer},
    ]


@functools.cache
def _processor(family: str):
    template = _TEMPLATES / f"{family}.jinja"
    chat_template = template.read_text() if template.exists() else None
    return processor_with_video(family, chat_template=chat_template, image_overrides=_IMAGE[family], **_VIDEO[family])


@functools.cache
def _clip(frames: int, width: int, height: int, fps: float, container: str, seed: int) -> bytes:
    return encode_clip(frames, width, height, fps, container, seed)


def _cases() -> list[tuple[list, list, list]]:
    """A video alone, text alone, and two videos around an image (the mixed case)."""
    picture = Image.new("RGB", (90, 60), (20, 140, 60))
    video_a, video_b = _clip(10, 96, 64, 5.0, "mp4", 1), _clip(12, 64, 128, 6.0, "mkv", 2)
    return [
        ([], [video_a], _turns([{"type": "video"}], "What moves?", "A square slides to the right.")),
        ([], [], _turns([], "Say something short.", "Short.")),
        ([picture], [video_b, video_a], _turns(
            [{"type": "video"}, {"type": "image"}, {"type": "video"}], "Order them.", "First the tall clip.")),
    ]  # fmt: skip


@functools.cache
def _samples(family: str, layout: str) -> tuple[dict, ...]:
    proc = _processor(family)
    return tuple(
        process_sample(images, conversation, processor=proc, layout=layout, key=f"{family}/{k}", videos=videos)
        for k, (images, videos, conversation) in enumerate(_cases())
    )


def _ids(family: str) -> tuple[int, int]:
    proc = _processor(family)
    return proc.image_token_id, proc.video_token_id


def _repeats(ids: torch.Tensor, family: str, per_image: torch.Tensor | None, per_video: torch.Tensor | None):
    """How often each collapsed token stands in the expanded sequence ``[L]``."""
    image_id, video_id = _ids(family)
    repeats = torch.ones_like(ids)
    if per_image is not None:
        repeats[ids == image_id] = per_image
    if per_video is not None:
        repeats[ids == video_id] = per_video
    return repeats


def _counts_in_order(ids: torch.Tensor, family: str, per_image, per_video) -> torch.Tensor:
    """Every placeholder's count, images and videos together in the order they stand in ``ids``."""
    image_id, video_id = _ids(family)
    repeats = _repeats(ids, family, per_image, per_video)
    return repeats[(ids == image_id) | (ids == video_id)]


def _collators(family: str, capacity: int, pad: int) -> tuple[PackingCollator, PackingCollator]:
    # max_rows=None: a call gets all the samples, re-packed into the rows they need (in-batch packing)
    kw = dict(tokenizer=_processor(family), family=family, pad_to_multiple_of=pad, max_rows=None)
    if family == "qwen2_5_vl":
        kw["tokens_per_second"] = 2  # Qwen2.5-VL's vision_config default (configuration_qwen2_5_vl.py)
    return PackingCollator(capacity, **kw), PackingCollator(capacity, layout="collapsed", **kw)


# --------------------------------------------------------------------------------------- (a) one sample


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", [0, 2], ids=["video", "video+image"])
def test_collapsed_sample_expands_to_the_expanded_one(family, case):
    expanded, collapsed = _samples(family, "expanded")[case], _samples(family, "collapsed")[case]
    image_id, video_id = _ids(family)
    ids = collapsed["input_ids"]
    per_video = collapsed["tokens_per_video_placeholder"]
    grid = collapsed["video_grid_thw"]
    assert int((ids == video_id).sum()) == per_video.numel()
    assert int((ids == image_id).sum()) == collapsed.get("tokens_per_image", torch.zeros(0)).numel()
    if family == "qwen3_vl":  # one placeholder per temporal group, each opened by its "<t seconds>" text
        assert per_video.numel() == int(grid[:, 0].sum()) > grid.shape[0]
        text = _processor(family).tokenizer.decode(ids)
        assert text.count(" seconds>") == per_video.numel()
    else:
        assert per_video.numel() == grid.shape[0]
    assert int(per_video.sum()) == int(expanded["tokens_per_video"].sum()) == int((expanded["input_ids"] == video_id).sum())
    repeats = _repeats(ids, family, collapsed.get("tokens_per_image"), per_video)
    for name in ("input_ids", "labels", "mm_token_type_ids"):
        assert torch.equal(torch.repeat_interleave(collapsed[name], repeats), expanded[name]), name
    assert ids.numel() < expanded["input_ids"].numel()
    for name in ("pixel_values_videos", "video_grid_thw", "tokens_per_video", "second_per_grid_ts", "pixel_values",
                 "image_grid_thw", "tokens_per_image"):  # fmt: skip
        assert (name in collapsed) == (name in expanded), name
        if name in expanded:
            assert torch.equal(collapsed[name], expanded[name]), name
    # the one forecast (header only) of the collapsed layout is the expanded length: what plans and rows count
    from vlm_pack import Preprocessor
    from vlm_pack.vision.video import read_video_header

    images, videos, conversation = _cases()[case]
    pre = Preprocessor(processor=_processor(family), layout="collapsed")
    length, _ = pre.forecast(conversation, [im.size for im in images], videos=[read_video_header(v) for v in videos])
    assert length == expanded["input_ids"].numel() == int(repeats.sum())


# ------------------------------------------------------------------------ (b), (c) the packed batch


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("pad", [1, pad_multiple_for(cp=2), pad_multiple_for(tp=2, cp=2, sequence_parallel=True)])
def test_collapsed_batch_remaps_to_the_expanded_batch(family, pad):
    expanded, collapsed = list(_samples(family, "expanded")), list(_samples(family, "collapsed"))
    longest = max(s["input_ids"].numel() for s in expanded)
    capacity = -(-(longest + 8) // pad) * pad  # rows hold one or two samples: several rows
    e_collator, c_collator = _collators(family, capacity, pad)
    e, c = e_collator(expanded), c_collator(collapsed)
    assert e.num_rows > 1 and torch.equal(c.sample_index, e.sample_index)
    assert c.input_ids.shape[0] == 1  # the packs are consecutive segments of one "thd" row
    # The collator's own expanded boundaries, and the remap called directly with both placeholder ids.
    assert torch.equal(c.cu_seqlens_expanded, e.cu_seqlens)
    assert torch.equal(c.cu_seqlens_padded_expanded, e.cu_seqlens_padded)
    ids = c.input_ids[0]
    counts = _counts_in_order(ids, family, c.tokens_per_image, c.tokens_per_video_placeholder)
    image_id, video_id = _ids(family)
    real, padded = remap_cu_seqlens_padded(c.cu_seqlens, c.cu_seqlens_padded, ids, (image_id, video_id), counts)
    assert torch.equal(real, e.cu_seqlens) and torch.equal(padded, e.cu_seqlens_padded)
    back = remap_cu_seqlens(e.cu_seqlens_padded, ids, (image_id, video_id), counts, inverse=True)
    assert torch.equal(back, c.cu_seqlens_padded)
    # Collapsed boundaries count one token per placeholder.
    assert c.seq_lens.tolist() == [collapsed[i]["input_ids"].numel() for i in c.sample_index.tolist()]
    # The expanded row, its labels and its mRoPE positions are the expanded layout's.
    repeats = _repeats(ids, family, c.tokens_per_image, c.tokens_per_video_placeholder)
    assert torch.equal(torch.repeat_interleave(ids, repeats), e.input_ids.reshape(-1))
    assert torch.equal(torch.repeat_interleave(c.labels[0], repeats), e.labels.reshape(-1))
    assert torch.equal(c.position_ids, e.position_ids.reshape(4, 1, -1))
    torch.testing.assert_close(c.video_grid_thw, e.video_grid_thw, rtol=0, atol=0)
    assert torch.equal(c.pixel_values_videos, e.pixel_values_videos)
    # (c) every sample's expanded span is a multiple of pad (context parallel: 2 * cp chunks per sample).
    spans = c.cu_seqlens_padded_expanded.diff()
    assert bool((spans % pad == 0).all()) and bool((spans >= c.seq_lens_expanded).all())
    if pad > 1:
        assert not torch.equal(c.cu_seqlens_expanded, c.cu_seqlens_padded_expanded)  # padding was needed


def test_llava_onevision_one_placeholder_per_video_and_image():
    """No grid: its video's frames x pooled tokens + 1 are one run (models/llava_onevision/processing_llava_onevision.py),
    counted by tokens_per_video; positions are 1-D."""
    template = _TEMPLATES / "llava_onevision.jinja"
    proc = processor_with_video("llava_onevision", chat_template=template.read_text() if template.exists() else None,
                                image_overrides={}, do_sample_frames=True, num_frames=4)  # fmt: skip
    images, videos, conversation = _cases()[2]
    conversation = _turns([{"type": "video"}, {"type": "image"}], "Which moves?", "The clip.")
    e, c = (process_sample(images, conversation, processor=proc, videos=videos[:1], layout=layout)
            for layout in ("expanded", "collapsed"))  # fmt: skip
    assert c["tokens_per_video_placeholder"].tolist() == e["tokens_per_video"].tolist()
    repeats = torch.ones_like(c["input_ids"])
    repeats[c["input_ids"] == proc.image_token_id] = c["tokens_per_image"]
    repeats[c["input_ids"] == proc.video_token_id] = c["tokens_per_video_placeholder"]
    for name in ("input_ids", "labels"):
        assert torch.equal(torch.repeat_interleave(c[name], repeats), e[name]), name
    # max_rows=None: the three samples need two rows (in-batch packing)
    kw = dict(tokenizer=proc, family="llava_onevision", pad_to_multiple_of=4, max_rows=None)
    text = process_sample([], _cases()[1][2], processor=proc)
    eb = PackingCollator(4096, **kw)([e, text, e])
    cb = PackingCollator(4096, layout="collapsed", **kw)([c, text, c])
    assert torch.equal(cb.cu_seqlens_expanded, eb.cu_seqlens)
    assert torch.equal(cb.cu_seqlens_padded_expanded, eb.cu_seqlens_padded)
    assert torch.equal(cb.position_ids, eb.position_ids.reshape(1, -1))


# ------------------------------------------------------------------------------------- (d) errors


def test_a_collator_without_the_video_token_says_how_to_give_it():
    collapsed = list(_samples("qwen2_vl", "collapsed"))
    collator = PackingCollator(4096, layout="collapsed", family="qwen2_vl", image_token_id=_ids("qwen2_vl")[0])
    with pytest.raises(ValueError, match=r"sample 0 .*has videos but the collator knows no video_token_id: pass"):
        collator(collapsed[:1])


@pytest.mark.parametrize("family", FAMILIES)
def test_expanded_video_tokens_in_a_collapsed_collator_name_the_fix(family):
    expanded = _samples(family, "expanded")[0]
    _, collator = _collators(family, 4096, 1)
    with pytest.raises(ValueError, match=r"video placeholder\(s\) but its 1 video\(s\) need 1 .*layout='collapsed'"):
        collator([expanded])


def test_counts_that_do_not_fit_the_placeholders_are_refused():
    sample = dict(_samples("qwen3_vl", "collapsed")[0])
    _, collator = _collators("qwen3_vl", 4096, 1)
    assert collator([sample]).tokens_per_video_placeholder.numel() == 2
    for wrong in (torch.tensor([1, -1]), torch.tensor([1, 0]), torch.tensor([0, 0, 0])):  # another split, sum, count
        changed = torch.cat([sample["tokens_per_video_placeholder"], torch.zeros(1, dtype=torch.long)])[: wrong.numel()]
        with pytest.raises(ValueError, match=r"tokens_per_video_placeholder \[.*\] disagrees with video_grid_thw"):
            collator([{**sample, "tokens_per_video_placeholder": changed + wrong}])
    # without tokens_per_video_placeholder the temporal groups of video_grid_thw count them
    plain = {k: v for k, v in sample.items() if k != "tokens_per_video_placeholder"}
    assert torch.equal(collator([plain]).tokens_per_video_placeholder, sample["tokens_per_video_placeholder"])


def test_a_processor_that_splits_a_videos_tokens_cannot_collapse():
    """A family whose processor wrote other tokens inside a video's run (row or frame markers) has no
    count per placeholder: refused naming the processor and layout='expanded'."""
    from vlm_pack.processing.layout import _collapse_videos

    sample = dict(_samples("qwen2_vl", "expanded")[0])
    video_id = _ids("qwen2_vl")[1]
    ids = sample["input_ids"]
    middle = int((ids == video_id).nonzero()[3])
    marker = offline.build_tokenizer("qwen2_vl").convert_tokens_to_ids("<|vision_end|>")
    split = {k: torch.cat([v[:middle], v.new_tensor([marker if k == "input_ids" else v[middle]]), v[middle:]])
             for k, v in sample.items() if k in ("input_ids", "labels", "mm_token_type_ids")}  # fmt: skip
    with pytest.raises(InternalCheckError, match=r"sample 'k'.*runs of \[3, \d+\]: MyProcessor interleaves.*'expanded'"):
        _collapse_videos({**sample, **split}, video_id, 2, "k", "MyProcessor")
    assert _collapse_videos(dict(sample), video_id, 2, "k")["input_ids"].numel() < ids.numel()


# -------------------------------------------------------------- packed = alone through the model's expansion

_VISION = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def _logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token ``[L - 1]`` (fp32 logits ``[L, V]``)."""
    return torch.log_softmax(logits[:-1].double(), -1).gather(-1, ids[1:, None])[:, 0]


def _expanded_forward(model, c, family: str, one_sequence: bool = False) -> torch.Tensor:
    """What a Megatron-style model does with the collapsed batch ``c``: each placeholder replaced by its count
    of tokens, then the language model over the expanded row with the batch's positions; logits ``[Te, V]``.
    ``one_sequence``: the control, positions numbered through the whole row (the model's own rope over it)."""
    repeats = _repeats(c.input_ids[0], family, c.tokens_per_image, c.tokens_per_video_placeholder)
    ids = torch.repeat_interleave(c.input_ids[0], repeats)[None]
    types = torch.repeat_interleave(c.mm_token_type_ids[0], repeats)[None]
    inputs = {name: getattr(c, name) for name in _VISION if getattr(c, name) is not None}
    positions = c.position_ids
    if one_sequence:
        rope, _ = model.model.get_rope_index(ids, mm_token_type_ids=types, **{
            k: v for k, v in inputs.items() if k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")})  # fmt: skip
        positions = torch.cat([torch.arange(ids.shape[1])[None, None], rope])
    return model(input_ids=ids, mm_token_type_ids=types, position_ids=positions, use_cache=False, **inputs).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_collapsed_batch_expanded_by_the_model_equals_each_sample_alone(family):
    """A Megatron-style model's forward on the collapsed batch (``_expanded_forward``), fp32 on the CPU,
    against the tiny model run on each sample alone as the processor expanded it (HF's own positions)."""
    model = offline.tiny_model(family, _processor(family).tokenizer, initializer_range=0.2, seed=0).eval()
    expanded, collapsed = _samples(family, "expanded"), list(_samples(family, "collapsed"))
    capacity = -(-sum(s["input_ids"].numel() + 4 for s in expanded) // 4) * 4
    c = PackingCollator(capacity, tokenizer=_processor(family), model_config=model.config, layout="collapsed",
                        pad_to_multiple_of=4)(collapsed)  # fmt: skip
    with torch.no_grad():
        alone = [
            model(input_ids=s["input_ids"][None], mm_token_type_ids=s["mm_token_type_ids"][None], use_cache=False,
                  **{name: s[name] for name in _VISION if name in s}).logits[0]
            for s in expanded
        ]  # fmt: skip
        errors = {}
        for control in (False, True):
            packed = _expanded_forward(model, c, family, one_sequence=control)
            errors[control] = []
            for k, index in enumerate(c.sample_index.tolist()):
                ids = expanded[index]["input_ids"]
                start = int(c.cu_seqlens_padded_expanded[k])
                a, b = _logprobs(alone[index], ids), _logprobs(packed[start : start + ids.numel()], ids)
                errors[control].append(float(token_mult_prob_error(a, b)))
    print(f"{family} collapsed -> expanded forward: token_mult_prob_error {errors[False]}; "
          f"positions through the row (control) {errors[True]}")  # fmt: skip
    assert c.sample_index.numel() == 3 and max(errors[False]) <= 1.0001, errors
    assert max(errors[True]) > 1.01, errors  # the check can fail: samples that see each other are caught
