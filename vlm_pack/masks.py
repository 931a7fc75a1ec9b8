"""Attention masks for packed rows of models whose attention is not plain causal: Gemma 3.

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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .remap import segment_ids

__all__ = ["gemma3_attention_masks", "image_blocks"]


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
    full = same_sample & (causal[None] | same_block)
    sliding = full
    if sliding_window is not None:
        sliding = full & (pos[None, :] > pos[:, None] - int(sliding_window))[None]
    masks = {"full_attention": full[:, None], "sliding_attention": sliding[:, None]}
    if dtype is None:
        return masks
    low = torch.finfo(dtype).min
    return {
        k: torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, low) for k, m in masks.items()
    }
