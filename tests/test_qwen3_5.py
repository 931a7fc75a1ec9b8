"""Qwen3.5 / 3.6 (``qwen3_5``, ``qwen3_5_moe``): forecast, positions and packed = alone, gated delta-net and
experts included.

Tiny random models of the genuine transformers classes (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``; 3 gated delta-net layers + 1 attention layer as released, init std 0.2),
the real ``Qwen3VLProcessor`` with the released checkpoint's settings (a lower pixel cap where noted, same rule)
and Qwen3.5's chat template (``tests/templates/qwen3_5.jinja``). Oracles: the processor's own ``__call__``
(lengths), the model's own ``get_rope_index`` (positions), each sample run alone through the model
(log-probs), transformers' own ``load_balancing_loss_func`` on the real tokens' router logits (aux loss).
Controls: the same packed rows without ``isolate_token_mixers`` (boundaries kept from the attention layer
only, transformers' PyTorch path) leak; the aux loss counted over the padded row differs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers import ProcessorMixin

import vlm_pack as vp
from vlm_pack import offline
from vlm_pack._compat import release
from vlm_pack.collate.collator import PackingCollator
from vlm_pack.families import family as record_of
from vlm_pack.processing import forecast_length, process_sample
from vlm_pack.testing import check_packed_equivalence, default_packed_forward
from vlm_pack.vision import vision_spec

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3_5.jinja").read_text()
FAMILIES = ("qwen3_5", "qwen3_5_moe")
# transformers 5.6.x's Qwen3_5MoeTextModel.forward (models/qwen3_5_moe/modeling_qwen3_5_moe.py) builds its masks
# from a 2-D attention_mask only: it takes no mask mapping, which a packed Qwen3.5-MoE row passes so that the
# router loss counts real tokens only ('MaskMapping' object has no attribute 'ndim'); 5.18 takes one
# (`if not isinstance(attention_mask, dict)`). Qwen3.5-MoE is supported from 5.18 (docs/versions.md).
MOE_MASKS = pytest.mark.skipif(
    release(transformers.__version__)[:2] < (5, 18),
    reason=f"transformers {transformers.__version__}: Qwen3.5-MoE's text model takes no mask mapping "
    "(modeling_qwen3_5_moe.py); supported from 5.18",
)
WITH_MOE = ["qwen3_5", pytest.param("qwen3_5_moe", marks=MOE_MASKS)]
TOL, MAX_ABS = 1.0001, 1e-3
CAP = dict(size={"shortest_edge": 4 * 32 * 32, "longest_edge": 48 * 32 * 32})  # fewer tokens, same rule
SIZES = [[(90, 60), (40, 110)], [(50, 140)], []]  # sample 0: two images, 1: one, 2: text only
_QUESTIONS = ["what is the red car near", "describe the picture", "count the people on the street"]
_ANSWERS = ["the dog is left of the tall building", "two people with a dog", "three cats and a house"]
PAD_TAIL = 24  # the packed row ends in padding: it must reach neither the loss nor the router


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _conversation(k: int, num_images: int) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": _QUESTIONS[k]}]},
        {"role": "assistant", "content": _ANSWERS[k]},
    ]


@functools.cache
def _processor(family: str, capped: bool = True):
    tok = offline.build_tokenizer(family)
    return offline.processor(family, tok, chat_template=TEMPLATE, **(CAP if capped else {}))


@functools.cache
def _samples(family: str) -> tuple:
    images = [[_image(w, h, seed=10 * k + j) for j, (w, h) in enumerate(sizes)] for k, sizes in enumerate(SIZES)]
    proc = _processor(family)
    return tuple(process_sample(images[k], _conversation(k, len(SIZES[k])), processor=proc) for k in range(3))


def _model(family: str, attn: str = "sdpa", isolated: bool = True):
    model = offline.tiny_model(
        family, _processor(family).tokenizer, attn_implementation=attn, initializer_range=0.2, seed=0, num_layers=4
    )
    return vp.isolate_token_mixers(model) if isolated else model


@functools.cache
def _batch(family: str):
    samples = _samples(family)
    total = sum(len(s["input_ids"]) for s in samples)
    collator = PackingCollator(
        total + PAD_TAIL, model_config=_model(family, isolated=False).config, tokenizer=_processor(family)
    )
    batch = collator(list(samples))
    assert batch.num_rows == 1 and batch.num_samples == 3 and batch.row_length >= total + PAD_TAIL
    return batch


def _check(family: str, model, style: str, **kwargs):
    return check_packed_equivalence(
        model,
        list(_samples(family)),
        None,
        packed_batch=_batch(family),
        style=style,
        batch_size=1,  # the reference: each sample alone, with exactly its processor's tensors
        tokenizer=_processor(family).tokenizer,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------- registry


def test_names_and_records():
    for spelling in ("Qwen3.5", "qwen3.5", "QWEN-3.5", "Qwen3.6", "qwen3_5"):
        assert record_of(spelling).name == "qwen3_5"
    for spelling in ("Qwen3.5-MoE", "qwen3.6 moe", "qwen3_5_moe"):
        assert record_of(spelling).name == "qwen3_5_moe"
    for name in FAMILIES:
        record = record_of(name)
        assert record.token_mixers == ("gated_delta_net",) and record.mrope == "qwen3_vl"
        assert record.wraps == "template" and record.image_token == "<|image_pad|>"
    assert record_of("qwen3_5_moe").experts and not record_of("qwen3_5").experts


# ---------------------------------------------------------------------------------------------- forecast

# (width, height): tiny, odd, square, huge, and aspect ratios up to the processor's limit of 200
MANY_SIZES = [
    (1, 1), (7, 3), (31, 33), (32, 32), (100, 75), (640, 480), (1920, 1080), (1080, 1920), (4096, 4096),
    (6000, 4000), (3000, 16), (16, 3000), (2000, 11), (199 * 20, 20),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_forecast_is_the_processors_own_length_on_many_sizes(family):
    """Released settings (65536..16777216 pixels): the spec's count and the forecast length equal what
    ``Qwen3VLProcessor.__call__`` makes of the rendered prompt, for every size."""
    proc = _processor(family, capped=False)
    spec = vision_spec(family)
    assert spec.family == family
    for width, height in MANY_SIZES:
        conversation = _conversation(1, 1)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _QUESTIONS[1]}]}]
        messages.append({"role": "assistant", "content": [{"type": "text", "text": _ANSWERS[1]}]})
        text = ProcessorMixin.apply_chat_template(proc, messages)
        enc = proc(text=[text], images=[Image.new("RGB", (width, height), (9, 99, 199))])
        grid = enc["image_grid_thw"][0].tolist()
        assert spec.num_tokens(width, height) == grid[0] * grid[1] * grid[2] // 4, (width, height)
        length, counts = forecast_length(conversation, [(width, height)], processor=proc)
        assert (length, counts) == (len(enc["input_ids"][0]), [grid[0] * grid[1] * grid[2] // 4]), (width, height)


@pytest.mark.parametrize("size", [(201 * 16, 16), (16, 4000)])
def test_aspect_ratios_the_processor_refuses_are_refused_by_the_forecast(size):
    with pytest.raises(ValueError):
        _processor("qwen3_5", capped=False)(text=["<|image_pad|>"], images=[Image.new("RGB", size)])
    with pytest.raises(ValueError, match="qwen3_5"):
        vision_spec("qwen3_5").num_tokens(*size)


# ---------------------------------------------------------------------------------------------- positions


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_are_the_models_get_rope_index_per_sample(family, assert_rope_index_per_sample):
    assert_rope_index_per_sample(_model(family, isolated=False), _batch(family), _samples(family), SIZES)


# ------------------------------------------------------------------------------------ packed == alone

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", WITH_MOE)
@pytest.mark.slow
def test_packed_row_matches_each_sample_alone(family, attn):
    report = _check(family, _model(family, attn), attn)
    print(f"{family} {attn}: token_mult_prob_error {report.metric:.7f} max|dlogp| {report.max_abs_diff:.2e}")
    assert report.passed and report.metric <= TOL and report.max_abs_diff <= MAX_ABS, str(report)
    assert report.num_samples == 3


@pytest.mark.parametrize("family", WITH_MOE)
@pytest.mark.slow
def test_flash_style_inputs_match_each_sample_alone(family):
    """``model_inputs("flash_attention_2")`` (``[1, R*T]``, ``cu_seq_lens_q/k``) through vlm-pack's varlen
    attention, which isolates the mixers from ``cu_seq_lens_q``; reference: each sample alone in sdpa."""
    from vlm_pack.forward.attention import use_varlen_attention

    model = use_varlen_attention(_model(family, isolated=False))
    alone = _model(family, isolated=False)
    report = _check(
        family,
        model,
        "flash_attention_2",
        batched_forward=lambda _, inputs: alone(**inputs, use_cache=False).logits,
        packed_forward=default_packed_forward("flash_attention_2"),
    )
    print(f"{family} flash-style: token_mult_prob_error {report.metric:.7f} max|dlogp| {report.max_abs_diff:.2e}")
    assert report.passed and report.metric <= TOL and report.max_abs_diff <= MAX_ABS, str(report)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", WITH_MOE)
@pytest.mark.slow
def test_control_without_isolated_mixers_leaks(family, attn):
    """The same rows, boundaries kept from the attention layer only (transformers' PyTorch path): the
    delta-net state and short convolution carry each sample into the next."""
    report = _check(family, _model(family, attn, isolated=False), attn)
    print(f"{family} {attn} leaking: token_mult_prob_error {report.metric:.7f}")
    assert not report.passed and report.metric > TOL, str(report)


# ------------------------------------------------------------------------------------ experts: the router


@MOE_MASKS
@pytest.mark.slow
def test_moe_aux_loss_of_a_padded_packed_row_counts_the_real_tokens_only():
    """Oracle: transformers' own ``load_balancing_loss_func`` on the router logits of the real tokens only
    (the row's padding tail dropped). Control: the same logits counted over the whole row, as a packed row
    without a padding mask is counted, differ."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    from vlm_pack.forward.attention import use_varlen_attention

    batch = _batch("qwen3_5_moe")
    models = {
        "sdpa": _model("qwen3_5_moe", "sdpa"),
        "eager": _model("qwen3_5_moe", "eager"),
        "flash_attention_2": use_varlen_attention(_model("qwen3_5_moe", isolated=False)),
    }
    text = models["sdpa"].config.text_config
    real = batch.cu_seqlens.tolist()[-1]  # one row: the real tokens are its first `real`
    assert batch.row_length - real >= PAD_TAIL
    for style, model in models.items():
        kwargs = dict(batch.model_inputs(style))
        with torch.no_grad():
            out = model(**kwargs, output_router_logits=True)
        logits = out.router_logits
        assert len(logits) == text.num_hidden_layers and logits[0].shape[0] == batch.row_length
        want = load_balancing_loss_func(tuple(g[:real] for g in logits), text.num_experts, text.num_experts_per_tok)
        counted_padding = load_balancing_loss_func(logits, text.num_experts, text.num_experts_per_tok)
        assert torch.allclose(out.aux_loss, want, atol=1e-6, rtol=1e-6), style
        assert abs(float(counted_padding) - float(want)) > 1e-4, style
        # the loss the trainer sees (labels are in the inputs) adds the coefficient times that aux loss
        ce = torch.nn.functional.cross_entropy(
            out.logits.reshape(-1, out.logits.shape[-1])[:-1], kwargs["labels"].reshape(-1)[1:], ignore_index=-100
        )
        assert torch.allclose(out.loss, ce + text.router_aux_loss_coef * want, atol=1e-5), style


def test_moe_rows_on_a_release_without_the_mask_mapping_say_which_release_to_install(monkeypatch):
    """Below 5.18 Qwen3.5-MoE takes a 2-D attention_mask only: model_inputs names the release to install
    instead of an AttributeError inside the model."""
    from vlm_pack import _compat

    batch = _batch("qwen3_5_moe")
    monkeypatch.setattr(_compat, "installed_transformers_version", lambda: "5.6.0")
    for style in ("sdpa", "flash_attention_2"):
        with pytest.raises(ValueError, match=r"qwen3_5_moe need transformers >= 5\.18: transformers 5\.6\.0"):
            batch.model_inputs(style)
    monkeypatch.setattr(_compat, "installed_transformers_version", lambda: "5.18.0")
    assert "attention_mask" in batch.model_inputs("sdpa")  # supported: the mask mapping goes in
