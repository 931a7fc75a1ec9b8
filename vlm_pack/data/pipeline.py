"""Stream WebDataset shards into packed batches: forecast from headers, pack, then decode what was packed.

Every sample is read once per epoch. Its text and image *headers* give its expanded length before any
pixel is decoded; the streaming packer groups samples into bins; only a bin that is emitted is decoded,
preprocessed by the real HF image processor and collated::

    shards ──> tar members ──> sample ─┬─> parse text, image_size() headers ──> forecast length  (no decode)
    {000..099}.tar   (webdataset)      │        bad? warn + count (shard, key, reason), skip
                                       │
                                       └─> shuffle buffer ──> StreamPacker.add(pos, length) ──> bins
                                                                                               │
    PackedBatch <── PackingCollator <── process_sample(images, conversation) <─────────────────┘
      + meta: stream, seq, epoch, (shard, key) of every sample, snapshot of the stream's state

Work split. The shards of an epoch (shuffled by ``shuffle_seed`` and the epoch) are dealt round-robin to
*streams*, one per (rank, DataLoader worker), as ``webdataset.split_by_node`` + ``split_by_worker`` do::

    epoch order   s7 s2 s9 s0 s4 s1 s8 s3 ...      world 2, 2 workers -> 4 streams, g = rank + world * worker
    stream 0      s7          s4          ...      rank 0, worker 0
    stream 1         s2          s1       ...      rank 1, worker 0
    stream 2            s9          s8    ...      rank 0, worker 1
    stream 3               s0          s3 ...      rank 1, worker 1

Resume. The state of a stream lives in its worker, so each batch carries a snapshot of its stream *after*
that batch: the read cursor (item, sample), the positions of the samples it holds (shuffle buffer, the
packer's open bins, bins waiting to be collated), the packer and RNG states and cumulative stats. A
stream holds each batch back until it has another bin to collate, so its last batch carries its final
state (the end of its shards, bad samples after that batch included); only a stream that yields no batch
at all (its shards unreadable, or all bad) sends a ``StreamEnd`` marker instead (or, rarely, one whose
bins after its last yielded batch all fail to decode).
The main process keeps the latest snapshot per stream (:meth:`PackedWebDataset.observe`, done for you by
:class:`PackedDataLoader`); ``state_dict()`` is those snapshots. On ``load_state_dict``:

- same layout (world size, workers): every stream re-reads the samples it held, restores packer and RNG,
  and continues from its cursor; the DataLoader is rotated to start at the stream that was due next. The
  remaining batches are exactly those an uninterrupted run would have produced, in the same order;
- another layout: the snapshots say, for every shard, which samples were consumed; the rest (unread
  samples and the ones that were buffered) is dealt again to the new streams. No sample is repeated or
  lost; the packs differ. With several ranks, pass every rank's state (a list) to ``load_state_dict``.

Usage (with a plain ``DataLoader``, call ``ds.observe(item)`` on every item and skip the None it returns
for a ``StreamEnd``, which only a stream without any batch yields; ``PackedDataLoader`` does both)::

    pre = Preprocessor(processor=AutoProcessor.from_pretrained("Qwen/Qwen2-VL-2B-Instruct"))
    ds = PackedWebDataset("data/shard-{000000..000099}.tar", pre,
                          capacity=8192, shuffle_seed=0)  # or PackingConfig(capacity=8192, ...) third
    loader = PackedDataLoader(ds, num_workers=8)     # a DataLoader(batch_size=None) that observes batches
    for batch in loader:                             # PackedBatch: batch.model_inputs("sdpa") ...
        ...
        checkpoint["data"] = loader.state_dict()     # plain JSON-serialisable data
    ds.load_state_dict(checkpoint["data"])           # later: the next iteration resumes there

Epochs: an iteration that runs to the end completes the epoch and the next iteration starts the next one
(reshuffled); ``set_epoch(e)`` starts epoch ``e`` explicitly. Workers must not be persistent (the state
reaches them when they start). Memory: a stream holds the encoded bytes of the samples in its buffers
(``shuffle_buffer`` samples and up to ``buffer_size`` open bins, plus with ``balance=StreamBalance(...)`` up to
one look-ahead window of packed bins), not decoded images.

Step balance (``balance=StreamBalance(grad_accum, window_steps)``, off by default): each stream emits its packs
window by window in a cost-quantile order every rank shares (:mod:`vlm_pack.packing.window`), so the packs that
meet at a step cost about the same on every rank, without moving data between ranks; a snapshot carries the
window (its bins are in ``ready``, ``scheduled`` of them already in their emission order), so a resume emits the
rest of it as the uninterrupted run would.

Bad data is never silent, and a bug never becomes an empty epoch (the one failure policy of
:mod:`vlm_pack.failures`): each bad sample or shard is skipped with a :class:`BadSampleWarning` naming shard
and key and counted by reason in :attr:`PackedWebDataset.stats` (``on_error="raise"`` raises instead).
Reasons: ``unreadable_shard`` (a cut tar names the sample it cuts), ``empty_shard``, ``missing_text``, ``bad_text``, ``corrupt_image`` (header), ``corrupt_video``
(a video member whose container does not open or read: header only, no frame decoded; ``KEY.mp4``,
``KEY.0.webm`` ... members are a sample's videos, forecast from their headers as images are),
``image_too_large`` (header over ``max_image_pixels``, refused before decoding), ``placeholder_mismatch``,
``image_rejected`` (the processor's size rule), ``too_long``, ``vision_too_large``, ``decode_error``
(pixels, or a processor refusing the sample), ``forecast_mismatch`` (processed to another length than its
forecast: left out, never packed as it was not planned; counted in ``stats.forecast_mismatches`` too). An error of code (a template or
callable raising ``AttributeError`` / ``TypeError`` ..., a bug) raises ``SampleCodeError`` naming the
sample. A systematic failure raises ``FailureBudgetError`` naming the most common reason and a sample of
each: more than ``max_consecutive_failures`` bad samples in a row (per stream and stage), or an epoch in
which no sample was good. An epoch in which no shard could be opened at all (a mistyped path) raises
``ValueError`` naming the shards instead of yielding nothing.

Where things live: this module (the dataset and its loader: which stream a process serves, progress
display), :mod:`~vlm_pack.data.stream` (one stream's work in a worker, from a frozen ``WorkerSpec`` the
dataset builds once), :mod:`~vlm_pack.data.tracker` (``StreamTracker``: the main process's record of what
each stream delivered, ``observe`` / ``state_dict`` / ``load_state_dict``), :mod:`~vlm_pack.data.state`
(the typed, versioned resume state), :mod:`~vlm_pack.data.stats` (counters and bad-sample reasons).
Imports go one way: pipeline -> stream, tracker -> state -> stats (``tests/test_architecture.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..config import PackingConfig, collator_options
from ..packing.online import PACKER_KNOBS
from ..packing.window import StreamBalance
from ..preprocessor import Preprocessor
from .stats import BAD_REASONS, BadSample, BadSampleWarning, PipelineStats
from .stream import StreamRunner, WorkerSpec, identity
from .stream_meta import StreamEnd, stream_info
from .tracker import StreamTracker

__all__ = [
    "BAD_REASONS",
    "BadSample",
    "BadSampleWarning",
    "PackedDataLoader",
    "PackedWebDataset",
    "PipelineStats",
    "StreamEnd",
    "stream_info",
]

logger = logging.getLogger("vlm_pack.data")


def _expand_urls(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    import webdataset as wds

    if isinstance(urls, (str, os.PathLike)):
        out = wds.shardlists.expand_urls(os.fspath(urls))
    else:
        out = [u for url in urls for u in wds.shardlists.expand_urls(os.fspath(url))]
    if not out:
        raise ValueError(f"no shard URLs in {urls!r}")
    return out


def _worker_layout() -> tuple[int, int, int, int]:
    """(rank, world size, worker id, number of workers) from torch.distributed / env and the DataLoader."""
    from webdataset.utils import pytorch_worker_info

    rank, world, _, _ = pytorch_worker_info()
    info = torch.utils.data.get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank, world, worker, num_workers


def _given(collator: Callable[[list[dict[str, Any]]], Any]) -> Callable[[list[dict[str, Any]]], Any]:
    """The collator factory of a collator the user passed (a module function: it pickles to workers)."""
    return collator


def _stream_config(config: PackingConfig | None, knobs: dict[str, Any]) -> PackingConfig:
    """The pipeline's config: ``config`` with ``knobs`` applied over it, or one built from ``knobs`` alone
    (``PackingConfig.resolve``: the same defaults either way); a stream cannot cut a sample: no "truncate"."""
    return PackingConfig.resolve("PackedWebDataset", config, refuse=("truncate",), **knobs)


class PackedWebDataset(torch.utils.data.IterableDataset):
    """An ``IterableDataset`` of packed batches from WebDataset shards (see the module docstring).

    Args:
        urls: shard paths or URLs: a brace pattern ``"data/shard-{000000..000099}.tar"``, several joined
            by ``::``, a ``pathlib.Path``, or a list of any of these. Anything ``webdataset.gopen`` opens
            (``pipe:``, ``http://`` ...).
        preprocessor: the checkpoint's :class:`~vlm_pack.Preprocessor` (tokenizer, processor, family,
            template, layout and spec, held once): what every sample is forecast and processed with.
        config: the packing and streaming knobs (:class:`~vlm_pack.PackingConfig`: ``capacity``,
            ``buffer_size``, ``min_fill_ratio``, ``drop_last``, ``max_samples_per_bin``, ``vision_capacity``,
            ``vision_cost``, ``oversized``, ``pad_to_multiple_of``, ``shuffle_seed``, ``shuffle_buffer``,
            ``on_error``, ``exif_transpose``, ``max_image_pixels``, ``max_consecutive_failures``). Each can
            also be passed as a keyword (``capacity=8192``), alone (a config is built, with the same defaults)
            or over ``config``. ``oversized``: "raise" (default) or "skip" (counted as ``too_long``); a stream
            cannot cut a sample, so "truncate" is refused.
        collator, collator_kwargs: the collator (default ``PackingCollator(capacity, **collator_kwargs)``
            with ``pad_to_multiple_of`` from the config: packing settings are keywords of the dataset, never
            ``collator_kwargs``).
        progress: ``"log"`` (INFO on ``vlm_pack.data`` every ``log_every`` s), ``"tqdm"`` or ``None``.
        max_examples: bad samples kept as examples per stream in ``stats.bad``.
        balance: a :class:`~vlm_pack.packing.window.StreamBalance`: each stream holds a look-ahead window of
            ``window_steps * grad_accum`` packs and emits it in a cost-quantile order shared by every rank, so
            the packs that meet at a step cost about the same on every rank, image packs first at each step's
            first micro-step (``vlm_pack.packing.window``). None (default): packs leave as they are packed.
            Costs a window of packs held per stream (memory, and a first batch that waits for a window).
    """

    def __init__(
        self,
        urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        preprocessor: Preprocessor,
        config: PackingConfig | None = None,
        *,
        collator: Callable[[list[dict[str, torch.Tensor]]], Any] | None = None,
        collator_kwargs: dict[str, Any] | None = None,
        progress: str | None = None,
        log_every: float = 30.0,
        max_examples: int = 100,
        balance: StreamBalance | None = None,
        **knobs: Any,
    ) -> None:
        super().__init__()
        if balance is not None and not isinstance(balance, StreamBalance):
            raise TypeError(
                f"PackedWebDataset: balance must be a vlm_pack.packing.window.StreamBalance or None, got {balance!r} "
                "(StepBalance is for PackedMapDataset's plans)"
            )
        self.balance = balance
        Preprocessor.refuse_parts("PackedWebDataset", knobs)
        self.preprocessor = Preprocessor.check(preprocessor)
        if progress not in (None, "log", "tqdm"):
            raise ValueError(f"progress must be None, 'log' or 'tqdm', got {progress!r}")
        collator_kwargs = collator_options("PackedWebDataset", collator_kwargs)
        self.config = _stream_config(config, knobs)
        self.urls = _expand_urls(urls)
        self.collator = collator
        # max_rows=1: a bin of the packer is one row, or the collator raises naming its samples
        self.collator_kwargs = {
            "pad_to_multiple_of": self.config.pad_to_multiple_of, "max_rows": 1, **collator_kwargs
        }
        self.progress = progress
        self.log_every = float(log_every)
        self.max_examples = int(max_examples)
        # too-long samples are reported by the stream with their shard and key, never by the packer
        packer = {k: getattr(self.config, k) for k in PACKER_KNOBS} | {"oversized": "raise"}
        shuffle_buffer = self.config.shuffle_buffer if self.config.shuffle_seed is not None else 0
        make_collator = (
            functools.partial(_given, collator)
            if collator is not None
            else functools.partial(self.preprocessor.collator, self.capacity, **self.collator_kwargs)
        )
        # what a stream's worker needs (all it sees of this dataset), and the one owner of the progress
        self._work = WorkerSpec(
            urls=tuple(self.urls),
            config=self.config,
            preprocessor=self.preprocessor,
            packer=packer,
            shuffle_buffer=shuffle_buffer,
            make_collator=make_collator,
            max_examples=self.max_examples,
            balance=balance,
        )
        self._tracker = StreamTracker(
            self.urls, self.config.shuffle_seed, shuffle_buffer, packer, capacity=self.capacity
        )
        self._iterated_in_worker = False
        self._bar: Any = None
        self._last_log = (time.monotonic(), 0, 0)

    @property
    def capacity(self) -> int:
        return self.config.capacity

    # -- pickling to workers: drop the main process's progress bar
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_bar"] = None
        return state

    # -- epoch and state (main process): the tracker's -------------------------------------------
    @property
    def epoch(self) -> int:
        return self._tracker.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (shuffles shards with ``(shuffle_seed, epoch)``); keeps progress if it is current.

        Without calls, each completed epoch is followed by the next one.
        """
        self._tracker.set_epoch(epoch)

    @property
    def stats(self) -> PipelineStats:
        """Counters over every batch the main process has observed (all epochs), summed over streams."""
        return self._tracker.stats

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream after the last observed batch: plain JSON data with a ``"version"`` key
        (:class:`~vlm_pack.data.state.PipelineState` typed, :meth:`load_state_dict` reads it back)."""
        return self._tracker.state_dict()

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Resume from :meth:`state_dict` (or a list of every rank's state dicts, merged).

        Reads the current state version and the untyped version 1 of earlier vlm-pack releases; another
        version raises ``ValueError`` naming it. Takes effect for the next iteration: create the
        DataLoader iterator after this call.
        """
        self._tracker.load_state_dict(state)

    def _begin(self, num_workers: int) -> None:
        """Move the main process's progress to the iteration about to start with ``num_workers``, as its
        workers will (so a rank whose streams get no work after a re-deal still records the new layout)."""
        _, world, _, _ = _worker_layout()
        self._tracker.begin((world, max(1, num_workers)))

    def observe(self, item: Any) -> Any:
        """Record that the consumer received ``item`` (its snapshot becomes the state); return the batch,
        or None for a :class:`~vlm_pack.data.stream_meta.StreamEnd` marker (skip it).

        Idempotent. :class:`PackedDataLoader` and single-process iteration call it for you; with a plain
        ``DataLoader``, call it on every item to make ``state_dict`` / ``stats`` follow the stream.

        Raises:
            ValueError: at the end of an epoch in which no shard of this rank could be opened.
        """
        meta = stream_info(item)
        if meta is None:
            raise ValueError("observe(): the batch carries no stream metadata; pass batches of this pipeline.")
        if self._tracker.observe(meta):
            self._report_progress()
        return None if isinstance(item, StreamEnd) else item

    def _mark_complete(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._tracker.mark_complete()

    def _report_progress(self) -> None:
        if self.progress is None:
            return
        stats = self._tracker.epoch_stats()
        if self.progress == "tqdm":
            self._report_tqdm(stats)
            return
        now = time.monotonic()
        last_time, last_samples, last_bins = self._last_log
        if now - last_time >= self.log_every:
            elapsed = now - last_time
            logger.info(
                "epoch %d: %.1f samples/s, %.2f packs/s, fill %.3f; %s",
                self.epoch,
                (stats.samples_packed - last_samples) / elapsed,
                (stats.bins - last_bins) / elapsed,
                stats.fill_ratio,
                stats.summary(),
            )
            self._last_log = (now, stats.samples_packed, stats.bins)

    def _report_tqdm(self, stats: PipelineStats) -> None:
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(unit="pack", desc=f"epoch {self.epoch}", initial=stats.bins)
        self._bar.n = stats.bins
        self._bar.set_postfix(
            samples=stats.samples_packed, fill=f"{stats.fill_ratio:.3f}", bad=stats.samples_bad, refresh=False
        )
        self._bar.refresh()

    # -- iteration (worker side) -------------------------------------------------------------------
    def _runner(self) -> StreamRunner:
        """The runner of the stream this process (DataLoader worker, or the main process) serves."""
        rank, world, worker, num_workers = _worker_layout()
        progress, exact = self._tracker.resolve((world, num_workers))
        # Rotate workers so the DataLoader's round robin starts with the stream that was due next.
        rotation = 0
        last = progress.last_stream.get(rank)
        if exact and last is not None:
            rotation = (last // world + 1) % num_workers
        stream = rank + world * ((worker + rotation) % num_workers)
        n_streams = world * num_workers
        assert progress.plan is not None
        if stream == 0 and len(progress.plan) < n_streams:
            warnings.warn(
                f"{len(progress.plan)} shard(s) for {n_streams} streams (world {world} x {num_workers} "
                "workers): some streams get no data; use more, smaller shards so ranks get equal work.",
                stacklevel=3,
            )
        snapshot = progress.streams.get(stream) if exact else None
        return StreamRunner(self._work, stream, progress.plan[stream::n_streams], progress, snapshot)

    def __iter__(self) -> Iterator[Any]:
        in_worker = torch.utils.data.get_worker_info() is not None
        if in_worker:
            if self._iterated_in_worker:
                raise RuntimeError(
                    "PackedWebDataset was iterated twice in one DataLoader worker: persistent_workers=True is "
                    "not supported, because the stream's state reaches the workers when they start. Use "
                    "PackedDataLoader or a DataLoader with persistent_workers=False."
                )
            self._iterated_in_worker = True
            yield from self._runner().run()
            return
        self._begin(0)
        for item in self._runner().run():
            batch = self.observe(item)
            if batch is not None:
                yield batch
        self._mark_complete()


class PackedDataLoader:
    """A ``DataLoader`` over a :class:`PackedWebDataset` that tracks the stream for checkpoints.

    Each iteration builds a ``torch.utils.data.DataLoader(dataset, batch_size=None, ...)`` (non-persistent
    workers, so every iteration starts from the current state), calls ``dataset.observe`` on every batch
    (consuming the streams' ``StreamEnd`` markers), and marks the epoch complete when the loader is
    exhausted; the next iteration starts the next epoch::

        loader = PackedDataLoader(dataset, num_workers=2)
        for batch in loader:               # epoch 0
            train_step(batch)
            if step % 1000 == 0:
                save(loader.state_dict())  # resume with loader.load_state_dict(saved)
    """

    def __init__(self, dataset: PackedWebDataset, num_workers: int = 0, **loader_kwargs: Any) -> None:
        for bad in ("batch_size", "persistent_workers", "sampler", "batch_sampler", "collate_fn", "shuffle"):
            if loader_kwargs.get(bad) not in (None, False):
                raise ValueError(f"PackedDataLoader: {bad}= is not supported (the dataset yields whole batches).")
            loader_kwargs.pop(bad, None)
        self.dataset = dataset
        self.num_workers = int(num_workers)
        self.loader_kwargs = loader_kwargs

    def __iter__(self) -> Iterator[Any]:
        self.dataset._begin(self.num_workers)
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=identity,
            **self.loader_kwargs,
        )
        for item in loader:
            batch = self.dataset.observe(item)
            if batch is not None:
                yield batch
        self.dataset._mark_complete()

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        self.dataset.load_state_dict(state)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    @property
    def stats(self) -> PipelineStats:
        return self.dataset.stats
