"""Attention masks for packed rows of models whose attention is not plain causal: Gemma 3 and Gemma 4.

Gemma 3's image tokens attend to each other both ways inside one image (``token_type_ids == 1``), text is
causal, and every other layer sees only a sliding window. For one sample transformers builds::

    full_attention     causal OR same image block
    sliding_attention  (causal OR same image block) AND kv > q - sliding_window

In a packed row (transformers 5.23) the full-attention layers come out right, but the sliding-window layers
apply the image blocks *before* the packing wrapper re-indexes positions within each sample, so from the
second sample on text tokens see future tokens and images lose their two-way attention. These masks are
built from the packed row itself, so every sample gets exactly the mask it gets alone::

    row          a0 a1 [I0 I1] a2 | b0 [J0 J1] b1          [..] = one image block (token_type_ids 1)
    sample       0  0   0  0   0  | 1   1  1   1
    allowed(q, k) = same sample AND (k <= q OR same image block)
    sliding(q, k) = allowed(q, k) AND k > q - sliding_window

Positions inside a sample differ by the same amount as in the row, so the window needs no re-indexing.
Gemma 4 (``use_bidirectional_attention="vision"``, ``modeling_gemma4.py``) keeps the two-way image blocks on
its sliding layers only; its full-attention layers are causal per sample (``two_way_layers``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..collate.remap import segment_ids

__all__ = ["TOKENS_KEY", "MaskMapping", "gemma3_attention_masks", "image_blocks", "real_tokens"]


def image_blocks(token_type_ids: torch.Tensor) -> torch.Tensor:
    """Block id of every image token (each maximal run of ``token_type_ids == 1``), -1 for text.

    ``token_type_ids`` ``[R, T]``; returns int64 ``[R, T]``, ids unique over the whole batch.
    """
    is_image = token_type_ids == 1
    starts = is_image & ~F.pad(is_image, (1, 0))[:, :-1]
    ids = torch.cumsum(starts.reshape(-1).long(), 0).reshape(is_image.shape) - 1
    return torch.where(is_image, ids, torch.full_like(ids, -1))


def gemma3_attention_masks(
    token_type_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    sliding_window: int | None,
    *,
    dtype: torch.dtype | None = None,
    two_way_layers: tuple[str, ...] = ("full_attention", "sliding_attention"),
    images_past_window: bool = False,
) -> dict[str, torch.Tensor]:
    """Gemma 3's per-layer-type masks of a packed batch: ``{"full_attention": M, "sliding_attention": S}``.

    Args:
        token_type_ids: ``[R, T]`` 1 on image tokens (``<image_soft_token>``), 0 elsewhere.
        cu_seqlens_padded: ``[N + 1]`` sample offsets in the flattened ``R*T`` buffer (padding belongs to
            the sample before it, and is causal there: no real token ever sees it).
        sliding_window: ``config.text_config.sliding_window`` (None: the sliding layers see everything a
            full layer sees).
        dtype: None gives bool masks (True = attend; what sdpa takes); a float dtype gives additive masks
            (0 or the dtype's minimum; what eager attention adds to its scores).
        two_way_layers: the layer types whose image blocks attend both ways; the others are causal per
            sample (Gemma 4: ``("sliding_attention",)``, as its ``create_masks_for_vision_model``).
        images_past_window: the sliding layers' image blocks ignore the window, (causal AND window) OR same
            image (Gemma 4 on transformers < 5.13, ``vlm_pack._compat.images_past_window``).

    Returns:
        The masks ``[R, 1, T, T]``, to pass as ``attention_mask=`` (Gemma 3 then uses them as they are,
        with ``token_type_ids`` still given).
    """
    rows, length = token_type_ids.shape
    device = token_type_ids.device
    sample = segment_ids(cu_seqlens_padded.to(device=device, dtype=torch.int64), rows * length)
    sample = sample.reshape(rows, length)
    block = image_blocks(token_type_ids)
    pos = torch.arange(length, device=device)
    causal = pos[None, :] <= pos[:, None]  # [q, k]
    same_sample = sample[:, :, None] == sample[:, None, :]
    same_block = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
    causal_only = same_sample & causal[None]
    two_way = same_sample & (causal[None] | same_block)
    full = two_way if "full_attention" in two_way_layers else causal_only
    sliding = two_way if "sliding_attention" in two_way_layers else causal_only
    if sliding_window is not None:
        window = (pos[None, :] > pos[:, None] - int(sliding_window))[None]
        past = same_block if images_past_window and "sliding_attention" in two_way_layers else False
        sliding = sliding & (window | past)
    masks = {"full_attention": full[:, None], "sliding_attention": sliding[:, None]}
    if dtype is None:
        return masks
    low = torch.finfo(dtype).min
    return {
        k: torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, low) for k, m in masks.items()
    }


#: The entry of a :class:`MaskMapping` that holds the 2-D mask of real tokens.
TOKENS_KEY = "real_tokens"


class MaskMapping(dict):
    """Packed masks as the one ``attention_mask`` a forward call takes (Gemma 3; mixture-of-experts models
    whose router loss reads a padding mask, Qwen3.5-MoE: ``full_attention`` and ``linear_attention`` None in
    the flash style)::

        {"full_attention": [R, 1, T, T], "sliding_attention": [R, 1, T, T], "real_tokens": [R, T] int64}

    Gemma 3 reads the entries of its layer types. Code written for a 2-D padding mask reads ``real_tokens``
    (1 on real tokens, 0 on padding): indexing with anything but a name (transformers <= 5.16's Gemma 3 loss
    takes ``attention_mask[:, -n:]``) and ``.sum()`` (TRL's count of a batch's tokens). Everything is an entry,
    so the mapping survives what happens to a batch on its way to the model: accelerate's ``send_to_device``
    rebuilds every mapping as ``type(m)({key: moved value})``, copy and pickle rebuild it from its items.
    """

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return super().__getitem__(key)
        return super().__getitem__(TOKENS_KEY)[key]

    def sum(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self[TOKENS_KEY].sum(*args, **kwargs)

    def reshape(self, *shape: Any) -> torch.Tensor:
        """``real_tokens`` reshaped: what a mixture-of-experts load-balancing loss reads
        (``attention_mask.reshape(-1)``), so that padding never enters the router's statistics."""
        return self[TOKENS_KEY].reshape(*shape)


def real_tokens(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, rows: int, length: int
) -> torch.Tensor:
    """``[R, T]`` int64: 1 on the real tokens of packed rows, 0 on each sample's padding and the rows' tail.

    ``cu_seqlens`` / ``cu_seqlens_padded``: ``[N + 1]`` offsets of the samples' real and padded spans in the
    flattened ``R*T`` buffer (sample ``k``'s real tokens open its padded span).
    """
    total = rows * length
    device = cu_seqlens_padded.device
    padded = cu_seqlens_padded.to(torch.int64)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.int64)
    sample = segment_ids(padded, total)  # N on the rows' tail, after the last sample
    k = sample.clamp(max=len(lengths) - 1)
    real = (sample < len(lengths)) & (torch.arange(total, device=device) - padded[k] < lengths[k])
    return real.to(torch.int64).reshape(rows, length)
