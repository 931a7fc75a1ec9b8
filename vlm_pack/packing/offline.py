"""``pack``: a whole dataset into bins, offline (BFD, FFD, first fit, next fit) with optional budgets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..config import PackingConfig
from .bins import (
    PackResult,
    Unpacked,
    _as_int_array,
    _length_text,
    _oversize_message,
    _vision_oversize_message,
    padded_lengths,
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
    config: PackingConfig | int | None = None,
    *,
    strategy: str = "bfd",
    vision: Sequence[int] | np.ndarray | None = None,
    **knobs: Any,
) -> PackResult:
    """Pack samples into bins of ``capacity`` tokens.

    ``config``: a :class:`~vlm_pack.config.PackingConfig` (or the capacity, an int), with ``knobs`` (its field
    names: ``capacity=``, ``oversized=`` ...) over it; PackingConfig validates them. ``pack`` reads
    ``capacity``, ``vision_capacity``, ``max_samples_per_bin``, ``oversized``, ``shuffle_seed`` and
    ``pad_to_multiple_of``; the streaming fields are :class:`StreamPacker`'s and the pipelines'.

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
        shuffle_seed: if given, shuffle the order of the bins (not their contents) with this seed. The
            decreasing strategies open bins longest-sample first, so iterating them in creation
            order would feed a length curriculum to training; ``None`` keeps creation order.
        pad_to_multiple_of: plan on each length rounded up to this multiple (:func:`padded_lengths`), the
            span the collator gives a sample under ``PackingCollator(pad_to_multiple_of=...)``: pass the
            collator's value, or a bin of the plan can need two rows. ``capacity`` must be a multiple of it.

    Returns:
        A :class:`PackResult`. Deterministic: the same input and seed give the same bins. Its ``lengths``
        and ``bin_lengths`` are the padded spans.

    Raises:
        ValueError / TypeError: naming the sample index, for non-integer, zero, negative or
            (under ``oversized="raise"``) oversized samples, and for bad arguments.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    cfg = PackingConfig.resolve("pack", config, **knobs)
    capacity, multiple, oversized = cfg.capacity, cfg.pad_to_multiple_of, cfg.oversized
    raw, vis, vision_cap = _validated(lengths, vision, cfg.vision_capacity)
    lens = padded_lengths(raw, multiple)
    cap = cfg.max_samples_per_bin
    sample_cap = lens.size + 1 if cap is None else cap  # n + 1: no bin reaches it
    lens, keep, unpacked, truncated = _apply_oversized(raw, lens, vis, capacity, vision_cap, oversized, multiple)
    sub, sub_vis = (lens, vis) if keep is None else (lens[keep], None if vis is None else vis[keep])

    order, offsets, bin_lengths, bin_vision = _bins(strategy, sub, sub_vis, keep, capacity, vision_cap, sample_cap)
    if cfg.shuffle_seed is not None and offsets.size > 2:
        new_to_old = np.random.default_rng(cfg.shuffle_seed).permutation(offsets.size - 1)
        order, offsets = _permute_bins(order, offsets, new_to_old)
        bin_lengths = bin_lengths[new_to_old]
        bin_vision = None if bin_vision is None else bin_vision[new_to_old]

    return PackResult(
        order=order,
        bin_offsets=offsets,
        lengths=lens,
        capacity=capacity,
        strategy=strategy,
        vision=vis,
        vision_capacity=vision_cap if vis is not None else None,
        max_samples_per_bin=cap,
        unpacked=unpacked,
        truncated=truncated,
        bin_lengths=bin_lengths,
        bin_vision=bin_vision,
        pad_to_multiple_of=multiple,
    )


def _bins(
    strategy: str,
    sub: np.ndarray,
    sub_vis: np.ndarray | None,
    keep: np.ndarray | None,
    capacity: int,
    vision_cap: int,
    sample_cap: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The packed samples ``sub`` ([M] lengths, ``sub_vis`` their vision costs; ``keep``: their indices among
    all samples, None for all) into bins: ``(order [M], offsets [B+1], bin_lengths [B], bin_vision [B])``,
    ``order`` bin-major over the original indices."""
    if sub.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), None, None
    perm, item_bin, num_bins, ordered = _run_core(strategy, sub, sub_vis, capacity, vision_cap, sample_cap)
    # per-bin sums by bincount (exact: float64 holds integers up to 2**53)
    bin_lengths = np.bincount(item_bin, weights=ordered, minlength=num_bins).astype(np.int64)
    bin_vision = None
    if sub_vis is not None:
        ordered_vis = sub_vis if perm is None else sub_vis[perm]
        bin_vision = np.bincount(item_bin, weights=ordered_vis, minlength=num_bins).astype(np.int64)
    # bin-major order; inside a bin, processing order (the sort is stable)
    within = _stable_argsort_ids(item_bin, num_bins)
    order = within if perm is None else perm[within]
    if keep is not None:
        order = keep[order]
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    np.cumsum(np.bincount(item_bin, minlength=num_bins), out=offsets[1:])
    return order, offsets, bin_lengths, bin_vision


def _validated(lengths: Any, vision: Any, vision_capacity: Any) -> tuple[np.ndarray, np.ndarray | None, int]:
    """``lengths`` [N] and ``vision`` [N] (or None) as int64 arrays, and the vision budget (0 without)."""
    lens = _as_int_array(lengths, "lengths", allow_zero=False)
    if vision is None:
        if vision_capacity is not None:
            raise ValueError("vision_capacity is given but vision is None: pass the per-sample vision costs")
        return lens, None, 0
    if vision_capacity is None:
        raise ValueError("vision is given but vision_capacity is None: pass the per-bin vision budget")
    vision_cap = int(vision_capacity)  # validated by PackingConfig
    vis = _as_int_array(vision, "vision", allow_zero=True)
    if vis.size != lens.size:
        raise ValueError(f"vision has {vis.size} entries but lengths has {lens.size}: give one per sample")
    return lens, vis, vision_cap


def _apply_oversized(
    raw: np.ndarray,
    lens: np.ndarray,
    vis: np.ndarray | None,
    capacity: int,
    vision_cap: int,
    oversized: str,
    multiple: int,
) -> tuple[np.ndarray, np.ndarray | None, list[Unpacked], dict[int, int]]:
    """Apply the ``oversized`` policy to the padded ``lens`` (``raw``: as given, for the messages):
    (lengths, indices kept or None for all, unpacked, truncated: index -> length as given)."""
    n = lens.size
    over = lens > capacity
    vision_over = vis > vision_cap if vis is not None else np.zeros(n, dtype=bool)
    if not (over.any() or vision_over.any()):
        return lens, None, [], {}
    if oversized == "raise":
        first_long = int(np.argmax(over)) if over.any() else n
        first_vision = int(np.argmax(vision_over)) if vision_over.any() else n
        if first_long <= first_vision:
            raise ValueError(
                _oversize_message(f"sample {first_long}", int(raw[first_long]), capacity, multiple)
            )
        raise ValueError(
            _vision_oversize_message(f"sample {first_vision}", int(vis[first_vision]), vision_cap)
        )
    # a vision budget cannot be truncated: such samples are skipped under both policies
    drop = vision_over | over if oversized == "skip" else vision_over
    unpacked = []
    for sample in np.flatnonzero(drop).tolist():
        why = []
        if over[sample]:
            why.append(f"length {_length_text(int(raw[sample]), multiple)} > capacity {capacity}")
        if vision_over[sample]:
            why.append(f"vision cost {int(vis[sample])} > vision_capacity {vision_cap} (cannot be truncated)")
        unpacked.append(Unpacked(sample, "; ".join(why)))
    truncated: dict[int, int] = {}
    if oversized == "truncate":
        clipped = np.flatnonzero(over & ~vision_over)
        truncated = dict(zip(clipped.tolist(), raw[clipped].tolist()))
        lens = np.where(over & ~vision_over, capacity, lens)
    keep = np.flatnonzero(~drop) if drop.any() else None
    return lens, keep, unpacked, truncated


def _run_core(
    strategy: str, lens: np.ndarray, vis: np.ndarray | None, capacity: int, vision_cap: int, sample_cap: int
) -> tuple[np.ndarray | None, np.ndarray, int, np.ndarray]:
    """Sort and hand the (kept) samples to the right core: (perm, item_bin, number of bins, lengths).

    ``perm`` [M] is the processing order (None: data order); ``item_bin`` [M] the bin of each sample
    and the last ``lengths`` [M] its length, both in processing order.
    """
    constrained = vis is not None or sample_cap <= lens.size
    perm = None
    if strategy in ("bfd", "ffd"):
        perm = _stable_argsort_desc(lens, capacity) if vis is None else np.lexsort((-vis, -lens))
        if not constrained:
            distinct, counts = _length_histogram(lens, capacity)
            core = _bfd_histogram if strategy == "bfd" else _ffd_histogram
            item_bin, num_bins = core(distinct, counts, capacity)
            return perm, item_bin, num_bins, np.repeat(distinct, counts)  # processing order, no gather
    ordered_arr = lens if perm is None else lens[perm]
    ordered = ordered_arr.tolist()
    ordered_vis = None if vis is None else (vis if perm is None else vis[perm]).tolist()
    shortest = int(lens.min())
    if strategy == "bfd" and ordered_vis is None:
        item_bin, num_bins = _bfd_capped(ordered, capacity, sample_cap, shortest)
    elif strategy == "bfd":
        if capacity > _MAX_TREE_CAPACITY:
            raise ValueError(
                f"capacity {capacity} is too large for best fit with a vision budget (its index "
                f"has one slot per free-space value, at most {_MAX_TREE_CAPACITY}); use "
                "strategy='ffd' or 'ff', whose index grows with the number of bins instead"
            )
        item_bin, num_bins = _bfd_constrained(
            ordered, ordered_vis, capacity, vision_cap, sample_cap, shortest
        )
    elif strategy in ("ffd", "ff"):
        item_bin, num_bins = _first_fit(ordered, ordered_vis, capacity, vision_cap, sample_cap, shortest)
    else:
        item_bin, num_bins = _next_fit(ordered, ordered_vis, capacity, vision_cap, sample_cap)
    return perm, np.asarray(item_bin, dtype=np.int64), num_bins, ordered_arr


def _length_histogram(lens: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct lengths, descending, and how many samples have each."""
    if capacity <= 8 * lens.size + (1 << 16):  # histogram over 0..capacity
        hist = np.bincount(lens, minlength=capacity + 1)
        distinct = np.flatnonzero(hist)[::-1]
        return distinct, hist[distinct]
    distinct, counts = np.unique(lens, return_counts=True)  # huge capacity: no capacity-sized arrays
    return distinct[::-1], counts[::-1]


def _permute_bins(order: np.ndarray, offsets: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder whole bins: new bin i is old bin ``p[i]``. Shapes [N], [B+1], [B] -> [N], [B+1]."""
    sizes = np.diff(offsets)[p]
    new_offsets = np.zeros(p.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=new_offsets[1:])
    src = np.repeat(offsets[:-1][p] - new_offsets[:-1], sizes) + np.arange(order.size)
    return order[src], new_offsets


# ----------------------------------------------------------------------------- streaming
