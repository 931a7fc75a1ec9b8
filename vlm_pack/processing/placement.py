"""Image placement through an HF processor: its own expansion and tokenization of the rendered prompt, where
each image's placeholder went in the expanded text (reported by transformers >= 5.7, else recorded by a
tokenizer that takes marks out), the labels moved onto the expanded prompt and the tokens per image."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from .._compat import VIDEOS_SINCE
from ..collate.labels import IGNORE_INDEX
from ..failures import InternalCheckError, SampleError
from .chat import Rendering
from .render import _embedding_token_id, _trained_tokens
from .videos import video_embedding_id


def _shift(
    spans: Sequence[tuple[int, int]], ends: torch.Tensor, new_ends: torch.Tensor
) -> list[tuple[int, int]]:
    """Character spans of the rendered prompt moved to the expanded prompt, where the placeholder ending at
    ``ends[i]`` became the text ending at ``new_ends[i]``."""
    gained = torch.cat([torch.zeros(1, dtype=torch.long), new_ends - ends])
    out = []
    for start, end in spans:
        i, j = (int(torch.searchsorted(ends, c, right=True)) for c in (start, end))
        out.append((start + int(gained[i]), end + int(gained[j])))
    return out


_TEXT_KEYS = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets")

# Processor classes seen to return ``text_replacement_offsets`` (transformers >= 5.7 added it): True / False.
_REPORTS_REPLACEMENTS: dict[type, bool] = {}
# Marks one placeholder's ends in the text handed to a processor that does not report its replacements; a
# private-use character, so no chat template writes it (checked per prompt).
_EDGE = "\ue000"


class _RecordingTokenizer:
    """A processor's tokenizer that takes ``_EDGE`` marks out of the text it is handed, keeping where they
    were: the spans of the expanded prompt each image's placeholder became."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.replaced: list[tuple[int, int]] = []

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        texts = [text] if isinstance(text, str) else list(text)
        pieces = texts[0].split(_EDGE)
        if len(pieces) % 2 == 0:
            raise RuntimeError(
                "the processor split an image's placeholder from its marks; report this to vlm-pack"
            )
        ends = list(itertools.accumulate(len(piece) for piece in pieces))
        self.replaced = [(ends[i], ends[i + 1]) for i in range(0, len(pieces) - 1, 2)]
        texts[0] = "".join(pieces)
        return self.tokenizer(texts[0] if isinstance(text, str) else texts, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def _call_processor(
    processor: Any, rendering: Rendering, images: list[Any], videos: Any = None
) -> tuple[Any, list[tuple[str, int, int, int]]]:
    """``processor(text=[prompt], images=[images], videos=...)`` with offsets, and per image and video in
    the order of the prompt ``(kind, end of its placeholder in the rendered prompt, start, end of what it
    was replaced by in the expanded prompt)``, ``kind`` ``"image"`` or ``"video"``.

    ``videos``: :class:`~vlm_pack.processing.videos.DecodedVideos`, their frames sampled already (the
    processor is told so, with the metadata its timestamps and ``second_per_grid_ts`` come from).

    transformers >= 5.7 reports them (``return_text_replacement_offsets``). Older processors each replace the
    placeholder inside their own ``__call__`` and hand the expanded text to their tokenizer, so there the
    placeholders are marked with ``_EDGE`` on both sides and the processor gets a tokenizer that takes the marks
    out before tokenizing, keeping where they were: the ids and every other output are the processor's own.
    """
    kind = type(processor)
    call = dict(
        return_tensors="pt", return_offsets_mapping=True, add_special_tokens=rendering.add_special_tokens
    )
    if videos:
        call.update(videos.processor_kwargs())
    if _REPORTS_REPLACEMENTS.get(kind, True) or not images or videos:
        enc = processor(
            text=[rendering.text],
            images=[images] if images else None,
            return_text_replacement_offsets=True,
            **call,
        )
        if not images and not videos:
            return enc, []
        reported = enc.get("text_replacement_offsets")
        _REPORTS_REPLACEMENTS[kind] = reported is not None
        if reported is not None:
            return enc, [(r["type"], r["span"][1], *r["new_span"]) for r in reported[0] if r["type"] in _MEDIA]
        if videos:
            raise InternalCheckError(
                f"{kind.__name__} does not report where it expanded each video (text_replacement_offsets): "
                f"video samples need transformers >= {'.'.join(map(str, VIDEOS_SINCE))}"
            )
    if _EDGE in rendering.text:
        raise SampleError(
            "bad_text",
            f"the rendered prompt holds {_EDGE!r}, which vlm-pack marks placeholders with; remove it",
        )
    recorder = _RecordingTokenizer(processor.tokenizer)
    marked = copy.copy(processor)  # a shallow copy: the user's processor keeps its own tokenizer
    marked.tokenizer = recorder
    text = rendering.text.replace(rendering.placeholder, f"{_EDGE}{rendering.placeholder}{_EDGE}")
    enc = marked(text=[text], images=[images], **call)
    placeholder = len(rendering.placeholder)
    pieces = rendering.text.split(rendering.placeholder)[:-1]
    ends = itertools.accumulate(len(p) + placeholder for p in pieces)
    return enc, [("image", end, *new) for end, new in zip(ends, recorder.replaced)]


_MEDIA = ("image", "video")


def _with_processor(
    processor: Any, rendering: Rendering, images: list[Any], key: Any, videos: Any = None
) -> dict[str, Any]:
    """The processor's expansion and tokenization of the rendered prompt, with labels and the embeddings of
    each image (``tokens_per_image``) and video (``tokens_per_video``)."""
    enc, replaced = _call_processor(processor, rendering, images, videos)
    if len(enc["input_ids"]) != 1:  # a processor that writes prompts of its own: the user's text is not kept
        raise InternalCheckError(
            f"{type(processor).__name__} made {len(enc['input_ids'])} rows of one sample's prompt (it writes "
            "prompts of its own around the text it is given), so the sample would not be the user's text: "
            "vlm-pack packs processors that expand one prompt into one row; process this model's samples "
            "yourself and pack their input_ids"
        )
    ids = enc["input_ids"][0]
    offsets = enc["offset_mapping"][0].long()
    media = torch.tensor([r[1:] for r in replaced], dtype=torch.long).reshape(-1, 3)  # [n, (end, start', end')]
    length = int(offsets.max()) if len(offsets) else 0
    trained = _trained_tokens(_shift(rendering.spans, media[:, 0].contiguous(), media[:, 2]), offsets, max(length, 1))
    out = {k: v for k, v in enc.items() if k not in _TEXT_KEYS}
    counts = {"image": torch.zeros(len(images), dtype=torch.long)}
    if videos:
        counts["video"] = torch.zeros(len(videos), dtype=torch.long)
    if replaced:
        starts, ends = media[:, 1].contiguous(), media[:, 2]
        item_of = torch.searchsorted(starts, offsets[:, 0].contiguous(), right=True) - 1
        inside = (item_of >= 0) & (offsets[:, 0] < ends[item_of.clamp(min=0)]) & (offsets[:, 1] > offsets[:, 0])
        trained &= ~inside
        kinds = [r[0] for r in replaced]
        token_ids = {"image": _embedding_token_id(processor), "video": video_embedding_id(processor)}
        for kind in counts:
            mine = torch.tensor([k == kind for k in kinds], dtype=torch.bool)
            rank = torch.cumsum(mine.long(), 0) - 1  # the item's index among its kind
            hit = (ids == token_ids[kind]) & inside & mine[item_of.clamp(min=0)]
            counts[kind] = torch.bincount(rank[item_of[hit]], minlength=len(counts[kind]))
        for kind in counts:  # InternVL's and GLM's frames are image tokens: one id, counted over both kinds
            sharing = [k for k in counts if token_ids[k] == token_ids[kind]]
            if sum(int(counts[k].sum()) for k in sharing) != int((ids == token_ids[kind]).sum()):
                raise SampleError(
                    "placeholder_mismatch",
                    f"sample {key!r}: {kind} tokens outside the {kind}s' expansions; remove them from the text",
                )
    if videos:
        out["tokens_per_video"] = counts["video"]
    for name in ("mm_token_type_ids", "token_type_ids"):
        if name in out:
            out[name] = out[name][0]
    out.update(
        input_ids=ids,
        labels=torch.where(trained, ids, torch.full_like(ids, IGNORE_INDEX)),
        tokens_per_image=counts["image"],
    )
    return out


