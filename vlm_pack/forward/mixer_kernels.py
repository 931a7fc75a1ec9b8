"""Token mixers on kernels: a whole packed row through flash-linear-attention with the samples' ``cu_seqlens``.

``isolate_token_mixers`` (``mixers.py``) runs a mixer per sample segment, which is exact everywhere. Where
flash-linear-attention's ``fla-core`` (pure Python, Triton: ``pip install 'vlm-pack[kernels]'``) imports and
the layer runs on CUDA, the layers below instead run the whole row once, the kernels keeping the samples
apart themselves::

    hidden [B, T, H] -> [1, B*T, H] -> projections -> causal_conv1d(x, w, cu_seqlens=cu)     (short conv)
                                                   -> chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
                     -> [B, T, H']                                                          (delta rule)

``cu`` holds every sample start and every row start (a sample never crosses a row). Each recipe repeats its
transformers layer's forward (5.25, ``models/qwen3_5/modeling_qwen3_5.py`` ``Qwen3_5GatedDeltaNet``,
``models/lfm2/modeling_lfm2.py`` ``Lfm2ShortConv``) with the two sequence operations taken as arguments, so
the same recipe runs on CPU with per-sample PyTorch references (``tests/test_mixer_kernels.py``) and on CUDA
with ``fla.modules.causal_conv1d.causal_conv1d(..., backend="triton")`` and
``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (``benchmarks/gpu_checks.sh``). A layer whose class has
no recipe, or whose attributes differ from it, stays on the per-sample path. The ``causal-conv1d`` CUDA package
is not needed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RECIPES", "fla_ops", "gated_delta_net_rows", "kernel_forward", "short_conv_rows"]

#: (x [1, N, D], weight [D, W], bias [D] | None, activation | None, cu [S+1], cu_host) -> [1, N, D]
Conv = Callable[..., torch.Tensor]
#: (q [1, N, Hk, K], k, v [1, N, Hv, V], g [1, N, Hv], beta [1, N, Hv], cu, cu_host) -> [1, N, Hv, V]
Rule = Callable[..., torch.Tensor]


def _apply_padding_mask(hidden: torch.Tensor, mask: Any) -> torch.Tensor:
    """transformers' ``apply_mask_to_padding_states``: a 2-D padding mask zeroes padded tokens."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] > 1 and mask.shape[1] > 1:
        return (hidden * mask[:, :, None]).to(hidden.dtype)
    return hidden


def _whole_row(layer: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A recipe over the flattened row, ``layer(m, x [1, N, H], cu, cu_host, *, conv, rule) -> [1, N, H']``, as
    the isolated forward calls it: ``(m, hidden [B, T, H], cu, cu_host, mask, *, conv, rule) -> [B, T, H']``
    (padding zeroed as the layers do, the B rows one sequence of N = B*T tokens cut at ``cu``)."""

    @functools.wraps(layer)
    def rows(m: nn.Module, hidden: torch.Tensor, cu: torch.Tensor, cu_host: torch.Tensor, mask: Any, *,
             conv: Conv, rule: Rule) -> torch.Tensor:  # fmt: skip
        batch, length, _ = hidden.shape
        x = _apply_padding_mask(hidden, mask).reshape(1, batch * length, -1)
        return layer(m, x, cu, cu_host, conv=conv, rule=rule).reshape(batch, length, -1)

    return rows


@_whole_row
def gated_delta_net_rows(m: nn.Module, x: torch.Tensor, cu: torch.Tensor, cu_host: torch.Tensor, *, conv: Conv,
                         rule: Rule) -> torch.Tensor:  # fmt: skip
    """Qwen3.5's gated delta-net (``Qwen3_5GatedDeltaNet.forward`` without a cache): x [1, N, H] -> [1, N, H]."""
    n = x.shape[1]
    mixed = m.in_proj_qkv(x)
    z = m.in_proj_z(x).reshape(1, n, -1, m.head_v_dim)
    b, a = m.in_proj_b(x), m.in_proj_a(x)
    mixed = conv(mixed, m.conv1d.weight.squeeze(1), m.conv1d.bias, m.activation, cu, cu_host)
    q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
    q = q.reshape(1, n, -1, m.head_k_dim)
    k = k.reshape(1, n, -1, m.head_k_dim)
    v = v.reshape(1, n, -1, m.head_v_dim)
    beta = b.sigmoid()
    g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)  # as the layer: fp32 (fp16 would give -inf)
    out = rule(q, k, v, g, beta, cu, cu_host)
    out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
    return m.out_proj(out.reshape(1, n, -1))


@_whole_row
def short_conv_rows(m: nn.Module, x: torch.Tensor, cu: torch.Tensor, cu_host: torch.Tensor, *, conv: Conv,
                    rule: Rule) -> torch.Tensor:  # fmt: skip
    """LFM2's gated short convolution (``Lfm2ShortConv.forward`` without a cache): x [1, N, H] -> [1, N, H]."""
    gate_in, gate_out, values = m.in_proj(x).chunk(3, dim=-1)
    mixed = conv(gate_in * values, m.conv.weight.squeeze(1), m.conv.bias, None, cu, cu_host)
    return m.out_proj(gate_out * mixed)


#: Layer class -> (recipe, the attributes it reads). Qwen3-Next's delta net fuses its projections
#: differently (``in_proj_qkvz``): it has no recipe and runs per sample.
RECIPES: dict[str, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    name: (gated_delta_net_rows, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log",
                                  "dt_bias", "norm", "out_proj", "key_dim", "value_dim", "head_k_dim",
                                  "head_v_dim", "activation"))
    for name in ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
} | {
    name: (short_conv_rows, ("in_proj", "conv", "out_proj"))
    for name in ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")
}


@functools.cache
def fla_ops() -> tuple[Conv, Rule] | None:
    """flash-linear-attention's varlen conv and delta rule as :data:`Conv` / :data:`Rule`, or None where
    ``fla`` (``fla-core``) does not import."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # absent, or no Triton here: the per-sample path it is
        return None

    def conv(x, weight, bias, activation, cu, cu_host):
        out, _ = causal_conv1d(x, weight, bias, activation=activation, backend="triton", cu_seqlens=cu,
                               cu_seqlens_cpu=cu_host)
        return out

    def rule(q, k, v, g, beta, cu, cu_host):
        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                        cu_seqlens_cpu=cu_host)
        return out

    return conv, rule


def recipe(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The whole-row recipe of ``module``'s class, when the module has every attribute it reads. The recipes
    follow the layers of transformers 5.24 on; on older releases the layer runs per sample instead."""
    from .._compat import mixers_refuse_packed_rows

    if not mixers_refuse_packed_rows():  # the same release line: 5.24's layer code
        return None
    found = RECIPES.get(type(module).__name__)
    if found is None or not all(hasattr(module, a) for a in found[1]):
        return None
    activation = getattr(module, "activation", None)
    if activation not in (None, "silu", "swish"):  # the kernel's conv knows these only
        return None
    return found[0]


def kernel_forward(module: nn.Module) -> Callable[..., torch.Tensor] | None:
    """``(module, hidden [B, T, H], cu, cu_host, mask) -> [B, T, H']`` on flash-linear-attention's kernels,
    or None (no recipe for the class, or no ``fla``): the caller runs the layer per sample instead."""
    ops = fla_ops()
    rows = recipe(module)
    if ops is None or rows is None:
        return None
    conv, rule = ops
    return functools.partial(rows, conv=conv, rule=rule)
