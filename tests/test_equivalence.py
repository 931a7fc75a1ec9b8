"""Packed forward == padded batched forward, token by token, for every family vlm-pack supports.

CPU, fp32, tiny random models built from config (init std 0.2 so that a packing mistake moves the
log-probs visibly), the locally built tokenizer and the real HF image processors. Each positive case must
reach token_mult_prob_error <= 1.0001; each negative control (the mistakes packing setups really make)
must fail the harness.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from vlm_pack import offline
from vlm_pack.collate.collator import PackingCollator
from vlm_pack.collate.remap import remap_cu_seqlens
from vlm_pack.processing import process_sample
from vlm_pack.testing import (
    CollapsedLlavaModel,
    PackedEquivalenceError,
    check_packed_equivalence,
    collapsed_batched_forward,
    collapsed_packed_forward,
    default_packed_forward,
    next_token_logprobs,
    pad_samples,
    token_mult_prob_error,
)

TOL = 1.0001
WRONG = 1.01  # every negative control must be clearly off, not merely above the tolerance

# Qwen images capped so that each gives 4-64 vision tokens (min/max pixels of the processor).
_OVERRIDES = {
    "qwen2_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
    "qwen2_5_vl": dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
    "qwen3_vl": dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}),
    "llava": {},
    "llava_next": {},
}
# (width, height): mixed aspect ratios. LLaVA-NeXT: tall images select the cheap 1008x336 pinpoints.
_SIZES = {
    "qwen": [(90, 60), (56, 56), (200, 70), (64, 150), (128, 128), (33, 47), (300, 100), (75, 75)],
    "llava_next": [(40, 300), (50, 100), (30, 200), (60, 240)],
}
_WORDS = "the red car on a street near two people with a dog and a tall building in the sky".split()


def _image(width: int, height: int, seed: int) -> Image.Image:
    """A real RGB picture: a noisy gradient with a few shapes (what a JPEG decoder would hand over)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], -1)
    noise = rng.integers(0, 64, (height, width, 3))
    im = Image.fromarray(((base + noise) % 256).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        draw.ellipse([x0, y0, x0 + width // 3, y0 + height // 3], fill=fill)
    return im


def _conversation(k: int, num_images: int) -> list[dict]:
    rng = np.random.default_rng(1000 + k)
    question = " ".join(rng.choice(_WORDS, 3 + k % 5))
    answer = " ".join(rng.choice(_WORDS, 4 + (7 * k) % 11)) + "."
    return [
        {"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": question}]},
        {"role": "assistant", "content": answer},
    ]


# Images per sample, cycled: text-only, one image, several images of different sizes.
_IMAGE_COUNTS = (0, 1, 3, 1, 2, 0, 1, 2)
_LLAVA_COUNTS = (0, 1, 2, 1)


@functools.cache
def _tokenizer(family: str):
    return offline.build_tokenizer(family)


@functools.cache
def _model(family: str, attn: str = "sdpa"):
    return offline.tiny_model(
        family, _tokenizer(family), attn_implementation=attn, initializer_range=0.2, seed=0
    )


@functools.cache
def _samples(family: str, n: int, layout: str = "expanded") -> tuple:
    tok = _tokenizer(family)
    proc = offline.image_processor(family, **_OVERRIDES[family])
    counts = _LLAVA_COUNTS if family.startswith("llava") else _IMAGE_COUNTS
    pool = _SIZES["llava_next"] if family == "llava_next" else _SIZES["qwen"]
    out = []
    for k in range(n):
        m = counts[k % len(counts)]
        images = [_image(*pool[(k + j) % len(pool)], seed=100 * k + j) for j in range(m)]
        out.append(
            process_sample(
                images, _conversation(k, m), tokenizer=tok, image_processor=proc, family=family, layout=layout
            )
        )
    return tuple(out)


def _collator(family: str, samples, per_pack: int, **kwargs) -> PackingCollator:
    model = _model(family)
    longest = sorted((len(s["input_ids"]) for s in samples), reverse=True)[:per_pack]
    m = kwargs.get("pad_to_multiple_of", 1)
    capacity = sum(-(-n // m) * m for n in longest)
    return PackingCollator(
        capacity,
        tokenizer=_tokenizer(family),
        model_config=model.config,
        max_samples_per_bin=per_pack,
        **kwargs,
        max_rows=None,
    )


def _check(family: str, n: int, per_pack: int, attn: str = "sdpa", **kwargs):
    samples = list(_samples(family, n))
    collator = _collator(family, samples, per_pack)
    batch = collator(samples)
    # the case really packs per_pack samples into a row (and 1 per row gives n rows)
    assert int(torch.bincount(batch.row_of_sample).max()) == per_pack
    report = check_packed_equivalence(
        _model(family, attn),
        samples,
        None,
        packed_batch=batch,
        style=attn,
        tokenizer=_tokenizer(family),
        **kwargs,
    )
    return report, batch


# ------------------------------------------------------------------------------------------ the metric


def test_token_mult_prob_error_is_nemo_rl_definition():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]], dtype=torch.float64)
    b = torch.tensor([[-1.0, -2.5, -3.0], [-0.5, -0.1, -1e9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    want = (1 + math.exp(0.5) + 1 + 1 + math.exp(0.4)) / 5
    assert float(token_mult_prob_error(a, b, mask)) == pytest.approx(want, rel=1e-12)
    # identical log-probs: exactly 1; an ignored token never turns the metric into inf/nan
    assert float(token_mult_prob_error(a, a)) == 1.0
    with pytest.raises(ValueError, match="no token"):
        token_mult_prob_error(a, b, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="shape"):
        token_mult_prob_error(a, b[:, :2])


def test_next_token_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    got = next_token_logprobs(logits, ids)
    want = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(got[:, :-1], want)
    assert torch.equal(got[:, -1], torch.zeros(2))


def test_pad_samples_right_pads_and_concatenates_vision():
    samples = list(_samples("qwen2_vl", 3))
    inputs = pad_samples(samples, pad_token_id=7)
    lengths = [len(s["input_ids"]) for s in samples]
    assert inputs["input_ids"].shape == (3, max(lengths))
    for r, s in enumerate(samples):
        assert torch.equal(inputs["input_ids"][r, : lengths[r]], s["input_ids"])
        assert (inputs["input_ids"][r, lengths[r] :] == 7).all()
        assert int(inputs["attention_mask"][r].sum()) == lengths[r]
    grids = [s["image_grid_thw"] for s in samples if "image_grid_thw" in s]
    assert torch.equal(inputs["image_grid_thw"], torch.cat(grids))


# ------------------------------------------------------------------------- HF models, expanded layout

# (family, samples, per pack): every family at 1 and 4 per pack; 16 per pack on the cheapest family.
_CASES = [
    ("qwen2_vl", 4, 1),
    ("qwen2_vl", 8, 4),
    ("qwen2_vl", 16, 16),
    ("qwen2_5_vl", 4, 1),
    ("qwen2_5_vl", 8, 4),
    ("qwen3_vl", 4, 1),
    ("qwen3_vl", 8, 4),
    ("llava", 4, 1),
    ("llava", 4, 4),
    ("llava_next", 4, 1),
    ("llava_next", 4, 4),
]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("family", "n", "per_pack"), _CASES, ids=[f"{f}-{n}x{p}" for f, n, p in _CASES])
@pytest.mark.slow
def test_hf_packed_matches_batched(family, n, per_pack, attn):
    report, _ = _check(family, n, per_pack, attn)
    assert report.passed, str(report)
    assert report.metric <= TOL
    assert report.num_samples == n and len(report.samples) == n
    assert report.num_tokens == sum(len(s["input_ids"]) - 1 for s in _samples(family, n))
    if attn == "eager":  # same kernels, same reductions: packing changes nothing at all
        assert report.max_abs_diff < 1e-5, str(report)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "llava_next"])
@pytest.mark.slow
def test_cp_padding_keeps_real_tokens_exact(family):
    """pad_to_multiple_of=8 (2 * CP with CP=4): padding between samples changes no real token."""
    samples = list(_samples(family, 4))
    collator = _collator(family, samples, 4, pad_to_multiple_of=8)
    batch = collator(samples)
    spans = batch.cu_seqlens_padded.diff()
    assert (spans % 8 == 0).all()
    assert int(spans.sum()) > int(batch.seq_lens.sum()), "the case must actually insert padding"
    report = check_packed_equivalence(_model(family), samples, collator)
    assert report.passed, str(report)


@pytest.mark.slow
def test_label_tokens_only():
    """targets="labels" scores what the loss sees: the assistant tokens, fewer than all transitions."""
    samples = list(_samples("qwen2_vl", 4))
    collator = _collator("qwen2_vl", samples, 4, pad_to_multiple_of=8)
    report = check_packed_equivalence(_model("qwen2_vl"), samples, collator, targets="labels")
    assert report.passed, str(report)
    want = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    assert report.num_tokens == want > 0


# ---------------------------------------------------------------------------------- negative controls


def _positions_as_one_sequence(model, batch):
    """The classic mistake: position ids computed for the whole row, as if it were one sample."""
    kwargs = dict(batch.model_inputs("sdpa"))
    pos = kwargs["position_ids"]
    rows, length = batch.input_ids.shape
    arange = torch.arange(length).expand(rows, length)
    if pos.dim() == 3:  # Qwen: the mRoPE of the whole row, from the model itself
        rope, _ = model.model.get_rope_index(
            batch.input_ids, mm_token_type_ids=batch.mm_token_type_ids, image_grid_thw=batch.image_grid_thw
        )
        kwargs["position_ids"] = torch.cat([arange[None], rope])
    else:
        kwargs["position_ids"] = arange
    return model(**kwargs).logits


def _three_row_mrope(model, batch):
    """Qwen-VL's usual 3-row mRoPE ids: transformers then finds no text row to detect the packing from."""
    kwargs = dict(batch.model_inputs("sdpa"))
    kwargs["position_ids"] = kwargs["position_ids"][1:]
    return model(**kwargs).logits


def _with_attention_mask(model, batch):
    """An all-ones attention_mask next to packed rows: transformers then skips packed-mask detection."""
    kwargs = dict(batch.model_inputs("sdpa"))
    kwargs["attention_mask"] = torch.ones_like(batch.input_ids)
    return model(**kwargs).logits


_CONTROLS = [
    ("qwen2_vl", "positions", _positions_as_one_sequence),
    ("llava_next", "positions", _positions_as_one_sequence),
    ("qwen2_vl", "use_cache", default_packed_forward("sdpa", use_cache=None)),
    ("llava", "use_cache", default_packed_forward("sdpa", use_cache=None)),
    ("qwen2_vl", "3-row mrope", _three_row_mrope),
    ("qwen3_vl", "3-row mrope", _three_row_mrope),
    ("qwen2_5_vl", "attention_mask", _with_attention_mask),
]


@pytest.mark.parametrize(
    ("family", "mistake", "forward"), _CONTROLS, ids=[f"{f}-{m}" for f, m, _ in _CONTROLS]
)
@pytest.mark.slow
def test_negative_controls_fail_the_harness(family, mistake, forward):
    if mistake == "use_cache":  # what the model does when the caller leaves use_cache out
        assert _model(family).config.get_text_config().use_cache is True
    report, _ = _check(family, 4, 4, packed_forward=forward)
    assert not report.passed
    assert report.metric > WRONG, str(report)
    assert "FAIL" in str(report) and "usual causes" in str(report)
    with pytest.raises(PackedEquivalenceError, match="token_mult_prob_error"):
        report.raise_if_failed()


# ------------------------------------------------------------------------------------ the report


def test_report_is_readable_and_names_worst_tokens():
    report, batch = _check("qwen2_vl", 8, 4)
    text = str(report)
    assert text.splitlines()[0].startswith("packed-vs-batched equivalence (sdpa): PASS")
    assert f"8 samples packed into {batch.num_rows} row(s)" in text
    assert "worst tokens:" in text and "worst samples:" in text
    assert len(report.worst_tokens) == 5
    worst = report.worst_tokens[0]
    assert worst.abs_diff == pytest.approx(report.max_abs_diff)
    assert worst.token is not None  # named by the tokenizer
    report.raise_if_failed()  # passing: no exception


@pytest.mark.slow
def test_processor_outputs_and_a_trainer_style_collator():
    """What a user hands over first: HF processor outputs ([1, L] tensors, attention_mask) and the
    collator they train with (return_style="sdpa" returns model kwargs, not a PackedBatch)."""
    proc = offline.processor("llava", tokenizer=_tokenizer("llava"))
    samples = [
        dict(
            proc(
                images=[_image(60, 40, 1)],
                text="USER: <image>\nwhat is it ASSISTANT: a car",
                return_tensors="pt",
            )
        ),
        dict(proc(text="USER: hello there ASSISTANT: hi", return_tensors="pt")),
        dict(
            proc(
                images=[_image(50, 90, 2)],
                text="USER: <image>\nand this ASSISTANT: a dog",
                return_tensors="pt",
            )
        ),
    ]
    assert samples[0]["input_ids"].shape[0] == 1 and "attention_mask" in samples[0]
    collator = PackingCollator(
        sum(s["input_ids"].shape[1] for s in samples),
        tokenizer=proc,
        model_config=_model("llava").config,
        return_style="sdpa",
    )
    report = check_packed_equivalence(_model("llava"), samples, collator)
    assert report.passed, str(report)
    assert report.num_tokens == sum(s["input_ids"].shape[1] - 1 for s in samples)


def test_report_flags_samples_missing_from_the_packed_batch():
    family = "qwen2_vl"
    samples = list(_samples(family, 4))
    collator = _collator(family, samples, 4)
    wrong_batch = collator(samples[1:])  # a batch that lost sample 3's place and shifted the others
    report = check_packed_equivalence(_model(family), samples, None, packed_batch=wrong_batch)
    assert not report.passed
    assert any("not in the packed batch" in p and "[3]" in p for p in report.problems)
    assert any("are not the sample's" in p for p in report.problems)
    assert "structural problem" in report.message


# ------------------------------------------------------ Megatron-style collapsed model and the remap


@functools.cache
def _collapsed():
    tok = _tokenizer("llava_next")
    model = CollapsedLlavaModel.tiny(tok, family="llava_next", image_size=56)
    proc = offline.image_processor("llava_next", **model.image_processor_overrides())
    return tok, model, proc


@functools.cache
def _collapsed_samples(n: int, layout: str = "collapsed") -> tuple:
    tok, _, proc = _collapsed()
    pool = [(90, 60), (40, 120), (200, 100), (64, 64), (150, 50), (50, 150)]
    out = []
    for k in range(n):
        m = _IMAGE_COUNTS[k % len(_IMAGE_COUNTS)]
        images = [_image(*pool[(k + j) % len(pool)], seed=7 * k + j) for j in range(m)]
        out.append(
            process_sample(
                images,
                _conversation(k, m),
                tokenizer=tok,
                image_processor=proc,
                family="llava_next",
                layout=layout,
            )
        )
    return tuple(out)


@pytest.mark.slow
def test_collapsed_model_is_the_hf_model():
    """CollapsedLlavaModel on collapsed ids == LlavaNextForConditionalGeneration on the expanded ids."""
    _, model, _ = _collapsed()
    collapsed = _collapsed_samples(3)
    expanded = _collapsed_samples(3, "expanded")
    # tiles make the embeddings per image vary: the point of the collapsed layout's tokens_per_image
    assert len({int(t) for s in collapsed for t in s["tokens_per_image"]}) > 2
    with torch.no_grad():
        for c, e in zip(collapsed, expanded):
            inputs = pad_samples([c])
            out = model(
                inputs["input_ids"],
                pixel_values=inputs.get("pixel_values"),
                image_sizes=inputs.get("image_sizes"),
                attention_mask=inputs["attention_mask"],
                tokens_per_image=c["tokens_per_image"],
            )
            hf = pad_samples([e])
            hf.pop("attention_mask")
            want = model.model(**hf, use_cache=False).logits
            assert out.logits.shape == want.shape
            torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)
            # token_index points each collapsed token at its (last) expanded slot
            assert torch.equal(e["input_ids"][out.token_index[0]], c["input_ids"])


def _expanded_length_by_loop(ids: list[int], tokens_per_image: list[int], image_token_id: int) -> int:
    length, image = 0, 0
    for token in ids:
        if token == image_token_id:
            length += tokens_per_image[image]
            image += 1
        else:
            length += 1
    assert image == len(tokens_per_image)
    return length


@pytest.mark.parametrize("per_pack", [1, 4, 16])
@pytest.mark.slow
def test_collapsed_model_needs_remapped_cu_seqlens(per_pack):
    """Megatron's LLaVA bug (seed 004): collapsed cu_seqlens after expansion are wrong; remapped are exact.
    The model attends through varlen attention (its default), as Megatron's THD path does."""
    tok, model, _ = _collapsed()
    n = max(per_pack, 4)
    samples = list(_collapsed_samples(n))
    longest = sorted((len(s["input_ids"]) + int(s["tokens_per_image"].sum()) for s in samples), reverse=True)
    collator = PackingCollator(
        sum(longest[:per_pack]),
        tokenizer=tok,
        model_config=model.config,
        layout="collapsed",
        max_samples_per_bin=per_pack,
        max_rows=None,
    )
    batch = collator(samples)
    assert batch.input_ids.shape[0] == 1 and batch.layout == "collapsed"
    kwargs = dict(batched_forward=collapsed_batched_forward, packed_batch=batch, tokenizer=tok)
    right = check_packed_equivalence(
        model, samples, None, packed_forward=collapsed_packed_forward(), **kwargs
    )
    assert right.passed and right.metric <= TOL, str(right)
    # Independent oracle: each sample expanded by a plain loop over its collapsed ids (every placeholder
    # becomes its image's embeddings, a count the vision tower confirmed in the harness run above); a
    # pack of `capacity` expanded tokens holds its samples back to back, the last owning the pack's tail.
    # The collator's boundaries and remap_cu_seqlens must both land there.
    lengths = [
        _expanded_length_by_loop(
            s["input_ids"].tolist(), s["tokens_per_image"].tolist(), model.image_token_id
        )
        for s in samples
    ]
    hf_expanded = _collapsed_samples(3, "expanded")  # the HF processor's own expansion agrees
    assert lengths[:3] == [len(e["input_ids"]) for e in hf_expanded]
    want_real, want_padded, offset = [0], [0], 0
    order, rows = batch.sample_index.tolist(), batch.row_of_sample.tolist()
    for k, (i, row) in enumerate(zip(order, rows)):
        offset += lengths[i]
        want_real.append(want_real[-1] + lengths[i])
        row_ends = k + 1 == len(order) or rows[k + 1] != row
        want_padded.append((row + 1) * collator.capacity if row_ends else offset)
        if row_ends:
            offset = (row + 1) * collator.capacity
    assert batch.cu_seqlens_expanded.tolist() == want_real
    assert batch.cu_seqlens_padded_expanded.tolist() == want_padded
    remapped = remap_cu_seqlens(
        batch.cu_seqlens_padded, batch.input_ids, model.image_token_id, batch.tokens_per_image
    )
    assert remapped.tolist() == want_padded
    wrong = check_packed_equivalence(
        model, samples, None, packed_forward=collapsed_packed_forward("collapsed"), **kwargs
    )
    assert not wrong.passed and wrong.metric > WRONG, str(wrong)


@pytest.mark.slow
def test_collapsed_model_varlen_attention_is_the_mask_path():
    """attention="varlen" (vlm_pack.forward.attention through attn_implementation "vlm_pack_varlen") takes its
    boundaries from the cu_seqlens it is given: its logits are the dense block-diagonal mask path's for
    remapped and for collapsed cu_seqlens alike; only the remap makes the harness pass, with either."""
    tok, model, _ = _collapsed()
    assert model.attention == "varlen"  # the default
    samples = list(_collapsed_samples(4))
    batch = PackingCollator(
        sum(len(s["input_ids"]) + int(s["tokens_per_image"].sum()) for s in samples),
        tokenizer=tok,
        model_config=model.config,
        layout="collapsed",
        max_samples_per_bin=4,
    )(samples)
    inputs = dict(pixel_values=batch.pixel_values, image_sizes=batch.image_sizes)
    lm_config = model.model.model.language_model.config
    with torch.no_grad():
        for cu in (batch.cu_seqlens_padded_expanded, batch.cu_seqlens_padded):
            varlen = model(batch.input_ids, cu_seqlens=cu, attention="varlen", **inputs).logits
            mask = model(batch.input_ids, cu_seqlens=cu, attention="mask", **inputs).logits
            torch.testing.assert_close(varlen, mask, rtol=1e-5, atol=1e-5)
        # the varlen kernels really run on the given boundaries: they reject a non-monotonic cu_seqlens
        bad = batch.cu_seqlens_padded_expanded.clone()
        bad[[1, 2]] = bad[[2, 1]]
        with pytest.raises(ValueError, match="non-decreasing"):
            model(batch.input_ids, cu_seqlens=bad, **inputs)
        with pytest.raises(ValueError, match="expanded row"):  # boundaries past the expanded row
            model(batch.input_ids, cu_seqlens=batch.cu_seqlens_padded_expanded + 1, **inputs)
    # only the text model switched, and only for those calls: the CLIP tower and the reference keep sdpa
    assert lm_config._attn_implementation == "sdpa"
    assert model.model.model.vision_tower.config._attn_implementation == "sdpa"
    # varlen through the harness: test_collapsed_model_needs_remapped_cu_seqlens; here the mask path
    kwargs = dict(batched_forward=collapsed_batched_forward, packed_batch=batch)
    right = check_packed_equivalence(
        model, samples, None, packed_forward=collapsed_packed_forward("remapped", "mask"), **kwargs
    )
    assert right.passed and right.metric <= TOL, str(right)
    wrong = check_packed_equivalence(
        model, samples, None, packed_forward=collapsed_packed_forward("collapsed", "mask"), **kwargs
    )
    assert not wrong.passed and wrong.metric > WRONG, str(wrong)
    with pytest.raises(ValueError, match=r"'varlen'.*'mask'"):
        collapsed_packed_forward(attention="flash")


@pytest.mark.slow
def test_collapsed_model_with_cp_padding():
    tok, model, _ = _collapsed()
    samples = list(_collapsed_samples(4))
    collator = PackingCollator(
        1024,
        tokenizer=tok,
        model_config=model.config,
        layout="collapsed",
        pad_to_multiple_of=8,
        max_samples_per_bin=2,
        max_rows=None,
    )
    batch = collator(samples)
    assert (batch.cu_seqlens_padded_expanded.diff() % 8 == 0).all()
    assert int(batch.cu_seqlens_padded_expanded[-1]) > int(batch.seq_lens_expanded.sum())  # real padding
    report = check_packed_equivalence(
        model,
        samples,
        None,
        packed_batch=batch,
        batched_forward=collapsed_batched_forward,
        packed_forward=collapsed_packed_forward("batch"),
    )
    assert report.passed, str(report)


# ------------------------------------------------------------------------------- GPU (bf16, varlen)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["varlen", "flash_attention_2"])
def test_bf16_varlen_on_gpu(attn):
    """bf16 packed rows through varlen kernels vs the padded sdpa batch: within 3x the bf16 noise floor,
    and the broken-positions control still fails that tolerance (see benchmarks/RESULTS.md)."""
    import importlib.util
    from pathlib import Path

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    path = Path(__file__).resolve().parents[1] / "examples" / "check_equivalence.py"
    spec = importlib.util.spec_from_file_location("check_equivalence", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = ["--device", "cuda", "--dtype", "bfloat16", "--attn", attn]
    assert example.main(common) == 0
    assert example.main([*common, "--mistake", "positions"]) == 1


if __name__ == "__main__":  # the figures of benchmarks/RESULTS.md, section "equivalence"
    rows = []
    for family, n, per_pack in _CASES:
        for attn in ("sdpa", "eager"):
            r, _ = _check(family, n, per_pack, attn)
            rows.append((f"{family} {n} samples, {per_pack}/pack, {attn}", r))
    for family, mistake, forward in _CONTROLS:
        r, _ = _check(family, 4, 4, packed_forward=forward)
        rows.append((f"CONTROL {family} {mistake}", r))
    tok, cmodel, _ = _collapsed()
    for per_pack in (1, 4, 16):
        samples = list(_collapsed_samples(max(per_pack, 4)))
        longest = sorted(
            (len(s["input_ids"]) + int(s["tokens_per_image"].sum()) for s in samples), reverse=True
        )
        batch = PackingCollator(
            sum(longest[:per_pack]),
            tokenizer=tok,
            model_config=cmodel.config,
            layout="collapsed",
            max_samples_per_bin=per_pack,
            max_rows=None,
        )(samples)
        for how in ("remapped", "collapsed"):
            r = check_packed_equivalence(
                cmodel,
                samples,
                None,
                packed_batch=batch,
                batched_forward=collapsed_batched_forward,
                packed_forward=collapsed_packed_forward(how),
            )
            rows.append(
                (f"collapsed LLaVA-NeXT {len(samples)} samples, {per_pack}/pack, varlen, cu_seqlens {how}", r)
            )
    print("| case | token_mult_prob_error | max abs dlogp | tokens | verdict |\n|---|---|---|---|---|")
    for name, r in rows:
        verdict = "PASS" if r.passed else "FAIL"
        print(f"| {name} | {r.metric:.7f} | {r.max_abs_diff:.2g} | {r.num_tokens} | {verdict} |")
