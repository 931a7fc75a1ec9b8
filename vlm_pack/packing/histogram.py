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
    take, new_bins = (_take_runs, _new_runs) if ranges else (_take_ids, _new_ids)
    shortest = int(distinct[-1])
    buckets: dict[int, list[Any]] = {}  # free space -> [bin count, stack of bins (top last)]
    free_keys: list[int] = []  # sorted free-space values of the non-empty buckets
    placed: list[Any] = []  # placement record: bins (ids or runs) in order ...
    items_per_bin: list[int] = []  # ... and how many items each took in a row
    new_keys: list[int] = []  # buckets created while placing one length, indexed afterwards

    def place(stack: list[Any], num_bins: int, items: int, free: int) -> None:
        """Record that each bin of ``stack`` took ``items`` items and now has ``free`` space: push them
        on top of that bucket (bins with less than the shortest length free never take another item)."""
        placed.extend(stack)
        items_per_bin.extend([items] * len(stack))
        if free >= shortest:
            bucket = buckets.get(free)
            if bucket is None:
                buckets[free] = [num_bins, stack]
                new_keys.append(free)
            else:
                bucket[0] += num_bins
                bucket[1] += stack

    num_opened = 0
    bisect_left = bisect.bisect_left
    insort = bisect.insort
    for length, items_left in zip(distinct.tolist(), counts.tolist()):
        first = pos = bisect_left(free_keys, length)  # the smallest bucket with room
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
                place(take(bucket[1], num_full), num_full, per_bin, free - per_bin * length)
            if rest:  # lands at >= length, where every bucket is now empty
                place(take(bucket[1], 1), 1, rest, free - rest * length)
            bucket[0] = in_bucket = in_bucket - num_full - (rest > 0)
            if not in_bucket:
                del buckets[free]
                pos += 1
        del free_keys[first:pos]
        if items_left:  # no bin has room: open bins of capacity // length items, the last maybe fewer
            per_bin = capacity // length
            num_full, rest = divmod(items_left, per_bin)
            if num_full:
                place(new_bins(num_opened, num_full), num_full, per_bin, capacity - per_bin * length)
                num_opened += num_full
            if rest:
                place(new_bins(num_opened, 1), 1, rest, capacity - rest * length)
                num_opened += 1
        for free in new_keys:
            insort(free_keys, free)
        new_keys.clear()
    return _expand(placed, items_per_bin, ranges), num_opened


# A stack of bins is a list of bin ids, or of ``range`` runs of ids (bins opened together move
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


def _expand(placed: list[Any], items_per_bin: list[int], ranges: bool) -> np.ndarray:
    if ranges:
        return _expand_runs(placed, items_per_bin)
    return np.repeat(np.array(placed, dtype=np.int64), np.array(items_per_bin, dtype=np.int64))


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


