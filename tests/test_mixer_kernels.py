"""The kernel path of the token mixers (``vlm_pack.forward.mixer_kernels``): a whole packed row through
flash-linear-attention with the samples' ``cu_seqlens``.

On CPU: each recipe with its two sequence operations replaced by per-segment PyTorch references (transformers'
own ``causal_conv1d_fn`` / ``torch_chunk_gated_delta_rule``, segment by segment) equals the layer's own forward on
each segment alone, and a whole model routed through the kernel branch equals each sample alone; so on a GPU only
the kernels themselves are new. On CUDA with ``fla-core`` (marker ``gpu``): the kernels against the per-sample path
and each sample alone (``benchmarks/gpu_checks.sh`` runs these).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_mixers import LENGTHS, _config  # the same tiny configs; LENGTHS: rows of 90 + 74 (+ 16 padding)

import vlm_pack as vp
from vlm_pack._compat import mixers_refuse_packed_rows
from vlm_pack.forward import mixer_kernels, mixers
from vlm_pack.forward.mixers import find_token_mixers
from vlm_pack.testing import check_packed_equivalence

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35  # noqa: E402


def _model(name: str, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    cfg, cls = _config(name)
    return cls(cfg).to(device=device, dtype=dtype).eval()


def _segments(cu_host: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_host.tolist()
    return list(itertools.pairwise(bounds))


def reference_conv(x, weight, bias, activation, cu, cu_host):
    """transformers' PyTorch causal conv, segment by segment: x [1, N, D] -> [1, N, D]."""
    parts = [q35.causal_conv1d_fn(x[:, s:e].transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
             for s, e in _segments(cu_host)]  # fmt: skip
    return torch.cat(parts, dim=1)


def reference_rule(q, k, v, g, beta, cu, cu_host):
    """transformers' PyTorch chunked gated delta rule, segment by segment."""
    parts = [q35.torch_chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                              use_qk_l2norm_in_kernel=True)[0]
             for s, e in _segments(cu_host)]  # fmt: skip
    return torch.cat(parts, dim=1)


@pytest.mark.skipif(not mixers_refuse_packed_rows(), reason="the whole-row recipes follow the layers of transformers 5.24 on (older releases run each layer per sample)")
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "lfm3"])
def test_each_recipe_is_its_layer_on_each_segment_alone(name):
    model = _model(name)
    layer = next(model.get_submodule(m.name) for m in find_token_mixers(model))
    rows = mixer_kernels.recipe(layer)
    assert rows is not None
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 90, 64, generator=g)
    cu_host = torch.tensor([0, 37, 90, 119, 180])  # samples never cross the row start at 90
    got = rows(layer, hidden, cu_host, cu_host, None, conv=reference_conv, rule=reference_rule)
    flat = hidden.reshape(1, 180, 64)
    with torch.no_grad():
        alone = torch.cat([type(layer).forward(layer, flat[:, s:e]) for s, e in _segments(cu_host)], dim=1)
    torch.testing.assert_close(got.reshape(1, 180, -1), alone, rtol=1e-5, atol=1e-5)


def test_layers_without_a_recipe_stay_on_the_per_sample_path():
    cfg, _ = _config("qwen3_next")
    layer = transformers.Qwen3NextForCausalLM(cfg).model.layers[0].linear_attn
    assert mixer_kernels.recipe(layer) is None  # fused in_proj_qkvz: another layout
    try:
        import fla  # noqa: F401
    except Exception:  # no flash-linear-attention here: nothing runs on kernels
        assert mixer_kernels.kernel_forward(_model("lfm2").model.layers[0].conv) is None


@pytest.mark.skipif(not mixers_refuse_packed_rows(), reason="the whole-row recipes follow the layers of transformers 5.24 on (older releases run each layer per sample)")
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_a_model_through_the_kernel_branch_equals_each_sample_alone(name, monkeypatch):
    """The whole wiring of the kernel branch (segments over rows, the flat row, the recipe) with the
    references standing in for the Triton kernels: packed rows from the collator = each sample alone."""
    monkeypatch.setattr(mixers, "_kernel_device", lambda hidden: True)
    monkeypatch.setattr(mixer_kernels, "fla_ops", lambda: (reference_conv, reference_rule))
    calls = []
    recipe = mixer_kernels.recipe
    monkeypatch.setattr(mixer_kernels, "recipe", lambda module: calls.append(module) or recipe(module))
    g = torch.Generator().manual_seed(1)
    samples = []
    for n in LENGTHS:
        ids = torch.randint(1, 128, (n,), generator=g)
        samples.append({"input_ids": ids, "labels": ids.clone()})
    collator = vp.PackingCollator(90, pad_token_id=0, max_rows=2)
    report = check_packed_equivalence(vp.isolate_token_mixers(_model(name)), samples, collator)
    assert report.passed and report.metric <= 1.0001, str(report)
    assert calls  # the kernel branch ran


def _fla_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("fla", reason="needs fla-core (pip install 'vlm-pack[kernels]')")
    assert mixer_kernels.fla_ops() is not None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_on_cuda_the_kernels_run_the_row_and_equal_each_sample_alone(name):
    _fla_on_cuda()
    model = vp.isolate_token_mixers(_model(name, device="cuda"))
    assert {m.isolation for m in find_token_mixers(model)} == {"kernel"}
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 128, (n,), generator=g).cuda() for n in LENGTHS]
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()
    seq_idx = torch.cat([torch.full((n,), k, dtype=torch.int32) for k, n in enumerate(LENGTHS)])[None].cuda()
    with torch.no_grad():
        packed = model(input_ids=torch.cat(samples)[None], position_ids=pos, seq_idx=seq_idx, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in samples])
    # fp32 on Triton (tf32 dots inside fla's kernels): close, not bitwise
    torch.testing.assert_close(packed, alone, rtol=2e-3, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_on_cuda_kernel_gradients_equal_the_per_sample_path(name, monkeypatch):
    _fla_on_cuda()
    grads = {}
    for path in ("kernel", "per_sample"):
        if path == "per_sample":
            monkeypatch.setattr(mixers, "_kernel_device", lambda hidden: False)
        model = vp.isolate_token_mixers(_model(name, device="cuda")).train()
        g = torch.Generator().manual_seed(1)
        ids = torch.cat([torch.randint(1, 128, (n,), generator=g) for n in LENGTHS])[None].cuda()
        pos = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()
        model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
        grads[path] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for n, grad in grads["per_sample"].items():
        gap = float((grads["kernel"][n] - grad).abs().max() / grad.abs().max().clamp_min(1e-12))
        assert gap < 1e-2, (n, gap)
