"""Varlen attention kernels for packed rows: every sample attends only to itself.

A packed row holds several samples back to back; ``cu_seqlens`` marks where each one starts::

    tokens      a0 a1 a2 b0 b1 c0 c1 c2 c3          total_tokens = 9
    cu_seqlens  [0,       3,    5,          9]      (num_samples + 1,), int32
    max_seqlen  4

    attention (causal)        a0 a1 a2 b0 b1 c0 c1 c2 c3
                          a0  x
                          a1  x  x
                          a2  x  x  x
                          b0           x
                          b1           x  x
                          c0                 x
                          c1                 x  x
                          c2                 x  x  x
                          c3                 x  x  x  x

sdpa/eager with a block-diagonal mask still compute (and hold) the whole T x T product. The varlen
backends below skip the blocks between samples, so a packed row costs what its samples cost alone.

Backends (``backend="auto"`` takes the first usable one in this order):

===================  ===========  =========================================================================
name                 devices      notes
===================  ===========  =========================================================================
``flash_attn``       CUDA         ``flash_attn.flash_attn_varlen_func``; fp16/bf16, head_dim <= 256
``torch_varlen``     CUDA         ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10 ships it); the
                                  same FlashAttention-2 kernels built into torch; fp16/bf16, sm80+
``flex``             CUDA (CPU)   FlexAttention with a document block mask built straight from
                                  ``cu_seqlens`` (no O(T^2) tensor). Compiled on CUDA. On CPU torch has
                                  no flex backward and, outside ``torch.compile``, it materialises the
                                  full score matrix, so "auto" never picks it there
``sdpa_per_sample``  any          one SDPA call per sample (a loop over samples, not tokens)
``sdpa_masked``      any          one SDPA call with a (T, T) block-diagonal mask: exact but O(T^2)
===================  ===========  =========================================================================

On CPU (``benchmarks/bench_train_step.py --kernels --device cpu --capacity 2048``: one 2038-token row of
4 samples, 8 heads, fp32, 2 cores) per-sample SDPA takes 9 ms forward / 33 ms forward+backward, masked
SDPA 35 / 105, the same samples as a padded batch 16 / 54, uncompiled flex 330 ms (forward only); flex
under ``torch.compile`` runs at about per-sample speed after a 15-40 s compile per shape. Hence CPU
"auto" = ``sdpa_per_sample``.

Usage (the transformers integration, which feeds these kernels from a model's attention calls, is
``vlm_pack.forward.attention``; every name here is re-exported there)::

    out = varlen_attention(q, k, v, cu_seqlens, max_seqlen)      # q (T, H, D), k/v (T, Hkv, D)
    resolve_backend("auto", q)                                    # which backend "auto" runs here
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .boundaries import IdentityCache, check_cu_seqlens, host_copy

__all__ = [
    "BACKENDS",
    "available_backends",
    "backend_unavailable_reason",
    "document_block_mask",
    "resolve_backend",
    "varlen_attention",
]

#: Backend names, in the order ``backend="auto"`` tries them.
BACKENDS = ("flash_attn", "torch_varlen", "flex", "sdpa_per_sample", "sdpa_masked")

_HALF = (torch.float16, torch.bfloat16)
_FLEX_BLOCK = 128  # FlexAttention's default sparse block size
_BLOCK_MASKS = IdentityCache()


# --------------------------------------------------------------------------------------------------------
# q/k/v checks and helpers (the boundaries live in boundaries.py)
# --------------------------------------------------------------------------------------------------------


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(
                f"{name} must be a packed (total_tokens, heads, head_dim) tensor, got "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}; reshape "
                "(1, T, H, D) rows with x.squeeze(0) or (B, H, T, D) with x.transpose(1, 2).flatten(0, 1)."
            )
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"q, k, v must hold the same number of tokens, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}."
        )
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q has {q.shape[1]} heads, k {k.shape[1]}, v {v.shape[1]}: k and v must have the same number of "
            "heads and it must divide the number of query heads (GQA)."
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head_dim differ: {q.shape[2]} vs {k.shape[2]}.")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}."
        )


def _doc_ids(cu_seqlens: torch.Tensor, total_tokens: int, length: int | None = None) -> torch.Tensor:
    """Sample index of every token: (length,) int32, tokens at or past ``total_tokens`` get -1."""
    length = total_tokens if length is None else length
    pos = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True).to(torch.int32)
    return doc.masked_fill_(pos >= total_tokens, -1) if length > total_tokens else doc


# --------------------------------------------------------------------------------------------------------
# backend availability
# --------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _flash_attn_varlen_func() -> Callable | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # a broken build (ABI mismatch) must not take the fallbacks down with it
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=1)
def _torch_varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=1)
def _flex() -> tuple[Callable, Any] | None:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None
    return flex_attention, BlockMask


@functools.cache
def _compiled_flex() -> Callable:
    flex_attention, _ = _flex()
    return torch.compile(flex_attention)


def _flash_kernel_refuses(kernel: str, dtype: torch.dtype | None, head_dim: int | None) -> str | None:
    """Why FlashAttention kernels (flash-attn's and torch's) refuse this dtype / head_dim, or None.

    They take fp16/bf16 only, with head_dim <= 256 and a multiple of 8; ``None`` (not given) passes.
    """
    if dtype is not None and dtype not in _HALF:
        return f"{kernel} needs fp16/bf16, got {dtype}"
    if head_dim is not None and (head_dim > 256 or head_dim % 8 != 0):
        return f"{kernel} needs head_dim <= 256 and a multiple of 8, got {head_dim}"
    return None


def backend_unavailable_reason(
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    requires_grad: bool = False,
) -> str | None:
    """Why ``backend`` cannot run for tensors of this device/dtype/head_dim, or None if it can."""
    device = torch.device(device)
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} or 'auto'"
    if backend == "flash_attn":
        if _flash_attn_varlen_func() is None:
            return "flash-attn is not installed (pip install flash-attn --no-build-isolation; needs CUDA)"
        if device.type != "cuda":
            return f"flash-attn runs on CUDA only, tensors are on {device.type}"
        return _flash_kernel_refuses("flash-attn", dtype, head_dim)
    if backend == "torch_varlen":
        if _torch_varlen_attn() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (added in torch 2.10)"
        if device.type != "cuda":
            return f"torch varlen_attn runs FlashAttention kernels on CUDA only, tensors are on {device.type}"
        if not torch.backends.cuda.is_flash_attention_available():
            return "this torch build has no FlashAttention kernels"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "torch varlen_attn needs an sm80+ GPU"
        return _flash_kernel_refuses("torch varlen_attn", dtype, head_dim)
    if backend == "flex":
        if _flex() is None:
            return f"torch {torch.__version__} has no FlexAttention"
        if device.type not in ("cuda", "cpu"):
            return f"vlm-pack runs FlexAttention on CUDA and CPU only, tensors are on {device.type}"
        if device.type == "cpu" and requires_grad:
            return "FlexAttention has no backward on CPU (torch raises); use sdpa_per_sample for CPU training"
        return None
    return None  # the SDPA backends run wherever torch does


def available_backends(
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    requires_grad: bool = False,
) -> list[str]:
    """Backends that can run on ``device`` (and ``dtype``/``head_dim`` when given), in "auto" order.

    >>> available_backends("cpu")
    ['flex', 'sdpa_per_sample', 'sdpa_masked']
    """
    return [
        b for b in BACKENDS if backend_unavailable_reason(b, device, dtype, head_dim, requires_grad) is None
    ]


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def resolve_backend(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
) -> str:
    """The backend that ``varlen_attention(q, k, v, ..., backend=backend)`` runs.

    "auto" picks the first usable of ``BACKENDS``, except flex on CPU (no backward there and, uncompiled,
    slower than per-sample SDPA) and sdpa_masked (O(T^2), only on request). An explicit name that cannot
    run raises ValueError with the reason.
    """
    tensors = [t for t in (q, k, v) if t is not None]
    grad = _needs_grad(*tensors)
    args = (q.device, q.dtype, q.shape[-1], grad)
    if backend == "auto":
        for name in BACKENDS[:-1]:
            if name == "flex" and q.device.type != "cuda":
                continue
            if backend_unavailable_reason(name, *args) is None:
                return name
        return "sdpa_per_sample"
    reason = backend_unavailable_reason(backend, *args)
    if reason is not None:
        raise ValueError(
            f"backend={backend!r} cannot run here: {reason}. Available for these tensors: "
            f"{available_backends(*args)} (or backend='auto')."
        )
    return backend


# --------------------------------------------------------------------------------------------------------
# backends: all take packed (T, H, D) q and (T, Hkv, D) k/v, int32 cu_seqlens, and return (T, H, D)
# --------------------------------------------------------------------------------------------------------


def _run_flash_attn(q, k, v, cu, max_seqlen, causal, scale):
    return _flash_attn_varlen_func()(
        q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=0.0, softmax_scale=scale, causal=causal
    )


@functools.lru_cache(maxsize=1)
def _torch_varlen_keywords() -> frozenset[str]:
    """Keyword names the installed ``varlen_attn`` takes (its signature changed between torch releases:
    2.10 took ``is_causal``, later ones ``window_size``/``scale``/``enable_gqa``). Read once."""
    return frozenset(inspect.signature(_torch_varlen_attn()).parameters)


def _torch_varlen_kwargs(causal: bool, scale: float, head_dim: int, gqa: bool) -> dict[str, Any]:
    """The keyword arguments for this call that the installed ``varlen_attn`` accepts.

    Raises NotImplementedError naming the torch version when it lacks an argument the call needs.
    GQA without ``enable_gqa`` is not an error: the caller repeats the kv heads.
    """
    names = _torch_varlen_keywords()
    kwargs: dict[str, Any] = {}
    if "window_size" in names:  # varlen_attn derives is_causal from window_size == (-1, 0): a tuple
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif "is_causal" in names:
        kwargs["is_causal"] = causal
    elif causal:
        raise NotImplementedError(
            f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal, so it cannot run "
            "causal attention; use backend='flash_attn' or 'flex', or upgrade torch."
        )
    if "scale" in names:
        kwargs["scale"] = scale
    elif not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
        raise NotImplementedError(
            f"torch {torch.__version__}'s varlen_attn has no scale argument and this call needs "
            f"softmax_scale={scale} (not head_dim ** -0.5); use backend='flash_attn' or 'flex', or upgrade torch."
        )
    if gqa and "enable_gqa" in names:
        kwargs["enable_gqa"] = True
    return kwargs


def _run_torch_varlen(q, k, v, cu, max_seqlen, causal, scale):
    gqa = q.shape[1] != k.shape[1]
    kwargs = _torch_varlen_kwargs(causal, scale, q.shape[-1], gqa)
    if gqa and "enable_gqa" not in kwargs:  # older varlen_attn: every query head needs its own kv head
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return _torch_varlen_attn()(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def document_block_mask(
    cu_seqlens: torch.Tensor, total_tokens: int, causal: bool = True, block_size: int = _FLEX_BLOCK
) -> Any:
    """FlexAttention ``BlockMask`` of a packed row, built from ``cu_seqlens`` without any (T, T) tensor.

    The row is cut into ``block_size`` tiles; a (q-tile, kv-tile) pair is computed only where some query
    and key share a sample, and marked "full" (mask_mod skipped) where both tiles lie inside one sample::

        cu_seqlens [0, 300, 320, 512], block 128     kv tile 0  1  2  3
                                          q tile 0       F
                                                 1       F  F
                                                 2       F  F  P
                                                 3             P  P     (causal; F full, P partial)

    Equivalent to ``create_block_mask(document_causal_mask_mod, None, None, T, T)`` at O((T/block)^2) cost.
    """
    _, BlockMask = _flex()
    cu = cu_seqlens.to(torch.int64)
    n_blocks = -(-total_tokens // block_size)
    doc = _doc_ids(cu, total_tokens, n_blocks * block_size)
    starts = torch.arange(n_blocks, device=cu.device) * block_size
    ends = torch.clamp(starts + block_size, max=total_tokens) - 1
    first, last = doc[starts], doc[ends]
    # Docs are contiguous and increasing, so two tiles share a sample iff their doc ranges overlap.
    shared = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    single = (first == last) & (ends - starts + 1 == block_size)
    full = single[:, None] & single[None, :] & (first[:, None] == first[None, :])
    if causal:
        below = torch.ones(n_blocks, n_blocks, dtype=torch.bool, device=cu.device)
        shared &= below.tril()
        full &= below.tril(-1)
    partial = shared & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = dense.sum(-1, dtype=torch.int32)[None, None]
        idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num, idx[None, None]

    if causal:

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(total_tokens, total_tokens),
    )


def _run_flex(q, k, v, cu, max_seqlen, causal, scale):
    flex_attention, _ = _flex()
    total = q.shape[0]
    key = (total, causal, q.device)
    mask = _BLOCK_MASKS.get(cu, key)
    if mask is None:
        mask = _BLOCK_MASKS.put(cu, key, document_block_mask(cu, total, causal))
    if not torch.is_grad_enabled():  # CPU flex rejects requires_grad inputs even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    # Eager flex on CUDA materialises the scores: compile it (unless the caller already compiles us).
    fn = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
    # (1, H, T, D) contiguous: inductor's CPU flex template reads a 4-D buffer layout, not a view.
    q, k, v = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
    out = fn(
        q,
        k,
        v,
        block_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _sdpa(q, k, v, causal, scale, mask=None):
    """SDPA on (L, H, D) packed slices; GQA by repeating kv heads (works on every device and kernel)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal and mask is None,
        scale=scale,
    )
    return out[0].transpose(0, 1)


def _run_sdpa_per_sample(q, k, v, cu, max_seqlen, causal, scale):
    bounds = host_copy(cu).tolist()
    spans = [(a, b) for a, b in itertools.pairwise(bounds) if b > a]
    if len(spans) == 1:
        return _sdpa(q, k, v, causal, scale)
    return torch.cat([_sdpa(q[a:b], k[a:b], v[a:b], causal, scale) for a, b in spans])


def _run_sdpa_masked(q, k, v, cu, max_seqlen, causal, scale):
    doc = _doc_ids(cu, q.shape[0])
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones_like(mask).tril()
    return _sdpa(q, k, v, False, scale, mask)


_RUNNERS = {
    "flash_attn": _run_flash_attn,
    "torch_varlen": _run_torch_varlen,
    "flex": _run_flex,
    "sdpa_per_sample": _run_sdpa_per_sample,
    "sdpa_masked": _run_sdpa_masked,
}


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention within each packed sample; no token attends across a ``cu_seqlens`` boundary.

    q: (total_tokens, heads, head_dim); k, v: (total_tokens, kv_heads, head_dim) with
    heads % kv_heads == 0 (GQA: query head h reads kv head h // (heads // kv_heads)).
    cu_seqlens: (num_samples + 1,) int32 (int64 is converted), [0, ..., total_tokens], non-decreasing
    (empty samples allowed). max_seqlen: longest sample (computed when None). softmax_scale defaults to
    head_dim ** -0.5. backend: "auto" or one of ``BACKENDS`` (see ``resolve_backend``).
    Returns (total_tokens, heads, head_dim) in q's dtype.
    """
    _check_qkv(q, k, v)
    cu, max_seqlen = check_cu_seqlens(cu_seqlens, q.shape[0], max_seqlen)
    if cu.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu.device} but q on {q.device}; move it with .to(q.device).")
    return _run_checked(q, k, v, cu, max_seqlen, causal, softmax_scale, backend)


def _run_checked(q, k, v, cu, max_seqlen: int, causal: bool, softmax_scale: float | None, backend: str):
    """``varlen_attention`` once ``cu`` (int32, on q's device) and ``max_seqlen`` (int) are validated."""
    name = resolve_backend(backend, q, k, v)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    return _RUNNERS[name](q, k, v, cu, max_seqlen, causal, scale)
