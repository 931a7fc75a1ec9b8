"""Turn one conversation with images into the token ids a VLM trains on, and forecast that length.

A user calls these through :class:`vlm_pack.Preprocessor` (``process``, ``forecast``, ``tokenize``), which
holds the checkpoint's parts once; the functions here are what it calls. Two entry points share one rendering (:func:`vlm_pack.chat.render_conversation`: the checkpoint's own chat
template, or vlm-pack's format for tokenizers without one), so the forecast is the processed length:

- ``forecast_length(conversation, image_sizes, ...)``: the expanded length from the text and the image
  *header* sizes only (no decode), for the packer;
- ``process_sample(images, conversation, ...)``: the real thing: with an HF ``processor`` its own expansion
  and tokenization of the rendered prompt (the ids are ``processor(text=prompt, images=...)["input_ids"]``),
  labels on the assistant spans, and the processor's vision tensors, ready for ``PackingCollator``.

Only assistant content and its end-of-turn token are trained::

    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]},
        {"role": "assistant", "content": "A red square."},
    ]

    Qwen2-VL's template, one image of grid (1, 4, 6) -> 6 vision tokens (merge 2):

    tokens  <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n   (the template's default system turn)
            <|im_start|> user \\n <|vision_start|> P P P P P P <|vision_end|> What is shown? <|im_end|> \\n
            <|im_start|> assistant \\n A red square. <|im_end|> \\n
    labels  -100 .............................................................................. -100
            -100 ..................... A red square. <|im_end|> -100

    layout="expanded":  P repeated once per vision embedding (as HF processors produce)
    layout="collapsed": P once per image (Megatron style); ``tokens_per_image`` says what it becomes

A plain string is a caption: the images are the prompt and the whole caption is trained on.
"""

from __future__ import annotations

import copy
import io
import itertools
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .chat import (
    IMAGE_MARKER,
    ChatFormat,
    Conversation,
    Rendering,
    Template,
    chat_format,
    render_conversation,
)
from .failures import ImageDecodeError, InternalCheckError, SampleError, skip_reason
from .families import FAMILIES, canonical, lookup
from .labels import IGNORE_INDEX

__all__ = [
    "IMAGE_MARKER",
    "ChatFormat",
    "Prompt",
    "chat_format",
    "forecast_length",
    "load_image",
    "process_pack",
    "process_sample",
    "tokenize_conversation",
]


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
) -> Rendering:
    family = canonical(family or getattr(tokenizer, "vlm_pack_family", None))  # any spelling
    if placeholder is None:  # a Preprocessor passes the one it asked once
        placeholder = _placeholder(tokenizer, processor, family)
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
    )


def _trained_tokens(spans: Sequence[tuple[int, int]], offsets: torch.Tensor, length: int) -> torch.Tensor:
    """bool (L,): tokens whose characters ``offsets`` (L, 2) overlap a trained character span."""
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
    return _collapsed_ids(rendering, tokenizer, num_images, key)


def _collapsed_ids(
    rendering: Rendering, tokenizer: Any, num_images: int, key: Any
) -> tuple[list[int], list[bool]]:
    ids, mask = _tokenize(tokenizer, rendering)
    image_id = tokenizer.convert_tokens_to_ids(rendering.placeholder)
    mask = [m and i != image_id for i, m in zip(ids, mask)]
    if ids.count(image_id) != num_images:
        raise InternalCheckError(
            f"sample {key!r}: {num_images} image(s) became {ids.count(image_id)} image token(s) "
            f"{rendering.placeholder!r}; the tokenizer must keep {rendering.placeholder!r} as one special token."
        )
    return ids, mask


# Per tokenizer: (vocabulary size, one image's expansion text) -> the marker tokens of that expansion besides
# its image tokens. Weak keys: a cache never keeps a tokenizer alive.
_MARKER_EXTRAS: weakref.WeakKeyDictionary[Any, dict[tuple[int, str], int]] = weakref.WeakKeyDictionary()


def _marker_extra_tokens(spec: Any, tokenizer: Any, processor: Any, width: int, height: int) -> int:
    """Tokens of one image's expansion besides its image tokens, for a family whose processor writes tile
    markers between its crops (Idefics3 / SmolVLM ``<row_r_col_c>``, LFM2-VL ``<|img_row_r_col_c|>``), counted
    through the tokenizer once per expansion (``spec.marker_prompt``: one image token per crop).

    The released tokenizers hold every marker as one added token; a tokenizer without them splits each into
    several, and only the tokenizer knows into how many. The expansion opens and closes with special tokens,
    so tokenized alone it gives the tokens it has inside any prompt.
    """

    def named(attr: str, default: str) -> str:
        # processors fix some names (Idefics3Processor's), others read them from the tokenizer
        return str(getattr(processor, attr, None) or getattr(tokenizer, attr, None) or default)

    prompt = spec.marker_prompt(width, height, named)
    key = (len(tokenizer), prompt.text)
    try:
        cache = _MARKER_EXTRAS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: counted every time
        cache = {}
    if key not in cache:
        ids = list(tokenizer(prompt.text, add_special_tokens=False)["input_ids"])
        first, last = (tokenizer.convert_tokens_to_ids(t) for t in prompt.edges)
        crops = prompt.text.count(prompt.image)
        image_id = tokenizer.convert_tokens_to_ids(prompt.image)
        if not ids or ids[0] != first or ids[-1] != last or ids.count(image_id) != crops:
            kept = list(dict.fromkeys([*prompt.edges, prompt.image]))
            raise InternalCheckError(
                f"the tokenizer must keep {', '.join(map(repr, kept))} as one special token each (the "
                f"processor wraps every image in them): add them with tokenizer.add_special_tokens"
                f"({{'additional_special_tokens': {kept!r}}})"
            )
        cache[key] = len(ids) - crops
    return cache[key]


def _wraps(spec: Any) -> str:
    """Who writes the tokens around each image of ``spec``'s family (``vlm_pack.families.WRAPS``); ``"none"``
    for a spec of a family without a record."""
    record = lookup(spec.family) if spec is not None else None
    return record.wraps if record is not None else "none"


def _processor_wraps(spec: Any) -> bool:
    """The processor writes tokens around each image of ``spec``'s family, so the collapsed ids do not say
    a prompt's expanded length: it is forecast sample by sample."""
    return _wraps(spec).startswith("processor")


def _image_extra_tokens(spec: Any, tokenizer: Any, processor: Any, width: int, height: int) -> int:
    """Non-placeholder tokens one image adds: ``spec.extra_tokens``, except that tile markers (Idefics3 /
    SmolVLM, LFM2-VL) are counted through ``tokenizer`` (the spec assumes each is one token)."""
    if _wraps(spec) == "processor_markers":
        return _marker_extra_tokens(spec, tokenizer, processor, width, height)
    return int(spec.extra_tokens(width, height))


def _skeleton(
    spec: Any, sizes: list[tuple[int, int]], placeholder: str, tokenizer: Any, processor: Any = None
) -> list[tuple[str, int]]:
    """Per image: text standing in for its expansion in the prompt, and the tokens that text leaves out.

    Every expansion starts and ends with special tokens, which tokenize alone, so one placeholder stands in
    for all of it (``len - 1`` tokens left out), except Gemma 3's, whose ``"\\n\\n"`` around the image merges
    with the text next to it: there the text is kept and only the image soft tokens are left out.
    """
    counts = [int(n) for n in spec.sample_tokens(sizes)]
    if _wraps(spec) == "processor_text":  # Gemma 3
        seq = f"\n\n{placeholder}{tokenizer.eoi_token}\n\n"
        out = []
        for (w, h), n in zip(sizes, counts):
            crops = spec.num_crops(w, h)
            text = seq
            if crops:
                text = f"Here is the original image {seq} and here are some crops to help you see better "
                text += " ".join([seq] * crops)
            out.append((text, n))
        return out
    if _processor_wraps(spec):
        counts = [
            n + _image_extra_tokens(spec, tokenizer, processor, w, h) for n, (w, h) in zip(counts, sizes)
        ]
    return [(placeholder, n - 1) for n in counts]


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


def forecast_length(
    conversation: Conversation,
    image_sizes: Sequence[tuple[int, int]],
    *,
    tokenizer: Any = None,
    spec: Any = None,
    processor: Any = None,
    image_processor: Any = None,
    family: str | None = None,
    template: str | ChatFormat | Template | None = None,
    key: Any = None,
) -> tuple[int, list[int]]:
    """Expanded length of a sample and its per-image token counts, from image ``(width, height)`` only.

    Give the same ``processor`` as to :func:`process_sample` (or ``tokenizer`` with ``image_processor`` or a
    vision ``spec``); the result equals ``len(process_sample(...)["input_ids"])`` and its
    ``tokens_per_image`` for the same conversation and images. The prompt is rendered and tokenized exactly
    as there; only the image expansions are counted instead of written out.
    """
    length, counts, _ = _forecast(
        conversation,
        image_sizes,
        tokenizer,
        spec,
        processor,
        image_processor,
        family,
        template,
        key,
        keep=False,
    )
    return length, counts


def _forecast(
    conversation: Conversation,
    image_sizes: Sequence[tuple[int, int]],
    tokenizer: Any,
    spec: Any,
    processor: Any,
    image_processor: Any,
    family: str | None,
    template: str | ChatFormat | Template | None,
    key: Any,
    keep: bool,
) -> tuple[int, list[int], Prompt | None]:
    from .vision import vision_spec_from_processor

    if processor is not None:
        tokenizer = tokenizer or processor.tokenizer
    if tokenizer is None:
        raise TypeError("forecast_length needs processor= or tokenizer=")
    sizes = [(int(w), int(h)) for w, h in image_sizes]
    if spec is None and sizes:
        source = processor if processor is not None else image_processor
        if source is None:
            raise TypeError("forecast_length with images needs processor=, image_processor= or spec=")
        spec = vision_spec_from_processor(source)
    rendering = _render(conversation, tokenizer, processor, family, template, len(sizes), key, spans=keep)
    counts = [int(n) for n in spec.sample_tokens(sizes)] if sizes else []
    plain = not _processor_wraps(spec)  # each image one placeholder in the tokenized prompt
    if keep and processor is None and plain:  # process_sample's own tokenization, kept for it
        ids, mask = _tokenize(tokenizer, rendering)
        return len(ids) - len(counts) + sum(counts), counts, Prompt(rendering, (ids, mask))
    prompt = Prompt(rendering) if keep else None
    if not sizes:
        return len(_tokenize(tokenizer, rendering)[0]), [], prompt
    skeletons = _skeleton(spec, sizes, rendering.placeholder, tokenizer, processor)
    pieces = rendering.text.split(rendering.placeholder)
    text = pieces[0] + "".join(s + piece for (s, _), piece in zip(skeletons, pieces[1:]))
    enc = tokenizer(text, add_special_tokens=rendering.add_special_tokens)
    return len(enc["input_ids"]) + sum(left for _, left in skeletons), counts, prompt


def load_image(source: Any, name: str = "image") -> Any:
    """A PIL RGB image from a path, bytes or PIL image, with EXIF orientation applied (as HF ``load_image``).

    Raises:
        ImageDecodeError: (a ``SampleError`` and an ``OSError``, reason ``"decode_error"``) naming ``name``
            when the file is missing, unreadable, truncated, not an image, or a decompression bomb: bad
            data, counted and skipped by the pipelines.
        SampleError: reason ``"corrupt_image"`` for a value that is no image (not a path, bytes or image).
    """
    import struct

    from PIL import Image, ImageOps

    if not isinstance(source, (Image.Image, bytes, bytearray, memoryview, str, os.PathLike)):
        raise SampleError(
            "corrupt_image",
            f"{name}: cannot load an image from {type(source).__name__}: give a path, bytes or PIL image",
        )
    try:
        if isinstance(source, Image.Image):
            image = source
        else:
            image = Image.open(
                io.BytesIO(bytes(source)) if not isinstance(source, (str, os.PathLike)) else source
            )
            image = ImageOps.exif_transpose(image)
        return image.convert("RGB")  # decodes the pixels: a truncated file fails here
    # Pillow's decoders report bad files as OSError (UnidentifiedImageError, "image file is truncated"),
    # SyntaxError (broken PNG chunks), EOFError, struct.error or ValueError, and bombs as their own error
    except (OSError, SyntaxError, EOFError, ValueError, struct.error, Image.DecompressionBombError) as exc:
        raise ImageDecodeError(
            "decode_error", f"{name} does not decode: {type(exc).__name__}: {exc}"
        ) from exc


def _load_images(images: Sequence[Any], key: Any) -> list[Any]:
    """``load_image`` of each of a sample's images, errors naming the sample and the image."""
    return [load_image(image, f"sample {key!r}, image {i}") for i, image in enumerate(images)]


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
    for name in ("input_ids", "labels", "mm_token_type_ids", "token_type_ids"):
        if name in out:
            out[name] = out[name][keep]
    return out


def _llava_counts(image_processor: Any, tokenizer: Any, images: list[Any]) -> list[int]:
    import transformers

    name = type(image_processor).__name__
    if not name.startswith(("LlavaImageProcessor", "LlavaNextImageProcessor", "CLIPImageProcessor")):
        raise InternalCheckError(
            f"process_sample with {name}: pass processor= (the checkpoint's HF processor) for this family; "
            "tokenizer= with image_processor= covers the Qwen-style and LLaVA / LLaVA-NeXT image processors."
        )
    cls = transformers.LlavaNextProcessor if name.startswith("LlavaNext") else transformers.LlavaProcessor
    # The llava-hf checkpoints' processor settings.
    processor = cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    sizes = [(im.height, im.width) for im in images]
    from ._compat import num_image_tokens

    return num_image_tokens(processor, sizes)


def _checked_tokens(
    tokenizer: Any, rendering: Rendering, n_images: int, key: Any, tokens: tuple[list[int], list[bool]] | None
) -> tuple[list[int], list[bool], int]:
    """The collapsed ids, trained mask and image token id of the rendered prompt, one image token per image."""
    ids_list, mask = tokens if tokens is not None else _tokenize(tokenizer, rendering)
    image_id = tokenizer.convert_tokens_to_ids(rendering.placeholder)
    if ids_list.count(image_id) != n_images:
        raise InternalCheckError(
            f"sample {key!r}: {n_images} image(s) became {ids_list.count(image_id)} image token(s) "
            f"{rendering.placeholder!r}; the tokenizer must keep {rendering.placeholder!r} as one special token."
        )
    return ids_list, mask, image_id


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
    ids_list, mask, image_id = _checked_tokens(tokenizer, rendering, len(images), key, tokens)
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
            counts = _llava_counts(image_processor, tokenizer, images)
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


def process_sample(
    images: Sequence[Any],
    conversation: Conversation,
    *,
    tokenizer: Any = None,
    image_processor: Any = None,
    processor: Any = None,
    family: str | None = None,
    layout: str = "expanded",
    template: str | ChatFormat | Template | None = None,
    key: Any = None,
    prompt: Prompt | None = None,
) -> dict[str, torch.Tensor]:
    """One processed sample (1-D token tensors) for ``PackingCollator``.

    Give an HF ``processor`` (any family: its chat template renders the conversation, its own expansion and
    tokenization give ``input_ids`` equal to ``processor(text=prompt, images=...)``), or ``tokenizer`` +
    ``image_processor`` (Qwen-style and LLaVA / LLaVA-NeXT). Returns ``input_ids`` (L,), ``labels`` (L,)
    with -100 outside assistant content + end-of-turn and on image tokens, ``tokens_per_image`` (n,)
    (embeddings each image becomes), and the vision tensors as the processor returns them for this one sample
    (``pixel_values``; by family ``image_grid_thw``, ``image_sizes``, ``batch_num_images``,
    ``pixel_attention_mask``, and the per-token ``mm_token_type_ids`` / ``token_type_ids`` (L,)).
    ``layout="collapsed"`` keeps one image token per image (families with one run of them per image).
    ``prompt``: the :class:`Prompt` ``Preprocessor.forecast_prompt`` rendered for this conversation with the
    same arguments (not rendered or tokenized again).
    """
    if processor is not None:
        tokenizer = tokenizer or processor.tokenizer
    if tokenizer is None:
        raise InternalCheckError("process_sample needs tokenizer= (or processor=)")
    if layout not in ("expanded", "collapsed"):
        raise InternalCheckError(f"layout must be 'expanded' or 'collapsed', got {layout!r}")
    if images and processor is None and image_processor is None:
        raise InternalCheckError(
            f"sample {key!r} has images: process_sample needs image_processor= (or processor=)"
        )
    if prompt is None:
        prompt = Prompt(_render(conversation, tokenizer, processor, family, template, len(images), key))
    rendering = prompt.rendering
    pil = _load_images(images, key)
    if processor is not None:
        out = _with_processor(processor, rendering, pil, key)
        image_id = _embedding_token_id(processor)
        if layout == "collapsed" and len(pil):
            out = _collapse(out, image_id, key)
        return out
    out = _with_image_processor(image_processor, tokenizer, rendering, pil, key, prompt.tokens)
    image_id = tokenizer.convert_tokens_to_ids(rendering.placeholder)
    return _finish(out, tokenizer, family, image_id, layout, len(pil), key)


# Image processors whose one call over many images equals a call per sample joined by ``join_vision``: each
# image is resized, normalized and patchified alone, the patches concatenated ([sum P_i, D]) and the grids
# stacked ([n, 3]), nothing padded to the batch. Others (LLaVA-NeXT pads tiles to the call's most, the fast
# torchvision processors group images by shape) are processed sample by sample.
_ONE_CALL = frozenset({"Qwen2VLImageProcessorPil", "Glm4vImageProcessorPil"})


def _one_call(image_processor: Any, processor: Any) -> bool:
    """Whether a pack's images go through one image-processor call (exact, and faster, see below).

    Not inside a DataLoader worker: there the batch is copied into shared memory anyway, and copying each
    sample's patches into its ``pixel_values`` while they are still in the CPU cache, then straight into
    shared memory (``join_vision``), costs ~8% less worker CPU than one call's concatenation of the whole
    pack's (cold) patches followed by that copy. In the main process one call saves a whole copy.
    """
    cls = type(image_processor)  # the class itself: a subclass may process images otherwise
    if (
        processor is not None
        or not cls.__module__.startswith("transformers.")
        or cls.__name__ not in _ONE_CALL
    ):
        return False
    return torch.utils.data.get_worker_info() is None


_SAMPLE_OPTIONS = ("tokenizer", "image_processor", "processor", "family", "layout", "template")


@dataclass
class _Staged:
    """A sample of a pack, decoded and tokenized, waiting for the pack's one image-processor call."""

    index: int
    key: Any
    images: list[Any]
    tokens: tuple[list[int], list[bool]]
    image_id: int


def process_pack(
    samples: Sequence[tuple[Sequence[Any], Conversation]],
    *,
    keys: Sequence[Any] | None = None,
    prompts: Sequence[Prompt | None] | None = None,
    **options: Any,
) -> list[dict[str, torch.Tensor] | SampleError]:
    """``process_sample`` of each ``(images, conversation)`` of a pack, or its data error, in order.

    ``options``: the keyword arguments of :func:`process_sample`; ``keys`` / ``prompts``: its ``key`` /
    ``prompt`` per sample. The result equals ``process_sample`` sample by sample, but with a Qwen2/2.5/3-VL or
    GLM-4.1V image processor (outside DataLoader workers) all the pack's images go through ONE
    image-processor call: it writes the pack's ``pixel_values`` [sum P, D] once, and each sample gets its
    rows as a view, so ``join_vision`` of the samples in this order is that tensor, not a copy.

    Failures follow ``vlm_pack.failures``: a sample with bad data (an undecodable image, a text the template
    or processor refuses) gets a :class:`~vlm_pack.failures.SampleError` (its reason, else
    ``"decode_error"``) and the others are still processed; an error of code raises
    :class:`~vlm_pack.failures.SampleCodeError` naming the sample's key.
    """
    unknown = sorted(set(options) - set(_SAMPLE_OPTIONS))
    if unknown:
        raise TypeError(f"process_pack: unknown argument(s) {unknown}; it takes {list(_SAMPLE_OPTIONS)}")
    keys = list(keys) if keys is not None else [None] * len(samples)
    prompts = list(prompts) if prompts is not None else [None] * len(samples)

    def alone(index: int) -> dict[str, torch.Tensor] | SampleError:
        images, conversation = samples[index]
        try:
            return process_sample(images, conversation, key=keys[index], prompt=prompts[index], **options)
        except Exception as exc:
            return _data_error(exc, keys[index])

    tokenizer, image_processor = options.get("tokenizer"), options.get("image_processor")
    if tokenizer is None or not _one_call(image_processor, options.get("processor")):
        return [alone(index) for index in range(len(samples))]
    results: list[dict[str, torch.Tensor] | SampleError | None] = [None] * len(samples)
    staged: list[_Staged] = []
    for index, sample in enumerate(samples):
        try:
            staged.append(_stage(index, sample, keys[index], prompts[index], options))
        except Exception as exc:
            results[index] = _data_error(exc, keys[index])
    try:
        vision = _vision_of_pack(image_processor, staged)
    except Exception:  # which image it was is unknown: each sample alone, so the error names its sample
        for sample in staged:
            results[sample.index] = alone(sample.index)
        return results  # type: ignore[return-value]
    family, layout = options.get("family"), options.get("layout", "expanded")
    for sample, out in zip(staged, vision):
        counts = _grid_counts(image_processor, out["image_grid_thw"]).tolist() if out else []
        out.update(_expand_text(*sample.tokens, sample.image_id, counts))
        results[sample.index] = _finish(
            out, tokenizer, family, sample.image_id, layout, len(sample.images), sample.key
        )
    return results  # type: ignore[return-value]


def _data_error(exc: Exception, key: Any) -> SampleError:
    """``exc`` as the :class:`SampleError` a pack's sample is skipped with; raises an error of code."""
    reason = skip_reason(exc, "decode_error", f"sample {key!r}", key)
    if isinstance(exc, SampleError):
        return exc
    error = SampleError(reason, f"sample {key!r}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _stage(
    index: int, sample: tuple[Sequence[Any], Conversation], key: Any, prompt: Prompt | None, options: Any
) -> _Staged:
    """A sample rendered (unless ``prompt``), tokenized and its images decoded, checked as process_sample does."""
    images, conversation = sample
    tokenizer = options["tokenizer"]
    layout = options.get("layout", "expanded")
    if layout not in ("expanded", "collapsed"):
        raise InternalCheckError(f"layout must be 'expanded' or 'collapsed', got {layout!r}")
    if prompt is None:
        family, template = options.get("family"), options.get("template")
        prompt = Prompt(_render(conversation, tokenizer, None, family, template, len(images), key))
    pil = _load_images(images, key)
    ids_list, mask, image_id = _checked_tokens(tokenizer, prompt.rendering, len(pil), key, prompt.tokens)
    return _Staged(index, key, pil, (ids_list, mask), image_id)


def _vision_of_pack(image_processor: Any, staged: list[_Staged]) -> list[dict[str, torch.Tensor]]:
    """Each staged sample's ``pixel_values`` [P_i, D] and ``image_grid_thw`` [n_i, 3], views of one call's."""
    images = [image for sample in staged for image in sample.images]
    if not images:
        return [{} for _ in staged]
    vision = image_processor(images=images, return_tensors="pt")
    pixels, grid = vision["pixel_values"], vision["image_grid_thw"]
    image_cuts = [0, *itertools.accumulate(len(sample.images) for sample in staged)]
    row_cuts = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)])[image_cuts].tolist()
    if row_cuts[-1] != pixels.shape[0]:
        raise InternalCheckError(
            f"{type(image_processor).__name__}: {pixels.shape[0]} patch rows, its grids {row_cuts[-1]}"
        )
    out: list[dict[str, torch.Tensor]] = []
    for first, last, first_row, last_row in zip(image_cuts, image_cuts[1:], row_cuts, row_cuts[1:]):
        with_images = last > first
        out.append(
            {"pixel_values": pixels[first_row:last_row], "image_grid_thw": grid[first:last]}
            if with_images
            else {}
        )
    return out
