"""The tokens a processor writes around each image: who writes them (``vlm_pack.families.WRAPS``), how many
(Idefics3 / SmolVLM / LFM2-VL tile markers counted through the tokenizer), and the text that stands in for an
image's expansion when a prompt's expanded length is forecast without writing the expansion out.

Where the installed processor has transformers' replacement API (``replace_image_token`` /
``replace_video_token`` / ``get_text_with_replacements``, 5.18+), the text around the vision tokens is the
processor's own, written from inputs synthesised from the forecast (grid, metadata, frame count), with each
run of vision tokens collapsed to one placeholder (:func:`vlm_pack.vision.oracle.vision_runs`)::

    replace_video_token  <0.5 seconds><|vision_start|> V V V V <|vision_end|><1.5 seconds><|vision_start|> V ...
    stand-in             <0.5 seconds><|vision_start|> V <|vision_end|><1.5 seconds><|vision_start|> V ...
                         (3 tokens left out per group)

and the processor's own ``get_text_with_replacements`` puts the stand-ins into the rendered prompt, so that
what a release does to the template's text around a placeholder is what is counted (transformers 5.25's
Qwen3-VL drops the template's ``<|vision_start|>``/``<|vision_end|>`` around a video). The hand-written
rules below serve releases without that API.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from ..failures import InternalCheckError, SampleError
from ..families import FAMILIES, lookup, video_family
from ..vision.oracle import vision_runs

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


def _video_family(spec: Any, processor: Any) -> Any:
    """The family record of ``spec``, else the one whose video processor ``processor`` carries; or None."""
    record = lookup(getattr(spec, "family", None) or getattr(processor, "vlm_pack_family", None))
    if record is None and processor is not None:
        record = video_family(getattr(processor, "video_processor", None))
    return record


def _video_record(spec: Any, processor: Any) -> Any:
    """:func:`_video_family`, which must process videos; InternalCheckError naming the families that do."""
    record = _video_family(spec, processor)
    if record is None or record.video_wraps is None:
        family = getattr(spec, "family", None) or getattr(processor, "vlm_pack_family", None)
        supported = ", ".join(f.name for f in FAMILIES.values() if f.video_wraps)
        raise InternalCheckError(f"vlm-pack processes no video of family {family!r}; videos: {supported}")
    return record


def _check_frame_counts(videos: list[Any], key: Any) -> None:
    """SampleError naming the sample where its videos keep different frame counts for a processor that
    stacks them: ``InternVLProcessor.__call__`` reads one ``num_frames`` off the stacked
    ``pixel_values_videos`` of the call (models/internvl/processing_internvl.py), so it fails on them."""
    kept = [len(v.indices) for v in videos]
    if len(set(kept)) > 1:
        raise SampleError(
            "decode_error",
            f"sample {key!r}: its videos keep {kept} frames, but the InternVL processor takes a sample's videos "
            "only with equal frame counts; sample a fixed number (do_sample_frames=True, num_frames=N) or put "
            "each video in its own sample",
        )


def _video_skeleton(
    spec: Any, videos: list[Any], placeholder: str, processor: Any, key: Any = None
) -> list[tuple[str, int]]:
    """Per video (its ``VideoForecast``): text standing in for its expansion, and the tokens it leaves out.

    Where the processor writes nothing around the video's tokens (Qwen2/2.5-VL, whose template wraps the
    placeholder; LLaVA-OneVision) its placeholder stands in for all of them. Qwen3-VL's processor writes
    ``<{t:.1f} seconds><|vision_start|>`` + one temporal group's tokens + ``<|vision_end|>`` per group
    (``Qwen3VLProcessor.replace_video_token``, models/qwen3_vl/processing_qwen3_vl.py): that text is kept with
    one placeholder per group, the rest of each group's tokens left out. InternVL's processor writes each kept
    frame as an image, ``Frame{i}: <img>`` + ``image_seq_length`` image tokens + ``</img>``, the frames joined
    by ``"\n"`` (``InternVLProcessor.replace_video_token``, models/internvl/processing_internvl.py): that text
    is kept too, one placeholder per frame, so that ``Frame1:`` tokenizes with the prompt text before it.
    GLM-4.1V / 4.5V / 4.6V's write per temporal group ``<|begin_of_image|>`` + its image tokens +
    ``<|end_of_image|>`` + the group's time (``int(t)``; GLM-4.6V ``f"{t:.1f} seconds"``): that text comes from
    the processor's own ``replace_frame_token_id`` with one placeholder (glm4v/processing_glm4v.py,
    glm46v/processing_glm46v.py), so the installed release's format is the one counted. A processor no record
    names wrote its own text into each forecast (``VideoForecast.stand_in``, the exact route): that is kept.
    """
    if videos and all(v.stand_in is not None for v in videos):  # the exact route: the processor's own text
        return [(text.replace(token, placeholder), left) for token, text, left in (v.stand_in for v in videos)]
    record = _video_record(spec, processor)
    if record.video_wraps == "image_frames":
        _check_frame_counts(videos, key)
    own = _processor_video_skeleton(processor, videos, placeholder)
    if own is not None:
        return own
    if record.video_wraps == "image_frames":
        start, end = processor.start_image_token, processor.end_image_token
        out = []
        for v in videos:
            frames = (f"Frame{i + 1}: {start}{placeholder}{end}" for i in range(len(v.frame_tokens)))
            out.append(("\n".join(frames), v.tokens - len(v.frame_tokens)))
        return out
    if record.video_wraps == "timed_image_frames":  # GLM-4.1V / 4.5V / 4.6V: the processor's own frame text
        out = []
        for v in videos:
            frames = (processor.replace_frame_token_id(t, num_image_tokens=1) for t in v.timestamps)
            out.append(("".join(frames).replace(processor.image_token, placeholder), v.tokens - len(v.timestamps)))
        return out
    if record.video_wraps != "frames":
        return [(placeholder, v.tokens - 1) for v in videos]
    start, end = processor.vision_start_token, processor.vision_end_token
    out = []
    for v in videos:
        text = "".join(f"<{t:.1f} seconds>{start}{placeholder}{end}" for t in v.timestamps)
        out.append((text, v.tokens - len(v.timestamps)))
    return out


def _own_method(processor: Any, name: str) -> bool:
    """``processor``'s class implements ``name`` itself: not absent (transformers < 5.18) and not
    ``ProcessorMixin``'s stub, which raises NotImplementedError."""
    method = getattr(type(processor), name, None)
    if method is None:
        return False
    from transformers import ProcessorMixin

    return method is not getattr(ProcessorMixin, name, None)


def _video_inputs(forecast: Any) -> dict[str, Any]:
    """What ``replace_video_token`` reads of a processed video, synthesised from its ``VideoForecast``: the
    grid, the metadata and frames without pixels (per-frame processors read only their count)."""
    import numpy as np

    inputs: dict[str, Any] = {
        "pixel_values_videos": [np.empty((len(forecast.indices), 0), dtype=np.uint8)],
        "video_metadata": [forecast.processor_metadata()],
    }
    if forecast.grid_thw is not None:
        inputs["video_grid_thw"] = np.asarray([forecast.grid_thw], dtype=np.int64)
    return inputs


def _processor_video_skeleton(processor: Any, videos: list[Any], placeholder: str) -> list[tuple[str, int]] | None:
    """:func:`_video_skeleton` from the processor's own ``replace_video_token``; None where the processor has
    none (transformers < 5.18) or a forecast carries no metadata.

    The vision tokens the processor's text holds must be the forecast's: a difference means vlm-pack's video
    rule and the installed release disagree, which no sample can fix (InternalCheckError)."""
    if not _own_method(processor, "replace_video_token") or any(v.metadata is None for v in videos):
        return None
    tokens = [t for t in (getattr(processor, "video_token", None), getattr(processor, "image_token", None)) if t]
    out = []
    for v in videos:
        runs = vision_runs(processor.replace_video_token(_video_inputs(v), 0), tokens)
        stand_in, left_out = runs.stand_in(placeholder)
        vision = runs.count
        if vision != v.tokens:
            import transformers

            raise InternalCheckError(
                f"{type(processor).__name__} (transformers {transformers.__version__}) writes {vision} vision tokens "
                f"for a video of {len(v.indices)} kept frames (grid {v.grid_thw}), vlm-pack's video rule forecast "
                f"{v.tokens}: report it with the processor's settings"
            )
        out.append((stand_in, left_out))
    return out


def _substitute(text: str, placeholder: str, stand_ins: Sequence[str], processor: Any = None, kind: str = "video") -> str:
    """``text`` with its i-th ``placeholder`` replaced by ``stand_ins[i]``.

    By the processor's own ``get_text_with_replacements`` where it has one and ``placeholder`` is its
    ``{kind}_token``: what the installed release does to the template's text around a placeholder is then
    counted (5.25's Qwen3-VL collapses ``<|vision_start|><|video_pad|><|vision_end|>`` into the video token).
    Elsewhere each placeholder in turn."""
    if processor is not None and getattr(processor, f"{kind}_token", None) == placeholder and hasattr(
        processor, "get_text_with_replacements"
    ):
        (out,), (offsets,) = processor.get_text_with_replacements([text], **{f"{kind}s_replacements": list(stand_ins)})
        if len(offsets) == len(stand_ins):
            return str(out)
    pieces = text.split(placeholder)
    return pieces[0] + "".join(s + piece for s, piece in zip(stand_ins, pieces[1:]))
