"""Varlen attention for Hugging Face transformers models: every packed sample attends only to itself.

The kernels (``varlen_attention`` over packed (T, H, D) tensors, the backends and how "auto" picks one)
live in ``vlm_pack.forward.varlen`` and are re-exported here, so ``from vlm_pack.forward.attention import ...`` keeps
working; this room routes a transformers model's attention calls to them.

``use_varlen_attention(model)`` (or ``register_hf_attention()`` then
``attn_implementation="vlm_pack_varlen"``) routes every attention call of a transformers 5.x model through
``hf_varlen_attention_forward``, which reads the sample boundaries from the flash-attention kwargs
(``cu_seq_lens_q``/``cu_seq_lens_k``/``max_length_q``/``max_length_k``) or, when absent, from the restarts
of ``position_ids`` (the same rule transformers uses to detect packed rows). Usage::

    out = varlen_attention(q, k, v, cu_seqlens, max_seqlen)      # q (T, H, D), k/v (T, Hkv, D)
    resolve_backend("auto", q)                                    # which backend "auto" runs here

    model = use_varlen_attention(model)                           # any transformers 5.x model
    model(input_ids=row, position_ids=pos, use_cache=False)       # row (1, T), pos restarts per sample
    model(input_ids=row, position_ids=pos, use_cache=False,       # or the boundaries, explicitly
          cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)

Never name that kwarg ``cu_seqlens`` for a HF VLM: the vision tower takes ``cu_seqlens`` as its own.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from .boundaries import (
    Packing,
    covers,
    cu_seqlens_from_position_ids,
    packing_from_cu,
    packing_from_mask,
    packing_from_positions,
)
from .varlen import (
    BACKENDS,
    _run_checked,
    available_backends,
    backend_unavailable_reason,
    document_block_mask,
    resolve_backend,
    varlen_attention,
)

__all__ = [
    "BACKENDS",
    "HF_ATTN_IMPLEMENTATION",
    "available_backends",
    "backend_unavailable_reason",
    "cu_seqlens_from_position_ids",
    "document_block_mask",
    "hf_varlen_attention_forward",
    "register_hf_attention",
    "resolve_backend",
    "use_varlen_attention",
    "varlen_attention",
]


#: Name under which ``register_hf_attention`` registers the HF attention and mask functions.
HF_ATTN_IMPLEMENTATION = "vlm_pack_varlen"


class _ModuleSettings:
    """What ``use_varlen_attention`` chose per module: its varlen backend, and whether it belongs to an encoder
    (vision tower, audio encoder). vlm-pack's state, held by weak reference instead of written onto the model's
    modules: transformers calls the one registered attention function with the module, which looks it up."""

    def __init__(self) -> None:
        self.backends: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self.encoders: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def backend(self, module: Any) -> str:  # a module no model switched (or a test's stand-in): "auto"
        return self.backends.get(module, "auto") if isinstance(module, torch.nn.Module) else "auto"

    def is_encoder(self, module: Any) -> bool:
        return isinstance(module, torch.nn.Module) and module in self.encoders


_SETTINGS = _ModuleSettings()


def _hf_packing(
    module, query, causal, attention_mask, position_ids, cu_q, cu_k, max_length
) -> Packing | None:
    """Where the samples of this HF attention call lie (see ``hf_varlen_attention_forward``), or None
    when the call is not packed (each of the B rows is one sequence)."""
    b, _, t, _ = query.shape
    if cu_q is not None and (
        causal
        or position_ids is not None
        or (not _SETTINGS.is_encoder(module) and covers(cu_q, b * t))
    ):
        return packing_from_cu(cu_q, cu_k, max_length, b * t, query.device)
    if attention_mask is not None:
        return packing_from_mask(attention_mask, position_ids, b, t, query.device)
    if position_ids is not None:
        return packing_from_positions(position_ids, b, t, query.device)
    return None


def _sdpa_fallback(query, key, value, mask, is_causal, scaling):
    """(B, H, T, D) SDPA for calls that are not packed text attention: vision chunks, decoding."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal and mask is None, scale=scaling
    )
    return out.transpose(1, 2).contiguous()


def _decode_attention(query, key, value, attention_mask, causal, scaling):
    """Fewer queries than keys (decoding with a KV cache) or a 4-D mask: SDPA with the mask, causal
    bottom-right aligned (query i sits at key position i + T_k - T_q)."""
    t_q, t_k = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is not None and mask.dim() == 2:  # (B, T_k) padding mask from the flash mask function
        mask = mask[:, None, None, :].bool()
    if causal and t_q > 1:
        rows = torch.arange(t_q, device=query.device)[:, None] + (t_k - t_q)
        tri = rows >= torch.arange(t_k, device=query.device)[None, :]
        mask = tri if mask is None else mask & tri
    return _sdpa_fallback(query, key, value, mask, False, scaling)


def _run_packing(query, key, value, packing: Packing, causal, scaling, backend) -> torch.Tensor:
    """(B, H, T, D) query, (B, Hkv, T, D) key/value -> (B, T, H, D), attention within each sample."""
    b, h, t, d = query.shape
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value))
    if packing.index is not None:
        q, k, v = (x.index_select(0, packing.index) for x in (q, k, v))
    out = _run_checked(q, k, v, packing.cu, packing.max_seqlen, causal, scaling, backend)
    if packing.index is not None:
        out = out.new_zeros(b * t, h, d).index_copy(0, packing.index, out)
    return out.view(b, t, h, d)


def hf_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | torch.Tensor | None = None,
    max_length_k: int | torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers ``AttentionInterface`` function: query (B, H, T, D), key/value (B, Hkv, T, D) ->
    ((B, T, H, D), None).

    Where the sample boundaries come from, first match wins:

    1. ``cu_seq_lens_q``/``cu_seq_lens_k`` (+ ``max_length_q``/``_k``) kwargs over the B*T tokens, as the
       flash-attention path of transformers takes them (never pass a kwarg named ``cu_seqlens`` to a HF VLM:
       the vision tower takes it as its own). They may stay on the host (CPU) while the model runs on a
       GPU: then no layer copies anything back. Vision towers also receive the text's kwargs through
       ``**kwargs``; a non-causal call without ``position_ids`` therefore uses them only when they cover
       exactly its B*T tokens and the module is not part of a vision/audio encoder (which
       ``use_varlen_attention`` marks), and otherwise ignores them.
    2. a 2-D padding ``attention_mask`` (B, T): padding tokens are dropped; ``position_ids``, when given,
       still split each row into its packed samples (without them each row's real tokens are one sample).
    3. restarts in ``position_ids`` (a sample starts where a position is not its predecessor + 1).
    4. none: each of the B rows is one sequence (plain SDPA), e.g. the Qwen2-VL vision tower's per-image
       calls.

    The boundaries are computed once per forward, by the first layer, on host copies of these tensors (one
    device-to-host copy per tensor object, none for host tensors) and cached for the other layers.
    Calls with fewer queries than keys (decoding with a KV cache) use SDPA with the padding mask.
    """
    if dropout:
        raise ValueError(
            f"{HF_ATTN_IMPLEMENTATION} does not implement attention dropout (got {dropout}); set the "
            "model config's attention_dropout to 0.0."
        )
    if softcap is not None or sliding_window is not None:
        raise NotImplementedError(
            f"{HF_ATTN_IMPLEMENTATION} supports neither softcap nor sliding windows (got softcap={softcap}, "
            f"sliding_window={sliding_window}); use attn_implementation='flash_attention_2' or 'sdpa'."
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if query.shape[2] != key.shape[2] or (attention_mask is not None and attention_mask.dim() == 4):
        return _decode_attention(query, key, value, attention_mask, causal, scaling), None
    packing = _hf_packing(
        module, query, causal, attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q
    )
    if packing is None:
        return _sdpa_fallback(query, key, value, None, causal and query.shape[2] > 1, scaling), None
    backend = _SETTINGS.backend(module)
    return _run_packing(query, key, value, packing, causal, scaling, backend), None


def register_hf_attention() -> str:
    """Register ``hf_varlen_attention_forward`` (and a padding-only mask function, so transformers never
    builds a (T, T) mask for it) under ``HF_ATTN_IMPLEMENTATION``; returns that name. Idempotent.

    Then ``Model.from_pretrained(..., attn_implementation="vlm_pack_varlen")`` or
    ``model.set_attn_implementation("vlm_pack_varlen")`` selects it.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(HF_ATTN_IMPLEMENTATION, hf_varlen_attention_forward)
    # The flash mask function returns None or the (B, T) padding mask: no O(T^2) tensor. Without a
    # registered mask function transformers would drop a padding mask altogether.
    AttentionMaskInterface.register(HF_ATTN_IMPLEMENTATION, flash_attention_mask)
    return HF_ATTN_IMPLEMENTATION


def use_varlen_attention(model: torch.nn.Module, backend: str = "auto") -> torch.nn.Module:
    """Switch a transformers model (all sub-models, vision tower included) to varlen attention.

    ``backend`` fixes the varlen backend for this model ("auto" picks per call). Feed packed rows with
    per-sample ``position_ids`` (Qwen2-VL: (4, 1, T)) or with ``cu_seq_lens_q``/``cu_seq_lens_k``/
    ``max_length_q``/``max_length_k``, ``attention_mask=None`` and ``use_cache=False``. The token mixers that
    are not attention (Qwen3.5's gated delta net, LFM2's short conv) get the boundaries too
    (``isolate_token_mixers``). Returns the model.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} or 'auto'.")
    model.set_attn_implementation(register_hf_attention())
    for module in model.modules():
        _SETTINGS.backends[module] = backend
    # Sub-models with their own config that is neither the model's nor its text config are encoders
    # (vision tower, audio encoder): their calls never take the text's cu_seq_lens_q from **kwargs.
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None else None
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and sub.config is not config and sub.config is not text_config:
            _SETTINGS.encoders.update(sub.modules())
    from .mixers import isolate_token_mixers

    return isolate_token_mixers(model)
