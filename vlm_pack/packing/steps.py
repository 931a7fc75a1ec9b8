"""A step plan: packs dealt to (step, rank) so that every rank's share of a training step costs about the same.

In synchronous data parallelism every optimizer step waits for the slowest rank, so what counts is the
sum over steps of the slowest rank's cost, not each rank's epoch total. A step is ``grad_accum``
micro-batches (one pack each) on every rank; a rank's share of it is the sum of its micro-batches::

    packs by cost     p0 p1 p2 p3 | p4 p5 p6 p7 | p8 ...      groups of world_size * grad_accum
                      (descending)                            consecutive costs = one step each
    in a group        round 0: the world_size dearest go one per rank;  round j: the next world_size go
                      dearest first to the ranks least loaded so far (equal counts: grad_accum each)
    across groups     the order of the groups is shuffled with the seed (the partial last group stays
                      last), so the epoch is not a length curriculum

    rank_bins   int64 [world_size, micro_steps]:  step g is columns g*grad_accum .. (g+1)*grad_accum - 1

An image on every rank at every step (``has_image``): a rank whose step has no image skips the vision
tower, which DDP reports as unused parameters and FSDP turns into a missing all-gather (a hang). With
``has_image`` the image packs are spread evenly over as many steps as can each hold ``world_size`` of them
(every step, when there are ``world_size * steps`` or more), and text-only packs fill the rest; each kind is
cut into the groups in cost order. Within a group the image packs come first, so round 0 gives every rank one::

    image packs by cost   i0 i1 ... i7 | i8 ... i15 | ...      text packs by cost   t0 ... t3 | t4 ... t7 | ...
    groups (steps)        [ i0..i7  t0..t3 ]  [ i8..i15  t4..t7 ]  ...              each >= world_size images

Where it cannot hold (fewer than ``world_size`` image packs per step in the plan), :func:`steps_short_of_images`
counts every step where a rank lacks one (``short``), and of those the ones the plan's image packs could have
filled (``avoidable``: 0 in every plan vlm-pack makes, ``plan_packs`` keeps no packs that break it); in a short
step a rank must keep the tower in its graph by itself (a dummy image through the tower with zero loss weight,
or DDP ``find_unused_parameters=True``). A step with no image pack at all is the same on every rank (no FSDP
hang).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bins import _as_positive_int
from .cost import CostFn, PackCost

__all__ = ["StepBalance", "block_order", "step_imbalance", "step_plan", "steps_short_of_images"]

PACKS = ("auto", "balanced", "bfd")  # StepBalance.packs: made for the step plan, or the best-fit packs as they are
# "auto" packs for the steps up to this many samples. Above, the best-fit packs alone already deal to within
# ~1.5% (there are many packs per step group), while packing for the steps costs ~13 s per million samples
# against BFD's 0.2 s (benchmarks/RESULTS.md): a 100 M-sample plan would take 20 min instead of 20 s.
AUTO_BALANCED_MAX_SAMPLES = 1_000_000


@dataclass(frozen=True)
class EpochBalance:
    """Deal fixed packs so that each rank's **epoch** total costs about the same (Karmarkar-Karp,
    :func:`~vlm_pack.packing.balance_bins`, the same count each), steps in one shuffled order: the dealing
    before step plans, kept as the baseline a :class:`StepBalance` is measured against. A step's packs may
    cost more on one rank than another (:func:`step_imbalance`); one micro-step per optimizer step."""

    def key(self) -> str:
        """What of it shapes a plan: ``"epoch"`` (the value plans keyed before it was a type)."""
        return "epoch"


@dataclass(frozen=True)
class StepBalance:
    """How a plan deals its packs to (step, rank) (:func:`step_plan`).

    Attributes:
        grad_accum: micro-batches (packs) per rank per optimizer step; balanced as their sum.
        cost: a :class:`~vlm_pack.packing.cost.PackCost` (``PackCost.from_config(model.config)``) or a
            callable ``(lengths [n], patches [m]) -> float`` per pack; None: ``PackCost()`` (Qwen2-VL-7B).
        image_every_rank: give every rank an image pack in every step with at least ``world_size`` of them;
            None: on when any sample has an image.
        seed: shuffles the order of the steps in the plan (no length curriculum).
        packs: ``"balanced"``: the plan makes its packs for the steps
            (:func:`~vlm_pack.packing.balanced.balanced_packs`: each rank's share of a step about the same
            cost, as many steps as the best-fit packs take) and keeps them where they take no more optimizer
            steps, keep the image rule and deal better than the best-fit packs
            (:func:`~vlm_pack.packing.balanced.keep_balanced`), else the best-fit ones; ``"bfd"``: the best-fit packs, dealt as they are;
            ``"auto"`` (default): ``"balanced"`` up to ``AUTO_BALANCED_MAX_SAMPLES`` (1 M) samples, where it
            matters most (few packs per step) and costs seconds, ``"bfd"`` above.
    """

    grad_accum: int = 1
    cost: PackCost | CostFn | None = None
    image_every_rank: bool | None = None
    seed: int = 0
    packs: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "grad_accum", _as_positive_int(self.grad_accum, "grad_accum"))
        if self.cost is not None and not isinstance(self.cost, PackCost) and not callable(self.cost):
            raise TypeError(f"cost must be a PackCost or a callable (lengths, patches) -> float, got {self.cost!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.packs not in PACKS:
            raise ValueError(f"packs must be one of {PACKS} (cost-balanced or best-fit packs), got {self.packs!r}")

    def key(self) -> dict[str, Any]:
        """What of it shapes a plan, as JSON values (a callable cost by its qualified name)."""
        cost: Any = self.cost.to_dict() if isinstance(self.cost, PackCost) else None
        if self.cost is not None and not isinstance(self.cost, PackCost):
            fn: Callable[..., Any] = self.cost
            cost = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
        return {
            "by": "step",
            "grad_accum": self.grad_accum,
            "cost": cost,
            "image_every_rank": self.image_every_rank,
            "seed": self.seed,
            "packs": self.packs,
        }


def _group_sizes(num_packs: int, world_size: int, grad_accum: int) -> np.ndarray:
    """int64 ``[G]``: packs per step, ``world_size * grad_accum`` each but the last (a multiple of world_size)."""
    full, rest = divmod(num_packs, world_size * grad_accum)
    return np.array([world_size * grad_accum] * full + ([rest] if rest else []), dtype=np.int64)


def _image_counts(sizes: np.ndarray, num_images: int, world_size: int) -> np.ndarray:
    """int64 ``[G]``: image packs per group (``sizes`` ``[G]`` packs each, the full ones first). Spread evenly
    over as many groups as can each hold ``world_size`` of them, when that holds them all; else groups are
    filled in turn, so that at most one holds fewer than ``world_size``. The other groups get none."""
    counts = np.zeros(sizes.size, dtype=np.int64)
    if num_images == 0 or sizes.size == 0:
        return counts
    size = int(sizes[0])
    most = min(sizes.size, num_images // world_size)  # groups that can each get world_size
    if most * size >= num_images:
        counts[:most] = num_images // most
        counts[: num_images % most] += 1
        return counts
    left = num_images
    for g in range(sizes.size):  # too few groups at world_size each: fill them in turn
        counts[g] = min(left, int(sizes[g]))
        left -= int(counts[g])
    return counts


def _deal_rounds(costs: np.ndarray, world_size: int) -> np.ndarray:
    """Deal ``[G, k * world_size]`` packs (each row ordered, dearest first) to ranks, ``k`` each: int64
    ``[G, world_size, k]`` column indices into the row. Round ``j`` gives its ``world_size`` packs dearest
    first to the ranks least loaded after rounds ``0..j-1``, all groups at once."""
    g, n = costs.shape
    k = n // world_size
    loads = np.zeros((g, world_size))
    out = np.empty((g, world_size, k), dtype=np.int64)
    rows = np.arange(g)[:, None]
    for j in range(k):
        cols = np.arange(j * world_size, (j + 1) * world_size)
        part = costs[:, cols]
        dear = np.argsort(-part, axis=1, kind="stable")  # [G, W] packs, dearest first
        light = np.argsort(loads, axis=1, kind="stable")  # [G, W] ranks, least loaded first
        out[rows, light, j] = cols[dear]
        loads[rows, light] += part[rows, dear]
    return out


def step_plan(
    costs: np.ndarray,
    world_size: int,
    grad_accum: int = 1,
    *,
    has_image: np.ndarray | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Deal packs to (step, rank), see the module docstring: int64 ``[world_size, B // world_size]``, pack ids.

    Args:
        costs: float ``[B]`` cost per pack (:func:`~vlm_pack.packing.cost.pack_costs`); ``B`` must be a
            multiple of ``world_size``.
        world_size, grad_accum: ranks, and micro-batches per rank per step.
        has_image: bool ``[B]``: which packs hold an image; given, every rank gets one in every step with
            at least ``world_size`` image packs (None: no such care).
        seed: shuffles the order of the (whole) steps.

    Every pack is in exactly one cell; the same inputs give the same plan.
    """
    world_size = _as_positive_int(world_size, "world_size")
    grad_accum = _as_positive_int(grad_accum, "grad_accum")
    c = np.asarray(costs, dtype=np.float64)
    nb = c.size
    if nb % world_size:
        raise ValueError(
            f"step_plan: {nb} packs cannot fill {world_size} ranks equally; split or drop {nb % world_size} "
            "pack(s) first (make_plan splits the largest packs)"
        )
    ids = np.arange(nb)
    image = np.zeros(nb, bool) if has_image is None else np.asarray(has_image, dtype=bool)
    sizes = _group_sizes(nb, world_size, grad_accum)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    # each kind dearest first, cut into the groups: a group holds its images, then its text-only packs
    images = ids[image][np.lexsort((ids[image], -c[image]))]
    texts = ids[~image][np.lexsort((ids[~image], -c[~image]))]
    cut = np.concatenate([[0], np.cumsum(_image_counts(sizes, images.size, world_size))])
    text_cut = starts - cut
    groups = [
        np.concatenate([images[cut[g] : cut[g + 1]], texts[text_cut[g] : text_cut[g + 1]]])
        for g in range(sizes.size)
    ]
    order = np.concatenate(groups) if groups else ids
    cols: list[np.ndarray] = []  # per group: [W, k] pack ids
    full = int((sizes == world_size * grad_accum).sum())
    if full:
        # within a group image packs first (round 0 = one per rank), then by cost: lexsort is stable per row
        block = order[: full * world_size * grad_accum].reshape(full, -1)
        within = np.lexsort((-c[block], ~image[block]), axis=1)
        block = np.take_along_axis(block, within, axis=1)
        dealt = _deal_rounds(c[block], world_size)
        cols.extend(np.take_along_axis(block, dealt.reshape(full, -1), axis=1).reshape(full, world_size, -1))
    if sizes.size > full:
        block = order[starts[full] :][None, :]
        within = np.lexsort((-c[block], ~image[block]), axis=1)
        block = np.take_along_axis(block, within, axis=1)
        dealt = _deal_rounds(c[block], world_size)
        cols.append(block[0][dealt[0]])
    perm = block_order(len(cols), full, np.random.default_rng([seed, 0x57E9]))
    return np.concatenate([cols[g] for g in perm], axis=1).astype(np.int64)


def block_order(num_blocks: int, full_blocks: int, rng: np.random.Generator | None) -> np.ndarray:
    """int64 ``[num_blocks]``: the whole blocks ``0..full_blocks-1`` in a random order (kept when ``rng`` is
    None), then a partial last block, which stays last: it is the step with fewer micro-batches, and
    moved inside the epoch it would shift every later step's grad-accumulation boundaries."""
    head = np.arange(full_blocks) if rng is None else rng.permutation(full_blocks)
    return np.concatenate([head, np.arange(full_blocks, num_blocks)]).astype(np.int64)


def _step_loads(costs: np.ndarray, rank_bins: np.ndarray, grad_accum: int) -> np.ndarray:
    """float64 ``[steps, world_size]``: each rank's cost of each step (its ``grad_accum`` micro-batches)."""
    per = np.asarray(costs, dtype=np.float64)[np.asarray(rank_bins, dtype=np.int64)]  # [W, S]
    w, s = per.shape
    starts = np.arange(0, s, grad_accum)
    return np.add.reduceat(per, starts, axis=1).T if s else np.zeros((0, w))


def step_imbalance(costs: np.ndarray, rank_bins: np.ndarray, grad_accum: int = 1) -> float:
    """Sum over steps of the slowest rank's cost / sum over steps of the mean rank's cost (1.0: no rank
    ever waits). ``costs`` ``[B]``; ``rank_bins`` ``[world_size, micro_steps]`` in training order."""
    loads = _step_loads(costs, rank_bins, _as_positive_int(grad_accum, "grad_accum"))
    mean = loads.mean(axis=1).sum() if loads.size else 0.0
    return float(loads.max(axis=1).sum() / mean) if mean > 0 else 1.0


def steps_short_of_images(has_image: np.ndarray, rank_bins: np.ndarray, grad_accum: int = 1) -> dict[str, int]:
    """Every step where some rank has no image pack, and how many of them the plan could have spared.

    ``has_image`` bool ``[B]`` per pack, ``rank_bins`` ``[world_size, micro_steps]``. Returns ``{"steps",
    "short" (steps where some rank has no image pack), "mixed" (of those, steps where another rank has one),
    "text_only" (no rank has one), "image_packs", "forced" (short steps no dealing of these packs avoids:
    a step with an image on every rank uses ``world_size`` image packs, so ``steps - image_packs //
    world_size`` of them at least), "avoidable" (``short - forced``: the image rule broken; 0 wherever
    the plan holds ``world_size`` image packs per step and every rank has one in every step)}``."""
    image = np.asarray(has_image, dtype=np.float64)
    hits = _step_loads(image, rank_bins, grad_accum)  # [S, W] image packs of each rank's share of each step
    some, every = (hits > 0).any(axis=1), (hits > 0).all(axis=1)
    steps, world = hits.shape[0], max(1, hits.shape[1])
    packs = int(image[np.asarray(rank_bins, dtype=np.int64)].sum())
    short = int((~every).sum())
    forced = min(steps, max(0, steps - packs // world))
    return {
        "steps": int(steps),
        "short": short,
        "mixed": int((some & ~every).sum()),
        "text_only": int((~some).sum()),
        "image_packs": packs,
        "forced": forced,
        "avoidable": max(0, short - forced),
    }
