"""``balance_bins``: deal bins to data-parallel ranks by compute cost (Karmarkar-Karp largest differencing)."""

from __future__ import annotations

import heapq
import itertools
import logging
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .bins import PackResult, _as_int_array, _as_positive_int

logger = logging.getLogger("vlm_pack.packing")


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
