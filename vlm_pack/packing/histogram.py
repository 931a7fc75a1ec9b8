"""Whole-length packing cores: exact BFD and FFD on a length histogram, one Python step per bucket move.

Same contract as ``per_item.py``: items in processing order (longest first) in, ``item_bin`` out.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from .per_item import _BinTree, _tree_first_at_least, _tree_set


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
    lengths are mostly distinct) and lists of ``range`` runs; only ``take`` / ``new_bins`` differ.
    ``ranges=None`` picks by items per length.
    Returns ``item_bin`` [n] for the items in processing order, and the bin count.
    """
    if distinct.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    if ranges is None:
        ranges = int(counts.sum()) >= 32 * distinct.size
    table = _Buckets(int(distinct[-1]), ranges)
    # Items longer than capacity / 2 never share a bin: each opens its own, in order, and the bins of
    # one length form one bucket at free space capacity - length (ascending over this loop).
    num_big = int(np.searchsorted(-distinct, -(capacity // 2), side="left"))
    big_counts = counts[:num_big]
    num_big_items = num_opened = int(big_counts.sum())
    ends = np.cumsum(big_counts).tolist()
    buckets, free_keys, shortest = table.buckets, table.free_keys, table.shortest
    for length, count, end in zip(distinct[:num_big].tolist(), big_counts.tolist(), ends):
        free = capacity - length
        if free >= shortest:
            run = range(end - count, end)
            buckets[free] = [count, run] if ranges else [count, *run]
            free_keys.append(free)
    lengths = distinct[num_big:].tolist()
    counts_left = counts[num_big:].tolist()
    index = 0
    while index < len(lengths):
        if counts_left[index] <= _FEW and not ranges:  # a run of lengths with a handful of items each
            index, num_opened = _place_few(lengths, counts_left, index, table, capacity, num_opened)
        else:
            num_opened = _place_length(lengths[index], counts_left[index], table, capacity, num_opened)
            index += 1
    placed = table.expand()
    return np.concatenate([np.arange(num_big_items, dtype=np.int64), placed]), num_opened


_FEW = 16  # items of one length below which bin-by-bin placement beats moving whole buckets


class _Buckets:
    """Open bins by free space: ``buckets[free] = [bin count, *stack]`` (top of the stack last) and the
    sorted ``free_keys``; plus the placement record (bins in placement order, items each took)."""

    __slots__ = (
        "buckets",
        "free_keys",
        "items_per_bin",
        "new_bins",
        "new_keys",
        "placed",
        "ranges",
        "shortest",
        "take",
    )

    def __init__(self, shortest: int, ranges: bool) -> None:
        self.buckets: dict[int, list[Any]] = {}
        self.free_keys: list[int] = []
        self.new_keys: list[int] = []  # buckets created while placing one length, indexed afterwards
        self.placed: list[Any] = []
        self.items_per_bin: list[int] = []
        self.shortest = shortest  # bins with less free space never take another item
        self.ranges = ranges
        self.take, self.new_bins = (_take_runs, _new_runs) if ranges else (_take_ids, _new_ids)

    def place(self, stack: list[Any], num_bins: int, items: int, free: int) -> None:
        """Record that each bin of ``stack`` took ``items`` items and now has ``free`` space; push the
        bins, in order, on top of that bucket."""
        self.placed += stack
        self.items_per_bin += [items] * len(stack)
        if free >= self.shortest:
            bucket = self.buckets.get(free)
            if bucket is None:
                self.buckets[free] = [num_bins, *stack]
                self.new_keys.append(free)
            else:
                bucket[0] += num_bins
                bucket += stack

    def expand(self) -> np.ndarray:
        """The placement record as ``item_bin`` (int64, one entry per placed item)."""
        if self.ranges:
            return _expand_runs(self.placed, self.items_per_bin)
        return np.repeat(np.array(self.placed, dtype=np.int64), np.array(self.items_per_bin, dtype=np.int64))


def _place_length(length: int, items_left: int, table: _Buckets, capacity: int, num_opened: int) -> int:
    """Place every item of one length, a bucket at a time; return the new number of opened bins."""
    free_keys = table.free_keys
    buckets = table.buckets
    take = table.take
    place = table.place
    first = pos = bisect.bisect_left(free_keys, length)  # the smallest bucket with room
    num_keys = len(free_keys)
    while items_left and pos < num_keys:
        free = free_keys[pos]
        bucket = buckets[free]
        per_bin = free // length
        in_bucket = bucket[0]
        if items_left >= per_bin * in_bucket:  # the whole bucket fills up with this length
            num_full, rest = in_bucket, 0
            items_left -= per_bin * in_bucket
        else:  # num_full bins take per_bin items, one more takes the rest
            num_full, rest = divmod(items_left, per_bin)
            items_left = 0
        if num_full:
            place(take(bucket, num_full), num_full, per_bin, free - per_bin * length)
        if rest:  # lands at >= length, where every bucket is now empty
            place(take(bucket, 1), 1, rest, free - rest * length)
        bucket[0] = in_bucket = in_bucket - num_full - (rest > 0)
        if not in_bucket:
            del buckets[free]
            pos += 1
    del free_keys[first:pos]
    if items_left:  # no bin has room: open bins of capacity // length items, the last maybe fewer
        per_bin = capacity // length
        num_full, rest = divmod(items_left, per_bin)
        if num_full:
            place(table.new_bins(num_opened, num_full), num_full, per_bin, capacity - per_bin * length)
            num_opened += num_full
        if rest:
            place(table.new_bins(num_opened, 1), 1, rest, capacity - rest * length)
            num_opened += 1
    for free in table.new_keys:
        bisect.insort(free_keys, free)
    table.new_keys.clear()
    return num_opened


def _place_few(
    lengths: list[int], counts: list[int], start: int, table: _Buckets, capacity: int, num_opened: int
) -> tuple[int, int]:
    """Place the lengths from ``start`` on while each has at most ``_FEW`` items, bin by bin (stacks of
    bin ids only); return the index of the first length not placed and the new number of opened bins.

    Cheaper than bucket-at-a-time when lengths are spread out: the top bin of the smallest bucket with
    room (``free_keys[pos]``) takes what it can, and ``free_keys`` is kept sorted in place.
    """
    free_keys = table.free_keys
    buckets = table.buckets
    append_bin = table.placed.append
    append_items = table.items_per_bin.append
    shortest = table.shortest
    bisect_left = bisect.bisect_left
    insort = bisect.insort
    few = _FEW
    for index in range(start, len(lengths)):
        items_left = counts[index]
        if items_left > few:
            return index, num_opened
        length = lengths[index]
        pos = bisect_left(free_keys, length)
        while items_left:
            if pos < len(free_keys):
                free = free_keys[pos]
                bucket = buckets[free]
                bin_id = bucket.pop()
                bucket[0] -= 1
                emptied = not bucket[0]
                if emptied:
                    del buckets[free]
            else:  # no bin has room: open one
                free, bin_id, emptied = capacity, num_opened, False
                num_opened += 1
            items = free // length
            if items > items_left:
                items = items_left
            items_left -= items
            append_bin(bin_id)
            append_items(items)
            free -= items * length
            if free >= length:  # done, and the bin keeps room: no bucket in [length, old free)
                buckets[free] = [1, bin_id]
                if emptied:
                    free_keys[pos] = free
                else:
                    free_keys.insert(pos, free)
                break
            if emptied:
                del free_keys[pos]
            if free >= shortest:  # below length: lands under pos
                bucket = buckets.get(free)
                if bucket is None:
                    buckets[free] = [1, bin_id]
                    insort(free_keys, free)
                    pos += 1
                else:
                    bucket[0] += 1
                    bucket.append(bin_id)
    return len(lengths), num_opened


# A stack of bins (a bucket after its count) holds bin ids, or ``range`` runs of ids (bins opened together move
# together, so a million samples become a few thousand runs). ``take`` pops ``n`` bins off the top
# and returns them in pop order (the most recently modified bin first).


def _take_ids(stack: list[int], n: int) -> list[int]:
    taken = stack[: -n - 1 : -1]
    del stack[-n:]
    return taken


def _new_ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _take_runs(stack: list[range], n: int) -> list[range]:
    taken = []
    while n:
        run = stack[-1]
        size = len(run)
        if size <= n:
            stack.pop()
            taken.append(run[::-1])
            n -= size
        else:
            taken.append(run[: size - n - 1 : -1])
            stack[-1] = run[: size - n]
            n = 0
    return taken


def _new_runs(start: int, n: int) -> list[range]:
    return [range(start, start + n)]


def _expand_runs(placed: list[range], items_per_bin: list[int]) -> np.ndarray:
    """Placement record -> ``item_bin``: run ``rec_r[i]`` of bins, each taking ``rec_q[i]`` items in a row."""
    num_runs = len(placed)
    starts = np.fromiter((run.start for run in placed), np.int64, num_runs)
    steps = np.fromiter((run.step for run in placed), np.int64, num_runs)
    sizes = np.fromiter(map(len, placed), np.int64, num_runs)
    first = np.zeros(num_runs, dtype=np.int64)
    np.cumsum(sizes[:-1], out=first[1:])
    pos = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(first, sizes)
    bins = np.repeat(starts, sizes) + pos * np.repeat(steps, sizes)
    return np.repeat(bins, np.repeat(np.array(items_per_bin, dtype=np.int64), sizes))


def _ffd_histogram(distinct: np.ndarray, counts: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Exact first-fit decreasing, a whole length at a time.

    For a length L the lowest-numbered bin with room takes ``free // L`` items in a row (after each
    it is still the lowest with room), so one tree query serves several items; when no bin has room,
    the remaining items open bins of ``capacity // L`` items each, added to the tree in bulk.
    Same inputs and output as :func:`_bfd_histogram`.
    """
    trees = _BinTree()
    free: list[int] = []
    placed: list[range] = []
    items_per_bin: list[int] = []
    num_opened = 0
    for length, items_left in zip(distinct.tolist(), counts.tolist()):
        while items_left:
            bin_id = _tree_first_at_least(trees.tf, trees.size, 0, length) if num_opened else -1
            if bin_id >= 0:
                items = min(items_left, free[bin_id] // length)
                placed.append(range(bin_id, bin_id + 1))
                items_per_bin.append(items)
                free[bin_id] -= items * length
                _tree_set(trees.tf, trees.size + bin_id, free[bin_id])
                items_left -= items
                continue
            per_bin = capacity // length
            num_full, rest = divmod(items_left, per_bin)
            while num_opened + num_full + 1 > trees.size:
                trees.grow()
            if num_full:
                placed.append(range(num_opened, num_opened + num_full))
                items_per_bin.append(per_bin)
                left = capacity - per_bin * length
                free.extend([left] * num_full)
                free_tree = trees.tf
                lo = trees.size + num_opened
                hi = lo + num_full - 1
                free_tree[lo : hi + 1] = [left] * num_full
                lo >>= 1
                hi >>= 1
                while lo:  # rebuild the ancestors of the new leaves, level by level
                    for node in range(lo, hi + 1):
                        left_max, right_max = free_tree[2 * node], free_tree[2 * node + 1]
                        free_tree[node] = left_max if left_max > right_max else right_max
                    lo >>= 1
                    hi >>= 1
                num_opened += num_full
            if rest:
                placed.append(range(num_opened, num_opened + 1))
                items_per_bin.append(rest)
                free.append(capacity - rest * length)
                _tree_set(trees.tf, trees.size + num_opened, free[num_opened])
                num_opened += 1
            break
    return _expand_runs(placed, items_per_bin), num_opened
