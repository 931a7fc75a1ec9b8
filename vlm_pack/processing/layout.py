"""The tokenizer + image-processor path (Qwen-style, LLaVA) and the collapsed layout: each image token repeated
once per embedding, ``mm_token_type_ids`` for mRoPE models, and Megatron's one placeholder per image (per video,
or per temporal group of a video where the processor writes text between groups)."""

from __future__ import annotations

from typing import Any

import torch

from ..collate.labels import IGNORE_INDEX
from ..failures import InternalCheckError
from ..families import FAMILIES, canonical, lookup
from .chat import Rendering
from .render import _checked_ids


def _collapse(out: dict[str, Any], image_id: int, key: Any) -> dict[str, Any]:
    """Keep the first of each image's embedding tokens (Megatron's one placeholder per image)."""
    counts = out["tokens_per_image"]
    emb = out["input_ids"] == image_id
    positions = torch.nonzero(emb).flatten()
    cum = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    first, last = positions[cum[:-1]], positions[cum[1:] - 1]
    if not bool((last - first + 1 == counts).all()):
        raise InternalCheckError(
            f"sample {key!r}: layout='collapsed' needs each image's tokens in one run, but this family's "
            "processor interleaves them with row or tile markers; use layout='expanded'."
        )
    keep = ~emb
    keep[first] = True
    return _keep_tokens(out, keep)


def _keep_tokens(out: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
    """``out``'s per-token fields (``(L,)`` each) at ``keep`` ``(L,)`` bool: the placeholders collapsed."""
    for name in ("input_ids", "labels", "mm_token_type_ids", "token_type_ids"):
        if name in out:
            out[name] = out[name][keep]
    return out


def _runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start positions and lengths ``(m,)`` of the runs of True in ``mask`` ``(L,)``."""
    edges = torch.diff(torch.cat([mask.new_zeros(1), mask, mask.new_zeros(1)]).long())
    starts, ends = torch.nonzero(edges == 1).flatten(), torch.nonzero(edges == -1).flatten()
    return starts, ends - starts


def _video_runs_expected(out: dict[str, Any], merge: int, n_runs: int) -> torch.Tensor | None:
    """The runs a video's tokens may form: one per video (``tokens_per_video``), or, with
    ``video_grid_thw`` ``(m, 3)``, one per temporal group (``h * w / merge**2`` each; Qwen3-VL writes its
    ``<t seconds>`` and vision start / end between groups, models/qwen3_vl/processing_qwen3_vl.py)."""
    per_video = out["tokens_per_video"].long()
    if n_runs == per_video.numel():
        return per_video
    grid = out.get("video_grid_thw")
    if grid is not None and n_runs == int(grid[:, 0].sum()):
        return torch.repeat_interleave(grid[:, 1:].prod(-1) // (merge * merge), grid[:, 0])
    return None


def _collapse_videos(out: dict[str, Any], video_id: int, merge: int, key: Any, who: str = "processor") -> dict[str, Any]:
    """Keep the first token of each run of video tokens: one placeholder per video (per temporal group where
    text stands between groups); ``tokens_per_video_placeholder`` ``(m',)`` says what each becomes."""
    is_video = out["input_ids"] == video_id
    starts, lengths = _runs(is_video)
    expected = _video_runs_expected(out, merge, starts.numel())
    if expected is None or not torch.equal(lengths, expected):
        raise InternalCheckError(
            f"sample {key!r}: layout='collapsed' needs each video's tokens in one run (or one per temporal "
            f"group), but its {out['tokens_per_video'].numel()} video(s) of {out['tokens_per_video'].tolist()} "
            f"tokens stand in runs of {lengths.tolist()}: {who} interleaves them with other tokens, so no "
            "placeholder count can stand for them; use layout='expanded' for this family's videos."
        )
    keep = ~is_video
    keep[starts] = True
    out = _keep_tokens(out, keep)
    out["tokens_per_video_placeholder"] = lengths
    return out


def _bare_counts(image_processor: Any, tokenizer: Any, images: list[Any]) -> list[int]:
    """Image tokens per image of a bare image processor given with a tokenizer: counted by the processor class
    its record names (``Family.bare_processor``) built around the two with its checkpoints' settings."""
    import transformers

    from ..vision.from_processor import _image_processor_record

    record = _image_processor_record(image_processor)
    if record is None or record.bare_processor is None:
        name = type(image_processor).__name__
        bare = sorted(c for f in FAMILIES.values() if f.bare_processor for c in f.image_processors)
        raise InternalCheckError(
            f"process_sample with {name}: pass processor= (the checkpoint's HF processor) for this family; "
            f"tokenizer= with image_processor= covers the Qwen-style image processors (grids) and {', '.join(bare)}."
        )
    cls_name, settings = record.bare_processor
    processor = getattr(transformers, cls_name)(image_processor=image_processor, tokenizer=tokenizer, **dict(settings))
    sizes = [(im.height, im.width) for im in images]
    from .._compat import num_image_tokens

    return num_image_tokens(processor, sizes)


def _expand_text(ids_list: list[int], mask: list[bool], image_id: int, counts: list[int]) -> dict[str, Any]:
    """``input_ids`` / ``labels`` (L,) with each image token repeated ``counts[i]`` times, ``tokens_per_image``."""
    input_ids = torch.tensor(ids_list, dtype=torch.long)
    trained = torch.tensor(mask, dtype=torch.bool) & (input_ids != image_id)
    labels = torch.where(trained, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    per_image = torch.tensor(counts, dtype=torch.long)
    if counts:
        repeats = torch.ones_like(input_ids)
        repeats[input_ids == image_id] = per_image
        input_ids, labels = input_ids.repeat_interleave(repeats), labels.repeat_interleave(repeats)
    return {"input_ids": input_ids, "tokens_per_image": per_image, "labels": labels}


def _with_image_processor(
    image_processor: Any,
    tokenizer: Any,
    rendering: Rendering,
    images: list[Any],
    key: Any,
    tokens: tuple[list[int], list[bool]] | None = None,
) -> dict[str, Any]:
    """Tokenizer + image processor: the placeholder repeated once per embedding (Qwen-style, LLaVA)."""
    ids_list, mask, image_id = _checked_ids(tokenizer, rendering, len(images), key, tokens)
    out: dict[str, Any] = {}
    counts: list[int] = []
    if images:
        vision = image_processor(images=images, return_tensors="pt")
        out["pixel_values"] = vision["pixel_values"]
        if "image_grid_thw" in vision:
            grid = out["image_grid_thw"] = vision["image_grid_thw"]
            counts = _grid_counts(image_processor, grid).tolist()
        else:
            if "image_sizes" in vision:
                out["image_sizes"] = vision["image_sizes"]
            counts = _bare_counts(image_processor, tokenizer, images)
    out.update(_expand_text(ids_list, mask, image_id, counts))
    return out


def _grid_counts(image_processor: Any, grid: torch.Tensor) -> torch.Tensor:
    """Embeddings per image (n,) of a Qwen-style ``image_grid_thw`` (n, 3): its patches over merge**2."""
    merge = int(getattr(image_processor, "merge_size", 2))
    return grid.prod(-1) // (merge * merge)


def _finish(
    out: dict[str, Any],
    tokenizer: Any,
    family: str | None,
    image_id: int,
    layout: str,
    n_images: int,
    key: Any,
) -> dict[str, Any]:
    """The image-processor path's ``mm_token_type_ids`` (Qwen-style) and the collapsed layout."""
    record = lookup(canonical(family or getattr(tokenizer, "vlm_pack_family", None)))
    if "image_grid_thw" in out or (record is not None and record.mrope is not None):  # what mRoPE models read
        out["mm_token_type_ids"] = (out["input_ids"] == image_id).long()
    if layout == "collapsed" and n_images:
        out = _collapse(out, image_id, key)
    return out


