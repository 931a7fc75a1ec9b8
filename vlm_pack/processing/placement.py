"""Image placement through an HF processor: its own expansion and tokenization of the rendered prompt, where
each image's placeholder went in the expanded text (reported by transformers >= 5.7, else recorded by a
tokenizer that takes marks out), the labels moved onto the expanded prompt and the tokens per image."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ..chat import Rendering
from ..failures import SampleError
from ..labels import IGNORE_INDEX
from .render import _embedding_token_id, _trained_tokens


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
    processor: Any, rendering: Rendering, images: list[Any]
) -> tuple[Any, list[tuple[int, int]]]:
    """``processor(text=[prompt], images=[images])`` with offsets, and the ``[(start, end), ...]`` characters
    of the rendered prompt each image's placeholder was replaced by, in the expanded prompt.

    transformers >= 5.7 reports them (``return_text_replacement_offsets``). Older processors each replace the
    placeholder inside their own ``__call__`` and hand the expanded text to their tokenizer, so there the
    placeholders are marked with ``_EDGE`` on both sides and the processor gets a tokenizer that takes the marks
    out before tokenizing, keeping where they were: the ids and every other output are the processor's own.
    """
    kind = type(processor)
    call = dict(
        return_tensors="pt", return_offsets_mapping=True, add_special_tokens=rendering.add_special_tokens
    )
    if _REPORTS_REPLACEMENTS.get(kind, True) or not images:
        enc = processor(
            text=[rendering.text],
            images=[images] if images else None,
            return_text_replacement_offsets=True,
            **call,
        )
        if not images:
            return enc, []
        reported = enc.get("text_replacement_offsets")
        _REPORTS_REPLACEMENTS[kind] = reported is not None
        if reported is not None:
            return enc, [tuple(r["new_span"]) for r in reported[0] if r["type"] == "image"]
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
    return enc, recorder.replaced


def _with_processor(processor: Any, rendering: Rendering, images: list[Any], key: Any) -> dict[str, Any]:
    """The processor's expansion and tokenization of the rendered prompt, with labels and image counts."""
    enc, replaced = _call_processor(processor, rendering, images)
    ids = enc["input_ids"][0]
    offsets = enc["offset_mapping"][0].long()
    placeholder = len(rendering.placeholder)
    pieces = rendering.text.split(rendering.placeholder)[:-1]
    ends = torch.tensor(list(itertools.accumulate(len(p) + placeholder for p in pieces)), dtype=torch.long)
    new = torch.tensor(replaced, dtype=torch.long).reshape(-1, 2)
    length = int(offsets.max()) if len(offsets) else 0
    trained = _trained_tokens(_shift(rendering.spans, ends, new[:, 1]), offsets, max(length, 1))
    counts = torch.zeros(len(images), dtype=torch.long)
    if images:
        starts, ends = new[:, 0].contiguous(), new[:, 1]
        image_of = torch.searchsorted(starts, offsets[:, 0].contiguous(), right=True) - 1
        inside = (
            (image_of >= 0) & (offsets[:, 0] < ends[image_of.clamp(min=0)]) & (offsets[:, 1] > offsets[:, 0])
        )
        trained &= ~inside
        emb = ids == _embedding_token_id(processor)
        counts = torch.bincount(image_of[emb & inside], minlength=len(images))
        if int(counts.sum()) != int(emb.sum()):
            raise SampleError(
                "placeholder_mismatch",
                f"sample {key!r}: image tokens outside the images' expansions; remove them from the text"
            )
    out = {k: v for k, v in enc.items() if k not in _TEXT_KEYS}
    for name in ("mm_token_type_ids", "token_type_ids"):
        if name in out:
            out[name] = out[name][0]
    out.update(
        input_ids=ids,
        labels=torch.where(trained, ids, torch.full_like(ids, IGNORE_INDEX)),
        tokens_per_image=counts,
    )
    return out


