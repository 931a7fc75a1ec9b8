"""One stream of the pipeline: read its shards, forecast each sample from headers, pack, preprocess, collate.

A *stream* is one (rank, DataLoader worker); :class:`StreamRunner` does its work inside the worker and
attaches to every batch the metadata the main process tracks (:func:`stream_info`), including a
:class:`~vlm_pack.data.state.StreamSnapshot` of the stream *after* that batch. Each batch is held back until
the stream has another bin to collate, so the last batch carries the stream's final state (``done``, and
the bad samples read after it). Only a stream that yields no batch at all (an unreadable shard, only bad
samples) ends with a :class:`StreamEnd` marker, so the main process always learns that the stream is done
and what it counted; a plain ``DataLoader`` over streams that each yield a batch never sees one (unless
every sample of the bins after a stream's last yielded batch fails to decode).

A runner knows nothing of the dataset: :class:`WorkerSpec` (frozen, built once by ``PackedWebDataset`` and
pickled to each worker) carries what a stream needs, and the stream's share of the epoch comes as plan items
with its last snapshot (from :class:`~vlm_pack.data.tracker.StreamTracker`, which the main process keeps).
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..failures import (
    Failure,
    FailureBudget,
    FailurePolicy,
    Guard,
    SampleCodeError,
    SampleError,
    Skip,
)
from ..packing import StreamPacker, padded_lengths
from ..packing.window import StreamBalance, reserved_positions, window_order, window_schedule
from ..processing import IMAGE_MARKER, Prompt
from ..processing.chat import VIDEO_MARKER
from .forecast import video_forecasts, video_patches
from .images import refuse_large_image
from .reader import read_header, stream_tar_samples
from .state import Cursor, EpochProgress, PlanItem, StreamSnapshot, position, split_position
from .stats import PHASES, BadSample, BadSampleWarning, PipelineStats
from .stream_meta import StreamEnd, attach_meta, stream_info

if TYPE_CHECKING:
    from ..config import PackingConfig
    from ..preprocessor import Preprocessor

__all__ = ["StreamRunner", "WorkerSpec"]



@dataclass(frozen=True)
class WorkerSpec:
    """Everything one stream's worker needs, and nothing of the dataset that built it (pickled to workers).

    ``PackedWebDataset`` builds one; :class:`StreamRunner` reads only this (no reference back to the
    dataset, so ``data.stream`` does not depend on ``data.pipeline``).
    """

    urls: tuple[str, ...]
    """The shard URLs; plan items index them."""
    config: PackingConfig
    """The packing and streaming knobs (capacity, pad_to_multiple_of, on_error, oversized, ...)."""
    preprocessor: Preprocessor
    """Forecasts a sample from its headers and processes a bin's samples."""
    packer: dict[str, Any]
    """``StreamPacker`` keyword arguments (saved in the resume state, which must match them)."""
    shuffle_buffer: int
    """Samples in the shuffle buffer; 0: no shuffling within a stream."""
    make_collator: Callable[[], Callable[[list[dict[str, Any]]], Any]]
    """Builds the collator (once per stream, in its worker)."""
    max_examples: int = 100
    """Bad samples kept as examples in a stream's ``PipelineStats.bad``."""
    balance: StreamBalance | None = None
    """Step balancing by a look-ahead window (:mod:`vlm_pack.packing.window`); None: bins leave as packed."""


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


@dataclass(slots=True)
class _Sample:
    """A forecast sample waiting in a buffer: raw image bytes, its text, its forecast and the prompt the
    forecast rendered and tokenized (processing reuses it: each conversation is tokenized once)."""

    url: str
    key: str
    images: list[bytes]
    videos: list[bytes]
    conversation: Any
    prompt: Prompt
    length: int  # forecast tokens
    vision: int  # vision cost (PackingConfig.vision_cost)
    patches: tuple[int, ...]  # ViT patches per image and video frame group, for the pack's cost (StreamBalance)


class StreamRunner:
    """One stream's reading, forecasting, packing and collation (runs in a DataLoader worker).

    Failures follow ``vlm_pack.failures``: one :class:`~vlm_pack.failures.FailurePolicy` per stream, whose
    guarded stages (the forecast, the processing of packed samples, reading shards) count a sample with bad
    data under its reason and skip it, raise ``SampleCodeError`` naming the sample for an error of code, and
    each keep a budget of consecutive bad samples.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        stream: int,
        items: list[PlanItem],
        progress: EpochProgress,
        snapshot: StreamSnapshot | None,
    ) -> None:
        self.work = spec
        self.config = config = spec.config
        self.stream = stream
        self.items = items
        self.epoch = progress.epoch
        self.generation = progress.generation
        self.layout = progress.layout
        self.packer = StreamPacker(**spec.packer)
        self.rng = (
            np.random.default_rng([config.shuffle_seed, self.epoch, self.generation, stream])
            if spec.shuffle_buffer
            else None
        )
        self.shuffle: list[int] = []
        self.samples: dict[int, _Sample] = {}
        self.ready: deque[list[int]] = deque()
        self.cursor = Cursor()
        self.seq = 0
        self.stats = PipelineStats(capacity=config.capacity, time={p: 0.0 for p in PHASES})
        self.collate = spec.make_collator()
        self.snapshot = snapshot
        self.flushed = False  # every sample read and the packer flushed: the bins left in ready are the last
        self.window = 0  # look-ahead windows scheduled so far (StreamBalance)
        self.scheduled = 0  # bins at the front of ready already in the window's emission order
        policy = FailurePolicy.of(f"PackedWebDataset stream {stream}", config, self._report)
        self.forecasting = policy.stage("header-only forecast", "bad_text")
        self.processing = policy.stage("processing packed samples", "decode_error")
        self.reading = Guard(policy, FailureBudget(None, policy.who), "unreadable_shard")  # shards: no budget

    # -- bad data
    def _report(self, failure: Failure) -> None:
        """Warn about and count a skipped sample (or shard) under its reason, with its shard and key."""
        bad = BadSample(failure.where, failure.key, failure.reason, failure.detail)
        warnings.warn(f"vlm-pack: skipping {bad}", BadSampleWarning, stacklevel=4)
        self.stats.count_bad(bad, self.work.max_examples)

    @staticmethod
    def _label(url: str, key: str | None) -> str:
        return f"key {key!r} in {url}"

    # -- per sample: header-only forecast
    def _check_images(self, names: list[str], sizes: list[tuple[int, int]]) -> None:
        for (width, height), name in zip(sizes, names):
            refuse_large_image(name, (width, height), self.config.max_image_pixels)
            try:
                self.work.preprocessor.spec.num_tokens(width, height)
            except ValueError as exc:
                raise SampleError("image_rejected", f"{name} {width}x{height}: {exc}") from None

    def _overflow(self, url: str, key: str | None, length: int) -> str | None:
        """Why a sample of ``length`` tokens fits no pack (None: it fits); raises under oversized="raise"."""
        config = self.config
        span = self._padded(length)
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
            spec = self.work.preprocessor.spec
            cost = sum(spec.num_patches(width, height) for width, height in sizes) + video_patches(videos)
        if cost > config.vision_capacity:
            raise SampleError("vision_too_large", f"vision cost {cost} > vision_capacity {config.vision_capacity}")
        return cost

    def _forecast_sample(self, url: str, raw: dict[str, Any]) -> _Sample:
        """The sample with its forecast; raises what makes it bad (``vlm_pack.failures`` sorts it out)."""
        preprocessor = self.work.preprocessor
        key = raw.get("__key__")
        header = read_header(raw, exif_transpose=self.config.exif_transpose)
        conversation, names, sizes = header.conversation, header.image_names, header.image_sizes
        images = [raw[name] for name in names]
        videos = [raw[name] for name in header.video_names]
        if preprocessor.template is None:
            _check_places(conversation, names, header.video_names)
        self._check_images(names, sizes)
        forecasts = video_forecasts(preprocessor, header.videos)  # each clip's tokens, from its header
        length, _, prompt = preprocessor.forecast_prompt(conversation, sizes, key, videos=forecasts)
        patches = _vision_units(preprocessor, sizes, forecasts) if self.work.balance else ()
        vision = self._vision_cost(sizes, forecasts)
        return _Sample(url, key, images, videos, conversation, prompt, length, vision, patches)

    def _forecast(self, url: str, raw: dict[str, Any]) -> _Sample | None:
        """The sample with its forecast, or None after reporting why it is skipped (timed as "forecast").

        Raises ``SampleCodeError`` naming the sample for an error of code (``vlm_pack.failures``).
        """
        started = time.thread_time()
        key = raw.get("__key__")
        label = self._label(url, key)
        try:
            sample = self.forecasting.call(self._forecast_sample, url, raw, sample=label, key=key, where=url)
            if isinstance(sample, Skip):
                return None
            overflow = self._overflow(url, key, sample.length)
            if overflow is not None:
                self.forecasting.bad(SampleError("too_long", overflow), label, key, url)
                return None
            self.forecasting.good()
            return sample
        finally:
            self.stats.time["forecast"] += time.thread_time() - started

    # -- packing
    def _padded(self, length: int) -> int:
        """The span ``length`` tokens take in a row: the one rounding rule of every planner."""
        return int(padded_lengths(length, self.config.pad_to_multiple_of))

    def _push(self, pos: int) -> None:
        if self.rng is None:
            self._pack(pos)
            return
        self.shuffle.append(pos)
        if len(self.shuffle) > self.work.shuffle_buffer:
            self._pack(self._draw())

    def _draw(self) -> int:
        buf = self.shuffle
        drawn = int(self.rng.integers(len(buf)))  # type: ignore[union-attr]
        buf[drawn], buf[-1] = buf[-1], buf[drawn]
        return buf.pop()

    def _pack(self, pos: int) -> None:
        sample = self.samples[pos]
        for packed_bin in self.packer.add(pos, self._padded(sample.length), sample.vision):
            self.ready.append(list(packed_bin.keys))

    def _flush(self) -> None:
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

    # -- collation
    def _process(self, samples: list[_Sample]) -> list[tuple[dict[str, Any], int] | None]:
        """``process_sample`` of a bin's samples (timed as "preprocess"); None for each bad one (counted).

        ``process_pack`` writes the bin's ``pixel_values`` once (one image-processor call where that is
        exact, in the main process), so the collator joins the samples' views without copying them again.
        """
        started = time.thread_time()
        try:
            outs = self.work.preprocessor.process_pack(
                [(s.images, s.conversation, s.videos) if s.videos else (s.images, s.conversation) for s in samples],
                keys=[sample.key for sample in samples],
                prompts=[sample.prompt for sample in samples],
            )
        except SampleCodeError as exc:  # name the sample's shard too
            url = next((sample.url for sample in samples if sample.key == exc.key), None)
            raise SampleCodeError(f"shard {url}, {exc}", exc.key) from exc
        self.stats.time["preprocess"] += time.thread_time() - started
        return [self._checked(sample, out) for sample, out in zip(samples, outs)]

    def _checked(self, sample: _Sample, out: dict[str, Any] | SampleError) -> tuple[dict[str, Any], int] | None:
        """``(out, its length in a row)`` of ``sample``, or None after reporting it bad: its processing failed,
        or its processed length is not its forecast (``Preprocessor.checked_length``: the bin was packed on it)."""
        label = self._label(sample.url, sample.key)
        if not isinstance(out, SampleError):
            try:
                return out, self.work.preprocessor.checked_length(out, sample.length, label)
            except SampleError as mismatch:
                self.stats.forecast_mismatches += 1
                out = mismatch
        self.processing.bad(out, label, sample.key, sample.url)
        return None

    def _make_batch(self, positions: list[int]) -> Any:
        processed, picked, lengths = [], [], []
        samples = [self.samples.pop(pos) for pos in positions]
        for sample, checked in zip(samples, self._process(samples)):
            if checked is None:
                continue
            out, length = checked
            out["__key__"] = sample.key
            out["__url__"] = sample.url
            processed.append(out)
            picked.append(sample)
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
        attach_meta(batch, self._meta(picked, lengths, done=False))
        return batch

    def _meta(self, picked: list[_Sample], lengths: list[int], done: bool) -> dict[str, Any]:
        """The metadata of the next yielded item (a batch of ``picked``, or a :class:`StreamEnd`)."""
        started = time.thread_time()
        self.seq += 1
        meta = {
            "epoch": self.epoch,
            "generation": self.generation,
            "layout": list(self.layout or ()),
            "samples": [[sample.url, sample.key] for sample in picked],
            "lengths": lengths,
            "forecast": [sample.length for sample in picked],
        }
        meta["snapshot"] = self._snapshot(done)
        self.stats.time["state"] += time.thread_time() - started  # counted in the next snapshot
        return meta

    def _snapshot(self, done: bool) -> StreamSnapshot:
        stats = PipelineStats.from_dict(self.stats.to_dict())  # a copy: the stream keeps counting
        return StreamSnapshot(
            stream=self.stream,
            seq=self.seq,
            done=done,
            cursor=Cursor(self.cursor.item, self.cursor.sample),
            shuffle=list(self.shuffle),
            rng=None if self.rng is None else self.rng.bit_generator.state,
            packer=self.packer.state_dict(),
            ready=[list(keys) for keys in self.ready],
            stats=stats,
            window=self.window,
            scheduled=self.scheduled,
        )

    def _drain(self, final: bool = False) -> Iterator[list[int]]:
        """Yield the bins that may leave: all of ``ready`` without balancing; with it, whole windows of
        ``StreamBalance.window`` bins in their scheduled order (the last, partial one once ``final``)."""
        balance = self.work.balance
        if balance is None:
            self.scheduled = 0  # a window of a state saved with balancing: its order no longer matters
            while self.ready:
                yield self.ready.popleft()
            return
        while True:
            if not self.scheduled:
                if len(self.ready) < balance.window and not (final and self.ready):
                    return
                self._schedule(min(balance.window, len(self.ready)))
            self.scheduled -= 1
            yield self.ready.popleft()

    def _schedule(self, n: int) -> None:
        """Put the first ``n`` bins of ``ready`` (a window) in the order of the shared schedule."""
        balance = self.work.balance
        assert balance is not None
        started = time.thread_time()
        window = [self.ready.popleft() for _ in range(n)]
        costs = np.empty(n)
        has_image = np.zeros(n, dtype=bool)
        for b, positions in enumerate(window):
            samples = [self.samples[pos] for pos in positions]
            costs[b] = balance.pack_cost([s.length for s in samples], [p for s in samples for p in s.patches])
            has_image[b] = any(s.images or s.videos for s in samples)  # a video runs the vision tower too
        seed = self.config.shuffle_seed
        key = (balance.seed, 0 if seed is None else seed + 1, self.epoch, self.generation, self.window)
        schedule = window_schedule(balance.window, key)
        reserved = None
        if balance.image_every_rank:
            world, workers = self.layout or (1, 1)
            reserved = reserved_positions(balance.window, balance.grad_accum, self.stream // world, workers)
        order = window_order(costs, schedule, has_image=has_image, reserved=reserved)
        self.ready.extendleft(window[i] for i in order[::-1])
        self.scheduled = n
        self.window += 1
        self.stats.time["pack"] += time.thread_time() - started

    # -- reading
    def _read_item(
        self, item: PlanItem, first: int, collect: set[int] | None = None
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Samples of a plan item with index >= ``first`` (or only those in ``collect``), timing the reads.

        Shard errors are reported as ``unreadable_shard`` (keyed by the sample a cut tar left incomplete) and end
        the item; a shard read whole that holds no sample as ``empty_shard``.
        """
        url = self.work.urls[item.shard]
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

    def _restore(self, snapshot: StreamSnapshot) -> None:
        self.cursor = Cursor(snapshot.cursor.item, snapshot.cursor.sample)
        self.seq = snapshot.seq
        self.stats = PipelineStats.from_dict(snapshot.stats.to_dict())
        for phase in PHASES:
            self.stats.time.setdefault(phase, 0.0)
        self.packer.load_state_dict(snapshot.packer)
        self.shuffle = list(snapshot.shuffle)
        if self.rng is not None and snapshot.rng is not None:
            self.rng.bit_generator.state = snapshot.rng
        self.ready = deque(list(keys) for keys in snapshot.ready)
        self.window, self.scheduled = snapshot.window, min(snapshot.scheduled, len(self.ready))
        # Re-read the samples the stream held: they were forecast before, so forecasting again is exact.
        item_of_shard = {item.shard: item for item in self.items}
        for shard, indices in sorted(snapshot.held_by_shard().items()):
            for index, raw in self._read_item(item_of_shard[shard], 0, collect=indices):
                sample = self._forecast(self.work.urls[shard], raw)
                if sample is not None:
                    self.samples[position(shard, index)] = sample
        missing = [pos for pos in snapshot.held_positions() if pos not in self.samples]
        if missing:
            shard, index = split_position(missing[0])
            raise RuntimeError(
                f"resume: {len(missing)} buffered sample(s) could not be read again (first: shard "
                f"{self.work.urls[shard]}, index {index}); the shards changed since the state was saved."
            )

    def _read_all(self) -> Iterator[list[int]]:
        """Read the stream's plan items from the cursor on, forecasting and packing; yield ready bins."""
        times = self.stats.time
        first_item, first_sample = self.cursor.item, self.cursor.sample
        for item_number in range(first_item, len(self.items)):
            item = self.items[item_number]
            url = self.work.urls[item.shard]
            pending = set(item.pending)
            start = first_sample if item_number == first_item else 0
            for index, raw in self._read_item(item, start):
                self.cursor = Cursor(item_number, index + 1)
                if index not in pending:  # re-dealt buffered samples were counted when first read
                    self.stats.samples_read += 1
                sample = self._forecast(url, raw)
                if sample is None:
                    continue
                started = time.thread_time()
                pos = position(item.shard, index)
                self.samples[pos] = sample
                self._push(pos)
                times["pack"] += time.thread_time() - started
                yield from self._drain()
            self.cursor = Cursor(item_number + 1, 0)

    def _bins(self) -> Iterator[list[int]]:
        """The positions of every bin the stream emits, in order; ``self.flushed`` once reading is over."""
        if self.snapshot is not None:
            self._restore(self.snapshot)
            yield from self._drain()
        yield from self._read_all()
        self.forecasting.finish()  # the share of bad samples over the whole stream (vlm_pack.failures)
        self._flush()
        self.flushed = True
        yield from self._drain(final=True)

    def run(self) -> Iterator[Any]:
        """The stream's batches; the last item yielded carries its final state (``snapshot.done``).

        Each batch is held back until the stream has another bin to collate (or has ended), so the last
        batch carries the state after the stream's end, bad samples read after it included. A held batch
        goes out before the next bin is preprocessed (a stream keeps at most one batch), except before the
        stream's last bin: if all of that bin's samples fail to decode, the held batch is the last one.
        Only a stream that yields no batch at all (or, rarely, whose bins after its last yielded batch all
        fail to decode) ends with a :class:`StreamEnd`. A held batch's snapshot, taken when it was made,
        still describes the state after the consumer received it: resuming from it makes the next again.
        """
        if self.snapshot is not None and self.snapshot.done:
            return  # delivered to its end before the checkpoint
        if self.snapshot is None and not self.items:
            return  # more streams than shards: nothing to do, nothing to report
        held = None
        for positions in self._bins():
            if held is not None and not (self.flushed and not self.ready):
                yield held
                held = None
            batch = self._make_batch(positions)
            if batch is not None:
                if held is not None:
                    yield held
                held = batch
        self.processing.finish()
        if held is None:
            yield StreamEnd(self._meta([], [], done=True))
            return
        stream_info(held)["snapshot"] = self._snapshot(done=True)  # same seq: the state after the end
        yield held


def identity(x: Any) -> Any:
    """The DataLoader's ``collate_fn``: the dataset yields whole batches."""
    return x

