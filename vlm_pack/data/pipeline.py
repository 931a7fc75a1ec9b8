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
packer's open bins, bins waiting to be collated), the packer and RNG states and cumulative stats. The
main process keeps the latest snapshot per stream (:meth:`PackedWebDataset.observe`, done for you by
:class:`PackedDataLoader`); ``state_dict()`` is those snapshots. On ``load_state_dict``:

- same layout (world size, workers): every stream re-reads the samples it held, restores packer and RNG,
  and continues from its cursor; the DataLoader is rotated to start at the stream that was due next. The
  remaining batches are exactly those an uninterrupted run would have produced, in the same order;
- another layout: the snapshots say, for every shard, which samples were consumed; the rest (unread
  samples and the ones that were buffered) is dealt again to the new streams. No sample is repeated or
  lost; the packs differ. With several ranks, pass every rank's state (a list) to ``load_state_dict``.

Usage::

    ds = PackedWebDataset("data/shard-{000000..000099}.tar", tokenizer=tok, image_processor=ip,
                          capacity=8192, shuffle_seed=0)
    loader = PackedDataLoader(ds, num_workers=8)     # a DataLoader(batch_size=None) that observes batches
    for batch in loader:                             # PackedBatch: batch.model_inputs("sdpa") ...
        ...
        checkpoint["data"] = loader.state_dict()     # plain JSON-serialisable data
    ds.load_state_dict(checkpoint["data"])           # later: the next iteration resumes there

Epochs: an iteration that runs to the end completes the epoch and the next iteration starts the next one
(reshuffled); ``set_epoch(e)`` starts epoch ``e`` explicitly. Workers must not be persistent (the state
reaches them when they start). Memory: a stream holds the encoded bytes of the samples in its buffers
(``shuffle_buffer`` samples and up to ``buffer_size`` open bins), not decoded images.

Bad data never stops training and is never silent: each bad sample or shard is skipped with a
:class:`BadSampleWarning` naming shard and key and counted by reason in :attr:`PackedWebDataset.stats`
(``on_error="raise"`` raises instead). Reasons: ``unreadable_shard``, ``missing_text``, ``bad_text``,
``corrupt_image`` (header), ``placeholder_mismatch``, ``image_rejected`` (the processor's size rule),
``too_long``, ``vision_too_large``, ``decode_error`` (pixels), ``forecast_mismatch``.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..packing import StreamPacker
from ..processing import IMAGE_MARKER, forecast_length, process_sample
from ..vision import vision_spec_from_processor
from .reader import read_header, stream_tar_samples
from .shards import SampleError

__all__ = [
    "BAD_REASONS",
    "BadSample",
    "BadSampleWarning",
    "PackedDataLoader",
    "PackedWebDataset",
    "PipelineStats",
    "build_packed_pipeline",
    "stream_info",
]

logger = logging.getLogger("vlm_pack.data")

#: Why a sample (or shard) was skipped.
BAD_REASONS = (
    "unreadable_shard",
    "missing_text",
    "bad_text",
    "corrupt_image",
    "placeholder_mismatch",
    "image_rejected",
    "too_long",
    "vision_too_large",
    "decode_error",
    "forecast_mismatch",
)

#: Phases timed in :attr:`PipelineStats.time`: CPU seconds of the stream's thread (``time.thread_time``, so
#: other processes on the machine do not inflate them), summed over streams. ``OWN_PHASES`` are vlm-pack's;
#: ``read`` is tar reading (I/O waits excluded), ``preprocess`` image decode + HF image processor + tokenizer.
PHASES = ("read", "forecast", "pack", "preprocess", "collate", "state")
OWN_PHASES = ("forecast", "pack", "collate", "state")

_SHIFT = 32  # a sample's position key: shard index << 32 | index of the sample in its shard
_META = "__stream__"  # where a yielded batch carries its stream metadata (see stream_info)


class BadSampleWarning(UserWarning):
    """A sample or shard was skipped; the message names the shard, the key and the reason."""


@dataclass(frozen=True)
class BadSample:
    """One skipped sample: ``shard`` (URL), ``key`` (WebDataset key; the last good key for a shard error)."""

    shard: str
    key: str | None
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.reason}: shard {self.shard}, key {self.key!r}: {self.detail}"


@dataclass
class PipelineStats:
    """Counters of the pipeline (per stream in workers, summed in the main process).

    ``samples_read == samples_packed + samples_bad + samples_dropped + samples held in buffers``; at the
    end of an epoch no sample is held. ``bad`` keeps the most recent ``max_examples`` bad samples per
    stream (1000 in a sum); ``reasons`` counts all of them. ``time`` holds CPU seconds per phase (``PHASES``).
    """

    capacity: int = 0
    samples_read: int = 0
    samples_packed: int = 0
    samples_bad: int = 0
    samples_dropped: int = 0
    bins: int = 0
    tokens: int = 0
    forecast_mismatches: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    bad: list[BadSample] = field(default_factory=list)
    time: dict[str, float] = field(default_factory=dict)

    @property
    def fill_ratio(self) -> float:
        """Real tokens / (bins * capacity) over the yielded batches."""
        return self.tokens / (self.bins * self.capacity) if self.bins and self.capacity else 0.0

    @property
    def own_time_share(self) -> float:
        """Share of the timed work spent in vlm-pack's own phases (forecast, pack, collate, state)."""
        total = sum(self.time.values())
        return sum(self.time.get(p, 0.0) for p in OWN_PHASES) / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "samples_read": self.samples_read,
            "samples_packed": self.samples_packed,
            "samples_bad": self.samples_bad,
            "samples_dropped": self.samples_dropped,
            "bins": self.bins,
            "tokens": self.tokens,
            "forecast_mismatches": self.forecast_mismatches,
            "reasons": dict(self.reasons),
            "bad": [[b.shard, b.key, b.reason, b.detail] for b in self.bad],
            "time": dict(self.time),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PipelineStats:
        return cls(
            capacity=int(d["capacity"]),
            samples_read=int(d["samples_read"]),
            samples_packed=int(d["samples_packed"]),
            samples_bad=int(d["samples_bad"]),
            samples_dropped=int(d["samples_dropped"]),
            bins=int(d["bins"]),
            tokens=int(d["tokens"]),
            forecast_mismatches=int(d["forecast_mismatches"]),
            reasons={k: int(v) for k, v in d["reasons"].items()},
            bad=[BadSample(*b) for b in d["bad"]],
            time={k: float(v) for k, v in d["time"].items()},
        )

    def merge(self, other: PipelineStats) -> PipelineStats:
        """A new stats object with both counts added."""
        reasons = dict(self.reasons)
        for k, v in other.reasons.items():
            reasons[k] = reasons.get(k, 0) + v
        times = dict(self.time)
        for k, v in other.time.items():
            times[k] = times.get(k, 0.0) + v
        return PipelineStats(
            capacity=self.capacity or other.capacity,
            samples_read=self.samples_read + other.samples_read,
            samples_packed=self.samples_packed + other.samples_packed,
            samples_bad=self.samples_bad + other.samples_bad,
            samples_dropped=self.samples_dropped + other.samples_dropped,
            bins=self.bins + other.bins,
            tokens=self.tokens + other.tokens,
            forecast_mismatches=self.forecast_mismatches + other.forecast_mismatches,
            reasons=reasons,
            bad=(self.bad + other.bad)[-1000:],
            time=times,
        )

    def summary(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items())) or "none"
        return (
            f"{self.samples_read} samples read, {self.samples_packed} packed into {self.bins} bins "
            f"(fill {self.fill_ratio:.3f}), {self.samples_bad} bad ({reasons}), "
            f"{self.samples_dropped} dropped (drop_last), {self.forecast_mismatches} forecast mismatches"
        )


class _Sample:
    """A forecast sample waiting in a buffer: raw image bytes, its text, its forecast."""

    __slots__ = ("conversation", "images", "key", "length", "url", "vision")

    def __init__(self, url: str, key: str, images: list[bytes], conversation: Any, length: int, vision: int):
        self.url = url
        self.key = key
        self.images = images
        self.conversation = conversation
        self.length = length
        self.vision = vision


def _attach(batch: Any, meta: dict[str, Any]) -> None:
    # In PackedBatch.metadata: a dataclass field, so it survives .to(device) and pin_memory().
    metadata = getattr(batch, "metadata", None)
    if isinstance(metadata, dict):
        metadata[_META] = meta
    elif isinstance(batch, dict):
        batch[_META] = meta
    else:
        try:
            setattr(batch, _META, meta)
        except AttributeError:
            raise TypeError(
                f"the collator returned a {type(batch).__name__}, which cannot carry the stream metadata: "
                "return a PackedBatch, a dict, or an object with a 'metadata' dict."
            ) from None


def stream_info(batch: Any) -> dict[str, Any] | None:
    """The stream metadata a batch of :class:`PackedWebDataset` carries (None for other batches).

    Keys: ``epoch``, ``generation`` (re-deals after a layout change), ``layout`` ([world, workers]),
    ``samples`` ([shard URL, key] per sample, in the order given to the collator), ``lengths`` (processed
    lengths), ``forecast`` (forecast lengths, equal unless reported), ``snapshot`` (the stream's state after
    this batch: ``stream``, ``seq``, ``done``, cursor, buffers, packer and RNG states, ``stats``). The
    per-sample keys in packed order are ``batch.metadata["__key__"]`` / ``["__url__"]``.
    """
    metadata = getattr(batch, "metadata", None)
    if isinstance(metadata, dict) and _META in metadata:
        return metadata[_META]
    if isinstance(batch, dict):
        return batch.get(_META)
    return getattr(batch, _META, None)


def _expand_urls(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    import webdataset as wds

    if isinstance(urls, (str, os.PathLike)):
        out = wds.shardlists.expand_urls(os.fspath(urls))
    else:
        out = [u for url in urls for u in wds.shardlists.expand_urls(os.fspath(url))]
    if not out:
        raise ValueError(f"no shard URLs in {urls!r}")
    return out


def _read_shard(url: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index in shard, raw sample dict) for each sample of one tar shard."""
    samples = stream_tar_samples(url)
    try:
        yield from enumerate(samples)
    finally:
        samples.close()  # closes the shard's stream now, also when the reader stops early


def _count_markers(conversation: Any) -> int:
    if isinstance(conversation, str):
        return conversation.count(IMAGE_MARKER)
    n = 0
    for turn in conversation:
        content = turn.get("content") if isinstance(turn, dict) else None
        if isinstance(content, str):
            n += content.count(IMAGE_MARKER)
        elif isinstance(content, list):
            n += sum(1 for part in content if isinstance(part, dict) and part.get("type") == "image")
    return n


def _worker_layout() -> tuple[int, int, int, int]:
    """(rank, world size, worker id, number of workers) from torch.distributed / env and the DataLoader."""
    from webdataset.utils import pytorch_worker_info

    rank, world, _, _ = pytorch_worker_info()
    info = torch.utils.data.get_worker_info()
    worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank, world, worker, num_workers


# -- epoch plans ------------------------------------------------------------------------------------
# A plan is the work of an epoch: a list of items [shard, start, pending]: read the samples of shard
# `shard` whose index is in `pending` or >= `start` (start None: only `pending`). A fresh epoch's plan is
# every shard from 0 in the epoch's order; a plan re-dealt after a layout change holds what is left.


def _fresh_plan(n_shards: int, seed: int | None, epoch: int) -> list[list[Any]]:
    order = range(n_shards) if seed is None else np.random.default_rng([seed, epoch]).permutation(n_shards)
    return [[int(s), 0, []] for s in order]


def _remaining_plan(
    plan: list[list[Any]], layout: list[int], streams: dict[int, dict[str, Any]]
) -> list[list[Any]]:
    """What is left of ``plan`` given each stream's latest snapshot (streams without one: untouched)."""
    n_streams = layout[0] * layout[1]
    remaining: list[tuple[int, list[Any]]] = []  # (index in the old plan, item)
    for g in range(n_streams):
        items = plan[g::n_streams]
        snap = streams.get(g)
        if snap is None:
            remaining.extend((i * n_streams + g, item) for i, item in enumerate(items))
            continue
        held: dict[int, set[int]] = {}
        for pos in _held_positions(snap):
            held.setdefault(pos >> _SHIFT, set()).add(pos & ((1 << _SHIFT) - 1))
        ci, ck = snap["cursor"]
        for i, (shard, start, pending) in enumerate(items):
            extra = held.get(shard, set())
            if i < ci:
                new = [None, sorted(extra)]
            elif i == ci:
                new = [
                    None if start is None else max(start, ck),
                    sorted({p for p in pending if p >= ck} | extra),
                ]
            else:
                new = [start, sorted(set(pending) | extra)]
            if new[0] is not None or new[1]:
                remaining.append((i * n_streams + g, [shard, *new]))
    remaining.sort(key=lambda t: t[0])  # back to the plan's order
    return [item for _, item in remaining]


def _held_positions(snap: dict[str, Any]) -> list[int]:
    """Positions a stream had read but not yet delivered: shuffle buffer, open bins, bins not collated."""
    out = list(snap["shuffle"])
    for b in snap["packer"]["open"]:
        out.extend(b["keys"])
    for keys in snap["ready"]:
        out.extend(keys)
    return out


def _fresh_progress(epoch: int) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "generation": 0,  # how many times the plan was re-dealt (layout changes) within this epoch
        "plan": None,  # None: the fresh plan of the epoch
        "layout": None,  # [world, num_workers] of the streams below
        "streams": {},  # stream id -> latest snapshot
        "last_stream": {},  # rank -> stream of its latest batch (to rotate the DataLoader on resume)
        "complete": False,
        "base": None,  # stats of the samples consumed before the latest re-deal
    }


class PackedWebDataset(torch.utils.data.IterableDataset):
    """An ``IterableDataset`` of packed batches from WebDataset shards (see the module docstring).

    Args:
        urls: shard paths or URLs: a brace pattern ``"data/shard-{000000..000099}.tar"``, several joined
            by ``::``, a ``pathlib.Path``, or a list of any of these. Anything ``webdataset.gopen`` opens
            (``pipe:``, ``http://`` ...).
        tokenizer, image_processor: the model's HF tokenizer and image processor; or ``processor``.
        capacity: tokens per packed row.
        family: chat format of ``vlm_pack.processing`` (``qwen2_vl`` ... ``llava_next``); default: from the
            tokenizer (``vlm_pack.offline``) or the image processor.
        template: ``callable(conversation, num_images) -> [(text, trained), ...]`` replacing the family's
            chat format (see ``vlm_pack.processing.ChatFormat.render``).
        buffer_size, min_fill_ratio, drop_last, max_samples_per_bin: the ``StreamPacker``'s.
        vision_capacity, vision_cost: a second per-bin budget: ViT ``"patches"`` (pixel_values rows) or
            ``"images"`` per bin.
        shuffle_seed: shuffle the shard order per epoch and samples through a ``shuffle_buffer``-sample
            buffer; ``None`` keeps the data order.
        oversized: a sample longer than ``capacity``: ``"skip"`` (counted as ``too_long``) or ``"raise"``.
        on_error: ``"warn"`` (skip, warn, count) or ``"raise"`` (``ValueError`` naming shard and key).
        pad_to_multiple_of, collator_kwargs: passed to ``PackingCollator``; or give ``collator``.
        exif_transpose: forecast from EXIF-rotated sizes, as ``load_image`` decodes them.
        progress: ``"log"`` (INFO on ``vlm_pack.data`` every ``log_every`` s), ``"tqdm"`` or ``None``.
    """

    def __init__(
        self,
        urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        capacity: int,
        tokenizer: Any = None,
        image_processor: Any = None,
        processor: Any = None,
        family: str | None = None,
        template: Callable[[Any, int], list[tuple[str, bool]]] | None = None,
        buffer_size: int = 256,
        min_fill_ratio: float = 0.95,
        drop_last: bool = False,
        max_samples_per_bin: int | None = None,
        vision_capacity: int | None = None,
        vision_cost: str = "patches",
        shuffle_seed: int | None = None,
        shuffle_buffer: int = 256,
        oversized: str = "skip",
        on_error: str = "warn",
        pad_to_multiple_of: int = 1,
        collator: Callable[[list[dict[str, torch.Tensor]]], Any] | None = None,
        collator_kwargs: dict[str, Any] | None = None,
        exif_transpose: bool = True,
        progress: str | None = None,
        log_every: float = 30.0,
        max_examples: int = 100,
    ) -> None:
        super().__init__()
        if processor is not None:
            tokenizer = tokenizer if tokenizer is not None else processor.tokenizer
            image_processor = image_processor if image_processor is not None else processor.image_processor
        if tokenizer is None or image_processor is None:
            raise ValueError("PackedWebDataset needs tokenizer= and image_processor= (or processor=).")
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', got {on_error!r}")
        if oversized not in ("skip", "raise"):
            raise ValueError(f"oversized must be 'skip' or 'raise', got {oversized!r}")
        if vision_cost not in ("patches", "images"):
            raise ValueError(f"vision_cost must be 'patches' or 'images', got {vision_cost!r}")
        if progress not in (None, "log", "tqdm"):
            raise ValueError(f"progress must be None, 'log' or 'tqdm', got {progress!r}")
        self.urls = _expand_urls(urls)
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.processor = processor
        self.spec = vision_spec_from_processor(processor if processor is not None else image_processor)
        self.family = family or getattr(tokenizer, "vlm_pack_family", None) or self.spec.family
        self.template = template
        self.capacity = int(capacity)
        self.packer_config = dict(
            capacity=self.capacity,
            buffer_size=buffer_size,
            min_fill_ratio=min_fill_ratio,
            drop_last=drop_last,
            vision_capacity=vision_capacity,
            max_samples_per_bin=max_samples_per_bin,
            oversized="raise",  # too-long samples are reported here with their shard and key
        )
        StreamPacker(**self.packer_config)  # validate now, not in a worker
        self.vision_capacity = vision_capacity
        self.vision_cost = vision_cost
        self.shuffle_seed = shuffle_seed
        self.shuffle_buffer = int(shuffle_buffer) if shuffle_seed is not None else 0
        self.oversized = oversized
        self.on_error = on_error
        self.exif_transpose = exif_transpose
        self.collator = collator
        self.collator_kwargs = {"pad_to_multiple_of": pad_to_multiple_of, **(collator_kwargs or {})}
        # Samples are packed on their padded span, as the collator lays them out.
        self.pad_to_multiple_of = int(self.collator_kwargs["pad_to_multiple_of"])
        if self.capacity % self.pad_to_multiple_of:
            raise ValueError(
                f"capacity {self.capacity} is not a multiple of pad_to_multiple_of {self.pad_to_multiple_of}"
            )
        self.progress = progress
        self.log_every = float(log_every)
        self.max_examples = int(max_examples)
        self._urls_digest = hashlib.sha1("\n".join(self.urls).encode()).hexdigest()
        self._progress = _fresh_progress(0)
        self._totals = PipelineStats(capacity=self.capacity)  # earlier epochs
        self._iterated_in_worker = False
        self._bar: Any = None
        self._last_log = (time.monotonic(), 0, 0)

    # -- pickling to workers: drop the main process's progress bar
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_bar"] = None
        return state

    # -- epoch and state (main process) ------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return int(self._progress["epoch"])

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` (shuffles shards with ``(shuffle_seed, epoch)``); keeps progress if it is current.

        Without calls, each completed epoch is followed by the next one.
        """
        if int(epoch) != self._progress["epoch"]:
            self._fold()
            self._progress = _fresh_progress(int(epoch))

    def _fold(self) -> None:
        self._totals = self._totals.merge(self._epoch_stats(self._progress))

    def _epoch_stats(self, progress: dict[str, Any]) -> PipelineStats:
        stats = PipelineStats(capacity=self.capacity)
        if progress["base"] is not None:
            stats = stats.merge(PipelineStats.from_dict(progress["base"]))
        for g in sorted(progress["streams"]):
            stats = stats.merge(PipelineStats.from_dict(progress["streams"][g]["stats"]))
        return stats

    @property
    def stats(self) -> PipelineStats:
        """Counters over every batch the main process has observed (all epochs), summed over streams."""
        return self._totals.merge(self._epoch_stats(self._progress))

    def state_dict(self) -> dict[str, Any]:
        """Position of the stream after the last observed batch (plain, JSON-serialisable data)."""
        p = copy.deepcopy(self._progress)
        p["streams"] = [p["streams"][g] for g in sorted(p["streams"])]
        return {
            "version": 1,
            "urls_digest": self._urls_digest,
            "num_urls": len(self.urls),
            "shuffle_seed": self.shuffle_seed,
            "shuffle_buffer": self.shuffle_buffer,
            "packer": dict(self.packer_config),
            "progress": p,
            "totals": self._totals.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any] | Sequence[dict[str, Any]]) -> None:
        """Resume from :meth:`state_dict` (or a list of every rank's state dicts, merged).

        Takes effect for the next iteration: create the DataLoader iterator after this call.
        """
        states = [state] if isinstance(state, dict) else list(state)
        if not states:
            raise ValueError("load_state_dict: empty list of states")
        for s in states:
            if s.get("version") != 1:
                raise ValueError(f"unsupported PackedWebDataset state version {s.get('version')!r}")
            if s["urls_digest"] != self._urls_digest:
                raise ValueError(
                    f"the state was saved for another shard list ({s['num_urls']} URLs, digest "
                    f"{s['urls_digest'][:12]}); build the pipeline with the same URLs, in the same order."
                )
            mine = {
                "shuffle_seed": self.shuffle_seed,
                "shuffle_buffer": self.shuffle_buffer,
                "packer": self.packer_config,
            }
            diff = {k: (s[k], v) for k, v in mine.items() if s[k] != v}
            if diff:
                raise ValueError(f"the state was saved with another configuration (saved, current): {diff}")
        first = states[0]["progress"]
        for s in states[1:]:
            p = s["progress"]
            if (p["epoch"], p["generation"], p["layout"]) != (
                first["epoch"],
                first["generation"],
                first["layout"],
            ):
                raise ValueError("load_state_dict: the states are from different epochs or layouts")
        progress = copy.deepcopy(first)
        progress["streams"] = {}
        for s in states:
            for snap in s["progress"]["streams"]:
                progress["streams"][int(snap["stream"])] = copy.deepcopy(snap)
            progress["last_stream"].update(s["progress"]["last_stream"])

        def merged(values: list[Any]) -> PipelineStats | None:
            # Ranks that resumed from one merged state carry the same counts: count them once.
            values = [v for v in values if v is not None]
            if not values:
                return None
            if all(v == values[0] for v in values):
                return PipelineStats.from_dict(values[0])
            out = PipelineStats(capacity=self.capacity)
            for v in values:
                out = out.merge(PipelineStats.from_dict(v))
            return out

        base = merged([s["progress"]["base"] for s in states])
        totals = merged([s["totals"] for s in states])
        progress["base"] = None if base is None else base.to_dict()
        progress["complete"] = all(s["progress"]["complete"] for s in states)
        self._progress = progress
        self._totals = totals if totals is not None else PipelineStats(capacity=self.capacity)

    def _resolve(self, progress: dict[str, Any], layout: list[int]) -> tuple[dict[str, Any], bool]:
        """The progress an iteration with ``layout`` starts from, and whether it resumes streams exactly.

        A pure function of the saved progress, so workers and the main process agree.
        """
        p = copy.deepcopy(progress)
        if p["complete"]:
            p = _fresh_progress(p["epoch"] + 1)
        if p["plan"] is None:
            p["plan"] = _fresh_plan(len(self.urls), self.shuffle_seed, p["epoch"])
        if p["layout"] is not None and p["layout"] != layout:
            base = self._epoch_stats(p)
            p["plan"] = _remaining_plan(p["plan"], p["layout"], p["streams"])
            p.update(generation=p["generation"] + 1, streams={}, last_stream={}, base=base.to_dict())
        p["layout"] = layout
        return p, bool(p["streams"])

    def observe(self, batch: Any) -> Any:
        """Record that the consumer received ``batch`` (its snapshot becomes the state); returns it.

        Idempotent. :class:`PackedDataLoader` and single-process iteration call it for you; with a plain
        ``DataLoader``, call it on every batch to make ``state_dict`` / ``stats`` follow the stream.
        """
        meta = stream_info(batch)
        if meta is None:
            raise ValueError(
                "observe(): the batch carries no stream metadata; pass batches of this pipeline."
            )
        p = self._progress
        if (meta["epoch"], meta["generation"], meta["layout"]) != (p["epoch"], p["generation"], p["layout"]):
            if p["complete"] and meta["epoch"] == p["epoch"]:
                return batch  # a stale batch of a finished epoch
            complete = p["complete"]
            resolved, _ = self._resolve(p, meta["layout"])
            if (meta["epoch"], meta["generation"]) != (resolved["epoch"], resolved["generation"]):
                raise ValueError(
                    f"observe(): batch of epoch {meta['epoch']} (generation {meta['generation']}) does not follow "
                    f"the state (epoch {p['epoch']}); call set_epoch() / load_state_dict() before iterating."
                )
            if complete:
                self._fold()
            self._progress = p = resolved
        snap = meta["snapshot"]
        g = int(snap["stream"])
        old = p["streams"].get(g)
        if old is None or old["seq"] < snap["seq"]:
            world = p["layout"][0]
            p["streams"][g] = snap
            p["last_stream"][str(g % world)] = g
            n_streams = world * p["layout"][1]
            # this rank's streams (another rank's tracker follows those)
            with_work = {h for h in range(g % world, n_streams, world) if p["plan"][h::n_streams]}
            p["complete"] = all(h in p["streams"] and p["streams"][h]["done"] for h in with_work)
            self._report_progress()
        return batch

    def _mark_complete(self) -> None:
        self._progress["complete"] = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _report_progress(self) -> None:
        if self.progress is None:
            return
        stats = self._epoch_stats(self._progress)
        if self.progress == "tqdm":
            if self._bar is None:
                from tqdm.auto import tqdm

                self._bar = tqdm(unit="pack", desc=f"epoch {self.epoch}", initial=stats.bins)
            self._bar.n = stats.bins
            self._bar.set_postfix(
                samples=stats.samples_packed,
                fill=f"{stats.fill_ratio:.3f}",
                bad=stats.samples_bad,
                refresh=False,
            )
            self._bar.refresh()
            return
        now = time.monotonic()
        t0, s0, b0 = self._last_log
        if now - t0 >= self.log_every:
            dt = now - t0
            logger.info(
                "epoch %d: %.1f samples/s, %.2f packs/s, fill %.3f; %s",
                self.epoch,
                (stats.samples_packed - s0) / dt,
                (stats.bins - b0) / dt,
                stats.fill_ratio,
                stats.summary(),
            )
            self._last_log = (now, stats.samples_packed, stats.bins)

    # -- iteration (worker side) -------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        rank, world, worker, num_workers = _worker_layout()
        in_worker = torch.utils.data.get_worker_info() is not None
        if in_worker:
            if self._iterated_in_worker:
                raise RuntimeError(
                    "PackedWebDataset was iterated twice in one DataLoader worker: persistent_workers=True is "
                    "not supported, because the stream's state reaches the workers when they start. Use "
                    "PackedDataLoader or a DataLoader with persistent_workers=False."
                )
            self._iterated_in_worker = True
        layout = [world, num_workers]
        progress, exact = self._resolve(self._progress, layout)
        # Rotate workers so the DataLoader's round robin starts with the stream that was due next.
        rotation = 0
        last = progress["last_stream"].get(str(rank))
        if exact and last is not None:
            rotation = (last // world + 1) % num_workers
        logical = (worker + rotation) % num_workers
        g = rank + world * logical
        n_streams = world * num_workers
        items = progress["plan"][g::n_streams]
        if g == 0 and len(progress["plan"]) < n_streams:
            warnings.warn(
                f"{len(progress['plan'])} shard(s) for {n_streams} streams (world {world} x {num_workers} "
                "workers): some streams get no data; use more, smaller shards so ranks get equal work.",
                stacklevel=2,
            )
        runner = _StreamRunner(self, g, items, progress, progress["streams"].get(g) if exact else None)
        for batch in runner.run():
            if not in_worker:
                self.observe(batch)
            yield batch
        if not in_worker:
            self._mark_complete()

    def _collate(self) -> Callable[[list[dict[str, Any]]], Any]:
        if self.collator is not None:
            return self.collator
        from ..collate import PackingCollator

        kwargs = dict(self.collator_kwargs)
        kwargs.setdefault("tokenizer", self.tokenizer)
        kwargs.setdefault("family", self.family)
        merge = getattr(self.image_processor, "merge_size", None)
        if merge is not None:
            kwargs.setdefault("spatial_merge_size", int(merge))
        return PackingCollator(self.capacity, **kwargs)


class _StreamRunner:
    """One stream's reading, forecasting, packing and collation (runs in a DataLoader worker)."""

    def __init__(
        self,
        ds: PackedWebDataset,
        g: int,
        items: list[list[Any]],
        progress: dict[str, Any],
        snap: dict[str, Any] | None,
    ) -> None:
        self.ds = ds
        self.g = g
        self.items = items
        self.epoch = progress["epoch"]
        self.generation = progress["generation"]
        self.layout = progress["layout"]
        self.packer = StreamPacker(**ds.packer_config)
        self.rng = (
            np.random.default_rng([ds.shuffle_seed, self.epoch, self.generation, g])
            if ds.shuffle_buffer
            else None
        )
        self.shuffle: list[int] = []
        self.samples: dict[int, _Sample] = {}
        self.ready: deque[list[int]] = deque()
        self.cursor = [0, 0]
        self.seq = 0
        self.stats = PipelineStats(capacity=ds.capacity, time={p: 0.0 for p in PHASES})
        self.collate = ds._collate()
        self.snap = snap

    # -- bad data
    def _bad(self, url: str, key: str | None, reason: str, detail: str) -> None:
        ds = self.ds
        bad = BadSample(url, key, reason, detail)
        if ds.on_error == "raise":
            raise ValueError(f"bad sample: {bad} (on_error='warn' skips such samples and counts them)")
        warnings.warn(f"vlm-pack: skipping {bad}", BadSampleWarning, stacklevel=3)
        st = self.stats
        if reason != "unreadable_shard":
            st.samples_bad += 1
        st.reasons[reason] = st.reasons.get(reason, 0) + 1
        st.bad.append(bad)
        del st.bad[: -ds.max_examples]

    # -- per sample: header-only forecast
    def _forecast(self, url: str, raw: dict[str, Any]) -> _Sample | None:
        ds = self.ds
        key = raw.get("__key__")
        try:
            conversation, names, sizes = read_header(raw, exif_transpose=ds.exif_transpose)
        except SampleError as exc:
            self._bad(url, key, exc.reason, str(exc))
            return None
        images = [raw[n] for n in names]
        n_markers = _count_markers(conversation) if ds.template is None else None
        if n_markers and n_markers != len(images):
            self._bad(
                url,
                key,
                "placeholder_mismatch",
                f"the text has {n_markers} image placeholder(s) but the sample has {len(images)} image(s) "
                f"({', '.join(names) or 'none'})",
            )
            return None
        spec = ds.spec
        for (w, h), name in zip(sizes, names):
            try:
                spec.num_tokens(w, h)
            except ValueError as exc:
                self._bad(url, key, "image_rejected", f"{name} {w}x{h}: {exc}")
                return None
        try:
            length, _ = forecast_length(
                conversation,
                sizes,
                tokenizer=ds.tokenizer,
                spec=spec,
                family=ds.family,
                template=ds.template,
                key=key,
            )
        except (ValueError, TypeError, AttributeError) as exc:
            reason = "placeholder_mismatch" if "placeholder" in str(exc) else "bad_text"
            self._bad(url, key, reason, str(exc))
            return None
        m = ds.pad_to_multiple_of
        span = -(-length // m) * m
        if span > ds.capacity:
            what = f"{length} tokens" + (f" (padded to {span})" if span != length else "")
            if ds.oversized == "raise":
                raise ValueError(
                    f"sample {key!r} in {url}: {what} > capacity {ds.capacity}; raise capacity, cap the "
                    "image processor's max_pixels, or pass oversized='skip'."
                )
            self._bad(url, key, "too_long", f"{what} > capacity {ds.capacity}")
            return None
        vision = 0
        if ds.vision_capacity is not None:
            vision = (
                len(sizes) if ds.vision_cost == "images" else sum(spec.num_patches(w, h) for w, h in sizes)
            )
            if vision > ds.vision_capacity:
                self._bad(
                    url,
                    key,
                    "vision_too_large",
                    f"vision cost {vision} > vision_capacity {ds.vision_capacity}",
                )
                return None
        return _Sample(url, key, images, conversation, length, vision)

    # -- packing
    def _push(self, pos: int) -> None:
        if self.rng is None:
            self._pack(pos)
            return
        buf = self.shuffle
        buf.append(pos)
        if len(buf) > self.ds.shuffle_buffer:
            self._pack(self._draw())

    def _draw(self) -> int:
        buf = self.shuffle
        j = int(self.rng.integers(len(buf)))  # type: ignore[union-attr]
        buf[j], buf[-1] = buf[-1], buf[j]
        return buf.pop()

    def _pack(self, pos: int) -> None:
        s = self.samples[pos]
        m = self.ds.pad_to_multiple_of
        for b in self.packer.add(pos, -(-s.length // m) * m, s.vision):
            self.ready.append(list(b.keys))

    # -- collation
    def _make_batch(self, keys: list[int], done: bool) -> Any:
        ds = self.ds
        t = self.stats.time
        processed, picked, lengths, mismatched = [], [], [], []
        for pos in keys:
            s = self.samples.pop(pos)
            t0 = time.thread_time()
            try:
                out = process_sample(
                    s.images,
                    s.conversation,
                    tokenizer=ds.tokenizer,
                    image_processor=ds.image_processor,
                    processor=ds.processor,
                    family=ds.family,
                    template=ds.template,
                    key=s.key,
                )
            except Exception as exc:
                t["preprocess"] += time.thread_time() - t0
                self._bad(s.url, s.key, "decode_error", f"{type(exc).__name__}: {exc}")
                continue
            t["preprocess"] += time.thread_time() - t0
            n = int(out["input_ids"].shape[0])
            if n != s.length:
                self.stats.forecast_mismatches += 1
                mismatched.append(len(processed))
                warnings.warn(
                    f"vlm-pack: FORECAST MISMATCH for key {s.key!r} in {s.url}: forecast {s.length} tokens, "
                    f"processed {n}. The vision spec does not match the image processor; please report it.",
                    BadSampleWarning,
                    stacklevel=2,
                )
                if ds.on_error == "raise":
                    raise ValueError(
                        f"forecast {s.length} != processed length {n} for key {s.key!r} in {s.url}"
                    )
            out["__key__"] = s.key
            out["__url__"] = s.url
            processed.append(out)
            picked.append(s)
            lengths.append(n)
        # A longer-than-forecast sample may overflow the bin: drop mismatched samples until it fits.
        m = ds.pad_to_multiple_of
        while sum(-(-n // m) * m for n in lengths) > ds.capacity and mismatched:
            j = mismatched.pop()
            s = picked[j]
            self._bad(s.url, s.key, "forecast_mismatch", f"processed {lengths[j]} tokens overflow the bin")
            del processed[j], picked[j], lengths[j]
        if not processed:
            return None
        t0 = time.thread_time()
        batch = self.collate(processed)
        t["collate"] += time.thread_time() - t0
        st = self.stats
        st.bins += 1
        st.samples_packed += len(processed)
        st.tokens += sum(lengths)
        self.seq += 1
        t0 = time.thread_time()
        meta = {
            "epoch": self.epoch,
            "generation": self.generation,
            "layout": list(self.layout),
            "samples": [[s.url, s.key] for s in picked],
            "lengths": lengths,
            "forecast": [s.length for s in picked],
            "snapshot": self._snapshot(done),
        }
        _attach(batch, meta)
        t["state"] += time.thread_time() - t0
        return batch

    def _snapshot(self, done: bool) -> dict[str, Any]:
        return {
            "stream": self.g,
            "seq": self.seq,
            "done": done,
            "cursor": list(self.cursor),
            "shuffle": list(self.shuffle),
            "rng": None if self.rng is None else self.rng.bit_generator.state,
            "packer": self.packer.state_dict(),
            "ready": [list(k) for k in self.ready],
            "stats": self.stats.to_dict(),
        }

    def _drain(self, final: bool) -> Iterator[Any]:
        while self.ready:
            keys = self.ready.popleft()
            batch = self._make_batch(keys, final and not self.ready)
            if batch is not None:
                yield batch

    # -- reading
    def _read_item(
        self, item: list[Any], first: int, collect: set[int] | None = None
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Samples of a plan item with index >= ``first`` (or only those in ``collect``), timing the reads.

        Shard errors are reported as ``unreadable_shard`` and end the item.
        """
        shard, start, pending = item
        url = self.ds.urls[shard]
        wanted = set(pending) if collect is None else collect
        last = max(wanted, default=-1) if (start is None or collect is not None) else math.inf
        if last < first:
            return
        t = self.stats.time
        it = _read_shard(url)
        key = None
        try:
            while True:
                t0 = time.thread_time()
                try:
                    idx, raw = next(it)
                except StopIteration:
                    break
                except Exception as exc:
                    t["read"] += time.thread_time() - t0
                    self._bad(
                        url, key, "unreadable_shard", f"{type(exc).__name__}: {exc} (after key {key!r})"
                    )
                    break
                t["read"] += time.thread_time() - t0
                key = raw.get("__key__")
                if idx < first:
                    continue
                if idx in wanted or (collect is None and start is not None and idx >= start):
                    yield idx, raw
                if idx >= last:
                    break
        finally:
            it.close()

    def _restore(self, snap: dict[str, Any]) -> None:
        self.cursor = list(snap["cursor"])
        self.seq = int(snap["seq"])
        self.stats = PipelineStats.from_dict(snap["stats"])
        for p in PHASES:
            self.stats.time.setdefault(p, 0.0)
        self.packer.load_state_dict(snap["packer"])
        self.shuffle = list(snap["shuffle"])
        if self.rng is not None and snap["rng"] is not None:
            self.rng.bit_generator.state = snap["rng"]
        self.ready = deque(list(k) for k in snap["ready"])
        # Re-read the samples the stream held: they were forecast before, so forecasting again is exact.
        held: dict[int, set[int]] = {}
        for pos in _held_positions(snap):
            held.setdefault(pos >> _SHIFT, set()).add(pos & ((1 << _SHIFT) - 1))
        by_shard = {item[0]: item for item in self.items}
        for shard in sorted(held):
            for idx, raw in self._read_item(by_shard[shard], 0, collect=held[shard]):
                t0 = time.thread_time()
                sample = self._forecast(self.ds.urls[shard], raw)
                self.stats.time["forecast"] += time.thread_time() - t0
                if sample is not None:
                    self.samples[(shard << _SHIFT) | idx] = sample
        missing = [pos for pos in _held_positions(snap) if pos not in self.samples]
        if missing:
            raise RuntimeError(
                f"resume: {len(missing)} buffered sample(s) could not be read again (first: shard "
                f"{self.ds.urls[missing[0] >> _SHIFT]}, index {missing[0] & ((1 << _SHIFT) - 1)}); the shards "
                "changed since the state was saved."
            )

    def run(self) -> Iterator[Any]:
        t = self.stats.time
        if self.snap is not None:
            self._restore(self.snap)
            if self.cursor[0] < len(self.items):  # else the final drain below yields them, flagging the last
                yield from self._drain(final=False)
        ci, ck = self.cursor
        for i in range(ci, len(self.items)):
            item = self.items[i]
            shard = item[0]
            url = self.ds.urls[shard]
            pending = set(item[2])
            for idx, raw in self._read_item(item, ck if i == ci else 0):
                self.cursor = [i, idx + 1]
                if idx not in pending:  # re-dealt buffered samples were counted when first read
                    self.stats.samples_read += 1
                t0 = time.thread_time()
                sample = self._forecast(url, raw)
                t1 = time.thread_time()
                t["forecast"] += t1 - t0
                if sample is None:
                    continue
                pos = (shard << _SHIFT) | idx
                self.samples[pos] = sample
                self._push(pos)
                t["pack"] += time.thread_time() - t1
                yield from self._drain(final=False)
            self.cursor = [i + 1, 0]
        t0 = time.thread_time()
        while self.shuffle:
            self._pack(self._draw())
        for b in self.packer.flush():
            self.ready.append(list(b.keys))
        for b in self.packer.dropped:
            for pos in b.keys:
                self.samples.pop(pos, None)
            self.stats.samples_dropped += len(b.keys)
        self.packer.dropped.clear()
        t["pack"] += time.thread_time() - t0
        yield from self._drain(final=True)


def build_packed_pipeline(
    urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], **kwargs: Any
) -> PackedWebDataset:
    """``PackedWebDataset(urls, **kwargs)``: see its docstring."""
    return PackedWebDataset(urls, **kwargs)


class PackedDataLoader:
    """A ``DataLoader`` over a :class:`PackedWebDataset` that tracks the stream for checkpoints.

    Each iteration builds a ``torch.utils.data.DataLoader(dataset, batch_size=None, ...)`` (non-persistent
    workers, so every iteration starts from the current state), calls ``dataset.observe`` on every batch,
    and marks the epoch complete when the loader is exhausted; the next iteration starts the next epoch::

        loader = PackedDataLoader(dataset, num_workers=2)
        for batch in loader:               # epoch 0
            train_step(batch)
            if step % 1000 == 0:
                save(loader.state_dict())  # resume with loader.load_state_dict(saved)
    """

    def __init__(self, dataset: PackedWebDataset, num_workers: int = 0, **loader_kwargs: Any) -> None:
        for bad in ("batch_size", "persistent_workers", "sampler", "batch_sampler", "collate_fn", "shuffle"):
            if loader_kwargs.get(bad) not in (None, False):
                raise ValueError(
                    f"PackedDataLoader: {bad}= is not supported (the dataset yields whole batches)."
                )
            loader_kwargs.pop(bad, None)
        self.dataset = dataset
        self.num_workers = int(num_workers)
        self.loader_kwargs = loader_kwargs

    def __iter__(self) -> Iterator[Any]:
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_identity,
            **self.loader_kwargs,
        )
        for batch in loader:
            yield self.dataset.observe(batch)
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


def _identity(x: Any) -> Any:
    return x
