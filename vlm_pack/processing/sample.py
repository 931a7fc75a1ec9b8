"""Processing samples: :func:`process_sample` (one) and :func:`process_pack` (a pack's, its images through one
image-processor call where that is exact)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..failures import InternalCheckError, SampleError, skip_reason
from ..families import FAMILIES
from .chat import ChatFormat, Conversation, Template
from .images import _load_images
from .layout import _collapse, _collapse_videos, _expand_text, _finish, _grid_counts, _with_image_processor
from .placement import _with_processor
from .render import Prompt, _checked_ids, _embedding_token_id, _render
from .videos import check_processed, load_videos


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
    videos: Sequence[Any] = (),
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

    ``videos``: encoded videos (bytes, paths, binary files), one per ``{"type": "video"}`` part or ``<video>``
    marker (none: they open the first user turn after the images). They need a ``processor`` with its video
    processor; each is decoded (PyAV) only at the frames its forecast keeps (``vlm_pack.processing.videos``)
    and processed with ``do_sample_frames=False`` and its metadata, giving ``pixel_values_videos``,
    ``video_grid_thw`` (Qwen-VL), ``second_per_grid_ts`` (Qwen2.5-VL) and ``tokens_per_video`` (n,), equal
    to the processor's own output for the whole decoded clip (InternVL: each kept frame is an image, its rows in
    ``pixel_values`` with the images' tiles in prompt order, its tokens image tokens). ``layout="collapsed"``
    keeps one video token per video (per temporal group for Qwen3-VL, whose ``<t seconds>`` text stays text)
    and adds ``tokens_per_video_placeholder`` (m',): the embeddings each of them becomes.
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
    if videos:
        _check_video_options(processor, key)
    if prompt is None:
        prompt = Prompt(
            _render(conversation, tokenizer, processor, family, template, len(images), key, num_videos=len(videos))
        )
    rendering = prompt.rendering
    pil = _load_images(images, key)
    if processor is not None:
        decoded = load_videos(videos, processor, key) if videos else None
        out = _with_processor(processor, rendering, pil, key, decoded)
        if decoded:
            check_processed(decoded, out, key)
        image_id = _embedding_token_id(processor)
        if layout == "collapsed" and len(pil):
            out = _collapse(out, image_id, key)
        if layout == "collapsed" and decoded:
            merge = int(getattr(processor.video_processor, "merge_size", 1))
            out = _collapse_videos(out, _video_token_id(processor), merge, key, type(processor).__name__)
        return out
    out = _with_image_processor(image_processor, tokenizer, rendering, pil, key, prompt.tokens)
    image_id = tokenizer.convert_tokens_to_ids(rendering.placeholder)
    return _finish(out, tokenizer, family, image_id, layout, len(pil), key)


def _video_token_id(processor: Any) -> int:
    """The id the processor expands into a video's embeddings (``<|video_pad|>``)."""
    token_id = getattr(processor, "video_token_id", None)
    return int(token_id if token_id is not None else processor.tokenizer.convert_tokens_to_ids(processor.video_token))


def _check_video_options(processor: Any, key: Any) -> None:
    """InternalCheckError naming the sample where its videos cannot be processed with these parts."""
    if processor is None or getattr(processor, "video_processor", None) is None:
        raise InternalCheckError(
            f"sample {key!r} has videos: process_sample needs processor= carrying its video processor "
            '(transformers video processors need torchvision: pip install "vlm-pack[video]")'
        )
    from ..vision.from_processor import takes_exact_route

    classes = {cls.__name__ for cls in type(processor.video_processor).__mro__}
    supported = {f.video_processor: f.name for f in FAMILIES.values() if f.video_wraps}
    if not classes & set(supported) and not takes_exact_route(processor):  # no record: its own video step
        raise InternalCheckError(
            f"sample {key!r} has videos: vlm-pack processes the videos of {', '.join(sorted(set(supported.values())))}"
            f", not those of {type(processor.video_processor).__name__} (its frames' tokens and wrappers have no "
            "forecast rule here yet)"
        )


# Image processors whose one call over many images equals a call per sample joined by ``join_vision``
# (``Family.one_call_image_processors``). Others (LLaVA-NeXT pads tiles to the call's most, the fast
# torchvision processors group images by shape) are processed sample by sample.
_ONE_CALL = frozenset(name for record in FAMILIES.values() for name in record.one_call_image_processors)


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
    samples: Sequence[tuple[Any, ...]],
    *,
    keys: Sequence[Any] | None = None,
    prompts: Sequence[Prompt | None] | None = None,
    **options: Any,
) -> list[dict[str, torch.Tensor] | SampleError]:
    """``process_sample`` of each ``(images, conversation)`` (or ``(images, conversation, videos)``) of a
    pack, or its data error, in order.

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
        images, conversation, *videos = samples[index]
        try:
            return process_sample(
                images, conversation, key=keys[index], prompt=prompts[index], videos=videos[0] if videos else (),
                **options,
            )  # fmt: skip
        except Exception as exc:
            return _pack_sample_error(exc, keys[index])

    tokenizer, image_processor = options.get("tokenizer"), options.get("image_processor")
    with_videos = any(len(sample) > 2 and sample[2] for sample in samples)
    if tokenizer is None or with_videos or not _one_call(image_processor, options.get("processor")):
        return [alone(index) for index in range(len(samples))]
    results: list[dict[str, torch.Tensor] | SampleError | None] = [None] * len(samples)
    staged: list[_Staged] = []
    for index, sample in enumerate(samples):
        try:
            staged.append(_stage(index, sample, keys[index], prompts[index], options))
        except Exception as exc:
            results[index] = _pack_sample_error(exc, keys[index])
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


def _pack_sample_error(exc: Exception, key: Any) -> SampleError:
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
    ids_list, mask, image_id = _checked_ids(tokenizer, prompt.rendering, len(pil), key, prompt.tokens)
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
