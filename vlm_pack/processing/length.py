"""The one forecast: a prompt's expanded length from its text and image header sizes, many rows at a time.

Every forecast of vlm-pack comes from :func:`forecast_rows` (``Preprocessor.forecast`` is it called with one
row, ``forecast_sources`` with a chunk's rows, ``forecast_length`` with one), and every processed sample's
expanded length from :func:`expanded_length`: the collator and the Energon encoder call it. Per row::

    rendered   <|im_start|>user\\n<|vision_start|> P <|vision_end|>What is shown?<|im_end|> ...
    stand-in   each P replaced by the text standing in for its expansion (``markers._skeleton``): P itself,
               or, where the processor writes text around the image (Gemma 3), that text
    tokenized  all rows of a chunk in one batched call (the Rust backend where it gives the same ids)
    length     len(ids) + the tokens each stand-in leaves out (the image's tokens and wrappers, less one)
    starts     image i's block: its first stand-in placeholder + the tokens left out before it

A row's videos (``VideoHeader`` or ``VideoForecast`` of ``vlm_pack.vision.video``: the frames the processor
keeps, its grid and timestamps) stand in the same way (``markers._video_skeleton``): their placeholder, or
Qwen3-VL's ``<t seconds><|vision_start|>P<|vision_end|>`` per temporal group, each P one frame's tokens.

Where the installed processor can say it, the stand-in is its own text (``markers`` module docstring): a
video's from ``replace_video_token`` on the forecast's grid and metadata, an image's from a spec that runs
the processor (``spec.stand_ins``: ``vlm_pack.vision.oracle.ProcessorSpec``), each put into the prompt by the processor's ``get_text_with_replacements``,
so that a release that changes the text around vision tokens changes the forecast with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._compat import fast_encode_plus
from .chat import ChatFormat, Conversation, Rendering, Template
from .markers import _skeleton, _substitute, _video_skeleton, _wraps
from .render import Prompt, _check_placeholders, _placeholder, _render, _tokenize

__all__ = ["Forecast", "expanded_length", "forecast_length", "forecast_rows"]


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a forecast ~2% (one per row)
class Forecast:
    """One row's forecast.

    Attributes:
        length: the expanded length, what ``process_sample`` gives (``len(input_ids)`` in the expanded layout).
        counts: ``[n]`` vision tokens of each image (``tokens_per_image``).
        starts: ``[n]`` where each image's block starts in the expanded sample: its first placeholder, or
            where the processor wraps it in marker tokens, the first of those.
        prompt: the rendering (and, where ``process_sample`` tokenizes it itself, its tokens) when asked to
            ``keep`` it, for ``process_sample(..., prompt=)``.
        video_counts: ``[m]`` vision tokens of each video (``tokens_per_video``).
    """

    length: int
    counts: list[int]
    starts: list[int]
    prompt: Prompt | None = None
    video_counts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Row:
    """A row rendered, its images' stand-ins in its text, waiting for its chunk's one tokenizer call."""

    index: int
    key: Any
    rendering: Rendering
    counts: list[int]
    text: str  # the rendered prompt with each placeholder replaced by its stand-in
    left: list[int] = field(default_factory=list)  # tokens each image's stand-in leaves out
    placeholders: list[int] = field(default_factory=list)  # placeholders in each image's stand-in
    tokens: tuple[list[int], list[bool]] | None = None  # kept for process_sample (its own tokenization)
    ids: list[int] | None = None
    videos: list[tuple[int, int, int]] = field(default_factory=list)  # per video: tokens, left out, placeholders


def forecast_rows(
    rows: Sequence[tuple[Any, ...]],
    *,
    tokenizer: Any,
    spec: Any = None,
    processor: Any = None,
    family: str | None = None,
    template: str | ChatFormat | Template | None = None,
    placeholder: str | None = None,
    keep: bool = False,
) -> list[Forecast | Exception]:
    """The :class:`Forecast` of each ``(conversation, image (width, height)s, key)`` row, or what it raised;
    a row ``(conversation, sizes, key, videos)`` also has videos (each a ``VideoHeader`` or ``VideoForecast``,
    ``vlm_pack.vision.video``; they need ``processor`` with its video processor).

    ``spec``: the vision spec (needed where a row has images); ``placeholder``: the token the template writes
    per image (default: asked here); ``keep``: keep each row's :class:`Prompt`. The rows' prompts are tokenized
    in one batched call; a row's error does not stop the others (the caller decides what it is).
    """
    placeholder = placeholder or _placeholder(tokenizer, processor, family)
    fast = bool(getattr(tokenizer, "is_fast", False))
    # the processor's own replacement text (an exact-route spec) keeps its embedding token, one per run, as
    # the image's mark: the template's placeholder may stand in that text too (Gemma 3's <start_of_image>)
    marker = getattr(spec, "image_token", None) if hasattr(spec, "stand_ins") else None
    how = _How(tokenizer, spec, processor, _wraps(spec), tokenizer.convert_tokens_to_ids(marker or placeholder), keep, fast)
    out: list[Forecast | Exception | None] = [None] * len(rows)
    staged: list[_Row] = []
    for index, given in enumerate(rows):
        conversation, sizes, key = given[0], given[1], given[2]
        try:
            videos = _video_forecasts(given[3], processor) if len(given) > 3 and given[3] else []
            rendering = _render(
                conversation, tokenizer, processor, family, template, len(sizes), key,
                spans=keep or not fast, placeholder=placeholder, num_videos=len(videos),
            )  # fmt: skip
            staged.append(_stage(index, key, rendering, sizes, how, videos))
        except Exception as exc:
            out[index] = exc
    for row, ids in zip(staged, _token_ids(tokenizer, staged)):
        try:
            out[row.index] = _finish(row, ids, how)
        except Exception as exc:
            out[row.index] = exc
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class _How:
    """What every row of one :func:`forecast_rows` call is forecast with, asked once for all of them."""

    tokenizer: Any
    spec: Any
    processor: Any
    wraps: str  # who writes the tokens around an image (vlm_pack.families.WRAPS)
    image_id: int  # the placeholder's id
    keep: bool
    fast: bool


def _video_forecasts(videos: Sequence[Any], processor: Any) -> list[Any]:
    """Each of a row's videos as a ``VideoForecast``: given, or forecast from its ``VideoHeader``."""
    from ..vision.video import VideoForecast, forecast_video

    if processor is None:
        raise TypeError("a forecast with videos needs processor= carrying its video processor")
    return [v if isinstance(v, VideoForecast) else forecast_video(v, processor) for v in videos]


def _stage(
    index: int, key: Any, rendering: Rendering, sizes: Sequence[tuple[int, int]], how: _How, videos: list[Any]
) -> _Row:
    """The row with its stand-in text; tokenized here where process_sample's own tokenization is kept, or the
    tokenizer is slow (process_sample tokenizes its prompt span by span there: the same ids)."""
    sizes = [(int(w), int(h)) for w, h in sizes]
    if sizes and how.spec is None:
        raise TypeError("a forecast with images needs a vision spec (processor=, image_processor= or spec=)")
    counts = [int(n) for n in how.spec.sample_tokens(sizes)] if sizes else []
    placeholder, text = rendering.placeholder, rendering.text
    row = _Row(index, key, rendering, counts, text, [n - 1 for n in counts], [1] * len(counts))
    if sizes and hasattr(how.spec, "stand_ins"):  # the processor's own text (no fast rule: oracle.py)
        stand_ins = how.spec.stand_ins(sizes)  # each run of its embedding token written once
        row.text = _substitute(text, placeholder, [s for s, _ in stand_ins], how.processor, "image")
        row.left = [left for _, left in stand_ins]
        mark = how.spec.image_token or placeholder  # each run's one embedding token (what _finish walks)
        row.placeholders = [s.count(mark) for s, _ in stand_ins]
    elif how.wraps.startswith("processor") and sizes:
        stand_ins = _skeleton(how.spec, how.wraps, sizes, counts, placeholder, how.tokenizer, how.processor)
        if any(stand_in != placeholder for stand_in, _ in stand_ins):
            pieces = text.split(placeholder)
            row.text = pieces[0] + "".join(s + piece for (s, _), piece in zip(stand_ins, pieces[1:]))
        row.left = [left for _, left in stand_ins]
        row.placeholders = [s.count(placeholder) for s, _ in stand_ins]
    if videos:
        video = rendering.video_placeholder
        stand_ins = _video_skeleton(how.spec, videos, video, how.processor, key)
        row.text = _substitute(row.text, video, [s for s, _ in stand_ins], how.processor, "video")
        row.videos = [(v.tokens, left, s.count(video)) for v, (s, left) in zip(videos, stand_ins)]
    own = how.keep and how.processor is None and not how.wraps.startswith("processor")
    if row.text == text and (own or not how.fast):
        row.tokens = _tokenize(how.tokenizer, rendering)
        row.ids = row.tokens[0]
    elif not how.fast:
        row.ids = list(how.tokenizer(row.text, add_special_tokens=rendering.add_special_tokens)["input_ids"])
    return row


def _finish(row: _Row, ids: list[int], how: _How) -> Forecast:
    """The row's length and image starts from its stand-in text's ids."""
    if row.videos:
        return _finish_with_videos(row, ids, how)
    found = ids.count(how.image_id)
    _check_placeholders(found, sum(row.placeholders), len(row.counts), row.rendering.placeholder, row.key)
    starts, at, shift = [], -1, 0
    for left, placeholders in zip(row.left, row.placeholders):
        at = ids.index(how.image_id, at + 1)
        starts.append(at + shift)
        for _ in range(placeholders - 1):  # the image's other placeholders (Gemma 3's crops)
            at = ids.index(how.image_id, at + 1)
        shift += left
    prompt = Prompt(row.rendering, row.tokens) if how.keep else None
    return Forecast(len(ids) + sum(row.left), row.counts, starts, prompt)


def _finish_with_videos(row: _Row, ids: list[int], how: _How) -> Forecast:
    """:func:`_finish` of a row with videos: its images' and videos' placeholders walked in the order they
    come, each item's stand-in holding its own run of them."""
    video_id = how.tokenizer.convert_tokens_to_ids(row.rendering.video_placeholder)
    marks = [(at, token == video_id) for at, token in enumerate(ids) if token in (how.image_id, video_id)]
    found = sum(is_video for _, is_video in marks)
    wanted = sum(n for _, _, n in row.videos)
    _check_placeholders(found, wanted, len(row.videos), row.rendering.video_placeholder, row.key)
    _check_placeholders(len(marks) - found, sum(row.placeholders), len(row.counts), row.rendering.placeholder, row.key)
    starts, shift, k, image, video = [], 0, 0, 0, 0
    while k < len(marks):
        at, is_video = marks[k]
        if is_video:
            k, shift, video = k + row.videos[video][2], shift + row.videos[video][1], video + 1
        else:
            starts.append(at + shift)
            k, shift, image = k + row.placeholders[image], shift + row.left[image], image + 1
    prompt = Prompt(row.rendering, row.tokens) if how.keep else None
    return Forecast(len(ids) + shift, row.counts, starts, prompt, [n for n, _, _ in row.videos])


def _token_ids(tokenizer: Any, rows: list[_Row]) -> list[list[int]]:
    """Each row's ids: those it has, the others' stand-in texts in one batched call per special-tokens
    setting (the tokenizer's Rust backend directly where that gives the tokenizer's own ids)."""
    todo: dict[bool, list[_Row]] = {}
    for row in rows:
        if row.ids is None:
            todo.setdefault(row.rendering.add_special_tokens, []).append(row)
    backend = _plain_backend(tokenizer) if todo else None
    for special, group in todo.items():
        texts = [row.text for row in group]
        if backend is not None:
            encoded = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special)]
        else:
            encoded = list(tokenizer(texts, add_special_tokens=special)["input_ids"])
        for row, ids in zip(group, encoded):
            row.ids = ids
    return [row.ids for row in rows]  # type: ignore[misc]


def _plain_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a fast HF tokenizer where calling it directly gives the ids
    ``tokenizer(texts, add_special_tokens=...)`` gives (no truncation, padding or special-token splitting
    set on it), else None. Skipping the wrapper's per-text offsets, masks and dicts takes about a quarter off
    the forecast's tokenizing, its largest cost."""
    from transformers import PreTrainedTokenizerFast as Fast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    cls = type(tokenizer)
    if cls.__call__ is not Fast.__call__ or fast_encode_plus(cls) is not fast_encode_plus(Fast):
        return None  # a tokenizer class with its own encoding steps: only its own call says what it gives
    plain = backend.truncation is None and backend.padding is None
    if not plain or bool(backend.encode_special_tokens) != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


def expanded_length(num_ids: int, tokens_per_image: Any, layout: str, tokens_per_video_placeholder: Any = None) -> int:
    """A processed sample's length once expanded: its ``num_ids`` in the expanded layout; in the collapsed
    one (one placeholder per image, per video or per video's temporal group) each image's placeholder becomes
    its ``tokens_per_image`` ``[n]`` and each video placeholder its ``tokens_per_video_placeholder`` ``[m']``."""
    if layout == "expanded":
        return int(num_ids)
    counts = [int(n) for n in (tokens_per_image if tokens_per_image is not None else ())]
    counts += [int(n) for n in (tokens_per_video_placeholder if tokens_per_video_placeholder is not None else ())]
    return int(num_ids) + sum(counts) - len(counts)


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
    as there; only the image expansions are counted instead of written out (:func:`forecast_rows`, one row).
    """
    from ..vision import vision_spec_from_processor

    if processor is not None:
        tokenizer = tokenizer or processor.tokenizer
    if tokenizer is None:
        raise TypeError("forecast_length needs processor= or tokenizer=")
    if spec is None and image_sizes:
        source = processor if processor is not None else image_processor
        if source is None:
            raise TypeError("forecast_length with images needs processor=, image_processor= or spec=")
        spec = vision_spec_from_processor(source)
    row = (conversation, image_sizes, key)
    (result,) = forecast_rows([row], tokenizer=tokenizer, spec=spec, processor=processor, family=family,
                              template=template)  # fmt: skip
    if isinstance(result, Exception):
        raise result
    return result.length, result.counts
