"""The resume state of :class:`~vlm_pack.data.PackedWebDataset`: typed, with a versioned JSON round trip.

::

    PipelineState                      what ``state_dict()`` returns (as JSON data, ``"version": 2``)
    ├── urls_digest, num_urls          the shard list it was saved for
    ├── shuffle_seed, shuffle_buffer, packer (StreamPacker config)   must match to resume
    ├── totals: PipelineStats          earlier epochs
    └── progress: EpochProgress        the current epoch
        ├── epoch, generation          generation: re-deals after a layout (world x workers) change
        ├── plan: [PlanItem]           the epoch's work; stream g reads plan[g::n_streams]
        ├── layout: (world, workers)
        ├── streams: {g: StreamSnapshot}   the latest snapshot each stream sent with a batch
        │   ├── cursor: Cursor(item, sample)        next sample to read
        │   ├── shuffle, packer["open"], ready     positions it holds (read, not yet delivered)
        │   ├── window, scheduled      look-ahead windows so far; bins of ready already in window order
        │   └── rng, seq, done, stats
        ├── last_stream: {rank: g}     to rotate the DataLoader's workers on resume
        ├── complete                   the epoch ran to its end
        └── base: PipelineStats        samples consumed before the latest re-deal

A sample's *position* is ``shard << 32 | index in the shard``. Version 1 (vlm-pack before typed state)
wrote the same content as lists (``[shard, start, pending]``, ``[item, sample]``); it still loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .stats import PipelineStats

__all__ = [
    "STATE_VERSION",
    "SUPPORTED_VERSIONS",
    "Cursor",
    "EpochProgress",
    "PipelineState",
    "PlanItem",
    "StreamSnapshot",
]

STATE_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
_SHIFT = 32
_INDEX_MASK = (1 << _SHIFT) - 1


def position(shard: int, index: int) -> int:
    """A sample's position key: ``shard << 32 | index`` (one int, cheap to hold and to save)."""
    return (shard << _SHIFT) | index


def split_position(pos: int) -> tuple[int, int]:
    """``(shard, index in shard)`` of a position key."""
    return pos >> _SHIFT, pos & _INDEX_MASK


@dataclass
class PlanItem:
    """Read the samples of ``shard`` whose index is in ``pending`` or ``>= start`` (``start`` None: only
    ``pending``). A fresh epoch's items start at 0; items re-dealt after a layout change hold what is left."""

    shard: int
    start: int | None = 0
    pending: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"shard": self.shard, "start": self.start, "pending": list(self.pending)}

    @classmethod
    def from_json(cls, data: Any) -> PlanItem:
        shard, start, pending = (data["shard"], data["start"], data["pending"]) if isinstance(data, dict) else data
        return cls(int(shard), None if start is None else int(start), [int(i) for i in pending])


@dataclass
class Cursor:
    """Where a stream reads next: sample ``sample`` of its plan item ``item``."""

    item: int = 0
    sample: int = 0

    @classmethod
    def from_json(cls, data: Any) -> Cursor:
        item, sample = (data["item"], data["sample"]) if isinstance(data, dict) else data
        return cls(int(item), int(sample))


@dataclass
class StreamSnapshot:
    """The state of one stream (one rank x DataLoader worker) after its batch number ``seq``.

    ``shuffle``, the packer's open bins and ``ready`` (bins packed, not yet collated) hold positions the
    stream read but did not deliver; resuming reads them again. ``packer`` is ``StreamPacker.state_dict()``
    (versioned by the packer); ``rng`` the numpy bit generator state of the shuffle buffer.
    """

    stream: int
    seq: int
    done: bool
    cursor: Cursor
    shuffle: list[int]
    rng: dict[str, Any] | None
    packer: dict[str, Any]
    ready: list[list[int]]
    stats: PipelineStats
    window: int = 0
    """Look-ahead windows scheduled so far (``StreamBalance``; 0 without it)."""
    scheduled: int = 0
    """Bins at the front of ``ready`` already in their window's emission order (the rest of that window)."""

    def held_positions(self) -> list[int]:
        """Positions read but not yet delivered: shuffle buffer, open bins, bins not collated."""
        held = list(self.shuffle)
        for open_bin in self.packer["open"]:
            held.extend(open_bin["keys"])
        for keys in self.ready:
            held.extend(keys)
        return held

    def held_by_shard(self) -> dict[int, set[int]]:
        """:meth:`held_positions` as ``{shard: {index, ...}}``."""
        held: dict[int, set[int]] = {}
        for pos in self.held_positions():
            shard, index = split_position(pos)
            held.setdefault(shard, set()).add(index)
        return held

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(
            cursor=dataclasses.asdict(self.cursor),
            shuffle=list(self.shuffle),
            ready=[list(keys) for keys in self.ready],
            stats=self.stats.to_dict(),
        )
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StreamSnapshot:
        return cls(
            stream=int(data["stream"]),
            seq=int(data["seq"]),
            done=bool(data["done"]),
            cursor=Cursor.from_json(data["cursor"]),
            shuffle=[int(p) for p in data["shuffle"]],
            rng=data["rng"],
            packer=data["packer"],
            ready=[[int(p) for p in keys] for keys in data["ready"]],
            stats=PipelineStats.from_dict(data["stats"]),
            window=int(data.get("window", 0)),
            scheduled=int(data.get("scheduled", 0)),
        )


@dataclass
class EpochProgress:
    """How far the current epoch got, from the snapshots the main process observed."""

    epoch: int
    generation: int = 0
    plan: list[PlanItem] | None = None  # None: the fresh plan of the epoch
    layout: tuple[int, int] | None = None  # (world size, DataLoader workers) of ``streams``
    streams: dict[int, StreamSnapshot] = field(default_factory=dict)
    last_stream: dict[int, int] = field(default_factory=dict)  # rank -> stream of its latest batch
    complete: bool = False
    base: PipelineStats | None = None

    @property
    def n_streams(self) -> int:
        assert self.layout is not None
        return self.layout[0] * self.layout[1]

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "generation": self.generation,
            "plan": None if self.plan is None else [item.to_json() for item in self.plan],
            "layout": None if self.layout is None else list(self.layout),
            "streams": [self.streams[g].to_json() for g in sorted(self.streams)],
            "last_stream": {str(rank): g for rank, g in self.last_stream.items()},
            "complete": self.complete,
            "base": None if self.base is None else self.base.to_dict(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EpochProgress:
        snapshots = [StreamSnapshot.from_json(s) for s in data["streams"]]
        return cls(
            epoch=int(data["epoch"]),
            generation=int(data["generation"]),
            plan=None if data["plan"] is None else [PlanItem.from_json(i) for i in data["plan"]],
            layout=None if data["layout"] is None else (int(data["layout"][0]), int(data["layout"][1])),
            streams={s.stream: s for s in snapshots},
            last_stream={int(rank): int(g) for rank, g in data["last_stream"].items()},
            complete=bool(data["complete"]),
            base=None if data["base"] is None else PipelineStats.from_dict(data["base"]),
        )


@dataclass
class PipelineState:
    """Everything :meth:`PackedWebDataset.state_dict` saves; ``to_json`` / ``from_json`` round trip."""

    urls_digest: str
    num_urls: int
    shuffle_seed: int | None
    shuffle_buffer: int
    packer: dict[str, Any]
    progress: EpochProgress
    totals: PipelineStats

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "urls_digest": self.urls_digest,
            "num_urls": self.num_urls,
            "shuffle_seed": self.shuffle_seed,
            "shuffle_buffer": self.shuffle_buffer,
            "packer": dict(self.packer),
            "progress": self.progress.to_json(),
            "totals": self.totals.to_dict(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PipelineState:
        """Read a state of any version in ``SUPPORTED_VERSIONS``; another version raises ``ValueError``."""
        version = data.get("version") if isinstance(data, dict) else None
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(
                f"unsupported PackedWebDataset state version {version!r}: this vlm-pack reads versions "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}. A newer state needs the vlm-pack that wrote it; "
                "pass the dict returned by state_dict() (or its JSON), not a part of it."
            )
        return cls(
            urls_digest=str(data["urls_digest"]),
            num_urls=int(data["num_urls"]),
            shuffle_seed=data["shuffle_seed"],
            shuffle_buffer=int(data["shuffle_buffer"]),
            packer=dict(data["packer"]),
            progress=EpochProgress.from_json(data["progress"]),
            totals=PipelineStats.from_dict(data["totals"]),
        )


# -- epoch plans ------------------------------------------------------------------------------------


def fresh_plan(n_shards: int, seed: int | None, epoch: int) -> list[PlanItem]:
    """Every shard from its first sample, in the epoch's order (shuffled by ``(seed, epoch)``)."""
    order = range(n_shards) if seed is None else np.random.default_rng([seed, epoch]).permutation(n_shards)
    return [PlanItem(int(shard)) for shard in order]


def _item_left(item: PlanItem, index: int, cursor: Cursor, held: set[int]) -> PlanItem | None:
    """What is left of a stream's plan item number ``index`` given its ``cursor`` and ``held`` samples."""
    if index < cursor.item:  # read to the end: only the held samples are left
        left = PlanItem(item.shard, None, sorted(held))
    elif index == cursor.item:
        start = None if item.start is None else max(item.start, cursor.sample)
        left = PlanItem(item.shard, start, sorted({i for i in item.pending if i >= cursor.sample} | held))
    else:  # not started
        left = PlanItem(item.shard, item.start, sorted(set(item.pending) | held))
    return left if left.start is not None or left.pending else None


def remaining_plan(progress: EpochProgress) -> list[PlanItem]:
    """What is left of ``progress.plan`` given each stream's latest snapshot (streams without one: all)."""
    assert progress.plan is not None
    n_streams = progress.n_streams
    remaining: list[tuple[int, PlanItem]] = []  # (index in the old plan, item)
    for stream in range(n_streams):
        items = progress.plan[stream::n_streams]
        snapshot = progress.streams.get(stream)
        if snapshot is None:
            remaining.extend((i * n_streams + stream, item) for i, item in enumerate(items))
            continue
        held = snapshot.held_by_shard()
        for i, item in enumerate(items):
            left = _item_left(item, i, snapshot.cursor, held.get(item.shard, set()))
            if left is not None:
                remaining.append((i * n_streams + stream, left))
    remaining.sort(key=lambda entry: entry[0])  # back to the plan's order
    return [item for _, item in remaining]
