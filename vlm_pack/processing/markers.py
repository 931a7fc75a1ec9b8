"""The tokens a processor writes around each image: who writes them (``vlm_pack.families.WRAPS``), how many
(Idefics3 / SmolVLM / LFM2-VL tile markers counted through the tokenizer), and the text that stands in for an
image's expansion when a prompt's expanded length is forecast without writing the expansion out."""

from __future__ import annotations

import weakref
from typing import Any

from ..failures import InternalCheckError
from ..families import FAMILIES, lookup

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


def _image_extra_tokens(spec: Any, tokenizer: Any, processor: Any, width: int, height: int) -> int:
    """Non-placeholder tokens one image adds: ``spec.extra_tokens``, except that tile markers (Idefics3 /
    SmolVLM, LFM2-VL) are counted through ``tokenizer`` (the spec assumes each is one token)."""
    if _wraps(spec) == "processor_markers":
        return _marker_extra_tokens(spec, tokenizer, processor, width, height)
    return int(spec.extra_tokens(width, height))


def _skeleton(
    spec: Any,
    wraps: str,
    sizes: list[tuple[int, int]],
    counts: list[int],
    placeholder: str,
    tokenizer: Any,
    processor: Any = None,
) -> list[tuple[str, int]]:
    """Per image of ``sizes`` (its ``counts`` vision tokens; ``wraps``: ``_wraps(spec)``): text standing in
    for its expansion in the prompt, and the tokens that text leaves out.

    Every expansion starts and ends with special tokens, which tokenize alone, so one placeholder stands in
    for all of it (``len - 1`` tokens left out), except Gemma 3's, whose ``"\\n\\n"`` around the image merges
    with the text next to it: there the text is kept and only the image soft tokens are left out.
    """
    if wraps == "processor_text":  # Gemma 3
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
    if wraps.startswith("processor"):
        counts = [
            n + _image_extra_tokens(spec, tokenizer, processor, w, h) for n, (w, h) in zip(counts, sizes)
        ]
    return [(placeholder, n - 1) for n in counts]




def _video_skeleton(spec: Any, videos: list[Any], placeholder: str, processor: Any) -> list[tuple[str, int]]:
    """Per video (its ``VideoForecast``): text standing in for its expansion, and the tokens it leaves out.

    Where the processor writes nothing around the video's tokens (Qwen2/2.5-VL, whose template wraps the
    placeholder; LLaVA-OneVision) its placeholder stands in for all of them. Qwen3-VL's processor writes
    ``<{t:.1f} seconds><|vision_start|>`` + one temporal group's tokens + ``<|vision_end|>`` per group
    (``Qwen3VLProcessor.replace_video_token``, models/qwen3_vl/processing_qwen3_vl.py): that text is kept with
    one placeholder per group, the rest of each group's tokens left out.
    """
    family = getattr(spec, "family", None) or getattr(processor, "vlm_pack_family", None)
    record = lookup(family)
    if record is None or record.video_wraps is None:
        supported = ", ".join(f.name for f in FAMILIES.values() if f.video_wraps)
        raise InternalCheckError(f"vlm-pack processes no video of family {family!r}; videos: {supported}")
    if record.video_wraps != "frames":
        return [(placeholder, v.tokens - 1) for v in videos]
    start, end = processor.vision_start_token, processor.vision_end_token
    out = []
    for v in videos:
        text = "".join(f"<{t:.1f} seconds>{start}{placeholder}{end}" for t in v.timestamps)
        out.append((text, v.tokens - len(v.timestamps)))
    return out
