"""One sample as the collator reads it: 1-D token tensors without a processor's padding, per-token fields
aligned with them, and the rest sorted into vision tensors, other tensors and metadata (:class:`SampleParts`).

A processed sample is ``process_sample``'s output or an HF processor's for one example: ``input_ids`` ``[L]``
or ``[1, L]``, optional ``labels`` / ``attention_mask`` / ``mm_token_type_ids`` of the same length, the vision
tensors of ``batch.VISION_KEYS``, and anything else (per-token weights are packed like ``input_ids``, other
tensors concatenated, other values kept as metadata).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..families import lookup
from .batch import VISION_KEYS
from .vision_inputs import join_vision

if TYPE_CHECKING:
    from .rows import RowPlan

__all__ = [
    "SampleParts",
    "TokenFields",
    "cat_counts",
    "check_images_beside_videos",
    "check_video_tokens",
    "collapsed_video_counts",
    "concat_vision",
    "frames_as_images",
    "keys_of",
    "num_images",
    "packed_extras",
    "placeholder_counts",
    "rename_samples",
    "split_fields",
]

# Per-sample keys the collator consumes itself.
_TOKEN_KEYS = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")
_OWN_KEYS = (*_TOKEN_KEYS, *VISION_KEYS, "tokens_per_image", "tokens_per_video", "tokens_per_video_placeholder")


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
    tokens_per_video_placeholder: torch.Tensor | None = None  # [m'] long, collapsed layout only


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
    name: str,
    is_video: torch.Tensor,
    vision: dict[str, torch.Tensor],
    tokens_per_video: torch.Tensor | None,
    merge: int | None,
) -> None:
    """ValueError naming the sample unless its video tokens (``is_video`` [L] bool) are what its
    ``video_grid_thw`` (Qwen-VL, ``merge`` the spatial merge size; None: not checked) and ``tokens_per_video``
    [m] make."""
    n_video = int(is_video.sum())
    video_grid = vision.get("video_grid_thw")
    if video_grid is not None and merge is not None:
        want = int((video_grid.reshape(-1, 3).prod(-1) // merge**2).sum())
        if n_video != want:
            raise ValueError(f"{name}: input_ids hold {n_video} video tokens but video_grid_thw makes {want}")
    if tokens_per_video is not None and int(tokens_per_video.sum()) != n_video:
        raise ValueError(
            f"{name}: input_ids hold {n_video} video tokens but tokens_per_video says "
            f"{tokens_per_video.tolist()}: the sample was changed after processing"
        )


def frames_as_images(
    family: str | None,
    tpi: torch.Tensor | None,
    n_images: int,
    sample: Mapping[str, Any],
    is_video: torch.Tensor,
    types: torch.Tensor | None,
) -> tuple[torch.Tensor | None, int, torch.Tensor | None, torch.Tensor]:
    """``(tokens_per_image, images, tokens_per_video, is_video)`` of a sample as the collator checks them.

    Where the family's processor writes video frames as image tokens (``Family.video_as_images``), its
    videos' tokens are counted with its images' (after them; the expanded layout only reads their sum), and
    its video tokens are those its ``mm_token_type_ids`` types 2 (GLM-4.1V's processor marks the image tokens
    between ``<|begin_of_video|>`` and ``<|end_of_video|>`` so); InternVL, which types none, has no video
    tokens apart from its images' (``tokens_per_video`` then checked with them, as image tokens).
    """
    tpv = sample.get("tokens_per_video")
    tpv = torch.as_tensor(tpv, dtype=torch.long).reshape(-1) if tpv is not None else None
    record = lookup(family)
    if tpv is None or record is None or not record.video_as_images:
        return tpi, n_images, tpv, is_video
    tpi = tpv if tpi is None else torch.cat([tpi, tpv])
    if types is None:
        return tpi, n_images + len(tpv), None, is_video
    return tpi, n_images + len(tpv), tpv, types == 2


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


def _per_video_placeholder(
    name: str, n_placeholders: int, per_video: torch.Tensor, grid: torch.Tensor | None, merge: int
) -> torch.Tensor:
    """One count per video placeholder: per video, or per temporal group where there are that many."""
    if n_placeholders == per_video.numel():
        return per_video
    if grid is not None and n_placeholders == int(grid[:, 0].sum()):
        return torch.repeat_interleave(grid[:, 1:].prod(-1) // merge**2, grid[:, 0])
    groups = f" or {int(grid[:, 0].sum())} (one per temporal group)" if grid is not None else ""
    raise ValueError(
        f"{name}: input_ids hold {n_placeholders} video placeholder(s) but its {per_video.numel()} video(s) need "
        f"{per_video.numel()} (one per video){groups} in the collapsed layout: process it with "
        "process_sample(..., layout='collapsed'), which also gives tokens_per_video_placeholder"
    )


def collapsed_video_counts(
    name: str,
    is_video: torch.Tensor,
    vision: dict[str, torch.Tensor],
    tokens_per_video: torch.Tensor | None,
    given: Any,
    merge: int,
    video_token_id: int | None,
) -> torch.Tensor | None:
    """Embeddings each video placeholder (``is_video`` [L] bool) of a collapsed sample becomes, ``[m']`` long
    (None without videos): one per video from ``video_grid_thw`` / ``tokens_per_video``, or one per temporal
    group (Qwen3-VL) where there are that many; ``given`` (its ``tokens_per_video_placeholder``) must equal
    them, or without a grid (LLaVA-OneVision) fit the placeholders and the videos' total."""
    grid = vision.get("video_grid_thw")
    grid = grid.reshape(-1, 3).long() if grid is not None else None
    if video_token_id is None:
        if grid is not None or "pixel_values_videos" in vision:
            raise ValueError(
                f"{name} has videos but the collator knows no video_token_id: pass video_token_id=, "
                "tokenizer= or model_config="
            )
        return None
    n_placeholders = int(is_video.sum())
    per_video = grid.prod(-1) // merge**2 if grid is not None else tokens_per_video
    if per_video is None:
        if n_placeholders:
            raise ValueError(
                f"{name}: the collapsed layout needs tokens_per_video_placeholder (or video_grid_thw / "
                "tokens_per_video) for its video placeholders; process_sample(..., layout='collapsed') returns it"
            )
        return None
    if tokens_per_video is not None and not torch.equal(tokens_per_video, per_video):
        raise ValueError(f"{name}: tokens_per_video {tokens_per_video.tolist()} disagrees with video_grid_thw")
    if given is None or grid is not None:
        derived = _per_video_placeholder(name, n_placeholders, per_video, grid, merge)
        if given is not None and not torch.equal(torch.as_tensor(given).long().reshape(-1), derived):
            raise ValueError(
                f"{name}: tokens_per_video_placeholder {torch.as_tensor(given).tolist()} disagrees with "
                f"video_grid_thw {grid.tolist()}, which makes {derived.tolist()}: the sample was changed after processing"
            )
        return derived
    counts = torch.as_tensor(given, dtype=torch.long).reshape(-1)
    if counts.numel() != n_placeholders or int(counts.sum()) != int(per_video.sum()) or bool((counts < 1).any()):
        raise ValueError(
            f"{name}: tokens_per_video_placeholder {counts.tolist()} does not fit its {n_placeholders} video "
            f"placeholder(s) and {int(per_video.sum())} video embeddings: the sample was changed after processing"
        )
    return counts


def placeholder_counts(
    flat_ids: torch.Tensor, kinds: Iterable[tuple[int | None, torch.Tensor | None]]
) -> tuple[tuple[int, ...], torch.Tensor, torch.Tensor]:
    """For each ``(token_id, counts)`` kind with counts (images, videos): the ids, the counts of all their
    placeholders in buffer order ``[P]``, and how often each token of ``flat_ids`` ``[L]`` repeats ``[L]``."""
    repeats = torch.ones_like(flat_ids)
    ids = []
    for token_id, counts in kinds:
        if token_id is not None and counts is not None:
            repeats[flat_ids == token_id] = counts
            ids.append(int(token_id))
    mask = torch.isin(flat_ids, torch.tensor(ids, dtype=flat_ids.dtype))
    return tuple(ids), repeats[mask], repeats


def cat_counts(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The samples' per-placeholder counts joined in packed order; None when no sample has any."""
    given = [p for p in parts if p is not None]
    return torch.cat(given) if given else None


def check_images_beside_videos(family: str | None, vision: Mapping[str, Any], parts: Sequence[SampleParts]) -> None:
    """Refuse a row with images and videos for a family whose model takes one or the other per forward.

    GLM-4.1V / 4.5V / 4.6V write video frames as ``<|image|>`` tokens, and transformers' model (5.24,
    ``modeling_glm4v.py`` ``get_placeholder_mask``) counts every such token as an image *and* as a video
    token: given both, it fails with a token/feature count mismatch far from the cause.
    """
    record = lookup(family)
    if record is None or not record.video_as_images:  # InternVL's frames travel as images: never both keys
        return
    if "pixel_values" not in vision or "pixel_values_videos" not in vision:
        return
    images = [p.name for p in parts if "pixel_values" in p.vision]
    videos = [p.name for p in parts if "pixel_values_videos" in p.vision]
    raise ValueError(
        f"{record.name}'s model takes images or videos in one forward, not both (transformers' "
        f"get_placeholder_mask counts its <|image|> frame tokens as both), but this row holds images "
        f"({', '.join(images[:3])}) and videos ({', '.join(videos[:3])}): pack image samples and video samples "
        "in separate rows (two datasets, e.g. interleaved by the training loop), or drop one kind"
    )


def concat_vision(ordered: list[SampleParts], family: str | None) -> dict[str, torch.Tensor]:
    """The samples' vision tensors joined in packed order as the model reads them (``vision_inputs``)."""
    vision = join_vision([s.vision for s in ordered])
    check_images_beside_videos(family, vision, ordered)
    return vision


def rename_samples(message: str, order: list[int]) -> str:
    """``message`` with every ``sample k`` (packed order) renamed to the caller's index ``order[k]``."""
    return re.sub(r"sample (\d+)", lambda mt: f"sample {order[int(mt.group(1))]}", message)
