"""Step balance for streaming, without communication: a look-ahead window per rank, one schedule for all ranks.

A streaming rank sees only its own packs, so it cannot deal packs to other ranks as a step plan does
(:mod:`vlm_pack.packing.steps`). What it can do alone is *order* its own packs. Every rank holds a window of
``W = window_steps * grad_accum`` packs, sorts it by cost, and emits it in the order of a schedule that every
rank derives from the same seed and window number: at micro-step ``t`` of window ``w`` every rank emits the pack
of the same cost rank in its own window. Ranks that read alike data (shards dealt at random) then have packs
of about the same cost at every micro-step, and so about the same cost at every step::

    one rank's window (W = 8, grad_accum 2)   packs   a b c d e f g h,  by cost (dearest first): c f a h b e d g
                                                                        cost rank:              0 1 2 3 4 5 6 7
    shared schedule (seed, epoch, window)     rank at each position:    5 0 | 3 6 | 1 7 | 2 4     (a permutation)
    emitted                                   e c | h d | f g | a b       step 0 = e c, step 1 = h d, ...
    another rank, same schedule               its cost ranks 5 0 | 3 6 | ...: the same quantiles, step by step

The schedule is a fresh permutation per window (``window_schedule``), so the epoch is no length curriculum.
A window of ``n < W`` packs (a stream's last) follows the first ``n`` schedule entries, its packs matched to
them in cost order (``window_order``).

An image on every rank at every step: a rank whose step has no image skips the vision tower (DDP: unused
parameters; FSDP: a missing all-gather, a hang). The shared rule *reserves* the first micro-step of every step
for an image pack (``reserved_positions``; with ``grad_accum`` 1 every micro-step is a step, so every position);
a rank fills the reserved positions in position order with image packs while it has them, so where ranks run
short it is in the last steps of the window on every rank alike (a step with no image on any rank is the same
on every rank: no hang)::

    grad_accum 2, W = 8, 3 image packs (I), 5 text-only (T)
    positions          0  1 | 2  3 | 4  5 | 6  7
    reserved           R  . | R  . | R  . | R  .
    emitted            I  T | I  T | I  T | T  T      step 3 has no image on this rank: it cannot hold

Within the reserved positions that get images, and within the other positions, packs are matched to the
schedule by cost rank, so the quantile alignment holds within each kind. Where a rank's window has more image
packs than reserved positions, the ones it places there are spread evenly over its image packs' cost ranks.

What it cannot do: move a pack to another rank. A rank whose window is dearer (or has fewer image packs) than
the others stays so; the imbalance left is the spread, across ranks, of the same cost quantile in windows of
``W`` packs, which shrinks as ``W`` grows (``benchmarks/bench_stream_balance.py``). The price is latency and
memory: a stream holds up to ``W`` packed bins (their encoded samples) before it emits the first of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .bins import _as_positive_int
from .cost import CostFn, PackCost

__all__ = ["StreamBalance", "reserved_positions", "window_order", "window_schedule"]

_SALT = 0x5B1A  # keeps the schedule's random stream apart from the shuffle buffer's (same seed)


@dataclass(frozen=True)
class StreamBalance:
    """Step balancing of a :class:`~vlm_pack.data.PackedWebDataset` by a look-ahead window (module docstring).

    Attributes:
        grad_accum: micro-batches (packs) per rank per optimizer step.
        window_steps: steps per window: each stream holds ``window_steps * grad_accum`` packs before it emits
            them (more: better balance, more memory and a later first batch).
        cost: a :class:`~vlm_pack.packing.cost.PackCost` or a callable ``(lengths [n], patches [m]) -> float``
            per pack; None: ``PackCost()`` (Qwen2-VL-7B widths and depths).
        image_every_rank: reserve the first micro-step of every step for an image pack.
        seed: the schedule's seed, with the dataset's ``shuffle_seed``, the epoch and the window number; the
            same on every rank (it must be, or the ranks' quantiles do not line up).
    """

    grad_accum: int = 1
    window_steps: int = 8
    cost: PackCost | CostFn | None = None
    image_every_rank: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "grad_accum", _as_positive_int(self.grad_accum, "grad_accum"))
        object.__setattr__(self, "window_steps", _as_positive_int(self.window_steps, "window_steps"))
        if self.cost is not None and not isinstance(self.cost, PackCost) and not callable(self.cost):
            raise TypeError(f"cost must be a PackCost or a callable (lengths, patches) -> float, got {self.cost!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        object.__setattr__(self, "image_every_rank", bool(self.image_every_rank))

    @property
    def window(self) -> int:
        """Packs per window: ``window_steps * grad_accum``."""
        return self.window_steps * self.grad_accum

    def pack_cost(self, lengths: Any, patches: Any) -> float:
        """The cost of one pack: its samples' lengths ``[n]`` and its images' patches ``[m]``."""
        cost = PackCost() if self.cost is None else self.cost
        return float(cost(np.asarray(lengths, dtype=np.int64), np.asarray(patches, dtype=np.int64)))


def window_schedule(size: int, key: tuple[int, ...] | list[int]) -> np.ndarray:
    """int64 ``[size]``: the cost rank (0: dearest) each position of a window emits, a permutation of
    ``0..size-1`` drawn from ``key`` (e.g. ``(seed, epoch, generation, window number)``), the same on every rank."""
    size = _as_positive_int(size, "size")
    return np.random.default_rng([_SALT, *(int(k) for k in key)]).permutation(size).astype(np.int64)


def reserved_positions(size: int, grad_accum: int = 1, slot: int = 0, num_workers: int = 1) -> np.ndarray:
    """bool ``[size]``: the positions of a stream's window that start a step (the image rule reserves them).

    A rank's DataLoader takes its ``num_workers`` streams in turn, so the ``i``-th pack of the stream in
    ``slot`` is the rank's micro-step ``i * num_workers + slot``; it starts a step where that is a multiple of
    ``grad_accum``. Windows start at multiples of ``size``, which must then be a multiple of ``grad_accum``
    (``StreamBalance.window`` is) for every window to have the same pattern::

        grad_accum 4, 2 workers: slot 0 ->  R . R . R .   (micro-steps 0, 4, 8 ...)   slot 1 -> none
        grad_accum 2, 1 worker:             R . R . R .
    """
    i = np.arange(size, dtype=np.int64)
    return (i * int(num_workers) + int(slot)) % _as_positive_int(grad_accum, "grad_accum") == 0


def _match(order: np.ndarray, packs: np.ndarray, positions: np.ndarray, targets: np.ndarray, costs: np.ndarray) -> None:
    """Put ``packs`` at ``positions`` (equal sizes): the dearest at the position of lowest target rank, and so on."""
    if positions.size == 0:
        return
    dear = packs[np.lexsort((packs, -costs[packs]))]
    order[positions[np.argsort(targets[positions], kind="stable")]] = dear


def window_order(
    costs: np.ndarray,
    schedule: np.ndarray,
    *,
    has_image: np.ndarray | None = None,
    reserved: np.ndarray | None = None,
) -> np.ndarray:
    """The order in which a stream emits a window: int64 ``[n]``, ``order[t]`` = the pack (index into the
    window) emitted at position ``t`` (see the module docstring).

    Args:
        costs: float ``[n]`` cost per pack of the window (``n <= W``).
        schedule: int64 ``[W]``: :func:`window_schedule`; position ``t`` emits the pack of cost rank
            ``schedule[t]`` (for ``n < W``: the packs matched in cost order to ``schedule[:n]``).
        has_image: bool ``[n]``: which packs hold an image (None: no image rule).
        reserved: bool ``[>= n]``: :func:`reserved_positions`; reserved positions take image packs first, in
            position order, while the window has them.

    A permutation of ``0..n-1``; the same inputs give the same order on every rank.
    """
    c = np.asarray(costs, dtype=np.float64)
    n = c.size
    targets = np.asarray(schedule, dtype=np.int64)
    if targets.size < n:
        raise ValueError(f"window_order: {n} packs for a schedule of {targets.size}; a window holds at most W packs")
    targets = targets[:n]
    order = np.empty(n, dtype=np.int64)
    packs = np.arange(n, dtype=np.int64)
    positions = np.arange(n, dtype=np.int64)
    if has_image is None or reserved is None:
        _match(order, packs, positions, targets, c)
        return order
    image = np.asarray(has_image, dtype=bool)
    slots = np.flatnonzero(np.asarray(reserved, dtype=bool)[:n])
    images = packs[image]
    take = min(images.size, slots.size)
    slots = slots[:take]  # the first steps of the window get the images a short rank has
    dear = images[np.lexsort((images, -c[images]))]
    picked = dear[((np.arange(take) + 0.5) * dear.size / max(take, 1)).astype(np.int64)] if take else dear[:0]
    _match(order, picked, slots, targets, c)
    rest = np.ones(n, dtype=bool)
    rest[picked] = False
    free = np.ones(n, dtype=bool)
    free[slots] = False
    _match(order, packs[rest], positions[free], targets, c)
    return order
