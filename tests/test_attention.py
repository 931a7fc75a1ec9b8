"""varlen_attention backends against a per-sample float64 reference, and the HF integration on tiny
real models (LLaMA, Qwen2-VL with real image tokens) against per-sample and sdpa forwards."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
from PIL import Image

from vlm_pack.forward.attention import (
    BACKENDS,
    HF_ATTN_IMPLEMENTATION,
    available_backends,
    backend_unavailable_reason,
    cu_seqlens_from_position_ids,
    document_block_mask,
    register_hf_attention,
    resolve_backend,
    use_varlen_attention,
    varlen_attention,
)

# CPU flex runs uncompiled here on purpose (correctness); torch warns that this is the slow path.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CPU_BACKENDS = available_backends("cpu")
CPU_GRAD_BACKENDS = available_backends("cpu", requires_grad=True)


def reference_attention(q, k, v, cu_seqlens, causal, scale=None):
    """Plain softmax attention in float64, one sample at a time (the definition varlen must match)."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    bounds = cu_seqlens.tolist()
    for a, b in itertools.pairwise(bounds):
        qs = q[a:b].transpose(0, 1)
        ks = k[a:b].repeat_interleave(groups, 1).transpose(0, 1)
        vs = v[a:b].repeat_interleave(groups, 1).transpose(0, 1)
        scores = qs @ ks.transpose(-1, -2) * scale
        if causal:
            future = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs)


def cu_from_lengths(lengths):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)


def random_lengths(seed, total):
    """Random split of ``total`` tokens with length-1 samples forced in."""
    rng = np.random.default_rng(seed)
    lengths, left = [1], total - 1
    while left > 0:
        n = int(min(left, rng.choice([1, 1, rng.integers(2, 40), rng.integers(40, 300)])))
        lengths.append(n)
        left -= n
    rng.shuffle(lengths)
    return lengths


LENGTH_CASES = {
    "random-a": random_lengths(0, 517),
    "random-b": random_lengths(1, 300),
    "single-sample-fills-row": [260],
    "all-length-1": [1] * 7,
    "empty-sample-inside": [3, 0, 129, 1],
}


def qkv(total, heads, kv_heads, dim=16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.slow
def test_backends_match_per_sample_reference(backend, case, causal, kv_heads):
    lengths = LENGTH_CASES[case]
    cu = cu_from_lengths(lengths)
    q, k, v = qkv(sum(lengths), 4, kv_heads)
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu, max(lengths), causal=causal, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, cu, causal), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.slow
def test_gqa_two_groups_int64_cu_and_custom_scale(backend):
    lengths = LENGTH_CASES["random-a"]
    cu = cu_from_lengths(lengths).long()  # int64 is accepted and converted
    q, k, v = qkv(sum(lengths), 6, 3, dim=8, seed=3)
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu, None, causal=True, softmax_scale=0.3, backend=backend)
    torch.testing.assert_close(
        out.double(), reference_attention(q, k, v, cu, True, 0.3), atol=2e-6, rtol=1e-5
    )


@pytest.mark.parametrize("backend", CPU_GRAD_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.slow
def test_gradients_match_reference(backend, causal):
    lengths = [*random_lengths(5, 200), 1]
    cu = cu_from_lengths(lengths)
    q, k, v = qkv(sum(lengths), 4, 2, seed=7, requires_grad=True)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    out = varlen_attention(q, k, v, cu, max(lengths), causal=causal, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, cu, causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4, msg=f"d{name} differs")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_backends_match_reference_in_bf16(causal):
    device = torch.device("cuda")
    lengths = [1, *random_lengths(2, 3000), 1]
    cu = cu_from_lengths(lengths).to(device)
    q, k, v = (t.to(device, torch.bfloat16).requires_grad_() for t in qkv(sum(lengths), 8, 2, dim=64))
    grad_out = torch.randn(q.shape, device=device, dtype=torch.bfloat16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, cu, causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    backends = available_backends(device, torch.bfloat16, 64, requires_grad=True)
    if torch.cuda.get_device_capability(device) >= (8, 0):
        assert "torch_varlen" in backends and resolve_backend("auto", q) in ("flash_attn", "torch_varlen")
    for backend in backends:
        out = varlen_attention(q, k, v, cu, max(lengths), causal=causal, backend=backend)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2, msg=backend)
        for name, got, want in zip("qkv", torch.autograd.grad(out, (q, k, v), grad_out), ref_grads):
            torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2, msg=f"{backend} d{name}")


@pytest.mark.parametrize("lengths", [[1, 130, 5, 0, 300, 1, 77], [128, 128, 44], [600], [3] * 50])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.slow
def test_document_block_mask_equals_create_block_mask(lengths, causal):
    from torch.nn.attention.flex_attention import create_block_mask

    cu = cu_from_lengths(lengths)
    total = sum(lengths)
    doc = torch.searchsorted(cu[1:].long(), torch.arange(total), right=True)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    want = create_block_mask(mask_mod, None, None, total, total, device="cpu")
    got = document_block_mask(cu, total, causal)
    assert torch.equal(got.to_dense(), want.to_dense())
    assert got.kv_num_blocks.flatten().tolist() == want.kv_num_blocks.flatten().tolist()
    assert got.full_kv_num_blocks.flatten().tolist() == want.full_kv_num_blocks.flatten().tolist()
    assert got.sparsity() == want.sparsity()


def test_backend_availability_and_selection_on_cpu():
    assert CPU_BACKENDS == ["flex", "sdpa_per_sample", "sdpa_masked"]
    assert CPU_GRAD_BACKENDS == ["sdpa_per_sample", "sdpa_masked"]
    q, k, v = qkv(10, 2, 2)
    # CPU auto: per-sample SDPA (flex has no CPU backward and is slower uncompiled).
    assert resolve_backend("auto", q) == "sdpa_per_sample"
    assert resolve_backend("auto", q.requires_grad_(), k, v) == "sdpa_per_sample"
    assert "CUDA" in backend_unavailable_reason("torch_varlen", "cpu")
    assert backend_unavailable_reason("sdpa_masked", "cpu") is None
    with pytest.raises(ValueError, match="no backward on CPU"):
        varlen_attention(q, k, v, cu_from_lengths([4, 6]), backend="flex")
    with pytest.raises(ValueError, match="cannot run here"):
        varlen_attention(q, k, v, cu_from_lengths([4, 6]), backend="torch_varlen")
    with pytest.raises(ValueError, match="unknown backend 'flash'"):
        varlen_attention(q, k, v, cu_from_lengths([4, 6]), backend="flash")
    assert set(BACKENDS) >= set(CPU_BACKENDS)


@pytest.mark.parametrize(
    ("cu", "error", "match"),
    [
        (torch.tensor([1, 4, 10], dtype=torch.int32), ValueError, r"must start at 0.*prepend a 0"),
        (torch.tensor([0, 6, 4, 10], dtype=torch.int32), ValueError, r"non-decreasing.*cu_seqlens\[2\] = 4"),
        (torch.tensor([0, 4, 9], dtype=torch.int32), ValueError, r"cu_seqlens\[-1\] = 9 .* = 10"),
        (torch.tensor([0.0, 4.0, 10.0]), TypeError, r"integer tensor.*to\(torch.int32\)"),
        (torch.tensor([[0, 4, 10]], dtype=torch.int32), ValueError, r"1-D"),
        ([0, 4, 10], TypeError, r"torch.Tensor"),
    ],
)
def test_bad_cu_seqlens_raise_with_fix(cu, error, match):
    q, k, v = qkv(10, 2, 2)
    with pytest.raises(error, match=match):
        varlen_attention(q, k, v, cu, None)


def test_bad_shapes_and_max_seqlen_raise():
    q, k, v = qkv(10, 4, 3)
    with pytest.raises(ValueError, match="divide the number of query heads"):
        varlen_attention(q, k, v, cu_from_lengths([10]))
    q, k, v = qkv(10, 4, 2)
    with pytest.raises(ValueError, match="max_seqlen = 5 is smaller than the longest sample"):
        varlen_attention(q, k, v, cu_from_lengths([4, 6]), 5)
    with pytest.raises(ValueError, match=r"\(total_tokens, heads, head_dim\)"):
        varlen_attention(q[None], k[None], v[None], cu_from_lengths([10]))


def test_cu_seqlens_from_position_ids_matches_transformers_rule():
    from transformers.masking_utils import find_packed_sequence_indices

    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6, 0, 1]])
    cu, max_len = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 4, 6, 8, 10] and max_len == 3
    groups = find_packed_sequence_indices(pos)[0]
    assert torch.equal(torch.bincount(groups), (cu[1:] - cu[:-1]).long())
    # Qwen2-VL (4, 1, T) layout: row 0 is the text positions; every row of a batch starts a sample.
    cu4, _ = cu_seqlens_from_position_ids(pos.expand(4, 1, -1))
    assert torch.equal(cu4, cu)
    cu2, _ = cu_seqlens_from_position_ids(torch.arange(4).repeat(2, 1))
    assert cu2.tolist() == [0, 4, 8]


# ------------------------------------------------------------------------------------------------------
# Hugging Face integration on tiny real models
# ------------------------------------------------------------------------------------------------------


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def token_logprobs(logits, ids):
    return logits.float().log_softmax(-1)[..., :-1, :].gather(-1, ids[..., 1:, None])[..., 0]


def packed_row_logprobs(lengths, logits, ids):
    """Per-sample next-token log-probs inside a packed row (never across a boundary)."""
    lp = token_logprobs(logits[0], ids[0])
    cu = np.cumsum([0, *lengths])
    return torch.cat([lp[a : b - 1] for a, b in itertools.pairwise(cu)])


@pytest.mark.slow
def test_llama_packed_varlen_matches_per_sample_and_sdpa_packing():
    model = tiny_llama()
    lengths = [7, 1, 33, 2, 20]
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in lengths]
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = cu_from_lengths(lengths)
    with torch.no_grad():
        alone = torch.cat([token_logprobs(model(input_ids=s[None]).logits[0], s) for s in samples])
        sdpa_packed = packed_row_logprobs(
            lengths, model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids
        )
        use_varlen_attention(model)
        assert model.config._attn_implementation == HF_ATTN_IMPLEMENTATION
        from_pos = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        from_cu = model(
            input_ids=ids,
            position_ids=pos,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
        ).logits
    for logits in (from_pos, from_cu):
        got = packed_row_logprobs(lengths, logits, ids)
        torch.testing.assert_close(got, alone, atol=2e-5, rtol=0)
        torch.testing.assert_close(got, sdpa_packed, atol=2e-5, rtol=0)
    # Without the position reset the samples would see each other: the check above can fail.
    with torch.no_grad():
        leaky = packed_row_logprobs(lengths, model(input_ids=ids, use_cache=False).logits, ids)
    assert (leaky - alone).abs().max() > 1e-2


@pytest.mark.slow
def test_llama_packed_training_step_gradients_match_sdpa():
    lengths = [30, 1, 17, 12]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, np.cumsum(lengths)[:-1]] = -100  # no loss across boundaries (shift is inside the model)
    grads = {}
    for impl in ("sdpa", HF_ATTN_IMPLEMENTATION):
        model = tiny_llama().train()
        if impl != "sdpa":
            use_varlen_attention(model, backend="sdpa_per_sample")
        loss = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
        loss.backward()
        grads[impl] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(grads["sdpa"][0], grads[HF_ATTN_IMPLEMENTATION][0], atol=1e-5, rtol=0)
    for name, g_sdpa in grads["sdpa"][1].items():
        torch.testing.assert_close(
            grads[HF_ATTN_IMPLEMENTATION][1][name], g_sdpa, atol=2e-5, rtol=1e-4, msg=name
        )


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.slow
def test_llama_padded_batch_and_generate_match_sdpa(side):
    model = tiny_llama()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    for row, n_pad in enumerate((0, 5, 11)):
        if n_pad:
            (mask[row, :n_pad] if side == "left" else mask[row, 12 - n_pad :]).zero_()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        want_gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        use_varlen_attention(model)
        got = model(input_ids=ids, attention_mask=mask).logits
        got_gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=0)
    if side == "left":  # greedy continuation of left-padded prompts, through the KV cache
        assert torch.equal(got_gen, want_gen)


@pytest.mark.slow
def test_llama_unpadded_batch_without_position_ids_matches_sdpa():
    # transformers then makes (1, T) position ids shared by all rows: each row is one sequence.
    model = tiny_llama()
    ids = torch.randint(0, 128, (3, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        got = use_varlen_attention(model)(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_forced_backend_runs_through_the_registered_function():
    model = tiny_llama()
    use_varlen_attention(model, backend="flash_attn")  # not installable on CPU: the forward must say so
    ids = torch.randint(0, 128, (1, 9))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    with pytest.raises(ValueError, match="backend='flash_attn' cannot run here"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    with pytest.raises(ValueError, match="unknown backend"):
        use_varlen_attention(model, backend="flash")
    assert register_hf_attention() == HF_ATTN_IMPLEMENTATION


def qwen2_vl_samples(tokenizer, image_processor, seed=0):
    """Three samples of text + real images (Pillow -> Qwen2-VL image processor): 2, 0 and 1 images."""
    rng = np.random.default_rng(seed)
    pad, start, end = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    merge = 4  # spatial_merge_size ** 2
    samples = []
    for n_text, sizes in ((9, [(56, 84), (112, 56)]), (23, []), (1, [(84, 84)])):
        ids = rng.integers(20, len(tokenizer), n_text).tolist()
        pixel_values, grids = [], []
        for h, w in sizes:
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            out = image_processor(images=[img], return_tensors="pt")
            pixel_values.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
            n_vis = int(out["image_grid_thw"].prod()) // merge
            ids += [start] + [pad] * n_vis + [end] + rng.integers(20, len(tokenizer), 3).tolist()
        samples.append(
            dict(
                input_ids=torch.tensor([ids]),
                pixel_values=torch.cat(pixel_values) if sizes else None,
                image_grid_thw=torch.cat(grids) if sizes else None,
            )
        )
    return samples


@pytest.mark.slow
def test_qwen2_vl_packed_images_varlen_matches_per_sample_and_sdpa():
    from vlm_pack.offline import build_tokenizer, image_processor, tiny_model

    tok = build_tokenizer("qwen2_vl")
    model = tiny_model("qwen2_vl", tok, initializer_range=0.2, vision_layers=2)
    samples = qwen2_vl_samples(tok, image_processor("qwen2_vl"))
    image_id = model.config.image_token_id
    lengths = [s["input_ids"].shape[1] for s in samples]
    positions = []
    with torch.no_grad():
        alone = []
        for s in samples:
            mm = (s["input_ids"] == image_id).int()
            inputs = {k: v for k, v in s.items() if v is not None}
            alone.append(token_logprobs(model(**inputs, mm_token_type_ids=mm).logits[0], s["input_ids"][0]))
            rope = model.model.get_rope_index(
                s["input_ids"], mm_token_type_ids=mm, image_grid_thw=s["image_grid_thw"]
            )[0]
            positions.append(torch.cat([torch.arange(rope.shape[-1]).view(1, 1, -1), rope]))
    alone = torch.cat(alone)
    packed = dict(
        input_ids=torch.cat([s["input_ids"] for s in samples], 1),
        pixel_values=torch.cat([s["pixel_values"] for s in samples if s["pixel_values"] is not None]),
        image_grid_thw=torch.cat([s["image_grid_thw"] for s in samples if s["image_grid_thw"] is not None]),
        position_ids=torch.cat(positions, -1),  # (4, 1, T): text arange + per-sample mRoPE rows
        use_cache=False,
    )
    assert packed["position_ids"].shape == (4, 1, sum(lengths))
    cu = cu_from_lengths(lengths)
    with torch.no_grad():
        sdpa = packed_row_logprobs(lengths, model(**packed).logits, packed["input_ids"])
        use_varlen_attention(model)
        assert model.config.vision_config._attn_implementation == HF_ATTN_IMPLEMENTATION
        from_pos = packed_row_logprobs(lengths, model(**packed).logits, packed["input_ids"])
        # The flash kwargs also reach the vision tower through **kwargs: it must ignore them.
        from_cu = packed_row_logprobs(
            lengths,
            model(
                **packed,
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=max(lengths),
                max_length_k=max(lengths),
            ).logits,
            packed["input_ids"],
        )
    for got in (from_pos, from_cu):
        torch.testing.assert_close(got, alone, atol=3e-5, rtol=0)
        torch.testing.assert_close(got, sdpa, atol=3e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------
# review regressions
# ------------------------------------------------------------------------------------------------------


class _Bidirectional(torch.nn.Module):
    is_causal = False


def test_non_causal_call_honours_its_own_cu_seq_lens_q():
    """A bidirectional attention fed cu_seq_lens_q (no position ids) must not attend across samples."""
    from vlm_pack.forward.attention import hf_varlen_attention_forward

    lengths = [3, 1, 5]
    cu = cu_from_lengths(lengths)
    q, k, v = (t.transpose(0, 1)[None] for t in qkv(sum(lengths), 4, 2, seed=11))  # (1, H, T, D)
    out, _ = hf_varlen_attention_forward(
        _Bidirectional(), q, k, v, None, is_causal=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5
    )
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    torch.testing.assert_close(out[0].double(), reference_attention(*flat, cu, False), atol=2e-6, rtol=1e-5)


@pytest.mark.slow
def test_inference_mode_tensors_run_and_are_not_cached():
    """torch.inference_mode() tensors have no version counter: the identity caches must not touch it."""
    from vlm_pack.forward.attention import hf_varlen_attention_forward

    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    use_varlen_attention(model)
    with torch.inference_mode():
        got = model(input_ids=ids.clone(), position_ids=pos.clone(), use_cache=False).logits
        q, k, v = qkv(9, 2, 2, seed=4)
        cu = torch.tensor([0, 3, 9], dtype=torch.int32)
        first = varlen_attention(q, k, v, cu)
        cu[1] = 5  # in place: an inference tensor cannot show this in a version counter
        torch.testing.assert_close(
            varlen_attention(q, k, v, cu).double(), reference_attention(q, k, v, cu, True)
        )
        assert not torch.equal(first, varlen_attention(q, k, v, cu))
        pos_inf = torch.tensor([[0, 1, 0, 1, 2]])
        x = torch.randn(1, 2, 5, 8)
        out, _ = hf_varlen_attention_forward(
            model.model.layers[0].self_attn, x, x, x, None, position_ids=pos_inf
        )
        assert out.shape == (1, 5, 2, 8)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_in_place_edit_of_cu_seqlens_is_not_served_from_cache():
    q, k, v = qkv(9, 2, 2, seed=5)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    for backend in CPU_BACKENDS:
        with torch.no_grad():
            varlen_attention(q, k, v, cu, backend=backend)
    cu[1] = 6
    for backend in CPU_BACKENDS:
        with torch.no_grad():
            out = varlen_attention(q, k, v, cu, backend=backend)
        torch.testing.assert_close(out.double(), reference_attention(q, k, v, cu, True), atol=2e-6, rtol=1e-5)


def test_bare_mrope_rows_mark_a_sample_where_all_three_restart():
    """GLM-4.5V's text model hands its layers the (3, B, T) mRoPE rows without the text row: a sample starts
    where all three are 0, never where one row alone stands still or restarts over an image."""
    rope = torch.tensor(
        [
            [[0, 1, 1, 1, 1, 2, 3, 0, 1, 1, 2]],  # t: stands still over each image
            [[0, 1, 1, 2, 2, 3, 4, 0, 1, 1, 2]],  # h
            [[0, 1, 2, 1, 2, 3, 4, 0, 0, 1, 2]],  # w: a second sample at 7, its image's w starts at 0
        ]
    )
    cu, max_seqlen = cu_seqlens_from_position_ids(rope)
    assert cu.tolist() == [0, 7, 11] and max_seqlen == 7
    with pytest.raises(ValueError, match=r"\(4, B, T\)"):
        cu_seqlens_from_position_ids(torch.zeros(2, 1, 8, dtype=torch.long))


@pytest.mark.slow
def test_qwen2_5_vl_windowed_vision_ignores_inherited_boundaries_and_switches_back():
    """Qwen2.5-VL's windowed vision tower under varlen: the text's cu_seq_lens_q reaching it through
    **kwargs is ignored even when it spans exactly the tower's tokens; set_attn_implementation("sdpa")
    restores the original model."""
    from vlm_pack.offline import build_tokenizer, image_processor, tiny_model

    tok = build_tokenizer("qwen2_5_vl")
    model = tiny_model("qwen2_5_vl", tok, initializer_range=0.2, vision_layers=2)
    samples = qwen2_vl_samples(tok, image_processor("qwen2_5_vl"))
    grid = samples[0]["image_grid_thw"][:1]  # one image: its vision calls see exactly n tokens
    n = int(grid.prod())
    pixels = samples[0]["pixel_values"][:n]
    inherited = torch.tensor([0, 5, n], dtype=torch.int32)  # text boundaries that happen to cover n tokens
    with torch.no_grad():
        want = model.model.visual(pixels, grid_thw=grid).pooler_output
        use_varlen_attention(model)
        got = model.model.visual(
            pixels, grid_thw=grid, cu_seq_lens_q=inherited, cu_seq_lens_k=inherited, max_length_q=n - 5
        ).pooler_output
        model.set_attn_implementation("sdpa")
        back = model.model.visual(pixels, grid_thw=grid).pooler_output
    assert model.config.vision_config._attn_implementation == "sdpa"
    for out in (got, back):
        torch.testing.assert_close(torch.cat(list(out)), torch.cat(list(want)), atol=2e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------
# Packed rows that also carry a padding mask
# ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_packed_right_padded_rows_with_a_mask_equal_each_sample_alone():
    """Two packed rows right-padded to one length, with a padding attention_mask AND per-sample
    position_ids: the mask only drops the padding; the positions keep every sample to itself."""
    from vlm_pack.testing import token_mult_prob_error

    model = tiny_llama()
    rows = [[7, 12], [3, 9, 6]]  # sample lengths per row
    width = 24
    g = torch.Generator().manual_seed(5)
    samples = [[torch.randint(0, 128, (n,), generator=g) for n in row] for row in rows]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(samples):
        used = sum(len(s) for s in row)
        ids[r, :used] = torch.cat(row)
        pos[r, :used] = torch.cat([torch.arange(len(s)) for s in row])
        mask[r, :used] = 1
    with torch.no_grad():
        alone = torch.cat(
            [token_logprobs(model(input_ids=s[None]).logits[0], s) for row in samples for s in row]
        )
        use_varlen_attention(model)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        # the same rows with a running position: samples then see each other (the test can fail)
        running = torch.arange(width).expand(len(rows), -1)
        leaky_logits = model(input_ids=ids, attention_mask=mask, position_ids=running, use_cache=False).logits

    def per_sample(out):
        return torch.cat(
            [packed_row_logprobs(row, out[r : r + 1], ids[r : r + 1]) for r, row in enumerate(rows)]
        )

    err = float(token_mult_prob_error(per_sample(logits), alone))
    leak = float(token_mult_prob_error(per_sample(leaky_logits), alone))
    print(f"packed+padding-mask vs alone: token_mult_prob_error {err:.7f} (running positions: {leak:.4f})")
    assert err <= 1.0001
    assert leak > 1.01


# ------------------------------------------------------------------------------------------------------
# torch varlen_attn signature adapter
# ------------------------------------------------------------------------------------------------------


def _stand_in_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """A CPU stand-in for the CUDA kernel: float64 per-sample reference; refuses GQA like the kernel does
    without enable_gqa."""
    assert q.shape[1] == k.shape[1], "kv heads must be repeated for a varlen_attn without enable_gqa"
    assert cu_q is cu_k
    return reference_attention(q, k, v, cu_q, causal, scale).to(q.dtype)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature: is_causal, no scale, no window_size, no enable_gqa."""
    return _stand_in_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None)


def varlen_attn_no_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    return _stand_in_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, False, None)


@pytest.fixture
def torch_varlen_as(monkeypatch):
    """Install ``fn`` as torch's varlen_attn (and let the backend run on CPU tensors)."""
    from vlm_pack.forward import varlen

    real_reason = varlen.backend_unavailable_reason

    def install(fn):
        monkeypatch.setattr(varlen, "_torch_varlen_attn", lambda: fn)
        varlen._torch_varlen_keywords.cache_clear()
        monkeypatch.setattr(
            varlen,
            "backend_unavailable_reason",
            lambda name, *a, **kw: None if name == "torch_varlen" else real_reason(name, *a, **kw),
        )

    yield install
    varlen._torch_varlen_keywords.cache_clear()


@pytest.mark.parametrize("causal", [True, False])
def test_torch_varlen_with_the_2_10_signature_gets_is_causal_and_repeated_kv(torch_varlen_as, causal):
    torch_varlen_as(varlen_attn_2_10)
    lengths = [5, 1, 12]
    cu = cu_from_lengths(lengths)
    q, k, v = qkv(sum(lengths), 4, 2)
    got = varlen_attention(q, k, v, cu, causal=causal, backend="torch_varlen")
    torch.testing.assert_close(got, reference_attention(q, k, v, cu, causal).float(), atol=1e-5, rtol=0)


def test_torch_varlen_missing_arguments_raise_naming_the_torch_version(torch_varlen_as):
    torch_varlen_as(varlen_attn_2_10)
    cu = cu_from_lengths([4, 4])
    q, k, v = qkv(8, 2, 2)
    with pytest.raises(
        NotImplementedError, match=re.escape(f"torch {torch.__version__}'s varlen_attn has no scale")
    ):
        varlen_attention(q, k, v, cu, softmax_scale=0.1, backend="torch_varlen")
    torch_varlen_as(varlen_attn_no_causal)
    with pytest.raises(
        NotImplementedError, match=re.escape(f"torch {torch.__version__}'s varlen_attn takes neither")
    ):
        varlen_attention(q, k, v, cu, causal=True, backend="torch_varlen")


@pytest.mark.skipif(
    backend_unavailable_reason("torch_varlen", "cpu") is not None
    and "no torch.nn.attention.varlen" in backend_unavailable_reason("torch_varlen", "cpu"),
    reason="this torch has no varlen_attn",
)
def test_installed_torch_varlen_signature_gets_its_keywords():
    """The keywords chosen for the installed torch are ones its varlen_attn declares."""
    import inspect

    from vlm_pack.forward import varlen

    varlen._torch_varlen_keywords.cache_clear()
    declared = inspect.signature(varlen._torch_varlen_attn()).parameters
    for causal, gqa in itertools.product([True, False], [True, False]):
        kwargs = varlen._torch_varlen_kwargs(causal, 0.25, 16, gqa)
        assert set(kwargs) <= set(declared)
        if "window_size" in declared:
            assert kwargs["window_size"] == ((-1, 0) if causal else (-1, -1))


def test_use_varlen_attention_writes_nothing_onto_the_models_modules():
    """The backend and the encoder flags are vlm-pack's state, held in a weak registry: the model's modules
    keep their own attributes (a deep copy or a pickle carries no vlm-pack state); the setting still reaches
    the forward, and is gone with the model."""
    import gc
    import weakref

    from vlm_pack.forward import attention

    model = tiny_llama()
    before = {name: set(module.__dict__) for name, module in model.named_modules()}
    use_varlen_attention(model, backend="flash_attn")
    assert {name: set(module.__dict__) for name, module in model.named_modules()} == before
    assert all(attention._SETTINGS.backend(m) == "flash_attn" for m in model.modules())
    with pytest.raises(ValueError, match="backend='flash_attn' cannot run here"):  # the setting reaches it
        model(input_ids=torch.randint(0, 128, (1, 5)), position_ids=torch.tensor([[0, 1, 0, 1, 2]]), use_cache=False)
    probe = weakref.ref(next(model.modules()))
    del model
    gc.collect()
    assert probe() is None  # the registry does not keep a model alive
