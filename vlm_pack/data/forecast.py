"""Header-only forecasts over any source, in parallel processes: records -> a :class:`LengthTable`.

Each worker process reads whole chunks of the sources itself (``sources.read_chunk``), normalises every
record, reads each image's ``(width, height)`` from its header bytes (``vision.image_size``; no pixel is
decoded) and forecasts the chunk's rows in one ``Preprocessor.forecast_rows`` call (vlm-pack's one forecast,
its prompts tokenized in one batched call): the numbers of ``Preprocessor.forecast``, so the forecast equals
``len(process_sample(...)["input_ids"])``. A video's header is read from its container (PyAV; an MKV / WebM's
packets demuxed, never decoded) and forecast once (``vision.video.forecast_video``), the forecast handed to
the Preprocessor as it is. Results come back in source order, whatever ``num_proc``::

    main       open_sources ─ chunks ─┬──────────────────────────────────┬─ in order ─> LengthTable
    worker 0        chunk 0, 2, 4 ... │ read ─ normalise ─ image_size ─  │  + tqdm: total, rate, ETA
    worker 1        chunk 1, 3, 5 ... │ video header ─ tokenize ─ sample │
                                      │ tokens; bad records as values    │  one Guard counts them,
                                      └──────────────────────────────────┘  in source order

A record that cannot be read or forecast travels back as its :class:`SampleError` (classified in the worker by
``vlm_pack.failures.data_error``: an error of code raises there); the main process counts every chunk's
outcomes in source order through the run's one :class:`~vlm_pack.failures.Guard` (``forecast_guard``): its
budgets (consecutive failures, and the share of bad records, judged at the end of the run too), its
``on_error``.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import (
    DEFAULT_MAX_BAD_FRACTION,
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    DEFAULT_MAX_IMAGE_PIXELS,
    ON_ERROR,
    check_choice,
)
from ..failures import FailurePolicy, Guard, SampleError, data_error, skip_reason
from .images import image_sizes, refuse_large_image
from .reader import video_headers
from .records import Sample
from .sources import Chunk, Source, chunk_samples, chunks, open_sources
from .strings import Strings

if TYPE_CHECKING:
    from ..config import PackingConfig
    from ..packing import PackResult
    from ..preprocessor import Preprocessor
    from ..processing.length import Forecast

__all__ = ["LengthTable", "forecast_sources", "image_sizes"]


@dataclass
class LengthTable:
    """Per-sample forecast, as flat arrays (ragged per-image data in CSR form).

    Attributes:
        keys, sources: ``[N]`` sample keys and where they were read, as :class:`~vlm_pack.data.strings.Strings`
            (front-coded, a few bytes an item; a list given is converted; indexing and iterating give ``str``).
        text_tokens: int64 ``[N]``: tokens that are not image placeholders (template and wrappers included).
        vision_tokens: int64 ``[N]``: image placeholder tokens (sum over the sample's images).
        num_patches: int64 ``[N]``: vision-encoder patches (the ViT's second budget).
        image_ptr: int64 ``[N + 1]``: images of sample ``i`` are ``image_ptr[i]:image_ptr[i+1]``.
        image_tokens: int64 ``[M]``: placeholders of each image.
        image_starts: int64 ``[M]``: offset of each image's block inside its (expanded) sample: its first
            placeholder, or where the processor wraps images in marker tokens (InternVL, Idefics3, SmolVLM,
            Pixtral, Gemma 3), the first of those.
        invalid: ``(key, source, reason)`` of samples that could not be forecast (``on_error="skip"``);
            ``reason`` is the message naming the sample.
        index: int64 ``[N]``: ordinal of each sample among all records read, invalid ones included (for a
            single dataset: its row), or None when the table was built from samples without one.
        invalid_reasons: the reason code (``vlm_pack.failures.REASONS``) of each ``invalid`` sample.
        num_videos, video_tokens: int64 ``[N]``: videos per sample and their placeholder tokens (None: a table
            made before videos, read as none); ``num_patches`` counts their encoder patches too (Qwen-VL).
        video_groups, video_group_patches: int64 ``[V]`` (``V = num_videos.sum()``, sample by sample): each
            video's temporal groups ``t`` and encoder patches per group ``h * w`` (its ``video_grid_thw``; the
            Qwen-VL tower attends within a group); 0 and 0 for a family without a grid; None: not known.
    """

    keys: Strings
    sources: Strings
    text_tokens: np.ndarray
    vision_tokens: np.ndarray
    num_patches: np.ndarray
    image_ptr: np.ndarray
    image_tokens: np.ndarray
    image_starts: np.ndarray
    invalid: list[tuple[str, str, str]] = field(default_factory=list)
    index: np.ndarray | None = None
    invalid_reasons: list[str] = field(default_factory=list)
    num_videos: np.ndarray | None = None
    video_tokens: np.ndarray | None = None
    video_groups: np.ndarray | None = None
    video_group_patches: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.keys, self.sources = Strings(self.keys), Strings(self.sources)  # lists are taken too

    @property
    def nbytes(self) -> int:
        """Bytes the table holds in its arrays and string columns (``invalid`` aside): about 100 a sample with
        one image (the keys and sources front-coded), so 100 M samples take ~10 GB, not the ~40 GB of lists."""
        arrays = [self.text_tokens, self.vision_tokens, self.num_patches, self.image_ptr, self.image_tokens,
                  self.image_starts, self.keys, self.sources]  # fmt: skip
        extra = (self.index, self.num_videos, self.video_tokens, self.video_groups, self.video_group_patches)
        arrays += [a for a in extra if a is not None]
        return sum(a.nbytes for a in arrays)

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[N]``: expanded lengths (text + image tokens + video tokens)."""
        if self.video_tokens is None:
            return self.text_tokens + self.vision_tokens
        return self.text_tokens + self.vision_tokens + self.video_tokens

    @property
    def num_images(self) -> np.ndarray:
        """int64 ``[N]``: images per sample."""
        return np.diff(self.image_ptr)

    def __len__(self) -> int:
        return len(self.keys)

    def pack(
        self, config: PackingConfig, strategy: str = "bfd", *, lengths: np.ndarray | None = None
    ) -> PackResult:
        """:func:`vlm_pack.packing.pack` of these samples with ``config``'s knobs, the vision budget counted
        as ``config.vision_cost``, each length padded to ``config.pad_to_multiple_of`` (the span the collator
        lays out), bins in an order shuffled by ``config.shuffle_seed`` (None: creation order). ``lengths``
        ``[N]`` replaces :attr:`lengths`."""
        from ..packing import pack

        vision = None
        if config.vision_capacity is not None:
            vision = self.num_images if config.vision_cost == "images" else self.num_patches
        return pack(
            self.lengths if lengths is None else lengths,
            config.capacity,
            strategy=strategy,
            vision=vision,
            vision_capacity=config.vision_capacity,
            max_samples_per_bin=config.max_samples_per_bin,
            oversized=config.oversized,
            shuffle_seed=config.shuffle_seed,
            pad_to_multiple_of=config.pad_to_multiple_of,
        )


@dataclass
class _Forecaster:
    """What every worker needs, set once per process (``_init``)."""

    sources: list[Source]
    pre: Preprocessor
    record_format: str | None
    exif_transpose: bool
    on_error: str
    verify: bool = False
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS


_WORKER: _Forecaster | None = None


def _init(forecaster: _Forecaster) -> None:
    global _WORKER
    _WORKER = forecaster


@dataclass
class _ChunkResult:
    """One chunk's forecast, compact for the trip back to the main process."""

    records: int = 0
    ordinals: list[int] = field(default_factory=list)  # within the chunk
    keys: list[str] = field(default_factory=list)
    wheres: list[str] = field(default_factory=list)
    text: list[int] = field(default_factory=list)
    patches: list[int] = field(default_factory=list)
    num_images: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    videos: list[int] = field(default_factory=list)  # videos of each sample
    video_tokens: list[int] = field(default_factory=list)  # their placeholder tokens, per sample
    groups: list[int] = field(default_factory=list)  # per video: temporal groups t of its grid (0: none)
    group_patches: list[int] = field(default_factory=list)  # per video: patches h * w of one group
    invalid: list[tuple[str, str, str]] = field(default_factory=list)
    failed_ordinals: list[int] = field(default_factory=list)  # of ``invalid``, within the chunk
    failed_reasons: list[str] = field(default_factory=list)  # of ``invalid``: reason codes

    def sealed(self) -> _ChunkResult:
        """The per-sample lists as int64 arrays and :class:`Strings`: a list of Python ints and strs costs
        ~300 bytes a sample, which the driver would hold for every chunk of a 100 M-sample forecast."""
        for name in ("ordinals", "text", "patches", "num_images", "counts", "starts", "videos", "video_tokens",
                     "groups", "group_patches"):
            setattr(self, name, np.asarray(getattr(self, name), dtype=np.int64))
        self.keys, self.wheres = Strings(self.keys), Strings(self.wheres)  # type: ignore[assignment]
        return self


@dataclass(slots=True)
class _Read:
    """A record read, its images sized and its videos' headers read, waiting for its chunk's one forecast
    (``Preprocessor.forecast_rows``)."""

    ordinal: int
    sample: Sample
    sizes: list[tuple[int, int]]
    patches: int
    videos: list[Any]  # VideoForecast (or VideoHeader) of each video (vlm_pack.vision.video), in placeholder order


def sample_videos(sample: Sample) -> list[Any]:
    """The ``VideoHeader`` of each video of ``sample``, from its container (no frame decoded); raises as
    :func:`vlm_pack.data.reader.video_headers` (``"corrupt_video"``; without PyAV, naming the extra)."""
    names = [f"{sample.label}, video {i}" for i in range(len(sample.videos))]
    return video_headers(sample.videos, names, sample.key)


def video_forecasts(pre: Preprocessor, headers: Sequence[Any]) -> list[Any]:
    """Each ``VideoHeader``'s ``VideoForecast`` by ``pre``'s processor (what its forecast takes as it is, so
    nothing is forecast twice; its ``num_patches`` is the video's vision cost), or the headers as they are
    where ``pre`` has no video processor (its forecast then names what is missing)."""
    if not headers or getattr(pre.processor, "video_processor", None) is None:
        return list(headers)
    from ..vision.video import forecast_video

    return [forecast_video(header, pre.processor) for header in headers]


def video_patches(videos: Sequence[Any]) -> int:
    """Vision-encoder patches of ``videos`` (``VideoForecast.num_patches``; 0 where a family gives none)."""
    return sum(int(getattr(video, "num_patches", None) or 0) for video in videos)


def _read(f: _Forecaster, sample: Sample, ordinal: int, sizes: list[tuple[int, int]] | None = None) -> _Read:
    if sizes is None:
        sizes = image_sizes(
            sample, exif_transpose=f.exif_transpose, verify=f.verify, max_image_pixels=f.max_image_pixels
        )
    else:  # sized by the shard reader's headers: the same limit
        for i, size in enumerate(sizes):
            refuse_large_image(f"{sample.label}, image {i}", size, f.max_image_pixels)
    videos = video_forecasts(f.pre, sample_videos(sample))
    patches = sum(int(f.pre.spec.num_patches(w, h)) for w, h in sizes) + video_patches(videos)
    return _Read(ordinal, sample, sizes, patches, videos)


def _row(r: _Read) -> tuple[Any, ...]:
    """The row ``Preprocessor.forecast_rows`` takes: ``(conversation, image sizes, key)``, and the video
    headers where the sample has videos."""
    if r.videos:
        return (r.sample.conversation, r.sizes, r.sample.key, r.videos)
    return (r.sample.conversation, r.sizes, r.sample.key)


def _row_error(exc: Exception, sample: Sample) -> SampleError:
    """A row's forecast error as the :class:`SampleError` the record is skipped with, naming where it lives;
    raises an error of code (``vlm_pack.failures``)."""
    reason = skip_reason(exc, "bad_text", sample.label, sample.key)
    message = str(exc) if sample.key in str(exc) else f"sample {sample.key!r}: {exc}"
    return SampleError(reason, f"{sample.label}: {message}")


def _add(r: _Read, forecast: Forecast, out: _ChunkResult) -> None:
    video_tokens = sum(getattr(forecast, "video_counts", None) or ())
    out.ordinals.append(r.ordinal)
    out.keys.append(r.sample.key)
    out.wheres.append(r.sample.where)
    out.text.append(forecast.length - sum(forecast.counts) - video_tokens)
    out.videos.append(len(r.videos))
    out.video_tokens.append(video_tokens)
    for video in r.videos:  # the grid the tower attends by (t groups of h * w patches), where the family has one
        t, h, w = getattr(video, "grid_thw", None) or (0, 0, 0)
        out.groups.append(int(t))
        out.group_patches.append(int(h) * int(w))
    out.patches.append(r.patches)
    out.num_images.append(len(forecast.counts))
    out.counts.extend(forecast.counts)
    out.starts.extend(forecast.starts)


def _forecast_chunk(chunk: Chunk) -> _ChunkResult:
    f = _WORKER
    assert f is not None, "forecast worker not initialised"
    return forecast_chunk(f, chunk)


def forecast_chunk(f: _Forecaster, chunk: Chunk) -> _ChunkResult:
    """Read ``chunk`` of ``f.sources`` and forecast its records: the pure step every engine runs (this
    module's process pool, ``vlm_pack.integrations.ray``'s ``map_batches``), so they agree bit for bit."""
    read = ((where, key, sample, None) for where, key, sample in chunk_samples(f.sources, chunk, record_format=f.record_format))
    return _forecast_items(f, read)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for one chunk. A chunk's records become many small dicts, which set
    off collections that walk every object torch and transformers hold: about half of normalising the
    records, measured. What a chunk drops is freed by reference counting; the collector resumes after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _forecast_items(
    f: _Forecaster, items: Iterable[tuple[str, str, Sample | SampleError, list[tuple[int, int]] | None]]
) -> _ChunkResult:
    """Forecast ``(where, key, sample or its read error, image sizes or None: read them)`` in one chunk."""
    with _collector_paused():
        return _forecast_chunk_items(f, items)


def _forecast_chunk_items(
    f: _Forecaster, items: Iterable[tuple[str, str, Sample | SampleError, list[tuple[int, int]] | None]]
) -> _ChunkResult:
    out = _ChunkResult()
    read: list[_Read] = []
    failed: list[tuple[int, str, str, SampleError]] = []  # (ordinal, key, where, error)
    for where, key, sample, sizes in items:
        out.records += 1
        try:
            if isinstance(sample, SampleError):
                raise sample
            read.append(_read(f, sample, out.records - 1, sizes))
        except Exception as e:
            label = sample.label if isinstance(sample, Sample) else where
            key = sample.key if isinstance(sample, Sample) else key  # the record's own key, as on success
            failed.append((out.records - 1, key, where, data_error(e, "bad_text", label, key)))
    for r, forecast in zip(read, f.pre.forecast_rows([_row(r) for r in read])):
        if isinstance(forecast, Exception):
            failed.append((r.ordinal, r.sample.key, r.sample.where, _row_error(forecast, r.sample)))
        else:
            _add(r, forecast, out)
    # The failures travel back as values; the run's one Guard (main process, _spend) counts them in order.
    failed.sort(key=lambda item: item[0])  # source order, whichever step found the fault
    out.invalid = [(key, where, str(e)) for _, key, where, e in failed]
    out.failed_ordinals = [ordinal for ordinal, _, _, _ in failed]
    out.failed_reasons = [e.reason for _, _, _, e in failed]
    return out.sealed()


def _spend(guard: Guard, result: _ChunkResult) -> None:
    """Count a chunk's outcomes, in source order, in the run's guarded forecast stage: a good sample ends a
    run of bad ones, a bad one is reported and counted under its reason (raises when the budget is spent,
    or at once under ``on_error="raise"``)."""
    failures = dict(zip(result.failed_ordinals, zip(result.failed_reasons, result.invalid)))
    for ordinal in sorted([*result.ordinals, *failures]):
        if ordinal not in failures:
            guard.good()
            continue
        reason, (key, where, message) = failures[ordinal]
        guard.bad(SampleError(reason, message), where if str(key) in where else f"{where} (key {key!r})", key, where)


def forecast_guard(
    who: str,
    on_error: str = "skip",
    max_consecutive_failures: int | None = None,
    max_bad_fraction: float | None = None,
) -> Guard:
    """The guarded stage a forecast run (``who``) counts its bad records in (``vlm_pack.failures``)."""
    policy = FailurePolicy(who, on_error, max_consecutive_failures, max_bad_fraction=max_bad_fraction)
    return policy.stage("header-only forecast", "bad_text")


def _ordered_map(executor: Executor | None, items: Iterator[Chunk], window: int) -> Iterator[_ChunkResult]:
    """``_forecast_chunk`` over ``items`` in order, at most ``window`` chunks in flight."""
    if executor is None:
        yield from map(_forecast_chunk, items)
        return
    pending: deque[Any] = deque()
    for item in items:
        pending.append(executor.submit(_forecast_chunk, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _pool(workers: int, forecaster: _Forecaster) -> Executor | None:
    if workers <= 1:
        _init(forecaster)
        return None
    # fork: the workers inherit the tokenizer, spec and open sources without pickling them.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked tokenizers must not use threads
    return ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(method), initializer=_init, initargs=(forecaster,)
    )


def _table(results: list[_ChunkResult]) -> LengthTable:
    """The chunks' (sealed) results end to end, in their order."""

    def cat(name: str) -> np.ndarray:
        return np.concatenate([np.zeros(0, np.int64)] + [np.asarray(getattr(r, name), np.int64) for r in results])

    bases = np.cumsum([0] + [r.records for r in results[:-1]], dtype=np.int64)
    index = np.concatenate(
        [np.zeros(0, np.int64)] + [np.asarray(r.ordinals, np.int64) + b for r, b in zip(results, bases)]
    )
    ptr = np.concatenate([[0], np.cumsum(cat("num_images"))]).astype(np.int64)
    counts = cat("counts")
    csum = np.concatenate([[0], np.cumsum(counts)])
    vision = (csum[ptr[1:]] - csum[ptr[:-1]]).astype(np.int64)
    return LengthTable(
        Strings.concat(r.keys for r in results),
        Strings.concat(r.wheres for r in results),
        cat("text"),
        vision,
        cat("patches"),
        ptr,
        counts,
        cat("starts"),
        [bad for r in results for bad in r.invalid],
        index,
        invalid_reasons=[reason for r in results for reason in r.failed_reasons],
        **_video_columns(cat("videos"), cat("video_tokens"), cat("groups"), cat("group_patches")),
    )


def _video_columns(videos: np.ndarray, tokens: np.ndarray, groups: np.ndarray, per_group: np.ndarray) -> dict:
    """A table's video arrays, or none for data without a video (an image-only table costs what it did)."""
    if not videos.any():
        return {}
    return {"num_videos": videos, "video_tokens": tokens, "video_groups": groups, "video_group_patches": per_group}


def make_forecaster(
    sources: Any | Sequence[Any],
    *,
    tokenizer: Any = None,
    spec: Any = None,
    family: str | None = None,
    template: Callable[..., Any] | None = None,
    preprocessor: Preprocessor | None = None,
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    exif_transpose: bool = True,
    verify: bool = False,
    on_error: str = "skip",
    who: str = "forecast_sources",
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
) -> _Forecaster:
    """The opened sources and checkpoint parts a worker forecasts :func:`forecast_chunk` with (the arguments
    of :func:`forecast_sources`)."""
    from ..preprocessor import Preprocessor

    pre = preprocessor or Preprocessor(tokenizer, family=family, template=template, spec=spec)
    if pre.spec is None:
        raise TypeError(f"{who} needs spec= (or a preprocessor with an image processor)")
    check_choice("on_error", on_error, ON_ERROR)
    opened = open_sources(sources, image_root=image_root)
    return _Forecaster(opened, pre, record_format, exif_transpose, on_error, verify, max_image_pixels)


def assemble_table(
    results: Iterable[_ChunkResult],
    max_consecutive_failures: int | None,
    who: str,
    on_error: str = "skip",
    max_bad_fraction: float | None = DEFAULT_MAX_BAD_FRACTION,
) -> LengthTable:
    """The :class:`LengthTable` of chunk results given in source order, consumed as they come: the failure
    budget is spent in that order (raises ``FailureBudgetError`` where :func:`forecast_sources` would) and,
    with ``on_error="raise"``, the first bad sample raises, so an engine stops at the first bad chunks."""
    guard = forecast_guard(who, on_error, max_consecutive_failures, max_bad_fraction)
    kept = []
    for result in results:
        _spend(guard, result)
        kept.append(result)
    guard.finish()
    return _table(kept)


def _num_proc(num_proc: Any, num_workers: Any) -> int:
    """``num_proc``, checked; ``num_workers`` (its old name) in its place, with a ``DeprecationWarning``."""
    if num_workers is not None:
        warnings.warn(
            "forecast_sources(num_workers=) is now num_proc= (the name datasets and PackedMapDataset use)",
            DeprecationWarning,
            stacklevel=3,
        )
        num_proc = num_workers
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc must be a positive int, got {num_proc!r}")
    return num_proc


def forecast_sources(
    sources: Any | Sequence[Any],
    *,
    tokenizer: Any = None,
    spec: Any = None,
    family: str | None = None,
    template: Callable[..., Any] | None = None,
    preprocessor: Preprocessor | None = None,
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    exif_transpose: bool = True,
    verify: bool = False,
    on_error: str = "skip",
    num_proc: int = 1,
    progress: bool | None = None,
    chunk_rows: int = 1024,
    max_consecutive_failures: int | None = DEFAULT_MAX_CONSECUTIVE_FAILURES,
    max_bad_fraction: float | None = DEFAULT_MAX_BAD_FRACTION,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    num_workers: int | None = None,
) -> LengthTable:
    """Forecast every record of ``sources`` (``datasets`` objects, parquet / JSON / JSONL files, shards,
    folders, globs: see ``sources.open_sources``) from text and image headers: a :class:`LengthTable`.

    Args:
        tokenizer, spec: the checkpoint's tokenizer and ``vlm_pack.vision`` spec.
        family: chat format (default: the tokenizer's ``vlm_pack_family``, else the spec's family).
        template: a callable replacing the family's chat format (see ``processing.tokenize_conversation``).
        preprocessor: a :class:`~vlm_pack.Preprocessor` instead of the four above (a
            ``processor``'s own chat template renders the prompts).
        record_format: force one record format (``records.RECORD_FORMATS``: webdataset, llava, sharegpt,
            messages, caption); default: detected per record.
        image_root: folder relative image paths resolve against (default: the source file's folder).
        exif_transpose: size images as ``ImageOps.exif_transpose`` shows them (as ``load_image`` does).
        verify: also decode every image's pixels (slower; catches files cut short after their header).
        max_image_pixels: refuse an image whose header declares more pixels, before decoding, as
            ``image_too_large`` (``PackingConfig``'s default; None: no cap).
        on_error: ``"skip"`` (default: listed in ``LengthTable.invalid`` with its reason) or ``"raise"`` (a
            ``SampleError`` naming where the record lives and its key); ``PackingConfig.on_error``'s values.
        num_proc: processes reading and forecasting chunks (1: this process), as ``datasets``' ``map``
            and ``PackedMapDataset`` name them. ``num_workers=`` is its old name (a ``DeprecationWarning``).
        progress: a tqdm bar with total and ETA (``None``: only on a terminal).
        chunk_rows: records per chunk (parquet: whole row groups).
        max_consecutive_failures, max_bad_fraction: with ``on_error="skip"``, the failure budget of
            ``vlm_pack.failures``: more invalid records than this in a row (source order), or more than this
            share of the records seen, raise ``FailureBudgetError`` naming the most common reason and its fix
            (defaults: ``PackingConfig``'s; None: no limit, every invalid record is listed).

    Records with bad data are invalid (``on_error``; an unreadable video: ``corrupt_video``). An error of code
    (a ``template`` raising ``TypeError`` ..., a bug; a video without ``pip install "vlm-pack[video]"``)
    raises ``SampleCodeError`` naming the record."""
    from tqdm import tqdm

    num_proc = _num_proc(num_proc, num_workers)
    forecaster = make_forecaster(
        sources, tokenizer=tokenizer, spec=spec, family=family, template=template, preprocessor=preprocessor,
        record_format=record_format, image_root=image_root, exif_transpose=exif_transpose, verify=verify,
        on_error=on_error, max_image_pixels=max_image_pixels,
    )  # fmt: skip
    opened = forecaster.sources
    totals = [s.num_rows for s in opened]
    total = None if None in totals else sum(t for t in totals if t is not None)
    disable = (not progress) if progress is not None else None
    results: list[_ChunkResult] = []
    guard = forecast_guard("forecast_sources", on_error, max_consecutive_failures, max_bad_fraction)
    executor = _pool(num_proc, forecaster)
    try:
        with tqdm(total=total, desc="forecast", unit=" samples", disable=disable, smoothing=0.1) as bar:
            for result in _ordered_map(executor, chunks(opened, chunk_rows), window=4 * num_proc):
                results.append(result)
                _spend(guard, result)
                bar.update(result.records)
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)
    guard.finish()
    return _table(results)
