"""GLM-4.5V / 4.6V mixture-of-experts text models on packed rows: padding never reaches the router statistics
or the auxiliary loss, and each sample's per-token loss is the one it gets alone.

Rows padded on purpose (each sample to a multiple of 8, the row to twice the content), run through the tiny
``Glm4vMoeForConditionalGeneration`` / ``Glm46VForConditionalGeneration`` with ``output_router_logits=True``.
Oracles from outside vlm-pack: the model run on each sample alone, transformers' own
``load_balancing_loss_func`` on the concatenated router logits of the samples alone (no padding anywhere).
Control: the model's own ``aux_loss`` of the packed rows (no 2-D mask: transformers counts the padding).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_pack import offline
from vlm_pack.collate.collator import PackingCollator
from vlm_pack.families import family as record_of
from vlm_pack.forward.loss import token_cross_entropy
from vlm_pack.forward.routers import expert_load, load_balancing_loss, record_router_logits
from vlm_pack.processing import process_sample

TEMPLATES = Path(__file__).parent / "templates"
MOE = ("glm4v_moe", "glm46v")
_CAP = dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 48 * 28 * 28})
SIZES = [[(90, 60), (40, 110)], [(50, 140)], []]
_TEXT = [("what is the red car near", "the dog is left"), ("describe it", "two people"), ("count", "three cats")]


def _conversation(k: int) -> list[dict]:
    q, a = _TEXT[k]
    user = [{"type": "image"}] * len(SIZES[k]) + [{"type": "text", "text": q}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": a}]


@functools.cache
def _setup(family: str):
    tok = offline.build_tokenizer(family)
    proc = offline.processor(family, tok, chat_template=(TEMPLATES / f"{family}.jinja").read_text(), **_CAP)
    rng = np.random.default_rng(0)
    samples = []
    for k, sizes in enumerate(SIZES):
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
        samples.append(process_sample(images, _conversation(k), processor=proc))
    model = offline.tiny_model(family, tok, initializer_range=0.2, seed=0)
    return proc, samples, model


def _forward(model, **inputs):
    """``(outputs, router logits per MoE layer)``, read with ``record_router_logits``: transformers 5.24's
    Glm46V forward refuses ``output_router_logits`` (its output class has no field for them) and computes no
    aux loss; GLM-4.5V's is asked for them too, for the control below."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    with record_router_logits(model) as seen, torch.no_grad():
        extra = {"output_router_logits": True} if type(model).__name__.startswith("Glm4vMoe") else {}
        out = model(**inputs, **extra)
    assert len(seen) == len(routers) >= 1
    if extra:  # the hooks read what the model itself reports
        assert all(torch.equal(a, b) for a, b in zip(seen, out.router_logits, strict=True))
    return out, tuple(seen)


def _alone(model, sample: dict):
    inputs = {k: sample[k][None] for k in ("input_ids", "mm_token_type_ids")}
    inputs.update({k: sample[k] for k in ("pixel_values", "image_grid_thw") if sample.get(k) is not None})
    return _forward(model, **inputs, use_cache=False)


def _packed(family: str):
    proc, samples, model = _setup(family)
    content = sum(-(-len(s["input_ids"]) // 8) * 8 for s in samples)
    collator = PackingCollator(2 * content, model_config=model.config, tokenizer=proc, pad_to_multiple_of=8)
    batch = collator(samples)
    assert batch.num_rows == 1 and batch.num_samples == 3
    real = batch.real_tokens()
    assert int(real.sum()) == sum(len(s["input_ids"]) for s in samples) < real.numel() - 8  # padding is there
    return batch, *_forward(model, **batch.model_inputs("sdpa"))


@pytest.mark.parametrize("family", MOE)
def test_router_statistics_and_aux_loss_count_real_tokens_only(family):
    from transformers.models.glm4v_moe.modeling_glm4v_moe import load_balancing_loss_func

    _, samples, model = _setup(family)
    text = model.config.text_config
    batch, out, routed = _packed(family)
    alone = [_alone(model, samples[k])[1] for k in batch.sample_index.tolist()]
    layers = len(routed)
    assert layers == text.num_hidden_layers - text.first_k_dense_replace >= 1
    # the router logits of every real token are those of the sample alone (routing is per token)
    real = batch.real_tokens().reshape(-1).bool()
    oracle_logits = tuple(torch.cat([a[i] for a in alone]) for i in range(layers))
    for layer in range(layers):
        assert torch.allclose(routed[layer][real], oracle_logits[layer], atol=1e-5)
    experts, k = text.n_routed_experts, text.num_experts_per_tok
    oracle = load_balancing_loss_func(oracle_logits, experts, k)
    mine = load_balancing_loss(routed, batch.real_tokens(), experts, k)
    assert torch.allclose(mine, oracle, rtol=1e-5), (mine, oracle)
    tokens, prob = expert_load(routed, batch.real_tokens(), k)
    assert torch.isclose(tokens.sum(), torch.tensor(float(k)))  # k picks per real token
    assert torch.isclose(prob.sum(), torch.tensor(1.0))
    # control: the same statistics over every routed token of the row (padding included) are off
    assert abs(float(load_balancing_loss_func(routed, experts, k)) - float(oracle)) > 1e-3
    if family == "glm4v_moe":  # the model's own aux loss of the packed rows (no 2-D mask) counts the padding
        assert torch.allclose(out.aux_loss, load_balancing_loss_func(routed, experts, k))
        assert abs(float(out.aux_loss) - float(oracle)) > 1e-3, (out.aux_loss, oracle)


@pytest.mark.parametrize("family", MOE)
def test_packed_per_token_loss_equals_each_sample_alone(family):
    _, samples, model = _setup(family)
    batch, out, _ = _packed(family)
    cu = batch.cu_seqlens_padded.tolist()
    for slot, k in enumerate(batch.sample_index.tolist()):
        s, a = samples[k], _alone(model, samples[k])[0]
        n = len(s["input_ids"])
        logits = out.logits[0, cu[slot] : cu[slot] + n]
        packed_sum, packed_n = token_cross_entropy(logits[:-1], s["labels"][1:])
        alone_sum, alone_n = token_cross_entropy(a.logits[0, :-1], s["labels"][1:])
        assert packed_n == alone_n > 0
        assert torch.allclose(packed_sum / packed_n, alone_sum / alone_n, atol=1e-5)
        assert torch.allclose(logits, a.logits[0], atol=1e-4)


def test_real_tokens_must_match_the_router_rows():
    with pytest.raises(ValueError, match="real_tokens"):
        load_balancing_loss([torch.zeros(6, 4)], torch.ones(1, 5), 4, 2)
    with pytest.raises(ValueError, match="output_router_logits"):
        expert_load([], torch.ones(1, 5), 2)


def test_record_router_logits_refuses_a_model_without_routers():
    with pytest.raises(ValueError, match="output_router_logits"), record_router_logits(torch.nn.Linear(2, 2)):
        pass


def test_glm45v_takes_the_routers_path_because_its_attention_cannot_take_the_mask_path():
    """Why GLM-4.5V is not ``experts=True`` (Qwen3.5-MoE's automatic path): its text model hands
    ``attention_mask`` to ``create_causal_mask`` (``modeling_glm4v_moe.py``). A ``MaskMapping`` is refused there,
    and the 2-D mask of real tokens (what its aux loss would read) makes one causal span of the row: the samples
    attend across each other and the router sees other tokens (the aux loss is off too)."""
    from transformers.models.glm4v_moe.modeling_glm4v_moe import load_balancing_loss_func

    from vlm_pack.forward.masks import TOKENS_KEY, MaskMapping

    assert not record_of("glm4v_moe").experts and not record_of("glm46v").experts
    assert record_of("qwen3_5_moe").experts
    _, samples, model = _setup("glm4v_moe")
    batch, out, routed = _packed("glm4v_moe")
    inputs, real = batch.model_inputs("sdpa"), batch.real_tokens()
    with pytest.raises(AttributeError):
        _forward(model, **inputs, attention_mask=MaskMapping({"full_attention": None, TOKENS_KEY: real}))
    joined, joined_routed = _forward(model, **inputs, attention_mask=real)
    cu = batch.cu_seqlens_padded.tolist()
    slot, k = 1, batch.sample_index.tolist()[1]  # the second sample sees the first one
    n = len(samples[k]["input_ids"])
    alone = _alone(model, samples[k])[0].logits[0]
    assert torch.allclose(out.logits[0, cu[slot] : cu[slot] + n], alone, atol=1e-4)  # vlm-pack's rows
    assert (joined.logits[0, cu[slot] : cu[slot] + n] - alone).abs().max() > 1e-2
    text = model.config.text_config
    experts, top = text.n_routed_experts, text.num_experts_per_tok
    oracle = load_balancing_loss(routed, real, experts, top)  # equal to the samples alone (test above)
    assert abs(float(joined.aux_loss) - float(oracle)) > 1e-3
    assert torch.allclose(joined.aux_loss, load_balancing_loss_func(joined_routed, experts, top, real))
