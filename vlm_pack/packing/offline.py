"""``pack``: a whole dataset into bins, offline (BFD, FFD, first fit, next fit) with optional budgets."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .bins import (
    PackResult,
    Unpacked,
    _as_int_array,
    _as_positive_int,
    _check_oversized,
    _oversize_message,
    _vision_oversize_message,
)
from .histogram import _bfd_histogram, _ffd_histogram
from .per_item import _bfd_capped, _bfd_constrained, _first_fit, _next_fit

STRATEGIES = ("bfd", "ffd", "ff", "nf")
_MAX_TREE_CAPACITY = 1 << 24


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
