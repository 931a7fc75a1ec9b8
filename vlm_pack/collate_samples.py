"""One sample as the collator reads it: 1-D token tensors without a processor's padding, per-token fields
aligned with them, and the rest sorted into vision tensors, other tensors and metadata (:class:`SampleParts`).

A processed sample is ``process_sample``'s output or an HF processor's for one example: ``input_ids`` ``[L]``
or ``[1, L]``, optional ``labels`` / ``attention_mask`` / ``mm_token_type_ids`` of the same length, the vision
tensors of ``batch.VISION_KEYS``, and anything else (per-token weights are packed like ``input_ids``, other
tensors concatenated, other values kept as metadata).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .batch import VISION_KEYS

if TYPE_CHECKING:
    from .collate_rows import RowPlan

__all__ = [
    "SampleParts",
    "TokenFields",
    "check_video_tokens",
    "keys_of",
    "num_images",
    "packed_extras",
    "split_fields",
]

# Per-sample keys the collator consumes itself.
_TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")
_OWN_KEYS = (*_TOKEN_KEYS, *VISION_KEYS, "tokens_per_image", "tokens_per_video")


@dataclass
class SampleParts:
    index: int
    name: str  # "sample 3" or "sample 3 (key 'abc')" for error messages
    ids: torch.Tensor  # [L] long, in the collator's layout
    labels: torch.Tensor  # [L] long
    types: torch.Tensor | None  # [L] long mm_token_type_ids
    expanded_len: int
    tokens_per_image: torch.Tensor | None  # [n] long
    vision: dict[str, torch.Tensor]
    token_extra: dict[str, torch.Tensor]
    other_extra: dict[str, torch.Tensor]
    metadata: dict[str, Any]


def _token_tensor(value: Any, name: str, what: str, integer: bool = True) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if t.dim() == 2 and t.shape[0] == 1:  # HF processors return [1, L] for one example
        t = t[0]
    if t.dim() != 1:
        raise ValueError(
            f"{name}: {what} must be [L] or [1, L] (one example), got shape {tuple(t.shape)}; collate "
            "examples one per list entry"
        )
    if not integer:
        return t
    if t.dtype.is_floating_point:
        raise TypeError(f"{name}: {what} must hold integers, got {t.dtype}")
    return t.long()


class TokenFields:
    """One sample's ``input_ids`` ``[L]`` without a processor's padding, and its other per-token fields
    read aligned with them (``fields(value, what)``)."""

    def __init__(self, sample: Mapping[str, Any], name: str) -> None:
        self.name = name
        ids = _token_tensor(sample["input_ids"], name, "input_ids")
        self.n_tokens = ids.numel()  # as given, padding included
        self.keep: torch.Tensor | None = None
        if sample.get("attention_mask") is not None:
            mask = _token_tensor(sample["attention_mask"], name, "attention_mask")
            if mask.numel() != self.n_tokens:
                raise ValueError(
                    f"{name}: attention_mask has {mask.numel()} entries, input_ids {self.n_tokens}"
                )
            if not bool(mask.all()):
                self.keep = mask.bool()  # a processor's padding: drop it, packing pads by itself
                ids = ids[self.keep]
        if ids.numel() == 0:
            raise ValueError(f"{name} has no tokens: drop empty samples before collating")
        self.ids = ids

    def is_per_token(self, value: torch.Tensor) -> bool:
        """``[L]`` or ``[1, L]``: one entry per token of the sample as given."""
        return (
            value.dim() in (1, 2)
            and value.shape[-1] == self.n_tokens
            and (value.dim() == 1 or value.shape[0] == 1)
        )

    def __call__(self, value: Any, what: str, integer: bool = True) -> torch.Tensor:
        t = _token_tensor(value, self.name, what, integer=integer)
        if t.numel() != self.n_tokens:
            raise ValueError(
                f"{self.name}: {what} has {t.numel()} entries but input_ids has {self.n_tokens}: one per token"
            )
        return t[self.keep] if self.keep is not None else t


def split_fields(
    sample: Mapping[str, Any], tokens: TokenFields
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """The sample's vision tensors, other per-token tensors, other tensors and non-tensor values."""
    vision: dict[str, torch.Tensor] = {}
    for k in VISION_KEYS:
        if sample.get(k) is not None:
            v = sample[k]
            vision[k] = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
    if "second_per_grid_ts" in vision:
        vision["second_per_grid_ts"] = vision["second_per_grid_ts"].reshape(-1)
    token_extra: dict[str, torch.Tensor] = {}
    other_extra: dict[str, torch.Tensor] = {}
    metadata: dict[str, Any] = {}
    for k, v in sample.items():
        if k in _OWN_KEYS:
            continue
        if not isinstance(v, torch.Tensor):
            metadata[k] = v
        elif tokens.is_per_token(v):
            token_extra[k] = tokens(v, k, integer=False)  # weights, masks: keep their dtype
        else:
            other_extra[k] = v
    return vision, token_extra, other_extra, metadata


def keys_of(dicts: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every key of ``dicts``, in first-seen order."""
    return list(dict.fromkeys(k for d in dicts for k in d))


def packed_extras(ordered: list[SampleParts], plan: RowPlan, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Other per-token tensors packed like ``input_ids`` (0 where a sample lacks one); other tensors
    concatenated along dim 0 in packed order."""
    extra = {}
    for k in keys_of(s.token_extra for s in ordered):
        dtype = next(s.token_extra[k].dtype for s in ordered if k in s.token_extra)
        parts = [s.token_extra.get(k, torch.zeros(s.ids.shape, dtype=dtype)) for s in ordered]
        extra[k] = plan.scatter(parts, 0).reshape(shape)
    for k in keys_of(s.other_extra for s in ordered):
        parts = [s.other_extra[k] for s in ordered if k in s.other_extra]
        try:
            extra[k] = torch.cat([p.reshape(1) if p.dim() == 0 else p for p in parts])
        except RuntimeError as e:
            raise ValueError(f"cannot concatenate the per-sample tensors {k!r} along dim 0: {e}") from None
    return extra


def check_video_tokens(
    name: str, is_video: torch.Tensor, vision: dict[str, torch.Tensor], tokens_per_video: torch.Tensor | None, merge: int
) -> None:
    """ValueError naming the sample unless its video tokens (``is_video`` [L] bool) are what its
    ``video_grid_thw`` (Qwen-VL, ``merge`` the spatial merge size) and ``tokens_per_video`` [m] make."""
    n_video = int(is_video.sum())
    video_grid = vision.get("video_grid_thw")
    if video_grid is not None:
        want = int((video_grid.reshape(-1, 3).prod(-1) // merge**2).sum())
        if n_video != want:
            raise ValueError(f"{name}: input_ids hold {n_video} video tokens but video_grid_thw makes {want}")
    if tokens_per_video is not None and int(tokens_per_video.sum()) != n_video:
        raise ValueError(
            f"{name}: input_ids hold {n_video} video tokens but tokens_per_video says "
            f"{tokens_per_video.tolist()}: the sample was changed after processing"
        )


def num_images(vision: dict[str, torch.Tensor], tpi: torch.Tensor | None) -> int:
    if "image_grid_thw" in vision:
        return int(vision["image_grid_thw"].reshape(-1, 3).shape[0])
    if "image_sizes" in vision:
        return int(vision["image_sizes"].reshape(-1, 2).shape[0])
    if tpi is not None:
        return int(tpi.numel())
    pv = vision.get("pixel_values")
    if pv is not None:
        # LLaVA-1.5: [n, C, H, W]; a single [C, H, W] image is one.
        return int(pv.shape[0]) if pv.dim() == 4 else 1
    return 0
