"""Packing engine: group samples into fixed-capacity bins (packs) without losing any.

A *bin* is one row of a packed batch: the samples in it are laid end to end and
separated by ``cu_seqlens``, so nothing attends across a sample boundary. Every
sample is fitted on its **expanded length**, the number of positions it really
occupies in the language model: text tokens plus the vision tokens its images
expand into (``vision.py`` forecasts those from the image header, e.g. Qwen2-VL's
``(H/14) * (W/14) / 4`` for an image resized to H x W). Fitting on text alone
would overflow every bin that holds an image.

Samples are placed longest first, each into the open bin with the least free
space that still holds it (best-fit decreasing)::

    pack([900, 700, 500, 400, 300, 120, 60], capacity=1024)

             0                                                     1024
    bin 0   |s0 900 .....................................|s6 60 |    |   960 used
    bin 1   |s1 700 ..............................|s4 300 .........| |  1000 used
    bin 2   |s2 500 ................|s3 400 ...............|s5 120 | |  1020 used

    PackResult (flat arrays, no per-sample Python objects):
    order       = [0, 6, 1, 4, 2, 3, 5]     sample indices, bin by bin
    bin_offsets = [0, 2, 4, 7]              bin i = order[bin_offsets[i]:bin_offsets[i+1]]
    bin_lengths = [960, 1000, 1020]         tokens used per bin
    efficiency  = 2980 / (3 * 1024) = 0.970, lower_bound = ceil(2980 / 1024) = 3

Three entry points:

- :func:`pack` packs a whole dataset offline (``"bfd"`` best-fit decreasing,
  ``"ffd"`` first-fit decreasing, ``"ff"`` first-fit in data order, ``"nf"``
  next-fit), with an optional second per-bin budget (``vision``: ViT patches
  before merge, or images per bin) and a cap on samples per bin.
- :class:`StreamPacker` packs an iterable stream with a bounded buffer of open
  bins, and its ``state_dict`` resumes mid-epoch to the exact same bins.
- :func:`balance_bins` deals bins to data-parallel ranks (Karmarkar-Karp) so each
  rank's attention + MLP + vision-tower work is balanced, not just its tokens.

Tie-breaking is part of the contract, so the bins are reproducible anywhere:
samples are visited longest first (then larger vision cost, then lower index);
best fit picks the bin with the least free token space among those the sample
fits, and among equal free space the bin modified most recently; first fit
picks the lowest-numbered bin it fits. Bins are numbered in the order they were
opened (``seed`` optionally shuffles that order afterwards). Nothing is lost:
every sample is in exactly one bin or in ``PackResult.unpacked`` with a reason.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import logging
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "STRATEGIES",
    "PackResult",
    "PackedBin",
    "StreamPacker",
    "StreamStats",
    "Unpacked",
    "balance_bins",
    "bin_costs",
    "pack",
    "partition_imbalance",
]

logger = logging.getLogger(__name__)

STRATEGIES = ("bfd", "ffd", "ff", "nf")
_MAX_TREE_CAPACITY = 1 << 24
_OVERSIZED = ("raise", "truncate", "skip")


# ----------------------------------------------------------------------------- validation


def _first_non_integer(values: Any) -> int:
    """Index of the first element that is not a Python/numpy integer (bools count as non-integers)."""
    for i, v in enumerate(values):
        if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral):
            return i
    return -1


def _as_int_array(values: Any, name: str, *, allow_zero: bool) -> np.ndarray:
    """``values`` as a 1-D int64 array, or a ValueError/TypeError naming the offending index."""
    if isinstance(values, np.ndarray):
        arr = values
    else:
        if not hasattr(values, "__len__"):  # a generator or other one-pass iterable
            values = list(values)
        try:
            arr = np.asarray(values)
        except (ValueError, TypeError) as e:  # ragged nested lists
            raise TypeError(f"{name} must be a 1-D sequence of integers: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one entry per sample), got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind == "f":
        bad = ~np.isfinite(arr) | (arr != np.floor(arr))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{name}[{i}] = {arr[i].item()!r} is not an integer; {name} must be whole token counts "
                f"(check that sample {i} was measured, not averaged)"
            )
        raise TypeError(
            f"{name} has float dtype {arr.dtype} ({name}[0] = {arr[0].item()!r}); token counts must be integers: pass "
            f"integers, e.g. np.asarray({name}, dtype=np.int64)"
        )
    if kind not in "iu":
        i = _first_non_integer(arr.tolist() if kind == "O" else arr)
        i = max(i, 0)
        v = arr[i]
        v = v.item() if isinstance(v, np.generic) else v
        raise TypeError(f"{name}[{i}] = {v!r} ({type(v).__name__}) is not an integer; {name} must hold ints")
    if kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(arr > np.iinfo(np.int64).max))
        raise ValueError(f"{name}[{i}] = {arr[i]} does not fit in int64")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        bad = arr < 0 if allow_zero else arr <= 0
        if bad.any():
            i = int(np.argmax(bad))
            what = "negative" if arr[i] < 0 else "zero"
            need = "non-negative" if allow_zero else "positive (at least one token)"
            raise ValueError(
                f"{name}[{i}] = {int(arr[i])} is {what}; {name} must be {need}. "
                f"Drop or fix sample {i} before packing."
            )
    return arr


def _as_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def _check_oversized(oversized: str) -> None:
    if oversized not in _OVERSIZED:
        raise ValueError(f"oversized must be one of {_OVERSIZED}, got {oversized!r}")


def _oversize_message(who: str, length: int, capacity: int) -> str:
    return (
        f"{who} has expanded length {length} > capacity {capacity}. Raise capacity to at least "
        f"{length}, or pass oversized='truncate' (clip it to {capacity} tokens) or oversized='skip' "
        f"(leave it out; it is reported with its reason)"
    )


def _vision_oversize_message(who: str, cost: int, vision_capacity: int) -> str:
    return (
        f"{who} has vision cost {cost} > vision_capacity {vision_capacity}. Raise vision_capacity "
        f"to at least {cost}, downscale its images (fewer vision tokens), or pass oversized='skip' "
        f"(a vision budget cannot be truncated: 'truncate' skips such samples too)"
    )


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Unpacked:
    """A sample left out of every bin, and why (``index`` is the sample index, or its key when streaming)."""

    index: Any
    reason: str


class PackResult:
    """Bins as flat arrays; per-bin Python lists are built only when :attr:`bins` is read.

    Attributes:
        order: int64 ``[num_packed]``: sample indices, bin by bin; inside a bin in placement order
            (longest first for the decreasing strategies, data order for ``ff``/``nf``).
        bin_offsets: int64 ``[num_bins + 1]``: bin ``i`` is ``order[bin_offsets[i]:bin_offsets[i+1]]``.
        bin_lengths: int64 ``[num_bins]``: tokens used per bin (sum of ``lengths`` of its samples).
        bin_vision: int64 ``[num_bins]`` vision cost per bin, or None when packing had no vision budget.
        lengths: int64 ``[num_samples]``: the lengths packing used (truncated ones clipped to capacity).
        vision: int64 ``[num_samples]``: the per-sample vision costs given to :func:`pack`, or None.
        unpacked: samples in no bin, with the reason (``Unpacked(index, reason)``).
        truncated: sample index -> original length, for samples clipped to ``capacity``.
    """

    __slots__ = (
        "_bins",
        "_sample_bin",
        "bin_lengths",
        "bin_offsets",
        "bin_vision",
        "capacity",
        "lengths",
        "max_samples_per_bin",
        "order",
        "strategy",
        "truncated",
        "unpacked",
        "vision",
        "vision_capacity",
    )

    def __init__(
        self,
        *,
        order: np.ndarray,
        bin_offsets: np.ndarray,
        lengths: np.ndarray,
        capacity: int,
        strategy: str,
        vision: np.ndarray | None = None,
        vision_capacity: int | None = None,
        max_samples_per_bin: int | None = None,
        unpacked: list[Unpacked] | None = None,
        truncated: dict[int, int] | None = None,
        bin_lengths: np.ndarray | None = None,
        bin_vision: np.ndarray | None = None,
    ) -> None:
        self.order = order
        self.bin_offsets = bin_offsets
        self.lengths = lengths
        self.capacity = capacity
        self.strategy = strategy
        self.vision = vision
        self.vision_capacity = vision_capacity
        self.max_samples_per_bin = max_samples_per_bin
        self.unpacked = unpacked if unpacked is not None else []
        self.truncated = truncated if truncated is not None else {}
        if bin_lengths is None:
            bin_lengths = _segment_sums(lengths[order], bin_offsets)
        if bin_vision is None and vision is not None:
            bin_vision = _segment_sums(vision[order], bin_offsets)
        self.bin_lengths = bin_lengths
        self.bin_vision = bin_vision
        self._bins: list[list[int]] | None = None
        self._sample_bin: np.ndarray | None = None

    @property
    def num_bins(self) -> int:
        return int(self.bin_offsets.size - 1)

    def __len__(self) -> int:
        return self.num_bins

    @property
    def num_samples(self) -> int:
        """Samples given to :func:`pack` (packed + unpacked)."""
        return int(self.lengths.size)

    @property
    def bin_sizes(self) -> np.ndarray:
        """int64 ``[num_bins]``: samples per bin."""
        return np.diff(self.bin_offsets)

    @property
    def total_tokens(self) -> int:
        return int(self.bin_lengths.sum())

    @property
    def efficiency(self) -> float:
        """Packed tokens / (num_bins * capacity); 0.0 when there are no bins."""
        return self.total_tokens / (self.num_bins * self.capacity) if self.num_bins else 0.0

    @property
    def lower_bound(self) -> int:
        """No packing of the packed samples can use fewer bins than this.

        ``ceil(sum(lengths) / capacity)``, and likewise for the vision budget and ``max_samples_per_bin``
        when given (the largest of these).
        """
        lb = -(-self.total_tokens // self.capacity)
        if self.bin_vision is not None and self.vision_capacity:
            lb = max(lb, -(-int(self.bin_vision.sum()) // self.vision_capacity))
        if self.max_samples_per_bin:
            lb = max(lb, -(-int(self.order.size) // self.max_samples_per_bin))
        return int(lb)

    def bin(self, i: int) -> np.ndarray:
        """Sample indices of bin ``i`` (an int64 view into :attr:`order`)."""
        i = operator.index(i)
        if not -self.num_bins <= i < self.num_bins:
            raise IndexError(f"bin {i} out of range for {self.num_bins} bins")
        i %= self.num_bins
        return self.order[self.bin_offsets[i] : self.bin_offsets[i + 1]]

    @property
    def bins(self) -> list[list[int]]:
        """Bins as lists of sample indices (built on first access, then cached)."""
        if self._bins is None:
            flat = self.order.tolist()
            offs = self.bin_offsets.tolist()
            self._bins = [flat[a:b] for a, b in itertools.pairwise(offs)]
        return self._bins

    @property
    def sample_bin(self) -> np.ndarray:
        """int64 ``[num_samples]``: the bin of each sample, -1 for unpacked samples."""
        if self._sample_bin is None:
            sb = np.full(self.num_samples, -1, dtype=np.int64)
            sb[self.order] = np.repeat(np.arange(self.num_bins, dtype=np.int64), self.bin_sizes)
            self._sample_bin = sb
        return self._sample_bin

    def __repr__(self) -> str:
        return (
            f"PackResult(strategy={self.strategy!r}, num_bins={self.num_bins}, lower_bound={self.lower_bound}, "
            f"capacity={self.capacity}, efficiency={self.efficiency:.4f}, packed={self.order.size}, "
            f"unpacked={len(self.unpacked)}, truncated={len(self.truncated)})"
        )


def _segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of ``values[offsets[i]:offsets[i+1]]`` per segment; segments are non-empty. Shapes [N], [B+1] -> [B]."""
    if offsets.size <= 1:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(values, offsets[:-1]).astype(np.int64, copy=False)


# ----------------------------------------------------------------------------- sorting helpers


def _stable_argsort_desc(lens: np.ndarray, capacity: int) -> np.ndarray:
    """Indices sorting ``lens`` (values in 1..capacity) longest first, ties by index: an O(n) radix sort."""
    key = capacity - lens
    if capacity < 1 << 16:
        key = key.astype(np.uint16)
    return np.argsort(key, kind="stable")


def _stable_argsort_ids(ids: np.ndarray, max_id: int) -> np.ndarray:
    """Stable argsort of bin ids in ``[0, max_id)``.

    One 16-bit radix pass when the ids fit; otherwise timsort, which is near linear here because
    the ids come in long ascending runs (bins are opened in processing order).
    """
    if max_id <= 1 << 16:
        return np.argsort(ids.astype(np.uint16), kind="stable")
    return np.argsort(ids, kind="stable")


# ----------------------------------------------------------------------------- strategies
#
# Each core takes lengths (1..capacity, already validated) in *processing order* and returns
# ``item_bin``: the bin (numbered in opening order) of each processed item, and the bin count.


def _bfd_histogram(
    distinct: np.ndarray, counts: np.ndarray, capacity: int, *, ranges: bool | None = None
) -> tuple[np.ndarray, int]:
    """Exact best-fit decreasing on a length histogram: numpy plus one Python step per bucket move.

    ``distinct``: the distinct lengths, descending; ``counts``: how many items have each (int64
    arrays of the same size). Items are processed longest first. Bins live in
    buckets keyed by free space ``r``; a bucket is a stack (top = most recently modified bin, the
    tie-break). For a length L the best bin is the top of the smallest bucket r >= L, and after
    taking one item it sits at r - L, which is again the best bin while r - L >= L: so it takes
    ``q = r // L`` items in a row, and every bin of bucket r does the same in stack order, ending
    at ``r % L``. A whole bucket is placed in one step, and new bins take ``capacity // L`` items
    each, so the Python work is per (length, bucket) pair, not per item::

        length L = 300, k = 7 items left        buckets (free space -> stack of bins, top last)
        smallest r >= 300: r = 620, q = 2        620: [b4, b9]      -> b9 takes 2, b4 takes 2 -> 20: [.., b9, b4]
        next r = 700,  q = 2                     700: [b2, b7, b8]  -> b8 takes 2, b7 takes 1 -> 400: [b7]
                                                                       (b2 stays at 700)

    Two representations of the stacks give the same bins: plain lists of bin ids (cheapest when
    lengths are mostly distinct) and lists of ``range`` runs (bins opened together move together,
    so a million samples become a few thousand runs). ``ranges=None`` picks by items per length.
    Returns ``item_bin`` [n] for the items in processing order, and the bin count.
    """
    if distinct.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    if ranges is None:
        ranges = int(counts.sum()) >= 32 * distinct.size
    return (_bfd_runs if ranges else _bfd_lists)(distinct, counts, capacity)


def _bfd_lists(distinct: np.ndarray, counts: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """:func:`_bfd_histogram` with stacks as lists of bin ids."""
    lmin = int(distinct[-1])
    buckets: dict[int, list[int]] = {}
    keys: list[int] = []  # sorted free-space values of non-empty buckets
    rec_bins: list[int] = []  # run-length record of placements: bin, how many items in a row
    rec_reps: list[int] = []
    # Items longer than capacity/2 never share a bin with each other: each opens its own bin,
    # and the bins of one length form one bucket at free space capacity - L.
    nbig = int(np.searchsorted(-distinct, -(capacity // 2), side="left"))
    big = distinct[:nbig]
    kbig = counts[:nbig]
    nb = int(kbig.sum())
    ends = np.cumsum(kbig).tolist()
    for length, k, e in zip(big.tolist(), kbig.tolist(), ends):
        d = capacity - length  # ascending over this loop
        if d >= lmin:
            buckets[d] = list(range(e - k, e))
            keys.append(d)
    bisect_left = bisect.bisect_left
    insort = bisect.insort
    rb_append = rec_bins.append
    rr_append = rec_reps.append
    for length, k in zip(distinct[nbig:].tolist(), counts[nbig:].tolist()):
        i = bisect_left(keys, length)
        if k <= 16:
            # Few items of this length (the usual case when lengths are spread out): bin by bin,
            # keeping the sorted keys up to date in place. The top bin of the smallest bucket
            # r >= length takes min(k, q) items; if it keeps >= length free, its new free space
            # d lies in [length, r), where no key exists, so d simply takes r's slot.
            while k:
                if i < len(keys):
                    r = keys[i]
                    q = r // length
                    stack = buckets[r]
                    b = stack.pop()
                    rb_append(b)
                    if q > k:
                        rr_append(k)
                        d = r - k * length
                        if stack:
                            keys.insert(i, d)
                        else:
                            del buckets[r]
                            keys[i] = d
                        buckets[d] = [b]
                        break
                    rr_append(q)
                    k -= q
                    if not stack:
                        del buckets[r]
                        del keys[i]
                    d = r - q * length  # < length: lands below position i
                    if d >= lmin:
                        dst = buckets.get(d)
                        if dst is None:
                            buckets[d] = [b]
                            insort(keys, d)
                            i += 1
                        else:
                            dst.append(b)
                else:  # no bin has room: open bins of capacity // length items, the last maybe fewer
                    q = capacity // length
                    nfull, rest = divmod(k, q)
                    for _ in range(nfull):
                        rb_append(nb)
                        rr_append(q)
                        d = capacity - q * length
                        if d >= lmin:
                            dst = buckets.get(d)
                            if dst is None:
                                buckets[d] = [nb]
                                insort(keys, d)
                            else:
                                dst.append(nb)
                        nb += 1
                    if rest:
                        rb_append(nb)
                        rr_append(rest)
                        d = capacity - rest * length  # >= length > every key
                        buckets[d] = [nb]
                        keys.append(d)
                        nb += 1
                    break
            continue
        nkeys = len(keys)
        j = i
        added: list[int] = []
        while k and j < nkeys:
            r = keys[j]
            stack = buckets[r]
            q = r // length
            c = len(stack)
            if k >= q * c:  # the whole bucket fills up with this length
                taken = stack[::-1]
                rec_bins += taken
                rec_reps += [q] * c
                k -= q * c
                del buckets[r]
                j += 1
                d = r - q * length
                if d >= lmin:
                    dst = buckets.get(d)
                    if dst is None:
                        buckets[d] = taken
                        added.append(d)
                    else:
                        dst += taken
            else:  # part of the bucket: nfull bins take q items, one more takes the rest
                nfull, rest = divmod(k, q)
                k = 0
                if nfull:
                    taken = stack[: -nfull - 1 : -1]
                    del stack[-nfull:]
                    rec_bins += taken
                    rec_reps += [q] * nfull
                    d = r - q * length
                    if d >= lmin:
                        dst = buckets.get(d)
                        if dst is None:
                            buckets[d] = taken
                            added.append(d)
                        else:
                            dst += taken
                if rest:
                    b = stack.pop()
                    rec_bins.append(b)
                    rec_reps.append(rest)
                    d = r - rest * length  # >= length: all buckets in [length, r) are now empty
                    buckets[d] = [b]
                    added.append(d)
                if not stack:
                    del buckets[r]
                    j += 1
        del keys[i:j]
        if k:  # open new bins; each takes capacity // length items
            q = capacity // length
            nfull, rest = divmod(k, q)
            if nfull:
                ids = list(range(nb, nb + nfull))
                nb += nfull
                rec_bins += ids
                rec_reps += [q] * nfull
                d = capacity - q * length
                if d >= lmin:
                    dst = buckets.get(d)
                    if dst is None:
                        buckets[d] = ids
                        added.append(d)
                    else:
                        dst += ids
            if rest:
                rec_bins.append(nb)
                rec_reps.append(rest)
                d = capacity - rest * length
                buckets[d] = [nb]
                added.append(d)
                nb += 1
        for d in added:
            bisect.insort(keys, d)
    rest_bins = np.repeat(np.array(rec_bins, dtype=np.int64), np.array(rec_reps, dtype=np.int64))
    return np.concatenate([np.arange(int(kbig.sum()), dtype=np.int64), rest_bins]), nb


def _bfd_runs(distinct: np.ndarray, counts: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """:func:`_bfd_histogram` with stacks as lists of ``range`` runs of bin ids (top = last id of last run)."""
    lmin = int(distinct[-1])
    buckets: dict[int, list[Any]] = {}  # free -> [bin count, runs]
    keys: list[int] = []
    rec_r: list[range] = []  # runs of bins in placement order
    rec_q: list[int] = []  # items each bin of the run takes in a row
    nb = 0
    bisect_left = bisect.bisect_left
    insort = bisect.insort
    for length, k in zip(distinct.tolist(), counts.tolist()):
        i = bisect_left(keys, length)
        j = i
        nkeys = len(keys)
        added: list[int] = []
        while k and j < nkeys:
            r = keys[j]
            ent = buckets[r]
            q = r // length
            c = ent[0]
            if k >= q * c:
                taken = [rg[::-1] for rg in reversed(ent[1])]
                rec_r += taken
                rec_q += [q] * len(taken)
                k -= q * c
                del buckets[r]
                j += 1
                d = r - q * length
                if d >= lmin:
                    dst = buckets.get(d)
                    if dst is None:
                        buckets[d] = [c, taken]
                        added.append(d)
                    else:
                        dst[0] += c
                        dst[1] += taken
            else:
                nfull, rest = divmod(k, q)
                k = 0
                rl = ent[1]
                if nfull:
                    need = nfull
                    taken = []
                    while need:
                        rg = rl[-1]
                        m = len(rg)
                        if m <= need:
                            rl.pop()
                            taken.append(rg[::-1])
                            need -= m
                        else:
                            taken.append(rg[: m - need - 1 : -1])
                            rl[-1] = rg[: m - need]
                            need = 0
                    ent[0] -= nfull
                    rec_r += taken
                    rec_q += [q] * len(taken)
                    d = r - q * length
                    if d >= lmin:
                        dst = buckets.get(d)
                        if dst is None:
                            buckets[d] = [nfull, taken]
                            added.append(d)
                        else:
                            dst[0] += nfull
                            dst[1] += taken
                if rest:
                    rg = rl[-1]
                    b = rg[-1]
                    if len(rg) == 1:
                        rl.pop()
                    else:
                        rl[-1] = rg[:-1]
                    ent[0] -= 1
                    one = range(b, b + 1)
                    rec_r.append(one)
                    rec_q.append(rest)
                    d = r - rest * length
                    buckets[d] = [1, [one]]
                    added.append(d)
                if not ent[0]:
                    del buckets[r]
                    j += 1
        del keys[i:j]
        if k:
            q = capacity // length
            nfull, rest = divmod(k, q)
            if nfull:
                ids = range(nb, nb + nfull)
                nb += nfull
                rec_r.append(ids)
                rec_q.append(q)
                d = capacity - q * length
                if d >= lmin:
                    dst = buckets.get(d)
                    if dst is None:
                        buckets[d] = [nfull, [ids]]
                        added.append(d)
                    else:
                        dst[0] += nfull
                        dst[1].append(ids)
            if rest:
                one = range(nb, nb + 1)
                rec_r.append(one)
                rec_q.append(rest)
                d = capacity - rest * length
                buckets[d] = [1, [one]]
                added.append(d)
                nb += 1
        for d in added:
            insort(keys, d)
    return _expand_runs(rec_r, rec_q), nb


def _expand_runs(rec_r: list[range], rec_q: list[int]) -> np.ndarray:
    """Placement record -> ``item_bin``: run ``rec_r[i]`` of bins, each taking ``rec_q[i]`` items in a row."""
    nrec = len(rec_r)
    starts = np.fromiter((rg.start for rg in rec_r), np.int64, nrec)
    steps = np.fromiter((rg.step for rg in rec_r), np.int64, nrec)
    sizes = np.fromiter(map(len, rec_r), np.int64, nrec)
    first = np.zeros(nrec, dtype=np.int64)
    np.cumsum(sizes[:-1], out=first[1:])
    pos = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(first, sizes)
    bins = np.repeat(starts, sizes) + pos * np.repeat(steps, sizes)
    return np.repeat(bins, np.repeat(np.array(rec_q, dtype=np.int64), sizes))


def _tree_set(tree: list[int], j: int, value: int) -> None:
    """Set leaf ``j`` (already offset by the tree size) of a max segment tree and fix its ancestors."""
    tree[j] = value
    j >>= 1
    while j:
        a, c = tree[2 * j], tree[2 * j + 1]
        m = a if a > c else c
        if tree[j] == m:
            break
        tree[j] = m
        j >>= 1


def _tree_first_at_least(tree: list[int], size: int, lo: int, value: int) -> int:
    """Leftmost leaf index >= ``lo`` whose value is >= ``value`` in a max segment tree, or -1."""
    i = lo + size
    if tree[i] < value:
        while True:  # climb to the next subtree to the right that holds a large enough leaf
            while i & 1:
                i >>= 1
            if i == 0:
                return -1
            i += 1
            if tree[i] >= value:
                break
        while i < size:
            i = 2 * i if tree[2 * i] >= value else 2 * i + 1
    return i - size


def _bfd_constrained(
    lens: list[int], vis: list[int] | None, capacity: int, vcap: int, max_n: int, lmin: int
) -> tuple[list[int], int]:
    """Best fit with a vision budget and/or a samples-per-bin cap, one item at a time, O(log C).

    Same rule as :func:`_bfd_histogram` among the bins that satisfy every budget: least free token
    space, then most recently modified. Bins are bucketed by free token space ``r``; a max segment
    tree over ``r`` holds each bucket's largest free vision budget, so the best bucket is the
    leftmost ``r >= L`` whose entry is ``>= v``, and inside it the topmost bin with room for ``v``.
    Bins that reached ``max_n`` samples, or whose free space is below the shortest item, leave the
    index for good.
    """
    size = 1 << capacity.bit_length()  # leaves 0..capacity
    tree = [-1] * (2 * size)  # -1: empty bucket
    buckets: dict[int, list[int]] = {}
    free: list[int] = []
    vfree: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    for t, length in enumerate(lens):
        v = vis[t] if vis is not None else 0
        r = _tree_first_at_least(tree, size, length, v)
        if r >= 0:
            stack = buckets[r]
            pos = len(stack) - 1
            while vfree[stack[pos]] < v:
                pos -= 1
            b = stack.pop(pos)
            if not stack:
                del buckets[r]
                _tree_set(tree, r + size, -1)
            elif vfree[b] == tree[r + size]:
                _tree_set(tree, r + size, max([vfree[x] for x in stack]))
        else:
            b = len(free)
            free.append(capacity)
            vfree.append(vcap)
            count.append(0)
        d = free[b] - length
        free[b] = d
        vf = vfree[b] - v
        vfree[b] = vf
        count[b] += 1
        item_bin[t] = b
        if d >= lmin and count[b] < max_n:
            stack = buckets.get(d)
            if stack is None:
                buckets[d] = [b]
                _tree_set(tree, d + size, vf)
            else:
                stack.append(b)
                if vf > tree[d + size]:
                    _tree_set(tree, d + size, vf)
    return item_bin, len(free)


def _bfd_capped(lens: list[int], capacity: int, max_n: int, lmin: int) -> tuple[list[int], int]:
    """Best fit with only a samples-per-bin cap: full bins leave the index, so the top of the smallest
    bucket ``r >= L`` is always the answer (bisect on the sorted free-space keys)."""
    buckets: dict[int, list[int]] = {}
    keys: list[int] = []
    free: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    bisect_left = bisect.bisect_left
    insort = bisect.insort
    for t, length in enumerate(lens):
        i = bisect_left(keys, length)
        if i < len(keys):
            r = keys[i]
            stack = buckets[r]
            b = stack.pop()
            if not stack:
                del buckets[r]
                del keys[i]
        else:
            b = len(free)
            free.append(capacity)
            count.append(0)
        d = free[b] - length
        free[b] = d
        c = count[b] + 1
        count[b] = c
        item_bin[t] = b
        if d >= lmin and c < max_n:
            stack = buckets.get(d)
            if stack is None:
                buckets[d] = [b]
                insort(keys, d)
            else:
                stack.append(b)
    return item_bin, len(free)


class _BinTree:
    """Max segment trees over bins (free tokens, free vision), grown by doubling; -1 marks closed bins."""

    __slots__ = ("size", "tf", "tv")

    def __init__(self) -> None:
        self.size = 1024
        self.tf = [-1] * (2 * self.size)
        self.tv = [-1] * (2 * self.size)

    def grow(self) -> None:
        size = self.size * 2
        for name in ("tf", "tv"):
            old = getattr(self, name)[self.size :]
            tree = [-1] * (2 * size)
            tree[size : size + len(old)] = old
            for j in range(size - 1, 0, -1):
                a, b = tree[2 * j], tree[2 * j + 1]
                tree[j] = a if a > b else b
            setattr(self, name, tree)
        self.size = size


def _ffd_histogram(distinct: np.ndarray, counts: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Exact first-fit decreasing, a whole length at a time.

    For a length L the lowest-numbered bin with room takes ``free // L`` items in a row (after each
    it is still the lowest with room), so one tree query serves several items; when no bin has room,
    the remaining items open bins of ``capacity // L`` items each, added to the tree in bulk.
    Same inputs and output as :func:`_bfd_histogram`.
    """
    bt = _BinTree()
    free: list[int] = []
    rec_r: list[range] = []
    rec_q: list[int] = []
    nb = 0
    for length, k in zip(distinct.tolist(), counts.tolist()):
        while k:
            b = _tree_first_at_least(bt.tf, bt.size, 0, length) if nb else -1
            if b >= 0:
                t = min(k, free[b] // length)
                rec_r.append(range(b, b + 1))
                rec_q.append(t)
                free[b] -= t * length
                _tree_set(bt.tf, bt.size + b, free[b])
                k -= t
                continue
            q = capacity // length
            nfull, rest = divmod(k, q)
            while nb + nfull + 1 > bt.size:
                bt.grow()
            if nfull:
                rec_r.append(range(nb, nb + nfull))
                rec_q.append(q)
                d = capacity - q * length
                free.extend([d] * nfull)
                tf = bt.tf
                lo = bt.size + nb
                hi = lo + nfull - 1
                tf[lo : hi + 1] = [d] * nfull
                lo >>= 1
                hi >>= 1
                while lo:  # rebuild the ancestors of the new leaves, level by level
                    for j in range(lo, hi + 1):
                        a, c = tf[2 * j], tf[2 * j + 1]
                        tf[j] = a if a > c else c
                    lo >>= 1
                    hi >>= 1
                nb += nfull
            if rest:
                rec_r.append(range(nb, nb + 1))
                rec_q.append(rest)
                free.append(capacity - rest * length)
                _tree_set(bt.tf, bt.size + nb, free[nb])
                nb += 1
            break
    return _expand_runs(rec_r, rec_q), nb


def _first_fit(
    lens: list[int], vis: list[int] | None, capacity: int, vcap: int, max_n: int, lmin: int
) -> tuple[list[int], int]:
    """Exact first fit: each item into the lowest-numbered bin where it satisfies every budget.

    A max tree over bins of free tokens finds the leftmost bin with room in O(log bins); with a
    vision budget a second tree (free vision) prunes a leftmost-first search over both.
    """
    bt = _BinTree()
    free: list[int] = []
    vfree: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    for t, length in enumerate(lens):
        tf = bt.tf
        size = bt.size
        if vis is None:
            b = _tree_first_at_least(tf, size, 0, length)
        else:
            v = vis[t]
            tv = bt.tv
            b = -1
            todo = [1]
            while todo:  # leftmost-first search, pruned where either budget cannot fit
                i = todo.pop()
                if tf[i] < length or tv[i] < v:
                    continue
                if i >= size:
                    b = i - size
                    break
                todo.append(2 * i + 1)
                todo.append(2 * i)
        if b < 0:
            b = len(free)
            if b == bt.size:
                bt.grow()
            free.append(capacity)
            vfree.append(vcap)
            count.append(0)
        d = free[b] - length
        free[b] = d
        count[b] += 1
        item_bin[t] = b
        alive = d >= lmin and count[b] < max_n
        _tree_set(bt.tf, b + bt.size, d if alive else -1)
        if vis is not None:
            vfree[b] -= vis[t]
            _tree_set(bt.tv, b + bt.size, vfree[b] if alive else -1)
    return item_bin, len(free)


def _next_fit(
    lens: list[int], vis: list[int] | None, capacity: int, vcap: int, max_n: int
) -> tuple[list[int], int]:
    """Next fit: keep one open bin; open a new one when the item does not fit it."""
    item_bin = [0] * len(lens)
    b = -1
    used = capacity + 1
    vused = 0
    n_in = 0
    if vis is None:
        for t, length in enumerate(lens):
            if used + length > capacity or n_in >= max_n:
                b += 1
                used = 0
                n_in = 0
            used += length
            n_in += 1
            item_bin[t] = b
    else:
        for t, length in enumerate(lens):
            v = vis[t]
            if used + length > capacity or vused + v > vcap or n_in >= max_n:
                b += 1
                used = vused = n_in = 0
            used += length
            vused += v
            n_in += 1
            item_bin[t] = b
    return item_bin, b + 1


# ----------------------------------------------------------------------------- pack


def pack(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    strategy: str = "bfd",
    vision: Sequence[int] | np.ndarray | None = None,
    vision_capacity: int | None = None,
    max_samples_per_bin: int | None = None,
    oversized: str = "raise",
    seed: int | None = None,
) -> PackResult:
    """Pack samples into bins of ``capacity`` tokens.

    Args:
        lengths: ``[N]`` positive ints: each sample's *expanded* length (text tokens + the vision
            tokens its images expand into). Lists, numpy arrays and CPU tensors are accepted.
        capacity: tokens per bin (the packed sequence length).
        strategy: ``"bfd"`` best-fit decreasing (default: fastest and tightest), ``"ffd"``
            first-fit decreasing, ``"ff"`` first-fit in data order (bins keep the data order more
            closely), ``"nf"`` next-fit (consecutive samples, the loosest).
        vision: optional ``[N]`` non-negative ints: a second per-sample cost with its own per-bin
            budget ``vision_capacity`` (ViT patches before merge, which bound the vision tower's
            activation memory; or images per sample to cap images per bin).
        vision_capacity: per-bin budget for ``vision`` (required when ``vision`` is given).
        max_samples_per_bin: optional cap on samples per bin.
        oversized: what to do with a sample longer than ``capacity``: ``"raise"`` (default),
            ``"truncate"`` (clip its length to ``capacity``; listed in ``result.truncated``; the
            caller must then cut the sample itself) or ``"skip"`` (listed in ``result.unpacked``).
            A sample whose vision cost alone exceeds ``vision_capacity`` cannot be truncated: it
            raises under ``"raise"`` and is skipped (and reported) under ``"truncate"``/``"skip"``.
        seed: if given, shuffle the order of the bins (not their contents) with this seed. The
            decreasing strategies open bins longest-sample first, so iterating them in creation
            order would feed a length curriculum to training; ``None`` keeps creation order.

    Returns:
        A :class:`PackResult`. Deterministic: the same input and seed give the same bins.

    Raises:
        ValueError / TypeError: naming the sample index, for non-integer, zero, negative or
            (under ``oversized="raise"``) oversized samples, and for bad arguments.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    _check_oversized(oversized)
    capacity = _as_positive_int(capacity, "capacity")
    lens = _as_int_array(lengths, "lengths", allow_zero=False)
    n = lens.size
    vis: np.ndarray | None = None
    vcap = 0
    if vision is not None:
        if vision_capacity is None:
            raise ValueError("vision is given but vision_capacity is None: pass the per-bin vision budget")
        vcap = _as_positive_int(vision_capacity, "vision_capacity")
        vis = _as_int_array(vision, "vision", allow_zero=True)
        if vis.size != n:
            raise ValueError(f"vision has {vis.size} entries but lengths has {n}: give one per sample")
    elif vision_capacity is not None:
        raise ValueError("vision_capacity is given but vision is None: pass the per-sample vision costs")
    max_n = n + 1
    if max_samples_per_bin is not None:
        max_n = _as_positive_int(max_samples_per_bin, "max_samples_per_bin")

    unpacked: list[Unpacked] = []
    truncated: dict[int, int] = {}
    skip = np.zeros(n, dtype=bool)
    over = lens > capacity
    vover = vis > vcap if vis is not None else np.zeros(n, dtype=bool)
    if over.any() or vover.any():
        i_len = int(np.argmax(over)) if over.any() else n
        i_vis = int(np.argmax(vover)) if vover.any() else n
        if oversized == "raise":
            if i_len <= i_vis:
                raise ValueError(_oversize_message(f"sample {i_len}", int(lens[i_len]), capacity))
            raise ValueError(_vision_oversize_message(f"sample {i_vis}", int(vis[i_vis]), vcap))
        # a vision budget cannot be truncated: such samples are skipped under both policies
        drop = vover | over if oversized == "skip" else vover
        for i in np.flatnonzero(drop).tolist():
            why = []
            if over[i]:
                why.append(f"length {int(lens[i])} > capacity {capacity}")
            if vover[i]:
                why.append(f"vision cost {int(vis[i])} > vision_capacity {vcap} (cannot be truncated)")
            unpacked.append(Unpacked(i, "; ".join(why)))
        skip = drop
        if oversized == "truncate":
            idx = np.flatnonzero(over & ~vover)
            truncated = dict(zip(idx.tolist(), lens[idx].tolist()))
            lens = np.where(over & ~vover, capacity, lens)
    keep = np.flatnonzero(~skip) if skip.any() else None
    sub = lens if keep is None else lens[keep]
    subv = None if vis is None else (vis if keep is None else vis[keep])
    m = sub.size

    bin_lengths = bin_vision = None
    if m == 0:
        order = np.zeros(0, dtype=np.int64)
        offsets = np.zeros(1, dtype=np.int64)
    else:
        constrained = subv is not None or max_n <= m
        perm = None
        if strategy in ("bfd", "ffd"):
            if subv is None:
                perm = _stable_argsort_desc(sub, capacity)
            else:
                perm = np.lexsort((-subv, -sub))  # lexsort is stable: ties keep index order
        if strategy in ("bfd", "ffd") and not constrained:
            if capacity <= 8 * m + (1 << 16):  # histogram over 0..capacity
                hist = np.bincount(sub, minlength=capacity + 1)
                distinct = np.flatnonzero(hist)[::-1]
                counts = hist[distinct]
            else:  # huge capacity: no capacity-sized arrays
                distinct, counts = np.unique(sub, return_counts=True)
                distinct, counts = distinct[::-1], counts[::-1]
            core = _bfd_histogram if strategy == "bfd" else _ffd_histogram
            item_bin, nb = core(distinct, counts, capacity)
            plens_arr = np.repeat(distinct, counts)  # lengths in processing order, without a gather
        else:
            plens_arr = sub if perm is None else sub[perm]
            plens = plens_arr.tolist()
            pvis = None if subv is None else (subv if perm is None else subv[perm]).tolist()
            lmin = int(sub.min())
            if strategy == "bfd" and pvis is None:
                ib, nb = _bfd_capped(plens, capacity, max_n, lmin)
            elif strategy == "bfd":
                if capacity > _MAX_TREE_CAPACITY:
                    raise ValueError(
                        f"capacity {capacity} is too large for best fit with a vision budget (its index "
                        f"has one slot per free-space value, at most {_MAX_TREE_CAPACITY}); use "
                        "strategy='ffd' or 'ff', whose index grows with the number of bins instead"
                    )
                ib, nb = _bfd_constrained(plens, pvis, capacity, vcap, max_n, lmin)
            elif strategy in ("ffd", "ff"):
                ib, nb = _first_fit(plens, pvis, capacity, vcap, max_n, lmin)
            else:
                ib, nb = _next_fit(plens, pvis, capacity, vcap, max_n)
            item_bin = np.asarray(ib, dtype=np.int64)
        # per-bin sums by bincount (exact: float64 holds integers up to 2**53)
        bin_lengths = np.bincount(item_bin, weights=plens_arr, minlength=nb).astype(np.int64)
        if subv is not None:
            pv = subv if perm is None else subv[perm]
            bin_vision = np.bincount(item_bin, weights=pv, minlength=nb).astype(np.int64)
        # bin-major order; inside a bin, processing order (the sort is stable)
        within = _stable_argsort_ids(item_bin, nb)
        order = within if perm is None else perm[within]
        if keep is not None:
            order = keep[order]
        offsets = np.zeros(nb + 1, dtype=np.int64)
        np.cumsum(np.bincount(item_bin, minlength=nb), out=offsets[1:])

    if seed is not None and offsets.size > 2:
        p = np.random.default_rng(seed).permutation(offsets.size - 1)
        order, offsets = _permute_bins(order, offsets, p)
        bin_lengths = bin_lengths[p]
        bin_vision = None if bin_vision is None else bin_vision[p]

    return PackResult(
        order=order,
        bin_offsets=offsets,
        lengths=lens,
        capacity=capacity,
        strategy=strategy,
        vision=vis,
        vision_capacity=vcap if vis is not None else None,
        max_samples_per_bin=max_samples_per_bin,
        unpacked=unpacked,
        truncated=truncated,
        bin_lengths=bin_lengths,
        bin_vision=bin_vision,
    )


def _permute_bins(order: np.ndarray, offsets: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder whole bins: new bin i is old bin ``p[i]``. Shapes [N], [B+1], [B] -> [N], [B+1]."""
    sizes = np.diff(offsets)[p]
    new_offsets = np.zeros(p.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=new_offsets[1:])
    src = np.repeat(offsets[:-1][p] - new_offsets[:-1], sizes) + np.arange(order.size)
    return order[src], new_offsets


# ----------------------------------------------------------------------------- streaming

_MT_BITS = 40  # low bits of an index key hold (~mtime) so equal free space sorts most-recent first
_MT_MASK = (1 << _MT_BITS) - 1


class PackedBin:
    """One bin from a :class:`StreamPacker`: the samples' keys and lengths in placement order, and totals.

    ``visions`` / ``vision_total`` are the per-sample vision costs and their sum when the packer has
    a ``vision_capacity`` (else None / 0).
    """

    __slots__ = ("_mtime", "keys", "lengths", "total", "vision_total", "visions")

    def __init__(
        self,
        keys: list[Any],
        lengths: list[int],
        total: int,
        visions: list[int] | None = None,
        vision_total: int = 0,
        _mtime: int = 0,
    ) -> None:
        self.keys = keys
        self.lengths = lengths
        self.total = total
        self.visions = visions
        self.vision_total = vision_total
        self._mtime = _mtime  # clock of the last placement (best-fit tie-break while open)

    def __len__(self) -> int:
        return len(self.keys)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedBin):
            return NotImplemented
        return (self.keys, self.lengths, self.total, self.visions, self.vision_total) == (
            other.keys,
            other.lengths,
            other.total,
            other.visions,
            other.vision_total,
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        v = "" if self.visions is None else f", visions={self.visions}, vision_total={self.vision_total}"
        return f"PackedBin(keys={self.keys}, lengths={self.lengths}, total={self.total}{v})"


@dataclass
class StreamStats:
    """Counters of a :class:`StreamPacker` (all samples are accounted for).

    ``samples_seen == samples_emitted + samples_open + samples_dropped + len(skipped)``.
    """

    samples_seen: int = 0
    samples_emitted: int = 0
    bins_emitted: int = 0
    tokens_emitted: int = 0
    samples_dropped: int = 0
    bins_dropped: int = 0
    tokens_dropped: int = 0
    capacity: int = 0
    skipped: list[Unpacked] = field(default_factory=list)
    truncated: list[tuple[Any, int]] = field(default_factory=list)  # (key, original length)

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
    """

    def __init__(
        self,
        capacity: int,
        buffer_size: int = 256,
        min_fill_ratio: float = 0.95,
        drop_last: bool = False,
        *,
        vision_capacity: int | None = None,
        max_samples_per_bin: int | None = None,
        oversized: str = "raise",
    ) -> None:
        self.capacity = _as_positive_int(capacity, "capacity")
        self.buffer_size = _as_positive_int(buffer_size, "buffer_size")
        if isinstance(min_fill_ratio, bool) or not isinstance(min_fill_ratio, numbers.Real):
            raise TypeError(f"min_fill_ratio must be a float in (0, 1], got {min_fill_ratio!r}")
        if not 0.0 < float(min_fill_ratio) <= 1.0:
            raise ValueError(f"min_fill_ratio must be in (0, 1], got {min_fill_ratio}")
        self.min_fill_ratio = float(min_fill_ratio)
        # integer threshold; round() first so 0.7 * 10 = 7.000000000000001 does not become 8
        self._threshold = max(1, math.ceil(round(self.min_fill_ratio * self.capacity, 9)))
        self.drop_last = bool(drop_last)
        self.vision_capacity = (
            None if vision_capacity is None else _as_positive_int(vision_capacity, "vision_capacity")
        )
        self.max_samples_per_bin = (
            None
            if max_samples_per_bin is None
            else _as_positive_int(max_samples_per_bin, "max_samples_per_bin")
        )
        _check_oversized(oversized)
        self.oversized = oversized
        self._max_n = self.max_samples_per_bin or (1 << 62)
        self._vcap = self.vision_capacity if self.vision_capacity is not None else 1 << 62
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
        return [self._as_packed(self._open[k]) for k in self._index]

    def _as_packed(self, b: PackedBin) -> PackedBin:
        return PackedBin(
            list(b.keys),
            list(b.lengths),
            b.total,
            None if b.visions is None else list(b.visions),
            b.vision_total,
        )

    # -- core
    def _validate(self, key: Any, length: Any, vision: Any) -> tuple[int, int] | None:
        """(length, vision) to place, or None if the sample is skipped (and reported)."""
        if type(length) is not int:
            if isinstance(length, bool | np.bool_) or not isinstance(length, numbers.Integral):
                raise TypeError(f"sample {key!r}: length {length!r} ({type(length).__name__}) is not an int")
            length = int(length)
        if length <= 0:
            raise ValueError(
                f"sample {key!r}: length {length} is {'zero' if length == 0 else 'negative'}; lengths "
                "must be positive expanded token counts. Filter such samples out before packing."
            )
        if type(vision) is not int:
            if isinstance(vision, bool | np.bool_) or not isinstance(vision, numbers.Integral):
                raise TypeError(f"sample {key!r}: vision {vision!r} ({type(vision).__name__}) is not an int")
            vision = int(vision)
        if vision < 0:
            raise ValueError(f"sample {key!r}: vision cost {vision} is negative")
        if vision and self.vision_capacity is None:
            raise ValueError(
                f"sample {key!r}: vision cost {vision} given but the packer has no vision_capacity; "
                "pass StreamPacker(..., vision_capacity=...) or vision=0"
            )
        if vision > self._vcap:
            if self.oversized == "raise":
                raise ValueError(_vision_oversize_message(f"sample {key!r}", vision, self._vcap))
            self.stats.skipped.append(
                Unpacked(key, f"vision cost {vision} > vision_capacity {self._vcap} (cannot be truncated)")
            )
            return None
        if length > self.capacity:
            if self.oversized == "raise":
                raise ValueError(_oversize_message(f"sample {key!r}", length, self.capacity))
            if self.oversized == "skip":
                self.stats.skipped.append(Unpacked(key, f"length {length} > capacity {self.capacity}"))
                return None
            self.stats.truncated.append((key, length))
            length = self.capacity
        return length, vision

    def _emit(self, b: PackedBin, out: list[PackedBin]) -> None:
        st = self.stats
        st.bins_emitted += 1
        st.samples_emitted += len(b.keys)
        st.tokens_emitted += b.total
        out.append(b)

    def _place(self, key: Any, length: int, vision: int, out: list[PackedBin]) -> None:
        index = self._index
        opened = self._open
        self._clock += 1
        clock = self._clock
        pos = bisect.bisect_left(index, length << _MT_BITS)
        n_open = len(index)
        if self.vision_capacity is not None and vision:
            vcap = self._vcap
            while pos < n_open and opened[index[pos]].vision_total + vision > vcap:
                pos += 1
        if pos < n_open:
            b = opened.pop(index.pop(pos))
            b.keys.append(key)
            b.lengths.append(length)
            if b.visions is not None:
                b.visions.append(vision)
            b.total += length
            b.vision_total += vision
        else:
            if length >= self._threshold or self._max_n == 1 or length == self.capacity:
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
            b = PackedBin([key], [length], length, None if self.vision_capacity is None else [vision], vision)
        free = self.capacity - b.total
        if b.total >= self._threshold or free == 0 or len(b.keys) >= self._max_n:
            self._emit(b, out)
            return
        b._mtime = clock
        k = (free << _MT_BITS) | (_MT_MASK - clock)
        pos = bisect.bisect_left(index, k)
        index.insert(pos, k)
        opened[k] = b

    def add(self, key: Any, length: int, vision: int = 0) -> list[PackedBin]:
        """Add one sample (``length`` = expanded tokens); return the bins this emitted (often none)."""
        lv = self._validate(key, length, vision)
        self.stats.samples_seen += 1
        out: list[PackedBin] = []
        if lv is not None:
            self._place(key, lv[0], lv[1], out)
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
        if visions is None and self.vision_capacity is None and self.max_samples_per_bin is None:
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
        for key, length, v in zip(keys, lengths, visions, strict=True):
            lv = validate(key, length, v)
            stats.samples_seen += 1
            if lv is not None:
                place(key, lv[0], lv[1], out)
        return out

    def _add_plain(self, keys: Iterable[Any], lengths: Iterable[int], out: list[PackedBin]) -> None:
        """:meth:`_place` inlined for the common configuration (token budget only), state in locals."""
        index = self._index
        opened = self._open
        capacity = self.capacity
        thr = self._threshold
        buffer_size = self.buffer_size
        validate = self._validate
        bisect_left = bisect.bisect_left
        stats = self.stats
        clock = self._clock
        seen = emitted = nbins = tokens = 0
        try:
            for key, length in zip(keys, lengths, strict=True):
                if type(length) is not int or not 0 < length <= capacity:
                    lv = validate(key, length, 0)
                    if lv is None:
                        seen += 1
                        continue
                    length = lv[0]
                seen += 1
                clock += 1
                pos = bisect_left(index, length << _MT_BITS)
                if pos < len(index):
                    b = opened.pop(index.pop(pos))
                    b.keys.append(key)
                    b.lengths.append(length)
                    total = b.total + length
                    b.total = total
                elif length >= thr or length == capacity:
                    out.append(PackedBin([key], [length], length))
                    emitted += 1
                    nbins += 1
                    tokens += length
                    continue
                else:
                    if len(index) >= buffer_size:  # buffer full: emit the fullest bin
                        f = opened.pop(index.pop(0))
                        out.append(f)
                        emitted += len(f.keys)
                        nbins += 1
                        tokens += f.total
                    b = PackedBin([key], [length], length)
                    total = length
                if total >= thr or total == capacity:
                    out.append(b)
                    emitted += len(b.keys)
                    nbins += 1
                    tokens += total
                    continue
                b._mtime = clock
                k = ((capacity - total) << _MT_BITS) | (_MT_MASK - clock)
                pos = bisect_left(index, k)
                index.insert(pos, k)
                opened[k] = b
        finally:  # also on a bad sample: the state stays consistent with the samples before it
            self._clock = clock
            stats.samples_seen += seen
            stats.samples_emitted += emitted
            stats.bins_emitted += nbins
            stats.tokens_emitted += tokens

    def flush(self) -> list[PackedBin]:
        """Emit every open bin (fullest first), e.g. at the end of an epoch.

        With ``drop_last=True``, bins holding fewer than ``min_fill_ratio * capacity`` tokens are not
        returned: they go to :attr:`dropped` and ``stats.samples_dropped`` / ``bins_dropped``, so
        the samples are accounted for (train on them next epoch or log them).
        """
        out: list[PackedBin] = []
        opened = [self._open[k] for k in self._index]
        self._open = {}
        self._index = []
        st = self.stats
        for b in opened:
            if self.drop_last and b.total < self._threshold:
                st.bins_dropped += 1
                st.samples_dropped += len(b.keys)
                st.tokens_dropped += b.total
                self.dropped.append(b)
            else:
                self._emit(b, out)
        return out

    # -- state
    def state_dict(self) -> dict[str, Any]:
        """The full state as plain Python (lists/dicts/ints/strs, plus the user's sample keys)."""
        st = self.stats
        return {
            "version": 1,
            "config": {
                "capacity": self.capacity,
                "buffer_size": self.buffer_size,
                "min_fill_ratio": self.min_fill_ratio,
                "drop_last": self.drop_last,
                "vision_capacity": self.vision_capacity,
                "max_samples_per_bin": self.max_samples_per_bin,
                "oversized": self.oversized,
            },
            "clock": self._clock,
            "open": [
                {
                    "keys": list(b.keys),
                    "lengths": list(b.lengths),
                    "visions": None if b.visions is None else list(b.visions),
                    "mtime": b._mtime,
                }
                for b in (self._open[k] for k in self._index)
            ],
            "stats": {
                "samples_seen": st.samples_seen,
                "samples_emitted": st.samples_emitted,
                "bins_emitted": st.bins_emitted,
                "tokens_emitted": st.tokens_emitted,
                "samples_dropped": st.samples_dropped,
                "bins_dropped": st.bins_dropped,
                "tokens_dropped": st.tokens_dropped,
                "skipped": [[u.index, u.reason] for u in st.skipped],
                "truncated": [[k, n] for k, n in st.truncated],
            },
            "dropped": [
                {
                    "keys": list(b.keys),
                    "lengths": list(b.lengths),
                    "visions": None if b.visions is None else list(b.visions),
                }
                for b in self.dropped
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (also after a JSON round trip). The configuration must match.

        JSON turns tuple keys such as ``(shard, index)`` into lists; list keys are turned back into
        tuples here, so the bins emitted after resuming equal those of an uninterrupted run.
        """
        if state.get("version") != 1:
            raise ValueError(f"unsupported StreamPacker state version {state.get('version')!r}")
        mine = self.state_dict()["config"]
        theirs = state["config"]
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            raise ValueError(
                "StreamPacker state was saved with a different configuration (saved, current): "
                f"{diff}; build the packer with the saved configuration to resume exactly"
            )
        self._reset_state()
        self._clock = int(state["clock"])
        entries = []
        for ob in state["open"]:
            lengths = [int(x) for x in ob["lengths"]]
            visions = None if ob["visions"] is None else [int(x) for x in ob["visions"]]
            b = PackedBin(
                [_key(k) for k in ob["keys"]],
                lengths,
                sum(lengths),
                visions,
                sum(visions or ()),
                int(ob["mtime"]),
            )
            entries.append((((self.capacity - b.total) << _MT_BITS) | (_MT_MASK - b._mtime), b))
        entries.sort(key=lambda e: e[0])
        self._index = [k for k, _ in entries]
        self._open = dict(entries)
        s = state["stats"]
        st = self.stats
        for name in (
            "samples_seen",
            "samples_emitted",
            "bins_emitted",
            "tokens_emitted",
            "samples_dropped",
            "bins_dropped",
            "tokens_dropped",
        ):
            setattr(st, name, int(s[name]))
        st.skipped = [Unpacked(_key(k), r) for k, r in s["skipped"]]
        st.truncated = [(_key(k), int(n)) for k, n in s["truncated"]]
        self.dropped = [
            PackedBin(
                [_key(k) for k in d["keys"]],
                [int(x) for x in d["lengths"]],
                sum(int(x) for x in d["lengths"]),
                None if d["visions"] is None else [int(x) for x in d["visions"]],
                sum(int(x) for x in d["visions"] or ()),
            )
            for d in state["dropped"]
        ]


def _key(key: Any) -> Any:
    """A sample key read back from a state dict: JSON lists become tuples again (recursively)."""
    return tuple(_key(k) for k in key) if isinstance(key, list) else key


# ----------------------------------------------------------------------------- DP balancing


def _flatten_per_bin(values: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-bin ints or per-bin sequences of ints -> (flat int64 values, offsets [B+1])."""
    if isinstance(values, PackResult):
        return values.lengths[values.order], values.bin_offsets
    items = list(values)
    if all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in items):
        flat = _as_int_array(items, name, allow_zero=True)
        return flat, np.arange(flat.size + 1, dtype=np.int64)
    sizes = []
    chunks = []
    for b, x in enumerate(items):
        if isinstance(x, numbers.Integral) and not isinstance(x, bool):
            x = [x]
        try:
            arr = _as_int_array(x, f"{name}[{b}]", allow_zero=True)
        except (TypeError, ValueError) as e:
            raise type(e)(f"bin {b}: {e}") from None
        chunks.append(arr)
        sizes.append(arr.size)
    offsets = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    return flat, offsets


def _per_bin_sum(flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum per bin, allowing empty bins. Shapes [N], [B+1] -> [B] float64."""
    c = np.zeros(flat.size + 1, dtype=np.float64)
    np.cumsum(flat, out=c[1:])
    return c[offsets[1:]] - c[offsets[:-1]]


def bin_costs(
    bins: PackResult | Sequence[int] | Sequence[Sequence[int]],
    *,
    cost: str | Callable[[np.ndarray], float] = "attention",
    vision: Sequence[int] | Sequence[Sequence[int]] | None = None,
    hidden_size: int = 4096,
    vision_hidden_size: int = 1280,
    vision_weight: float | None = None,
) -> np.ndarray:
    """Compute cost per bin, float64 ``[num_bins]``.

    A transformer layer costs about ``12 h^2 s + 2 h s^2`` FLOPs on a sequence of ``s`` tokens
    (projections + MLP, then attention), i.e. proportional to ``s^2 + 6 h s``; in a packed bin the
    attention term is per *sample* (varlen attention never crosses a boundary)::

        cost(bin) = sum_i (len_i^2 + 6*hidden_size*len_i)                            # language model
                  + vision_weight * sum_img (p^2 + 6*vision_hidden_size*p)         # vision tower

    Args:
        bins: a :class:`PackResult`, per-bin sample lengths (list of lists), or per-bin totals
            (ints: then each bin counts as a single sequence, which overstates attention).
        cost: ``"attention"`` (the formula above), ``"tokens"`` (just lengths and patches), or a
            callable mapping one bin's int64 sample lengths to its cost.
        vision: per bin, the ViT patch counts *before merge* of its images (a list per bin), or one
            int per bin (its patches as one image). The ViT attends within each image.
        hidden_size / vision_hidden_size: model widths for the linear terms (defaults: a 7B LLM,
            Qwen2-VL's ViT).
        vision_weight: ViT work per unit of the formula relative to the LLM's; default
            ``vision_hidden_size / hidden_size`` (equal depth). Scale by ViT depth / LLM depth.
    """
    flat, offsets = _flatten_per_bin(bins, "bins")
    nb = offsets.size - 1
    if callable(cost):
        out = np.array([float(cost(flat[a:b])) for a, b in itertools.pairwise(offsets)], dtype=np.float64)
        vmode = "attention"
    elif cost == "attention":
        f = flat.astype(np.float64)
        out = _per_bin_sum(f * f + 6.0 * hidden_size * f, offsets)
        vmode = "attention"
    elif cost == "tokens":
        out = _per_bin_sum(flat.astype(np.float64), offsets)
        vmode = "tokens"
    else:
        raise ValueError(f"cost must be 'attention', 'tokens' or a callable, got {cost!r}")
    if vision is not None:
        vflat, voff = _flatten_per_bin(vision, "vision")
        if voff.size - 1 != nb:
            raise ValueError(f"vision has {voff.size - 1} bins but bins has {nb}: give one entry per bin")
        w = vision_hidden_size / hidden_size if vision_weight is None else float(vision_weight)
        p = vflat.astype(np.float64)
        vc = p * p + 6.0 * vision_hidden_size * p if vmode == "attention" else p
        out = out + w * _per_bin_sum(vc, voff)
    return out


def partition_imbalance(costs: Sequence[float] | np.ndarray, partition: Sequence[Sequence[int]]) -> float:
    """max rank load / mean rank load (1.0 = perfectly balanced)."""
    c = np.asarray(costs, dtype=np.float64)
    loads = np.array([c[np.asarray(p, dtype=np.int64)].sum() if len(p) else 0.0 for p in partition])
    mean = loads.mean() if loads.size else 0.0
    return float(loads.max() / mean) if mean > 0 else 1.0


def _karmarkar_karp(costs: list[float], k: int, equal_count: bool) -> list[list[int]]:
    """k-way largest differencing (Karmarkar-Karp), deterministic.

    Each state is k partial sets sorted by load; the two states with the largest spread are merged
    by pairing the heaviest set of one with the lightest of the other, until one state remains.
    With ``equal_count`` the initial states are k consecutive items of the sorted costs, one per
    set, so every rank ends with the same number of bins.
    """
    import heapq

    n = len(costs)
    order = sorted(range(n), key=lambda i: (costs[i], i))
    heap: list[tuple[float, int, list[tuple[float, int, Any]]]] = []
    # a set is (load, first_item, items) with items a nested tuple tree (cheap merges)
    seq = 0

    def push(sets: list[tuple[float, int, Any]]) -> None:
        nonlocal seq
        sets.sort(key=lambda s: (-s[0], s[1]))
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), seq, sets))
        seq += 1

    if equal_count:
        for off in range(0, n, k):
            push([(costs[i], i, i) for i in order[off : off + k]])
    else:
        for i in order:
            push([(costs[i], i, i)] + [(0.0, n + j, None) for j in range(k - 1)])
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = [(sa[0] + sb[0], min(sa[1], sb[1]), (sa[2], sb[2])) for sa, sb in zip(a, reversed(b))]
        push(merged)
    out: list[list[int]] = []
    for _load, _first, tree in heap[0][2] if heap else []:
        items: list[int] = []
        stack = [tree]
        while stack:
            t = stack.pop()
            if t is None:
                continue
            if isinstance(t, tuple):
                stack.extend(t)
            else:
                items.append(t)
        out.append(sorted(items))
    while len(out) < k:
        out.append([])
    return out


def balance_bins(
    bins: PackResult | Sequence[int] | Sequence[Sequence[int]],
    world_size: int,
    *,
    cost: str | Callable[[np.ndarray], float] = "attention",
    vision: Sequence[int] | Sequence[Sequence[int]] | None = None,
    equal_count: bool = False,
    hidden_size: int = 4096,
    vision_hidden_size: int = 1280,
    vision_weight: float | None = None,
) -> list[list[int]]:
    """Deal bins to ``world_size`` data-parallel ranks so that their compute is balanced.

    Costs come from :func:`bin_costs` (attention as ``sum len^2`` per sample, linear layers, and
    the vision tower's per-image work), then bins are split with Karmarkar-Karp largest
    differencing (as veRL's ``seqlen_balancing`` does for text)::

        bins (cost)   a(9) b(7) c(6) d(5) e(4) f(3)          world_size = 2
        rank 0        a(9) + e(4) + f(3)    = 17
        rank 1        b(7) + c(6) + d(5)    = 18            max / mean = 1.03

    Args:
        bins, cost, vision, hidden_size, vision_hidden_size, vision_weight: see :func:`bin_costs`.
        world_size: number of ranks.
        equal_count: give every rank the same number of bins (requires ``num_bins % world_size ==
            0``). Use it when each bin is one micro-batch: ranks with different numbers of
            micro-batches would desynchronise gradient accumulation collectives.

    Returns:
        ``world_size`` lists of bin indices (each sorted ascending); with fewer bins than ranks the
        extra ranks get empty lists (no error: check for them if every rank must step). The achieved imbalance
        (max rank cost / mean) is logged at DEBUG; compute it with :func:`partition_imbalance`.
    """
    world_size = _as_positive_int(world_size, "world_size")
    costs = bin_costs(
        bins,
        cost=cost,
        vision=vision,
        hidden_size=hidden_size,
        vision_hidden_size=vision_hidden_size,
        vision_weight=vision_weight,
    )
    nb = costs.size
    if equal_count and nb % world_size:
        raise ValueError(
            f"equal_count=True needs num_bins divisible by world_size, got {nb} bins for {world_size} "
            f"ranks: drop or add {nb % world_size} / {world_size - nb % world_size} bins first"
        )
    parts = _karmarkar_karp(costs.tolist(), world_size, equal_count)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "balance_bins: %d bins on %d ranks, imbalance (max/mean) %.4f",
            nb,
            world_size,
            partition_imbalance(costs, parts),
        )
    return parts
