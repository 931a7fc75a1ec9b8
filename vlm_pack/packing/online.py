"""``StreamPacker``: online best fit for iterable datasets, bounded buffer, exact resume from ``state_dict``."""

from __future__ import annotations

import bisect
import gc
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .._checks import checked_count
from ..config import PackingConfig
from .bins import (
    PackedBin,
    Unpacked,
    _length_text,
    _oversize_message,
    _vision_oversize_message,
    round_up,
)

_MT_BITS = 40  # low bits of an index key hold (~mtime) so equal free space sorts most-recent first
_MT_MASK = (1 << _MT_BITS) - 1
_LENGTH_FIX = "lengths must be positive expanded token counts. Filter such samples out before packing."
_VISION_FIX = "vision costs must be non-negative integers (ViT patches or images)."
# the PackingConfig fields a StreamPacker uses, in the order of its state_dict's "config"
PACKER_KNOBS = (
    "capacity",
    "buffer_size",
    "min_fill_ratio",
    "drop_last",
    "vision_capacity",
    "max_samples_per_bin",
    "oversized",
)


@dataclass
class StreamStats:
    """Counters of a :class:`StreamPacker` (all samples are accounted for).

    ``samples_seen == samples_emitted + samples_open + samples_dropped + len(skipped)``.
    """

    samples_seen: int = 0
    """Samples given to ``add`` / ``add_many``."""
    samples_emitted: int = 0
    """Samples in the emitted bins."""
    bins_emitted: int = 0
    """Bins emitted: full enough, pushed out by a full buffer, or flushed."""
    tokens_emitted: int = 0
    """Tokens in the emitted bins (the lengths given to ``add``, truncated ones at ``capacity``)."""
    samples_dropped: int = 0
    """Samples in the bins ``flush`` dropped under ``drop_last``."""
    bins_dropped: int = 0
    """Bins ``flush`` dropped under ``drop_last``: below ``min_fill_ratio`` at the end of the stream."""
    tokens_dropped: int = 0
    """Tokens in the dropped bins."""
    capacity: int = 0
    """Tokens per bin; the denominator of :attr:`fill_ratio`."""
    skipped: list[Unpacked] = field(default_factory=list)
    """Samples refused under ``oversized="skip"`` (too long, or too much vision cost), with the reason."""
    truncated: list[tuple[Any, int]] = field(default_factory=list)
    """``(key, original length)`` of the samples cut to ``capacity`` under ``oversized="truncate"``."""

    @property
    def fill_ratio(self) -> float:
        """Mean fill of the emitted bins: tokens_emitted / (bins_emitted * capacity)."""
        return self.tokens_emitted / (self.bins_emitted * self.capacity) if self.bins_emitted else 0.0


class StreamPacker:
    """Online best-fit packer for iterable datasets, with a bounded buffer and exact resume.

    Samples arrive one at a time (``add``) or in batches (``add_many``). Each goes into the open bin
    with the least free space that holds it (ties: the most recently modified bin), or opens a new
    bin. A bin is emitted as soon as it holds ``min_fill_ratio * capacity`` tokens or can take
    nothing more (full, or ``max_samples_per_bin`` reached). When a sample fits no open bin and
    ``buffer_size`` bins are already open, the fullest open bin is emitted first. ``flush()`` emits
    the rest at the end of an epoch (with ``drop_last``, the underfilled ones are dropped and
    reported in ``dropped`` / ``stats``)::

        StreamPacker(1024, min_fill_ratio=0.7): a bin leaves as soon as it holds >= 717 tokens
        add(s0=700)  open: [700]                  -> []           700 < 717: keep filling
        add(s1=500)  open: [700] [500]            -> []           500 fits no open bin: new bin
        add(s2=300)  open: [500]                  -> [700+300]    best fit: 324 free beats 524
        add(s3=900)  open: [500]                  -> [900]        900 >= 717 alone: out at once

    ``min_fill_ratio`` trades fill for latency: eager emission at 0.7 gives ~0.77-0.86 mean fill
    on realistic length mixes, 0.95 (the default) ~0.98, 1.0 (emit only full bins or, when the buffer
    is full, the fullest) ~0.99+; see ``benchmarks/RESULTS.md``.

    Memory is bounded by ``buffer_size`` open bins; a sample costs one bisection plus list
    insertions in the sorted index of open bins (O(log buffer_size) comparisons). The whole state
    is plain Python data: ``state_dict()`` / ``load_state_dict()`` resume mid-epoch and emit exactly
    the bins an uninterrupted run would (JSON-serialisable as long as the sample keys are: str, int,
    or tuples of them, which come back as tuples).

    The knobs are those of :class:`vlm_pack.config.PackingConfig`, which validates them:
    ``StreamPacker(cfg)`` takes a config shared with ``PackedWebDataset`` and the CLI (its streaming-only
    knobs are ignored here), ``StreamPacker(1024, min_fill_ratio=0.7)`` the capacity and knobs over the
    defaults; ``packer.config`` is the validated config.
    ``oversized="truncate"`` clips a too-long sample to ``capacity`` and lists it in
    ``stats.truncated`` (the caller cuts the sample itself), as :func:`pack` does.
    ``pad_to_multiple_of`` (as :func:`pack`'s): each length is placed as its padded span
    (:func:`padded_lengths`), the one the collator lays out, so that every bin is one row; the bins'
    ``lengths`` are those spans.
    """

    def __init__(self, config: PackingConfig | int | None = None, **knobs: Any) -> None:
        # PackingConfig names, defaults and validates the knobs (an int config is the capacity)
        config = PackingConfig.resolve("StreamPacker", config, **knobs)
        self.config = config
        self.capacity = config.capacity
        self.buffer_size = config.buffer_size
        self.min_fill_ratio = config.min_fill_ratio
        self.drop_last = config.drop_last
        self.vision_capacity = config.vision_capacity
        self.max_samples_per_bin = config.max_samples_per_bin
        self.oversized = config.oversized
        self.pad_to_multiple_of = config.pad_to_multiple_of
        self._threshold = config.fill_threshold
        # the caps as ints, "no cap" as a number no bin reaches, so the hot loops need no None test
        self._sample_cap = self.max_samples_per_bin or (1 << 62)
        self._vision_cap = self.vision_capacity if self.vision_capacity is not None else 1 << 62
        self.dropped: list[PackedBin] = []
        self._reset_state()

    def _reset_state(self) -> None:
        self._index: list[int] = []  # sorted: free << 40 | (~mtime & mask)
        self._open: dict[int, PackedBin] = {}  # index key -> open bin
        self._clock = 0
        self.dropped = []
        self.stats = StreamStats(capacity=self.capacity)

    # -- introspection
    @property
    def num_open(self) -> int:
        return len(self._open)

    def open_bins(self) -> list[PackedBin]:
        """Snapshot of the open (not yet emitted) bins, fullest first."""
        return [self._as_packed(self._open[index_key]) for index_key in self._index]

    def _as_packed(self, packed: PackedBin) -> PackedBin:
        return PackedBin(
            list(packed.keys),
            list(packed.lengths),
            packed.total,
            None if packed.visions is None else list(packed.visions),
            packed.vision_total,
        )

    # -- core
    def _validate(self, key: Any, length: Any, vision: Any) -> tuple[int, int] | None:
        """(length, vision) to place, or None if the sample is skipped (and reported)."""
        if type(length) is not int or length <= 0:  # the common case costs two tests
            length = checked_count(length, f"sample {key!r}: length", _LENGTH_FIX)
        if type(vision) is not int or vision < 0:
            vision = checked_count(vision, f"sample {key!r}: vision cost", _VISION_FIX, allow_zero=True)
        if vision and self.vision_capacity is None:
            raise ValueError(
                f"sample {key!r}: vision cost {vision} given but the packer has no vision_capacity; "
                "pass StreamPacker(..., vision_capacity=...) or vision=0"
            )
        if vision > self._vision_cap:
            if self.oversized == "raise":
                raise ValueError(_vision_oversize_message(f"sample {key!r}", vision, self._vision_cap))
            self.stats.skipped.append(
                Unpacked(
                    key, f"vision cost {vision} > vision_capacity {self._vision_cap} (cannot be truncated)"
                )
            )
            return None
        multiple = self.pad_to_multiple_of
        if length > self.capacity:
            if self.oversized == "raise":
                raise ValueError(_oversize_message(f"sample {key!r}", length, self.capacity, multiple))
            if self.oversized == "skip":
                why = f"length {_length_text(length, multiple)} > capacity {self.capacity}"
                self.stats.skipped.append(Unpacked(key, why))
                return None
            self.stats.truncated.append((key, length))
            length = self.capacity
        if multiple > 1:  # capacity is a multiple of it: a length that fits also fits once padded
            length = round_up(length, multiple)
        return length, vision

    def _emit(self, packed: PackedBin, out: list[PackedBin]) -> None:
        stats = self.stats
        stats.bins_emitted += 1
        stats.samples_emitted += len(packed.keys)
        stats.tokens_emitted += packed.total
        out.append(packed)

    def _place(self, key: Any, length: int, vision: int, out: list[PackedBin]) -> None:
        index = self._index
        opened = self._open
        self._clock += 1
        clock = self._clock
        pos = bisect.bisect_left(index, length << _MT_BITS)
        n_open = len(index)
        if self.vision_capacity is not None and vision:
            vision_cap = self._vision_cap
            while pos < n_open and opened[index[pos]].vision_total + vision > vision_cap:
                pos += 1
        if pos < n_open:
            packed = opened.pop(index.pop(pos))
            packed.keys.append(key)
            packed.lengths.append(length)
            if packed.visions is not None:
                packed.visions.append(vision)
            packed.total += length
            packed.vision_total += vision
        else:
            if length >= self._threshold or self._sample_cap == 1 or length == self.capacity:
                # a bin that would be emitted at once: do not evict an open bin for it
                self._emit(
                    PackedBin(
                        [key], [length], length, None if self.vision_capacity is None else [vision], vision
                    ),
                    out,
                )
                return
            if n_open >= self.buffer_size:  # buffer full: emit the fullest bin to make room
                self._emit(opened.pop(index.pop(0)), out)
            packed = PackedBin(
                [key], [length], length, None if self.vision_capacity is None else [vision], vision
            )
        free = self.capacity - packed.total
        if packed.total >= self._threshold or free == 0 or len(packed.keys) >= self._sample_cap:
            self._emit(packed, out)
            return
        packed._mtime = clock
        index_key = (free << _MT_BITS) | (_MT_MASK - clock)
        pos = bisect.bisect_left(index, index_key)
        index.insert(pos, index_key)
        opened[index_key] = packed

    def add(self, key: Any, length: int, vision: int = 0) -> list[PackedBin]:
        """Add one sample (``length`` = expanded tokens); return the bins this emitted (often none)."""
        checked = self._validate(key, length, vision)
        self.stats.samples_seen += 1
        out: list[PackedBin] = []
        if checked is not None:
            self._place(key, checked[0], checked[1], out)
        return out

    def add_many(
        self, keys: Iterable[Any], lengths: Iterable[int], visions: Iterable[int] | None = None
    ) -> list[PackedBin]:
        """Add samples in order (same bins as calling :meth:`add` on each); return all emitted bins.

        About 4x faster per sample than :meth:`add`: the loop is inlined for the token-only case and
        Python's cyclic garbage collector is paused for the duration of the call (the packer creates
        no reference cycles, so refcounting frees everything; the collector's scans of the many
        young lists otherwise dominate the cost).
        """
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._add_many(keys, lengths, visions)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _add_many(
        self, keys: Iterable[Any], lengths: Iterable[int], visions: Iterable[int] | None
    ) -> list[PackedBin]:
        out: list[PackedBin] = []
        if isinstance(lengths, np.ndarray):
            lengths = lengths.tolist()
        caps = (self.vision_capacity, self.max_samples_per_bin)
        if visions is None and caps == (None, None) and self.pad_to_multiple_of == 1:
            self._add_plain(keys, lengths, out)
            return out
        if isinstance(visions, np.ndarray):
            visions = visions.tolist()
        if visions is None:
            lengths = list(lengths)
            visions = [0] * len(lengths)
        stats = self.stats
        validate = self._validate
        place = self._place
        for key, length, vision in zip(keys, lengths, visions, strict=True):
            checked = validate(key, length, vision)
            stats.samples_seen += 1
            if checked is not None:
                place(key, checked[0], checked[1], out)
        return out

    def _add_plain(self, keys: Iterable[Any], lengths: Iterable[int], out: list[PackedBin]) -> None:
        """:meth:`_place` inlined for the common configuration (token budget only), state in locals."""
        index = self._index
        opened = self._open
        capacity = self.capacity
        threshold = self._threshold
        buffer_size = self.buffer_size
        validate = self._validate
        bisect_left = bisect.bisect_left
        stats = self.stats
        clock = self._clock
        seen = emitted = bins_out = tokens = 0
        try:
            for key, length in zip(keys, lengths, strict=True):
                if type(length) is not int or not 0 < length <= capacity:
                    checked = validate(key, length, 0)
                    if checked is None:
                        seen += 1
                        continue
                    length = checked[0]
                seen += 1
                clock += 1
                pos = bisect_left(index, length << _MT_BITS)
                if pos < len(index):
                    packed = opened.pop(index.pop(pos))
                    packed.keys.append(key)
                    packed.lengths.append(length)
                    total = packed.total + length
                    packed.total = total
                elif length >= threshold or length == capacity:
                    out.append(PackedBin([key], [length], length))
                    emitted += 1
                    bins_out += 1
                    tokens += length
                    continue
                else:
                    if len(index) >= buffer_size:  # buffer full: emit the fullest bin
                        fullest = opened.pop(index.pop(0))
                        out.append(fullest)
                        emitted += len(fullest.keys)
                        bins_out += 1
                        tokens += fullest.total
                    packed = PackedBin([key], [length], length)
                    total = length
                if total >= threshold or total == capacity:
                    out.append(packed)
                    emitted += len(packed.keys)
                    bins_out += 1
                    tokens += total
                    continue
                packed._mtime = clock
                index_key = ((capacity - total) << _MT_BITS) | (_MT_MASK - clock)
                pos = bisect_left(index, index_key)
                index.insert(pos, index_key)
                opened[index_key] = packed
        finally:  # also on a bad sample: the state stays consistent with the samples before it
            self._clock = clock
            stats.samples_seen += seen
            stats.samples_emitted += emitted
            stats.bins_emitted += bins_out
            stats.tokens_emitted += tokens

    def flush(self) -> list[PackedBin]:
        """Emit every open bin (fullest first), e.g. at the end of an epoch.

        With ``drop_last=True``, bins holding fewer than ``min_fill_ratio * capacity`` tokens are not
        returned: they go to :attr:`dropped` and ``stats.samples_dropped`` / ``bins_dropped``, so
        the samples are accounted for (train on them next epoch or log them).
        """
        out: list[PackedBin] = []
        opened = [self._open[index_key] for index_key in self._index]
        self._open = {}
        self._index = []
        stats = self.stats
        for packed in opened:
            if self.drop_last and packed.total < self._threshold:
                stats.bins_dropped += 1
                stats.samples_dropped += len(packed.keys)
                stats.tokens_dropped += packed.total
                self.dropped.append(packed)
            else:
                self._emit(packed, out)
        return out

    # -- state
    def state_dict(self) -> dict[str, Any]:
        """The full state as plain Python (lists/dicts/ints/strs, plus the user's sample keys).

        Format (version 1, unchanged since the first release): ``config`` (the knobs), ``clock``,
        ``open`` (fullest first: keys, lengths, visions, mtime), ``stats`` (the counters, plus
        ``skipped`` as [key, reason] and ``truncated`` as [key, length]) and ``dropped`` bins.
        """
        stats = self.stats
        return {
            "version": _STATE_VERSION,
            "config": self._config_state(),
            "clock": self._clock,
            "open": [
                {**_bin_state(packed), "mtime": packed._mtime}
                for packed in (self._open[index_key] for index_key in self._index)
            ],
            "stats": {
                **{name: getattr(stats, name) for name in _COUNTERS},
                "skipped": [[u.index, u.reason] for u in stats.skipped],
                "truncated": [[key, length] for key, length in stats.truncated],
            },
            "dropped": [_bin_state(packed) for packed in self.dropped],
        }

    def _config_state(self) -> dict[str, Any]:
        """The knobs a state is saved with; ``pad_to_multiple_of`` only when set, so that states of the
        default packer keep the first release's format (and such states load as unpadded)."""
        config = {name: getattr(self, name) for name in PACKER_KNOBS}
        if self.pad_to_multiple_of != 1:
            config["pad_to_multiple_of"] = self.pad_to_multiple_of
        return config

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (also after a JSON round trip). The configuration must match.

        JSON turns tuple keys such as ``(shard, index)`` into lists; list keys are turned back into
        tuples here, so the bins emitted after resuming equal those of an uninterrupted run.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported StreamPacker state version {state.get('version')!r}")
        theirs, ours = state["config"], self._config_state()
        pairs = {
            name: (theirs.get(name, _DEFAULTS.get(name)), ours.get(name, _DEFAULTS.get(name)))
            for name in (*PACKER_KNOBS, *_DEFAULTS)
        }
        diff = {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}
        if diff:
            raise ValueError(
                "StreamPacker state was saved with a different configuration (saved, current): "
                f"{diff}; build the packer with the saved configuration to resume exactly"
            )
        self._reset_state()
        self._clock = int(state["clock"])
        entries = []
        for saved in state["open"]:
            packed = _bin_from_state(saved)
            packed._mtime = int(saved["mtime"])
            entries.append(
                (((self.capacity - packed.total) << _MT_BITS) | (_MT_MASK - packed._mtime), packed)
            )
        entries.sort(key=lambda entry: entry[0])
        self._index = [index_key for index_key, _ in entries]
        self._open = dict(entries)
        saved_stats = state["stats"]
        for name in _COUNTERS:
            setattr(self.stats, name, int(saved_stats[name]))
        self.stats.skipped = [Unpacked(_key(key), reason) for key, reason in saved_stats["skipped"]]
        self.stats.truncated = [(_key(key), int(length)) for key, length in saved_stats["truncated"]]
        self.dropped = [_bin_from_state(saved) for saved in state["dropped"]]


_STATE_VERSION = 1
_DEFAULTS = {"pad_to_multiple_of": 1}  # knobs a state may lack: saved only when not at this default
# StreamStats' integer counters (every field but capacity and the skipped/truncated lists), derived
# once so that a new counter is saved, restored and compared without another list to update
_COUNTERS = tuple(f.name for f in fields(StreamStats) if f.type == "int" and f.name != "capacity")


def _bin_state(packed: PackedBin) -> dict[str, Any]:
    return {
        "keys": list(packed.keys),
        "lengths": list(packed.lengths),
        "visions": None if packed.visions is None else list(packed.visions),
    }


def _bin_from_state(saved: dict[str, Any]) -> PackedBin:
    lengths = [int(x) for x in saved["lengths"]]
    visions = None if saved["visions"] is None else [int(x) for x in saved["visions"]]
    return PackedBin([_key(k) for k in saved["keys"]], lengths, sum(lengths), visions, sum(visions or ()))


def _key(key: Any) -> Any:
    """A sample key read back from a state dict: JSON lists become tuples again (recursively)."""
    return tuple(_key(k) for k in key) if isinstance(key, list) else key


# ----------------------------------------------------------------------------- DP balancing
