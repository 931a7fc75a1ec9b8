"""Rendering and tokenizing a conversation: the placeholder token a chat template writes once per image, the
prompt rendered by the checkpoint's template (or vlm-pack's format), and its collapsed ids with the mask of
trained tokens (one placeholder per image, before any expansion)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..failures import InternalCheckError
from ..families import FAMILIES, canonical, lookup, names
from .chat import ChatFormat, Conversation, Rendering, Template, render_conversation

if TYPE_CHECKING:  # torch is imported where a mask is built: a forecast-only process (a Ray worker) never loads it
    import torch


@dataclass(frozen=True)
class Prompt:
    """A conversation rendered once by ``Preprocessor.forecast_prompt``, for ``Preprocessor.process(...,
    prompt=...)``: a pipeline that forecasts every sample and processes the packed ones so renders (and,
    without a ``processor``, tokenizes) each conversation once.

    ``tokens``: the collapsed ids and trained mask of ``rendering`` where :func:`process_sample` tokenizes the
    prompt itself (``tokenizer`` + ``image_processor``); None with a ``processor``, which tokenizes its own
    expansion.
    """

    rendering: Rendering
    tokens: tuple[list[int], list[bool]] | None = None




def _image_token(tokenizer: Any, family: str | None = None) -> tuple[str, int]:
    """``(token, id)`` of the image placeholder: ``tokenizer.image_token[_id]``, else the family's token
    (a vocabulary may hold several: LLaVA-OneVision's Qwen2 vocabulary has both ``<|image_pad|>`` and
    ``<image>``, so the family decides), else the first image token of any family the vocabulary has."""
    token_id = getattr(tokenizer, "image_token_id", None)
    if token_id is not None:
        return str(tokenizer.convert_ids_to_tokens(int(token_id))), int(token_id)
    record = lookup(canonical(family or getattr(tokenizer, "vlm_pack_family", None)))
    named = getattr(tokenizer, "image_token", None)
    if named:
        candidates = [named]
    elif record is not None and record.image_token:
        candidates = [record.image_token]
    else:
        candidates = list(dict.fromkeys(f.image_token for f in FAMILIES.values() if f.image_token))
    for token in candidates:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is not None and tid != tokenizer.unk_token_id:
            return token, int(tid)
    raise InternalCheckError(
        f"the tokenizer has none of the image tokens {candidates}: set tokenizer.image_token and "
        "tokenizer.image_token_id (or add the token with tokenizer.add_special_tokens), or pass processor=."
    )


def _placeholder(tokenizer: Any, processor: Any, family: str | None) -> str:
    """The token a chat template writes once per image (what the processor then expands)."""
    # Gemma 4's template writes <|image|>, its processor's image_token, which it expands into
    # <|image> <|image|>... <image|>: the family's own token, before the Gemma 3 rule below.
    record = lookup(canonical(family or getattr(tokenizer, "vlm_pack_family", None), strict=False))
    named = getattr(processor, "image_token", None) if processor is not None else None
    if record is not None and record.image_token and named == record.image_token:
        return str(named)
    # Gemma 3's template writes <start_of_image>: transformers >= 5.7 names it the processor's image_token,
    # 5.6 its boi_token (image_token there is the embedding token it expands into).
    for name in ("boi_token", "image_token"):
        if processor is not None and getattr(processor, name, None):
            return str(getattr(processor, name))
    for name in ("boi_token", "context_image_token"):  # Gemma 3, InternVL tokenizers
        if getattr(tokenizer, name, None):
            return str(getattr(tokenizer, name))
    return _image_token(tokenizer, family)[0]


def _embedding_token_id(processor: Any) -> int:
    """The id the model scatters image features into (Gemma 3's placeholder ``<start_of_image>`` is not it)."""
    tok = processor.tokenizer
    named = getattr(tok, "image_token", None)
    if named and named != processor.image_token and getattr(tok, "image_token_id", None) is not None:
        return int(tok.image_token_id)
    return int(processor.image_token_id)


def _video_placeholder(tokenizer: Any, processor: Any, family: str | None) -> str:
    """The token a chat template writes once per video (what the processor then expands): the processor's
    ``video_token``, else the tokenizer's, else the family's (``vlm_pack.families``)."""
    for owner in (processor, tokenizer):
        named = getattr(owner, "video_token", None) if owner is not None else None
        if isinstance(named, str) and named:
            return named
    record = lookup(canonical(family or getattr(tokenizer, "vlm_pack_family", None), strict=False))
    if record is not None and record.video_token:
        return record.video_token
    raise InternalCheckError(
        f"no video token known for family {family!r}: pass a processor with a video_token (videos are "
        f"processed for {', '.join(names('video_wraps'))})"
    )


def _render(
    conversation: Conversation,
    tokenizer: Any,
    processor: Any,
    family: str | None,
    template: Any,
    n: int,
    key: Any,
    spans: bool = True,
    placeholder: str | None = None,
    num_videos: int = 0,
) -> Rendering:
    family = canonical(family or getattr(tokenizer, "vlm_pack_family", None))  # any spelling
    if placeholder is None:  # a Preprocessor passes the one it asked once
        placeholder = _placeholder(tokenizer, processor, family)
    video = _video_placeholder(tokenizer, processor, family) if num_videos else None
    return render_conversation(
        conversation,
        tokenizer=tokenizer,
        placeholder=placeholder,
        num_images=n,
        processor=processor,
        family=family or getattr(tokenizer, "vlm_pack_family", None),
        template=template,
        key=key,
        spans=spans,
        num_videos=num_videos,
        video_placeholder=video,
    )


def _trained_tokens(spans: Sequence[tuple[int, int]], offsets: torch.Tensor, length: int) -> torch.Tensor:
    """bool (L,): tokens whose characters ``offsets`` (L, 2) overlap a trained character span."""
    import torch

    char = torch.zeros(length + 1, dtype=torch.long)
    for start, end in spans:
        char[start + 1 : end + 1] = 1
    cum = char.cumsum(0)  # cum[e] - cum[s]: trained characters in [s, e)
    offsets = offsets.clamp(0, length)
    return (cum[offsets[:, 1]] - cum[offsets[:, 0]]) > 0


def _tokenize(tokenizer: Any, rendering: Rendering) -> tuple[list[int], list[bool]]:
    """Ids of the whole prompt in one call (tokens merge across turns as in an HF processor) and the mask."""
    text = rendering.text
    try:
        enc = tokenizer(text, add_special_tokens=rendering.add_special_tokens, return_offsets_mapping=True)
    except NotImplementedError:  # slow (Python) tokenizers have no offsets: tokenize span by span
        cuts = sorted({0, len(text), *(c for span in rendering.spans for c in span)})
        trained = {s for s, _ in rendering.spans}
        ids: list[int] = []
        mask: list[bool] = []
        for start, end in itertools.pairwise(cuts):
            piece = tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [start in trained] * len(piece)
        return ids, mask
    import torch

    offsets = torch.tensor(enc["offset_mapping"], dtype=torch.long).reshape(-1, 2)
    return list(enc["input_ids"]), _trained_tokens(rendering.spans, offsets, len(text)).tolist()


def tokenize_conversation(
    conversation: Conversation,
    *,
    tokenizer: Any,
    family: str | None = None,
    num_images: int = 0,
    template: str | ChatFormat | Template | None = None,
    key: Any = None,
    processor: Any = None,
) -> tuple[list[int], list[bool]]:
    """Token ids of ``conversation`` in the collapsed layout (one placeholder per image) and a trained mask.

    Rendered by ``template`` (a Jinja string, a :class:`ChatFormat`, or a callable returning ``[(text,
    trained), ...]`` with ``<image>`` where images go), else by the processor's or tokenizer's
    ``chat_template``, else by vlm-pack's format of ``family``. The prompt is tokenized in one call, as an HF
    processor does, so tokens merge across turn boundaries exactly as there (``"ASSISTANT: the"`` ->
    ``" the"``). A token is trained when any of its characters is in a trained span; placeholders never are.

    Raises ``ValueError`` naming ``key`` when the text has a different number of image places than
    ``num_images``, contains the image token itself, or the template loses text.
    """
    rendering = _render(conversation, tokenizer, processor, family, template, num_images, key)
    return _checked_ids(tokenizer, rendering, num_images, key)[:2]


def _checked_ids(
    tokenizer: Any,
    rendering: Rendering,
    num_images: int,
    key: Any,
    tokens: tuple[list[int], list[bool]] | None = None,
) -> tuple[list[int], list[bool], int]:
    """The collapsed ids, trained mask (placeholders never trained) and placeholder id of ``rendering``
    (``tokens``: its ids and mask, tokenized already), checked to hold one placeholder per image."""
    ids, mask = tokens if tokens is not None else _tokenize(tokenizer, rendering)
    image_id = tokenizer.convert_tokens_to_ids(rendering.placeholder)
    _check_placeholders(ids.count(image_id), num_images, num_images, rendering.placeholder, key)
    return ids, [m and i != image_id for i, m in zip(ids, mask)], image_id


def _check_placeholders(found: int, wanted: int, num_images: int, placeholder: str, key: Any) -> None:
    """Raise unless the tokenized prompt holds the ``wanted`` placeholders its ``num_images`` images write:
    a tokenizer that splits the placeholder would otherwise give every length and label wrong."""
    if found != wanted:
        raise InternalCheckError(
            f"sample {key!r}: {num_images} image(s) became {found} image token(s) {placeholder!r}; "
            f"the tokenizer must keep {placeholder!r} as one special token."
        )
