"""The stages of one stream (``data.stream.StreamRunner`` runs them in order), each a small unit with its state::

    ShardReader ──raw samples──> StreamForecaster ──_Held (SampleJob)──> BinMaker ──bins──> BinLoader ──batch──>
    read a plan item's tar       header-only forecast,    shuffle buffer, StreamPacker,   process + check
    (reading: no budget)         limits, too long         look-ahead window order         (data.job), collate

What a stream saves to resume (``state.StreamSnapshot``) lives in :class:`BinMaker` (shuffle buffer, its rng,
the packer, the bins ready, the window counters) and in the runner (cursor, seq); the stages share the stream's
one ``PipelineStats`` (counts, and CPU time by phase) and its ``FailurePolicy``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..failures import Guard, SampleCodeError, SampleError, Skip
from ..packing import StreamPacker, padded_lengths
from ..packing.window import reserved_positions, window_order, window_schedule
from ..processing import IMAGE_MARKER
from ..processing.chat import VIDEO_MARKER
from .forecast import video_patches
from .images import refuse_large_image
from .job import SampleJob, forecast_job, process_jobs
from .reader import read_header, stream_tar_samples
from .state import PlanItem
from .stats import PipelineStats

if TYPE_CHECKING:
    from ..config import PackingConfig
    from ..packing.window import StreamBalance
    from ..preprocessor import Preprocessor

__all__ = ["BinLoader", "BinMaker", "ShardReader", "StreamForecaster"]


def _read_shard(url: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index in shard, raw sample dict) for each sample of one tar shard."""
    samples = stream_tar_samples(url)
    try:
        yield from enumerate(samples)
    finally:
        samples.close()  # closes the shard's stream now, also when the reader stops early


def _count_markers(conversation: Any, marker: str = IMAGE_MARKER, kind: str = "image") -> int:
    """``marker``s in string content plus ``{"type": kind}`` parts: the places the text gives that medium."""
    if isinstance(conversation, str):
        return conversation.count(marker)
    count = 0
    for turn in conversation:
        content = turn.get("content") if isinstance(turn, dict) else None
        if isinstance(content, str):
            count += content.count(marker)
        elif isinstance(content, list):
            count += sum(1 for part in content if isinstance(part, dict) and part.get("type") == kind)
    return count


def _check_places(conversation: Any, images: list[str], videos: list[str]) -> None:
    """The text's image (and video) places against the sample's members: a mismatch is bad data."""
    for kind, marker, members in (("image", IMAGE_MARKER, images), ("video", VIDEO_MARKER, videos)):
        n_markers = _count_markers(conversation, marker, kind)
        if n_markers and n_markers != len(members):
            raise SampleError(
                "placeholder_mismatch",
                f"the text has {n_markers} {kind} placeholder(s) but the sample has {len(members)} {kind}(s) "
                f"({', '.join(members) or 'none'})",
            )


def _vision_units(preprocessor: Any, sizes: list[tuple[int, int]], videos: list[Any]) -> tuple[int, ...]:
    """ViT patches of each image, then of each video's frame groups (``t`` groups of ``h * w``: the tower
    attends within a group, so a video costs as ``t`` images; vlm_pack.packing.cost.vision_patches)."""
    units = [preprocessor.spec.num_patches(w, h) for w, h in sizes]
    for video in videos:
        t, h, w = getattr(video, "grid_thw", None) or (0, 0, 0)
        units += [int(h) * int(w)] * int(t)
    return tuple(units)


def _label(url: str, key: str | None) -> str:
    return f"key {key!r} in {url}"


@dataclass(slots=True)
class _Held:
    """A forecast sample waiting in the stream's buffers: its job (raw media, prompt, forecast length) and
    what packing weighs it by."""

    job: SampleJob
    vision: int  # vision cost (PackingConfig.vision_cost)
    patches: tuple[int, ...]  # ViT patches per image and video frame group, for the pack's cost (StreamBalance)


class ShardReader:
    """Read stage: the samples of a plan item, timing the reads (``stats.time["read"]``); a shard error is
    reported under ``reading`` (no budget: a shard is not a sample) and ends the item."""

    def __init__(self, urls: tuple[str, ...], stats: PipelineStats, reading: Guard) -> None:
        self.urls, self.stats, self.reading = urls, stats, reading

    def read_item(
        self, item: PlanItem, first: int, collect: set[int] | None = None
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Samples of a plan item with index >= ``first`` (or only those in ``collect``).

        Shard errors are reported as ``unreadable_shard`` (keyed by the sample a cut tar left incomplete) and end
        the item; a shard read whole that holds no sample as ``empty_shard``.
        """
        url = self.urls[item.shard]
        wanted = set(item.pending) if collect is None else collect
        everything_from_start = collect is None and item.start is not None
        last = math.inf if everything_from_start else max(wanted, default=-1)
        if last < first:
            return
        times = self.stats.time
        samples = _read_shard(url)
        key = None
        whole = first == 0 and collect is None and not item.start  # the whole shard, from its start
        try:
            while True:
                started = time.thread_time()
                try:
                    index, raw = next(samples)
                except StopIteration:
                    if whole and key is None:  # an empty shard: said, never a silent 0 batches
                        detail = "the shard holds no sample (an empty or unfinished tar)"
                        self.reading.bad(SampleError("empty_shard", detail), url, None, url)
                    break
                except Exception as exc:
                    # any error of the shard (I/O, a cut tar) is counted, never classified as code; a cut
                    # tar yields every whole sample first and names the one it cuts (reader.ShardCutError)
                    lost = getattr(exc, "lost", None)
                    detail = f"{type(exc).__name__}: {exc}" + ("" if lost else f" (after key {key!r})")
                    self.reading.bad(SampleError("unreadable_shard", detail), url, lost or key, url)
                    break
                finally:
                    times["read"] += time.thread_time() - started
                key = raw.get("__key__")
                if index < first:
                    continue
                if index in wanted or (everything_from_start and index >= item.start):  # type: ignore[operator]
                    yield index, raw
                if index >= last:
                    break
        finally:
            samples.close()


class StreamForecaster:
    """Forecast stage: a raw tar sample's job from its headers (``job.forecast_job``), the run's limits
    (image pixels, vision cost, capacity) applied; timed as ``stats.time["forecast"]``."""

    def __init__(
        self, config: PackingConfig, preprocessor: Preprocessor, balance: bool, stats: PipelineStats,
        forecasting: Guard,
    ) -> None:  # fmt: skip
        self.config, self.preprocessor, self.balance = config, preprocessor, balance
        self.stats, self.forecasting = stats, forecasting

    def padded(self, length: int) -> int:
        """The span ``length`` tokens take in a row: the one rounding rule of every planner."""
        return int(padded_lengths(length, self.config.pad_to_multiple_of))

    def __call__(self, url: str, raw: dict[str, Any]) -> _Held | None:
        """The sample with its forecast, or None after reporting why it is skipped.

        Raises ``SampleCodeError`` naming the sample for an error of code (``vlm_pack.failures``).
        """
        started = time.thread_time()
        key = raw.get("__key__")
        label = _label(url, key)
        try:
            held = self.forecasting.call(self._forecast, url, raw, sample=label, key=key, where=url)
            if isinstance(held, Skip):
                return None
            overflow = self._overflow(url, key, held.job.length)
            if overflow is not None:
                self.forecasting.bad(SampleError("too_long", overflow), label, key, url)
                return None
            self.forecasting.good()
            return held
        finally:
            self.stats.time["forecast"] += time.thread_time() - started

    def _forecast(self, url: str, raw: dict[str, Any]) -> _Held:
        """The sample with its forecast; raises what makes it bad (``vlm_pack.failures`` sorts it out)."""
        preprocessor = self.preprocessor
        key = raw.get("__key__")
        header = read_header(raw, exif_transpose=self.config.exif_transpose)
        names, sizes = header.image_names, header.image_sizes
        if preprocessor.template is None:
            _check_places(header.conversation, names, header.video_names)
        self._check_images(names, sizes)
        images = [raw[name] for name in names]
        videos = [raw[name] for name in header.video_names]
        job = forecast_job(preprocessor, header, images, videos, key=key, label=_label(url, key), where=url)
        forecasts = job.video_forecasts or header.videos
        patches = _vision_units(preprocessor, sizes, forecasts) if self.balance else ()
        return _Held(job, self._vision_cost(sizes, forecasts), patches)

    def _check_images(self, names: list[str], sizes: list[tuple[int, int]]) -> None:
        for (width, height), name in zip(sizes, names):
            refuse_large_image(name, (width, height), self.config.max_image_pixels)
            try:
                self.preprocessor.spec.num_tokens(width, height)
            except ValueError as exc:
                raise SampleError("image_rejected", f"{name} {width}x{height}: {exc}") from None

    def _overflow(self, url: str, key: str | None, length: int) -> str | None:
        """Why a sample of ``length`` tokens fits no pack (None: it fits); raises under oversized="raise"."""
        config = self.config
        span = self.padded(length)
        if span <= config.capacity:
            return None
        what = f"{length} tokens" + (f" (padded to {span})" if span != length else "")
        if config.oversized == "raise":  # the policy of the run, not bad data: it stops there
            raise ValueError(
                f"sample {key!r} in {url}: {what} > capacity {config.capacity}; raise capacity, cap the "
                "image processor's max_pixels, or pass oversized='skip'."
            )
        return f"{what} > capacity {config.capacity}"

    def _vision_cost(self, sizes: list[tuple[int, int]], videos: list[Any]) -> int:
        """The sample's vision cost: its images and videos (``"images"``), or their encoder patches."""
        config = self.config
        if config.vision_capacity is None:
            return 0
        if config.vision_cost == "images":
            cost = len(sizes) + len(videos)
        else:
            spec = self.preprocessor.spec
            cost = sum(spec.num_patches(width, height) for width, height in sizes) + video_patches(videos)
        if cost > config.vision_capacity:
            raise SampleError("vision_too_large", f"vision cost {cost} > vision_capacity {config.vision_capacity}")
        return cost


class BinMaker:
    """Pack stage: forecast samples (by position) through the shuffle buffer into the packer; bins leave
    ``ready`` as packed, or by look-ahead windows in the shared schedule's order (``StreamBalance``).
    Timed as ``stats.time["pack"]``. Its state is the stream's resumable packing state."""

    def __init__(
        self, packer: StreamPacker, rng: np.random.Generator | None, shuffle_buffer: int,
        padded: Callable[[int], int], stats: PipelineStats,
    ) -> None:  # fmt: skip
        self.packer, self.rng, self.shuffle_buffer = packer, rng, shuffle_buffer
        self.padded, self.stats = padded, stats
        self.shuffle: list[int] = []
        self.samples: dict[int, _Held] = {}  # every sample held: in the shuffle buffer, the packer or ready
        self.ready: deque[list[int]] = deque()
        self.window = 0  # look-ahead windows scheduled so far (StreamBalance)
        self.scheduled = 0  # bins at the front of ready already in the window's emission order

    def hold(self, pos: int, held: _Held) -> None:
        """Take a forecast sample: into the shuffle buffer, or straight to the packer."""
        started = time.thread_time()
        self.samples[pos] = held
        if self.rng is None:
            self._pack(pos)
        else:
            self.shuffle.append(pos)
            if len(self.shuffle) > self.shuffle_buffer:
                self._pack(self._draw())
        self.stats.time["pack"] += time.thread_time() - started

    def _draw(self) -> int:
        buf = self.shuffle
        drawn = int(self.rng.integers(len(buf)))  # type: ignore[union-attr]
        buf[drawn], buf[-1] = buf[-1], buf[drawn]
        return buf.pop()

    def _pack(self, pos: int) -> None:
        held = self.samples[pos]
        for packed_bin in self.packer.add(pos, self.padded(held.job.length), held.vision):
            self.ready.append(list(packed_bin.keys))

    def flush(self) -> None:
        """End of the stream's reading: empty the shuffle buffer and the packer into ``ready``."""
        started = time.thread_time()
        while self.shuffle:
            self._pack(self._draw())
        for packed_bin in self.packer.flush():
            self.ready.append(list(packed_bin.keys))
        for packed_bin in self.packer.dropped:
            for pos in packed_bin.keys:
                self.samples.pop(pos, None)
            self.stats.samples_dropped += len(packed_bin.keys)
        self.packer.dropped.clear()
        self.stats.time["pack"] += time.thread_time() - started

    def take(self, positions: list[int]) -> list[_Held]:
        """A bin's samples, no longer held."""
        return [self.samples.pop(pos) for pos in positions]

    def drain(self, balance: StreamBalance | None, schedule_key: tuple[Any, ...], reserved: Any,
              final: bool = False) -> Iterator[list[int]]:  # fmt: skip
        """Yield the bins that may leave: all of ``ready`` without balancing; with it, whole windows of
        ``balance.window`` bins in their scheduled order (the last, partial one once ``final``).
        ``schedule_key``: the shared schedule's key without the window number; ``reserved``: the
        ``(rank, workers)`` image positions reserve for, or None."""
        if balance is None:
            self.scheduled = 0  # a window of a state saved with balancing: its order no longer matters
            while self.ready:
                yield self.ready.popleft()
            return
        while True:
            if not self.scheduled:
                if len(self.ready) < balance.window and not (final and self.ready):
                    return
                self._schedule(balance, min(balance.window, len(self.ready)), schedule_key, reserved)
            self.scheduled -= 1
            yield self.ready.popleft()

    def _schedule(self, balance: StreamBalance, n: int, schedule_key: tuple[Any, ...], reserved: Any) -> None:
        """Put the first ``n`` bins of ``ready`` (a window) in the order of the shared schedule."""
        started = time.thread_time()
        window = [self.ready.popleft() for _ in range(n)]
        costs = np.empty(n)
        has_image = np.zeros(n, dtype=bool)
        for b, positions in enumerate(window):
            held = [self.samples[pos] for pos in positions]
            costs[b] = balance.pack_cost([h.job.length for h in held], [p for h in held for p in h.patches])
            has_image[b] = any(h.job.images or h.job.videos for h in held)  # a video runs the vision tower too
        schedule = window_schedule(balance.window, (*schedule_key, self.window))
        positions_reserved = None
        if balance.image_every_rank and reserved is not None:
            rank, workers = reserved
            positions_reserved = reserved_positions(balance.window, balance.grad_accum, rank, workers)
        order = window_order(costs, schedule, has_image=has_image, reserved=positions_reserved)
        self.ready.extendleft(window[i] for i in order[::-1])
        self.scheduled = n
        self.window += 1
        self.stats.time["pack"] += time.thread_time() - started


class BinLoader:
    """Load stage: a bin's jobs processed and checked (``job.process_jobs``: one sequence for every loader),
    the bad ones reported under ``processing``, the rest collated (``stats.time["preprocess"]`` /
    ``["collate"]``)."""

    def __init__(
        self, preprocessor: Preprocessor, collate: Callable[[list[dict[str, Any]]], Any], stats: PipelineStats,
        processing: Guard,
    ) -> None:  # fmt: skip
        self.preprocessor, self.collate, self.stats, self.processing = preprocessor, collate, stats, processing

    def __call__(self, samples: list[_Held]) -> tuple[Any, list[SampleJob], list[int]] | None:
        """``(batch, the jobs in it, their lengths in the row)``, or None when no sample of the bin loads."""
        jobs = [held.job for held in samples]
        processed, picked, lengths = [], [], []
        for job, checked in zip(jobs, self._process(jobs)):
            if isinstance(checked, SampleError):
                if checked.reason == "forecast_mismatch":
                    self.stats.forecast_mismatches += 1
                self.processing.bad(checked, job.label, job.key, job.where)
                continue
            out, length = checked
            out["__key__"] = job.key
            out["__url__"] = job.where
            processed.append(out)
            picked.append(job)
            lengths.append(length)
        if not processed:
            return None
        self.processing.good()
        started = time.thread_time()
        batch = self.collate(processed)
        self.stats.time["collate"] += time.thread_time() - started
        self.stats.bins += 1
        self.stats.samples_packed += len(processed)
        self.stats.tokens += sum(lengths)
        return batch, picked, lengths

    def _process(self, jobs: list[SampleJob]) -> list[Any]:
        """:func:`process_jobs` of a bin's jobs (timed as "preprocess"), an error of code naming the shard.

        ``process_pack`` writes the bin's ``pixel_values`` once (one image-processor call where that is
        exact, in the main process), so the collator joins the samples' views without copying them again.
        """
        started = time.thread_time()
        try:
            checked = process_jobs(self.preprocessor, jobs)
        except SampleCodeError as exc:  # name the sample's shard too
            url = next((job.where for job in jobs if job.key == exc.key), None)
            raise SampleCodeError(f"shard {url}, {exc}", exc.key) from exc
        self.stats.time["preprocess"] += time.thread_time() - started
        return checked
