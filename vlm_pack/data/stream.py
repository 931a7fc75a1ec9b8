"""One stream of the pipeline: read its shards, forecast each sample from headers, pack, preprocess, collate.

A *stream* is one (rank, DataLoader worker); :class:`StreamRunner` does its work inside the worker and
attaches to every batch the metadata the main process tracks (:func:`stream_info`), including a
:class:`~vlm_pack.data.state.StreamSnapshot` of the stream *after* that batch. Each batch is held back until
the stream has another bin to collate, so the last batch carries the stream's final state (``done``, and
the bad samples read after it). Only a stream that yields no batch at all (an unreadable shard, only bad
samples) ends with a :class:`StreamEnd` marker, so the main process always learns that the stream is done
and what it counted; a plain ``DataLoader`` over streams that each yield a batch never sees one (unless
every sample of the bins after a stream's last yielded batch fails to decode).

The runner holds the stream's stages (:mod:`vlm_pack.data.stream_stages`: ``ShardReader`` -> ``StreamForecaster``
-> ``BinMaker`` -> ``BinLoader``, each a small unit with its state; a sample travels them as a
:class:`~vlm_pack.data.job.SampleJob`) and what it emits: the cursor, the sequence number, the snapshots.

A runner knows nothing of the dataset: :class:`WorkerSpec` (frozen, built once by ``PackedWebDataset`` and
pickled to each worker) carries what a stream needs, and the stream's share of the epoch comes as plan items
with its last snapshot (from :class:`~vlm_pack.data.tracker.StreamTracker`, which the main process keeps).
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..failures import Failure, FailureBudget, FailurePolicy, Guard
from ..packing import StreamPacker
from ..packing.window import StreamBalance
from .job import SampleJob
from .state import Cursor, EpochProgress, PlanItem, StreamSnapshot, position, split_position
from .stats import PHASES, BadSample, BadSampleWarning, PipelineStats
from .stream_meta import StreamEnd, attach_meta, stream_info
from .stream_stages import BinLoader, BinMaker, ShardReader, StreamForecaster, _vision_units  # noqa: F401

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


class StreamRunner:
    """One stream's reading, forecasting, packing and collation (runs in a DataLoader worker): the stages of
    ``data.stream_stages`` (read -> forecast -> pack -> load -> emit) in order, and the stream's resume state.

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
        config = spec.config
        self.stream, self.items, self.snapshot = stream, items, snapshot
        self.epoch, self.generation, self.layout = progress.epoch, progress.generation, progress.layout
        self.cursor = Cursor()
        self.seq = 0
        self.flushed = False  # every sample read and the packer flushed: the bins left in ready are the last
        self.stats = PipelineStats(capacity=config.capacity, time={p: 0.0 for p in PHASES})
        if snapshot is not None:  # the stages count into the stream's one stats from the start
            self.stats = PipelineStats.from_dict(snapshot.stats.to_dict())
            for phase in PHASES:
                self.stats.time.setdefault(phase, 0.0)
        policy = FailurePolicy.of(f"PackedWebDataset stream {stream}", config, self._report)
        reading = Guard(policy, FailureBudget(None, policy.who), "unreadable_shard")  # shards: no budget
        self.reader = ShardReader(spec.urls, self.stats, reading)
        self.forecast = StreamForecaster(
            config, spec.preprocessor, spec.balance is not None, self.stats,
            policy.stage("header-only forecast", "bad_text"),
        )  # fmt: skip
        rng = (
            np.random.default_rng([config.shuffle_seed, self.epoch, self.generation, stream])
            if spec.shuffle_buffer
            else None
        )
        self.bins = BinMaker(StreamPacker(**spec.packer), rng, spec.shuffle_buffer, self.forecast.padded, self.stats)
        self.load = BinLoader(
            spec.preprocessor, spec.make_collator(), self.stats, policy.stage("processing packed samples", "decode_error")
        )

    def _report(self, failure: Failure) -> None:
        """Warn about and count a skipped sample (or shard) under its reason, with its shard and key."""
        bad = BadSample(failure.where, failure.key, failure.reason, failure.detail)
        warnings.warn(f"vlm-pack: skipping {bad}", BadSampleWarning, stacklevel=4)
        self.stats.count_bad(bad, self.work.max_examples)

    # -- emit: metadata and resume state
    def _meta(self, picked: list[SampleJob], lengths: list[int], done: bool) -> dict[str, Any]:
        """The metadata of the next yielded item (a batch of ``picked``, or a :class:`StreamEnd`)."""
        started = time.thread_time()
        self.seq += 1
        meta = {
            "epoch": self.epoch,
            "generation": self.generation,
            "layout": list(self.layout or ()),
            "samples": [[job.where, job.key] for job in picked],
            "lengths": lengths,
            "forecast": [job.length for job in picked],
        }
        meta["snapshot"] = self._snapshot(done)
        self.stats.time["state"] += time.thread_time() - started  # counted in the next snapshot
        return meta

    def _snapshot(self, done: bool) -> StreamSnapshot:
        stats = PipelineStats.from_dict(self.stats.to_dict())  # a copy: the stream keeps counting
        bins = self.bins
        return StreamSnapshot(
            stream=self.stream,
            seq=self.seq,
            done=done,
            cursor=Cursor(self.cursor.item, self.cursor.sample),
            shuffle=list(bins.shuffle),
            rng=None if bins.rng is None else bins.rng.bit_generator.state,
            packer=bins.packer.state_dict(),
            ready=[list(keys) for keys in bins.ready],
            stats=stats,
            window=bins.window,
            scheduled=bins.scheduled,
        )

    def _restore(self, snapshot: StreamSnapshot) -> None:
        """The state of ``snapshot`` (its stats were taken at construction); the samples it held read again."""
        self.cursor = Cursor(snapshot.cursor.item, snapshot.cursor.sample)
        self.seq = snapshot.seq
        bins = self.bins
        bins.packer.load_state_dict(snapshot.packer)
        bins.shuffle = list(snapshot.shuffle)
        if bins.rng is not None and snapshot.rng is not None:
            bins.rng.bit_generator.state = snapshot.rng
        bins.ready = deque(list(keys) for keys in snapshot.ready)
        bins.window, bins.scheduled = snapshot.window, min(snapshot.scheduled, len(bins.ready))
        # Re-read the samples the stream held: they were forecast before, so forecasting again is exact.
        item_of_shard = {item.shard: item for item in self.items}
        for shard, indices in sorted(snapshot.held_by_shard().items()):
            for index, raw in self.reader.read_item(item_of_shard[shard], 0, collect=indices):
                held = self.forecast(self.work.urls[shard], raw)
                if held is not None:
                    bins.samples[position(shard, index)] = held
        missing = [pos for pos in snapshot.held_positions() if pos not in bins.samples]
        if missing:
            shard, index = split_position(missing[0])
            raise RuntimeError(
                f"resume: {len(missing)} buffered sample(s) could not be read again (first: shard "
                f"{self.work.urls[shard]}, index {index}); the shards changed since the state was saved."
            )

    # -- read -> forecast -> pack
    def _drain(self, final: bool = False) -> Iterator[list[int]]:
        """The bins that may leave now (``BinMaker.drain`` with this stream's schedule)."""
        balance = self.work.balance
        key, reserved = (), None
        if balance is not None:
            seed = self.work.config.shuffle_seed
            key = (balance.seed, 0 if seed is None else seed + 1, self.epoch, self.generation)
            world, workers = self.layout or (1, 1)
            reserved = (self.stream // world, workers)
        return self.bins.drain(balance, key, reserved, final)

    def _read_all(self) -> Iterator[list[int]]:
        """Read the stream's plan items from the cursor on, forecasting and packing; yield ready bins."""
        first_item, first_sample = self.cursor.item, self.cursor.sample
        for item_number in range(first_item, len(self.items)):
            item = self.items[item_number]
            url = self.work.urls[item.shard]
            pending = set(item.pending)
            start = first_sample if item_number == first_item else 0
            for index, raw in self.reader.read_item(item, start):
                self.cursor = Cursor(item_number, index + 1)
                if index not in pending:  # re-dealt buffered samples were counted when first read
                    self.stats.samples_read += 1
                held = self.forecast(url, raw)
                if held is None:
                    continue
                self.bins.hold(position(item.shard, index), held)
                yield from self._drain()
            self.cursor = Cursor(item_number + 1, 0)

    def _bins(self) -> Iterator[list[int]]:
        """The positions of every bin the stream emits, in order; ``self.flushed`` once reading is over."""
        if self.snapshot is not None:
            self._restore(self.snapshot)
            yield from self._drain()
        yield from self._read_all()
        self.forecast.forecasting.finish()  # the share of bad samples over the whole stream (vlm_pack.failures)
        self.bins.flush()
        self.flushed = True
        yield from self._drain(final=True)

    # -- load -> emit
    def _make_batch(self, positions: list[int]) -> Any:
        loaded = self.load(self.bins.take(positions))
        if loaded is None:
            return None
        batch, picked, lengths = loaded
        attach_meta(batch, self._meta(picked, lengths, done=False))
        return batch

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
            if held is not None and not (self.flushed and not self.bins.ready):
                yield held
                held = None
            batch = self._make_batch(positions)
            if batch is not None:
                if held is not None:
                    yield held
                held = batch
        self.load.processing.finish()
        if held is None:
            yield StreamEnd(self._meta([], [], done=True))
            return
        stream_info(held)["snapshot"] = self._snapshot(done=True)  # same seq: the state after the end
        yield held


def identity(x: Any) -> Any:
    """The DataLoader's ``collate_fn``: the dataset yields whole batches."""
    return x

