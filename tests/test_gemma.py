"""Gemma 3n end to end, and the Gemma 4 checks beyond the released 26B / 31B: the E2B / E4B (causal images) and
the mixture-of-experts text model.

Gemma 3n (``models/gemma3n/``): 256 tokens per image whatever its size (``Gemma3nProcessor``, the oracle for the
forecast and the template's ids), a MobileNetV5 tower from timm (so its model tests need timm + torchvision:
``@pytest.mark.torchvision``) and a text model whose AltUp, LAuReL, per-layer inputs and activation sparsity act
per token and whose image tokens attend causally: packed rows need only the sample boundaries of attention.
Three samples (two images, one, none) packed into ONE row give each sample's log-probs alone
(token_mult_prob_error <= 1.0001, fp32, CPU) through sdpa, eager and flash-style inputs; the control (the row
numbered as one sequence) fails.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import test_chat_templates as tct
import test_families as tf
import torch
from PIL import Image

from vlm_pack import offline
from vlm_pack.collate.collator import PackingCollator
from vlm_pack.forward.mixers import find_token_mixers
from vlm_pack.processing import forecast_length, process_sample
from vlm_pack.testing import check_packed_equivalence, default_packed_forward
from vlm_pack.vision import vision_spec, vision_spec_from_processor

TOL, MAX_ABS, WRONG = tf.TOL, tf.MAX_ABS, tf.WRONG
SIZES = [(20, 20), (90, 60), (640, 480), (768, 768), (1000, 57), (57, 1000), (3000, 40), (1337, 777), (4000, 3000)]


def _rgb(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


# ------------------------------------------------------------------------------ Gemma 3n: forecast, template


def test_gemma3n_forecast_is_the_processors_call():
    """Oracle: Gemma3nProcessor.__call__ with the released SiglipImageProcessor settings: 256 image tokens and
    the same 768 x 768 pixels for every size, wrapped in '\\n\\n<start_of_image>' ... '<end_of_image>\\n\\n'."""
    proc = offline.processor("gemma3n")
    spec = vision_spec_from_processor(proc)
    assert spec == vision_spec("gemma3n") == vision_spec("Gemma-3n")
    tok = proc.tokenizer
    for i, (w, h) in enumerate(SIZES):
        out = proc(text=f"hi {proc.image_token} x", images=[_rgb(w, h, i)], return_tensors="np")
        ids = out["input_ids"][0]
        assert (ids == proc.image_token_id).sum() == spec.num_tokens(w, h) == 256, (w, h)
        assert out["pixel_values"].shape == (1, 3, 768, 768)
        opened = list(ids).index(tok.convert_tokens_to_ids("<start_of_image>"))
        assert ids[opened + 257] == tok.convert_tokens_to_ids("<end_of_image>")
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
        length, counts = forecast_length(conversation, [(w, h)], processor=tct._processor("gemma3n"))
        s = process_sample([_rgb(w, h, i)], conversation, processor=tct._processor("gemma3n"))
        assert (length, counts) == (len(s["input_ids"]), [256]), (w, h)


def test_gemma3n_bare_siglip_image_processor_is_refused():
    with pytest.raises(ValueError, match=r"bare SiglipImageProcessorPil does not say which model.*full processor"):
        vision_spec_from_processor(offline.image_processor("gemma3n"))


@pytest.mark.slow
def test_gemma3n_released_template_gives_the_processors_ids_spans_and_forecast():
    """The released turn format (tests/templates/gemma3n.jinja) through Gemma3nProcessor: ids, trained spans
    (each reply and its <end_of_turn>) and forecast."""
    proc = tct._processor("gemma3n")
    for conversation, images in [(tct.MULTI, tct.IMAGES), (tct.SINGLE, tct.IMAGES[:1])]:
        text, ref = tct._oracle(proc, conversation, images)
        s = process_sample(images, conversation, processor=proc, key="shard-0/k")
        assert s["input_ids"].tolist() == ref
        assert s["labels"].tolist() == tct._expected_labels(proc.tokenizer, ref, conversation, "<end_of_turn>")
        length, counts = forecast_length(conversation, [im.size for im in images], processor=proc, key="k")
        assert (length, counts) == (len(ref), [256] * len(images))
        assert text.startswith("<bos><start_of_turn>user\n") and ref[1] != proc.tokenizer.bos_token_id
        assert "<image_soft_token>" in text and s["token_type_ids"].sum() == 256 * len(images)


# ------------------------------------------------------------------------------- Gemma 3n: packed == alone


@functools.cache
def _gemma3n(attn: str):
    """Four text layers: sliding / full, the last two sharing the first two's keys and values."""
    pytest.importorskip("torchvision")
    pytest.importorskip("timm")
    from vlm_pack._compat import timm_tower_without_sdpa

    if attn == "sdpa" and (why := timm_tower_without_sdpa()):
        pytest.skip(why)
    tok = tf._processor("gemma3n").tokenizer
    return offline.tiny_model("gemma3n", tok, attn_implementation=attn, initializer_range=0.2, num_layers=4)


def _gemma3n_check(attn: str, packed_forward=None, model=None, **kwargs):
    samples = list(tf._samples("gemma3n"))
    model = model if model is not None else _gemma3n(attn)
    collator = PackingCollator(
        sum(len(s["input_ids"]) for s in samples), model_config=model.config, tokenizer=tf._processor("gemma3n")
    )
    batch = collator(samples)
    assert batch.num_rows == 1 and batch.num_samples == 3
    return check_packed_equivalence(
        model, samples, None, packed_batch=batch, style=attn, batch_size=1, packed_forward=packed_forward, **kwargs
    )


@pytest.mark.torchvision
@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gemma3n_packed_row_matches_each_sample_alone(attn):
    report = _gemma3n_check(attn)
    assert report.passed and report.metric <= TOL and report.max_abs_diff <= MAX_ABS, str(report)
    assert [len(s["tokens_per_image"]) for s in tf._samples("gemma3n")] == [2, 1, 0]
    text = _gemma3n(attn).config.text_config
    if hasattr(type(text), "kv_sharing_modes"):
        assert text.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    else:  # transformers < 5.24 has no kv_sharing_modes (configuration_gemma3n.py): the last two layers share
        assert (text.num_hidden_layers, text.num_kv_shared_layers) == (4, 2)
    assert report.num_samples == 3


@pytest.mark.torchvision
@pytest.mark.slow
def test_gemma3n_control_row_numbered_as_one_sequence_fails():
    report = _gemma3n_check("sdpa", packed_forward=tf._positions_as_one_sequence)
    assert not report.passed and report.metric > WRONG, str(report)


@pytest.mark.torchvision
@pytest.mark.slow
def test_gemma3n_flash_style_inputs_through_varlen_attention_match_each_sample_alone():
    """Gemma 3n supports flash attention (no two-way image blocks): rows flattened with ``cu_seq_lens_q/k``
    on vlm-pack's varlen attention vs each sample alone through sdpa."""
    from vlm_pack.forward.attention import use_varlen_attention

    _gemma3n("sdpa")  # skips without timm / torchvision
    sdpa = _build("gemma3n", "sdpa", num_layers=4, **_WIDE)
    model = use_varlen_attention(_unwindowed(_build("gemma3n", "sdpa", num_layers=4, **_WIDE)))
    alone = dict(batched_forward=lambda _, inputs: sdpa(**inputs, use_cache=False).logits)
    report = _gemma3n_check("sdpa", model=model, packed_forward=default_packed_forward("flash_attention_2"), **alone)
    assert report.passed and report.max_abs_diff <= MAX_ABS, str(report)
    control = _gemma3n_check("sdpa", model=model, packed_forward=_flash_as_one_sequence, **alone)
    assert not control.passed and control.metric > WRONG, str(control)


def _flash_as_one_sequence(model, batch):
    """Control: the flash-style row given as ONE sequence (cu_seq_lens [0, T], positions 0..T-1)."""
    kwargs = dict(batch.model_inputs("flash_attention_2"), use_cache=False)
    length = kwargs["input_ids"].shape[-1]
    kwargs["position_ids"] = torch.arange(length)[None]
    for side in ("q", "k"):
        kwargs[f"cu_seq_lens_{side}"] = torch.tensor([0, length], dtype=torch.int32)
        kwargs[f"max_length_{side}"] = length
    return model(**kwargs).logits.reshape(*batch.input_ids.shape, -1)


@pytest.mark.torchvision
@pytest.mark.slow
def test_gemma3n_mixes_tokens_only_in_attention_and_its_images_attend_causally():
    """AltUp, LAuReL, per-layer inputs and the activation-sparsity top-k act per token: no token mixer to
    isolate. token_type_ids change nothing: image tokens attend causally (no two-way blocks as Gemma 3's)."""
    model = _gemma3n("sdpa")
    assert find_token_mixers(model) == []
    s = tf._samples("gemma3n")[1]
    inputs = dict(input_ids=s["input_ids"][None], pixel_values=s["pixel_values"], use_cache=False)
    with torch.no_grad():
        typed = model(**inputs, token_type_ids=s["token_type_ids"][None]).logits
        plain = model(**inputs).logits
    assert torch.equal(typed, plain)


# --------------------------------------------------- Gemma 4: E2B / E4B behaviour, mixture-of-experts text


def _build(family: str, attn: str, num_layers: int = 2, **text: object):
    """The tiny model of ``family`` with text-config fields replaced before the weights are made."""
    from vlm_pack.offline.models import _transformers_class

    tok = tf._processor(family).tokenizer
    config = offline.tiny_model_config(family, tok, initializer_range=0.2, num_layers=num_layers)
    for name, value in text.items():
        setattr(config.text_config, name, value)
    torch.manual_seed(0)
    cls = _transformers_class(family, "model")
    return cls._from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def _gemma4(attn: str, **text: object):
    return _build("gemma4", attn, **text)


# vlm-pack's CPU varlen attention has no sliding windows: the flash-style checks give the sliding layers a
# window wider than any row (the same attention as none), so they check the sample boundaries, not the window.
_WIDE = dict(sliding_window=4096)


def _unwindowed(model):
    """``model`` (windows wider than its rows) with its attention layers told they have none."""
    for module in model.modules():
        if getattr(module, "is_sliding", False):
            module.sliding_window = None
    return model


def _gemma4_check(model, attn: str, **kwargs):
    samples = list(tf._samples("gemma4"))
    collator = PackingCollator(
        sum(len(s["input_ids"]) for s in samples), model_config=model.config, tokenizer=tf._processor("gemma4")
    )
    batch = collator(samples)
    assert batch.num_rows == 1 and batch.num_samples == 3
    return check_packed_equivalence(model, samples, None, packed_batch=batch, style=attn, batch_size=1, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gemma4_causal_images_packed_row_matches_each_sample_alone(attn):
    """use_bidirectional_attention=None (google/gemma-4-E2B / E4B): images attend causally on every layer."""
    report = _gemma4_check(_gemma4(attn, use_bidirectional_attention=None), attn)
    assert report.passed and report.metric <= TOL and report.max_abs_diff <= MAX_ABS, str(report)


@pytest.mark.slow
def test_gemma4_causal_images_flash_style_inputs_match_each_sample_alone():
    from vlm_pack.forward.attention import use_varlen_attention

    model = use_varlen_attention(_unwindowed(_gemma4("sdpa", use_bidirectional_attention=None, **_WIDE)))
    sdpa = _gemma4("sdpa", use_bidirectional_attention=None, **_WIDE)
    report = _gemma4_check(
        model,
        "sdpa",
        packed_forward=default_packed_forward("flash_attention_2"),
        batched_forward=lambda _, inputs: sdpa(**inputs, use_cache=False).logits,
    )
    assert report.passed and report.max_abs_diff <= MAX_ABS, str(report)


@pytest.mark.slow
def test_gemma4_causal_images_control_one_causal_mask_over_the_row_fails():
    report = _gemma4_check(
        _gemma4("sdpa", use_bidirectional_attention=None), "sdpa", packed_forward=tf._row_causal_mask
    )
    assert not report.passed and report.metric > WRONG, str(report)


_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


@pytest.mark.slow
def test_gemma4_moe_packed_row_matches_each_sample_alone():
    """Gemma 4's mixture-of-experts text model (enable_moe_block: Gemma4TextRouter + Gemma4TextExperts beside
    the dense MLP). Its router computes no auxiliary loss (modeling_gemma4.py returns router_logits only on
    request): no padding can reach one, and the record sets no ``experts``."""
    from vlm_pack.families import family

    model = _gemma4("sdpa", **_MOE)
    assert any(type(m).__name__ == "Gemma4TextRouter" for m in model.modules())
    report = _gemma4_check(model, "sdpa")
    assert report.passed and report.metric <= TOL and report.max_abs_diff <= MAX_ABS, str(report)
    assert not family("gemma4").experts
